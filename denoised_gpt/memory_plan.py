"""How much memory a training run needs per GPU, computed from the model's shapes before renting any:
the plan `bench.py --plan=True` prints (docs/benchmarks.md, "Memory plan").

The step is train.py's compiled on CUDA: float32 weights, gradients and AdamW's two moments (16 bytes a
parameter), forward under bf16 autocast, the plain lm_head + cross-entropy that inductor fuses, or with
activation checkpointing the fused chunked loss (as on the CPU and eager: fused_loss=True), which needs less.
Activations are what the
forward keeps for the backward, counted tensor by tensor from model.py's code (tests/test_memory_plan.py
checks the sum against torch.profiler's tensor peak on CPU for every attn_type), plus the largest
short-lived working set of the step. Not counted: the CUDA context, the allocator's fragmentation
and NCCL's buffers; `usable_fraction` of each device is planned for, the rest left to them.
"""
import torch

from model import (ATTENTION_TYPES, GPT, NOISE_GRADIENT_ROWS, DiffAttention, DintAttention, GPTConfig, LinearAttention,
                   LowRankDintAttention, NoiseFormerAttention)

GPT2_SIZES = {'gpt2': (12, 12, 768), 'gpt2-medium': (24, 16, 1024), 'gpt2-large': (36, 20, 1280),
              'gpt2-xl': (48, 25, 1600)}  # name: (n_layer, n_head, n_embd)
DEVICE_GIB = (40, 80, 96)  # A100 40GB, H100 / A100 80GB, Gaudi 3 / GH200 96GB
A = 2  # bytes of an activation under bf16 autocast (matmul inputs and outputs)
F = 4  # bytes of a float32 value (the residual stream, LayerNorm, the float32 combine of DIFF / DINT)
LOSS_CHUNK = 32  # rows of float32 log-probabilities lm_head_cross_entropy holds at once


# ----------------------------------------------------------------------------------------------
# What one attention layer keeps for the backward, per attention class: (bytes per token, bytes per
# layer and batch); ATTENTION_BACKWARD: an attention backward whose working set is larger than the
# MLP's (bytes per token). C = n_embd, H = n_head, T = block_size; SDPA keeps q, k, v, its output and a float32
# logsumexp per head and query. Written next to what the forward does (model.py), in its order.

def _softmax_of_scores(c):  # the default of a class whose forward is causal_attention over its score_inputs (base,
    # symmetric): c_attn's projections (q and k qk_head_size wide, one tensor for both when K := Q, v n_embd wide)
    # and the logsumexp; the SDPA output is c_proj's input, counted with the block
    cls = ATTENTION_TYPES[c.attn_type]
    qk, others = cls.qk_projections, cls.c_attn_projections - cls.qk_projections
    return A * (qk * _qk_width(c) + others * c.n_embd) + F * c.n_head, 0


def _noiseformer(c):  # symmetric, plus the noise eps and the mask sigma * eps, (1 or B, heads, T, T) each
    noise = 2 * A * (ATTENTION_TYPES[c.attn_type].noise_heads or c.n_head) * c.block_size
    if c.noise_per_sample:
        return _softmax_of_scores(c)[0] + noise, 0
    return _softmax_of_scores(c)[0], noise * c.block_size


def _noiseformer_backward(c):  # NoiseScoreGradient: float32 scores and weights of NOISE_GRADIENT_ROWS
    # queries x T keys per head, i.e. per token of the sequence (over its T / rows chunks) 2 F H rows
    return 2 * F * c.n_head * min(NOISE_GRADIENT_ROWS, c.block_size)


def _two_branch(c):  # diff / dint: q, k, v; v repeated for both branches; two SDPA outputs (one per
    # d-wide value slice); the float32 combine keeps O2 (diff) or A3 V - O2 (dint) for d/dlambda; the
    # RMSNorm keeps its float32 input and normalised output, and one rstd per differential head
    C, H = c.n_embd, c.n_head
    return A * (3 * C + 2 * C + 2 * C) + F * (C + 2 * C) + F * (2 * H + H // 2), 0


def _lowrank_dint(c):  # dint_lowrank: q1, k1, v; the bf16 input of q2_down and k2_down; their rank-r
    # outputs; q2, k2; two SDPA outputs; the float32 combine and RMSNorm as DINT
    C, H, r = c.n_embd, c.n_head, c.lowrank_rank
    return A * (3 * C + 2 * C + 2 * r + 2 * C + 2 * C) + F * (C + 2 * C) + F * (2 * H + H), 0


def _linear(c):  # q, k, v; under autocast each matmul of the chunked form keeps bf16 copies of its
    # inputs: k, v (chunk sums), q, k (scores), q (past state), v (scores @ v), q (normaliser) and the
    # numerator; the masked within-chunk scores, the past state S and z per chunk, the normaliser
    C, H, chunk = c.n_embd, c.n_head, c.linear_chunk_size
    d = C // H
    return A * (3 * C + 8 * C + H * chunk + C * d / chunk + C / chunk + H), 0


ATTENTION_ACTIVATIONS = {  # base and symmetric: _softmax_of_scores, the default
    NoiseFormerAttention: _noiseformer,
    DiffAttention: _two_branch,
    DintAttention: _two_branch,  # the integral term costs one more float32 tensor in place of O2: the same
    LowRankDintAttention: _lowrank_dint,
    LinearAttention: _linear,
}
ATTENTION_BACKWARD = {NoiseFormerAttention: _noiseformer_backward}


def _qk_width(c):
    return c.n_head * (c.qk_head_size or c.n_embd // c.n_head)


def _closest(table, config):
    """table's entry for the config's attention class, or for the nearest base class whose forward it runs
    unchanged (v1 / v2: NoiseFormer's). A class that rewrites forward gets none of its base classes' entries."""
    cls = ATTENTION_TYPES[config.attn_type]
    forward_owner = next(c for c in cls.__mro__ if 'forward' in vars(c))
    return next((table[c] for c in cls.__mro__ if c in table and issubclass(c, forward_owner)), None)


def attention_activations(config):
    """(bytes per token, bytes per layer and batch) one attention layer keeps for the backward."""
    cls = ATTENTION_TYPES[config.attn_type]
    formula = _closest(ATTENTION_ACTIVATIONS, config)
    if formula is None and cls.softmax_of_scores():
        formula = _softmax_of_scores
    if formula is None:
        raise ValueError(f"no activation formula for {cls.__name__}: add one to ATTENTION_ACTIVATIONS in "
                         f"denoised_gpt/memory_plan.py (what its forward keeps for the backward), or give it "
                         f"score_inputs if its forward is causal_attention over them")
    return formula(config)


# ----------------------------------------------------------------------------------------------
# The whole model

def block_bytes_per_token(config):
    """What one block keeps per token: ln_1's and ln_2's float32 inputs (the residual stream) and
    statistics, the bf16 inputs of c_attn (cast from ln_1's float32 output), c_proj and c_fc, c_fc's
    4C output (GELU's input) and GELU's output (the MLP's c_proj input), plus the attention's own."""
    C = config.n_embd
    common = F * 2 * C + F * 2 * 2 + A * 3 * C + A * 2 * 4 * C
    return common + attention_activations(config)[0]


def head_bytes_per_token(config, fused_loss=False):
    """ln_f's float32 input and statistics, its float32 output (the loss keeps x), and the bf16 logits:
    the fused loss writes d loss / d logits over them in the forward and keeps that alone; the compiled
    plain loss keeps the logits and has their gradient beside them in the backward, 3 A V in all (on an
    H100, GPT-2 small at batch 12: 1.97 GiB more per step than the fused loss; 2 A V is 2.30 GiB)."""
    return F * config.n_embd + F * 2 + F * config.n_embd + (1 if fused_loss else 3) * A * config.vocab_size


def block_backward_bytes_per_token(config):
    """The largest set of gradients alive at once inside one block's backward: the MLP's (the residual
    stream's float32 gradient twice, the bf16 gradients of GELU's output and input, 4C each), or the
    attention's where that is larger (ATTENTION_BACKWARD)."""
    C = config.n_embd
    attention = _closest(ATTENTION_BACKWARD, config)
    return max(F * 2 * C + A * 2 * 4 * C, attention(config) if attention else 0)


def matmul_weight_count(model):
    """Elements of the blocks' matmul weights: autocast keeps one bf16 copy of each (its cache in the
    forward; the saved inputs of the backward)."""
    return sum(p.numel() for block in model.transformer.h for p in block.parameters() if p.dim() == 2)


def activation_bytes(config, batch_size, checkpointing, weight_count, fused_loss=None):
    """Peak bytes of a training step beyond the static memory (weights, gradients, optimizer state):
    the largest of three moments (the loss: see head_bytes_per_token; fused_loss None: train.py's
    compiled CUDA step, fused with checkpointing only). The end of the forward (everything
    kept, autocast's bf16 weight copies, the loss's float32 chunk and its bf16 lm_head weight), the start
    of the backward (the lm_head's backward: its weight and gradient in bf16 and float32), and the last
    block's backward (with checkpointing: that block's activations recomputed, with its bf16 weights)."""
    L, T, C, V = config.n_layer, config.block_size, config.n_embd, config.vocab_size
    N = batch_size * T  # tokens of the micro-batch
    block_tokens, noise = block_bytes_per_token(config), attention_activations(config)[1]
    head = N * head_bytes_per_token(config, checkpointing if fused_loss is None else fused_loss)
    weights_bf16 = A * weight_count
    if checkpointing:  # each block keeps only its input (the residual stream) until its rerun
        kept = N * F * C * L
        end_of_forward = kept + head + weights_bf16 + A * V * C + 2 * F * LOSS_CHUNK * V
        start_of_backward = kept + head + (2 * A + F) * V * C
        last_block = kept + N * (block_tokens - F * C + block_backward_bytes_per_token(config)) \
            + noise + weights_bf16 / L
    else:
        kept = N * block_tokens * L + noise * L + weights_bf16
        end_of_forward = kept + head + A * V * C + 2 * F * LOSS_CHUNK * V
        start_of_backward = kept + head + (2 * A + F) * V * C
        last_block = kept + N * block_backward_bytes_per_token(config)
    return max(end_of_forward, start_of_backward, last_block)


# ----------------------------------------------------------------------------------------------
# Per GPU, DDP or FSDP

def count_parameters(config):
    """(parameters, blocks' matmul weight elements, one block's parameters) of GPT(config), built on
    the meta device (no memory, no initialisation)."""
    with torch.device('meta'):
        model = GPT(config)
    return (sum(p.numel() for p in model.parameters()), matmul_weight_count(model),
            sum(p.numel() for p in model.transformer.h[0].parameters()))


def largest_micro_batch(room, bytes_at):
    """The largest batch b with bytes_at(b) <= room (bytes_at grows with b), 0 if not even one fits."""
    if bytes_at(1) > room:
        return 0
    low, high = 1, 2
    while bytes_at(high) <= room:
        low, high = high, 2 * high
    while high - low > 1:  # bytes_at(low) fits, bytes_at(high) does not
        mid = (low + high) // 2
        low, high = (mid, high) if bytes_at(mid) <= room else (low, mid)
    return low


def plan_row(config, parallelism, checkpointing, world_size, usable_fraction=0.9, counts=None, micro_steps=1):
    """One line of the plan as a dict of bytes (per GPU) and micro-batch sizes. parallelism: 'ddp'
    (every rank holds everything) or 'fsdp' (weights, gradients and AdamW state sharded over
    world_size; the blocks being computed are gathered whole: one block's float32 weights twice
    (computing one, prefetching the next) and its gradient, and the tied embedding / lm_head).
    micro_steps: micro-batches per rank per optimizer step. train.py's fsdp reduce-scatters the
    gradients after the last one only, so with more than one each rank holds whole float32 gradients
    in between, as under DDP."""
    n_params, weight_count, block_params = counts or count_parameters(config)
    shards = world_size if parallelism == 'fsdp' else 1
    grad_shards = shards if micro_steps == 1 else 1
    params, grads, adamw = F * n_params / shards, F * n_params / grad_shards, 2 * F * n_params / shards
    gathered = 0
    if parallelism == 'fsdp':
        gathered = F * (3 * block_params + 2 * config.vocab_size * config.n_embd)
    static = params + grads + adamw + gathered
    per_sequence = activation_bytes(config, 2, checkpointing, weight_count) - activation_bytes(config, 1, checkpointing, weight_count)
    fixed = activation_bytes(config, 1, checkpointing, weight_count) - per_sequence
    largest = {gib: largest_micro_batch(gib * 2**30 * usable_fraction - static,
                                        lambda b: activation_bytes(config, b, checkpointing, weight_count))
               for gib in DEVICE_GIB}
    ring = (world_size - 1) / world_size  # each rank sends (and receives) this share of the whole
    if parallelism == 'ddp':  # all-reduce of the float32 gradients, once per optimizer step
        comm = 2 * ring * F * n_params
    else:  # every micro-batch all-gathers the bf16 weights in the forward and again in the backward; the
        # float32 gradients are reduce-scattered once per optimizer step
        comm = micro_steps * 2 * ring * A * n_params + ring * F * n_params
    return dict(attn_type=config.attn_type, parallelism=parallelism, checkpointing=checkpointing,
                params=n_params, param_bytes=params, grad_bytes=grads, adamw_bytes=adamw, gathered_bytes=gathered,
                activation_bytes_per_sequence=per_sequence, activation_bytes_fixed=fixed,
                largest_micro_batch={str(g): b for g, b in largest.items()}, comm_bytes=comm)


def plan(attn_types, sizes, block_size, vocab_size, bias, world_size, usable_fraction=0.9, micro_steps=1):
    """Rows for every size x attn_type x (ddp, fsdp) x (checkpointing off, on); a size the attn_type
    cannot take, or a variant without an activation formula, gives one row with 'not_possible' (the reason)."""
    rows = []
    for size_name, (n_layer, n_head, n_embd) in sizes.items():
        for attn_type in attn_types:
            try:
                config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                                   n_embd=n_embd, bias=bias, attn_type=attn_type)
            except ValueError as e:  # e.g. diff / dint at GPT-2 XL's 25 heads: a row that says why
                rows.append({'size': size_name, 'attn_type': attn_type, 'not_possible': str(e)})
                continue
            counts = count_parameters(config)
            try:
                attention_activations(config)
            except ValueError as e:  # a variant the plan has no formula for: a row that says so
                rows.append({'size': size_name, 'attn_type': attn_type, 'not_possible': str(e)})
                continue
            for parallelism in ('ddp', 'fsdp'):
                for checkpointing in (False, True):
                    row = plan_row(config, parallelism, checkpointing, world_size, usable_fraction, counts,
                                   micro_steps)
                    rows.append({'size': size_name, **row})
    return rows


def format_plan(rows, world_size, usable_fraction, micro_steps=1):
    def gb(b):
        return f"{b / 1e9:.2f}"
    lines = [f"memory per GPU in GB (1e9 bytes), float32 weights + AdamW, bf16 autocast; fsdp over {world_size} GPUs; "
             f"micro-batch = the most sequences that fit in {usable_fraction:.0%} of the device; {micro_steps} "
             f"micro-batch(es) per rank per step" + (" (fsdp holds whole gradients between them)" if micro_steps > 1 else ""),
             "act/seq: activations per sequence; act fix: per micro-batch whatever its size (bf16 weight copies, "
             "lm_head working set, NoiseFormer's batch-shared noise); comm: what each rank sends per optimizer "
             "step (ddp: all-reduce of the float32 gradients; fsdp: 2 all-gathers of the bf16 weights per "
             "micro-batch, one reduce-scatter of the float32 gradients)",
             f"{'size':<12}{'attn_type':<16}{'par':<6}{'ckpt':<6}{'params':>8}{'weights':>9}{'grads':>7}{'AdamW':>7}"
             f"{'gathered':>9}{'act/seq':>9}{'act fix':>8}" + ''.join(f"{f'B@{g}G':>7}" for g in DEVICE_GIB)
             + f"{'comm':>11}"]
    for r in rows:
        if 'not_possible' in r:
            lines.append(f"{r['size']:<12}{r['attn_type']:<16}n/a: {r['not_possible']}")
            continue
        lines.append(f"{r['size']:<12}{r['attn_type']:<16}{r['parallelism']:<6}{'on' if r['checkpointing'] else 'off':<6}"
                     f"{r['params'] / 1e6:>7.0f}M{gb(r['param_bytes']):>9}{gb(r['grad_bytes']):>7}{gb(r['adamw_bytes']):>7}"
                     f"{gb(r['gathered_bytes']):>9}{gb(r['activation_bytes_per_sequence']):>9}"
                     f"{gb(r['activation_bytes_fixed']):>8}"
                     + ''.join(f"{r['largest_micro_batch'][str(g)]:>7}" for g in DEVICE_GIB)
                     + f"{gb(r['comm_bytes']):>11}")
    return '\n'.join(lines)
