"""Run by test_fsdp.py under torchrun (2 ranks, gloo), not a test file itself: for every attn_type, a few
training steps of the tiny model sharded with denoised_gpt.parallel (as train.py's parallel='fsdp'
step does them) against the same steps on an unsharded copy in this process (what one process of
train.py does with the same total accumulation). Rank 0 prints one JSON line: per case, the largest
difference of any weight and of the summed loss, and how far the noise mean moved (it moves through
the KL term alone, whose gradient FSDP must not drop). Each case's sharded model and AdamW state is
saved as train.py saves it (sharded_checkpoint.py) into OUT_DIR/<attn_type>-<dtype>[-recompute], with
its gathered weights (gathered.pt) and the unsharded reference's checkpoint (reference/) beside it;
'reloaded': loading it into a fresh sharded model and optimizer gives back every tensor bit for bit.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_steps.py OUT_DIR
"""
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from denoised_gpt.device import autocast_context  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                                     get_optimizer_state_dict)

from denoised_gpt.checkpoint import optimizer_param_names, save_checkpoint  # noqa: E402
from denoised_gpt.parallel import shard_model, sharded_kl  # noqa: E402
from denoised_gpt.sharded_checkpoint import load_sharded_state, model_and_optimizer_state, save_sharded  # noqa: E402
from denoised_gpt.weights import empty_model  # noqa: E402
from helpers import VOCAB, tiny_gpt  # noqa: E402
from model import ATTENTION_TYPES  # noqa: E402

STEPS, MICRO, BATCH = 3, 4, 2  # MICRO: micro-batches per step over all ranks
KL_WEIGHT = 0.1  # large, so that a KL gradient lost on the way would show in the weights


def train(model, kl_divergence, micro_batches, rank, world, ctx, sync=None):
    """STEPS AdamW steps; this process does micro-batches rank, rank + world, ... of each; returns the
    losses summed over this process's micro-batches, and the optimizer."""
    optimizer = model.configure_optimizers(0.1, 3e-3, (0.9, 0.99), 'cpu')
    losses = []
    for step in range(STEPS):
        mine = list(range(rank, MICRO, world))
        total = 0.0
        for i, m in enumerate(mine):
            if sync is not None:
                sync(i == len(mine) - 1)
            x, y = micro_batches[step][m]
            torch.manual_seed(1000 * step + m)  # the noise of micro-batch m, whoever computes it
            with ctx:
                _, ce = model(x, y, return_logits=False)
                loss = ce + KL_WEIGHT * kl_divergence()
            (loss / len(mine)).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # small: it clips
        if hasattr(norm, 'full_tensor'):
            norm = norm.full_tensor()
        assert torch.isfinite(norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, optimizer


def main():
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    micro_batches = [[(torch.randint(0, VOCAB, (BATCH, 32), generator=g),) * 2 for _ in range(MICRO)]
                     for _ in range(STEPS)]
    micro_batches = [[(x, torch.roll(y, -1, dims=1)) for x, y in step] for step in micro_batches]
    cases = [(a, 'float32', False) for a in ATTENTION_TYPES]
    cases += [('noiseformer_v2', 'float32', True), ('base', 'bfloat16', False), ('noiseformer_v2', 'bfloat16', False)]
    results = {}
    for attn_type, dtype, recompute in cases:
        ctx = autocast_context('cpu', dtype)
        reference = tiny_gpt(attn_type)
        reference.activation_checkpointing = recompute
        start = {k: v.clone() for k, v in reference.state_dict().items()}
        ref_losses, ref_optimizer = train(reference, reference.kl_divergence, micro_batches, 0, 1, ctx)
        model = shard_model(tiny_gpt(attn_type), 'cpu', dtype)
        model.activation_checkpointing = recompute
        assert model.transformer.wte.weight is model.lm_head.weight, "the tie was lost"
        losses, optimizer = train(model, sharded_kl(model), micro_batches, rank, world, ctx,
                                  model.set_requires_gradient_sync)
        summed = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(summed)  # this rank's losses + the other's = the reference's
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # gathered
        ref_weights = reference.state_dict()
        assert list(weights) == list(ref_weights)
        name = f"{attn_type}/{dtype}" + ("/recompute" if recompute else "")
        train_state = {'model_args': dataclasses.asdict(reference.config), 'iter_num': STEPS, 'best_val_loss': 1e9,
                       'config': {'attn_type': attn_type}}
        out = Path(sys.argv[1]) / name.replace('/', '-')
        save_sharded(*model_and_optimizer_state(model, optimizer), train_state, out, writer=rank == 0)
        if rank == 0:
            torch.save(weights, out / 'gathered.pt')
            save_checkpoint({'model': ref_weights, 'optimizer': ref_optimizer.state_dict(),
                             'optimizer_param_names': optimizer_param_names(reference, ref_optimizer), **train_state},
                            out / 'reference')
        # read back in place as a resume does: a model built empty (meta), sharded, given room, then loaded
        again = shard_model(empty_model(reference.config), 'cpu', dtype)
        again.to_empty(device='cpu')
        again_optimizer = again.configure_optimizers(0.1, 3e-3, (0.9, 0.99), 'cpu')
        load_sharded_state(str(out / f'ckpt.sharded-{STEPS:07d}'), again, again_optimizer)
        again_weights = get_model_state_dict(again, options=StateDictOptions(full_state_dict=True))
        full = StateDictOptions(full_state_dict=True)
        state, again_state = (get_optimizer_state_dict(m, o, options=full)['state']
                              for m, o in ((model, optimizer), (again, again_optimizer)))
        mu = [k for k in weights if k.endswith('noise_mu')]
        results[name] = {
            'reloaded': again.lm_head.weight is again.transformer.wte.weight
            and all(torch.equal(again_weights[k], v) for k, v in weights.items())
            and state.keys() == again_state.keys()
            and all(torch.equal(again_state[n][k], v) for n in state for k, v in state[n].items()),
            'weights': max((weights[k] - ref_weights[k]).abs().max().item() for k in weights),
            'loss': (summed - torch.tensor(ref_losses, dtype=torch.float64)).abs().max().item(),
            'mu_moved': min(((weights[k] - start[k]).abs().max().item() for k in mu), default=None),
            'tied': model.lm_head.weight is model.transformer.wte.weight and torch.equal(
                weights['lm_head.weight'], weights['transformer.wte.weight']),
        }
    if rank == 0:
        print(json.dumps(results))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
