"""denoised_gpt.memory_plan (bench.py --plan=True): the activation estimate against the tensor peak
torch.profiler measures on CPU for every attn_type, with activation checkpointing off and on, and the
per-GPU bookkeeping of DDP and FSDP."""
import pytest
import torch

from denoised_gpt.device import cpu_tensor_peak
from denoised_gpt.memory_plan import (activation_bytes, attention_activations, format_plan, matmul_weight_count, plan,
                                     plan_row)
from model import ATTENTION_TYPES, GPT, AttentionBase, GPTConfig

# small, but with every term of the estimate present: T a multiple of linear attention's chunk (64)
SIZE = dict(n_layer=3, n_head=4, n_embd=64, block_size=128, vocab_size=256, bias=False)
BATCH = 4


def estimate_and_measured_peak(config, checkpointing):
    """(activation_bytes' estimate, torch.profiler's tensor peak) of train.py's micro-step on CPU for GPT(config) at
    BATCH; the peak is None where this torch's profiler has no allocation trace."""
    torch.manual_seed(0)
    model = GPT(config).train()
    model.activation_checkpointing = checkpointing
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(config.vocab_size, (BATCH, config.block_size), generator=g) for _ in range(2))

    def step():  # train.py's micro-step on CPU: bf16 autocast, the fused loss, backward outside autocast
        torch.manual_seed(1)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            _, ce = model(x, y, return_logits=False)
            loss = ce + 5e-6 * model.kl_divergence()
        loss.backward()

    step()  # the gradients exist from now on: static memory, like the weights (and AdamW's state)
    measured = cpu_tensor_peak(step)
    return activation_bytes(config, BATCH, checkpointing, matmul_weight_count(model), fused_loss=True), measured


@pytest.mark.parametrize('checkpointing', [False, True], ids=['plain', 'checkpointed'])
@pytest.mark.parametrize('attn_type', list(ATTENTION_TYPES))
def test_activation_estimate_within_15_percent_of_the_measured_peak(attn_type, checkpointing):
    """Every variant the plan has a formula for (a softmax of score_inputs has one derived; another class is a row
    that says it has none, in bench.py's plan, and is skipped here naming where to add it)."""
    try:
        attention_activations(GPTConfig(**SIZE, attn_type=attn_type))
    except ValueError as e:
        pytest.skip(str(e))
    estimate, measured = estimate_and_measured_peak(GPTConfig(**SIZE, attn_type=attn_type), checkpointing)
    if measured is None:
        pytest.skip("this torch's profiler has no allocation trace")
    assert 0.85 < estimate / measured < 1.15, (estimate, measured, estimate / measured)


def test_checkpointing_and_fsdp_shrink_what_they_should():
    config = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=False)
    counts = (124_000_000, 85_000_000, 7_000_000)  # (parameters, blocks' matmul weights, one block): round figures
    ddp, fsdp = (plan_row(config, p, False, 8, counts=counts) for p in ('ddp', 'fsdp'))
    ddp_ckpt = plan_row(config, 'ddp', True, 8, counts=counts)
    assert ddp['param_bytes'] == 4 * 124e6 and ddp['adamw_bytes'] == 8 * 124e6 and ddp['gathered_bytes'] == 0
    assert fsdp['param_bytes'] == ddp['param_bytes'] / 8 and fsdp['grad_bytes'] == ddp['grad_bytes'] / 8
    assert fsdp['gathered_bytes'] > 0
    assert ddp['comm_bytes'] == pytest.approx(2 * 7 / 8 * 4 * 124e6)  # ring all-reduce of float32 gradients
    # 2 all-gathers of bf16 weights + 1 reduce-scatter of float32 gradients
    assert fsdp['comm_bytes'] == pytest.approx((2 * 2 + 4) * 7 / 8 * 124e6)
    # accumulating over 4 micro-batches: whole float32 gradients between them, 4 x the all-gathers
    fsdp4 = plan_row(config, 'fsdp', False, 8, counts=counts, micro_steps=4)
    assert fsdp4['grad_bytes'] == ddp['grad_bytes'] and fsdp4['param_bytes'] == fsdp['param_bytes']
    assert fsdp4['comm_bytes'] == pytest.approx((4 * 2 * 2 + 4) * 7 / 8 * 124e6)
    assert fsdp4['largest_micro_batch']['80'] < fsdp['largest_micro_batch']['80']
    # checkpointing keeps one float32 residual per block and token instead of ~34 bytes x n_embd
    assert ddp_ckpt['activation_bytes_per_sequence'] < ddp['activation_bytes_per_sequence'] / 3
    for row in (ddp, fsdp, ddp_ckpt):
        fits = row['largest_micro_batch']
        assert 0 < fits['40'] < fits['80'] < fits['96']
    assert ddp_ckpt['largest_micro_batch']['80'] > 3 * ddp['largest_micro_batch']['80']


def test_a_variant_the_plan_has_no_formula_for_gets_a_row_that_says_so(monkeypatch):
    """A new attention class registered in model.py (not derived from a planned one): bench.py --plan lists the
    other variants and says what the plan needs for it, instead of stopping."""
    class Unplanned(AttentionBase):
        def forward(self, x, cache=None):
            return self.c_proj(x)
    monkeypatch.setitem(ATTENTION_TYPES, 'unplanned', Unplanned)
    rows = plan(['base', 'unplanned'], {'gpt2': (12, 12, 768)}, 1024, 50304, True, 8)
    assert [r['attn_type'] for r in rows] == ['base'] * 4 + ['unplanned']
    assert rows[-1]['not_possible'].startswith("no activation formula for Unplanned: add one to ATTENTION_ACTIVATIONS")
    assert 'no activation formula for Unplanned' in format_plan(rows, 8, 0.9)
