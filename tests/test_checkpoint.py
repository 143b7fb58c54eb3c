"""checkpoint.py: atomic saves that keep the previous checkpoint, clear errors on damaged files,
RNG states that round-trip through weights_only loading."""
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint import (CheckpointError, capture_rng_state, load_checkpoint, restore_rng_state,
                        save_checkpoint)

ROOT = Path(__file__).resolve().parents[1]


def state(iter_num, **extra):
    torch.manual_seed(iter_num)
    return {'model': {'w': torch.randn(64, 64)}, 'optimizer': {'state': {}, 'param_groups': []},
            'model_args': {'n_layer': 2}, 'iter_num': iter_num, 'best_val_loss': 1.5,
            'config': {'batch_size': 4}, 'rng': capture_rng_state('cpu'), **extra}


def test_save_keeps_previous_and_leaves_no_temp_files(tmp_path):
    save_checkpoint(state(1), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt']
    save_checkpoint(state(2), tmp_path)
    save_checkpoint(state(3), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ['ckpt.prev.pt', 'ckpt.pt']
    newest, prev = load_checkpoint(tmp_path), load_checkpoint(tmp_path / 'ckpt.prev.pt')
    assert (newest['iter_num'], prev['iter_num']) == (3, 2)
    assert torch.equal(newest['model']['w'], state(3)['model']['w'])


def test_truncated_newest_names_previous_which_still_loads(tmp_path):
    save_checkpoint(state(1), tmp_path)
    save_checkpoint(state(2), tmp_path)
    path = tmp_path / 'ckpt.pt'
    data = path.read_bytes()
    for cut in (0, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(tmp_path)
        msg = str(e.value)
        assert 'truncated or corrupt' in msg and str(tmp_path / 'ckpt.prev.pt') in msg and 'mv ' in msg
    assert load_checkpoint(tmp_path / 'ckpt.prev.pt')['iter_num'] == 1


def test_failed_save_leaves_existing_checkpoints_intact(tmp_path):
    save_checkpoint(state(1), tmp_path)
    save_checkpoint(state(2), tmp_path)
    before = {n: (tmp_path / n).read_bytes() for n in ('ckpt.pt', 'ckpt.prev.pt')}
    with pytest.raises(Exception):  # pickling a lambda fails midway through torch.save
        save_checkpoint(state(3, bad=lambda: None), tmp_path)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    assert load_checkpoint(tmp_path)['iter_num'] == 2


def test_process_killed_mid_save_leaves_checkpoint_intact(tmp_path):
    save_checkpoint(state(1), tmp_path)
    good = (tmp_path / 'ckpt.pt').read_bytes()
    # a child process starts saving a large checkpoint and is SIGKILLed while pickling it
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from checkpoint import save_checkpoint
        class KillDuringPickling:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)
        state = {{'big': torch.zeros(4_000_000), 'model': {{}}, 'killer': KillDuringPickling()}}
        save_checkpoint(state, {str(tmp_path)!r})
    """)
    proc = subprocess.run([sys.executable, '-c', script], capture_output=True)
    assert proc.returncode == -9
    assert any(n.startswith('ckpt.pt.tmp-') for n in os.listdir(tmp_path))  # the half-written file
    assert (tmp_path / 'ckpt.pt').read_bytes() == good
    assert load_checkpoint(tmp_path)['iter_num'] == 1
    save_checkpoint(state(2), tmp_path)  # the next save clears the stale temp file
    assert sorted(os.listdir(tmp_path)) == ['ckpt.prev.pt', 'ckpt.pt']


def test_missing_files_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path)
    save_checkpoint(state(1), tmp_path)
    save_checkpoint(state(2), tmp_path)
    os.remove(tmp_path / 'ckpt.pt')  # e.g. deleted by hand: the previous one is named
    with pytest.raises(CheckpointError, match="ckpt.prev.pt"):
        load_checkpoint(tmp_path)
    torch.save({'weights': torch.zeros(2)}, tmp_path / 'other.pt')
    with pytest.raises(CheckpointError, match="not a training checkpoint: it lacks model, optimizer"):
        load_checkpoint(tmp_path / 'other.pt')


def test_nanogpt_compiled_checkpoint_keys_are_cleaned(tmp_path):
    s = state(1)
    s['model'] = {'_orig_mod.transformer.wte.weight': torch.zeros(3)}
    save_checkpoint(s, tmp_path)
    assert list(load_checkpoint(tmp_path)['model']) == ['transformer.wte.weight']


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    save_checkpoint(state(1), tmp_path)  # captures the RNG state right after seeding
    draws = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    restore_rng_state(load_checkpoint(tmp_path)['rng'], 'cpu')  # loads with weights_only=True
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]
