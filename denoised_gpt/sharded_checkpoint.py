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

No file of a sharded checkpoint may run code when read. DCP itself unpickles .metadata with plain pickle,
so every DCP read goes through checkpoint_reader, whose .metadata unpickler admits DCP's metadata classes
and nothing else (read_metadata); the shards' tensors and train_state.pt are read with weights_only. A
refusal is a one-line CheckpointError saying the file holds code, never that it is corrupt. Nor may a
folder from someone else do anything else: .metadata is read as plain data (it changes no class or object
of the process), only the folder's own regular files are read (no path out of it, no FIFO), and every
size it declares is checked against the bytes on disk before anything is allocated (_check_records).
"""
import contextlib
import dataclasses
import errno
import functools
import glob
import inspect
import io
import math
import os
import pickle
import shutil
import stat
import warnings
import zipfile

import torch

from denoised_gpt.checkpoint_base import CheckpointError, optimizer_state_by_name, short_reason, untrusted_file_error
from denoised_gpt.files import file_kind

POINTER_NAME = 'ckpt.sharded'
STATE_NAME = 'train_state.pt'
TIED = ('lm_head.weight', 'transformer.wte.weight')  # GPT ties the output layer to the token embedding


def sharded_pointer(out_dir):
    return os.path.join(out_dir, POINTER_NAME)


def newest_sharded(out_dir):
    """The folder out_dir/ckpt.sharded names, or None when out_dir has no sharded checkpoint, or a pointer
    that cannot be followed (pointer_problem says why; load_checkpoint does)."""
    return _read_pointer(out_dir)[0]


def pointer_problem(out_dir):
    """Why out_dir/ckpt.sharded is not followed, or None: it is not a file (a FIFO would hang the reader), or
    it names something other than a ckpt.sharded-* folder inside out_dir (a folder elsewhere would load
    another run's checkpoint through this one)."""
    return _read_pointer(out_dir)[1]


def _read_pointer(out_dir):  # (folder or None, problem or None)
    pointer = sharded_pointer(out_dir)
    if not os.path.lexists(pointer):
        return None, None
    mode = os.stat(pointer).st_mode if os.path.exists(pointer) else 0
    if not stat.S_ISREG(mode):
        return None, (f"{pointer} is a {file_kind(mode) if mode else 'broken link'}, not the file naming the newest "
                      f"sharded checkpoint: remove it (or put the file back)")
    with open(pointer) as f:
        name = f.read(256).strip()  # (written as one folder name)
    folder = os.path.join(out_dir, name)
    if not name.startswith(POINTER_NAME + '-') or os.path.basename(name) != name or \
            os.path.dirname(os.path.realpath(folder)) != os.path.realpath(out_dir):
        return None, (f"{pointer} names {name[:80]!r}, not a {POINTER_NAME}-* folder in {out_dir}, and is not "
                      f"followed: a run's checkpoints are its own folders (write the newest one's name there)")
    return folder, None


def is_sharded_checkpoint(path):
    # whatever train_state.pt is (a FIFO, say): read_train_state says what is wrong with it
    return os.path.lexists(os.path.join(path, STATE_NAME))


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
            dcp.save({'model': weights, 'optimizer': optimizer_state}, checkpoint_id=tmp,
                     **({'no_dist': not distributed} if _takes_no_dist(dcp.save) else {}))
        if writer:
            with open(os.path.join(tmp, STATE_NAME), 'wb') as f:
                torch.save({**train_state, 'optimizer_param_groups': param_groups}, f)
                f.flush()
                os.fsync(f.fileno())
    except (OSError, dcp.CheckpointException) as e:  # disk full, quota, I/O error on some rank
        intact = f"{current} is intact" if current else "no sharded checkpoint was written"
        then = "resume with init_from='resume'" if current else "start the run again"  # nothing to resume from
        cause = failure_cause(e)
        reason = getattr(cause, 'strerror', None) or f"{type(cause).__name__}: {short_reason(cause)}"
        raise CheckpointError(f"could not write a sharded checkpoint in {out_dir} ({reason}); "
                              f"{intact}. Fix the cause and {then}") from e
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
    weights = {k: v for k, v in ckpt['model'].items() if k != TIED[0]}
    optimizer_state, param_groups = optimizer_state_by_name(ckpt)
    train_state = {k: v for k, v in ckpt.items() if k not in ('model', 'optimizer', 'optimizer_param_names')}
    return weights, optimizer_state, param_groups, train_state


# ----------------------------------------------------------------------------------------------
# Reading

# what DCP pickles into .metadata (torch 2.13; 2.6 the same less _StorageInfo's transform_descriptors): its
# metadata dataclasses, the shapes, dtypes, layout and memory format of the tensors, and the path the
# checkpoint was saved to. Not BytesStorageMetadata: DCP reads such an entry with torch.load(weights_only=False),
# and save_sharded writes tensors only.
METADATA_GLOBALS = {
    'torch.distributed.checkpoint.metadata': {'Metadata', 'TensorStorageMetadata', 'ChunkStorageMetadata',
                                              'TensorProperties', 'MetadataIndex', 'StorageMeta',
                                              '_MEM_FORMAT_ENCODING'},
    'torch.distributed.checkpoint.filesystem': {'_StorageInfo'},
    'torch': {'Size'} | {name for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
    'torch.serialization': {'_get_layout'},  # layouts by name, from torch's own table
    'pathlib': {'PosixPath', 'WindowsPath'},
    'pathlib._local': {'PosixPath', 'WindowsPath'},  # where Python 3.13 defines them
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a .metadata file into plain values. A global outside METADATA_GLOBALS is refused before it is
    looked up (a crafted file never gets hold of a callable that could run code), and one inside comes back
    as a stand-in made for this one read (_Pickled), never as the real class: a pickle sets attributes of
    whatever it holds (BUILD), and on a real class or a shared object that would last for the whole process.
    _rebuild then makes DCP's objects from the plain values."""

    def __init__(self, file, path):
        super().__init__(file)
        self.path, self.stand_ins = path, {}

    def find_class(self, module, name):
        if name not in METADATA_GLOBALS.get(module, ()):
            raise CheckpointError(f"sharded checkpoint file {self.path} holds Python objects other than DCP's "
                                  f"checkpoint metadata (it references {module}.{name}), which are not loaded "
                                  f"because unpickling them can run code")
        if (module, name) not in self.stand_ins:
            real = super().find_class(module, name)
            self.stand_ins[module, name] = type(name, (_Pickled,), {
                'real': staticmethod(real), 'global_name': f"{module}.{name}", 'path': self.path})
        return self.stand_ins[module, name]


class _OfInstances:
    """A method of a stand-in's instances; looked up on the stand-in itself (what BUILD on the class does), a
    refusal."""

    def __init__(self, method):
        self.method = method

    def __get__(self, obj, cls):
        if obj is None:
            raise CheckpointError(_sets_attributes(cls.path, cls.global_name))
        return self.method.__get__(obj, cls)


class _Pickled:
    """A global of .metadata (`real`) as the file uses it: called (REDUCE, NEWOBJ), an instance that keeps the
    arguments, and the state the file gives it (BUILD): only DCP's dataclasses take state, each instance
    being made afresh from it; what anything else returns can be one object for every later use."""

    def __new__(cls, *args):
        self = object.__new__(cls)
        self.args = args
        return self

    @_OfInstances
    def __setstate__(self, state):
        if not dataclasses.is_dataclass(self.real):
            raise CheckpointError(_sets_attributes(self.path, f"what {self.global_name} returns"))
        self.state = state


def _sets_attributes(path, what):
    return (f"sharded checkpoint file {path} sets attributes of {what}, which would change it for the whole "
            f"process: DCP's metadata never does, and the file is not loaded")


def _rebuild(x, memo):
    """The value that x, from _MetadataUnpickler, stands for: plain values as they are; a global the file names
    as a value, the real one if a dtype (the only such global DCP writes); a stand-in's instance, a real object
    made here from plain values: for a dataclass a fresh instance given the file's fields, for anything else
    the real call (torch.Size, a layout or a memory format by name, a path) on the file's arguments.
    ValueError for anything else. memo: one real object per object of the file, so that shared references
    cannot make the work grow faster than the file."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if id(x) not in memo:
        memo[id(x)] = _rebuilt(x, memo)
    return memo[id(x)]


def _rebuilt(x, memo):  # _rebuild's work on one object of the file
    if type(x) in (list, tuple):
        return type(x)(_rebuild(v, memo) for v in x)
    if type(x) is dict:
        return {_rebuild(k, memo): _rebuild(v, memo) for k, v in x.items()}
    stand_in = x if isinstance(x, type) else type(x)
    if not issubclass(stand_in, _Pickled):
        raise ValueError(f"it holds a {type(x).__name__}")
    real = stand_in.real
    if x is stand_in:
        if not isinstance(real, torch.dtype):
            raise ValueError(f"it holds {stand_in.global_name} itself")
        return real
    if not dataclasses.is_dataclass(real):
        return real(*_rebuild(x.args, memo))
    fields, required = _fields(real)
    state, obj = _rebuild(getattr(x, 'state', None), memo), real.__new__(real)
    if x.args == () and '__setstate__' in vars(real):  # TensorProperties: a tuple
        obj.__setstate__(state)
    elif x.args == () and type(state) is dict and required <= set(state) <= fields:
        vars(obj).update(state)
    else:
        raise ValueError(f"its {stand_in.global_name} is not made as DCP makes one")
    return obj


@functools.cache
def _fields(dataclass):
    """A dataclass's field names, and those of them without a default."""
    fields = dataclasses.fields(dataclass)
    return ({f.name for f in fields},
            {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})


def read_metadata(path):
    """DCP's Metadata from the .metadata file at path, read as plain data (_MetadataUnpickler, _rebuild) and
    checked against the shards (_check_records). CheckpointError for a file that references anything else,
    sets attributes of a class or shared object, or names files other than its folder's regular files;
    ValueError for one that is not DCP's metadata of tensors or declares more than the shards hold."""
    with open(_file_in(*os.path.split(path))[0], 'rb') as f:
        try:
            metadata = _rebuild(_MetadataUnpickler(f, path).load(), {})
        except CheckpointError:
            raise
        except Exception as e:  # bytes that are not DCP's metadata: damaged, or some other file
            raise ValueError(_not_metadata(path, f" ({type(e).__name__}: {short_reason(e)})")) from e
    _check_records(metadata, path)
    return metadata


def _not_metadata(path, why=''):
    return f"{os.path.basename(path)} is not DCP's metadata of a checkpoint of tensors{why}"


HOLE_SLACK = 64 << 20  # bytes of a shard's records that may lie in holes beyond as many as its data


def _check_records(metadata, path):
    """Refuse metadata (from read_metadata) whose reading would allocate more than the shards hold, or read
    outside them, before anything is: the reader allocates every declared tensor before it reads a byte, then
    torch.loads each record (a torch.save zip) from its shard. So each tensor is covered by its chunks, and
    each chunk's record has at least the chunk's bytes (a record of a stride-0 tensor declares any size from
    a few bytes); a shard is a regular file of the folder (_file_in), its records lie in it, apart and on data
    (a sparse file's holes cost nothing to make), each a zip whose parts are stored within it (torch allocates
    a part's declared size, and a deflated part inflates to any); no record is transformed (DCP's compression:
    unbounded, and never written here)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    def tensor(m):  # the types DCP gives each field (the file chooses every value)
        return (isinstance(m, TensorStorageMetadata) and isinstance(m.properties, TensorProperties)
                and isinstance(m.properties.dtype, torch.dtype) and isinstance(m.size, torch.Size)
                and type(m.chunks) is list and all(
                    isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                    and isinstance(c.sizes, torch.Size) and len(c.offsets) == len(c.sizes) == len(m.size)
                    for c in m.chunks))

    def record(index, r):
        return (isinstance(index, MetadataIndex) and isinstance(r, _StorageInfo) and isinstance(r.relative_path, str)
                and all(type(n) is int and n >= 0 for n in (r.offset, r.length)))

    if not (isinstance(metadata, Metadata) and isinstance(metadata.storage_meta, (StorageMeta, type(None)))
            and isinstance(metadata.state_dict_metadata, dict) and isinstance(metadata.storage_data, dict)
            and all(map(tensor, metadata.state_dict_metadata.values()))
            and all(record(*item) for item in metadata.storage_data.items())):
        raise ValueError(_not_metadata(path))
    entries, records, name = metadata.state_dict_metadata, metadata.storage_data, os.path.basename(path)
    for fqn, m in entries.items():
        chunks = [c for c in m.chunks if math.prod(c.sizes)]  # (an empty shard of a rank: nothing to read)
        for chunk in chunks:
            record = records.get(MetadataIndex(fqn, chunk.offsets))
            needs = math.prod(chunk.sizes) * m.properties.dtype.itemsize
            if record is None or needs > record.length or any(
                    o < 0 or n < 0 or o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, m.size)):
                held = f"its record holds {record.length:,}" if record else "it has no record"
                raise ValueError(f"{name} declares {fqn}{list(chunk.offsets)} of shape {tuple(chunk.sizes)} "
                                 f"({needs:,} bytes) in {tuple(m.size)}, but {held}")
        covered = sum(math.prod(c.sizes) for c in chunks)
        if covered != math.prod(m.size) or len({c.offsets for c in chunks}) < len(chunks):
            raise ValueError(f"{name} declares {fqn} of shape {tuple(m.size)}, but its chunks do not cover it "
                             f"exactly once")
    folder, shards = os.path.dirname(path), {}
    for index, record in records.items():
        if getattr(record, 'transform_descriptors', None):
            raise CheckpointError(f"sharded checkpoint file {path} declares the record of {index.fqn} transformed "
                                  f"({', '.join(map(str, record.transform_descriptors))}), which is not read: "
                                  f"undoing it has no size bound, and sharded checkpoints here are written without")
        shards.setdefault(record.relative_path, []).append((record.offset, record.offset + record.length))
    for shard_name, ranges in shards.items():
        shard, size = _file_in(folder, shard_name, path)
        ranges = sorted(ranges)
        declared, held = sum(end - start for start, end in ranges), _data_bytes(shard, size)
        if ranges[-1][1] > size or any(start < end for (_, end), (start, _) in zip(ranges, ranges[1:])):
            raise ValueError(f"{name} declares records in {shard_name} that overlap or end beyond its {size:,} bytes")
        # (slack: some file systems and copies, ZFS with compression or rsync -S, store a real shard's runs of
        # zeros as holes; what a crafted folder can make the reader allocate stays bounded by its data)
        if declared > 2 * held + HOLE_SLACK:
            raise ValueError(f"{name} declares {declared:,} bytes of records in {shard_name}, which holds "
                             f"{held:,} bytes of data (the rest are holes in a sparse file)")
        with open(shard, 'rb') as f:
            for start, end in ranges:
                check_zip_parts(_Window(f, start, end - start), f"the record at byte {start:,} of {shard_name}")


def _file_in(folder, name, named_by=None):
    """The path and size of the file `name` in folder (named by the file named_by, if any), refused in one line
    unless it is a regular file inside the folder: a shard named by an absolute path, by '..' or by a link out
    of the folder would be read from anywhere the user can read, and a FIFO or a device would hang the reader
    (or never end). CheckpointError; FileNotFoundError when there is no such file."""
    path = os.path.join(folder, name)
    if named_by and (name in ('', '.', '..') or os.path.basename(name) != name):
        raise CheckpointError(f"sharded checkpoint file {named_by} names {name!r} as a shard, which is not a file "
                              f"in its folder and is not read: a sharded checkpoint reads only its own files")
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(folder):
        raise CheckpointError(f"sharded checkpoint file {path} is a link to {real}, outside its folder, and is not "
                              f"read: copy that file into the folder in place of the link (cp -L)")
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"sharded checkpoint file {path} is a {file_kind(st.st_mode)}, not a regular file, "
                              f"and is not read (reading it could wait forever): put the checkpoint's own file there")
    return path, st.st_size


def _data_bytes(path, size):
    """How many of the file's `size` bytes hold data: a sparse file's holes read as zeros but take no disk
    (os.truncate makes a terabyte of them at once), so its size says nothing of what was written. Where the
    system cannot tell (no SEEK_DATA), every byte counts."""
    if not hasattr(os, 'SEEK_DATA'):
        return size
    held = pos = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while pos < size:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            held += pos - start
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: only holes after pos; anything else: holes cannot be told
            return size
    finally:
        os.close(fd)
    return held


def check_zip_parts(file, what):
    """Refuse (ValueError) what would make torch.load allocate more than the bytes of `file` (open, seekable)
    hold, before it does: torch.save's legacy format (allocates each storage's declared size, then reads it),
    and a zip part declared beyond the file (allocated, then not there) or compressed (inflates to any size).
    torch.save writes zips of parts stored as they are."""
    try:
        with zipfile.ZipFile(file) as archive:
            parts = archive.infolist()
    except zipfile.BadZipFile:
        file.seek(0)
        if file.read(1) == b'\x80':  # a pickle: the legacy format
            raise ValueError(f"{what} is in torch.save's legacy format, which sharded checkpoints never use")
        return  # damaged: torch.load says how
    length = file.seek(0, os.SEEK_END)
    for part in parts:
        if part.compress_type != zipfile.ZIP_STORED or part.file_size != part.compress_size \
                or part.header_offset + part.compress_size > length:
            raise ValueError(f"{what} holds {part.filename} compressed or larger than the file "
                             f"({part.file_size:,} bytes): torch.save writes neither")


class _Window(io.RawIOBase):
    """`length` bytes of the open file f from `start`, read as a file of their own."""

    def __init__(self, f, start, length):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seekable(self):
        return True

    def readable(self):
        return True

    def seek(self, offset, whence=os.SEEK_SET):
        self.pos = min(max(0, offset + {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]),
                       self.length)
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buffer):
        self.f.seek(self.start + self.pos)
        n = self.f.readinto(memoryview(buffer)[:self.length - self.pos])
        self.pos += n
        return n


def checkpoint_reader(folder):
    """DCP's FileSystemReader for folder, its .metadata read by read_metadata: the storage_reader of every
    dcp.load here (without one, DCP builds its own reader, which unpickles .metadata with plain pickle)."""
    return _reader_class()(folder)


@functools.cache
def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = (self._get_metadata_path(kwargs.get('rank')) if hasattr(self, '_get_metadata_path')
                    else os.path.join(self.path, '.metadata'))  # torch 2.6: one .metadata, at the top
            metadata = read_metadata(str(path))
            # what FileSystemReader.read_metadata does after its own unpickling
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return CheckedReader


def raise_if_refused(path, e):
    """Raise the one-line CheckpointError that refuses a file holding pickled code, when e is one or wraps
    one (DCP gathers each rank's errors), or is torch.load(weights_only=True)'s refusal of a file at path
    (train_state.pt; a shard's tensor record: path is then the folder). Any other error: return."""
    cause = failure_cause(e)
    refused = cause if isinstance(cause, CheckpointError) else untrusted_file_error(path, cause)
    if refused is not None:
        raise refused from (None if refused is e else e)


def read_train_state(folder):
    path = _file_in(folder, STATE_NAME)[0]
    try:
        with open(path, 'rb') as f:
            check_zip_parts(f, STATE_NAME)
        return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:
        raise_if_refused(path, e)
        raise  # damaged: the caller says so


def read_sharded(folder, model_only=False):
    """A sharded checkpoint as one process's dict in ckpt.pt's layout, whole tensors on the CPU (the
    optimizer state positional, with optimizer_param_names, as train.py writes it). model_only: the
    weights alone ('optimizer': None)."""
    import torch.distributed.checkpoint as dcp
    state = read_train_state(folder)
    reader = checkpoint_reader(folder)
    wanted = ('model.',) if model_only else ('model.', 'optimizer.')
    # the saved tensors' names and shapes are in DCP's metadata: whole tensors to read each into
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items() if key.startswith(wanted)}
    with _quiet_single_process():
        if _takes_no_dist(dcp.load):
            dcp.load(tensors, storage_reader=reader, no_dist=True)
        else:  # this process alone, even under a process group: the switch older releases keep in DCP's worker
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
            _load_state_dict(tensors, reader, no_dist=True)
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
    reader = checkpoint_reader(folder)
    try:
        reader.read_metadata()  # a refusal here, in one line, rather than inside DCP's collective
        dcp.load(template, storage_reader=reader)
    except (Exception, dcp.CheckpointException) as e:  # a missing or truncated shard, no optimizer state in it
        raise_if_refused(folder, e)
        cause = failure_cause(e)
        raise CheckpointError(f"cannot resume from the sharded checkpoint {folder} ({type(cause).__name__}: "
                              f"{short_reason(cause)}); load_checkpoint({folder!r}) says more") from e
    set_model_state_dict(model, template['model'], options=_non_strict())
    set_optimizer_state_dict(model, optimizer, {'state': template['optimizer'], 'param_groups': optim['param_groups']})


def _non_strict():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(strict=False)  # lm_head.weight: the tied embedding, loaded under its first name


def _takes_no_dist(dcp_call):
    """Whether DCP's save / load takes no_dist (one process, whatever the process group). Releases whose calls
    do not (torch 2.6) run in one process exactly when there is no process group."""
    return 'no_dist' in inspect.signature(dcp_call).parameters


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every use without a process group, even when asked for exactly that (no_dist=True), and
    torch 2.6's DCP about the TypedStorage it calls itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='torch.distributed is (disabled, )?unavailable or uninitialized')
        warnings.filterwarnings('ignore', message='TypedStorage is deprecated')
        yield
