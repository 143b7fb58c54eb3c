"""
Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and improving recall in
efficient language models", arXiv:2312.04927): the synthetic task that tells attention mechanisms
apart at laptop scale. One example of seq_len + 1 tokens, for N key-value pairs:

    tokens  k1 v1 k2 v2 ... kN vN | . . kj .  . . . . ki .  . . ... .
    labels                                   vj             vi
            '--- 2N tokens ------'  '--- queries: every key once, its value the label of the query; . = filler

- keys are drawn without replacement from 1 .. V/2 - 1, values from V/2 .. V - 1 (disjoint halves of
  the vocabulary V; 0 is never a key or value);
- query j sits at an even offset 2 g_j after the pairs, with the slots g_j drawn without replacement
  from the power law P(g) ~ a g^(a - 1), g = 1 .. (seq_len - 2N) / 2 (a = power_a = 0.01 as in the
  paper: most queries come soon after the pairs, a few far away, like repeated bigrams in text);
- every other position holds a token drawn uniformly from the whole vocabulary (the paper's random
  non-query tokens), so nothing but recall predicts a value; or, with --filler zeros, token 0 (the
  paper's random_non_queries=False: then a key id in the input is always a pair or a query).
As in the paper, the value is only a label of the query position: the token after a query is filler,
so an example never shows an earlier query's answer (were it shown, a model could score H_N / N, 0.34
at 8 pairs, by guessing among the values not yet answered, without recalling anything).
`{split}_labels.bin` holds the targets (int32, aligned with the tokens as the next-token targets are:
the label at position i is the target of the prediction made at i - 1; -1 everywhere but the answers);
train.py and eval.py then score the model on those targets alone, and draw whole examples
(block_size = seq_len).

    python3 data/mqar/prepare.py          # the recall study's data: 2, 4 and 8 pairs, seq_len 32, vocab 64
    python3 data/mqar/prepare.py --num_kv_pairs 8 --seq_len 64 --vocab_size 256 --out_dir data/mqar64
    python3 data/mqar/prepare.py --num_kv_pairs 8 16 32 64 --seq_len 256 --vocab_size 8192 --out_dir data/mqar-paper

Writes train.bin / val.bin (uint16, examples one after another), train_labels.bin / val_labels.bin
(int32) and meta.json. Train and val come from separate seeds; each number of pairs has its own stream, so
adding one leaves the others' examples as they were.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # data/, for prepare_common
from prepare_common import (PrepareError, atomic_outputs, check_out_dir, choose_without_replacement, max_id,
                            run_examples_script, write_array, write_json)

from denoised_gpt.cli import human_bytes, ram_bytes  # (prepare_common put the repository on the path)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = dict(vocab_size=64, seq_len=32, train_examples=50000, val_examples=500)  # the recall study's data


def power_law(space, power_a):
    """P(slot g) for g = 0 .. space - 1, proportional to a (g + 1)^(a - 1): the paper's gap law."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def mqar_examples(num_examples, num_kv_pairs, seq_len, vocab_size, seed, power_a=0.01, filler="random"):
    """(tokens, labels): (num_examples, seq_len + 1) arrays, uint16 tokens and int32 labels (each answer
    one position after its query key, -1 elsewhere), from numpy's default generator seeded with
    (seed, num_kv_pairs): the same arguments give the same bytes. filler="zeros" writes token 0 (never a
    key or value) wherever "random" writes a random token, and leaves everything else the same."""
    check_shape(num_kv_pairs, seq_len, vocab_size)
    rng = np.random.default_rng([seed, num_kv_pairs])
    n, pairs, half = num_examples, num_kv_pairs, vocab_size // 2
    keys = 1 + choose_without_replacement(rng, n, half - 1, pairs)
    values = half + choose_without_replacement(rng, n, vocab_size - half, pairs)
    space = (seq_len - 2 * pairs) // 2
    slots = choose_without_replacement(rng, n, space, pairs, power_law(space, power_a))

    tokens = rng.integers(0, vocab_size, size=(n, seq_len + 1))  # the filler, overwritten below
    if filler == "zeros":
        tokens[:] = 0  # after the draw: the same keys, values and query slots as with random filler
    labels = np.full((n, seq_len + 1), -1, dtype=np.int32)
    tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = keys, values
    query_at = 2 * pairs + 2 * slots  # (n, pairs): where key j is asked for
    rows = np.arange(n)[:, None]
    tokens[rows, query_at] = keys
    labels[rows, query_at + 1] = values  # a label only: the token there stays filler
    return tokens.astype(np.uint16), labels


def check_shape(num_kv_pairs, seq_len, vocab_size):
    if not 1 <= vocab_size <= 1 << 16:
        raise PrepareError(f"--vocab_size {vocab_size} must be between 1 and 65536 (the token files hold uint16 ids)")
    if num_kv_pairs < 1:
        raise PrepareError(f"--num_kv_pairs {num_kv_pairs} must be at least 1")
    if seq_len % 2 or seq_len < 4 * num_kv_pairs:
        raise PrepareError(f"--seq_len {seq_len} must be even and at least 4 x num_kv_pairs = {4 * num_kv_pairs} "
                           f"(2N tokens of pairs, then N queries in at least as many two-token slots)")
    if vocab_size // 2 - 1 < num_kv_pairs:
        raise PrepareError(f"--vocab_size {vocab_size} has {vocab_size // 2 - 1} key ids (1 .. V/2 - 1), fewer than "
                           f"{num_kv_pairs} distinct keys per example; raise it to at least {2 * num_kv_pairs + 2}")


def memory_needed(train_examples, val_examples, num_kv_pairs, seq_len, vocab_size):
    """About the most bytes of arrays this script holds at once (2-20 % below the measured peak resident size
    beyond the interpreter's own, from 0.3 to 1 GB): the largest of a split being drawn (the examples so far,
    then the draw: its uniform numbers, scores and their argsort, 8 bytes each per candidate key, value or
    query slot, or its int64 tokens), its concatenation (every example twice), and the train rows' set that
    counts shared examples."""
    parts, example = len(num_kv_pairs), 6 * (seq_len + 1)  # an example: uint16 tokens and int32 labels
    half, slots = vocab_size // 2, max((seq_len - 2 * min(num_kv_pairs)) // 2, 1)

    def drawing(n):  # one split of n examples per number of pairs
        draws = n * max(24 * max(half, vocab_size - half), 32 * slots, 14 * (seq_len + 1))
        return max(example * n * (parts - 1) + draws, 2 * example * n * parts)
    train = example * train_examples * parts
    return max(drawing(train_examples), train + drawing(val_examples),
               train + example * val_examples * parts + (2 * (seq_len + 1) + 80) * train_examples * parts)


def check_memory(args):
    """PrepareError when the examples asked for need more memory than this machine has: one line naming the
    setting that, put back at its default, lowers the need most, and the memory needed."""
    sizes = {k: getattr(args, k) for k in DEFAULTS}
    need = memory_needed(num_kv_pairs=args.num_kv_pairs, **sizes)
    room = ram_bytes()
    if room is None or need <= room:
        return
    culprit = min((k for k in sizes if sizes[k] > DEFAULTS[k]), default="train_examples",
                  key=lambda k: memory_needed(num_kv_pairs=args.num_kv_pairs, **{**sizes, k: DEFAULTS[k]}))
    raise PrepareError(f"--{culprit} {sizes[culprit]:,} is too large: {len(args.num_kv_pairs)} x "
                       f"({args.train_examples:,} + {args.val_examples:,}) examples of {args.seq_len + 1:,} tokens "
                       f"over {args.vocab_size:,} ids would need about {human_bytes(need)} of memory to make, more "
                       f"than this machine's {human_bytes(room)}; choose a smaller --{culprit}")


def split(args, seed, per_pairs):
    """All the examples of one split, grouped by number of pairs in --num_kv_pairs order."""
    parts = [mqar_examples(per_pairs, pairs, args.seq_len, args.vocab_size, seed, args.power_a, args.filler)
             for pairs in args.num_kv_pairs]
    return np.concatenate([t for t, _ in parts]), np.concatenate([m for _, m in parts])


def shared_examples(train, val):
    """How many val examples also occur, token for token, in train."""
    seen = {row.tobytes() for row in train}
    return sum(row.tobytes() in seen for row in val)


def prepare(args):
    if args.train_examples < 1 or args.val_examples < 1:
        raise PrepareError("--train_examples and --val_examples must be at least 1")
    if not 0 < args.power_a < float("inf"):
        raise PrepareError(f"--power_a {args.power_a} must be a positive finite number (1 is uniform over the query "
                           f"slots)")
    if args.seed < 0 or args.val_seed < 0:
        raise PrepareError("--seed and --val_seed must be non-negative integers")
    if args.seed == args.val_seed:
        raise PrepareError("--seed and --val_seed must differ: validation examples are drawn from their own seed")
    if len(set(args.num_kv_pairs)) != len(args.num_kv_pairs):
        raise PrepareError(f"--num_kv_pairs {args.num_kv_pairs} repeats a value")
    for pairs in args.num_kv_pairs:
        check_shape(pairs, args.seq_len, args.vocab_size)
    check_memory(args)
    for pairs in args.num_kv_pairs:  # a large power_a overflows g^(a - 1): the weights are inf / inf
        with np.errstate(all="ignore"):
            weights = power_law((args.seq_len - 2 * pairs) // 2, args.power_a)
        if not np.isfinite(weights).all():
            raise PrepareError(f"--power_a {args.power_a} is too large for --seq_len {args.seq_len}: the query slots' "
                               f"weights g^(a - 1) overflow; choose a smaller one (1 is uniform)")
    check_out_dir(args.out_dir)

    try:
        train, train_labels = split(args, args.seed, args.train_examples)
        val, val_labels = split(args, args.val_seed, args.val_examples)
    except MemoryError as e:  # more than this machine has free now (check_memory: more than it has at all)
        raise PrepareError(f"cannot make the examples: {e}; ask for fewer (--train_examples, --val_examples) or "
                           f"shorter ones (--seq_len)") from None
    overlap = shared_examples(train, val)
    names = ["train.bin", "val.bin", "train_labels.bin", "val_labels.bin", "meta.json"]
    with atomic_outputs(args.out_dir, names) as tmp:
        for name, array in zip(names, (train, val, train_labels, val_labels)):
            write_array(tmp[name], array)
        write_json(tmp["meta.json"], {
            "tokenizer": "ids", "task": "mqar", "vocab_size": args.vocab_size,
            # what train.py and eval.py need: whole examples, and the loss on the labelled answers only
            "example_tokens": args.seq_len + 1, "labels": "answers",
            "seq_len": args.seq_len, "num_kv_pairs": args.num_kv_pairs, "power_a": args.power_a,
            "filler": args.filler,
            "train_examples": len(train), "val_examples": len(val), "val_examples_in_train": overlap,
            "seed": args.seed, "val_seed": args.val_seed,
            "train_tokens": train.size, "val_tokens": val.size,
            "train_max_id": max_id(train.ravel()), "val_max_id": max_id(val.ravel()),
            "source": "data/mqar/prepare.py"})
    print(f"MQAR, vocab {args.vocab_size}, seq_len {args.seq_len}, pairs {args.num_kv_pairs}: train {len(train):,} "
          f"examples, val {len(val):,} ({overlap} of them also in train); wrote {args.out_dir}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab_size", type=int, default=DEFAULTS["vocab_size"],
                   help="V: keys from 1 .. V/2 - 1, values from V/2 .. V - 1")
    p.add_argument("--seq_len", type=int, default=DEFAULTS["seq_len"],
                   help="tokens the model reads per example (train with block_size equal to it)")
    p.add_argument("--num_kv_pairs", type=int, nargs="+", default=[2, 4, 8],
                   help="key-value pairs per example; several values give a mix, each with the numbers of examples below")
    p.add_argument("--train_examples", type=int, default=DEFAULTS["train_examples"],
                   help="training examples per number of pairs")
    p.add_argument("--val_examples", type=int, default=DEFAULTS["val_examples"],
                   help="validation examples per number of pairs")
    p.add_argument("--power_a", type=float, default=0.01, help="the query slots' power law (the paper's 0.01)")
    p.add_argument("--filler", choices=["random", "zeros"], default="random",
                   help="what fills the positions that are neither pairs nor queries: uniformly random tokens "
                        "(the paper's random_non_queries=True) or token 0 (its False)")
    run_examples_script(p, argv, prepare, HERE)


if __name__ == "__main__":
    main()
