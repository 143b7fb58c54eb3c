"""
Sample from a trained model: plain text, a ready-to-paste Markdown or LaTeX appendix, or JSON lines.

$ python3 sample.py --out_dir=out-shakespeare-char
$ python3 sample.py --out_dir=out-owt-noiseformer_v2 --prompts_file=prompts/appendix.txt --format=latex > appendix.tex
$ python3 sample.py --init_from=gpt2-xl --start="What is the answer to life, the universe, and everything?"
$ python3 sample.py --init_from=hf-owt-noiseformer_v2   # a folder written by export_hf.py

Prompts come from --start (the text itself, or FILE:path to use a whole file as one prompt) or from
--prompts_file (one prompt per line, blank lines skipped; prompts/appendix.txt is a small neutral set).
Every prompt gets num_samples completions of max_new_tokens tokens, generated together as one batch
with the model's KV cache (model.generate): at batch 1 each token reads all the weights for one
sequence, so a batch of 3 costs little more than one sequence.

Reproducibility: before prompt i (0-based, blank lines not counted) the random generators are seeded
with seed + i, and that prompt's batch is the only thing generated until the next seeding. So prompt
i's samples depend only on the prompt, seed + i and the model and settings (same device and dtype): a
command prints the same samples every time it runs, adding a prompt at the end of the file changes
none of the others, and the samples of prompt i equal those of --start=<that prompt> --seed=<seed + i>.
Prompts are not batched with each other, even when of equal length: the shared batch would make a
prompt's samples depend on which other prompts are in the file (NoiseFormer noise draws, rounding).

Weights are held in the sampling dtype instead of being autocast from float32 at every token; a variant's
own parameters (DIFF/DINT lambda and head norm, NoiseFormer mu/sigma) stay float32, and the model runs under
autocast, as in training (model.AttentionBase: precision). --dtype=auto is the dtype the checkpoint was
trained in where the device runs it (a model trained in float32 can answer differently in bfloat16), else the
device's fastest (bfloat16, or float16 on CUDA without bfloat16). --dtype=float32 keeps everything in float32.

Only the samples go to stdout; messages go to stderr, so `> appendix.md` captures a clean file.
Formats:
  text      nanoGPT's output: each sample (prompt + completion) followed by a line of dashes
  markdown  a heading per prompt, the completions (the generated text only) as code blocks separated
            by horizontal rules, the model and checkpoint named once at the top
  latex     the same as \\subsection* / \\subsubsection* / quote environments; every LaTeX special
            character is escaped and line breaks and indentation are kept, so any sample compiles
  jsonl     one JSON object per completion: prompt, completion, and the model and sampling settings
Special tokens (GPT-2's <|endoftext|>) are kept as readable markers: `<|endoftext|>`.
NoiseFormer models keep their attention noise on while sampling (as in the paper) unless
--noise_at_eval=False. Each completion of a batch gets its own noise draw (noise_per_sample=True
while sampling): with one draw shared by the batch, the completions of a prompt would see the same
noise at every step, unlike completions generated one at a time (at temperature 0 they would even
be identical). Each sequence's own noise has the distribution training gave it either way.

Weights that are not all finite (NaN or inf: a diverged run's state, which train.py never saves) are
refused in one line: every sample from them would be NaN.

The char-level vocabulary is read from data/<dataset>/ (meta.json, or nanoGPT's meta.pkl read as
plain data only: a meta.pkl that would run code is refused). When a checkpoint's dataset points
outside data/, a note names the folder the vocabulary is read from.
"""

from configurator import answer_help
from denoised_gpt.cpu_threads import wait_passively_if_busy

answer_help(__file__)  # --help before the heavy imports below
wait_passively_if_busy()  # before torch loads OpenMP, which reads its wait policy once

import json
import os
import re
import time

import torch

from denoised_gpt.batches import load_meta, read_meta_pkl
from denoised_gpt.cli import (MAX_STEPS, check_inference_source, check_ranges, fail, gpt2_encoding, log, prepare_device,
                              print_result, quiet_ctrl_c, read_config, refused_allocation, run_dtype)
from denoised_gpt.checkpoint_base import MAX_COUNT
from denoised_gpt.models import load_model, noise_on, trained_dtype
from denoised_gpt.files import MAX_PROMPT_BYTES, FileError, read_text
from denoised_gpt.device import autocast_context, manual_seed, torch_dtype
from model import ATTENTION_TYPES

quiet_ctrl_c()  # Ctrl-C: one line and exit 130, no traceback

# -----------------------------------------------------------------------------
init_from = 'resume'  # 'resume' (from an out_dir), a gpt2 variant (e.g. 'gpt2-xl') or a Hugging Face folder (export_hf.py)
out_dir = 'out'  # ignored if init_from is not 'resume'
start = "\n"  # or "<|endoftext|>" or etc. Can also specify a file, use as: "FILE:prompt.txt"
prompts_file = ''  # a file with one prompt per line (blank lines skipped), instead of start
num_samples = 3  # number of completions per prompt
max_new_tokens = 100  # number of tokens generated in each completion
temperature = 0.8  # 1.0 = no change, < 1.0 = less random, > 1.0 = more random; 0 = always the likeliest
top_k = 200  # retain only the top_k most likely tokens, clamp others to have 0 probability (0: keep all)
seed = 1337  # prompt i (0-based) is sampled after seeding with seed + i: its samples never depend on other prompts
device = 'auto'  # 'auto' (cuda > hpu > mps > cpu), 'cpu', 'cuda', 'cuda:1', 'hpu', 'mps'
dtype = 'auto'  # 'auto' (the training dtype), 'float32', 'bfloat16' or 'float16' (CUDA); the weights are held in it
format = 'text'  # 'text', 'markdown', 'latex' or 'jsonl' (see the top of this file)
noise_at_eval = None  # NoiseFormer only: None keeps the checkpoint's setting (noise on), False turns it off
kv_cache = True  # generate with the KV cache; False recomputes the whole context for every token
dataset = ''  # char-level models: the data/ folder with meta.pkl (default: the checkpoint's dataset)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))]
FORMATS = ('text', 'markdown', 'latex', 'jsonl')

config = read_config(__file__, {k: globals()[k] for k in config_keys}, optional_bools=('noise_at_eval',))
globals().update(config)
if format not in FORMATS:
    fail(f"format={format!r} is not one of {', '.join(FORMATS)}")
try:
    check_ranges(config, at_least_one=('num_samples', 'max_new_tokens'), seeds=('seed',),
                 at_most={'num_samples': (MAX_COUNT, "completions per prompt (torch's int64)"),
                          'max_new_tokens': (MAX_STEPS, "tokens")})  # (beyond the memory check below: a traceback)
except ValueError as e:
    fail(e)
if temperature < 0 or top_k < 0:
    fail(f"temperature={temperature} and top_k={top_k} must not be negative (top_k=0 keeps all tokens)")
check_inference_source(init_from)

# -----------------------------------------------------------------------------
# prompts first: a typo in a file name should not cost a model load


def read_prompts(path, what):
    try:
        return read_text(path, MAX_PROMPT_BYTES, what, "give a text file of prompts")
    except FileNotFoundError:
        fail(f"{what} {path!r} not found (relative paths start from {os.getcwd()})")
    except FileError as e:
        fail(e)
    except OSError as e:
        fail(f"cannot read {what} {path!r}: {e}")


if prompts_file:
    if start != "\n":
        fail("give the prompts either with --start or with --prompts_file, not both")
    prompts = [line for line in read_prompts(prompts_file, 'prompts_file').splitlines() if line.strip()]
    if not prompts:
        fail(f"prompts_file {prompts_file!r} has no prompts: write one prompt per line "
             f"(blank lines are skipped)")
elif start.startswith('FILE:'):
    prompts = [read_prompts(start[5:], 'prompt file (start=FILE:...)')]
    if not prompts[0]:
        fail(f"prompt file {start[5:]!r} is empty")
else:
    prompts = [start]
    if not start:
        fail("start='' is an empty prompt; give some text, e.g. --start='\\n' or --start='<|endoftext|>'")

# -----------------------------------------------------------------------------
# model

device, dtype = prepare_device(device, dtype)
# the completions of a prompt are one batch: give each its own noise draw, as if it had been generated
# alone (a shared draw would correlate them; see the top of this file)
try:  # source: the checkpoint file or folder read, or init_from
    model, checkpoint, source = load_model(init_from, out_dir, noise_at_eval,
                                           model_overrides=dict(noise_per_sample=True))
except ValueError as e:
    fail(e)
dtype = run_dtype(dtype, device, trained_dtype(checkpoint if init_from == 'resume' else None))
attn_type = model.config.attn_type
model.to(device)

# the modules whose weights autocast would cast at every token; a variant's own parameters stay float32
LOW_PRECISION_MODULES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm)


def hold_weights_in(model, dtype):
    """Cast the matmul, embedding and LayerNorm weights to dtype once. Generation at small batch is
    memory-bound (each token reads every weight), so half-size weights and no per-token autocast copy
    of them is what makes it faster. Tied weights (wte = lm_head) stay tied: the shared Parameter is
    converted in place."""
    for module in model.modules():
        if isinstance(module, LOW_PRECISION_MODULES):
            module.to(torch_dtype(dtype))


# the rule of model.AttentionBase (precision): a variant's float32 parameters meet autocast, as in training
ctx = autocast_context(device, dtype)  # float32: a no-op
if dtype != 'float32':
    hold_weights_in(model, dtype)  # so autocast casts none of them again
    log(f"weights held in {dtype} for sampling (each variant's own parameters in float32)")

if checkpoint is not None:
    val = checkpoint['best_val_loss']
    val = float(val.item() if torch.is_tensor(val) else val)
    model_info = dict(attn_type=attn_type, checkpoint=source,
                      iter=int(checkpoint['iter_num']), best_val_loss=val if val < 1e9 else None)
else:
    model_info = dict(attn_type=attn_type, checkpoint=init_from, iter=None, best_val_loss=None)
model_info['params'] = model.get_num_params()

# -----------------------------------------------------------------------------
# tokenizer: the char-level vocabulary of the checkpoint's dataset (meta.pkl), else GPT-2's BPE


def outside_data_dir(path):
    data_dir = os.path.realpath('data')
    return os.path.commonpath([data_dir, os.path.realpath(path)]) != data_dir


meta_dir = None
if dataset:
    meta_dir = os.path.join('data', dataset)
elif checkpoint is not None and 'dataset' in checkpoint.get('config', {}):
    meta_dir = os.path.join('data', checkpoint['config']['dataset'])
if meta_dir and os.path.isdir(meta_dir) and outside_data_dir(meta_dir):
    # an absolute or ../ dataset (a checkpoint from another machine, or a crafted one) is followed,
    # but never silently: its meta.pkl is read as plain data only (batches.read_meta_pkl)
    source = "--dataset" if dataset else "the checkpoint's config['dataset']"
    log(f"note: reading the vocabulary from {os.path.realpath(meta_dir)}, outside data/ ({source})")
try:
    meta = load_meta(meta_dir) if meta_dir and os.path.isdir(meta_dir) else None
except ValueError as e:
    fail(e)
meta_pkl = os.path.join(meta_dir, 'meta.pkl') if meta_dir else None
if meta is not None and 'stoi' not in meta and meta.get('tokenizer') == 'char':
    if not os.path.isfile(meta_pkl):
        fail(f"{meta_dir} is a char-level dataset but has no meta.pkl (its vocabulary); "
             f"run its prepare.py again")
    try:
        meta = {**meta, **read_meta_pkl(meta_pkl)}  # plain data only: a crafted meta.pkl cannot run code
    except ValueError as e:
        fail(e)
if meta is not None and meta.get('tokenizer') == 'ids':
    fail(f"{meta_dir} holds token ids with no text ({meta.get('task', 'a synthetic task')}): sample.py has nothing to "
         f"print; score the model with eval.py --out_dir={out_dir} --recall=True")
char_level = meta is not None and 'stoi' in meta
vocab_size = model.config.vocab_size
if char_level:
    log(f"loading the char-level vocabulary from {meta_dir}")
    stoi, itos = meta['stoi'], meta['itos']
    if len(itos) > vocab_size:
        fail(f"the vocabulary in {meta_dir} has {len(itos)} characters but the model only "
             f"{vocab_size} token ids: pass --dataset=<the folder the model was trained on>")
    eot = None
else:
    if vocab_size < 50257:
        where = f"in {meta_dir} " if meta_dir else ""
        fail(f"the model has a vocabulary of {vocab_size} tokens, so it was not trained with GPT-2's "
             f"tokenizer, and no meta.pkl with its vocabulary was found {where}(the checkpoint's "
             f"config names dataset={checkpoint['config'].get('dataset') if checkpoint else None!r}): "
             f"pass --dataset=<data folder with meta.pkl>")
    if meta is not None and meta.get('tokenizer') == 'gpt2':
        log(f"GPT-2 encodings (the tokenizer named in {meta_dir}/meta.json)")
    else:
        log("no meta.pkl found, assuming GPT-2 encodings...")
    enc = gpt2_encoding()
    eot = enc.eot_token


def encode(s):
    if char_level:
        unknown = sorted(set(c for c in s if c not in stoi))
        if unknown:
            fail(f"the prompt {s[:60]!r} has characters the model's vocabulary ({len(stoi)} characters, "
                 f"{meta_dir}) does not contain: {''.join(unknown)!r} (for the quickstart's Tiny Shakespeare "
                 f"model, prompts/shakespeare_char.txt holds prompts in its characters)")
        return [stoi[c] for c in s]
    return enc.encode(s, allowed_special={"<|endoftext|>"})


def decode_pieces(ids):
    """Token ids -> [(text, is_special)]. Special tokens (<|endoftext|>) and ids the tokenizer has no
    text for (the vocabulary's padding, 50257..50303) are pieces of their own, shown as <|...|>."""
    pieces, run = [], []
    for i in ids + [None]:
        ordinary = i is not None and (i < len(itos) if char_level else i < eot)
        if ordinary:
            run.append(i)
            continue
        if run:
            pieces.append((''.join(itos[j] for j in run) if char_level else enc.decode(run), False))
            run = []
        if i is not None:
            pieces.append(("<|endoftext|>" if i == eot else f"<|token {i}|>", True))
    return pieces


def plain(pieces):
    return ''.join(text for text, _ in pieces)


# -----------------------------------------------------------------------------
# output formats

MD_SPECIAL = re.compile(r'([\\`*_\[\]<>#|~&])')  # what can start markup inside a heading line
LATEX_SPECIAL = {'\\': r'\textbackslash{}', '{': r'\{', '}': r'\}', '$': r'\$', '&': r'\&', '#': r'\#',
                 '%': r'\%', '_': r'\_', '^': r'\textasciicircum{}', '~': r'\textasciitilde{}',
                 '<': r'\textless{}', '>': r'\textgreater{}', '|': r'\textbar{}', '\ufffd': '?'}


def one_line(s, limit=80):
    """A prompt as a heading: newlines shown as \\n, cut at `limit` characters."""
    s = s.replace('\r', '').replace('\n', '\\n').replace('\t', ' ')
    return s if len(s) <= limit else s[:limit - 3] + '...'


def md_escape(s):
    return MD_SPECIAL.sub(r'\\\1', s)


def md_code(text):
    fence = '`' * max(3, 1 + max((len(m) for m in re.findall(r'`+', text)), default=0))
    return f"{fence}text\n{text}\n{fence}"


def latex_escape(s):
    out = []
    for c in s:
        if c in LATEX_SPECIAL:
            out.append(LATEX_SPECIAL[c])
        elif c == '\t':
            out.append(' ')
        elif ord(c) < 32 and c != '\n':
            out.append('?')  # control characters have no glyph
        else:
            out.append(c)
    return ''.join(out)


def latex_block(pieces):
    """Text that typesets as it reads: specials escaped, each line break kept (\\\\), runs of spaces
    and indentation kept (~), empty lines kept (\\mbox{}), special tokens in typewriter type."""
    body = ''.join(latex_tt(t) if special else latex_escape(t) for t, special in pieces)
    lines = []
    for line in body.split('\n'):
        line = re.sub(r'^ +', lambda m: '~' * len(m.group()), line)
        line = re.sub(r'(?<= ) +', lambda m: '~' * len(m.group()), line)
        lines.append(line if line.strip() else r'\mbox{}')
    return '\\\\\n'.join(lines)


def model_sentence(tt, quote):
    """'base attention, checkpoint out/ckpt.pt (iter 5000, best val loss 1.4697, 10.65M parameters)'"""
    i = model_info
    details = [f"iter {i['iter']}"] if i['iter'] is not None else []
    if i['best_val_loss'] is not None:
        details.append(f"best val loss {i['best_val_loss']:.4f}")
    details.append(f"{i['params'] / 1e6:.2f}M parameters")
    source = (f"checkpoint {tt(i['checkpoint'])}" if checkpoint is not None
              else f"OpenAI GPT-2 weights {tt(i['checkpoint'])}")
    return f"{tt(i['attn_type'])} attention, {source} ({', '.join(quote(d) for d in details)})"


def sampling_sentence():
    s = (f"{num_samples} completion{'s' if num_samples > 1 else ''} per prompt, {max_new_tokens} new tokens each, temperature "
         f"{temperature:g}, top-k {top_k if top_k else 'off'}, seed {seed}")
    if noise_on(model):
        s += ", NoiseFormer attention noise on"
    elif 'noise_at_eval' in ATTENTION_TYPES[attn_type].config_fields:
        s += ", NoiseFormer attention noise off (noise_at_eval=False)"
    return s


def md_tt(s):
    return '`' + s + '`'


def latex_tt(s):
    return '\\texttt{' + latex_escape(s) + '}'


def header():
    if format == 'markdown':
        return (f"## Samples: `{attn_type}` model\n\n"
                f"Model: {model_sentence(md_tt, str)}.  \n"
                f"Sampling: {sampling_sentence()}.  \n"
                f"Each completion below continues the prompt in its heading.\n")
    if format == 'latex':
        return ("% Model samples written by sample.py. Plain LaTeX: every special character is escaped.\n"
                "% Text beyond ASCII needs \\usepackage[utf8]{inputenc} (the default since 2018) or\n"
                "% xelatex/lualatex; \\usepackage[T1]{fontenc} gives the best < > | glyphs.\n"
                f"\\subsection*{{Samples: {latex_escape(attn_type)} model}}\n"
                f"\\noindent Model: {model_sentence(latex_tt, latex_escape)}.\\\\\n"
                f"Sampling: {latex_escape(sampling_sentence())}.\\\\\n"
                f"Each completion continues the prompt in its heading.\n")
    return None


def render_prompt(i, prompt, prompt_ids, completions):
    """completions: one list of pieces (the generated tokens only) per sample."""
    n = len(prompts)
    if format == 'text':  # nanoGPT's: the whole sequence, then a line of dashes
        lines = [f"=== prompt {i + 1}/{n}: {one_line(prompt)} ===" if n > 1 else None]
        for c in completions:
            lines += [plain(decode_pieces(prompt_ids)) + plain(c), '---------------']
        return '\n'.join(l for l in lines if l is not None)
    if format == 'jsonl':
        return '\n'.join(json.dumps(dict(prompt_index=i, prompt=prompt, sample=j, completion=plain(c),
                                         **model_info, max_new_tokens=max_new_tokens,
                                         temperature=temperature, top_k=top_k or None, seed=seed + i,
                                         noise_on=noise_on(model)), ensure_ascii=False)
                         for j, c in enumerate(completions))
    full = '\n' not in prompt.strip('\n') and len(prompt) <= 80  # the heading shows all of it
    if format == 'markdown':
        out = [f"### Prompt {i + 1}: {md_escape(one_line(prompt))}", ""]
        if not full:
            out += ["Prompt:", "", md_code(prompt), ""]
        out.append("\n\n---\n\n".join(md_code(plain(c)) for c in completions))
        return '\n'.join(out) + '\n'
    out = [f"\\subsubsection*{{Prompt {i + 1}: {latex_escape(one_line(prompt))}}}"]
    if not full:
        out.append(f"\\noindent Prompt:\n\\begin{{quote}}\n{latex_block([(prompt, False)])}\n\\end{{quote}}")
    out.append("\n\\noindent\\rule{\\linewidth}{0.4pt}\n".join(
        f"\\begin{{quote}}\n{latex_block(c)}\n\\end{{quote}}" for c in completions))
    return '\n'.join(out) + '\n'


# -----------------------------------------------------------------------------
# run generation

encoded = [encode(p) for p in prompts]  # every prompt checked before any output
log(f"{model_sentence(str, str)}; device {device} ({dtype})"
    + ("; NoiseFormer attention noise on, as in the paper (--noise_at_eval=False turns it off)" if noise_on(model) else ""))
if header() is not None:
    print_result(header())
generating = 0.0  # seconds spent in model.generate, for the tokens/s line at the end
for i, (prompt, prompt_ids) in enumerate(zip(prompts, encoded)):
    if len(prompt_ids) > model.config.block_size:
        log(f"prompt {i + 1} has {len(prompt_ids)} tokens, more than block_size={model.config.block_size}: "
            f"only its last {model.config.block_size} tokens condition the samples")
    # the prompt's num_samples completions as one batch (row j = sample j), seeded for this prompt only
    manual_seed(seed + i)
    t0 = time.perf_counter()
    try:
        x = torch.tensor(prompt_ids, dtype=torch.long, device=device).repeat(num_samples, 1)
        with torch.no_grad(), ctx:
            y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None, use_cache=kv_cache)
    except (MemoryError, RuntimeError) as e:  # num_samples or max_new_tokens too large for the machine
        if refused_allocation(e) is None:
            raise
        fail(f"cannot generate num_samples={num_samples} x max_new_tokens={max_new_tokens} tokens at once: "
             f"{refused_allocation(e)}; ask for fewer")
    new_tokens = y[:, len(prompt_ids):].tolist()  # .tolist() waits for the device: the timing is complete
    generating += time.perf_counter() - t0
    completions = [decode_pieces(row) for row in new_tokens]
    print_result(render_prompt(i, prompt, prompt_ids, completions))
n_tokens = len(prompts) * num_samples * max_new_tokens
log(f"generated {n_tokens} tokens in {generating:.1f} s ({n_tokens / generating:.1f} tokens/s)")
