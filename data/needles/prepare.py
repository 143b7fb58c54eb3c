"""
Needles in a text haystack: the DIFF Transformer paper's key retrieval, where the distracting context is text
the model has to read. From any prepared text dataset (data/shakespeare_char, character level, or a GPT-2 BPE
one such as data/openwebtext), one example of seq_len + 1 tokens, for N needles:

    tokens  t t t k1 v1 t t t t k2 v2 t t ... t t | kj ki ... | t
    labels                                           vj vi ...
            '--- seq_len - N positions: seq_len - 3N text tokens with the N needles at random depths
                                                     '--- the N keys asked, in random order

- the text is one window of the split's own tokens (train.bin for train, val.bin for val), in order, the
  needles inserted between its tokens at depths drawn uniformly (two needles may stand side by side);
- keys and values are ids added after the text's vocabulary V: keys V .. V + K - 1 and values V + K ..
  V + K + M - 1, distinct within an example, so nothing in the text predicts them;
- every key is asked once at the end, its value the label of the query position (as in data/mqar: never
  shown as input, so an earlier answer gives nothing away); the last token, after the queries, is the text's
  next one and is never read;
- with --text_labels, every text token followed by a text token is labelled with it too: the model is then
  a language model of the haystack as well as a retriever.

Writes train.bin / val.bin (uint16), train_labels.bin / val_labels.bin (int32, -1 where nothing is scored),
train_needles.bin / val_needles.bin (int32: per example and needle, in depth order, the position of its key
and of its query) and meta.json. train.py trains on it with block_size = seq_len; eval.py --recall and
--attention_noise read it (docs/recall.md).

    python3 data/needles/prepare.py --text data/shakespeare_char
    python3 data/needles/prepare.py --text data/openwebtext --seq_len 1024 --num_needles 8 --out_dir data/needles-owt
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for prepare_common
from prepare_common import (PrepareError, atomic_outputs, check_out_dir, choose_without_replacement, max_id,
                            run_examples_script, write_array, write_json)

from denoised_gpt.batches import load_meta  # noqa: E402 (prepare_common put the repository on the path)
from denoised_gpt.cli import human_bytes, ram_bytes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BYTES_PER_TOKEN = 40  # arrays held per example token while a split is made: the mask, int64 tokens, labels, copies


def needle_examples(text, num_examples, seq_len, num_needles, text_vocab, key_ids, value_ids, seed,
                    text_labels=False):
    """(tokens uint16, labels int32, positions int32): (n, seq_len + 1), (n, seq_len + 1), (n, N, 2), from the
    uint16 token array `text` (module docstring), from numpy's default generator seeded with seed."""
    rng = np.random.default_rng(seed)
    n, N, T = num_examples, num_needles, seq_len
    H = T - 3 * N  # text tokens before the queries; one more stands after them
    windows = text[rng.integers(0, len(text) - H, size=n)[:, None] + np.arange(H + 1)]
    depth = np.sort(rng.integers(0, H + 1, size=(n, N)), axis=1)  # needle i goes before text token depth[i]
    keys = text_vocab + choose_without_replacement(rng, n, key_ids, N)
    values = text_vocab + key_ids + choose_without_replacement(rng, n, value_ids, N)
    asked = choose_without_replacement(rng, n, N, N)  # query slot s asks needle asked[s]

    rows = np.arange(n)[:, None]
    key_at = depth + 2 * np.arange(N)
    query_at = np.empty((n, N), dtype=np.int64)
    query_at[rows, asked] = T - N + np.arange(N)
    placed = np.zeros((n, T + 1), dtype=bool)
    for at in (key_at, key_at + 1, query_at):
        placed[rows, at] = True
    tokens = np.empty((n, T + 1), dtype=np.int64)
    tokens[~placed] = windows.ravel()  # H + 1 free positions a row, filled in order
    tokens[rows, key_at], tokens[rows, key_at + 1], tokens[rows, query_at] = keys, values, keys
    labels = np.full((n, T + 1), -1, dtype=np.int32)
    labels[rows, query_at + 1] = values
    if text_labels:
        haystack = ~placed
        haystack[:, T] = False  # the token after the queries is no part of it
        follows = haystack[:, :-1] & haystack[:, 1:]
        labels[:, 1:][follows] = tokens[:, 1:][follows]
    return tokens.astype(np.uint16), labels, np.stack([key_at, query_at], axis=-1).astype(np.int32)


def text_split(folder, split):
    """The uint16 tokens of folder/{split}.bin, mapped; PrepareError when it is missing or not a token file."""
    path = os.path.join(folder, f"{split}.bin")
    if not os.path.isfile(path):
        raise PrepareError(f"{path} not found: prepare that text first (e.g. data/shakespeare_char/prepare.py), "
                           f"or name a prepared text dataset with --text")
    if os.path.getsize(path) % 2:
        raise PrepareError(f"{path} has an odd size, so it is not a uint16 token file; prepare that text again")
    return np.memmap(path, dtype=np.uint16, mode="r")


def text_meta(folder):
    """The text dataset's vocabulary size and tokenizer; PrepareError for a folder that is no prepared text."""
    try:
        meta = load_meta(folder) if os.path.isdir(folder) else None
    except (OSError, ValueError) as e:
        raise PrepareError(f"--text {folder}: {e}") from None
    if meta is None:
        raise PrepareError(f"--text {folder} is not a prepared dataset (no meta.json or meta.pkl there); give a text "
                           f"prepared by data/<name>/prepare.py, e.g. data/shakespeare_char")
    if meta.get("example_tokens") is not None:
        raise PrepareError(f"--text {folder} is a dataset of examples ({meta.get('task', 'recall')}), not a text; "
                           f"give a text dataset, e.g. data/shakespeare_char")
    return meta["vocab_size"], meta["tokenizer"]


def check_settings(args, text_vocab):
    N, T = args.num_needles, args.seq_len
    if N < 1:
        raise PrepareError(f"--num_needles {N} must be at least 1")
    if T < 3 * N + 1:
        raise PrepareError(f"--seq_len {T} must be at least 3 x num_needles + 1 = {3 * N + 1} (each needle and its "
                           f"query take 3 positions, and one text token at least)")
    if args.key_ids < N or args.value_ids < N:
        raise PrepareError(f"--key_ids {args.key_ids} and --value_ids {args.value_ids} must each be at least "
                           f"num_needles = {N} (distinct keys and values in an example)")
    if text_vocab + args.key_ids + args.value_ids > 1 << 16:
        raise PrepareError(f"the text's {text_vocab:,} ids plus {args.key_ids} key and {args.value_ids} value ids "
                           f"exceed the 65,536 a uint16 token file holds; ask for fewer --key_ids / --value_ids")
    if args.train_examples < 1 or args.val_examples < 1:
        raise PrepareError("--train_examples and --val_examples must be at least 1")
    if args.seed < 0 or args.val_seed < 0:
        raise PrepareError("--seed and --val_seed must be non-negative integers")
    if args.seed == args.val_seed:
        raise PrepareError("--seed and --val_seed must differ: validation examples are drawn from their own seed")
    need = BYTES_PER_TOKEN * max(args.train_examples, args.val_examples) * (T + 1)
    room = ram_bytes()
    if room is not None and need > room:
        raise PrepareError(f"{max(args.train_examples, args.val_examples):,} examples of {T + 1:,} tokens would "
                           f"need about {human_bytes(need)} of memory to make, more than this machine's "
                           f"{human_bytes(room)}; ask for fewer (--train_examples, --val_examples) or shorter ones")


def prepare(args):
    text_vocab, tokenizer = text_meta(args.text)
    check_settings(args, text_vocab)
    if os.path.isdir(args.out_dir) and os.path.samefile(args.out_dir, args.text):
        raise PrepareError(f"--out_dir {args.out_dir} is the text's own folder: its train.bin and val.bin would be "
                           f"replaced; give another folder")
    check_out_dir(args.out_dir)
    H = args.seq_len - 3 * args.num_needles
    splits = {}
    for split, seed, n in (("train", args.seed, args.train_examples), ("val", args.val_seed, args.val_examples)):
        text = text_split(args.text, split)
        if len(text) < H + 1:
            raise PrepareError(f"{args.text}/{split}.bin holds {len(text):,} tokens, fewer than the {H + 1:,} an "
                               f"example reads; give a shorter --seq_len or more needles")
        splits[split] = needle_examples(text, n, args.seq_len, args.num_needles, text_vocab, args.key_ids,
                                        args.value_ids, seed, args.text_labels)
    names = ["train.bin", "val.bin", "train_labels.bin", "val_labels.bin", "train_needles.bin", "val_needles.bin",
             "meta.json"]
    (train, train_labels, train_at), (val, val_labels, val_at) = splits["train"], splits["val"]
    vocab_size = text_vocab + args.key_ids + args.value_ids
    with atomic_outputs(args.out_dir, names) as tmp:
        for name, array in zip(names, (train, val, train_labels, val_labels, train_at, val_at)):
            write_array(tmp[name], array)
        write_json(tmp["meta.json"], {
            "tokenizer": "ids", "task": "needles", "vocab_size": vocab_size,
            # what train.py and eval.py need: whole examples, and the loss on the labelled positions only
            "example_tokens": args.seq_len + 1, "labels": "answers", "text_labels": args.text_labels,
            "needles": "{split}_needles.bin: int32, per example and needle (in depth order) its key's position "
                       "and its query's",
            "seq_len": args.seq_len, "num_needles": args.num_needles, "text_tokens": H,
            "text": args.text, "text_tokenizer": tokenizer, "text_vocab_size": text_vocab,
            "key_ids": [text_vocab, text_vocab + args.key_ids - 1],
            "value_ids": [text_vocab + args.key_ids, vocab_size - 1],
            "train_examples": len(train), "val_examples": len(val), "seed": args.seed, "val_seed": args.val_seed,
            "train_tokens": train.size, "val_tokens": val.size,
            "train_max_id": max_id(train.ravel()), "val_max_id": max_id(val.ravel()),
            "source": "data/needles/prepare.py"})
    print(f"needles in {args.text} ({tokenizer}, {text_vocab:,} ids): {args.num_needles} needles in {H:,} text "
          f"tokens, then their {args.num_needles} queries (seq_len {args.seq_len}); keys {text_vocab}.."
          f"{text_vocab + args.key_ids - 1}, values {text_vocab + args.key_ids}..{vocab_size - 1}; labels on the "
          f"answers{' and the text' if args.text_labels else ''}; train {len(train):,} examples, val {len(val):,}; "
          f"wrote {args.out_dir}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=os.path.join(os.path.dirname(HERE), "shakespeare_char"),
                   help="a prepared text dataset's folder (train.bin, val.bin, meta.json) (default: %(default)s)")
    p.add_argument("--seq_len", type=int, default=256, help="tokens the model reads per example (train with "
                                                            "block_size equal to it)")
    p.add_argument("--num_needles", type=int, default=4, help="key-value needles per example, each asked once")
    p.add_argument("--key_ids", type=int, default=32, help="key ids added after the text's vocabulary")
    p.add_argument("--value_ids", type=int, default=32, help="value ids added after the key ids")
    p.add_argument("--text_labels", action="store_true",
                   help="label every text token followed by a text token with it too (a language model of the "
                        "haystack as well)")
    p.add_argument("--train_examples", type=int, default=20000, help="training examples")
    p.add_argument("--val_examples", type=int, default=500, help="validation examples")
    run_examples_script(p, argv, prepare, HERE)


if __name__ == "__main__":
    main()
