"""A training run's directory (out_dir) and what it records: preparing the folder, metrics.jsonl,
wandb, and the peak memory figure logged at each evaluation."""
import contextlib
import errno
import glob
import json
import netrc
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from denoised_gpt.checkpoint import CKPT_NAME, PREV_NAME, SHARDED_GLOB, checkpoint_path
from denoised_gpt.sharded_checkpoint import POINTER_NAME
from denoised_gpt.device import max_memory_allocated

# out_dir/metrics.jsonl: one JSON line per logged iteration and per evaluation, for compare.py and
# plots. Resume-safe: a resumed run first drops the rows written after its checkpoint.
METRICS_NAME = 'metrics.jsonl'


LOCK_NAME = '.lock'


def lock_out_dir(out_dir):
    """One writer per out_dir. Makes out_dir (checking it is writable now, not at the first save thousands
    of iterations later) and takes an exclusive lock on out_dir/.lock, which the OS holds for this process
    until it exits or is killed: a stale lock never blocks. Returns the open lock file (keep it: closing
    it releases the lock). ValueError naming the run that holds it, or the reason out_dir is unusable."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
        lock = open(os.path.join(out_dir, LOCK_NAME), 'a+')
    except OSError as e:
        raise ValueError(f"out_dir={out_dir!r} is not a writable directory ({e.strerror or e}): fix its "
                         f"permissions or choose another --out_dir") from e
    try:
        import fcntl  # POSIX; elsewhere runs are not locked
    except ImportError:
        return lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or 'another process'
        lock.close()
        raise ValueError(f"out_dir={out_dir!r} is in use by another run ({holder}): one run writes to an "
                         f"out_dir at a time. Wait for it to finish or stop it, or choose another --out_dir")
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.path.basename(sys.argv[0])}, pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    return lock


def clear_for_new_run(out_dir, overwrite):
    """A new run never destroys another run's checkpoint in out_dir: it is moved to a replaced-<time>/
    folder inside it unless overwrite=True. Returns a message saying what happened, or None."""
    old = [os.path.join(out_dir, name) for name in (CKPT_NAME, POINTER_NAME, PREV_NAME, METRICS_NAME)]
    had_checkpoint = os.path.exists(old[0]) or os.path.exists(old[1])
    old += sorted(glob.glob(os.path.join(out_dir, SHARDED_GLOB)))  # the sharded checkpoints' folders
    if not had_checkpoint or overwrite:
        for path in old:  # with no checkpoint, a metrics log is from a run that never saved: not ours
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        return f"overwrite=True: deleted the previous run's checkpoint in {out_dir}" if had_checkpoint else None
    aside = tempfile.mkdtemp(prefix=time.strftime('replaced-%Y%m%d-%H%M%S-'), dir=out_dir)  # a new name every time
    for path in old:
        if os.path.exists(path):
            os.replace(path, os.path.join(aside, os.path.basename(path)))
    return (f"{out_dir} held another run's checkpoint: moved it to {aside}/ so this new run does not replace "
            f"it (to continue that run instead, use --init_from=resume; --overwrite=True deletes it)")


def log_metrics(out_dir, row):
    """Append one JSON line to out_dir/metrics.jsonl. A failed write (disk full, ...) is undone, so the
    file keeps only whole rows, and raises OSError with a message that says what to do."""
    path = os.path.join(out_dir, METRICS_NAME)
    line = (json.dumps(row) + '\n').encode()
    with open(path, 'ab', buffering=0) as f:  # unbuffered: a failed write fails here, not at close
        size = f.tell()
        try:
            if f.write(line) != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise OSError(e.errno, f"cannot append to {path} ({e.strerror or e}); the checkpoints in {out_dir} "
                                   f"are intact: free some space and resume with --init_from=resume") from e


def trim_metrics(out_dir, resumed_iter):
    """Keep the rows the checkpoint had seen: iterations before resumed_iter, evaluations up to it."""
    path = os.path.join(out_dir, METRICS_NAME)
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.read().splitlines()
    keep = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # the last line of a killed run may be cut short
            continue
        if row['iter'] < resumed_iter or (row['iter'] == resumed_iter and 'val_loss' in row):
            keep.append(line)
    with open(path + '.tmp', 'w') as f:
        f.write(''.join(line + '\n' for line in keep))
    os.replace(path + '.tmp', path)


def restart_advice(out_dir, saved_iter):
    """What to do after a divergence, given the iteration of the checkpoint on disk (None: none yet)."""
    if saved_iter is None:
        return "No checkpoint was written yet: start the run again with a lower learning_rate"
    return (f"Resume from the last checkpoint ({checkpoint_path(out_dir)}, iter {saved_iter}) with a "
            f"lower learning_rate: --init_from=resume --learning_rate=...")


def checkpoint_note(out_dir, saved_iter, saved_val_loss, best_val_loss):
    """The last line of a run: which state its checkpoint holds. saved_val_loss: the val loss of the state this
    process saved last (None: not evaluated, or nothing saved by this process)."""
    path = checkpoint_path(out_dir)
    if saved_val_loss is not None and saved_val_loss > best_val_loss:  # always_save_checkpoint, or SIGTERM
        return (f"checkpoint: {path} holds the last state (iter {saved_iter}, val loss {saved_val_loss:.4f}); "
                f"the best val loss, {best_val_loss:.4f}, was an earlier state that it replaced "
                f"(always_save_checkpoint=False keeps the best instead)")
    return f"checkpoint: {path} (best val loss {best_val_loss:.4f})"


def peak_memory_mib(device):
    """Peak tensor memory on CUDA / Gaudi; on CPU the process's peak resident size (an upper bound)."""
    peak = max_memory_allocated(device)
    if peak is None:
        try:
            import resource  # Unix only
        except ImportError:
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return peak / 2 ** 20


def wandb_logged_in():
    """An API key in the environment or in ~/.netrc (where `wandb login` puts it)."""
    if os.environ.get('WANDB_API_KEY'):
        return True
    host = os.environ.get('WANDB_BASE_URL', 'https://api.wandb.ai').split('://')[-1].split('/')[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def start_wandb(project, name, config, out_dir):
    """wandb online where the user is logged in; otherwise (or when that fails) offline into
    out_dir/wandb, to upload later with `wandb sync`: a missing login never stops a training run.
    Returns the wandb module, initialised."""
    import wandb
    run = dict(project=project, name=name, config=config, dir=out_dir)
    if os.environ.get('WANDB_MODE') or wandb_logged_in():
        try:
            wandb.init(**run)
            return wandb
        except Exception as e:  # no network, a revoked key, ...
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    else:
        reason = "not logged in"
    wandb.init(mode='offline', **run)
    print(f"wandb: {reason}; logging offline to {os.path.join(out_dir, 'wandb')} "
          f"(upload later with: wandb sync {os.path.join(out_dir, 'wandb', 'offline-run-*')})")
    return wandb


def wandb_learned_values(learned):
    """GPT.learned_values() ({name: [[per head] per layer]}) as flat wandb keys: sigma/layer0/1, ..."""
    return {f"{name}/layer{i}/{j}": v for name, layers in learned.items()
            for i, layer in enumerate(layers) for j, v in enumerate(layer)}


class StopRequest:
    """SIGTERM (a scheduler's preemption, `kill`) or Ctrl-C, remembered: the training loop finishes the
    step in progress, saves a checkpoint and exits 0. A second Ctrl-C exits at once."""

    def __init__(self):
        self.signal = None  # the name of the signal received
        signal.signal(signal.SIGTERM, self.request)
        signal.signal(signal.SIGINT, self.request)

    def request(self, signum, frame):
        self.signal = signal.Signals(signum).name
        if signum == signal.SIGINT:
            print("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to quit at once)",
                  file=sys.stderr)
            signal.signal(signal.SIGINT, signal.default_int_handler)
