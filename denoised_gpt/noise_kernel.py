"""NoiseFormer's attention in one Triton kernel: O = softmax(Q Q^T / sqrt(d) + sigma_h * eps + M) V, with eps ~ N(0, 1)
drawn inside the kernel from a seed and drawn again in the backward, as flash attention does for dropout. Nothing
T x T is stored or read: no noise mask, no attention matrix, no float32 recomputation of P for dsigma.

mu is left out of the scores: softmax is invariant to a constant added to a whole row, so S + mu has the same output
and dL/dmu = 0 (only the KL term moves mu). The op still takes mu and gives it that zero gradient, as the SDPA path
does, so that every parameter has a gradient (DDP expects one for each).

The noise: eps[b, h, i, j] is N(0, 1) from Philox (Triton's tl.randn4x) keyed by seed + b * noise_heads + h and
counted by the score's position (four keys per draw: `_noise`). b is 0 unless noise_per_sample (one draw per
sequence), h is 0 for noiseformer_v1 (one draw for every head) and the head for v2. `seed` is a 1-element int64
tensor drawn from torch's generator at every forward, so torch.manual_seed replays a forward exactly, and DDP ranks,
seeded apart, draw apart.
`noise_eps` writes the eps a seed gives, for tests and analysis.

Backward, with P = softmax(S), dS = P * (dP - D), dP = dO V^T, D = rowsum(dO * O) (flash attention 2):
dV = P^T dO; Q is both query and key, so dQ = (dS Q + dS^T Q) / sqrt(d), the first (and D) from a kernel over
query blocks, the second from one over key blocks; dsigma_h = sum(dS * eps), summed per key by the second kernel.

Where it runs: CUDA (float32, float16, bfloat16; float32 accumulation), and CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1 before this module is imported), which the tests use. model.py keeps the SDPA path as the
reference and the fallback (noise_kernel='sdpa', or where `unsupported` says why not).
"""

import math
import os
import warnings

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get('TRITON_INTERPRET') == '1'  # triton decides at each @triton.jit below, at import
MAX_HEAD_SIZE = 256  # one head's q, k, v rows are held whole by a program
MAX_SEQUENCE = 65536  # the noise's int32 counters i * ceil(T / 4) + k stay below 2^31
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_said = set()


def say_once(message):
    """Why NoiseFormer takes its SDPA path, one warning the first time (never while torch.compile traces)."""
    if message not in _said and not torch.compiler.is_compiling():
        _said.add(message)
        warnings.warn(message, stacklevel=4)


def note_dropout(dropout):
    """The kernel has no attention dropout: a model built with some trains on the SDPA path (said once)."""
    if dropout > 0:
        say_once(f"noise_kernel='triton' has no attention dropout: with dropout={dropout} NoiseFormer trains on "
                 f"its SDPA path (evaluation and sampling, without dropout, use the kernel)")


def runs_on(q, v):
    """Whether the kernel runs on these queries and values; where not, why is said once."""
    reason = unsupported(q, v)
    if reason is not None:
        say_once(f"noise_kernel='triton': {reason}; NoiseFormer uses its SDPA path here")
    return reason is None


def unsupported(q, v):
    """Why the kernel cannot run on these (B, H, T, hs) queries and values, or None."""
    if q.device.type != ('cpu' if INTERPRETED else 'cuda'):
        return (f"Triton runs on CUDA GPUs (or on the CPU under TRITON_INTERPRET=1, for tests), not on "
                f"{q.device.type}" + (' while TRITON_INTERPRET=1' if INTERPRETED else ''))
    if q.dtype not in DTYPES or v.dtype != q.dtype:
        return f"the kernel takes float32, float16 or bfloat16, not {q.dtype} / {v.dtype}"
    if q.size(-1) != v.size(-1) or q.size(-1) > MAX_HEAD_SIZE:
        return f"the kernel takes one head size up to {MAX_HEAD_SIZE} for queries and values, not {q.size(-1)}"
    if q.size(-2) > MAX_SEQUENCE:
        return f"the kernel's noise offsets hold sequences up to {MAX_SEQUENCE} tokens, not {q.size(-2)}"
    return None


def draw_seed(device):
    """The kernel's seed, a fresh draw from torch's generator of `device` (no host sync on a GPU)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Triton kernels. One program: one block of rows of one (batch, head); q/k/v tiles in their own dtype, scores and
# accumulators in float32.

@triton.jit
def _noise(seed_ptr, b, h, T, offs_m, start_n, BLOCK_N: tl.constexpr, NOISE_HEADS: tl.constexpr,
           PER_SAMPLE: tl.constexpr):
    """eps for queries offs_m and keys start_n .. start_n + BLOCK_N - 1 of batch row b, head h: (BLOCK_M, BLOCK_N)
    float32 N(0, 1). One Philox draw gives four (two Box-Muller pairs): keys 4k .. 4k + 3 of query i share the
    counter i * ceil(T / 4) + k, their normals in that order (start_n is a multiple of 4)."""
    seed = tl.load(seed_ptr) + h % NOISE_HEADS
    if PER_SAMPLE:
        seed += b * NOISE_HEADS
    groups = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    n1, n2, n3, n4 = tl.randn4x(seed, offs_m[:, None] * ((T + 3) // 4) + groups[None, :])
    return tl.interleave(tl.interleave(n1, n3), tl.interleave(n2, n4))


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in float32. PRECISION 'upcast': the operands are cast to float32 first, exactly (bfloat16
    under Triton's interpreter, whose bfloat16 tl.dot reads the raw bits as numbers)."""
    if PRECISION == 'upcast':
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision='ieee')
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _scores(q, k, sigma, eps, scale, offs_m, offs_n, T, PRECISION: tl.constexpr):
    """S = q k^T * scale + sigma * eps, -inf where key j is after query i or outside the sequence."""
    s = _dot(q, tl.trans(k), PRECISION) * scale + sigma * eps
    visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < T)
    return tl.where(visible, s, float('-inf'))


@triton.jit
def _rows(ptr, stride_t, stride_d, offs, offs_d, T, D):
    """Rows offs (a block of positions) of one (batch, head)'s (T, D) matrix, 0 outside it."""
    mask = (offs[:, None] < T) & (offs_d[None, :] < D)
    return tl.load(ptr + offs[:, None] * stride_t + offs_d[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def _forward_kernel(Q, V, O, LSE, SIGMA, SEED, sq_b, sq_h, sq_t, sq_d, sv_b, sv_h, sv_t, sv_d, so_b, so_h, so_t, so_d,
                    H, T, D, scale, NOISE_HEADS: tl.constexpr, PER_SAMPLE: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = bh // H, bh % H
    Q, V, O = Q + b * sq_b + h * sq_h, V + b * sv_b + h * sv_h, O + b * so_b + h * so_h
    sigma = tl.load(SIGMA + h % NOISE_HEADS).to(tl.float32)
    offs_m, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q = _rows(Q, sq_t, sq_d, offs_m, offs_d, T, D)
    m_i = tl.full((BLOCK_M,), float('-inf'), tl.float32)  # running row max
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, start_m + BLOCK_M, BLOCK_N):  # causal: keys up to the block's last row
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _rows(Q, sq_t, sq_d, offs_n, offs_d, T, D), _rows(V, sv_t, sv_d, offs_n, offs_d, T, D)
        eps = _noise(SEED, b, h, T, offs_m, start_n, BLOCK_N, NOISE_HEADS, PER_SAMPLE)
        s = _scores(q, k, sigma, eps, scale, offs_m, offs_n, T, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    rows = offs_m < T
    tl.store(O + offs_m[:, None] * so_t + offs_d[None, :] * so_d, acc.to(O.dtype.element_ty),
             mask=rows[:, None] & (offs_d[None, :] < D))
    tl.store(LSE + bh * T + offs_m, m_i + tl.log(l_i), mask=rows)


@triton.jit
def _score_gradient(q, k, v, do, lse, delta, sigma, eps, scale, offs_m, offs_n, T, PRECISION: tl.constexpr):
    """P and dS = P * (dO v^T - delta) for one (query block, key block) tile, float32."""
    s = _scores(q, k, sigma, eps, scale, offs_m, offs_n, T, PRECISION)
    p = tl.where(offs_m[:, None] < T, tl.exp(s - lse[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _backward_query_kernel(Q, V, O, DO, LSE, DELTA, DQ, SIGMA, SEED, sq_b, sq_h, sq_t, sq_d, sv_b, sv_h, sv_t, sv_d,
                           so_b, so_h, so_t, so_d, sdo_b, sdo_h, sdo_t, sdo_d, H, T, D, scale,
                           NOISE_HEADS: tl.constexpr, PER_SAMPLE: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """For one block of query rows: D = rowsum(dO * O) (into DELTA, for the key kernel) and dQ from Q's use as
    queries, dS Q / sqrt(d) (float32, into DQ)."""
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = bh // H, bh % H
    Q, V, O, DO = Q + b * sq_b + h * sq_h, V + b * sv_b + h * sv_h, O + b * so_b + h * so_h, DO + b * sdo_b + h * sdo_h
    sigma = tl.load(SIGMA + h % NOISE_HEADS).to(tl.float32)
    offs_m, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q, do = _rows(Q, sq_t, sq_d, offs_m, offs_d, T, D), _rows(DO, sdo_t, sdo_d, offs_m, offs_d, T, D)
    lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.sum(do.to(tl.float32) * _rows(O, so_t, so_d, offs_m, offs_d, T, D).to(tl.float32), 1)
    tl.store(DELTA + bh * T + offs_m, delta, mask=offs_m < T)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(0, start_m + BLOCK_M, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _rows(Q, sq_t, sq_d, offs_n, offs_d, T, D), _rows(V, sv_t, sv_d, offs_n, offs_d, T, D)
        eps = _noise(SEED, b, h, T, offs_m, start_n, BLOCK_N, NOISE_HEADS, PER_SAMPLE)
        _, ds = _score_gradient(q, k, v, do, lse, delta, sigma, eps, scale, offs_m, offs_n, T, PRECISION)
        dq += _dot(ds.to(k.dtype), k, PRECISION)
    tl.store(DQ + bh * T * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :], dq * scale,
             mask=offs_m[:, None] < T)


@triton.jit
def _backward_key_kernel(Q, V, DO, LSE, DELTA, DQ, DQ_OUT, DV, DSIGMA, SIGMA, SEED, sq_b, sq_h, sq_t, sq_d, sv_b, sv_h,
                         sv_t, sv_d, sdo_b, sdo_h, sdo_t, sdo_d, sdq_b, sdq_h, sdq_t, sdq_d, sdv_b, sdv_h, sdv_t, sdv_d,
                         H, T, D, scale, NOISE_HEADS: tl.constexpr, PER_SAMPLE: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """For one block of key rows: dQ from Q's use as keys (dS^T Q / sqrt(d)), added to the query kernel's DQ rows
    into DQ_OUT; dV = P^T dO; each key's part of dsigma = sum(dS * eps) (into DSIGMA[bh, key])."""
    start_n, bh = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    b, h = bh // H, bh % H
    Q, V, DO = Q + b * sq_b + h * sq_h, V + b * sv_b + h * sv_h, DO + b * sdo_b + h * sdo_h
    DQ_OUT, DV = DQ_OUT + b * sdq_b + h * sdq_h, DV + b * sdv_b + h * sdv_h
    sigma = tl.load(SIGMA + h % NOISE_HEADS).to(tl.float32)
    offs_n, offs_d = start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k, v = _rows(Q, sq_t, sq_d, offs_n, offs_d, T, D), _rows(V, sv_t, sv_d, offs_n, offs_d, T, D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dsigma = tl.zeros((BLOCK_N,), tl.float32)
    for start_m in range((start_n // BLOCK_M) * BLOCK_M, T, BLOCK_M):  # causal: queries from the block's first key
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do = _rows(Q, sq_t, sq_d, offs_m, offs_d, T, D), _rows(DO, sdo_t, sdo_d, offs_m, offs_d, T, D)
        lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(DELTA + bh * T + offs_m, mask=offs_m < T, other=0.0)
        eps = _noise(SEED, b, h, T, offs_m, start_n, BLOCK_N, NOISE_HEADS, PER_SAMPLE)
        p, ds = _score_gradient(q, k, v, do, lse, delta, sigma, eps, scale, offs_m, offs_n, T, PRECISION)
        dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION)
        dsigma += tl.sum(ds * eps, 0)
    rows = offs_n[:, None] < T
    dq = tl.load(DQ + bh * T * BLOCK_D + offs_n[:, None] * BLOCK_D + offs_d[None, :], mask=rows) + dk * scale
    mask = rows & (offs_d[None, :] < D)
    tl.store(DQ_OUT + offs_n[:, None] * sdq_t + offs_d[None, :] * sdq_d, dq.to(DQ_OUT.dtype.element_ty), mask=mask)
    tl.store(DV + offs_n[:, None] * sdv_t + offs_d[None, :] * sdv_d, dv.to(DV.dtype.element_ty), mask=mask)
    tl.store(DSIGMA + bh * T + offs_n, dsigma, mask=offs_n < T)


@triton.jit
def _noise_kernel(EPS, SEED, H, T, NOISE_HEADS: tl.constexpr, PER_SAMPLE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """EPS (B, H, T, T) float32: the eps the attention kernels draw for this seed, every entry (masked ones too)."""
    start_m, start_n, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, tl.program_id(2)
    offs_m, offs_n = start_m + tl.arange(0, BLOCK_M), start_n + tl.arange(0, BLOCK_N)
    eps = _noise(SEED, bh // H, bh % H, T, offs_m, start_n, BLOCK_N, NOISE_HEADS, PER_SAMPLE)
    tl.store(EPS + bh * T * T + offs_m[:, None] * T + offs_n[None, :], eps,
             mask=(offs_m[:, None] < T) & (offs_n[None, :] < T))


# ----------------------------------------------------------------------------------------------
# Launches. On a GPU each kernel picks its tiles among a few flash-attention-like ones (triton.autotune, once per
# sequence length and head size); the interpreter runs every program in numpy, where 16 x 16 tiles spread the tests'
# small shapes over several blocks.

def _tiles(*configs):
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s) for m, n, w, s in configs]


TILES = {  # kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates
    _forward_kernel: _tiles((128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)),
    _backward_query_kernel: _tiles((64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)),
    _backward_key_kernel: _tiles((64, 64, 4, 2), (32, 128, 8, 2), (32, 64, 4, 2)),
}
INTERPRETER_TILES = dict(BLOCK_M=16, BLOCK_N=16)
_tuned = {}  # kernel: its autotuner, made at its first launch (making one needs a GPU driver)


def _launch(kernel, rows, *args, **constants):
    """kernel over (row blocks of `rows` positions, B * H) with its tiles: autotuned on a GPU, 16 x 16 interpreted."""
    bh = args[0].size(0) * args[0].size(1)
    if INTERPRETED:
        grid = (triton.cdiv(rows, INTERPRETER_TILES[rows_block(kernel)]), bh)
        return kernel[grid](*args, **constants, **INTERPRETER_TILES)
    if kernel not in _tuned:
        _tuned[kernel] = triton.autotune(TILES[kernel], key=['T', 'D'])(kernel)
    _tuned[kernel][lambda meta: (triton.cdiv(rows, meta[rows_block(kernel)]), bh)](*args, **constants)


def rows_block(kernel):
    """The tile size a kernel's programs split the rows by: key blocks for the key kernel, query blocks else."""
    return 'BLOCK_N' if kernel is _backward_key_kernel else 'BLOCK_M'


def _common(q, sigma, per_sample):
    """The arguments every kernel takes after its tensors: sizes, scale and the noise's shape."""
    B, H, T, D = q.shape
    precision = 'ieee' if q.dtype == torch.float32 else 'tf32'  # float32 as torch computes it: no TF32
    if INTERPRETED and q.dtype == torch.bfloat16:
        precision = 'upcast'
    return (H, T, D, 1.0 / math.sqrt(D)), dict(NOISE_HEADS=sigma.numel(), PER_SAMPLE=per_sample,
                                               PRECISION=precision, BLOCK_D=max(16, triton.next_power_of_2(D)))


def _forward(q, v, sigma, seed, per_sample):
    B, H, T, D = q.shape
    o = torch.empty_like(v)  # the layout the op's register_fake promises
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    args, constants = _common(q, sigma, per_sample)
    _launch(_forward_kernel, T, q, v, o, lse, sigma, seed, *q.stride(), *v.stride(), *o.stride(), *args, **constants)
    return o, lse


def _backward(do, q, v, o, lse, sigma, seed, per_sample):
    B, H, T, D = q.shape
    args, constants = _common(q, sigma, per_sample)
    do = do.to(q.dtype)
    delta = q.new_empty(B, H, T, dtype=torch.float32)  # D_i = dO_i . O_i, from the query kernel
    # dQ from the queries, float32, padded to BLOCK_D columns; the key kernel adds the keys' part into dq
    dq_queries = q.new_empty(B, H, T, constants['BLOCK_D'], dtype=torch.float32)
    dq, dv = torch.empty_like(q), torch.empty_like(v)  # the layouts the op's register_fake promises
    dsigma = q.new_empty(B, H, T, dtype=torch.float32)  # each key's sum of dS * eps
    _launch(_backward_query_kernel, T, q, v, o, do, lse, delta, dq_queries, sigma, seed, *q.stride(), *v.stride(),
            *o.stride(), *do.stride(), *args, **constants)
    _launch(_backward_key_kernel, T, q, v, do, lse, delta, dq_queries, dq, dv, dsigma, sigma, seed, *q.stride(),
            *v.stride(), *do.stride(), *dq.stride(), *dv.stride(), *args, **constants)
    n = sigma.numel()  # v1: one sigma for every head
    return dq, dv, dsigma.view(B, n, -1).sum((0, 2)).to(sigma.dtype)


# ----------------------------------------------------------------------------------------------
# As torch ops, so that torch.compile keeps the attention one node (no graph break) and autograd takes its backward.

@torch.library.custom_op('denoised_gpt::noise_attention', mutates_args=())
def _noise_attention_op(q: torch.Tensor, v: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, seed: torch.Tensor,
                        per_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, v, sigma, seed, per_sample)


@_noise_attention_op.register_fake
def _(q, v, mu, sigma, seed, per_sample):
    B, H, T, _ = q.shape
    return torch.empty_like(v), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op('denoised_gpt::noise_attention_backward', mutates_args=())
def _noise_attention_backward_op(do: torch.Tensor, q: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                                 lse: torch.Tensor, sigma: torch.Tensor, seed: torch.Tensor,
                                 per_sample: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, v, o, lse, sigma, seed, per_sample)


@_noise_attention_backward_op.register_fake
def _(do, q, v, o, lse, sigma, seed, per_sample):
    return torch.empty_like(q), torch.empty_like(v), torch.empty_like(sigma)


def _save(ctx, inputs, output):
    q, v, mu, sigma, seed, per_sample = inputs
    ctx.save_for_backward(q, v, output[0], output[1], sigma, seed)
    ctx.per_sample = per_sample


def _differentiate(ctx, do, _):  # the log-sum-exp output is the backward's own input
    q, v, o, lse, sigma, seed = ctx.saved_tensors
    dq, dv, dsigma = _noise_attention_backward_op(do, q, v, o, lse, sigma, seed, ctx.per_sample)
    return dq, dv, torch.zeros_like(sigma), dsigma, None, None


_noise_attention_op.register_autograd(_differentiate, setup_context=_save)


def noise_attention(q, v, mu, sigma, per_sample, seed=None):
    """softmax(q q^T / sqrt(d) + mu_h + sigma_h * eps + M) v for (B, H, T, d) q and v: NoiseFormer's causal,
    symmetric scores, mu and sigma 1 (one noise for all heads) or H values. eps is drawn from `seed` (a 1-element
    int64 tensor on q's device; drawn from torch's generator when None). Differentiable in q, v, mu (its gradient
    is 0: mu cancels) and sigma."""
    if seed is None:
        seed = draw_seed(q.device)
    return _noise_attention_op(q, v, mu, sigma, seed, per_sample)[0]


def noise_eps(seed, batch_size, noise_heads, T):
    """The eps the kernels draw from `seed`: (batch_size, noise_heads, T, T) float32 on the seed's device, its
    batch_size 1 unless the noise is per sample. Every entry, above the diagonal too (the kernels never use
    those)."""
    eps = torch.empty(batch_size, noise_heads, T, T, device=seed.device, dtype=torch.float32)
    block = 16 if INTERPRETED else 64  # any multiple of 4: the noise does not depend on the tiles
    _noise_kernel[(triton.cdiv(T, block), triton.cdiv(T, block), batch_size * noise_heads)](
        eps, seed, noise_heads, T, NOISE_HEADS=noise_heads, PER_SAMPLE=batch_size > 1, BLOCK_M=block, BLOCK_N=block)
    return eps
