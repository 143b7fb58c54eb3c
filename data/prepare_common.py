"""
The shared body of data/openwebtext/prepare.py and data/fineweb_edu/prepare.py (the writer helpers
are also used by data/shakespeare_char/prepare.py):

documents -> seeded train/val split -> GPT-2 BPE in parallel (each document followed by EOT, as
nanoGPT) -> train.bin / val.bin (flat uint16, nanoGPT-compatible) + meta.json.

Two ways in, one split (`split_documents`) and one tokeniser (`encode_documents`):
- the Hugging Face hub goes through `datasets`, which downloads resumably and caches every slow
  step (download, Arrow conversion, tokenisation) under --cache_dir, so re-running a 54 GB job
  reuses what was done;
- local --input files skip `datasets`: each worker process reads its own byte range of a file (or
  parquet row group), parses and tokenises it, so nothing but a 0.1 s tokenizer load runs on one
  core. On 2 cores that is ~2x a one-process tokenising loop; the `datasets` import (0.8-1.1 s) and its
  one-process JSON-to-Arrow conversion (~0.5 s per 50 MB) would come first (docs/benchmarks.md).
The scripts import this file by putting data/ on sys.path; it puts the repository there too, for what it
shares with the package (the words for a failed write: denoised_gpt/files.py).
"""
import argparse
import bz2
import errno
import glob
import gzip
import itertools
import json
import lzma
import multiprocessing
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from math import ceil

import numpy as np
import tiktoken
from tqdm import tqdm

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for the package
from denoised_gpt.files import parse_json, write_problem  # noqa: E402

RESTART_HINT = """\
Interrupted or failed? Run the same command again. From the hub, the download resumes
(huggingface_hub keeps partial files) and each finished step (download, Arrow conversion,
tokenisation) is cached by `datasets` in --cache_dir (default: $HF_DATASETS_CACHE,
~/.cache/huggingface/datasets) and reused; delete that dataset folder after a successful run to get
the disk space back. Local --input files are not cached: a rerun tokenises them again, and while it
runs --out_dir holds the tokens twice (tokens.partial, in input order, then train.bin). train.bin,
val.bin and meta.json are written as *.partial and renamed only when all of them are complete, so a
train.bin that exists is a finished one."""

EOT_TEXT = "<|endoftext|>"
TEXT_KINDS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
COMPRESSED = {".gz", ".bz2", ".xz", ".zst", ".lz4"}  # read whole, by one worker per file
# the CPUs this process may use (taskset, SLURM, containers), not all the machine has
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
# Local files are cut into units of total / (16 x num_proc) bytes, so that the workers finish
# together (the last unit runs alone), within these bounds: a unit's text, documents and tokens
# are in one worker's memory at once (a 16.8 MB unit of JSON lines: +49 MB of peak RSS).
MIN_UNIT_BYTES, MAX_UNIT_BYTES = 64 << 10, 16 << 20
# What cannot be cut is read whole into one worker's memory, with its documents and tokens (about 3x its
# size): a compressed file (inflated), a JSON array, a .txt document, one line or paragraph. Past this, a
# file is refused instead: a .gz of zeros inflates a thousandfold, a file may be one endless line.
MAX_WHOLE_BYTES = 1 << 30
ENCODE_CHARS = 1 << 20  # characters of documents joined into one tiktoken call
LINE_END = re.compile(rb"\n")
BLANK_LINE_END = re.compile(rb"\n[ \t\r\f\v]*\n")  # a line break, a blank line and its line break


class PrepareError(Exception):
    """Bad input or arguments: printed as one line, without a traceback."""


@contextmanager
def one_line_errors():
    """Bad input or arguments (PrepareError) end the script with one line on stderr and exit status
    2, as argparse's own errors do: a traceback would read as a bug in the script."""
    try:
        yield
    except PrepareError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        sys.exit(2)


def run_examples_script(parser, argv, prepare, out_dir):
    """The end of a synthetic-examples script (MQAR, needles): the seeds of its two splits and --out_dir added to
    its parser, then prepare(the arguments), bad input said in one line."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the training examples")
    parser.add_argument("--val_seed", type=int, default=1, help="seed of the validation examples (not --seed)")
    parser.add_argument("--out_dir", default=out_dir, help="where the files go (default: %(default)s)")
    with one_line_errors():
        prepare(parser.parse_args(argv))


def check_out_dir(out_dir):
    """Refuse, before any work, an --out_dir that cannot become a folder we write in: otherwise
    os.makedirs or the final renames fail only after the download and the tokenising. It is made and
    written in now, so that what only the system knows (a name too long, a read-only file system) is
    said now too; the folders made for the trial are removed again, and a failed run leaves none."""
    if not out_dir:
        raise PrepareError("--out_dir is empty; give a folder (it is made if missing), e.g. --out_dir .")
    path = os.path.abspath(out_dir)
    made = []  # the missing folders of the path, innermost first
    while not os.path.lexists(path):  # the nearest part of the path that exists
        made.append(path)
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        where = "is" if path == os.path.abspath(out_dir) else f"goes through {path}, which is"
        raise PrepareError(f"--out_dir {out_dir} {where} a file, not a folder; give a folder (it is made if "
                           f"missing) or move that file away")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PrepareError(f"--out_dir {out_dir}: no permission to write in {path}; give a folder you can write in")
    try:
        os.makedirs(os.path.abspath(out_dir), exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise PrepareError(f"--out_dir {out_dir}: cannot make that folder or write in it ({e.strerror or e}); "
                           f"give a folder you can write in") from e
    finally:
        for folder in made:
            if os.path.isdir(folder):
                os.rmdir(folder)


def make_parser(description, out_dir):
    p = argparse.ArgumentParser(description=description, epilog=RESTART_HINT,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="local files or globs instead of the hub: .txt (see --text_unit), .jsonl (one document "
                        "per line) or .json (JSON lines, or one array of records), .parquet; .gz/.xz/.bz2/.zst/.lz4 "
                        "compressed ones too. A compressed file, a JSON array, a .txt document and a line are read "
                        f"whole: at most {MAX_WHOLE_BYTES >> 30} GiB each")
    p.add_argument("--out_dir", default=out_dir, help="where train.bin, val.bin, meta.json go (default: %(default)s)")
    p.add_argument("--num_proc", type=int, default=CPUS,
                   help="worker processes for download and tokenisation (default: the usable CPUs, %(default)s)")
    p.add_argument("--val_fraction", type=float, default=0.0005,
                   help="fraction of documents for val.bin (default: nanoGPT's %(default)s)")
    p.add_argument("--seed", type=int, default=2357, help="seed of the train/val split (default: nanoGPT's %(default)s)")
    p.add_argument("--max_tokens", type=int,
                   help="stop train.bin at this many tokens (whole documents; val.bin is unaffected)")
    p.add_argument("--text_column", default="text", help="column/field holding the document text (default: %(default)s)")
    p.add_argument("--text_unit", default="document", choices=["document", "paragraph", "line"],
                   help="what one document is in a .txt input: the whole file, a paragraph (lines up to a blank "
                        "line), or a line; blank lines are never documents themselves")
    p.add_argument("--cache_dir", help="hub only: the datasets cache (default: $HF_DATASETS_CACHE); needs room for "
                                       "the download, its Arrow copy and the tokens")
    return p


# ------------------------------------------------------------------------------- tokenising

@lru_cache(maxsize=None)
def gpt2_encoding():
    # tiktoken's "r50k_base" is GPT-2's BPE (the same ranks, pattern and <|endoftext|>; a test checks
    # it) stored as one .tiktoken file: it loads in 0.1 s, where "gpt2" parses vocab.bpe and
    # encoder.json in 0.3 s. Workers forked after the first call share it.
    try:
        return tiktoken.get_encoding("r50k_base")
    except Exception as e:  # requests' ConnectionError and friends: the BPE file is fetched once, then cached
        raise PrepareError(f"could not load the GPT-2 BPE (tiktoken 'r50k_base'): {e}. tiktoken downloads it once; "
                           f"offline, point TIKTOKEN_CACHE_DIR at a folder holding the file") from e


def encode_documents(docs):
    """GPT-2 tokens of `docs`, each followed by EOT, as one flat uint16 array, and the number of
    tokens of each document (its EOT included). The same as encode_ordinary(doc) + [EOT] per
    document: a literal '<|endoftext|>' inside a document is plain text, as in nanoGPT."""
    enc = gpt2_encoding()
    arrays, lengths, i = [], [], 0
    while i < len(docs):
        if EOT_TEXT in docs[i]:
            ids = np.append(enc.encode_to_numpy(docs[i], disallowed_special=()), enc.eot_token)
            arrays.append(ids.astype(np.uint16))
            lengths.append([len(ids)])
            i += 1
            continue
        # Documents joined by '<|endoftext|>' and encoded with that special token allowed: tiktoken
        # encodes the text between special tokens independently, so this is exactly the per-document
        # result, and one call per ~1M characters is ~12% faster than one per document.
        j, chars = i, 0
        while j < len(docs) and chars < ENCODE_CHARS and EOT_TEXT not in docs[j]:
            chars += len(docs[j])
            j += 1
        ids = enc.encode_to_numpy(EOT_TEXT.join(docs[i:j]) + EOT_TEXT, allowed_special={EOT_TEXT})
        ends = np.flatnonzero(ids == enc.eot_token) + 1  # GPT-2's plain-text ids are all < EOT
        assert len(ends) == j - i
        arrays.append(ids.astype(np.uint16))
        lengths.append(np.diff(ends, prepend=0))
        i = j
    if not arrays:
        return np.zeros(0, np.uint16), np.zeros(0, np.int64)
    return np.concatenate(arrays), np.concatenate(lengths).astype(np.int64)


def split_documents(n, val_fraction, seed):
    """nanoGPT's split, computed as datasets' train_test_split(test_size=val_fraction, seed=seed):
    a seeded permutation of the n documents; its first ceil(val_fraction * n) are val, the rest,
    in that shuffled order, train. Returns (val indices, train indices)."""
    n_val = ceil(val_fraction * n)
    if n_val >= n:
        raise PrepareError(f"--val_fraction {val_fraction} of {n} documents leaves none for train; lower it")
    order = np.random.default_rng(seed).permutation(n)
    return order[:n_val], order[n_val:]


def documents_within(lengths, max_tokens):
    """How many of the documents with these token counts, from the first, fit in max_tokens."""
    keep = int(np.searchsorted(np.cumsum(lengths), max_tokens, side="right"))
    if keep == 0:
        raise PrepareError(f"--max_tokens {max_tokens} is smaller than the first train document; raise it")
    return keep


# ---------------------------------------------------------------------------- local files

@dataclass(frozen=True)
class Piece:
    """Part of one input file: bytes [start, end) of a .txt/.jsonl file, the row group `start` of a
    parquet file, or (end None) the whole file, e.g. a compressed one."""
    path: str
    kind: str  # "text", "json" or "parquet"
    start: int = 0
    end: int | None = None


def dead_link(path):
    """What path is when it is a symbolic link that leads to no file: 'a broken symbolic link (to X, which
    does not exist)' or 'a symbolic link that loops'; None otherwise. Such a path is not missing: there is a
    link there that someone made, and nothing should be downloaded or written to it."""
    try:
        os.stat(path)
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link that loops (following it leads back to a link already followed)"
        if isinstance(e, FileNotFoundError) and os.path.islink(path):
            return f"a broken symbolic link (to {os.readlink(path)}, which does not exist)"
    return None


def input_files(patterns):
    """Expand paths/globs in the order given (sorted within a glob), so the same command sees the same documents."""
    files = []
    for pattern in patterns:
        found = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not found:
            raise PrepareError(f"--input {pattern!r} matches no file; check the path "
                               f"(quote globs so that the shell passes them on)")
        for f in found:  # a document file that is not there: said, not skipped
            problem = dead_link(f)
            if problem:
                raise PrepareError(f"--input {f} is {problem}; point it at the file, or name the file itself")
        matched = [f for f in found if os.path.isfile(f)]
        if not matched:  # say so, rather than "the input holds no documents" later
            what = ("is a folder" if len(found) == 1 and os.path.isdir(found[0])
                    else "matches only folders or special files")
            raise PrepareError(f"--input {pattern!r} {what}, not files; name the files themselves, e.g. "
                               f"'{os.path.join(found[0], '*.jsonl')}'")
        files += matched
    for f in files:  # unreadable files are found here, before any worker or output starts
        try:
            open(f, "rb").close()
        except OSError as e:
            raise PrepareError(f"{f}: cannot read it ({e.strerror or e}); check its permissions") from e
    return files


def input_kind(path):
    """("text" | "json" | "parquet", compressed?) from the file name."""
    root, ext = os.path.splitext(path.lower())
    compressed = ext in COMPRESSED
    if compressed:
        root, ext = os.path.splitext(root)
    if ext not in TEXT_KINDS:
        raise PrepareError(f"{path}: unknown input type; --input takes .txt, .jsonl/.json or .parquet files "
                           f"(optionally {'/'.join(sorted(COMPRESSED))} compressed)")
    return TEXT_KINDS[ext], compressed


def parquet_text_column(path, column):
    import pyarrow as pa
    import pyarrow.parquet as pq
    with parquet_errors(path):
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    if column not in schema.names:
        raise PrepareError(f"{path} has no {column!r} column (it has {schema.names}); "
                           f"name the one holding the text with --text_column")
    if not (pa.types.is_string(schema.field(column).type) or pa.types.is_large_string(schema.field(column).type)):
        raise PrepareError(f"{path}: column {column!r} holds {schema.field(column).type}, not text; "
                           f"name the one holding the text with --text_column")
    return pf


@contextmanager
def parquet_errors(path):
    """pyarrow's errors on a file that is not parquet (random bytes, a renamed text file, a cut-off
    download) or whose data is damaged, as bad input naming the file."""
    import pyarrow as pa
    try:
        yield
    except (pa.ArrowException, OSError) as e:
        raise PrepareError(f"{path}: not a readable parquet file ({e}); check that it is a whole, undamaged "
                           f".parquet file") from e


def next_boundary(path, pos, pattern, size, what="line"):
    """The first position >= pos where a unit may start: the end of the first `pattern` match at
    or after pos (or the end of the file). PrepareError when none comes within MAX_WHOLE_BYTES: the
    line (or paragraph, `what`) there would be read whole into memory."""
    if pos >= size:
        return size
    with open(path, "rb") as f:
        f.seek(pos)
        buf, chunk = b"", 1 << 16
        while True:
            data = f.read(min(chunk, MAX_WHOLE_BYTES + 1 - len(buf)))
            buf += data
            m = pattern.search(buf)
            if m:
                return pos + m.end()
            if len(buf) > MAX_WHOLE_BYTES:
                raise PrepareError(f"{path}, line {lines_before(path, pos) + 1:,}: {what} longer than "
                                   f"{MAX_WHOLE_BYTES:,} bytes, the most one may hold (each is read whole into "
                                   f"memory); split it into shorter ones")
            if not data:
                return size
            chunk *= 2


def lines_before(path, end):
    """The line breaks in the first `end` bytes of the file, counted 16 MiB at a time."""
    n = 0
    with open(path, "rb") as f:
        while end > 0:
            data = f.read(min(end, 1 << 24))
            if not data:
                break
            n, end = n + data.count(b"\n"), end - len(data)
    return n


def file_pieces(path, text_unit, column, unit_bytes):
    """Yield (piece, its bytes) covering the whole file, each at most ~unit_bytes where the format
    allows a cut: JSON lines at line ends, .txt lines at line ends and paragraphs after blank lines,
    parquet at row groups."""
    kind, compressed = input_kind(path)
    size = os.path.getsize(path)
    if kind == "parquet":
        pf = parquet_text_column(path, column)
        for g in range(pf.num_row_groups):
            yield Piece(path, kind, g), pf.metadata.row_group(g).total_byte_size
        return
    if compressed:
        whole = True  # no seeking into the middle of a compressed stream
    elif kind == "json":
        with open(path, "rb") as f:
            whole = starts_json_array(f.read(4096))  # one array of records, not JSON lines
    else:
        whole = text_unit == "document"
    if whole:
        if not compressed and size > MAX_WHOLE_BYTES:  # (a compressed file's size is known only inflated)
            what, fix = (("one JSON array", "write it as JSON lines (one record per line), which are read in parts")
                         if kind == "json" else ("one document (--text_unit document)", "use --text_unit paragraph "
                                                 "or line, or split the file"))
            raise PrepareError(f"{path} is {what} of {size:,} bytes, more than the {MAX_WHOLE_BYTES:,} read whole "
                               f"into memory; {fix}")
        yield Piece(path, kind), size
        return
    paragraphs = kind == "text" and text_unit == "paragraph"
    pattern = BLANK_LINE_END if paragraphs else LINE_END
    what = "a paragraph" if paragraphs else "a JSON line" if kind == "json" else "a line"
    start = 0
    while start < size:
        end = next_boundary(path, start + unit_bytes, pattern, size, what)
        yield Piece(path, kind, start, end), end - start
        start = end


def plan_units(files, text_unit, column, num_proc, unit_bytes=None):
    """Cut the input files into work units of about unit_bytes each, in input order: a list of
    (pieces, their bytes)."""
    if unit_bytes is None:
        total = sum(os.path.getsize(f) for f in files)
        unit_bytes = min(max(total // (16 * num_proc), MIN_UNIT_BYTES), MAX_UNIT_BYTES)
    units, unit, nbytes = [], [], 0
    for path in files:
        for piece, size in file_pieces(path, text_unit, column, unit_bytes):
            unit.append(piece)
            nbytes += size
            if nbytes >= unit_bytes:
                units.append((unit, nbytes))
                unit, nbytes = [], 0
    if unit:
        units.append((unit, nbytes))
    return units


def read_piece(piece):
    """The bytes of a piece; a whole file (compressed: inflated) read at most MAX_WHOLE_BYTES + 1 bytes far,
    whatever its size claims, and refused past MAX_WHOLE_BYTES."""
    if piece.end is not None:
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            return f.read(piece.end - piece.start)
    ext = os.path.splitext(piece.path.lower())[1]
    if ext not in COMPRESSED:
        with open(piece.path, "rb") as f:
            data = f.read(MAX_WHOLE_BYTES + 1)
        if len(data) > MAX_WHOLE_BYTES:
            raise PrepareError(f"{piece.path} holds more than the {MAX_WHOLE_BYTES:,} bytes read whole into memory; "
                               f"give it as JSON lines or --text_unit paragraph or line, which are read in parts")
        return data
    try:
        if ext in {".zst", ".lz4"}:
            import pyarrow as pa
            with pa.input_stream(piece.path, compression="detect") as f:
                data = f.read(MAX_WHOLE_BYTES + 1)
        else:
            with {".gz": gzip, ".bz2": bz2, ".xz": lzma}[ext].open(piece.path, "rb") as f:
                data = f.read(MAX_WHOLE_BYTES + 1)
    # gzip/bz2/pyarrow raise OSError on data that is not theirs, lzma LZMAError, a cut-off stream EOFError
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise PrepareError(f"{piece.path}: not a readable {ext} file ({e}); check that it is whole and "
                           f"{ext}-compressed") from e
    if len(data) > MAX_WHOLE_BYTES:  # e.g. a .gz of zeros: a thousand times its size
        raise PrepareError(f"{piece.path} inflates to more than {MAX_WHOLE_BYTES:,} bytes, the most a compressed input "
                           f"may hold (it is read whole into memory); decompress it first and pass the uncompressed "
                           f"file, which is read in parts")
    return data


def line_number(piece, data, pos):
    """The 1-based line of byte `pos` of `data` (read from `piece`) in its file: for error messages."""
    before = data.count(b"\n", 0, pos)
    if piece.start and piece.end is not None:
        before += lines_before(piece.path, piece.start)
    return before + 1


def record_text(record, column, where):
    """The text of a JSON record; `where()` names the record in an error message."""
    if isinstance(record, dict) and isinstance(record.get(column), str):
        return record[column]
    if not isinstance(record, dict):
        raise PrepareError(f"{where()}: expected a JSON object (a record), got {type(record).__name__}")
    if column not in record:
        raise PrepareError(f"{where()}: no {column!r} field (it has {list(record)}); "
                           f"name the one holding the text with --text_column")
    text = record[column]
    raise PrepareError(f"{where()}: {column!r} is {'null' if text is None else type(text).__name__}, not text; "
                       f"drop or fix that record")


def starts_json_array(data):
    return data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")  # after a UTF-8 BOM and white space


def json_documents(piece, data, column):
    if piece.end is None and starts_json_array(data):  # one JSON array of records
        try:
            records = parse_json(data)  # ValueError, also for nesting deeper than Python's parser goes
        except ValueError as e:
            raise PrepareError(f"{piece.path}: not valid JSON ({e})") from e
        return [record_text(r, column, lambda: f"{piece.path}, record {i}") for i, r in enumerate(records)]
    docs, pos = [], 0
    for line in data.split(b"\n"):
        if line.strip():
            try:
                record = parse_json(line)
            except ValueError as e:
                raise PrepareError(f"{piece.path}, line {line_number(piece, data, pos)}: not valid JSON ({e}); "
                                   f"--input takes JSON lines (one object per line) or one JSON array") from e
            docs.append(record_text(record, column, lambda: f"{piece.path}, line {line_number(piece, data, pos)}"))
        pos += len(line) + 1
    return docs


def text_documents(piece, data, text_unit):
    try:
        text = data.decode("utf-8-sig" if piece.start == 0 else "utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{piece.path}: not UTF-8 text (byte {piece.start + e.start}); convert it to UTF-8") from e
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as Python's text mode
    if text_unit == "document":
        return [text]
    lines = text.split("\n")
    if text_unit == "line":
        return [line for line in lines if line.strip()]
    return ["\n".join(run) for blank, run in itertools.groupby(lines, key=lambda line: not line.strip()) if not blank]


def piece_documents(piece, column, text_unit):
    if piece.kind == "parquet":
        pf = parquet_text_column(piece.path, column)
        with parquet_errors(piece.path):
            texts = pf.read_row_group(piece.start, columns=[column]).column(0)
        if texts.null_count:
            row = texts.is_null().to_pylist().index(True)
            raise PrepareError(f"{piece.path}, row group {piece.start}, row {row}: {column!r} is null, not text; "
                               f"drop or fix that record")
        return texts.to_pylist()
    data = read_piece(piece)
    return json_documents(piece, data, column) if piece.kind == "json" else text_documents(piece, data, text_unit)


def tokenize_unit(job):
    """Worker: the tokens and per-document token counts of one unit."""
    pieces, column, text_unit = job
    return encode_documents([doc for piece in pieces for doc in piece_documents(piece, column, text_unit)])


def tokenize_files(units, column, text_unit, num_proc, tokens_path):
    """Tokenise the units in num_proc worker processes; write every token, in input order, to
    tokens_path; return each document's token count."""
    jobs = [(pieces, column, text_unit) for pieces, _ in units]
    num_proc = min(num_proc, len(units))
    gpt2_encoding()  # loaded once here: the forked workers inherit it
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    lengths = []
    with open(tokens_path, "wb") as out, tqdm(desc="tokenizing", total=sum(n for _, n in units),
                                              unit="B", unit_scale=True) as bar:
        if num_proc == 1:
            results = map(tokenize_unit, jobs)
            pool = None
        else:
            pool = context.Pool(num_proc)
            results = pool.imap(tokenize_unit, jobs)  # in order, so documents keep the input order
        try:
            for (tokens, unit_lengths), (_, nbytes) in zip(results, units):
                try:
                    out.write(tokens.data)  # (not tofile: its error on a full disk does not say so)
                except OSError as e:
                    raise write_failed(os.path.dirname(tokens_path) or ".", e) from e
                lengths.append(unit_lengths)
                bar.update(nbytes)
        finally:
            if pool is not None:
                pool.terminate()
    return np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def token_memmap(path, total):
    """A uint16 memmap of `total` tokens at path, to write, its disk space reserved first: a write through a
    map to a full disk is a SIGBUS that kills the process with no message and no cleanup, where the
    reservation fails as an OSError (ENOSPC)."""
    if total and hasattr(os, "posix_fallocate"):  # (not on macOS: there the file is sparse, as before)
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, 2 * total)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot reserve space
                    raise
                f.truncate(2 * total)
        return np.memmap(path, dtype=np.uint16, mode="r+", shape=(total,))
    return np.memmap(path, dtype=np.uint16, mode="w+", shape=(total,))


def write_documents(tokens, lengths, order, path, desc):
    """Write the documents `order` (indices into lengths) of the flat `tokens`, in that order, to a
    uint16 file; return its token count and largest token id."""
    starts = np.cumsum(lengths) - lengths
    total = int(lengths[order].sum())
    out = token_memmap(path, total)
    pos, top = 0, -1
    with tqdm(total=total, unit="tok", unit_scale=True, desc=desc) as bar:
        for k in range(0, len(order), 100_000):  # Python ints (fast slicing) for 100k documents at a time
            batch, batch_start = order[k:k + 100_000], pos
            for s, n in zip(starts[batch].tolist(), lengths[batch].tolist()):
                out[pos:pos + n] = tokens[s:s + n]
                pos += n
            top = max(top, max_id(out[batch_start:pos]))  # while these pages are still in memory
            bar.update(pos - bar.n)
    out.flush()
    return total, top


def choose_without_replacement(rng, n_rows, population, size, p=None):
    """(n_rows, size) indices into range(population), distinct within a row. With weights p, the draw is
    the same in law as drawing one by one in proportion to the weights left (numpy's choice(replace=
    False, p=p)): each row keeps the `size` largest log(u) / p (Efraimidis and Spirakis, 2006)."""
    u = rng.random((n_rows, population))
    score = u if p is None else np.log(u) / p
    return np.argsort(-score, axis=1, kind="stable")[:, :size]


def max_id(tokens):
    """The largest id of a token array, -1 when it is empty; meta.json stores it per split so that
    train.py can check the ids against the model's vocabulary without reading the files again."""
    return int(tokens.max()) if len(tokens) else -1


def prepare_local(args):
    files = input_files(args.input)
    units = plan_units(files, args.text_unit, args.text_column, args.num_proc)
    made_out_dir = not os.path.isdir(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    tokens_path = os.path.join(args.out_dir, "tokens.partial")  # every document, input order; deleted at the end
    try:
        print(f"tokenizing {len(files)} file(s), {sum(map(os.path.getsize, files)) / 1e6:,.1f} MB, in "
              f"{len(units)} part(s) on {min(args.num_proc, len(units))} process(es)")
        if not units:  # every file is empty: nothing for the workers to do
            check_count(0)
        lengths = tokenize_files(units, args.text_column, args.text_unit, args.num_proc, tokens_path)
        check_count(len(lengths))
        val_docs, train_docs = split_documents(len(lengths), args.val_fraction, args.seed)
        if args.max_tokens is not None:
            train_docs = train_docs[:documents_within(lengths[train_docs], args.max_tokens)]
        tokens = np.memmap(tokens_path, dtype=np.uint16, mode="r")
        with atomic_outputs(args.out_dir, ["val.bin", "train.bin", "meta.json"]) as tmp:
            val_tokens, val_max = write_documents(tokens, lengths, val_docs, tmp["val.bin"], "writing val.bin")
            train_tokens, train_max = write_documents(tokens, lengths, train_docs, tmp["train.bin"],
                                                      "writing train.bin")
            write_meta(tmp["meta.json"], args, (train_tokens, val_tokens), (train_max, val_max),
                       (len(train_docs), len(val_docs)), args.input)
        del tokens
    finally:
        if os.path.exists(tokens_path):
            os.remove(tokens_path)
        if made_out_dir and not os.listdir(args.out_dir):  # a failed run leaves nothing behind
            os.rmdir(args.out_dir)
    return train_tokens, val_tokens, len(train_docs), len(val_docs)


# ------------------------------------------------------------------------------ the hub

def tokenize_batch(batch, indices):
    # A module-level function (not a closure over the encoder) so that datasets can hash it: the
    # same command then reuses the cached tokens instead of tokenising again.
    for i, text in zip(indices, batch["text"]):
        if text is None:
            raise PrepareError(f"document {i} has no text (null); drop or fix that record")
    tokens, lengths = encode_documents(batch["text"])
    return {"ids": np.split(tokens, np.cumsum(lengths)[:-1]), "len": lengths}


def tokenize_dataset(dset, num_proc, desc):
    import datasets
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("uint16")),  # 4x smaller than int64
                                  "len": datasets.Value("int64")})
    # at most one worker per 1000-document batch: forking costs more than tokenising a few documents
    num_proc = min(num_proc, len(dset) // 1000)
    return dset.map(tokenize_batch, batched=True, batch_size=1000, with_indices=True, remove_columns=["text"],
                    features=features, num_proc=num_proc if num_proc > 1 else None, desc=desc)


def token_counts(tok):
    # via arrow: 10M rows in 0.005 s, where the numpy formatter takes 5 s
    return tok.with_format("arrow")["len"][:].to_numpy()


def tokenize_within(train, max_tokens, num_proc):
    """Tokenise train documents from the start until max_tokens, keeping whole documents only.
    A 1000-document sample first, then as many documents as its tokens/document says the rest
    needs (+10%); repeat in the rare case that was still short."""
    import datasets
    parts, have, done = [], 0, 0
    while have < max_tokens and done < len(train):
        n = 1000 if done == 0 else int((max_tokens - have) * done / have * 1.1) + 1
        part = tokenize_dataset(train.select(range(done, min(done + n, len(train)))), num_proc,
                                f"tokenizing train (up to {max_tokens:,} tokens)")
        parts.append(part)
        have, done = have + int(token_counts(part).sum()), done + len(part)
    tok = datasets.concatenate_datasets(parts)
    return tok.select(range(documents_within(token_counts(tok), max_tokens)))


def write_bin(tok, path, desc):
    """Stream the tokenised documents into a flat uint16 memmap, as nanoGPT does; return its token
    count and largest token id."""
    import pyarrow.compute as pc
    total = int(token_counts(tok).sum())
    arr = token_memmap(path, total)
    i, top = 0, -1
    with tqdm(total=total, unit="tok", unit_scale=True, desc=desc) as bar:
        for batch in tok.with_format("arrow").iter(batch_size=10_000):
            ids = pc.list_flatten(batch["ids"]).to_numpy()  # all documents of the batch, one copy
            arr[i:i + len(ids)] = ids
            top = max(top, max_id(ids))
            i += len(ids)
            bar.update(len(ids))
    assert i == total, f"wrote {i} tokens into {path}, expected {total}"
    arr.flush()
    return total, top


def prepare_dataset(docs, args, source):
    """train.bin / val.bin / meta.json from a datasets.Dataset with a 'text' column."""
    check_count(len(docs))
    val_docs, train_docs = split_documents(len(docs), args.val_fraction, args.seed)
    val, train = docs.select(val_docs), docs.select(train_docs)
    gpt2_encoding()  # load it once here, before datasets forks the workers
    val_tok = tokenize_dataset(val, args.num_proc, "tokenizing val")
    if args.max_tokens is None:
        train_tok = tokenize_dataset(train, args.num_proc, "tokenizing train")
    else:
        train_tok = tokenize_within(train, args.max_tokens, args.num_proc)
    with atomic_outputs(args.out_dir, ["val.bin", "train.bin", "meta.json"]) as tmp:
        val_tokens, val_max = write_bin(val_tok, tmp["val.bin"], "writing val.bin")
        train_tokens, train_max = write_bin(train_tok, tmp["train.bin"], "writing train.bin")
        write_meta(tmp["meta.json"], args, (train_tokens, val_tokens), (train_max, val_max),
                   (len(train_tok), len(val_tok)), source)
    return train_tokens, val_tokens, len(train_tok), len(val_tok)


def prepare_hub(args, hub_path, hub_name):
    import datasets
    print(f"loading {hub_path} {hub_name or ''} from the Hugging Face hub (cached in --cache_dir; reruns resume)")
    try:
        dset = datasets.load_dataset(hub_path, name=hub_name, split="train", num_proc=args.num_proc,
                                     cache_dir=args.cache_dir)
    except ConnectionError as e:
        raise PrepareError(f"{e}. Rerun the same command to resume once the hub is reachable; without network "
                           f"access, copy the dataset's parquet files over and pass them with --input") from e
    if args.text_column not in dset.column_names:
        raise PrepareError(f"{hub_path} has no {args.text_column!r} column (it has {dset.column_names}); "
                           f"name the one holding the text with --text_column")
    dset = dset.select_columns([args.text_column])
    if args.text_column != "text":
        dset = dset.rename_column(args.text_column, "text")
    return prepare_dataset(dset, args, f"{hub_path}/{hub_name}" if hub_name else hub_path)


# --------------------------------------------------------------------------------- writing

def write_failed(out_dir, e):
    """The PrepareError for an OSError (e) while writing into out_dir: a full disk, a read-only file system,
    no permission (files.write_problem's words)."""
    cause, remedy = write_problem(e)
    return PrepareError(f"cannot write in {out_dir}: {cause}; the files there are as they were (this run's partial "
                        f"files are removed). {remedy.capitalize()} and run the same command again")


@contextmanager
def atomic_outputs(out_dir, names):
    """Yield {name: temporary path}. Only when the block finishes are they renamed to their final
    names (in the order given: put meta.json last); on any error or Ctrl-C they are deleted. A
    killed process (`kill`, SIGKILL, power loss) can only leave '<name>.partial' files, never a
    finished-looking .bin, and the next run overwrites them. A failed write is a PrepareError."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = {name: os.path.join(out_dir, name + ".partial") for name in names}
    try:
        yield tmp
        for name, path in tmp.items():
            os.replace(path, os.path.join(out_dir, name))
    except OSError as e:  # the block only writes: a full disk, most likely
        raise write_failed(out_dir, e) from e
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)


def write_array(path, array):
    """array's bytes as the file at path (what ndarray.tofile writes), through a Python file: tofile's error
    on a full disk carries no errno ('N requested and 0 written'), this one says ENOSPC."""
    with open(path, "wb") as f:
        f.write(np.ascontiguousarray(array).data)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_meta(path, args, tokens, max_ids, documents, source):
    """meta.json; tokens, max_ids and documents are (train, val) pairs."""
    enc = gpt2_encoding()
    write_json(path, {
        "tokenizer": "gpt2", "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "dtype": "uint16",
        "train_tokens": tokens[0], "val_tokens": tokens[1], "train_max_id": max_ids[0], "val_max_id": max_ids[1],
        "train_documents": documents[0], "val_documents": documents[1],
        "source": source, "val_fraction": args.val_fraction, "seed": args.seed, "max_tokens": args.max_tokens,
    })


def check_count(n):
    if n == 0:
        raise PrepareError("the input holds no documents (its files are empty or hold only blank lines); "
                           "check that --input names the right files")
    if n < 2:
        raise PrepareError(f"the input has {n} document(s); the train/val split needs at least 2 "
                           f"(a .txt file is one document unless --text_unit paragraph or line)")


def run(args, hub_path, hub_name):
    if not 0 < args.val_fraction < 1:
        raise PrepareError(f"--val_fraction must be between 0 and 1, got {args.val_fraction}")
    if args.num_proc < 1:
        raise PrepareError(f"--num_proc must be at least 1, got {args.num_proc}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise PrepareError(f"--max_tokens must be positive, got {args.max_tokens}")
    if args.seed < 0:  # (numpy's generators take no negative seed)
        raise PrepareError(f"--seed must be a non-negative integer, got {args.seed}")
    check_out_dir(args.out_dir)
    if args.input is None:
        train_tokens, val_tokens, train_docs, val_docs = prepare_hub(args, hub_path, hub_name)
    else:
        train_tokens, val_tokens, train_docs, val_docs = prepare_local(args)
    print(f"wrote {args.out_dir}: train.bin {train_tokens:,} tokens ({train_docs:,} documents), "
          f"val.bin {val_tokens:,} tokens ({val_docs:,} documents), meta.json")


def main(description, hub_path, hub_name=None, out_dir="."):
    args = make_parser(description, out_dir).parse_args()
    with one_line_errors():
        try:
            run(args, hub_path, hub_name)
        except PrepareError:
            raise
        except BaseException:
            print("\nprepare.py stopped before finishing; this run wrote no train.bin/val.bin.\n" + RESTART_HINT,
                  file=sys.stderr)
            raise
