"""Files a user loads that would run code if unpickled as they are: a sharded checkpoint's .metadata (which
torch's own DCP reader unpickles with plain pickle), its train_state.pt and its shards, a ckpt.pt, a GPT-2
folder's pytorch_model.bin. Each is refused in one line that says the file holds code (never "corrupt",
never torch's advice to load it with weights_only=False), before the payload runs, by the library and by
the scripts that read it. A real sharded checkpoint (model, AdamW state, bf16 weights) still loads through
the restricted reader, and a truncated checkpoint is one short line naming the fallback."""
import dataclasses
import io
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from denoised_gpt.sharded_checkpoint import checkpoint_as_sharded, load_sharded_state, read_metadata, save_sharded
from helpers import ROOT, make_dataset, run_script_in_process, subprocess_env, tiny_gpt
from test_sample import CreatesFile
from test_sharded_checkpoint import assert_same_checkpoint, trained_checkpoint

ATTN = 'noiseformer_v1'  # trained_checkpoint's model


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    """An out_dir holding a trained ckpt.pt (iter 7) and the same checkpoint sharded (as new: the one read)."""
    out = tmp_path_factory.mktemp('untrusted') / 'out'
    save_sharded(*checkpoint_as_sharded(trained_checkpoint(out, iter_num=7, attn_type=ATTN)), out)
    return out


def folder_of(out):
    return out / 'ckpt.sharded-0000007'


# ----------------------------------------------------------------------------------------------
# payloads: each makes `marker` exist when its file is unpickled without restriction

def metadata_payload(folder, marker):
    with open(folder / '.metadata', 'wb') as f:
        pickle.dump(CreatesFile(marker), f)


def train_state_payload(folder, marker):
    state = torch.load(folder / 'train_state.pt', weights_only=True)
    torch.save({**state, 'extra': CreatesFile(marker)}, folder / 'train_state.pt')


def _point_at_payload(folder, marker, as_bytes):
    """The shard's first weight, in .metadata, pointed at a pickled payload appended to the shard: as a
    tensor record (DCP reads those with weights_only), or as a bytes entry (DCP's torch.load of those
    runs code)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    with open(folder / '.metadata', 'rb') as f:
        metadata = pickle.load(f)  # written by save_sharded just now: trusted
    shard = folder / '__0_0.distcp'
    payload = io.BytesIO()  # as long as the weight it stands for: a shorter record is refused before it is read
    torch.save({'payload': CreatesFile(marker), 'padding': torch.zeros(48 * 32)}, payload)
    offset = shard.stat().st_size
    with open(shard, 'ab') as f:
        f.write(payload.getvalue())
    fqn = 'model.transformer.wte.weight'
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    where = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    if as_bytes:
        metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
        index = MetadataIndex(fqn)
    metadata.storage_data[index] = where
    with open(folder / '.metadata', 'wb') as f:
        pickle.dump(metadata, f)


def shard_payload(folder, marker):
    _point_at_payload(folder, marker, as_bytes=False)


def bytes_entry_payload(folder, marker):
    _point_at_payload(folder, marker, as_bytes=True)


PAYLOADS = {'.metadata': metadata_payload, 'train_state.pt': train_state_payload, 'shard': shard_payload,
            'bytes entry': bytes_entry_payload}


@pytest.fixture
def evil(source, tmp_path, request):
    """(out_dir, marker): a copy of source whose sharded checkpoint carries request.param's payload."""
    out, marker = tmp_path / 'out', tmp_path / 'marker'
    shutil.copytree(source, out)
    PAYLOADS[request.param](folder_of(out), marker)
    return out, marker


def assert_refused(message, marker):
    """One line saying the file holds code, the payload not run, nothing unsafe advised."""
    assert not marker.exists(), "the payload ran"
    assert len(message.strip().splitlines()) == 1, message
    assert "not loaded because unpickling them can run code" in message, message
    assert "corrupt" not in message, message
    assert "weights_only" not in message and "still be loaded" not in message, message  # torch's advice


def test_the_payloads_are_live(source, tmp_path):
    """torch's own reader runs a crafted .metadata: what every test below guards against."""
    from torch.distributed.checkpoint import FileSystemReader
    folder = tmp_path / 'folder'
    shutil.copytree(folder_of(source), folder)
    metadata_payload(folder, tmp_path / 'marker')
    FileSystemReader(folder).read_metadata()
    assert (tmp_path / 'marker').exists()


# ----------------------------------------------------------------------------------------------
# the library

LOADS = {
    'load_checkpoint': lambda out: load_checkpoint(out),
    'model_only': lambda out: load_checkpoint(out, model_only=True),
    'the folder itself': lambda out: load_checkpoint(folder_of(out)),
    'metadata_only': lambda out: load_checkpoint(out, metadata_only=True),  # reads train_state.pt alone
}
EVERY_PAYLOAD = pytest.mark.parametrize('evil', list(PAYLOADS), indirect=True)


@pytest.mark.parametrize('evil,load', [(p, load) for p in PAYLOADS for load in LOADS if load != 'metadata_only']
                         + [('train_state.pt', 'metadata_only')], indirect=['evil'])
def test_load_checkpoint_refuses_in_one_line(evil, load):
    out, marker = evil
    with pytest.raises(CheckpointError) as e:
        LOADS[load](out)
    assert_refused(str(e.value), marker)


@EVERY_PAYLOAD
def test_the_newest_is_chosen_and_refused_even_with_a_good_ckpt_pt_beside_it(evil):
    out, marker = evil
    assert (out / 'ckpt.pt').is_file()
    assert checkpoint_path(out) == str(folder_of(out))  # as new as ckpt.pt; choosing it runs nothing
    assert not marker.exists()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(out)
    assert_refused(str(e.value), marker)


# load_sharded_state is collective: train.py calls it under a process group; here one process calls it
# on purpose, and DCP warns that it assumes a single process
SINGLE_PROCESS_DCP = pytest.mark.filterwarnings('ignore:torch.distributed is (disabled, )?unavailable:UserWarning')


@pytest.mark.parametrize('evil', ['.metadata', 'shard', 'bytes entry'], indirect=True)
@SINGLE_PROCESS_DCP
def test_an_fsdp_resume_refuses_in_one_line(evil):
    """load_sharded_state, what train.py --init_from=resume --parallel=fsdp runs on every rank (here in
    one process, with a plain model and optimizer)."""
    out, marker = evil
    model = tiny_gpt(ATTN)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    with pytest.raises(CheckpointError) as e:
        load_sharded_state(str(folder_of(out)), model, optimizer)
    assert_refused(str(e.value), marker)


@SINGLE_PROCESS_DCP
def test_a_real_sharded_checkpoint_loads_through_the_restricted_reader(source, tmp_path):
    """Everything torch writes into .metadata is admitted: the same Metadata as plain pickle reads, for
    model and AdamW state in float32 and bfloat16; load_checkpoint and load_sharded_state read it all."""
    original = load_checkpoint(source / 'ckpt.pt')
    bf16 = dict(original, model={k: v.to(torch.bfloat16) for k, v in original['model'].items()})
    bf16['model']['lm_head.weight'] = bf16['model']['transformer.wte.weight']
    folder = save_sharded(*checkpoint_as_sharded(bf16), tmp_path)
    with open(os.path.join(folder, '.metadata'), 'rb') as f:
        assert read_metadata(os.path.join(folder, '.metadata')) == pickle.load(f)
    loaded = load_checkpoint(folder)
    assert all(v.dtype == torch.bfloat16 for v in loaded['model'].values())
    assert_same_checkpoint(loaded, bf16)
    assert_same_checkpoint(load_checkpoint(source), original)

    model = tiny_gpt(ATTN, seed=1)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    load_sharded_state(str(folder_of(source)), model, optimizer)
    assert all(torch.equal(p, original['model'][n]) for n, p in model.state_dict().items())
    state = optimizer.state[model.transformer.wte.weight]
    saved = original['optimizer']['state'][original['optimizer_param_names'][0].index('transformer.wte.weight')]
    assert all(torch.equal(state[k], saved[k]) for k in ('step', 'exp_avg', 'exp_avg_sq'))


# ----------------------------------------------------------------------------------------------
# the scripts

SCRIPTS = {
    'sample.py': ['--out_dir={out}', '--device=cpu'],
    'eval.py': ['--out_dir={out}', '--val_loss=True', '--device=cpu'],
    'eval.py --compare_to': ['--out_dir={tmp}/good', '--compare_to={out}', '--entropy=True', '--device=cpu'],
    'convert_checkpoint.py': ['--out_dir={out}'],
    'grow.py': ['--out_dir={out}', '--grow_to=32', '--out={tmp}/grown'],
    'export_hf.py': ['--out_dir={out}', '--hf_dir={tmp}/hf'],
    'train.py resume': ['--init_from=resume', '--out_dir={out}', '--device=cpu'],
    'train.py init_from': ['--init_from={out}', '--out_dir={tmp}/new', '--dataset={data}', '--device=cpu'],
}


@pytest.mark.parametrize('evil', ['.metadata', 'train_state.pt'], indirect=True)
@pytest.mark.parametrize('command', SCRIPTS)
def test_every_script_refuses_in_one_line(evil, command, source, tmp_path):
    out, marker = evil
    assert_refused(refusal_of(command, out, source, tmp_path), marker)


def refusal_of(command, out, source, tmp_path, *more):
    """SCRIPTS[command] run on out_dir `out`: its one error line (exit status 2, nothing written)."""
    if command == 'eval.py --compare_to':
        shutil.copytree(source, tmp_path / 'good')
    data = make_dataset(tmp_path) if command == 'train.py init_from' else None
    script = command.split()[0]
    args = [a.format(out=out, tmp=tmp_path, data=data) for a in SCRIPTS[command]] + list(more)
    if script == 'train.py':
        args.insert(0, str(ROOT / 'tests' / 'config_tiny.py'))
    proc = run_script_in_process(script, args)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"{script}: error: "), proc.stderr
    assert not (tmp_path / 'hf').exists() and not (tmp_path / 'grown').exists()
    return errors[0]


@pytest.mark.parametrize('evil', ['.metadata'], indirect=True)
def test_a_process_prints_the_refusal_alone(evil):
    """The whole stderr of a real process: no warning, log line or traceback from DCP around the refusal."""
    out, marker = evil
    proc = subprocess.run([sys.executable, 'convert_checkpoint.py', f'--out_dir={out}'], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("convert_checkpoint.py: error: "), proc.stderr
    assert_refused(proc.stderr, marker)


# ----------------------------------------------------------------------------------------------
# the other files a user loads

def test_a_ckpt_pt_holding_code_is_refused_without_torchs_advice(source, tmp_path):
    marker = tmp_path / 'marker'
    checkpoint = torch.load(source / 'ckpt.pt', weights_only=True)
    torch.save({**checkpoint, 'extra': CreatesFile(marker)}, tmp_path / 'ckpt.pt')
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert_refused(str(e.value), marker)
    assert "io.open" in str(e.value)  # what it references, named


def gpt2_folder(folder, marker):
    """A tiny GPT-2 saved by transformers, its weights in a pytorch_model.bin that also holds a payload."""
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_positions=32, vocab_size=48, n_layer=1, n_head=2, n_embd=16,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(folder)
    os.remove(folder / 'model.safetensors')
    torch.save({**model.state_dict(), 'extra': CreatesFile(marker)}, folder / 'pytorch_model.bin')
    return folder


@pytest.mark.parametrize('script', ['sample.py', 'train.py'])
def test_a_gpt2_folder_holding_code_is_refused_in_one_line(script, tmp_path):
    marker = tmp_path / 'marker'
    folder = gpt2_folder(tmp_path / 'gpt2', marker)
    args = ([f'--init_from={folder}', '--device=cpu'] if script == 'sample.py' else
            [str(ROOT / 'tests' / 'config_tiny.py'), f'--init_from={folder}', f'--out_dir={tmp_path / "out"}',
             f'--dataset={make_dataset(tmp_path)}', '--device=cpu', '--attn_type=base'])
    proc = run_script_in_process(script, args)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{script}: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert_refused(errors[0], marker)
    assert "weights_only" not in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------
# what else a sharded folder's files could make the reader do: read files outside the folder, change a
# class for the whole process, allocate far more than the folder holds, or wait forever

WTE = 'model.transformer.wte.weight'


def crafted(source, tmp_path, change):
    """A copy of source's sharded checkpoint whose .metadata change(metadata, folder) rewrote: its folder."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    folder = folder_of(out)
    with open(folder / '.metadata', 'rb') as f:
        metadata = pickle.load(f)  # written by save_sharded just now: trusted
    change(metadata, folder)
    with open(folder / '.metadata', 'wb') as f:
        pickle.dump(metadata, f)
    return folder


def set_record(metadata, fqn, **fields):
    """The record (file, offset, length...) of fqn's only chunk, with fields replaced."""
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **fields)


def saved(obj):
    data = io.BytesIO()
    torch.save(obj, data)
    return data.getvalue()


def append_record(metadata, folder, data):
    """data appended to the shard, the token embedding's record."""
    with open(folder / '__0_0.distcp', 'ab') as f:
        offset = f.tell()
        f.write(data)
    set_record(metadata, WTE, offset=offset, length=len(data))


def assert_one_line(e, *parts):
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    assert all(part in message for part in parts), message


OUTSIDE = {'absolute path': None, 'dot-dot': '../outside.distcp', 'link': 'link.distcp'}  # (None: its path)


@pytest.mark.parametrize('how', OUTSIDE)
def test_a_shard_outside_the_folder_is_refused_before_it_is_read(source, tmp_path, how):
    """Records that name a copy of the real shard outside the folder (reading it would load fine): a sharded
    checkpoint reads only the regular files in its own folder, whatever its .metadata names. A link to a
    file inside the folder is read as that file."""
    outside = tmp_path / 'out' / 'outside.distcp'  # beside the checkpoint's folder
    name = OUTSIDE[how] or str(outside)

    def point_outside(metadata, folder):
        shutil.copy(folder / '__0_0.distcp', outside)
        if how == 'link':
            (folder / name).symlink_to(outside)
        for index in metadata.storage_data:
            set_record(metadata, index.fqn, relative_path=name)

    folder = crafted(source, tmp_path, point_outside)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    if how != 'link':
        assert_one_line(e, f"sharded checkpoint file {folder / '.metadata'} names {name!r} as a shard, which is not "
                           f"a file in its folder and is not read")
        return
    assert_one_line(e, f"sharded checkpoint file {folder / name} is a link to {outside}, outside its folder, and is "
                       f"not read: copy that file into the folder in place of the link")
    os.remove(folder / name)
    os.replace(outside, folder / 'real.distcp')
    (folder / name).symlink_to('real.distcp')
    assert_same_checkpoint(load_checkpoint(folder), load_checkpoint(source / 'ckpt.pt'))


def pickle_string(text):
    return b'X' + len(text).to_bytes(4, 'little') + text.encode()  # BINUNICODE


# objects every later use in the process shares: (the object; a pickle that gets it, as a .metadata can, and
# sets one of its attributes by BUILD; what the refusal names)
MEM_FORMAT = 'torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING'
SHARED_OBJECTS = {
    'a class': (lambda: pathlib.PosixPath,
                b'cpathlib\nPosixPath\n'  # GLOBAL; state (None, {...}): setattr
                + b'N}' + pickle_string('_str') + pickle_string('set by a checkpoint') + b's\x86b',
                'pathlib.PosixPath'),
    'an enum member': (lambda: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
                       b'c' + MEM_FORMAT.replace('._', '\n_').encode() + b'\nK\x00\x85R'  # _MEM_FORMAT_ENCODING(0)
                       + b'}' + pickle_string('_name_') + pickle_string('set by a checkpoint') + b'sb',  # its __dict__
                       f"what {MEM_FORMAT} returns"),
}


@pytest.mark.parametrize('target', SHARED_OBJECTS)
def test_metadata_that_sets_attributes_of_a_shared_object_is_refused_and_changes_nothing(source, tmp_path, target):
    """Ahead of DCP's own metadata, a pickle that gets an object every later use in the process shares and
    BUILDs on it: refused in one line, and the object is as it was (pathlib paths still print as themselves)."""
    obj, build, what = SHARED_OBJECTS[target]
    obj = obj()
    folder = crafted(source, tmp_path, lambda metadata, folder: None)
    data = (folder / '.metadata').read_bytes()
    (folder / '.metadata').write_bytes(data[:2] + build + b'0' + data[2:])  # PROTO, the BUILD, POP, the rest
    before = dict(vars(obj))
    try:
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(folder)
        assert dict(vars(obj)) == before
        assert str(pathlib.Path('/a') / 'b') == '/a/b'
    finally:  # what a regression would leave for the tests after this one
        for name in set(vars(obj)) - set(before):
            delattr(obj, name)
        if target == 'an enum member':
            vars(obj).update(before)
    assert_one_line(e, f"sharded checkpoint file {folder / '.metadata'} sets attributes of {what}, which would change "
                       f"it for the whole process")


def declare_4tb(metadata, folder):
    entry = metadata.state_dict_metadata[WTE]
    entry.size = entry.chunks[0].sizes = torch.Size([10**6, 10**6])


def declare_4tb_in_one_chunk(metadata, folder):
    metadata.state_dict_metadata[WTE].size = torch.Size([10**6, 10**6])


def stride_0_record(metadata, folder):
    append_record(metadata, folder, saved(torch.zeros(1).expand(48, 32)))  # one float's storage


def deflated_record(metadata, folder):
    """The record of a tensor of 20 MB deflated to a few KB: torch.load inflates it before any check."""
    deflated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved(torch.zeros(5 * 10**6)))) as stored, zipfile.ZipFile(deflated, 'w') as out:
        for name in stored.namelist():
            out.writestr(name, stored.read(name), compress_type=zipfile.ZIP_DEFLATED)
    append_record(metadata, folder, deflated.getvalue())


DECLARED = {  # the crafted .metadata, what its refusal says
    '4 TB': (declare_4tb, f"declares {WTE}[0, 0] of shape (1000000, 1000000) (4,000,000,000,000 bytes) in "
                          f"(1000000, 1000000), but its record holds"),
    '4 TB, chunk as saved': (declare_4tb_in_one_chunk, f"declares {WTE} of shape (1000000, 1000000), but its chunks "
                                                       f"do not cover it exactly once"),
    'stride 0': (stride_0_record, "(6,144 bytes) in (48, 32), but its record holds"),
    'deflated': (deflated_record, "of __0_0.distcp holds archive/data.pkl compressed or larger than the file"),
}


@pytest.mark.parametrize('declared', DECLARED)
def test_metadata_declaring_more_than_its_records_hold_is_refused_before_allocating(source, tmp_path, declared):
    """The reader allocates every declared tensor, then torch.loads each record: a weight declared 4 TB, or
    declared at its true size but read from a record of one float (a stride-0 tensor saved as itself) or from a
    deflated record that inflates to 20 MB, is refused in one line before anything is allocated."""
    change, says = DECLARED[declared]
    folder = crafted(source, tmp_path, change)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    assert_one_line(e, f"sharded checkpoint {folder} is incomplete or corrupt (ValueError: ", says)


def test_a_sparse_shard_does_not_pass_for_data(source, tmp_path):
    """os.truncate makes a shard 400 MB long at once, all holes: the weight declared 400 MB, its record over
    the holes, is refused before the reader allocates it, by the bytes the shard holds on disk."""
    def over_holes(metadata, folder):
        shard = folder / '__0_0.distcp'
        end = shard.stat().st_size
        os.truncate(shard, end + 400 * 10**6)
        set_record(metadata, WTE, offset=end, length=400 * 10**6)
        entry = metadata.state_dict_metadata[WTE]
        entry.size = entry.chunks[0].sizes = torch.Size([10**8 // 32, 32])  # 10^8 float32

    folder = crafted(source, tmp_path, over_holes)
    if (folder / '__0_0.distcp').stat().st_blocks * 512 > 400 * 10**6:
        pytest.skip("this file system stores holes as data")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    assert_one_line(e, "(ValueError: .metadata declares 400,", " bytes of records in __0_0.distcp, which holds ",
                    " bytes of data (the rest are holes in a sparse file))")


def test_a_transformed_record_is_refused(source, tmp_path):
    """DCP can declare a record compressed (zstd): it would be inflated, unbounded, before any check. Sharded
    checkpoints here are never written so: refused in one line."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    if 'transform_descriptors' not in {f.name for f in dataclasses.fields(_StorageInfo)}:
        pytest.skip("this torch's DCP has no transforms")
    folder = crafted(source, tmp_path, lambda metadata, folder: set_record(metadata, WTE,
                                                                          transform_descriptors=['stream.zstd/1']))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    assert_one_line(e, f"sharded checkpoint file {folder / '.metadata'} declares the record of {WTE} transformed "
                       f"(stream.zstd/1), which is not read")


def test_a_legacy_train_state_is_refused(source, tmp_path):
    """torch.load's legacy format allocates each storage at the size the file declares before reading it;
    save_sharded never writes it."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    path = folder_of(out) / 'train_state.pt'
    torch.save(torch.load(path, weights_only=True), path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(out)
    assert_one_line(e, "incomplete or corrupt (ValueError: train_state.pt is in torch.save's legacy format")


def test_a_legacy_ckpt_pt_is_refused_and_the_conversion_it_names_makes_it_load(source, tmp_path):
    """A ckpt.pt in torch.save's legacy format: refused before torch.load allocates the sizes it declares
    (neither train.py nor nanoGPT writes it); the command the message gives converts it to a loadable file."""
    path = tmp_path / 'ckpt.pt'
    torch.save(torch.load(source / 'ckpt.pt', weights_only=True), path, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert_one_line(e, f"checkpoint {path} is in torch.save's legacy format, which is not read")
    command = re.search(r'python3 -c "(.*)"$', str(e.value)).group(1)
    subprocess.run([sys.executable, '-c', command], check=True, env=subprocess_env(), timeout=120)
    assert zipfile.is_zipfile(path)
    converted, original = load_checkpoint(tmp_path), load_checkpoint(source / 'ckpt.pt')
    assert converted['model'].keys() == original['model'].keys()
    assert all(torch.equal(converted['model'][k], v) for k, v in original['model'].items())
    assert {k: converted[k] for k in ('model_args', 'iter_num', 'config')} == \
           {k: original[k] for k in ('model_args', 'iter_num', 'config')}


@pytest.mark.parametrize('name', ['.metadata', '__0_0.distcp', 'train_state.pt'])
def test_a_fifo_in_the_folder_is_one_line_not_a_hang(source, tmp_path, name):
    """Opening a FIFO waits for a writer that never comes (a shard, .metadata), and a train_state.pt that is
    one made the folder look like no checkpoint at all: each is refused by stat, before it is opened. Run as
    a process, with a time limit: a regression hangs."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    os.remove(out / 'ckpt.pt')
    path = folder_of(out) / name
    os.replace(path, path.parent / 'aside.distcp')  # its bytes still in the folder, under a name nothing reads
    os.mkfifo(path)
    proc = subprocess.run([sys.executable, 'sample.py', f'--out_dir={out}', '--device=cpu'], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"sample.py: error: sharded checkpoint file {path} is a FIFO, not a regular file, "
                                  f"and is not read"), proc.stderr


def test_a_truncated_checkpoint_is_one_short_line_naming_the_fallback(source, tmp_path):
    """torch's zip reader goes on for lines after its first sentence: only that sentence is kept."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    shutil.copy(out / 'ckpt.pt', out / 'ckpt.prev.pt')
    data = (out / 'ckpt.pt').read_bytes()
    (out / 'ckpt.pt').write_bytes(data[:len(data) // 2])
    with pytest.raises(Exception) as torch_error:
        torch.load(out / 'ckpt.pt', weights_only=True)
    first_sentence = re.split(r'\.\s', str(torch_error.value))[0]
    # torch 2.13's line says more than its first sentence (torch 2.6's is that sentence alone)
    assert len(first_sentence) <= len(str(torch_error.value).splitlines()[0])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(out / 'ckpt.pt')
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "truncated or corrupt" in message
    assert f"(RuntimeError: {first_sentence}). The previous checkpoint {out / 'ckpt.prev.pt'} was kept" in message

    folder = folder_of(out)
    state = (folder / 'train_state.pt').read_bytes()
    (folder / 'train_state.pt').write_bytes(state[:len(state) // 2])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    assert len(str(e.value).splitlines()) == 1
    assert f"incomplete or corrupt (RuntimeError: {first_sentence}). No previous sharded" in str(e.value)


# ----------------------------------------------------------------------------------------------
# counters of another type than train.py writes: refused on load, never a TypeError mid-run

def with_counter(source, tmp_path, kind, key, value):
    """A copy of source whose ckpt.pt (kind 'ckpt.pt': the sharded checkpoint removed) or sharded
    checkpoint's train_state.pt (kind 'sharded') holds `value` under key."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    if kind == 'ckpt.pt':
        shutil.rmtree(folder_of(out))
        (out / 'ckpt.sharded').unlink()
        path = out / 'ckpt.pt'
    else:
        path = folder_of(out) / 'train_state.pt'
    torch.save({**torch.load(path, weights_only=True), key: value}, path)
    return out


@pytest.mark.parametrize('kind', ['ckpt.pt', 'sharded'])
@pytest.mark.parametrize('command', SCRIPTS)
def test_every_script_refuses_a_checkpoint_whose_iter_num_is_a_string_in_one_line(kind, command, source, tmp_path):
    out = with_counter(source, tmp_path, kind, 'iter_num', '7')
    to_sharded = ['--to=sharded'] if command.startswith('convert_checkpoint.py') and kind == 'ckpt.pt' else []
    error = refusal_of(command, out, source, tmp_path, *to_sharded)
    where = out / 'ckpt.pt' if kind == 'ckpt.pt' else folder_of(out)
    assert f"{where} is not as train.py writes one: its iter_num is '7' (a str), not a non-negative integer" \
        in error, error


@pytest.mark.parametrize('key, value, expected', [
    ('best_val_loss', 'low', "best_val_loss is 'low' (a str), not a number"),
    ('best_val_loss', True, "best_val_loss is True (a bool), not a number"),
    ('iter_num', -1, "iter_num is -1 (a int), not a non-negative integer"),
    ('best_iter', 2.0, "best_iter is 2.0 (a float), not a non-negative integer or null"),
    ('val_loss', [1.5], "val_loss is [1.5] (a list), not a number or null"),
    ('train_time', None, "train_time is None (a NoneType), not a number"),
    ('config', 'x', "config is 'x' (a str), not a dict"),
])
def test_load_checkpoint_names_a_counter_of_the_wrong_type(source, tmp_path, key, value, expected):
    for kind in ('ckpt.pt', 'sharded'):
        out = with_counter(source, tmp_path / kind, kind, key, value)
        for metadata_only in (False, True):
            with pytest.raises(CheckpointError) as e:
                load_checkpoint(out, metadata_only=metadata_only)
            assert expected in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
    # what train.py and nanoGPT write loads: nanoGPT's best_val_loss is the 0-d tensor of its evaluation
    out = with_counter(source, tmp_path / 'nanogpt', 'ckpt.pt', 'best_val_loss', torch.tensor(2.5))
    assert load_checkpoint(out)['best_val_loss'] == 2.5


# ----------------------------------------------------------------------------------------------
# an exported folder's JSON files (export_hf.py writes them; sample.py, eval.py and train.py read them back)

@pytest.fixture(scope='module')
def exported(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp('exported') / 'hf'
    proc = run_script_in_process('export_hf.py', [f'--out_dir={source / "ckpt.pt"}', f'--hf_dir={folder}'])
    assert proc.returncode == 0, proc.stderr
    return folder


@pytest.mark.parametrize('name, content, expected', [
    ('config.json', '{"a": ' * 100_000 + '1' + '}' * 100_000, "config.json is not valid JSON (nested too deeply)"),
    ('training_run.json', '[' * 100_000 + ']' * 100_000, "training_run.json is not valid JSON (nested too deeply)"),
    ('training_run.json', '{"iter_num": "7", "best_val_loss": 2.5, "config": {}}',
     "training_run.json is not as export_hf.py writes it: its iter_num is '7' (a str), not a non-negative integer"),
], ids=['config.json nested', 'training_run.json nested', 'iter_num a string'])
@pytest.mark.parametrize('script, args', [
    ('sample.py', ['--num_samples=1', '--max_new_tokens=2']),
    ('eval.py', ['--val_loss=True']),
    ('train.py', [str(ROOT / 'tests' / 'config_tiny.py'), '--out_dir={tmp}/new', '--dataset={data}']),
])
def test_a_damaged_json_file_of_an_exported_folder_is_one_line(exported, tmp_path, name, content, expected, script,
                                                              args):
    folder = tmp_path / 'hf'
    shutil.copytree(exported, folder)
    (folder / name).write_text(content)
    data = make_dataset(tmp_path) if script == 'train.py' else None
    proc = run_script_in_process(script, [f'--init_from={folder}', '--device=cpu',
                                          *[a.format(tmp=tmp_path, data=data) for a in args]])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"{script}: error: {folder}/{expected}; export the model again"
    assert not (tmp_path / 'new').exists()


@pytest.mark.parametrize('pointer', ['elsewhere', 'fifo', 'link out'])
def test_the_pointer_to_the_newest_sharded_checkpoint_names_a_folder_of_the_run_or_is_refused(source, tmp_path,
                                                                                               pointer):
    """out_dir/ckpt.sharded names the newest sharded folder: one naming a folder elsewhere (another run's
    checkpoint, read and perhaps exported through this one) is not followed, and one that is a FIFO does not
    hang the reader; scripts say so in one line."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    elsewhere = tmp_path / 'other-run'
    shutil.copytree(folder_of(out), elsewhere / 'ckpt.sharded-0000099')
    (out / 'ckpt.pt').unlink()
    if pointer == 'elsewhere':
        (out / 'ckpt.sharded').write_text('../other-run/ckpt.sharded-0000099\n')
    elif pointer == 'link out':
        (out / 'ckpt.sharded-0000099').symlink_to(elsewhere / 'ckpt.sharded-0000099')
        (out / 'ckpt.sharded').write_text('ckpt.sharded-0000099\n')
    else:
        (out / 'ckpt.sharded').unlink()
        os.mkfifo(out / 'ckpt.sharded')
    for script, args in (('sample.py', ['--num_samples=1', '--max_new_tokens=2']), ('eval.py', ['--val_loss=True'])):
        proc = subprocess.run([sys.executable, script, f'--out_dir={out}', '--device=cpu', *args], cwd=ROOT,
                              env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"{script}: error: {out / 'ckpt.sharded'} "), last
        assert ("is a FIFO, not the file naming" if pointer == 'fifo' else "folder in") in last, last
