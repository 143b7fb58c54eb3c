"""
Trained models in the Hugging Face format (export_hf.py), and such folders read back (init_from=<folder>
in train.py, sample.py and eval.py).

A `base` model with biases means what GPT-2's weights mean: it becomes a plain transformers
GPT2LMHeadModel folder (exact GELU, Conv1D weights transposed, lm_head tied to wte, no dropout) that loads
without remote code. Any other model (another attn_type; base without biases or with widened query/key
heads, which GPT-2's layers cannot hold) becomes a `denoised_gpt` folder: config.json with every GPTConfig
field, model.safetensors with GPT's state_dict (the tied lm_head.weight stored once, as wte, the way
transformers stores tied weights), copies of model.py and fused_loss.py, and the two short files of hf_templates/ that make
it an AutoModelForCausalLM with trust_remote_code=True.

Either way the vocabulary keeps the checkpoint's size (GPT-2's 50257 padded to 50304), so the logits are
exactly the model's; the tokenizer is written where the dataset's vocabulary allows it; README.md (the
model card) says what the folder holds and how to load it; training_run.json keeps the run's counters
and settings, which sample.py and eval.py show and use to find a char-level vocabulary.
"""
import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile

import torch

from denoised_gpt.batches import load_meta, read_meta_pkl
from denoised_gpt.checkpoint import CKPT_NAME
from denoised_gpt.checkpoint_base import short_reason, train_state_problem
from denoised_gpt.extras import require
from denoised_gpt.files import read_json

MODEL_TYPE = 'denoised_gpt'  # config.json's model_type of a folder with our own modeling code
WEIGHTS_FILE = 'model.safetensors'
RUN_FILE = 'training_run.json'
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'hf_templates')
CODE_FILES = ('configuration_denoised_gpt.py', 'modeling_denoised_gpt.py')
AUTO_MAP = {'AutoConfig': 'configuration_denoised_gpt.DenoisedGPTConfig',
            'AutoModelForCausalLM': 'modeling_denoised_gpt.DenoisedGPTForCausalLM'}
GPT2_VOCAB = 50257  # GPT-2's BPE tokens; <|endoftext|> is the last
GPT2_EOT = 50256
# the two files of tiktoken's 'gpt2' encoding: the address tiktoken caches them under, and their SHA-256
GPT2_BPE_FILES = {
    'encoder.json': ('https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json',
                     '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783'),
    'vocab.bpe': ('https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe',
                  '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5'),
}
CONV1D_WEIGHTS = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
# the names of the files an export writes (fnmatch patterns), whatever its format, tokenizer and the
# transformers version that saved it: an export into an earlier one (overwrite) removes those it does not
# write again, which would make a wrong folder, and keeps every other file (.git, .gitattributes, notes)
MODEL_FILES = ('model.py', 'fused_loss.py')  # copied unchanged: the fused loss's copy names its op itself
EXPORT_FILES = ('README.md', RUN_FILE, 'config.json', 'generation_config.json', *MODEL_FILES, *CODE_FILES,
                WEIGHTS_FILE, 'model.safetensors.index.json', 'model-*-of-*.safetensors',
                'pytorch_model.bin', 'pytorch_model.bin.index.json', 'pytorch_model-*-of-*.bin',
                'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json',
                'vocab.json', 'merges.txt', 'chat_template.jinja')


# ----------------------------------------------------------------------------------------------
# Export

# files a user edits or adds in an exported folder: an export into it again keeps them when they are not
# what the earlier export wrote
USERS_FILES = ('README.md', 'chat_template.jinja')


def check_hf_dir(hf_dir, overwrite):
    """ValueError unless hf_dir can take an export: a new or empty folder (hidden files such as .git do not
    count: a clone of a new Hub repository), or with overwrite one holding an earlier export (and perhaps
    more: a git clone of the published model) or only the README.md a new Hub repository starts with."""
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ValueError(f"hf_dir={hf_dir!r} is a file, not a folder: choose a folder name")
    visible = [name for name in os.listdir(hf_dir) if not name.startswith('.')] if os.path.isdir(hf_dir) else []
    if not visible:
        return
    if not overwrite:
        raise ValueError(f"hf_dir={hf_dir!r} is not empty: pass --overwrite=True to replace the export there, "
                         f"or choose another folder")
    if visible == ['README.md']:
        return
    if not os.path.isfile(os.path.join(hf_dir, 'config.json')) or os.path.exists(os.path.join(hf_dir, CKPT_NAME)):
        raise ValueError(f"hf_dir={hf_dir!r} holds something other than an exported model (no config.json, or a "
                         f"training checkpoint): overwrite only replaces an earlier export; choose another folder")
    if not os.path.isfile(os.path.join(hf_dir, RUN_FILE)):  # every export writes it: another model's folder
        raise ValueError(f"hf_dir={hf_dir!r} holds a model export_hf.py did not write (no {RUN_FILE}): overwrite "
                         f"only replaces an earlier export, never another model's files; choose another folder")


def gpt2_incompatibility(config):
    """Why a transformers GPT2LMHeadModel cannot hold this model (a GPTConfig), or None when it can."""
    if config.attn_type != 'base':
        return f"attn_type={config.attn_type!r} is not GPT-2's attention"
    if not config.bias:
        return "the model has no biases (bias=False), and GPT-2's layers always have them"
    if config.qk_head_size not in (None, config.n_embd // config.n_head):
        return f"its query/key heads are widened (qk_head_size={config.qk_head_size}), GPT-2's are not"
    return None


def exported_code_problem(config):
    """Why the copy of model.py that an export of this model (a GPTConfig) carries could not build it, or None: its
    attn_type must be registered in model.py's own ATTENTION_TYPES, to a class defined there."""
    import ast

    import model as model_module
    cls = model_module.ATTENTION_TYPES[config.attn_type]
    with open(model_module.__file__) as f:
        tree = ast.parse(f.read())
    registries = [node.value for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                  and any(getattr(t, 'id', None) == 'ATTENTION_TYPES' for t in node.targets)]
    written = {ast.literal_eval(k): getattr(v, 'id', None) for r in registries for k, v in zip(r.keys, r.values)}
    if written.get(config.attn_type) == cls.__name__ and cls.__module__ == model_module.__name__:
        return None
    return (f"attn_type={config.attn_type!r} ({cls.__module__}.{cls.__qualname__}) is not registered in model.py's "
            f"ATTENTION_TYPES, and an exported folder runs a copy of model.py: define the class and its registry "
            f"line in model.py to export it")


def export(checkpoint, hf_dir, data_dir=None, overwrite=False):
    """Write `checkpoint` (read_checkpoint's dict) to hf_dir in the Hugging Face format; data_dir: the
    dataset folder whose metadata says what the token ids mean (None: unknown). The files are written
    into a temporary folder beside hf_dir and moved into place when all are written (_move_into_place),
    so a failed export leaves hf_dir as it was. Returns notes for the user: the format chosen and why,
    what the tokenizer is. ValueError when the checkpoint or hf_dir cannot be used."""
    from safetensors import SafetensorError
    from denoised_gpt.weights import PEFT_WRAPPER, model_with_weights
    from model import GPTConfig
    check_hf_dir(hf_dir, overwrite)
    if any(PEFT_WRAPPER + '.' in k for k in checkpoint['model']):
        raise ValueError("this checkpoint holds LoRA adapters: merge them first (python3 train.py --out_dir=<its "
                         "out_dir> --merge_lora=True) and export <out_dir>/merged")
    try:
        model = model_with_weights(GPTConfig(**checkpoint['model_args']), checkpoint['model']).eval()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"the checkpoint does not build a model: {short_reason(e)}") from e
    incompatibility = gpt2_incompatibility(model.config)
    problem = incompatibility and exported_code_problem(model.config)  # a GPT-2 folder needs no model.py
    if problem:
        raise ValueError(problem)
    vocabulary, itos, why_not = dataset_vocabulary(data_dir, model.config.vocab_size)

    notes = []
    tmp = f"{os.path.realpath(hf_dir)}.tmp-{os.getpid()}"  # real path: on hf_dir's file system, renames work
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        end_of_text = GPT2_EOT if vocabulary == 'gpt2' else None
        if incompatibility is None:
            write_gpt2_model(model, tmp, end_of_text)
            notes.append("format: transformers GPT2LMHeadModel (loads without remote code)")
        else:
            write_denoised_gpt_model(model, tmp, end_of_text)
            notes.append(f"format: model.py's own code, loaded with trust_remote_code=True ({incompatibility})")
        tokenizer_note = write_tokenizer(tmp, vocabulary, itos, why_not, model.config.block_size)
        notes.append(f"tokenizer: {tokenizer_note}")
        run = dict(attn_type=model.config.attn_type, iter_num=int(checkpoint['iter_num']),
                   best_val_loss=_plain_float(checkpoint['best_val_loss']), config=checkpoint.get('config', {}))
        with open(os.path.join(tmp, 'README.md'), 'w') as f:
            f.write(model_card(model, run, incompatibility, vocabulary, tokenizer_note, hf_dir))
        # what the files a user may edit held, so that a later export into this folder tells edits from its own
        run['digests'] = {name: _sha256(os.path.join(tmp, name)) for name in USERS_FILES
                          if os.path.isfile(os.path.join(tmp, name))}
        with open(os.path.join(tmp, RUN_FILE), 'w') as f:
            json.dump(run, f, indent=2, default=repr)
        notes += _move_into_place(tmp, hf_dir)
    except SafetensorError as e:  # a failed write of the weights, in safetensors' words
        written = re.search(r"\(os error (\d+)\)", str(e))
        if written is None:
            raise
        raise OSError(int(written[1]), os.strerror(int(written[1]))) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return notes


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    return digest.hexdigest()


def _written_by_earlier_export(hf_dir):
    """{name: sha256} of the USERS_FILES the earlier export in hf_dir wrote, as its training_run.json records
    them; None when nothing records them (no earlier export, one from a version that did not, a damaged
    record)."""
    try:
        digests = _read_json(os.path.join(hf_dir, RUN_FILE)).get('digests')
    except ValueError:
        return None
    return digests if isinstance(digests, dict) else None


def _move_into_place(tmp, hf_dir):
    """Put the finished export (the files in tmp) in hf_dir. A new folder is tmp renamed. In an existing
    one (empty, a new Hub repository's clone, or an earlier export with overwrite) each file is renamed
    into place, replacing the earlier file of its name, and the earlier export's files that this one does
    not write (EXPORT_FILES) are removed; nothing else there is touched: .git, .gitattributes, the user's
    own files and folders. A model card or chat template that the earlier export did not write as it is
    (edited, or added, by the user) is kept. Returns notes saying what was replaced, removed and kept.

    What is atomic: each file's rename, not the folder's. While the files go in (milliseconds) a reader
    can see some earlier files beside new ones; if a rename fails, the earlier files are put back and the
    folder is as it was. Only a crash in those milliseconds leaves a mix (export again to repair it)."""
    _make_shareable(tmp)
    if not os.path.isdir(hf_dir):
        os.rename(tmp, hf_dir)
        return []
    earlier = {name for name in os.listdir(hf_dir) if not _is_folder(os.path.join(hf_dir, name))}
    written = _written_by_earlier_export(hf_dir)
    kept = [name for name in USERS_FILES if name in earlier and written is not None
            and written.get(name) != _sha256(os.path.join(hf_dir, name))]
    new = sorted(set(os.listdir(tmp)) - set(kept))  # a fixed order: a failure part-way is the same every time
    stale = sorted(name for name in earlier - set(new) - set(kept) if is_export_file(name))
    old = f"{tmp}.old"
    os.mkdir(old)
    moved = []  # the names handled so far, in order, for putting the earlier files back
    try:
        for name in new + stale:
            moved.append(name)
            if name in earlier:
                os.rename(os.path.join(hf_dir, name), os.path.join(old, name))
            if name in new:
                os.rename(os.path.join(tmp, name), os.path.join(hf_dir, name))
    except OSError:
        for name in reversed(moved):
            if os.path.lexists(os.path.join(old, name)):
                os.replace(os.path.join(old, name), os.path.join(hf_dir, name))
            elif name in new and not os.path.lexists(os.path.join(tmp, name)):
                os.remove(os.path.join(hf_dir, name))  # a new file where there was none
        os.rmdir(old)
        raise
    shutil.rmtree(old)
    replaced = [name for name in new if name in earlier]
    notes = [f"{hf_dir}: replaced {', '.join(replaced)}"] if replaced else []
    if stale:
        notes.append(f"{hf_dir}: removed {', '.join(stale)} (the earlier export's; this one does not write them)")
    notes += [f"{hf_dir}: kept your {name} (not as the earlier export wrote it)" + (
        "; this export's model card is not written: update yours, or delete it and export again for a new one"
        if name == 'README.md' else "") for name in kept]
    return notes


def is_export_file(name):
    """Whether a file of this name in an exported folder is one an export writes (EXPORT_FILES)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in EXPORT_FILES)


def _is_folder(path):
    return stat.S_ISDIR(os.lstat(path).st_mode)  # a link is a file here: moving it moves the link only


def _make_shareable(folder):
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):  # some writers make their files private (0600): this folder is for sharing
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _plain_float(value):
    value = float(value.item() if torch.is_tensor(value) else value)
    return value if value < 1e9 else None  # 1e9: train.py's "not evaluated yet"


def write_gpt2_model(model, folder, end_of_text):
    """model (base attention with biases) as a transformers GPT2LMHeadModel saved in folder."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = model.config
    hf_config = GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                           n_head=c.n_head, layer_norm_epsilon=1e-5,
                           activation_function='gelu',  # our MLP's exact nn.GELU; GPT-2's gelu_new is the tanh form
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                           bos_token_id=end_of_text, eos_token_id=end_of_text)
    # the same names as ours; GPT-2's Conv1D modules hold the transpose of a Linear's weight
    state = {k: (v.t().contiguous() if k.endswith(CONV1D_WEIGHTS) else v) for k, v in model.state_dict().items()}
    with torch.device('meta'):  # every tensor comes from the model: nothing to initialise
        hf_model = GPT2LMHeadModel(hf_config)
    hf_model.load_state_dict(state, assign=True)
    hf_model.lm_head.weight = hf_model.transformer.wte.weight  # assign gave each name its own Parameter
    hf_model.save_pretrained(folder)


def write_denoised_gpt_model(model, folder, end_of_text):
    """model as config.json + model.safetensors + model.py, fused_loss.py + the hf_templates/ code, in folder."""
    import model as model_module
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != 'lm_head.weight'}  # = wte, tied
    save_file(state, os.path.join(folder, WEIGHTS_FILE), metadata={'format': 'pt'})
    config = {**dataclasses.asdict(model.config), 'model_type': MODEL_TYPE,
              'architectures': ['DenoisedGPTForCausalLM'], 'auto_map': AUTO_MAP, 'tie_word_embeddings': True,
              'dtype': str(model.lm_head.weight.dtype).removeprefix('torch.'),
              'bos_token_id': end_of_text, 'eos_token_id': end_of_text}
    with open(os.path.join(folder, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    for name in MODEL_FILES:
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(model_module.__file__)), name),
                    os.path.join(folder, name))
    for name in CODE_FILES:
        shutil.copy(os.path.join(TEMPLATES, name), os.path.join(folder, name))


# ----------------------------------------------------------------------------------------------
# Tokenizer

def dataset_vocabulary(data_dir, vocab_size):
    """What the model's token ids mean, decided as sample.py decides it: (kind, itos, why_not) with kind
    'gpt2', 'char' (itos: {id: character}) or None (why_not: why no tokenizer can be written).
    ValueError for unreadable metadata."""
    meta = load_meta(data_dir) if data_dir and os.path.isdir(data_dir) else None
    if meta is not None and meta.get('tokenizer') == 'ids':
        task = meta.get('task', 'a synthetic task')
        return None, None, (f"{data_dir} holds token ids with no text ({task}), so there is no tokenizer: give "
                            f"the model token ids")
    if meta is not None and meta.get('tokenizer') == 'char':
        meta_pkl = os.path.join(data_dir, 'meta.pkl')
        if 'itos' not in meta and os.path.isfile(meta_pkl):
            meta = {**meta, **read_meta_pkl(meta_pkl)}  # plain data only
        if 'itos' in meta:
            return 'char', meta['itos'], None
        return None, None, (f"{data_dir} is a char-level dataset whose vocabulary is not there (no chars in "
                            f"meta.json, no meta.pkl), so the characters of the token ids are unknown")
    if vocab_size >= GPT2_VOCAB:
        return 'gpt2', None, None
    where = f"in {data_dir}" if data_dir else "(the checkpoint names no dataset)"
    return None, None, (f"the model has {vocab_size} token ids, too few for GPT-2's BPE, and no vocabulary was "
                        f"found {where}: pass --dataset=<the data folder it was trained on> to export its tokenizer")


def write_tokenizer(folder, vocabulary, itos, why_not, block_size):
    """Save the tokenizer of dataset_vocabulary's (vocabulary, itos, why_not) in folder: GPT-2's BPE, or one
    token per character. Returns what was written, or why nothing was, in one line for the model card."""
    if vocabulary == 'gpt2':
        gpt2_tokenizer(block_size).save_pretrained(folder)
        return "GPT-2's BPE (tiktoken's 'gpt2' encoding), written for AutoTokenizer"
    if vocabulary == 'char':
        tokenizer = char_tokenizer(itos, block_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            _set_tokenizer_class(folder, 'PreTrainedTokenizerFast')
            return f"one token per character ({len(itos)} characters), written for AutoTokenizer"
        why_not = ("the dataset's vocabulary has entries that are not single characters, which a character "
                   "tokenizer cannot reproduce exactly")
    return f"none written: {why_not}"


def _set_tokenizer_class(folder, name):
    # transformers 5 saves its generic class as 'TokenizersBackend', a name transformers 4 does not know
    path = os.path.join(folder, 'tokenizer_config.json')
    config = _read_json(path)
    with open(path, 'w') as f:
        json.dump({**config, 'tokenizer_class': name}, f, indent=2)


def gpt2_tokenizer(block_size):
    """transformers' GPT-2 tokenizer from tiktoken's own files (its cache, TIKTOKEN_CACHE_DIR; tiktoken
    fetches them once where they are not cached), so it encodes exactly as tiktoken's 'gpt2'."""
    import tiktoken.load
    from transformers import GPT2TokenizerFast
    with tempfile.TemporaryDirectory() as tmp:
        for name, hf_name in (('encoder.json', 'vocab.json'), ('vocab.bpe', 'merges.txt')):
            url, sha256 = GPT2_BPE_FILES[name]
            try:
                data = tiktoken.load.read_file_cached(url, sha256)
            except Exception as e:  # offline, tiktoken's download is a network error of some kind
                raise ValueError(f"cannot read GPT-2's BPE file {name} ({type(e).__name__}: {e}); tiktoken downloads "
                                 f"it on first use: connect once, or point TIKTOKEN_CACHE_DIR at a folder that holds "
                                 f"its files") from e
            with open(os.path.join(tmp, hf_name), 'wb') as f:
                f.write(data)
        tokenizer = GPT2TokenizerFast.from_pretrained(tmp, model_max_length=block_size)
    for where_read_from in ('is_local', 'local_files_only'):  # about the temporary folder, not the tokenizer
        tokenizer.init_kwargs.pop(where_read_from, None)
    return tokenizer


def char_tokenizer(itos, block_size):
    """A tokenizer with one token per character ({id: character}): every character of a text is its
    own token, and decoding joins them without spaces. None unless it round-trips the vocabulary exactly."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    itos = {int(i): c for i, c in itos.items()}
    ids = sorted(itos)
    text = ''.join(itos[i] for i in ids)
    if any(len(itos[i]) != 1 for i in ids) or len(set(text)) != len(ids):
        return None
    backend = Tokenizer(models.WordLevel({itos[i]: i for i in ids}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), behavior='isolated')  # each character alone
    backend.decoder = decoders.Fuse()  # the characters joined as they are
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=block_size,
                                        clean_up_tokenization_spaces=False)
    if tokenizer.encode(text, verbose=False) != ids or tokenizer.decode(ids) != text:
        return None
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Model card

def model_card(model, run, incompatibility, vocabulary, tokenizer_note, hf_dir):
    """README.md of the exported folder: what the model is, how to load it, what to know, how it was trained."""
    from model import ATTENTION_TYPES
    c = model.config
    name = os.path.basename(os.path.normpath(hf_dir))
    remote = incompatibility is not None
    n_params = sum(p.numel() for p in model.parameters())
    best = f"{run['best_val_loss']:.4f}" if run['best_val_loss'] is not None else "not evaluated"
    trust = ", trust_remote_code=True" if remote else ""
    rows = [('attention', f"`{c.attn_type}`"),
            ('parameters', f"{n_params:,} ({model.get_num_params():,} without the position embeddings, "
                           f"nanoGPT's count)"),
            ('layers / heads / width / context', f"{c.n_layer} / {c.n_head} / {c.n_embd} / {c.block_size} tokens"),
            ('dataset', f"`{run['config'].get('dataset', 'unknown')}`"),
            ('iterations', f"{run['iter_num']:,}"),
            ('best val loss', best),
            ('format', "model.py's own code (`trust_remote_code=True`)" if remote
             else "transformers `GPT2LMHeadModel` (no remote code)"),
            ('tokenizer', tokenizer_note)]
    notes = []
    if remote:
        notes.append(f"GPT-2's model class cannot hold this model ({incompatibility}), so the folder carries "
                     f"its own code: `model.py` (the training code's model, unchanged) and two short files that "
                     f"wrap it as a transformers model. `trust_remote_code=True` runs that code.")
        notes.append("`generate()` decodes with model.py's own cache (keys and values per layer; the recurrent "
                     "state for linear attention; DINT's running sum): pass `use_cache=True` (the default). "
                     "Batches must not be padded (an `attention_mask` with zeros is refused), and a sequence "
                     f"may be at most {c.block_size} tokens long.")
    if vocabulary == 'gpt2' and c.vocab_size > GPT2_VOCAB:
        notes.append(f"The vocabulary has {c.vocab_size} rows: GPT-2's {GPT2_VOCAB} tokens padded to a multiple "
                     f"of 64 for speed, kept so that the logits are exactly the trained model's. Ids "
                     f"{GPT2_VOCAB}-{c.vocab_size - 1} are padding rows, never a target in training (training "
                     f"pushes their probabilities towards zero), which the tokenizer cannot decode; to rule them out when "
                     f"sampling, pass `suppress_tokens=list(range({GPT2_VOCAB}, {c.vocab_size}))` to `generate()`.")
    if 'noise_at_eval' in ATTENTION_TYPES[c.attn_type].config_fields:
        if c.noise_at_eval:
            notes.append("NoiseFormer: the attention noise is on in evaluation and generation, as in training "
                         "(`noise_at_eval=True`), so outputs are random: seed torch for repeatable runs. "
                         "`from_pretrained(..., noise_at_eval=False)` turns it off (exactly symmetric attention).")
        else:
            notes.append("NoiseFormer: the attention noise is off in evaluation and generation "
                         "(`noise_at_eval=False`: exactly symmetric attention); "
                         "`from_pretrained(..., noise_at_eval=True)` turns it on, as in training.")
    if tokenizer_note.startswith('none'):
        notes.append(f"No tokenizer: {tokenizer_note.removeprefix('none written: ')}.")
    settings = '\n'.join(f"{k} = {v!r}" for k, v in run['config'].items())
    load_tokenizer = "" if tokenizer_note.startswith('none') else \
        f'tokenizer = AutoTokenizer.from_pretrained("{name}"{trust})  # AutoTokenizer reads config.json too\n'
    return f"""---
library_name: transformers
tags:
- {MODEL_TYPE}
- {c.attn_type}
---
# {name}: a GPT with `{c.attn_type}` attention

Exported by `export_hf.py` from a checkpoint of the denoised-gpt training code (nanoGPT with several
attention variants).

| | |
|---|---|
""" + '\n'.join(f"| {k} | {v} |" for k, v in rows) + f"""

## Loading

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}"{trust})
{load_tokenizer}```

With the training code: `python3 sample.py --init_from={name}`, `python3 eval.py --init_from={name} ...`,
or a new run starting from these weights: `python3 train.py --init_from={name} --attn_type={c.attn_type} ...`.

## Notes

""" + '\n'.join(f"- {n}" for n in notes) + f"""

## Training settings

The run's settings as its checkpoint recorded them (a flat config file for `train.py`):

```python
{settings}
```
"""


# ----------------------------------------------------------------------------------------------
# Reading an exported folder back

def exported_model_type(path):
    """config.json's model_type when path is a folder in the Hugging Face format ('gpt2', MODEL_TYPE, ...),
    else None. ValueError for a config.json that cannot be read."""
    config_path = os.path.join(path, 'config.json')
    if not os.path.isfile(config_path):
        return None
    return _read_json(config_path).get('model_type')


def _read_json(path):
    """An exported folder's JSON file (config.json, training_run.json, ...) as a dict: ValueError naming it
    and what is wrong otherwise."""
    try:
        value = read_json(path, "export the model again")
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror or e}): export the model again") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object: export the model again")
    return value


def exported_run(path):
    """What training_run.json of an exported folder records (iter_num, best_val_loss, config), as the
    keys of a checkpoint dict; None for a folder without one (e.g. GPT-2 saved by transformers)."""
    run_path = os.path.join(path, RUN_FILE)
    if not os.path.isfile(run_path):
        return None
    run = _read_json(run_path)
    best = run.get('best_val_loss')
    state = dict(iter_num=run.get('iter_num', 0), best_val_loss=1e9 if best is None else best,
                 config=run.get('config', {}))
    problem = train_state_problem(state)
    if problem:
        raise ValueError(f"{run_path} is not as export_hf.py writes it: its {problem}; export the model again")
    return state


def read_exported(path):
    """A denoised_gpt folder (export_hf.py's, or saved again by the transformers model's save_pretrained)
    as a checkpoint dict like read_checkpoint's: model (GPT's state_dict, lm_head.weight = wte again),
    model_args, and iter_num, best_val_loss, config from training_run.json; no optimizer state.
    ValueError / FileNotFoundError for a folder that is not one."""
    require('safetensors', f"reading {path} (an exported folder)")
    from safetensors.torch import load_file
    from model import GPTConfig
    config = _read_json(os.path.join(path, 'config.json'))
    if config.get('model_type') != MODEL_TYPE:
        raise ValueError(f"{path} holds a {config.get('model_type')!r} model, not one exported as {MODEL_TYPE!r}")
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{path} has a config.json but no {WEIGHTS_FILE}: export the model again")
    model_args = {f.name: config[f.name] for f in dataclasses.fields(GPTConfig) if f.name in config}
    # 'gpt.': the prefix the transformers model (whose GPT is model.gpt) gives the names when it saves
    state = {k.removeprefix('gpt.'): v for k, v in load_file(weights).items()}
    if 'transformer.wte.weight' in state:
        state.setdefault('lm_head.weight', state['transformer.wte.weight'])  # tied: stored once
    run = exported_run(path) or dict(iter_num=0, best_val_loss=1e9, config={})
    return dict(model=state, model_args=model_args, optimizer=None, **run)
