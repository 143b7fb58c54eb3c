"""Files a user loads that would run code if unpickled as they are, or make a reader allocate more than they
hold: a ckpt.pt, a GPT-2 folder's pytorch_model.bin, an exported folder's JSON files, and sharded checkpoints
of the earlier format (torch.distributed.checkpoint's pickled .metadata, which torch's own reader unpickles
with plain pickle). Each is refused in one line that says what the file is or holds (never "corrupt" for
code, never torch's advice to load it with weights_only=False), before any payload runs, by the library and
by the scripts that read it. The sharded format's own checks: test_sharded_format.py."""
import inspect
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

from denoised_gpt import checkpoint as checkpoint_module
from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, read_checkpoint
from denoised_gpt.sharded_checkpoint import checkpoint_as_sharded, save_sharded
from helpers import ROOT, ends_if_it_hangs, make_dataset, run_script_in_process, subprocess_env
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


def assert_refused(message, marker):
    """One line saying the file holds code, the payload not run, nothing unsafe advised."""
    assert not marker.exists(), "the payload ran"
    assert len(message.strip().splitlines()) == 1, message
    assert "not loaded because unpickling them can run code" in message, message
    assert "corrupt" not in message, message
    assert "weights_only" not in message and "still be loaded" not in message, message  # torch's advice


def assert_one_line(e, *parts):
    message = str(e.value)
    assert len(message.splitlines()) == 1 and all(part in message for part in parts), message


# ----------------------------------------------------------------------------------------------
# sharded checkpoints of the earlier format: refused unread, converted only by the user's explicit flag

def write_old_format(checkpoint, folder):
    """checkpoint as the earlier format's folder: torch.distributed.checkpoint's files and train_state.pt."""
    import torch.distributed.checkpoint as dcp
    weights, optimizer_state, param_groups, train_state = checkpoint_as_sharded(checkpoint)
    no_dist = {'no_dist': True} if 'no_dist' in inspect.signature(dcp.save).parameters else {}
    with warnings.catch_warnings():  # that it assumes one process, as asked
        warnings.simplefilter('ignore')
        dcp.save({'model': weights, 'optimizer': optimizer_state}, checkpoint_id=folder, **no_dist)
    torch.save({**train_state, 'optimizer_param_groups': param_groups}, folder / 'train_state.pt')


@pytest.fixture(scope='module')
def old_format(source, tmp_path_factory):
    """An out_dir whose only checkpoint is source's, as a sharded checkpoint of the earlier format."""
    out = tmp_path_factory.mktemp('old') / 'out'
    out.mkdir()
    write_old_format(read_checkpoint(source / 'ckpt.pt')[1], folder_of(out))
    (out / 'ckpt.sharded').write_text('ckpt.sharded-0000007\n')
    return out


@pytest.fixture
def evil(old_format, tmp_path):
    """(out_dir, marker): a copy of old_format whose .metadata creates marker when unpickled."""
    out, marker = tmp_path / 'out', tmp_path / 'marker'
    shutil.copytree(old_format, out)
    with open(folder_of(out) / '.metadata', 'wb') as f:
        pickle.dump(CreatesFile(marker), f)
    return out, marker


def test_the_payload_is_live(evil):
    """torch's own reader runs a crafted .metadata: why the earlier format is not read."""
    from torch.distributed.checkpoint import FileSystemReader
    out, marker = evil
    FileSystemReader(folder_of(out)).read_metadata()
    assert marker.exists()


def assert_names_the_conversion(message, out, marker):
    assert not marker.exists(), "the payload ran"
    assert len(message.strip().splitlines()) == 1, message
    assert f"{folder_of(out)} is in the earlier format" in message, message
    assert f"python3 convert_checkpoint.py --out_dir={out} --trust_old_format=True" in message, message


@pytest.mark.parametrize('load', [{}, {'model_only': True}, {'metadata_only': True}])
def test_an_old_format_folder_is_refused_unread_naming_the_conversion(evil, load):
    out, marker = evil
    assert checkpoint_path(out) == str(folder_of(out))
    for path in (out, folder_of(out)):
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(path, **load)[1]
        assert_names_the_conversion(str(e.value), out, marker)


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


@pytest.mark.parametrize('command', SCRIPTS)
def test_every_script_refuses_an_old_format_folder_in_one_line(evil, command, source, tmp_path):
    out, marker = evil
    assert_names_the_conversion(refusal_of(command, out, source, tmp_path), out, marker)


def test_the_conversion_named_reads_a_trusted_old_format_folder(old_format, source, tmp_path):
    """convert_checkpoint.py --trust_old_format=True reads it with DCP's own reader into ckpt.pt: the same
    checkpoint as the one it was written from, which then loads everywhere."""
    out = tmp_path / 'out'
    shutil.copytree(old_format, out)
    proc = run_script_in_process('convert_checkpoint.py', [f'--out_dir={out}', '--trust_old_format=True'])
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out / 'ckpt.pt'} from {folder_of(out)}, iter 7" in proc.stdout
    assert_same_checkpoint(read_checkpoint(out / 'ckpt.pt')[1], read_checkpoint(source / 'ckpt.pt')[1])


# ----------------------------------------------------------------------------------------------
# the other files a user loads

def test_a_ckpt_pt_holding_code_is_refused_without_torchs_advice(source, tmp_path):
    marker = tmp_path / 'marker'
    checkpoint = torch.load(source / 'ckpt.pt', weights_only=True)
    torch.save({**checkpoint, 'extra': CreatesFile(marker)}, tmp_path / 'ckpt.pt')
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)[1]
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
# a ckpt.pt whose pickle builds more than its file holds: torch's weights-only unpickler runs no code, but calls
# _codecs.encode and bytearray as often as the pickle asks, on one memoised string

def _text(t):
    return pickle.BINUNICODE + struct.pack('<I', len(t)) + t


def memo_bomb(call, n, size=1 << 20):
    """A pickle of one object: (s, call, 'latin1') and the tuple of n calls call(s, 'latin1'), s a memoised string
    of `size` bytes: n x size bytes built from size + 16 n bytes (memo slots far above torch.save's own). call
    None: (s,) and the tuple of n references to s (one string, but n x size bytes of JSON or of repr)."""
    def put(slot):
        return pickle.LONG_BINPUT + struct.pack('<I', (1 << 30) + slot)

    def get(slot):
        return pickle.LONG_BINGET + struct.pack('<I', (1 << 30) + slot)

    if call is None:
        head, use = [_text(b'x' * size), put(0), pickle.TUPLE1], get(0)
    else:
        head = [_text(b'x' * size), put(0), pickle.GLOBAL + call.replace('.', '\n').encode() + b'\n', put(1),
                _text(b'latin1'), put(2), pickle.TUPLE3]
        use = get(1) + get(0) + get(2) + pickle.TUPLE2 + pickle.REDUCE
    return b''.join(head + [pickle.MARK, use * n, pickle.TUPLE, pickle.TUPLE2])


def with_memo_bomb(path, call, n=3000):
    """The checkpoint at path with memo_bomb(call, n) under the key 'extra', laid out as torch.save lays it out."""
    marker = 'MEMO-BOMB-HERE'
    checkpoint = torch.load(path, weights_only=True)
    with open(path, 'wb') as f:
        torch.save({**checkpoint, 'extra': marker}, f)
    saved = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(saved)) as src, zipfile.ZipFile(path, 'w') as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith('/data.pkl'):
                grown = data.replace(_text(marker.encode()), memo_bomb(call, n))
                data = grown + bytes(-(len(grown) - len(data)) % 64)  # (after STOP) the tensors stay aligned
            dst.writestr(info, data)


LOAD_EVERY_WAY = """
import resource, sys
from denoised_gpt import checkpoint as checkpoint_module
from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, read_checkpoint
print(checkpoint_path(sys.argv[1]))
for way in ({}, {'metadata_only': True}, {'model_only': True}):
    try:
        print('loaded iter', read_checkpoint(sys.argv[1], **way)[1]['iter_num'])
    except CheckpointError as e:
        print(e)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)  # the peak, in MiB
"""


def load_every_way(out):
    """What checkpoint_path(out) and each kind of read_checkpoint(out) give, in a fresh process, and its peak
    memory (MiB)."""
    proc = subprocess.run([sys.executable, '-c', LOAD_EVERY_WAY, str(out)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    *lines, peak = proc.stdout.splitlines()
    return lines, int(peak)


@pytest.mark.parametrize('call', ['_codecs.encode', 'builtins.bytearray'])
def test_a_pickle_that_builds_more_than_its_file_is_refused_before_it_is_built(source, tmp_path, call):
    """3,000 calls on one memoised 1 MiB string: 3 GB from a 1 MB file. Refused by every load and by
    checkpoint_path's look at ckpt.pt beside the sharded checkpoint (which then names ckpt.pt, for read_checkpoint
    to say why), in one line, with no more memory than loading the real checkpoint takes."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    with_memo_bomb(out / 'ckpt.pt', call)
    assert (out / 'ckpt.pt').stat().st_size < (source / 'ckpt.pt').stat().st_size + 1.1e6
    (path, *refusals), peak = load_every_way(out)
    assert path == str(out / 'ckpt.pt')
    expected = ("would build more than" if call == '_codecs.encode' else
                "references builtins.bytearray, which torch.save does not write for a checkpoint")
    for message in refusals:
        assert message.startswith(f"checkpoint {out / 'ckpt.pt'} ") and expected in message, message
        assert "can run code" not in message and "No previous checkpoint" in message, message
    _, baseline = load_every_way(source)  # the real checkpoint: torch, the model, its tensors
    assert peak < baseline + 64, (peak, baseline)


@pytest.mark.parametrize('command', ['sample.py', 'eval.py', 'export_hf.py', 'train.py resume'])
def test_every_script_refuses_a_pickle_that_builds_more_than_its_file(command, source, tmp_path):
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    shutil.rmtree(folder_of(out))
    (out / 'ckpt.sharded').unlink()
    with_memo_bomb(out / 'ckpt.pt', '_codecs.encode')
    error = refusal_of(command, out, source, tmp_path)
    assert f"checkpoint {out / 'ckpt.pt'} would build more than" in error, error


def with_optimizer_state(path, field, value):
    """The checkpoint at path with `value` as the AdamW state `field` of its first parameter."""
    checkpoint = torch.load(path, weights_only=True)
    checkpoint['optimizer']['state'][0][field] = value
    torch.save(checkpoint, path)


@pytest.mark.parametrize('case, says', [
    ('shared string', "would build more than"),
    ('long string', "the training state cannot be saved in a sharded checkpoint's index: as JSON it is larger than "
                    "16 MiB, which no index is"),
    ('step', "the checkpoint's optimizer state step for transformer.wte.weight is -5, not a count of updates"),
    ('shape', "the checkpoint's optimizer state exp_avg for transformer.wte.weight has shape (3, 3) but the model's "
              "parameter has (48, 32)"),
])
def test_convert_checkpoint_refuses_before_writing_what_its_readers_would_refuse(case, says, source, tmp_path):
    """It wrote, exit 0, a 3.1 GB checkpoint.json from a 1.4 MB ckpt.pt (a string referenced over and over), and
    checkpoints whose AdamW state every resume refuses. Now each is one line, and nothing is written."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    shutil.rmtree(folder_of(out))
    (out / 'ckpt.sharded').unlink()
    path = out / 'ckpt.pt'
    if case == 'shared string':
        with_memo_bomb(path, None)
    elif case == 'long string':
        checkpoint = torch.load(path, weights_only=True)
        torch.save({**checkpoint, 'config': {**checkpoint['config'], 'notes': 'x' * (17 << 20)}}, path)
    elif case == 'step':
        with_optimizer_state(path, 'step', torch.tensor(-5.0))
    else:
        with_optimizer_state(path, 'exp_avg', torch.zeros(3, 3))
    before = sorted(os.listdir(out))
    error = refusal_of('convert_checkpoint.py', out, source, tmp_path, '--to=sharded')
    assert says in error, error
    assert sorted(set(os.listdir(out)) - {'.lock'}) == before  # (the lock's file: one writer per out_dir)


def test_convert_checkpoint_to_a_file_refuses_a_state_its_readers_would_refuse(source, tmp_path):
    """A sharded train state of 900,000 small values (1.8 MB of JSON, within the index's caps) pickles to a
    ckpt.pt that builds more than its size allows: it was written, and every load refused it. Checked before it
    replaces anything, as every save is."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    (out / 'ckpt.pt').unlink()
    index = json.loads((folder_of(out) / 'checkpoint.json').read_text())
    index['train_state']['padding'] = [0] * 900_000
    (folder_of(out) / 'checkpoint.json').write_text(json.dumps(index))
    before = sorted(os.listdir(out))
    error = refusal_of('convert_checkpoint.py', out, source, tmp_path)
    assert "the checkpoint would build more than " in error and "it is not saved, as every reader would refuse it" \
        in error, error
    assert sorted(set(os.listdir(out)) - {'.lock'}) == before


def _holding_itself():
    x = []
    x.append(x)
    return x


@pytest.mark.parametrize('extra, protocol, says', [
    ({1, 2}, 2, "references builtins.set, which torch.save does not write for a checkpoint"),
    (bytearray(b'x'), 2, "references builtins.bytearray, which torch.save does not write for a checkpoint"),
    (1j, 2, "references builtins.complex, which torch.save does not write for a checkpoint"),
    (_holding_itself(), 2, "changes an object after using it (APPEND), which torch.save does not write"),
    (None, 4, "is a pickle of protocol 4, which torch.save does not write (it writes 2)"),
], ids=['set', 'bytearray', 'complex', 'list holding itself', 'protocol 4'])
def test_a_checkpoint_holding_what_torch_save_does_not_write_for_one_is_refused(source, tmp_path, extra, protocol,
                                                                                says):
    """What torch's weights-only reader allows but no checkpoint holds is refused before it is built, in one line
    that does not say it runs code."""
    path = tmp_path / 'ckpt.pt'
    torch.save({**torch.load(source / 'ckpt.pt', weights_only=True), 'extra': extra}, path, pickle_protocol=protocol)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)[1]
    assert_one_line(e, f"checkpoint {path} {says}, so it is not read")
    assert "run code" not in str(e.value)


def test_what_torch_save_writes_for_checkpoints_passes_far_below_the_bound(source, tmp_path):
    """What train.py writes, nanoGPT's train.py (its model, AdamW state, config) and the fixture of an earlier
    version (test_old_checkpoint.py), and every kind of value a checkpoint may hold, build a small part of what
    their files' sizes allow."""
    from collections import OrderedDict

    from denoised_gpt.checkpoint_pickle import _walk, check_pickle, pickle_bound
    from nanogpt_reference import BETAS, LR, WD, NanoConfig, NanoGPT, nano_checkpoint
    cfg = NanoConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=16, dropout=0.0, bias=True)
    model = NanoGPT(cfg)
    torch.save(nano_checkpoint(model, model.configure_optimizers(WD, LR, BETAS), cfg, compiled=True),
               tmp_path / 'nanogpt.pt')
    values = {f'{dtype}': torch.zeros(2, 3, dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16,
                                                                       torch.int64, torch.bool, torch.uint8)}
    torch.save({**values, 'bytes': b'\x00\xff', 'size': torch.Size([2, 3]), 'parameter': torch.nn.Parameter(
        torch.ones(2)), 'ordered': OrderedDict(a=1), 'text': 'é', 'nothing': None, 'flags': [True, False],
        'big': 2**100, 'pair': (1.5, -3), 'tied': [values['torch.float32']] * 2}, tmp_path / 'values.pt')
    for path in (source / 'ckpt.pt', ROOT / 'tests' / 'fixtures' / 'ckpt-23a31c2' / 'ckpt.pt', tmp_path / 'nanogpt.pt',
                 tmp_path / 'values.pt'):
        with open(path, 'rb') as f:
            check_pickle(f, str(path))
        with zipfile.ZipFile(path) as archive:
            info = next(i for i in archive.infolist() if i.filename.endswith('/data.pkl'))
            with archive.open(info) as stream:
                assert _walk(stream, pickle_bound(path.stat().st_size)) < pickle_bound(0) / 10


def test_a_legacy_ckpt_pt_is_refused_and_the_conversion_it_names_makes_it_load(source, tmp_path):
    """A ckpt.pt in torch.save's legacy format: refused before torch.load allocates the sizes it declares
    (neither train.py nor nanoGPT writes it); the command the message gives converts it to a loadable file."""
    path = tmp_path / 'ckpt.pt'
    torch.save(torch.load(source / 'ckpt.pt', weights_only=True), path, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(tmp_path)[1]
    assert_one_line(e, f"checkpoint {path} is in torch.save's legacy format, which is not read")
    command = re.search(r'python3 -c "(.*)"$', str(e.value)).group(1)
    subprocess.run([sys.executable, '-c', command], check=True, env=subprocess_env(), timeout=120)
    assert zipfile.is_zipfile(path)
    converted, original = read_checkpoint(tmp_path)[1], read_checkpoint(source / 'ckpt.pt')[1]
    assert converted['model'].keys() == original['model'].keys()
    assert all(torch.equal(converted['model'][k], v) for k, v in original['model'].items())
    assert {k: converted[k] for k in ('model_args', 'iter_num', 'config')} == \
           {k: original[k] for k in ('model_args', 'iter_num', 'config')}


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
        read_checkpoint(out / 'ckpt.pt')[1]
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "truncated or corrupt" in message
    assert f"(RuntimeError: {first_sentence}). The previous checkpoint {out / 'ckpt.prev.pt'} was kept" in message

    shard = folder_of(out) / 'rank-00000.safetensors'
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(folder_of(out))[1]
    assert len(str(e.value).splitlines()) == 1
    assert "incomplete or corrupt (rank-00000.safetensors is not a whole safetensors file (" in str(e.value)
    assert str(e.value).endswith("No previous sharded checkpoint exists next to it.")


# ----------------------------------------------------------------------------------------------
# counters of another type than train.py writes: refused on load, never a TypeError mid-run

def with_counter(source, tmp_path, kind, key, value):
    """A copy of source whose ckpt.pt (kind 'ckpt.pt': the sharded checkpoint removed) or sharded
    checkpoint's train state (kind 'sharded', in its checkpoint.json) holds `value` under key."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    if kind == 'ckpt.pt':
        shutil.rmtree(folder_of(out))
        (out / 'ckpt.sharded').unlink()
        path = out / 'ckpt.pt'
        torch.save({**torch.load(path, weights_only=True), key: value}, path)
    else:
        index = json.loads((folder_of(out) / 'checkpoint.json').read_text())
        index['train_state'][key] = value
        (folder_of(out) / 'checkpoint.json').write_text(json.dumps(index))
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
    ('best_iter', 2.0, "best_iter is 2.0 (a float), not a non-negative integer up to 2**63 - 1, or null"),
    ('val_loss', [1.5], "val_loss is [1.5] (a list), not a number a float holds, or null"),
    ('train_time', None, "train_time is None (a NoneType), not a number"),
    ('best_val_loss', 10**400, "best_val_loss is 100000000000000000...0000000000000000000 (a int), not a number a "
                               "float holds"),  # (float() of it: an OverflowError in sample.py, train.py)
    ('iter_num', 2**64, "iter_num is 18446744073709551616 (a int), not a non-negative integer up to 2**63 - 1"),
    ('config', 'x', "config is 'x' (a str), not a dict"),
])
def test_read_checkpoint_names_a_counter_of_the_wrong_type(source, tmp_path, key, value, expected):
    for kind in ('ckpt.pt', 'sharded'):
        out = with_counter(source, tmp_path / kind, kind, key, value)
        for metadata_only in (False, True):
            with pytest.raises(CheckpointError) as e:
                read_checkpoint(out, metadata_only=metadata_only)[1]
            assert expected in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
    # what train.py and nanoGPT write loads: nanoGPT's best_val_loss is the 0-d tensor of its evaluation
    out = with_counter(source, tmp_path / 'nanogpt', 'ckpt.pt', 'best_val_loss', torch.tensor(2.5))
    assert read_checkpoint(out)[1]['best_val_loss'] == 2.5


def test_an_integer_too_long_for_torchs_reader_is_said_as_such_not_as_code(source, tmp_path):
    """pickle writes an int of more than 255 bytes as LONG4, which torch's weights-only reader refuses as if it
    were code."""
    path = tmp_path / 'ckpt.pt'
    torch.save({**torch.load(source / 'ckpt.pt', weights_only=True), 'best_val_loss': 10**4000}, path)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(path)[1]
    assert_one_line(e, f"checkpoint {path} holds an integer of more than 255 bytes, which no checkpoint does")
    assert "run code" not in str(e.value)


@pytest.mark.parametrize('key, says', [
    ('train_batches', "the checkpoint's train_batches state is not as train.py writes it: it lacks 'generator'"),
    ('rng', "the checkpoint's rng state is not as train.py writes it: it holds what cannot be restored"),
])
def test_a_train_state_train_py_cannot_restore_is_one_line_at_resume(tmp_path, key, says):
    """The batches' sampler state without its generator was a KeyError's traceback (train.py's own checkpoint
    of an earlier version, tests/fixtures, with one part of its state emptied)."""
    fixture = ROOT / 'tests' / 'fixtures' / 'ckpt-23a31c2'
    out = tmp_path / 'out'
    out.mkdir()
    checkpoint = torch.load(fixture / 'ckpt.pt', weights_only=True)
    torch.save({**checkpoint, key: {} if key == 'train_batches' else {**checkpoint['rng'], 'torch': 'x'}},
               out / 'ckpt.pt')
    proc = run_script_in_process('train.py', ['--init_from=resume', f'--out_dir={out}', f'--dataset={fixture / "data"}',
                                              '--device=cpu', '--dtype=float32', '--compile=False'])
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"train.py: error: {says}"), proc.stderr


@pytest.mark.parametrize('command', ['sample.py', 'eval.py', 'export_hf.py'])
def test_a_model_size_torch_cannot_hold_is_one_line(command, source, tmp_path):
    """n_embd=2**70: torch's error carried a 19-line C++ stack into the one line."""
    out = tmp_path / 'out'
    out.mkdir()
    checkpoint = torch.load(source / 'ckpt.pt', weights_only=True)
    torch.save({**checkpoint, 'model_args': {**checkpoint['model_args'], 'n_embd': 2**70}}, out / 'ckpt.pt')
    args = [a.format(out=out, tmp=tmp_path) for a in SCRIPTS[command]]
    proc = run_script_in_process(command, args)
    assert proc.returncode == 2 and "frame #" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{command}: error: ")]
    assert len(errors) == 1 and "does not build a model: " in errors[0] and "Overflow" in errors[0], proc.stderr
    assert proc.stderr.strip().endswith(errors[0]), proc.stderr  # (nothing after it)


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
     "training_run.json is not as export_hf.py writes it: its iter_num is '7' (a str), not a non-negative integer up "
     "to 2**63 - 1"),
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


@pytest.mark.slow
@pytest.mark.parametrize('pointer', ['elsewhere', 'fifo', 'link out', 'symbolic link', 'hard link'])
def test_the_pointer_to_the_newest_sharded_checkpoint_names_a_folder_of_the_run_or_is_refused(source, tmp_path,
                                                                                               pointer):
    """out_dir/ckpt.sharded names the newest sharded folder: one naming a folder elsewhere (another run's
    checkpoint, read and perhaps exported through this one) is not followed, one that is a FIFO does not hang
    the reader, and one that is a link (a file from anywhere) is not read; scripts say so in one line."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    elsewhere = tmp_path / 'other-run'
    shutil.copytree(folder_of(out), elsewhere / 'ckpt.sharded-0000099')
    (out / 'ckpt.pt').unlink()
    says = {'fifo': "is a FIFO, not a regular file, and is not read (reading it could wait forever): remove it",
            'symbolic link': "is a link, and is not read: a sharded checkpoint reads only its own files",
            'hard link': "has 1 other hard link(s), so it may be a file from outside its folder, and is not read"
            }.get(pointer, "folder in")
    if pointer == 'elsewhere':
        (out / 'ckpt.sharded').write_text('../other-run/ckpt.sharded-0000099\n')
    elif pointer == 'link out':
        (out / 'ckpt.sharded-0000099').symlink_to(elsewhere / 'ckpt.sharded-0000099')
        (out / 'ckpt.sharded').write_text('ckpt.sharded-0000099\n')
    elif pointer == 'fifo':
        (out / 'ckpt.sharded').unlink()
        os.mkfifo(out / 'ckpt.sharded')
    else:
        os.replace(out / 'ckpt.sharded', tmp_path / 'pointer')
        if pointer == 'symbolic link':
            (out / 'ckpt.sharded').symlink_to(tmp_path / 'pointer')
        else:
            os.link(tmp_path / 'pointer', out / 'ckpt.sharded')
    for script, args in (('sample.py', ['--num_samples=1', '--max_new_tokens=2']), ('eval.py', ['--val_loss=True'])):
        proc = subprocess.run([sys.executable, script, f'--out_dir={out}', '--device=cpu', *args], cwd=ROOT,
                              env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and 'Traceback' not in proc.stderr, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"{script}: error: {out / 'ckpt.sharded'} ") and says in last, last


def test_a_ckpt_pt_that_is_a_symbolic_link_is_not_followed(source, tmp_path):
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'ckpt.pt').symlink_to(source / 'ckpt.pt')
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(out)[1]
    assert_one_line(e, f"checkpoint {out / 'ckpt.pt'} is a symbolic link, which is not followed: load the file it "
                       f"names by its own path, or copy it there (cp -L)")


def test_a_fifo_swapped_in_while_checkpoint_path_looks_at_ckpt_pt_is_never_read(source, tmp_path, monkeypatch):
    """checkpoint_path reads the iteration of ckpt.pt beside a sharded checkpoint from the file it opened and
    checked, once: a FIFO put in its place meanwhile is never opened (which waits for ever). SIGALRM ends a
    regression."""
    out = tmp_path / 'out'
    shutil.copytree(source, out)
    check = checkpoint_module.check_zip_parts

    def check_then_swap(file, what):
        check(file, what)
        os.replace(out / 'ckpt.pt', out / 'aside.pt')
        os.mkfifo(out / 'ckpt.pt')

    monkeypatch.setattr(checkpoint_module, 'check_zip_parts', check_then_swap)

    with ends_if_it_hangs(30, "the FIFO was opened"):
        assert checkpoint_path(out) == str(folder_of(out))  # as new as ckpt.pt, as the file it opened said
    assert (out / 'ckpt.pt').is_fifo()
