"""
A retrieval probe for a model trained on text (eval.py --retrieval): can it copy a span it saw D tokens
earlier, and where does its attention go while it copies?

Each example is a window of the model's own validation text with a span of k random tokens written into it
twice: the first copy, then D tokens of the real text, then the second copy ending at the window's last
position. The span's tokens are drawn, distinct, from the token ids that occur in the validation file (ids
the model has seen), so nothing but the first copy tells what follows inside the second: predicting it is
copying (induction). At each copy position p = b + i (b the second copy's start, i = 0 .. k - 2) the target
is span[i + 1], which stands at a + i + 1 in the first copy (a its start).

Copy accuracy: the share of those targets that the most likely next token gets right; chance is about 1 over
the number of candidate ids. Where the effective attention row (the weights that multiply V, as
attention_noise.py's) at p goes, in five parts:
  copy        a + i + 1: the token to copy, what an induction head reads (as a lookup reads the value)
  occurrence  a + i: the earlier occurrence of the query's token, what a copy matches on (as a lookup the key)
  span        the rest of both copies up to p: relevant tokens, the wrong entries
  own         the query's own token, p: it holds what a copy matches on, so attention to it is not noise
  text        the real-text context: everything else up to p
source = copy + occurrence; noise = span + text. Shares and the layer as a whole are attention_noise.py's
(part_shares, layer_part_shares): absolute mass over the row's, the signed shares beside them; the copy head
and the reading layer are ranked by the signed copy share over every distance, and read at each distance.
"""
import numpy as np
import torch

from denoised_gpt.evaluation.attention_noise import layer_part_shares, summary, uniform_shares

PARTS = ('copy', 'occurrence', 'span', 'own', 'text', 'source', 'noise', 'signed_copy', 'signed_occurrence',
         'signed_source')  # copy_parts' five, then part_shares' sums and signed shares
SPAN = 10  # tokens in the repeated span (k): k - 1 copy targets per example
DISTANCES = 5  # default distances: the longest that fits the window, then halved


def default_distances(length, span):
    """DISTANCES distances spanning a window of `length`: the longest that leaves one token of text before the
    first copy (position 0 is no ordinary position for most models), then halves of it."""
    longest = length - 2 * span - 1
    if longest < 1:
        raise ValueError(f"a window of {length} tokens cannot hold a span of {span} twice with text between: "
                         f"a smaller retrieval_span, or a model with a larger block_size")
    return sorted({max(1, longest >> n) for n in range(DISTANCES)})


def candidate_ids(path, vocab_size):
    """The token ids that occur in a uint16 token file (below vocab_size), sorted."""
    counts = np.bincount(np.memmap(path, dtype=np.uint16, mode='r'), minlength=vocab_size)[:vocab_size]
    return np.nonzero(counts)[0]


def probe_examples(path, vocab_size, length, span, distances, per_distance, seed):
    """The probe's examples, the same for every model given the same arguments. -> (tokens (n, length) int64,
    first copy's start a (n,), distance (n,), span tokens (n, span), number of candidate ids). The second copy
    starts at length - span, so a = length - 2 span - distance."""
    data = np.memmap(path, dtype=np.uint16, mode='r')
    if len(data) < length:
        raise ValueError(f"{path} holds {len(data)} tokens: the retrieval probe needs windows of {length}")
    ids = candidate_ids(path, vocab_size)
    if len(ids) < span:
        raise ValueError(f"{path} holds {len(ids)} distinct token ids, fewer than the span of {span}: give a "
                         f"smaller retrieval_span")
    for d in distances:
        if not 1 <= d <= length - 2 * span:
            raise ValueError(f"distance {d} does not fit: a window of {length} tokens holds a span of {span} twice "
                             f"with 1 .. {length - 2 * span} tokens of text between")
    rng = np.random.default_rng(seed)
    tokens, starts, dists, spans = [], [], [], []
    for d in distances:
        for _ in range(per_distance):
            at = int(rng.integers(0, len(data) - length + 1))
            window = data[at:at + length].astype(np.int64)
            repeat = rng.choice(ids, size=span, replace=False)
            a = length - 2 * span - d
            window[a:a + span] = repeat
            window[length - span:] = repeat
            tokens.append(window)
            starts.append(a)
            dists.append(d)
            spans.append(repeat)
    return (torch.from_numpy(np.stack(tokens)), torch.tensor(starts), torch.tensor(dists),
            torch.from_numpy(np.stack(spans)), len(ids))


def copy_parts(length, span, first, offset):
    """The (Q, length) bool masks of copy, occurrence, span, own and text (module docstring) for queries at offset
    i of the second copy of examples whose first copy starts at `first` (both (Q,) tensors)."""
    j = torch.arange(length)
    b = length - span
    at = b + offset
    copy, occurrence = j == (first + offset + 1)[:, None], j == (first + offset)[:, None]
    source = copy | occurrence
    in_first = (j >= first[:, None]) & (j < (first + span)[:, None])
    in_second = (j >= b) & (j < at[:, None])
    own = j == at[:, None]
    spans = (in_first | in_second) & ~source
    text = (j < at[:, None]) & ~source & ~spans
    return [copy, occurrence, spans, own, text]


@torch.no_grad()
def retrieval(model, path, batch_size, device, ctx, span=SPAN, distances=None, per_distance=64, seed=0,
              length=None):
    """Copy accuracy and attention parts (module docstring), overall and by distance, over per_distance examples
    at each distance (default: default_distances) in windows of `length` tokens (default: block_size) of the
    uint16 token file at path. ValueError when the examples cannot be built."""
    length = length or model.config.block_size
    if length > model.config.block_size:
        raise ValueError(f"windows of {length} tokens do not fit the model's block_size {model.config.block_size}")
    if span < 2:
        raise ValueError(f"retrieval_span={span}: a span needs at least 2 tokens (the first one cannot be copied)")
    distances = list(distances or default_distances(length, span))
    tokens, first, dist, spans, candidates = probe_examples(path, model.config.vocab_size, length, span, distances,
                                                           per_distance, seed)
    offsets = torch.arange(span - 1)
    hits, shares, layer_shares, uniform = [], [], [], []
    for i in range(0, len(tokens), batch_size):
        x = tokens[i:i + batch_size]
        b = torch.arange(len(x)).repeat_interleave(span - 1)  # every copy position of every row
        offset = offsets.repeat(len(x))
        masks = copy_parts(length, span, first[i:i + batch_size][b], offset)
        per_head, whole, _ = layer_part_shares(model, x, b, length - span + offset, masks, device, ctx)
        uniform.append(uniform_shares(masks, length - span + offset))
        shares.append(per_head)
        layer_shares.append(whole)
        y = torch.full_like(x, -1)
        y[:, length - span:length - 1] = spans[i:i + batch_size, 1:]
        with ctx:
            logits, _ = model(x.to(device), targets=y.to(device))
        hits.append((logits.argmax(-1).cpu() == y)[:, length - span:length - 1])  # (rows, span - 1)
    hits, shares, layer_shares = torch.cat(hits).double(), torch.cat(shares), torch.cat(layer_shares)
    uniform = torch.cat(uniform)
    per_copy = dist.repeat_interleave(span - 1)
    result = dict(normalisation='abs', parts=list(PARTS), ranked_by='signed_copy', span=span, length=length,
                  distances=distances, examples=len(tokens), candidates=candidates, chance=1 / candidates,
                  accuracy=float(hits.mean()),
                  **summary(shares, layer_shares, parts=PARTS, counted='copies', best='copy_head', uniform=uniform))
    copy_head = (result['copy_head']['layer'], result['copy_head']['head'])
    reading = result['reading_layer']['layer']
    result['by_offset'] = {str(i): float(hits[:, i].mean()) for i in range(span - 1)}
    result['by_distance'] = {}
    for d in distances:
        chosen = per_copy == d
        result['by_distance'][str(d)] = dict(
            accuracy=float(hits[dist == d].mean()),
            **summary(shares[chosen], layer_shares[chosen], copy_head, reading, parts=PARTS, counted='copies',
                      best='copy_head', uniform=uniform[chosen]))
    return result


def heatmap_panels(result):
    """The panels of the probe's PNG: at each distance, the signed share on the token to copy per layer and head
    (the copy head, ranked by it, boxed) with the copy accuracy there against chance; then the five parts per
    layer as a whole over every distance (the reading layer boxed); each says what a uniform row would score."""
    from denoised_gpt.evaluation.entropy import Panel
    head, u = result['copy_head'], result['uniform']
    words = dict(copy='token to copy', occurrence='earlier occurrence', span='span', own='own token', text='text')
    panels = {f"token to copy, signed, D={d}; copy head boxed\naccuracy {r['accuracy']:.3f} (chance "
              f"{result['chance']:.3f}), uniform row {r['uniform']['copy']:.3f}":
              Panel(r['shares']['signed_copy'], signed=True, mark=(head['layer'], head['head']))
              for d, r in result['by_distance'].items()}
    panels["layer as a whole; reading layer boxed\n(beside each part: a uniform row's share)"] = Panel(
        {f"{words[part]} ({u[part]:.3f})": result['layer_shares'][part] for part in PARTS[:5]},
        mark=result['reading_layer']['layer'])
    return panels
