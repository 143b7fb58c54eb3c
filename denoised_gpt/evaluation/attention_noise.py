"""
Where attention goes on a recall task (DIFF's "attention noise"): for every answer of a recall dataset's
validation examples (data/mqar), in every layer and head, how the query's *effective* attention row
divides between the answer span and everything else.

The row is the one that multiplies V (the layer's attention_maps): softmax for base, symmetric and NoiseFormer
(with its noise exactly as evaluation runs it: on, one draw per layer and batch, unless noise_at_eval is
off), A1 - lambda A2 for DIFF, A1 + lambda (A3 - A2) for DINT and low-rank DINT, linear attention's
normalised feature-map weights. The query at position p sees keys 0..p, in six parts:
  value    the queried key's value in the pairs: where a lookup reads what it answers with
  key      the queried key in the pairs: what the query is matched against (a head can match the key
           without carrying the value, so the two are read apart)
  pairs    the other key-value pairs (2N - 2 tokens): relevant context, but the wrong entries
  own      the query's own token, position p: it holds the key being asked, so attending to it is part of
           the lookup (the key to match), not noise
  queries  the earlier queries of the example (positions after the pairs where a key was asked before p)
  filler   everything else up to p: the random (or zero) filler tokens, or the text of a needle dataset
answer = value + key; noise = pairs + queries + filler: what a lookup has no use for. A needle dataset
(data/needles) has the same parts: its needles are the pairs, its text the filler (PART_WORDS).

One normalisation for every variant: a part's share is its *absolute* mass over the row's absolute mass,
sum_{j in part} |a_pj| / sum_{j <= p} |a_pj|, so the shares are in [0, 1] and add up to 1 even where
DIFF / DINT maps are negative or rows do not sum to 1. `signed_value`, `signed_key` and `signed_answer` are
the signed masses over the same denominator (in [-1, 1]; equal to the absolute shares where no weight is
negative): a differential map that subtracts a part has a large absolute share and a negative signed one.
Heads and layers are ranked by the signed value share (the lookup head, the reading layer): the value is what
the lookup carries into the output; a head that matches the key but carries no value, or reads the value
while subtracting the key (a signed answer share near 0), would rank high or low by the answer as a whole.

A head's share cannot tell a layer that spreads its lookup over several heads from one that reads noise,
so each layer is also measured as a whole, by what each key adds to the layer's output (norm-based, as
Kobayashi et al. 2020, "Attention is not only a weight"): key j adds u_pj = c_proj(the heads' a_pj v_j,
each times the factor forward applies to its head's output: DIFF / DINT's RMSNorm and (1 - lambda_init)),
c_proj's bias aside, so that sum_j u_pj is the layer's attention output at p. A part's layer share is
sum_{j in part} |u_pj| / sum_{j <= p} |u_pj|: heads that cancel on a key cancel in its share. Its signed
answer share is the answer's additions along the layer's output, sum_{j in answer} u_pj . o_p / |o_p| over
the same denominator (o_p = sum_j u_pj): negative where the layer subtracts what the answer would add.

The parts are positions, and above the first layer a position holds more than its token: a head of the layer
below that reads each token's previous one gives the token after the value that value, and a lookup can read
it there (DIFF, DINT, NoiseFormer v2 on MQAR: docs/recall.md), where the parts count it as another pair or filler.
`by_offset` gives the signed shares of the keys at OFFSETS from the queried key, per head and per layer.
"""
import numpy as np
import torch

from denoised_gpt.evaluation import attention_inputs
from denoised_gpt.evaluation.recall import dataset_task, distance_bucket, validation_examples

PARTS = ('value', 'key', 'pairs', 'own', 'queries', 'filler', 'answer', 'noise', 'signed_value', 'signed_key',
         'signed_answer')  # the six parts (recall_parts' order), then part_shares' sums and signed shares
# where a lookup can read besides the value: keys at these offsets from the queried key (+1 its value, +2 the token
# after it, which a layer below may have given the value by attending to its previous token)
OFFSETS = (-1, 0, 1, 2, 3)
RANKED_BY = 'signed_value'  # the lookup head, each layer's best head and the reading layer
# the parts in words, by task: a needle dataset's pairs are needles in a text
PART_WORDS = {'mqar': dict(value='answer value', key='answer key', pairs='other pairs', own='own token',
                           queries='earlier queries', filler='filler'),
              'needles': dict(value='answer value', key='answer key', pairs='other needles', own='own token',
                              queries='earlier queries', filler='text')}


def effective_map(maps):
    """Of a layer's attention_maps, the one that multiplies V."""
    return maps['combined'] if 'combined' in maps else maps['attn']


def recall_parts(T, key_at, needles, at, asked):
    """The (Q, T) bool masks of value, key, pairs, own, queries and filler (module docstring), in that order, of
    queries at positions `at` asking the key at key_at (both (Q,)); needles and asked (Q, T): where the query's
    example holds its pairs (keys and values) and its queries."""
    j = torch.arange(T)
    value, key = j == key_at[:, None] + 1, j == key_at[:, None]
    in_pairs = needles & ~value & ~key
    own = j == at[:, None]
    earlier = asked & (j < at[:, None])
    filler = (j <= at[:, None]) & ~value & ~key & ~in_pairs & ~own & ~earlier
    return [value, key, in_pairs, own, earlier, filler]


def part_shares(rows, masks, signed=None):
    """rows (Q, heads, T): attention rows (or per-key norms); masks: the parts as (Q, T) bool masks, disjoint,
    together every key up to the query: first the key a lookup reads (the value, or the token a copy copies),
    second the key it matches (the key, or the earlier occurrence), fourth the query's own token. -> (Q, heads,
    len(masks) + 5) float64: each part's share of the row's absolute mass, then the first two together, noise
    (every part but those three), and the signed shares of the first, the second and the two together (signed
    weights: default rows)."""
    visible = torch.stack(masks).any(0)[:, None, :]
    rows = rows.double() * visible
    signed = rows if signed is None else signed.double() * visible
    mass = rows.abs()
    total = mass.sum(-1).clamp_min(1e-300)
    shares = [(mass * where[:, None, :]).sum(-1) / total for where in masks]
    noise = sum(s for i, s in enumerate(shares) if i not in (0, 1, 3))
    read, matched = ((signed * where[:, None, :]).sum(-1) / total for where in masks[:2])
    return torch.stack([*shares, shares[0] + shares[1], noise, read, matched, read + matched], dim=-1)


def uniform_shares(masks, at):
    """(Q, len(masks)) float64: each part's share in a uniform row over keys 0 .. at, |part| / (at + 1): the level
    a head that does not choose scores."""
    return torch.stack([m.sum(-1) for m in masks], dim=-1).double() / (at + 1)[:, None]


def layer_part_shares(model, x, b, at, masks, device, ctx, positions=None):
    """The part_shares of Q queries, at every layer: x (B, T) token ids; b, at (Q,) each query's row of x and
    position; masks: its parts (part_shares). -> ((Q, layers, heads, parts) per head, (Q, layers, parts) the
    layer as a whole, by what each key adds to its output, and, for positions (Q, K), the signed shares of those
    keys over the same masses (signed_shares_at), (Q, layers, heads + 1, K) with the layer as a whole last;
    None without positions)."""
    b_on, at_on = b.to(device), at.to(device)
    per_layer, whole_layer, at_positions = [], [], []
    with ctx:
        for _, attn, h in attention_inputs(model, x.to(device)):
            rows = effective_map(attn.attention_maps(h))[b_on, :, at_on, :]
            per_layer.append(part_shares(rows.cpu(), masks))
            norms, along = contributions(attn, rows, attn.value_heads(h)[b_on])
            whole_layer.append(part_shares(norms[:, None, :].cpu(), masks, signed=along[:, None, :].cpu())[:, 0])
            if positions is not None:
                signed, mass = torch.cat([rows, along[:, None, :]], 1), torch.cat([rows, norms[:, None, :]], 1)
                at_positions.append(signed_shares_at(signed.cpu(), mass.cpu(), masks, positions, at))
    return (torch.stack(per_layer, dim=1), torch.stack(whole_layer, dim=1),
            None if positions is None else torch.stack(at_positions, dim=1))


def signed_shares_at(signed, mass, masks, positions, at):
    """signed, mass (Q, rows, T): the signed weights, and those whose absolute sum over the keys up to the query
    is the denominator (part_shares'); positions (Q, K) key positions. -> (Q, rows, K) float64: each position's
    signed share, 0 where it does not stand before the query at (Q,)."""
    visible = torch.stack(masks).any(0)[:, None, :]
    total = (mass.double().abs() * visible).sum(-1).clamp_min(1e-300)
    before = (positions >= 0) & (positions < at[:, None])
    index = positions.clamp(0, signed.size(-1) - 1)[:, None, :].expand(-1, signed.size(1), -1)
    return signed.double().gather(-1, index) * before[:, None, :] / total[..., None]


def contributions(attn, rows, values):
    """rows (Q, heads, T): effective attention rows of one layer's module attn; values (Q, heads, T, value
    size): the V of each query's example. -> (|u_pj|, u_pj . o_p / |o_p|), each (Q, T): the norm of what key
    j adds to the layer's output at the query, and its component along that output (module docstring)."""
    dtype = torch.promote_types(rows.dtype, torch.float32)
    rows, values = rows.to(dtype), values.to(dtype)
    per_key = rows[..., None] * values  # (Q, heads, T, value size)
    per_key = per_key * attn.head_output_scale(per_key.sum(2)).to(dtype)[:, :, None, :]
    weight = attn.c_proj.weight.to(dtype).view(-1, per_key.size(1), per_key.size(-1))  # (C, heads, size)
    adds = torch.einsum('qhtd,chd->qtc', per_key, weight)  # (Q, T, C)
    output = adds.sum(1, keepdim=True)
    along = (adds * output).sum(-1) / output.norm(dim=-1).clamp_min(1e-300)
    return adds.norm(dim=-1), along


@torch.no_grad()
def attention_noise(model, data_dir, batch_size, device, ctx, split="val"):
    """Per layer and head, the mean share of each part (module docstring) over every answer of the split's
    examples; the best head of each layer (highest signed value share) and the best overall (the `lookup`
    head); each layer's shares as a whole and the best layer (the `reading_layer`); a uniform row's shares;
    by_offset: the signed shares of the keys at OFFSETS from the queried key; and, by number of pairs, by the
    example's filler length and by query distance, the same means. ValueError when data_dir is not a recall
    dataset."""
    examples, batches = validation_examples(model, data_dir, batch_size, split)
    # per answer: (layers, heads, parts), (layers, parts), (layers, heads + 1, offsets), a uniform row's parts, groups
    shares, layer_shares, by_offset, uniform, groups = [], [], [], [], []
    for x, y, asked in batches:
        found = [(row, p, key_at, len(a)) for row, a in enumerate(asked) for p, key_at in a]
        if not found:  # examples without a labelled answer have nothing to measure
            continue
        asked_at = torch.zeros(x.shape, dtype=torch.bool)  # where each example's queries stand
        needles = torch.zeros(x.shape, dtype=torch.bool)  # and its pairs (every key is asked once)
        for row, p, key_at, _ in found:
            asked_at[row, p] = needles[row, key_at] = needles[row, key_at + 1] = True
        b, at, key_at, pairs = (torch.tensor(c, dtype=torch.long) for c in zip(*found))
        masks = recall_parts(x.size(1), key_at, needles[b], at, asked_at[b])
        per_head, whole, offsets = layer_part_shares(model, x, b, at, masks, device, ctx,
                                                     positions=key_at[:, None] + torch.tensor(OFFSETS))
        by_offset.append(offsets)
        uniform.append(uniform_shares(masks, at))
        shares.append(per_head)  # (Q, layers, heads, parts)
        layer_shares.append(whole)  # (Q, layers, layer parts)
        T = x.size(1)
        groups += [(int(n), T - 3 * int(n), distance_bucket(int(p - k))) for n, p, k in zip(pairs, at, key_at)]
    if not shares:
        raise ValueError(f"{data_dir}'s {split} examples hold no labelled answer: nothing to measure")
    shares, layer_shares, uniform = torch.cat(shares), torch.cat(layer_shares), torch.cat(uniform)
    result = dict(normalisation='abs', parts=list(PARTS), ranked_by=RANKED_BY, examples=examples,
                  part_words=PART_WORDS[dataset_task(data_dir)], **summary(shares, layer_shares, uniform=uniform))
    mean = torch.cat(by_offset).mean(0)  # (layers, heads + 1, offsets)
    result['by_offset'] = {f'{o:+d}': dict(heads=mean[:, :-1, i].tolist(), layers=mean[:, -1, i].tolist())
                           for i, o in enumerate(OFFSETS)}
    lookup = (result['lookup']['layer'], result['lookup']['head'])
    reading = result['reading_layer']['layer']
    for name, column, order in (('by_pairs', 0, int), ('by_filler', 1, int),
                                ('by_distance', 2, lambda k: int(k.split('-')[0]))):
        keys = np.array([g[column] for g in groups], dtype=object)
        result[name] = {}
        for k in sorted(set(keys), key=order):
            chosen = torch.from_numpy(keys == k)
            result[name][str(k)] = summary(shares[chosen], layer_shares[chosen], lookup, reading,
                                           uniform=uniform[chosen])
    return result


def summary(shares, layer_shares, lookup=None, reading=None, parts=PARTS, counted='answers', best='lookup',
            uniform=None):
    """shares (Q, layers, heads, parts), layer_shares (Q, layers, parts), uniform (Q, the parts before the sums):
    uniform_shares -> dict({counted}: Q, shares: {part: [[mean per head] per layer]}, best_head: per layer,
    {best}: the best head overall, or the given (layer, head); layer_shares: {part: [mean per layer]},
    reading_layer: the best layer, or the given one; uniform: {part: mean}, noise too). Best:
    the highest mean signed share of the part a lookup reads (part_shares' third column from the end)."""
    mean, layer_mean = shares.mean(0), layer_shares.mean(0)  # (layers, heads, parts), (layers, parts)
    rank = mean[..., -3]

    def head(layer, h):
        return dict(layer=int(layer), head=int(h), **{part: float(mean[layer, h, i]) for i, part in enumerate(parts)})
    if lookup is None:
        lookup = divmod(int(rank.argmax()), rank.size(1))
    if reading is None:
        reading = int(layer_mean[:, -3].argmax())
    return {counted: shares.size(0),
            'shares': {part: mean[..., i].tolist() for i, part in enumerate(parts)},
            'best_head': [head(layer, int(rank[layer].argmax())) for layer in range(rank.size(0))],
            best: head(*lookup),
            'layer_shares': {part: layer_mean[:, i].tolist() for i, part in enumerate(parts)},
            'reading_layer': dict(layer=reading,
                                  **{part: float(layer_mean[reading, i]) for i, part in enumerate(parts)}),
            **({} if uniform is None else {'uniform': uniform_levels(uniform.mean(0).tolist(), parts)})}


def uniform_levels(levels, parts):
    """{part: a uniform row's mean share} from uniform_shares' means, with the sums of part_shares (the first two
    together, noise) after them."""
    noise = sum(v for i, v in enumerate(levels) if i not in (0, 1, 3))
    return dict(zip(parts, [*levels, levels[0] + levels[1], noise]))


def heatmap_panels(result):
    """The panels of the heatmap PNG: the answer value's and key's signed shares per layer and head (the lookup
    head, ranked by the value's, boxed), the own token's and the noise's (absolute) shares, then the six parts
    per layer as a whole (the reading layer boxed); each says what a uniform row would score."""
    from denoised_gpt.evaluation.entropy import Panel
    words, shares, u = result['part_words'], result['shares'], result['uniform']
    look, reading = result['lookup'], result['reading_layer']['layer']
    return {f"{words['value']}, signed; lookup head boxed\nuniform row {u['value']:.3f}":
            Panel(shares['signed_value'], signed=True, mark=(look['layer'], look['head'])),
            f"{words['key']}, signed\nuniform row {u['key']:.3f}": Panel(shares['signed_key'], signed=True),
            f"{words['own']}\nuniform row {u['own']:.3f}": shares['own'],
            f"noise: {words['pairs']}, {words['queries']},\n{words['filler']}; uniform row {u['noise']:.3f}":
            shares['noise'],
            "layer as a whole; reading layer boxed\n(beside each part: a uniform row's share)":
            Panel({f"{words[part]} ({u[part]:.3f})": result['layer_shares'][part] for part in PARTS[:6]},
                  mark=reading)}
