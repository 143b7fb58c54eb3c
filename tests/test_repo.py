"""Repository-level promises: the README's commands are the ones CI and users actually run."""
import os
import re
import shutil
import subprocess

from helpers import ROOT
from model import ATTENTION_TYPES


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


def test_ci_removes_what_it_built_when_it_fails(tmp_path):
    # CI runs on a machine whose disk outlives the run, and each torch build is several GB: a run
    # that fails half way must not leave its virtual environment behind. python3 here fails at once.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text("#!/bin/sh\nmkdir -p \"$3\"\nexit 3\n")  # `python3 -m venv DIR`
    (fake_bin / "python3").chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "TMPDIR": str(scratch)}
    result = subprocess.run([shutil.which("bash"), str(ROOT / ".ci" / "run")], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "=== torch" in result.stdout  # it got as far as making a virtual environment
    assert list(scratch.iterdir()) == [], f".ci/run left {list(scratch.iterdir())} behind"


def test_the_docs_index_names_every_page_and_result_folder_and_its_links_resolve():
    docs = ROOT / "docs"
    index = (docs / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)", index)
    assert all((docs / link).exists() for link in links), [link for link in links if not (docs / link).exists()]
    named = {link.split("/")[0] for link in links} - {".."}  # (the top-level README)
    assert sorted(named) == sorted(p.name for p in docs.iterdir() if p.name != "README.md")


def variant_rows():
    """The attn_types of the rows of the README's table of variants."""
    readme = (ROOT / "README.md").read_text().split("## Attention variants", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^`(\w+)` \|", readme, re.M)


def undocumented(attn_types):
    """One line per attn_type that the README's table of variants or a heading of docs/attention.md lacks."""
    rows = variant_rows()
    sections = re.findall(r"^## (.+)$", (ROOT / "docs" / "attention.md").read_text(), re.M)
    words = [re.findall(r"\w+", heading) for heading in sections]
    return ([f"README.md's table of attention variants has no row for attn_type={a!r}: add one"
             for a in attn_types if a not in rows]
            + [f"docs/attention.md has no section for attn_type={a!r}: add '## {a}' with its equations"
               for a in attn_types if not any(a in w for w in words)])


def test_the_readme_table_and_attention_md_name_every_registered_variant():
    missing = undocumented(ATTENTION_TYPES)
    assert not missing, "; ".join(missing)
    assert undocumented(["tempered"]) == [
        "README.md's table of attention variants has no row for attn_type='tempered': add one",
        "docs/attention.md has no section for attn_type='tempered': add '## tempered' with its equations"]


# The scripts stay readable in one sitting: a budget of lines each. Growing past one is a decision (move what
# the scripts share into denoised_gpt/, or raise the budget here in the same change and say why). model.py has
# none: a new variant's class belongs there; what its reader meets first is checked below.
LINE_BUDGETS = {'train.py': 650, 'compare.py': 1020, 'bench.py': 616, 'eval.py': 537, 'sample.py': 432,
                'README.md': 325}


def counted_lines(name):
    """The file's lines; the README's without its table of variants' rows (one a variant brings, not growth)."""
    lines = (ROOT / name).read_text().splitlines()
    return len(lines) - (len(variant_rows()) if name == 'README.md' else 0)


def test_the_scripts_stay_within_their_line_budgets():
    over = {name: n for name, n in ((name, counted_lines(name)) for name in LINE_BUDGETS) if n > LINE_BUDGETS[name]}
    assert not over, (f"over their line budgets (tests/test_repo.py LINE_BUDGETS): "
                      f"{', '.join(f'{name} {n} > {LINE_BUDGETS[name]}' for name, n in over.items())}")


def test_model_py_shows_its_first_variant_early():
    """A reader meets the config, AttentionBase and then base attention within the first 200 lines."""
    lines = (ROOT / 'model.py').read_text().splitlines()
    assert lines.index('class CausalSelfAttention(AttentionBase):') < 200
