"""The CUDA paths, on a machine with an NVIDIA GPU (skipped elsewhere, i.e. in CI).

test_model.py checks every variant against the float64 equations on the CPU. Here the same
references judge the CUDA kernels: SDPA's flash / memory-efficient kernels, NoiseFormer's noise
drawn by the CUDA generator, DIFF/DINT's split values, the fused loss, in float32 (TF32 off) and
under bf16 autocast; KV-cache decoding; and train.py on cuda, resumed bitwise.
"""
import math

import pytest
import torch

from helpers import iter_losses, make_dataset, run_train
from denoised_gpt.checkpoint import read_checkpoint
import model as model_module
from model import ATTENTION_TYPES, KVCache, causal_attention, causal_randn
from naive_attention import NAIVE
from test_model import (DIFFERENTIAL, NOISE, VARIANTS, make_model, naive_kwargs, noise_shape, rel_err,
                        sdpa_kernels)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
F64 = torch.float64
CUDA = 'cuda'
# float32 with TF32 off: rounding of ~1e-7 per operation through a 2-layer model; bf16 keeps 8 bits,
# and DIFF/DINT's O1 - lambda O2 cancels some of them (input gradient of dint_lowrank: 0.044 at T = 7)
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 3e-2
BF16_DIFFERENTIAL_TOLERANCE = 6e-2


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def reference_and_cuda_layer(attn_type, layer_index=1, dtype=torch.float32, **overrides):
    """The float64 layer on the CPU (the reference's parameters) and a copy on cuda in `dtype`."""
    model = make_model(attn_type, **overrides)
    on_cuda = make_model(attn_type, **overrides).to(CUDA, dtype)
    return model, model.transformer.h[layer_index].attn, on_cuda.transformer.h[layer_index].attn


def check_layer_against_float64(attn_type, autocast):
    """Forward and input gradient of one layer on cuda against the float64 equations on the CPU,
    at T = 7 and T = 100 (several flash / efficient tiles); NoiseFormer with its noise drawn by the
    CUDA generator and replayed for the reference."""
    model, ref_attn, attn = reference_and_cuda_layer(attn_type)
    ref_attn.train(), attn.train()
    tolerance = FP32_TOLERANCE if not autocast else \
        BF16_DIFFERENTIAL_TOLERANCE if attn_type in DIFFERENTIAL else BF16_TOLERANCE
    for T in (7, 100):
        x64 = torch.randn(2, T, 32, dtype=F64, requires_grad=True)
        x = x64.detach().float().to(CUDA).requires_grad_()
        g64 = torch.randn(2, T, 32, dtype=F64)
        torch.manual_seed(5)
        with torch.autocast(CUDA, dtype=torch.bfloat16, enabled=autocast):
            y = attn(x)
        (dx,) = torch.autograd.grad(y.float(), x, g64.float().to(CUDA))
        eps = None
        if attn_type in NOISE:
            torch.manual_seed(5)
            eps = causal_randn(noise_shape(attn_type, 2, 4, T, False), device=CUDA,
                               dtype=torch.bfloat16 if autocast else torch.float32).to('cpu', F64)
        kwargs = {"eps": eps} if attn_type in NOISE else naive_kwargs(attn_type, 1, model.config)
        ref = NAIVE[attn_type](ref_attn, x64, **kwargs)
        (dx_ref,) = torch.autograd.grad(ref, x64, g64)
        assert rel_err(y.to('cpu', F64), ref) < tolerance, (attn_type, T, rel_err(y.to('cpu', F64), ref))
        assert rel_err(dx.to('cpu', F64), dx_ref) < tolerance, (attn_type, T, rel_err(dx.to('cpu', F64), dx_ref))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("attn_type", VARIANTS)
def test_attention_on_cuda_equals_naive_float64(attn_type, autocast):
    check_layer_against_float64(attn_type, autocast)


def test_gradients_on_cuda_do_not_depend_on_earlier_calls():
    """Every variant after every other in one process, bf16, with the same shapes: the kernels that run
    must keep no state from one call to the next (see the output-gradient layouts below)."""
    for attn_type in VARIANTS + VARIANTS[::-1]:
        check_layer_against_float64(attn_type, autocast=True)


@pytest.mark.parametrize("backend", model_module.CUDA_SDPA_BACKENDS, ids=lambda b: b.name)
def test_every_cuda_sdpa_backend_takes_any_output_gradient_layout(backend):
    """Each kernel model.sdpa may pick, with q, k, v laid out as c_attn's split gives them ((B, T, H, D)
    memory seen as (B, H, T, D)), gives float64's dq, dk, dv for an output gradient in that layout (base's
    merge_heads) and in a contiguous (B, H, T, D) one (after the heads are concatenated or scaled), in
    either order. cuDNN attention fails this with torch 2.11 (relative error 1.3-1.4 for the second
    layout, whichever ran first), which is why it is not among them."""
    B, H, T, D = 2, 4, 100, 64
    q, k, v = (torch.randn(B, T, H, D, device=CUDA, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    q64, k64, v64 = (t.detach().to('cpu', F64).requires_grad_() for t in (q, k, v))
    grads = {'bshd': torch.randn(B, T, H, D, device=CUDA, dtype=torch.bfloat16).transpose(1, 2),
             'bhsd': torch.randn(B, H, T, D, device=CUDA, dtype=torch.bfloat16)}
    for layout in ('bshd', 'bhsd', 'bshd', 'bhsd'):
        with torch.nn.attention.sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = torch.autograd.grad(out, (q, k, v), grads[layout])
        ref = causal_attention(q64, k64, v64)
        want = torch.autograd.grad(ref, (q64, k64, v64), grads[layout].to('cpu', F64))
        for name, a, b in zip(('dq', 'dk', 'dv'), got, want):
            assert rel_err(a.to('cpu', F64), b) < BF16_TOLERANCE, (layout, name, rel_err(a.to('cpu', F64), b))


def test_compiled_loss_on_cuda_is_inductors_and_equals_the_fused_one():
    """Compiled on cuda, GPT's training loss (return_logits=False) is the plain lm_head + cross-entropy,
    which inductor fuses (no custom op in the graph); its loss and gradients equal the eager fused op's,
    with rows without a target among them."""
    model = make_model('base', dtype=torch.float32).to(CUDA).train()
    idx = torch.randint(0, 61, (2, 40), device=CUDA)
    targets = idx.roll(-1, 1)
    targets[:, ::4] = -1

    def loss_and_grads(forward):
        model.zero_grad(set_to_none=True)
        _, loss = forward(idx, targets, return_logits=False)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    eager = loss_and_grads(model)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm
    compiled = loss_and_grads(torch.compile(model, dynamic=False))
    for a, b in zip(compiled, eager):
        assert rel_err(a.double(), b.double()) < FP32_TOLERANCE
    torch._dynamo.reset()
    traced = torch.compile(model, backend=keep_graph, dynamic=False)
    traced(idx, targets, return_logits=False)
    targets_called = {str(n.target) for gm in graphs for n in gm.graph.nodes}
    assert not any('lm_head_cross_entropy' in t for t in targets_called), targets_called


def test_fused_loss_on_cuda_waits_for_nothing():
    """Eager on cuda, the fused loss's forward and backward never wait for the device (a value read back
    would stall every step), rows without a target included."""
    model = make_model('base', dtype=torch.float32).to(CUDA).train()
    idx = torch.randint(0, 61, (2, 40), device=CUDA)
    targets = idx.roll(-1, 1)
    targets[:, ::4] = -1
    model(idx, targets, return_logits=False)[1].backward()  # first call: lazy initialisations may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        _, loss = model(idx, targets, return_logits=False)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("attn_type", VARIANTS)
def test_bf16_training_step_on_cuda_takes_a_fused_kernel(attn_type):
    """Which SDPA kernel each variant's bf16 training step gets on this GPU: flash or memory-
    efficient, never the math path that keeps the (B, H, T, T) scores, nor cuDNN (see model.sdpa)."""
    model = make_model(attn_type, dtype=torch.float32).to(CUDA).train()
    idx = torch.randint(0, 61, (2, 96), device=CUDA)

    def step():
        with torch.autocast(CUDA, dtype=torch.bfloat16):
            _, loss = model(idx, targets=idx)
        (loss + model.kl_divergence()).backward()
        torch.cuda.synchronize()
    kernels = sdpa_kernels(step)
    print(attn_type, sorted(kernels))
    if not kernels:
        pytest.skip(f"{attn_type} calls no SDPA kernel (explicit products)")
    assert not any("math" in k or "cudnn" in k for k in kernels), kernels


@pytest.mark.parametrize("attn_type", VARIANTS)
def test_kv_cache_logits_on_cuda_equal_full_forward(attn_type):
    """Decoding one token at a time with the cache gives the full forward's logits at every
    position (float32 on cuda), so generation on the GPU samples from the right distribution."""
    overrides = {"noise_at_eval": False} if attn_type in NOISE else {}
    if "linear_chunk_size" in ATTENTION_TYPES[attn_type].config_fields:
        overrides["linear_chunk_size"] = 4
    model = make_model(attn_type, dtype=torch.float32, **overrides).to(CUDA).eval()
    idx = torch.randint(0, 61, (2, 20), device=CUDA)
    with torch.no_grad():
        full, _ = model(idx, targets=idx)
        cache = KVCache(model.config.n_layer)
        logits, _ = model(idx[:, :5], kv_cache=cache)
        steps = [logits[:, -1]]
        for t in range(5, 20):
            logits, _ = model(idx[:, t:t + 1], kv_cache=cache)
            steps.append(logits[:, -1])
    decoded = torch.stack(steps, dim=1)
    assert rel_err(decoded.double(), full[:, 4:].double()) < FP32_TOLERANCE


@pytest.mark.parametrize("attn_type,dtype", [("noiseformer_v2", "bfloat16"), ("noiseformer_v1", "float32"),
                                             ("diff", "float32")])
def test_train_on_cuda_resumes_bitwise(tmp_path, attn_type, dtype):
    """train.py on cuda: the loss falls, and 10 iterations + a resume to 20 equal 20 in one go,
    loss by loss and weight by weight (the noise's CUDA generator state is restored too). compile=auto
    compiles on cuda."""
    data = make_dataset(tmp_path)
    common = ['--device=cuda', f'--dtype={dtype}', f'--attn_type={attn_type}', '--eval_interval=10']
    full = run_train(tmp_path / 'full', data, *common, '--max_iters=20')
    reference_losses = iter_losses(full.stdout)
    assert reference_losses[19] < reference_losses[0] - 0.3, reference_losses  # diff: 3.89 -> 3.39 on an H200
    run_train(tmp_path / 'resumed', data, *common, '--max_iters=10')
    resumed = run_train(tmp_path / 'resumed', data, *common, '--max_iters=20', '--init_from=resume')
    for it, loss in iter_losses(resumed.stdout).items():
        assert loss == reference_losses[it], (it, loss, reference_losses[it])
    a, b = read_checkpoint(tmp_path / 'full')[1], read_checkpoint(tmp_path / 'resumed')[1]
    assert a['iter_num'] == b['iter_num'] == 20
    for name in a['model']:
        assert torch.equal(a['model'][name], b['model'][name]), name


@pytest.mark.parametrize("attn_type", ["base", "noiseformer_v2", "diff", "linear"])
def test_float16_training_on_cuda_learns_with_the_grad_scaler(tmp_path, attn_type):
    """--dtype=float16 (GPUs without bf16: V100, T4) trains through the GradScaler: the loss falls and
    no iteration's loss is inf or nan (NoiseFormer's mask and DIFF's O1 - lambda O2 in float16)."""
    data = make_dataset(tmp_path)
    proc = run_train(tmp_path / 'out', data, '--device=cuda', '--dtype=float16', f'--attn_type={attn_type}',
                     '--max_iters=20', '--eval_interval=10')
    losses = iter_losses(proc.stdout)
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses.values()), losses
    assert losses[19] < losses[0] - 0.3, losses


@pytest.mark.parametrize("attn_type", VARIANTS)
def test_generation_on_cuda_avoids_cudnn_attention(attn_type):
    """cuDNN's attention builds a plan per sequence length and decoding makes a new length every token
    (GPT-2 small on an H200: ~49 ms per token): generation runs flash / memory-efficient kernels,
    with the cache and without it."""
    overrides = {"noise_at_eval": False} if attn_type in NOISE else {}
    model = make_model(attn_type, dtype=torch.float32, **overrides).to(CUDA).eval()
    prompt = torch.randint(0, 61, (2, 5), device=CUDA)
    outs = []
    for use_cache in (True, False):
        with torch.no_grad(), torch.autocast(CUDA, dtype=torch.bfloat16):
            kernels = sdpa_kernels(lambda: outs.append(model.generate(prompt, 12, temperature=0, use_cache=use_cache)))
        if not kernels:
            pytest.skip(f"{attn_type} calls no SDPA kernel (explicit products)")
        assert not any("cudnn" in k for k in kernels), kernels
    assert torch.equal(outs[0][:, :5], prompt) and outs[0].shape == (2, 17)
