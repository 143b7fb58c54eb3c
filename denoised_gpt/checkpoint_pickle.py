"""
What a ckpt.pt's pickle can build, found before torch.load builds any of it. torch's weights-only unpickler runs
no code, but it builds whatever the pickle asks of the functions it allows: `_codecs.encode` called 3,000 times on
one memoised 1 MiB string makes 3 GB from a 1 MB file. So check_pickle walks the pickle opcode by opcode
(pickletools.genops: nothing is unpickled) and allows only what torch.save writes for a checkpoint (dicts, lists,
tuples, str, bytes, numbers, bools, None, OrderedDict, torch.Size, tensors and their storages), with the size of
everything it builds, a memoised object counted in full each time it is used again, at most pickle_bound of the
file's size. It imports nothing from the package.
"""
import _compat_pickle
import io
import os
import pickletools
import struct
import sys
import zipfile
import zlib

import torch

OBJECT, SLOT = 64, 8  # bytes counted for each object built (at least what Python takes), and each container slot
MAX_PICKLE_BYTES = 64 << 20  # a checkpoint's pickle is kilobytes: its tensors are records of their own
# the opcodes of pickle protocol 2 (torch.save's) for those objects
LEAVES = {'NONE', 'NEWTRUE', 'NEWFALSE', 'BININT', 'BININT1', 'BININT2', 'LONG1', 'BINFLOAT', 'BINUNICODE',
          'EMPTY_DICT', 'EMPTY_LIST', 'EMPTY_TUPLE'}
TUPLES = {'TUPLE': None, 'TUPLE1': 1, 'TUPLE2': 2, 'TUPLE3': 3}  # how many items each takes (None: to the mark)
FILLS = {'APPEND': 1, 'APPENDS': None, 'SETITEM': 2, 'SETITEMS': None, 'BUILD': 1}  # items added to the object below
# (and MARK, the memo's BINPUT / BINGET and their LONG_ forms, GLOBAL, REDUCE, BINPERSID, PROTO 2, STOP)
CALLS = {'collections OrderedDict', 'torch Size', '_codecs encode',  # (protocol 2 writes bytes as _codecs.encode)
         'torch._utils _rebuild_tensor_v2', 'torch._utils _rebuild_parameter',
         'torch._utils _rebuild_parameter_with_state'}
# the values a persistent id (a tensor's storage) names: its storage type and dtype (vars: no lazy imports)
STORAGES = {f'{module} {name}' for module in ('torch', 'torch.cuda') for name, value in vars(torch).items()
            if name.endswith('Storage') and isinstance(value, type)}
DTYPES = {f'torch {name}' for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def pickle_bound(file_size):
    """The most bytes of objects a pickle in a file of file_size bytes may build: eight times the file, plus 32 MiB.
    A real checkpoint builds some 1.3 kB for each tensor, whose record (header, data, its part of the pickle) is
    200 bytes or more, and little else."""
    return 8 * file_size + (32 << 20)


class RefusedPickle(ValueError):
    """A pickle that is not loaded; runs_code: it references what unpickling would run as code."""
    runs_code = False


class _Refused(Exception):
    pass


class _Built:
    """An object the pickle builds: its size with everything in it, its name where it is a global, and whether
    it has been used through the memo (then its size must be final)."""
    __slots__ = ('size', 'name', 'used')

    def __init__(self, size, name=None, used=False):
        self.size, self.name, self.used = size, name, used


def check_pickle(file, what):
    """RefusedPickle, one line naming `what`, unless the pickle of the torch.save zip in `file` (open, seekable, its
    parts checked: checkpoint.check_zip_parts) holds only what torch.save writes for a checkpoint and builds at most
    pickle_bound(the file's size) bytes. A zip that cannot be read passes: torch.load says how it is damaged."""
    size = file.seek(0, os.SEEK_END)
    try:
        archive = zipfile.ZipFile(file)
        first = archive.infolist()[0].filename
        info = archive.getinfo(first.split('/')[0] + '/data.pkl')  # where torch.load looks for it
    except (zipfile.BadZipFile, IndexError, KeyError):
        return
    if info.file_size > MAX_PICKLE_BYTES:
        raise RefusedPickle(f"{what} holds a pickle of {info.file_size:,} bytes, which no checkpoint does "
                            f"(theirs are kilobytes: the tensors are records of their own)")
    data = _stored_bytes(file, info)
    if info.CRC and zlib.crc32(data) != info.CRC:  # (0: saved without CRC-32s) flipped bytes read as anything
        raise RefusedPickle(f"{what} is truncated or corrupt ({info.filename} does not match its CRC-32)")
    try:
        _walk(io.BytesIO(data), pickle_bound(size))
    except _Refused as e:
        refused = RefusedPickle(f"{what} {e}")
        refused.runs_code = e.args[0].startswith("holds Python objects")
        raise refused from None
    except (ValueError, KeyError, IndexError) as e:
        raise RefusedPickle(f"{what} is truncated or corrupt (its pickle: {str(e)[:100]})") from None


def record_offset(file, info):
    """Where the bytes of the zip record `info` begin in `file`: after its local header and that header's name and
    extra field, whose lengths only the local header holds."""
    file.seek(info.header_offset + 26)
    name_length, extra_length = struct.unpack('<HH', file.read(4))
    return info.header_offset + 30 + name_length + extra_length


def _stored_bytes(file, info):
    """The bytes of the stored record `info` of the zip in `file`, as they are (zipfile's reader would fail a
    CRC-32 that torch.save left 0)."""
    file.seek(record_offset(file, info))
    return file.read(info.compress_size)


def _walk(stream, bound):
    """The bytes of objects the pickle in stream builds, each memo reference counted as a copy of what it refers
    to (a reader walking the result, as a conversion to JSON does, makes one); _Refused when that is more than
    `bound`, or the pickle uses other than torch.save's opcodes and calls. KeyError, IndexError or ValueError
    (genops) where it is damaged. The stack holds a _Built for each object the pickle puts there."""
    stack, marks, memo, built = [], [], {}, 0

    def take(n):  # the top n items (None: those above the last mark)
        start = marks.pop() if n is None else len(stack) - n
        if start < 0:
            raise IndexError("an opcode takes more than the stack holds")
        items = stack[start:]
        del stack[start:]
        return items

    for op, arg, _ in pickletools.genops(stream):
        name, new = op.name, None
        if name in LEAVES:
            new = _Built(OBJECT + _payload(arg))
            cost = new.size
        elif name in TUPLES:
            items = take(TUPLES[name])
            new = _Built(OBJECT + sum(SLOT + item.size for item in items))
            cost = OBJECT + SLOT * len(items)  # (the items themselves were counted as they were built)
        elif name in FILLS:
            items = take(FILLS[name])
            if stack[-1].used:  # so each use counts it whole (and nothing holds itself): pickle fills an object first
                raise _Refused(f"changes an object after using it ({name}), which torch.save does not write")
            stack[-1].size += sum(SLOT + item.size for item in items)
            cost = SLOT * len(items)
        elif name in ('BINPUT', 'LONG_BINPUT'):
            memo[arg] = stack[-1]
            continue
        elif name in ('BINGET', 'LONG_BINGET'):
            memo[arg].used = True
            new = _Built(memo[arg].size, memo[arg].name, used=True)
            cost = new.size
        elif name == 'MARK':
            marks.append(len(stack))
            continue
        elif name == 'GLOBAL':
            _check_global(arg)
            new = _Built(OBJECT, arg)
            cost = OBJECT
        elif name == 'REDUCE':
            args, call = take(2)[::-1]
            if call.name not in CALLS:
                raise _Refused(f"calls {_dotted(call.name) if call.name else 'an object'}, which torch.save does not "
                               f"write for a checkpoint")
            new = _Built(OBJECT + args.size)  # what each of CALLS builds is at most about the size of its arguments
            cost = new.size
        elif name == 'BINPERSID':  # a storage: its bytes are a record of the zip, not built from the pickle
            new = _Built(OBJECT + take(1)[0].size)
            cost = OBJECT
        elif name == 'LONG4':  # (torch's reader refuses it too, as if it were code)
            raise _Refused("holds an integer of more than 255 bytes, which no checkpoint does")
        elif name == 'PROTO':
            if arg != 2:
                raise _Refused(f"is a pickle of protocol {arg}, which torch.save does not write (it writes 2)")
            continue
        elif name == 'STOP':
            return built
        else:
            raise _Refused(f"uses the pickle opcode {name}, which torch.save does not write")
        if new is not None:
            stack.append(new)
        built += cost
        if built > bound:
            raise _Refused(f"would build more than {bound:,} bytes of objects from its pickle (a memoised object used "
                           f"over and over), which no checkpoint does")
    raise ValueError("it ends before its STOP")


def _payload(arg):
    """The bytes of a leaf's value beyond OBJECT: a str's characters (up to 4 bytes each), an int's digits."""
    if isinstance(arg, str):
        return len(arg) if arg.isascii() else 4 * len(arg)
    return arg.bit_length() // 8 if isinstance(arg, int) else 0


def _check_global(name):
    """_Refused unless `name` ('module attribute', as genops gives it) is one of CALLS, a storage type or a dtype:
    what torch.save writes for tensors and plain values."""
    if name in CALLS or name in STORAGES or name in DTYPES:
        return
    try:  # what torch's own weights-only unpickler refuses can run code; the rest merely is not a checkpoint's
        from torch._weights_only_unpickler import _get_allowed_globals
        harmless = _dotted(name) in _get_allowed_globals()
    except ImportError:
        harmless = False
    if harmless:
        raise _Refused(f"references {_dotted(name)}, which torch.save does not write for a checkpoint")
    module, _, attribute = _dotted(name).rpartition('.')
    loaded = sys.modules.get(module)  # (a module not imported yet is never imported to ask: that could run code)
    if loaded is not None and not hasattr(loaded, attribute):  # nothing of that name to call: damage, not code
        raise _Refused(f"is truncated or corrupt (its pickle names {_dotted(name)[:80]}, which does not exist)")
    raise _Refused(f"holds Python objects other than tensors and plain values (it references {_dotted(name)[:80]}), "
                   f"which are not loaded because unpickling them can run code")


def _dotted(name):
    """'module attribute' as Python 3 names it (pickle protocol 2 writes builtins as __builtin__)."""
    module, _, attribute = name.partition(' ')
    module, attribute = _compat_pickle.NAME_MAPPING.get(
        (module, attribute), (_compat_pickle.IMPORT_MAPPING.get(module, module), attribute))
    return f"{module}.{attribute}"
