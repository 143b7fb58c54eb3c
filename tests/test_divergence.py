"""A run that diverges never saves its non-finite state (weights or optimizer moments): ckpt.pt and
ckpt.prev.pt always hold the last finite ones, the advice it stops with names one of them (or says none
was written), following that advice trains on, and a non-finite checkpoint made elsewhere is refused in
one line by every tool that reads one. (The non-finite steps themselves, stop and skip: test_train.py.)"""
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from denoised_gpt.checkpoint import read_checkpoint
from denoised_gpt.run_dir import LOCK_NAME
from denoised_gpt.training import divergence_cause
from denoised_gpt.weights import all_finite, nonfinite_optimizer_state, nonfinite_weights
from helpers import (NO_AUTOCAST, ROOT, TINY, eval_losses, iter_losses, make_dataset, run_script_in_process,
                     save_model_checkpoint, subprocess_env, tiny_checkpoint, tiny_gpt)
from model import GPT, GPTConfig


BLOW_UP = ['--learning_rate=1e30', '--decay_lr=False']  # one step takes every weight to ~1e30, the next is NaN


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp('data'))


def train(data, out, *args, expect_rc=0):
    proc = run_script_in_process('train.py', [TINY, f'--dataset={data}', f'--out_dir={out}', *args])
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def state_is_finite(ckpt, data):
    """Whether a checkpoint's weights are finite and give a finite loss on a batch of the val data (weights
    of ~1e30 are finite, but nothing can be trained from them)."""
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    rows = torch.from_numpy(np.fromfile(data / 'val.bin', dtype=np.uint16)[:4 * 33].astype(np.int64)).view(4, 33)
    x, y = rows[:, :-1], rows[:, 1:]
    with torch.no_grad(), NO_AUTOCAST:
        _, loss = model(x, y)
    return all_finite(model.parameters()) and math.isfinite(loss.item())


def test_all_finite_is_one_check_that_finds_nan_and_inf_but_not_large_weights():
    ones = torch.ones(3, 4)
    assert all_finite([ones, torch.tensor([3e38, -3e38])])  # a sum or a 2-norm of these would overflow
    assert all_finite([])
    for bad in (float('nan'), float('inf'), float('-inf')):
        assert not all_finite([ones, torch.tensor([1.0, bad]), ones])
        assert not all_finite([torch.tensor([bad]).bfloat16(), ones])
    assert all_finite([torch.arange(5), ones])  # integer tensors (always finite) are not in the way


# two ranks, each with a shard of one tensor: a NaN in rank 1's shard only
SHARDED_CHECK = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
sys.path.insert(0, {root!r})
from denoised_gpt.weights import all_finite, nonfinite_optimizer_state, nonfinite_weights

dist.init_process_group('gloo', init_method={store!r}, rank=int(sys.argv[1]), world_size=2)
w = distribute_tensor(torch.ones(4, 3), init_device_mesh('cpu', (2,)), [Shard(0)])
answers = [all_finite([w, torch.ones(2)])]
if dist.get_rank() == 1:
    w.to_local()[0, 0] = float('nan')
answers.append(all_finite([w, torch.ones(2)]))
print(f"rank {{dist.get_rank()}}: {{answers}}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_all_finite_agrees_across_the_ranks_of_sharded_weights(tmp_path):
    """What an fsdp run's save checks: a NaN in one rank's shard makes every rank refuse the save (they must
    agree, or some would write their shards and wait for the others for ever)."""
    (tmp_path / 'check.py').write_text(SHARDED_CHECK.format(root=str(ROOT), store=f"file://{tmp_path / 'store'}"))
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / 'check.py'), str(rank)], cwd=ROOT, env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], results
    assert [out.strip() for out, _ in results] == ['rank 0: [True, False]', 'rank 1: [True, False]']


def test_a_run_diverging_at_iter_1_writes_no_checkpoint_and_says_to_start_again(tmp_path, data):
    out = tmp_path / 'out'
    proc = train(data, out, *BLOW_UP, '--eval_interval=1', '--always_save_checkpoint=True', expect_rc=3)
    val = eval_losses(proc.stdout)
    assert math.isfinite(val[0]) and math.isnan(val[1])  # the run this is about: its iter-1 state is NaN
    assert "not saving iter 1 (val loss nan): its evaluation is not finite" in proc.stderr
    assert "No checkpoint was written yet: start the run again with a lower learning_rate" in proc.stderr
    assert "Resume from" not in proc.stderr
    assert not [p.name for p in out.iterdir() if p.name.startswith('ckpt')]


def test_the_advice_after_a_divergence_names_a_finite_checkpoint_that_resumes(tmp_path, data):
    out = tmp_path / 'out'
    train(data, out, '--max_iters=4', '--eval_interval=2')  # finite checkpoints at iters 2 and 4
    proc = train(data, out, '--init_from=resume', *BLOW_UP, '--eval_interval=1', '--max_iters=20', expect_rc=3)
    assert math.isnan(eval_losses(proc.stdout)[5])
    ckpt = read_checkpoint(out)[1]
    assert f"Resume from the last checkpoint ({out / 'ckpt.pt'}, iter {ckpt['iter_num']}) with a lower " \
           f"learning_rate" in proc.stderr
    assert ckpt['iter_num'] == 4 and state_is_finite(ckpt, data)
    assert state_is_finite(read_checkpoint(out / 'ckpt.prev.pt')[1], data)
    # following the advice trains on (it used to resume the NaN state and stop again with the same advice)
    proc = train(data, out, '--init_from=resume', '--learning_rate=1e-3', '--max_iters=8')
    assert sorted(iter_losses(proc.stdout)) == [4, 5, 6, 7]
    assert read_checkpoint(out)[1]['iter_num'] == 8


def test_nonfinite_skip_never_leaves_both_checkpoints_nonfinite(tmp_path, data):
    out = tmp_path / 'out'
    train(data, out, '--max_iters=4', '--eval_interval=2')
    proc = train(data, out, '--init_from=resume', *BLOW_UP, '--nonfinite=skip', '--max_skipped_steps=3',
                 '--eval_interval=1', '--max_iters=20', expect_rc=3)
    assert [it for it in range(4, 8) if f"iter {it}: skipping the update" in proc.stdout] == [5, 6]
    assert "3 steps in a row had a non-finite loss or gradient (max_skipped_steps=3)" in proc.stderr
    assert "not saving iter 6 (val loss nan)" in proc.stderr and "not saving iter 7 (val loss nan)" in proc.stderr
    current, previous = read_checkpoint(out)[1], read_checkpoint(out / 'ckpt.prev.pt')[1]
    assert (current['iter_num'], previous['iter_num']) == (4, 2)
    assert state_is_finite(current, data) and state_is_finite(previous, data)
    assert f"Resume from the last checkpoint ({out / 'ckpt.pt'}, iter 4)" in proc.stderr


def test_the_state_a_skipping_run_ends_with_is_not_saved(tmp_path, data):
    """nonfinite='skip' to the end: the last save refuses the NaN state too, and the run says so (exit 3)."""
    out = tmp_path / 'out'
    proc = train(data, out, *BLOW_UP, '--nonfinite=skip', '--eval_interval=1000', '--max_iters=3', expect_rc=3)
    assert "iter 2: skipping the update" in proc.stdout
    assert "not saving iter 3 (val loss nan): its evaluation is not finite" in proc.stderr
    assert "stopping at iter 3 without a checkpoint" in proc.stderr and "start the run again" in proc.stderr
    assert not (out / 'ckpt.pt').exists() and "sample from it" not in proc.stdout


def test_resuming_a_nonfinite_checkpoint_is_refused_in_one_line(tmp_path, data):
    out = tmp_path / 'out'
    model = tiny_gpt()  # as a run that diverged elsewhere saved it, with its optimizer state
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float('nan')
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), 'cpu')
    save_model_checkpoint(out, model, optimizer=optimizer.state_dict(), iter_num=3, config={'dataset': str(data)})
    before = files(out)
    for skip in ('stop', 'skip'):  # it used to train on, skipping or stopping at every step
        proc = train(data, out, '--init_from=resume', '--max_iters=6', f'--nonfinite={skip}', expect_rc=2)
        assert proc.stderr.startswith(f"train.py: error: {out / 'ckpt.pt'} holds non-finite weights (NaN or inf)")
        assert len(proc.stderr.strip().splitlines()) == 1
        assert files(out) == before  # refused before out_dir is touched


def nan_weight(model):
    model.transformer.h[0].mlp.c_fc.weight[0, 0] = float('nan')


def files(folder):
    """What a folder holds, name -> bytes, out_dir's lock aside (it names its last holder)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != LOCK_NAME}


@pytest.mark.parametrize('script,args', [
    ('grow.py', ['--out={tmp}/grown', '--grow_to=24']),
    ('export_hf.py', ['--hf_dir={tmp}/hf']),
    ('convert_checkpoint.py', ['--to=sharded']),
], ids=['grow', 'export', 'convert'])
def test_no_tool_writes_a_new_state_from_a_nonfinite_checkpoint(tmp_path, data, script, args):
    """grow.py, export_hf.py and convert_checkpoint.py read a checkpoint and write another: from NaN weights
    they would write NaN weights again (and grow.py advise resuming them)."""
    out = tmp_path / 'out'
    tiny_checkpoint(out, 'base', data, tweak=nan_weight)
    before = files(out)
    proc = run_script_in_process(script, [f'--out_dir={out}', *(a.format(tmp=tmp_path) for a in args)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"{script}: error: {nonfinite_weights(out / 'ckpt.pt')}\n"
    assert [p.name for p in tmp_path.iterdir()] == ['out']  # nothing written beside it
    assert files(out) == before


def test_a_new_run_from_nonfinite_weights_names_the_weights_not_the_learning_rate(tmp_path, data):
    start = tmp_path / 'start'
    tiny_checkpoint(start, 'base', data, tweak=nan_weight)
    proc = train(data, tmp_path / 'out', f'--init_from={start}', '--max_iters=4', expect_rc=2)
    assert proc.stderr == f"train.py: error: {nonfinite_weights(start)}\n"
    assert not (tmp_path / 'out').exists()


def test_a_nonfinite_optimizer_moment_is_neither_resumed_nor_converted(tmp_path, data):
    """An inf second moment freezes its parameter for good (its update is m / inf = 0): a state holding
    one is refused like NaN weights, by resuming and by convert_checkpoint.py."""
    out = tmp_path / 'out'
    train(data, out, '--max_iters=3')
    state = torch.load(out / 'ckpt.pt', weights_only=True)
    state['optimizer']['state'][0]['exp_avg_sq'][0] = float('inf')
    torch.save(state, out / 'ckpt.pt')
    before = files(out)
    proc = train(data, out, '--init_from=resume', '--max_iters=6', expect_rc=2)
    assert proc.stderr == f"train.py: error: {nonfinite_optimizer_state(out / 'ckpt.pt')}\n"
    proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={out}', '--to=sharded'])
    assert proc.returncode == 2 and proc.stderr == (
        f"convert_checkpoint.py: error: {nonfinite_optimizer_state(out / 'ckpt.pt')}\n")
    assert files(out) == before
    # its weights are finite: the advice, a new run from them, trains
    train(data, tmp_path / 'new', f'--init_from={out}', '--max_iters=2')


# at float32's limit (past it: refused at start-up) / its gradient overflows
@pytest.mark.parametrize('kl_weight', ['3e38', '1e30'])
def test_a_kl_term_that_swamps_the_loss_is_named_as_the_cause_not_the_learning_rate(tmp_path, data, kl_weight):
    proc = train(data, tmp_path / 'out', '--attn_type=noiseformer_v2', f'--kl_weight={kl_weight}', '--max_iters=4',
                 expect_rc=3)
    last = proc.stderr.strip().splitlines()[-1]
    assert "(the KL term, kl_weight x kl = " in last and "swamps the cross-entropy" in last
    assert "start the run again with a lower kl_weight" in last and "learning_rate" not in last


def test_a_first_forward_that_is_not_finite_is_not_blamed_on_the_learning_rate(tmp_path, data):
    """Noise a trillion trillion times the scores' size makes the very first loss NaN: no update was made, so the
    advice names the model's settings and the data, not the step size."""
    proc = train(data, tmp_path / 'out', '--attn_type=noiseformer_v2', '--noise_init_std=1e300', '--max_iters=4',
                 expect_rc=3)
    last = proc.stderr.strip().splitlines()[-1]
    assert "stopping at iter 0: non-finite loss or gradient in the first forward, before any update, so not from " \
           "the learning rate" in last
    assert "noise_init_std" in last and "lower learning_rate" not in last


@pytest.mark.parametrize('setting, says', [
    ('--kl_weight=1e308', "kl_weight=1e+308 is past float32's range (3.4e+38), in which the loss is computed: "
                          "kl_weight x kl would be inf (or NaN where kl is 0); use a smaller kl_weight"),
])
def test_settings_that_make_every_step_non_finite_are_refused_before_the_run(tmp_path, data, setting, says):
    """kl_weight=1e308 is inf in the float32 loss (and inf x 0 = NaN on base, which has no KL term): NaN at
    iteration 0, blamed on the learning rate. Refused at start-up in one line, nothing trained."""
    proc = train(data, tmp_path / 'out', setting, '--learning_rate=1e-3', '--max_iters=2', expect_rc=2)
    assert proc.stderr.strip().splitlines() == [f"train.py: error: {says}"], proc.stderr
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()


@pytest.mark.parametrize('settings, cause, advice', [
    ({'noise_init_std': 1e300, 'lowrank_score_divisor': 81.0, 'qk_head_size': None},
     " in the first forward, before any update, so not from the learning rate: noise_init_std=1e+300 (default "
     "0.01) makes it", "Start again with noise_init_std nearer the default"),
    ({'noise_init_std': 0.01, 'lowrank_score_divisor': 1e-300, 'qk_head_size': 24},
     " in the first forward, before any update, so not from the learning rate: lowrank_score_divisor=1e-300 (default "
     "81.0), qk_head_size=24 (default None) make it",
     "Start again with lowrank_score_divisor and qk_head_size nearer the default"),
    ({'learning_rate': 3e-3, 'weight_decay': 1e308},
     " (learning_rate x weight_decay = 3e+305: AdamW multiplies each decayed weight by 1 - 3e+305 = -3e+305 every "
     "step, where it needs a factor between 0 and 1)",
     "No checkpoint was written yet: start the run again with a lower weight_decay"),
])
def test_the_setting_that_made_the_first_nan_is_named(settings, cause, advice):
    """divergence_cause given the run's settings (train.py's, its model's among them) names the one that made the
    loss or gradient non-finite: a model setting off its default in the first forward, or a weight decay whose
    step flips and grows the weights (learning_rate x weight_decay = 3e305: NaN at iteration 1). Without
    settings it could name none."""
    first_step = 'weight_decay' not in settings
    ce = float('nan') if first_step else 3.9
    assert divergence_cause(ce, 0.0, 5e-6, first_step, 'out', None, settings=settings) == (cause, advice)
    # at their defaults, a first forward that is not finite is the model's or the data's, no setting named
    general = divergence_cause(float('nan'), 0.0, 5e-6, True, 'out', None,
                               settings={'noise_init_std': 0.01, 'lowrank_score_divisor': 81.0, 'learning_rate': 1e-3,
                                         'weight_decay': 0.1})
    assert general[0].endswith("a setting that shapes the model (e.g. noise_init_std, lowrank_score_divisor, "
                               "qk_head_size) or batches without a target make it")
