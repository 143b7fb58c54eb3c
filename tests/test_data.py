"""Data pipeline: data/*/prepare.py run as a user runs them (subprocesses, offline, local inputs), and
batches.TokenBatches / load_meta on the files they write."""
import json
import os
import pickle
import random
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import datasets
import pytest
import tiktoken

from denoised_gpt.batches import TokenBatches, load_meta
from helpers import ROOT, on_small_disk, small_disk_available, without_root_file_access

OWT = ROOT / "data" / "openwebtext" / "prepare.py"
FINEWEB = ROOT / "data" / "fineweb_edu" / "prepare.py"
SHAKESPEARE = ROOT / "data" / "shakespeare_char" / "prepare.py"
MQAR = ROOT / "data" / "mqar" / "prepare.py"
# the real Tiny Shakespeare (nanoGPT's input.txt) when this variable names the file (CI sets it)
SHAKESPEARE_TXT = Path(os.environ["TINY_SHAKESPEARE"]) if os.environ.get("TINY_SHAKESPEARE") else None
sys.path.insert(0, str(ROOT / "data"))
import gpt2_bpe  # noqa: E402
import prepare_common  # noqa: E402
from prepare_common import PrepareError  # noqa: E402

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

_why_no_bpe = gpt2_bpe.unavailable()
if _why_no_bpe:
    pytest.skip(gpt2_bpe.skip_message(_why_no_bpe), allow_module_level=True)

ENC = tiktoken.get_encoding("gpt2")
EOT = ENC.eot_token


def make_docs(n, seed=0, max_words=300):
    """Unique documents with what tokenisers trip on: unicode, emoji, newlines, an empty document,
    and the literal text '<|endoftext|>' (plain text inside a document, as in nanoGPT)."""
    rng = random.Random(seed)
    words = ["alpha", "béta", "日本語", "🎉", "<|endoftext|>", "  spaced  ", "line\nbreak", "tab\t", "x" * 40]
    docs = [f"doc {i}:" + " ".join(rng.choice(words) for _ in range(rng.randint(0, max_words))) for i in range(n)]
    docs[1] = ""
    return docs


def write_jsonl(path, docs, field="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": len(d)}) + "\n")
    return path


def prepare(script, *args, check=True, **kwargs):
    r = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, **kwargs)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def decode_bin(path):
    """The documents of a .bin: split at EOT (every document ends with one), each checked to be
    exactly encode_ordinary of its text."""
    tokens = np.fromfile(path, dtype=np.uint16)
    assert len(tokens) and tokens[-1] == EOT, f"{path} does not end with EOT"
    docs = []
    for seg in np.split(tokens, np.flatnonzero(tokens == EOT) + 1)[:-1]:
        text = ENC.decode(seg[:-1].tolist())
        assert seg[:-1].tolist() == ENC.encode_ordinary(text)
        docs.append(text)
    return docs


def splits(out_dir):
    return decode_bin(out_dir / "train.bin"), decode_bin(out_dir / "val.bin")


def assert_partition(train, val, docs):
    assert sorted(train + val) == sorted(docs), "the two .bin files must hold every input document exactly once"
    assert not set(train) & set(val)


# ---------------------------------------------------------------------------------- prepare.py

DOCS = make_docs(40)


@pytest.fixture(scope="module")
def owt_jsonl(tmp_path_factory):
    """openwebtext/prepare.py on a local jsonl, seed 1; its cache is reused by later tests."""
    tmp = tmp_path_factory.mktemp("owt")
    src = write_jsonl(tmp / "docs.jsonl", DOCS)
    args = ["--input", src, "--val_fraction", 0.25, "--seed", 1, "--num_proc", 1, "--cache_dir", tmp / "cache"]
    r = prepare(OWT, *args, "--out_dir", tmp / "out")
    return tmp, args, r


def test_prepare_jsonl_decodes_to_the_documents(owt_jsonl):
    tmp, _, r = owt_jsonl
    out = tmp / "out"
    train, val = splits(out)
    assert_partition(train, val, DOCS)
    assert len(val) == 10  # ceil(0.25 * 40)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257 and meta["eot_token"] == EOT
    assert meta["train_tokens"] * 2 == (out / "train.bin").stat().st_size
    assert meta["val_tokens"] * 2 == (out / "val.bin").stat().st_size
    assert (meta["train_documents"], meta["val_documents"]) == (30, 10)
    for split in ["train", "val"]:  # stored so that train.py need not read the files to check the ids
        assert meta[f"{split}_max_id"] == int(np.fromfile(out / f"{split}.bin", dtype=np.uint16).max())
    assert meta["source"] == [str(tmp / "docs.jsonl")]
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    assert "train.bin" in r.stdout


def test_split_is_deterministic_per_seed(owt_jsonl, tmp_path):
    tmp, args, _ = owt_jsonl
    # same seed, fresh cache: the same split, byte for byte
    prepare(OWT, *args[:-1], tmp_path / "cache", "--out_dir", tmp_path / "same")
    for name in ["train.bin", "val.bin"]:
        assert (tmp_path / "same" / name).read_bytes() == (tmp / "out" / name).read_bytes()
    # another seed: another val set, still a partition
    prepare(OWT, *args, "--seed", 2, "--out_dir", tmp_path / "other")
    train, val = splits(tmp_path / "other")
    assert_partition(train, val, DOCS)
    assert set(val) != set(splits(tmp / "out")[1])


PARQUET_DOCS = make_docs(2500, seed=1, max_words=30)  # > 2 x 1000-document batches, so --num_proc 2 really forks two workers


@pytest.fixture(scope="module")
def owt_parquet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parquet")
    # 5 row groups: the units of work, so --num_proc 2 really runs two workers
    pq.write_table(pa.table({"content": PARQUET_DOCS, "n": range(len(PARQUET_DOCS))}), tmp / "docs.parquet",
                   row_group_size=500)
    args = ["--input", tmp / "*.parquet", "--text_column", "content", "--num_proc", 2, "--val_fraction", 0.1,
            "--cache_dir", tmp / "cache"]
    r = prepare(OWT, *args, "--out_dir", tmp / "out")
    return tmp, args, r


def test_prepare_parquet_in_parallel(owt_parquet, tmp_path):
    tmp, args, r = owt_parquet
    assert re.search(r"in [2-5] part\(s\) on 2 process\(es\)", r.stdout), r.stdout
    train, val = splits(tmp / "out")
    assert_partition(train, val, PARQUET_DOCS)
    assert len(val) == 250
    # one process: the same bytes
    prepare(OWT, *args, "--num_proc", 1, "--out_dir", tmp_path)
    for name in ["train.bin", "val.bin"]:
        assert (tmp_path / name).read_bytes() == (tmp / "out" / name).read_bytes()


def test_prepare_text_files_one_document_each(tmp_path):
    docs = make_docs(6, seed=2)
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d, encoding="utf-8", newline="")  # '\n' stays '\n'
    prepare(OWT, "--input", tmp_path / "*.txt", "--val_fraction", 0.2, "--num_proc", 2,
            "--cache_dir", tmp_path / "cache", "--out_dir", tmp_path / "out")
    train, val = splits(tmp_path / "out")
    assert_partition(train, val, docs)
    assert len(val) == 2  # ceil(0.2 * 6)


def test_fineweb_max_tokens_keeps_whole_documents(owt_parquet, tmp_path):
    tmp, args, _ = owt_parquet
    full_train = decode_bin(tmp / "out" / "train.bin")
    # a budget ending exactly at a document boundary, at 60% of the tokens (more than the hub path's
    # first 1000-document sample holds, so its estimate-and-extend step runs too)
    ends = np.cumsum([len(ENC.encode_ordinary(d)) + 1 for d in full_train])
    keep = int(np.searchsorted(ends, ends[-1] * 0.6))
    budget = int(ends[keep - 1])
    assert keep > 1000
    prepare(FINEWEB, *args[:-1], tmp_path / "cache", "--max_tokens", budget, "--out_dir", tmp_path / "out")
    train, val = splits(tmp_path / "out")
    # the first `keep` of the same shuffled train documents (the one that ends on the budget included),
    # and the same val.bin
    assert train == full_train[:keep]
    assert (tmp_path / "out" / "val.bin").read_bytes() == (tmp / "out" / "val.bin").read_bytes()
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["train_tokens"] == budget
    # the hub path (datasets, tokenising only what the budget needs) writes the same bytes
    hub = tmp_path / "hub"
    prepare_common.prepare_dataset(datasets.Dataset.from_dict({"text": PARQUET_DOCS}),
                                   _args("--val_fraction", 0.1, "--num_proc", 1, "--max_tokens", budget,
                                         "--out_dir", hub), "test")
    for name in ["train.bin", "val.bin"]:
        assert (hub / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_hub_path_writes_what_the_local_path_writes(owt_jsonl, tmp_path):
    """The hub goes through datasets (load_dataset, split by select, tokenised by a cached map);
    local files do not. The same documents must give the same bytes either way. The "hub" here is
    a local folder laid out like a dataset repository: load_dataset reads it as it reads a
    downloaded one, with no network."""
    tmp, _, _ = owt_jsonl
    repo = tmp_path / "repo" / "plain_text"
    repo.mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS}), repo / "train-00000-of-00001.parquet")
    args = _args("--val_fraction", 0.25, "--seed", 1, "--num_proc", 1, "--out_dir", tmp_path / "out",
                 "--cache_dir", tmp_path / "cache")
    prepare_common.run(args, str(tmp_path / "repo"), None)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["source"] == str(tmp_path / "repo") and meta["train_documents"] == 30
    for split in ["train", "val"]:
        assert meta[f"{split}_max_id"] == int(np.fromfile(tmp_path / "out" / f"{split}.bin", dtype=np.uint16).max())
    for name in ["train.bin", "val.bin"]:
        assert (tmp_path / "out" / name).read_bytes() == (tmp / "out" / name).read_bytes()
    # again: every step comes from the datasets cache (no new cache file), same bytes
    before = sorted(p.name for p in (tmp_path / "cache").rglob("*.arrow"))
    prepare_common.run(args, str(tmp_path / "repo"), None)
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*.arrow")) == before
    for name in ["train.bin", "val.bin"]:
        assert (tmp_path / "out" / name).read_bytes() == (tmp / "out" / name).read_bytes()
    with pytest.raises(PrepareError, match=r"repo has no 'content' column \(it has \['text'\]\)"):
        prepare_common.run(_args("--text_column", "content", "--num_proc", 1, "--out_dir", tmp_path / "x",
                                 "--cache_dir", tmp_path / "cache"), str(tmp_path / "repo"), None)
    with pytest.raises(PrepareError, match="document 1 has no text"):
        prepare_common.tokenize_batch({"text": ["fine", None]}, [0, 1])


def test_split_is_datasets_train_test_split():
    # nanoGPT split with datasets' train_test_split; split_documents must pick the same documents, in the same order
    for n, fraction, seed in [(40, 0.25, 1), (2500, 0.1, 2357), (10_001, 0.0005, 7)]:
        expected = datasets.Dataset.from_dict({"i": range(n)}).train_test_split(test_size=fraction, seed=seed)
        val, train = prepare_common.split_documents(n, fraction, seed)
        assert val.tolist() == expected["test"]["i"] and train.tolist() == expected["train"]["i"]


def test_gpt2_bpe_is_r50k_base():
    # prepare.py loads GPT-2's BPE as tiktoken's 'r50k_base' (one file, 3x faster to load)
    r50k = prepare_common.gpt2_encoding()
    assert r50k._mergeable_ranks == ENC._mergeable_ranks and r50k._pat_str == ENC._pat_str
    assert r50k._special_tokens == ENC._special_tokens == {"<|endoftext|>": EOT}


def test_encode_documents_equals_one_call_per_document(monkeypatch):
    docs = make_docs(300, seed=3) + ["ends with spaces   ", "  ", "<|endoftext|>", "a<|endoftext|>b", "\n\n"]
    monkeypatch.setattr(prepare_common, "ENCODE_CHARS", 500)  # many joined calls, each of a few documents
    tokens, lengths = prepare_common.encode_documents(docs)
    expected = [ENC.encode_ordinary(d) + [EOT] for d in docs]
    assert tokens.dtype == np.uint16 and lengths.tolist() == [len(e) for e in expected]
    assert tokens.tolist() == [t for e in expected for t in e]


def _file_size_limit(nbytes):
    """preexec_fn: a per-file size limit, like a disk that fills up: a longer write fails with EFBIG
    (Python ignores SIGXFSZ, so the process is not killed but gets an OSError)."""
    import resource
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as on Linux")
def test_interrupted_prepare_leaves_no_final_bin(owt_jsonl, tmp_path):
    tmp, args, _ = owt_jsonl
    train_bytes = (tmp / "out" / "train.bin").stat().st_size
    out = tmp_path / "out"
    # the disk fills (no file may grow to train.bin's size): an error, and nothing left behind
    r = prepare(OWT, *args, "--out_dir", out, check=False, preexec_fn=_file_size_limit(train_bytes - 1))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr  # (the progress bars are on stderr too)
    assert r.stderr.strip().splitlines()[-1] == (
        f"prepare.py: error: cannot write in {out}: File too large; the files there are as they were (this run's "
        f"partial files are removed). Fix the cause and run the same command again")
    assert not out.exists()
    # an error after val.bin was written, while train.bin is: neither is left
    out.mkdir()
    with pytest.raises(PrepareError, match=f"cannot write in {out}: disk full"):
        with prepare_common.atomic_outputs(out, ["val.bin", "train.bin", "meta.json"]) as partial:
            Path(partial["val.bin"]).write_bytes(b"\x01\x00")
            Path(partial["train.bin"]).write_bytes(b"\x02")
            raise OSError("disk full")
    assert os.listdir(out) == []
    # a killed run can leave only '*.partial' files (nothing else is written before the final
    # renames); the same command again finishes and replaces them
    (out / "train.bin.partial").write_bytes(b"\x07" * 11)
    prepare(OWT, *args, "--out_dir", out)
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    assert (out / "train.bin").read_bytes() == (tmp / "out" / "train.bin").read_bytes()


def test_prepare_cli_error_is_one_clear_line(tmp_path):
    # the hub path with no network (an empty HF_HOME, so nothing cached can stand in)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = prepare(FINEWEB, "--out_dir", tmp_path / "out", "--cache_dir", tmp_path / "cache", check=False, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("prepare.py: error: ")
    assert "Couldn't reach 'HuggingFaceFW/fineweb-edu'" in r.stderr and "Rerun the same command" in r.stderr
    assert not (tmp_path / "out").exists()


def _args(*argv):
    return prepare_common.make_parser("", ".").parse_args([str(a) for a in argv])


def run_local(*argv):
    prepare_common.run(_args(*argv), None, None)


def test_prepare_bad_inputs(tmp_path):
    out = ["--out_dir", tmp_path / "out", "--num_proc", 1]
    with pytest.raises(PrepareError, match=r"--input '.*missing\*.jsonl' matches no file; check the path"):
        run_local("--input", tmp_path / "missing*.jsonl", *out)
    (tmp_path / "docs.csv").write_text("text\nhello\n")
    with pytest.raises(PrepareError, match=r"docs.csv: unknown input type; --input takes \.txt, \.jsonl"):
        run_local("--input", tmp_path / "docs.csv", *out)
    write_jsonl(tmp_path / "content.jsonl", ["a", "b"], field="content")
    with pytest.raises(PrepareError, match=r"content.jsonl, line 1: no 'text' field \(it has \['content', 'id'\]\)"
                                           r".*--text_column"):
        run_local("--input", tmp_path / "content.jsonl", *out)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": null}\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl, line 3: 'text' is null, not text"):
        run_local("--input", tmp_path / "bad.jsonl", *out)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl, line 2: not valid JSON"):
        run_local("--input", tmp_path / "bad.jsonl", *out)
    # the same from a worker process: 3000 lines in several units, the bad one in the last
    (tmp_path / "bad.jsonl").write_text('{"text": "%s"}\n' % ("x" * 80) * 2999 + '{"text": 7}\n')
    assert len(prepare_common.plan_units([str(tmp_path / "bad.jsonl")], "document", "text", 2)) > 2
    with pytest.raises(PrepareError, match=r"bad.jsonl, line 3000: 'text' is int, not text"):
        run_local("--input", tmp_path / "bad.jsonl", *out[:-1], 2)
    (tmp_path / "bad.json").write_text('[{"text": "a"}, 3]')
    with pytest.raises(PrepareError, match=r"bad.json, record 1: expected a JSON object"):
        run_local("--input", tmp_path / "bad.json", *out)
    pq.write_table(pa.table({"body": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(PrepareError, match=r"null.parquet has no 'text' column \(it has \['body'\]\)"):
        run_local("--input", tmp_path / "null.parquet", *out)
    with pytest.raises(PrepareError, match=r"null.parquet, row group 0, row 1: 'body' is null"):
        run_local("--input", tmp_path / "null.parquet", "--text_column", "body", *out)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(PrepareError, match=r"column 'text' holds int64, not text"):
        run_local("--input", tmp_path / "ints.parquet", *out)
    (tmp_path / "text.parquet").write_text("text\nhello\n")  # a text file renamed .parquet
    with pytest.raises(PrepareError, match=r"text.parquet: not a readable parquet file \(Parquet magic bytes"):
        run_local("--input", tmp_path / "text.parquet", *out)
    # a parquet file whose footer is whole but whose data pages are damaged: found by the worker reading them
    pq.write_table(pa.table({"text": [f"doc {i} " * 50 for i in range(200)]}), tmp_path / "damaged.parquet")
    damaged = bytearray((tmp_path / "damaged.parquet").read_bytes())
    damaged[200:2000] = b"\xab" * 1800
    (tmp_path / "damaged.parquet").write_bytes(damaged)
    with pytest.raises(PrepareError, match=r"damaged.parquet: not a readable parquet file"):
        run_local("--input", tmp_path / "damaged.parquet", *out)
    # compressed inputs that are not what their names say, or were cut off
    import gzip
    for ext in [".gz", ".bz2", ".xz", ".zst", ".lz4"]:
        (tmp_path / f"plain.jsonl{ext}").write_text('{"text": "not compressed"}\n' * 10)
        with pytest.raises(PrepareError, match=rf"plain.jsonl\{ext}: not a readable \{ext} file"):
            run_local("--input", tmp_path / f"plain.jsonl{ext}", *out)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:-20])
    with pytest.raises(PrepareError, match=r"cut.jsonl.gz: not a readable \.gz file \(Compressed file ended"):
        run_local("--input", tmp_path / "cut.jsonl.gz", *out)
    (tmp_path / "folder").mkdir()
    with pytest.raises(PrepareError, match=r"--input '.*folder' is a folder, not files; name the files themselves"):
        run_local("--input", tmp_path / "folder", *out)
    with pytest.raises(PrepareError, match=r"--out_dir .*docs.csv.out goes through .*docs.csv, which is a file, "
                                           r"not a folder"):
        run_local("--input", tmp_path / "content.jsonl", "--text_column", "content", "--num_proc", 1,
                  "--out_dir", tmp_path / "docs.csv" / "out")
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(PrepareError, match=r"latin1.txt: not UTF-8 text \(byte 6\)"):
        run_local("--input", tmp_path / "latin1.txt", "--text_unit", "line", *out)
    write_jsonl(tmp_path / "one.jsonl", ["only one"])
    with pytest.raises(PrepareError, match="has 1 document.*needs at least 2"):
        run_local("--input", tmp_path / "one.jsonl", *out)
    with pytest.raises(PrepareError, match="--val_fraction 0.9 of 2 documents leaves none for train"):
        run_local("--input", tmp_path / "content.jsonl", "--text_column", "content", "--val_fraction", 0.9, *out)
    with pytest.raises(PrepareError, match="--val_fraction must be between 0 and 1"):
        run_local("--input", tmp_path / "one.jsonl", "--val_fraction", 1.5, *out)
    with pytest.raises(PrepareError, match="--num_proc must be at least 1, got 0"):
        run_local("--input", tmp_path / "one.jsonl", *out, "--num_proc", 0)
    with pytest.raises(PrepareError, match="--max_tokens must be positive"):
        run_local("--input", tmp_path / "one.jsonl", "--max_tokens", 0, *out)
    assert not (tmp_path / "out").exists()  # failed runs leave nothing, not even the folder
    # the right --text_column: a finished run
    run_local("--input", tmp_path / "content.jsonl", "--text_column", "content", *out)
    assert sorted(splits(tmp_path / "out")[0] + splits(tmp_path / "out")[1]) == ["a", "b"]


def test_input_without_documents_says_so(tmp_path):
    """An input with no documents is bad input (one line, exit 2), not a crash followed by advice to
    run the same command again."""
    (tmp_path / "empty.jsonl").write_bytes(b"")
    r = prepare(OWT, "--input", tmp_path / "empty.jsonl", "--out_dir", tmp_path / "out", check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["prepare.py: error: the input holds no documents (its files are empty or hold "
                                     "only blank lines); check that --input names the right files"]
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_text("\n  \n\t\r\n\n")
    (tmp_path / "blank.jsonl").write_text("\n \n\n")
    for inputs in [["empty.txt"], ["blank.txt"], ["empty.txt", "blank.txt"]]:
        for unit in ["line", "paragraph"]:
            with pytest.raises(PrepareError, match=r"^the input holds no documents"):
                run_local("--input", *[tmp_path / name for name in inputs], "--text_unit", unit,
                          "--out_dir", tmp_path / "out", "--num_proc", 2)
    with pytest.raises(PrepareError, match=r"^the input holds no documents"):
        run_local("--input", tmp_path / "blank.jsonl", tmp_path / "empty.jsonl", "--out_dir", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def assert_bad_input(r, phrase):
    """How a prepare.py refuses bad input: exit status 2 and a single stderr line 'prepare.py: error:
    ...' naming the problem, no traceback."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare.py: error: ") and phrase in lines[0], r.stderr


def test_out_dir_file_and_garbage_parquet_are_one_line_errors(tmp_path):
    """An --out_dir that is a file is refused before any work (os.makedirs would fail only at the end
    of a hub download); a .parquet input that is no parquet file is named. Both scripts share the
    code, so each case runs through one of them."""
    write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    (tmp_path / "taken").write_text("a file\n")
    r = prepare(OWT, "--input", tmp_path / "docs.jsonl", "--out_dir", tmp_path / "taken", check=False)
    assert_bad_input(r, "--out_dir " + str(tmp_path / "taken") + " is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "a file\n"
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "taken"]
    (tmp_path / "random.parquet").write_bytes(random.Random(7).randbytes(3000))
    r = prepare(FINEWEB, "--input", tmp_path / "random.parquet", "--out_dir", tmp_path / "out", check=False)
    assert_bad_input(r, "random.parquet: not a readable parquet file")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="file modes and capabilities as on Linux")
def test_unreadable_input_and_unwritable_out_dir_are_one_line_errors(tmp_path):
    (tmp_path / "locked.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    (tmp_path / "locked.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    (tmp_path / "readonly").mkdir()
    for path, mode in [("locked.jsonl", 0o000), ("locked.txt", 0o000), ("readonly", 0o555)]:
        (tmp_path / path).chmod(mode)
    try:
        cases = [(OWT, ["--input", tmp_path / "locked.jsonl", "--out_dir", tmp_path / "out"],
                  "locked.jsonl: cannot read it (Permission denied)"),
                 (OWT, ["--input", tmp_path / "docs.jsonl", "--out_dir", tmp_path / "readonly" / "out"],
                  f"no permission to write in {tmp_path / 'readonly'}"),
                 (SHAKESPEARE, ["--input", tmp_path / "locked.txt", "--out_dir", tmp_path / "out"],
                  "locked.txt: cannot read it (Permission denied)")]
        for script, args, phrase in cases:
            try:
                r = prepare(script, *args, check=False, preexec_fn=without_root_file_access())
            except subprocess.SubprocessError as e:  # prctl refused (a container without CAP_SETPCAP)
                pytest.skip(f"cannot run the script without root's file access: {e}")
            assert_bad_input(r, phrase)
        assert not (tmp_path / "out").exists() and os.listdir(tmp_path / "readonly") == []
    finally:
        for path in ["locked.jsonl", "locked.txt", "readonly"]:
            (tmp_path / path).chmod(0o755)


def test_without_the_bpe_files_the_error_says_how_to_supply_them(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    # an empty tiktoken cache, and a proxy on a closed local port: the download fails at once
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "empty"), https_proxy="http://127.0.0.1:9",
               HTTPS_PROXY="http://127.0.0.1:9")
    r = prepare(OWT, "--input", tmp_path / "docs.jsonl", "--out_dir", tmp_path / "out", check=False, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "could not load the GPT-2 BPE" in r.stderr and "TIKTOKEN_CACHE_DIR" in r.stderr
    assert not (tmp_path / "out").exists()


def _read_units(path, text_unit, unit_bytes):
    units = prepare_common.plan_units([str(path)], text_unit, "text", num_proc=2, unit_bytes=unit_bytes)
    return len(units), [d for pieces, _ in units for p in pieces
                        for d in prepare_common.piece_documents(p, "text", text_unit)]


def test_files_cut_into_units_anywhere_read_the_same_documents(tmp_path):
    """Workers read byte ranges cut at line ends (JSON lines, .txt lines) or after blank lines (.txt
    paragraphs): whatever the cut points, the documents are those of the whole file, in order."""
    rng = random.Random(4)
    docs = make_docs(60, seed=4, max_words=12)
    write_jsonl(tmp_path / "docs.jsonl", docs)
    # paragraphs of lines with no blank one inside; separators of blank lines, some holding spaces,
    # some CRLF; a UTF-8 BOM in front
    paras = ["\n".join(f"{w} {i}.{k} 日本語" for k in range(rng.randint(1, 4))) for i, w in enumerate(docs[:40])]
    paras = [p.replace("\n\n", "\n").strip() or "x" for p in paras]
    seps = ["\n\n", "\n  \n", "\r\n\r\n", "\n\n\n\t\n"]
    text = "\ufeff" + "".join(p + rng.choice(seps) for p in paras)
    (tmp_path / "paras.txt").write_bytes(text.encode("utf-8"))
    lines = [line for p in paras for line in p.split("\n") if line.strip()]
    for path, unit, expected in [(tmp_path / "docs.jsonl", "document", docs),
                                 (tmp_path / "paras.txt", "paragraph", [p.strip("\ufeff") for p in paras]),
                                 (tmp_path / "paras.txt", "line", [x.strip("\ufeff") for x in lines])]:
        n_whole, whole = _read_units(path, unit, 10 ** 9)
        assert n_whole == 1 and whole == expected, (path, unit)
        for unit_bytes in [1, 2, 7, 50, 333]:
            n_units, got = _read_units(path, unit, unit_bytes)
            assert n_units > 1 and got == expected, (path, unit, unit_bytes)


def test_compressed_and_json_array_inputs(tmp_path):
    import bz2
    import gzip
    import lzma
    docs = make_docs(10, seed=5)
    body = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    for ext, compress in [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)]:
        (tmp_path / f"docs.jsonl{ext}").write_bytes(compress(body))
    with pa.output_stream(str(tmp_path / "docs.jsonl.zst"), compression="zstd") as f:
        f.write(body)
    (tmp_path / "array.json").write_text("\ufeff  " + json.dumps([{"text": d} for d in docs]), encoding="utf-8")
    prepare(OWT, "--input", tmp_path / "docs.*", tmp_path / "array.json", "--val_fraction", 0.1,
            "--out_dir", tmp_path / "out")
    train, val = splits(tmp_path / "out")
    assert sorted(train + val) == sorted(docs * 5)  # each file's documents, once per file


def test_what_is_read_whole_is_bounded(tmp_path, monkeypatch):
    """What cannot be cut into parts is read whole into memory, so past MAX_WHOLE_BYTES (here 100 kB) it is
    refused in one line naming the file and the limit: a .gz that inflates without bound (10 MiB of zeros in
    10 kB), a 6 GB line (a sparse file: no disk used, and no more than the limit is read), a line or
    paragraph of a .txt, a .txt document and a JSON array over it. They were read whole, the 6 GB line grown
    in memory until it ended."""
    monkeypatch.setattr(prepare_common, "MAX_WHOLE_BYTES", 100_000)
    out = ["--out_dir", tmp_path / "out", "--num_proc", 1]
    zeros = zlib.compressobj(wbits=31)  # (the gzip format)
    bomb = b"".join(zeros.compress(bytes(1 << 20)) for _ in range(10)) + zeros.flush()
    (tmp_path / "bomb.jsonl.gz").write_bytes(bomb)
    with pytest.raises(PrepareError, match=r"bomb.jsonl.gz inflates to more than 100,000 bytes, the most a compressed "
                                           r"input may hold \(it is read whole into memory\); decompress it first"):
        run_local("--input", tmp_path / "bomb.jsonl.gz", *out)
    with open(tmp_path / "huge.jsonl", "wb") as f:
        f.write(b'{"text": "a"}\n{"text": "')
        f.truncate(6 * 10 ** 9)  # one line of 6 GB
    with pytest.raises(PrepareError, match=r"huge.jsonl, line 2: a JSON line longer than 100,000 bytes, the most one "
                                           r"may hold \(each is read whole into memory\); split it into shorter ones"):
        run_local("--input", tmp_path / "huge.jsonl", *out)
    (tmp_path / "long.txt").write_text("a\nb\n\n" + "word " * 60_000 + "\nc\n")
    for unit in ["line", "paragraph"]:
        with pytest.raises(PrepareError, match=rf"long.txt, line 4: a {unit} longer than 100,000 bytes"):
            run_local("--input", tmp_path / "long.txt", "--text_unit", unit, *out)
    with pytest.raises(PrepareError, match=r"long.txt is one document \(--text_unit document\) of 300,008 bytes, "
                                           r"more than the 100,000 read whole into memory; use --text_unit paragraph"):
        run_local("--input", tmp_path / "long.txt", *out)
    (tmp_path / "array.json").write_text(json.dumps([{"text": "word " * 100} for _ in range(300)]))
    with pytest.raises(PrepareError, match=r"array.json is one JSON array of [\d,]+ bytes, more than the 100,000 read "
                                           r"whole into memory; write it as JSON lines"):
        run_local("--input", tmp_path / "array.json", *out)
    assert not (tmp_path / "out").exists()


def test_json_nested_deeper_than_the_parser_goes_and_a_negative_seed_are_one_line(tmp_path):
    """A RecursionError (JSON lines and a JSON array) and numpy's ValueError on a negative seed were tracebacks."""
    out = ["--out_dir", tmp_path / "out", "--num_proc", 1]
    (tmp_path / "deep.jsonl").write_text('{"text": "a"}\n{"text": ' + "[" * 100_000 + "\n")
    with pytest.raises(PrepareError, match=r"deep.jsonl, line 2: not valid JSON \(nested too deeply\)"):
        run_local("--input", tmp_path / "deep.jsonl", *out)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PrepareError, match=r"deep.json: not valid JSON \(nested too deeply\)"):
        run_local("--input", tmp_path / "deep.json", *out)
    write_jsonl(tmp_path / "docs.jsonl", ["a", "b", "c"])
    r = prepare(OWT, "--input", tmp_path / "docs.jsonl", "--seed", -1, *out, check=False)
    assert_bad_input(r, "--seed must be a non-negative integer, got -1")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------- shakespeare_char

def shakespeare_text(tmp_path):
    """The real Tiny Shakespeare when the TINY_SHAKESPEARE environment variable names the file; else
    a stand-in written here: lines of speaker names and verse drawn from a fixed alphabet (a
    non-ASCII letter among them, so reading as UTF-8 is tested too), long enough that both splits
    hold many distinct characters."""
    if SHAKESPEARE_TXT is not None and SHAKESPEARE_TXT.is_file():
        return SHAKESPEARE_TXT
    rng = random.Random(6)
    words = ["thou", "art", "Verona", "naïve", "O", "ROMEO:", "JULIET:", "what's", "here?", "love,", "night;", "Ay!"]
    text = "\n\n".join(rng.choice(words[5:7]) + "\n" + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
                       for _ in range(800)) + "\n"
    path = tmp_path / "stand-in.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_shakespeare_char_as_nanogpt(tmp_path):
    src = shakespeare_text(tmp_path)
    out = tmp_path / "out"
    r = prepare(SHAKESPEARE, "--input", src, "--out_dir", out)
    text = src.read_text(encoding="utf-8")
    chars = sorted(set(text))
    n_train = int(len(text) * 0.9)  # nanoGPT: the first 90% of the characters
    if src == SHAKESPEARE_TXT:  # the figures every nanoGPT user has seen
        assert (len(chars), n_train, len(text) - n_train) == (65, 1_003_854, 111_540)
    assert f"vocab size {len(chars)}" in r.stdout
    with open(out / "meta.pkl", "rb") as f:
        pkl = pickle.load(f)
    assert pkl["vocab_size"] == len(chars) and set(pkl) == {"vocab_size", "itos", "stoi"}
    assert pkl["stoi"] == {ch: i for i, ch in enumerate(chars)}  # ids in sorted character order, as nanoGPT
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert (len(train), len(val)) == (n_train, len(text) - n_train)
    assert "".join(pkl["itos"][i] for i in train.tolist()) + "".join(pkl["itos"][i] for i in val.tolist()) == text
    meta = load_meta(out)  # meta.json, which alone can decode
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == len(chars)
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert (meta["train_max_id"], meta["val_max_id"]) == (int(train.max()), int(val.max()))
    assert meta["itos"] == pkl["itos"] and meta["stoi"] == pkl["stoi"]


def test_shakespeare_char_without_network_says_how_to_supply_the_file(tmp_path):
    # a proxy on a closed local port: the download fails at once, as with no network
    env = dict(os.environ, https_proxy="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
    r = prepare(SHAKESPEARE, "--out_dir", tmp_path / "out", check=False, env=env)
    assert r.returncode == 1 and "could not download" in r.stderr
    assert "pass --input path/to/input.txt" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_shakespeare_char_bad_input_is_one_line(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "one.txt").write_text("O")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 4)  # not UTF-8 from byte 128 on
    (tmp_path / "folder").mkdir()
    (tmp_path / "taken").write_text("a file\n")
    good = shakespeare_text(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for args, phrase in [(["--input", tmp_path / "empty.txt"], "empty.txt holds no text (the file is empty)"),
                         (["--input", tmp_path / "one.txt"], "one.txt holds only 1 character"),
                         (["--input", tmp_path / "binary.txt"], "binary.txt: not UTF-8 text (byte 128)"),
                         (["--input", tmp_path / "folder"], "folder is a folder, not a text file"),
                         (["--input", good, "--out_dir", tmp_path / "taken"], "taken is a file, not a folder")]:
        r = prepare(SHAKESPEARE, "--out_dir", tmp_path / "out", *args, check=False)
        assert_bad_input(r, phrase)
        assert r.stdout == ""
    # nothing written: no out folder, the file given as --out_dir unchanged
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "folder") == []
    assert (tmp_path / "taken").read_text() == "a file\n"


def test_shakespeare_char_never_downloads_to_a_given_input(tmp_path):
    """An --input whose name is too long for the file system: os.stat cannot say it is missing, and it was
    downloaded to (offline: 'could not download', exit 1)."""
    name = tmp_path / ("x" * 300)
    r = prepare(SHAKESPEARE, "--input", name, "--out_dir", tmp_path / "out", check=False)
    assert_bad_input(r, f"{name}: cannot read it (File name too long); give a text file you can read")
    assert r.stdout == "" and os.listdir(tmp_path) == []


@pytest.mark.parametrize("script", [SHAKESPEARE, OWT], ids=["shakespeare_char", "openwebtext"])
def test_an_input_that_is_a_looping_or_broken_link_is_named_not_downloaded(tmp_path, script):
    """A looping link was taken for a missing file: shakespeare_char offered to download to that path (and
    said it could not), openwebtext said it matched 'only folders or special files'."""
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "broken").symlink_to(tmp_path / "gone.txt")
    for name, what in [("loop", "a symbolic link that loops (following it leads back to a link already followed)"),
                       ("broken", f"a broken symbolic link (to {tmp_path / 'gone.txt'}, which does not exist)")]:
        r = prepare(script, "--input", tmp_path / name, "--out_dir", tmp_path / "out", check=False)
        assert_bad_input(r, f"{tmp_path / name} is {what}; point it at ")
        assert "download" not in r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path)) == ["broken", "loop"]
    if script == SHAKESPEARE:  # its input.txt in --out_dir, where it downloads to when there is none
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "input.txt").symlink_to("input.txt")
        r = prepare(script, "--out_dir", tmp_path / "out", check=False)
        assert_bad_input(r, f"{tmp_path / 'out' / 'input.txt'} is a symbolic link that loops")
        assert "download" not in r.stdout + r.stderr and os.listdir(tmp_path / "out") == ["input.txt"]


def test_a_full_disk_while_writing_the_token_files_is_one_line_and_keeps_the_earlier_ones(tmp_path):
    """train.bin.partial a link to /dev/full: every write to it fails with ENOSPC (tofile's error said
    '36000 requested and 0 written', in a traceback)."""
    out = tmp_path / "out"
    prepare(SHAKESPEARE, "--input", shakespeare_text(tmp_path), "--out_dir", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "train.bin.partial").symlink_to("/dev/full")
    r = prepare(SHAKESPEARE, "--input", shakespeare_text(tmp_path), "--out_dir", out, check=False)
    assert_bad_input(r, f"cannot write in {out}: no space left on device; the files there are as they were (this "
                        f"run's partial files are removed). Free some space and run the same command again")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.skipif(not small_disk_available(), reason="needs `unshare -rm` to mount a small tmpfs (a real full disk)")
def test_a_disk_that_fills_while_a_mapped_token_file_is_written_is_one_line_and_leaves_nothing(tmp_path):
    """train.bin is written through a memory map: a write to a full disk there was a SIGBUS (the process
    killed without a word, its .partial files left behind). tokens.partial fits the 600 kB disk; train.bin,
    as large, does not."""
    docs = write_jsonl(tmp_path / "docs.jsonl", [f"document {i} " + "word " * 60 for i in range(3000)])
    disk = tmp_path / "disk"
    r, left = on_small_disk(disk, [sys.executable, OWT, "--input", docs, "--out_dir", disk / "out", "--num_proc", 1],
                            size="600k")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr  # (the progress bars are on stderr too)
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"prepare.py: error: cannot write in {disk / 'out'}: no space left on device; the files there are as they "
        f"were"), r.stderr
    assert left == []  # no out folder (this run made it), no partial file


def test_prepared_max_ids_checked_against_the_model_vocab(owt_jsonl):
    out = owt_jsonl[0] / "out"
    TokenBatches(out, "val", 8, 2, vocab_size=50257)  # GPT-2's EOT, 50256, is the largest id
    with pytest.raises(ValueError, match=r"val.bin holds token ids up to 50256 \(its meta.json's val_max_id\), "
                                         r"but vocab_size is 50000"):
        TokenBatches(out, "val", 8, 2, vocab_size=50000)


def _memory_at_most(nbytes):
    """preexec_fn bounding a script's address space: a script that reads an endless input fails with a
    MemoryError, not the machine."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    return limit


@pytest.mark.skipif(sys.platform != "linux", reason="/dev/zero, FIFOs and sparse files as on Linux")
def test_shakespeare_char_refuses_what_it_cannot_read_whole_without_reading_it(tmp_path):
    """An endless device, a FIFO (open waits for a writer) and a file over the 1 GiB limit (sparse: no disk
    used) are refused from os.stat alone, in one line naming the limit that --help states."""
    limit = 1 << 30
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge.txt", "wb") as f:
        f.truncate(limit + 1)
    for path, phrase in [("/dev/zero", "/dev/zero is a device or other special file, not a text file"),
                         (tmp_path / "fifo", "fifo is a FIFO, not a text file"),
                         (tmp_path / "huge.txt", f"huge.txt holds {limit + 1:,} bytes, more than the {limit:,} "
                                                 f"bytes (1 GiB) this script reads")]:
        r = prepare(SHAKESPEARE, "--input", path, "--out_dir", tmp_path / "out", check=False,  # prepare's timeout
                    preexec_fn=_memory_at_most(2 << 30))
        assert_bad_input(r, phrase)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "huge.txt"]
    assert "at most 1 GiB" in " ".join(prepare(SHAKESPEARE, "--help").stdout.split())


def test_shakespeare_char_takes_65536_distinct_characters_and_refuses_more(tmp_path):
    """uint16 ids: 65,536 distinct characters are ids 0 .. 65535 and decode back; one more is refused in one
    line naming the count and the limit, with nothing written."""
    # every code point but the surrogates (not UTF-8) and '\r' (read as '\n', as nanoGPT's open() does)
    chars = [chr(i) for i in range(1, 0x11000) if not 0xD800 <= i < 0xE000 and i != 13][:65537]
    random.Random(8).shuffle(chars)
    (tmp_path / "most.txt").write_text("".join(chars[:65536]), encoding="utf-8")
    (tmp_path / "more.txt").write_text("".join(chars), encoding="utf-8")
    prepare(SHAKESPEARE, "--input", tmp_path / "most.txt", "--out_dir", tmp_path / "out")
    meta = load_meta(tmp_path / "out")
    ids = np.concatenate([np.fromfile(tmp_path / "out" / name, dtype=np.uint16) for name in ("train.bin", "val.bin")])
    assert meta["vocab_size"] == 65536 and int(ids.max()) == 65535
    assert "".join(meta["itos"][i] for i in ids.tolist()) == "".join(chars[:65536])
    r = prepare(SHAKESPEARE, "--input", tmp_path / "more.txt", "--out_dir", tmp_path / "out2", check=False)
    assert_bad_input(r, "more.txt has 65,537 distinct characters, more than the 65,536 ids a token file holds")
    assert not (tmp_path / "out2").exists()



def test_an_out_dir_that_cannot_be_made_is_one_line_before_any_work(tmp_path):
    """Empty, or a folder name longer than the file system takes: each prepare.py says so in one line (not
    os.makedirs' traceback at the end), and leaves nothing behind; a nested --out_dir that can be made is
    made only by the run that writes into it."""
    write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    (tmp_path / "in.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    inputs = {OWT: ["--input", tmp_path / "docs.jsonl"], SHAKESPEARE: ["--input", tmp_path / "in.txt"], MQAR: []}
    too_long = tmp_path / ("x" * 300) / "out"
    for script, args in inputs.items():
        for out_dir, phrase in [("", "--out_dir is empty"),
                                (too_long, f"--out_dir {too_long}: cannot make that folder or write in it "
                                           f"(File name too long)")]:
            r = prepare(script, *args, "--out_dir", out_dir, check=False)
            assert_bad_input(r, phrase)
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "in.txt"]
    (tmp_path / "empty.txt").write_bytes(b"")  # refused after the --out_dir check
    r = prepare(SHAKESPEARE, "--input", tmp_path / "empty.txt", "--out_dir", tmp_path / "new" / "out", check=False)
    assert_bad_input(r, "empty.txt holds no text")
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "empty.txt", "in.txt"]  # no new/out made for the check
