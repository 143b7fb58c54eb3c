"""train.py's stop_at_val_loss (training ends at the first evaluation at or below it) and what compare.py
makes of it: a stopped run counts as finished, and in tuning reaching it sooner beats reaching it later,
which beats not reaching it."""
import json
import math

import pytest
import torch

from helpers import SCRIPT_VARIABLES, TINY, VOCAB, make_dataset, run_script_in_process, run_train_in_process

pytestmark = pytest.mark.slow  # training runs and sweeps (conftest.py: slow)

ITERS = 40
SCHEDULE = (f'--max_iters={ITERS}', f'--lr_decay_iters={ITERS}', '--eval_interval=5')


def evaluations(out_dir):
    rows = [json.loads(line) for line in (out_dir / 'metrics.jsonl').read_text().splitlines()]
    return [r for r in rows if 'val_loss' in r]


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp('stop'))


def test_training_ends_at_the_first_evaluation_at_or_below_the_target_and_resume_trains_nothing(data, tmp_path):
    run_train_in_process(tmp_path / 'full', data, *SCHEDULE)
    full = evaluations(tmp_path / 'full')
    target = full[3]['val_loss']  # iter 15's: the run reaches it there, or earlier if it was lower before
    stop = next(r['iter'] for r in full if r['iter'] > 0 and r['val_loss'] <= target)
    assert stop < ITERS
    proc = run_train_in_process(tmp_path / 'stop', data, *SCHEDULE, f'--stop_at_val_loss={target!r}')
    stopped = evaluations(tmp_path / 'stop')
    assert stopped == [r | {'time': s['time'], 'peak_memory_mib': s['peak_memory_mib']}
                       for r, s in zip(full, stopped)]  # the same run up to the stop (timings aside)
    assert stopped[-1]['iter'] == stop
    assert f"training ends at iter {stop} of max_iters={ITERS}" in proc.stdout
    ckpt = torch.load(tmp_path / 'stop' / 'ckpt.pt', map_location='cpu', weights_only=True)
    assert ckpt['iter_num'] == stop and ckpt['val_loss'] == stopped[-1]['val_loss']

    # resumed, the run has reached its target: nothing more is trained, evaluated or saved
    before = (tmp_path / 'stop' / 'ckpt.pt').stat().st_mtime_ns
    proc = run_train_in_process(tmp_path / 'stop', data, '--init_from=resume')
    assert "\niter " not in proc.stdout and evaluations(tmp_path / 'stop') == stopped
    assert (tmp_path / 'stop' / 'ckpt.pt').stat().st_mtime_ns == before


@pytest.mark.parametrize('value', ['-0.1', 'nan'])
def test_a_negative_or_nan_target_is_refused_in_one_line(data, tmp_path, value):
    proc = run_script_in_process('train.py', [str(TINY), f'--dataset={data}', f'--out_dir={tmp_path}',
                                              f'--stop_at_val_loss={value}'])
    assert proc.returncode == 2 and 'stop_at_val_loss' in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and 'Traceback' not in proc.stderr


def test_tuning_ranks_reaching_the_target_sooner_above_later_above_never():
    from denoised_gpt.tuning import choose, score

    def result(iters, reached, val_loss=0.5, accuracy=0.5):
        return {'final_val_loss': val_loss, 'final_iter': iters, 'reached_target': reached, 'accuracy': accuracy}
    never = [result(100, False, val_loss=0.01, accuracy=1.0)] * 2  # best metric, but never stopped
    late = [result(80, True), result(60, True)]  # mean 70
    soon = [result(40, True), result(60, True)]  # mean 50
    half = [result(10, True), result(100, False)]  # one seed only: not reached
    for metric in ('accuracy', 'val_loss'):
        scores = [score(runs, metric) for runs in (never, late, soon, half)]
        assert [s['reached'] for s in scores] == [False, True, True, False]
        assert [s['iters'] for s in scores] == [100, 70, 50, 55]
        assert choose(scores, metric) == 2
        assert choose([scores[0], scores[1]], metric) == 1
        assert choose([scores[0], scores[3]], metric) == 0  # neither reached: the metric decides


TARGET = math.log(VOCAB) - 0.5  # half a nat below the initial val loss: 1e-2 gets there in ITERS, 1e-6 does not


def tuning_sweep(data, out, learning_rates):
    """compare.py's arguments: base tuned over learning_rates on seed 5 to reach TARGET, then seed 1."""
    overrides = (f"--dataset={data} --max_iters={ITERS} --lr_decay_iters={ITERS} --eval_interval=5 --eval_iters=2 "
                 f"--stop_at_val_loss={TARGET!r} --log_interval=10")
    return [f'--base_config={TINY}', f'--overrides={overrides}', '--attn_types=base', '--seeds=1', f'--out_dir={out}',
            '--samples=False', f"--tune={{'learning_rate': {learning_rates!r}}}", '--tune_seeds=5']


def test_compare_counts_a_stopped_run_as_finished_and_tunes_by_how_soon_the_target_is_reached(data, tmp_path):
    """lr 1e-6 cannot move the loss in 40 iterations, 1e-2 can: with the target half a nat below the
    initial val loss (about log(VOCAB): the initial weights predict nearly uniformly), only 1e-2 reaches
    it, stops there, is chosen, and a second sweep trains nothing."""
    target, out = TARGET, tmp_path / 'sweep'
    args = tuning_sweep(data, out, [1e-06, 0.01])
    proc = run_script_in_process('compare.py', args, env=SCRIPT_VARIABLES)  # its train.py runs are processes
    assert proc.returncode == 0, proc.stdout + proc.stderr
    small, good = (evaluations(out / 'tune' / f'base-learning_rate{lr}-seed5') for lr in ('1e-06', '0.01'))
    assert small[-1]['iter'] == ITERS and small[0]['val_loss'] > target and small[-1]['val_loss'] > target
    assert good[-1]['iter'] < ITERS and good[-1]['val_loss'] <= target
    assert all(r['val_loss'] > target for r in good[1:-1])  # it stopped at the first evaluation below
    results = json.loads((out / 'report' / 'results.json').read_text())
    assert results['protocol']['stop_at_val_loss'] == target
    tuning, = results['tuning']
    assert [(c['reached'], c['iters']) for c in tuning['candidates']] == [(False, ITERS), (True, good[-1]['iter'])]
    assert tuning['chosen'] == 'learning_rate=0.01'
    run, = results['runs']
    compared = evaluations(out / 'runs' / 'base-seed1')
    assert run['reached_target'] == (compared[-1]['val_loss'] <= target) and run['final_iter'] == compared[-1]['iter']
    report = (out / 'report' / 'report.md').read_text()
    assert f"the candidate with the fewest iterations to val loss <= {target:g} (where its runs stopped)" in report
    assert f"| `base` | {small[-1]['val_loss']:.4f} | **at iter {good[-1]['iter']}: {good[-1]['val_loss']:.4f}** |" in report
    per_seed = str(run['final_iter']) if run['reached_target'] else f"not by {run['final_iter']}"
    assert f"| `base` | {int(run['reached_target'])} of 1 | {per_seed} |" in report

    logs = {p: p.read_text() for p in out.glob('*/*/train.log')}
    again = run_script_in_process('compare.py', args, env=SCRIPT_VARIABLES)
    assert again.returncode == 0, again.stdout + again.stderr
    assert {p: p.read_text() for p in out.glob('*/*/train.log')} == logs  # no train.py started again


def test_a_candidate_is_outranked_once_its_iterations_so_far_average_the_best_reached():
    from denoised_gpt.tuning import outranked
    reached_at_50 = [(40, True), (60, True)]
    assert outranked([reached_at_50, [(50, False), (40, False)]]) == ([], 50)  # mean 45: may still reach it sooner
    assert outranked([reached_at_50, [(50, False), (50, False)]]) == ([1], 50)  # can only reach it after 50
    assert outranked([reached_at_50, [(90, True), (10, False)]]) == ([1], 50)
    assert outranked([reached_at_50, [(80, True), (70, True)]]) == ([], 50)  # finished: ranked, not stopped
    assert outranked([reached_at_50, [(100, False), (None, False)]]) == ([], 50)  # a seed not started yet
    assert outranked([reached_at_50, [(100, False), None]]) == ([], 50)  # diverged: ranks last anyway
    assert outranked([[(100, False)], [(200, False)]]) == ([], None)  # nothing reached: nothing is out-ranked
    assert outranked([[(30, True)], [(20, True)], [(25, False)]]) == ([2], 20)


def test_tuning_stops_a_candidate_once_another_has_reached_the_target_sooner(data, tmp_path):
    """1e-2 reaches the target first; 1e-6, trained after it, stops at its first evaluation at or past that
    iteration, is out-ranked, shown so in the table, and is not trained again by a second sweep."""
    target, out = TARGET, tmp_path / 'sweep'
    args = tuning_sweep(data, out, [0.01, 1e-06])
    proc = run_script_in_process('compare.py', args, env=SCRIPT_VARIABLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    good, small = (out / 'tune' / f'base-learning_rate{lr}-seed5' for lr in ('0.01', '1e-06'))
    reached_at = evaluations(good)[-1]['iter']
    assert evaluations(good)[-1]['val_loss'] <= target and reached_at < ITERS
    stopped_at = evaluations(small)[-1]['iter']
    assert reached_at <= stopped_at < ITERS and (small / 'ckpt.pt').exists()  # stopped, checkpointed
    tuning, = json.loads((out / 'report' / 'results.json').read_text())['tuning']
    assert [(c['reached'], c['outranked'], c['iters']) for c in tuning['candidates']] == [
        (True, False, reached_at), (False, True, stopped_at)]
    assert tuning['chosen'] == 'learning_rate=0.01'
    report = (out / 'report' / 'report.md').read_text()
    assert f"| out-ranked at iter {stopped_at}: {evaluations(small)[-1]['val_loss']:.4f} |" in report

    logs = {p: p.read_text() for p in out.glob('*/*/train.log')}
    again = run_script_in_process('compare.py', args, env=SCRIPT_VARIABLES)
    assert again.returncode == 0, again.stdout + again.stderr
    assert {p: p.read_text() for p in out.glob('*/*/train.log')} == logs


def test_the_report_says_when_base_did_not_reach_the_target_on_every_seed():
    from denoised_gpt.compare_report import stop_lines

    def run(variant, reached, iters):
        return {'variant': variant, 'base': 'base', 'reached_target': reached, 'final_iter': iters}
    solved = [run('base', True, 30), run('base', True, 35), run('diff', False, 40), run('diff', True, 20)]
    text = '\n'.join(stop_lines(solved, 0.01, {'': 40}))
    assert "or at the end of its budget (40 iterations) without reaching it" in text
    assert "| `base` | 2 of 2 | 30, 35 |" in text and "| `diff` | 1 of 2 | not by 40, 20 |" in text
    assert "did not reach it on every seed" not in text
    unsolved = [run('base', True, 30), run('base', False, 40), run('diff', True, 20), run('diff', True, 25)]
    text = '\n'.join(stop_lines(unsolved, 0.01, {'n_embd=16': 40, 'n_embd=32': 50}))
    assert "(max_iters by grid point: `n_embd=16` 40, `n_embd=32` 50)" in text
    assert "**`base` did not reach it on every seed (1 of 2)**: at this setting and budget" in text


def test_the_val_loss_plot_shows_a_seed_that_trained_on_after_the_others_stopped():
    """The mean curve covers the iterations every seed reached; a seed still on the plateau when the others
    reached the target (the recall study's base seed 1339) is drawn on to its own end, not cut off."""
    from denoised_gpt.compare_report import seed_band, seed_tails

    def run(last, loss):
        return {'curve': [{'iter': it, 'val_loss': loss(it), 'time': it / 10} for it in range(0, last + 1, 10)]}
    solved, stuck, later = run(20, lambda it: 1 / (it + 1)), run(60, lambda it: 1.6), run(40, lambda it: 1.0)
    iters, *_ = seed_band([solved, stuck, later], 'val_loss')
    assert iters == [0, 10, 20]
    tails = seed_tails([solved, stuck, later], iters)
    assert tails == [([20, 30, 40, 50, 60], [1.6] * 5, [2.0, 3.0, 4.0, 5.0, 6.0]),
                     ([20, 30, 40], [1.0] * 3, [2.0, 3.0, 4.0])]
    assert seed_tails([solved, run(20, lambda it: 0.5)], iters) == []  # all stopped together: the mean says it all
