"""train.py end to end on CPU (tiny model, OMP_NUM_THREADS=1 subprocesses, torch.compile off):
exact resume after SIGKILL and SIGTERM, DDP's refusal of an accumulation it cannot split (DDP equal to one
process: test_fsdp.py, on the runs its FSDP test trains anyway), non-finite handling,
every attention variant learning. (The LR schedule itself: test_lr_schedule.py.)"""
import dataclasses
import fcntl
import json
import os
import pty
import re
import runpy
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch

from denoised_gpt.checkpoint import read_checkpoint
from denoised_gpt.lr_schedule import get_lr
from denoised_gpt.parallel import kl_layers
from helpers import (ITER_LINE, ROOT, TINY, TINY_MODEL, VOCAB, eval_losses, iter_losses, make_dataset,
                     run_script_in_process, run_train, run_train_in_process, subprocess_env, tiny_gpt,
                     train_command)
from model import ATTENTION_TYPES, GPT, GPTConfig


def test_tiny_model_is_config_tiny_model():
    """helpers.TINY_MODEL, which the tiny checkpoints here and in other files are built with, is the
    model train.py builds from tests/config_tiny.py on make_dataset's data."""
    settings = runpy.run_path(str(TINY))
    fields = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    from_config = {k: settings.get(k, default) for k, default in fields.items() if k != 'vocab_size'}
    assert GPTConfig(**TINY_MODEL) == GPTConfig(**from_config, vocab_size=VOCAB)


# -----------------------------------------------------------------------------
# exact resume: SIGKILL after a checkpoint, then SIGTERM, then to the end == one uninterrupted run

def run_until_signal(out_dir, data, sig, after_iter, *args):
    """Start train.py, send `sig` once it has printed iteration `after_iter`; return (rc, stdout, stderr)."""
    proc = subprocess.Popen(train_command(out_dir, data, *args), cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = ITER_LINE.match(line)
        if m and int(m[1]) >= after_iter:
            proc.send_signal(sig)
            break
    rest, err = proc.communicate(timeout=60)
    return proc.returncode, ''.join(lines) + rest, err


@pytest.mark.slow
def test_resume_after_sigkill_and_sigterm_reproduces_the_uninterrupted_run(tmp_path):
    data = make_dataset(tmp_path)
    n = 60
    # noiseformer_v2: noise drawn at every forward must replay too; the LR schedule spans the run
    common = ['--attn_type=noiseformer_v2', '--eval_interval=10', f'--lr_decay_iters={n}']
    # wandb with no login (no WANDB_MODE, no key, an empty home): offline, said in one line, no crash
    no_login = {k: v for k, v in subprocess_env(HOME=str(tmp_path)).items() if k not in ('WANDB_MODE', 'WANDB_API_KEY')}
    full = run_train(tmp_path / 'full', data, *common, f'--max_iters={n}', '--wandb_log=True', env=no_login)
    reference = iter_losses(full.stdout)
    assert sorted(reference) == list(range(n)) and len(set(reference.values())) > n // 2
    assert list((tmp_path / 'full' / 'wandb').glob('offline-run-*')), "wandb offline run not written"
    assert "wandb: not logged in; logging offline to" in full.stdout and "wandb sync" in full.stdout

    out = tmp_path / 'interrupted'
    # 1) SIGKILL a few iterations after the checkpoint at iter 10 (the run would go on for ever)
    rc, stdout1, _ = run_until_signal(out, data, signal.SIGKILL, 12, *common, '--max_iters=1000000')
    assert rc == -signal.SIGKILL
    k1 = read_checkpoint(out)[1]['iter_num']
    assert 10 <= k1 < n
    # 2) resume; SIGTERM: the last finished step is saved (the step in progress is dropped, or done if the signal
    # came in its last micro-batch), exit 0
    rc, stdout2, err = run_until_signal(out, data, signal.SIGTERM, k1 + 3, *common, '--init_from=resume',
                                        '--max_iters=1000000')
    assert rc == 0, err
    k2 = read_checkpoint(out)[1]['iter_num']
    assert k1 + 3 < k2 < n and max(iter_losses(stdout2)) == k2 - 1
    assert stopped_at(stdout2) == k2
    # its last line: the state saved on SIGTERM was not evaluated, so no val loss is given for it
    evals = {**eval_losses(stdout1), **eval_losses(stdout2)}
    best = min(evals, key=evals.get)
    assert f"checkpoint: {out / 'ckpt.pt'} holds the last state (iter {k2}); the best val loss seen, " \
           f"{evals[best]:.4f}, was at iter {best}\n" in stdout2
    # 3) resume to the end (in this process: nothing signals it)
    stdout3 = train_in_process(*tiny_args(tmp_path, data, 'interrupted'), *common, '--init_from=resume',
                               f'--max_iters={n}').stdout
    assert f"python3 sample.py --out_dir={out}" in stdout3

    for part in (stdout1, stdout2, stdout3):
        for it, loss in iter_losses(part).items():
            assert loss == reference[it], f"iter {it}: {loss} after resuming, {reference[it]} uninterrupted"
    assert set(iter_losses(stdout1)) | set(iter_losses(stdout2)) | set(iter_losses(stdout3)) == set(range(n))
    # out_dir/metrics.jsonl: a killed and resumed run has exactly one row per iteration and per
    # evaluation, with the uninterrupted run's values
    rows = {name: [json.loads(line) for line in (tmp_path / name / 'metrics.jsonl').read_text().splitlines()]
            for name in ('full', 'interrupted')}
    for name, table in rows.items():
        steps = [r['iter'] for r in table if 'loss' in r]
        evals = [r['iter'] for r in table if 'val_loss' in r]
        assert steps == list(range(n)) and evals == list(range(0, n + 1, 10)), name
    full_rows = {(r['iter'], 'val_loss' in r): r for r in rows['full']}
    for r in rows['interrupted']:
        ref = full_rows[(r['iter'], 'val_loss' in r)]
        for key in ('loss', 'ce', 'kl', 'lr', 'train_loss', 'val_loss'):
            assert r.get(key) == ref.get(key), (r['iter'], key)
    assert eval_losses(stdout3)[n] == eval_losses(full.stdout)[n]
    a, b = read_checkpoint(tmp_path / 'full')[1], read_checkpoint(out)[1]
    assert a['iter_num'] == b['iter_num'] == n
    assert a['model'].keys() == b['model'].keys()
    for name in a['model']:
        assert torch.equal(a['model'][name], b['model'][name]), name
    for pa, pb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert torch.equal(pa['exp_avg_sq'], pb['exp_avg_sq'])


def test_resume_refuses_a_changed_architecture_and_fills_in_what_is_not_given(tmp_path):
    data = make_dataset(tmp_path)
    train_in_process(*tiny_args(tmp_path, data), '--max_iters=0')  # writes a checkpoint at iter 0
    proc = train_in_process(*tiny_args(tmp_path, data), '--init_from=resume', '--n_layer=3', '--attn_type=symmetric',
                            '--dropout=0.1', expect_rc=2)
    assert "the checkpoint in" in proc.stderr and "has a different model" in proc.stderr
    assert "n_layer: checkpoint 2, this run 3" in proc.stderr
    assert "attn_type: checkpoint 'base', this run 'symmetric'" in proc.stderr
    assert "dropout" not in proc.stderr  # a runtime setting may change on resume
    # without the config file (nanoGPT's way), the architecture and block_size come from the checkpoint
    train_in_process('--init_from=resume', f'--dataset={data}', f'--out_dir={tmp_path / "out"}', '--device=cpu',
                     '--max_iters=1', '--eval_iters=2', '--gradient_accumulation_steps=1', '--batch_size=2')
    ckpt = read_checkpoint(tmp_path / 'out')[1]
    assert ckpt['iter_num'] == 1
    assert (ckpt['model_args']['n_layer'], ckpt['model_args']['block_size']) == (2, 32)


def test_init_from_a_local_gpt2_checkpoint_into_a_variant(tmp_path):
    """init_from takes GPT-2 weights (a name, or a transformers directory: offline here); with
    attn_type=dint_lowrank the base weights load and only the new parameters start at init."""
    transformers = pytest.importorskip('transformers')
    hf_config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(tmp_path / 'hf')
    data = make_dataset(tmp_path)
    proc = train_in_process(*tiny_args(tmp_path, data), f'--init_from={tmp_path / "hf"}', '--attn_type=dint_lowrank',
                            '--max_iters=2', '--eval_interval=2')
    assert "parameters not in the base weights" in proc.stdout
    args = read_checkpoint(tmp_path / 'out')[1]['model_args']
    assert (args['attn_type'], args['n_layer'], args['vocab_size'], args['bias']) == ('dint_lowrank', 2, 64, True)
    assert args['block_size'] == 32  # config_tiny's block_size: the 64 positions were cropped


# -----------------------------------------------------------------------------
# DDP with gloo: 2 ranks == 1 process with the same total accumulation is checked in test_fsdp.py, on the
# one-process and DDP runs its FSDP test compares with (the same settings: the same runs would be trained twice)

@pytest.mark.slow
def test_ddp_accumulation_that_does_not_split_over_the_ranks_is_refused(tmp_path):
    """A clear error, not a silent change."""
    bad = run_train(tmp_path / 'bad', make_dataset(tmp_path), '--gradient_accumulation_steps=3', nproc=2, expect_rc=1)
    assert "gradient_accumulation_steps=3 (the total over all ranks) must be divisible by the number " \
           "of processes, 2" in bad.stderr


# -----------------------------------------------------------------------------
# non-finite loss (what is saved and said then: test_divergence.py)

def diverging_resume(tmp_path, *args, expect_rc):
    """Resume a finite checkpoint of iter 2 with a learning rate that takes every weight to ~1e30 in one
    step (iter 2), so that every loss from iter 3 on is NaN; the checkpoint must be left as it was."""
    data = make_dataset(tmp_path)
    train_in_process(*tiny_args(tmp_path, data), '--max_iters=2', '--eval_interval=2')
    before = (tmp_path / 'out' / 'ckpt.pt').read_bytes()
    proc = train_in_process(*tiny_args(tmp_path, data), '--init_from=resume', '--learning_rate=1e30',
                            '--decay_lr=False', *args, expect_rc=expect_rc)
    assert (tmp_path / 'out' / 'ckpt.pt').read_bytes() == before  # nothing was saved over it
    return proc


def test_nonfinite_loss_stops_by_default(tmp_path):
    proc = diverging_resume(tmp_path, '--max_iters=6', expect_rc=3)
    assert "rank 0: non-finite loss or gradient at iter 3" in proc.stderr
    assert "stopping at iter 3" in proc.stderr and "--nonfinite=skip" in proc.stderr
    assert sorted(iter_losses(proc.stdout)) == [2]  # stopped before logging the step


def test_nonfinite_loss_skips_the_step_when_asked(tmp_path):
    proc = diverging_resume(tmp_path, '--max_iters=6', '--nonfinite=skip', expect_rc=0)
    for it in (3, 4, 5):
        assert f"iter {it}: skipping the update" in proc.stdout
    assert "not saving iter 6 (val loss nan)" in proc.stderr  # the end's state is the skipped steps' NaN one


# -----------------------------------------------------------------------------
# every attention variant learns (in-process: one torch import for all of them)

def train_in_process(*args, expect_rc=0):
    """`python3 train.py ARGS` run in this process (one torch import for all of them); its exit
    status must be expect_rc."""
    proc = run_script_in_process('train.py', args)
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize('attn_type', list(ATTENTION_TYPES))
def test_every_attention_variant_trains(attn_type, tmp_path):
    data = make_dataset(tmp_path)
    out = train_in_process(str(TINY), f'--dataset={data}', f'--out_dir={tmp_path / "out"}', f'--attn_type={attn_type}',
                           '--max_iters=50', '--lr_decay_iters=50', '--eval_interval=50', '--log_interval=5').stdout
    val = eval_losses(out)
    assert sorted(val) == [0, 50]
    assert val[50] < val[0] - 0.5, val  # the same val batches before and after: it learned
    # what the variant adds to the loss and logs, asked of a fresh model of it (its class decides, not its name)
    fresh = tiny_gpt(attn_type)
    kl = [float(m[4]) for m in ITER_LINE.finditer(out)]
    assert all(k > 0 for k in kl) if kl_layers(fresh) else all(k == 0 for k in kl)
    assert re.search(r"^iter 45: .*ms/iter, [\d,]+ tok/s, 92% done, \S+ left$", out, re.M)  # no MFU on a CPU
    assert read_checkpoint(tmp_path / 'out')[1]['iter_num'] == 50
    # the metrics log's evaluation rows carry what the variant learns (see test_model for the values)
    evals = [json.loads(line) for line in (tmp_path / 'out' / 'metrics.jsonl').read_text().splitlines()
             if 'val_loss' in line]
    learned = set(fresh.learned_values())
    assert [r['iter'] for r in evals] == [0, 50]
    assert all(set(r) - {'iter', 'train_loss', 'val_loss', 'lr', 'time', 'peak_memory_mib'} == learned for r in evals)
    assert evals[0]['time'] == 0 < evals[1]['time'] and evals[1]['peak_memory_mib'] > 0
    if learned:
        assert evals[0][min(learned)] != evals[1][min(learned)]  # they moved during training


@pytest.mark.parametrize('arg,message', [
    ('--learning_rat=1e-3', "unknown config key 'learning_rat'; did you mean 'learning_rate'?"),
    ('--attn_type=noiseformer2', "attn_type='noiseformer2' is not a known attention variant; valid values: base, "),
    ('--dataset=nosuch', "data/nosuch/train.bin not found: "),
])
def test_a_wrong_key_attn_type_or_dataset_is_said_before_torch_loads(arg, message):
    """These are wrong on any machine: said before torch's import, which takes seconds on a busy CPU."""
    probe = ("import runpy, sys\nsys.argv = ['train.py', 'config/train_shakespeare_char.py', sys.argv[1]]\n"
             "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
             "finally:\n    print('torch loaded' if 'torch' in sys.modules else 'torch not loaded')")
    proc = subprocess.run([sys.executable, '-c', probe, arg], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == 'torch not loaded\n', proc.stdout + proc.stderr
    assert proc.stderr.startswith("train.py: error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_attention_names_read_before_torch_loads_are_model_pys():
    from configurator import attention_names
    assert attention_names(ROOT / 'model.py') == list(ATTENTION_TYPES)


def test_config_typo_exits_2_with_the_suggestion(tmp_path):
    proc = train_in_process(*tiny_args(tmp_path, make_dataset(tmp_path)), '--n_layr=3', expect_rc=2)
    assert "train.py: error: command line argument '--n_layr=3': unknown config key 'n_layr'; did you mean " \
           "'n_layer'?" in proc.stderr
    assert 'Traceback' not in proc.stderr


# -----------------------------------------------------------------------------
# Hardening: resume and out_dir semantics, settings checked before any work

def tiny_args(tmp_path, data, out='out'):
    return [str(TINY), f'--dataset={data}', f'--out_dir={tmp_path / out}']


def test_resume_refuses_an_architecture_given_at_its_default_value(tmp_path):
    data = make_dataset(tmp_path)
    train_in_process(*tiny_args(tmp_path, data), '--attn_type=dint', '--max_iters=0')
    # base is train.py's default, but it was given: it must be compared, not ignored
    proc = train_in_process(*tiny_args(tmp_path, data), '--init_from=resume', '--attn_type=base', expect_rc=2)
    assert "attn_type: checkpoint 'dint', this run 'base'" in proc.stderr
    assert read_checkpoint(tmp_path / 'out')[1]['model_args']['attn_type'] == 'dint'


def test_resume_continues_the_checkpoints_run_settings(tmp_path):
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    first = train_in_process(str(TINY), f'--dataset={data}', f'--out_dir={out}', '--batch_size=2',
                             '--gradient_accumulation_steps=1', '--max_iters=2', '--eval_interval=2').stdout
    assert "tokens per iteration will be: 64" in first  # 1 x 2 x 32
    assert "max_iters=2 ends during the warmup (warmup_iters=5)" in first and "give --warmup_iters=0" in first
    # nanoGPT's way of resuming: no config file; batch, data and schedule come from the checkpoint
    second = train_in_process('--init_from=resume', f'--out_dir={out}', '--max_iters=4', '--learning_rate=0.001',
                              '--device=cpu', '--dtype=float32').stdout
    assert "tokens per iteration will be: 64" in second
    assert "learning_rate: checkpoint 0.003, this run 0.001" in second
    assert "max_iters: checkpoint 2, this run 4" in second
    assert "ends before lr_decay_iters" not in first + second  # ends in the warmup: said above instead
    ckpt = read_checkpoint(out)[1]
    assert ckpt['iter_num'] == 4
    assert (ckpt['config']['batch_size'], ckpt['config']['dataset'], ckpt['config']['learning_rate']) == (2, str(data), 0.001)


def test_scratch_run_keeps_another_runs_checkpoint_aside(tmp_path):
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    first = train_in_process(*tiny_args(tmp_path, data), '--max_iters=10', '--eval_interval=5').stdout
    # config_tiny's schedule decays over 20 iterations: a run of 10 is told how far its rate gets
    reached = get_lr(10, 3e-3, 5, 20, 3e-4)
    assert (f"note: max_iters=10 ends before lr_decay_iters=20: the learning rate decays only to {reached:.3g} "
            "(min_lr=0.0003); pass --lr_decay_iters=10 to decay over this run") in first
    before = {name: (out / name).read_bytes() for name in ('ckpt.pt', 'ckpt.prev.pt', 'metrics.jsonl')}
    # the same command again (or a short test run with the same out_dir): the first run is not lost
    stdout = train_in_process(*tiny_args(tmp_path, data), '--max_iters=2', '--eval_interval=5').stdout
    aside = [p for p in out.iterdir() if p.name.startswith('replaced-')]
    assert len(aside) == 1 and f"moved it to {aside[0]}/" in stdout
    assert {name: (aside[0] / name).read_bytes() for name in before} == before
    assert read_checkpoint(out)[1]['iter_num'] == 2
    stdout = train_in_process(*tiny_args(tmp_path, data), '--max_iters=1', '--overwrite=True').stdout
    assert "deleted the previous run's checkpoint" in stdout
    assert len([p for p in out.iterdir() if p.name.startswith('replaced-')]) == 1


def test_resume_does_not_replace_the_fallback_before_training(tmp_path):
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    train_in_process(*tiny_args(tmp_path, data), '--max_iters=10', '--eval_interval=5')  # saves at 5, 10
    assert read_checkpoint(out / 'ckpt.prev.pt')[1]['iter_num'] == 5
    before = {name: (out / name).read_bytes() for name in ('ckpt.pt', 'ckpt.prev.pt')}
    stdout = train_in_process(*tiny_args(tmp_path, data), '--init_from=resume', '--max_iters=10').stdout
    assert 'saved checkpoint' not in stdout and 'step 10:' not in stdout  # nothing left to train, said
    assert ("note: max_iters=10 is the checkpoint's iteration: nothing to train (give --max_iters above 10 to "
            "continue the run)\n") in stdout
    assert {name: (out / name).read_bytes() for name in before} == before
    train_in_process(*tiny_args(tmp_path, data), '--init_from=resume', '--max_iters=12')
    assert read_checkpoint(out)[1]['iter_num'] == 12 and read_checkpoint(out / 'ckpt.prev.pt')[1]['iter_num'] == 10


def test_a_checkpoint_whose_best_val_loss_is_nan_still_saves_a_better_one(tmp_path):
    """A NaN best (a damaged or hand-edited checkpoint) would beat nothing (x < nan is False): every later
    save would be skipped without a word. Resumed, it counts as no best yet."""
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    args = [*tiny_args(tmp_path, data), '--eval_interval=5', '--always_save_checkpoint=False']
    train_in_process(*args, '--max_iters=10')
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    torch.save({**ckpt, 'best_val_loss': float('nan')}, out / 'ckpt.pt')
    train_in_process(*args, '--init_from=resume', '--max_iters=15')
    resumed = read_checkpoint(out)[1]
    assert resumed['iter_num'] == 15 and resumed['best_val_loss'] < 1e9


BAD_SETTINGS = [
    (['--grad_clip=-1'], "grad_clip=-1.0 must not be negative"),
    (['--block_size=0'], "block_size=0 must be at least 1"),
    (['--n_embd=0'], "n_embd=0 must be at least 1"),
    (['--seed=-1'], "seed=-1 must be a non-negative integer"),
    (['--beta1=1.5'], "beta1=1.5 must be in [0, 1)"),
    (['--out_dir='], "out_dir='' is empty"),
    (['--learning_rate=-0.1', '--decay_lr=False'], "learning_rate=-0.1 must be positive"),
    (['--nonfinite=skip', '--max_skipped_steps=0'], "max_skipped_steps=0 must be at least 1"),
    # each step would run for days (it ran, and a stop waited for the step), or the first batch exhaust memory
    (['--gradient_accumulation_steps=2000000'], "gradient_accumulation_steps=2000000 is over the limit of 1,048,576 "
                                                "micro-batches per iteration"),
    (['--batch_size=100000'], "batch_size=100000 is over the limit of 65,536 sequences per micro-batch"),
    (['--batch_size=' + '9' * 4000], "batch_size=999999999999... (4,000 digits) is over the limit of 65,536"),
    # an evaluation, or a run, that would never end
    (['--eval_iters=10000000'], "eval_iters=10000000 is over the limit of 1,000,000 batches per evaluation"),
    (['--max_iters=' + '1' * 40], "max_iters=111111111111... (40 digits) is over the limit of 1,000,000,000,000"),
    # a short run cut from a config with a longer warmup: the fix it needs
    (['--max_iters=50', '--lr_decay_iters=50', '--warmup_iters=50'], "e.g. --warmup_iters=5 (below max_iters)"),
    # base has no KL term: the weight of none was accepted without a word
    (['--kl_weight=1e7'], "kl_weight=1e+07 weighs the KL term of NoiseFormer's noise, which attn_type='base' does not "
                          "have: leave kl_weight at 5e-06, or train a noiseformer attn_type"),
]


@pytest.mark.parametrize('args,message', BAD_SETTINGS, ids=[a[0].split('=')[0] for a, _ in BAD_SETTINGS])
def test_impossible_settings_fail_before_any_work(args, message, tmp_path):
    data = make_dataset(tmp_path, n_train=2000, n_val=500)
    err = train_in_process(str(TINY), f'--dataset={data}', f'--out_dir={tmp_path / "out"}', *args, expect_rc=2).stderr
    assert err.strip() == f"train.py: error: {err.strip()[len('train.py: error: '):]}"
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / 'out').exists()  # nothing was started


def test_unwritable_out_dir_is_found_at_start(tmp_path):
    data = make_dataset(tmp_path, n_train=2000, n_val=500)
    (tmp_path / 'file').write_text('not a directory')
    captured = train_in_process(str(TINY), f'--dataset={data}', f'--out_dir={tmp_path / "file" / "out"}', expect_rc=2)
    assert "is not a writable directory" in captured.stderr
    assert 'iter 0' not in captured.stdout


@pytest.mark.slow
def test_gpt2_weights_offline_is_one_clear_line(tmp_path):
    pytest.importorskip('transformers')
    data = make_dataset(tmp_path, n_train=2000, n_val=500)
    env = subprocess_env(HF_HUB_OFFLINE='1', HF_HOME=str(tmp_path / 'hf-home'))
    proc = run_train(tmp_path / 'out', data, '--init_from=gpt2', env=env, expect_rc=2)
    assert "could not fetch the 'gpt2' weights" in proc.stderr and "save_pretrained" in proc.stderr
    assert 'Traceback' not in proc.stderr


def test_permanent_divergence_stops_after_max_skipped_steps(tmp_path):
    proc = diverging_resume(tmp_path, '--max_iters=50', '--nonfinite=skip', '--max_skipped_steps=4', expect_rc=3)
    assert proc.stdout.count("skipping the update") == 3
    assert "4 steps in a row had a non-finite loss or gradient (max_skipped_steps=4)" in proc.stderr


def stopped_at(stdout):
    """The iteration whose state a stop saved, by the line train.py printed: after a finished step (the signal came
    in its last micro-batch, or between steps), or during one, which is dropped."""
    after = re.findall(r"^SIG\w+ received: stopping after iter (\d+)$", stdout, re.M)
    during = re.findall(r"^SIG\w+ received during iter (\d+) \(\d+ of its \d+ micro-batches done\): stopping without it$",
                        stdout, re.M)
    assert len(after) + len(during) == 1, stdout[-2000:]
    return int(after[0]) + 1 if after else int(during[0])


@pytest.mark.slow
def test_ctrl_c_saves_the_last_finished_step(tmp_path):
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    rc, stdout, err = run_until_signal(out, data, signal.SIGINT, 3, '--max_iters=1000000', '--eval_interval=1000')
    assert rc == 0, err
    k = read_checkpoint(out)[1]['iter_num']
    assert k >= 4 and stopped_at(stdout) == k and max(iter_losses(stdout)) == k - 1
    assert "Ctrl-C again to quit at once" in err


@pytest.mark.slow
def test_a_stop_does_not_wait_for_a_step_of_a_million_micro_batches(tmp_path):
    """With 10^6 micro-batches a step takes an hour here, and a stop used to wait for it: SIGTERM now ends the run
    within seconds, the unfinished step dropped, and the checkpoint is the last finished state (before any step:
    no update in AdamW's state, and the RNGs as the step found them, as a run saving at iter 0 has them)."""
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    proc = subprocess.Popen(train_command(out, data, '--gradient_accumulation_steps=1000000', '--max_iters=10'),
                            cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith('step 0:'):  # the evaluation before the first step: the step starts now
                break
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)  # (generous: the step alone would take an hour)
    finally:
        proc.kill()
        proc.wait()
    stdout = ''.join(lines) + rest
    assert proc.returncode == 0, err
    assert re.search(r"^SIGTERM received during iter 0 \(\d+ of its 1000000 micro-batches done\): stopping without "
                     r"it$", stdout, re.M), stdout
    assert f"saved checkpoint to {out / 'ckpt.pt'} (iter 0, SIGTERM)" in stdout and not iter_losses(stdout)
    state = read_checkpoint(out)[1]
    assert state['iter_num'] == 0 and state['optimizer']['state'] == {}
    initial = train_in_process(*tiny_args(tmp_path, data, 'initial'), '--max_iters=0')  # saves iter 0, after its evaluation
    assert "(iter 0, end of training)" in initial.stdout
    reference = read_checkpoint(tmp_path / 'initial')[1]
    assert torch.equal(state['rng']['torch'], reference['rng']['torch'])
    for name, w in reference['model'].items():
        assert torch.equal(state['model'][name], w), name


def signal_in_micro_batch(monkeypatch, index):
    """SIGTERM to this process during the training forward pass number `index` (counting every micro-batch of the
    train.py runs in this process from 0), as a scheduler's would arrive there."""
    forward, calls = GPT.forward, iter(range(10 ** 9))

    def counting(self, idx, targets=None, kv_cache=None, return_logits=True):
        if not return_logits and next(calls) == index:  # (evaluation asks for the logits)
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, idx, targets, kv_cache, return_logits)
    monkeypatch.setattr(GPT, 'forward', counting)


def test_a_stop_within_a_step_saves_the_last_finished_step_and_the_resumed_run_is_exact(tmp_path, monkeypatch):
    """4 micro-batches a step. A SIGTERM in iter 3's second micro-batch drops iter 3: the checkpoint is iter 3's
    state exactly as a stop between iters 2 and 3 saves it (weights, AdamW, RNGs, sampler), and the run resumed
    from it gives the uninterrupted run's losses and weights."""
    data = make_dataset(tmp_path)
    common = ['--attn_type=noiseformer_v2', '--gradient_accumulation_steps=4', '--eval_interval=5',
              '--lr_decay_iters=10']  # noiseformer_v2: noise drawn at every forward must replay too
    full = train_in_process(*tiny_args(tmp_path, data, 'full'), *common, '--max_iters=10').stdout
    signal_in_micro_batch(monkeypatch, 2 * 4 + 3)  # iter 2's last micro-batch: iter 2 finishes
    after = train_in_process(*tiny_args(tmp_path, data, 'after'), *common, '--max_iters=10').stdout
    assert "SIGTERM received: stopping after iter 2" in after
    monkeypatch.undo()
    signal_in_micro_batch(monkeypatch, 3 * 4 + 1)  # iter 3's second: stopped before its third
    during = train_in_process(*tiny_args(tmp_path, data, 'during'), *common, '--max_iters=10').stdout
    assert "SIGTERM received during iter 3 (2 of its 4 micro-batches done): stopping without it" in during
    assert f"saved checkpoint to {tmp_path / 'during' / 'ckpt.pt'} (iter 3, SIGTERM)" in during
    assert iter_losses(during) == iter_losses(after) == {it: iter_losses(full)[it] for it in range(3)}
    a, b = read_checkpoint(tmp_path / 'after')[1], read_checkpoint(tmp_path / 'during')[1]
    assert a['iter_num'] == b['iter_num'] == 3 and a['val_loss'] is b['val_loss'] is None
    for name in a['model']:
        assert torch.equal(a['model'][name], b['model'][name]), name
    for pa, pb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert torch.equal(a['rng']['torch'], b['rng']['torch']) and a['rng']['python'] == b['rng']['python']
    assert torch.equal(a['train_batches']['generator'], b['train_batches']['generator'])
    monkeypatch.undo()
    resumed = train_in_process(*tiny_args(tmp_path, data, 'during'), *common, '--init_from=resume',
                               '--max_iters=10').stdout
    assert iter_losses(resumed) == {it: iter_losses(full)[it] for it in range(3, 10)}
    assert eval_losses(resumed) == {it: eval_losses(full)[it] for it in (5, 10)}
    rows = [json.loads(line) for line in (tmp_path / 'during' / 'metrics.jsonl').read_text().splitlines()]
    assert [r['iter'] for r in rows if 'loss' in r] == list(range(10))
    a, b = read_checkpoint(tmp_path / 'full')[1], read_checkpoint(tmp_path / 'during')[1]
    for name in a['model']:
        assert torch.equal(a['model'][name], b['model'][name]), name


@pytest.mark.slow
def test_a_stop_during_an_evaluation_saves_at_once_and_the_resumed_run_evaluates_that_state(tmp_path):
    """A preemption's grace period (SLURM's 30 s) is shorter than a long evaluation: a stop arriving
    during one saves the last finished step without waiting for it, and the resumed run evaluates that
    state first, so its evaluations equal an uninterrupted run's."""
    data = make_dataset(tmp_path)
    common = ['--eval_interval=5', '--eval_iters=2']
    full = train_in_process(*tiny_args(tmp_path, data, 'full'), *common, '--max_iters=10').stdout
    out = tmp_path / 'out'
    train_in_process(*tiny_args(tmp_path, data), *common, '--max_iters=5')
    # iterations 5 to 9, then an evaluation at 10 of 10^6 batches (minutes): SIGTERM once iter 9 is logged
    rc, stdout, err = run_until_signal(out, data, signal.SIGTERM, 9, '--init_from=resume', '--max_iters=100',
                                       '--eval_interval=5', '--eval_iters=1000000')
    assert rc == 0, err
    assert "SIGTERM received during the evaluation at iter 10: stopping without it" in stdout
    assert not eval_losses(stdout) and f"saved checkpoint to {out / 'ckpt.pt'} (iter 10, SIGTERM)" in stdout
    state = read_checkpoint(out)[1]
    assert state['iter_num'] == 10 and state['val_loss'] is None
    resumed = train_in_process(*tiny_args(tmp_path, data), '--init_from=resume', *common, '--max_iters=10').stdout
    assert eval_losses(resumed) == {10: eval_losses(full)[10]}
    rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert [r['iter'] for r in rows if 'val_loss' in r] == [0, 5, 10]


@pytest.mark.slow
def test_sighup_from_a_closed_terminal_checkpoints_like_sigterm(tmp_path):
    """A closed terminal or ssh session sends SIGHUP, and writing to that terminal fails from then on:
    the run still finishes its step, saves and exits 0."""
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    terminal, its_end = pty.openpty()
    proc = subprocess.Popen(train_command(out, data, '--max_iters=1000000', '--eval_interval=1000'), cwd=ROOT,
                            env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=its_end, stderr=its_end)
    os.close(its_end)
    shown = b''
    while not re.search(rb"^iter 3: loss", shown, re.M):
        shown += os.read(terminal, 4096)
    os.close(terminal)  # the terminal is gone: a write to it fails (EIO)
    last_shown = max(int(n) for n in re.findall(rb"^iter (\d+): loss", shown, re.M))
    time.sleep(2)  # the run writes to the closed terminal before the signal comes (it may come late)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=60) == 0
    # it did write there: each iteration prints a line
    assert read_checkpoint(out)[1]['iter_num'] > last_shown + 1 and not list(out.glob('ckpt*.tmp*'))


def queued_bytes(pipe):
    """How many bytes wait in a pipe, unread."""
    return struct.unpack('i', fcntl.ioctl(pipe, termios.FIONREAD, b'\0' * 4))[0]


@pytest.mark.slow
def test_a_second_ctrl_c_quits_at_once_in_one_line(tmp_path):
    data = make_dataset(tmp_path)
    out = tmp_path / 'out'
    proc = subprocess.Popen(train_command(out, data, '--max_iters=1000000', '--eval_interval=5'), cwd=ROOT,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # a one-page stdout pipe, unread until train.py has filled it: from then on it cannot write the lines
    # of what the first Ctrl-C asks for (a step, a save, the last lines), so it is still at it at the second
    size = fcntl.fcntl(proc.stdout, fcntl.F_SETPIPE_SZ, 4096)
    while queued_bytes(proc.stdout) < size - 300 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:
        if "Ctrl-C: stopping at the next micro-batch, then saving a checkpoint" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    k = read_checkpoint(out)[1]['iter_num']
    # (it may have been at the save the first Ctrl-C asked for, or at an evaluation's: it says which)
    assert re.fullmatch(f"interrupted( during a save)?: {re.escape(str(out / 'ckpt.pt'))} is the iter {k} state "
                        rf"\(resume with --init_from=resume\)", err.strip()), err
    assert k >= 5 and not list(out.glob('ckpt*.tmp*'))


class ConstantFlops:
    """estimate_mfu of a model doing 1e9 FLOPs per iteration, against a 1e10 FLOP/s peak."""
    @staticmethod
    def estimate_mfu(fwdbwd_per_iter, dt, peak_flops):
        return 1e9 / dt / peak_flops


def test_mfu_starts_from_the_median_of_settled_steps_not_one_slow_one(capsys):
    from denoised_gpt.training import StepSpeed
    speed = StepSpeed(ConstantFlops(), 1, 1e10)
    assert speed.update(10.0, settled=False) is None  # warm-up steps are not measured
    shown = [speed.update(dt, settled=True) for dt in (1.0, 0.1, 0.1, 0.1, 0.1)]  # one slow step first
    assert shown[:4] == [None] * 4 and shown[4] == pytest.approx(1.0)  # the median: 1e9 / 0.1 / 1e10
    assert speed.update(0.05, settled=True) == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)  # then a moving average
    for dt in (0.5, 0.1, 0.6, 0.1, 0.7, 0.1, 0.1, 0.1):
        speed.update(dt, settled=True)
    assert capsys.readouterr().out == ''  # not on a CPU: no note on swinging steps


def test_swinging_cpu_steps_get_one_note_naming_the_wait_policy_and_no_mfu(capsys, monkeypatch):
    """On a CPU (no peak: a measured one moves with the machine's load) MFU is never shown, and swinging step
    times get one note, which names the passive wait policy where the threads spin."""
    from denoised_gpt.training import StepSpeed
    monkeypatch.delenv('OMP_WAIT_POLICY', raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # restored at the end
    speed = StepSpeed(ConstantFlops(), 1, None)
    assert {speed.update(dt, settled=True) for dt in [0.1] * 12} == {None}
    assert capsys.readouterr().out == ''  # steady steps: nothing to say
    for dt in (0.5, 0.1, 0.6, 0.1, 0.7, 0.1, 0.8):
        assert speed.update(dt, settled=True) is None
    out = capsys.readouterr().out
    assert out.count('note: step times swing from 100 ms to') == 1 and 'OMP_WAIT_POLICY=PASSIVE' in out
    assert "torch's 2 threads spin while they wait" in out
    monkeypatch.setenv('OMP_WAIT_POLICY', 'passive')  # already sleeping: nothing more to suggest
    speed.warned = False
    speed.update(0.9, settled=True)
    out = capsys.readouterr().out
    assert 'step times swing' in out and 'OMP_WAIT_POLICY' not in out and 'threads' not in out
    monkeypatch.delenv('OMP_WAIT_POLICY')
    torch.set_num_threads(1)  # one thread waits for none: the note names no thread and no policy
    speed.warned = False
    speed.update(0.9, settled=True)
    out = capsys.readouterr().out
    torch.set_num_threads(threads)
    assert 'step times swing' in out and 'OMP_WAIT_POLICY' not in out and 'threads' not in out


def test_progress_shows_the_time_left_from_settled_steps_and_the_evaluations_to_come(tmp_path):
    """Every log line from the first settled step on, and every evaluation, says how far the run is and how long is
    left; the last evaluation has nothing left."""
    from denoised_gpt.training import StepSpeed
    out = run_train_in_process(tmp_path / 'out', make_dataset(tmp_path), '--max_iters=20', '--eval_interval=8').stdout
    left = {int(m[1]): (int(m[2]), m[3]) for m in re.finditer(r"^iter (\d+): .* tok/s, (\d+)% done, (\S+) left$",
                                                              out, re.M)}
    assert sorted(left) == list(range(StepSpeed.SETTLED_AFTER, 20))  # none before a settled step
    assert all(done == 100 * (i + 1) // 20 for i, (done, _) in left.items())
    evaluations = re.findall(r"^step (\d+): train loss \S+, val loss \S+(.*)$", out, re.M)
    assert evaluations[0] == ('0', '')  # before any step: nothing to estimate from
    assert re.fullmatch(r" \(40% done, \d+s left\)", dict(evaluations)['8'])
    assert dict(evaluations)['20'] == " (100% done, 0s left)"


def test_time_left_follows_the_step_time_and_counts_the_evaluations_to_come():
    from denoised_gpt.cli import duration
    from denoised_gpt.training import StepSpeed
    speed = StepSpeed(None, 1, None)
    assert speed.time_left(10, 100, 25) == ''  # no settled step yet
    for _ in range(5):
        speed.update(1.0, settled=True)
    speed.eval_seconds = 30.0
    # 90 steps at 1 s, evaluations at 25, 50, 75 and 100 at 30 s each
    assert speed.time_left(10, 100, 25) == f"10% done, {duration(90 + 4 * 30)} left" == "10% done, 3m30s left"
    assert speed.time_left(25, 100, 25, evaluated=True) == "25% done, 2m45s left"  # 75 s + 3 evaluations
    assert speed.time_left(95, 98, 25) == "96% done, 33s left"  # 3 s + the last one, at max_iters
    speed.update(10.0, settled=True)  # one slow step does not move it
    assert speed.time_left(10, 100, 25) == "10% done, 3m30s left"
    for _ in range(3):  # the machine slows down: the estimate follows within a few steps
        speed.update(3.0, settled=True)
    assert speed.time_left(50, 100, 25) == f"50% done, {duration(50 * 3 + 3 * 30)} left"
    assert [duration(s) for s in (0.4, 59.6, 3600 * 25 + 61)] == ['0s', '1m00s', '1d01h']


def test_grad_clip_zero_trains_exactly_as_a_clip_that_never_binds(tmp_path):
    """grad_clip=0 only measures the gradient (no multiply of every gradient by 1): the run, its logged
    losses and its weights are bit for bit those of a clip threshold no gradient reaches."""
    data = make_dataset(tmp_path)
    runs = {}
    for clip in ('0', '1e30'):
        out = tmp_path / f'clip{clip}'
        proc = run_train_in_process(out, data, f'--grad_clip={clip}', '--max_iters=6', '--eval_interval=6')
        runs[clip] = iter_losses(proc.stdout), read_checkpoint(out)[1]['model']
    (losses, weights), (ref_losses, ref_weights) = runs['0'], runs['1e30']
    assert losses == ref_losses and len(losses) == 6
    for name, w in ref_weights.items():
        assert torch.equal(weights[name], w), name


def test_a_model_larger_than_memory_is_one_line(tmp_path):
    data = make_dataset(tmp_path)
    proc = train_in_process(*tiny_args(tmp_path, data), '--block_size=99999999999', '--max_iters=1', expect_rc=2)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: cannot allocate the model (n_layer=2, n_embd=32, "
                           "block_size=99999999999, vocab_size=") and last.endswith("; choose smaller sizes")
    assert 'Traceback' not in proc.stderr and not (tmp_path / 'out' / 'ckpt.pt').exists()
