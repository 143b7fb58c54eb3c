"""
Where attention goes on a recall task (DIFF's "attention noise"): for every answer of a recall dataset's
validation examples (data/mqar), in every layer and head, how the query's *effective* attention row
divides between the answer span and everything else.

The row is the one that multiplies V (GPT.attention_maps): softmax for base, symmetric and NoiseFormer
(with its noise exactly as evaluation runs it: on, one draw per layer and batch, unless noise_at_eval is
off), A1 - lambda A2 for DIFF, A1 + lambda (A3 - A2) for DINT and low-rank DINT, linear attention's
normalised feature-map weights. The query at position p sees keys 0..p, in three parts:
  answer   the queried key in the pairs and its value (2 tokens): where a lookup must read
  pairs    the other key-value pairs (2N - 2 tokens): relevant context, but the wrong entries
  context  everything after the pairs up to the query itself: earlier queries and the random filler
noise = pairs + context, everything but the answer.

One normalisation for every variant: a part's share is its *absolute* mass over the row's absolute mass,
sum_{j in part} |a_pj| / sum_{j <= p} |a_pj|, so the shares are in [0, 1] and add up to 1 even where
DIFF / DINT maps are negative or rows do not sum to 1. `signed_answer` is the answer span's signed mass
over the same denominator (in [-1, 1]; equal to the answer share where no weight is negative), so a
differential map that cancels onto the answer shows as a gap between the two.

A head's share cannot tell a layer that spreads its lookup over several heads from one that reads noise,
so each layer is also measured as a whole, by what each key adds to the layer's output (norm-based, as
Kobayashi et al. 2020, "Attention is not only a weight"): key j adds u_pj = c_proj(the heads' a_pj v_j,
each times the factor forward applies to its head's output: DIFF / DINT's RMSNorm and (1 - lambda_init)),
c_proj's bias aside, so that sum_j u_pj is the layer's attention output at p. A part's layer share is
sum_{j in part} |u_pj| / sum_{j <= p} |u_pj|: heads that cancel on a key cancel in its share.
"""
import numpy as np
import torch

from denoised_gpt.evaluation.recall import answers, distance_bucket, validation_examples

PARTS = ('answer', 'pairs', 'context', 'noise', 'signed_answer')
LAYER_PARTS = PARTS[:4]  # a norm has no sign


def effective_map(maps):
    """Of a layer's attention_maps, the one that multiplies V."""
    return maps['combined'] if 'combined' in maps else maps['attn']


def query_shares(rows, key_at, pairs, at):
    """rows (Q, heads, T): the effective attention rows of Q queries; key_at, pairs, at (Q,) int tensors: where
    each one's key stands in the pairs, its example's number of pairs, the query's own position.
    -> (Q, heads, len(PARTS)) float64, the parts' shares (module docstring); keys after the query count for
    nothing (a causal map has no weight there)."""
    j = torch.arange(rows.size(-1), device=rows.device)
    visible = j <= at[:, None]
    answer = (j >= key_at[:, None]) & (j <= key_at[:, None] + 1)
    in_pairs = (j < 2 * pairs[:, None]) & ~answer
    rows = rows.double() * visible[:, None, :]
    mass = rows.abs()
    total = mass.sum(-1).clamp_min(1e-300)

    def share(where, of=mass):
        return (of * where[:, None, :]).sum(-1) / total
    a, p, c = share(answer), share(in_pairs), share(visible & ~answer & ~in_pairs)
    return torch.stack([a, p, c, p + c, share(answer, of=rows)], dim=-1)


def contribution_norms(attn, rows, values):
    """rows (Q, heads, T): effective attention rows of one layer's module attn; values (Q, heads, T, value
    size): the V of each query's example. -> (Q, T): |u_pj|, the norm of what key j adds to the layer's
    output at the query (module docstring)."""
    dtype = torch.promote_types(rows.dtype, torch.float32)
    rows, values = rows.to(dtype), values.to(dtype)
    per_key = rows[..., None] * values  # (Q, heads, T, value size)
    per_key = per_key * attn.head_output_scale(per_key.sum(2)).to(dtype)[:, :, None, :]
    weight = attn.c_proj.weight.to(dtype).view(-1, per_key.size(1), per_key.size(-1))  # (C, heads, size)
    return torch.einsum('qhtd,chd->qtc', per_key, weight).norm(dim=-1)


@torch.no_grad()
def attention_noise(model, data_dir, batch_size, device, ctx, split="val"):
    """Per layer and head, the mean share of each part (module docstring) over every answer of the split's
    examples; the best head of each layer (highest answer share) and the best overall (the `lookup` head);
    each layer's shares as a whole and the best layer (the `reading_layer`); and, by number of pairs, by the
    example's filler length and by query distance, the same means.
    ValueError when data_dir is not a recall dataset."""
    examples, batches = validation_examples(model, data_dir, batch_size, split)
    shares, layer_shares, groups = [], [], []  # per answer: (layers, heads, parts), (layers, parts), its groups
    for x, y in batches:
        found = []  # (row, query position, key position, pairs) of every answer in the batch
        for row in range(len(x)):
            asked = answers(x[row].numpy(), y[row].numpy())
            found += [(row, p, key_at, len(asked)) for p, key_at in asked]
        if not found:  # examples without a labelled answer have nothing to measure
            continue
        b, at, key_at, pairs = (torch.tensor(c, dtype=torch.long) for c in zip(*found))
        b_on, at_on = b.to(device), at.to(device)
        per_layer, whole_layer = [], []
        with ctx:
            for _, attn, h in model.attention_inputs(x.to(device)):
                rows = effective_map(attn.attention_maps(h))[b_on, :, at_on, :]
                per_layer.append(query_shares(rows.cpu(), key_at, pairs, at))
                norms = contribution_norms(attn, rows, attn.value_heads(h)[b_on])
                whole_layer.append(query_shares(norms[:, None, :].cpu(), key_at, pairs, at)[:, 0, :len(LAYER_PARTS)])
        shares.append(torch.stack(per_layer, dim=1))  # (Q, layers, heads, parts)
        layer_shares.append(torch.stack(whole_layer, dim=1))  # (Q, layers, layer parts)
        T = x.size(1)
        groups += [(int(n), T - 3 * int(n), distance_bucket(int(p - k))) for n, p, k in zip(pairs, at, key_at)]
    if not shares:
        raise ValueError(f"{data_dir}'s {split} examples hold no labelled answer: nothing to measure")
    shares, layer_shares = torch.cat(shares), torch.cat(layer_shares)
    result = dict(normalisation='abs', parts=list(PARTS), examples=examples, **summary(shares, layer_shares))
    lookup = (result['lookup']['layer'], result['lookup']['head'])
    reading = result['reading_layer']['layer']
    for name, column, order in (('by_pairs', 0, int), ('by_filler', 1, int),
                                ('by_distance', 2, lambda k: int(k.split('-')[0]))):
        keys = np.array([g[column] for g in groups], dtype=object)
        result[name] = {}
        for k in sorted(set(keys), key=order):
            chosen = torch.from_numpy(keys == k)
            result[name][str(k)] = summary(shares[chosen], layer_shares[chosen], lookup, reading)
    return result


def summary(shares, layer_shares, lookup=None, reading=None):
    """shares (Q, layers, heads, parts), layer_shares (Q, layers, layer parts) -> dict(answers, shares:
    {part: [[mean per head] per layer]}, best_head: per layer, lookup: the best head overall, or the given
    (layer, head); layer_shares: {part: [mean per layer]}, reading_layer: the layer with the highest answer
    share, or the given one)."""
    mean, layer_mean = shares.mean(0), layer_shares.mean(0)  # (layers, heads, parts), (layers, layer parts)
    answer = mean[..., PARTS.index('answer')]

    def head(layer, h):
        return dict(layer=int(layer), head=int(h), **{part: float(mean[layer, h, i]) for i, part in enumerate(PARTS)})
    if lookup is None:
        flat = int(answer.argmax())
        lookup = divmod(flat, answer.size(1))
    if reading is None:
        reading = int(layer_mean[:, LAYER_PARTS.index('answer')].argmax())
    return dict(answers=shares.size(0),
                shares={part: mean[..., i].tolist() for i, part in enumerate(PARTS)},
                best_head=[head(layer, int(answer[layer].argmax())) for layer in range(answer.size(0))],
                lookup=head(*lookup),
                layer_shares={part: layer_mean[:, i].tolist() for i, part in enumerate(LAYER_PARTS)},
                reading_layer=dict(layer=reading, **{part: float(layer_mean[reading, i])
                                                     for i, part in enumerate(LAYER_PARTS)}))


def heatmap_panels(result):
    """The panels of the heatmap PNG: the three parts' shares per layer and head, then per layer as a whole."""
    layer = result['layer_shares']
    return {'answer': result['shares']['answer'], 'other pairs': result['shares']['pairs'],
            'context': result['shares']['context'],
            'layer as a whole': {'answer': layer['answer'], 'other pairs': layer['pairs'], 'context': layer['context']}}
