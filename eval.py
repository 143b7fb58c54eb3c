"""
Judge a checkpoint (ours, nanoGPT's, or OpenAI's GPT-2 weights) by more than the val loss train.py prints.

$ python eval.py --out_dir=out-shakespeare-char --val_loss=True --entropy=True
$ python eval.py --init_from=gpt2 --glue=all --seeds=0,1,2
$ python eval.py --out_dir=out-owt-dint --lm_eval=hellaswag,lambada_openai,arc_easy,piqa
$ python eval.py --out_dir=out-owt-dint_lowrank --entropy=True --compare_to=out-owt-base
$ python eval.py --out_dir=out-mqar --recall=True --val_loss=True
$ python eval.py --out_dir=out-mqar-diff --attention_noise=True --compare_to=out-mqar
$ python eval.py --out_dir=out-shakespeare-char --retrieval=True
$ python eval.py --init_from=hf-owt-dint --val_loss=True   # a folder written by export_hf.py

What it measures (any combination in one run; results go to eval_dir as JSON, tables to stdout):
  val_loss  the mean cross-entropy over the whole data/<dataset>/val.bin, in non-overlapping
            block_size windows, so every variant is scored on exactly the same tokens
  entropy   per layer and head, the mean normalised Shannon entropy of the attention rows over
            entropy_batches validation batches (1 = uniform over the visible keys, 0 = one key);
            diff / dint / dint_lowrank: both branches and the combined (signed) map. JSON and a
            heatmap PNG; with --compare_to=OTHER_OUT_DIR a side-by-side PNG of both checkpoints
  glue      the NoiseFormer paper's protocol: backbone frozen, the final hidden state (after ln_f) at
            the last token of each example feeds a new linear layer + softmax trained with
            cross-entropy (100 epochs, lr 1e-5). Each example's feature is computed once and cached
            on disk, so the epochs are a linear probe over cached features. Markdown table + JSON
  lm_eval   tasks of EleutherAI's lm-evaluation-harness through an adapter for our models
  recall    on a recall dataset (data/mqar or data/needles): the share of answers the model's most
            likely next token gets right over every validation example, overall, by number of key-value
            pairs and by query distance (docs/recall.md)
  attention_noise  on a recall dataset (data/mqar, or data/needles: needles in a text): per layer
            and head, the share of each answer's effective attention row (the weights that multiply V)
            on the answer's value and on its key in the pairs, the other pairs (needles), the query's
            own token, the earlier queries and the filler (text), as shares of the row's absolute
            mass (and signed shares); ranked by the signed value share; each layer as a whole too; by
            pairs, filler length and distance. JSON and a heatmap PNG; --compare_to side by side on
            the same examples
  retrieval on the model's own validation text, a span of retrieval_span random tokens written twice
            with D tokens of text between: copy accuracy over the second copy and, at each copy
            position, the effective attention row's share on the token to copy and on its earlier
            occurrence, the rest of the span, the query's own token and the text, per layer
            and head and per layer as a whole, by distance D. Char-level and GPT-2 BPE models alike.
            JSON and a heatmap PNG; --compare_to on the same examples

GLUE details: a sentence pair is joined as `first + "\\n" + second` (GPT-2 has no separator token),
encoded with GPT-2's BPE, and the start is cut if it exceeds block_size so the last token is kept.
NoiseFormer models extract features with the noise as the model's noise_at_eval says (on by default,
one draw per example, seeded); --glue_noise_draws=k averages the feature over k draws,
--noise_at_eval=False turns the noise off. Char-level checkpoints cannot do GLUE or lm_eval: both
need the GPT-2 vocabulary. See docs/eval.md.
"""

from configurator import answer_help
from denoised_gpt.cpu_threads import wait_passively_if_busy

answer_help(__file__)  # --help before the heavy imports below
wait_passively_if_busy()  # before torch loads OpenMP, which reads its wait policy once

import json
import os
import time

from denoised_gpt.batches import ExampleLayout, TokenBatches, TokenIdError, check_token_ids, load_meta
from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, read_checkpoint
from denoised_gpt.cli import (MAX_BATCH_SIZE, MAX_STEPS, check_inference_source, check_ranges, check_writable_folder,
                              fail, gpt2_encoding, log, prepare_device, print_result, quiet_ctrl_c, read_config,
                              run_dtype)
from denoised_gpt.extras import require as require_extra
from denoised_gpt.files import FileError, write_atomically
from denoised_gpt.models import load_model, noise_on, trained_dtype
from denoised_gpt.device import autocast_context, manual_seed
from model import ATTENTION_TYPES

quiet_ctrl_c()  # Ctrl-C: one line and exit 130, no traceback

# -----------------------------------------------------------------------------
init_from = 'resume'  # 'resume' (the checkpoint in out_dir), a GPT-2 model name (gpt2, gpt2-medium, ...) or a Hugging Face folder (export_hf.py)
out_dir = 'out'  # the checkpoint's directory (init_from='resume')
eval_dir = ''  # where results are written (default: out_dir, or eval-<init_from's name> for GPT-2 weights and folders)
dataset = ''  # data/<dataset> with val.bin for val_loss and entropy (default: the checkpoint's dataset)
device = 'auto'  # 'auto' (cuda > hpu > mps > cpu), 'cpu', 'cuda', 'cuda:1', 'hpu', 'mps'
dtype = 'auto'  # 'auto', 'float32', 'bfloat16' or 'float16' (autocast for the model's forward passes)
seed = 1337  # seeds the entropy batches and NoiseFormer's noise draws
batch_size = 8  # sequences per forward pass (val loss, entropy, GLUE features, lm-eval)
noise_at_eval = None  # NoiseFormer only: None keeps the checkpoint's setting (noise on), False turns it off
# exact validation loss
val_loss = False  # mean cross-entropy over the whole val.bin in non-overlapping block_size windows
# attention entropy
entropy = False  # normalised attention entropy per layer and head: JSON + heatmap PNG in eval_dir
entropy_batches = 10  # validation batches (of batch_size sequences) the entropy is averaged over
entropy_block_size = 0  # sequence length for the entropy (0: the model's block_size)
compare_to = ''  # another out_dir: its entropy is computed on the same batches, side by side in one PNG
# GLUE (NoiseFormer paper protocol: frozen backbone, last-token pooling, linear probe)
glue = ''  # comma-separated tasks (cola, sst2, mrpc, qqp, mnli, qnli, rte) or 'all'
glue_path = 'nyu-mll/glue'  # the datasets repo (or a local folder with the same layout)
glue_epochs = 100  # probe epochs over the cached features (paper: 100)
glue_lr = 1e-5  # probe learning rate, AdamW (paper: 1e-5)
glue_weight_decay = 0.0  # probe AdamW weight decay
glue_batch_size = 0  # probe batch size; 0: the paper's rule, 32 below 50k training examples, else 256
glue_max_examples = 0  # use only the first N examples of each split (0: all), for quick looks
glue_noise_draws = 1  # NoiseFormer: average each example's feature over this many noise draws
glue_cache_dir = ''  # where features are cached (default: eval_dir/glue_cache)
seeds = [0]  # probe seeds (--seeds=0,1,2); several give mean and standard deviation
# lm-evaluation-harness
lm_eval = ''  # comma-separated lm-eval task names, e.g. hellaswag,lambada_openai,arc_easy,piqa
lm_eval_limit = 0  # examples per task (0: all)
lm_eval_num_fewshot = None  # few-shot examples per prompt (None: each task's default)
lm_eval_include_path = ''  # a folder of extra task YAMLs (your own tasks)
max_gen_toks = 256  # generate_until tasks: the most tokens generated per request
# recall
recall = False  # answer accuracy over a recall dataset's validation examples (data/mqar), by pairs and distance
attention_noise = False  # recall dataset: each answer's attention share on its key and value vs the rest, per layer and head
# retrieval probe (any model trained on text)
retrieval = False  # copy accuracy on a span repeated in the validation text, and where attention goes while copying
retrieval_span = 10  # tokens in the repeated span
retrieval_distances = []  # tokens of text between the two copies, e.g. 8,32,96 (default: 5 values up to the block_size)
retrieval_examples = 64  # examples per distance
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, list, type(None)))]

globals().update(read_config(__file__, {k: globals()[k] for k in config_keys}, optional_bools=('noise_at_eval',)))
if not (val_loss or entropy or glue or lm_eval or recall or attention_noise or retrieval):
    fail("nothing to evaluate: pass one or more of --val_loss=True, --entropy=True, --glue=all (or a list "
         "of tasks), --lm_eval=TASK[,TASK], --recall=True, --attention_noise=True, --retrieval=True")
check_inference_source(init_from)
try:
    check_ranges({k: globals()[k] for k in config_keys}, seeds=('seed',),
                 at_least_one=('batch_size', 'entropy_batches', 'glue_epochs', 'glue_noise_draws', 'max_gen_toks',
                               'retrieval_examples'),
                 at_most={'batch_size': (MAX_BATCH_SIZE, "sequences per forward pass"),
                          'entropy_batches': (MAX_STEPS, "batches")})
except ValueError as e:
    fail(e)
for key in ('entropy_block_size', 'glue_batch_size', 'glue_max_examples', 'lm_eval_limit'):
    if globals()[key] < 0:
        fail(f"{key}={globals()[key]} must not be negative (0 means the default)")
seed_list = seeds
if not all(type(s) is int and 0 <= s < 2 ** 63 for s in seed_list):
    fail(f"seeds={seeds!r} must be non-negative integers, e.g. --seeds=0,1,2")
if not seed_list:
    fail("seeds is empty: give at least one probe seed, e.g. --seeds=0")
if not all(type(d) is int and d >= 1 for d in retrieval_distances):
    fail(f"retrieval_distances={retrieval_distances!r} must be positive integers, e.g. --retrieval_distances=8,32,96")
if compare_to and not (entropy or attention_noise or retrieval):
    fail("compare_to compares attention entropy or attention shares: add --entropy=True, --attention_noise=True "
         "or --retrieval=True")
try:  # what the light install leaves out, said before any work
    if entropy or attention_noise or retrieval:
        require_extra('matplotlib', "drawing the heatmaps of --entropy, --attention_noise and --retrieval")
    if lm_eval:
        require_extra('lm_eval', "--lm_eval")
except ValueError as e:
    fail(e)
if glue:
    from denoised_gpt.evaluation import glue as glue_eval
    try:
        glue_tasks = glue_eval.parse_tasks(glue)
    except glue_eval.GlueError as e:
        fail(e)
if not eval_dir:
    eval_dir = out_dir if init_from == 'resume' else f"eval-{os.path.basename(os.path.normpath(init_from))}"


if eval_dir != out_dir or os.path.isdir(out_dir):  # an out_dir that is no folder: loading it says why, below
    check_writable_folder('eval_dir', eval_dir)
if glue and glue_cache_dir:
    check_writable_folder('glue_cache_dir', glue_cache_dir)

# -----------------------------------------------------------------------------
# model(s)



def load(source, from_dir, noise=noise_at_eval):
    """-> (model in eval mode on the CPU, info dict). source: 'resume' (from_dir/ckpt.pt), a gpt2 name or a
    Hugging Face folder."""
    from denoised_gpt.evaluation.entropy import run_name
    from denoised_gpt.hf_format import WEIGHTS_FILE
    try:  # path: the checkpoint file or folder read, or source
        model, ckpt, path = load_model(source, from_dir, noise)
    except ValueError as e:
        fail(e)
    if ckpt is None:
        info = dict(name=source, attn_type='base', checkpoint=source, dataset=dataset or None, identity=source)
    else:
        stat = os.stat(path if source == 'resume' else os.path.join(source, WEIGHTS_FILE))
        info = dict(name=run_name(from_dir if source == 'resume' else source), attn_type=model.config.attn_type,
                    checkpoint=path, iter=int(ckpt['iter_num']),
                    dataset=dataset or ckpt.get('config', {}).get('dataset'),
                    # the feature cache key: this file, as it is now
                    identity=f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}")
    info['params'] = model.get_num_params()
    info['dtype'] = trained_dtype(ckpt if source == 'resume' else None)
    info['noise_on'] = noise_on(model)
    data_dir = os.path.join('data', info['dataset']) if info['dataset'] else None
    try:
        meta = load_meta(data_dir) if data_dir and os.path.isdir(data_dir) else None
    except ValueError as e:
        fail(e)
    info['data_dir'] = data_dir
    info['char_level'] = model.config.vocab_size < 50257 or (meta is not None and meta.get('tokenizer') == 'char')
    return model, info


def load_compare_to():
    """compare_to's model and info, loaded before anything is computed: a wrong path fails in seconds,
    not after the first model's entropy, and names compare_to (load_model's messages name out_dir)."""
    try:
        other = read_checkpoint(compare_to, metadata_only=True)[1]  # settings only: the tensors are read next
    except FileNotFoundError:
        fail(f"compare_to={compare_to!r}: no checkpoint at {checkpoint_path(compare_to)}; give the out_dir "
             f"of the run to compare with")
    except CheckpointError as e:
        fail(f"compare_to={compare_to!r}: {e}")
    # noise_at_eval is about the NoiseFormer model(s) of the two; a model without noise has none to turn off
    noisy = 'noise_at_eval' in getattr(ATTENTION_TYPES.get(other['model_args'].get('attn_type', 'base')),
                                       'config_fields', ())
    other_model, other_info = load('resume', compare_to, noise_at_eval if noisy else None)
    other_info.pop('dtype')
    return other_model, other_info


def recall_data_dir():
    """The data/<dataset> --recall and --attention_noise would read, from the settings or the checkpoint's own
    (its settings alone, not its weights); None where only loading the model can tell."""
    name = dataset
    if not name and init_from == 'resume':
        try:
            name = read_checkpoint(out_dir, metadata_only=True)[1].get('config', {}).get('dataset')
        except (FileNotFoundError, CheckpointError):
            return None  # loading the model says why
    return os.path.join('data', name) if name else None


if recall or attention_noise:  # a text dataset is refused before the model is loaded
    from denoised_gpt.evaluation.recall import check_recall_dataset
    recall_dir = recall_data_dir()
    if recall_dir and os.path.isdir(recall_dir):
        try:
            check_recall_dataset(recall_dir)
        except ValueError as e:
            fail(e)

device, dtype = prepare_device(device, dtype)
model, info = load(init_from, out_dir)
dtype = run_dtype(dtype, device, info.pop('dtype'))
ctx = autocast_context(device, dtype)
model.to(device)
if compare_to:
    other_model, other_info = load_compare_to()  # on the CPU until its turn comes
os.makedirs(eval_dir, exist_ok=True)
log(f"{info['attn_type']} model, {info['checkpoint']}, {info['params'] / 1e6:.2f}M parameters; "
    f"device {device} ({dtype}); results in {eval_dir}")
results = dict(model={k: v for k, v in info.items() if k != 'identity'})


def write_file(name, write, binary=False):
    """eval_dir/name written whole or not at all (write(f) fills it); a failed write is one line and exit 2,
    the file there before intact."""
    path = os.path.join(eval_dir, name)
    try:
        write_atomically(path, write, binary, then=" and evaluate again")
    except FileError as e:
        fail(e)
    log(f"wrote {path}")


def write_png(name, figure):
    write_file(name, lambda f: figure.savefig(f, format='png', dpi=100), binary=True)


def write_json(name, value):
    # default: lm-eval's results hold a few non-JSON values
    write_file(name, lambda f: json.dump(value, f, indent=2, default=str))


def val_bin(which):
    if not which['data_dir']:
        fail("val_loss and entropy read data/<dataset>/val.bin: pass --dataset=<name> (GPT-2 weights and "
             "checkpoints without a dataset in their config need it)")
    return os.path.join(which['data_dir'], 'val.bin')


def needs_gpt2_vocabulary(what):
    if info['char_level']:
        fail(f"{what} needs the GPT-2 vocabulary, but this model has {model.config.vocab_size} token ids "
             f"(a char-level model, data {info['data_dir']}): evaluate a model trained on GPT-2 tokens "
             f"(e.g. openwebtext) or --init_from=gpt2")


# every check that can fail quickly runs before any long computation
if glue:
    needs_gpt2_vocabulary("GLUE")
if lm_eval:
    needs_gpt2_vocabulary("lm_eval")
if val_loss or entropy or recall or attention_noise or retrieval:
    val_path = val_bin(info)
    if not os.path.isfile(val_path):
        fail(f"{val_path} not found: run that dataset's prepare.py first, or pass --dataset=<name>")
if val_loss or recall or attention_noise or retrieval:  # they read the whole file: an id the model has no embedding for is said now
    try:
        check_token_ids(val_path, model.config.vocab_size)
    except ValueError as e:
        fail(e)
if entropy:
    def entropy_data(which_model, which_info, what):
        """The validation windows which_model's entropy is averaged over (what: the model, in messages)."""
        T = entropy_block_size or which_model.config.block_size
        if T > which_model.config.block_size:
            fail(f"entropy_block_size={T} is larger than {what}'s block_size {which_model.config.block_size}")
        try:
            return TokenBatches(which_info['data_dir'], 'val', T, batch_size, device=device, seed=seed,
                                vocab_size=which_model.config.vocab_size)
        except (FileNotFoundError, ValueError) as e:
            fail(e)

    mine_data = entropy_data(model, info, 'the model')
    if compare_to:
        val_bin(other_info)
        other_data = entropy_data(other_model, other_info, f"compare_to's model ({other_info['checkpoint']})")


def write_shares(name, mine, measure, panels):
    """name.json and name.png (heatmaps: panels(result)) of this model's attention shares and, with compare_to,
    of the other model's, measured by measure(model, info) on the same examples, beside them."""
    from denoised_gpt.evaluation.entropy import file_name_part, plot_heatmaps
    # the colour bar: a head's share is of its row's absolute weights, a layer's of what each key adds to it
    label = "share, 0 to 1 (a head: of its attention weights, by size; the layer: of what each key adds to its output)"
    write_json(f'{name}.json', mine)
    write_png(f'{name}.png', plot_heatmaps([(info['name'], panels(mine))], label))
    if compare_to:
        other_model.to(device)
        theirs = measure(other_model, other_info)
        other_model.cpu()
        other = file_name_part(other_info['name'])
        write_json(f'{name}_{other}.json', theirs)
        write_png(f'{name}_vs_{other}.png', plot_heatmaps([(info['name'], panels(mine)),
                                                           (other_info['name'], panels(theirs))], label))


def seeded(measure, *args, **kwargs):
    """measure(*args, **kwargs) after seeding NoiseFormer's noise draws; its ValueError is the one-line error."""
    manual_seed(seed)
    try:
        return measure(*args, **kwargs)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:  # a dataset's missing file (its labels);
        fail(e)  # a variant without attention_maps


# -----------------------------------------------------------------------------
# exact validation loss

if val_loss:
    from denoised_gpt.evaluation import exact_val_loss
    t0 = time.time()
    r = seeded(lambda: exact_val_loss(model, val_path, model.config.block_size, batch_size, device, ctx,
                                      ExampleLayout(info['data_dir'], 'val')))  # the layout's errors are one line too
    r.update(file=val_path, block_size=model.config.block_size, noise_on=info['noise_on'])
    print_result(f"val loss {r['loss']:.4f} (perplexity {r['perplexity']:.2f}) over all {r['tokens']:,} target tokens "
                 f"of {val_path} ({r['windows']} windows of {model.config.block_size}, {time.time() - t0:.1f}s)")
    results['val_loss'] = r
    write_json('val_loss.json', r)

# -----------------------------------------------------------------------------
# answer accuracy on a recall task

if recall:
    from denoised_gpt.evaluation.recall import answer_accuracy
    t0 = time.time()
    r = seeded(answer_accuracy, model, info['data_dir'], batch_size, device, ctx)
    r.update(file=val_path, noise_on=info['noise_on'], dtype=dtype)
    print_result(f"answer accuracy {r['accuracy']:.4f} over {r['answers']:,} answers of {r['examples']:,} validation "
                 f"examples ({time.time() - t0:.1f}s)")
    print_result("  by key-value pairs N (a guess among the example's N values scores 1/N): "
                 + ", ".join(f"{k}: {v['accuracy']:.4f}" for k, v in r['by_pairs'].items()))
    print_result("  by query distance:  " + ", ".join(f"{k}: {v['accuracy']:.4f}" for k, v in r['by_distance'].items()))
    results['recall'] = r
    write_json('recall.json', r)

# -----------------------------------------------------------------------------
# where attention goes on a recall task: the answer span against the rest

if attention_noise:
    from denoised_gpt.evaluation.attention_noise import attention_noise as attention_shares, heatmap_panels

    def shares_of(which_model, which_info):
        """which_model's shares on this checkpoint's dataset: a compared model sees the same examples."""
        t0 = time.time()
        r = seeded(attention_shares, which_model, info['data_dir'], batch_size, device, ctx)
        r.update(file=val_path, attn_type=which_info['attn_type'], checkpoint=which_info['checkpoint'],
                 noise_on=which_info['noise_on'], dtype=dtype, seed=seed)
        look, layer, w = r['lookup'], r['reading_layer'], r['part_words']

        def parts(s):
            return (f"{w['value']} {s['value']:.3f} (signed {s['signed_value']:.3f}), {w['key']} {s['key']:.3f} "
                    f"(signed {s['signed_key']:.3f}), {w['pairs']} {s['pairs']:.3f}, {w['own']} {s['own']:.3f}, "
                    f"{w['queries']} {s['queries']:.3f}, {w['filler']} {s['filler']:.3f}")
        best = ', '.join(f"L{b['layer']}h{b['head']} {b['value']:.3f} ({b['signed_value']:.3f})"
                         for b in r['best_head'])
        by_filler = ', '.join(f"{k}: {v['lookup']['signed_value']:.3f}" for k, v in r['by_filler'].items())
        print_result(f"attention shares ({which_info['name']}, {r['answers']:,} answers of {r['examples']:,} "
                     f"examples, {time.time() - t0:.1f}s; a share: of the query's attention row, absolute weights; "
                     f"signed: negative where the row subtracts; noise = {w['pairs']} + {w['queries']} + "
                     f"{w['filler']})")
        print_result("  a uniform row (every key alike) would score: "
                     + ", ".join(f"{w[part]} {r['uniform'][part]:.3f}" for part in ('value', 'key', 'own'))
                     + f", noise {r['uniform']['noise']:.3f}")
        print_result(f"  per layer, the head (L layer, h head) with the highest signed share on the {w['value']}: "
                     f"{w['value']} (signed) = {best}")
        print_result(f"  lookup head L{look['layer']}h{look['head']} (the highest signed {w['value']} share): "
                     f"{parts(look)}; noise {look['noise']:.3f}; signed {w['value']} by {w['filler']} length: "
                     f"{by_filler}")
        print_result(f"  reading layer L{layer['layer']} (all heads, by what each key adds to the layer's output): "
                     f"{parts(layer)}; noise {layer['noise']:.3f}")
        offsets = [f"L{i} " + ", ".join(f"{o} {v['layers'][i]:.3f}" for o, v in r['by_offset'].items())
                   for i in range(len(r['layer_shares']['value']))]
        print_result(f"  each layer's signed share by offset from the queried key (+1 the {w['value']}, +2 the token "
                     f"after it, which a layer below may have given the value): {'; '.join(offsets)}")
        return r

    results['attention_noise'] = shares_of(model, info)
    write_shares('attention_noise', results['attention_noise'], shares_of, heatmap_panels)

# -----------------------------------------------------------------------------
# the retrieval probe: copying a span repeated in the validation text

if retrieval:
    from denoised_gpt.evaluation.retrieval import heatmap_panels as probe_panels, retrieval as retrieval_probe

    # windows both models take, so that a compared model sees the very same examples
    probe_length = min([model.config.block_size] + ([other_model.config.block_size] if compare_to else []))
    if compare_to and other_model.config.vocab_size != model.config.vocab_size:  # before anything is measured
        fail(f"compare_to's model has {other_model.config.vocab_size} token ids, this one {model.config.vocab_size}: "
             f"the probe compares models on the same tokens")

    def probe(which_model, which_info):
        """which_model's copy accuracy and attention parts on this checkpoint's validation text: a compared
        model sees the same examples."""
        t0 = time.time()
        r = seeded(retrieval_probe, which_model, val_path, batch_size, device, ctx, span=retrieval_span,
                   distances=retrieval_distances, per_distance=retrieval_examples, seed=seed,
                   length=probe_length)
        r.update(file=val_path, attn_type=which_info['attn_type'], checkpoint=which_info['checkpoint'],
                 noise_on=which_info['noise_on'], dtype=dtype, seed=seed)
        by = r['by_distance']

        def parts(s):
            return (f"token to copy {s['copy']:.3f} (signed {s['signed_copy']:.3f}), earlier occurrence "
                    f"{s['occurrence']:.3f} (signed {s['signed_occurrence']:.3f}), span {s['span']:.3f}, "
                    f"own {s['own']:.3f}, text {s['text']:.3f}")
        print_result(f"retrieval probe ({which_info['name']}): a span of {r['span']} random tokens written twice in "
                     f"{r['length']}-token windows of {val_path}, D tokens of text between; {r['examples']:,} "
                     f"examples, {r['copies']:,} copy targets, {time.time() - t0:.1f}s")
        print_result(f"  copy accuracy {r['accuracy']:.4f} (chance about {r['chance']:.4f}: 1 in the "
                     f"{r['candidates']} token ids of the file); by distance D: "
                     + ", ".join(f"{d}: {v['accuracy']:.4f}" for d, v in by.items()))
        head, layer = r['copy_head'], r['reading_layer']
        if r['accuracy'] < 2 * r['chance']:  # then no head copies: the ranking still names one
            print_result(f"  this model does not copy (accuracy {r['accuracy']:.4f}, under twice chance): the copy "
                         f"head and reading layer below only rank where attention goes, not how a copy is made")
        print_result(f"  copy head L{head['layer']}h{head['head']} (layer {head['layer']}, head {head['head']}: the "
                     f"highest signed share on the token to copy, the token after the earlier occurrence), "
                     f"share of its attention row by distance:")
        for d, v in by.items():
            print_result(f"    D={d}: {parts(v['copy_head'])}")
        print_result(f"  reading layer L{layer['layer']} (all heads, by what each key adds to the layer's output), "
                     f"by distance:")
        for d, v in by.items():
            print_result(f"    D={d}: {parts(v['reading_layer'])}")
        return r

    results['retrieval'] = probe(model, info)
    write_shares('retrieval', results['retrieval'], probe, probe_panels)

# -----------------------------------------------------------------------------
# attention entropy

if entropy:
    from denoised_gpt.evaluation.entropy import attention_entropy, entropy_summary, file_name_part, plot_entropy

    def entropy_of(which_model, which_info, data):
        manual_seed(seed)  # NoiseFormer's noise draws
        batches = (data.get_batch()[0] for _ in range(entropy_batches))
        try:
            ent = attention_entropy(which_model, batches, ctx)
        except (TokenIdError, NotImplementedError) as e:  # a file too large to scan up front is checked batch by
            fail(e)  # batch; a variant without attention_maps
        return dict(entropy=ent, layer_mean=entropy_summary(ent), block_size=data.block_size,
                    batches=entropy_batches, batch_size=batch_size, seed=seed, attn_type=which_info['attn_type'],
                    checkpoint=which_info['checkpoint'], noise_on=which_info['noise_on'])

    mine = entropy_of(model, info, mine_data)
    for name, means in mine['layer_mean'].items():
        print_result(f"attention entropy ({name}), mean over heads per layer: " + ' '.join(f"{m:.3f}" for m in means))
    results['entropy'] = mine
    write_json('entropy.json', mine)
    write_png('entropy.png', plot_entropy([(info['name'], mine['entropy'])]))
    if compare_to:
        theirs = entropy_of(other_model.to(device), other_info, other_data)
        del other_model
        for name, means in theirs['layer_mean'].items():
            print_result(f"compare_to {other_info['name']} ({name}): " + ' '.join(f"{m:.3f}" for m in means))
        write_json(f"entropy_{file_name_part(other_info['name'])}.json", theirs)
        write_png(f"entropy_vs_{file_name_part(other_info['name'])}.png",
                  plot_entropy([(info['name'], mine['entropy']), (other_info['name'], theirs['entropy'])]))

# -----------------------------------------------------------------------------
# GLUE: frozen backbone, cached last-token features, linear probe

if glue:
    settings = dict(epochs=glue_epochs, lr=glue_lr, weight_decay=glue_weight_decay, batch_size=glue_batch_size,
                    max_examples=glue_max_examples, noise_draws=glue_noise_draws, seeds=seed_list)
    try:
        glue_results = glue_eval.run(model, info, gpt2_encoding(), glue_tasks, glue_path,
                                     glue_cache_dir or os.path.join(eval_dir, 'glue_cache'), settings,
                                     extract_batch_size=batch_size, device=device, ctx=ctx, seed=seed,
                                     dtype=dtype, log=log)
    except glue_eval.GlueError as e:
        fail(e)
    table = glue_eval.markdown_table(info['name'], glue_results, settings)
    print_result(table)
    results['glue'] = glue_results
    write_json('glue.json', dict(model=results['model'], settings=settings, results=glue_results))
    write_file('glue.md', lambda f: f.write(table + '\n'))

# -----------------------------------------------------------------------------
# lm-evaluation-harness

if lm_eval:
    from denoised_gpt.evaluation.lm_eval_adapter import run_lm_eval
    try:
        table, lm_results = run_lm_eval(model, gpt2_encoding(), [t.strip() for t in lm_eval.split(',') if t.strip()],
                                        batch_size=batch_size, device=device, ctx=ctx, limit=lm_eval_limit or None,
                                        num_fewshot=lm_eval_num_fewshot, include_path=lm_eval_include_path or None,
                                        max_gen_toks=max_gen_toks, seed=seed)
    except ValueError as e:
        fail(e)
    print_result(table)
    results['lm_eval'] = lm_results
    write_json('lm_eval.json', dict(model=results['model'], results=lm_results))
