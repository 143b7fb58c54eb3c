"""NoiseFormer's Triton kernel (denoised_gpt/noise_kernel.py) against the float64 equations, with the eps it draws.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before
anything imports triton), at small odd shapes: T not a multiple of the interpreter's
16-row blocks, head sizes 16 and 64. tests/test_cuda.py runs the same kernels compiled on a GPU.
"""
import math
import os
import subprocess
import sys
import warnings

import numpy
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the NoiseFormer kernel's tests are skipped")

from model import GPT, GPTConfig, causal_attention_learned_noise  # noqa: E402

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER_NUMPY_CLASH = (tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)
                           and tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4))


@pytest.fixture(scope="module")
def nk():
    """The kernel module: compiled on a GPU, interpreted on a CPU (TRITON_INTERPRET=1, from tests/conftest.py)."""
    if INTERPRETER_NUMPY_CLASH:
        pytest.skip(f"triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__} (it takes "
                    f"1-element arrays as ints): the kernel's CPU tests need triton >= 3.7 or numpy < 2.4")
    from denoised_gpt import noise_kernel
    if noise_kernel.INTERPRETED != (DEVICE == "cpu"):
        pytest.skip("TRITON_INTERPRET=1 runs triton on a CPU, and only there: set it (as tests/conftest.py does) "
                    "before triton is imported, and not with a GPU")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only spins
    yield noise_kernel
    torch.set_num_threads(before)


def reference(q, v, sigma, eps):
    """The equations in float64: softmax(q q^T / sqrt(d) + sigma_h * eps + M) v (mu cancels), eps broadcasting over
    the batch (1 or B) and heads (1 or H)."""
    q, v, sigma, eps = (t.to(F64) for t in (q, v, sigma, eps))
    T, n = q.size(-2), sigma.numel()
    scores = q @ q.transpose(-1, -2) / math.sqrt(q.size(-1)) + sigma.view(1, n, 1, 1) * eps
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def inputs(B, H, T, D, noise_heads, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, H, T, D, generator=g).to(DEVICE, dtype)
    mu = torch.randn(noise_heads, generator=g).to(DEVICE)
    sigma = (0.5 + torch.rand(noise_heads, generator=g)).to(DEVICE)  # large enough to matter in every head
    return [t.requires_grad_() for t in (q, v, mu, sigma)]


def kernel_and_reference(nk, B, H, T, D, noise_heads, per_sample, dtype=torch.float32):
    """(kernel's o and gradients of q, v, mu, sigma; float64 reference's o and gradients of q, v, sigma)."""
    q, v, mu, sigma = inputs(B, H, T, D, noise_heads, dtype)
    seed = nk.draw_seed(DEVICE)
    o = nk.noise_attention(q, v, mu, sigma, per_sample, seed)
    grad_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    o.backward(grad_o)
    eps = nk.noise_eps(seed, B if per_sample else 1, noise_heads, T)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, v, sigma)]
    ref = reference(*leaves, eps)
    ref.backward(grad_o.to(F64))
    return (o, q.grad, v.grad, mu.grad, sigma.grad), (ref, *(t.grad for t in leaves))


def rel_err(a, b):
    return ((a.to(F64) - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("noise_heads,per_sample,D", [(3, False, 16), (3, True, 16), (1, False, 16), (1, True, 16),
                                                      (2, True, 64)])
@pytest.mark.slow
def test_float32_equals_the_float64_equations(nk, noise_heads, per_sample, D):
    """v2 (one eps and sigma per head) and v1 (one for all heads), per sample or shared by the batch: output and the
    gradients of q (its uses as query and as key), v and sigma against float64 with the eps the kernel drew; mu's
    gradient is 0 (it cancels in the softmax)."""
    H = noise_heads if noise_heads > 1 else 3
    got, ref = kernel_and_reference(nk, 2, H, 37 if D == 16 else 33, D, noise_heads, per_sample)
    o, dq, dv, dmu, dsigma = got
    for name, a, b in zip(("o", "dq", "dv", "dsigma"), (o, dq, dv, dsigma), ref):
        assert a.dtype == torch.float32 and rel_err(a, b) < 2e-5, (name, rel_err(a, b))
    assert torch.equal(dmu, torch.zeros_like(dmu))
    assert rel_err(dsigma, ref[3]) < 2e-5 and ref[3].abs().min() > 1e-3  # a gradient that could be wrong


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_the_sdpa_paths_rounding(nk, dtype):
    """bf16 / fp16 inputs, float32 accumulation: no further from the float64 equations than a few times the SDPA
    path's own error in the same dtype, on the same inputs."""
    B, H, T, D = 2, 3, 37, 16
    got, ref = kernel_and_reference(nk, B, H, T, D, H, False, dtype)
    # the SDPA path (model.py's) on the same inputs, eps and output gradient, against the same float64 equations
    q, v, mu, sigma = inputs(B, H, T, D, H, dtype)
    eps = nk.noise_eps(nk.draw_seed(DEVICE), 1, H, T).to(dtype)
    grad_o = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    o = causal_attention_learned_noise(q, q, v, mu, sigma, eps)
    o.backward(grad_o)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, v, sigma)]
    sdpa_ref = reference(*leaves, eps)
    sdpa_ref.backward(grad_o.to(F64))
    sdpa_errors = [rel_err(o, sdpa_ref)] + [rel_err(t.grad, leaf.grad) for t, leaf in zip((q, v, sigma), leaves)]
    kernel_results = (got[0], got[1], got[2], got[4])  # o, dq, dv, dsigma
    for name, a, b, sdpa_error in zip(("o", "dq", "dv", "dsigma"), kernel_results, ref, sdpa_errors):
        assert a.dtype == (torch.float32 if name == "dsigma" else dtype)
        # the interpreter rounds to bf16 by truncation (twice the error of round-to-nearest) where the GPU rounds
        assert rel_err(a, b) < 4 * sdpa_error + 4 * torch.finfo(dtype).eps, (name, rel_err(a, b), sdpa_error)


def test_causal_no_gradient_from_future_tokens(nk):
    """The outputs up to position t depend on no q or v after t: their gradients there are exactly 0, and changing
    the future leaves them unchanged."""
    q, v, mu, sigma = inputs(1, 2, 35, 16, 2)
    seed = nk.draw_seed(DEVICE)
    t = 20
    o = nk.noise_attention(q, v, mu, sigma, False, seed)
    o[:, :, :t + 1].sum().backward()
    assert torch.all(q.grad[:, :, t + 1:] == 0) and torch.all(v.grad[:, :, t + 1:] == 0)
    assert q.grad[:, :, :t + 1].abs().min() > 0 and v.grad[:, :, :t + 1].abs().sum() > 0
    with torch.no_grad():
        q2, v2 = q.clone(), v.clone()
        q2[:, :, t + 1:] += 1.0
        v2[:, :, t + 1:] -= 1.0
        o2 = nk.noise_attention(q2, v2, mu, sigma, False, seed)
    assert torch.equal(o2[:, :, :t + 1], o[:, :, :t + 1].detach()) and not torch.equal(o2, o.detach())


def test_noise_is_standard_normal_and_independent(nk):
    """The visible entries of eps: mean 0, variance 1, N(0, 1) by a KS test, and uncorrelated across batch rows,
    heads, rows and columns (each |correlation| below 5 standard errors)."""
    B, n, T = 3, 4, 64
    eps = nk.noise_eps(nk.draw_seed(DEVICE), B, n, T).to(F64).cpu()
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    x = eps[..., visible].flatten()
    N = x.numel()
    assert abs(x.mean()) < 5 / math.sqrt(N) and abs(x.var() - 1) < 5 * math.sqrt(2 / N)
    xs = x.sort().values
    cdf = 0.5 * (1 + torch.erf(xs / math.sqrt(2)))
    ks = torch.maximum(torch.arange(1, N + 1, dtype=F64) / N - cdf, cdf - torch.arange(N, dtype=F64) / N).max()
    assert ks < 1.63 / math.sqrt(N)  # the 1 % critical value

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).sum() / (a.norm() * b.norm())).item(), a.numel()

    lower = torch.ones(T - 1, T - 1, dtype=torch.bool).tril()
    for a, b in [(eps[0], eps[1]), (eps[:, 0], eps[:, 1]), (eps[:, :, 1:, :-1], eps[:, :, :-1, :-1]),
                 (eps[:, :, 1:, 1:], eps[:, :, 1:, :-1])]:
        mask = visible if a.size(-1) == T else lower
        r, m = corr(a[..., mask], b[..., mask])
        assert abs(r) < 5 / math.sqrt(m), r
    # the draw per sample really is per sample, the shared one shared: batch rows of equal inputs
    q, v, mu, sigma = inputs(1, 2, 21, 16, 2)
    q, v = q.detach().expand(3, -1, -1, -1), v.detach().expand(3, -1, -1, -1)
    for per_sample in (False, True):
        o = nk.noise_attention(q, v, mu, sigma, per_sample)
        assert torch.equal(o[0], o[1]) != per_sample and torch.equal(o[0], o[2]) != per_sample


def test_same_seed_same_result(nk):
    """A seed replays the forward and backward bit for bit; another seed draws other noise; torch.manual_seed
    replays the seed draw (so train.py's per-micro-batch seeding and exact resume hold)."""
    def run(seed):
        q, v, mu, sigma = inputs(2, 2, 25, 16, 2)
        o = nk.noise_attention(q, v, mu, sigma, True, seed)
        o.pow(2).sum().backward()
        return [o.detach(), q.grad, v.grad, sigma.grad]

    seed = nk.draw_seed(DEVICE)
    a, b, c = run(seed), run(seed.clone()), run(seed + 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not any(torch.equal(x, y) for x, y in zip(a, c))
    torch.manual_seed(5)
    s1 = nk.draw_seed(DEVICE)
    torch.manual_seed(5)
    assert torch.equal(s1, nk.draw_seed(DEVICE))


# ----------------------------------------------------------------------------- in the model

def tiny_noiseformer(attn_type, noise_kernel, **overrides):
    torch.manual_seed(0)
    config = GPTConfig(block_size=32, vocab_size=37, n_layer=2, n_head=2, n_embd=32, bias=False, attn_type=attn_type,
                       noise_init_std=0.5, noise_kernel=noise_kernel, **overrides)
    return GPT(config).to(DEVICE)


def replay_kernel_noise(nk, reference_model, kernel_model, B, T):
    """Make reference_model (the SDPA path) draw, layer by layer, the eps that kernel_model's kernel draws after the
    same torch.manual_seed: each layer's seed is one torch.randint, in layer order."""
    seeds = [nk.draw_seed(DEVICE) for _ in kernel_model.transformer.h]
    for block, seed in zip(reference_model.transformer.h, seeds):
        attn = block.attn
        eps = nk.noise_eps(seed, B if attn.noise_per_sample else 1, attn.noise_mu.numel(), T)
        attn.draw_noise = lambda *args, eps=eps, **kwargs: eps


@pytest.mark.slow
@pytest.mark.parametrize("attn_type,per_sample", [("noiseformer_v2", False), ("noiseformer_v1", True)])
def test_training_step_equals_the_sdpa_path_with_the_same_eps(nk, attn_type, per_sample):
    """One SGD step of a 2-layer model with noise_kernel='triton' equals the SDPA path's given the same eps: loss,
    every parameter's gradient (mu's 0 from the cross-entropy, as there), the updated weights. (Not AdamW: its
    first step moves every weight by lr * sign(gradient), which rounding flips where a gradient is ~0.)"""
    B, T = 3, 29
    kernel = tiny_noiseformer(attn_type, "triton", noise_per_sample=per_sample)
    ref = tiny_noiseformer(attn_type, "sdpa", noise_per_sample=per_sample)
    ref.load_state_dict(kernel.state_dict())
    idx = torch.randint(0, 37, (B, T + 1), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    torch.manual_seed(11)
    replay_kernel_noise(nk, ref, kernel, B, T)
    losses = []
    for model in (kernel, ref):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch.manual_seed(11)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    params = dict(ref.named_parameters())
    for name, p in kernel.named_parameters():
        assert p.grad is not None and params[name].grad is not None, name
        assert torch.allclose(p.grad, params[name].grad, rtol=1e-4, atol=1e-6), name
        assert torch.allclose(p, params[name], rtol=1e-5, atol=1e-6), name
        if name.endswith("noise_sigma"):
            assert p.grad.abs().min() > 1e-4  # the noise's own gradient, not a zero that matches a zero
        if name.endswith("noise_mu"):
            assert torch.all(p.grad.abs() < 1e-6)


@pytest.mark.slow
def test_compiled_without_a_graph_break_equals_eager(nk):
    """torch.compile(fullgraph=True) takes the kernel as one op (a graph break would raise), and the compiled
    forward and backward equal eager's for the same seed."""
    model = tiny_noiseformer("noiseformer_v2", "triton")
    idx = torch.randint(0, 37, (2, 21), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for m in (model, compiled):
        model.zero_grad()
        torch.manual_seed(2)
        _, loss = m(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_where_the_kernel_cannot_run_the_sdpa_path_says_so_once(nk):
    """float64 (not a kernel dtype) and attention dropout: one warning each, naming the reason, and the SDPA path's
    result; decoding with a KV cache takes the SDPA path too (the kernel's scores are square)."""
    model = tiny_noiseformer("noiseformer_v2", "triton").to(F64)
    ref = tiny_noiseformer("noiseformer_v2", "sdpa").to(F64)
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (model, model, ref):
            torch.manual_seed(4)
            logits.append(m(idx)[0])
    said = [str(w.message) for w in caught if "noise_kernel='triton'" in str(w.message)]
    assert len(said) == 1 and "float32, float16 or bfloat16, not torch.float64" in said[0], said
    assert torch.equal(logits[0], logits[2])
    with pytest.warns(UserWarning, match=r"no attention dropout: with dropout=0.1 .* SDPA path"):
        tiny_noiseformer("noiseformer_v1", "triton", dropout=0.1)


def test_without_triton_the_model_says_so_and_trains_on_the_sdpa_path(tmp_path):
    """Where triton cannot be imported, noise_kernel='triton' builds a model that trains on the SDPA path, saying so
    in one line (a process in which `import triton` fails)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import warnings, torch; from model import GPT, GPTConfig\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    m = GPT(GPTConfig(block_size=16, vocab_size=11, n_layer=1, n_head=2, n_embd=16,"
            " attn_type='noiseformer_v2', noise_kernel='triton'))\n"
            "print(len(w), w[0].message)\n"
            "idx = torch.randint(0, 11, (2, 9)); m(idx[:, :-1], idx[:, 1:])[1].backward()\n"
            "print('sigma grad', bool(m.transformer.h[0].attn.noise_sigma.grad.abs().sum() > 0))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1 noise_kernel='triton': ") and "SDPA path" in lines[0] and "triton" in lines[0]
    assert lines[1] == "sigma grad True"


@pytest.mark.slow
def test_kernels_compile_for_an_h100(tmp_path):
    """What the interpreter cannot check (types, tile shapes, shared memory): triton compiles the three kernels for
    sm_90 down to ptxas, here without a GPU (.ci/triton_compile_check.py --quick, in a fresh Triton cache)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, os.path.join(root, ".ci", "triton_compile_check.py"), "--quick"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.count("\nok ") + out.stdout.startswith("ok ") == 3, out.stdout + out.stderr
    assert "sm_90: 0 of 3 failed" in out.stdout


def test_noise_kernel_setting_is_checked():
    with pytest.raises(ValueError, match=r"noise_kernel='cuda' must be 'sdpa' .* or 'triton'"):
        GPTConfig(attn_type="noiseformer_v2", noise_kernel="cuda")
    with pytest.raises(ValueError, match=r"noise_kernel='triton' is only used by attn_type noiseformer_v1"):
        GPTConfig(attn_type="base", noise_kernel="triton")
