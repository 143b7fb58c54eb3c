"""What a run does to its out_dir: one writer at a time, nothing touched by a run that is refused, the
settings a resume says it applies applied, and messages that name what is really on disk."""
import json
import os
import signal
import subprocess

import pytest
import torch

from denoised_gpt.checkpoint import CheckpointError, read_checkpoint
from helpers import (ITER_LINE, ROOT, TINY, eval_losses, make_dataset, run_script_in_process, subprocess_env,
                     train_command)



@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp('data'))


def train(*args, expect_rc=0):
    proc = run_script_in_process('train.py', args)
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def snapshot(folder):
    """Every file under folder (names and bytes), so that a refused run can be shown to change nothing."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


@pytest.mark.slow
def test_a_second_run_on_a_busy_out_dir_is_refused_and_the_first_is_untouched(tmp_path, data):
    out = tmp_path / 'out'
    first = subprocess.Popen(train_command(out, data, '--max_iters=100000', '--eval_interval=20'), cwd=ROOT,
                             env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in first.stdout:  # the first run trains (for as long as it is let)...
        if ITER_LINE.match(line):
            break
    # ... when the same command is launched again, and a scratch run with another seed
    for extra in ([], ['--seed=2']):
        second = train(*train_command(out, data, '--max_iters=100000', '--eval_interval=20', *extra)[2:],
                       expect_rc=2)
        assert f"out_dir='{out}' is in use by another run (train.py, pid {first.pid} on " in second.stderr
        assert 'iter 0' not in second.stdout
    first.send_signal(signal.SIGTERM)  # then stops, saving where it is
    first.communicate(timeout=120)
    assert first.returncode == 0
    assert not [p for p in out.iterdir() if p.name.startswith('replaced-')]
    # the first run's files are exactly those of the same run alone, trained as far
    k = read_checkpoint(out)[1]['iter_num']
    lone = tmp_path / 'lone'
    train(*train_command(lone, data, f'--max_iters={k}', '--eval_interval=20')[2:])
    a, b = read_checkpoint(lone)[1], read_checkpoint(out)[1]
    for name in a['model']:
        assert torch.equal(a['model'][name], b['model'][name]), name
    strip = lambda text: [line.split(', "ms"')[0].split(', "time"')[0] for line in text.splitlines()  # noqa: E731
                          if json.loads(line)['iter'] < k]
    assert strip((out / 'metrics.jsonl').read_text()) == strip((lone / 'metrics.jsonl').read_text())
    # the lock died with its process: the next run goes ahead
    train(*train_command(out, data, '--init_from=resume', f'--max_iters={k + 1}')[2:])


@pytest.mark.slow
def test_a_run_killed_with_sigkill_leaves_no_lock_behind(tmp_path, data):
    out = tmp_path / 'out'
    proc = subprocess.Popen(train_command(out, data, '--max_iters=100000', '--eval_interval=5'), cwd=ROOT,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith('saved checkpoint'):
            proc.send_signal(signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert (out / '.lock').exists()
    train(*train_command(out, data, '--init_from=resume', '--max_iters=6')[2:])
    assert read_checkpoint(out)[1]['iter_num'] == 6


REFUSED = [
    ['--attn_type=noiseformer2'],
    ['--n_embd=30', '--n_head=4'],
    ['--qk_head_size=0'],
    ['--lowrank_rank=0'],  # a dint_lowrank setting on base
    ['--dataset=nosuch'],
    ['--learning_rate=1e309'],
    ['--weight_decay=1e999'],
    ['--kl_weight=inf'],
    ['--noise_init_std=1e400', '--attn_type=noiseformer_v2'],
    ['--init_from=nosuch-checkpoint'],
]


@pytest.mark.slow
@pytest.mark.parametrize('args', REFUSED, ids=[a[0].split('=')[0][2:] for a in REFUSED])
def test_a_refused_setting_leaves_out_dir_byte_identical(args, tmp_path, data):
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=5', '--eval_interval=5')
    before = snapshot(out)
    for overwrite in ('False', 'True'):
        proc = train(str(TINY), f'--dataset={data}', f'--out_dir={out}', f'--overwrite={overwrite}', *args,
                     expect_rc=2)
        assert proc.stderr.startswith('train.py: error: ') and 'Traceback' not in proc.stderr
        assert snapshot(out) == before
    new = tmp_path / 'new'
    train(str(TINY), f'--dataset={data}', f'--out_dir={new}', *args, expect_rc=2)
    assert not new.exists()  # no empty folder either


def test_resume_applies_changed_optimizer_settings(tmp_path, data):
    common = [str(TINY), f'--dataset={data}', '--max_iters=6', '--eval_interval=3']
    for name in ('same', 'changed'):
        train(*common, f'--out_dir={tmp_path / name}', '--max_iters=3')
    train(*common, f'--out_dir={tmp_path / "same"}', '--init_from=resume')
    proc = train(*common, f'--out_dir={tmp_path / "changed"}', '--init_from=resume', '--weight_decay=0.5',
                 '--beta1=0.5', '--beta2=0.9')
    assert "weight_decay: checkpoint 0.1, this run 0.5" in proc.stdout
    same, changed = read_checkpoint(tmp_path / 'same')[1], read_checkpoint(tmp_path / 'changed')[1]
    groups = changed['optimizer']['param_groups']
    assert groups[0]['weight_decay'] == 0.5 and groups[1]['weight_decay'] == 0.0  # norms and biases never decay
    assert all(tuple(g['betas']) == (0.5, 0.9) for g in groups)
    assert changed['config']['weight_decay'] == 0.5
    assert same['optimizer']['param_groups'][0]['weight_decay'] == 0.1
    differ = [k for k in same['model'] if not torch.equal(same['model'][k], changed['model'][k])]
    assert differ, "the changed settings did not change the training"


def test_divergence_before_any_checkpoint_does_not_send_the_user_to_one(tmp_path, data):
    proc = train(str(TINY), f'--dataset={data}', f'--out_dir={tmp_path / "out"}', '--learning_rate=1e30',
                 '--decay_lr=False', '--grad_clip=0', '--max_iters=50', '--eval_interval=1000', expect_rc=3)
    assert "No checkpoint was written yet: start the run again with a lower learning_rate" in proc.stderr
    assert "Resume from the last checkpoint" not in proc.stderr


def test_the_last_line_says_when_the_checkpoint_is_not_the_best(tmp_path, data):
    # a learning rate that makes the model worse after its first evaluation
    for always_save in (True, False):
        out = tmp_path / f'out-{always_save}'
        proc = train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--learning_rate=2.0', '--decay_lr=False',
                     '--max_iters=20', '--eval_interval=5', f'--always_save_checkpoint={always_save}')
        vals = eval_losses(proc.stdout)
        best = min(vals, key=vals.get)
        if not vals[20] > vals[best]:
            pytest.fail(f"learning_rate=2.0 did not make the model worse: {vals}")
        ckpt = read_checkpoint(out)[1]
        assert ckpt['iter_num'] == 20 and ckpt['best_val_loss'] == pytest.approx(vals[best], abs=1e-4)
        last = proc.stdout.strip().splitlines()[-2]
        said = f"checkpoint: {out / 'ckpt.pt'} holds the last state (iter 20, val loss {vals[20]:.4f}); the best " \
               f"val loss seen, {vals[best]:.4f}, was at iter {best}"
        if always_save and best > 0:  # False would have kept it
            said += " (always_save_checkpoint=False keeps the best instead)"
        assert last == said
        if not always_save:  # nothing better than iter 0, which is never saved: ckpt.pt is the end's state
            assert best == 0 and "replaced" not in last


def test_a_checkpoint_damaged_at_its_start_points_to_the_previous_one(tmp_path, data):
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=10', '--eval_interval=5')
    raw = bytearray((out / 'ckpt.pt').read_bytes())
    raw[60:68] = bytes(b ^ 0xFF for b in raw[60:68])  # inside the first record (the pickle)
    (out / 'ckpt.pt').write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        read_checkpoint(out)[1]
    assert 'ckpt.prev.pt' in str(e.value) and 'unpickling them can run code' not in str(e.value)


@pytest.mark.parametrize('script,args', [
    ('sample.py', ['--out_dir={file}']),
    ('eval.py', ['--out_dir={file}', '--val_loss=True']),
    ('grow.py', ['--out_dir={file}', '--grow_to=8', '--out={tmp}/grown']),
    ('train.py', ['--init_from={file}', '--out_dir={tmp}/out', '--dataset={data}']),
    ('train.py', ['--init_from=resume', '--out_dir={file}']),
])
def test_a_file_that_is_not_a_checkpoint_is_one_line(script, args, tmp_path, data):
    text = tmp_path / 'notes.txt'
    text.write_text('hello\n')
    proc = run_script_in_process(script, [a.format(file=text, tmp=tmp_path, data=data) for a in args])
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
    assert f"{script}: error: " in proc.stderr and "not a checkpoint" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt']  # nothing written


def test_a_full_disk_while_logging_is_one_clear_error(tmp_path):
    from denoised_gpt.run_dir import METRICS_NAME, log_metrics
    (tmp_path / METRICS_NAME).symlink_to('/dev/full')  # every write: ENOSPC
    with pytest.raises(OSError) as e:
        log_metrics(tmp_path, {'iter': 0, 'loss': 1.0})
    # before the first checkpoint there is nothing to resume from
    assert e.value.errno == 28 and "no checkpoint was written yet: free some space and start the run again" \
        in e.value.strerror
    (tmp_path / 'ckpt.pt').write_bytes(b'')  # (only its existence matters here)
    with pytest.raises(OSError) as e:
        log_metrics(tmp_path, {'iter': 0, 'loss': 1.0})
    assert e.value.errno == 28 and f"the checkpoints in {tmp_path} are intact: free some space and resume with " \
        f"--init_from=resume" in e.value.strerror


def test_bench_refuses_an_impossible_optimizer_setting():
    proc = run_script_in_process('bench.py', ['--beta2=-1', '--attn_types=base'])
    assert proc.returncode == 2 and proc.stderr.strip() == "bench.py: error: beta2=-1.0 must be in [0, 1)"


def test_a_missing_dataset_is_said_before_the_model_is_built(tmp_path):
    """config/noiseformer_v2.py builds a 116M-parameter model: a missing OpenWebText must be said first."""
    proc = run_script_in_process('train.py', ['config/noiseformer_v2.py', '--dataset=no-such-dataset',
                                              f'--out_dir={tmp_path / "out"}', '--device=cpu'])
    assert proc.returncode == 2 and "data/no-such-dataset/train.bin not found" in proc.stderr, proc.stderr
    assert "Initializing" not in proc.stdout and "number of parameters" not in proc.stdout
    assert not (tmp_path / 'out').exists()


# -----------------------------------------------------------------------------
# a full disk (a link to /dev/full: every write to it fails with ENOSPC), a killed save, a resume to an
# iteration already passed: one line each, nothing left behind

def test_a_full_disk_when_taking_the_lock_is_one_line(tmp_path, data):
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=5', '--eval_interval=5')
    (out / '.lock').unlink()
    (out / '.lock').symlink_to('/dev/full')
    before = snapshot(out)
    for more in ([], ['--init_from=resume', '--max_iters=10']):  # a new run, a resume
        proc = train(str(TINY), f'--dataset={data}', f'--out_dir={out}', *more, expect_rc=2)
        assert proc.stderr.strip() == f"train.py: error: out_dir='{out}': no space left on device while taking " \
                                      f"its lock; the checkpoints in it are intact: free some space or choose " \
                                      f"another --out_dir"
        assert snapshot(out) == before


def test_a_full_disk_when_trimming_the_metrics_log_is_one_line_and_leaves_no_temporary(tmp_path, data):
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=5', '--eval_interval=5')
    (out / 'metrics.jsonl.tmp').symlink_to('/dev/full')  # the file trimming writes
    log = (out / 'metrics.jsonl').read_bytes()
    proc = train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--init_from=resume', '--max_iters=10',
                 expect_rc=2)
    assert proc.stderr.startswith(f"train.py: error: out_dir='{out}': no space left on device while trimming "
                                  f"{out / 'metrics.jsonl'} to the checkpoint's iteration")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not os.path.lexists(out / 'metrics.jsonl.tmp') and (out / 'metrics.jsonl').read_bytes() == log


def test_a_killed_saves_temporary_is_removed_when_the_next_run_starts(tmp_path, data):
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=10', '--eval_interval=5')
    left = [out / 'ckpt.pt.tmp-999999', out / 'ckpt.prev.pt.tmp-999999']  # as kill -9 mid-save leaves them
    for path in left:
        path.write_bytes((out / 'ckpt.pt').read_bytes()[:1000])
    left.append(out / 'ckpt.sharded-0000012.tmp')  # and an fsdp run's, a folder of shards
    left[-1].mkdir()
    (left[-1] / 'rank-00000.safetensors').write_bytes(b'half')
    before = {name: (out / name).read_bytes() for name in ('ckpt.pt', 'ckpt.prev.pt')}
    # a resume with nothing left to train: it saves nothing (saving used to be what removed them)
    proc = train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--init_from=resume', '--max_iters=10')
    assert 'saved checkpoint' not in proc.stdout
    assert not [p for p in left if p.exists()]
    assert {name: (out / name).read_bytes() for name in before} == before


def test_resuming_to_an_iteration_already_passed_is_refused_in_one_line(tmp_path, data):
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=10', '--eval_interval=5')
    before = snapshot(out)
    proc = train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--init_from=resume', '--max_iters=6',
                 expect_rc=2)
    assert proc.stderr.strip() == f"train.py: error: max_iters=6 is below the iteration of the checkpoint in {out} " \
                                  f"(10): nothing to train. Give --max_iters above 10 to continue its run " \
                                  f"(--eval_only=True evaluates it)"
    assert snapshot(out) == before


# -----------------------------------------------------------------------------
# a damaged metrics.jsonl: a resume goes on without the lines that are not rows, and says which it left out

DAMAGED_LINES = ['{}', '[]', '{"iter": "x", "loss": 1.0}', '{"iter": 3, "val_loss": "x", "train_loss": 1.0, "time": 1}',
                 '{"iter": NaN, "loss": 1.0}', '{"iter": 2, "loss": 1.0}', '[' * 100_000 + ']' * 100_000,
                 '{"iter": 1, "loss": "' + 'x' * (2 << 20) + '"}']


def test_a_resume_leaves_out_the_lines_of_the_metrics_log_that_are_not_rows(tmp_path, data):
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=5', '--eval_interval=5')
    rows = (out / 'metrics.jsonl').read_text().splitlines()
    (out / 'metrics.jsonl').write_text('\n'.join(rows[:2] + DAMAGED_LINES + rows[2:]) + '\n')
    proc = train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--init_from=resume', '--max_iters=6',
                 '--eval_interval=5')
    assert proc.stdout.count(f"note: left out 8 lines of {out / 'metrics.jsonl'} that are not metrics rows (line 3: "
                             f"it has no iter; line 4: an array, not a JSON object; line 5: its iter is \"x\", not a "
                             f"non-negative integer up to 2**63 - 1; and 5 more)") == 1, proc.stdout
    logged = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    # the rows train.py wrote up to the checkpoint, then the resumed run's
    assert [json.dumps(r) for r in logged[:len(rows)]] == rows
    assert [(r['iter'], 'val_loss' in r) for r in logged[len(rows):]] == [(5, False), (6, True)]


def test_each_kind_of_line_that_is_not_a_row_is_named(tmp_path):
    from denoised_gpt.run_dir import metrics_rows
    (tmp_path / 'metrics.jsonl').write_text('\n'.join(DAMAGED_LINES) + '\n\n')  # (a blank line holds no row)
    assert [(n, row, problem) for n, _, row, problem in metrics_rows(tmp_path / 'metrics.jsonl')] == [
        (1, None, "it has no iter"), (2, None, "an array, not a JSON object"),
        (3, None, 'its iter is "x", not a non-negative integer up to 2**63 - 1'),
        (4, None, 'its val_loss is "x", not a number'),
        (5, None, "its iter is NaN, not a non-negative integer up to 2**63 - 1"), (6, None, "it has no tokens_per_s"),
        (7, None, "not JSON (nested too deeply)"), (8, None, "longer than 1 MiB")]


def test_a_number_no_float_holds_is_not_a_row(tmp_path):
    """A JSON integer of 400 digits parses to an int that float() cannot take: the report's arithmetic raised an
    OverflowError."""
    from denoised_gpt.run_dir import metrics_rows
    (tmp_path / 'metrics.jsonl').write_text('{"iter": 3, "val_loss": 1' + '0' * 400 + ', "train_loss": 1.0, '
                                            '"time": 1}\n{"iter": ' + str(2**64) + ', "loss": 1.0}\n')
    assert [problem for *_, problem in metrics_rows(tmp_path / 'metrics.jsonl')] == [
        "its val_loss is 1000000000000000000000000000000000000..., not a number",
        "its iter is 18446744073709551616, not a non-negative integer up to 2**63 - 1"]


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['device', 'FIFO', 'sparse file'])
def test_a_metrics_log_that_is_a_device_or_a_fifo_is_refused_at_resume_in_one_line(tmp_path, data, kind):
    """A link to /dev/zero was read whole (the process grew to 24 GB); a FIFO hung the resume; a sparse file of a
    terabyte (no disk) was read as zeros for hours."""
    out = tmp_path / 'out'
    train(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--max_iters=5', '--eval_interval=5')
    if kind == 'sparse file':
        with open(out / 'metrics.jsonl', 'ab') as f:
            f.truncate(1 << 40)
    else:
        (out / 'metrics.jsonl').unlink()
    if kind == 'device':
        (out / 'metrics.jsonl').symlink_to('/dev/zero')
    elif kind == 'FIFO':
        os.mkfifo(out / 'metrics.jsonl')
    def files():  # (the lock file says who holds it: every run rewrites it; a terabyte is compared by its stat)
        log = out / 'metrics.jsonl'
        sparse = log.stat() if kind == 'sparse file' else None
        if sparse:
            os.replace(log, tmp_path / 'aside')
        try:
            return {k: v for k, v in snapshot(out).items() if k.name != '.lock'}, sparse and (sparse.st_size,
                                                                                              sparse.st_mtime_ns)
        finally:
            if sparse:
                os.replace(tmp_path / 'aside', log)
    before = files()
    proc = subprocess.run(train_command(out, data, '--init_from=resume', '--max_iters=10'), cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    what = (f"metrics log {out / 'metrics.jsonl'} is {1 << 40:,} bytes, more than 1,024 MiB, which no metrics log "
            f"is" if kind == 'sparse file' else f"cannot read {out / 'metrics.jsonl'}: it is a {kind}, not a file")
    assert proc.stderr.strip() == f"train.py: error: {what}; put the run's metrics log there, or move it away (a " \
                                  f"resumed run then logs from its checkpoint on)"
    assert files() == before
