"""checkpoint.py: atomic saves that keep the previous checkpoint, clear errors on damaged files and
failed writes, nanoGPT's model_args layout, optimizer state by parameter name, RNG states that
round-trip through weights_only loading. (nanoGPT's own files both ways: test_nanogpt_compat.py.)"""
import copy
import json
import os
import random
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch

from denoised_gpt.checkpoint import (NANOGPT_MODEL_ARGS, CheckpointError, capture_rng_state, checkpoint_path,
                                     load_optimizer_state, optimizer_param_names, read_checkpoint, restore_rng_state,
                                     save_checkpoint)
from helpers import ROOT, small_disk_available, tiny_gpt


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
    newest, prev = read_checkpoint(tmp_path)[1], read_checkpoint(tmp_path / 'ckpt.prev.pt')[1]
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
            read_checkpoint(tmp_path)[1]
        msg = str(e.value)
        assert 'truncated or corrupt' in msg and str(tmp_path / 'ckpt.prev.pt') in msg and 'mv ' in msg
    assert read_checkpoint(tmp_path / 'ckpt.prev.pt')[1]['iter_num'] == 1


def test_failed_save_leaves_existing_checkpoints_intact(tmp_path):
    save_checkpoint(state(1), tmp_path)
    save_checkpoint(state(2), tmp_path)
    before = {n: (tmp_path / n).read_bytes() for n in ('ckpt.pt', 'ckpt.prev.pt')}
    with pytest.raises(Exception):  # pickling a lambda fails midway through torch.save
        save_checkpoint(state(3, bad=lambda: None), tmp_path)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    assert read_checkpoint(tmp_path)[1]['iter_num'] == 2


def test_process_killed_mid_save_leaves_checkpoint_intact(tmp_path):
    save_checkpoint(state(1), tmp_path)
    good = (tmp_path / 'ckpt.pt').read_bytes()
    # a child process starts saving a large checkpoint and is SIGKILLed while pickling it
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from denoised_gpt.checkpoint import save_checkpoint
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
    assert read_checkpoint(tmp_path)[1]['iter_num'] == 1
    save_checkpoint(state(2), tmp_path)  # the next save clears the stale temp file
    assert sorted(os.listdir(tmp_path)) == ['ckpt.prev.pt', 'ckpt.pt']


def test_missing_files_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        read_checkpoint(tmp_path)[1]
    # the file path itself (train.py's resume passes checkpoint_path(out_dir)): named once, not as ckpt.pt/ckpt.pt
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path / 'ckpt.pt'}: train one first"):
        read_checkpoint(checkpoint_path(tmp_path))[1]
    save_checkpoint(state(1), tmp_path)
    save_checkpoint(state(2), tmp_path)
    os.remove(tmp_path / 'ckpt.pt')  # e.g. deleted by hand: the previous one is named
    with pytest.raises(CheckpointError, match="ckpt.prev.pt"):
        read_checkpoint(tmp_path)[1]
    torch.save({'weights': torch.zeros(2)}, tmp_path / 'other.pt')
    with pytest.raises(CheckpointError, match="not a training checkpoint: it lacks model, optimizer"):
        read_checkpoint(tmp_path / 'other.pt')[1]


def test_a_folder_in_the_checkpoints_place_is_named_once_with_advice_that_works(tmp_path):
    save_checkpoint(state(1), tmp_path)
    save_checkpoint(state(2), tmp_path)
    os.remove(tmp_path / 'ckpt.pt')
    (tmp_path / 'ckpt.pt').mkdir()  # e.g. a mistaken `mkdir` or a copy gone wrong
    path, prev = tmp_path / 'ckpt.pt', tmp_path / 'ckpt.prev.pt'
    for given in (tmp_path, path):
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(given)[1]
        assert str(e.value) == (f"{path} is a folder, not a checkpoint file: move it away, then resume from the "
                                f"previous checkpoint with `mv {prev} {path}`")
    os.rmdir(path)  # the advice, followed
    os.rename(prev, path)
    assert read_checkpoint(tmp_path)[1]['iter_num'] == 1


def test_nanogpt_compiled_checkpoint_keys_are_cleaned(tmp_path):
    s = state(1)
    s['model'] = {'_orig_mod.transformer.wte.weight': torch.zeros(3)}
    save_checkpoint(s, tmp_path)
    assert list(read_checkpoint(tmp_path)[1]['model']) == ['transformer.wte.weight']


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    save_checkpoint(state(1), tmp_path)  # captures the RNG state right after seeding
    draws = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    restore_rng_state(read_checkpoint(tmp_path)[1]['rng'], 'cpu')  # loads with weights_only=True
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(draws[0], again[0]) and np.array_equal(draws[1], again[1]) and draws[2] == again[2]


# ---------------------------------------------------------------------------- model_args layout

FULL_BASE_ARGS = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, bias=False, vocab_size=61, dropout=0.0,
                      attn_type='base', noise_init_std=0.01, lowrank_rank=32, linear_chunk_size=64)


def test_model_args_are_written_in_nanogpt_layout_and_read_back_whole(tmp_path):
    s = state(1, model_args=dict(FULL_BASE_ARGS))
    save_checkpoint(s, tmp_path)
    assert s['model_args'] == FULL_BASE_ARGS and 'attn_args' not in s  # the caller's state is untouched
    raw = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert list(raw['model_args']) == [k for k in FULL_BASE_ARGS if k in NANOGPT_MODEL_ARGS]
    assert sorted(raw['model_args']) == sorted(NANOGPT_MODEL_ARGS)
    assert raw['attn_args'] == {k: v for k, v in FULL_BASE_ARGS.items() if k not in NANOGPT_MODEL_ARGS}
    loaded = read_checkpoint(tmp_path)[1]
    assert loaded['model_args'] == FULL_BASE_ARGS and 'attn_args' not in loaded
    # older checkpoints of ours (everything in model_args) and nanoGPT's (its 7 keys) read as before
    for name, model_args in (('ours_old.pt', FULL_BASE_ARGS), ('nanogpt.pt', raw['model_args'])):
        torch.save({**state(2), 'model_args': model_args}, tmp_path / name)
        assert read_checkpoint(tmp_path / name)[1]['model_args'] == model_args


# ---------------------------------------------------------------------------- integrity

def flip_bytes_inside_record(path, record_suffix):
    """Overwrite 8 bytes in the middle of a record's data, as a bad disk or copy would."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    data = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], 'little'), \
        int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], 'little')
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    data[start:start + 8] = bytes(b ^ 0xFF for b in data[start:start + 8])
    path.write_bytes(data)


def test_bytes_flipped_inside_a_tensor_are_reported_like_a_truncated_file(tmp_path):
    save_checkpoint(state(1), tmp_path)
    save_checkpoint(state(2), tmp_path)
    path = tmp_path / 'ckpt.pt'
    flip_bytes_inside_record(path, 'data/0')  # the 64x64 model weight
    damaged = torch.load(path, weights_only=True)['model']['w']  # torch itself loads it silently
    assert not torch.equal(damaged, state(2)['model']['w'])
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)[1]
    msg = str(e.value)
    assert 'truncated or corrupt' in msg and 'CRC-32' in msg and str(tmp_path / 'ckpt.prev.pt') in msg
    assert '\n' not in msg
    assert read_checkpoint(tmp_path / 'ckpt.prev.pt')[1]['iter_num'] == 1


def test_files_saved_without_crcs_load_and_our_saves_always_have_them(tmp_path):
    was = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)  # a user's (or library's) global choice
    try:
        torch.save(state(1), tmp_path / 'no_crc.pt')
        save_checkpoint(state(2), tmp_path)
    finally:
        torch.serialization.set_crc32_options(was)
    with zipfile.ZipFile(tmp_path / 'no_crc.pt') as z:
        assert all(i.CRC == 0 for i in z.infolist())  # nothing to verify: not reported as damage
    assert read_checkpoint(tmp_path / 'no_crc.pt')[1]['iter_num'] == 1
    with zipfile.ZipFile(tmp_path / 'ckpt.pt') as z:
        assert all(i.CRC == zipfile.crc32(z.read(i)) for i in z.infolist())
        assert any(i.CRC != 0 for i in z.infolist())


# ---------------------------------------------------------------------------- failed writes

SAVE_UNTIL_IT_FAILS = """
import json, os, sys, torch
sys.path.insert(0, {root!r})
from denoised_gpt.checkpoint import CheckpointError, save_checkpoint
out = {out!r}
def state(i, numel):
    return {{'model': {{'w': torch.full((numel,), float(i))}}, 'optimizer': {{}}, 'model_args': {{}},
            'iter_num': i, 'best_val_loss': 0.0, 'config': {{}}}}
save_checkpoint(state(1, 1000), out)
save_checkpoint(state(2, 1000), out)
before = {{n: open(os.path.join(out, n), 'rb').read().hex() for n in ('ckpt.pt', 'ckpt.prev.pt')}}
{limit}
try:
    save_checkpoint(state(3, 1_000_000), out)  # 4 MB: more than the limit allows
    message = None
except CheckpointError as e:
    message = str(e)
after = {{n: open(os.path.join(out, n), 'rb').read().hex() for n in sorted(os.listdir(out))}}
save_checkpoint(state(4, 1000), out)  # the half-written file was removed: a small save fits again
print(json.dumps(dict(message=message, intact=before == after, files=sorted(after))))
"""


def run_save_until_it_fails(out, limit, wrap=()):
    script = SAVE_UNTIL_IT_FAILS.format(root=str(ROOT), out=str(out), limit=limit)
    proc = subprocess.run([*wrap, sys.executable, '-c', script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not small_disk_available(), reason="needs `unshare -rm` (user + mount namespaces) to mount "
                                                       "a small tmpfs, i.e. a real full disk")
def test_disk_full_during_save_is_one_line_and_keeps_both_checkpoints(tmp_path):
    out = tmp_path / 'full_disk'
    out.mkdir()
    # a 1 MiB tmpfs over out, seen by this child process only: two small checkpoints fit, a 4 MB one not
    wrap = ['unshare', '-rm', 'sh', '-c', f'mount -t tmpfs -o size=1m tmpfs {out} && exec "$0" "$@"']
    result = run_save_until_it_fails(out, limit='', wrap=wrap)
    assert result['message'] == (f"no space left on device in {out} while saving a checkpoint; {out}/ckpt.pt / "
                                 f"{out}/ckpt.prev.pt are intact. Free some space (or set out_dir to a disk "
                                 f"with room) and resume with init_from='resume'")
    assert result['intact'] and result['files'] == ['ckpt.prev.pt', 'ckpt.pt']


@pytest.mark.skipif(sys.platform != 'linux', reason="RLIMIT_FSIZE / SIGXFSZ as on Linux")
def test_other_write_errors_are_one_line_and_keep_both_checkpoints(tmp_path):
    # the file size limit (RLIMIT_FSIZE) makes the kernel refuse the write with EFBIG
    limit = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.RLIM_INFINITY))")
    result = run_save_until_it_fails(tmp_path, limit=limit)
    assert result['message'] == (f"File too large in {tmp_path} while saving a checkpoint; {tmp_path}/ckpt.pt / "
                                 f"{tmp_path}/ckpt.prev.pt are intact. Fix the cause (or set out_dir to a disk with "
                                 f"room) and resume with init_from='resume'")
    assert result['intact'] and result['files'] == ['ckpt.prev.pt', 'ckpt.pt']


# ---------------------------------------------------------------------------- optimizer state by name

def model_and_optimizer(seed, attn_type='noiseformer_v2', **overrides):
    """A 4-head model (helpers.tiny_gpt, with biases, context 16, 61 tokens; overrides applied) and
    its AdamW."""
    model = tiny_gpt(attn_type, seed, **{**dict(n_head=4, block_size=16, vocab_size=61, bias=True), **overrides})
    return model, model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')


def train_steps(model, optimizer, seeds):
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        x = torch.randint(0, model.config.vocab_size, (2, model.config.block_size + 1), generator=g)
        torch.manual_seed(s)  # the same noise draws in every copy
        model(x[:, :-1], x[:, 1:])[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def trained_checkpoint(tmp_path, attn_type='noiseformer_v2', **overrides):
    model, optimizer = model_and_optimizer(0, attn_type, **overrides)
    train_steps(model, optimizer, [1, 2])
    save_checkpoint({**state(2), 'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                     'optimizer_param_names': optimizer_param_names(model, optimizer)}, tmp_path)
    return read_checkpoint(tmp_path)[1]


def test_optimizer_param_names_name_every_slot_in_order():
    model, optimizer = model_and_optimizer(0, 'base')
    names = optimizer_param_names(model, optimizer)
    params = dict(model.named_parameters())
    assert [[params[n] for n in group] for group in names] == [g['params'] for g in optimizer.param_groups]
    assert names[0][:3] == ['transformer.wte.weight', 'transformer.wpe.weight', 'transformer.h.0.attn.c_attn.weight']


def test_loading_by_name_is_bit_identical_to_load_state_dict_for_our_checkpoints(tmp_path):
    ckpt = trained_checkpoint(tmp_path)
    resumed = []
    for load in ('plain', 'by name'):
        model, optimizer = model_and_optimizer(5)  # different init: everything must come from the checkpoint
        model.load_state_dict(ckpt['model'])
        c = copy.deepcopy(ckpt)
        optimizer.load_state_dict(c['optimizer']) if load == 'plain' else load_optimizer_state(optimizer, model, c)
        train_steps(model, optimizer, [3])
        resumed.append(model.state_dict())
    assert all(torch.equal(resumed[0][k], resumed[1][k]) for k in resumed[0])


def test_an_older_checkpoint_of_ours_with_c_proj_first_resumes_by_name(tmp_path):
    """Before c_attn was registered first, our checkpoints listed each block's attn.c_proj before
    attn.c_attn in the model and in the optimizer's slots, with no optimizer_param_names."""
    model, _ = model_and_optimizer(0, 'base')
    params = dict(model.named_parameters())
    old = list(params)
    for i in range(model.config.n_layer):  # c_attn.weight, c_attn.bias, c_proj.weight, c_proj.bias
        attn = [n for n in old if n.startswith(f'transformer.h.{i}.attn.c_')]
        at = old.index(attn[0])
        old[at:at + 4] = attn[2:] + attn[:2]
    assert old.index('transformer.h.0.attn.c_proj.weight') < old.index('transformer.h.0.attn.c_attn.weight')
    optimizer = torch.optim.AdamW([{'params': [params[n] for n in old if params[n].dim() >= 2], 'weight_decay': 0.1},
                                   {'params': [params[n] for n in old if params[n].dim() < 2], 'weight_decay': 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95))
    train_steps(model, optimizer, [1, 2])
    sd = model.state_dict()
    sd = {k: sd[k] for k in old + ['lm_head.weight']}
    save_checkpoint({**state(2), 'model': sd, 'optimizer': optimizer.state_dict()}, tmp_path)

    new_model, new_optimizer = model_and_optimizer(5, 'base')
    ckpt = read_checkpoint(tmp_path)[1]
    new_model.load_state_dict(ckpt['model'])
    load_optimizer_state(new_optimizer, new_model, ckpt)
    for name, p in new_model.named_parameters():
        for key in ('exp_avg', 'exp_avg_sq'):
            assert torch.equal(new_optimizer.state[p][key], optimizer.state[params[name]][key]), (name, key)


def test_optimizer_state_that_does_not_fit_the_model_is_refused_clearly(tmp_path):
    ckpt = trained_checkpoint(tmp_path / 'a', attn_type='base')
    model, optimizer = model_and_optimizer(0, 'base', vocab_size=64)
    with pytest.raises(CheckpointError, match=r"exp_avg for transformer.wte.weight has shape \(61, 32\) but the "
                                              r"model's parameter has \(64, 32\)"):
        load_optimizer_state(optimizer, model, copy.deepcopy(ckpt))
    model, optimizer = model_and_optimizer(0, 'diff')  # the same matrices plus lambda vectors and a norm
    with pytest.raises(CheckpointError, match=r"param group 1 lacks \['transformer.h.0.attn.head_norm.weight'"):
        load_optimizer_state(optimizer, model, copy.deepcopy(ckpt))
    # AdamW's step count below zero (or NaN): its bias correction made every update NaN at iteration 0
    for step in (-3.0, float('nan')):
        bad = copy.deepcopy(ckpt)
        bad['optimizer']['state'][0]['step'] = torch.tensor(step)
        model, optimizer = model_and_optimizer(0, 'base', vocab_size=61)
        with pytest.raises(CheckpointError, match=rf"optimizer state step for transformer.wte.weight is {step:g}, not "
                                                  rf"a count of updates"):
            load_optimizer_state(optimizer, model, bad)
    del ckpt['optimizer_param_names']  # nanoGPT's layout: names inferred from the model's keys
    ckpt['model'].pop('transformer.ln_f.weight')
    model, optimizer = model_and_optimizer(0, 'base')
    with pytest.raises(CheckpointError, match=r"param groups of \[10, 18\] tensors but nanoGPT's grouping of "
                                              r"its model gives \[10, 17\]"):
        load_optimizer_state(optimizer, model, ckpt)


def flip_byte_in(path, tensor):
    """Flip one byte inside the zip record that holds `tensor`'s bytes (found by content)."""
    raw = bytearray(path.read_bytes())
    needle = tensor.detach().contiguous().numpy().tobytes()
    at = raw.find(needle)
    assert at > 0 and raw.find(needle, at + 1) < 0, "the tensor's bytes must occur once in the file"
    raw[at + len(needle) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_running_the_model_reads_only_its_tensors_and_still_refuses_a_damaged_one(tmp_path):
    from helpers import tiny_gpt
    model = tiny_gpt('noiseformer_v2', seed=1)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
    optimizer.step()  # AdamW state to damage
    state = {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'model_args': {}, 'iter_num': 1,
             'best_val_loss': 1.0, 'config': {}}
    for name in ('opt', 'weights'):
        save_checkpoint(state, tmp_path / name)
    # a flipped byte in the optimizer state: sample.py / eval.py never read it; a resume does
    flip_byte_in(tmp_path / 'opt' / 'ckpt.pt', optimizer.state_dict()['state'][0]['exp_avg_sq'])
    loaded = read_checkpoint(tmp_path / 'opt', model_only=True)[1]
    assert loaded['optimizer'] is None  # not even as views of the file's mapping
    for k, v in model.state_dict().items():
        assert torch.equal(loaded['model'][k], v), k
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(tmp_path / 'opt')[1]
    # a flipped byte inside a model tensor: refused either way, naming the tensor
    flip_byte_in(tmp_path / 'weights' / 'ckpt.pt', model.state_dict()['transformer.h.1.mlp.c_fc.weight'])
    with pytest.raises(CheckpointError, match=r"truncated or corrupt \(the bytes of transformer.h.1.mlp.c_fc.weight"):
        read_checkpoint(tmp_path / 'weights', model_only=True)[1]
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(tmp_path / 'weights')[1]


def test_a_compressed_part_is_refused_before_torch_load_inflates_it(tmp_path):
    """torch.save stores a zip's parts as they are; a deflated one (a few KB of zeros declaring 200 MB, say)
    would be inflated in memory by torch.load, to any size: refused first, in one line."""
    save_checkpoint(state(1), tmp_path)
    path = tmp_path / 'ckpt.pt'
    with zipfile.ZipFile(path) as z:
        parts = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, 'w') as z:
        for info, data in parts:
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)[1]
    assert str(e.value).startswith(f"checkpoint {path} holds ") and "compressed or larger than the file" in str(e.value)
    assert "so it is not read. No previous checkpoint" in str(e.value)


CUT_WHILE_READ = """
import os, sys
from denoised_gpt import checkpoint as checkpoint_module
from denoised_gpt.checkpoint import CheckpointError, read_checkpoint
records = checkpoint_module._data_records
def cut_once_mapped(f):  # (called once torch.load has mapped the file, before the model's bytes are read)
    found = records(f)
    os.truncate(sys.argv[1], min(found) + 1)
    return found
checkpoint_module._data_records = cut_once_mapped
try:
    read_checkpoint(sys.argv[1], model_only=True)
except CheckpointError as e:
    print(e)
"""


def test_a_ckpt_pt_cut_short_while_sample_py_reads_it_is_one_line_not_sigbus(tmp_path):
    """sample.py and eval.py map ckpt.pt (model_only) and read the model's records: a file truncated in place once
    mapped killed the reader touching its pages (SIGBUS, no message); the model's bytes are read, not touched through
    the mapping, so it is said. Run as a process: a regression dies."""
    from helpers import tiny_checkpoint
    tiny_checkpoint(tmp_path, 'base', 'data')
    path = tmp_path / 'ckpt.pt'
    proc = subprocess.run([sys.executable, '-c', CUT_WHILE_READ, str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert proc.stdout.startswith(f"checkpoint {path} is truncated or corrupt (it is shorter than when it was opened: "
                                  f"it changed while transformer."), proc.stdout
    assert proc.stdout.count("\n") == 1 and "No previous checkpoint (ckpt.prev.pt) exists next to it." in proc.stdout


def test_sample_py_s_reader_gives_the_models_tensors_from_memory_equal_to_the_full_read(tmp_path):
    """model_only: the model's tensors equal a full read's, bit for bit, tied weights still one storage, and none
    is a view of the file's mapping (each owns its bytes); a flipped byte in a record is named."""
    from helpers import tiny_checkpoint
    tiny_checkpoint(tmp_path, 'diff', 'data')
    _, full = read_checkpoint(tmp_path)
    _, model_only = read_checkpoint(tmp_path, model_only=True)
    assert full['model'].keys() == model_only['model'].keys()
    for name, t in model_only['model'].items():
        assert t.dtype == full['model'][name].dtype and torch.equal(t, full['model'][name]), name
        assert t.untyped_storage().nbytes() == full['model'][name].untyped_storage().nbytes()
    tied = model_only['model']
    assert tied['lm_head.weight'].untyped_storage().data_ptr() == tied['transformer.wte.weight'].untyped_storage().data_ptr()
    raw = bytearray((tmp_path / 'ckpt.pt').read_bytes())
    needle = full['model']['transformer.h.1.attn.c_proj.weight'].numpy().tobytes()
    at = raw.find(needle)
    raw[at + 5] ^= 0xFF
    (tmp_path / 'ckpt.pt').write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"the bytes of transformer\.h\.1\.attn\.c_proj\.weight do not match "
                                              r"their record's CRC-32"):
        read_checkpoint(tmp_path, model_only=True)


def test_a_pickle_naming_a_function_that_does_not_exist_is_called_damaged_not_code(tmp_path):
    """A file saved without CRC-32s (torch's set_crc32_options(False)) whose pickle names a function of torch that
    does not exist (one letter flipped): nothing of that name could run, so the file is damaged, not one that
    holds code. (A module not imported yet is not imported to ask: that stays "can run code".)"""
    if not hasattr(torch.serialization, 'set_crc32_options'):
        pytest.skip("this torch always writes CRC-32s")
    model = tiny_gpt('base')
    torch.serialization.set_crc32_options(False)  # (save_checkpoint writes them whatever this says)
    try:
        torch.save({'model': model.state_dict(), 'optimizer': {}, 'model_args': {}, 'iter_num': 1,
                    'best_val_loss': 2.0, 'config': {}}, tmp_path / 'ckpt.pt')
    finally:
        torch.serialization.set_crc32_options(True)
    raw = (tmp_path / 'ckpt.pt').read_bytes()
    assert raw.count(b'_rebuild_tensor_v2') >= 1
    (tmp_path / 'ckpt.pt').write_bytes(raw.replace(b'_rebuild_tensor_v2', b'_rebuild_tensoX_v2'))
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)
    assert str(e.value) == (f"checkpoint {tmp_path / 'ckpt.pt'} is truncated or corrupt (its pickle names "
                            f"torch._utils._rebuild_tensoX_v2, which does not exist), so it is not read. No previous "
                            f"checkpoint (ckpt.prev.pt) exists next to it."), str(e.value)
