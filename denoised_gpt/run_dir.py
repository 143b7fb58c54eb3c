"""A training run's directory (out_dir) and what it records: preparing the folder (one writer at a time,
what a killed run left half-written removed, a full disk said in one line), metrics.jsonl, wandb, the
peak memory figure logged at each evaluation, what the run's last lines say its checkpoint holds, the end
of a diverged run, and the stop signals (SIGTERM, Ctrl-C, a second Ctrl-C)."""
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

import torch
import torch.distributed as dist

from denoised_gpt.checkpoint import (CKPT_NAME, PREV_NAME, SHARDED_GLOB, CheckpointError, checkpoint_path,
                                     read_checkpoint)
from denoised_gpt.checkpoint_base import MAX_COUNT, is_float_value
from denoised_gpt.cli import fail
from denoised_gpt.sharded_checkpoint import POINTER_NAME
from denoised_gpt.device import max_memory_allocated
from denoised_gpt.files import open_log, parse_json, write_problem

# out_dir/metrics.jsonl: one JSON line per logged iteration and per evaluation, for compare.py and
# plots. Resume-safe: a resumed run first drops the rows written after its checkpoint.
METRICS_NAME = 'metrics.jsonl'
_MOVE_METRICS_AWAY = "move it away (a resumed run then logs from its checkpoint on)"


LOCK_NAME = '.lock'


def lock_out_dir(out_dir):
    """One writer per out_dir. Makes out_dir (checking it is writable now, not at the first save thousands
    of iterations later) and takes an exclusive lock on out_dir/.lock, which the OS holds for this process
    until it exits or is killed: a stale lock never blocks. With the lock held no other process writes
    there, so what a killed save left half-written is removed (remove_temporaries). Returns the open lock
    file (keep it: closing it releases the lock). ValueError naming the run that holds it, or the reason
    out_dir is unusable (a full disk, permissions)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
        # unbuffered (a failed write fails at once), not O_APPEND: the holder's line is written over the
        # last one's, then what is left of that is cut
        lock = open(os.open(os.path.join(out_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666), 'r+b', buffering=0)
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
        holder = lock.read().decode(errors='replace').strip() or 'another process'
        lock.close()
        raise ValueError(f"out_dir={out_dir!r} is in use by another run ({holder}): one run writes to an "
                         f"out_dir at a time. Wait for it to finish or stop it, or choose another --out_dir")
    try:
        lock.write(f"{os.path.basename(sys.argv[0])}, pid {os.getpid()} on {socket.gethostname()}, "
                   f"since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        lock.truncate()
        remove_temporaries(out_dir)
    except OSError as e:  # a full disk, most likely: found now rather than at the first save
        lock.close()
        raise ValueError(out_dir_error(out_dir, e, "taking its lock")) from e
    return lock


def out_dir_error(out_dir, e, doing):
    """One line for an OSError (e) while `doing` something in out_dir before training, which changed nothing
    that matters there: a full disk (or quota) said as such."""
    cause, remedy = write_problem(e)
    return (f"out_dir={out_dir!r}: {cause} while {doing}; the checkpoints in it are intact: {remedy} or choose "
            f"another --out_dir")


# what a save writes before renaming it into place (checkpoint.py, sharded_checkpoint.py): left behind
# only by a process killed mid-save
TEMPORARIES = ('ckpt*.tmp-*', SHARDED_GLOB + '.tmp')


def remove_temporaries(out_dir):
    """Remove the temporary files and folders of checkpoint saves in out_dir. Only for the process that
    holds out_dir's lock (lock_out_dir): no other writer's save can be in progress."""
    for pattern in TEMPORARIES:
        for path in glob.glob(os.path.join(out_dir, pattern)):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def clear_for_new_run(out_dir, overwrite):
    """A new run never destroys another run's checkpoint in out_dir: it is moved to a replaced-<time>/
    folder inside it unless overwrite=True. Returns a message saying what happened, or None. ValueError
    when that folder cannot be made (a full disk)."""
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
    try:
        aside = tempfile.mkdtemp(prefix=time.strftime('replaced-%Y%m%d-%H%M%S-'), dir=out_dir)  # a new name every time
    except OSError as e:
        raise ValueError(out_dir_error(out_dir, e, "making a folder to keep another run's checkpoint in")) from e
    for path in old:
        if os.path.exists(path):
            os.replace(path, os.path.join(aside, os.path.basename(path)))
    return (f"{out_dir} held another run's checkpoint: moved it to {aside}/ so this new run does not replace "
            f"it (to continue that run instead, use --init_from=resume; --overwrite=True deletes it)")


def prepare_out_dir(out_dir, resumed_iter, overwrite, eval_only):
    """out_dir made ready for a run, once every check that can refuse the run has passed: locked for this
    process (lock_out_dir), then, unless eval_only, the metrics a resumed run logged after its checkpoint
    dropped (resumed_iter: the checkpoint's iteration; None for a new run) or another run's checkpoint kept
    aside (clear_for_new_run). Returns (the lock, a message for the user or None). ValueError, in one line."""
    lock = lock_out_dir(out_dir)
    if eval_only:
        return lock, None
    if resumed_iter is not None:
        return lock, trim_metrics(out_dir, resumed_iter)
    return lock, clear_for_new_run(out_dir, overwrite)


def log_row(out_dir, row):
    """train.py's log_metrics: a failed write (disk full) ends the run in one line (exit 2); the checkpoints are
    intact, and so is the log (whole rows only)."""
    try:
        log_metrics(out_dir, row)
    except OSError as e:
        fail(e.strerror)


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
            if os.path.exists(checkpoint_path(out_dir)):
                then = f"the checkpoints in {out_dir} are intact: free some space and resume with --init_from=resume"
            else:  # (nothing to resume from)
                then = "no checkpoint was written yet: free some space and start the run again"
            raise OSError(e.errno, f"cannot append to {path} ({e.strerror or e}); {then}") from e


def trim_metrics(out_dir, resumed_iter):
    """Keep the rows the checkpoint had seen: iterations before resumed_iter, evaluations up to it, and
    drop the lines that are not rows (metrics_rows). Returns a note saying what was dropped as damaged, or
    None. ValueError when metrics.jsonl is not a regular file, or cannot be rewritten (a full disk): it is
    then left as it was."""
    path = os.path.join(out_dir, METRICS_NAME)
    if not os.path.exists(path):
        return None
    keep, damaged = [], []
    try:
        for number, line, row, problem in metrics_rows(path):
            if problem is not None:
                damaged.append((number, problem))
            elif row['iter'] < resumed_iter or (row['iter'] == resumed_iter and 'val_loss' in row):
                keep.append(line)
    except OSError as e:  # permission denied, an I/O error
        raise ValueError(f"cannot read {path} ({e.strerror or e}); fix its permissions, or {_MOVE_METRICS_AWAY}") from e
    tmp = path + '.tmp'
    try:
        with open(tmp, 'w') as f:
            f.write(''.join(line + '\n' for line in keep))
        os.replace(tmp, path)
    except OSError as e:  # a full disk: metrics.jsonl is as it was
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ValueError(out_dir_error(out_dir, e, f"trimming {path} to the checkpoint's iteration")) from e
    return dropped_note(path, damaged)


# A line of metrics.jsonl is at most kilobytes (an evaluation's row holds the learned values per head); one
# longer than this is damage, and is skipped without being held in memory whole
MAX_ROW_BYTES = 1 << 20
# A run's whole log: 600,000 iterations logged one by one, and an evaluation every 250, are some 200 MB
MAX_METRICS_BYTES = 1 << 30
# what train.py writes in each kind of row, as compare.py reads it: an iteration's (it has 'loss') and an
# evaluation's (it has 'val_loss'); a non-finite value is a number too (a diverged evaluation is logged so)
ROW_NUMBERS = {'loss': ('loss', 'tokens_per_s', 'time'), 'val_loss': ('val_loss', 'train_loss', 'time')}


def metrics_rows(path):
    """(line number, line, row, problem) for each line of the metrics log at path: row is the parsed row and
    problem None for a row train.py writes (log_metrics); for any other line (cut short by a kill, damaged,
    edited) row is None and problem says why. Refused (ValueError) unless path is a regular file: a link to
    a device would be read for ever, a FIFO would hang; nor when it is larger than MAX_METRICS_BYTES (a sparse
    file of a terabyte takes no disk). Reads a line at a time, each at most MAX_ROW_BYTES."""
    with open_log(path, MAX_METRICS_BYTES, "metrics log", f"put the run's metrics log there, or "
                                                          f"{_MOVE_METRICS_AWAY}") as f:
        for number, data in enumerate(bounded_lines(f, MAX_METRICS_BYTES), start=1):
            if data is None:
                yield number, None, None, f"longer than {MAX_ROW_BYTES >> 20} MiB"
                continue
            if not data.strip():
                continue  # a blank line holds nothing
            try:
                line = data.decode('utf-8').rstrip('\n')
                row = parse_json(line)
            except ValueError as e:  # cut short by a kill, or damaged
                yield number, None, None, f"not JSON ({e})"
                continue
            problem = metrics_row_problem(row)
            yield number, line, None if problem else row, problem


def bounded_lines(f, max_bytes):
    """The lines of the binary file f, each at most MAX_ROW_BYTES long; None for a longer one, whose rest is
    read past, never held whole. At most max_bytes in all are read (a file that grows meanwhile: up to there)."""
    left = max_bytes
    while left > 0:
        line = f.readline(min(MAX_ROW_BYTES + 1, left))
        left -= len(line)
        if not line:
            return
        if len(line) <= MAX_ROW_BYTES or line.endswith(b'\n'):
            yield line
            continue
        while line and not line.endswith(b'\n') and left > 0:
            line = f.readline(min(MAX_ROW_BYTES, left))
            left -= len(line)
        yield None


def metrics_row_problem(row):
    """Why a parsed metrics.jsonl line is not a row train.py writes (in words for a message), or None."""
    if not isinstance(row, dict):
        kind = {list: 'an array', str: 'a string', bool: 'true or false', type(None): 'null'}.get(type(row), 'a number')
        return f"{kind}, not a JSON object"
    number = is_float_value  # (a JSON integer of 400 digits is no float: the report's arithmetic would fail)
    if 'iter' not in row:
        return "it has no iter"
    if not (isinstance(row['iter'], int) and number(row['iter']) and 0 <= row['iter'] <= MAX_COUNT):
        return f"its iter is {_shown(row['iter'])}, not a non-negative integer up to 2**63 - 1"
    kind = 'val_loss' if 'val_loss' in row else 'loss' if 'loss' in row else None
    if kind is None:
        return "neither an iteration's row (loss) nor an evaluation's (val_loss)"
    for key in ROW_NUMBERS[kind]:
        if key not in row:
            return f"it has no {key}"
        if not number(row[key]):
            return f"its {key} is {_shown(row[key])}, not a number"
    if kind == 'val_loss' and not (row.get('peak_memory_mib') is None or number(row['peak_memory_mib'])):
        return f"its peak_memory_mib is {_shown(row['peak_memory_mib'])}, not a number"
    return None


def _shown(value):
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + '...'


def dropped_note(path, damaged):
    """A note naming the lines of path left out as not rows ((line number, problem) pairs), or None."""
    if not damaged:
        return None
    shown = '; '.join(f"line {n}: {problem}" for n, problem in damaged[:3])
    more = f"; and {len(damaged) - 3} more" if len(damaged) > 3 else ""
    what = "1 line" if len(damaged) == 1 else f"{len(damaged)} lines"
    rows = "is not a metrics row" if len(damaged) == 1 else "are not metrics rows"
    return f"note: left out {what} of {path} that {rows} ({shown}{more})"


def restart_advice(out_dir, saved_iter, setting='learning_rate'):
    """What to do after a divergence, given the iteration of the checkpoint on disk (None: none yet) and the
    setting to lower. train.py only ever saves finite states, so that checkpoint is one to resume from."""
    if saved_iter is None:
        return f"No checkpoint was written yet: start the run again with a lower {setting}"
    return (f"Resume from the last checkpoint ({checkpoint_path(out_dir)}, iter {saved_iter}) with a "
            f"lower {setting}: --init_from=resume --{setting}=...")


def stop_diverged(message, master, distributed):
    """A non-finite loss or gradient ends the run with exit status 3, rank 0 (master) printing message; the
    checkpoint on disk is the last good one: nothing is saved on the way out."""
    if master:
        print(message, file=sys.stderr)
    if distributed:
        dist.destroy_process_group()
    sys.exit(3)


def checkpoint_note(path, saved_iter, saved_val_loss, best_iter, best_val_loss, last_iter, keeps_best_hint):
    """The last line of a run: which state its checkpoint (path) holds, in numbers true of that file.
    saved_iter, saved_val_loss: its iteration and val loss (None: not evaluated, or not known); best_iter,
    best_val_loss: the best evaluation seen (best_iter None: not known, a checkpoint of an older version;
    best_val_loss 1e9: none); last_iter: the iteration the run ended at; keeps_best_hint: whether
    always_save_checkpoint=False would have kept the best state instead."""
    if best_val_loss >= 1e9:
        return f"checkpoint: {path} (iter {saved_iter}, not evaluated)"
    if saved_iter == best_iter or (saved_val_loss is not None and saved_val_loss <= best_val_loss):
        return f"checkpoint: {path} (best val loss {best_val_loss:.4f})"
    held = f"iter {saved_iter}" + (f", val loss {saved_val_loss:.4f}" if saved_val_loss is not None else "")
    held = f"the last state ({held})" if saved_iter == last_iter else held
    best = (f"the best val loss seen, {best_val_loss:.4f}, was at iter {best_iter}" if best_iter is not None
            else f"the best val loss seen was {best_val_loss:.4f}")
    hint = " (always_save_checkpoint=False keeps the best instead)" if keeps_best_hint else ""
    return f"checkpoint: {path} holds {held}; {best}{hint}"


def next_step(out_dir, lora, meta=None):
    """The run's last line: what to do with its checkpoint. lora: a LoRA run's, whose adapters sample.py and
    eval.py read only once merged into a plain checkpoint; meta: its dataset's meta.json, whose token ids
    may be no text to sample (a recall dataset's: eval.py scores its answers)."""
    if lora:
        return (f"merge its LoRA adapters (for sample.py, eval.py) with: python3 train.py --out_dir={out_dir} "
                f"--merge_lora=True")
    if meta and meta.get('labels'):
        return (f"score its answers with: python3 eval.py --out_dir={out_dir} --recall=True (its data is token ids, "
                f"not text: sample.py has nothing to print)")
    return f"sample from it with: python3 sample.py --out_dir={out_dir}"


def checkpoint_on_disk(out_dir):
    """A line naming out_dir's checkpoint and the iteration it holds, read from the file itself."""
    try:
        iter_num = read_checkpoint(out_dir, metadata_only=True)[1]['iter_num']
    except FileNotFoundError:
        return f"no checkpoint was written in {out_dir}"
    except CheckpointError as e:
        return str(e)
    return f"{checkpoint_path(out_dir)} is the iter {iter_num} state (resume with --init_from=resume)"


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


def writes_to(stream, fds):
    """Whether the stream writes to one of these file descriptors (a stream a test captures has none)."""
    try:
        return stream.fileno() in fds
    except (AttributeError, ValueError, OSError):
        return False


class TerminalStream:
    """sys.stdout or sys.stderr on a terminal: a write that fails because the terminal has hung up (EIO) drops
    the terminal's output (hung_up()) and is written again, to where its file descriptor now points."""

    def __init__(self, stream, hung_up):
        self.stream, self.hung_up = stream, hung_up

    def write(self, text):
        return self.again_after_hangup(self.stream.write, text)

    def flush(self):
        return self.again_after_hangup(self.stream.flush)

    def again_after_hangup(self, method, *args):
        try:
            return method(*args)
        except OSError as error:
            if error.errno != errno.EIO:
                raise
            self.hung_up()
            return method(*args)

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


class StopRequest:
    """SIGTERM (a scheduler's preemption, `kill`), SIGHUP (the terminal or ssh session closed) or Ctrl-C,
    remembered: the training loop stops at the next micro-batch (a step it has not finished is dropped, however
    many micro-batches it has), saves the last finished step and exits 0. A Ctrl-C after either quits at once,
    with exit status 130 (128 + SIGINT, what a shell reports for a process Ctrl-C ended) and one line naming the
    checkpoint on disk, as read from it (a save cut short before its rename left the previous one in
    place), and the save's temporary file removed. (A second SIGTERM changes nothing: schedulers repeat it.)"""

    def __init__(self, out_dir=None, distributed=False):
        """out_dir: the run's, when this process holds its lock (rank 0); else None: a second Ctrl-C quits
        without a word (rank 0 says it). distributed: under DDP / FSDP (every rank constructs it, in the same
        order as its other process groups), requested() asks every rank."""
        self.out_dir = out_dir
        # the ranks agree through a CPU (gloo) group: asked once a micro-batch, a flag on the GPU would make every
        # micro-batch wait for the GPU (a host sync); on the CPU it is a message between the ranks' host threads
        self.group = (None if dist.get_backend() == 'gloo' else dist.new_group(backend='gloo')) if distributed \
            else False
        self.signal = None  # the name of the signal received
        self.saving = False  # train.py sets it while it writes a checkpoint
        # known now: a hung-up terminal no longer answers isatty
        self.terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]
        # The terminal fails writes (EIO) from the moment it hangs up, and the run may write there before the
        # SIGHUP is handled (or get none: a closed pty that was not its controlling terminal).
        if writes_to(sys.stdout, self.terminal_fds):
            sys.stdout = TerminalStream(sys.stdout, self.drop_terminal_output)
        if writes_to(sys.stderr, self.terminal_fds):
            sys.stderr = TerminalStream(sys.stderr, self.drop_terminal_output)
        for name in ('SIGTERM', 'SIGINT', 'SIGHUP'):  # (Windows has no SIGHUP)
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), self.request)

    def requested(self):
        """Whether a stop signal has reached this process or, under DDP / FSDP, any rank: every rank gets the
        same answer (an all-reduce, so every rank must ask at the same point)."""
        if self.group is False:
            return self.signal is not None
        flag = torch.tensor(float(self.signal is not None))
        dist.all_reduce(flag, group=self.group)
        return flag.item() > 0

    def request(self, signum, frame):
        if signum == getattr(signal, 'SIGHUP', None):
            self.drop_terminal_output()
        if self.signal is not None:
            if signum == signal.SIGINT:
                self.quit()
            return
        self.signal = signal.Signals(signum).name
        if signum == signal.SIGINT:
            print("\nCtrl-C: stopping at the next micro-batch, then saving a checkpoint (Ctrl-C again to quit at once)",
                  file=sys.stderr)

    def drop_terminal_output(self):
        """A write to a closed terminal fails (EIO), which would end the run before its save: what would
        have gone there is dropped instead (a log file that stdout or stderr goes to gets everything)."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in self.terminal_fds:
            os.dup2(devnull, fd)
        os.close(devnull)

    def quit(self):
        if self.out_dir is not None:
            remove_temporaries(self.out_dir)  # this process holds the lock: any is this save's
            print(f"\ninterrupted{' during a save' if self.saving else ''}: {checkpoint_on_disk(self.out_dir)}",
                  file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # the log's last lines (unless this interrupted a write of them)
            sys.stdout.flush()
        os._exit(130)  # at once: no exception to unwind through the code this interrupted
