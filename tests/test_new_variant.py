"""A variant added as docs/attention.md says (Adding a variant), one class and one registry line, reaches every
part of the project that loops over the variants, or is told in one line what it lacks. Two toys are registered
for each test and removed after it: `tempered`, softmax(Q K^T / (tau sqrt(d)) + M) V, whose attention is a
softmax of its own scores, so its maps and memory formula follow from its class; and `relu`, relu(Q K^T /
sqrt(d)) V averaged over the visible keys, which rewrites base's forward and so inherits none of what base's
softmax implies."""
import contextlib
import dataclasses
import json
import math
import pickle
import re
import string

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from denoised_gpt.evaluation.attention_noise import PARTS, attention_noise
from denoised_gpt.evaluation.entropy import attention_entropy
from denoised_gpt.hf_format import export
from denoised_gpt.memory_plan import ATTENTION_ACTIVATIONS, plan
from denoised_gpt.parallel import kl_layers
from helpers import NO_AUTOCAST, TINY_MODEL, run_script_in_process, tiny_checkpoint
from model import (ATTENTION_TYPES, GPT, AttentionBase, CausalSelfAttention, GPTConfig, LinearAttention,
                   append_to_cache, causal_attention, causal_mask, merge_heads)
from naive_attention import NAIVE, NAIVE_MAPS, MissingReference
from test_attention_noise import EXAMPLES, T, write_examples
from test_memory_plan import SIZE, estimate_and_measured_peak


class TemperedAttention(CausalSelfAttention):
    """tempered: softmax(Q K^T / (tau sqrt(d)) + M) V."""
    tau = 2.0

    def score_inputs(self, x):
        q, k, _ = self.queries_keys_values(x)
        return q, k, 1 / (self.tau * math.sqrt(q.size(-1))), None

    def forward(self, x, cache=None):
        q, k, v = self.queries_keys_values(x)
        k, v = append_to_cache(cache, k=k, v=v)
        scale = 1 / (self.tau * math.sqrt(q.size(-1)))
        return self.output(causal_attention(q, k, v, self.attn_dropout_p, scale=scale))


class ReluAttention(CausalSelfAttention):
    """relu: relu(Q K^T / sqrt(d)) over the visible keys, divided by their number, then V."""

    def weights(self, q, k):
        visible = causal_mask(q.size(-2), k.size(-2), q.device)
        scores = F.relu(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)))
        return scores.masked_fill(~visible, 0) / visible.sum(-1, keepdim=True)

    def forward(self, x, cache=None):
        q, k, v = self.queries_keys_values(x)
        k, v = append_to_cache(cache, k=k, v=v)
        return self.output(self.weights(q, k) @ v)

    def attention_maps(self, x):
        q, k, _ = self.queries_keys_values(x)
        return {'attn': self.weights(q, k)}


class UnmappedReluAttention(ReluAttention):
    attention_maps = AttentionBase.attention_maps  # what a variant that defines no maps of its own has


class PenalisedTemperedAttention(TemperedAttention):
    """tempered with a Gaussian prior on c_proj's weight, as a KL term: 0.5 |W|^2."""

    def kl_parameters(self):
        return [self.c_proj.weight]

    def kl_divergence(self):
        return 0.5 * self.c_proj.weight.square().sum()


class MixedAttention(CausalSelfAttention):
    """base whose queries pass through a learned (head size x head size) matrix: a parameter of the variant's
    own, outside the Linear / Embedding / LayerNorm modules, used in a matmul."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.q_mix = nn.Parameter(torch.eye(self.qk_head_size))

    def forward(self, x, cache=None):
        q, k, v = self.queries_keys_values(x)
        k, v = append_to_cache(cache, k=k, v=v)
        return self.output(causal_attention(q @ self.q_mix, k, v, self.attn_dropout_p))


TOYS = {'tempered': TemperedAttention, 'relu': ReluAttention}
TINY = dict(block_size=T, vocab_size=64, n_layer=2, n_head=4, n_embd=32, bias=True)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    for name, cls in TOYS.items():
        monkeypatch.setitem(ATTENTION_TYPES, name, cls)  # removed again after each test


def toy_model(attn_type, seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, 'attn_type': attn_type, **overrides}))


def one_line(message):
    return '\n' not in message and message.strip() == message


# ----------------------------------------------------------------------------------------------
# training and generation

@pytest.mark.parametrize('attn_type', list(TOYS))
def test_the_new_variant_trains_and_generates_with_its_cache(attn_type):
    model = toy_model(attn_type)
    assert all(type(block.attn) is TOYS[attn_type] for block in model.transformer.h)
    idx = torch.randint(0, 64, (4, T), generator=torch.Generator().manual_seed(1))
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')
    losses = []
    for _ in range(5):  # train.py's step: the fused loss plus the (here zero) KL term
        _, ce = model(idx[:, :-1], idx[:, 1:], return_logits=False)
        kl = model.kl_divergence()
        (ce + 5e-6 * kl).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(ce.item())
    assert kl.item() == 0 and kl_layers(model) == []
    assert losses[-1] < losses[0] - 0.1, losses
    model.eval()
    prompt = idx[:2, :3]
    with_cache = model.generate(prompt, 2 * T, temperature=0)  # past block_size: the window is recomputed
    assert with_cache.shape == (2, 3 + 2 * T)
    assert torch.equal(with_cache, model.generate(prompt, 2 * T, temperature=0, use_cache=False))


def test_the_new_variant_takes_the_config_fields_of_its_class():
    # relu is a CausalSelfAttention: it takes base's qk_head_size and refuses the noise settings
    assert toy_model('relu', qk_head_size=16).transformer.h[0].attn.c_attn.out_features == 2 * 4 * 16 + 32
    with pytest.raises(ValueError, match=r"noise_init_std=0\.5 is only used by attn_type noiseformer_v1 / "
                                         r"noiseformer_v2, but attn_type='relu'"):
        GPTConfig(attn_type='relu', noise_init_std=0.5)


def test_a_resumed_run_may_change_the_settings_a_class_calls_runtime_and_no_other():
    """runtime_fields names some of a class's own config_fields; a resume takes those (and dropout) from the new run
    and every other model setting from the checkpoint (resumed_model_args), whichever class declares them."""
    from denoised_gpt.training import RUNTIME_MODEL_ARGS, resumed_model_args
    for name, cls in ATTENTION_TYPES.items():
        assert set(cls.runtime_fields) <= set(cls.config_fields), name
    saved = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    for field in {f for cls in ATTENTION_TYPES.values() for f in cls.config_fields}:
        changed = {**saved, field: 'changed'}
        if field in RUNTIME_MODEL_ARGS:
            assert resumed_model_args(saved, changed, {field}, None, 'd', 'out')[field] == 'changed'
        else:
            with pytest.raises(ValueError, match=field):
                resumed_model_args(saved, changed, {field}, None, 'd', 'out')
    assert {'noise_at_eval', 'noise_kernel', 'linear_chunk_size'} <= set(RUNTIME_MODEL_ARGS)


def test_a_variant_s_kl_term_is_what_its_class_says(monkeypatch):
    monkeypatch.setitem(ATTENTION_TYPES, 'penalised', PenalisedTemperedAttention)
    model = toy_model('penalised')
    layers = [block.attn for block in model.transformer.h]
    expected = sum(0.5 * attn.c_proj.weight.square().sum() for attn in layers)
    assert expected > 0 and torch.allclose(model.kl_divergence(), expected)
    assert kl_layers(model) == layers  # what parallel='fsdp' sums over the ranks
    model.kl_divergence().backward()
    assert torch.allclose(layers[0].c_proj.weight.grad, layers[0].c_proj.weight)
    noisy = toy_model('noiseformer_v2')
    assert kl_layers(noisy) == [block.attn for block in noisy.transformer.h]


def test_sample_py_s_bf16_path_runs_a_variant_with_its_own_float_parameter(tmp_path, monkeypatch):
    """AttentionBase's dtype rule: sample.py holds the weights in bf16 and keeps the variant's own float32
    parameter working as training's autocast does (the matmul of bf16 queries and a float32 matrix)."""
    monkeypatch.setitem(ATTENTION_TYPES, 'mixed', MixedAttention)
    chars = (string.ascii_letters + string.digits + ' .')[:TINY_MODEL['vocab_size']]
    (tmp_path / 'data').mkdir()
    with open(tmp_path / 'data' / 'meta.pkl', 'wb') as f:  # nanoGPT's char-level vocabulary
        pickle.dump({'vocab_size': len(chars), 'itos': dict(enumerate(chars)),
                     'stoi': {c: i for i, c in enumerate(chars)}}, f)
    tiny_checkpoint(tmp_path / 'out', 'mixed', tmp_path / 'data')
    r = run_script_in_process('sample.py', [f"--out_dir={tmp_path / 'out'}", '--dtype=bfloat16', '--start=ab',
                                            '--max_new_tokens=8', '--num_samples=2', '--format=jsonl'])
    assert r.returncode == 0, r.stderr
    assert "weights held in bfloat16" in r.stderr
    completions = [json.loads(line)['completion'] for line in r.stdout.splitlines()]
    assert len(completions) == 2 and all(len(c) == 8 and set(c) <= set(chars) for c in completions), completions


# ----------------------------------------------------------------------------------------------
# analysis: attention maps, entropy, attention noise

@pytest.mark.parametrize('attn_type', list(TOYS))
def test_the_maps_are_the_weights_forward_multiplies_v_by(attn_type):
    attn = toy_model(attn_type).double().transformer.h[1].attn
    x = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a = attn.attention_maps(x)['attn']
    assert torch.all(a.triu(1) == 0)
    assert torch.allclose(attn.c_proj(merge_heads(a @ attn.value_heads(x))), attn(x), atol=1e-12)


def test_a_variant_whose_forward_is_not_the_softmax_of_its_scores_gets_no_softmax_maps(monkeypatch):
    assert TemperedAttention.softmax_of_scores() and not ReluAttention.softmax_of_scores()
    monkeypatch.setitem(ATTENTION_TYPES, 'unmapped', UnmappedReluAttention)
    attn = toy_model('unmapped').transformer.h[0].attn
    with pytest.raises(NotImplementedError) as e:
        attn.attention_maps(torch.randn(1, 5, 32))
    assert str(e.value).startswith("UnmappedReluAttention has no attention_maps: define them in model.py")
    assert one_line(str(e.value))


def test_entropy_and_attention_noise_read_the_new_variant(tmp_path):
    data = write_examples(tmp_path / 'data', EXAMPLES)
    idx = torch.tensor([t[:T] for t, _ in EXAMPLES])
    base = toy_model('base').double().eval()
    with torch.no_grad():
        base.transformer.h[0].attn.c_attn.weight.mul_(20)  # maps far from uniform
    tempered = toy_model('tempered').double().eval()
    tempered.load_state_dict(base.state_dict())  # base's weights: only the temperature differs
    entropy = {name: attention_entropy(m, [idx], contextlib.nullcontext())['attn'] for name, m in
               (('base', base), ('tempered', tempered))}
    # a temperature of 2 flattens every row: more entropy in each head of the sharpened layer
    assert all(t > b + 1e-3 for t, b in zip(entropy['tempered'][0], entropy['base'][0])), entropy

    def shares(model):  # (parts, layers, heads)
        result = attention_noise(model, str(data), 8, 'cpu', NO_AUTOCAST)['shares']
        return torch.tensor([result[part] for part in PARTS], dtype=torch.float64)
    at_tau = {}
    for tau in (1.0, 2.0):
        TemperedAttention.tau = tau
        try:
            at_tau[tau] = shares(tempered)
        finally:
            TemperedAttention.tau = 2.0
    # at tau = 1 the variant is base: the measure reads the class's own scores, whose temperature moves it
    assert torch.allclose(at_tau[1.0], shares(base), atol=1e-12)
    assert (at_tau[2.0][:2] - at_tau[1.0][:2]).abs().max() > 1e-3
    relu = shares(toy_model('relu').double().eval())
    assert torch.allclose(relu[:6].sum(0), torch.ones_like(relu[0]))  # the six parts split every row


# ----------------------------------------------------------------------------------------------
# the memory plan (bench.py --plan=True)

def test_the_plan_derives_the_softmax_variant_s_formula_and_names_what_relu_lacks():
    rows = plan(['base', 'tempered', 'relu'], {'gpt2': (12, 12, 768)}, 1024, 50304, True, 8)
    by_type = {}
    for row in rows:
        by_type.setdefault(row['attn_type'], []).append(row)
    # the same projections and one SDPA call: base's activations and parameters, row by row
    assert len(by_type['tempered']) == 4
    assert [{k: v for k, v in r.items() if k != 'attn_type'} for r in by_type['tempered']] == \
        [{k: v for k, v in r.items() if k != 'attn_type'} for r in by_type['base']]
    (relu,) = by_type['relu']
    assert relu['not_possible'].startswith("no activation formula for ReluAttention: add one to "
                                           "ATTENTION_ACTIVATIONS in denoised_gpt/memory_plan.py")
    assert one_line(relu['not_possible'])


def test_the_derived_formula_is_within_15_percent_of_the_measured_peak():
    estimate, measured = estimate_and_measured_peak(GPTConfig(**SIZE, attn_type='tempered'), False)
    if measured is None:
        pytest.skip("this torch's profiler has no allocation trace")
    assert 0.85 < estimate / measured < 1.15, (estimate, measured)


def test_a_class_that_rewrites_a_planned_forward_loses_its_formula(monkeypatch):
    class RewrittenLinear(LinearAttention):
        def forward(self, x, cache=None):  # another computation, so another memory
            return self.c_proj(x)
    assert LinearAttention in ATTENTION_ACTIVATIONS
    monkeypatch.setitem(ATTENTION_TYPES, 'rewritten', RewrittenLinear)
    (row,) = plan(['rewritten'], {'gpt2': (12, 12, 768)}, 1024, 50304, True, 8)
    assert row['not_possible'].startswith("no activation formula for RewrittenLinear")


# ----------------------------------------------------------------------------------------------
# compare.py, the Hugging Face export, the float64 references

def test_compare_s_default_sweep_is_every_registered_variant():
    # compare.py's default attn_types (every registered variant) as it names them when `chosen` lacks some
    r = run_script_in_process('compare.py', ["--chosen={'base': {'learning_rate': 1e-3}}", '--chosen_by=x'])
    assert r.returncode != 0
    listed = re.search(r"every attn_type of attn_types \(([^)]*)\)", r.stderr.strip().splitlines()[-1])
    assert listed and listed[1].split(', ') == list(ATTENTION_TYPES)
    assert listed[1].split(', ')[-len(TOYS):] == list(TOYS)  # the toys registered here are swept too


def test_the_hf_export_refuses_a_variant_its_copy_of_model_py_lacks(tmp_path):
    """An exported folder runs a copy of model.py, where a class registered from elsewhere is not: refused in
    one line before anything is written (a variant defined and registered in model.py exports as the others)."""
    model = toy_model('tempered')
    checkpoint = {'model': model.state_dict(), 'model_args': dataclasses.asdict(model.config), 'iter_num': 1,
                  'best_val_loss': 2.0}
    with pytest.raises(ValueError) as e:
        export(checkpoint, str(tmp_path / 'hf'))
    assert re.match(r"attn_type='tempered' \(\S*TemperedAttention\) is not registered in model\.py's ATTENTION_TYPES",
                    str(e.value)) and one_line(str(e.value)), str(e.value)
    assert not (tmp_path / 'hf').exists()


def test_the_float64_harness_names_the_reference_the_new_variant_lacks():
    assert list(NAIVE) == list(NAIVE_MAPS) == list(ATTENTION_TYPES)  # the registry, toys included
    for table, name in ((NAIVE, 'naive_tempered'), (NAIVE_MAPS, 'tempered_map')):
        with pytest.raises(MissingReference) as e:
            table['tempered']
        assert str(e.value).startswith(f"no float64 reference for attn_type='tempered': write {name}(attn, x, "
                                       f"eps=None)") and str(e.value).endswith("in tests/naive_attention.py")
        assert one_line(str(e.value))
    assert 'tempered' not in NAIVE and 'base' in NAIVE
