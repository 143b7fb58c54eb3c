"""Files a user loads that would run code if unpickled as they are, or make a reader allocate more than they
hold: a ckpt.pt, a GPT-2 folder's pytorch_model.bin, an exported folder's JSON files, and sharded checkpoints
of the earlier format (torch.distributed.checkpoint's pickled .metadata, which torch's own reader unpickles
with plain pickle). Each is refused in one line that says what the file is or holds (never "corrupt" for
code, never torch's advice to load it with weights_only=False), before any payload runs, by the library and
by the scripts that read it. The sharded format's own checks: test_sharded_format.py."""
import inspect
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from denoised_gpt.sharded_checkpoint import checkpoint_as_sharded, save_sharded
from helpers import ROOT, make_dataset, run_script_in_process, subprocess_env
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
    write_old_format(load_checkpoint(source / 'ckpt.pt'), folder_of(out))
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
            load_checkpoint(path, **load)
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
    assert_same_checkpoint(load_checkpoint(out / 'ckpt.pt'), load_checkpoint(source / 'ckpt.pt'))


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

    shard = folder_of(out) / 'rank-00000.safetensors'
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder_of(out))
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


@pytest.mark.slow
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
