"""Random invalid settings for every script (tests/fuzz_settings.py: a fixed seed, 50 cases each; the data
preparation scripts, which need no torch and refuse a case in milliseconds, 100): each ends in an exit status
and a message, never a traceback or a hang."""
import json
import subprocess
import sys

import pytest

from helpers import ROOT, subprocess_env

SCRIPTS = ['train.py', 'sample.py', 'eval.py', 'bench.py', 'compare.py', 'grow.py']
DATA_SCRIPTS = ['data/openwebtext/prepare.py', 'data/fineweb_edu/prepare.py', 'data/mqar/prepare.py',
                'data/shakespeare_char/prepare.py']
CASES = {**{script: 50 for script in SCRIPTS}, **{script: 100 for script in DATA_SCRIPTS},
         'data/shakespeare_char/prepare.py': 20}  # (its one setting, --input, has 9 bad values)


@pytest.mark.slow
@pytest.mark.parametrize('script', SCRIPTS + DATA_SCRIPTS)
def test_invalid_settings_never_end_in_a_traceback(script):
    cases = CASES[script]
    proc = subprocess.run([sys.executable, 'tests/fuzz_settings.py', script, f'--cases={cases}', '--seed=0'],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report['cases'] == cases and sum(report['exit_codes'].values()) + len(report['failures']) == cases
    assert report['failures'] == [], json.dumps(report['failures'], indent=1)
    assert report['exit_codes'].get('2', 0) >= 0.8 * cases  # nearly every case is refused with exit status 2
