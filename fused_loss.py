"""
The fused lm_head + cross-entropy loss that GPT.forward (model.py) trains with. Why: at vocab 50304 the float32
(N, V) logits and their gradient were most of a small model's step on CPU; this loss holds `chunk` rows of them at
a time and has no separate backward. Torch only, like model.py: an exported Hugging Face folder carries both files.
"""
import hashlib
import os

import torch
from torch.nn import functional as F

# The custom op's namespace. Imported as the project's own module, 'denoised_gpt'. A copy imported under another
# name (the one in an exported folder, loaded by transformers) registers under a namespace of its own, named by
# its module name and source, so loading a folder beside this code never replaces the op this code runs.
if __name__ == 'fused_loss':
    OP_NAMESPACE = 'denoised_gpt'
else:
    with open(os.path.abspath(__file__), 'rb') as _source:
        OP_NAMESPACE = 'denoised_gpt_' + hashlib.sha256(__name__.encode() + _source.read()).hexdigest()[:12]


def upcast(t):
    """Half-precision tensors to float32; float32/float64 unchanged (as model.py's)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def lm_head_ce_forward(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compute_dtype: torch.dtype,
                       chunk: int, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of x @ weight^T against targets (-1 ignored), F.cross_entropy(lm_head(x))'s numbers
    (log-softmax in float32 on the matmul-dtype logits), with d loss / d logits = softmax - onehot written over
    the logits in the same pass. Returns (loss, that gradient unscaled for every row, or an empty tensor when
    needs_grad is False). A custom op (below), so torch.compile keeps it one node: traced, the chunk loop would
    unroll into hundreds of small kernels (a compiled CPU step 15x slower than eager)."""
    xc, wc = x.to(compute_dtype), weight.to(compute_dtype)
    logits = xc @ wc.t()  # (N, V) in the matmul dtype; becomes the gradient below
    valid = targets != -1
    n_valid = valid.sum().clamp_min(1)
    safe = targets.clamp_min(0)
    total = torch.zeros((), dtype=upcast(logits[:1, :1]).dtype, device=x.device)  # float32 at least
    for s in range(0, logits.size(0), chunk):
        g, t, v = logits[s:s + chunk], safe[s:s + chunk], valid[s:s + chunk]
        rows = torch.arange(t.size(0), device=x.device)
        logp = torch.log_softmax(upcast(g), dim=-1)
        logp_t = logp[rows, t]
        total -= (logp_t * v).sum()
        if needs_grad:
            torch.exp(logp, out=g)  # softmax
            g[rows, t] = (logp_t.exp() - 1).to(g.dtype)  # minus the one-hot, in float32
    if not needs_grad:
        return total / n_valid, logits.new_empty(0)
    return total / n_valid, logits  # rows without a target are zeroed in the backward (no host sync here)


_lm_head_ce = torch.library.custom_op(f"{OP_NAMESPACE}::lm_head_cross_entropy", lm_head_ce_forward, mutates_args=())


@_lm_head_ce.register_fake
def _lm_head_ce_shapes(x, weight, targets, compute_dtype, chunk, needs_grad):
    loss_dtype = torch.float32 if compute_dtype in (torch.float16, torch.bfloat16) else compute_dtype
    grad_shape = (x.size(0), weight.size(0)) if needs_grad else (0,)
    return x.new_empty((), dtype=loss_dtype), x.new_empty(grad_shape, dtype=compute_dtype)


def _lm_head_ce_save(ctx, inputs, output):
    x, weight, targets, compute_dtype, chunk, needs_grad = inputs
    ctx.save_for_backward(output[1], x, weight, targets != -1)
    ctx.compute_dtype = compute_dtype
    ctx.set_materialize_grads(False)  # no (N, V) zeros for the gradient output, which nothing differentiates


def _lm_head_ce_backward(ctx, grad_loss, _):  # the second output is the forward's own gradient
    grad, x, weight, valid = ctx.saved_tensors
    if grad_loss is None:  # the loss took no part in what is differentiated
        return None, None, None, None, None, None
    xc, wc = x.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
    scale = grad_loss / valid.sum().clamp_min(1)
    # a row without a target has a softmax in `grad` but adds nothing: zeroed here, on (N, C), not (N, V)
    row_used = valid.unsqueeze(1)
    gx = gw = None
    if ctx.needs_input_grad[0]:
        gx = (grad @ wc).to(x.dtype) * scale * row_used
    if ctx.needs_input_grad[1]:
        gw = (grad.t() @ (xc * scale.to(xc.dtype) * row_used)).to(weight.dtype)
    return gx, gw, None, None, None, None


_lm_head_ce.register_autograd(_lm_head_ce_backward, setup_context=_lm_head_ce_save)


# rows of float32 log-probabilities held at once by the fused loss. CPU: 32 rows stay in cache. GPUs: ~128 MiB
# at a time, since each chunk costs ~8 kernel launches (32 rows at vocab 50304: ~3,000 per GPT-2 step)
CPU_LOSS_CHUNK_ROWS = 32
GPU_LOSS_CHUNK_BYTES = 128 * 2**20


def lm_head_cross_entropy(x, weight, targets, chunk=None, low_memory=False):
    """(B, T, C) activations, the (V, C) lm_head weight, (B, T) targets -> mean CE (float32 scalar).
    Under autocast the matmuls run in the autocast dtype, as lm_head would (see lm_head_ce_forward)."""
    kind = x.device.type
    if kind == 'cuda' and torch.compiler.is_compiling() and not low_memory:
        # compiled on CUDA, inductor fuses the plain loss into two passes over the bf16 logits: a GPT-2-small
        # step 5.2 ms (15 %) faster than the op, for ~2 GiB more at batch 12 (docs/benchmarks.md). With
        # activation checkpointing (low_memory) the op stays: there the logits are most of the activations
        logits = F.linear(x, weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
    if chunk is None:  # (Gaudi takes the GPU rule too; not measured there)
        chunk = CPU_LOSS_CHUNK_ROWS if kind == 'cpu' else \
            max(CPU_LOSS_CHUNK_ROWS, GPU_LOSS_CHUNK_BYTES // (4 * weight.size(0)))
    compute_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    scored = targets != -1
    if kind == 'cpu' and not torch.compiler.is_compiling() and not bool(scored.all()):
        # rows without a target add nothing: where few rows have one (answer-only data: 1 position in 4-16) the
        # lm_head runs on those alone. CPU only (on a GPU bool() would wait for the device every step), and
        # not when compiled (a data-dependent shape)
        x, targets = x[scored], targets[scored]
    loss, _ = _lm_head_ce(x, weight, targets, compute_dtype, chunk, needs_grad)
    return loss
