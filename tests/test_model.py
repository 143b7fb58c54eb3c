"""Correctness of model.py against the spec (docs/attention.md).

The attention references in naive_attention.py are written from the equations only; here every
variant's module is compared with them in float64, and the whole GPT is checked for causality,
parameter counts, the NoiseFormer KL / gradient facts, gradients, KV-cache generation, config
validation, nanoGPT / Hugging Face compatibility and the optimizer's weight-decay groups.
CPU only, tiny configs.
"""
import dataclasses
import inspect
import math
import re

import pytest
import torch
from torch.nn import functional as F

from model import (ATTENTION_TYPES, GPT, GPTConfig, KVCache, NoiseFormerAttention,
                   TwoBranchAttention, causal_randn)
from naive_attention import (NAIVE, NAIVE_MAPS, PARAMETERS, MissingReference, diff_lambda, lambda_init_for,
                             noise_mu_sigma)

F64 = torch.float64
VARIANTS = list(ATTENTION_TYPES)  # every registered variant, each checked against its float64 reference
NOISE = [v for v in VARIANTS if issubclass(ATTENTION_TYPES[v], NoiseFormerAttention)]
DIFFERENTIAL = [v for v in VARIANTS if issubclass(ATTENTION_TYPES[v], TwoBranchAttention)]


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are tiny: a second intra-op thread only spins, and on a busy 2-core
    machine that makes this file several times slower. Restored for the other test files."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(attn_type, **overrides):
    args = dict(block_size=128, vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                bias=True, attn_type=attn_type)
    if attn_type == "dint_lowrank":
        args["lowrank_rank"] = 8
    args.update(overrides)
    return GPTConfig(**args)


def randomize_(model, seed=0):
    """Every parameter to a non-trivial random value (lambda vectors, norm weights and noise
    parameters included), so that no term of an equation can hide behind its initial value."""
    g = torch.Generator().manual_seed(seed)

    def randn(p, std, mean=0.0):
        return torch.randn(p.shape, generator=g, dtype=F64).to(p.dtype) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "noise_sigma":
                p.copy_(torch.rand(p.shape, generator=g, dtype=F64).to(p.dtype) * 0.7 + 0.3)
            elif leaf == "noise_logvar":
                p.copy_(randn(p, 0.5))
            elif leaf == "noise_mu":
                p.copy_(randn(p, 1.0))
            elif leaf.startswith("lambda_"):
                p.copy_(randn(p, 0.3))
            elif p.dim() == 1 and leaf == "weight":      # LayerNorm / RMSNorm weights
                p.copy_(randn(p, 0.3, 1.0))
            elif p.dim() == 1:                           # biases
                p.copy_(randn(p, 0.1))
            else:                                        # matmul weights and embeddings
                p.copy_(randn(p, 1.0 / math.sqrt(p.shape[1])))
    return model


def make_model(attn_type, seed=0, dtype=F64, randomize=True, **overrides):
    torch.manual_seed(seed)
    model = GPT(tiny_config(attn_type, **overrides)).to(dtype)
    if randomize:
        randomize_(model, seed)
    return model


def full_logits(model, idx):
    """Logits at every position: nanoGPT returns them only when targets are given."""
    logits, _ = model(idx, targets=idx)
    return logits


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def noise_shape(attn_type, B, H, T, per_sample):
    return (B if per_sample else 1, ATTENTION_TYPES[attn_type].noise_heads or H, T, T)


def naive_kwargs(attn_type, layer_index, config):
    kw = {}
    if attn_type in DIFFERENTIAL:
        kw["layer_index"] = layer_index
    if attn_type == "dint_lowrank":
        kw["score_divisor"] = config.lowrank_score_divisor
    return kw


# ----------------------------------------------------------------------------- the references

def test_every_registered_variant_has_its_float64_references():
    # the groups the tests below run over, derived from the classes: none may come out empty
    assert {"noiseformer_v1", "noiseformer_v2"} <= set(NOISE) and {"diff", "dint", "dint_lowrank"} <= set(DIFFERENTIAL)
    for attn_type in VARIANTS:
        assert callable(NAIVE[attn_type]) and callable(NAIVE_MAPS[attn_type]), attn_type
    assert list(NAIVE) == list(NAIVE_MAPS) == VARIANTS


def test_naive_base_reference_matches_sdpa():
    """The reference itself is checked once against torch's SDPA, so a wrong reference cannot
    silently agree with a wrong model."""
    model = make_model("base")
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 9, 32, dtype=F64)
    q, k, v = (t.view(2, 9, 4, 8).transpose(1, 2) for t in attn.c_attn(x).split(32, dim=2))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = attn.c_proj(y.transpose(1, 2).reshape(2, 9, 32))
    assert rel_err(NAIVE["base"](attn, x), expected) < 1e-13


# ----------------------------------------------------------------------------- 1. equal to naive

EQUALITY_CASES = [(v, {}) for v in VARIANTS] + [
    ("linear", {"linear_chunk_size": 16}),
    ("linear", {"linear_chunk_size": 7}),
    ("dint_lowrank", {"lowrank_score_divisor": 16.0}),
    ("dint_lowrank", {"n_head": 2}),
    ("dint_lowrank", {"n_head": 1}),
    ("diff", {"bias": False}),
    ("symmetric", {"bias": False}),
]


@pytest.mark.parametrize("attn_type,overrides", EQUALITY_CASES,
                         ids=[f"{v}-{o}" if o else v for v, o in EQUALITY_CASES])
def test_attention_equals_naive_float64(attn_type, overrides):
    if attn_type in NOISE:   # noise off here; the replayed-noise test below covers it on
        overrides = dict(overrides, noise_at_eval=False)
    model = make_model(attn_type, **overrides).eval()
    config = model.config
    for layer_index, block in enumerate(model.transformer.h):
        attn = block.attn
        for T in (1, 7, 64, 100):
            for B in (1, 3):
                x = torch.randn(B, T, config.n_embd, dtype=F64)
                with torch.no_grad():
                    y = attn(x)
                ref = NAIVE[attn_type](attn, x, **naive_kwargs(attn_type, layer_index, config))
                assert y.shape == (B, T, config.n_embd) and y.dtype == F64
                assert rel_err(y, ref) < 1e-10, (attn_type, layer_index, T, B, rel_err(y, ref))


NOISE_CASES = [(v, p, s) for v in NOISE for p in ("sigma", "logvar") for s in (False, True)]


@pytest.mark.parametrize("attn_type,noise_param,per_sample", NOISE_CASES)
def test_noiseformer_equals_naive_with_replayed_noise(attn_type, noise_param, per_sample):
    """Contract: eps = causal_randn(shape, dtype=x.dtype), shape (1 or B, 1 or H, T, T), one draw
    per layer per forward; re-seeding and drawing the same shape replays it."""
    model = make_model(attn_type, noise_param=noise_param, noise_per_sample=per_sample).train()
    H = model.config.n_head
    for block in model.transformer.h:
        attn = block.attn
        assert hasattr(attn, "noise_logvar" if noise_param == "logvar" else "noise_sigma")
        assert attn.noise_mu.shape == ((1,) if attn_type == "noiseformer_v1" else (H,))
        for T in (1, 7, 64, 100):
            for B in (1, 3):
                x = torch.randn(B, T, model.config.n_embd, dtype=F64)
                torch.manual_seed(1234)
                with torch.no_grad():
                    y = attn(x)
                torch.manual_seed(1234)
                eps = causal_randn(noise_shape(attn_type, B, H, T, per_sample), dtype=F64)
                ref = NAIVE[attn_type](attn, x, eps=eps)
                assert rel_err(y, ref) < 1e-10, (T, B, rel_err(y, ref))
                if T > 1:   # the noise really is in there
                    assert rel_err(NAIVE[attn_type](attn, x, eps=None), ref) > 1e-3


@pytest.mark.parametrize("T", [1, 2, 7, 64, 101])
def test_causal_randn_visible_entries_are_distinct_standard_normal_draws(T):
    """causal_randn draws half the numbers of torch.randn and places some of them twice: every
    entry the causal mask lets through must still be its own draw (no value seen twice in a head),
    N(0, 1) distributed; the hidden upper triangle is exactly 0 above the diagonal's block."""
    torch.manual_seed(0)
    eps = causal_randn((3, 5, T, T), dtype=F64)
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    seen = eps[..., visible]  # (3, 5, T (T + 1) / 2)
    for head in seen.reshape(-1, seen.size(-1)):
        assert head.unique().numel() == head.numel()
    h = (T + 1) // 2
    assert torch.all(eps[..., :h, h:] == 0)
    if T >= 64:  # a KS test of all visible entries against N(0, 1)
        x = seen.flatten().sort().values
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        n = x.numel()
        ks = torch.maximum(torch.arange(1, n + 1, dtype=F64) / n - cdf, cdf - torch.arange(n, dtype=F64) / n).max()
        assert ks < 1.63 / math.sqrt(n)  # the 1% critical value
        assert abs(x.mean()) < 5 / math.sqrt(n) and abs(x.std() - 1) < 5 / math.sqrt(n)


@pytest.mark.parametrize("attn_type", NOISE)
def test_noise_shared_across_batch_unless_per_sample(attn_type):
    for per_sample in (False, True):
        model = make_model(attn_type, noise_per_sample=per_sample).train()
        x = torch.randn(1, 12, 32, dtype=F64).expand(3, 12, 32).contiguous()
        with torch.no_grad():
            y = model.transformer.h[0].attn(x)
        same = torch.equal(y[0], y[1]) and torch.equal(y[0], y[2])
        assert same == (not per_sample)


@pytest.mark.parametrize("attn_type", NOISE)
def test_noise_switch_train_eval_noise_at_eval(attn_type):
    """Noise is applied when attn.training or config.noise_at_eval; off it is symmetric attention."""
    x = torch.randn(2, 10, 32, dtype=F64)
    for noise_at_eval in (True, False):
        model = make_model(attn_type, noise_at_eval=noise_at_eval)
        attn = model.transformer.h[1].attn
        for training in (True, False):
            model.train(training)
            torch.manual_seed(7)
            with torch.no_grad():
                y = attn(x)
            noisy = training or noise_at_eval
            torch.manual_seed(7)
            eps = causal_randn(noise_shape(attn_type, 2, 4, 10, False), dtype=F64) if noisy else None
            assert rel_err(y, NAIVE[attn_type](attn, x, eps=eps)) < 1e-10, (noise_at_eval, training)


# ----------------------------------------------------------------------------- 2. causality

@pytest.mark.parametrize("attn_type", VARIANTS)
def test_causal_whole_model(attn_type):
    model = make_model(attn_type).train()   # train(): noise on for noiseformer, held by re-seeding
    T, V = 24, model.config.vocab_size
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(99)
    ref = full_logits(model, idx).detach()
    assert ref.shape == (2, T, V)
    for t in (0, 1, 9, 16, T - 1):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1 + torch.arange(2)) % V
        torch.manual_seed(99)
        out = full_logits(model, changed).detach()
        if t > 0:
            assert (out[:, :t] - ref[:, :t]).abs().max().item() < 1e-12, t
        assert (out[:, t] - ref[:, t]).abs().max().item() > 1e-6, t   # the change is seen at t


@pytest.mark.parametrize("attn_type", ["base", "dint"])
def test_targets_none_returns_last_position(attn_type):
    model = make_model(attn_type).eval()
    idx = torch.randint(0, 61, (3, 11))
    logits, loss = model(idx)
    assert loss is None and logits.shape == (3, 1, 61)
    full, loss = model(idx, targets=idx)
    assert torch.allclose(logits[:, 0], full[:, -1], rtol=0, atol=1e-12)
    expected = torch.nn.functional.cross_entropy(full.reshape(-1, 61), idx.reshape(-1))
    assert torch.allclose(loss, expected, rtol=1e-12)


# ----------------------------------------------------------------------------- 3. parameter counts

def gpt2_small_count(attn_type, vocab_size=50304):
    """Parameter count derived from the spec (lm_head tied to wte, counted once): base's, plus each layer's own
    parameters by the variant's formula beside its float64 reference (naive_attention.PARAMETERS)."""
    L, H, C, block = 12, 12, 768, 1024
    layer = (2 * C                      # ln_1
             + 3 * C * C + 3 * C        # c_attn
             + C * C + C                # attn.c_proj
             + 2 * C                    # ln_2
             + 4 * C * C + 4 * C        # mlp.c_fc
             + 4 * C * C + C)           # mlp.c_proj
    base = vocab_size * C + block * C + L * layer + 2 * C   # wte, wpe, blocks, ln_f
    config = GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=block, vocab_size=vocab_size, bias=True,
                       attn_type=attn_type)
    try:
        return base + L * PARAMETERS[attn_type](config)
    except MissingReference as e:
        pytest.fail(str(e), pytrace=False)


def test_gpt2_small_formula_figures():
    base = gpt2_small_count("base")
    assert base == 124_475_904                                # padded vocab 50304 (GPTConfig default)
    assert gpt2_small_count("base", vocab_size=50257) == 124_439_808
    assert gpt2_small_count("symmetric") == base - 7_087_104
    assert round(100 * 7_087_104 / base, 2) == 5.69
    assert gpt2_small_count("noiseformer_v1") == base - 7_087_104 + 24
    assert gpt2_small_count("noiseformer_v2") == base - 7_087_104 + 288
    assert gpt2_small_count("diff") == gpt2_small_count("dint") == base + 4_608
    assert gpt2_small_count("dint_lowrank") == base + 12 * (4 * 768 * 32 + 4 * 64 + 64) == base + 1_183_488
    assert gpt2_small_count("linear") == base


def test_estimate_mfu_palm_flops_and_nanogpt_call():
    """nanoGPT's GPT-2 small figure: 6N + 12 L H Q T FLOPs per token at N = 124M (non-embedding
    count), T = 1024. The scripts pass their device's peak; the two-argument call takes nanoGPT's
    own assumption, an A100's bfloat16 peak (312e12 FLOP/s)."""
    config = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=True)
    model = build_on_meta(config)
    n = model.get_num_params()
    per_token = 6 * n + 12 * 12 * 12 * 64 * 1024
    assert per_token == 6 * 123_689_472 + 113_246_208  # N = 124,475,904 - 1024 * 768 (wpe)
    # 5 x 12 sequences of 1024 tokens in 0.5 s against a 1 PFLOP/s peak
    assert model.estimate_mfu(60, 0.5, 1e15) == pytest.approx(per_token * 1024 * 60 / 0.5 / 1e15, rel=1e-12)
    assert model.estimate_mfu(60, 0.5) == pytest.approx(per_token * 1024 * 60 / 0.5 / 312e12, rel=1e-12)
    tiny = make_model("base", dtype=torch.float32, randomize=False)
    assert tiny.estimate_mfu(4, 0.1) == tiny.estimate_mfu(4, 0.1, 312e12)
    # query/key heads of 256: the scores cost 6 L H 256 T, the values' product 6 L H 64 T
    wide = build_on_meta(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304,
                                   bias=True, qk_head_size=256))
    per_token = 6 * wide.get_num_params() + 6 * 12 * 12 * (256 + 64) * 1024
    assert wide.estimate_mfu(60, 0.5, 1e15) == pytest.approx(per_token * 1024 * 60 / 0.5 / 1e15, rel=1e-12)


def build_on_meta(config):
    with torch.device("meta"):
        return GPT(config)


# the padded vocabulary (GPTConfig's default) for every variant; GPT-2's own 50257 only shifts wte
COUNT_CASES = [(v, 50304) for v in VARIANTS] + [("base", 50257), ("dint_lowrank", 50257)]


@pytest.mark.parametrize("attn_type,vocab_size", COUNT_CASES)
def test_parameter_count_gpt2_small(attn_type, vocab_size):
    """Built on the meta device: the real model code, no 124M-parameter allocation."""
    config = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=vocab_size,
                       bias=True, attn_type=attn_type)
    model = build_on_meta(config)
    assert model.lm_head.weight.device.type == "meta"
    n = sum(p.numel() for p in model.parameters())
    assert n == gpt2_small_count(attn_type, vocab_size=vocab_size), n
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.get_num_params(non_embedding=False) == n
    assert model.get_num_params() == n - 1024 * 768          # nanoGPT: wpe not counted


# ----------------------------------------------------------------------------- NoiseFormer facts

def closed_form_kl(model):
    total, terms = torch.zeros((), dtype=F64), 0
    for block in model.transformer.h:
        mu, sigma = noise_mu_sigma(block.attn)
        total = total + (0.5 * (mu ** 2 + sigma ** 2 - torch.log(sigma ** 2) - 1)).sum()
        terms += mu.numel()
    return total, terms


@pytest.mark.parametrize("noise_param", ["sigma", "logvar"])
@pytest.mark.parametrize("attn_type", NOISE)
def test_kl_divergence_closed_form(attn_type, noise_param):
    model = make_model(attn_type, noise_param=noise_param, n_layer=3)
    expected, terms = closed_form_kl(model)
    assert terms == (3 if attn_type == "noiseformer_v1" else 3 * 4)
    kl = model.kl_divergence()
    assert kl.dim() == 0 and kl.requires_grad
    assert abs(kl.item() - expected.item()) < 1e-12 * max(1.0, abs(expected.item()))
    per_layer = sum(block.attn.kl_divergence() for block in model.transformer.h)
    assert abs(per_layer.item() - expected.item()) < 1e-12 * max(1.0, abs(expected.item()))
    # sigma exactly 0 must still give a finite KL and gradient (spec: guard log(sigma^2))
    if noise_param == "sigma":
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.noise_sigma.zero_()
        kl = model.kl_divergence()
        assert torch.isfinite(kl)
        kl.backward()
        assert all(torch.isfinite(b.attn.noise_sigma.grad).all() for b in model.transformer.h)


@pytest.mark.parametrize("attn_type", ["base", "diff", "linear"])
def test_kl_divergence_zero_without_noise(attn_type):
    kl = make_model(attn_type).kl_divergence()
    assert torch.is_tensor(kl) and kl.dim() == 0 and kl.item() == 0.0


@pytest.mark.parametrize("noise_param", ["sigma", "logvar"])
@pytest.mark.parametrize("attn_type", NOISE)
def test_cross_entropy_gradient_zero_for_mu_not_sigma(attn_type, noise_param):
    """softmax is invariant to a constant added to a whole row: dCE/dmu == 0, dCE/dsigma != 0."""
    model = make_model(attn_type, noise_param=noise_param).train()
    idx = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    _, loss = model(idx, targets=idx)
    loss.backward()
    scale_name = "noise_logvar" if noise_param == "logvar" else "noise_sigma"
    for block in model.transformer.h:
        attn = block.attn
        assert attn.noise_mu.grad is not None
        assert attn.noise_mu.grad.abs().max().item() < 1e-12
        assert getattr(attn, scale_name).grad.abs().min().item() > 1e-8


@pytest.mark.parametrize("attn_type", NOISE)
def test_noise_off_at_eval_is_exactly_symmetric(attn_type):
    noisy = make_model(attn_type, noise_at_eval=False)
    symmetric = make_model("symmetric", seed=1)
    missing, unexpected = symmetric.load_state_dict(noisy.state_dict(), strict=False)
    assert missing == []
    assert unexpected and all(re.search(r"\.noise_(mu|sigma|logvar)$", k) for k in unexpected)
    idx = torch.randint(0, 61, (2, 30))
    noisy.eval(), symmetric.eval()
    with torch.no_grad():
        a, b = full_logits(noisy, idx), full_logits(symmetric, idx)
    assert torch.equal(a, b), (a - b).abs().max().item()
    noisy.train()                                     # training always has the noise
    with torch.no_grad():
        assert (full_logits(noisy, idx) - b).abs().max().item() > 1e-6


# ----------------------------------------------------------------------------- lambda_init

@pytest.mark.parametrize("attn_type", DIFFERENTIAL)
def test_lambda_init_schedule(attn_type):
    model = make_model(attn_type, randomize=False, n_layer=12)
    values = [block.attn.lambda_init for block in model.transformer.h]
    assert f"{values[0]:.4f}" == "0.2000" and f"{values[-1]:.4f}" == "0.7779"
    for i, value in enumerate(values):
        assert isinstance(value, float)
        assert abs(value - (0.8 - 0.6 * math.exp(-0.3 * i))) < 1e-15
        assert abs(value - lambda_init_for(i)) < 1e-15


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("attn_type", VARIANTS)
def test_gradients_finite_for_every_parameter(attn_type):
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(2))
    for randomize in (False, True):          # the variant's own init (float32), then random weights
        model = make_model(attn_type, dtype=torch.float32, randomize=randomize).train()
        torch.manual_seed(0)
        _, loss = model(idx, targets=idx)
        (loss + model.kl_divergence()).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name
            if randomize:                    # every tensor moves (mu through the KL term)
                assert p.grad.abs().max().item() > 0, name


# ----------------------------------------------------------------------------- KV-cache generation

GEN_VARIANTS = [(v, {}) for v in VARIANTS if v not in NOISE] + [
    (v, {"noise_at_eval": False}) for v in NOISE]
GEN_CASES = [  # (prompt length, new tokens, block_size, temperature, top_k)
    (5, 12, 32, 0.8, 5),       # within the block
    (5, 30, 16, 1.0, None),    # runs past block_size while generating
    (20, 6, 16, 0.7, 10),      # the prompt alone is longer than the block
]


@pytest.mark.parametrize("case", GEN_CASES, ids=["within", "past-block", "long-prompt"])
@pytest.mark.parametrize("attn_type,overrides", GEN_VARIANTS, ids=[v for v, _ in GEN_VARIANTS])
def test_kv_cache_generation_equals_cache_free(attn_type, overrides, case):
    prompt_len, new, block, temperature, top_k = case
    if "linear_chunk_size" in ATTENTION_TYPES[attn_type].config_fields:
        overrides = {**overrides, "linear_chunk_size": 4}  # chunk boundaries inside the prompt and the generation
    model = make_model(attn_type, block_size=block, **overrides)
    model.eval()
    prompt = torch.randint(0, 61, (2, prompt_len), generator=torch.Generator().manual_seed(4))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(2024)
        with torch.no_grad():
            outs.append(model.generate(prompt.clone(), new, temperature=temperature, top_k=top_k,
                                       use_cache=use_cache))
    with_cache, without = outs
    assert with_cache.shape == (2, prompt_len + new)
    assert torch.equal(with_cache[:, :prompt_len], prompt)
    assert torch.equal(with_cache, without), (with_cache, without)


@pytest.mark.parametrize("attn_type", NOISE)
def test_generation_with_noise_runs(attn_type):
    """At temperature 0 the sampling is an argmax, so the noise is the only randomness: with
    noise_at_eval (the default) the seed changes the tokens and the same seed repeats them; with
    noise_at_eval=False every seed gives the same tokens. The prompt is always kept as the prefix."""
    prompt = torch.randint(0, 61, (2, 3), generator=torch.Generator().manual_seed(9))

    def generations(model, seeds):
        outs = []
        for seed in seeds:
            torch.manual_seed(seed)
            out = model.generate(prompt.clone(), 20, temperature=0)
            assert out.shape == (2, 23) and int(out.max()) < 61
            assert torch.equal(out[:, :3], prompt)
            outs.append(out)
        return outs

    noisy = make_model(attn_type, block_size=16).eval()          # noise_at_eval=True
    assert noisy.transformer.h[0].attn.noise_at_eval
    outs = generations(noisy, (0, 1, 2, 0))
    assert torch.equal(outs[0], outs[3])                           # the same seed, the same noise
    assert not torch.equal(outs[0], outs[1]) or not torch.equal(outs[0], outs[2]), outs
    quiet = make_model(attn_type, block_size=16, noise_at_eval=False).eval()
    outs = generations(quiet, (0, 1, 2))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_generate_default_uses_cache_and_matches():
    """The contract's default is use_cache=True: the default call decodes through one KVCache
    (the prompt once, then one token per forward, until the sequence outgrows block_size and
    each step recomputes the window without a cache) and gives the cache-free call's tokens."""
    assert inspect.signature(GPT.generate).parameters["use_cache"].default is True
    model = make_model("dint", block_size=16).eval()
    prompt = torch.randint(0, 61, (1, 4), generator=torch.Generator().manual_seed(7))
    calls = []   # (input length, kv_cache) of every forward

    def record(module, args, kwargs):
        calls.append((args[0].size(1), kwargs.get("kv_cache")))
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        torch.manual_seed(5)
        a = model.generate(prompt, 20, temperature=0.9, top_k=8)
        default_calls = calls[:]
        calls.clear()
        torch.manual_seed(5)
        b = model.generate(prompt, 20, temperature=0.9, top_k=8, use_cache=False)
    finally:
        handle.remove()
    assert torch.equal(a, b)
    # 4 + 12 = 16 = block_size tokens through the cache; the last 7 steps crop to 16 without one
    assert [t for t, _ in default_calls] == [4] + [1] * 12 + [16] * 7
    cache = default_calls[0][1]
    assert isinstance(cache, KVCache) and cache.length == 16
    assert all(c is cache for _, c in default_calls[:13]) and all(c is None for _, c in default_calls[13:])
    assert [t for t, _ in calls] == [min(n, 16) for n in range(4, 24)]
    assert all(c is None for _, c in calls)


# ----------------------------------------------------------------------------- bad configs

BAD_CONFIGS = [
    (dict(attn_type="noiseformer2"), r"attn_type[\s\S]*noiseformer_v2"),
    (dict(attn_type="diff", n_head=3, n_embd=48), r"n_head"),
    (dict(attn_type="dint", n_head=5, n_embd=40), r"n_head"),
    (dict(attn_type="base", lowrank_rank=16), r"lowrank_rank"),
    (dict(attn_type="diff", noise_param="logvar"), r"noise_param"),
    (dict(attn_type="base", n_embd=30, n_head=4), r"n_embd"),
    (dict(attn_type="symmetric", noise_per_sample=True), r"noise_per_sample"),
    (dict(attn_type="linear", noise_init_std=0.02), r"noise_init_std"),
    (dict(attn_type="dint", lowrank_score_divisor=16.0), r"lowrank_score_divisor"),
    (dict(attn_type="base", linear_chunk_size=32), r"linear_chunk_size"),
    (dict(attn_type="diff", noise_at_eval=False), r"noise_at_eval"),
    (dict(attn_type="noiseformer_v1", noise_param="std"), r"noise_param"),
]


@pytest.mark.parametrize("kwargs,pattern", BAD_CONFIGS, ids=[str(k) for k, _ in BAD_CONFIGS])
def test_bad_config_raises_naming_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GPTConfig(**kwargs)


OUT_OF_RANGE_CONFIGS = [  # each was accepted, to fail later as a torch error or nan losses
    (dict(attn_type="noiseformer_v1", noise_init_std=-1), "noise_init_std=-1 must not be negative"),
    (dict(attn_type="noiseformer_v2", noise_init_std=-0.01), "noise_init_std=-0.01 must not be negative"),
    (dict(attn_type="noiseformer_v2", noise_init_std=math.nan), "noise_init_std=nan must be a finite number"),
    (dict(attn_type="noiseformer_v1", noise_init_std=math.inf), "noise_init_std=inf must be a finite number"),
    (dict(dropout=-0.1), r"dropout=-0.1 must be in \[0, 1\)"),
    (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
    (dict(dropout=math.nan), "dropout=nan must be a finite number"),
    (dict(attn_type="dint_lowrank", lowrank_score_divisor=math.nan), "lowrank_score_divisor=nan must be a finite"),
    (dict(attn_type="dint_lowrank", lowrank_score_divisor=math.inf), "lowrank_score_divisor=inf must be a finite"),
    (dict(block_size=0), "block_size=0 must be at least 1"),
    (dict(vocab_size=-5), "vocab_size=-5 must be at least 1"),
    (dict(n_layer=0), "n_layer=0 must be at least 1"),
    (dict(n_layer=12 * 10 ** 9), "n_layer=12000000000 is over 10,000 layers"),
    (dict(n_layer=2 ** 63), f"n_layer={2 ** 63} is over 10,000 layers"),
    (dict(n_embd=0), "n_embd=0 must be at least 1"),
    (dict(n_embd=-24), "n_embd=-24 must be at least 1"),
]


@pytest.mark.parametrize("kwargs,message", OUT_OF_RANGE_CONFIGS, ids=[str(k) for k, _ in OUT_OF_RANGE_CONFIGS])
def test_out_of_range_config_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as e:
        GPTConfig(**kwargs)
    assert re.match(rf"GPTConfig\.{message}", str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_unknown_attn_type_lists_valid_and_suggests():
    with pytest.raises(ValueError) as info:
        GPTConfig(attn_type="noiseformer2")
    message = str(info.value)
    assert re.search(r"did you mean", message, re.I) and "noiseformer_v2" in message
    for name in VARIANTS:
        assert name in message


GOOD_CONFIGS = [
    dict(attn_type="dint_lowrank", n_head=3, n_embd=48),    # odd heads fine: one per base head
    dict(attn_type="noiseformer_v2", noise_param="logvar", noise_per_sample=True),
    dict(attn_type="linear", linear_chunk_size=32),
    dict(attn_type="dint_lowrank", lowrank_rank=16, lowrank_score_divisor=16.0),
]


@pytest.mark.parametrize("kwargs", GOOD_CONFIGS, ids=[str(k) for k in GOOD_CONFIGS])
def test_good_configs_accepted(kwargs):
    """An accepted config holds what was given, and the model built from it has the registry's
    attention class in every layer, set up with those settings."""
    from model import (ATTENTION_TYPES, LinearAttention, LowRankDintAttention, NoiseFormerV2Attention)
    config = GPTConfig(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value, name
    # a small model of the same attention settings: one layer per check is enough
    model = GPT(dataclasses.replace(config, n_layer=2, block_size=8, vocab_size=61))
    expected = {"dint_lowrank": LowRankDintAttention, "noiseformer_v2": NoiseFormerV2Attention,
                "linear": LinearAttention}[config.attn_type]
    assert ATTENTION_TYPES[config.attn_type] is expected
    C, d = config.n_embd, config.n_embd // config.n_head
    for block in model.transformer.h:
        attn = block.attn
        assert type(attn) is expected
        if config.attn_type == "dint_lowrank":
            r = config.lowrank_rank
            assert attn.n_diff_heads == config.n_head and attn.value_size == d
            for down, up in ((attn.q2_down, attn.q2_up), (attn.k2_down, attn.k2_up)):
                assert down.weight.shape == (r, C) and up.weight.shape == (C, r)
            assert attn.branch2_scale == pytest.approx(math.sqrt(config.lowrank_score_divisor) / math.sqrt(d))
        elif config.attn_type == "noiseformer_v2":
            assert attn.noise_param == "logvar" and attn.noise_per_sample
            assert attn.noise_logvar.shape == attn.noise_mu.shape == (config.n_head,)
            assert not hasattr(attn, "noise_sigma")
        else:
            assert attn.chunk_size == 32


# ----------------------------------------------------------------------------- nanoGPT compatibility

def nanogpt_keys(n_layer, bias):
    keys = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(n_layer):
        for mod in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            keys.append(f"transformer.h.{i}.{mod}.weight")
            if bias:
                keys.append(f"transformer.h.{i}.{mod}.bias")
    keys.append("transformer.ln_f.weight")
    if bias:
        keys.append("transformer.ln_f.bias")
    return keys + ["lm_head.weight"]


@pytest.mark.parametrize("bias", [True, False])
def test_base_state_dict_is_nanogpt(bias):
    C, V, block = 32, 61, 128
    model = GPT(tiny_config("base", bias=bias))
    sd = model.state_dict()
    assert sorted(sd) == sorted(nanogpt_keys(2, bias))
    shapes = {"wte.weight": (V, C), "wpe.weight": (block, C), "c_attn.weight": (3 * C, C),
              "c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C), "c_fc.weight": (4 * C, C),
              "mlp.c_proj.weight": (C, 4 * C), "lm_head.weight": (V, C), "ln_1.weight": (C,)}
    for key, tensor in sd.items():
        for suffix, shape in shapes.items():
            if key.endswith(suffix):
                assert tuple(tensor.shape) == shape, key


def save_tiny_hf_gpt2(path, activation_function="gelu_new"):
    """A small random GPT-2 saved by transformers; weights moved far from init so logits are O(1).
    'gelu_new' (tanh approximation) is GPT-2's own activation and transformers' default."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=48, n_layer=2,
                                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        bos_token_id=0, eos_token_id=0,
                                        activation_function=activation_function)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 0.3))
    hf.save_pretrained(path)
    return hf


def test_from_pretrained_local_hf_checkpoint(tmp_path):
    """GPT.from_pretrained(<local dir>) gives Hugging Face's logits. The checkpoint uses exact GELU:
    like nanoGPT, model.py uses exact GELU everywhere, while OpenAI's GPT-2 checkpoints declare
    the tanh approximation ('gelu_new'), a known difference of ~1e-3 in the logits (docs/attention.md)."""
    hf = save_tiny_hf_gpt2(tmp_path, "gelu")
    model = GPT.from_pretrained(str(tmp_path)).eval()
    assert model.config.attn_type == "base"
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd) == (2, 4, 48)
    assert (model.config.vocab_size, model.config.block_size) == (97, 64)
    assert model.lm_head.weight is model.transformer.wte.weight and not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.transformer.h[1].attn.c_attn.weight, hf.transformer.h[1].attn.c_attn.weight.t())
    idx = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        ours = full_logits(model, idx)
        theirs = hf(idx).logits
    assert theirs.abs().max() > 0.5
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (ours - theirs).abs().max().item()


# ----------------------------------------------------------------------------- dint_lowrank from base

LOWRANK_NEW = {"attn.q2_down.weight", "attn.q2_up.weight", "attn.k2_down.weight",
               "attn.k2_up.weight", "attn.lambda_q1", "attn.lambda_k1", "attn.lambda_q2",
               "attn.lambda_k2", "attn.head_norm.weight"}


def test_dint_lowrank_loads_base_weights():
    base = make_model("base", seed=3)
    lowrank = make_model("dint_lowrank", seed=4)
    # a nanoGPT checkpoint saved from a torch.compile'd model carries the '_orig_mod.' prefix
    sd = {"_orig_mod." + k: v for k, v in base.state_dict().items()}
    new = lowrank.load_base_weights(sd)
    assert set(new) == {f"transformer.h.{i}.{k}" for i in range(2) for k in LOWRANK_NEW}
    own = lowrank.state_dict()
    for key, value in base.state_dict().items():
        assert torch.equal(own[key], value), key
    assert lowrank.lm_head.weight is lowrank.transformer.wte.weight
    # the first branch of every differential head is exactly the base head's attention
    attn = lowrank.transformer.h[1].attn
    assert attn.c_attn.weight.shape == base.transformer.h[1].attn.c_attn.weight.shape
    x = torch.randn(2, 9, 32, dtype=F64)
    ref = NAIVE["dint_lowrank"](attn, x, layer_index=1, score_divisor=81.0)
    assert rel_err(attn(x).detach(), ref) < 1e-10


@pytest.mark.parametrize("attn_type", ["symmetric", "noiseformer_v1"])
def test_base_weights_that_do_not_fit_raise(attn_type):
    model = make_model(attn_type)
    with pytest.raises(ValueError, match=r"c_attn"):
        model.load_base_weights(make_model("base").state_dict())


def test_from_pretrained_into_dint_lowrank(tmp_path):
    hf = save_tiny_hf_gpt2(tmp_path)
    model = GPT.from_pretrained(str(tmp_path), override_args={"attn_type": "dint_lowrank"})
    assert model.config.attn_type == "dint_lowrank"
    hf_sd = hf.state_dict()
    for i, block in enumerate(model.transformer.h):
        # transformers' Conv1D stores (in, out): the transpose of nn.Linear's weight
        assert torch.equal(block.attn.c_attn.weight, hf_sd[f"transformer.h.{i}.attn.c_attn.weight"].t())
        assert torch.equal(block.mlp.c_fc.bias, hf_sd[f"transformer.h.{i}.mlp.c_fc.bias"])
        assert block.attn.q2_down.weight.shape == (model.config.lowrank_rank, 48)
    assert torch.equal(model.transformer.wte.weight, hf_sd["transformer.wte.weight"])
    idx = torch.randint(0, 97, (1, 20))
    logits, _ = model(idx, targets=idx)
    assert torch.isfinite(logits).all()


# ----------------------------------------------------------------------------- optimizer groups

@pytest.mark.parametrize("attn_type", VARIANTS)
def test_configure_optimizers_decay_groups(attn_type):
    model = make_model(attn_type, dtype=torch.float32, randomize=False)
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    all_ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(all_ids) == len(set(all_ids))                      # nothing twice
    assert set(all_ids) == {id(p) for p in model.parameters()}    # nothing left out
    assert decay | no_decay == set(all_ids)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert linear_weights and linear_weights <= decay
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith(("noise_", "lambda_")) or "norm" in name or "ln_" in name or p.dim() < 2:
            assert id(p) in no_decay, name
    for g in opt.param_groups:
        assert g["lr"] == 6e-4 and tuple(g["betas"]) == (0.9, 0.95)


# ----------------------------------------------------------------------------- crop_block_size

@pytest.mark.parametrize("attn_type", VARIANTS)
def test_crop_block_size_keeps_outputs(attn_type):
    model = make_model(attn_type, block_size=64).train()
    idx = torch.randint(0, 61, (2, 16))
    torch.manual_seed(3)
    before = full_logits(model, idx).detach()
    model.crop_block_size(16)
    assert model.config.block_size == 16 and model.transformer.wpe.weight.shape[0] == 16
    torch.manual_seed(3)
    after = full_logits(model, idx).detach()
    assert rel_err(after, before) < 1e-12


# ----------------------------------------------------------------------------- fused lm_head + CE

@pytest.mark.parametrize("ignore", [False, True])
def test_fused_cross_entropy_equals_reference_float64(ignore):
    """forward(..., return_logits=False) (chunked lm_head + cross-entropy, training's path) gives
    F.cross_entropy's loss and every parameter's gradient, in float64, with ignored (-1) targets."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=40, vocab_size=97, n_layer=1, n_head=2, n_embd=16)
    idx = torch.randint(0, 97, (3, 40))
    targets = torch.randint(0, 97, (3, 40))
    if ignore:
        targets[:, ::3] = -1
    grads, losses = [], []
    for return_logits in (True, False):
        torch.manual_seed(1)
        model = GPT(cfg).double()
        logits, loss = model(idx, targets, return_logits=return_logits)
        assert (logits is None) == (not return_logits)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.allclose(losses[0], losses[1], rtol=1e-12, atol=0)
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-9, atol=1e-14), name


@pytest.mark.parametrize("chunk", [1, 7, 32, 500])
def test_fused_cross_entropy_any_chunk_equals_reference_float64(chunk):
    """The rows per chunk (32 on CPU, ~128 MiB of float32 rows on GPUs) never change the numbers:
    chunks of 1, a partial last chunk, and one chunk for all 120 rows give F.cross_entropy's loss
    and input / weight gradients."""
    from fused_loss import lm_head_cross_entropy
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, 16, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(97, 16, generator=g, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 97, (3, 40), generator=g)
    targets[:, ::5] = -1
    results = []
    for loss in (lm_head_cross_entropy(x, w, targets, chunk=chunk),
                 F.cross_entropy((x @ w.t()).view(-1, 97), targets.view(-1), ignore_index=-1)):
        results.append((loss, *torch.autograd.grad(loss, (x, w))))
    for new, ref in zip(*results):
        assert rel_err(new, ref) < 1e-12


def test_fused_cross_entropy_bf16_autocast_close_to_float32():
    """Under bf16 autocast the fused loss is as close to the float32 loss as F.cross_entropy's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=500, n_layer=1, n_head=2, n_embd=32))
    idx, targets = torch.randint(0, 500, (4, 32)), torch.randint(0, 500, (4, 32))
    with torch.no_grad():
        _, exact = model(idx, targets)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            _, ref = model(idx, targets)
            _, fused = model(idx, targets, return_logits=False)
    assert abs(fused - exact) <= 2 * abs(ref - exact) + 1e-6


@pytest.mark.parametrize("attn_type,overrides", [(a, {}) for a in VARIANTS if a not in NOISE]
                         + [(a, {"noise_param": p}) for a in NOISE for p in ("sigma", "logvar")])
def test_learned_values_per_layer_match_the_parameters(attn_type, overrides):
    """What train.py logs at each evaluation: sigma and mu per head (v2) or layer (v1) for NoiseFormer,
    lambda per layer for DIFF/DINT (the float64 references' own formulas), nothing for the others."""
    model = make_model(attn_type, n_layer=3, **overrides)
    values = model.learned_values()
    blocks = model.transformer.h
    if attn_type in NOISE:
        assert set(values) == {"sigma", "mu"}
        for i, block in enumerate(blocks):
            mu, sigma = noise_mu_sigma(block.attn)
            assert len(values["sigma"][i]) == (1 if attn_type == "noiseformer_v1" else 4)
            assert values["sigma"][i] == pytest.approx(sigma.tolist(), rel=1e-12)
            assert values["mu"][i] == pytest.approx(mu.tolist(), rel=1e-12)
    elif attn_type in DIFFERENTIAL:
        assert set(values) == {"lambda"}
        assert [v[0] for v in values["lambda"]] == pytest.approx(
            [diff_lambda(block.attn, i).item() for i, block in enumerate(blocks)], rel=1e-12)
    else:  # each value logged is one of the layer's own parameters (those base lacks), as it stands
        own = [[p.detach().flatten().tolist() for n, p in block.attn.named_parameters()
                if not n.startswith(("c_attn.", "c_proj."))] for block in blocks]
        assert bool(values) == bool(own[0]), (attn_type, sorted(values))
        for name, per_layer in values.items():
            assert len(per_layer) == len(blocks), name
            assert all(any(v == pytest.approx(p, rel=1e-12) for p in own[i]) for i, v in enumerate(per_layer)), name


# ----------------------------------------------------------------------------- fused paths: never SDPA's math path

def sdpa_kernels(fn):
    """Names of the SDPA implementations (aten ops) that fn() runs, forward and backward."""
    from torch.profiler import profile
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()
            if "scaled_dot_product" in e.key and e.key != "aten::scaled_dot_product_attention"}


@pytest.mark.parametrize("attn_type", VARIANTS)
def test_training_step_never_takes_sdpa_math_path(attn_type):
    """The math path builds and keeps the (B, H, T, T) scores: 2.4-3.4x base's step at block 1024
    on CPU. DIFF/DINT's 2d-wide values and NoiseFormer's differentiable noise mask both sent
    SDPA there; every softmax variant's forward + backward must stay on the fused kernel."""
    model = make_model(attn_type).train()
    idx = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(6))

    def step():
        _, loss = model(idx, targets=idx)
        (loss + model.kl_divergence()).backward()
    kernels = sdpa_kernels(step)
    if not kernels:
        pytest.skip(f"{attn_type} calls no SDPA kernel (explicit products): no math path to take")
    assert not any("math" in k for k in kernels), kernels


def test_wide_values_equal_one_wide_call_float64():
    """DIFF/DINT's split values give the one wide SDPA call's output and q, k, v gradients."""
    from model import causal_attention, causal_attention_wide_values
    g = torch.Generator().manual_seed(8)
    q, k = (torch.randn(2, 4, 37, 8, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 37, 16, generator=g, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 4, 37, 16, generator=g, dtype=F64)
    results = []
    for attend in (causal_attention_wide_values, causal_attention):
        out = attend(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, new, ref in zip(("out", "dq", "dk", "dv"), *results):
        assert rel_err(new, ref) < 1e-13, name


# (B, attention heads, noise heads, eps batch, t_q, t_k): v2, v1 (one eps for all heads),
# per-sample eps, several row chunks of NoiseScoreGradient, decoding (queries = the last keys)
NOISE_SHAPES = [(2, 4, 4, 1, 37, 37), (3, 4, 1, 3, 20, 20), (2, 4, 4, 2, 300, 300), (2, 4, 1, 1, 5, 140)]


@pytest.mark.parametrize("shape", NOISE_SHAPES, ids=["v2", "v1-per-sample", "chunks", "decoding"])
def test_learned_noise_equals_materialised_float64(shape):
    """The fused kernel + NoiseScoreGradient give the materialised reference's output and gradients
    of q, k, v, mu and sigma, for the same eps."""
    from model import NOISE_GRADIENT_ROWS, causal_attention_learned_noise
    B, H, n, Be, t_q, t_k = shape
    assert t_q <= NOISE_GRADIENT_ROWS or t_q % NOISE_GRADIENT_ROWS   # a partial last chunk
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, H, t_q, 8, generator=g, dtype=F64, requires_grad=True)
    k, v = (torch.randn(B, H, t_k, 8, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    mu = torch.randn(n, generator=g, dtype=F64, requires_grad=True)
    sigma = (torch.rand(n, generator=g, dtype=F64) + 0.3).requires_grad_()
    eps = torch.randn(Be, n, t_q, t_k, generator=g, dtype=F64)
    grad_out = torch.randn(B, H, t_q, 8, generator=g, dtype=F64)
    results = []
    for materialise in (False, True):
        out = causal_attention_learned_noise(q, k, v, mu, sigma, eps, materialise=materialise)
        results.append((out, *torch.autograd.grad(out, (q, k, v, mu, sigma), grad_out)))
    new, ref = results
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsigma"), new[:4] + new[5:], ref[:4] + ref[5:]):
        assert rel_err(a, b) < 1e-12, name
    assert new[5].abs().min() > 1e-3                      # sigma really gets a gradient
    assert ref[4].abs().max() < 1e-12 and new[4].abs().max() < 1e-12   # dL/dmu = 0 (row shift)


@pytest.mark.parametrize("attn_type,noise_param,per_sample", NOISE_CASES)
def test_noiseformer_training_step_equals_materialised_float64(attn_type, noise_param, per_sample):
    """Whole model, training mode, loss = CE + KL: the default path and the materialised reference
    (materialise_noise) give the same loss and every parameter's gradient (sigma or logvar, and mu
    through the KL term) for the same seed, i.e. the same noise draws; and the layer's output is
    the float64 reference's with the replayed eps, with grad enabled (the path training takes)."""
    idx = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(10))
    losses, grads = [], []
    for materialise in (False, True):
        model = make_model(attn_type, noise_param=noise_param, noise_per_sample=per_sample).train()
        for block in model.transformer.h:
            block.attn.materialise_noise = materialise
        torch.manual_seed(11)
        _, loss = model(idx, targets=idx)
        loss = loss + model.kl_divergence()
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=1e-13)
    for name, ref in grads[1].items():
        assert rel_err(grads[0][name], ref) < 1e-10, name
    attn = model.transformer.h[0].attn
    attn.materialise_noise = False
    x = torch.randn(3, 40, 32, dtype=F64, requires_grad=True)
    torch.manual_seed(12)
    y = attn(x)
    torch.manual_seed(12)
    eps = causal_randn(noise_shape(attn_type, 3, 4, 40, per_sample), dtype=F64)
    assert rel_err(y, NAIVE[attn_type](attn, x, eps=eps)) < 1e-10


@pytest.mark.parametrize("attn_type", VARIANTS)
def test_input_gradient_equals_naive_float64(attn_type):
    """d(output . g)/dx of each attention module equals autograd through the float64 reference
    equations (noise replayed), so the fused paths' backward is the equations' backward."""
    model = make_model(attn_type).train()
    attn = model.transformer.h[1].attn
    eps = None
    if attn_type in NOISE:
        torch.manual_seed(13)
        eps = causal_randn(noise_shape(attn_type, 2, 4, 50, False), dtype=F64)
    x = torch.randn(2, 50, 32, dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 50, 32, dtype=F64)
    torch.manual_seed(13)
    (dx,) = torch.autograd.grad(attn(x), x, grad_out)
    kwargs = {"eps": eps} if attn_type in NOISE else naive_kwargs(attn_type, 1, model.config)
    ref = NAIVE[attn_type](attn, x, **kwargs)
    (dx_ref,) = torch.autograd.grad(ref, x, grad_out)
    assert rel_err(dx, dx_ref) < 1e-10


def test_fused_cross_entropy_never_reads_back_from_the_device():
    """The fused loss's forward and backward queue work without waiting for the device (no value is read
    back to Python, which would stall a GPU every step), and rows without a target (-1) still add nothing:
    loss and gradients equal F.cross_entropy's in float64 with those rows handed to the op itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import fused_loss

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))  # e.g. 'aten.mm.default'
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 16, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(97, 16, generator=g, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 97, (50,), generator=g)
    targets[::3] = -1
    with Calls() as calls:  # the op's body as its kernel runs it, then its backward through autograd
        fused_loss.lm_head_ce_forward(x.detach(), w.detach(), targets, F64, 7, True)
        loss, _ = fused_loss._lm_head_ce(x, w, targets, F64, 7, True)
        grads = torch.autograd.grad(loss, (x, w))
    assert 'aten.mm.default' in calls.names  # the mode saw the op's work
    assert not {name for name in calls.names if name.startswith(('aten._local_scalar_dense.', 'aten.nonzero.',
                                                                 'aten.item.'))}, calls.names
    ref = F.cross_entropy(x @ w.t(), targets, ignore_index=-1)
    for new, want in zip((loss, *grads), (ref, *torch.autograd.grad(ref, (x, w)))):
        assert rel_err(new, want) < 1e-12

