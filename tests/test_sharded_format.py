"""A sharded checkpoint's folder, handed over by someone else, can describe nothing it does not hold
(denoised_gpt/sharded_checkpoint.py): checkpoint.json whose chunks overlap, leave rows uncovered or declare
more than the files hold, safetensors files whose headers lie, sparse files, links and FIFOs are each
refused in one line before anything is allocated or read from outside the folder. The same for a ckpt.pt
whose zip parts overlap or inflate, and for a counter whose repr would be huge."""
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from denoised_gpt import checkpoint as checkpoint_module, sharded_checkpoint
from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, read_checkpoint, save_checkpoint
from denoised_gpt.sharded_checkpoint import HOLE_SLACK, checkpoint_as_sharded, load_sharded_state, save_sharded
from helpers import ROOT, ends_if_it_hangs, subprocess_env, tiny_gpt
from test_sharded_checkpoint import assert_same_checkpoint, trained_checkpoint

WTE = 'model.transformer.wte.weight'  # (48, 32) float32 in trained_checkpoint's model


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    """An out_dir holding a trained ckpt.pt (iter 7) and the same checkpoint sharded."""
    out = tmp_path_factory.mktemp('format') / 'out'
    save_sharded(*checkpoint_as_sharded(trained_checkpoint(out, iter_num=7)), out)
    return out


def folder_of(out):
    return out / 'ckpt.sharded-0000007'


def copy_of(source, tmp_path):
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    return out


def refusal(folder):
    """read_checkpoint's one-line refusal of the folder."""
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(folder)[1]
    assert len(str(e.value).splitlines()) == 1, str(e.value)
    return str(e.value)


def safetensors_bytes(header, data=b''):
    """A safetensors file as its format is: the header's length (8 bytes, little-endian), the header, the data."""
    text = json.dumps(header).encode()
    return struct.pack('<Q', len(text)) + text + data


def test_a_real_checkpoint_holds_no_pickle_and_loads_in_float32_and_bfloat16(source, tmp_path):
    """The folder is checkpoint.json and one safetensors file per rank; model and AdamW state in float32 and
    bfloat16 come back bit for bit through read_checkpoint and load_sharded_state."""
    original = read_checkpoint(source / 'ckpt.pt')[1]
    assert sorted(os.listdir(folder_of(source))) == ['checkpoint.json', 'rank-00000.safetensors']
    assert_same_checkpoint(read_checkpoint(folder_of(source))[1], original)
    bf16 = dict(original, model={k: v.to(torch.bfloat16) for k, v in original['model'].items()})
    bf16['model']['lm_head.weight'] = bf16['model']['transformer.wte.weight']
    loaded = read_checkpoint(save_sharded(*checkpoint_as_sharded(bf16), tmp_path))[1]
    assert all(v.dtype == torch.bfloat16 for v in loaded['model'].values())
    assert_same_checkpoint(loaded, bf16)

    model = tiny_gpt('noiseformer_v1', seed=1)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    load_sharded_state(str(folder_of(source)), model, optimizer)
    assert all(torch.equal(p, original['model'][n]) for n, p in model.state_dict().items())
    state = optimizer.state[model.transformer.wte.weight]
    saved = original['optimizer']['state'][original['optimizer_param_names'][0].index('transformer.wte.weight')]
    assert all(torch.equal(state[k], saved[k]) for k in ('step', 'exp_avg', 'exp_avg_sq'))


# ----------------------------------------------------------------------------------------------
# checkpoint.json that declares what the files do not hold: each change(index, folder) -> what the refusal says

def rows_twice(index, folder):  # a second file holding the same rows again
    shutil.copy(folder / 'rank-00000.safetensors', folder / 'rank-00001.safetensors')
    index['tensors'][WTE]['chunks'].append({'file': 'rank-00001.safetensors', 'rows': [0, 48]})


def rows_missing(index, folder):
    index['tensors'][WTE]['shape'] = [96, 32]


def one_file_twice(index, folder):
    index['tensors'][WTE]['chunks'] = [{'file': 'rank-00000.safetensors', 'rows': [0, 24]},
                                       {'file': 'rank-00000.safetensors', 'rows': [24, 48]}]


def four_terabytes(index, folder):
    index['tensors'][WTE].update(shape=[2**37, 8], chunks=[{'file': 'rank-00000.safetensors', 'rows': [0, 2**37]}])


def file_outside(index, folder):
    shutil.copy(folder / 'rank-00000.safetensors', folder.parent / 'rank-00000.safetensors')
    index['tensors'][WTE]['chunks'][0]['file'] = '../rank-00000.safetensors'


def missing_state_tensor(index, folder):
    index['train_state']['rng']['torch'] = {'__tensor__': 'train_state.99'}


DECLARED = {
    'rows twice': (rows_twice, f"declares '{WTE}' of shape (48, 32) with chunks that do not cover its 48 rows "
                               f"exactly once"),
    'rows missing': (rows_missing, f"declares '{WTE}' of shape (96, 32) with chunks that do not cover its 96 rows"),
    'one file twice': (one_file_twice, "exactly once, each in a file of its own"),
    '4 TB': (four_terabytes, f"rank-00000.safetensors holds F32 of shape [48, 32] as '{WTE}', which "
                             f"checkpoint.json declares float32 of shape [137438953472, 8]"),
    'other dtype': (lambda index, folder: index['tensors'][WTE].update(dtype='float64'), "declares float64"),
    'file outside': (file_outside, "with chunks that are not ranges of rows in rank-NNNNN.safetensors files"),
    'state tensor': (missing_state_tensor, "its train state names a tensor 'train_state.99' it does not list"),
    'newer version': (lambda index, folder: index.update(version=2), "is of format version 2, which this code does "
                                                                    "not read (it reads version 1)"),
}


def crafted(source, tmp_path, change):
    """A copy of source's sharded checkpoint whose checkpoint.json change(index, folder) rewrote: its folder."""
    folder = folder_of(copy_of(source, tmp_path))
    index = json.loads((folder / 'checkpoint.json').read_text())
    change(index, folder)
    (folder / 'checkpoint.json').write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize('declared', DECLARED)
def test_an_index_declaring_what_the_files_do_not_hold_is_refused_before_allocating(source, tmp_path, declared):
    change, says = DECLARED[declared]
    folder = crafted(source, tmp_path, change)
    message = refusal(folder)
    assert f"sharded checkpoint {folder} is incomplete or corrupt (" in message, message
    assert says.format(folder=folder) in message, message


def test_a_safetensors_file_whose_header_lies_is_refused_by_the_library(source, tmp_path):
    """A header declaring a tensor beyond the file's bytes, or two tensors on the same bytes: the safetensors
    library refuses the file before any tensor is made."""
    folder = folder_of(copy_of(source, tmp_path))
    for header, data in (
            ({WTE: {'dtype': 'F32', 'shape': [10**8, 32], 'data_offsets': [0, 128 * 10**8]}}, bytes(6144)),
            ({WTE: {'dtype': 'F32', 'shape': [48, 32], 'data_offsets': [0, 6144]},
              'model.x': {'dtype': 'F32', 'shape': [48, 32], 'data_offsets': [0, 6144]}}, bytes(6144))):
        (folder / 'rank-00000.safetensors').write_bytes(safetensors_bytes(header, data))
        assert "corrupt (rank-00000.safetensors is not a whole safetensors file (" in refusal(folder)


def holes(path, header_name, rows):
    """A safetensors file at path whose one tensor, header_name of `rows` x 32 float32, lies in holes."""
    nbytes = rows * 32 * 4
    path.write_bytes(safetensors_bytes({header_name: {'dtype': 'F32', 'shape': [rows, 32],
                                                      'data_offsets': [0, nbytes]}}))
    os.truncate(path, path.stat().st_size + nbytes)


def test_sparse_files_do_not_pass_for_data_however_many_there_are(source, tmp_path):
    """os.truncate makes files of any length at once, all holes: two files of 40 MB of holes each (within the
    allowance for one file, beyond it for the folder) holding the token embedding's rows are refused before
    the reader allocates them, by the bytes the files hold on disk."""
    rows = 40 * 10**6 // 128
    folder = crafted(source, tmp_path, lambda index, folder: index['tensors'][WTE].update(
        shape=[2 * rows, 32], chunks=[{'file': 'rank-00001.safetensors', 'rows': [0, rows]},
                                      {'file': 'rank-00002.safetensors', 'rows': [rows, 2 * rows]}]))
    for n in (1, 2):
        holes(folder / f'rank-0000{n}.safetensors', WTE, rows)
    if (folder / 'rank-00001.safetensors').stat().st_blocks * 512 > 10**6:
        pytest.skip("this file system stores holes as data")
    assert 40 * 10**6 < HOLE_SLACK < 80 * 10**6
    message = refusal(folder)  # the other tensors besides: 80.3 MB
    assert "corrupt (checkpoint.json declares 80,3" in message and " bytes of tensors, but the files hold " in message


@pytest.mark.parametrize('name', ['rank-00000.safetensors', 'checkpoint.json'])
@pytest.mark.parametrize('how', ['symbolic link', 'hard link'])
def test_a_file_that_may_be_from_outside_the_folder_is_refused(source, tmp_path, how, name):
    """A link's target is not in the folder (a symbolic one names any file; a hard link is one): not the rank
    files, nor the index, which would describe them (here: another run's, of iteration 777)."""
    out = copy_of(source, tmp_path)
    folder = folder_of(out)
    outside = tmp_path / name
    os.replace(folder / name, outside)
    if name == 'checkpoint.json':
        index = json.loads(outside.read_text())
        outside.write_text(json.dumps({**index, 'train_state': {**index['train_state'], 'iter_num': 777}}))
    if how == 'symbolic link':
        (folder / name).symlink_to(outside)
        says = f"{name} is a link, and is not read: a sharded checkpoint reads only its own files"
    else:
        os.link(outside, folder / name)
        says = f"{name} has 1 other hard link(s), so it may be a file from outside its folder"
    assert says in refusal(folder)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(folder, metadata_only=True)[1]
    assert says in str(e.value)
    os.remove(out / 'ckpt.pt')
    assert checkpoint_path(out) == str(folder) and says in refusal(out)


CUT_WHILE_READ = """
import os, sys
from denoised_gpt import sharded_checkpoint
from denoised_gpt.checkpoint import CheckpointError, read_checkpoint
counted = sharded_checkpoint._data_bytes

def cut_once_open(fd, size):  # (called once the file is open and its header checked)
    os.truncate(sys.argv[1] + '/rank-00000.safetensors', size // 2)
    return counted(fd, size)

sharded_checkpoint._data_bytes = cut_once_open
try:
    read_checkpoint(sys.argv[1])
except CheckpointError as e:
    print(e)
"""


def test_a_file_cut_short_while_it_is_read_is_one_line_not_sigbus(source, tmp_path):
    """A rank file truncated in place once it is open: a mapped file's missing pages kill the reader (SIGBUS,
    no message); the files are read, not mapped, so it is said. Run as a process: a regression dies."""
    folder = folder_of(copy_of(source, tmp_path))
    proc = subprocess.run([sys.executable, '-c', CUT_WHILE_READ, str(folder)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert proc.stdout.strip() == (f"sharded checkpoint {folder} is incomplete or corrupt (rank-00000.safetensors is "
                                   f"shorter than when it was opened: it changed while it was read). No previous "
                                   f"sharded checkpoint exists next to it."), proc.stdout


PEAK_OF_LOAD = """
import resource, sys
from denoised_gpt.checkpoint import CheckpointError, read_checkpoint
try:
    read_checkpoint(sys.argv[1], metadata_only=True)
except CheckpointError as e:
    print(e)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)  # the peak, in MiB
"""


def peak_of_load(folder):
    """read_checkpoint(folder, metadata_only=True) in a fresh process: (its refusal or '', its peak memory in MiB)."""
    proc = subprocess.run([sys.executable, '-c', PEAK_OF_LOAD, str(folder)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    *message, peak = proc.stdout.splitlines()
    return ''.join(message), int(peak)


@pytest.mark.parametrize('mib', [15, 60])
def test_an_index_whose_train_state_is_huge_is_refused_before_it_is_parsed(source, tmp_path, mib):
    """A train state of 2-byte JSON values: some 32 bytes of Python objects per byte parsed (60 MiB: 3.2 GB and a
    minute). An index is capped at what a real one needs, in bytes and in values, so parsing stays small."""
    folder = folder_of(copy_of(source, tmp_path))
    index = json.loads((folder / 'checkpoint.json').read_text())
    index['train_state']['padding'] = []
    text = json.dumps(index).replace('"padding": []', '"padding": [' + '0,' * (mib << 19) + '0]')
    (folder / 'checkpoint.json').write_text(text)
    message, peak = peak_of_load(folder)
    says = "holds 7,86" if mib == 15 else "checkpoint.json is larger than 16 MiB, which no index is"
    assert message.startswith(f"sharded checkpoint {folder} is incomplete or corrupt (") and says in message, message
    assert peak < peak_of_load(folder_of(source))[1] + 100


@pytest.mark.slow
def test_a_fifo_in_the_folder_is_one_line_not_a_hang(source, tmp_path):
    """Opening a FIFO waits for a writer that never comes: refused as what it is. Run as a process with a time
    limit: a regression hangs."""
    out = copy_of(source, tmp_path)
    os.remove(out / 'ckpt.pt')
    path = folder_of(out) / 'rank-00000.safetensors'
    os.remove(path)
    os.mkfifo(path)
    proc = subprocess.run([sys.executable, 'sample.py', f'--out_dir={out}', '--device=cpu'], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"sample.py: error: sharded checkpoint file {path} is a FIFO, not a regular file, "
                                  f"and is not read"), proc.stderr


def test_a_fifo_swapped_in_after_the_file_is_opened_is_never_read(source, tmp_path, monkeypatch):
    """Each file is checked as the open file it is, and read through that: a FIFO put in its place once it is
    open (the moment after any check by name) changes nothing. A regression hangs: SIGALRM ends it."""
    folder = folder_of(copy_of(source, tmp_path))
    opened = sharded_checkpoint.open_regular

    def open_then_swap(path, *args, **kwargs):
        f = opened(path, *args, **kwargs)
        if str(path).endswith('.safetensors'):
            os.replace(path, str(path) + '.aside')
            os.mkfifo(path)
        return f

    monkeypatch.setattr(sharded_checkpoint, 'open_regular', open_then_swap)

    with ends_if_it_hangs(60, "the reader opened the FIFO"):
        loaded = read_checkpoint(folder)[1]
    assert (folder / 'rank-00000.safetensors').is_fifo()
    assert_same_checkpoint(loaded, read_checkpoint(source / 'ckpt.pt')[1])


def test_an_adamw_step_that_is_no_count_is_refused_by_an_fsdp_resume(source, tmp_path):
    """load_sharded_state (every rank of an fsdp resume) reads AdamW's step as it is: one below zero made every
    update NaN. Refused in one line, as a ckpt.pt's is."""
    from safetensors.torch import load_file, save_file
    folder = folder_of(copy_of(source, tmp_path))
    name = 'optimizer.transformer.wte.weight.step'
    tensors = load_file(folder / 'rank-00000.safetensors')
    tensors[name] = torch.tensor(-3.0)
    save_file(tensors, folder / 'rank-00000.safetensors')
    model = tiny_gpt('noiseformer_v1', seed=1)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    with pytest.raises(CheckpointError) as e:
        load_sharded_state(str(folder), model, optimizer)
    assert str(e.value) == (f"cannot resume from the sharded checkpoint {folder} (its {name} is -3, not a count of "
                            f"updates (AdamW's bias correction would make every update non-finite))")


# ----------------------------------------------------------------------------------------------
# ckpt.pt: nanoGPT's format (torch.save's zip) keeps its layout; parts that overlap or inflate are refused

def rewritten_zip(path, compress_type=zipfile.ZIP_STORED):
    """The torch.save zip at path written again by zipfile (its parts in order, compress_type)."""
    with zipfile.ZipFile(path) as archive:
        parts = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, 'w', compress_type) as archive:
        for name, data in parts:
            archive.writestr(name, data)


def point_last_part_at_the_first(path):
    """The central directory's last entry points at the first part's local header: one byte counted twice."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        start, count = archive.start_dir, len(archive.infolist())
    pos = start
    for _ in range(count - 1):  # each entry: 46 bytes and its name, extra and comment
        name, extra, comment = struct.unpack('<HHH', data[pos + 28:pos + 34])
        pos += 46 + name + extra + comment
    data[pos + 42:pos + 46] = struct.pack('<I', 0)
    path.write_bytes(bytes(data))


def test_a_ckpt_pt_whose_parts_overlap_or_inflate_is_refused_before_torch_reads_it(source, tmp_path, monkeypatch):
    path = tmp_path / 'ckpt.pt'
    shutil.copy(source / 'ckpt.pt', path)
    rewritten_zip(path)
    assert read_checkpoint(path)[1]['iter_num'] == 7  # zipfile's own layout of the same parts loads
    point_last_part_at_the_first(path)
    assert "holds parts that overlap (" in refusal(path)

    # a deflated ckpt.pt (newer) beside a sharded checkpoint: choosing between them inflates nothing
    out = copy_of(source, tmp_path / 'beside')
    checkpoint = read_checkpoint(out / 'ckpt.pt')[1]
    save_checkpoint({**checkpoint, 'iter_num': 9}, out)
    rewritten_zip(out / 'ckpt.pt', zipfile.ZIP_DEFLATED)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(checkpoint_module.torch, 'load', lambda *a, **k: loads.append(a) or real_load(*a, **k))
    assert checkpoint_path(out) == str(out / 'ckpt.pt') and loads == []
    monkeypatch.undo()
    assert "compressed or larger than the file" in refusal(out)


@pytest.mark.slow
def test_a_counter_nesting_a_huge_structure_is_named_in_a_short_line(source, tmp_path):
    """A ckpt.pt of kilobytes whose iter_num is a list nesting itself 2^60 times over (a pickle shares it): its
    repr would never end, and a walk of it (a conversion to JSON) would build 2^60 lists. Refused before it is
    built, in a short line. Run as a process with a time limit."""
    script = f"""
import torch
from denoised_gpt.checkpoint import CheckpointError, read_checkpoint
checkpoint = torch.load({str(source / 'ckpt.pt')!r}, weights_only=True)
x = []
for _ in range(60):
    x = [x, x]
torch.save({{**checkpoint, 'iter_num': x}}, {str(tmp_path / 'ckpt.pt')!r})
try:
    read_checkpoint({str(tmp_path)!r})
except CheckpointError as e:
    print(e)
"""
    proc = subprocess.run([sys.executable, '-c', script], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"checkpoint {tmp_path / 'ckpt.pt'} would build more than " in proc.stdout, proc.stdout
    assert len(proc.stdout) < 600, proc.stdout
