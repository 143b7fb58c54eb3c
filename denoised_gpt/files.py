"""Files a user hands over or keeps, read and written so that every failure is one line that names the file,
the cause and the fix (never a traceback), and so that a failed write loses nothing already written.

- FileError: that line, as a ValueError (what the scripts print as their one-line error).
- write_problem: what an OSError on a write means to the user, told apart by errno (a full disk, a read-only
  file system, no permission): the package's one wording of them.
- write_atomically: a file written whole or not at all, the previous one intact on failure.
- lock_folder: one writer per folder, for folders that must hold nothing but their own files.
- open_regular, require_regular_file, read_json, parse_json, read_text, open_log: what a user may hand over
  (meta.json, an export's config.json and training_run.json, a run's metrics.jsonl, a prompts file) read without
  hanging on a FIFO, reading a device or a sparse file for ever, holding an unbounded file in memory, or a
  RecursionError from JSON nested deeper than Python's parser goes.
It imports nothing from the package.
"""
import contextlib
import errno
import json
import os
import stat

MAX_JSON_BYTES = 64 << 20  # a JSON file of ours is kilobytes; one larger than this is not one (read whole)
MAX_PROMPT_BYTES = 16 << 20  # far more text than any block holds: a larger file is not a prompts file


class FileError(ValueError):
    """A file that cannot be read or written as needed; the message names it, the cause and the fix."""


def write_problem(e):
    """(cause, remedy) for an OSError from writing: a full disk (or quota), a read-only file system and a
    missing permission each say so; anything else is the system's own words."""
    if e.errno in (errno.ENOSPC, getattr(errno, 'EDQUOT', errno.ENOSPC)):
        return "no space left on device", "free some space"
    if e.errno == errno.EROFS:
        return "read-only file system", "write to a writable disk"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied", "give this user write access there"
    return e.strerror or str(e), "fix the cause"


def write_atomically(path, write, binary=False, then=""):
    """Write the file at path whole or not at all: write(f) fills path + '.tmp', which then replaces path, so
    a reader never sees half a file and a failed write leaves the file there before as it was. The temporary
    file is removed on any failure. A failed write (OSError) raises FileError naming path, the cause, what
    is intact and the remedy; `then` is added to the remedy (e.g. how to write it again)."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb' if binary else 'w') as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if not isinstance(e, OSError):
            raise
        cause, remedy = write_problem(e)
        kept = "the file there before is intact" if os.path.isfile(path) else "nothing was written"
        raise FileError(f"cannot write {path}: {cause}; {kept}. {remedy.capitalize()}{then}") from e


def file_kind(mode):
    """What a file that is not a regular one is, from its stat mode."""
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def require_regular_file(path, fix):
    """FileError unless path is a regular file (a missing or unreadable one passes: opening it names that).
    Asked of stat before anything opens it: open() waits for ever on a FIFO, a device such as /dev/zero
    never ends, a folder raises IsADirectoryError."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise FileError(f"cannot read {path}: it is a {file_kind(mode)}, not a file; {fix}")


def open_regular(path, fix, follow_links=True):
    """The file at path, open for reading (binary), when it is a regular file: asked of the open file itself
    (fstat), so that a FIFO or a device put there after any earlier check is refused too, never read (opening
    it does not wait: O_NONBLOCK). FileError naming it and `fix` otherwise; OSError when it cannot be opened
    (follow_links=False: a link at path is ELOOP)."""
    flags = os.O_RDONLY | getattr(os, 'O_NONBLOCK', 0) | (0 if follow_links else getattr(os, 'O_NOFOLLOW', 0))
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            error = FileError(f"cannot read {path}: it is a {file_kind(mode)}, not a file; {fix}")
            error.kind = file_kind(mode)
            raise error
        return os.fdopen(fd, 'rb')
    except BaseException:
        os.close(fd)
        raise


def opened_path(f):
    """A path naming the open file f itself, for a reader that takes a path (torch.load, safetensors): Linux's
    /proc/self/fd/<n>, whatever f's own path names by now; elsewhere f's path."""
    fd_path = f'/proc/self/fd/{f.fileno()}'
    return fd_path if os.path.exists(fd_path) else f.name


def read_at_most(path, max_bytes, fix):
    """The bytes of the regular file at path (open_regular), or None when it holds more than max_bytes: at
    most max_bytes + 1 are read, whatever its size claims."""
    with open_regular(path, fix) as f:
        data = f.read(max_bytes + 1)
    return data if len(data) <= max_bytes else None


def open_log(path, max_bytes, what, fix):
    """The regular file at path (open_regular), open for reading, when it holds at most max_bytes (asked of the
    open file: a sparse file of a terabyte takes no disk, and would be read for hours). FileError naming `what`,
    the file and `fix` otherwise. Read it with a limit too: a log may grow while it is read."""
    f = open_regular(path, fix)
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        f.close()
        raise FileError(f"{what} {path} is {size:,} bytes, more than {max_bytes >> 20:,} MiB, which no {what} "
                        f"is; {fix}")
    return f


def lock_folder(path, busy):
    """An exclusive lock on the existing folder at path, held by this process until the returned FolderLock is
    closed (or dropped) or the process ends (flock on the folder itself: nothing is written into it, nothing
    left behind). FileError `busy` when another process holds it. None where the system has no flock."""
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, 'O_DIRECTORY', 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise FileError(busy) from e
    return FolderLock(fd)


class FolderLock:
    """lock_folder's open descriptor of the folder: closing it (or dropping the last reference) ends the lock."""

    def __init__(self, fd):
        self.fd = fd

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = close


def parse_json(text):
    """json.loads, with every failure a ValueError: nesting deeper than Python's parser goes (a
    RecursionError) says 'nested too deeply'."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json(path, fix):
    """The JSON value in the file at path. FileError naming the file, the cause and `fix` for one that is
    not a regular file, is larger than MAX_JSON_BYTES or is not valid JSON (bad syntax, not UTF-8, an int of
    too many digits, nested too deeply); OSError (FileNotFoundError, PermissionError) when it cannot be
    opened."""
    data = read_at_most(path, MAX_JSON_BYTES, fix)
    if data is None:
        raise FileError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB, which no JSON file of ours is; {fix}")
    try:
        return parse_json(data.decode('utf-8'))
    except ValueError as e:  # a UnicodeDecodeError is one too
        raise FileError(f"{path} is not valid JSON ({e}); {fix}") from e


def read_text(path, max_bytes, what, fix):
    """The UTF-8 text of the file at path, read whole. FileError naming `what`, the file, the cause and `fix`
    for one that is not a regular file, is larger than max_bytes (found by reading at most max_bytes + 1,
    whatever its size claims) or is not UTF-8; OSError (FileNotFoundError, PermissionError) when it cannot
    be opened."""
    data = read_at_most(path, max_bytes, fix)
    if data is None:
        raise FileError(f"{what} {path} is larger than {max_bytes >> 20} MiB; {fix}")
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise FileError(f"{what} {path} is not UTF-8 text ({e}); {fix}") from e


# the token files of a dataset (data/<name>/train.bin, val.bin): said before torch loads, so kept here
PREPARE_AGAIN = "remove it and run that dataset's prepare.py again"


def permission_denied(path):
    return ValueError(f"cannot read {path}: permission denied; give the user running this read access to it "
                      f"and search (x) access to its folders (chmod/chown), or run as the user who prepared it")


def missing_data_hint(data_dir, path=None):
    """What to run so that data_dir gets its train.bin/val.bin (or the labels file `path` of a recall
    dataset): the dataset's own prepare.py when it has one (data/<name>/prepare.py), else what such a folder
    needs."""
    if path is not None and path.endswith("_labels.bin"):
        return (f"{data_dir}'s meta.json marks labelled answers, which its prepare.py writes beside the tokens "
                f"(e.g. python3 data/mqar/prepare.py --out_dir={data_dir}): prepare the dataset again")
    script = os.path.join(data_dir, "prepare.py")
    if os.path.isfile(script):
        return f"run python3 {script} first (it writes train.bin and val.bin there)"
    return (f"{data_dir} needs the train.bin and val.bin that a data/<name>/prepare.py writes (e.g. python3 "
            f"data/shakespeare_char/prepare.py); set the `dataset` key (--dataset=<name> reads data/<name>/, "
            f"or an absolute path) to a folder holding them")


def token_file_size(data_dir, path):
    """Size in bytes of the token file `path`, once it is known to be a regular file we may read;
    otherwise an error that says which of those it is not."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: {missing_data_hint(data_dir, path)}") from None
    except NotADirectoryError:
        raise ValueError(f"cannot read {path}: {data_dir} is not a folder; set the `dataset` key to the folder "
                         f"holding train.bin and val.bin") from None
    except PermissionError:  # a folder on the way lacks x permission (stat fails, so isfile() says False)
        raise permission_denied(path) from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"cannot read {path}: it is a {file_kind(st.st_mode)}, not a token file; {PREPARE_AGAIN}")
    try:
        open(path, "rb").close()  # now, rather than as a raw PermissionError at the first batch
    except PermissionError:
        raise permission_denied(path) from None
    return st.st_size


def check_token_files(data_dir):
    """data_dir's train.bin and val.bin exist and can be read: checked before a model is built, so that a
    missing dataset is said at once (their sizes and ids are checked when TokenBatches opens them)."""
    for split in ("train", "val"):
        token_file_size(data_dir, os.path.join(data_dir, f"{split}.bin"))
