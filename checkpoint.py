"""
Checkpoint files: written so that a crash or a kill at any moment leaves a loadable checkpoint.

out_dir/ckpt.pt       the newest checkpoint
out_dir/ckpt.prev.pt  the one before it, kept in case the newest is damaged later (disk full, a
                      copy cut short): loadable directly with load_checkpoint('out_dir/ckpt.prev.pt')

A save writes ckpt.pt.tmp-<pid>, fsyncs it, hard-links the current ckpt.pt to ckpt.prev.pt (so
ckpt.pt never disappears, not even for an instant) and renames the temp file over ckpt.pt.
Renames within a directory are atomic, so a reader sees the old file or the new one, never half.

A checkpoint is a dict: model, optimizer, model_args (GPTConfig fields), iter_num, best_val_loss,
config (every training setting), plus what train.py needs to continue exactly (RNG and sampler
states, GradScaler). Only tensors and plain Python values are stored, so loading uses
torch.load(weights_only=True) and never runs code from the file. nanoGPT's ckpt.pt files load too.
"""

import glob
import os
import pickle
import random
import shutil

import numpy as np
import torch

CKPT_NAME = 'ckpt.pt'
PREV_NAME = 'ckpt.prev.pt'
REQUIRED_KEYS = ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss', 'config')


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says why and what to do instead."""


def save_checkpoint(state, out_dir):
    """Atomically write `state` to out_dir/ckpt.pt, keeping the previous one as ckpt.prev.pt.
    If anything fails (an unpicklable value, a full disk, a kill) the existing files are untouched.
    Returns the path written."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, CKPT_NAME)
    prev = os.path.join(out_dir, PREV_NAME)
    for stale in glob.glob(path + '.tmp-*') + glob.glob(prev + '.tmp-*'):
        os.remove(stale)  # left by a process killed mid-save (only rank 0 ever writes here)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them "the" checkpoint
        if os.path.exists(path):
            _keep_as_previous(path, prev)
        os.replace(tmp, path)
        _fsync_dir(out_dir)  # and the rename itself survives a power cut
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _keep_as_previous(path, prev):
    link = f"{prev}.tmp-{os.getpid()}"
    try:
        os.link(path, link)  # free, and ckpt.pt stays where it is
    except OSError:  # a filesystem without hard links: copy instead
        shutil.copyfile(path, link)
        with open(link, 'rb+') as f:
            os.fsync(f.fileno())
    os.replace(link, prev)


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_path(out_dir_or_file):
    """out_dir -> out_dir/ckpt.pt; a file path is returned unchanged."""
    return out_dir_or_file if os.path.isfile(out_dir_or_file) else os.path.join(out_dir_or_file, CKPT_NAME)


def load_checkpoint(out_dir_or_file, map_location='cpu'):
    """Load out_dir/ckpt.pt (or the given file). Raises FileNotFoundError when there is none and
    CheckpointError when it is unreadable, naming ckpt.prev.pt as the fallback where it exists."""
    path = checkpoint_path(out_dir_or_file)
    prev = os.path.join(os.path.dirname(path), PREV_NAME)
    has_fallback = os.path.basename(path) == CKPT_NAME and os.path.isfile(prev)
    use_prev = (f"The previous checkpoint {prev} was kept for this: resume from it with "
                f"`mv {prev} {path}`, or load it directly with load_checkpoint({prev!r})."
                if has_fallback else "No previous checkpoint (ckpt.prev.pt) exists next to it.")
    if not os.path.isfile(path):
        if has_fallback:
            raise CheckpointError(f"no checkpoint at {path}. {use_prev}")
        raise FileNotFoundError(f"no checkpoint at {path}: train one first (init_from='scratch'), "
                                f"or point out_dir at the directory that holds ckpt.pt")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if 'weights_only' not in str(e).lower() and 'weights only' not in str(e).lower():
            raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({_first_line(e)}). "
                                  f"{use_prev}") from e
        raise CheckpointError(f"checkpoint {path} holds Python objects other than tensors and plain "
                              f"values, which are not loaded because unpickling them can run code "
                              f"({_first_line(e)})") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # zip reader / short read errors
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: "
                              f"{_first_line(e)}). {use_prev}") from e
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint: it lacks {', '.join(missing)}")
    # torch.compile'd models (nanoGPT saves them so) prefix every key with '_orig_mod.'
    ckpt['model'] = {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()}
    return ckpt


def _first_line(e):
    return (str(e).strip().splitlines() or [''])[0][:300]


# ----------------------------------------------------------------------------------------------
# RNG states, as tensors and plain values so that weights_only loading accepts them

def capture_rng_state(device_type):
    state = {'torch': torch.get_rng_state(), 'python': random.getstate()}
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state['numpy'] = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    if device_type == 'cuda':
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state, device_type):
    torch.set_rng_state(state['torch'])
    random.setstate(_as_tuples(state['python']))
    name, keys, pos, has_gauss, cached = state['numpy']
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device_type == 'cuda' and 'cuda' in state:
        torch.cuda.set_rng_state_all(state['cuda'])


def _as_tuples(x):
    """random.setstate wants tuples; a round trip through some serialisers gives lists."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
