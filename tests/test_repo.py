"""Repository-level promises: the README's commands are the ones CI and users actually run."""
import re

from helpers import ROOT


def readme_commands():
    """The fenced shell commands under the README's 'Quick start' heading, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```(?:bash|sh)?\n(.*?)```", section, re.S)]


def test_ci_runs_the_readme_test_command():
    commands = readme_commands()
    assert len(commands) == 2, f"Quick start must show exactly two commands, found {len(commands)}"
    test_command = commands[1]
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, f".ci/run does not run the README test command {test_command!r}"
