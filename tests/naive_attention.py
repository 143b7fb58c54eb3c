"""Naive float64 reference implementations of every attention variant, written from
docs/attention.md and the parameter names of the model contract, independently of model.py.

Each `<variant>_map(attn, x, eps=None, ...)` builds the variant's effective attention map (the matrix
that multiplies V, per head) and returns it with the values; `naive_<variant>(attn, x, eps=None, ...)`
gives the module's output after `c_proj` from them (dropout taken to be 0), shape (B, T, C); linear
attention's output is built from explicit running sums instead, independently of its map. Both read
the weights of an attention module (`model.transformer.h[i].attn`) by their contract names, cast
everything to float64 and build the full T x T matrices with explicit loops or plain tensor ops: no
SDPA, no chunking, no cumsum. NAIVE and NAIVE_MAPS find them by these names for every attn_type
model.py registers.

Extra keyword arguments, passed by the tests from the config rather than read from the module:
- `layer_index` (diff, dint, dint_lowrank): lambda_init = 0.8 - 0.6 * exp(-0.3 * layer_index).
- `score_divisor` (dint_lowrank): A2 uses the scale sqrt(score_divisor) / sqrt(d).
- `eps` (noiseformer): the standard-normal noise tensor, broadcastable to (B, H, T, T);
  None means no noise (the layer is then exactly symmetric attention).
"""
import functools
import math
from collections.abc import Mapping

import torch

F64 = torch.float64
RMS_EPS = 1e-5      # RMSNorm epsilon of the differential heads (spec)
LINEAR_EPS = 1e-6   # denominator epsilon of linear attention (spec)


# ----------------------------------------------------------------------------- building blocks

def _w(p):
    return None if p is None else p.detach().to(F64)


def _linear(lin, x):
    """x @ W^T + b for an nn.Linear, in float64."""
    y = x @ _w(lin.weight).T
    if lin.bias is not None:
        y = y + _w(lin.bias)
    return y


def _heads(t, n, d):
    """(B, T, n*d) -> (B, n, T, d)."""
    B, T, _ = t.shape
    return t.reshape(B, T, n, d).permute(0, 2, 1, 3)


def _merge(t):
    """(B, n, T, d) -> (B, T, n*d)."""
    B, n, T, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(B, T, n * d)


@functools.lru_cache(maxsize=None)
def _causal_mask(T):
    m = torch.zeros(T, T, dtype=F64)
    for i in range(T):
        for j in range(T):
            if j > i:
                m[i, j] = float("-inf")
    return m


def causal_mask(T):
    """(T, T) additive mask: 0 where key j <= query i, -inf elsewhere (explicit loops, cached)."""
    return _causal_mask(T).clone()


def softmax_rows(s):
    """Softmax over the last dim written out: exp(s - max) / sum."""
    s = s - s.max(dim=-1, keepdim=True).values
    e = torch.exp(s)
    return e / e.sum(dim=-1, keepdim=True)


def causal_probs(scores):
    """softmax(scores + M) for scores (..., T, T)."""
    T = scores.shape[-1]
    return softmax_rows(scores + causal_mask(T))


def rms_norm(h, weight, eps=RMS_EPS):
    """RMSNorm over the last dim: h / sqrt(mean(h^2) + eps) * weight."""
    return h / torch.sqrt((h * h).mean(dim=-1, keepdim=True) + eps) * weight


def lambda_init_for(layer_index):
    return 0.8 - 0.6 * math.exp(-0.3 * layer_index)


def diff_lambda(attn, layer_index):
    """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, as a float64 scalar tensor."""
    lq1, lk1 = _w(attn.lambda_q1), _w(attn.lambda_k1)
    lq2, lk2 = _w(attn.lambda_q2), _w(attn.lambda_k2)
    return torch.exp((lq1 * lk1).sum()) - torch.exp((lq2 * lk2).sum()) + lambda_init_for(layer_index)


def integral_probs(a1):
    """A3[i, :] = mean over r <= i of A1[r, :], built row by row. a1: (..., T, T)."""
    T = a1.shape[-1]
    a3 = torch.zeros_like(a1)
    for i in range(T):
        a3[..., i, :] = a1[..., : i + 1, :].mean(dim=-2)
    return a3


def _sizes(attn):
    C, H = attn.n_embd, attn.n_head
    assert C % H == 0
    return C, H, C // H


def _layer_index(attn, layer_index):
    if layer_index is None:
        raise TypeError("pass layer_index= (the naive reference derives lambda_init from it)")
    return layer_index


# ----------------------------------------------------------------------------- the variants
# Each variant's effective map (the matrix that multiplies V, per head), then its output from it.

def base_map(attn, x, eps=None):
    """Standard causal attention: A = softmax(Q K^T / sqrt(d) + M); returns (A, V)."""
    C, H, d = _sizes(attn)
    q, k, v = (_heads(t, H, d) for t in _linear(attn.c_attn, x.to(F64)).split(C, dim=2))
    return causal_probs(q @ k.transpose(-1, -2) / math.sqrt(d)), v


def symmetric_map(attn, x, eps=None):
    """K := Q: A = softmax(Q Q^T / sqrt(d) + M), c_attn gives (q, v)."""
    C, H, d = _sizes(attn)
    q, v = (_heads(t, H, d) for t in _linear(attn.c_attn, x.to(F64)).split(C, dim=2))
    return causal_probs(q @ q.transpose(-1, -2) / math.sqrt(d)), v


def noise_mu_sigma(attn):
    """(mu, sigma) of a noiseformer layer as float64 tensors of shape (1,) or (H,)."""
    mu = _w(attn.noise_mu)
    if hasattr(attn, "noise_logvar"):
        sigma = torch.sqrt(torch.exp(_w(attn.noise_logvar)))
    else:
        sigma = _w(attn.noise_sigma)
    return mu, sigma


def noiseformer_map(attn, x, eps=None):
    """S = Q Q^T / sqrt(d) + mu + sigma * eps, A = softmax(S + M).

    mu, sigma have shape (1,) (v1) or (H,) (v2) and broadcast over heads; eps (1 or B, 1 or H, T, T).
    """
    C, H, d = _sizes(attn)
    q, v = (_heads(t, H, d) for t in _linear(attn.c_attn, x.to(F64)).split(C, dim=2))
    s = q @ q.transpose(-1, -2) / math.sqrt(d)
    if eps is not None:
        mu, sigma = noise_mu_sigma(attn)
        s = s + mu.reshape(1, -1, 1, 1) + sigma.reshape(1, -1, 1, 1) * eps.to(F64)
    return causal_probs(s), v


def _differential_map(attn, x, layer_index, integral):
    """diff / dint: n_head q/k heads of d, n_head/2 value heads of 2d; head h = q/k heads 2h, 2h+1.
    A = A1 - lambda A2 (+ lambda A3 for dint), per differential head."""
    C, H, d = _sizes(attn)
    q, k, v = _linear(attn.c_attn, x.to(F64)).split(C, dim=2)
    q, k = _heads(q, H, d), _heads(k, H, d)            # (B, H, T, d)
    lam = diff_lambda(attn, _layer_index(attn, layer_index))
    maps = []
    for h in range(H // 2):
        a1 = causal_probs(q[:, 2 * h] @ k[:, 2 * h].transpose(-1, -2) / math.sqrt(d))
        a2 = causal_probs(q[:, 2 * h + 1] @ k[:, 2 * h + 1].transpose(-1, -2) / math.sqrt(d))
        maps.append(a1 - lam * a2 + (lam * integral_probs(a1) if integral else 0))
    return torch.stack(maps, dim=1), _heads(v, H // 2, 2 * d)


def diff_map(attn, x, eps=None, layer_index=None):
    return _differential_map(attn, x, layer_index, integral=False)


def dint_map(attn, x, eps=None, layer_index=None):
    """A = lambda A3 + A1 - lambda A2, A3 the causal running row-mean of A1."""
    return _differential_map(attn, x, layer_index, integral=True)


def dint_lowrank_map(attn, x, eps=None, layer_index=None, score_divisor=81.0):
    """DINT where every base head h (q1, k1, v from c_attn exactly as base) is one differential head;
    Q2 = X W_q2_down W_q2_up, K2 = X W_k2_down W_k2_up split into the same H heads of d;
    A2 = softmax(Q2 K2^T * sqrt(score_divisor) / sqrt(d) + M)."""
    C, H, d = _sizes(attn)
    x = x.to(F64)
    q1, k1, v = (_heads(t, H, d) for t in _linear(attn.c_attn, x).split(C, dim=2))
    q2 = _heads(_linear(attn.q2_up, _linear(attn.q2_down, x)), H, d)
    k2 = _heads(_linear(attn.k2_up, _linear(attn.k2_down, x)), H, d)
    lam = diff_lambda(attn, _layer_index(attn, layer_index))
    a1 = causal_probs(q1 @ k1.transpose(-1, -2) / math.sqrt(d))
    a2 = causal_probs(q2 @ k2.transpose(-1, -2) * math.sqrt(score_divisor) / math.sqrt(d))
    return lam * integral_probs(a1) + a1 - lam * a2, v


def linear_map(attn, x, eps=None):
    """The map linear attention applies: A_ij = phi(q_i).phi(k_j) / (sum_{j' <= i} phi(q_i).phi(k_j') + 1e-6)
    for j <= i, 0 after; phi = elu + 1."""
    C, H, d = _sizes(attn)
    q, k, v = (_heads(t, H, d) for t in _linear(attn.c_attn, x.to(F64)).split(C, dim=2))
    phi = lambda t: torch.where(t > 0, t + 1.0, torch.exp(t))   # elu(t) + 1
    scores = phi(q) @ phi(k).transpose(-1, -2)
    T = scores.shape[-1]
    a = torch.zeros_like(scores)
    for i in range(T):
        a[..., i, : i + 1] = scores[..., i, : i + 1] / (scores[..., i, : i + 1].sum(-1, keepdim=True) + LINEAR_EPS)
    return a, v


def _softmax_output(variant_map):
    def naive(attn, x, eps=None, **kwargs):
        a, v = variant_map(attn, x, eps, **kwargs)
        return _linear(attn.c_proj, _merge(a @ v))
    naive.__doc__ = f"O = A V with A from {variant_map.__name__}, then c_proj."
    return naive


def _differential_output(variant_map):
    def naive(attn, x, eps=None, layer_index=None, **kwargs):
        """O = A V per differential head, RMSNorm(value size), * (1 - lambda_init), then c_proj."""
        a, v = variant_map(attn, x, eps, layer_index=layer_index, **kwargs)
        o = rms_norm(a @ v, _w(attn.head_norm.weight)) * (1.0 - lambda_init_for(layer_index))
        return _linear(attn.c_proj, _merge(o))
    return naive


naive_base = _softmax_output(base_map)
naive_symmetric = _softmax_output(symmetric_map)
naive_noiseformer = naive_noiseformer_v1 = naive_noiseformer_v2 = _softmax_output(noiseformer_map)
noiseformer_v1_map = noiseformer_v2_map = noiseformer_map
naive_diff = _differential_output(diff_map)
naive_dint = _differential_output(dint_map)
naive_dint_lowrank = _differential_output(dint_lowrank_map)


def naive_linear(attn, x, eps=None):
    """O_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + 1e-6), S_i = sum_{j<=i} phi(k_j) v_j^T,
    z_i = sum_{j<=i} phi(k_j), phi = elu + 1, no temperature; explicit sums for every i."""
    C, H, d = _sizes(attn)
    x = x.to(F64)
    q, k, v = (_heads(t, H, d) for t in _linear(attn.c_attn, x).split(C, dim=2))
    phi = lambda t: torch.where(t > 0, t + 1.0, torch.exp(t))   # elu(t) + 1
    pq, pk = phi(q), phi(k)
    B, _, T, _ = q.shape
    out = torch.zeros(B, H, T, d, dtype=F64)
    for i in range(T):
        S = torch.zeros(B, H, d, d, dtype=F64)
        z = torch.zeros(B, H, d, dtype=F64)
        for j in range(i + 1):
            S = S + pk[:, :, j, :, None] * v[:, :, j, None, :]
            z = z + pk[:, :, j]
        num = (pq[:, :, i, :, None] * S).sum(dim=-2)          # (B, H, d)
        den = (pq[:, :, i] * z).sum(dim=-1, keepdim=True)     # (B, H, 1)
        out[:, :, i] = num / (den + LINEAR_EPS)
    return _linear(attn.c_proj, _merge(out))


# Each variant's parameters in one layer beyond base's (c_attn's q, k, v and c_proj, with biases), from its
# equations: the parameter counts of tests/test_model.py and the README's table follow from them.

def base_parameters(c):
    return 0


linear_parameters = base_parameters


def symmetric_parameters(c):
    return -(c.n_embd * c.n_embd + c.n_embd * c.bias)  # no key projection


def noiseformer_v1_parameters(c):
    return symmetric_parameters(c) + 2  # (mu, sigma) per layer


def noiseformer_v2_parameters(c):
    return symmetric_parameters(c) + 2 * c.n_head  # (mu, sigma) per head


def diff_parameters(c):
    d = c.n_embd // c.n_head
    return 4 * d + 2 * d  # 4 lambda vectors (d), RMSNorm over a differential head's values (2d)


dint_parameters = diff_parameters


def dint_lowrank_parameters(c):
    d = c.n_embd // c.n_head  # every base head is one differential head of dim d
    return 4 * c.n_embd * c.lowrank_rank + 4 * d + d  # q2 / k2 down (C x r) and up (r x C), lambdas, RMSNorm(d)


class MissingReference(KeyError):
    def __str__(self):  # KeyError's own quotes its message
        return self.args[0]


class References(Mapping):
    """attn_type -> its reference in this module, named `pattern` with the attn_type filled in, for every variant
    model.py registers (ATTENTION_TYPES, read at each use): a new variant is checked as soon as it is registered,
    and one without a reference is a one-line MissingReference naming the function to write."""

    def __init__(self, pattern, what):
        self.pattern, self.what = pattern, what

    def __getitem__(self, attn_type):
        name = self.pattern.format(attn_type)
        if not callable(globals().get(name)):
            raise MissingReference(f"no float64 reference for attn_type={attn_type!r}: write {name}(attn, x, "
                                   f"eps=None) ({self.what}) in tests/naive_attention.py")
        return globals()[name]

    def __iter__(self):
        from model import ATTENTION_TYPES  # the registry's names only: the references never run model.py's code
        return iter(list(ATTENTION_TYPES))

    def __len__(self):
        return len(list(iter(self)))


NAIVE = References("naive_{}", "the module's output after c_proj")
# attn_type -> (its effective map, V): the matrix that multiplies the values, per head
NAIVE_MAPS = References("{}_map", "its effective map and V")
# attn_type -> its parameters in one layer beyond base's, for a GPTConfig
PARAMETERS = References("{}_parameters", "its parameters in one layer beyond base's")


# ----------------------------------------------------------------------------- where attention goes

@torch.no_grad()
def naive_part_shares(model, idx, seed, queries, parts):
    """The means over `queries` of each part's share of the effective attention row, per layer and head and
    for each layer as a whole (by the norm of what each key adds to the layer's output), with explicit loops
    over keys in float64: eval.py --attention_noise's and --retrieval's measure from its definition.
    queries: [(row of idx, query position p, part(j) -> the part of key j <= p, 0 .. parts - 1)], part 0 the
    key a lookup reads, part 1 the key it matches, part 3 the query's own token. -> (layers, heads, parts + 5)
    and (layers, parts + 5): the parts' shares, parts 0 and 1 together, noise (every part but 0, 1 and 3), the
    signed shares of part 0, part 1 and the two together. The layer inputs come from the
    model's own blocks; NoiseFormer's noise is drawn after torch.manual_seed(seed), in the order
    denoised_gpt.evaluation.attention_inputs draws it (the layer's map, then the block's forward)."""
    from model import causal_randn
    torch.manual_seed(seed)
    cfg = model.config
    T = idx.size(1)
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T))
    per_layer, whole_layer = [], []

    def shares(weights, signed):  # [(part, |weight|)], [(part, signed weight)] -> the parts + 5 row
        out, sign = [0.0] * parts, [0.0] * parts
        for part, w in weights:
            out[part] += w
        for part, w in signed:
            sign[part] += w
        total = sum(out)
        return torch.tensor([*out, out[0] + out[1], sum(v for i, v in enumerate(out) if i not in (0, 1, 3)),
                             sign[0], sign[1], sign[0] + sign[1]], dtype=F64) / total
    for layer, block in enumerate(model.transformer.h):
        attn = block.attn
        eps, kwargs = None, {}
        if hasattr(attn, 'noise_mu'):
            eps = causal_randn((1, attn.noise_mu.numel(), T, T), dtype=F64)
        if hasattr(attn, 'lambda_q1'):
            kwargs['layer_index'] = layer
        if cfg.attn_type == 'dint_lowrank':
            kwargs['score_divisor'] = cfg.lowrank_score_divisor
        a, v = NAIVE_MAPS[cfg.attn_type](attn, block.ln_1(x), eps, **kwargs)
        heads = a.size(1)
        # the factor each head's output A V is multiplied by before c_proj: the differential heads' RMSNorm
        # and (1 - lambda_init), 1 for the others
        y = a @ v
        scale = torch.ones_like(y)
        if hasattr(attn, 'head_norm'):
            scale = (attn.head_norm.weight.double() / torch.sqrt((y * y).mean(-1, keepdim=True) + RMS_EPS)
                     * (1 - lambda_init_for(layer)))
        output = NAIVE[cfg.attn_type](attn, block.ln_1(x), eps, **kwargs)
        sums = torch.zeros(heads, parts + 5, dtype=F64)
        layer_sums = torch.zeros(parts + 5, dtype=F64)
        for row, p, part in queries:
            # what key j adds to the layer's output at p: c_proj (no bias) of the heads' scaled a_pj v_j
            adds = [attn.c_proj.weight.double() @ torch.cat([scale[row, h, p] * a[row, h, p, j] * v[row, h, j]
                                                             for h in range(heads)]) for j in range(p + 1)]
            bias = 0 if attn.c_proj.bias is None else attn.c_proj.bias.double()
            assert torch.allclose(sum(adds) + bias, output[row, p], rtol=1e-9, atol=1e-12)
            direction = sum(adds) / sum(adds).norm()
            layer_sums += shares([(part(j), float(u.norm())) for j, u in enumerate(adds)],
                                 [(part(j), float(u @ direction)) for j, u in enumerate(adds)])
            for h in range(heads):
                w = [float(a[row, h, p, j]) for j in range(p + 1)]
                sums[h] += shares([(part(j), abs(w[j])) for j in range(p + 1)], [(part(j), w[j]) for j in range(p + 1)])
        per_layer.append(sums / len(queries))
        whole_layer.append(layer_sums / len(queries))
        x = block(x)
    return torch.stack(per_layer), torch.stack(whole_layer)
