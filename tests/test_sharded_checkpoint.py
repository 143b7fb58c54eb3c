"""Sharded checkpoints (denoised_gpt/sharded_checkpoint.py) in one process: a kill at any point of a save
leaves the previous one loadable, convert_checkpoint.py turns ckpt.pt into a sharded checkpoint and back
without changing a bit, read_checkpoint takes the newer kind, a damaged shard is reported with the
fallback, and a new run moves an old run's sharded checkpoints aside. (Written by 2 ranks: test_fsdp.py.)"""
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from denoised_gpt.checkpoint import (CheckpointError, checkpoint_path, optimizer_param_names, read_checkpoint,
                                     save_checkpoint)
from denoised_gpt.run_dir import clear_for_new_run
from denoised_gpt import sharded_checkpoint
from denoised_gpt.sharded_checkpoint import checkpoint_as_sharded, load_sharded_state, newest_sharded, save_sharded
from helpers import ROOT, TINY, VOCAB, make_dataset, run_script_in_process, subprocess_env, tiny_gpt


def trained_checkpoint(out_dir, iter_num, attn_type='noiseformer_v1'):
    """ckpt.pt of a tiny model after two AdamW steps, as train.py writes it."""
    model = tiny_gpt(attn_type, seed=iter_num)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    for seed in range(2):
        x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint({'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                     'optimizer_param_names': optimizer_param_names(model, optimizer),
                     'model_args': dataclasses.asdict(model.config), 'iter_num': iter_num, 'best_val_loss': 2.5,
                     'config': {'dataset': 'x'}, 'rng': {'torch': torch.get_rng_state()}}, out_dir)
    return read_checkpoint(out_dir)[1]


def assert_same_checkpoint(a, b):
    assert list(a['model']) == list(b['model']) and all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])
    assert a['model']['lm_head.weight'] is a['model']['transformer.wte.weight']
    assert a['optimizer']['param_groups'] == b['optimizer']['param_groups']
    assert a['optimizer_param_names'] == b['optimizer_param_names']
    assert a['optimizer']['state'].keys() == b['optimizer']['state'].keys()
    for slot, state in a['optimizer']['state'].items():
        assert all(torch.equal(v, b['optimizer']['state'][slot][k]) for k, v in state.items()), slot
    for key in ('model_args', 'iter_num', 'best_val_loss', 'config'):
        assert a[key] == b[key], key
    assert torch.equal(a['rng']['torch'], b['rng']['torch'])


def test_convert_to_sharded_and_back_changes_nothing_and_the_newer_kind_is_read(tmp_path):
    original = trained_checkpoint(tmp_path, iter_num=7)
    proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={tmp_path}', '--to=sharded'])
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / 'ckpt.sharded-0000007'
    assert f"wrote {folder} from {tmp_path / 'ckpt.pt'}, iter 7" in proc.stdout
    assert checkpoint_path(tmp_path) == str(folder)  # as new as ckpt.pt: the sharded one is read
    assert_same_checkpoint(read_checkpoint(tmp_path)[1], original)
    only_model = read_checkpoint(tmp_path, model_only=True)[1]
    assert only_model['optimizer'] is None and only_model['model'].keys() == original['model'].keys()

    os.remove(tmp_path / 'ckpt.pt')
    proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={tmp_path}'])
    assert proc.returncode == 0, proc.stderr
    assert_same_checkpoint(read_checkpoint(tmp_path / 'ckpt.pt')[1], original)

    trained_checkpoint(tmp_path, iter_num=9)  # a newer ckpt.pt (an fsdp run resumed in one process, say)
    assert checkpoint_path(tmp_path) == str(tmp_path / 'ckpt.pt') and read_checkpoint(tmp_path)[1]['iter_num'] == 9
    before = (tmp_path / 'ckpt.pt').read_bytes()
    proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={tmp_path}'])  # the older over it: refused
    assert proc.returncode == 2 and "(iter 9 against 7): converting" in proc.stderr and "--to=sharded" in proc.stderr
    assert (tmp_path / 'ckpt.pt').read_bytes() == before and read_checkpoint(tmp_path)[1]['iter_num'] == 9

    empty = tmp_path / 'empty'
    empty.mkdir()
    for to in ('file', 'sharded'):
        proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={empty}', f'--to={to}'])
        assert proc.returncode != 0 and f"{empty} holds no" in proc.stderr


KILL_POINTS = {
    # after every rank's file is written, while checkpoint.json is being written
    'shards written': "sharded_checkpoint._write_index = die",
    # after the folder got its final name, before ckpt.sharded points at it
    'folder renamed': "sharded_checkpoint._write_pointer = die",
}


@pytest.mark.slow
@pytest.mark.parametrize('point', KILL_POINTS)
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, point):
    first = trained_checkpoint(tmp_path / 'src1', iter_num=1)
    save_sharded(*checkpoint_as_sharded(first), tmp_path / 'out')
    trained_checkpoint(tmp_path / 'src2', iter_num=2)
    script = f"""
import os, signal, torch
from denoised_gpt import sharded_checkpoint
from denoised_gpt.checkpoint import read_checkpoint
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
{KILL_POINTS[point]}
_, source = read_checkpoint({str(tmp_path / 'src2')!r})
sharded_checkpoint.save_sharded(*sharded_checkpoint.checkpoint_as_sharded(source), {str(tmp_path / 'out')!r})
"""
    proc = subprocess.run([sys.executable, '-c', script], cwd=ROOT, env=subprocess_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert newest_sharded(tmp_path / 'out') == str(tmp_path / 'out' / 'ckpt.sharded-0000001')
    assert_same_checkpoint(read_checkpoint(tmp_path / 'out')[1], first)
    # the next save clears what the killed one left and keeps the newest two
    third = trained_checkpoint(tmp_path / 'src3', iter_num=3)
    save_sharded(*checkpoint_as_sharded(third), tmp_path / 'out')
    assert sorted(os.listdir(tmp_path / 'out')) == ['ckpt.sharded', 'ckpt.sharded-0000001', 'ckpt.sharded-0000003']
    assert_same_checkpoint(read_checkpoint(tmp_path / 'out')[1], third)


def test_a_damaged_shard_is_reported_with_the_previous_checkpoint(tmp_path):
    for it in (1, 2):
        save_sharded(*checkpoint_as_sharded(trained_checkpoint(tmp_path / f'src{it}', iter_num=it)), tmp_path / 'out')
    shard = tmp_path / 'out' / 'ckpt.sharded-0000002' / 'rank-00000.safetensors'
    shard.write_bytes(shard.read_bytes()[:100])  # a copy cut short
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path / 'out')[1]
    assert "is incomplete or corrupt" in str(e.value) and "ckpt.sharded-0000001, was kept for this" in str(e.value)
    assert read_checkpoint(tmp_path / 'out' / 'ckpt.sharded-0000001')[1]['iter_num'] == 1
    # what an fsdp resume does with it (each rank reading its part): the same kind of error, in one line
    model = tiny_gpt('noiseformer_v1')
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    with pytest.raises(CheckpointError) as e:
        load_sharded_state(str(shard.parent), model, optimizer)
    assert len(str(e.value).splitlines()) == 1 and "cannot resume from the sharded checkpoint" in str(e.value)


def test_a_new_run_moves_an_old_runs_sharded_checkpoints_aside_or_deletes_them(tmp_path):
    for out, overwrite in ((tmp_path / 'keep', False), (tmp_path / 'delete', True)):
        save_sharded(*checkpoint_as_sharded(trained_checkpoint(tmp_path / 'src', iter_num=1)), out)
        (out / 'metrics.jsonl').write_text('{}\n')
        message = clear_for_new_run(str(out), overwrite)
        left = sorted(os.listdir(out))
        if overwrite:
            assert left == [] and "deleted the previous run's checkpoint" in message
        else:
            assert len(left) == 1 and left[0].startswith('replaced-') and "moved it to" in message
            assert sorted(os.listdir(out / left[0])) == ['ckpt.sharded', 'ckpt.sharded-0000001', 'metrics.jsonl']


def test_a_failed_write_says_so_in_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    first = trained_checkpoint(tmp_path / 'src1', iter_num=1)
    save_sharded(*checkpoint_as_sharded(first), tmp_path / 'out')

    second = checkpoint_as_sharded(trained_checkpoint(tmp_path / 'src2', iter_num=2))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(sharded_checkpoint, '_write_safetensors', disk_full)
    with pytest.raises(CheckpointError) as e:
        save_sharded(*second, tmp_path / 'out')
    monkeypatch.undo()
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "No space left on device" in message
    assert f"{tmp_path / 'out' / 'ckpt.sharded-0000001'} is intact" in message
    assert_same_checkpoint(read_checkpoint(tmp_path / 'out')[1], first)


@pytest.mark.parametrize('kind', ['ckpt.pt', 'sharded'])
def test_a_checkpoint_that_does_not_fit_its_own_model_args_is_one_line(tmp_path, kind):
    """model_args that say vocab_size=64 beside a (48, 32) token embedding: train.py's resume says so in one
    line naming the checkpoint, for both kinds, not with load_state_dict's traceback."""
    out = tmp_path / 'out'
    trained_checkpoint(out, iter_num=7)
    if kind == 'sharded':
        save_sharded(*checkpoint_as_sharded(read_checkpoint(out)[1]), out)
        os.remove(out / 'ckpt.pt')
    path = newest_sharded(out) if kind == 'sharded' else str(out / 'ckpt.pt')
    if kind == 'sharded':
        index = json.loads((out / path / 'checkpoint.json').read_text())
        index['train_state']['model_args']['vocab_size'] = 64
        (out / path / 'checkpoint.json').write_text(json.dumps(index))
    else:
        state = torch.load(path, weights_only=True)
        state['model_args']['vocab_size'] = 64
        torch.save(state, path)
    proc = run_script_in_process('train.py', [TINY, '--init_from=resume', f'--out_dir={out}',
                                              f'--dataset={make_dataset(tmp_path)}', '--device=cpu'])
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"train.py: error: checkpoint {path} does not fit its own model_args: its transformer.wte.weight has shape "
        f"(48, 32), the model they describe (64, 32)"], proc.stderr


@pytest.mark.slow
def test_convert_never_writes_beside_a_run_that_holds_the_out_dir(tmp_path):
    """convert_checkpoint.py takes out_dir's lock as train.py does: while another process holds it (a training
    run), the conversion is refused in one line and writes nothing."""
    trained_checkpoint(tmp_path, iter_num=7)
    holder = subprocess.Popen([sys.executable, '-c', 'import sys; from denoised_gpt.run_dir import lock_out_dir; '
                               f'lock = lock_out_dir({str(tmp_path)!r}); print("held", flush=True); sys.stdin.read()'],
                              cwd=ROOT, env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}  # ckpt.pt and the lock
        proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={tmp_path}', '--to=sharded'])
    finally:
        holder.communicate('')
    assert proc.returncode == 2 and "is in use by another run" in proc.stderr, proc.stderr
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before
    proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={tmp_path}', '--to=sharded'])  # released
    assert proc.returncode == 0, proc.stderr
