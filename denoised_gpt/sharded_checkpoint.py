"""
Sharded checkpoints, what parallel='fsdp' runs write: each rank saves its own rows of the weights and of
AdamW's state, so no rank ever gathers the whole training state.

out_dir/ckpt.sharded          one line: the folder of the newest sharded checkpoint (replaced atomically)
out_dir/ckpt.sharded-0000500/ the checkpoint of iteration 500:
    rank-00000.safetensors    each rank's rows of each tensor it holds, under the tensor's name
    rank-00001.safetensors    ...
    checkpoint.json           everything else a ckpt.pt holds (model_args, iter_num, config, RNG and sampler
                              states, the optimizer's param groups by name), as JSON, and every tensor's dtype,
                              shape and chunks: which file holds which of its rows
out_dir/ckpt.sharded-0000250/ the one before it, kept as ckpt.prev.pt is

Tensors are named 'model.<parameter>' (the lm_head tied to the token embedding stored once, as
transformer.wte.weight), 'optimizer.<parameter>.<step|exp_avg|exp_avg_sq>' and 'train_state.<n>' (the
tensors among the train state, in rank 0's file). A save writes the folder under a .tmp name (each rank its
file, rank 0 checkpoint.json last, all fsynced), renames it, and only then points ckpt.sharded at it: a
kill at any moment leaves the pointer naming a whole checkpoint.

A folder from someone else can describe nothing it does not hold: nothing in it is pickled, and no byte
offset of it is taken on trust. The safetensors library checks each rank's file's header against the file
(every tensor's bytes inside it, none overlapping, dtype x shape = bytes); checkpoint.json, capped at what a
real one needs (MAX_INDEX_BYTES, MAX_INDEX_VALUES), is checked before anything is allocated (read_index):
each tensor's chunks split it along its first dimension (what FSDP2 writes) and cover each row exactly once,
each in its own file, where it must be a tensor of the chunk's dtype and shape. A load so allocates the bytes
the files hold and no more (nor more than twice the data of sparse files, plus HOLE_SLACK), and reads only the
folder's own regular files (the pointer and checkpoint.json too: no link, no other hard link), each opened
once and read, not mapped, from that descriptor: a file cut short meanwhile is an error, not SIGBUS.

Reading: a run under fsdp loads its rows in place (load_sharded_state), however many ranks wrote them;
everything else (one process, DDP, sample.py, eval.py, convert_checkpoint.py) reads whole tensors into a
ckpt.pt's dict (read_sharded), through read_checkpoint, which takes the newer of ckpt.pt and the sharded
checkpoint. Every rank must see out_dir (a shared filesystem across nodes).

Folders of the earlier format (torch.distributed.checkpoint's pickled .metadata and train_state.pt) are
refused, naming the conversion: convert_checkpoint.py --trust_old_format=True reads one with DCP's own
reader (read_old_format), which unpickles it, for a folder the user trusts.
"""
import contextlib
import errno
import glob
import inspect
import json
import math
import os
import re
import shutil
import warnings

import torch

from denoised_gpt.checkpoint_base import CheckpointError, optimizer_state_by_name, short_reason
from denoised_gpt.files import FileError, open_regular, opened_path, parse_json


class FormatError(ValueError):
    """A folder whose files are not a sharded checkpoint as save_sharded writes one; the message, one line,
    says what in which of its files (the folder itself named by the caller)."""


POINTER_NAME = 'ckpt.sharded'
INDEX_NAME = 'checkpoint.json'
FORMAT, VERSION = 'denoised_gpt sharded checkpoint', 1
SHARD_FILE = re.compile(r'rank-\d{5}\.safetensors')
OLD_FORMAT_FILES = ('train_state.pt', '.metadata')  # torch.distributed.checkpoint's folder, the earlier format
TIED = ('lm_head.weight', 'transformer.wte.weight')  # GPT ties the output layer to the token embedding
# the dtypes a checkpoint holds, by their names in checkpoint.json and in safetensors' headers
DTYPES = {'float32': 'F32', 'bfloat16': 'BF16', 'float16': 'F16', 'float64': 'F64', 'int64': 'I64',
          'int32': 'I32', 'int16': 'I16', 'int8': 'I8', 'uint8': 'U8', 'bool': 'BOOL'}
MAX_INDEX_BYTES = 16 << 20  # checkpoint.json: some 150 bytes a tensor, a few kilobytes of train state
MAX_INDEX_VALUES = 1 << 20  # its JSON values: some 15 a tensor (48 tensors a layer, with AdamW's state)
HOLE_SLACK = 64 << 20  # bytes a folder's files may hold in holes beyond as many as their data (see _check_data)
MAX_DIMS = 8


def sharded_pointer(out_dir):
    return os.path.join(out_dir, POINTER_NAME)


def newest_sharded(out_dir):
    """The folder out_dir/ckpt.sharded names, or None when out_dir has no sharded checkpoint, or a pointer
    that cannot be followed (pointer_problem says why; read_checkpoint does)."""
    return _read_pointer(out_dir)[0]


def pointer_problem(out_dir):
    """Why out_dir/ckpt.sharded is not followed, or None: it is not a regular file of out_dir's own (a FIFO would
    hang the reader; a link, symbolic or hard, may be a file from anywhere), or it names something other than a
    ckpt.sharded-* folder inside out_dir (a folder elsewhere would load another run's checkpoint through this
    one)."""
    return _read_pointer(out_dir)[1]


def _read_pointer(out_dir):  # (folder or None, problem or None)
    pointer = sharded_pointer(out_dir)
    if not os.path.lexists(pointer):
        return None, None
    try:
        with _open_regular(pointer, what=pointer, fix="remove it, or put back the file naming the newest sharded "
                                                         "checkpoint") as f:
            name = f.read(256).decode(errors='replace').strip()  # (written as one folder name)
    except CheckpointError as e:
        return None, str(e)
    except OSError as e:
        return None, f"cannot read {pointer} ({e.strerror or e}): remove it (or put the file back)"
    folder = os.path.join(out_dir, name)
    if not name.startswith(POINTER_NAME + '-') or os.path.basename(name) != name or \
            os.path.dirname(os.path.realpath(folder)) != os.path.realpath(out_dir):
        return None, (f"{pointer} names {name[:80]!r}, not a {POINTER_NAME}-* folder in {out_dir}, and is not "
                      f"followed: a run's checkpoints are its own folders (write the newest one's name there)")
    return folder, None


def is_old_format(folder):
    """Whether folder holds a sharded checkpoint of the earlier format (see the top)."""
    return not os.path.lexists(os.path.join(folder, INDEX_NAME)) and \
        any(os.path.lexists(os.path.join(folder, name)) for name in OLD_FORMAT_FILES)


def is_sharded_checkpoint(path):
    """Whether path is a sharded checkpoint's folder (of either format: read_index refuses the earlier one)."""
    return any(os.path.lexists(os.path.join(path, name)) for name in (INDEX_NAME, *OLD_FORMAT_FILES))


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


def _named_tensors(weights, optimizer_state):
    """The checkpoint's tensors by their names in it (see the top)."""
    named = {f'model.{k}': v for k, v in weights.items()}
    for param, state in optimizer_state.items():
        named.update({f'optimizer.{param}.{field}': v for field, v in state.items() if torch.is_tensor(v)})
    return named


def _rows_held(tensor, writer):
    """(the rows of `tensor` this rank holds as a CPU tensor, the first of them), or None when it holds none: a
    DTensor's local shard, which must split it along its first dimension; a plain tensor whole, by the writer
    alone (every rank has the same one)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(tensor, DTensor):
        return (tensor.detach(), 0) if writer else None
    local = tensor.to_local().detach()
    start = _global_offset(tensor)
    if local.numel() == 0:
        return None
    if any(start[1:]) or tuple(local.shape[1:]) != tuple(tensor.shape[1:]):
        raise CheckpointError(f"a tensor of shape {tuple(tensor.shape)} sharded as {tensor.placements} is split "
                              f"along other than its first dimension, which sharded checkpoints do not hold")
    return local, start[0]


def _global_offset(dtensor):
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # where older releases keep it
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    return compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)[1]


def save_sharded(weights, optimizer_state, param_groups, train_state, out_dir, writer=True):
    """Write a sharded checkpoint of iteration train_state['iter_num'] into out_dir (see the top). Under
    torch.distributed every rank calls it with its shards (a collective) and writer is rank 0's; in one
    process it writes the whole tensors as one rank's. Returns the folder written. CheckpointError when a
    rank cannot write (the checkpoints already there are intact)."""
    import torch.distributed as dist
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    name = f"{POINTER_NAME}-{train_state['iter_num']:07d}"
    final, tmp = os.path.join(out_dir, name), os.path.join(out_dir, name + '.tmp')
    state_tensors, too_large = {}, None
    if writer:
        state = _to_json({**train_state, 'optimizer_param_groups': param_groups}, state_tensors)
        too_large = _index_size_problem(json.dumps(state).encode())  # its index would be refused by every reader
        if too_large:
            too_large = f"the training state cannot be saved in a sharded checkpoint's index: as JSON it {too_large}"
            if not distributed:  # (the other ranks learn it below, once they have written their files)
                raise CheckpointError(f"{too_large}; nothing was written")
    if writer:
        os.makedirs(out_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(out_dir, POINTER_NAME + '-*.tmp')):
            shutil.rmtree(stale)  # left by a run killed mid-save
        os.makedirs(tmp)
    if distributed:
        dist.barrier()  # tmp is there, and clean, before any rank writes into it
    current = newest_sharded(out_dir)
    file = f'rank-{rank:05d}.safetensors'
    chunks, failure = {}, None
    try:
        held = {}
        for key, tensor in {**_named_tensors(weights, optimizer_state), **state_tensors}.items():
            rows = _rows_held(tensor, writer)
            if rows is not None:
                local, start = rows
                held[key] = torch.empty(local.shape, dtype=local.dtype).copy_(local)  # CPU, contiguous, its own
                chunks[key] = (_dtype_name(tensor.dtype), list(tensor.shape), start, start + _rows(local.shape))
        _write_safetensors(held, os.path.join(tmp, file))
    except OSError as e:  # disk full, quota, I/O error
        failure = e
    every_rank = [None] * world
    if distributed:
        dist.all_gather_object(every_rank, (file, chunks, _reason(failure) or too_large))
    else:
        every_rank = [(file, chunks, _reason(failure))]
    failed = next((reason for _, _, reason in every_rank if reason), None)
    if writer and failed is None:
        try:
            _write_index(tmp, state, every_rank)
        except OSError as e:
            failed = _reason(e)
    if distributed:
        outcome = [failed]
        dist.broadcast_object_list(outcome, src=0)  # rank 0's index written, or why not
        failed = outcome[0]
    if failed:
        intact = f"{current} is intact" if current else "no sharded checkpoint was written"
        then = "resume with init_from='resume'" if current else "start the run again"  # nothing to resume from
        raise CheckpointError(f"could not write a sharded checkpoint in {out_dir} ({failed}); "
                              f"{intact}. Fix the cause and {then}") from failure
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


def _reason(e):
    return None if e is None else (e.strerror or f"{type(e).__name__}: {short_reason(e)}")


def _rows(shape):
    return shape[0] if len(shape) else 1  # a 0-d tensor (AdamW's step) is one row


def _dtype_name(dtype):
    name = str(dtype).removeprefix('torch.')
    if name not in DTYPES:
        raise CheckpointError(f"a tensor of dtype {name} cannot be stored in a sharded checkpoint "
                              f"(it holds {', '.join(DTYPES)})")
    return name


def _write_safetensors(tensors, path):
    from safetensors.torch import save_file
    save_file(tensors, path)
    _fsync(path)


def _write_index(folder, state, every_rank):
    """checkpoint.json of the folder: the train state and each tensor's chunks in row order."""
    tensors = {}
    for file, chunks, _ in every_rank:
        for key, (dtype, shape, start, stop) in chunks.items():
            entry = tensors.setdefault(key, {'dtype': dtype, 'shape': shape, 'chunks': []})
            entry['chunks'].append({'file': file, 'rows': [start, stop]})
    for entry in tensors.values():
        entry['chunks'].sort(key=lambda chunk: chunk['rows'])
    path = os.path.join(folder, INDEX_NAME)
    with open(path, 'w') as f:
        json.dump({'format': FORMAT, 'version': VERSION, 'train_state': state, 'tensors': tensors}, f)
    _fsync(path)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    _fsync(out_dir)  # the renames survive a power cut


def checkpoint_as_sharded(ckpt):
    """A checkpoint dict in ckpt.pt's layout (read_checkpoint's) -> save_sharded's arguments (whole
    tensors: one shard), for convert_checkpoint.py."""
    weights = {k: v for k, v in ckpt['model'].items() if k != TIED[0]}
    optimizer_state, param_groups = optimizer_state_by_name(ckpt)
    train_state = {k: v for k, v in ckpt.items() if k not in ('model', 'optimizer', 'optimizer_param_names')}
    return weights, optimizer_state, param_groups, train_state


# The train state as JSON: tensors, tuples and dicts with keys other than strings are marked, the rest is JSON's
_TENSOR, _TUPLE, _ITEMS = '__tensor__', '__tuple__', '__items__'


def _to_json(value, tensors):
    """value as JSON, each tensor in it put into `tensors` as 'train_state.<n>' and named in its place."""
    if torch.is_tensor(value):
        name = f'train_state.{len(tensors)}'
        tensors[name] = value
        return {_TENSOR: name}
    if isinstance(value, tuple):
        return {_TUPLE: [_to_json(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_to_json(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(type(k) is str and k not in (_TENSOR, _TUPLE, _ITEMS) for k in value):
            return {k: _to_json(v, tensors) for k, v in value.items()}
        return {_ITEMS: [[_to_json(k, tensors), _to_json(v, tensors)] for k, v in value.items()]}
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise CheckpointError(f"a training state holding a {type(value).__name__} cannot be saved in a sharded "
                          f"checkpoint (it holds tensors and JSON's values)")


def _from_json(value, tensors):
    """_to_json undone, the named tensors taken from `tensors`. ValueError for a name it lacks."""
    if isinstance(value, list):
        return [_from_json(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and _TENSOR in value:
        if value[_TENSOR] not in tensors:
            raise FormatError(f"its train state names a tensor {str(value[_TENSOR])[:80]!r} it does not list")
        return tensors[value[_TENSOR]]
    if len(value) == 1 and _TUPLE in value:
        return tuple(_from_json(value[_TUPLE], tensors))
    if len(value) == 1 and _ITEMS in value:
        items = _from_json(value[_ITEMS], tensors)
        if not all(isinstance(item, list) and len(item) == 2 and _hashable(item[0]) for item in items):
            raise FormatError("its train state holds a dict that is not a list of key-value pairs")
        return dict(items)
    return {k: _from_json(v, tensors) for k, v in value.items()}


def _hashable(key):
    return key is None or type(key) in (bool, int, float, str) or (type(key) is tuple and all(map(_hashable, key)))


# ----------------------------------------------------------------------------------------------
# Reading

def read_index(folder):
    """checkpoint.json of the sharded checkpoint in folder, checked (see the top): {'train_state': JSON,
    'tensors': {name: (torch dtype, shape, [(file, first row, row after the last), ...])}}. CheckpointError
    for a folder of the earlier format or files it does not read; ValueError for an index that is not one."""
    if is_old_format(folder):
        raise CheckpointError(old_format_refusal(folder))
    index = _parse_index(os.path.join(folder, INDEX_NAME))
    if not (isinstance(index, dict) and index.get('format') == FORMAT and isinstance(index.get('tensors'), dict)):
        raise FormatError(f"{INDEX_NAME} is not the index of a sharded checkpoint")
    if index.get('version') != VERSION:
        raise FormatError(f"{INDEX_NAME} is of format version {str(index.get('version'))[:20]}, which this code does "
                          f"not "
                         f"read (it reads version {VERSION}): update the code, or convert it where it was written")
    tensors = {}
    for name, entry in index['tensors'].items():
        tensors[name] = _checked_entry(name, entry)
    return {'train_state': index.get('train_state'), 'tensors': tensors}


def _parse_index(path):
    """The JSON of checkpoint.json, read from the file once opened (_open_regular), at most MAX_INDEX_BYTES
    holding at most MAX_INDEX_VALUES values: what parsing it allocates stays small (a value takes some 64 bytes
    of Python objects from as few as 2 bytes of JSON)."""
    with _open_regular(path) as f:
        data = f.read(MAX_INDEX_BYTES + 1)
    problem = _index_size_problem(data)
    if problem:
        raise FormatError(f"{INDEX_NAME} {problem}")
    try:
        return parse_json(data.decode('utf-8'))
    except ValueError as e:  # a UnicodeDecodeError is one too
        raise FormatError(f"{INDEX_NAME} is not valid JSON ({short_reason(e)})") from e


def _index_size_problem(data):
    """Why the JSON text `data` is too large to be read as an index (read_index), or None."""
    if len(data) > MAX_INDEX_BYTES:
        return (f"is larger than {MAX_INDEX_BYTES >> 20} MiB, which no index is (a 1,000-layer model's is some "
                f"8 MiB)")
    values = data.count(b',') + data.count(b'[') + data.count(b'{')  # (at least one for each value but the first)
    if values > MAX_INDEX_VALUES:
        return f"holds {values:,} values or more, which no index does (a 1,000-layer model's holds under 750,000)"
    return None


def _checked_entry(name, entry):
    """(dtype, shape, chunks) of one tensor of the index, or ValueError: chunks in row order, each a range of
    rows in a file of its own, together covering every row of the tensor exactly once."""
    def bad(why):
        return FormatError(f"{INDEX_NAME} declares {name[:80]!r} {why}")

    if not isinstance(entry, dict) or entry.get('dtype') not in DTYPES:
        raise bad(f"with no dtype it holds ({', '.join(DTYPES)})")
    shape, chunks = entry.get('shape'), entry.get('chunks')
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(n) is int and n >= 0 for n in shape)):
        raise bad("with a shape that is not a list of sizes")
    if not isinstance(chunks, list) or not all(isinstance(c, dict) and isinstance(c.get('file'), str)
                                               and SHARD_FILE.fullmatch(c['file']) and _is_range(c.get('rows'))
                                               for c in chunks):
        raise bad("with chunks that are not ranges of rows in rank-NNNNN.safetensors files")
    rows, covered = _rows(shape), 0
    for chunk in chunks:  # in order, each starting where the one before ended: every row once
        start, stop = chunk['rows']
        if start != covered or stop > rows:
            raise bad(f"of shape {tuple(shape)} with chunks that do not cover its {rows:,} rows exactly once")
        covered = stop
    if covered != rows or len({c['file'] for c in chunks}) < len(chunks):
        raise bad(f"of shape {tuple(shape)} with chunks that do not cover its {rows:,} rows exactly once, each in "
                  f"a file of its own")
    return getattr(torch, entry['dtype']), shape, [(c['file'], *c['rows']) for c in chunks]


def _is_range(rows):
    return isinstance(rows, list) and len(rows) == 2 and all(type(n) is int for n in rows) and 0 <= rows[0] < rows[1]


def old_format_refusal(folder):
    out_dir = os.path.dirname(os.path.normpath(folder)) or '.'
    return (f"sharded checkpoint {folder} is in the earlier format (torch.distributed.checkpoint's pickled "
            f".metadata), which is not read: unpickling it can run code, and its metadata can describe what its "
            f"files do not hold. If you trust where it came from, convert it once: python3 convert_checkpoint.py "
            f"--out_dir={out_dir} --trust_old_format=True")


def _open_regular(path, what=None, fix=None):
    """The regular file at path, open for reading (files.open_regular: nothing swapped in after a check is
    read), not a link, with no other hard link (which may be a file from anywhere: a link's target is not in the
    folder). CheckpointError otherwise, naming the file as `what` (by default as a sharded checkpoint's file)
    and `fix`."""
    what = what or f"sharded checkpoint file {path}"
    try:
        f = open_regular(path, "put the checkpoint's own file there", follow_links=False)
    except FileError as e:
        fix = fix or "put the checkpoint's own file there"
        raise CheckpointError(f"{what} is a {e.kind}, not a regular file, and is not read (reading it could wait "
                              f"forever): {fix}") from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{what} is a link, and is not read: a sharded checkpoint reads only its own files; "
                                  f"{fix or 'copy the file there (cp -L)'}") from e
        raise
    links = os.fstat(f.fileno()).st_nlink
    if links > 1:
        f.close()
        raise CheckpointError(f"{what} has {links - 1} other hard link(s), so it may be a file from outside its "
                              f"folder, and is not read: {fix or 'copy the folder (cp -r) and load the copy'}")
    return f


class _Shard:
    """A rank file, open: its tensors as its safetensors header places them (checked against the file by the
    safetensors library when it was opened), their bytes read from the open file into the tensor they fill,
    never mapped: a file cut short while it is read is one line (FormatError), where a mapped one is SIGBUS."""

    def __init__(self, f, file):
        self.f, self.file = f, file
        size = int.from_bytes(os.pread(f.fileno(), 8, 0), 'little')
        header = json.loads(os.pread(f.fileno(), size, 8))
        self.start = 8 + size
        self.tensors = {k: v for k, v in header.items() if k != '__metadata__'}

    def dtype_and_shape(self, name):  # (safetensors' dtype code, shape) or None
        entry = self.tensors.get(name)
        return (entry['dtype'], entry['shape']) if entry else None

    def read_rows(self, name, first, out):
        """Fill `out` with the rows first.. of the tensor `name` (a 0-d tensor: itself)."""
        stage = out if out.device.type == 'cpu' and out.is_contiguous() else torch.empty_like(out, device='cpu')
        buffer = stage.reshape(-1).view(torch.uint8).numpy()
        row = math.prod(self.tensors[name]['shape'][1:]) * out.element_size()
        self.f.seek(self.start + self.tensors[name]['data_offsets'][0] + first * row)
        if self.f.readinto(buffer) != len(buffer):
            raise FormatError(f"{self.file} is shorter than when it was opened: it changed while it was read")
        if stage is not out:
            out.copy_(stage)


@contextlib.contextmanager
def _shards(folder, files):
    """({file name: its _Shard}, the bytes of data the files hold) for the folder's own files named, each opened
    once through _open_regular (a link out of the folder, a FIFO, a file with other hard links: CheckpointError)
    and its header checked against its size by the safetensors library."""
    from safetensors import SafetensorError, safe_open
    with contextlib.ExitStack() as stack:
        readers, held = {}, 0
        for file in sorted(files):
            f = stack.enter_context(_open_regular(os.path.join(folder, file)))
            try:  # the file just checked, even if its path names another one by now
                with safe_open(opened_path(f), 'pt'):
                    pass
                readers[file] = _Shard(f, file)
            except (SafetensorError, OSError, ValueError) as e:
                raise FormatError(f"{file} is not a whole safetensors file ({short_reason(e)})") from e
            held += _data_bytes(f.fileno(), os.fstat(f.fileno()).st_size)
        yield readers, held


def _check_chunks(tensors, readers, held):
    """ValueError unless each chunk of `tensors` (read_index's) is a tensor of its file with the chunk's dtype
    and shape, and the files hold at least half their bytes as data (see HOLE_SLACK). Then the tensors' bytes
    are the bytes of their files: what a load allocates."""
    needed = 0
    for name, (dtype, shape, chunks) in tensors.items():
        for file, start, stop in chunks:
            want = [stop - start, *shape[1:]] if shape else []
            found = readers[file].dtype_and_shape(name)
            if found != (DTYPES[_dtype_name(dtype)], want):
                what = f"{found[0]} of shape {found[1]}" if found else "nothing"
                raise FormatError(f"{file} holds {what} as {name[:80]!r}, which {INDEX_NAME} declares "
                                  f"{_dtype_name(dtype)} of shape {want}")
            needed += math.prod(want) * dtype.itemsize
    _check_data(needed, held)


def _check_data(needed, held):
    """A sparse file's holes read as zeros but take no disk (os.truncate makes a terabyte of them at once): its
    size says nothing of what was written. So the bytes to allocate may be at most twice the files' data, plus
    HOLE_SLACK once for the folder (some file systems and copies, ZFS with compression or rsync -S, store a real
    file's runs of zeros as holes)."""
    if needed > 2 * held + HOLE_SLACK:
        raise FormatError(f"{INDEX_NAME} declares {needed:,} bytes of tensors, but the files hold {held:,} bytes of "
                          f"data "
                         f"(the rest are holes in sparse files)")


def _data_bytes(fd, size):
    """How many of the open file's `size` bytes hold data (SEEK_DATA / SEEK_HOLE); every byte where the system
    cannot tell."""
    if not hasattr(os, 'SEEK_DATA'):
        return size
    held = pos = 0
    try:
        while pos < size:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            held += pos - start
    except OSError as e:
        if e.errno != errno.ENXIO:  # ENXIO: only holes after pos; anything else: holes cannot be told
            return size
    return held


def _read_tensors(folder, index, wanted):
    """The whole tensors of the index whose names start with one of `wanted`, read from the folder's files
    (checked first: _shards, _check_chunks)."""
    tensors = {name: entry for name, entry in index['tensors'].items() if name.startswith(wanted)}
    with _shards(folder, {file for _, _, chunks in tensors.values() for file, _, _ in chunks}) as (readers, held):
        _check_chunks(tensors, readers, held)
        out = {}
        for name, (dtype, shape, chunks) in tensors.items():
            whole = out[name] = torch.empty(shape, dtype=dtype)
            for file, start, stop in chunks:
                readers[file].read_rows(name, 0, whole[start:stop] if shape else whole)
    return out


def read_train_state(folder):
    """Everything but the weights and the optimizer state: the train state of checkpoint.json with its tensors,
    and 'optimizer_param_groups'. CheckpointError or FormatError as read_index, and for a damaged train state."""
    index = read_index(folder)
    return _train_state(index, _read_tensors(folder, index, ('train_state.',)))


def _train_state(index, tensors):
    try:
        state = _from_json(index['train_state'], tensors)
    except RecursionError:
        raise FormatError(f"the train state of {INDEX_NAME} is nested too deeply") from None
    if not isinstance(state, dict) or 'optimizer_param_groups' not in state:
        raise FormatError(f"{INDEX_NAME} holds no train state")
    return state


def read_sharded(folder, model_only=False):
    """A sharded checkpoint as one process's dict in ckpt.pt's layout, whole tensors on the CPU (the
    optimizer state positional, with optimizer_param_names, as train.py writes it). model_only: the
    weights alone ('optimizer': None). Each file is opened once."""
    index = read_index(folder)
    tensors = _read_tensors(folder, index, ('train_state.', 'model.') + (() if model_only else ('optimizer.',)))
    return _as_checkpoint(_train_state(index, tensors), tensors, model_only)


def _as_checkpoint(state, tensors, model_only):
    """The train state and the tensors by their names in a sharded checkpoint -> ckpt.pt's dict."""
    weights = {k.removeprefix('model.'): v for k, v in tensors.items() if k.startswith('model.')}
    if TIED[1] not in weights:
        raise FormatError(f"it holds no {TIED[1]}")
    weights[TIED[0]] = weights[TIED[1]]  # one tensor under both names, as in a ckpt.pt
    groups = state.pop('optimizer_param_groups')
    state['model'] = weights
    state['optimizer'] = None  # model_only, or a checkpoint without optimizer state (grow.py's, say)
    if not model_only and groups is not None:
        state['optimizer'], state['optimizer_param_names'] = _positional(tensors, groups)
    return state


def _positional(tensors, groups):
    """The 'optimizer.<name>.<key>' tensors and the param groups by name -> torch's optimizer state_dict (slots
    numbered in group order) and the slots' names."""
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
    """Load a sharded checkpoint's weights and AdamW state into `model` (sharded with FSDP2) and `optimizer`
    built on it: each rank reads the rows its shards cover, however many ranks wrote them. CheckpointError
    naming what does not fit."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict,
                                                         StateDictOptions)
    from torch.distributed.tensor import DTensor
    weights = get_model_state_dict(model)
    weights.pop(TIED[0], None)
    optim = get_optimizer_state_dict(model, optimizer)  # (creates AdamW's state to read into)
    template = _named_tensors(weights, optim['state'])
    try:
        index = read_index(folder)
        missing = sorted(set(template) - set(index['tensors']))
        if missing:
            more = f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise FormatError(f"it holds no {missing[0]}{more}")
        saved = {name: index['tensors'][name] for name in template}
        for name, tensor in template.items():
            dtype, shape, _ = saved[name]
            if list(tensor.shape) != shape:
                raise FormatError(f"its {name} has shape {tuple(shape)}, the model's {tuple(tensor.shape)}")
        with _shards(folder, {file for _, _, chunks in saved.values() for file, _, _ in chunks}) as (readers, held):
            _check_chunks(saved, readers, held)
            for name, tensor in template.items():
                local, first = (tensor.to_local(), _global_offset(tensor)[0]) if isinstance(tensor, DTensor) \
                    else (tensor, 0)
                _fill_rows(local, first, name, saved[name], readers)
                if name.endswith('.step') and not (local.numel() == 1 and 0 <= float(local) < math.inf):
                    raise FormatError(f"its {name} is {float(local.flatten()[0]):g}, not a count of updates "
                                      f"(AdamW's bias correction would make every update non-finite)")
    except (ValueError, OSError) as e:  # a missing or damaged file, a checkpoint of another model
        reason = str(e) if isinstance(e, FormatError) else short_reason(e)
        raise CheckpointError(f"cannot resume from the sharded checkpoint {folder} ({reason})") from e
    # strict=False: lm_head.weight is the tied embedding, loaded under its first name
    set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, {'state': optim['state'], 'param_groups': optim['param_groups']})


def _fill_rows(local, first, name, entry, readers):
    """Copy into `local` (rows first.. of the tensor `name`) the rows the saved chunks hold of them."""
    dtype, shape, chunks = entry
    if not shape:
        readers[chunks[0][0]].read_rows(name, 0, local)
        return
    last = first + local.shape[0]
    for file, start, stop in chunks:
        lo, hi = max(start, first), min(stop, last)
        if lo < hi:
            readers[file].read_rows(name, lo - start, local[lo - first:hi - first])


# ----------------------------------------------------------------------------------------------
# The earlier format, read only when the user trusts the folder (convert_checkpoint.py --trust_old_format=True)

def read_old_format(folder):
    """A sharded checkpoint of the earlier format (torch.distributed.checkpoint's files and train_state.pt) as
    read_sharded's dict, read with DCP's own reader: it unpickles .metadata, which can run code. Only for a
    folder the user trusts."""
    import torch.distributed.checkpoint as dcp
    state = torch.load(os.path.join(folder, OLD_FORMAT_FILES[0]), map_location='cpu', weights_only=True)
    reader = dcp.FileSystemReader(folder)
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()}
    with warnings.catch_warnings():  # DCP warns on every use without a process group
        warnings.simplefilter('ignore')
        if 'no_dist' in inspect.signature(dcp.load).parameters:
            dcp.load(tensors, storage_reader=reader, no_dist=True)
        else:  # torch 2.6: one process exactly when there is no process group
            dcp.load(tensors, storage_reader=reader)
    return _as_checkpoint(state, tensors, model_only=False)
