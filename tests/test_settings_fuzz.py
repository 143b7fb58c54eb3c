"""Random invalid settings for every script (tests/fuzz_settings.py: 50 cases each, a fixed seed): each
ends in an exit status and a message, never a traceback or a hang."""
import json
import subprocess
import sys

import pytest

from helpers import ROOT, subprocess_env

SCRIPTS = ['train.py', 'sample.py', 'eval.py', 'bench.py', 'compare.py', 'grow.py']


@pytest.mark.parametrize('script', SCRIPTS)
def test_invalid_settings_never_end_in_a_traceback(script):
    proc = subprocess.run([sys.executable, 'tests/fuzz_settings.py', script, '--cases=50', '--seed=0'], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report['cases'] == 50 and sum(report['exit_codes'].values()) + len(report['failures']) == 50
    assert report['failures'] == [], json.dumps(report['failures'], indent=1)
    assert report['exit_codes'].get('2', 0) >= 40  # nearly every case is refused with exit status 2
