"""
Training batches from the token shards written by data/<name>/prepare.py: random (x, y) windows of
a flat uint16 file, drawn from a dedicated torch.Generator whose state goes into checkpoints, so a
resumed run draws exactly the batches the uninterrupted run would have drawn.

A dataset of fixed-length examples (a synthetic task such as data/mqar) says so in its meta.json:
`example_tokens` (each row of a batch is then one whole example, never a window across two) and
`labels` (the targets come from {split}_labels.bin instead of the next tokens: the answers, and -1,
which the model's losses ignore, everywhere else).
"""
import json
import os
import pickle

import numpy as np
import torch

from denoised_gpt.files import (PREPARE_AGAIN, permission_denied, read_json, require_regular_file,
                                token_file_size)

SCAN_CHUNK = 1 << 26  # tokens per step of the vocab check (128 MB of uint16): bounded work per call, stops early
# Token files up to this many tokens (256 MB) have all their ids checked when TokenBatches opens them:
# well under a second, so even a meta.json's stored max id is not taken on trust there (the file may
# have changed since). A larger file (OpenWebText's train.bin: 9 G tokens, up to a minute per rank when
# not in the page cache) is checked by its meta.json's max id, when that describes it, and batch by batch.
FULL_SCAN_TOKENS = 1 << 27
# (true for every script: the vocabulary is the model's, from meta.json or a checkpoint, never a setting)
_OTHER_TOKENIZER = ("the file was made with another tokenizer than the model's: prepare it again with its "
                    "prepare.py, or give the data the model was trained on (--dataset)")


class TokenIdError(ValueError):
    """A token id the model has no embedding for (>= vocab_size), named with its file and position.
    A ValueError, which the scripts print as their one-line error."""


def _id_error(path, token, at, vocab_size, vouched=None):
    """The TokenIdError for id `token` at position `at` of path, with the fix that fits its dataset.
    vouched: what the dataset's meta.json said of the file's ids ("train_max_id 64"), if anything."""
    data_dir = os.path.dirname(path)
    if vouched is not None:
        fix = f"its meta.json says {vouched}, so the file changed after prepare.py wrote it; prepare the dataset again"
    elif not any(os.path.exists(os.path.join(data_dir, name)) for name in ("meta.json", "meta.pkl")):
        fix = (f"the file was made with another tokenizer, and {data_dir} has no meta.json to say its vocabulary; "
               f"prepare it with its prepare.py (which writes meta.json with the vocab_size the model is built with)")
    else:
        fix = _OTHER_TOKENIZER
    return TokenIdError(f"{path} holds token id {token} at position {at}, but vocab_size is {vocab_size}: {fix}")


def check_token_ids(path, vocab_size, vouched=None):
    """TokenIdError naming the first id of the token file at path that is not below vocab_size: an id
    that would index past the embedding table mid-run, as an IndexError (a device-side assert on CUDA).
    For a file read whole (eval.py's validation loss), and by TokenBatches. A vectorised max over the
    memmap, chunk by chunk."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    for start in range(0, len(data), SCAN_CHUNK):
        top = int(data[start:start + SCAN_CHUNK].max())
        if top >= vocab_size:
            at = start + int(np.argmax(data[start:start + SCAN_CHUNK] >= vocab_size))
            raise _id_error(path, int(data[at]), at, vocab_size, vouched)


def _label_error(path, label, at, vocab_size):
    """The TokenIdError for a label outside -1 .. vocab_size - 1 at position `at` of a labels file."""
    return TokenIdError(f"{path} holds label {label} at position {at}, but a label is -1 (not scored) or a token id "
                        f"below vocab_size {vocab_size}: the file is damaged or from another preparation; run that "
                        f"dataset's prepare.py again")


def check_label_ids(path, vocab_size):
    """TokenIdError naming the first label of the labels file at path (int32) outside -1 .. vocab_size - 1:
    a target the loss would index past its logits with, mid-run, as an IndexError; or saying that every label
    is -1: no target to learn or evaluate (the loss would be 0, the evaluation NaN, and the run's advice
    about it wrong). Chunk by chunk, as check_token_ids."""
    labels = np.memmap(path, dtype=np.int32, mode="r")
    scored = False
    for start in range(0, len(labels), SCAN_CHUNK):
        chunk = labels[start:start + SCAN_CHUNK]
        if int(chunk.min()) < -1 or int(chunk.max()) >= vocab_size:
            at = start + int(np.argmax((chunk < -1) | (chunk >= vocab_size)))
            raise _label_error(path, int(labels[at]), at, vocab_size)
        scored = scored or int(chunk.max()) >= 0
    if not scored:
        raise TokenIdError(f"{path} scores no position (every label is -1, not scored): there is nothing to learn "
                           f"or evaluate; the file is damaged or from another preparation: run that dataset's "
                           f"prepare.py again")


class ExampleLayout:
    """How a dataset's token file is cut into training rows: random windows (example_tokens None), or
    whole examples of example_tokens tokens. With labels (meta.json's "labels"), the targets come from
    `{split}_labels.bin` (int32, aligned with the tokens as next-token targets are; -1 = not scored)
    instead of the next tokens: a task whose answers are labels only, never shown as input (MQAR)."""

    def __init__(self, data_dir, split):
        try:
            meta = _read_meta_json(os.path.join(data_dir, "meta.json"))
        except OSError:
            meta = {}  # no meta.json (nanoGPT's datasets, GPT-2 shards without one): plain windows
        if "target_mask" in meta:
            raise ValueError(f"{data_dir} was prepared by an earlier data/mqar/prepare.py, whose examples showed "
                             f"each answer after its query (a model could guess among the values not yet answered): "
                             f"run prepare.py again")
        self.example_tokens = meta.get("example_tokens")
        self.task = meta.get("task")  # 'mqar', 'needles' (whose positions eval.py reads), or None for text
        self.labels_path = os.path.join(data_dir, f"{split}_labels.bin") if meta.get("labels") else None
        # needle data whose text is labelled too: its answers are the labels from the first value id up (the
        # text's ids lie below); None where every label is an answer, or there are no labels
        if meta.get("text_labels") and "value_ids" not in meta:
            raise ValueError(f"{data_dir}/meta.json says its text is labelled but not which ids are the answers "
                             f"(value_ids): run data/needles/prepare.py again")
        self.first_answer_id = meta["value_ids"][0] if meta.get("text_labels") else None

    def answers_only(self, y):
        """The targets y with every label but the answers -1 (not scored)."""
        return y if self.first_answer_id is None else y.masked_fill(y < self.first_answer_id, -1)

    def check(self, path, num_tokens, block_size, vocab_size=None):
        """ValueError unless the token file at path (num_tokens long) fits this layout at block_size: with
        labels, a labels file of one label per token, and with vocab_size, every label in -1 .. vocab_size - 1
        (a TokenIdError)."""
        if self.example_tokens is None:
            return
        if block_size != self.example_tokens - 1:
            raise ValueError(f"{path} holds examples of {self.example_tokens} tokens (its meta.json's example_tokens), "
                             f"read {self.example_tokens - 1} at a time: set block_size={self.example_tokens - 1} "
                             f"(now {block_size}), so that every row of a batch is one whole example")
        if num_tokens % self.example_tokens:
            raise ValueError(f"{path} has {num_tokens} tokens, not a whole number of {self.example_tokens}-token "
                             f"examples: it is truncated or from another preparation; run prepare.py again")
        if self.labels_path is not None:
            label_bytes = token_file_size(os.path.dirname(path), self.labels_path)
            if label_bytes != 4 * num_tokens:
                raise ValueError(f"{self.labels_path} has {label_bytes} bytes but {path} has {num_tokens} tokens "
                                 f"(one int32 label per token): the files are from different preparations; run "
                                 f"prepare.py again")
            if vocab_size is not None:
                check_label_ids(self.labels_path, vocab_size)

    def rows(self, path, starts, length):
        """(x, y) int64 tensors: for each start, tokens [start, start + length) and their targets: the next
        tokens, or the labels where the dataset has them."""
        data = np.memmap(path, dtype=np.uint16, mode="r")
        w = torch.from_numpy(data[starts[:, None] + np.arange(length + 1)].astype(np.int64))  # one read per row
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if self.labels_path is not None:
            labels = np.memmap(self.labels_path, dtype=np.int32, mode="r")
            y = torch.from_numpy(labels[starts[:, None] + np.arange(1, length + 1)].astype(np.int64))
        return x, y


class TokenBatches:
    """Random (x, y) windows from data_dir/{split}.bin (flat uint16 memmap); y is x shifted by one.
    For a dataset of examples (ExampleLayout), random whole examples, with their masked targets.
    With vocab_size, an id the model has no embedding for is a TokenIdError: when the file is opened
    (see FULL_SCAN_TOKENS), or at the latest from get_batch, before the batch reaches the model."""

    def __init__(self, data_dir, split, block_size, batch_size, device="cpu", seed=1337, vocab_size=None):
        self.path = os.path.join(data_dir, f"{split}.bin")
        self.block_size, self.batch_size, self.device = block_size, batch_size, device
        nbytes = token_file_size(data_dir, self.path)
        if nbytes % 2:
            raise ValueError(f"{self.path} has an odd size ({nbytes} bytes), so it is not a uint16 token file: "
                             f"it is truncated or not a .bin from prepare.py; run prepare.py again")
        self.num_tokens = nbytes // 2
        self.layout = ExampleLayout(data_dir, split)
        # the labels are read whole here up to the size whose token file is (FULL_SCAN_TOKENS); beyond it,
        # batch by batch
        self.layout.check(self.path, self.num_tokens, block_size,
                          vocab_size if self.num_tokens <= FULL_SCAN_TOKENS else None)
        if self.num_tokens < block_size + 1:
            raise ValueError(f"{self.path} has {self.num_tokens} tokens, fewer than block_size + 1 = {block_size + 1} "
                             f"needed for one (x, y) window; lower block_size or prepare more data")
        # vocab_size: every id must be below it (checked here and in every batch); None checks nothing
        self.vocab_size = vocab_size
        self.vouched = None  # "{split}_max_id M" when the dataset's meta.json vouches for this file
        if vocab_size is not None:
            self.vouched = self._meta_vouches(data_dir, split, vocab_size)
            if self.vouched is None or self.num_tokens <= FULL_SCAN_TOKENS:
                check_token_ids(self.path, vocab_size, self.vouched)
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        # Pinned host memory + non_blocking overlaps the copy with compute; only CUDA benefits.
        self.pin = torch.device(device).type == "cuda"

    def _meta_vouches(self, data_dir, split, vocab_size):
        # prepare.py stores the largest id of each split in meta.json. When that meta.json describes
        # this very file (same token count), its {split}_max_id settles a large file's check without
        # reading it all (see FULL_SCAN_TOKENS); the batches are still checked as they are drawn. Its
        # vocab_size alone proves nothing: a file from another tokenizer may sit there.
        # The fields are type-checked as load_meta checks them: `"train_max_id": false` (a bool, so an
        # int to isinstance) would otherwise vouch for any file. A wrong-typed field is named here.
        # Returns what vouched ("train_max_id 64"), or None.
        try:
            meta = _read_meta_json(os.path.join(data_dir, "meta.json"))
        except OSError:
            return None  # no meta.json (or none we may read): the scan decides
        top = meta.get(f"{split}_max_id")
        if meta.get(f"{split}_tokens") != self.num_tokens or top is None or top < 0:
            return None  # another file, or a meta.json from before max ids were stored: scan
        if top >= vocab_size:
            raise TokenIdError(f"{self.path} holds token ids up to {top} (its meta.json's {split}_max_id), but "
                               f"vocab_size is {vocab_size}: {_OTHER_TOKENIZER}")
        return f"{split}_max_id {top}"

    def _check_batch(self, rows, starts, path, offset, labels=False):
        # Every batch, on the CPU before the copy to the device: one max over batch_size * block_size
        # ints (microseconds), for what the construction did not read (a large file) or what changed
        # on disk since. rows[r, t] was read from path at position starts[r] + offset + t; labels: rows
        # of labels, which may also be -1 (not scored), and no lower.
        low = -1 if labels else 0
        if int(rows.max()) >= self.vocab_size or int(rows.min()) < low:
            r, t = np.argwhere((rows.numpy() >= self.vocab_size) | (rows.numpy() < low))[0]
            at = int(starts[r]) + offset + int(t)
            if labels:
                raise _label_error(path, int(rows[r, t]), at, self.vocab_size)
            raise _id_error(path, int(rows[r, t]), at, self.vocab_size, self.vouched)

    def get_batch(self, generator=None):
        """(x, y), int64 tensors of shape (batch_size, block_size) on self.device. Draws the window
        starts from `generator`, or from self.generator (the checkpointed one) when None."""
        g = self.generator if generator is None else generator
        if self.layout.example_tokens is None:
            ix = torch.randint(self.num_tokens - self.block_size, (self.batch_size,), generator=g).numpy()
        else:
            examples = self.num_tokens // self.layout.example_tokens
            ix = torch.randint(examples, (self.batch_size,), generator=g).numpy() * self.layout.example_tokens
        # A fresh memmap per batch, as nanoGPT: a long-lived one keeps every page it touched mapped
        # in this process, which shows up as a memory leak on large files.
        x, y = self.layout.rows(self.path, ix, self.block_size)
        if self.vocab_size is not None:
            self._check_batch(x, ix, self.path, 0)
            if self.layout.labels_path is None:  # y is x shifted by one: only its last column is new
                self._check_batch(y[:, -1:], ix, self.path, self.block_size)
            else:
                self._check_batch(y, ix, self.layout.labels_path, 1, labels=True)
        if self.pin:
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, strings and numbers only: any class or function reference (the
    way a pickle runs code) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain data is read")


def read_meta_pkl(path):
    """nanoGPT's meta.pkl (vocab_size, itos, stoi) read safely: a file that references any class or
    function (a crafted pickle that would run code) raises ValueError instead of being executed."""
    require_regular_file(path, PREPARE_AGAIN)
    try:
        with open(path, "rb") as f:
            meta = _PlainDataUnpickler(f).load()
    except PermissionError:
        raise permission_denied(path) from None
    except (ValueError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError) as e:
        raise ValueError(f"{path} is not a plain-data meta.pkl ({e}); it is not loaded because unpickling "
                         f"anything else can run code. Delete it and run that dataset's prepare.py again") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a {type(meta).__name__}, not the dict nanoGPT's prepare.py writes; "
                         f"run that dataset's prepare.py again")
    return meta


def _exists(path):
    # os.path.exists() says False when a folder on the way cannot be searched: the metadata would be
    # silently skipped (and the model built with GPT-2's vocabulary) instead of the real cause named.
    try:
        os.stat(path)
    except PermissionError:
        raise permission_denied(path) from None
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


# What load_meta and its callers read from the metadata, and what each must be. Absent optional
# fields are fine (a meta.json from before they were stored); keys not named here are not checked.
# A *_max_id of -1 is what prepare.py's max_id() writes for an empty split. vocab_size is bounded
# by the token files' uint16 ids: a larger one describes no file here, and a huge one would only
# fail later, allocating the embedding table.
MAX_VOCAB = 1 << 16
_FIELDS = {
    "vocab_size": (f"a positive integer, at most {MAX_VOCAB} (the token files hold uint16 ids)",
                   lambda v: _is_int(v) and 0 < v <= MAX_VOCAB),
    "tokenizer": ("a string ('gpt2' or 'char')", lambda v: isinstance(v, str)),
    "train_tokens": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "val_tokens": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "train_max_id": ("a non-negative integer (or -1 for an empty split)", lambda v: _is_int(v) and v >= -1),
    "val_max_id": ("a non-negative integer (or -1 for an empty split)", lambda v: _is_int(v) and v >= -1),
    "example_tokens": ("an integer of at least 2 (tokens per example: block_size is one less)",
                       lambda v: _is_int(v) and v >= 2),
    "labels": ("'answers' (the targets in {split}_labels.bin)", lambda v: v == "answers"),
    "text_labels": ("true or false (whether the text between the needles is labelled too)",
                    lambda v: isinstance(v, bool)),
    "value_ids": ("a pair [first, last] of token ids, first <= last (the needles' values)",
                  lambda v: isinstance(v, list) and len(v) == 2 and all(_is_int(i) for i in v) and 0 <= v[0] <= v[1]),
    "chars": ("a string (the vocabulary in id order) or a list of strings",
              lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(c, str) for c in v))),
}


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true/false load as bool, a subclass of int


def _shown(value):
    """A field's value as it reads in the file (JSON spelling: true, "65"), kept to one short line."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # meta.pkl can hold what JSON cannot (bytes, sets, int keys)
        try:
            text = repr(value)
        except ValueError:  # an int of more digits than Python converts to text
            text = f"(a {type(value).__name__} too long to show)"
    return text if len(text) <= 60 else text[:57] + "..."


def _check_fields(meta, path):
    """ValueError naming path, the field, its value and the fix for the first known field of the
    wrong type or range."""
    for field, (expected, ok) in _FIELDS.items():
        if field in meta and not ok(meta[field]):
            raise ValueError(f"{path}: {field} is {_shown(meta[field])}, but it must be {expected}; prepare the "
                             f"dataset again with its prepare.py, or correct {field} in that file")


def _read_meta_json(json_path):
    """meta.json as a dict whose known fields have their types: ValueError for a file that is not a
    JSON object or holds a wrong-typed field; OSError (FileNotFoundError, PermissionError) when it
    cannot be read."""
    meta = read_json(json_path, PREPARE_AGAIN)
    if not isinstance(meta, dict):
        raise ValueError(f"{json_path} holds a JSON {type(meta).__name__}, not an object; run that dataset's "
                         f"prepare.py again")
    _check_fields(meta, json_path)
    return meta


def load_meta(data_dir):
    """The dataset's metadata: meta.json (prepare.py here) if present, else nanoGPT's meta.pkl, else None.
    Always has 'vocab_size' (a positive int) and 'tokenizer' ('gpt2' or 'char'); char datasets also get
    'stoi'/'itos'. A field of the wrong type is a ValueError naming the file, the field and the fix."""
    json_path, pkl_path = os.path.join(data_dir, "meta.json"), os.path.join(data_dir, "meta.pkl")
    from_json = _exists(json_path)
    if from_json:  # meta.json wins: a meta.pkl beside it is never unpickled
        try:
            meta = _read_meta_json(json_path)
        except PermissionError:
            raise permission_denied(json_path) from None
    elif _exists(pkl_path):
        meta = read_meta_pkl(pkl_path)
        meta.setdefault("tokenizer", "char")  # nanoGPT writes meta.pkl only for its character-level datasets
        _check_fields(meta, pkl_path)
    else:
        return None
    missing = {"vocab_size", "tokenizer"} - set(meta)
    if missing:
        raise ValueError(f"the metadata in {data_dir} lacks {sorted(missing)}; run that dataset's prepare.py again")
    if from_json and meta["tokenizer"] == "char" and "chars" in meta:
        meta["stoi"] = {ch: i for i, ch in enumerate(meta["chars"])}
        meta["itos"] = dict(enumerate(meta["chars"]))
    return meta
