"""compare.py end to end on a tiny sweep (2 variants x 2 seeds, CPU): the report's numbers are the
runs' metrics.jsonl rows, a sweep killed in the middle of a run and started again gives the same
numbers as an uninterrupted one, and finished runs are skipped."""
import contextlib
import json
import os
import re
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, SCRIPT_VARIABLES, TINY, make_dataset, run_script_in_process, subprocess_env

pytestmark = pytest.mark.slow  # training runs and sweeps (conftest.py: slow)

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

ITERS = 24


def sweep_args(out_dir, data, *args, attn_types='base,noiseformer_v2', seeds='1,2'):
    overrides = (f"--dataset={data} --max_iters={ITERS} --lr_decay_iters={ITERS} --eval_interval=8 --eval_iters=2 "
                 f"--log_interval=4")
    return [f'--base_config={TINY}', f'--overrides={overrides}', f'--attn_types={attn_types}', f'--seeds={seeds}',
            f'--out_dir={out_dir}', *args]


def compare(args):
    """compare.py ARGS run in this process (its train.py and sample.py runs are processes all the same),
    which spares a torch start-up per sweep; its runs see the environment a subprocess's would."""
    return run_script_in_process('compare.py', args, env=SCRIPT_VARIABLES)


def metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / 'metrics.jsonl').read_text().splitlines()]
    return [r for r in rows if 'loss' in r], [r for r in rows if 'val_loss' in r]


@pytest.fixture(scope='module')
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('compare')
    data = make_dataset(tmp)
    chars = ''.join(chr(ord('a') + i) if i < 26 else chr(ord('A') + i - 26) for i in range(48))
    meta = json.loads((data / 'meta.json').read_text())
    (data / 'meta.json').write_text(json.dumps({**meta, 'chars': list(chars)}))  # so sample.py can decode
    proc = compare(sweep_args(tmp / 'out', data, '--sample_tokens=20'))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp, data, proc


def test_report_numbers_are_the_metrics_rows(sweep):
    tmp, _, proc = sweep
    report_dir = tmp / 'out' / 'report'
    assert f"report: {report_dir / 'report.md'} (4 of 4 runs)" in proc.stdout
    results = json.loads((report_dir / 'results.json').read_text())
    report = (report_dir / 'report.md').read_text()
    assert len(results['runs']) == 4 and results['failed'] == []
    for r in results['runs']:
        steps, evals = metrics(tmp / 'out' / 'runs' / f"{r['attn_type']}-seed{r['seed']}")
        assert [e['iter'] for e in evals] == [0, 8, 16, 24]
        assert r['final_val_loss'] == evals[-1]['val_loss']
        assert r['best_val_loss'] == min(e['val_loss'] for e in evals)
        assert r['tokens_per_s'] == statistics.median(s['tokens_per_s'] for s in steps)
        assert r['train_time_s'] == evals[-1]['time']
        assert [p['val_loss'] for p in r['curve']] == [e['val_loss'] for e in evals]
    for attn_type in ('base', 'noiseformer_v2'):
        finals = [r['final_val_loss'] for r in results['runs'] if r['attn_type'] == attn_type]
        s = results['summary'][attn_type]
        assert s['final_val_loss']['mean'] == statistics.mean(finals)
        assert s['final_val_loss']['std'] == statistics.stdev(finals)
        row = next(line for line in report.splitlines() if line.startswith(f"| `{attn_type}` |"))
        assert f"{statistics.mean(finals):.4f} ± {statistics.stdev(finals):.4f}" in row
        assert ', '.join(f"{v:.4f}" for v in finals) in row
    # the seeds' initial weights differ, so their losses do
    assert len({r['final_val_loss'] for r in results['runs']}) == 4
    # parameters: noiseformer_v2 = symmetric (no key projection) + mu, sigma per head and layer
    params = results['summary']
    assert params['base']['params'] - params['noiseformer_v2']['params'] == 2 * (32 * 32) - 2 * 2 * 2
    # the plots exist and are PNG files; the sigma plot is there because noiseformer_v2 learns sigma
    for png in ('val_loss.png', 'learned.png'):
        assert (report_dir / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and f"({png})" in report
    assert "### `base`" in report and "### `noiseformer_v2`" in report  # one sample each


def test_the_val_loss_plot_titles_its_panels_alike(sweep):
    """Both panels are titled in one size, what they share said once above them."""
    from denoised_gpt.compare_report import TITLE_SIZE, by_variant, val_loss_figure
    tmp, _, _ = sweep
    results = json.loads((tmp / 'out' / 'report' / 'results.json').read_text())['runs']
    fig = val_loss_figure(by_variant(results))
    assert [ax.get_title() for ax in fig.axes] == ['against iterations', 'against training time']
    assert {ax.title.get_fontsize() for ax in fig.axes} == {TITLE_SIZE}
    assert fig.get_suptitle().startswith('val loss: mean over seeds')


def test_paired_differences_are_the_metrics_rows(sweep):
    """Each variant against base, seed by seed: the final evaluation rows' differences, their mean and
    sample std, sign agreement and the reading, in results.json and report.md."""
    tmp, _, _ = sweep
    report_dir = tmp / 'out' / 'report'
    summary = json.loads((report_dir / 'results.json').read_text())['summary']
    report = (report_dir / 'report.md').read_text()
    final = {(a, s): metrics(tmp / 'out' / 'runs' / f'{a}-seed{s}')[1][-1]['val_loss']
             for a in ('base', 'noiseformer_v2') for s in (1, 2)}
    d = [final[('noiseformer_v2', s)] - final[('base', s)] for s in (1, 2)]
    same_sign = all(x < 0 for x in d) or all(x > 0 for x in d)
    assert 'paired_vs_base' not in summary['base']
    assert summary['noiseformer_v2']['paired_vs_base'] == {
        'seeds': [1, 2], 'differences': d, 'mean': statistics.mean(d), 'std': statistics.stdev(d),
        'same_sign': same_sign}
    stat = f"{statistics.mean(d):+.4f} ± {statistics.stdev(d):.4f}"
    row = next(line for line in report.split('## Final val loss against base, seed by seed')[1].splitlines()
               if line.startswith("| `noiseformer_v2` |"))
    assert row == f"| `noiseformer_v2` | 1, 2 | {d[0]:+.4f}, {d[1]:+.4f} | {stat} | {'yes' if same_sign else 'no'} |"
    reading = next(line for line in report.splitlines() if line.startswith("| `noiseformer_v2` |")).split(' | ')[-1]
    if same_sign:
        assert reading == f"{'lower' if d[0] < 0 else 'higher'} than base on every seed (2/2): {stat} |"
    else:
        assert reading.startswith("no consistent difference: signs differ across seeds")
    assert next(line for line in report.splitlines() if line.startswith("| `base` |")).endswith(" |  |")
    assert "only when every seed's difference has the same sign" in report and "seed spread" not in report


def test_reading_calls_a_difference_only_when_every_seed_agrees():
    """The held-out sweep that unpaired spreads misread: symmetric was higher than base on every seed,
    noiseformer_v2 against symmetric had no consistent difference at all."""
    from denoised_gpt.compare_report import paired_cell, paired_vs_base, reading
    per_seed = {'base': [2.000, 2.100, 2.050], 'symmetric': [2.043, 2.133, 2.081],
                'noiseformer_v2': [2.017, 2.159, 2.071]}
    results = [{'variant': a, 'seed': s, 'final_val_loss': v}
               for a, values in per_seed.items() for s, v in zip((1, 2, 3), values)]
    sym = paired_vs_base(results, 'symmetric')
    assert sym['seeds'] == [1, 2, 3] and sym['same_sign']
    assert sym['differences'] == pytest.approx([0.043, 0.033, 0.031])
    assert reading(sym) == "higher than base on every seed (3/3): +0.0357 ± 0.0064"
    v2 = paired_vs_base(results, 'noiseformer_v2', base='symmetric')
    assert v2['differences'] == pytest.approx([-0.026, 0.026, -0.010]) and not v2['same_sign']
    assert reading(v2).startswith("no consistent difference: signs differ across seeds (lower on 2/3;")
    lower = paired_vs_base(results, 'base', base='symmetric')
    assert reading(lower) == "lower than base on every seed (3/3): -0.0357 ± 0.0064"
    # only the seeds both finished are paired; a zero difference agrees with no sign
    partial = [r for r in results if (r['variant'], r['seed']) not in {('base', 1), ('symmetric', 3)}]
    one = paired_vs_base(partial, 'symmetric')
    assert one['seeds'] == [2] and one['std'] is None
    assert reading(one) == "+0.0330 vs base (seed 2), one seed: no spread to judge it against"
    none = paired_vs_base([r for r in partial if r['seed'] != 2], 'symmetric')
    assert none == {'seeds': [], 'differences': [], 'mean': None, 'std': None, 'same_sign': False}
    assert reading(none).startswith("no seed finished by both")
    tied = [{**r, 'final_val_loss': 2.0 + 0.01 * (r['seed'] == 2 and r['variant'] == 'symmetric')}
            for r in results if r['variant'] in ('base', 'symmetric')]
    assert not paired_vs_base(tied, 'symmetric')['same_sign']
    assert reading(paired_vs_base(tied, 'symmetric')).startswith("no consistent difference")
    # the report's * marks agreement, which takes two seeds or more
    assert paired_cell(sym) == "+0.036 ± 0.006*" and paired_cell(v2) == "-0.003 ± 0.027"
    assert paired_cell(one) == "+0.033" and paired_cell(none) == ''


def test_progress_bar_ends_each_run_done(sweep):
    """train.py logs only every log_interval iterations, so the bar's last 'iter' text is not the end of
    a run: once a run finishes, the bar counts it in full and says it is done."""
    _, _, proc = sweep
    updates = [u for u in proc.stderr.replace('\n', '\r').split('\r') if '4 runs' in u]
    assert updates and f"{4 * ITERS}/{4 * ITERS}" in updates[-1], updates[-3:]
    assert updates[-1].rstrip().endswith("noiseformer_v2 seed 2: done]"), updates[-1]  # ] closes tqdm's postfix
    for i, (attn_type, seed) in enumerate([('base', 1), ('base', 2), ('noiseformer_v2', 1)]):
        assert any(f"{(i + 1) * ITERS}/{4 * ITERS}" in u and u.rstrip().endswith(f"{attn_type} seed {seed}: done]")
                   for u in updates), (attn_type, seed)


def test_finished_runs_are_skipped(sweep):
    tmp, data, _ = sweep
    before = {p: p.stat().st_mtime_ns for p in (tmp / 'out' / 'runs').glob('*/ckpt.pt')}
    proc = compare(sweep_args(tmp / 'out', data, '--samples=False'))
    assert proc.returncode == 0, proc.stderr
    assert {p: p.stat().st_mtime_ns for p in before} == before  # nothing trained again


def test_killed_sweep_started_again_gives_the_same_numbers(sweep):
    tmp, data, _ = sweep
    out = tmp / 'killed'
    args = sweep_args(out, data, '--samples=False', attn_types='noiseformer_v2', seeds='2')
    # a process of its own, to be killed
    proc = subprocess.Popen([sys.executable, 'compare.py', *args], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = out / 'runs' / 'noiseformer_v2-seed2'
    deadline = time.time() + 120
    while time.time() < deadline and not ((run_dir / 'train.log').exists() and
                                          'saved checkpoint' in (run_dir / 'train.log').read_text()):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # in the middle of the run: its train.py dies with it
    proc.wait()
    _, evals = metrics(run_dir)
    assert evals[-1]['iter'] < ITERS, "the run finished before the kill: nothing was interrupted"
    rerun = compare(args)
    assert rerun.returncode == 0, rerun.stderr
    commands = [line for line in (run_dir / 'train.log').read_text().splitlines() if line.startswith('$ ')]
    assert len(commands) == 2 and '--init_from=resume' in commands[1]
    a = next(r for r in json.loads((tmp / 'out' / 'report' / 'results.json').read_text())['runs']
             if (r['attn_type'], r['seed']) == ('noiseformer_v2', 2))
    b = json.loads((out / 'report' / 'results.json').read_text())['runs'][0]
    for key in ('attn_type', 'seed', 'final_val_loss', 'best_val_loss', 'params', 'learned'):
        assert a[key] == b[key], key
    assert [p['val_loss'] for p in a['curve']] == [p['val_loss'] for p in b['curve']]
    steps_a, _ = metrics(tmp / 'out' / 'runs' / 'noiseformer_v2-seed2')
    steps_b, _ = metrics(run_dir)
    assert [s['iter'] for s in steps_b] == list(range(0, ITERS, 4))  # one row per logged iteration after the resume
    assert [s['loss'] for s in steps_a] == [s['loss'] for s in steps_b]


@pytest.mark.parametrize('sig, to_a_thread', [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGINT, True)],
                         ids=['SIGTERM', 'SIGHUP', 'SIGINT-to-a-thread'])
def test_a_signal_to_compare_alone_checkpoints_its_runs_and_ends(sweep, sig, to_a_thread):
    """SIGINT, SIGTERM or SIGHUP sent to compare.py's process only (not its process group, as Ctrl-C would): its
    train.py gets SIGTERM, saves and exits, and compare.py exits 130 soon, not after the run's 10^6
    iterations; the run is resumable from where it stopped. The kernel may hand a signal sent to the process
    to any of its threads: to_a_thread sends it by thread id to one that is not the main one (Linux gives a
    signal sent to a thread id to that thread first), where Python only notes it for the main thread. That
    case also starts compare.py as a shell starts a job in the background, with SIGINT ignored."""
    tmp, data, _ = sweep
    out = tmp / f'signalled-{sig.name}'
    ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if to_a_thread else None
    proc, log = start_endless_run(out, data, preexec_fn=ignore_sigint)
    if to_a_thread:
        threads = [int(t) for t in os.listdir(f'/proc/{proc.pid}/task') if int(t) != proc.pid]
        assert threads, "compare.py runs its train.py from a thread of its own"
        os.kill(threads[0], sig)
    else:
        os.kill(proc.pid, sig)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"compare.py did not end within 60 s of the signal; its stderr ends:\n{stderr[-1500:]}\n"
                    f"train.log ends:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 130 and "run the same command again to continue" in stderr, stderr
    assert "failed" not in stderr and "base seed 1: stopped" in stderr, stderr  # checkpointed, not failed
    text = log.read_text()
    # the signal lands between micro-batches (the step dropped), in a step's last (saved after it) or in an
    # evaluation (saved without it): each is train.py's stop
    after_step = re.search(r"SIGTERM received: stopping after iter (\d+)", text)
    within = re.search(r"SIGTERM received during (?:the evaluation at )?iter (\d+)\b.*: stopping without it", text)
    assert after_step or within, text[-2000:]
    saved = int(after_step[1]) + 1 if after_step else int(within[1])
    ckpt = torch.load(out / 'runs' / 'base-seed1' / 'ckpt.pt', map_location='cpu', weights_only=True)
    assert ckpt['iter_num'] == saved < 1_000_000


def start_endless_run(out, data, preexec_fn=None):
    """compare.py as a process of its own, training one run of 10^6 iterations (stderr a pipe), once that run
    has saved its first checkpoint, with a second run waiting for its job slot (a stop must not wait for it);
    returns (the process, the first run's train.log)."""
    overrides = f"--dataset={data} --max_iters=1000000 --lr_decay_iters=1000000 --eval_interval=8 --eval_iters=2"
    args = [f'--base_config={TINY}', f'--overrides={overrides}', '--attn_types=base', '--seeds=1,2',
            f'--out_dir={out}', '--samples=False']
    proc = subprocess.Popen([sys.executable, 'compare.py', *args], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    log = out / 'runs' / 'base-seed1' / 'train.log'
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and 'saved checkpoint' in log.read_text()):
        time.sleep(0.01)
    return proc, log


def children(pid, script):
    """The process ids of pid's children that run script (Linux: /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir('/proc')):
        with contextlib.suppress(OSError):  # (one that ended meanwhile)
            stat = Path(f'/proc/{entry}/stat').read_text()
            if int(stat.rsplit(')', 1)[1].split()[1]) == pid and script in Path(f'/proc/{entry}/cmdline').read_text():
                found.append(int(entry))
    return found


def running(pid):
    """Whether the process is there and not a zombie (a child ended but not yet waited for)."""
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


def stderr_lines(proc):
    """The lines proc writes to stderr, read by a thread into the list returned, as they come."""
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return lines


def test_a_ctrl_c_after_a_stop_quits_at_once_in_one_line(sweep):
    """The first stop waits for the runs to save (here a train.py held stopped cannot), and says that a Ctrl-C
    quits at once: that Ctrl-C ends the sweep in one line (a KeyboardInterrupt traceback before), with its
    train.py ended, not left behind, and the run's last checkpoint intact."""
    tmp, data, _ = sweep
    proc, log = start_endless_run(tmp / 'second-ctrl-c', data)
    [train] = children(proc.pid, 'train.py')
    os.kill(train, signal.SIGSTOP)
    try:
        lines = stderr_lines(proc)
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while time.time() < deadline and not any("Ctrl-C again to quit at once" in line for line in lines):
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        os.kill(train, signal.SIGCONT)  # (it then saves, or quits at the Ctrl-C compare.py passes on)
        proc.wait(timeout=30)
    finally:  # (what a failure leaves: train.py, stopped or not, dies with compare.py)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.1)  # (the reader thread takes the last lines)
    err = ''.join(lines)
    assert proc.returncode == 130 and 'Traceback' not in err, err[-3000:]
    assert "stopping: the runs save a checkpoint and exit (Ctrl-C again to quit at once)\n" in err
    assert err.count("interrupted again: quit without waiting for the runs to save (each keeps its last checkpoint): "
                     "run the same command again to continue the sweep\n") == 1, err[-3000:]
    assert not running(train)
    assert torch.load(log.parent / 'ckpt.pt', map_location='cpu', weights_only=True)['iter_num'] >= 8


def test_a_stop_while_the_report_is_written_ends_in_one_line_and_stops_sample_py(sweep):
    """SIGTERM while sample.py writes the report's samples: compare.py ends in one line (a KeyboardInterrupt
    traceback before), sample.py with it, and no report is left half written."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'report-stopped')
    args = sweep_args(out, data, '--report_only=True', '--sample_tokens=20', attn_types='base', seeds='1')
    proc = subprocess.Popen([sys.executable, 'compare.py', *args], cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sample = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None and not (sample := children(proc.pid, 'sample.py')):
            time.sleep(0.01)
        assert sample and proc.poll() is None, "compare.py ended before it ran sample.py"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and 'Traceback' not in err, err
    assert err.strip().splitlines()[-1] == ("interrupted while writing the report: run the same command again to "
                                            "write it (the runs are intact)"), err
    assert not running(sample[0]) and not (out / 'report' / 'results.json').exists()


def copy_sweep(tmp, name, runs=('base-seed1',)):
    """A new sweep folder holding copies of some of the module sweep's finished runs."""
    import shutil
    out = tmp / name
    for run in runs:
        shutil.copytree(tmp / 'out' / 'runs' / run, out / 'runs' / run)
    return out


def test_a_sweep_with_other_settings_is_refused_unless_told_to_continue(sweep):
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'changed')
    ckpt = out / 'runs' / 'base-seed1' / 'ckpt.pt'
    before = ckpt.read_bytes()
    longer = [f'--overrides=--dataset={data} --max_iters={ITERS + 2} --lr_decay_iters={ITERS + 2} --eval_interval=8 '
              f'--eval_iters=2', '--samples=False']
    args = sweep_args(out, data, attn_types='base', seeds='1')
    proc = compare(args + longer)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"max_iters: {ITERS} in 1 run, this sweep {ITERS + 2}" in proc.stderr
    assert "lr_decay_iters" in proc.stderr and "--continue_changed=True" in proc.stderr
    assert ckpt.read_bytes() == before  # nothing trained
    proc = compare(args + longer + ['--continue_changed=True'])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (out / 'report' / 'report.md').read_text()
    assert "## Settings changed during the sweep" in report
    line = f"- `runs/base-seed1`, from iter {ITERS}: "
    assert line in report and f"max_iters {ITERS} -> {ITERS + 2}" in report
    proc = compare(args + longer + ['--continue_changed=True'])  # again: nothing to train, nothing changed since
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / 'report' / 'report.md').read_text().count("from iter") == 1
    # lines compare.py did not write as they are (damaged, edited) are left out of the report, not a traceback
    with open(out / 'settings_changes.jsonl', 'a') as f:
        f.write('{}\n[]\nnot json\n{"run": 5, "attn_type": "base", "from_iter": 1, "changes": {}}\n' + '[' * 100_000 + '\n')
    with open(out / 'settings_changes.jsonl', 'ab') as f:  # not UTF-8; a line of 2 MiB (beyond any of ours)
        f.write(b'{"run": "caf\xe9"}\n' + b'7' * (2 << 20) + b'\n')
    proc = compare(args + longer + ['--continue_changed=True', '--report_only=True'])
    assert proc.returncode == 0 and 'Traceback' not in proc.stderr, proc.stdout + proc.stderr
    assert (out / 'report' / 'report.md').read_text().count("from iter") == 1


def test_a_run_trained_again_from_scratch_drops_the_changes_recorded_for_its_folder(sweep):
    """Removing a run's folder to retrain it gives a run trained with one set of settings: the report must not
    list the continuation of the run that was there before."""
    import shutil
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'changed-then-removed', runs=('base-seed1', 'base-seed2'))
    longer = [f'--overrides=--dataset={data} --max_iters={ITERS + 2} --lr_decay_iters={ITERS + 2} --eval_interval=8 '
              f'--eval_iters=2', '--samples=False', '--continue_changed=True']
    args = sweep_args(out, data, attn_types='base', seeds='1,2') + longer
    assert compare(args).returncode == 0
    assert (out / 'report' / 'report.md').read_text().count("from iter") == 2
    shutil.rmtree(out / 'runs' / 'base-seed1')
    proc = compare(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (out / 'report' / 'report.md').read_text()
    assert "`runs/base-seed1`" not in report and "- `runs/base-seed2`, from iter" in report


def test_a_changed_run_that_is_not_trained_again_is_not_listed(sweep):
    """Only a run continued under the new settings was trained with two: a finished one keeps its own."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'changed-finished')
    other = [f'--overrides=--dataset={data} --max_iters={ITERS} --lr_decay_iters={ITERS} --eval_interval=8 '
             f'--eval_iters=2 --weight_decay=0.123', '--samples=False', '--continue_changed=True']
    proc = compare(sweep_args(out, data, attn_types='base', seeds='1') + other)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "weight_decay" in proc.stdout  # told, since the sweep's settings differ from the run's
    assert "Settings changed during the sweep" not in (out / 'report' / 'report.md').read_text()


def test_a_sweep_refuses_a_dataset_that_is_not_there(sweep):
    """Without the dataset a report would score its runs by another metric than they were trained for."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'no-dataset')
    missing = tmp / 'not-prepared'
    proc = compare(sweep_args(out, data, '--report_only=True', f'--overrides=--dataset={missing}', attn_types='base'))
    assert proc.returncode == 2 and f"dataset '{missing}' not found" in proc.stderr, proc.stderr
    assert "prepare it first" in proc.stderr and not (out / 'report').exists()


def test_report_only_names_an_unreadable_checkpoint(sweep):
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'damaged', runs=('base-seed1', 'base-seed2'))
    ckpt = out / 'runs' / 'base-seed2' / 'ckpt.pt'
    ckpt.write_bytes(b'not a checkpoint' + ckpt.read_bytes()[16:])
    proc = compare(sweep_args(out, data, '--report_only=True', '--samples=False', attn_types='base'))
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr  # 1: a run failed
    assert "(1 of 2 runs, 1 failed)" in proc.stdout
    failed = json.loads((out / 'report' / 'results.json').read_text())['failed']
    assert [(f['attn_type'], f['seed']) for f in failed] == [('base', 2)]
    assert "its checkpoint cannot be read" in failed[0]['reason'] and "or not a checkpoint" in failed[0]['reason']


def test_report_only_leaves_out_the_lines_of_a_metrics_log_that_are_not_rows(sweep):
    """Each raised a traceback in the report (a TypeError, a KeyError, a StopIteration); a damaged line is
    named and left out, and the run's numbers are those of its other rows."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'damaged-metrics')
    log = out / 'runs' / 'base-seed1' / 'metrics.jsonl'
    rows = log.read_text().splitlines()
    evals = [json.loads(r) for r in rows if 'val_loss' in json.loads(r)]
    damaged = ['{}', '[]', '"text"', '{"iter": NaN, "val_loss": 1.0, "train_loss": 1.0, "time": 1.0}',
               '{"iter": "8", "val_loss": 1.0, "train_loss": 1.0, "time": 1.0}',
               '{"iter": 8, "val_loss": "x", "train_loss": 1.0, "time": 1.0, "peak_memory_mib": 1}',
               '{"iter": 8, "val_loss": 1.0, "train_loss": 1.0, "time": 1.0, "peak_memory_mib": "x"}',
               '{"iter": 2, "loss": 1.0}', '[' * 100_000 + ']' * 100_000]
    log.write_text('\n'.join(rows[:3] + damaged + rows[3:]) + '\n')
    proc = compare(sweep_args(out, data, '--report_only=True', '--samples=False', attn_types='base', seeds='1'))
    assert proc.returncode == 0 and 'Traceback' not in proc.stderr, proc.stderr
    assert f"note: left out 9 lines of {log} that are not metrics rows (line 4: it has no iter; line 5: an array, " \
           f"not a JSON object; line 6: a string, not a JSON object; and 6 more)" in proc.stderr
    run = json.loads((out / 'report' / 'results.json').read_text())['runs'][0]
    assert [p['val_loss'] for p in run['curve']] == [e['val_loss'] for e in evals]


@pytest.mark.parametrize('kind', ['device', 'FIFO'])
def test_report_only_refuses_a_metrics_log_that_is_a_device_or_a_fifo(sweep, kind):
    tmp, data, _ = sweep
    out = copy_sweep(tmp, f'metrics-{kind}')
    log = out / 'runs' / 'base-seed1' / 'metrics.jsonl'
    log.unlink()
    if kind == 'device':
        log.symlink_to('/dev/zero')
    else:
        os.mkfifo(log)
    proc = compare(sweep_args(out, data, '--report_only=True', '--samples=False', attn_types='base', seeds='1'))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"compare.py: error: cannot read {log}: it is a {kind}, not a file; put the run's " \
                                  f"metrics log there, or move it away (a resumed run then logs from its checkpoint on)"
    assert not (out / 'report').exists()


@pytest.mark.parametrize('log', ['metrics.jsonl', 'settings_changes.jsonl'])
def test_report_only_refuses_a_sparse_log_of_a_terabyte_in_one_line_at_once(sweep, log):
    """A terabyte of holes takes no disk (756 KB here) and was read as zeros for hours; a log larger than any
    run writes is refused before it is read."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, f'sparse-{log}')
    path = out / 'runs' / 'base-seed1' / log if log == 'metrics.jsonl' else out / log
    with open(path, 'ab') as f:
        f.truncate(1 << 40)
    what, fix = (("metrics log", "put the run's metrics log there, or move it away (a resumed run then logs from "
                                 "its checkpoint on)") if log == 'metrics.jsonl' else
                 ("settings changes log", "remove it (it lists runs continued with changed settings)"))
    proc = compare(sweep_args(out, data, '--report_only=True', '--samples=False', attn_types='base', seeds='1'))
    assert proc.returncode == 2, proc.stderr
    limit = "1,024" if log == 'metrics.jsonl' else "64"
    assert proc.stderr.strip() == f"compare.py: error: {what} {path} is {1 << 40:,} bytes, more than {limit} MiB, " \
                                  f"which no {what} is; {fix}"


def test_a_full_disk_when_writing_the_report_is_one_line_and_keeps_the_earlier_results(sweep):
    """results.json.tmp a link to /dev/full: every write to it fails with ENOSPC (a traceback before)."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'full-report')
    args = sweep_args(out, data, '--report_only=True', '--samples=False', attn_types='base', seeds='1')
    assert compare(args).returncode == 0
    results = (out / 'report' / 'results.json').read_bytes()
    (out / 'report' / 'results.json.tmp').symlink_to('/dev/full')
    proc = compare(args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"compare.py: error: cannot write {out / 'report' / 'results.json'}: no space left " \
                                  f"on device; the file there before is intact. Free some space and run the same " \
                                  f"command with --report_only=True (the runs are intact)"
    assert (out / 'report' / 'results.json').read_bytes() == results
    assert not os.path.lexists(out / 'report' / 'results.json.tmp')


def test_a_report_folder_that_is_a_file_is_refused_before_any_training(sweep):
    """It was a FileExistsError traceback from os.makedirs, once every run had trained."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'report-a-file', runs=())
    out.mkdir()
    (out / 'report').write_text('my notes\n')
    for more in (['--report_only=True'], []):
        proc = compare(sweep_args(out, data, *more, '--samples=False', attn_types='base', seeds='1'))
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"compare.py: error: {out / 'report'} is not a folder, and compare.py writes its report there: move it "
            f"away"), proc.stderr
    assert (out / 'report').read_text() == 'my notes\n' and not (out / 'runs').exists()


def test_compare_runs_from_another_directory(sweep):
    """train.py and sample.py are found beside compare.py, not in the current directory (a traceback
    'No such file: train.py' before); the finished run is reported, nothing retrained."""
    tmp, data, _ = sweep
    out = copy_sweep(tmp, 'elsewhere')
    before = (out / 'runs' / 'base-seed1' / 'ckpt.pt').stat().st_mtime_ns
    elsewhere = tmp / 'cwd'
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / 'compare.py'),
                           *sweep_args(out, data, '--sample_tokens=20', attn_types='base', seeds='1')],
                          cwd=elsewhere, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (out / 'runs' / 'base-seed1' / 'ckpt.pt').stat().st_mtime_ns == before
    report = (out / 'report' / 'report.md').read_text()
    # sample.py ran (and refused this data's vocabulary, which lacks its default prompt, a newline), not "can't open"
    assert "sample.py: error: the prompt" in report and "can't open file" not in report, report


@pytest.mark.parametrize('args,message', [
    (['--attn_types=base,noiseformer2'], "unknown 'noiseformer2' (did you mean 'noiseformer_v2'?)"),
    (["--tune={'learning_rate': [1e-3]}", '--tune_seeds=1338'], "tune_seeds and seeds share [1338]"),
    (["--tune={'seed': [1, 2]}"], "tune: seed cannot be tuned"),
    (["--tune={'learning_rat': [1e-3, 1e-2]}"], "tune candidate learning_rat=0.001: command line argument"),
    (["--tune={'learning_rate': 1e-3}"], "must map train.py settings to lists of distinct values"),
    (["--tune={'learning_rate': {'base': [1e-3]}}"], "tune['learning_rate'] gives values per variant: it must map every"),
    (["--tune={'learning_rate': [1e-3]}", '--tune_metric=acc'], "tune_metric='acc' must be one of"),
    (['--nproc=99999999999'], "nproc=99999999999 must be between 1 and this machine's"),
    (['--jobs=99999'], "jobs=99999 runs of nproc=1 processes must fit this machine's"),
    (['--grid=--n_embd=64,--n_embd=64'], "repeats a point"),
    (['--grid=--seed=3'], "attn_type, seed, out_dir and init_from are compare.py's to set"),
    (['--grid=--n_emb=64'], "n_emb"),
    (['--report_only=True'], "does not exist, so there are no runs to report"),
    (["--tune={'learning_rate': [1e-3]}", '--grid=--n_embd=64', '--tune_at=--n_embd=32'],
     "tune_at='--n_embd=32' is not one of grid's entries ('--n_embd=64'): give one of them as written"),
    (['--grid=--n_embd=64', '--tune_at=--n_embd=64'], "tune_at='--n_embd=64' names where to tune, but tune is empty"),
    (["--chosen={'base': {'learning_rate': 1e-3}}", "--tune={'learning_rate': [1e-3]}", '--chosen_by=x'],
     "chosen gives each variant its settings and tune chooses them: give one of the two"),
    (["--chosen={'base': {'learning_rate': 1e-3}}", '--attn_types=base'], "chosen needs chosen_by"),
    (["--chosen={'base': {'learning_rate': 1e-3}}", '--attn_types=base,diff', '--chosen_by=x'],
     "must give every attn_type of attn_types (base, diff) a dict of train.py settings"),
    (["--chosen={'base': {'seed': 3}}", '--attn_types=base', '--chosen_by=x'], "chosen['base']: seed is compare.py's"),
])
def test_bad_sweep_settings_are_one_line(args, message, tmp_path):
    proc = run_script_in_process('compare.py', [f'--out_dir={tmp_path / "out"}', *args])
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'out').exists()


def test_every_runs_settings_are_checked_once_before_any_run_starts(tmp_path):
    """A short sweep that inherits its config's warmup is refused in one line naming the fix, before any run
    starts; a setting only one variant's runs get is refused naming that run."""
    data = make_dataset(tmp_path)
    short = f"--dataset={data} --max_iters=50 --lr_decay_iters=50 --warmup_iters=50"
    proc = compare([f'--base_config={TINY}', f'--overrides={short}', '--attn_types=base,diff',
                    f'--out_dir={tmp_path / "a"}'])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "compare.py: error: every run: lr_decay_iters=50 must be larger than warmup_iters=50" in proc.stderr
    assert "give a shorter warmup, e.g. --warmup_iters=5 (below max_iters)" in proc.stderr
    proc = compare([f'--base_config={TINY}', f'--overrides=--dataset={data}', '--attn_types=base,diff', '--chosen_by=x',
                    "--chosen={'base': {'n_head': 2}, 'diff': {'n_head': 3}}", f'--out_dir={tmp_path / "b"}'])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "compare.py: error: run diff: " in proc.stderr and "n_head" in proc.stderr
    assert not (tmp_path / 'a').exists() and not (tmp_path / 'b').exists()  # no run was started


# -----------------------------------------------------------------------------
# tuning: each variant at its own best settings

TUNE = "{'learning_rate': [0.01, 1e-06, 1e+30]}"  # a good rate, one far too small to learn, one that diverges


@pytest.fixture(scope='module')
def tuned_sweep(sweep):
    tmp, data, _ = sweep
    args = sweep_args(tmp / 'tuned', data, f'--tune={TUNE}', '--tune_seeds=5', '--samples=False',
                      attn_types='base,linear', seeds='1')
    proc = compare(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp / 'tuned', args, proc


def test_tuning_chooses_each_variants_best_and_compares_it_there(tuned_sweep):
    """The tuning table is the tuning runs' final val losses; the rate that cannot learn scores clearly worse,
    the diverged one ranks last; the comparison trains each variant at the chosen rate, min_lr at the config's
    ratio (tests/config_tiny.py: 3e-3 and 3e-4)."""
    from denoised_gpt.checkpoint import read_checkpoint
    out, _, proc = tuned_sweep
    results = json.loads((out / 'report' / 'results.json').read_text())
    assert results['protocol'] == {'tuned': True, 'tune': {'learning_rate': [0.01, 1e-06, 1e+30]},
                                   'tune_seeds': [5], 'metric': ['val_loss']}
    report = (out / 'report' / 'report.md').read_text()
    for t in results['tuning']:
        a = t['attn_type']
        finals = [metrics(out / 'tune' / f'{a}-learning_rate{lr}-seed5')[1] for lr in ('0.01', '1e-06')]
        good, small = (evals[-1]['val_loss'] for evals in finals)
        assert [c['val_loss'] for c in t['candidates'][:2]] == [good, small] and good < small - 0.1
        assert [c['diverged'] for c in t['candidates']] == [False, False, True]
        assert (out / 'tune' / f'{a}-learning_rate1e+30-seed5' / 'diverged.txt').exists()
        assert t['chosen'] == 'learning_rate=0.01' and [c['chosen'] for c in t['candidates']] == [True, False, False]
        assert t['warnings'] == []  # 0.01 lies inside the range tried
        assert f"| `{a}` | **{good:.4f}** | {small:.4f} | diverged | learning_rate=0.01 |" in report
        config = read_checkpoint(out / 'runs' / f'{a}-seed1', metadata_only=True)[1]['config']
        assert config['learning_rate'] == 0.01 and config['min_lr'] == pytest.approx(1e-3)
    assert report.index("**Protocol: each variant at its own best settings.**") < report.index("## Comparison")
    assert "diverged: ranked below every candidate" in proc.stdout + proc.stderr


def test_tuning_seeds_never_appear_in_the_comparison(tuned_sweep):
    out, _, _ = tuned_sweep
    results = json.loads((out / 'report' / 'results.json').read_text())
    assert sorted((r['attn_type'], r['seed']) for r in results['runs']) == [('base', 1), ('linear', 1)]
    assert sorted(p.name for p in (out / 'runs').iterdir()) == ['base-seed1', 'linear-seed1']
    assert {p.name.rsplit('-', 1)[1] for p in (out / 'tune').iterdir()} == {'seed5'}


def test_a_tuned_sweep_run_again_trains_nothing(tuned_sweep):
    """Finished tuning and comparison runs are skipped, and a diverged candidate is not tried again."""
    out, args, _ = tuned_sweep
    logs = sorted(out.glob('*/*/train.log'))
    before = {p: p.read_bytes() for p in logs}
    proc = compare(args)
    assert proc.returncode == 0, proc.stderr
    assert len(logs) == 8 and {p: p.read_bytes() for p in logs} == before


def test_a_compared_run_is_never_continued_at_a_value_the_tuning_chose_anew(tuned_sweep, tmp_path):
    """With another grid the tuning chooses 0.003 where the compared runs trained at 0.01: even with
    --continue_changed=True (meant for e.g. a longer max_iters) the sweep refuses to continue them."""
    import shutil
    out, args, _ = tuned_sweep
    copy = tmp_path / 'tuned'
    shutil.copytree(out, copy)
    before = (copy / 'runs' / 'base-seed1' / 'ckpt.pt').read_bytes()
    args = [a for a in args if not a.startswith(('--tune=', '--out_dir='))]
    proc = compare([*args, f'--out_dir={copy}', "--tune={'learning_rate': [1e-06, 0.003]}", '--continue_changed=True'])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("2 compared runs (first: base seed 1) were trained at learning_rate=0.01, and the tuning now chooses "
            "0.003: move their folders out of") in proc.stderr
    assert (copy / 'runs' / 'base-seed1' / 'ckpt.pt').read_bytes() == before


def test_tune_at_tunes_at_one_grid_point_and_compares_every_point_at_its_choice(sweep):
    """Tuned at the grid's first point only; both points' comparison runs train at the rate chosen there,
    and the report says where the tuning ran and that the other point was not tuned. The second point sets
    its own max_iters: its runs train that long, and the report gives each point's."""
    from denoised_gpt.checkpoint import read_checkpoint
    tmp, data, _ = sweep
    out = tmp / 'tuned-at'
    proc = compare(sweep_args(out, data, "--tune={'learning_rate': [1e-06, 0.01]}", '--tune_seeds=5', '--samples=False',
                              f'--grid=--n_embd=16,--n_embd=32 --max_iters={ITERS + 4} --lr_decay_iters={ITERS + 4}',
                              '--tune_at=--n_embd=16', attn_types='base', seeds='1'))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (out / 'tune').iterdir()) == ['base-n_embd16-learning_rate0.01-seed5',
                                                                'base-n_embd16-learning_rate1e-06-seed5']
    longer = f'n_embd32-max_iters{ITERS + 4}-lr_decay_iters{ITERS + 4}'
    for width, point, iters in ((16, 'n_embd16', ITERS), (32, longer, ITERS + 4)):
        config = read_checkpoint(out / 'runs' / f'base-{point}-seed1', metadata_only=True)[1]['config']
        assert config['learning_rate'] == 0.01 and config['n_embd'] == width and config['max_iters'] == iters
    results = json.loads((out / 'report' / 'results.json').read_text())
    assert results['protocol']['tuned_at'] == 'n_embd=16'
    assert [(t['variant'], t['chosen']) for t in results['tuning']] == [('base n_embd=16', 'learning_rate=0.01')]
    label = f'n_embd=32 max_iters={ITERS + 4} lr_decay_iters={ITERS + 4}'
    assert sorted(r['variant'] for r in results['runs']) == ['base n_embd=16', f'base {label}']
    assert [r['final_iter'] for r in sorted(results['runs'], key=lambda r: r['variant'])] == [ITERS, ITERS + 4]
    report = (out / 'report' / 'report.md').read_text()
    assert "was trained at `n_embd=16` only on tuning seed 5" in report
    assert "(the one chosen at `n_embd=16`) at every point of the grid: at the other points it was not tuned" in report
    assert f"max_iters by grid point: `n_embd=16` {ITERS}, `{label}` {ITERS + 4}; seeds 1." in report


def test_an_untuned_report_says_every_variant_used_the_same_settings(sweep):
    tmp, _, _ = sweep
    results = json.loads((tmp / 'out' / 'report' / 'results.json').read_text())
    assert results['protocol']['tuned'] is False and results['tuning'] == []
    assert results['protocol']['settings']['learning_rate'] == 3e-3
    report = (tmp / 'out' / 'report' / 'report.md').read_text()
    line = next(line for line in report.splitlines() if line.startswith('**Protocol'))
    assert line.startswith("**Protocol: the same settings for every variant** (learning_rate=0.003, min_lr=0.0003,")
    assert "none was tuned for any variant" in line


def test_values_tuned_per_variant_and_the_retrieval_probe_reach_the_report(tuned_sweep, tmp_path):
    """The tuned sweep's runs read again (--report_only, nothing trained) as if each variant had tried its own
    rates: the table leaves the others' blank. With retrieval every compared run's eval.py --retrieval result is
    in results.json, paired with base seed by seed, and in the report."""
    import shutil
    out, args, _ = tuned_sweep
    copy = tmp_path / 'probed'
    shutil.copytree(out, copy)
    args = [a for a in args if not a.startswith(('--tune=', '--out_dir='))]
    tune = "{'learning_rate': {'base': [1e-06, 0.01], 'linear': [0.01, 1e+30]}}"
    proc = compare([*args, f'--out_dir={copy}', f'--tune={tune}', '--report_only=True', '--retrieval=True'])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((copy / 'report' / 'results.json').read_text())
    assert [[c['label'] for c in t['candidates']] for t in results['tuning']] == [
        ['learning_rate=1e-06', 'learning_rate=0.01'], ['learning_rate=0.01', 'learning_rate=1e+30']]
    report = (copy / 'report' / 'report.md').read_text()
    assert "| variant | `learning_rate=1e-06` | `learning_rate=0.01` | `learning_rate=1e+30` | chosen |" in report
    base, linear = results['tuning']
    assert "Blank: not one of that variant's candidates" in report
    assert f"| `linear` |  | **{linear['candidates'][0]['val_loss']:.4f}** | diverged |" in report
    assert f"| `base` | {base['candidates'][0]['val_loss']:.4f} | **{base['candidates'][1]['val_loss']:.4f}** |  |" \
        in report  # 1e+30 was not base's to try
    runs = {r['attn_type']: r for r in results['runs']}
    for attn_type, r in runs.items():
        probe = json.loads((copy / 'runs' / f'{attn_type}-seed1' / 'retrieval.json').read_text())
        assert r['copy_accuracy'] == probe['accuracy'] and probe['distances'] == [1, 2, 5, 11]  # block_size 32
        assert r['copy_layer_noise_share@11'] == probe['by_distance']['11']['reading_layer']['noise']
    paired = results['summary']['linear']['copy_accuracy@5_vs_base']
    assert paired['differences'] == [runs['linear']['copy_accuracy@5'] - runs['base']['copy_accuracy@5']]
    assert "## Copying a span from the text (retrieval probe)" in report and "| D=1 | D=2 | D=5 | D=11 |" in report
    assert (copy / 'report' / 'retrieval.png').read_bytes()[:4] == b'\x89PNG'
    width, height = struct.unpack('>II', (copy / 'report' / 'retrieval.png').read_bytes()[16:24])  # its IHDR
    assert width <= 1100 < height  # the three panels one above the other: readable at a page's width


def test_tuning_ranks_candidates_and_warns_at_the_edge_of_the_range():
    from denoised_gpt.tuning import candidate_settings, candidates, choose, edge_warnings, score
    tune = {'learning_rate': [1e-3, 1e-2], 'weight_decay': [0.0, 0.1]}
    assert candidates(tune) == [{'learning_rate': 1e-3, 'weight_decay': 0.0}, {'learning_rate': 1e-3, 'weight_decay': 0.1},
                                {'learning_rate': 1e-2, 'weight_decay': 0.0}, {'learning_rate': 1e-2, 'weight_decay': 0.1}]
    config = {'learning_rate': 2e-3, 'min_lr': 2e-4}
    assert candidate_settings({'learning_rate': 1e-2}, config) == {'learning_rate': 1e-2, 'min_lr': pytest.approx(1e-3)}
    assert candidate_settings({'learning_rate': 1e-2, 'min_lr': 0.0}, config) == {'learning_rate': 1e-2, 'min_lr': 0.0}
    for rate in (1e-4, 3e-4, 1e-3, 3e-3, 0.1, 7e-5):  # a constant rate stays constant, never a rise
        assert candidate_settings({'learning_rate': rate}, {'learning_rate': 1e-2, 'min_lr': 1e-2})['min_lr'] == rate
        assert candidate_settings({'learning_rate': rate}, config)['min_lr'] <= rate
    # accuracy first, val loss between equals; a seed that diverged sinks its candidate; nan is not finite
    def result(val_loss, accuracy):  # a tuning run that trained to max_iters
        return {'final_val_loss': val_loss, 'accuracy': accuracy, 'final_iter': 100, 'reached_target': False}
    runs = [[result(0.5, 0.9), result(0.7, 1.0)],  # mean 0.95, 0.6
            [result(0.2, 1.0), result(0.2, 0.9)],  # mean 0.95, 0.2
            [result(0.1, 1.0), None],
            [result(float('nan'), 1.0), result(0.1, 1.0)]]
    scores = [score(r, 'accuracy') for r in runs]
    assert [s['diverged'] for s in scores] == [False, False, True, True]
    assert scores[0] == {'diverged': False, 'val_loss': pytest.approx(0.6), 'accuracy': pytest.approx(0.95),
                         'iters': 100, 'reached': False}
    assert choose(scores, 'accuracy') == 1 and choose(scores, 'val_loss') == 1
    assert choose([score([r[0]], 'accuracy') for r in runs[:2]], 'accuracy') == 1  # 1.0 beats 0.9
    assert choose(scores[2:], 'val_loss') is None
    assert edge_warnings(tune, {'learning_rate': 1e-2, 'weight_decay': 0.0}) == [
        "learning_rate=0.01 is the largest value tried: the best may lie above it; extend the range up",
        "weight_decay=0 is the smallest value tried: the best may lie below it; extend the range down"]
    assert edge_warnings({'learning_rate': [1e-3, 3e-3, 1e-2], 'compile': [True, False]},
                         {'learning_rate': 3e-3, 'compile': True}) == []


def test_chosen_settings_train_each_variant_at_its_own_and_the_report_says_where_they_come_from(sweep):
    """chosen: no tuning; each variant's runs train at its own rate (min_lr at the config's ratio, as a tuned
    choice would), and the report's protocol names every variant's settings and where they were chosen."""
    from denoised_gpt.checkpoint import read_checkpoint
    tmp, data, _ = sweep
    out = tmp / 'chosen'
    proc = compare(sweep_args(out, data, "--chosen={'base': {'learning_rate': 0.01}, 'linear': {'learning_rate': 0.001}}",
                              '--chosen_by=an earlier report', '--samples=False', attn_types='base,linear', seeds='1'))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (out / 'tune').exists()
    for attn_type, rate in (('base', 0.01), ('linear', 0.001)):
        config = read_checkpoint(out / 'runs' / f'{attn_type}-seed1', metadata_only=True)[1]['config']
        assert config['learning_rate'] == rate and config['min_lr'] == pytest.approx(rate / 10)
    results = json.loads((out / 'report' / 'results.json').read_text())
    assert results['protocol']['chosen'] == {'base': {'learning_rate': 0.01}, 'linear': {'learning_rate': 0.001}}
    line = next(line for line in (out / 'report' / 'report.md').read_text().splitlines() if line.startswith('**Protocol'))
    assert line.startswith("**Protocol: each variant at the settings an earlier tuning chose for it** (an earlier "
                           "report): `base` learning_rate=0.01; `linear` learning_rate=0.001 (min_lr at the config's "
                           "ratio to each rate); not tuned again here.")
    assert "learning_rate=0.003" not in line and "min_lr" not in line.split("not tuned")[1] and "weight_decay=0.1" in line
