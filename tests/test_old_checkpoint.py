"""A checkpoint written before the code moved into the denoised_gpt package (tests/fixtures/ckpt-23a31c2,
made by commit 23a31c2: see its README) still means the same run: it resumes to the losses that the
uninterrupted run of that commit logged, and samples the text that commit's sample.py printed."""
import json
import shutil

import pytest
import torch

from helpers import ROOT, run_script_in_process

FIXTURE = ROOT / 'tests' / 'fixtures' / 'ckpt-23a31c2'
EXPECTED = json.loads((FIXTURE / 'expected.json').read_text())
CPU_FLOAT32 = ['--device=cpu', '--dtype=float32']  # the settings the fixture was made with
# The torch releases the expected samples were checked on: sampling draws from torch's RNG, and torch 2.6
# draws other tokens from the same seed (the resumed losses hold on every release)
SAMPLES_HOLD_FOR = ('2.13.', '2.14.')


def run(script, *args):
    """The script in this process (one thread, as a subprocess with OMP_NUM_THREADS=1)."""
    proc = run_script_in_process(script, args)
    assert proc.returncode == 0, f"{script} exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture
def old_run(tmp_path):
    out = tmp_path / 'run'
    out.mkdir()
    shutil.copy(FIXTURE / 'ckpt.pt', out / 'ckpt.pt')
    return out


def test_old_checkpoint_resumes_to_the_uninterrupted_runs_losses(old_run):
    run('train.py', '--init_from=resume', f'--out_dir={old_run}', f'--dataset={FIXTURE / "data"}',
        '--compile=False', *CPU_FLOAT32)
    rows = [json.loads(line) for line in (old_run / 'metrics.jsonl').read_text().splitlines()]
    expected = EXPECTED['rows_after_resume']
    assert [(r['iter'], 'val_loss' in r) for r in rows] == [(r['iter'], 'val_loss' in r) for r in expected]
    for got, want in zip(rows, expected):
        for key, value in want.items():
            # the same arithmetic on the same kind of CPU gives the same bits; a tolerance far below
            # what one more or one less training step changes allows for another CPU's float rounding
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (got['iter'], key)


@pytest.mark.skipif(not torch.__version__.startswith(SAMPLES_HOLD_FOR),
                    reason=f"the expected samples hold for torch {' / '.join(SAMPLES_HOLD_FOR)}x, whose sampling RNG "
                           f"made them; this is {torch.__version__}")
def test_old_checkpoint_samples_the_same_text(old_run):
    proc = run('sample.py', f'--out_dir={old_run}', f'--dataset={FIXTURE / "data"}', '--max_new_tokens=40',
               '--start=abc', '--format=jsonl', *CPU_FLOAT32)
    completions = [json.loads(line)['completion'] for line in proc.stdout.splitlines()]
    assert completions == EXPECTED['samples']
