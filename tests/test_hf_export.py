"""export_hf.py and denoised_gpt/hf_format.py: trained models in the Hugging Face format and back, with
the transformers, safetensors, tokenizers and lm-eval installed here, offline.

For every attn_type the exported folder, loaded by transformers' AutoModelForCausalLM (plain GPT-2 for a
base model with biases, our own code with trust_remote_code=True for the others), gives model.py's logits
and, with generate() (greedy, sampled, beam search; with its cache and without), model.py's tokens.
lm-eval's own `hf` model on exported folders scores a local task as our adapter scores the checkpoints. init_from=<folder> (train.py, sample.py,
eval.py) gets the checkpoint's weights bit for bit. The tokenizers encode as the model's data did; an
export never half-writes or overwrites what it should not, and bad input fails in one line.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
import torch

import gpt2_bpe
from denoised_gpt.checkpoint import read_checkpoint
from denoised_gpt.evaluation import final_hidden_states
from denoised_gpt.hf_format import export, write_tokenizer
from helpers import (NO_AUTOCAST, ROOT, TINY, VOCAB, hf_lm, local_mc_task, make_dataset, on_small_disk,
                     per_doc_loglikelihoods, run_script_in_process, save_model_checkpoint, small_disk_available,
                     subprocess_env, tiny_checkpoint, tiny_gpt)
from model import ATTENTION_TYPES, GPT, GPTConfig

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

# the checkpoints exported here: tests/config_tiny.py's model (no biases) of each attn_type; 'base' with
# biases means GPT-2's weights, so 'base-no-bias' is the base model that needs our own code
KINDS = {**{attn: dict(attn_type=attn) for attn in ATTENTION_TYPES},
         'base': dict(attn_type='base', bias=True), 'base-no-bias': dict(attn_type='base')}
CHARS = "\n !$&',-.:;?ABCDEFGHIJKLMNOPQRSTabcdefghijklmnopqrstuvwxyz"[:VOCAB]  # make_dataset's 48 token ids


def peaked(model):
    """Larger embeddings: decisive next-token distributions, whose choices score clearly apart."""
    model.transformer.wte.weight.mul_(20)


def learn(model, data, steps=100):
    """A hundred AdamW steps on make_dataset's Markov chain: an untrained model repeats one token when
    decoding greedily, one that learnt the chain's successors walks through many. One thread: a model
    this small gains nothing from two, and loses much when another process keeps the second core busy."""
    tokens = torch.from_numpy(np.fromfile(data / 'train.bin', dtype=np.uint16).astype(np.int64))
    windows = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(tokens) - 33, (8,), generator=windows)
            w = torch.stack([tokens[s:s + 33] for s in starts])
            model(w[:, :-1], w[:, 1:])[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return model


def load_hf(folder, **kwargs):
    from transformers import AutoModelForCausalLM
    remote = os.path.isfile(os.path.join(folder, 'modeling_denoised_gpt.py'))
    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=remote, **kwargs).eval()


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope='module')
def char_data(tmp_path_factory):
    """make_dataset's token files with a char vocabulary in meta.json (as data/shakespeare_char's)."""
    data = make_dataset(tmp_path_factory.mktemp('data'), n_train=3000, n_val=600)
    meta = json.loads((data / 'meta.json').read_text())
    (data / 'meta.json').write_text(json.dumps({**meta, 'chars': CHARS}))
    return data


@pytest.fixture(scope='module')
def exported(tmp_path_factory, char_data):
    """{kind: (model, checkpoint dir, exported folder, export's notes)} for every KINDS entry."""
    root = tmp_path_factory.mktemp('export')
    out = {}
    for i, (kind, settings) in enumerate(KINDS.items()):
        model = learn(tiny_gpt(seed=i, **settings), char_data).eval()
        save_model_checkpoint(root / f'out-{kind}', model, iter_num=7, best_val_loss=2.5,
                              config={'dataset': str(char_data)})
        notes = export(read_checkpoint(root / f'out-{kind}')[1], str(root / f'hf-{kind}'), data_dir=str(char_data))
        out[kind] = (model, root / f'out-{kind}', root / f'hf-{kind}', notes)
    return out


@pytest.mark.parametrize('kind', KINDS)
def test_transformers_gives_model_pys_logits_and_generated_tokens(exported, kind):
    model, _, folder, notes = exported[kind]
    op = torch.ops.denoised_gpt.lm_head_cross_entropy.default
    hf = load_hf(folder)
    own_code = kind != 'base'
    # the folder's fused_loss.py registers its op under a namespace of its own: ours is not replaced
    assert torch.ops.denoised_gpt.lm_head_cross_entropy.default is op
    assert (type(hf).__name__ == 'DenoisedGPTForCausalLM') == own_code  # base with biases: GPT2LMHeadModel
    assert os.path.isfile(folder / 'modeling_denoised_gpt.py') == own_code
    if kind == 'base-no-bias':
        assert "bias=False" in notes[0] and "trust_remote_code=True" in notes[0]
    idx = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.manual_seed(5)  # NoiseFormer: the same noise draws (noise_at_eval is on)
        ours = model.lm_head(final_hidden_states(model, idx))
        torch.manual_seed(5)
        theirs = hf(idx).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{kind}: max |logits difference| {diff:.2e}")
    assert ours.shape == theirs.shape and diff <= 1e-5

    if 'noiseformer' in kind:  # noise drawn under one seed, and off
        decodes_as_model_py(model, hf, idx[:2, :6], own_code, deterministic=False)
        model, hf = noise_off(model), load_hf(folder, noise_at_eval=False)
    decodes_as_model_py(model, hf, idx[:2, :6], own_code, deterministic=True)


def noise_off(model):
    """model with NoiseFormer's noise off at eval time: exactly symmetric attention."""
    off = GPT(GPTConfig(**{**vars(model.config), 'noise_at_eval': False})).eval()
    off.load_state_dict(model.state_dict())
    return off


def cached_length(out):
    """The decoding state generate() returned has seen this many positions (transformers 5 names it `cache`)."""
    cache = out.cache if 'cache' in out else out.past_key_values
    assert type(cache).__name__ == 'DenoisedGPTCache'
    return cache.get_seq_length()


def decodes_as_model_py(model, hf, prompt, own_code, deterministic, new=16):
    """hf.generate gives model.generate's tokens, greedy and sampled under one seed, with its cache (one position
    per step: after generate it has seen prompt + new - 1 of them) and without; beam search reorders the cache
    (compared with beam search without one) where the model is deterministic (no noise drawn)."""
    for use_cache in (True, False):
        for temperature in (0, 0.8):
            torch.manual_seed(7)
            expected = model.generate(prompt, new, temperature=temperature, use_cache=use_cache)
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else \
                dict(do_sample=False)
            torch.manual_seed(7)
            out = hf.generate(prompt, max_new_tokens=new, use_cache=use_cache, return_dict_in_generate=True,
                              **sampling)
            case = f"use_cache={use_cache} temperature={temperature}"
            assert out.sequences.tolist() == expected.tolist(), case
            assert len(set(expected[:, prompt.size(1):].flatten().tolist())) > 3, case  # not one token repeated
            if own_code and use_cache:  # decoded with model.py's own cache, one token per step
                assert cached_length(out) == prompt.size(1) + new - 1, case
    if deterministic:
        beams = dict(max_new_tokens=new, num_beams=3, num_return_sequences=3, do_sample=False, length_penalty=0.0)
        with_cache = hf.generate(prompt, use_cache=True, **beams)
        assert with_cache.tolist() == hf.generate(prompt, use_cache=False, **beams).tolist()
        assert len(set(map(tuple, with_cache.tolist()))) == 6  # three distinct beams per prompt


def test_gpt2s_format_holds_base_attention_with_biases_and_gpt2s_head_shape_only():
    from denoised_gpt.hf_format import gpt2_incompatibility
    shape = dict(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32)
    assert gpt2_incompatibility(GPTConfig(**shape, bias=True)) is None
    assert gpt2_incompatibility(GPTConfig(**shape, bias=True, qk_head_size=16)) is None  # n_embd / n_head
    assert "qk_head_size=32" in gpt2_incompatibility(GPTConfig(**shape, bias=True, qk_head_size=32))
    assert "bias=False" in gpt2_incompatibility(GPTConfig(**shape, bias=False))
    assert "attn_type='linear'" in gpt2_incompatibility(GPTConfig(**shape, bias=True, attn_type='linear'))


def test_noiseformer_noise_follows_noise_at_eval_and_can_be_turned_off_when_loading(exported):
    model, _, folder, _ = exported['noiseformer_v2']
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    noisy = load_hf(folder)
    with torch.no_grad():
        assert not torch.equal(noisy(idx).logits, noisy(idx).logits)  # a fresh draw at every call
        quiet = load_hf(folder, noise_at_eval=False)
        off = GPT(GPTConfig(**{**vars(model.config), 'noise_at_eval': False})).eval()
        off.load_state_dict(model.state_dict())
        a, b = quiet(idx).logits, off.lm_head(final_hidden_states(off, idx))
    assert torch.equal(a, quiet(idx).logits) and (a - b).abs().max() <= 1e-5  # exactly symmetric attention


def test_lm_evals_hf_model_on_exported_folders_scores_as_our_adapter_on_the_checkpoints(tmp_path):
    """GPT-2's vocabulary (50304 rows, padded): a plain GPT-2 folder and one with our own code (dint)."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from denoised_gpt.evaluation.lm_eval_adapter import run_lm_eval
    gpt2_bpe.require()
    task_manager = TaskManager(include_path=str(local_mc_task(tmp_path)))
    for attn_type, bias in (('base', True), ('dint', False)):
        model = tiny_checkpoint(tmp_path / f'out-{attn_type}', attn_type, 'openwebtext', tweak=peaked,
                                block_size=64, vocab_size=50304, bias=bias)
        folder = tmp_path / f'hf-{attn_type}'
        export(read_checkpoint(tmp_path / f'out-{attn_type}')[1], str(folder))
        _, ours = run_lm_eval(model.eval(), tiktoken.get_encoding('gpt2'), ['tiny_mc'], batch_size=3, device='cpu',
                              ctx=NO_AUTOCAST, log_samples=True, task_manager=task_manager)
        theirs = lm_eval.simple_evaluate(model=hf_lm(folder, trust_remote_code=attn_type != 'base'),
                                         tasks=['tiny_mc'], task_manager=task_manager)
        a, b = per_doc_loglikelihoods(ours, 'tiny_mc'), per_doc_loglikelihoods(theirs, 'tiny_mc')
        assert sorted(a) == sorted(b) == [0, 1, 2, 3]
        for doc in a:
            assert a[doc] == pytest.approx(b[doc], abs=1e-4), (attn_type, doc)
        assert len({round(x, 3) for doc in a for x in a[doc]}) > 4  # the choices score differently


@pytest.mark.parametrize('kind, run_args', [('base', []), ('noiseformer_v2', ['--attn_type=noiseformer_v2'])])
def test_train_init_from_an_exported_folder_starts_with_the_checkpoints_weights(exported, char_data, tmp_path,
                                                                             kind, run_args):
    """A GPT-2 folder goes through GPT.from_pretrained, our own through the checkpoint path: the run's first
    checkpoint (max_iters=0: the model as loaded) holds the exported weights bit for bit."""
    model, _, folder, _ = exported[kind]
    proc = run_script_in_process('train.py', [TINY, f'--dataset={char_data}', f'--out_dir={tmp_path / "run"}',
                                              f'--init_from={folder}', '--max_iters=0', *run_args])
    assert proc.returncode == 0, proc.stderr
    assert same_state(read_checkpoint(tmp_path / 'run')[1]['model'], model.state_dict())


def test_a_folder_saved_again_by_transformers_reads_back_the_same(exported, tmp_path):
    from denoised_gpt.hf_format import read_exported
    model, _, folder, _ = exported['dint_lowrank']
    load_hf(folder).save_pretrained(tmp_path / 'again')
    assert same_state(read_exported(str(tmp_path / 'again'))['model'], model.state_dict())


def test_sample_and_eval_read_an_exported_folder_as_its_checkpoint(exported, char_data):
    _, out_dir, folder, _ = exported['dint']
    common = ['--device=cpu', '--dtype=float32']
    sample = ['--start=ab', '--num_samples=2', '--max_new_tokens=12', *common]
    from_ckpt = run_script_in_process('sample.py', [f'--out_dir={out_dir}', *sample])
    from_folder = run_script_in_process('sample.py', [f'--init_from={folder}', *sample])
    assert from_ckpt.returncode == from_folder.returncode == 0, from_folder.stderr
    assert from_folder.stdout == from_ckpt.stdout and from_folder.stdout.count('---------------') == 2
    assert f"checkpoint {folder} (iter 7" in from_folder.stderr  # training_run.json's counters

    evaluate = ['--val_loss=True', f'--eval_dir={folder.parent / "eval"}', *common]
    from_ckpt = run_script_in_process('eval.py', [f'--out_dir={out_dir}', *evaluate])
    from_folder = run_script_in_process('eval.py', [f'--init_from={folder}', *evaluate])
    assert from_ckpt.returncode == from_folder.returncode == 0, from_folder.stderr
    def val_loss_lines(stdout):  # without the seconds the evaluation took, which differ between two runs
        return [re.sub(r', [\d.]+s\)$', ')', line) for line in stdout.splitlines() if line.startswith('val loss')]
    loss = val_loss_lines(from_folder.stdout)
    assert loss and loss == val_loss_lines(from_ckpt.stdout)


def test_gpt2_tokenizer_encodes_as_tiktoken(tmp_path):
    from transformers import AutoTokenizer
    gpt2_bpe.require()
    assert write_tokenizer(str(tmp_path), 'gpt2', None, None, 64).startswith("GPT-2's BPE")
    tokenizer, enc = AutoTokenizer.from_pretrained(str(tmp_path)), tiktoken.get_encoding('gpt2')
    text = "Hello world!  \n\n  It's 2024: naïve café 😀 <|endoftext|> then\ttabs and   trailing spaces   "
    ids = enc.encode(text, allowed_special='all')
    assert tokenizer(text)['input_ids'] == ids and tokenizer.decode(ids) == text
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256 and tokenizer.model_max_length == 64


def test_char_tokenizer_round_trips_the_shakespeare_characters(tmp_path, exported):
    """Every character its own token, decoded without spaces: the whole Tiny Shakespeare text when
    TINY_SHAKESPEARE names it, else an excerpt-like text, and the exported folder's own tokenizer."""
    from transformers import AutoTokenizer
    path = os.environ.get('TINY_SHAKESPEARE')
    text = open(path, encoding='utf-8').read() if path and os.path.isfile(path) else \
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n  $3 & 'tis -- ok?!;"
    chars = sorted(set(text))
    note = write_tokenizer(str(tmp_path), 'char', dict(enumerate(chars)), None, 256)
    assert note == f"one token per character ({len(chars)} characters), written for AutoTokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tokenizer(text, verbose=False)['input_ids']
    assert ids == [chars.index(c) for c in text] and tokenizer.decode(ids) == text

    _, _, folder, notes = exported['dint']  # make_dataset's ids with CHARS as their characters
    assert notes[1] == f"tokenizer: one token per character ({VOCAB} characters), written for AutoTokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)  # AutoConfig reads config.json
    assert tokenizer(CHARS, verbose=False)['input_ids'] == list(range(VOCAB))
    assert tokenizer.decode(list(range(VOCAB))) == CHARS


def test_token_id_datasets_and_unknown_vocabularies_get_no_tokenizer(tmp_path, exported):
    ids_data = tmp_path / 'data-ids'
    ids_data.mkdir()
    (ids_data / 'meta.json').write_text(json.dumps({'tokenizer': 'ids', 'vocab_size': VOCAB, 'task': 'mqar'}))
    for name, data_dir, says in (('ids', str(ids_data), "token ids with no text (mqar)"),
                                 ('unknown', None, "too few for GPT-2's BPE")):
        notes = export(read_checkpoint(exported['linear'][1])[1], str(tmp_path / name), data_dir=data_dir)
        assert notes[1].startswith("tokenizer: none written") and says in notes[1]
        assert not (tmp_path / name / 'tokenizer.json').exists()
        assert "No tokenizer: " in (tmp_path / name / 'README.md').read_text()


def test_the_model_card_records_the_run(exported, char_data):
    card = (exported['noiseformer_v2'][2] / 'README.md').read_text()
    for expected in ("`noiseformer_v2`", "| iterations | 7 |", "| best val loss | 2.5000 |", "trust_remote_code=True",
                     "attention noise is on", "noise_at_eval=False", f"dataset = '{char_data}'"):
        assert expected in card, expected
    assert "trust_remote_code" not in (exported['base'][2] / 'README.md').read_text()


def test_refused_overwrite_leaves_the_folder_untouched_and_a_failed_export_leaves_nothing(exported, tmp_path,
                                                                                        monkeypatch):
    _, out_dir, _, _ = exported['diff']
    folder = tmp_path / 'hf'
    assert run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={folder}']).returncode == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    again = run_script_in_process('export_hf.py', [f'--out_dir={out_dir / "ckpt.pt"}', f'--hf_dir={folder}'])
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"export_hf.py: error: hf_dir='{folder}' is not empty: pass --overwrite=True to replace the export there, "
        f"or choose another folder"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    other = tmp_path / 'notes'
    other.mkdir()
    (other / 'mine.txt').write_text('keep me')
    refused = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={other}', '--overwrite=True'])
    assert refused.returncode == 2 and "holds something other than an exported model" in refused.stderr
    assert [p.name for p in other.iterdir()] == ['mine.txt']
    # another model's Hugging Face folder (config.json and weight shards, no training_run.json): never touched
    theirs = tmp_path / 'theirs'
    theirs.mkdir()
    for name, data in (('config.json', b'{"model_type": "llama"}'), ('model-00001-of-00002.safetensors', b'w1'),
                       ('model-00002-of-00002.safetensors', b'w2'), ('model.safetensors.index.json', b'{}')):
        (theirs / name).write_bytes(data)
    files_before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    refused = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={theirs}', '--overwrite=True'])
    assert refused.returncode == 2 and "holds a model export_hf.py did not write (no training_run.json)" in refused.stderr
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == files_before
    replaced = run_script_in_process('export_hf.py', [f'--out_dir={exported["dint"][1]}', f'--hf_dir={folder}',
                                                      '--overwrite=True'])
    assert replaced.returncode == 0 and json.loads((folder / 'config.json').read_text())['attn_type'] == 'dint'

    import denoised_gpt.hf_format as hf_format

    def broken(*args):
        raise OSError("disk full")
    monkeypatch.setattr(hf_format, 'write_tokenizer', broken)
    with pytest.raises(OSError):
        export(read_checkpoint(out_dir)[1], str(tmp_path / 'half'))
    assert sorted(p.name for p in tmp_path.iterdir()) == ['hf', 'notes', 'theirs']  # no hf_dir, no temporary folder


def test_an_export_into_a_folder_another_export_is_writing_is_refused_and_changes_nothing(exported, tmp_path):
    """One writer per folder: while another process holds hf_dir (an export in progress), an export there with
    --overwrite is refused in one line; the lock is on the folder itself, so it leaves no file there."""
    _, out_dir, folder, _ = exported['base']
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    holder = subprocess.Popen([sys.executable, '-c', 'import sys; from denoised_gpt.files import lock_folder; '
                               f'lock = lock_folder({str(folder)!r}, "busy"); print("held", flush=True); '
                               'sys.stdin.read()'], cwd=ROOT, env=subprocess_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        proc = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={folder}', '--overwrite=True'])
    finally:
        holder.communicate('')
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"export_hf.py: error: hf_dir='{folder}' is in use by another export_hf.py: one export writes to a folder "
        f"at a time. Wait for it to finish, or choose another --hf_dir"], proc.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_bad_out_dir_fails_in_one_line(tmp_path):
    proc = run_script_in_process('export_hf.py', [f'--out_dir={tmp_path / "nothing"}', f'--hf_dir={tmp_path / "hf"}'])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"export_hf.py: error: no checkpoint at {tmp_path / 'nothing' / 'ckpt.pt'}: train one first "
        f"(init_from='scratch'), or point out_dir at the directory that holds ckpt.pt"]
    assert not (tmp_path / 'hf').exists()


def folder_contents(folder):
    """{path relative to folder: the file's bytes, or None for a folder}: everything under it."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob('*'))}


def clone_of(folder):
    """folder made into what `git clone` of a published export gives, plus the user's own files."""
    (folder / '.git' / 'objects' / 'ab').mkdir(parents=True)
    (folder / '.git' / 'config').write_text("[core]\n\trepositoryformatversion = 0\n")
    (folder / '.git' / 'objects' / 'ab' / 'cdef').write_bytes(b'\x78\x01 a git object')
    (folder / '.gitattributes').write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (folder / 'notes.txt').write_text("my notes on this model")
    (folder / 'eval').mkdir()
    (folder / 'eval' / 'results.json').write_text('{"val loss": 2.5}')
    return {k: v for k, v in folder_contents(folder).items() if k.split(os.sep)[0] in (
        '.git', '.gitattributes', 'notes.txt', 'eval')}


@pytest.fixture
def token_id_data(tmp_path):
    """A dataset folder of token ids with no text (as data/mqar's): an export from it has no tokenizer."""
    data = tmp_path / 'data-ids'
    data.mkdir()
    (data / 'meta.json').write_text(json.dumps({'tokenizer': 'ids', 'vocab_size': VOCAB, 'task': 'mqar'}))
    return data


def same_export(files, exports):
    """Whether the {name: bytes} files hold the export `exports`: byte for byte but for the model card, which
    names its folder, and its digest in training_run.json."""
    def run(data):
        return {k: v for k, v in json.loads(data).items() if k != 'digests'}
    return all(files[name] == data if name != 'training_run.json' else run(files[name]) == run(data)
               for name, data in exports.items() if name != 'README.md')


def test_overwrite_replaces_only_the_exports_files_in_a_clone_and_removes_the_stale_ones(exported, tmp_path,
                                                                                       token_id_data):
    """A model with its own code and a tokenizer, exported again into its git clone as a plain GPT-2 folder
    without one: the clone's files stay byte for byte, the folder holds exactly a fresh export's files."""
    clone = tmp_path / 'clone'
    first = run_script_in_process('export_hf.py', [f'--out_dir={exported["dint"][1]}', f'--hf_dir={clone}'])
    assert first.returncode == 0, first.stderr
    assert {'model.py', 'modeling_denoised_gpt.py', 'tokenizer.json'} <= {p.name for p in clone.iterdir()}
    users = clone_of(clone)

    model, out_dir, _, _ = exported['base']
    replaced = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--dataset={token_id_data}',
                                                      f'--hf_dir={clone}', '--overwrite=True'])
    assert replaced.returncode == 0, replaced.stderr
    fresh = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--dataset={token_id_data}',
                                                   f'--hf_dir={tmp_path / "fresh"}'])
    assert fresh.returncode == 0, fresh.stderr
    after = folder_contents(clone)
    assert {k: after.get(k, 'gone') for k in users} == users  # .git, .gitattributes, notes, eval/ as they were
    exports = {p.name: p.read_bytes() for p in (tmp_path / 'fresh').iterdir()}
    assert set(after) - set(users) == set(exports)  # no model.py, no tokenizer: nothing stale is left
    assert same_export(after, exports)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['clone', 'data-ids', 'fresh']  # nothing left beside

    hf = load_hf(clone)
    assert type(hf).__name__ == 'GPT2LMHeadModel'
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(idx).logits - model.lm_head(final_hidden_states(model, idx))).abs().max() <= 1e-5


def test_overwrite_keeps_a_model_card_and_chat_template_the_user_wrote_and_says_what_it_replaced(exported,
                                                                                                 tmp_path):
    _, out_dir, _, _ = exported['base']
    folder = tmp_path / 'hf'
    assert run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={folder}']).returncode == 0
    card = (folder / 'README.md').read_text()
    again = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={folder}', '--overwrite=True'])
    assert again.returncode == 0 and f"{folder}: replaced README.md, config.json," in again.stderr + again.stdout
    assert (folder / 'README.md').read_text() == card  # not edited: a new card (the same here)
    (folder / 'README.md').write_text(card + "\n## Results\nOur own notes.\n")
    (folder / 'chat_template.jinja').write_text("{{ messages }}")
    edited = {name: (folder / name).read_bytes() for name in ('README.md', 'chat_template.jinja')}
    proc = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={folder}', '--overwrite=True'])
    assert proc.returncode == 0, proc.stderr
    said = proc.stderr + proc.stdout
    assert f"{folder}: kept your README.md (not as the earlier export wrote it); this export's model card" in said
    assert f"{folder}: kept your chat_template.jinja (not as the earlier export wrote it)" in said
    assert {name: (folder / name).read_bytes() for name in edited} == edited
    assert load_hf(folder) is not None  # the rest is a whole export


def test_a_clone_of_a_new_hub_repository_takes_an_export(exported, tmp_path):
    """A new Hub repository cloned: .git and .gitattributes only (taken without --overwrite), or also the
    README.md the Hub may start it with (replaced with --overwrite); the git files stay as they were."""
    _, out_dir, _, _ = exported['base']
    fresh = tmp_path / 'fresh'
    assert run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={fresh}']).returncode == 0
    exports = {p.name: p.read_bytes() for p in fresh.iterdir()}
    for name, readme in (('bare', False), ('with-readme', True)):
        clone = tmp_path / name
        (clone / '.git').mkdir(parents=True)
        (clone / '.git' / 'HEAD').write_text("ref: refs/heads/main\n")
        (clone / '.gitattributes').write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
        if readme:
            (clone / 'README.md').write_text("---\nlicense: mit\n---\n")
            refused = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={clone}'])
            assert refused.returncode == 2 and "is not empty: pass --overwrite=True" in refused.stderr
        git = {k: v for k, v in folder_contents(clone).items() if k.startswith('.git')}
        proc = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={clone}',
                                                      *(['--overwrite=True'] if readme else [])])
        assert proc.returncode == 0, proc.stderr
        after = folder_contents(clone)
        assert {k: after[k] for k in git} == git
        assert set(after) - set(git) == set(exports)
        assert same_export(after, exports)
        assert "license: mit" not in after['README.md'].decode()


def test_a_failed_overwrite_leaves_the_folder_exactly_as_it_was(exported, char_data, tmp_path, token_id_data,
                                                                monkeypatch):
    """Failing while the files are written (the disk full at the tokenizer), or while they are moved in (a
    folder where one of them goes, after several have gone in): the clone as it was, nothing left beside."""
    import denoised_gpt.hf_format as hf_format
    clone = tmp_path / 'clone'
    export(read_checkpoint(exported['base'][1])[1], str(clone), data_dir=str(token_id_data))
    clone_of(clone)
    (clone / 'tokenizer_config.json').mkdir()  # the new export writes a file of that name, after seven others
    (clone / 'tokenizer_config.json' / 'mine.txt').write_text("in the way")
    before = folder_contents(clone)
    dint = read_checkpoint(exported['dint'][1])[1]
    with pytest.raises(IsADirectoryError):
        export(dint, str(clone), data_dir=str(char_data), overwrite=True)
    assert folder_contents(clone) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['clone', 'data-ids']

    def broken(*args):
        raise OSError("disk full")
    monkeypatch.setattr(hf_format, 'write_tokenizer', broken)
    with pytest.raises(OSError, match="disk full"):
        export(dint, str(clone), overwrite=True)
    assert folder_contents(clone) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['clone', 'data-ids']


def test_every_file_an_export_writes_is_one_an_overwrite_would_remove_when_stale(exported):
    """EXPORT_FILES names them all, for each format and tokenizer (a transformers version that saves another
    file must be added there, or an export into an earlier one could leave that file stale)."""
    from denoised_gpt.hf_format import is_export_file
    written = {p.name for _, _, folder, _ in exported.values() for p in folder.iterdir()}
    assert {'model.py', 'generation_config.json', 'tokenizer.json'} <= written
    assert [name for name in sorted(written) if not is_export_file(name)] == []
    assert not any(map(is_export_file, ['.git', '.gitattributes', 'notes.txt', 'ckpt.pt', 'eval']))


def test_export_hf_refuses_a_dataset_that_is_not_there(exported, tmp_path):
    out_dir = exported['dint'][1]
    (tmp_path / 'a-file').write_text("not a folder")
    for dataset in ('nosuch', str(tmp_path / 'a-file')):
        proc = run_script_in_process('export_hf.py', [f'--out_dir={out_dir}', f'--hf_dir={tmp_path / "hf"}',
                                                      f'--dataset={dataset}'])
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"export_hf.py: error: dataset={dataset!r}: no folder "), proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ['a-file']  # nothing written


@pytest.mark.skipif(not small_disk_available(), reason="needs `unshare -rm` to mount a small tmpfs (a real full "
                                                       "disk, a read-only file system)")
def test_an_export_to_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(tmp_path):
    """safetensors says a failed write of the weights in its own exception (SafetensorError), which was a
    traceback; now it is the OSError it stands for, said as the other write failures are."""
    tiny_checkpoint(tmp_path / 'out', 'base', tmp_path / 'no-data')
    for read_only, cause, remedy in [(False, "no space left on device", "Free some space"),
                                     (True, "read-only file system", "Write to a writable disk")]:
        disk = tmp_path / f"disk-{read_only}"
        proc, left = on_small_disk(disk, [sys.executable, 'export_hf.py', f"--out_dir={tmp_path / 'out'}",
                                          f"--hf_dir={disk / 'hf'}"], size='64k', read_only=read_only)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (f"export_hf.py: error: cannot write {disk / 'hf'}: {cause}; "
                                                        f"nothing was changed there. {remedy} and export again")
        assert 'Traceback' not in proc.stderr and left == []  # no hf_dir, no temporary folder
