"""
Answer accuracy on a recall dataset (data/mqar): over every validation example, the share of answer
labels (`{split}_labels.bin`) that the model's most likely next token gets right,
overall, by the example's number of key-value pairs (its count of answers: every key is asked once)
and by query distance (from the key in the pairs to its query, in tokens). Where each key and its query
stand is read off an MQAR example itself; a needle dataset (data/needles), whose needles stand at random
depths in a text (its meta.json's task "needles"), says it in `{split}_needles.bin`.
"""
import os

import numpy as np
import torch

from denoised_gpt.batches import ExampleLayout


def distance_bucket(d):
    """Powers of two: '1', '2-3', '4-7', '8-15', ..."""
    low = 1 << (int(d).bit_length() - 1)
    return str(low) if low == 1 else f"{low}-{2 * low - 1}"


def _tally(table, key, correct):
    entry = table.setdefault(key, [0, 0])
    entry[0] += int(correct)
    entry[1] += 1


def _accuracies(table, order):
    return {k: {"accuracy": table[k][0] / table[k][1], "answers": table[k][1]} for k in sorted(table, key=order)}


def check_recall_dataset(data_dir, split="val"):
    """The split's ExampleLayout; ValueError, one whole sentence with the fix, when data_dir holds no examples
    with labelled answers (a text, say)."""
    layout = ExampleLayout(data_dir, split)
    if layout.example_tokens is None or layout.labels_path is None:
        raise ValueError(f"{data_dir} is not a recall dataset (its meta.json has no example_tokens and labels), so "
                         f"--recall and --attention_noise have no answers to read: give a dataset of data/mqar/"
                         f"prepare.py or data/needles/prepare.py (needles in a text), or probe a model trained on "
                         f"text with --retrieval=True")
    return layout


def validation_examples(model, data_dir, batch_size, split="val"):
    """-> (number of examples, batches): (x, y, asked) of whole examples of a recall dataset's split, in file
    order, x and y int64, asked per row the [(p, key_at)] of `answers`: what answer_accuracy and
    attention_noise walk. ValueError (before the first batch) when data_dir is not a
    dataset of examples with labelled answers (its meta.json says example_tokens and labels) or its
    examples do not fit the model."""
    layout = check_recall_dataset(data_dir, split)
    path = f"{data_dir}/{split}.bin"
    num_tokens = np.memmap(path, dtype=np.uint16, mode="r").size
    length = layout.example_tokens - 1
    layout.check(path, num_tokens, length, model.config.vocab_size)
    if length > model.config.block_size:
        raise ValueError(f"{data_dir}'s examples are {length} tokens, longer than the model's block_size "
                         f"{model.config.block_size}")
    starts = np.arange(0, num_tokens, layout.example_tokens)
    placed = needle_positions(data_dir, split, len(starts), length)

    def batches():
        for i in range(0, len(starts), batch_size):
            x, y = layout.rows(path, starts[i:i + batch_size], length)
            rows = [None] * len(x) if placed is None else placed[i:i + batch_size]
            yield x, y, [answers(*r) for r in zip(x.numpy(), y.numpy(), rows)]
    return len(starts), batches()


def dataset_task(data_dir):
    """'needles' for a needle dataset (data/needles), 'mqar' for any other recall dataset."""
    return "needles" if ExampleLayout(data_dir, "val").task == "needles" else "mqar"


def needle_positions(data_dir, split, examples, length):
    """A needle dataset's (examples, N, 2) int32 positions of each needle's key and of its query, from
    {split}_needles.bin; None for a dataset without it (MQAR). ValueError when the file does not fit examples
    of `length` tokens."""
    if dataset_task(data_dir) != "needles":
        return None
    path = os.path.join(data_dir, f"{split}_needles.bin")
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found (the needles' positions): run data/needles/prepare.py again")
    placed = np.fromfile(path, dtype=np.int32)
    if examples == 0 or placed.size % (2 * examples):
        raise ValueError(f"{path} holds {placed.size} positions, not 2 per needle of {examples} examples: the files "
                         f"are from different preparations; run data/needles/prepare.py again")
    placed = placed.reshape(examples, -1, 2)
    if placed.size and (placed.min() < 0 or placed[..., 0].max() + 1 >= length or placed[..., 1].max() >= length):
        raise ValueError(f"{path} places a needle or query outside the examples' {length} tokens: it is from another "
                         f"preparation; run data/needles/prepare.py again")
    return placed


def answers(x_row, y_row, placed=None):
    """[(p, key_at)] for one example (numpy rows): each query position p (x[p] is a query key, its target the
    answer) and where that key stands, in the order of p. With placed (N, 2), a needle dataset's positions of
    each needle's key and its query. Otherwise an MQAR example: it opens with its N pairs, N = its number of
    answers (every key is asked once), keys at the even positions 0 .. 2N - 2."""
    if placed is not None:
        return sorted((int(p), int(key_at)) for key_at, p in placed)
    at = np.nonzero(y_row >= 0)[0]
    keys = x_row[0:2 * len(at):2]
    return [(int(p), 2 * int(np.argmax(keys == x_row[p]))) for p in at]


@torch.no_grad()
def answer_accuracy(model, data_dir, batch_size, device, ctx, split="val"):
    """dict(accuracy, answers, examples, by_pairs, by_distance); ValueError when data_dir is not a recall
    dataset (validation_examples)."""
    examples, batches = validation_examples(model, data_dir, batch_size, split)
    by_pairs, by_distance, right = {}, {}, 0
    for x, y, found in batches:
        with ctx:
            logits, _ = model(x.to(device), targets=y.to(device))
        hit = (logits.argmax(-1).cpu() == y).numpy()
        for row, asked in enumerate(found):
            for p, key_at in asked:
                _tally(by_pairs, len(asked), hit[row, p])
                _tally(by_distance, distance_bucket(p - key_at), hit[row, p])
                right += int(hit[row, p])
    total = sum(n for _, n in by_pairs.values())
    return dict(accuracy=right / total, answers=total, examples=examples,
                by_pairs={str(k): v for k, v in _accuracies(by_pairs, int).items()},
                by_distance=_accuracies(by_distance, lambda b: int(b.split("-")[0])))
