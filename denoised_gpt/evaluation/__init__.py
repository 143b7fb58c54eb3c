"""
The pieces of eval.py that tests import: exact validation loss and the final hidden states (here),
attention entropy (entropy.py), the GLUE frozen-backbone probe (glue.py) and the
lm-evaluation-harness adapter (lm_eval_adapter.py), and the mean and spread over seeds that eval.py's
and compare.py's tables report. Heavy libraries (datasets, lm_eval, matplotlib)
are imported inside the functions that need them, so `eval.py --help` and a val-loss run stay quick.
"""
import math
import statistics

import numpy as np
import torch


def mean_std(values):
    """{'values', 'mean', 'std'} over seeds: std is the sample standard deviation, None for one value
    (no spread to report), and mean None when there are no values."""
    values = list(values)
    return dict(values=values, mean=statistics.mean(values) if values else None,
                std=statistics.stdev(values) if len(values) > 1 else None)


@torch.no_grad()
def attention_inputs(model, idx):
    """Yields (layer index, the layer's attention module, its input after ln_1) for a GPT and (B, T) token ids,
    layer by layer, as GPT.forward computes them: each block runs after its attention module is analysed, so
    NoiseFormer's analysis draws its noise before the block's own forward draws."""
    pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
    x = model.transformer.drop(model.transformer.wte(idx) + model.transformer.wpe(pos))
    for i, block in enumerate(model.transformer.h):
        yield i, block.attn, block.ln_1(x)
        x = block(x)


@torch.no_grad()
def final_hidden_states(model, idx):
    """(B, T) token ids -> (B, T, C): the output of the model's final LayerNorm (ln_f), i.e. what
    lm_head reads. Taken with a forward hook, so it is exactly GPT.forward's computation for every
    attn_type (GPT.forward itself only applies lm_head to the last position)."""
    captured = []
    handle = model.transformer.ln_f.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        model(idx)
    finally:
        handle.remove()
    return captured[0]


@torch.no_grad()
def exact_val_loss(model, path, block_size, batch_size, device, ctx, layout=None):
    """Mean cross-entropy over every target token of a flat uint16 token file: windows of block_size
    tokens that do not overlap (the last one shorter), so token t >= 1 is predicted exactly once, from
    the tokens since its window's start. Variants evaluated on the same file see the same tokens.
    With a layout of examples (batches.ExampleLayout), each window is one example and only its
    marked targets count. Returns dict(loss, tokens, windows, perplexity); tokens: the targets scored."""
    if layout is not None and layout.example_tokens is not None:
        return _examples_val_loss(model, path, batch_size, device, ctx, layout)
    data = np.memmap(path, dtype=np.uint16, mode='r')
    n_targets = len(data) - 1
    if n_targets < 1:
        raise ValueError(f"{path} has {len(data)} tokens: at least 2 are needed for one prediction")
    starts = list(range(0, n_targets, block_size))
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        group = starts[i:i + batch_size]
        # windows of equal length go in one batch; only the last window can be shorter
        for length in sorted({min(block_size, n_targets - s) for s in group}, reverse=True):
            rows = [s for s in group if min(block_size, n_targets - s) == length]
            w = torch.from_numpy(np.stack([data[s:s + length + 1].astype(np.int64) for s in rows])).to(device)
            with ctx:
                _, loss = model(w[:, :-1], targets=w[:, 1:])
            total += float(loss) * w[:, 1:].numel()  # loss is the mean over this batch's targets
            count += w[:, 1:].numel()
    return dict(loss=total / count, tokens=count, windows=len(starts), perplexity=math.exp(total / count))


def _examples_val_loss(model, path, batch_size, device, ctx, layout):
    num_tokens = np.memmap(path, dtype=np.uint16, mode='r').size
    length = layout.example_tokens - 1
    layout.check(path, num_tokens, length, model.config.vocab_size)
    starts = np.arange(0, num_tokens, layout.example_tokens)
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        x, y = layout.rows(path, starts[i:i + batch_size], length)
        scored = int((y >= 0).sum())
        if scored == 0:
            continue
        with ctx:
            _, loss = model(x.to(device), targets=y.to(device))
        total += float(loss) * scored  # loss is the mean over this batch's scored targets
        count += scored
    if count == 0:
        raise ValueError(f"{path} has no marked target to score")
    return dict(loss=total / count, tokens=count, windows=len(starts), perplexity=math.exp(total / count))
