"""Activation checkpointing (GPT.activation_checkpointing, train.py --activation_checkpointing=True):
each block's forward runs again in the backward, and that changes no number: the loss and every
gradient equal the run without it, bitwise, for every attn_type (NoiseFormer's noise and dropout
draw the same numbers in the rerun, because torch.utils.checkpoint restores the RNG state)."""
import pytest
import torch

from helpers import TINY_MODEL, iter_losses, make_dataset, run_script_in_process, run_train, tiny_gpt, TINY
from model import ATTENTION_TYPES, NoiseFormerAttention


def count_block_forwards(model):
    """A list that grows by one at every block forward that starts (a rerun in the backward included:
    it stops as soon as it has what the backward needs, so a hook at the end of forward may not run)."""
    calls = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def loss_and_grads(model, x, y, checkpointing, autocast=False):
    model.activation_checkpointing = checkpointing
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # noise and dropout, the same in both runs (as train.py seeds each micro-batch)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        _, ce = model(x, y, return_logits=False)  # train.py's fused loss
        loss = ce + 5e-6 * model.kl_divergence()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [(a, 0.0, False) for a in ATTENTION_TYPES] + [
    ('base', 0.1, False), ('noiseformer_v1', 0.1, False), ('noiseformer_v2', 0.1, False), ('diff', 0.1, False),
    ('noiseformer_v2', 0.0, True), ('dint_lowrank', 0.0, True),  # bf16 autocast, train.py's CPU default
]


@pytest.mark.parametrize('attn_type, dropout, autocast', CASES)
def test_loss_and_gradients_equal_without_checkpointing(attn_type, dropout, autocast):
    model = tiny_gpt(attn_type, dropout=dropout, lowrank_rank=4).train()
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(TINY_MODEL['vocab_size'], (3, 24), generator=g) for _ in range(2))
    calls = count_block_forwards(model)
    loss, grads = loss_and_grads(model, x, y, checkpointing=False, autocast=autocast)
    assert len(calls) == 2  # one forward per block
    loss_ckpt, grads_ckpt = loss_and_grads(model, x, y, checkpointing=True, autocast=autocast)
    assert len(calls) == 2 + 4  # each block ran again in the backward: checkpointing was on
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert torch.equal(grads[name], grads_ckpt[name]), name
    # the noise and dropout are really random: another seed gives another loss (else this test proves little)
    if issubclass(ATTENTION_TYPES[attn_type], NoiseFormerAttention) or dropout > 0:
        torch.manual_seed(99)
        assert not torch.equal(model(x, y, return_logits=False)[1].detach(), loss)


@pytest.mark.parametrize('attn_type', ['base', 'noiseformer_v2', 'dint', 'linear'])
def test_evaluation_and_generation_do_not_recompute(attn_type):
    model = tiny_gpt(attn_type, lowrank_rank=4).eval()
    x = torch.randint(TINY_MODEL['vocab_size'], (2, 16), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for checkpointing in (False, True):
        model.activation_checkpointing = checkpointing
        calls = count_block_forwards(model) if checkpointing else []
        torch.manual_seed(5)
        logits, loss = model(x, x)
        torch.manual_seed(6)
        tokens = model.generate(x[:1, :4], 6, temperature=1.0)
        outputs[checkpointing] = logits, loss, tokens
    # eval mode: plain forwards, once per block (evaluation 2 + generation 6 x 2 blocks), the same numbers
    assert len(calls) == 2 + 6 * 2
    for a, b in zip(outputs[False], outputs[True]):
        assert torch.equal(a, b)
    # training mode without gradients (no backward to rerun for): no checkpoint either
    model.train()
    with torch.no_grad():
        calls.clear()
        model(x, x)
    assert len(calls) == 2


@pytest.mark.slow
def test_train_py_prints_the_same_losses_with_checkpointing(tmp_path):
    """Single process in this process, and DDP over 2 gloo ranks: the logged losses equal a run without it."""
    data = make_dataset(tmp_path)
    args = ['--attn_type=noiseformer_v2', '--dropout=0.1', '--max_iters=4', '--eval_interval=4', '--eval_iters=2',
            '--lr_decay_iters=4', '--warmup_iters=1', '--gradient_accumulation_steps=2']
    runs = {}
    for name, extra in (('plain', []), ('checkpointed', ['--activation_checkpointing=True'])):
        proc = run_script_in_process('train.py', [TINY, f'--dataset={data}', f'--out_dir={tmp_path / name}', *args, *extra])
        assert proc.returncode == 0, proc.stderr
        runs[name] = iter_losses(proc.stdout)
    assert sorted(runs['plain']) == list(range(4))
    assert runs['plain'] == runs['checkpointed']  # the printed 6 decimals, every iteration
    ddp = iter_losses(run_train(tmp_path / 'ddp', data, *args, '--activation_checkpointing=True', nproc=2).stdout)
    assert sorted(ddp) == list(range(4))
    for it, loss in runs['plain'].items():  # DDP sums the ranks' losses in another order: within 1e-5, as test_train
        assert abs(ddp[it] - loss) < 1e-5, (it, ddp[it], loss)
