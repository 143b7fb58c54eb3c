"""
Answer accuracy on a recall dataset (data/mqar): over every validation example, the share of answer
labels (`{split}_labels.bin`) that the model's most likely next token gets right,
overall, by the example's number of key-value pairs (its count of answers: every key is asked once)
and by query distance (from the key in the pairs to its query, in tokens: both read off the
example itself, so no other file is needed).
"""
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


def validation_examples(model, data_dir, batch_size, split="val"):
    """Yields (x, y) int64 batches of whole examples of a recall dataset's split, in file order: what
    answer_accuracy and attention_noise walk. ValueError (before the first batch) when data_dir is not a
    dataset of examples with labelled answers (its meta.json says example_tokens and labels) or its
    examples do not fit the model."""
    layout = ExampleLayout(data_dir, split)
    path = f"{data_dir}/{split}.bin"
    if layout.example_tokens is None or layout.labels_path is None:
        raise ValueError(f"{data_dir} is not a recall dataset (its meta.json has no example_tokens and labels): "
                         f"answer accuracy needs examples with labelled answers, e.g. data/mqar/prepare.py's")
    num_tokens = np.memmap(path, dtype=np.uint16, mode="r").size
    length = layout.example_tokens - 1
    layout.check(path, num_tokens, length, model.config.vocab_size)
    if length > model.config.block_size:
        raise ValueError(f"{data_dir}'s examples are {length} tokens, longer than the model's block_size "
                         f"{model.config.block_size}")
    starts = np.arange(0, num_tokens, layout.example_tokens)

    def batches():
        for i in range(0, len(starts), batch_size):
            yield layout.rows(path, starts[i:i + batch_size], length)
    return len(starts), batches()


def answers(x_row, y_row):
    """[(p, key_at)] for one example (numpy rows): each position p whose target is an answer (x[p] is a
    query key) and where that key stands in the pairs. The example opens with its N pairs, N = its
    number of answers (every key is asked once), keys at the even positions 0 .. 2N - 2."""
    at = np.nonzero(y_row >= 0)[0]
    keys = x_row[0:2 * len(at):2]
    return [(int(p), 2 * int(np.argmax(keys == x_row[p]))) for p in at]


@torch.no_grad()
def answer_accuracy(model, data_dir, batch_size, device, ctx, split="val"):
    """dict(accuracy, answers, examples, by_pairs, by_distance); ValueError when data_dir is not a recall
    dataset (validation_examples)."""
    examples, batches = validation_examples(model, data_dir, batch_size, split)
    by_pairs, by_distance, right = {}, {}, 0
    for x, y in batches:
        with ctx:
            logits, _ = model(x.to(device), targets=y.to(device))
        hit = (logits.argmax(-1).cpu() == y).numpy()
        x, y = x.numpy(), y.numpy()
        for row in range(len(x)):
            asked = answers(x[row], y[row])
            for p, key_at in asked:
                _tally(by_pairs, len(asked), hit[row, p])
                _tally(by_distance, distance_bucket(p - key_at), hit[row, p])
                right += int(hit[row, p])
    total = sum(n for _, n in by_pairs.values())
    return dict(accuracy=right / total, answers=total, examples=examples,
                by_pairs={str(k): v for k, v in _accuracies(by_pairs, int).items()},
                by_distance=_accuracies(by_distance, lambda b: int(b.split("-")[0])))
