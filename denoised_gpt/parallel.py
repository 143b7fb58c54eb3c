"""
parallel='fsdp': train.py's second data-parallel strategy, PyTorch's FSDP2 (fully_shard). Each rank
keeps 1/W of the weights, gradients and AdamW state; a block's weights are all-gathered just before
it computes (forward and backward) and its gradients reduce-scattered after its backward.

How it maps onto train.py's DDP step, so that the two train the same model:
- Sharding: each transformer block is one FSDP group, the root (embeddings, the tied wte / lm_head,
  ln_f) another. The tied weight is one Parameter of the root group, so it stays tied.
- Mixed precision (bf16 runs): FSDP's policy gathers the weights in bf16 (half the all-gather bytes)
  and reduces the gradients in float32 into the float32 shards. The forward then runs in bf16,
  residual stream and layer norms included (under DDP + autocast those stay float32). train.py's
  autocast stays on top: it changes nothing for the bf16 matmuls, keeps the ops on its float32 list
  in float32 (softmax, layer norm on CUDA), and the model's code reads its dtype (the fused
  lm_head + loss). Keeping the residual stream float32 (cast_forward_inputs=False) fails on CPU:
  its layer_norm refuses a float32 input with a bf16 weight.
- Gradient accumulation: reduce-scatter only after the last micro-step (set_requires_gradient_sync,
  DDP's no_sync); FSDP accumulates the unsynced gradients in float32. The price: between micro-steps
  each rank holds every block's whole gradient, as much gradient memory as DDP (memory_plan.py
  counts sharded gradients and a reduce-scatter per micro-batch instead).
- The KL term: after the forward a block's weights are shards again, so each layer's KL is summed
  from the shards and over the ranks (sharded_kl).
- Checkpoints: sharded, each rank writing its own shards (sharded_checkpoint.py); a resume reads them
  on any number of ranks. Resuming from a single-file ckpt.pt (a DDP run's, or one converted with
  convert_checkpoint.py), every rank loads the whole file and keeps its shard (shard_optimizer_state).
"""
import torch
import torch.distributed as dist

from denoised_gpt.device import device_type, torch_dtype

PARALLEL = ('ddp', 'fsdp')


def check_parallel(parallel, trainable, compile, device, dtype):
    """Settings parallel='fsdp' cannot train with yet: ValueError (device and dtype resolved; compile
    as given: True / 'auto' / False)."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r} must be 'ddp' or 'fsdp'")
    if parallel != 'fsdp':
        return
    kind = device_type(device)
    if kind not in ('cuda', 'cpu'):
        raise ValueError(f"parallel='fsdp' runs on cuda and cpu only, not {kind} (Gaudi's older torch and "
                         f"lazy mode are untested with FSDP2; MPS has no collective backend): use parallel='ddp'")
    if dtype == 'float16':
        raise ValueError("parallel='fsdp' with dtype='float16' needs a GradScaler whose inf check agrees across "
                         "ranks (each holds only a shard of the gradients): not built yet; use dtype='bfloat16'")
    if trainable != 'all':
        raise ValueError(f"parallel='fsdp' with trainable={trainable!r} is not supported yet (frozen weights "
                         f"inside sharded groups are untested, and a small trainable set gains little from "
                         f"sharding): use parallel='ddp'")
    if compile is True or (isinstance(compile, str) and compile.lower() == 'true'):
        raise ValueError("parallel='fsdp' with compile=True is not supported yet (FSDP2 wants each block "
                         "compiled on its own): use compile=False or compile=auto (off under fsdp)")
    if kind == 'cpu' and not hasattr(torch.cpu.Stream, 'record_event'):
        raise ValueError(f"parallel='fsdp' on the CPU needs a torch whose CPU streams record events (FSDP2 waits "
                         f"on them; torch {torch.__version__} has none, 2.13 has): use parallel='ddp', or a newer torch")


def shard_model(model, device, dtype):
    """FSDP2 on `model` (a GPT) in place, over every rank of the process group: one group per block
    and the root. Its parameters become DTensors holding this rank's shard (moved to the device);
    build the optimizer afterwards, on them."""
    # imported here: FSDP's modules take over a second to import, which every other run would pay at start
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device_type(device), (dist.get_world_size(),))
    # float32: no policy. bf16: weights gathered (and the forward computed) in bf16, gradients reduced
    # and accumulated in float32, the sharded weights and AdamW state float32 as on the DDP path
    policy = MixedPrecisionPolicy() if dtype == 'float32' else MixedPrecisionPolicy(
        param_dtype=torch_dtype(dtype), reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: kept gathered from forward to backward
    return model


def kl_layers(model):
    """The attention modules of a GPT that add a KL term to the loss: those whose kl_parameters name any."""
    return [block.attn for block in model.transformer.h if block.attn.kl_parameters()]


def sharded_kl(model):
    """model.kl_divergence() for a sharded model, called after its forward (as train.py does): each
    layer's KL term from this rank's shards of the parameters it reads (NoiseFormer's mu and sigma;
    DTensor arithmetic, in float32 whatever the policy), summed over the ranks. Its gradient goes
    straight to this rank's shards, where FSDP adds the reduce-scattered cross-entropy gradient.
    (Computed inside a block's forward instead, the KL's backward would read the gathered weights,
    freed again after that forward.)"""
    layers = kl_layers(model)
    for layer in layers:
        for p in layer.kl_parameters():
            # DTensor may return a shard's gradient replicated (an uneven split, e.g. noiseformer_v1's one mu
            # over two ranks); FSDP adds its reduce-scattered gradient to a shard-shaped one
            p.register_hook(lambda grad, p=p: grad.redistribute(p.device_mesh, p.placements))

    def kl_divergence():
        if not layers:
            return torch.zeros((), device=model.lm_head.weight.device)
        # full_tensor: the all-reduce of each layer's partial sum; its backward keeps the gradient local
        return torch.stack([m.kl_divergence().full_tensor() for m in layers]).sum()
    return kl_divergence


@torch.no_grad()
def learned_values(model):
    """GPT.learned_values of a sharded model, one block gathered at a time (every rank must call it).
    Under a bf16 policy the gathered weights, and so these values, are bf16."""
    values = {}
    for block in model.transformer.h:
        block.unshard()
        for name, layer_values in block.attn.learned_values().items():
            values.setdefault(name, []).append(layer_values)
        block.reshard()
    return values


@torch.no_grad()
def shard_optimizer_state(optimizer):
    """After optimizer.load_state_dict of a checkpoint's whole tensors (every rank read the file): each
    parameter's state (exp_avg, exp_avg_sq) cut to the parameter's own shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    for group in optimizer.param_groups:
        for p in group['params']:
            if not isinstance(p, DTensor):
                continue
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == p.shape:
                    # every rank holds the same whole tensor: each takes its shard, no communication
                    state[key] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)


def broadcast_from_rank0(value):
    """Rank 0's value (a picklable object) on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
