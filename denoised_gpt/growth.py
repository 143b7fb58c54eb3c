"""
The math behind grow.py: widening the query/key heads of a trained `base` model from d = qk_head_size
to d' = d + p. Read with docs/grow.md, which derives it.

Per layer and head, with X the layer input after ln_1 (T x C; with bias=True the column of ones is
appended, so the bias is the last row of each factor) and W_Q, W_K the head's (C x d) factors:

  S = X W_Q W_K^T X^T / sqrt(d)                     the scores before the causal mask
  B = sqrt(d) S - step_size * G                     G: d(sequence's summed token loss) / dS
  Z = mean over sequences of X^+ B (X^+)^T          least squares in each sequence, then averaged
  Z ~ U_d' S_d' V_d'^T (truncated SVD)              Eckart-Young: the best rank-d' product
  W_Q' = U S^(1/2) c,  W_K' = V S^(1/2) c,  c = (d'/d)^(1/4)

The new scores X W_Q' W_K'^T X^T / sqrt(d') = X Z_d' X^T / sqrt(d): the c^2 = sqrt(d'/d) folded into
the factors cancels the change of the score scale from 1/sqrt(d) to 1/sqrt(d'). The sign of the step
is a descent step (S moves to S - step_size * G); B = G + sqrt(d) S, read literally, is step_size = -1.

Baselines: 'zero' appends zero columns and 'random' columns drawn at init scale (N(0, 0.02^2)); both
keep the old columns and fold the whole sqrt(d'/d) into the query side, which is exact (a power of
two) when d'/d is a power of 4, so 'zero' then leaves the model's outputs bit-identical.
"""

import math

import torch
import torch.nn.functional as F

from model import CausalSelfAttention, causal_mask

METHODS = ('closed_form', 'random', 'zero')


# ----------------------------------------------------------------------------------------------
# Scores and their gradient, through an explicit forward pass (analysis only: training never uses it)

def explicit_forward(model, idx, targets, on_scores):
    """model(idx, targets)'s mean cross-entropy, but with each layer's (B, H, T, T) score matrix built
    explicitly (SDPA never shows it) and handed to on_scores(layer, x, scores) with x the layer's
    input after ln_1. Call in eval mode: attention dropout is not modelled here."""
    tr = model.transformer
    T = idx.size(1)
    x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(T, device=idx.device)))
    mask = causal_mask(T, T, idx.device)
    for layer, block in enumerate(tr.h):
        h = block.ln_1(x)
        q, k, v = block.attn.queries_keys_values(h)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
        on_scores(layer, h, scores)
        att = torch.softmax(scores.masked_fill(~mask, float('-inf')), dim=-1)
        x = x + block.attn.output(att @ v)
        x = x + block.mlp(block.ln_2(x))
    logits = model.lm_head(tr.ln_f(x))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def score_gradients(model, idx, targets, on_gradient):
    """Forward and backward through explicit_forward. A hook on every layer's score tensor calls
    on_gradient(layer, x, scores, grad) as soon as backward reaches it, with grad = d(mean loss) /
    d(scores) and everything detached. No parameter's .grad is touched. Returns the loss (a float)."""
    kept = []

    def keep(layer, x, scores):
        x = x.detach()
        scores.register_hook(lambda grad: on_gradient(layer, x, scores.detach(), grad.detach()))
        kept.append(scores)

    with torch.enable_grad():
        loss = explicit_forward(model, idx, targets, keep)
        torch.autograd.grad(loss, kept)  # gradients w.r.t. the scores only; the hooks see each one
    return loss.item()


# ----------------------------------------------------------------------------------------------
# The closed form

def with_ones(x, bias):
    """(..., T, C) -> (..., T, C + 1) with a column of ones when the model has biases."""
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1) if bias else x


def least_squares_product(X, B, rtol=None):
    """Z = X^+ B (X^+)^T, the minimum-norm minimiser of ||B - X Z X^T||_F, for (..., T, n) X and
    (..., T, T) B (batched). rtol: pinv's cutoff for small singular values of X."""
    P = torch.linalg.pinv(X, rtol=rtol) if rtol is not None else torch.linalg.pinv(X)
    return P @ B @ P.transpose(-1, -2)


def truncated_factors(Z, rank):
    """(n, n) Z -> (U_r S_r^(1/2), V_r S_r^(1/2)), both (n, rank): the best rank-r factorisation
    (Eckart-Young; the residual ||Z - U_r S_r V_r^T||_F^2 is the sum of the discarded sigma_i^2)."""
    U, S, Vh = torch.linalg.svd(Z)
    root = S[:rank].sqrt()
    return U[:, :rank] * root, Vh[:rank].transpose(0, 1) * root


def head_factors(attn):
    """A base layer's query and key factors per head, (H, n, d) each, float64; n = C (+1 for the bias
    row). Head h's queries are X~ @ wq[h] with X~ = with_ones(X)."""
    assert isinstance(attn, CausalSelfAttention)
    H, d, w = attn.n_head, attn.qk_head_size, attn.qk_width
    weight = attn.c_attn.weight.detach().double()  # (2 w + C, C): rows are output features
    if attn.c_attn.bias is not None:
        weight = torch.cat([weight, attn.c_attn.bias.detach().double()[:, None]], dim=1)
    wq, wk = weight[:w], weight[w:2 * w]
    return (wq.view(H, d, -1).transpose(1, 2).contiguous(), wk.view(H, d, -1).transpose(1, 2).contiguous())


def layer_state(attn_prefix, state_dict, wq, wk):
    """Write per-head factors wq, wk (H, n, d') back into a copy of the layer's c_attn tensors in
    state_dict (values unchanged); returns {name: tensor} for the grown model."""
    weight = state_dict[attn_prefix + 'c_attn.weight']
    C = weight.size(1)
    H, n, d_new = wq.shape
    rows = torch.cat([f.transpose(1, 2).reshape(H * d_new, n) for f in (wq, wk)])  # (2 H d', n)
    out = {attn_prefix + 'c_attn.weight': torch.cat([rows[:, :C].to(weight.dtype), weight[-C:]])}
    bias_name = attn_prefix + 'c_attn.bias'
    if bias_name in state_dict:
        bias = state_dict[bias_name]
        out[bias_name] = torch.cat([rows[:, C].to(bias.dtype), bias[-C:]])
    return out


def widen_baseline(wq, wk, d_new, method, bias, generator=None, init_std=0.02):
    """'zero' / 'random': keep the old columns, append d_new - d new ones (zeros, or N(0, init_std^2)
    on the weight rows and zero on the bias row), and fold sqrt(d_new / d) into the queries."""
    H, n, d = wq.shape
    new = [torch.zeros(H, n, d_new - d, dtype=wq.dtype) for _ in range(2)]
    if method == 'random':
        rows = n - 1 if bias else n  # new biases start at zero, as GPT._init_weights does
        for t in new:
            t[:, :rows] = torch.randn(H, rows, d_new - d, generator=generator, dtype=t.dtype) * init_std
    return torch.cat([wq * math.sqrt(d_new / d), new[0]], dim=2), torch.cat([wk, new[1]], dim=2)


def closed_form_factors(Z, d_old, d_new):
    """Per head (H, n, n) averaged Z -> factors (H, n, d_new) with the scale change folded in."""
    c = (d_new / d_old) ** 0.25
    pairs = [truncated_factors(z, d_new) for z in Z]
    return (torch.stack([p[0] for p in pairs]) * c, torch.stack([p[1] for p in pairs]) * c)


class GrowthStatistics:
    """What one layer accumulates over the collection batches (float64):
    Z  sum over sequences of X^+ B (X^+)^T per head (divided by `sequences` at the end)
    Y  sum over batches of sum_i X_i^T G_i X_i per head: d(mean loss) / d(W_Q W_K^T / sqrt(d)), for
       the first-order predicted change of the loss, <Y, new product - old product> / batches."""

    def __init__(self, n_head, n, d, bias, step_size, rtol, need_z=True):
        self.Z = torch.zeros(n_head, n, n, dtype=torch.float64) if need_z else None  # the baselines skip it
        self.Y = torch.zeros(n_head, n, n, dtype=torch.float64)
        self.sequences = self.batches = 0
        self.d, self.bias, self.step_size, self.rtol = d, bias, step_size, rtol

    def add(self, x, scores, grad):
        """x (B, T, C), scores and grad (B, H, T, T) of one batch (grad of the batch's mean loss)."""
        X = with_ones(x.double(), self.bias).cpu()
        S, G = scores.double().cpu(), grad.double().cpu()
        Bsz, T = x.shape[:2]
        G_sum = G * (Bsz * T)  # d(each sequence's summed token loss) / dS
        target = math.sqrt(self.d) * S - self.step_size * G_sum  # B
        if self.Z is not None:
            self.Z += least_squares_product(X[:, None], target, self.rtol).sum(0)
        self.Y += (X[:, None].transpose(-1, -2) @ G @ X[:, None]).sum(0)
        self.sequences += Bsz
        self.batches += 1


# ----------------------------------------------------------------------------------------------
# A whole model

def collect_statistics(model, xy_batches, chosen, method, step_size, rtol=None):
    """GrowthStatistics of every layer over the (x, y) batches (Z only where closed_form grows the
    layer), and the mean loss over the batches. `model` in eval mode, float32 or float64."""
    cfg = model.config
    n = cfg.n_embd + (1 if cfg.bias else 0)
    d = model.transformer.h[0].attn.qk_head_size
    stats = [GrowthStatistics(cfg.n_head, n, d, cfg.bias, step_size, rtol, need_z=method == 'closed_form' and l in chosen)
             for l in range(cfg.n_layer)]
    losses = [score_gradients(model, x, y, lambda layer, *t: stats[layer].add(*t)) for x, y in xy_batches]
    return stats, sum(losses) / len(losses)


def grown_state_dict(model, d_new, method, chosen, stats=None, generator=None):
    """The state_dict of `model` (a CPU base GPT) grown to qk_head_size d_new: layers in `chosen` by
    `method`, the others by 'zero' (the model has one qk_head_size). Returns it and the first-order
    predicted change of the mean loss over the collection batches (None without stats)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    predicted = 0.0 if stats is not None else None
    for l, block in enumerate(model.transformer.h):
        d_old = block.attn.qk_head_size
        wq, wk = head_factors(block.attn)
        if l in chosen and method == 'closed_form':
            new_q, new_k = closed_form_factors(stats[l].Z / stats[l].sequences, d_old, d_new)
        else:
            new_q, new_k = widen_baseline(wq, wk, d_new, method if l in chosen else 'zero', model.config.bias,
                                          generator)
        if stats is not None:  # <dL/dN, N' - N>, N = W_Q W_K^T / sqrt(d) the product the scores see
            change = new_q @ new_k.transpose(1, 2) / math.sqrt(d_new) - wq @ wk.transpose(1, 2) / math.sqrt(d_old)
            predicted += (stats[l].Y / stats[l].batches * change).sum().item()
        state.update(layer_state(f'transformer.h.{l}.attn.', state, new_q, new_k))
    return state, predicted
