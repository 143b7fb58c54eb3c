"""
Sharded checkpoints, what parallel='fsdp' runs write: each rank saves its own shards of the weights and
AdamW state with torch.distributed.checkpoint (DCP), so no rank ever gathers the whole training state.

out_dir/ckpt.sharded          one line: the folder of the newest sharded checkpoint (replaced atomically)
out_dir/ckpt.sharded-0000500/ its DCP files (.metadata, __<rank>_0.distcp) and train_state.pt
out_dir/ckpt.sharded-0000250/ the one before it, kept as ckpt.prev.pt is

A save writes the folder under a .tmp name (every rank its shards, rank 0 then train_state.pt, all
fsynced), renames it, and only then points ckpt.sharded at it: a kill at any moment leaves the pointer
naming a whole checkpoint. Inside, DCP holds 'model' (name -> tensor; the lm_head tied to the token
embedding is stored once, as transformer.wte.weight) and 'optimizer' (name -> AdamW's step, exp_avg,
exp_avg_sq); train_state.pt (torch.save, read with weights_only) holds everything else a ckpt.pt holds
(model_args, iter_num, config, RNG and sampler states...) and the optimizer's param groups by name.

Reading: a run under fsdp loads its shards in place (load_sharded_state), resharded to however many
ranks it has now; everything else (one process, DDP, sample.py, eval.py, convert_checkpoint.py) reads
the whole tensors into a ckpt.pt's dict (read_sharded), through load_checkpoint, which takes the newer of
ckpt.pt and the sharded checkpoint. DCP needs every rank to see out_dir (a shared filesystem across nodes).
"""
import contextlib
import glob
import os
import shutil
import warnings

import torch

POINTER_NAME = 'ckpt.sharded'
STATE_NAME = 'train_state.pt'
TIED = ('lm_head.weight', 'transformer.wte.weight')  # GPT ties the output layer to the token embedding


def sharded_pointer(out_dir):
    return os.path.join(out_dir, POINTER_NAME)


def newest_sharded(out_dir):
    """The folder out_dir/ckpt.sharded names, or None when out_dir has no sharded checkpoint."""
    pointer = sharded_pointer(out_dir)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(out_dir, f.read().strip())


def is_sharded_checkpoint(path):
    return os.path.isfile(os.path.join(path, STATE_NAME))


# ----------------------------------------------------------------------------------------------
# Writing

def model_and_optimizer_state(model, optimizer):
    """This rank's shards of the weights and of AdamW's state, by parameter name (torch's distributed
    state_dict API: DTensors under FSDP, whole tensors for a plain model), and the param groups by name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    weights = get_model_state_dict(model)
    if model.lm_head.weight is model.transformer.wte.weight:
        weights.pop(TIED[0])
    optim = get_optimizer_state_dict(model, optimizer)
    return weights, optim['state'], optim['param_groups']


def save_sharded(weights, optimizer_state, param_groups, train_state, out_dir, writer=True):
    """Write a sharded checkpoint of iteration train_state['iter_num'] into out_dir (see the top). Under
    torch.distributed every rank calls it with its shards (a collective) and writer is rank 0's; in one
    process (no process group) it writes the whole tensors as one shard. Returns the folder written."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    distributed = dist.is_available() and dist.is_initialized()
    name = f"{POINTER_NAME}-{train_state['iter_num']:07d}"
    final, tmp = os.path.join(out_dir, name), os.path.join(out_dir, name + '.tmp')
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(out_dir, POINTER_NAME + '-*.tmp')):
            shutil.rmtree(stale)  # left by a run killed mid-save
    if distributed:
        dist.barrier()  # no rank writes into tmp before it is clean
    current = newest_sharded(out_dir)
    try:
        with _quiet_single_process():
            dcp.save({'model': weights, 'optimizer': optimizer_state}, checkpoint_id=tmp, no_dist=not distributed)
        if writer:
            with open(os.path.join(tmp, STATE_NAME), 'wb') as f:
                torch.save({**train_state, 'optimizer_param_groups': param_groups}, f)
                f.flush()
                os.fsync(f.fileno())
    except (OSError, dcp.CheckpointException) as e:  # disk full, quota, I/O error on some rank
        from denoised_gpt.checkpoint import CheckpointError
        intact = f"{current} is intact" if current else "no sharded checkpoint was written"
        cause = failure_cause(e)
        reason = getattr(cause, 'strerror', None) or f"{type(cause).__name__}: {_first_line(cause)}"
        raise CheckpointError(f"could not write a sharded checkpoint in {out_dir} ({reason}); "
                              f"{intact}. Fix the cause and resume with init_from='resume'") from e
    if writer:
        if os.path.exists(final) and final != current:  # an older run's folder of the same iteration
            shutil.rmtree(final)
        if final == current:  # the same iteration saved again: a fresh name, the pointer still valid
            final = _unused_name(final)
        os.replace(tmp, final)
        _write_pointer(out_dir, os.path.basename(final))
        for old in glob.glob(os.path.join(out_dir, POINTER_NAME + '-*')):
            if old not in (final, current) and not old.endswith('.tmp'):
                shutil.rmtree(old)  # keep the newest and the one before it
    if distributed:
        dist.barrier()  # the pointer is in place before any rank goes on (and, say, saves again)
    return final


def failure_cause(e):
    """The exception behind a DCP CheckpointException (it gathers each failed rank's), else e itself."""
    failures = getattr(e, 'failures', None)  # CheckpointException: {rank: (exception, traceback)}
    return next(iter(failures.values()))[0] if failures else e


def _first_line(e):
    return (str(e).strip().splitlines() or [''])[0][:200]


def _unused_name(path):
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    return f"{path}.{n}"


def _write_pointer(out_dir, folder_name):
    pointer = sharded_pointer(out_dir)
    tmp = f"{pointer}.tmp-{os.getpid()}"
    with open(tmp, 'w') as f:
        f.write(folder_name + '\n')
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames survive a power cut
    finally:
        os.close(fd)


def checkpoint_as_sharded(ckpt):
    """A checkpoint dict in ckpt.pt's layout (load_checkpoint's) -> save_sharded's arguments (whole
    tensors: one shard), for convert_checkpoint.py."""
    from denoised_gpt.checkpoint import optimizer_state_by_name
    weights = {k: v for k, v in ckpt['model'].items() if k != TIED[0]}
    optimizer_state, param_groups = optimizer_state_by_name(ckpt)
    train_state = {k: v for k, v in ckpt.items() if k not in ('model', 'optimizer', 'optimizer_param_names')}
    return weights, optimizer_state, param_groups, train_state


# ----------------------------------------------------------------------------------------------
# Reading

def read_train_state(folder):
    return torch.load(os.path.join(folder, STATE_NAME), map_location='cpu', weights_only=True)


def read_sharded(folder, model_only=False):
    """A sharded checkpoint as one process's dict in ckpt.pt's layout, whole tensors on the CPU (the
    optimizer state positional, with optimizer_param_names, as train.py writes it). model_only: the
    weights alone ('optimizer': None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    state = read_train_state(folder)
    reader = FileSystemReader(folder)
    wanted = ('model.',) if model_only else ('model.', 'optimizer.')
    # the saved tensors' names and shapes are in DCP's metadata: whole tensors to read each into
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items() if key.startswith(wanted)}
    with _quiet_single_process():
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    weights = {k.removeprefix('model.'): v for k, v in tensors.items() if k.startswith('model.')}
    weights[TIED[0]] = weights[TIED[1]]  # one tensor under both names, as in a ckpt.pt
    groups = state.pop('optimizer_param_groups')
    state['model'] = weights
    state['optimizer'] = None  # model_only, or a checkpoint without optimizer state (grow.py's, say)
    if not model_only and groups is not None:
        state['optimizer'], state['optimizer_param_names'] = _positional(tensors, groups)
    return state


def _positional(tensors, groups):
    """DCP's 'optimizer.<name>.<key>' tensors and the param groups by name -> torch's optimizer
    state_dict (slots numbered in group order) and the slots' names."""
    per_name = {}
    for key, value in tensors.items():
        if key.startswith('optimizer.'):
            name, field = key.removeprefix('optimizer.').rsplit('.', 1)
            per_name.setdefault(name, {})[field] = value
    state, out_groups, names, slot = {}, [], [], 0
    for group in groups:
        ids = []
        for name in group['params']:
            if name in per_name:
                state[slot] = per_name[name]
            ids.append(slot)
            slot += 1
        out_groups.append({**group, 'params': ids})
        names.append(list(group['params']))
    return {'state': state, 'param_groups': out_groups}, names


def load_sharded_state(folder, model, optimizer):
    """Load a sharded checkpoint's weights and AdamW state into `model` (sharded with FSDP2) and
    `optimizer` built on it: each rank reads the
    parts of the files its shards cover, however many ranks wrote them. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    weights = get_model_state_dict(model)
    weights.pop(TIED[0], None)
    optim = get_optimizer_state_dict(model, optimizer)  # (creates AdamW's state to read into)
    template = {'model': weights, 'optimizer': optim['state']}
    try:
        dcp.load(template, checkpoint_id=folder)
    except (Exception, dcp.CheckpointException) as e:  # a missing or truncated shard, no optimizer state in it
        from denoised_gpt.checkpoint import CheckpointError
        cause = failure_cause(e)
        raise CheckpointError(f"cannot resume from the sharded checkpoint {folder} ({type(cause).__name__}: "
                              f"{_first_line(cause)}); load_checkpoint({folder!r}) says more") from e
    set_model_state_dict(model, template['model'], options=_non_strict())
    set_optimizer_state_dict(model, optimizer, {'state': template['optimizer'], 'param_groups': optim['param_groups']})


def _non_strict():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(strict=False)  # lm_head.weight: the tied embedding, loaded under its first name


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every use without a process group, even when asked for exactly that (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='torch.distributed is disabled, unavailable or uninitialized')
        yield
