"""batches.py: TokenBatches (random windows of a token file, checkpointable) and load_meta, and the
clear errors both give for missing, unreadable or mismatched data. No tokenizer needed."""
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from denoised_gpt import batches
from denoised_gpt.batches import TokenBatches, load_meta
from helpers import ROOT, TINY, run_script_in_process, subprocess_env, write_tokens


@pytest.fixture
def positions(tmp_path):
    """train.bin whose token at position i is i: a window shows where it was cut from."""
    write_tokens(tmp_path / "train.bin", np.arange(300))
    return tmp_path


def test_windows_are_slices_of_the_file(positions):
    tb = TokenBatches(positions, "train", block_size=16, batch_size=8, vocab_size=300)
    starts = []
    for _ in range(200):
        x, y = tb.get_batch()
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
        assert x.is_contiguous() and y.is_contiguous()
        assert torch.equal(x, x[:, :1] + torch.arange(16)) and torch.equal(y, x + 1)
        starts += x[:, 0].tolist()
    assert min(starts) == 0 and max(starts) == 300 - 16 - 1  # every window start is reachable, none overruns


def test_state_dict_round_trip_reproduces_batches(positions):
    tb = TokenBatches(positions, "train", block_size=16, batch_size=4, seed=7)
    tb.get_batch()
    buf = io.BytesIO()
    torch.save(tb.state_dict(), buf)  # as a checkpoint holds it
    expected = [tb.get_batch() for _ in range(3)]
    other = TokenBatches(positions, "train", block_size=16, batch_size=4, seed=999)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    for (x, y), (ex, ey) in zip([other.get_batch() for _ in range(3)], expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_generator_argument_leaves_own_state_alone(positions):
    tb = TokenBatches(positions, "train", block_size=16, batch_size=4, seed=7)
    fresh = TokenBatches(positions, "train", block_size=16, batch_size=4, seed=7)
    x, _ = tb.get_batch(generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, tb.get_batch(generator=torch.Generator().manual_seed(0))[0])  # drawn from the argument
    assert torch.equal(tb.get_batch()[0], fresh.get_batch()[0])  # self's sequence is where it was


def test_bad_token_files_fail_clearly(tmp_path):
    (tmp_path / "val.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"odd size \(3 bytes\).*not a uint16 token file"):
        TokenBatches(tmp_path, "val", 8, 2)
    write_tokens(tmp_path / "short" / "train.bin", np.arange(8))
    with pytest.raises(ValueError, match=r"has 8 tokens, fewer than block_size \+ 1 = 9"):
        TokenBatches(tmp_path / "short", "train", 8, 2)
    TokenBatches(tmp_path / "short", "train", 7, 2)  # exactly block_size + 1 is enough


def test_token_ids_checked_against_vocab_size(tmp_path, monkeypatch):
    tokens = np.zeros(5000, dtype=np.uint16)
    tokens[4321] = 50257
    write_tokens(tmp_path / "train.bin", tokens)
    TokenBatches(tmp_path, "train", 8, 2, vocab_size=50258)  # the largest id is vocab_size - 1: fine
    TokenBatches(tmp_path, "train", 8, 2)  # no vocab_size, no check
    monkeypatch.setattr(batches, "SCAN_CHUNK", 1000)  # several chunks; the bad id is in the fifth
    with pytest.raises(ValueError, match=r"token id 50257 at position 4321, but vocab_size is 50257"):
        TokenBatches(tmp_path, "train", 8, 2, vocab_size=50257)
    # meta.json's vocab_size and a matching token count prove nothing about the ids (a file from
    # another tokenizer): without a stored max id the file is still scanned, at construction
    meta = {"tokenizer": "gpt2", "vocab_size": 50257, "train_tokens": 5000}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"token id 50257 at position 4321, but vocab_size is 50257"):
        TokenBatches(tmp_path, "train", 8, 2, vocab_size=50257)
    # the max id prepare.py stored for this very file (same token count) stands in for the scan:
    # too large fails from meta.json alone, ...
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, train_max_id=50257)))
    with pytest.raises(ValueError, match=r"train.bin holds token ids up to 50257 \(its meta.json's train_max_id\), "
                                         r"but vocab_size is 50257: the file was made with another tokenizer"):
        TokenBatches(tmp_path, "train", 8, 2, vocab_size=50257)
    # ... small enough is trusted for a large file, which is then not read at construction (the planted
    # id goes unseen there; the batches are checked as drawn, below), ...
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, train_max_id=50256)))
    monkeypatch.setattr(batches, "FULL_SCAN_TOKENS", 4999)
    TokenBatches(tmp_path, "train", 8, 2, vocab_size=50257)
    # ... and a meta.json describing another file (another token count) is not trusted
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, train_max_id=50256, train_tokens=4999)))
    with pytest.raises(ValueError, match=r"token id 50257 at position 4321"):
        TokenBatches(tmp_path, "train", 8, 2, vocab_size=50257)


def test_token_id_beyond_vocab_without_meta_is_named(tmp_path):
    # no meta.json (nanoGPT's datasets): the caller's vocab_size (GPT-2's by default) against a uint16 file
    tokens = np.zeros(5000, dtype=np.uint16)
    tokens[1234] = 60000
    write_tokens(tmp_path / "train.bin", tokens)
    with pytest.raises(batches.TokenIdError) as e:
        TokenBatches(tmp_path, "train", 8, 2, vocab_size=50304)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'train.bin'} holds token id 60000 at position 1234, but vocab_size is "
                              f"50304: the file was made with another tokenizer, and {tmp_path} has no meta.json")
    assert "\n" not in message


def test_small_file_is_scanned_even_when_its_meta_json_vouches(tmp_path):
    # a meta.json whose train_max_id no longer describes its file (same token count, rewritten since):
    # a small file costs nothing to read, so the stale max id cannot let 60000 through to the embedding
    tokens = np.zeros(5000, dtype=np.uint16)
    tokens[4321] = 60000
    write_tokens(tmp_path / "train.bin", tokens)
    (tmp_path / "meta.json").write_text(json.dumps({**GOOD_META, "train_tokens": 5000, "train_max_id": 64}))
    with pytest.raises(batches.TokenIdError, match=r"train.bin holds token id 60000 at position 4321, but vocab_size "
                                                   r"is 65: its meta.json says train_max_id 64, so the file changed"):
        TokenBatches(tmp_path, "train", 8, 2, vocab_size=65)


@pytest.mark.parametrize("labels", [False, True])
def test_every_batch_is_checked_against_vocab_size(tmp_path, labels, monkeypatch):
    # What construction did not read (a large file whose meta.json vouches for it) or what changed on
    # disk since is caught by the batch that holds it, before it reaches the model: a TokenIdError
    # naming the file, the id and its position (read back from the file), never an IndexError.
    monkeypatch.setattr(batches, "FULL_SCAN_TOKENS", 0)  # every file counts as large here
    meta = {**GOOD_META, "train_tokens": 600, "train_max_id": 64}
    if labels:  # whole 6-token examples whose targets come from train_labels.bin
        meta.update(example_tokens=6, labels="answers")
        np.full(600, -1, dtype=np.int32).tofile(tmp_path / "train_labels.bin")
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    write_tokens(tmp_path / "train.bin", np.arange(600) % 65)
    tb = TokenBatches(tmp_path, "train", 5, 4, vocab_size=65)
    for _ in range(20):
        tb.get_batch()  # valid ids pass
    bad_path = tmp_path / ("train_labels.bin" if labels else "train.bin")
    if labels:
        np.full(600, 99, dtype=np.int32).tofile(bad_path)
    else:
        write_tokens(bad_path, np.full(600, 99))  # rewritten since: every id is out of range
    with pytest.raises(batches.TokenIdError) as e:
        tb.get_batch()
    if labels:  # a label is a target, not a token: its own range and fix
        m = re.fullmatch(rf"{re.escape(str(bad_path))} holds label 99 at position (\d+), but a label is -1 \(not "
                         rf"scored\) or a token id below vocab_size 65: the file is damaged or from another "
                         rf"preparation; run that dataset's prepare.py again", str(e.value))
    else:
        m = re.fullmatch(rf"{re.escape(str(bad_path))} holds token id 99 at position (\d+), but vocab_size is 65: "
                         rf"its meta.json says train_max_id 64, so the file changed after prepare.py wrote it; "
                         rf"prepare the dataset again", str(e.value))
    assert m, str(e.value)
    assert np.fromfile(bad_path, dtype=np.int32 if labels else np.uint16)[int(m[1])] == 99
    if labels:
        assert int(m[1]) % 6 == 1  # the first target of an example: the label after its first token


def test_the_target_after_the_window_is_checked_too(tmp_path, monkeypatch):
    # one window fits (block_size + 1 tokens): the last token is only ever a target, never an input
    monkeypatch.setattr(batches, "FULL_SCAN_TOKENS", 0)
    (tmp_path / "meta.json").write_text(json.dumps({**GOOD_META, "train_tokens": 6, "train_max_id": 5}))
    write_tokens(tmp_path / "train.bin", [0, 1, 2, 3, 4, 99])
    tb = TokenBatches(tmp_path, "train", 5, 2, vocab_size=65)
    with pytest.raises(batches.TokenIdError, match=r"train.bin holds token id 99 at position 5, but vocab_size is 65"):
        tb.get_batch()


def _no_meta_dataset(tmp_path, bad_id):
    """train.bin / val.bin as nanoGPT's prepare.py leaves them (no meta file), train.bin holding one bad id."""
    data = tmp_path / "data"
    train = np.arange(3000) % 40
    train[2345] = bad_id
    write_tokens(data / "train.bin", train)
    write_tokens(data / "val.bin", np.arange(600) % 40)
    return data


def test_train_refuses_token_id_beyond_default_vocab_in_one_line(tmp_path):
    # without meta the model gets GPT-2's 50304 ids; 60000 fits a uint16 file but not the embedding
    data = _no_meta_dataset(tmp_path, 60000)
    proc = run_script_in_process("train.py", [TINY, f"--dataset={data}", f"--out_dir={tmp_path / 'out'}"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"train.py: error: {data / 'train.bin'} holds token id 60000 at position 2345, but vocab_size is 50304: the "
        f"file was made with another tokenizer, and {data} has no meta.json to say its vocabulary; prepare it with "
        f"its prepare.py (which writes meta.json with the vocab_size the model is built with)"]
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_train_refuses_token_id_beyond_a_stale_meta_json_in_one_line(tmp_path):
    data = _no_meta_dataset(tmp_path, 47)  # 47: outside the vocabulary of 40 its meta.json records
    (data / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 40, "train_tokens": 3000,
                                                "train_max_id": 39, "val_tokens": 600, "val_max_id": 39}))
    proc = run_script_in_process("train.py", [TINY, f"--dataset={data}", f"--out_dir={tmp_path / 'out'}"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"train.py: error: {data / 'train.bin'} holds token id 47 at position 2345, but vocab_size is 40: its "
        f"meta.json says train_max_id 39, so the file changed after prepare.py wrote it; prepare the dataset again"]


def test_train_stops_at_the_batch_holding_a_bad_id_in_one_line(tmp_path, monkeypatch):
    # a large file whose meta.json vouches for it is not read up front: the first batch drawn (train.py
    # evaluates first) holds a bad id, and the run ends there in one line, exit 2, not an IndexError
    monkeypatch.setattr(batches, "FULL_SCAN_TOKENS", 0)
    data = tmp_path / "data"
    write_tokens(data / "train.bin", np.full(3000, 47))
    write_tokens(data / "val.bin", np.arange(600) % 40)
    (data / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 40, "train_tokens": 3000,
                                                "train_max_id": 39, "val_tokens": 600, "val_max_id": 39}))
    proc = run_script_in_process("train.py", [TINY, f"--dataset={data}", f"--out_dir={tmp_path / 'out'}"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"train.py: error: {re.escape(str(data / 'train.bin'))} holds token id 47 at position \d+, but vocab_size "
        rf"is 40: its meta.json says train_max_id 39, so the file changed after prepare.py wrote it; prepare the "
        rf"dataset again", lines[0]), lines


def test_load_meta_json_pkl_or_none(tmp_path):
    assert load_meta(tmp_path) is None
    with open(tmp_path / "meta.pkl", "wb") as f:  # a nanoGPT character-level dataset
        pickle.dump({"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "c"}, "stoi": {"a": 0, "b": 1, "c": 2}}, f)
    meta = load_meta(tmp_path)
    assert meta["tokenizer"] == "char" and meta["vocab_size"] == 3 and meta["itos"][2] == "c"
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    assert load_meta(tmp_path) == {"tokenizer": "gpt2", "vocab_size": 50257}  # meta.json wins
    (tmp_path / "meta.json").write_text('{"tokenizer": "gpt2", ')
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        load_meta(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "gpt2"}))
    with pytest.raises(ValueError, match=r"lacks \['vocab_size'\]"):
        load_meta(tmp_path)


# A meta.json as prepare.py writes it; each case below spoils one field of it.
GOOD_META = {"tokenizer": "char", "vocab_size": 65, "chars": "".join(chr(48 + i) for i in range(65)),
             "train_tokens": 5000, "val_tokens": 1000, "train_max_id": 64, "val_max_id": 64, "source": "tests"}


@pytest.mark.parametrize("field, value", [
    # each of these reached the scripts unchecked: a TypeError or RuntimeError building the model,
    # or (a bool being an int to Python) an id check skipped and an IndexError mid-training
    ("vocab_size", "sixty"), ("vocab_size", 65.5), ("vocab_size", True), ("vocab_size", "65"),
    ("vocab_size", -1), ("vocab_size", 0), ("vocab_size", None), ("vocab_size", 10 ** 12),
    ("tokenizer", 7), ("tokenizer", None), ("tokenizer", ["char"]),
    ("train_tokens", "5000"), ("train_tokens", 5000.0), ("train_tokens", -1), ("val_tokens", False),
    ("train_max_id", False), ("train_max_id", "64"), ("train_max_id", 64.0), ("val_max_id", -2),
    ("val_max_id", True), ("chars", 7), ("chars", [1, 2]),
    # a needle dataset's: eval_answers_only reads the answers from the first value id up
    ("text_labels", "yes"), ("text_labels", 1), ("value_ids", 97), ("value_ids", [97]), ("value_ids", [97, 96]),
    ("value_ids", [-1, 5]), ("value_ids", [97.0, 128]),
])
def test_wrong_typed_meta_json_field_is_named(tmp_path, field, value):
    (tmp_path / "meta.json").write_text(json.dumps({**GOOD_META, field: value}))
    with pytest.raises(ValueError) as e:
        load_meta(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'meta.json'}: {field} is {json.dumps(value)}, but it must be ")
    assert message.endswith(f"prepare the dataset again with its prepare.py, or correct {field} in that file")
    assert "\n" not in message  # the scripts print it as one `<script>: error:` line


@pytest.mark.parametrize("split", ["train", "val"])
def test_bool_max_id_never_vouches_for_a_token_file(tmp_path, split):
    # false == 0 < vocab_size: trusted, it would skip the scan and let the id 200 below through to
    # the embedding lookup, mid-training. TokenBatches reads meta.json itself, so it checks too.
    tokens = np.zeros(500, dtype=np.uint16)
    tokens[123] = 200
    write_tokens(tmp_path / f"{split}.bin", tokens)
    meta = {**GOOD_META, f"{split}_tokens": 500, f"{split}_max_id": False}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"meta.json: {split}_max_id is false, but it must be a non-negative"):
        TokenBatches(tmp_path, split, 8, 2, vocab_size=65)
    # -1 (what prepare.py writes for an empty split) describes no file of 500 tokens: scanned, not trusted
    (tmp_path / "meta.json").write_text(json.dumps({**meta, f"{split}_max_id": -1}))
    with pytest.raises(ValueError, match=r"token id 200 at position 123, but vocab_size is 65"):
        TokenBatches(tmp_path, split, 8, 2, vocab_size=65)


@pytest.mark.parametrize("write, expected", [
    # these raised RecursionError, a ValueError naming no file, or IsADirectoryError
    (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "is not valid JSON (nested too deeply)"),
    (lambda p: p.write_text('{"vocab_size": ' + "9" * 5000 + "}"), "is not valid JSON (Exceeds the limit"),
    (lambda p: p.write_bytes(b'{"tokenizer": "\xff"}'), "is not valid JSON ('utf-8' codec can't decode"),
    (lambda p: p.mkdir(), ": it is a folder, not a file; remove it"),
], ids=["deeply nested", "too many digits", "not UTF-8", "a folder"])
def test_unreadable_meta_json_is_a_value_error(tmp_path, write, expected):
    write(tmp_path / "meta.json")
    with pytest.raises(ValueError) as e:
        load_meta(tmp_path)
    assert expected in str(e.value) and str(tmp_path / "meta.json") in str(e.value)


@pytest.mark.parametrize("field, value", [("vocab_size", "65"), ("vocab_size", True), ("vocab_size", -1),
                                          ("tokenizer", 3)])
def test_wrong_typed_meta_pkl_field_is_named(tmp_path, field, value):
    # nanoGPT's meta.pkl feeds vocab_size to the same callers: checked the same way
    meta = {"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "c"}, "stoi": {"a": 0, "b": 1, "c": 2}}
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({**meta, field: value}, f)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'meta.pkl'}: {field} is .*, but it must be "):
        load_meta(tmp_path)


def test_good_meta_json_with_extra_keys_loads(tmp_path):
    # keys load_meta does not know (prepare_common's eot_token and dtype, anything a user adds) are
    # allowed and kept; an empty split's max id of -1 is what prepare.py writes
    meta = {**GOOD_META, "val_tokens": 0, "val_max_id": -1, "eot_token": 50256, "dtype": "uint16",
            "notes": {"by": "me", "tags": [1, None, True]}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    loaded = load_meta(tmp_path)
    assert {k: loaded[k] for k in meta} == meta
    assert loaded["stoi"]["0"] == 0 and loaded["itos"][64] == GOOD_META["chars"][64] and len(loaded["itos"]) == 65
    # a list of characters is a vocabulary too; the largest vocabulary uint16 ids allow passes
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "chars": list("abc"), "vocab_size": 1 << 16}))
    assert load_meta(tmp_path)["itos"] == {0: "a", 1: "b", 2: "c"}


# ------------------------------------------------------------------------- missing or unreadable data

def test_missing_data_names_the_prepare_script_to_run(tmp_path, monkeypatch):
    # as train.py reads --dataset=openwebtext: data/openwebtext/, relative to the repository root
    (tmp_path / "data" / "openwebtext").mkdir(parents=True)
    (tmp_path / "data" / "openwebtext" / "prepare.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        TokenBatches(os.path.join("data", "openwebtext"), "train", 8, 2)
    assert str(e.value) == (f"{os.path.join('data', 'openwebtext', 'train.bin')} not found: run python3 "
                            f"{os.path.join('data', 'openwebtext', 'prepare.py')} first (it writes train.bin and "
                            f"val.bin there)")
    # a folder with no prepare.py of its own: what it needs, and the setting that names it
    with pytest.raises(FileNotFoundError) as e:
        TokenBatches(tmp_path / "mine", "val", 8, 2)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'mine' / 'val.bin'} not found: {tmp_path / 'mine'} needs the "
                              f"train.bin and val.bin that a data/<name>/prepare.py writes")
    assert "the `dataset` key" in message and "data_dir" not in message


def test_what_is_not_a_readable_token_file_is_named(tmp_path):
    """These fail the same way for root, whom chmod 000 does not stop."""
    (tmp_path / "dir" / "train.bin").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"^cannot read .*train.bin: it is a folder, not a token file; remove it"):
        TokenBatches(tmp_path / "dir", "train", 8, 2)
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "val.bin")  # opening it would block: refused before that
    with pytest.raises(ValueError, match=r"^cannot read .*val.bin: it is a FIFO, not a token file"):
        TokenBatches(tmp_path / "fifo", "val", 8, 2)
    (tmp_path / "a-file").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"^cannot read .*a-file/train.bin: .*a-file is not a folder; set the "
                                         r"`dataset` key"):
        TokenBatches(tmp_path / "a-file", "train", 8, 2)
    assert load_meta(tmp_path / "a-file") is None  # (TokenBatches then names the problem)


def without_root_privileges(fn):
    """Call fn() where file permissions apply, and return (exception type name, message) or None.
    An ordinary user calls it here; root, whom chmod 000 does not stop, calls it in a forked child
    that first drops to the unprivileged uid/gid 65534 ('nobody')."""
    def call():
        try:
            fn()
        except Exception as e:
            return [type(e).__name__, str(e)]
        return None

    if os.geteuid() != 0:
        return call()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write_end, json.dumps(call()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        report = f.read()
    os.waitpid(pid, 0)
    return json.loads(report)


@pytest.fixture
def world_readable_dir():
    # pytest's tmp_path lies in a folder only its owner may enter; the unprivileged child must be
    # stopped by the permission under test, not by that
    path = Path(tempfile.mkdtemp(prefix="batches-perm-"))
    path.chmod(0o755)
    yield path
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755)
    shutil.rmtree(path)


def test_unreadable_data_says_permission_denied(world_readable_dir):
    d = world_readable_dir / "locked"
    d.mkdir()
    np.arange(100, dtype=np.uint16).tofile(d / "train.bin")
    (d / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 100}))
    d.chmod(0o000)  # the dataset folder: its files cannot even be looked up (os.path.isfile says False)
    assert without_root_privileges(lambda: TokenBatches(d, "train", 8, 2)) == [
        "ValueError", f"cannot read {d / 'train.bin'}: permission denied; give the user running this read access "
                      f"to it and search (x) access to its folders (chmod/chown), or run as the user who prepared it"]
    assert without_root_privileges(lambda: load_meta(d)) == [
        "ValueError", batches.permission_denied(d / "meta.json").args[0]]
    d.chmod(0o755)
    (d / "train.bin").chmod(0o000)  # the token file itself
    assert without_root_privileges(lambda: TokenBatches(d, "train", 8, 2)) == [
        "ValueError", batches.permission_denied(d / "train.bin").args[0]]
    (d / "meta.json").chmod(0o000)
    assert without_root_privileges(lambda: load_meta(d)) == [
        "ValueError", batches.permission_denied(d / "meta.json").args[0]]
    (d / "meta.json").unlink()
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 3}, f)
    (d / "meta.pkl").chmod(0o000)
    assert without_root_privileges(lambda: load_meta(d)) == [
        "ValueError", batches.permission_denied(d / "meta.pkl").args[0]]
    # and with the permissions back, the same calls work (what failed was the permission)
    for p in d.iterdir():
        p.chmod(0o644)
    assert without_root_privileges(lambda: (TokenBatches(d, "train", 8, 2), load_meta(d))) is None


# ---------------------------------------------------------------------------------- meta.pkl

class RunsCode:
    """Unpickling this calls os.mkdir(marker): what a crafted meta.pkl would do, harmlessly."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def crafted_dataset(folder, marker):
    """A dataset folder whose meta.pkl runs code when unpickled, with valid token files beside it."""
    folder.mkdir(parents=True)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": RunsCode(str(marker)), "stoi": {}}, f)
    for split in ["train", "val"]:
        np.zeros(1000, dtype=np.uint16).tofile(folder / f"{split}.bin")
    return folder


def test_crafted_meta_pkl_is_refused_not_run(tmp_path):
    data = crafted_dataset(tmp_path / "data", tmp_path / "marker")
    # the payload is live: plain pickle runs it
    with open(data / "meta.pkl", "rb") as f:
        pickle.load(f)
    assert (tmp_path / "marker").is_dir()
    (tmp_path / "marker").rmdir()
    with pytest.raises(ValueError, match=r"meta.pkl is not a plain-data meta.pkl \(refusing to load posix.mkdir: "
                                         r"only plain data is read\); it is not loaded"):
        load_meta(data)
    assert not (tmp_path / "marker").exists()
    # with a meta.json beside it, meta.pkl is not even opened: the vocabulary is meta.json's
    (data / "meta.json").write_text(json.dumps({"tokenizer": "char", "vocab_size": 3, "chars": "abc"}))
    meta = load_meta(data)
    assert meta["vocab_size"] == 3 and meta["itos"] == {0: "a", 1: "b", 2: "c"}
    assert not (tmp_path / "marker").exists()


@pytest.mark.slow
def test_train_py_refuses_a_crafted_meta_pkl(tmp_path):
    data = crafted_dataset(tmp_path / "data", tmp_path / "marker")
    r = subprocess.run([sys.executable, "train.py", str(TINY), f"--dataset={data}",
                        f"--out_dir={tmp_path / 'out'}", "--max_iters=1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=subprocess_env())
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"train.py: error: {data / 'meta.pkl'} is not a plain-data meta.pkl (refusing to load posix.mkdir: only plain "
        f"data is read); it is not loaded because unpickling anything else can run code. Delete it and run that "
        f"dataset's prepare.py again"]
    assert not (tmp_path / "marker").exists()


def test_nanogpt_meta_pkl_loads_in_every_pickle_protocol(tmp_path):
    # nanoGPT's data/shakespeare_char/prepare.py: pickle.dump(meta, f) with the default protocol;
    # older Pythons wrote older protocols
    chars = sorted(set("First Citizen:\nBefore we proceed any further, hear me speak."))
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with open(tmp_path / "meta.pkl", "wb") as f:
            pickle.dump(meta, f, protocol=protocol)
        assert load_meta(tmp_path) == {**meta, "tokenizer": "char"}, protocol
