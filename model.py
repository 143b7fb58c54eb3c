"""
A GPT language model whose attention is chosen by `GPTConfig.attn_type`, in one file.

Read top to bottom: the config; what every attention variant shares (AttentionBase, the decoding cache); each
variant with the kernels only it uses; the registry mapping `attn_type` to a class; MLP, Block and GPT, which are
nanoGPT's; last the causal SDPA calls the variants share. GPT's fused lm_head + cross-entropy loss is fused_loss.py.
A variant is one AttentionBase subclass and one registry line (the checklist: docs/attention.md, Adding a
variant). Equations and design decisions: docs/attention.md.

References:
1) nanoGPT: https://github.com/karpathy/nanoGPT/blob/master/model.py
2) Symmetric dot-product attention: Courtois et al., arXiv:2406.06366
3) NoiseFormer: Nyshadham, Polisetty, Rathore, arXiv:2601.11619
4) Differential Transformer: Ye et al., arXiv:2410.05258 (microsoft/unilm Diff-Transformer)
5) DINT Transformer: Cang et al., arXiv:2501.17486
6) Linear attention: Katharopoulos et al., "Transformers are RNNs", ICML 2020
"""

import difflib
import inspect
import math
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.nn import functional as F

try:  # beside this file; in an exported Hugging Face folder both are modules of one package
    from .fused_loss import lm_head_cross_entropy
except ImportError:
    from fused_loss import lm_head_cross_entropy


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # bias in Linears and LayerNorms, like GPT-2
    attn_type: str = 'base'  # a key of ATTENTION_TYPES (below)
    # The variants' own settings, each read by the classes whose config_fields name it. The comment on a field's
    # line is its meaning in train.py's and bench.py's --help, which take these fields as settings.
    qk_head_size: int = None  # base / symmetric: query/key head size (None: n_embd // n_head); grow.py widens it
    noise_init_std: float = 0.01  # noiseformer: mu, sigma ~ noise_init_std * N(0, 1) (the paper's noise factor)
    noise_per_sample: bool = False  # noiseformer: one noise draw per sequence instead of one shared by the batch
    noise_param: str = 'sigma'  # noiseformer: learn 'sigma' directly, or 'logvar' = log(sigma^2)
    noise_at_eval: bool = True  # noiseformer: keep the noise on in evaluation and sampling (as the paper)
    noise_kernel: str = 'sdpa'  # noiseformer: 'sdpa' (the noise as SDPA's mask) or 'triton' (drawn in one kernel, CUDA)
    lowrank_rank: int = 32  # dint_lowrank: rank r of the second branch's query/key factors
    lowrank_score_divisor: float = 81.0  # dint_lowrank: the branch-2 scores are multiplied by sqrt(81 / d)
    linear_chunk_size: int = 64  # linear: tokens per chunk of the chunked causal linear attention

    def __post_init__(self):
        if self.attn_type not in ATTENTION_TYPES:
            close = difflib.get_close_matches(str(self.attn_type), ATTENTION_TYPES, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"GPTConfig.attn_type={self.attn_type!r} is not a known attention variant; "
                             f"valid values: {', '.join(ATTENTION_TYPES)}.{hint}")
        if self.n_head < 1 or self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                             f"(the head size is n_embd / n_head)")
        # A variant's field set on a variant that ignores it (noise settings copied into a diff run), and values
        # that cannot build or train a model, are refused in one line, not ignored or met deep in a layer.
        attn_cls = ATTENTION_TYPES[self.attn_type]
        for f in fields(self):
            value = getattr(self, f.name)
            users = [name for name, cls in ATTENTION_TYPES.items() if f.name in cls.config_fields]
            if users and f.name not in attn_cls.config_fields and value != f.default:
                raise ValueError(f"GPTConfig.{f.name}={value!r} is only used by attn_type {' / '.join(users)}, "
                                 f"but attn_type={self.attn_type!r}; remove {f.name} or change attn_type")
            if f.type is float and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"GPTConfig.{f.name}={value!r} must be a finite number")
        for name in ('block_size', 'vocab_size', 'n_layer', 'n_embd'):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be at least 1")
        if self.n_layer > 10_000:  # built a layer at a time: a count past any model would run for hours, not fail
            raise ValueError(f"GPTConfig.n_layer={self.n_layer} is over 10,000 layers (GPT-3 has 96): building them "
                             f"would run for hours or exhaust memory; choose fewer")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1) (a probability)")
        attn_cls.check_config(self)
        if self.qk_head_size is not None and (type(self.qk_head_size) is not int or self.qk_head_size < 1):
            raise ValueError(f"GPTConfig.qk_head_size={self.qk_head_size!r} must be a positive int, or None "
                             f"for n_embd // n_head")


# ----------------------------------------------------------------------------------------------
# Attention: what every variant shares

class KVCache:
    """Decoding state for GPT.generate: one dict per layer, filled by that layer's attention."""

    def __init__(self, n_layer):
        self.layers = [{} for _ in range(n_layer)]
        self.length = 0  # tokens already processed = absolute position of the next token


class AttentionBase(nn.Module):
    """What every variant has: head bookkeeping, the input projection c_attn, the output projection c_proj and
    dropout; forward(x, cache=None) -> (B, T, C). A variant declares the GPTConfig fields it reads (config_fields;
    runtime_fields: those a resumed run may change), how many n_embd-wide projections c_attn computes and how many
    of them are queries / keys of qk_head_size per head, and may refuse a config (check_config). The rest of the
    project asks the class, never its name: each hook below has the default of a variant that needs nothing there.

    Precision: in bf16 / fp16 a variant always runs under autocast (train.py, bench.py, eval.py, and sample.py,
    which holds the Linear, Embedding and LayerNorm weights in that dtype), and its own parameters stay float32.
    So a variant may use its parameters in any op autocast covers (a matmul); elsewhere it upcasts the
    activations it combines them with, as DIFF's lambda and NoiseFormer's sigma are used here."""
    config_fields = runtime_fields = ()  # runtime: how it runs, not what its weights mean (changeable on resume)
    c_attn_projections = 3  # q, k, v
    qk_projections = 0  # of them, queries / keys qk_head_size wide per head (base 2, symmetric 1)
    # (x) -> (q, k, scale or None for 1/sqrt(d), additive score bias or None) where the attention is
    # softmax(q k^T * scale + bias + M) V: attention_maps and bench.py's memory plan then follow from it
    score_inputs = None

    @classmethod
    def check_config(cls, config):
        pass

    def __init__(self, config, layer_idx):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_size = config.n_embd // config.n_head
        # queries and keys may be wider than values (qk_head_size); the scores' scale follows them
        self.qk_head_size = config.qk_head_size or self.head_size
        self.qk_width = config.n_head * self.qk_head_size
        self.dropout = config.dropout
        # c_attn before c_proj, as nanoGPT: optimizers store their state by parameter position, so only this
        # order lets nanoGPT resume a base checkpoint of ours, and gives nanoGPT's initial weights
        c_attn_width = (self.qk_projections * self.qk_width
                        + (self.c_attn_projections - self.qk_projections) * config.n_embd)
        self.c_attn = nn.Linear(config.n_embd, c_attn_width, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def output(self, y):
        """(B, heads, T, hs) -> residual-stream update (B, T, C)."""
        return self.resid_dropout(self.c_proj(merge_heads(y)))

    @property
    def attn_dropout_p(self):
        return self.dropout if self.training else 0.0

    def learned_values(self):
        """What this variant learns beyond weights, for the training logs: {name: [floats]}."""
        return {}

    def kl_parameters(self):
        """The parameters kl_divergence reads; none: the variant adds no KL term to the loss."""
        return []

    def kl_divergence(self):
        """This layer's KL term (0-dim tensor) in the loss ce + kl_weight * KL, if kl_parameters names any."""
        return None

    @classmethod
    def softmax_of_scores(cls):
        """Whether forward is the softmax of score_inputs: defined no higher in the class tree than forward (a
        subclass that rewrites forward alone, into ReLU weights say, computes something else)."""
        def owner(name):
            return next(c for c in cls.__mro__ if name in vars(c))
        return cls.score_inputs is not None and issubclass(owner('score_inputs'), owner('forward'))

    def attention_maps(self, x):
        """Analysis only (eval.py --entropy, --attention_noise): {name: (B, heads, T, T) weights that multiply
        V} for the layer input x (after ln_1); by default the causal softmax of score_inputs."""
        if not self.softmax_of_scores():
            raise NotImplementedError(f"{type(self).__name__} has no attention_maps: define them in model.py (the "
                                      f"weights that multiply V), or score_inputs if forward is their softmax")
        q, k, scale, bias = self.score_inputs(x)
        return {'attn': causal_softmax_map(q, k, scale, bias)}

    def value_heads(self, x):
        """Analysis only: V (c_attn's last projection) split into the heads of the maps, (B, heads, T, size)."""
        return split_heads(self.c_attn(x)[..., -self.n_embd:], self.n_head)

    def head_output_scale(self, y):
        """Analysis only: the factor forward multiplies a head's output y = A V by before c_proj (none here)."""
        return torch.ones_like(y)


# ----------------------------------------------------------------------------------------------
# base and symmetric

class CausalSelfAttention(AttentionBase):
    """base: standard causal attention, nanoGPT's parameter names, shapes and order. With qk_head_size set, q
    and k are n_head * qk_head_size wide and SDPA's default scale is 1/sqrt(qk_head_size)."""
    config_fields = ('qk_head_size',)
    qk_projections = 2

    def queries_keys_values(self, x):
        """(B, T, C) -> q, k (B, H, T, qk_head_size) and v (B, H, T, head_size)."""
        qkv = self.c_attn(x).split((self.qk_width, self.qk_width, self.n_embd), dim=2)
        return (split_heads(t, self.n_head) for t in qkv)

    def forward(self, x, cache=None):
        q, k, v = self.queries_keys_values(x)
        k, v = append_to_cache(cache, k=k, v=v)
        return self.output(causal_attention(q, k, v, self.attn_dropout_p))

    def score_inputs(self, x):
        q, k, _ = self.queries_keys_values(x)
        return q, k, None, None


class SymmetricAttention(AttentionBase):
    """symmetric: K := Q, so the scores Q Q^T / sqrt(d) are symmetric and there is no key projection.
    qk_head_size widens q (d = qk_head_size) as in base; NoiseFormer does not take it."""
    config_fields = ('qk_head_size',)
    c_attn_projections = 2  # q, v
    qk_projections = 1

    def queries_values(self, x):
        return (split_heads(t, self.n_head) for t in self.c_attn(x).split((self.qk_width, self.n_embd), dim=2))

    def score_bias(self, batch_size, t_q, t_k, like):
        return None  # NoiseFormer adds its noise here

    def attend(self, q, k, v, batch_size):
        return causal_attention(q, k, v, self.attn_dropout_p)

    def forward(self, x, cache=None):
        q, v = self.queries_values(x)
        k, v = append_to_cache(cache, k=q, v=v)
        return self.output(self.attend(q, k, v, x.size(0)))

    def score_inputs(self, x):
        q, _ = self.queries_values(x)
        # NoiseFormer: a fresh noise draw, on or off exactly as in forward (training / noise_at_eval)
        return q, q, None, self.score_bias(x.size(0), q.size(-2), q.size(-2), like=q)


# ----------------------------------------------------------------------------------------------
# NoiseFormer

class NoiseFormerAttention(SymmetricAttention):
    """Symmetric scores plus learned Gaussian noise: S = Q Q^T / sqrt(d) + mu + sigma * eps, eps ~ N(0, 1)
    drawn at every forward pass (reparameterisation trick), (1 or B, noise heads, T, T), one draw per layer.
    Softmax is shift-invariant along a row, so mu never changes the output (dCE/dmu = 0 up to rounding; only
    the KL term moves it): sigma is what matters."""
    config_fields = ('noise_init_std', 'noise_per_sample', 'noise_param', 'noise_at_eval', 'noise_kernel')
    runtime_fields = ('noise_at_eval', 'noise_kernel')
    noise_heads = None  # 1: one (mu, sigma) per layer (v1); None: one per head (v2)
    materialise_noise = False  # True: the noise as a differentiable (B, H, T, T) mask, the slow reference path

    @classmethod
    def check_config(cls, config):
        if config.noise_param not in ('sigma', 'logvar'):
            raise ValueError(f"GPTConfig.noise_param={config.noise_param!r} must be 'sigma' or 'logvar'")
        if config.noise_init_std < 0:
            raise ValueError(f"GPTConfig.noise_init_std={config.noise_init_std} must not be negative (it is a "
                             f"standard deviation; 0 starts the noise at zero)")
        if config.noise_kernel not in ('sdpa', 'triton'):
            raise ValueError(f"GPTConfig.noise_kernel={config.noise_kernel!r} must be 'sdpa' (the noise as SDPA's "
                             f"mask) or 'triton' (drawn inside one Triton kernel)")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        n = self.noise_heads or config.n_head
        self.noise_per_sample = config.noise_per_sample
        self.noise_at_eval = config.noise_at_eval
        self.noise_param = config.noise_param
        # the Triton kernel where it can run (training and prefill without attention dropout), else SDPA's path
        self.fused = config.noise_kernel == 'triton' and load_noise_kernel(config.dropout)
        self.noise_mu = nn.Parameter(config.noise_init_std * torch.randn(n))
        sigma = config.noise_init_std * torch.randn(n)
        if self.noise_param == 'sigma':
            self.noise_sigma = nn.Parameter(sigma)
        else:  # same initial distribution, learned as log(sigma^2)
            self.noise_logvar = nn.Parameter(torch.log(sigma.square().clamp_min(1e-30)))

    def sigma(self):
        return self.noise_sigma if self.noise_param == 'sigma' else torch.exp(0.5 * self.noise_logvar)

    def log_variance(self):
        if self.noise_param == 'logvar':
            return self.noise_logvar
        return torch.log(self.noise_sigma.square().clamp_min(1e-30))  # guard sigma = 0

    def learned_values(self):
        return {'sigma': self.sigma().tolist(), 'mu': self.noise_mu.tolist()}

    def kl_parameters(self):
        return [self.noise_mu, self.noise_sigma if self.noise_param == 'sigma' else self.noise_logvar]

    def kl_divergence(self):
        """sum over this layer's distributions of KL(N(mu, sigma^2) || N(0, 1))."""
        return 0.5 * (self.noise_mu.square() + self.log_variance().exp() - self.log_variance() - 1).sum()

    def draw_noise(self, batch_size, t_q, t_k, like):
        """eps ~ N(0, 1) of shape (1 or B, noise heads, t_q, t_k), or None when the noise is off."""
        if not (self.training or self.noise_at_eval):
            return None  # exactly symmetric attention
        shape = (batch_size if self.noise_per_sample else 1, self.noise_mu.numel(), t_q, t_k)
        draw = causal_randn if t_q == t_k else torch.randn  # t_q < t_k: decoding, a few rows
        return draw(shape, device=like.device, dtype=like.dtype)

    def score_bias(self, batch_size, t_q, t_k, like):
        eps = self.draw_noise(batch_size, t_q, t_k, like)
        if eps is None:
            return None
        n = self.noise_mu.numel()
        return self.noise_mu.view(1, n, 1, 1) + self.sigma().view(1, n, 1, 1) * eps

    def attend(self, q, k, v, batch_size):
        noisy = self.training or self.noise_at_eval
        if noisy and self.fused and self.attn_dropout_p == 0 and q.size(-2) == k.size(-2) \
                and _noise_kernel.runs_on(q, v):  # k is q: the kernel reads q twice
            return _noise_kernel.noise_attention(q, v, self.noise_mu, self.sigma(), self.noise_per_sample)
        eps = self.draw_noise(batch_size, q.size(-2), k.size(-2), like=q)
        if eps is None:
            return causal_attention(q, k, v, self.attn_dropout_p)
        return causal_attention_learned_noise(q, k, v, self.noise_mu, self.sigma(), eps, self.attn_dropout_p,
                                              materialise=self.materialise_noise)


class NoiseFormerV1Attention(NoiseFormerAttention):
    """noiseformer_v1: one (mu, sigma) pair per layer and one eps shared by all heads."""
    noise_heads = 1


class NoiseFormerV2Attention(NoiseFormerAttention):
    """noiseformer_v2: one (mu, sigma) pair per head and a different eps draw per head (noise_heads = n_head)."""


# The fused kernel (denoised_gpt/noise_kernel.py, Triton): the noise drawn from a seed inside the attention kernel
# and again in its backward, nothing T x T in memory. Optional: without triton, or where it cannot run (that module
# says why, once), the SDPA path below.

_noise_kernel = None  # the module once imported, False where it cannot be


def load_noise_kernel(dropout):
    """Whether denoised_gpt.noise_kernel can be imported for noise_kernel='triton' (where not: said once)."""
    global _noise_kernel
    if _noise_kernel is None:
        try:
            from denoised_gpt import noise_kernel as module
        except ImportError as e:  # no triton (or model.py copied without its package: an exported folder)
            warnings.warn(f"noise_kernel='triton': {e}; NoiseFormer uses its SDPA path (pip install triton, on CUDA)")
            module = False
        _noise_kernel = module
    if _noise_kernel:
        _noise_kernel.note_dropout(dropout)
    return bool(_noise_kernel)


# Why NoiseFormer has kernels of its own: as a float mask that requires grad, the noise sends SDPA to its math
# path (3.4x base's step at block 1024 on CPU), and drawing it was a third of the rest of its overhead.

def causal_randn(shape, device=None, dtype=None):
    """N(0, 1) draws of shape (..., T, T) for scores under a causal mask, at half torch.randn's cost: only the
    first h = ceil(T / 2) columns are drawn; the bottom-right (T - h) x (T - h) block is the top-left one
    transposed (its strict lower triangle is the top-left's hidden upper one) with a diagonal of its own.
    Every visible entry is a different draw; the hidden top-right block is 0."""
    T = shape[-1]
    h, m = (T + 1) // 2, T // 2
    # one draw for both parts: with a second, in-place draw on a view, torch.compile drew other numbers
    draws = torch.randn(*shape[:-2], T * h + m, device=device, dtype=dtype)
    left, diagonal = draws[..., :T * h].unflatten(-1, (T, h)), draws[..., T * h:]
    eps = torch.empty(shape, device=device, dtype=dtype)
    eps[..., :h].copy_(left)
    eps[..., :h, h:].zero_()
    eps[..., h:, h:].copy_(left[..., :m, :m].transpose(-1, -2))
    eps[..., h:, h:].diagonal(dim1=-2, dim2=-1).copy_(diagonal)
    return eps


def causal_attention_learned_noise(q, k, v, mu, sigma, eps, dropout_p=0.0, materialise=False):
    """softmax(q k^T / sqrt(d) + mu + sigma * eps + M) v, eps a fixed N(0, 1) draw broadcasting to (B, H, t_q,
    t_k), mu and sigma one value per noise head (1 or H). From the noise the loss needs one number per noise
    head, dL/dsigma = sum(dS * eps) (dL/dmu = sum(dS) = 0), so the fused kernel runs with the noise as a
    constant mask and NoiseScoreGradient adds dsigma. The reference path (materialise) is kept with attention
    dropout, whose dropped entries the chunks cannot know, and without gradients (a fused kernel there too)."""
    n = mu.numel()
    mu, sigma = mu.view(1, n, 1, 1), sigma.view(1, n, 1, 1)
    needs_noise_grad = torch.is_grad_enabled() and (mu.requires_grad or sigma.requires_grad)
    if materialise or dropout_p > 0 or not needs_noise_grad:
        return causal_attention(q, k, v, dropout_p, score_bias=mu + sigma * eps)
    with torch.no_grad():
        # mu is left out: a constant added to a whole row does not change its softmax. sigma is cast to eps's
        # dtype (bf16 under autocast: a 0.2% scale error at most, the mask is rounded to bf16 anyway) so that
        # building the mask is one pass, not a float32 detour.
        mask = eps.to(q.dtype) * sigma.to(q.dtype)
        mask.masked_fill_(~causal_mask(q.size(-2), k.size(-2), q.device), float('-inf'))
    o = sdpa(q, k, v, attn_mask=mask)
    return NoiseScoreGradient.apply(o, mu, sigma, q.detach(), k.detach(), v.detach(), mask, eps)


NOISE_GRADIENT_ROWS = 128  # queries per chunk of NoiseScoreGradient: a few (B, H, 128, T) fp32 tensors


class NoiseScoreGradient(torch.autograd.Function):
    """Identity on the attention output o; its backward adds the gradients of mu and sigma that the constant
    noise mask hides from autograd. With P = softmax(S) and dO the output's gradient, dS_ij = P_ij (dO_i . v_j
    - D_i), D_i = dO_i . o_i, so with W = P * eps, dL/dsigma = sum_i dO_i . (W v)_i - D_i sum_j W_ij: W built
    for NOISE_GRADIENT_ROWS queries at a time over the keys they see, in float32 at least. dL/dmu is 0."""
    @staticmethod
    def forward(ctx, o, mu, sigma, q, k, v, mask, eps):
        ctx.save_for_backward(o, q, k, v, mask, eps)  # the fused kernel keeps all but eps anyway
        ctx.noise_heads = mu.numel()
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad_o):
        o, q, k, v, mask, eps = ctx.saved_tensors
        t_q, t_k = q.size(-2), k.size(-2)
        d_o = upcast(grad_o)
        q_scaled = q * (1.0 / math.sqrt(q.size(-1)))  # SDPA's default scale
        D = (d_o * upcast(o)).sum(-1)  # (B, H, t_q)
        d_sigma = torch.zeros(q.size(1), dtype=d_o.dtype, device=q.device)  # per attention head
        for r0 in range(0, t_q, NOISE_GRADIENT_ROWS):
            r1 = min(r0 + NOISE_GRADIENT_ROWS, t_q)
            seen = t_k - t_q + r1  # keys beyond this are masked for every query of the chunk
            scores = upcast(q_scaled[..., r0:r1, :] @ k[..., :seen, :].transpose(-1, -2))
            w = torch.softmax(scores.add_(mask[..., r0:r1, :seen]), dim=-1).mul_(eps[..., r0:r1, :seen])
            w_v = w @ upcast(v[..., :seen, :])
            d_sigma += (d_o[..., r0:r1, :] * w_v).sum(dim=(0, 2, 3))
            d_sigma -= (D[..., r0:r1] * w.sum(-1)).sum(dim=(0, 2))
        n = ctx.noise_heads  # noiseformer_v1: one (mu, sigma) for all heads
        d_sigma = d_sigma.view(n, -1).sum(1).view(1, n, 1, 1)
        return grad_o, torch.zeros_like(d_sigma), d_sigma, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# DIFF, DINT and low-rank DINT

class TwoBranchAttention(AttentionBase):
    """What diff, dint and dint_lowrank share: two softmax branches A1, A2 over the same values, the
    re-parameterised lambda, a per-head RMSNorm and the (1 - lambda_init) output scale. Subclasses give the
    branch outputs O1 = A1 V, O2 = A2 V (`branches`, never building A1, A2) and how they combine (`combine`)."""
    heads_per_diff_head = 2  # diff/dint: q/k heads 2h and 2h+1 form differential head h

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        d = self.head_size
        self.n_diff_heads = config.n_head // self.heads_per_diff_head
        self.value_size = config.n_embd // self.n_diff_heads
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)  # layer_idx is 0-based
        self.lambda_q1 = nn.Parameter(torch.randn(d) * 0.1)
        self.lambda_k1 = nn.Parameter(torch.randn(d) * 0.1)
        self.lambda_q2 = nn.Parameter(torch.randn(d) * 0.1)
        self.lambda_k2 = nn.Parameter(torch.randn(d) * 0.1)
        self.head_norm = nn.RMSNorm(self.value_size, eps=1e-5)  # one weight shared by all heads

    def lambda_full(self):
        return (torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
                - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2)) + self.lambda_init)

    def learned_values(self):
        return {'lambda': [self.lambda_full().item()]}

    def queries_keys_values(self, x):
        """q, k (B, n_head, T, d); v (B, n_diff_heads, T, value_size)."""
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        return split_heads(q, self.n_head), split_heads(k, self.n_head), split_heads(v, self.n_diff_heads)

    def branch_queries_keys(self, x):
        """((q1, k1, scale1), (q2, k2, scale2)) as branches() uses them; scale None = 1/sqrt(d)."""
        q, k, _ = self.queries_keys_values(x)
        return (q[:, 0::2], k[:, 0::2], None), (q[:, 1::2], k[:, 1::2], None)

    def branches(self, x, cache):
        q, k, v = self.queries_keys_values(x)  # heads 2h, 2h+1 -> branch 1, 2
        k, v = append_to_cache(cache, k=k, v=v)
        # both branches of differential head h read the same values: one attention over all 2H' heads
        o = causal_attention_wide_values(q, k, v.repeat_interleave(2, dim=1), self.attn_dropout_p)
        return o[:, 0::2], o[:, 1::2]

    def combine(self, o1, o2, lam, cache):
        return o1 - lam * o2

    def forward(self, x, cache=None):
        o1, o2 = self.branches(x, cache)
        # combine in float32 at least: O1 - lambda O2 cancels badly in bf16 when lambda is near 1
        y = self.combine(upcast(o1), upcast(o2), self.lambda_full(), cache)
        y = self.head_norm(y.to(self.head_norm.weight.dtype)) * (1 - self.lambda_init)
        return self.output(y.to(o1.dtype))

    def attention_maps(self, x):
        # combine() is linear in its inputs and works along the query axis, so combining the maps A1, A2 gives
        # the map that multiplies V: A1 - lambda A2 (diff), A1 + lambda (A3 - A2) (dint)
        (q1, k1, scale1), (q2, k2, scale2) = self.branch_queries_keys(x)
        a1, a2 = causal_softmax_map(q1, k1, scale1), causal_softmax_map(q2, k2, scale2)
        return {'branch1': a1, 'branch2': a2, 'combined': self.combine(a1, a2, upcast(self.lambda_full()), None)}

    def value_heads(self, x):
        return split_heads(self.c_attn(x)[..., -self.n_embd:], self.n_diff_heads)

    def head_output_scale(self, y):
        # head_norm(y) * (1 - lambda_init) as forward applies it: RMSNorm is y * weight / rms(y)
        norm = self.head_norm
        return norm.weight * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 - self.lambda_init)


class DiffAttention(TwoBranchAttention):
    """diff: O = (A1 - lambda A2) V; n_head ordinary heads pair up into n_head / 2 differential heads."""

    @classmethod
    def check_config(cls, config):
        if config.n_head % 2:
            raise ValueError(f"GPTConfig.n_head={config.n_head} must be even for attn_type="
                             f"{config.attn_type!r}: each differential head uses two heads")


# Why DIFF / DINT have a kernel of their own: SDPA's fused kernels need one head size for q, k and v, and their
# values are twice as wide, which sent SDPA to the math path (340 ms against 105 ms at block 1024 on CPU).

def causal_attention_wide_values(q, k, v, dropout_p=0.0):
    """causal_attention for values n times wider than q and k: one fused call per d-wide slice of the values on
    the same q and k, the outputs side by side (stacking the slices along the batch measured the same, but
    copies q and k). With attention dropout, separate calls would drop a score for one slice and keep it for
    another: there the one wide call keeps one mask."""
    d = q.size(-1)
    if v.size(-1) == d or dropout_p > 0:
        return causal_attention(q, k, v, dropout_p)
    return torch.cat([causal_attention(q, k, v_slice) for v_slice in v.split(d, dim=-1)], dim=-1)


class DintAttention(DiffAttention):
    """dint: O = (lambda A3 + A1 - lambda A2) V with the causal integral term A3[i] = mean over rows r <= i of
    A1[r], i.e. A3 V is the running mean over positions of A1 V."""

    def combine(self, o1, o2, lam, cache):
        return o1 + lam * (self.running_mean(o1, cache) - o2)

    @staticmethod
    def running_mean(o1, cache):
        past_sum, past_len = (cache['o1_sum'], cache['o1_len']) if cache and 'o1_sum' in cache else (0, 0)
        sums = past_sum + torch.cumsum(o1, dim=2)
        if cache is not None:
            cache['o1_sum'], cache['o1_len'] = sums[:, :, -1:], past_len + o1.size(2)
        counts = torch.arange(past_len + 1, past_len + o1.size(2) + 1, device=o1.device, dtype=o1.dtype)
        return sums / counts.view(-1, 1)


class LowRankDintAttention(DintAttention):
    """dint_lowrank: DINT whose second branch's queries and keys come from rank-r factors. Branch 1 (q1, k1) and
    v are exactly base's c_attn, each base head one differential head, so a pretrained `base` model loads
    unchanged (GPT.load_base_weights). A product of two factors has much smaller variance than a full matrix,
    so A2 uses the larger scale sqrt(lowrank_score_divisor) / sqrt(d)."""
    config_fields = ('lowrank_rank', 'lowrank_score_divisor')
    heads_per_diff_head = 1

    @classmethod
    def check_config(cls, config):
        if config.lowrank_rank < 1 or config.lowrank_score_divisor <= 0:
            raise ValueError(f"GPTConfig.lowrank_rank={config.lowrank_rank} and lowrank_score_divisor="
                             f"{config.lowrank_score_divisor} must both be positive")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        C, r = config.n_embd, config.lowrank_rank
        self.q2_down, self.q2_up = nn.Linear(C, r, bias=False), nn.Linear(r, C, bias=False)
        self.k2_down, self.k2_up = nn.Linear(C, r, bias=False), nn.Linear(r, C, bias=False)
        self.branch2_scale = math.sqrt(config.lowrank_score_divisor) / math.sqrt(self.head_size)

    def second_queries_keys(self, x):
        return (split_heads(self.q2_up(self.q2_down(x)), self.n_head),
                split_heads(self.k2_up(self.k2_down(x)), self.n_head))

    def branch_queries_keys(self, x):
        q1, k1, _ = self.queries_keys_values(x)
        q2, k2 = self.second_queries_keys(x)
        return (q1, k1, None), (q2, k2, self.branch2_scale)

    def branches(self, x, cache):
        q1, k1, v = self.queries_keys_values(x)
        q2, k2 = self.second_queries_keys(x)
        k1, k2, v = append_to_cache(cache, k1=k1, k2=k2, v=v)
        o1 = causal_attention(q1, k1, v, self.attn_dropout_p)
        o2 = causal_attention(q2, k2, v, self.attn_dropout_p, scale=self.branch2_scale)
        return o1, o2


# ----------------------------------------------------------------------------------------------
# Linear attention

class LinearAttention(AttentionBase):
    """linear: O_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps), S_i = sum_{j<=i} phi(k_j) v_j^T,
    z_i = sum_{j<=i} phi(k_j), phi = elu + 1. Training uses the chunked form; decoding carries (S, z)."""
    config_fields = runtime_fields = ('linear_chunk_size',)
    eps = 1e-6

    @classmethod
    def check_config(cls, config):
        if config.linear_chunk_size < 1:
            raise ValueError(f"GPTConfig.linear_chunk_size={config.linear_chunk_size} must be positive")

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)  # c_attn and c_proj exactly as base
        self.chunk_size = config.linear_chunk_size

    def features_values(self, x):
        """phi(q), phi(k), v in heads. phi before splitting: the same numbers, but elu's gradient on the
        transposed heads made torch.compile's backward fail ('view size is not compatible', torch 2.13)."""
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        return (split_heads(t, self.n_head) for t in (F.elu(q) + 1, F.elu(k) + 1, v))

    def forward(self, x, cache=None):
        q, k, v = (upcast(t) for t in self.features_values(x))  # accumulate in float32
        state = (cache['S'], cache['z']) if cache is not None and 'S' in cache else None
        y, S, z = chunked_linear_attention(q, k, v, self.chunk_size, self.eps, state)
        if cache is not None:
            cache['S'], cache['z'] = S, z
        return self.output(y.to(x.dtype))

    def attention_maps(self, x):
        # the map linear attention applies implicitly: A_ij = phi(q_i).phi(k_j) / (phi(q_i).z_i + eps)
        q, k, _ = (upcast(t) for t in self.features_values(x))
        scores = (q @ k.transpose(-1, -2)).tril()
        return {'attn': scores / (scores.sum(-1, keepdim=True) + self.eps)}


# Why chunked: the recurrent form is a Python loop over T and the quadratic one builds (T, T); chunks give prefix
# sums of k^T v between chunks and a small masked product within each.

def chunked_linear_attention(q, k, v, chunk, eps, state=None):
    """Causal linear attention on feature-mapped q, k (B, H, T, d) and v (B, H, T, e), `chunk` tokens at a
    time; state: (S, z) of earlier tokens (decoding). Returns (y, S, z), S and z after the last token."""
    B, H, T, d = q.shape
    pad = (-T) % chunk
    if pad:  # zero k, v rows contribute nothing (phi is applied before padding)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    n = (T + pad) // chunk
    q, k, v = (t.view(B, H, n, chunk, t.size(-1)) for t in (q, k, v))
    kv = k.transpose(-1, -2) @ v  # (B, H, n, d, e): each chunk's sum of k_j v_j^T
    kz = k.sum(dim=-2)  # (B, H, n, d)
    S_before = torch.cumsum(kv, dim=2) - kv  # exclusive prefix sums: everything before the chunk
    z_before = torch.cumsum(kz, dim=2) - kz
    if state is not None:
        S_before = S_before + state[0].unsqueeze(2)
        z_before = z_before + state[1].unsqueeze(2)
    scores = (q @ k.transpose(-1, -2)).tril()  # (B, H, n, c, c), within-chunk causal
    num = q @ S_before + scores @ v
    den = (q @ z_before.unsqueeze(-1)).squeeze(-1) + scores.sum(-1)
    y = (num / (den + eps).unsqueeze(-1)).view(B, H, n * chunk, -1)[:, :, :T]
    return y, S_before[:, :, -1] + kv[:, :, -1], z_before[:, :, -1] + kz[:, :, -1]


# attn_type -> class. The only place a variant is chosen; GPTConfig validates against it.
ATTENTION_TYPES = {
    'base': CausalSelfAttention,
    'symmetric': SymmetricAttention,
    'noiseformer_v1': NoiseFormerV1Attention,
    'noiseformer_v2': NoiseFormerV2Attention,
    'diff': DiffAttention,
    'dint': DintAttention,
    'dint_lowrank': LowRankDintAttention,
    'linear': LinearAttention,
}


# ----------------------------------------------------------------------------------------------
# The rest of the transformer: nanoGPT's

class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = ATTENTION_TYPES[config.attn_type](config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # True: in training each block's forward runs again in the backward instead of keeping its activations
        # (train.py's activation_checkpointing); the rerun restores the RNG state, so noise and dropout repeat
        self.activation_checkpointing = False
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # init all weights, then the GPT-2 paper's scaled init of the residual projections; variant parameters
        # (noise, lambda, norms) initialise themselves in their module
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        """Number of parameters; by default the position embeddings are not counted (nanoGPT). The token
        embeddings are counted: they are tied to lm_head, which does compute."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, kv_cache=None, return_logits=True):
        b, t = idx.size()
        start = kv_cache.length if kv_cache is not None else 0
        if start + t > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {start + t}: block_size is "
                             f"{self.config.block_size}")
        pos = torch.arange(start, start + t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        caches = kv_cache.layers if kv_cache is not None else [None] * self.config.n_layer
        recompute = self.activation_checkpointing and self.training and kv_cache is None and torch.is_grad_enabled()
        for block, cache in zip(self.transformer.h, caches):
            if recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache)
        x = self.transformer.ln_f(x)
        if kv_cache is not None:
            kv_cache.length += t
        if targets is not None and not return_logits:
            # training: the loss without materialising float32 logits (see lm_head_cross_entropy)
            logits = None
            loss = lm_head_cross_entropy(x, self.lm_head.weight, targets, low_memory=self.activation_checkpointing)
        elif targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None
        return logits, loss

    def kl_divergence(self):
        """The sum of the layers' KL terms (NoiseFormer's KL(N(mu, sigma^2) || N(0, 1)); 0 for variants without
        one). train.py adds kl_weight * this to the mean cross-entropy."""
        terms = [block.attn.kl_divergence() for block in self.transformer.h if block.attn.kl_parameters()]
        return torch.stack(terms).sum() if terms else torch.zeros((), device=self.lm_head.weight.device)

    @torch.no_grad()
    def learned_values(self):
        """What the attention variant learns, per layer: {name: [layer 0's values, layer 1's, ...]} (NoiseFormer's
        sigma and mu, DIFF/DINT's lambda; {} for the others). train.py logs them at every evaluation."""
        values = {}
        for block in self.transformer.h:
            for name, layer_values in block.attn.learned_values().items():
                values.setdefault(name, []).append(layer_values)
        return values

    def crop_block_size(self, block_size):
        # model surgery to decrease the block size, e.g. to run a gpt2 checkpoint with a smaller context
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """GPT-2 weights from Hugging Face: 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', or a local directory
        saved by transformers. override_args: dropout, and attn_type for variants whose weights extend base's
        (diff, dint, dint_lowrank, linear): see load_base_weights."""
        override_args = override_args or {}
        assert all(k in ('dropout', 'attn_type') for k in override_args)
        from transformers import GPT2LMHeadModel  # optional dependency, only needed here
        print(f"loading weights from pretrained gpt: {model_type}")
        hf_model = GPT2LMHeadModel.from_pretrained(model_type)
        hf = hf_model.config
        config = GPTConfig(block_size=hf.n_positions, vocab_size=hf.vocab_size, n_layer=hf.n_layer,
                           n_head=hf.n_head, n_embd=hf.n_embd, bias=True, **override_args)
        sd_hf = {k: v for k, v in hf_model.state_dict().items()
                 if not k.endswith(('.attn.masked_bias', '.attn.bias'))}  # buffers, not parameters
        # OpenAI's checkpoints use Conv1D modules, whose weights are the transpose of a Linear's
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        sd_base = {k: (v.t().contiguous() if k.endswith(transposed) else v) for k, v in sd_hf.items()}
        if config.attn_type != 'base':  # the variant's own parameters keep their initialisation
            model = cls(config)
            model.load_base_weights(sd_base)
            return model
        with torch.device('meta'):  # every tensor comes from GPT-2: nothing to initialise and throw away
            model = cls(config)
        model.load_state_dict(sd_base, assign=True)
        model.lm_head.weight = model.transformer.wte.weight  # assign gave each key its own Parameter
        return model

    def load_base_weights(self, state_dict):
        """Copy a `base` model's weights (nanoGPT / GPT-2 names) into this model. Every base tensor must fit;
        parameters base does not have keep their init. Returns their names (and prints them)."""
        prefix = '_orig_mod.'  # left by torch.compile in nanoGPT checkpoints
        state_dict = {k.removeprefix(prefix): v for k, v in state_dict.items()}
        own = self.state_dict()
        for k, v in state_dict.items():
            if k not in own or own[k].shape != v.shape:
                raise ValueError(f"base weight {k} {tuple(v.shape)} does not fit attn_type={self.config.attn_type!r} "
                                 f"(it has {tuple(own[k].shape) if k in own else 'no such parameter'})")
        with torch.no_grad():
            for k, v in state_dict.items():
                own[k].copy_(v)
        new = [k for k in own if k not in state_dict and k != 'lm_head.weight']  # tied to wte
        if new:
            print(f"parameters not in the base weights (kept at init): {', '.join(new)}")
        return new

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # matmul weights and embeddings (2-D) decay; biases, norm weights, lambda vectors, mu / sigma (1-D) never
        params = [p for p in self.parameters() if p.requires_grad]
        decay_params = [p for p in params if p.dim() >= 2]
        nodecay_params = [p for p in params if p.dim() < 2]
        optim_groups = [{'params': decay_params, 'weight_decay': weight_decay},
                        {'params': nodecay_params, 'weight_decay': 0.0}]
        for name, group in (('decayed', decay_params), ('non-decayed', nodecay_params)):
            print(f"num {name} parameter tensors: {len(group)}, with {sum(p.numel() for p in group):,} parameters")
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type in ('cuda', 'cpu')  # CPU: fused since torch 2.4
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")
        return optimizer

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=312e12):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (the scripts pass their device's; left out,
        nanoGPT's A100 bfloat16 312 TFLOP/s). FLOPs per token as PaLM appendix B, 6N + 12 L H Q T for every
        variant, with wider query/key heads 6 L H (Q_qk + Q) T for the attention."""
        N = self.get_num_params()
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        Q_qk = cfg.qk_head_size or Q
        flops_per_token = 6 * N + 6 * L * H * (Q_qk + Q) * T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter
        return flops_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Sample max_new_tokens tokens after idx (LongTensor (b, t)); call model.eval() first. With use_cache each
        new token costs one position's forward (each layer keeps its decoding state) until the sequence outgrows
        block_size; then, as nanoGPT, the window of the last block_size tokens is recomputed every step.
        temperature=0 takes the most likely token."""
        cache = None
        for _ in range(max_new_tokens):
            if use_cache and idx.size(1) <= self.config.block_size:
                new = idx if cache is None else idx[:, -1:]  # the prompt first, then one token at a time
                cache = cache or KVCache(self.config.n_layer)
                logits, _ = self(new, kv_cache=cache)
            else:
                logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :]
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:  # sample among the top_k only: the same distribution, 50x cheaper
                    v, ix = torch.topk(logits, min(top_k, logits.size(-1)))
                    idx_next = ix.gather(-1, torch.multinomial(F.softmax(v.float(), dim=-1), num_samples=1))
                else:
                    idx_next = torch.multinomial(F.softmax(logits.float(), dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


# ----------------------------------------------------------------------------------------------
# The causal attention every softmax variant calls: one fused SDPA call for training and cached decoding alike;
# the explicit (T, T) map is built for analysis only.

# cuDNN attention is left out on CUDA: with torch 2.11 (cuDNN 9.19, H100) its backward returns wrong dq, dk, dv
# (relative error 1.3-1.4) when the output gradient is contiguous while q, k, v are (B, T, H, D) memory seen as
# (B, H, T, D), and it plans anew for every sequence length. Cost: 1.2 ms (4 %) of a compiled GPT-2-small step.
CUDA_SDPA_BACKENDS = [torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                      torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.MATH]


def sdpa(q, k, v, **kwargs):
    """F.scaled_dot_product_attention, on CUDA restricted to CUDA_SDPA_BACKENDS."""
    if q.device.type == 'cuda':
        with torch.nn.attention.sdpa_kernel(CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def split_heads(t, n_head):
    """(B, T, n_head * hs) -> (B, n_head, T, hs)"""
    return t.unflatten(-1, (n_head, -1)).transpose(1, 2)


def merge_heads(t):
    """(B, n_head, T, hs) -> (B, T, n_head * hs)"""
    return t.transpose(1, 2).flatten(2)


def causal_mask(t_q, t_k, device):
    """Boolean (t_q, t_k) mask, True where query i (at absolute position t_k - t_q + i) may look."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


def causal_attention(q, k, v, dropout_p=0.0, scale=None, score_bias=None):
    """softmax(q k^T * scale + score_bias + M) v in one SDPA call. The queries are the last t_q positions of
    the t_k keys: training (t_q == t_k) and cached decoding (t_q < t_k) alike. score_bias: an additive float
    tensor broadcasting to (B, H, t_q, t_k) (NoiseFormer's noise)."""
    t_q, t_k = q.size(-2), k.size(-2)
    if score_bias is None:
        if t_q == t_k:
            return sdpa(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
        mask = None if t_q == 1 else causal_mask(t_q, t_k, q.device)
    else:
        mask = score_bias.to(q.dtype).masked_fill(~causal_mask(t_q, t_k, q.device), float('-inf'))
    return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def causal_softmax_map(q, k, scale=None, score_bias=None):
    """Analysis only: the (B, H, t, t) matrix softmax(q k^T * scale + bias + M) that causal_attention never
    builds, in float32 at least."""
    q, k = upcast(q), upcast(k)
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if score_bias is not None:
        scores = scores + upcast(score_bias)
    mask = causal_mask(q.size(-2), k.size(-2), q.device)
    return torch.softmax(scores.masked_fill(~mask, float('-inf')), dim=-1)


def append_to_cache(cache, **tensors):
    """Concatenate new keys/values to a layer's decoding cache along time; return the full tensors."""
    if cache is None:
        return tuple(tensors.values())
    for name, t in tensors.items():
        cache[name] = t if name not in cache else torch.cat([cache[name], t], dim=-2)
    return tuple(cache[name] for name in tensors)


def upcast(t):
    """Half-precision tensors to float32; float32/float64 unchanged (so float64 tests stay exact)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
