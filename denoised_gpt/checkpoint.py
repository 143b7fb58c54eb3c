"""
Checkpoint files: written so that a crash or a kill at any moment leaves a loadable checkpoint,
laid out so that nanoGPT's scripts read ours and ours read nanoGPT's.

out_dir/ckpt.pt       the newest checkpoint
out_dir/ckpt.prev.pt  the one before it, kept in case the newest is damaged later (disk full, a
                      copy cut short): loadable directly with read_checkpoint('out_dir/ckpt.prev.pt')
(fsdp runs write sharded checkpoints instead, sharded_checkpoint.py; read_checkpoint(out_dir) reads the
newer of the two kinds, so every script reads both.)

A save writes ckpt.pt.tmp-<pid>, fsyncs it, hard-links the current ckpt.pt to ckpt.prev.pt (so
ckpt.pt never disappears, not even for an instant) and renames the temp file over ckpt.pt.
Renames within a directory are atomic, so a reader sees the old file or the new one, never half.
A save that fails (disk full, quota, I/O error) raises CheckpointError with one line saying so;
the existing ckpt.pt and ckpt.prev.pt are untouched.

A checkpoint is a dict: model, optimizer, model_args, iter_num, best_val_loss, config (every
training setting), plus what train.py needs to continue exactly (RNG and sampler states,
GradScaler, optimizer_param_names). Only tensors and plain Python values are stored, so loading
uses torch.load(weights_only=True) and never runs code from the file; before it, the file's zip parts
(check_zip_parts) and its pickle (checkpoint_pickle.check_pickle: what it builds, bounded by the file's size)
are checked, on the file opened once (_open_checkpoint).

nanoGPT interoperability:
- model_args on disk holds nanoGPT's seven GPTConfig fields (NANOGPT_MODEL_ARGS); attn_type and
  the variant fields are stored under 'attn_args', so nanoGPT's sample.py and train.py build a
  `base` checkpoint of ours with their own GPTConfig(**model_args). Other variants keep attn_type
  in model_args, so nanoGPT refuses them by name instead of running softmax attention on weights
  that mean something else (linear attention has base's exact parameter names and shapes).
  read_checkpoint merges the two again: callers always see the full dict in ckpt['model_args'],
  for new checkpoints, older ones of ours and nanoGPT's alike.
- Optimizer state: torch stores AdamW's state by parameter position. load_optimizer_state maps it
  by parameter name instead: from 'optimizer_param_names' (see optimizer_param_names) in our
  checkpoints, or, in nanoGPT's, from the order nanoGPT's configure_optimizers gives (the keys of
  checkpoint['model'] in order, 2-D and larger tensors decayed, the rest not).
- Integrity: torch.save writes a zip whose records carry CRC-32s (nanoGPT's files too);
  read_checkpoint checks them, so bytes flipped inside a tensor are reported like a truncated file.
"""

import concurrent.futures
import errno
import glob
import math
import os
import pickle
import random
import re
import shutil
import zipfile
import zlib

import numpy as np
import torch

from denoised_gpt.checkpoint_base import (CheckpointError, clean_name, first_damaged_record, nanogpt_param_names,
                                          optimizer_state_by_name, short_reason, train_state_problem,
                                          untrusted_file_error)
from denoised_gpt.checkpoint_pickle import RefusedPickle, check_pickle, record_offset
from denoised_gpt.files import FileError, open_regular, opened_path, write_problem
from denoised_gpt.sharded_checkpoint import (POINTER_NAME, FormatError, is_old_format, is_sharded_checkpoint,
                                             newest_sharded, pointer_problem, read_index, read_old_format,
                                             read_sharded, read_train_state, sharded_pointer)

CKPT_NAME = 'ckpt.pt'
PREV_NAME = 'ckpt.prev.pt'
SHARDED_GLOB = POINTER_NAME + '-*'  # the sharded checkpoints' folders in an out_dir
REQUIRED_KEYS = ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss', 'config')
# nanoGPT's GPTConfig fields: what its sample.py / train.py pass to GPTConfig(**model_args)
NANOGPT_MODEL_ARGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size', 'dropout')
NANOGPT_MASK_KEY = re.compile(r'transformer\.h\.\d+\.attn\.bias')  # a buffer, not a parameter


def save_checkpoint(state, out_dir):
    """Atomically write `state` to out_dir/ckpt.pt, keeping the previous one as ckpt.prev.pt.
    state['model_args'] is written in nanoGPT's layout (see split_model_args); `state` itself is
    not modified. If anything fails (an unpicklable value, a full disk, a kill) the existing files
    are untouched; a failed write (OSError) raises CheckpointError with a one-line message.
    Returns the path written."""
    path = os.path.join(out_dir, CKPT_NAME)
    prev = os.path.join(out_dir, PREV_NAME)
    for stale in glob.glob(path + '.tmp-*') + glob.glob(prev + '.tmp-*'):
        os.remove(stale)  # left by a process killed mid-save (only rank 0 ever writes here)
    if isinstance(state.get('model_args'), dict):
        state = dict(state)
        state['model_args'], state['attn_args'] = split_model_args(state['model_args'])
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(out_dir, exist_ok=True)  # (a read-only place fails here: said as a failed save)
        _write_synced(state, tmp)
        _check_readable(tmp, path)
        if os.path.exists(path):
            _keep_as_previous(path, prev)
        os.replace(tmp, path)
        _fsync_dir(out_dir)  # and the rename itself survives a power cut
    except Exception as e:
        cause = _os_error_behind(e)
        if cause is None:
            raise  # not a write failure (e.g. an unpicklable value): the traceback is the message
        raise CheckpointError(_write_failure_message(cause, out_dir, path, prev)) from e
    finally:
        for leftover in (tmp, f"{prev}.tmp-{os.getpid()}"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path


def split_model_args(model_args):
    """Full model_args -> (what nanoGPT's GPTConfig accepts, everything else) for the file.
    attn_type stays with nanoGPT's keys unless it is 'base', so that nanoGPT builds a base model
    and refuses (naming attn_type) any other variant."""
    keep = NANOGPT_MODEL_ARGS + (() if model_args.get('attn_type', 'base') == 'base' else ('attn_type',))
    return ({k: v for k, v in model_args.items() if k in keep},
            {k: v for k, v in model_args.items() if k not in keep})


def full_model_args(ckpt):
    """A checkpoint's whole model_args, whatever the layout on disk (see split_model_args)."""
    return {**ckpt['model_args'], **ckpt.get('attn_args', {})}


def _write_synced(state, tmp):
    # the CRC-32s are what read_checkpoint verifies: write them even if someone turned them off
    crc32_was = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them "the" checkpoint
    finally:
        torch.serialization.set_crc32_options(crc32_was)


def _check_readable(tmp, path):
    """CheckpointError unless the checkpoint just written to tmp passes the checks every reader makes of it
    (check_pickle: a training state of a million tiny values builds more than its file allows): never saved as
    path, then, to be refused on every load."""
    with open(tmp, 'rb') as f:
        try:
            check_pickle(f, "the checkpoint")
        except RefusedPickle as e:
            raise CheckpointError(f"{e}: it is not saved, as every reader would refuse it ({path} is as it "
                                  f"was)") from e


def _os_error_behind(e):
    """The OSError that caused `e`, if any: torch.save reports a failed write as a RuntimeError
    from its zip writer ('inline_container.cc ... unexpected pos') chained to the real OSError."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _write_failure_message(err, out_dir, path, prev):
    kept = [p for p in (path, prev) if os.path.isfile(p)]
    intact = (f"{' / '.join(kept)} {'are' if len(kept) > 1 else 'is'} intact" if kept
              else "no checkpoint was written")
    then = "resume with init_from='resume'" if kept else "start the run again"  # nothing to resume from
    cause, remedy = write_problem(err)
    return (f"{cause} in {out_dir} while saving a checkpoint; {intact}. {remedy.capitalize()} (or set out_dir "
            f"to a disk with room) and {then}")


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
    """out_dir -> its newest checkpoint: out_dir/ckpt.pt, or the sharded checkpoint's folder (fsdp runs,
    sharded_checkpoint.py) when out_dir has no ckpt.pt or the sharded one is as new or newer. A file or a
    sharded checkpoint's folder is returned unchanged."""
    if os.path.isfile(out_dir_or_file) or is_sharded_checkpoint(out_dir_or_file):
        return out_dir_or_file
    if os.path.basename(out_dir_or_file) == CKPT_NAME:
        return out_dir_or_file  # a checkpoint file that is not there (yet), or a folder in its place
    path = os.path.join(out_dir_or_file, CKPT_NAME)
    folder = newest_sharded(out_dir_or_file)
    if folder is None:
        return path
    if not os.path.isfile(path) or not is_sharded_checkpoint(folder):
        return folder if not os.path.isfile(path) else path
    try:  # both: e.g. an fsdp run resumed in one process, or a sharded checkpoint consolidated
        with _open_checkpoint(path, "") as f:  # checked as every reader checks it
            file_iter = _read_checkpoint_file(f, path, 'cpu', True, False, "")[0]['iter_num']
    except Exception:
        return path  # damaged: read_checkpoint says so, naming the fallback
    try:
        folder_iter = read_index(folder)['train_state']['iter_num']
    except Exception:
        return folder  # damaged, or of the earlier format: read_checkpoint says which
    for it, which in ((file_iter, path), (folder_iter, folder)):
        if train_state_problem({'iter_num': it}):
            return which  # not a count: read_checkpoint says so
    return folder if folder_iter >= file_iter else path


def read_checkpoint(out_dir_or_file, map_location='cpu', metadata_only=False, model_only=False,
                    trust_old_format=False):
    """(where the checkpoint was found, the checkpoint): out_dir's newest (checkpoint_path: ckpt.pt or a sharded
    checkpoint's folder), or the given file or folder, found and read once. Raises FileNotFoundError when there
    is none and CheckpointError when it is unreadable, naming ckpt.prev.pt as the fallback where it exists.
    metadata_only: for the settings, counters and model_args alone: the file is memory-mapped, so its
    tensors are not read (nor checked against their CRC-32s).
    model_only: for running the model (sample.py, eval.py): memory-mapped too, and only the model's
    tensors are read, from their records into memory (never through the mapping: a file cut short in place is
    one line, not SIGBUS), and checked against their CRC-32s; the optimizer state is never read (None).
    trust_old_format: a sharded checkpoint of the earlier format is read with DCP's own reader, which unpickles
    its metadata (sharded_checkpoint.read_old_format): only for a folder the user trusts (convert_checkpoint.py)."""
    path = checkpoint_path(out_dir_or_file)
    if is_sharded_checkpoint(path):
        return path, _load_sharded(path, metadata_only, model_only, trust_old_format)
    prev = os.path.join(os.path.dirname(path), PREV_NAME)
    has_fallback = os.path.basename(path) == CKPT_NAME and os.path.isfile(prev)
    use_prev = (f"The previous checkpoint {prev} was kept for this: resume from it with "
                f"`mv {prev} {path}`, or load it directly with read_checkpoint({prev!r})."
                if has_fallback else "No previous checkpoint (ckpt.prev.pt) exists next to it.")
    if os.path.isdir(path):  # (a sharded checkpoint's folder returned above)
        raise CheckpointError(f"{path} is a folder, not a checkpoint file: move it away" + (
            f", then resume from the previous checkpoint with `mv {prev} {path}`" if has_fallback else ""))
    if not os.path.isfile(path):
        problem = os.path.basename(path) == CKPT_NAME and pointer_problem(os.path.dirname(path))
        if problem:
            raise CheckpointError(problem)
        if has_fallback:
            raise CheckpointError(f"no checkpoint at {path}. {use_prev}")
        raise FileNotFoundError(f"no checkpoint at {path}: train one first (init_from='scratch'), "
                                f"or point out_dir at the directory that holds ckpt.pt")
    with _open_checkpoint(path, use_prev) as f:
        ckpt, damaged = _read_checkpoint_file(f, path, map_location, metadata_only, model_only, use_prev)
    if damaged:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({damaged}). {use_prev}")
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint: it lacks {', '.join(missing)}")
    problem = train_state_problem(ckpt)
    if problem:
        raise CheckpointError(f"checkpoint {path} is not as train.py writes one: its {problem}. {use_prev}")
    # torch.compile'd models (nanoGPT saves them so) prefix every key with '_orig_mod.'; nanoGPT
    # without flash attention (torch < 2) saved each layer's causal mask, a buffer, as attn.bias
    model = {clean_name(k): v for k, v in ckpt['model'].items()}
    ckpt['model'] = {k: v for k, v in model.items() if not NANOGPT_MASK_KEY.fullmatch(k)}
    ckpt['model_args'] = full_model_args(ckpt)
    ckpt.pop('attn_args', None)
    return path, ckpt


def _open_checkpoint(path, use_prev):
    """The checkpoint file at path, opened once for every read of it (files.open_regular: a FIFO or a device in
    its place is refused, never waited on), not through a symbolic link. CheckpointError otherwise. (Its link
    count is not asked: save_checkpoint hard-links it as ckpt.prev.pt for an instant.)"""
    try:
        return open_regular(path, f"put a checkpoint file there. {use_prev}", follow_links=False)
    except FileError as e:
        raise CheckpointError(str(e)) from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint {path} is a symbolic link, which is not followed: load the file it "
                                  f"names by its own path, or copy it there (cp -L)") from e
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e


def _read_checkpoint_file(f, path, map_location, metadata_only, model_only, use_prev):
    """(the checkpoint in the open file f, the name of its first damaged record or None), see read_checkpoint.
    torch reads the file f is (f's /proc/self/fd path where there is one), whatever path names by then."""
    head = f.read(2)
    if head not in (b'PK', b'\x80\x02'):  # torch.save's zip; its legacy pickle format
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt, or not a checkpoint: it does not "
                              f"begin as a file written by torch.save does. {use_prev}")
    if head == b'\x80\x02':  # torch.load gives each tensor the size this format declares, then reads it
        raise CheckpointError(f"checkpoint {path} is in torch.save's legacy format, which is not read: a damaged "
                              f"or crafted one can ask for any amount of memory (train.py and nanoGPT write the zip "
                              f"format). To convert a file you trust: python3 -c \"import torch; p = '{path}'; "
                              f"torch.save(torch.load(p, weights_only=True), p)\"")
    try:  # before torch.load, which would inflate a compressed part and build whatever the pickle asks
        check_zip_parts(f, f"checkpoint {path}")
        check_pickle(f, f"checkpoint {path}")
    except RefusedPickle as e:
        raise CheckpointError(str(e) if e.runs_code else f"{e}, so it is not read. {use_prev}") from e
    except ValueError as e:
        raise CheckpointError(f"{e}, so it is not read. {use_prev}") from e
    opened = opened_path(f)
    try:
        mmap = (metadata_only or model_only) and zipfile.is_zipfile(opened)  # torch maps only its zip format
        ckpt = torch.load(opened, map_location=map_location, weights_only=True, mmap=mmap)
        if mmap and not metadata_only and isinstance(ckpt, dict) and isinstance(ckpt.get('model'), dict):
            damaged = _read_model_tensors(f, ckpt)
            if 'optimizer' in ckpt:  # never read, and not left as views of the mapping (as a sharded read)
                ckpt['optimizer'] = None
            return ckpt, damaged
        damaged = None if metadata_only else first_damaged_record(opened)
        return ckpt, damaged and f"{damaged} does not match its CRC-32"
    except pickle.UnpicklingError as e:
        refused = untrusted_file_error(path, e, opened)  # holds code: refused as such
        if refused:
            raise refused from e
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({short_reason(e)}). {use_prev}") from e
    except Exception as e:  # short reads, bad zips, damaged records: torch raises many kinds
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: "
                              f"{short_reason(e)}). {use_prev}") from e


def check_zip_parts(file, what):
    """Refuse (ValueError) a torch.save zip whose parts would make torch.load allocate more than the file's
    bytes, before it does: a part compressed (inflates to any size), one declared beyond the file (allocated,
    then not there), or parts that overlap (one byte counted for many: together they may declare any size).
    torch.save writes each part stored, once. `file`: open, seekable."""
    try:
        with zipfile.ZipFile(file) as archive:
            parts = archive.infolist()
    except zipfile.BadZipFile:
        return  # damaged: torch.load says how
    length = file.seek(0, os.SEEK_END)
    for part in parts:
        if part.compress_type != zipfile.ZIP_STORED or part.file_size != part.compress_size \
                or part.header_offset + part.compress_size > length:
            raise ValueError(f"{what} holds {part.filename} compressed or larger than the file "
                             f"({part.file_size:,} bytes): torch.save writes neither")
    # a part's bytes follow its local header (30 bytes and its name, at least) up to the next part's header
    parts.sort(key=lambda part: part.header_offset)
    for part, after in zip(parts, parts[1:] + [None]):
        end = part.header_offset + 30 + len(part.orig_filename.encode()) + part.compress_size
        if end > (after.header_offset if after else length):
            raise ValueError(f"{what} holds parts that overlap ({part.filename} runs into "
                             f"{after.filename if after else 'the end of the file'}): torch.save writes each once")


def _load_sharded(folder, metadata_only, model_only, trust_old_format):
    """read_checkpoint for a sharded checkpoint's folder: the same dict (metadata_only: no tensors read,
    'model' and 'optimizer' None)."""
    folder = os.path.normpath(folder)  # a Path, a trailing slash: compared with the other folders' names below
    try:
        if trust_old_format and is_old_format(folder):
            ckpt = read_old_format(folder)
        elif metadata_only:
            ckpt = {**read_train_state(folder), 'model': None, 'optimizer': None}
            ckpt.pop('optimizer_param_groups')
        else:
            ckpt = read_sharded(folder, model_only=model_only)
    except CheckpointError:  # the earlier format, files it does not read: said as such, not as damage
        raise
    except Exception as e:  # a missing or truncated file, an index that does not fit its files
        reason = str(e) if isinstance(e, FormatError) else f"{type(e).__name__}: {short_reason(e)}"
        raise CheckpointError(f"sharded checkpoint {folder} is incomplete or corrupt ({reason}). "
                              f"{_sharded_fallback(folder)}") from e
    problem = train_state_problem(ckpt)
    if problem:
        raise CheckpointError(f"sharded checkpoint {folder} is not as train.py writes one: its {problem}. "
                              f"{_sharded_fallback(folder)}")
    ckpt['model_args'] = full_model_args(ckpt)
    ckpt.pop('attn_args', None)
    return ckpt


def _sharded_fallback(folder):
    """What to use instead of the sharded checkpoint in folder, which cannot be loaded."""
    others = sorted(glob.glob(os.path.join(os.path.dirname(folder), SHARDED_GLOB)))
    others = [o for o in others if o != folder and is_sharded_checkpoint(o)]
    return (f"The previous one, {others[-1]}, was kept for this: load it directly, or resume from it by "
            f"writing its name into {sharded_pointer(os.path.dirname(folder))}" if others else
            "No previous sharded checkpoint exists next to it.")


def _read_model_tensors(f, ckpt):
    """model_only: the model's tensors read from the open file f into memory, each checked against its record's
    CRC-32, in place of torch's memory-mapped views of them. A mapped file cut short in place kills the process
    that touches a page past its new end (SIGBUS, no message); read, it is one line. Only the model's records are
    read; the other tensors stay mapped, untouched. Returns what is damaged (a phrase), or None. A file that
    carries no CRCs (see first_damaged_record) is read unchecked."""
    records = _data_records(f)  # {offset of its bytes in the file: (size, CRC-32)}
    mapped = [t.untyped_storage() for t in _tensors(ckpt)]
    mapped = [s for s in mapped if s.nbytes()]
    if not records or not mapped:
        return None
    # torch maps the whole file once and views each record at its offset: the lowest view is the first record
    start = min(s.data_ptr() for s in mapped) - min(records)
    storages = {}  # tied weights share one record
    for name, t in ckpt['model'].items():
        storages.setdefault(t.untyped_storage().data_ptr(), name)

    def read(ptr):
        size, crc = records.get(ptr - start, (None, None))
        name = storages[ptr]
        if size is None or size != ckpt['model'][name].untyped_storage().nbytes():
            return name, None, f"the bytes of {name} match no record of the file"
        buffer = torch.empty(size, dtype=torch.uint8)
        if size and os.preadv(f.fileno(), [buffer.numpy()], ptr - start) != size:
            return name, None, f"it is shorter than when it was opened: it changed while {name} was read"
        if crc and zlib.crc32(buffer.numpy()) != crc:
            return name, None, f"the bytes of {name} do not match their record's CRC-32"
        return name, buffer.untyped_storage(), None

    # reading and zlib release the GIL: the cores share the work (~0.5 GB at GPT-2 size)
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(read, storages))
    read_into = {}
    for ptr, (name, storage, problem) in zip(storages, results):
        if problem:
            return problem
        read_into[ptr] = storage
    for name, t in ckpt['model'].items():
        ckpt['model'][name] = torch.empty(0, dtype=t.dtype).set_(
            read_into[t.untyped_storage().data_ptr()], t.storage_offset(), t.size(), t.stride())
    return None


def _data_records(f):
    """{offset of the record's bytes in the torch.save zip f: (their size, their CRC-32)} for its tensor records."""
    records = {}
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            if '/data/' not in info.filename or not info.file_size:
                continue
            records[record_offset(f, info)] = (info.file_size, info.CRC)
    return records


def _tensors(x):
    """Every tensor in a checkpoint's nested dicts, lists and tuples."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


# ----------------------------------------------------------------------------------------------
# Optimizer state by parameter name (torch's load_state_dict goes by position)

def optimizer_param_names(model, optimizer):
    """The parameter name of every slot of every param group of `optimizer`, e.g.
    [['transformer.wte.weight', ...], ['transformer.h.0.ln_1.weight', ...]]. train.py stores it in
    the checkpoint under 'optimizer_param_names' so that load_optimizer_state can map by name."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}  # a tied weight: its first name
    missing = [tuple(p.shape) for g in optimizer.param_groups for p in g['params'] if id(p) not in names]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the "
                         f"model (shapes {missing[:3]}): build it from this model's parameters")
    return [[names[id(p)] for p in g['params']] for g in optimizer.param_groups]


def load_optimizer_state(optimizer, model, checkpoint):
    """Load checkpoint['optimizer'] into `optimizer`, giving each parameter of `model` the state
    saved for the parameter of the same name. The slot names come from
    checkpoint['optimizer_param_names'] (ours) or, without it (nanoGPT's), from nanoGPT's own order:
    checkpoint['model']'s keys in order, less the tied lm_head.weight and buffers, 2-D and larger
    tensors in the decayed group, the rest in the other. Each group's hyperparameters (lr, betas,
    weight_decay, ...) come from the saved group, as with optimizer.load_state_dict, which this
    matches exactly when the order is the same. A missing name or a shape that differs raises
    CheckpointError. `model` is the plain module (not the DDP wrapper), as for configure_optimizers."""
    saved = checkpoint['optimizer']
    if 'optimizer_param_names' in checkpoint:
        saved_names, source = checkpoint['optimizer_param_names'], "its optimizer_param_names name"
    else:
        saved_names, source = nanogpt_param_names(checkpoint, model), "nanoGPT's grouping of its model gives"
    saved_names = [[clean_name(n) for n in group] for group in saved_names]
    sizes, named = [len(g['params']) for g in saved['param_groups']], [len(n) for n in saved_names]
    if sizes != named:
        raise CheckpointError(f"the checkpoint's optimizer has param groups of {sizes} tensors but {source} "
                              f"{named}: its state cannot be matched to parameters")
    saved_state = {name: saved['state'][i]
                   for group, names in zip(saved['param_groups'], saved_names)
                   for i, name in zip(group['params'], names) if i in saved['state']}
    own_names = optimizer_param_names(model, optimizer)
    _check_same_groups(own_names, saved_names)

    # torch's own format, numbered in our slot order, so that load_state_dict pairs each saved state
    # with the parameter of its name (and casts it to that parameter's device and dtype as usual)
    params = {clean_name(n): p for n, p in model.named_parameters()}
    slot = 0
    state, groups = {}, []
    for saved_group, own in zip(saved['param_groups'], own_names):
        ids = []
        for name in own:
            if name in saved_state:
                _check_state_shapes(name, saved_state[name], params[name])
                state[slot] = saved_state[name]
            ids.append(slot)
            slot += 1
        groups.append({**saved_group, 'params': ids})  # the saved lr, betas, weight_decay, ...
    optimizer.load_state_dict({'state': state, 'param_groups': groups})


def check_optimizer_state(checkpoint):
    """CheckpointError for an optimizer state that a resume would refuse (load_optimizer_state, or an fsdp run's
    load_sharded_state): param groups its names do not fit, a state for no parameter of the model, a moment of
    another shape than its parameter, a step that is no count. For a conversion, which so writes only what its
    readers read."""
    saved = checkpoint['optimizer']
    if saved is None:
        return
    try:
        names = checkpoint.get('optimizer_param_names') or nanogpt_param_names(checkpoint, None)
        sizes, named = [len(g['params']) for g in saved['param_groups']], [len(n) for n in names]
        if sizes != named:
            raise CheckpointError(f"the checkpoint's optimizer has param groups of {sizes} tensors but names "
                                  f"{named}: its state cannot be matched to parameters")
        state, _ = optimizer_state_by_name(checkpoint)
        for name, param_state in state.items():
            if name not in checkpoint['model']:
                raise CheckpointError(f"the checkpoint's optimizer state names {name[:80]!r}, which its model lacks")
            _check_state_shapes(name, param_state, checkpoint['model'][name])
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint's optimizer state is not as torch's AdamW writes one "
                              f"({type(e).__name__}: {short_reason(e)[:80]})") from e


def _check_same_groups(own_names, saved_names):
    if len(own_names) != len(saved_names):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_names)} parameter groups, this "
                              f"one {len(own_names)}: it was built by a different configure_optimizers")
    for g, (own, theirs) in enumerate(zip(own_names, saved_names)):
        if set(own) != set(theirs):
            lacking, extra = sorted(set(own) - set(theirs)), sorted(set(theirs) - set(own))
            raise CheckpointError(f"the checkpoint's optimizer state does not fit this model: param group {g} "
                                  f"lacks {lacking[:3] or 'nothing'} and has extra {extra[:3] or 'nothing'}")


def _check_state_shapes(name, param_state, param):
    for key, value in param_state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
            raise CheckpointError(f"the checkpoint's optimizer state {key} for {name} has shape "
                                  f"{tuple(value.shape)} but the model's parameter has {tuple(param.shape)}")
    step = param_state.get('step')  # AdamW's count of updates: its bias correction 1 - beta^step needs >= 0
    if step is not None and not (float(step) >= 0 and math.isfinite(float(step))):
        raise CheckpointError(f"the checkpoint's optimizer state step for {name} is {float(step):g}, not a count of "
                              f"updates (AdamW's bias correction would make every update non-finite)")


# ----------------------------------------------------------------------------------------------
# RNG states, as tensors and plain values so that weights_only loading accepts them

def restore_training_state(checkpoint, model, optimizer, scaler, train_batches, device_type, optimizer_loaded=False):
    """What a resumed run takes from its checkpoint besides the weights: the optimizer state (by parameter
    name; optimizer_loaded: already loaded, from a sharded checkpoint), and where train.py wrote it, the
    GradScaler, the RNGs and the training batches' sampler. Returns a note for the user, or None.
    CheckpointError when the optimizer state does not fit."""
    note = None
    if optimizer_loaded:
        pass
    elif checkpoint['optimizer'] is None:  # grow.py's and --merge_lora's: moments of other weights would not fit
        note = "the checkpoint has no optimizer state (grow.py or --merge_lora changed its weights): AdamW starts fresh"
    else:  # by parameter name: nanoGPT's checkpoints order their optimizer state differently
        # loading puts back the saved hyperparameters too; the run's own (weight_decay, betas: the
        # checkpoint's unless given again) are the ones to train with
        settings = [{k: v for k, v in group.items() if k != 'params'} for group in optimizer.param_groups]
        load_optimizer_state(optimizer, model, checkpoint)
        for group, own in zip(optimizer.param_groups, settings):
            group.update(own)
    if 'rng' in checkpoint:  # written by our train.py (a nanoGPT checkpoint has model and optimizer only)
        for key, restore in (('scaler', scaler.load_state_dict), ('rng', lambda s: restore_rng_state(s, device_type)),
                             ('train_batches', train_batches.load_state_dict)):
            try:
                restore(checkpoint[key])
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
                what = f"lacks {e}" if isinstance(e, KeyError) else f"holds what cannot be restored ({short_reason(e)})"
                raise CheckpointError(f"the checkpoint's {key} state is not as train.py writes it: it {what[:200]}. "
                                      f"Resume from a checkpoint train.py wrote") from e
    return note


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
