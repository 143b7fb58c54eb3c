"""
GLUE as the NoiseFormer paper evaluates it (Table II): the pretrained backbone is frozen and its final
hidden state (after ln_f) at the last real token of each example replaces the LM head as the input
of a new linear layer + softmax, trained with cross-entropy (paper: 100 epochs, batch 32 or 256 by
dataset size, lr 1e-5). Metrics on the validation split(s): accuracy, plus F1 for MRPC and QQP and
Matthews correlation for CoLA.

Since the backbone never changes, each example's pooled feature is computed once (batched, padded
on the right, which a causal model never looks at) and cached on disk, keyed by checkpoint + task +
split + every setting that changes the feature. Extraction writes the cache in chunks of CHUNK
examples, so a run killed midway keeps what it computed and the next run continues from there. The
epochs are then a linear probe over cached features: seconds, not a forward pass per epoch.

Text: a sentence pair is joined as `first + "\\n" + second` (GPT-2 has no separator token; a newline
is what a pair of lines reads as in its training text), encoded with GPT-2's BPE (special-token text
is treated as plain text) and, if longer than block_size, cut at the start so the last token, the
one pooled, is kept. NoiseFormer: the noise follows the model's noise_at_eval; with noise on each
feature is the mean over `noise_draws` draws, seeded per chunk, so features are reproducible.
"""
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from denoised_gpt.device import manual_seed
from denoised_gpt.evaluation import final_hidden_states, mean_std

CHUNK = 1024  # examples per cache file written during extraction: a kill loses at most this many
FORMAT = 1  # bump when the feature computation changes, so old caches are not reused
JOIN = '\n'
LARGE_TASK = 50_000  # the paper's rule read here: batch 32 below this many training examples, 256 above


class GlueError(ValueError):
    """A GLUE setting or dataset that cannot work; eval.py prints it in one line."""


@dataclass(frozen=True)
class Task:
    columns: tuple  # the text columns, joined in this order
    num_labels: int
    extra_metric: str  # besides accuracy: 'f1', 'mcc' or ''
    eval_splits: tuple
    title: str


# In the column order of the paper's Table II.
TASKS = {
    'mrpc': Task(('sentence1', 'sentence2'), 2, 'f1', ('validation',), 'MRPC'),
    'cola': Task(('sentence',), 2, 'mcc', ('validation',), 'CoLA'),
    'mnli': Task(('premise', 'hypothesis'), 3, '', ('validation_matched', 'validation_mismatched'), 'MNLI'),
    'qqp': Task(('question1', 'question2'), 2, 'f1', ('validation',), 'QQP'),
    'rte': Task(('sentence1', 'sentence2'), 2, '', ('validation',), 'RTE'),
    'qnli': Task(('question', 'sentence'), 2, '', ('validation',), 'QNLI'),
    'sst2': Task(('sentence',), 2, '', ('validation',), 'SST-2'),
}
SPLIT_TITLES = {'validation_matched': '-m', 'validation_mismatched': '-mm', 'validation': ''}


def parse_tasks(text):
    names = list(TASKS) if text.strip() == 'all' else [t.strip().lower().replace('-', '') for t in text.split(',') if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise GlueError(f"glue={text!r}: unknown task {', '.join(unknown) or '(none given)'}; use 'all' or a "
                        f"comma-separated list of {', '.join(TASKS)}")
    return names


# ----------------------------------------------------------------------------- metrics

def accuracy(pred, gold):
    return (pred == gold).double().mean().item()


def f1_score(pred, gold):
    """F1 of the positive class (label 1), as GLUE reports it for MRPC and QQP."""
    tp = ((pred == 1) & (gold == 1)).sum().item()
    fp = ((pred == 1) & (gold != 1)).sum().item()
    fn = ((pred != 1) & (gold == 1)).sum().item()
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def matthews_corrcoef(pred, gold):
    """Binary Matthews correlation (CoLA); 0 when a row or column of the confusion matrix is empty."""
    tp = ((pred == 1) & (gold == 1)).sum().item()
    tn = ((pred != 1) & (gold != 1)).sum().item()
    fp = ((pred == 1) & (gold != 1)).sum().item()
    fn = ((pred != 1) & (gold == 1)).sum().item()
    denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denominator if denominator else 0.0


METRICS = {'accuracy': accuracy, 'f1': f1_score, 'mcc': matthews_corrcoef}


# ----------------------------------------------------------------------------- features

def encode_examples(enc, rows, columns, max_len):
    """GLUE rows -> token lists: the columns joined by JOIN, the start cut to keep the last max_len tokens."""
    out = []
    for row in rows:
        ids = enc.encode_ordinary(JOIN.join(str(row[c]) for c in columns)) or [enc.eot_token]
        out.append(ids[-max_len:])
    return out


def length_batches(lengths, tokens_per_batch):
    """Indices grouped longest first, each group padded to its longest row within tokens_per_batch tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


@torch.no_grad()
def pooled_features(model, token_lists, tokens_per_batch, device, ctx, noise_draws):
    """(N, C) float32: the final hidden state at each sequence's last token, mean over noise_draws
    forward passes (1 unless the model draws noise)."""
    features = torch.zeros(len(token_lists), model.config.n_embd)
    for batch in length_batches([len(t) for t in token_lists], tokens_per_batch):
        longest = len(token_lists[batch[0]])
        idx = torch.zeros(len(batch), longest, dtype=torch.long)  # right padding: never seen by a causal model
        for row, i in enumerate(batch):
            idx[row, :len(token_lists[i])] = torch.tensor(token_lists[i])
        last = torch.tensor([len(token_lists[i]) - 1 for i in batch])
        idx = idx.to(device)
        for _ in range(noise_draws):
            with ctx:
                hidden = final_hidden_states(model, idx)
            features[batch] += hidden[torch.arange(len(batch)), last.to(device)].float().cpu() / noise_draws
    return features


def atomic_save(obj, path):
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill mid-write leaves no half file under the real name


def cached_features(model, token_lists, cache_path, tokens_per_batch, device, ctx, noise_draws, seed, desc):
    """Features of token_lists, from cache_path if a finished run wrote it, else computed CHUNK examples
    at a time into cache_path.parts/ (reused after a kill), then joined into cache_path."""
    if os.path.isfile(cache_path):
        return torch.load(cache_path, weights_only=True)
    from tqdm import tqdm
    parts_dir = cache_path + '.parts'
    os.makedirs(parts_dir, exist_ok=True)
    chunks = []
    with tqdm(total=len(token_lists), desc=desc, unit='ex', dynamic_ncols=True) as bar:
        for c, start in enumerate(range(0, len(token_lists), CHUNK)):
            part = os.path.join(parts_dir, f"{c:06d}.pt")
            if os.path.isfile(part):
                chunk = torch.load(part, weights_only=True)
            else:
                manual_seed(seed + c)  # noise draws depend on the chunk only, not on where a run resumed
                chunk = pooled_features(model, token_lists[start:start + CHUNK], tokens_per_batch, device, ctx,
                                        noise_draws)
                atomic_save(chunk, part)
            chunks.append(chunk)
            bar.update(len(chunk))
    features = torch.cat(chunks) if chunks else torch.zeros(0, model.config.n_embd)
    atomic_save(features, cache_path)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return features


def cache_key(**fields):
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the probe

def probe_batch_size(setting, n_train):
    return setting or (32 if n_train < LARGE_TASK else 256)


def train_probe(x, y, num_labels, epochs, lr, weight_decay, batch_size, seed, desc='probe'):
    """A linear layer + softmax on frozen features, trained with cross-entropy and AdamW; seeded
    (initialisation and shuffling) so a seed gives the same probe every time."""
    from tqdm import tqdm
    g = torch.Generator().manual_seed(seed)
    probe = nn.Linear(x.size(1), num_labels).to(x.device)
    bound = 1 / math.sqrt(x.size(1))  # nn.Linear's own init, drawn from the seeded generator
    with torch.no_grad():
        probe.weight.copy_(torch.empty(probe.weight.shape).uniform_(-bound, bound, generator=g))
        probe.bias.copy_(torch.empty(probe.bias.shape).uniform_(-bound, bound, generator=g))
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in tqdm(range(epochs), desc=desc, unit='epoch', dynamic_ncols=True, leave=False):
        perm = torch.randperm(len(x), generator=g).to(x.device)
        for i in range(0, len(x), batch_size):
            b = perm[i:i + batch_size]
            loss = F.cross_entropy(probe(x[b]), y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return probe


# ----------------------------------------------------------------------------- the protocol

def load_split(path, task, split, max_examples):
    import datasets
    try:
        ds = datasets.load_dataset(path, task, split=split)
    except Exception as e:  # offline, a wrong path, a missing config: all end the same way for the user
        raise GlueError(f"cannot load GLUE {task}/{split} from {path!r} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); it needs the network once (Hugging Face "
                        f"datasets cache), or --glue_path=<a local folder in nyu-mll/glue's layout>") from e
    missing = [c for c in TASKS[task].columns + ('label',) if c not in ds.column_names]
    if missing:
        raise GlueError(f"GLUE {task}/{split} from {path!r} has no column {', '.join(missing)} (it has "
                        f"{', '.join(ds.column_names)}); --glue_path must have nyu-mll/glue's columns")
    if max_examples:
        ds = ds.select(range(min(max_examples, len(ds))))
    return ds


def run(model, info, enc, tasks, path, cache_dir, settings, extract_batch_size, device, ctx, seed, dtype,
        log=print):
    """Every task: cached features of train and validation splits, one probe per seed, metrics.
    Returns {task: {'splits': {split: {metric: mean_std}}, 'train_examples', 'batch_size', 'seconds'}}."""
    os.makedirs(cache_dir, exist_ok=True)
    block = model.config.block_size
    draws = settings['noise_draws'] if info['noise_on'] else 1  # no noise: every draw is the same
    tokens_per_batch = extract_batch_size * block  # the memory of batch_size full windows
    results = {}
    for task in tasks:
        spec = TASKS[task]
        t0 = time.time()
        data = {}
        for split in ('train',) + spec.eval_splits:
            ds = load_split(path, task, split, settings['max_examples'])
            key = cache_key(model=info['identity'], task=task, split=split, path=path, n=len(ds), block=block,
                            join=JOIN, noise_on=info['noise_on'], draws=draws, dtype=dtype, seed=seed,
                            tokens_per_batch=tokens_per_batch, format=FORMAT)
            tokens = encode_examples(enc, ds, spec.columns, block)
            feats = cached_features(model, tokens, os.path.join(cache_dir, f"{task}-{split}-{key}.pt"),
                                    tokens_per_batch, device, ctx, draws, seed, desc=f"{task} {split} features")
            labels = torch.tensor(ds['label'], dtype=torch.long)
            bad = labels[(labels < 0) | (labels >= spec.num_labels)]
            if len(bad):
                raise GlueError(f"GLUE {task}/{split} has label {bad[0].item()} (expected 0..{spec.num_labels - 1}); "
                                f"the test splits are unlabelled, use train and validation")
            data[split] = (feats.to(device), labels.to(device))
        t1 = time.time()
        x, y = data['train']
        bs = probe_batch_size(settings['batch_size'], len(x))
        scores = {split: {m: [] for m in ('accuracy', spec.extra_metric) if m} for split in spec.eval_splits}
        for s in settings['seeds']:
            probe = train_probe(x, y, spec.num_labels, settings['epochs'], settings['lr'], settings['weight_decay'],
                                bs, s, desc=f"{task} probe seed {s}")
            with torch.no_grad():
                for split in spec.eval_splits:
                    vx, vy = data[split]
                    pred = probe(vx).argmax(-1)
                    for m in scores[split]:
                        scores[split][m].append(METRICS[m](pred.cpu(), vy.cpu()))
        results[task] = dict(splits={split: {m: mean_std(v) for m, v in ms.items()} for split, ms in scores.items()},
                             train_examples=len(x), eval_examples={s: len(data[s][0]) for s in spec.eval_splits},
                             batch_size=bs, seconds=dict(features=t1 - t0, probe=time.time() - t1))
        log(f"{task}: " + ', '.join(f"{split} {m} {r['mean']:.4f}" for split, ms in results[task]['splits'].items()
                                    for m, r in ms.items())
            + f" (features {t1 - t0:.1f}s, {len(settings['seeds'])} probe(s) {time.time() - t1:.1f}s)")
    return results


def markdown_table(model_name, results, settings):
    """Table II's layout: one row per model, a column per task (MNLI matched and mismatched apart),
    cells in percent, 'acc / F1' for MRPC and QQP, 'acc / MCC' for CoLA, mean ± std over seeds."""
    header, cells = ['Model'], [model_name]
    for task in (t for t in TASKS if t in results):
        spec = TASKS[task]
        for split in spec.eval_splits:
            metrics = results[task]['splits'][split]
            names = ['acc'] + ([spec.extra_metric.upper() if spec.extra_metric == 'mcc' else 'F1']
                               if spec.extra_metric else [])
            header.append(f"{spec.title}{SPLIT_TITLES[split]} ({' / '.join(names)})")
            parts = []
            for m in metrics:
                r = metrics[m]
                parts.append(f"{100 * r['mean']:.1f}" + (f" ± {100 * r['std']:.1f}" if r['std'] is not None else ''))
            cells.append(' / '.join(parts))
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header), '| ' + ' | '.join(cells) + ' |']
    n = len(settings['seeds'])
    lines.append('')
    lines.append(f"Frozen backbone, last-token features, linear probe: {settings['epochs']} epochs, lr {settings['lr']:g}, "
                 f"AdamW weight decay {settings['weight_decay']:g}, batch "
                 f"{settings['batch_size'] or '32/256 by training-set size'}; {n} seed{'s' if n > 1 else ''}"
                 f"{' (mean ± sample std)' if n > 1 else ''}; validation split(s).")
    return '\n'.join(lines)
