"""The recall testbed (MQAR, data/mqar/prepare.py): the generator against the task's definition, whole
examples with labelled answers in training batches, the loss on answers only for every attn_type,
eval.py's answer accuracy, and compare.py's sweep over a grid with its accuracy report."""
import itertools
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from denoised_gpt.batches import ExampleLayout, TokenBatches, TokenIdError
from denoised_gpt.compare_report import filler_lines, reading
from denoised_gpt.evaluation import exact_val_loss
from denoised_gpt.evaluation.recall import answer_accuracy, distance_bucket
from helpers import (NO_AUTOCAST, ROOT, SCRIPT_VARIABLES, TINY, eval_losses, iter_losses, run_script_in_process,
                     run_train, run_train_in_process, subprocess_env, tiny_checkpoint, tiny_gpt)
from model import ATTENTION_TYPES

sys.path.insert(0, str(ROOT / "data" / "mqar"))
from prepare import choose_without_replacement, mqar_examples, power_law  # noqa: E402

PREPARE = ROOT / "data" / "mqar" / "prepare.py"


def prepare(out_dir, *args):
    proc = subprocess.run([sys.executable, str(PREPARE), f"--out_dir={out_dir}", *map(str, args)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    return proc


def read_split(data_dir, split, example_tokens):
    """(tokens, labels, marks): int64 tokens and labels per example, and where the labels are answers."""
    tokens = np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16).reshape(-1, example_tokens)
    labels = np.fromfile(data_dir / f"{split}_labels.bin", dtype=np.int32).reshape(-1, example_tokens)
    return tokens.astype(np.int64), labels.astype(np.int64), labels >= 0


@pytest.fixture(scope='module')
def mqar(tmp_path_factory):
    """A mix of 2, 4 and 8 pairs at seq_len 32 over 64 token ids (the tiny model's context is 32)."""
    data = tmp_path_factory.mktemp('mqar') / 'data'
    proc = prepare(data, "--vocab_size=64", "--seq_len=32", "--num_kv_pairs", 2, 4, 8, "--train_examples=400",
                   "--val_examples=50", "--seed=3", "--val_seed=4")
    assert proc.returncode == 0, proc.stderr
    return data


# -----------------------------------------------------------------------------
# the generator

def test_examples_follow_the_definition(mqar):
    meta = json.loads((mqar / "meta.json").read_text())
    assert meta["example_tokens"] == 33 and meta["labels"] == "answers" and meta["vocab_size"] == 64
    assert meta["train_examples"] == 1200 and meta["val_examples"] == 150
    shown = 0
    for split in ("train", "val"):
        tokens, labels, mask = read_split(mqar, split, 33)
        for row, label, marks in zip(tokens, labels, mask):
            answers = np.nonzero(marks)[0]
            n = len(answers)
            assert n in (2, 4, 8)
            keys, values = row[0:2 * n:2], row[1:2 * n:2]
            assert len(set(keys)) == n, "keys are distinct within an example"
            assert ((1 <= keys) & (keys < 32)).all() and ((32 <= values) & (values < 64)).all()
            pairs = dict(zip(keys, values))
            assert (answers >= 2 * n + 1).all() and ((answers - 2 * n - 1) % 2 == 0).all()  # even query slots
            assert sorted(row[answers - 1]) == sorted(keys), "every key is asked exactly once"
            assert all(label[a] == pairs[row[a - 1]] for a in answers), "the answer is the queried key's value"
            shown += sum(row[a] == label[a] for a in answers)  # filler there: a value only by chance
        counts = [int(m.sum()) for m in mask]
        per = 400 if split == "train" else 50
        assert counts == [2] * per + [4] * per + [8] * per  # grouped in --num_kv_pairs order
    # the answers are labels, not inputs: the token after a query is uniform filler, which equals the
    # answer with probability 1/64: Binomial(6300, 1/64) has mean 98 and sd 9.8 (were the answers shown: 6300)
    assert shown < 150


def test_seeds_reproduce_bit_for_bit_and_train_and_val_are_disjoint(mqar, tmp_path):
    again = tmp_path / "again"
    assert prepare(again, "--vocab_size=64", "--seq_len=32", "--num_kv_pairs", 2, 4, 8, "--train_examples=400",
                   "--val_examples=50", "--seed=3", "--val_seed=4").returncode == 0
    for name in ("train.bin", "val.bin", "train_labels.bin", "val_labels.bin", "meta.json"):
        assert (again / name).read_bytes() == (mqar / name).read_bytes()
    train, _, _ = read_split(mqar, "train", 33)
    val, _, _ = read_split(mqar, "val", 33)
    assert not {r.tobytes() for r in val} & {r.tobytes() for r in train}
    assert json.loads((mqar / "meta.json").read_text())["val_examples_in_train"] == 0
    # another seed, other examples; each number of pairs draws from its own stream
    other, _ = mqar_examples(50, 4, 32, 64, seed=5)
    assert not np.array_equal(other, mqar_examples(50, 4, 32, 64, seed=4)[0])
    assert np.array_equal(mqar_examples(50, 4, 32, 64, seed=4)[0], val[50:100])


def test_zero_filler_keeps_the_examples_and_zeroes_the_rest(tmp_path):
    tokens, labels = mqar_examples(200, 4, 32, 64, seed=7)
    zeros, zero_labels = mqar_examples(200, 4, 32, 64, seed=7, filler="zeros")
    assert np.array_equal(labels, zero_labels)
    answers = labels >= 0
    kept = np.zeros_like(answers)
    kept[:, :8] = True  # the pairs
    kept[:, :-1] |= answers[:, 1:]  # the query keys, one position before their answers
    assert np.array_equal(zeros[kept], tokens[kept]) and (zeros[~kept] == 0).all()
    assert (zeros[kept] != 0).all(), "0 is never a key or value"
    assert prepare(tmp_path, "--filler=zeros", "--num_kv_pairs", 4, "--train_examples=20",
                   "--val_examples=5").returncode == 0
    assert json.loads((tmp_path / "meta.json").read_text())["filler"] == "zeros"


def test_query_slots_follow_the_power_law_drawn_without_replacement():
    """Each row keeps `size` distinct slots whose law is that of drawing one at a time in proportion to the
    weights left. Exact inclusion probabilities by enumerating the ordered draws, against 200k rows."""
    space, size, power_a = 5, 2, 0.3
    p = power_law(space, power_a)
    exact = np.zeros(space)
    for order in itertools.permutations(range(space), size):
        prob, left = 1.0, 1.0
        for slot in order:
            prob *= p[slot] / left
            left -= p[slot]
        exact[list(order)] += prob
    rows = choose_without_replacement(np.random.default_rng(0), 200_000, space, size, p)
    assert all(len(set(r)) == size for r in rows[:1000])
    seen = np.bincount(rows.ravel(), minlength=space) / len(rows)
    sd = np.sqrt(exact * (1 - exact) / len(rows))
    assert np.all(np.abs(seen - exact) < 5 * sd), (seen, exact)
    assert p[0] > p[1] > p[-1]  # most queries soon after the pairs


@pytest.mark.parametrize("args,message", [
    (["--seq_len=30", "--num_kv_pairs=8"], "at least 4 x num_kv_pairs = 32"),
    (["--vocab_size=16", "--num_kv_pairs=8"], "fewer than 8 distinct keys"),
    (["--seed=1", "--val_seed=1"], "must differ"),
    (["--num_kv_pairs", "4", "4"], "repeats a value"),
])
def test_bad_settings_are_one_line_and_write_nothing(tmp_path, args, message):
    proc = prepare(tmp_path / "out", *args)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--train_examples=100000000000"], r"--train_examples 100,000,000,000 is too large: 3 x \(100,000,000,000 \+ "
                                        r"500\) examples of 33 tokens over 64 ids would need about [\d.,]+ TiB of "
                                        r"memory to make, more than this machine's [\d.,]+ [GT]iB; choose a smaller "
                                        r"--train_examples"),
    (["--seq_len=99999999998", "--train_examples=10"], r"--seq_len 99,999,999,998 is too large: .* would need about "
                                                       r"[\d.,]+ PiB of memory"),
    (["--power_a=inf"], r"--power_a inf must be a positive finite number"),
    (["--power_a=1e300"], r"--power_a 1e\+300 is too large for --seq_len 32: the query slots' weights g\^\(a - 1\) "
                          r"overflow; choose a smaller one"),
])
def test_sizes_past_the_memory_and_an_overflowing_power_law_are_one_line(tmp_path, capsys, args, message):
    """Counts no machine holds: one line naming the setting and the memory the examples need, before any draw
    (numpy's MemoryError was a traceback). A power_a whose weights overflow (inf / inf) drew query slots from
    NaN weights without a word."""
    import prepare as mqar_prepare  # data/mqar/prepare.py (on sys.path above)
    with pytest.raises(SystemExit) as stop:
        mqar_prepare.main([f"--out_dir={tmp_path / 'out'}", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------
# batches and the loss on answers only

def test_batches_are_whole_examples_with_targets_only_at_answers(mqar):
    tokens, labels, _ = read_split(mqar, "train", 33)
    batches = TokenBatches(str(mqar), "train", 32, 16, seed=0, vocab_size=64)
    starts = {row[:32].tobytes(): i for i, row in enumerate(tokens)}
    for _ in range(5):
        x, y = batches.get_batch()
        for xr, yr in zip(x.numpy(), y.numpy()):
            i = starts[xr.tobytes()]  # every row is one example, from its first token
            assert np.array_equal(yr, labels[i, 1:])  # the answers, -1 elsewhere


def test_a_block_size_that_cuts_examples_is_refused(mqar):
    with pytest.raises(ValueError, match="set block_size=32 .now 31."):
        TokenBatches(str(mqar), "train", 31, 4, vocab_size=64)


def test_labels_from_another_preparation_are_refused(mqar, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "val.bin", "val_labels.bin", "meta.json"):
        (data / name).write_bytes((mqar / name).read_bytes())
    (data / "train_labels.bin").write_bytes((mqar / "train_labels.bin").read_bytes()[:-4 * 33])
    with pytest.raises(ValueError, match="train_labels.bin has 158268 bytes but .* has 39600 tokens"):
        TokenBatches(str(data), "train", 32, 4, vocab_size=64)


def copy_of(mqar, data):
    data.mkdir()
    for name in ("train.bin", "val.bin", "train_labels.bin", "val_labels.bin", "meta.json"):
        (data / name).write_bytes((mqar / name).read_bytes())
    return data


def set_label(path, at, value):
    labels = np.fromfile(path, dtype=np.int32)
    labels[at] = value
    labels.tofile(path)


@pytest.mark.parametrize("value", [-2, 64, 2 ** 31 - 1])
def test_a_label_outside_minus_one_to_vocab_size_is_refused_at_load_in_one_line(mqar, tmp_path, value):
    """Labels are checked as the tokens are: -2 was an IndexError mid-run in train.py, any of them an
    IndexError in eval.py's validation pass."""
    data = copy_of(mqar, tmp_path / "data")
    set_label(data / "train_labels.bin", 34, value)  # the second example's first target: after a training batch
    message = (f"holds label {value} at position 34, but a label is -1 (not scored) or a token id below vocab_size 64: "
               f"the file is damaged or from another preparation; run that dataset's prepare.py again")
    proc = run_script_in_process("train.py", [TINY, f"--dataset={data}", f"--out_dir={tmp_path / 'out'}"])
    assert proc.returncode == 2 and proc.stderr.strip() == f"train.py: error: {data / 'train_labels.bin'} {message}"
    assert not (tmp_path / "out").exists()
    set_label(data / "train_labels.bin", 34, int(np.fromfile(mqar / "train_labels.bin", dtype=np.int32)[34]))
    set_label(data / "val_labels.bin", 34, value)
    out = tmp_path / "trained"
    tiny_checkpoint(out, "base", data, vocab_size=64)
    for measure in ("--val_loss=True", "--recall=True", "--attention_noise=True"):
        proc = run_script_in_process("eval.py", [f"--out_dir={out}", measure, "--device=cpu"])
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"eval.py: error: {data / 'val_labels.bin'} {message}"
    assert not [p for p in out.iterdir() if p.suffix == ".json"]


def test_a_labels_file_that_scores_nothing_is_refused_at_load_in_one_line(mqar, tmp_path):
    """Every label -1: the loss was 0 on every step and the evaluation NaN, which the run blamed on the learning
    rate. Nothing to learn: refused before training, naming the file."""
    data = copy_of(mqar, tmp_path / "data")
    np.full(len(np.fromfile(data / "train_labels.bin", dtype=np.int32)), -1, dtype=np.int32).tofile(
        data / "train_labels.bin")
    proc = run_script_in_process("train.py", [TINY, f"--dataset={data}", f"--out_dir={tmp_path / 'out'}"])
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"train.py: error: {data / 'train_labels.bin'} scores no position (every label is -1, not scored): there is "
        f"nothing to learn or evaluate; the file is damaged or from another preparation: run that dataset's "
        f"prepare.py again"), proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_label_file_changed_after_load_is_caught_by_the_batch_that_holds_it(mqar, tmp_path, monkeypatch):
    monkeypatch.setattr("denoised_gpt.batches.FULL_SCAN_TOKENS", 0)  # every file counts as large: read by batches
    data = copy_of(mqar, tmp_path / "data")
    tb = TokenBatches(str(data), "train", 32, 16, seed=0, vocab_size=64)
    tb.get_batch()
    np.full(39600, -2, dtype=np.int32).tofile(data / "train_labels.bin")
    with pytest.raises(TokenIdError, match=r"train_labels.bin holds label -2 at position \d+, but a label "
                                                   r"is -1 \(not scored\) or a token id below vocab_size 64"):
        tb.get_batch()


def test_data_from_the_earlier_generator_is_refused(mqar, tmp_path):
    """Its examples showed each answer after its query: it is refused with the fix, not trained on."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.bin", "val.bin"):
        (data / name).write_bytes((mqar / name).read_bytes())
    meta = json.loads((mqar / "meta.json").read_text())
    del meta["labels"]
    (data / "meta.json").write_text(json.dumps({**meta, "target_mask": "answers"}))
    with pytest.raises(ValueError, match="earlier data/mqar/prepare.py.*run prepare.py again"):
        TokenBatches(str(data), "train", 32, 4, vocab_size=64)


@pytest.mark.parametrize("attn_type", list(ATTENTION_TYPES))
def test_the_loss_is_cross_entropy_over_the_answers_only(mqar, attn_type):
    """train.py's loss (the fused lm_head + cross-entropy) and the evaluation's (logits, then F.cross_entropy)
    on a labelled batch, against log-softmax at the answer positions computed here."""
    model = tiny_gpt(attn_type, vocab_size=64, lowrank_rank=4)
    x, y = TokenBatches(str(mqar), "train", 32, 8, seed=1, vocab_size=64).get_batch()
    torch.manual_seed(7)
    _, fused = model(x, y, return_logits=False)
    torch.manual_seed(7)  # NoiseFormer: the same noise draw for every computation
    logits, loss = model(x, y)
    answers = y >= 0
    direct = -torch.log_softmax(logits.double(), -1)[answers].gather(-1, y[answers][:, None]).mean()
    assert answers.sum() == sum(int(m) for m in (y >= 0).sum(1))  # only the answers are targets
    assert 0 < answers.sum() < y.numel() / 4
    torch.testing.assert_close(loss.double(), direct, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.double(), direct, rtol=1e-5, atol=1e-6)
    fused.backward()  # and it trains: the gradient reaches the embeddings
    assert model.transformer.wte.weight.grad.abs().sum() > 0


# -----------------------------------------------------------------------------
# eval.py: accuracy and the exact val loss over the answers

class Oracle(torch.nn.Module):
    """Knows the answer to every query except those of examples with `wrong_pairs` pairs: stands in for
    a trained model, so that the expected accuracies are known exactly."""

    def __init__(self, vocab_size, wrong_pairs):
        super().__init__()
        self.config = type("Config", (), {"block_size": 32, "vocab_size": vocab_size})
        self.vocab_size, self.wrong_pairs = vocab_size, wrong_pairs

    def forward(self, x, targets):
        logits = torch.zeros(*x.shape, self.vocab_size)
        for b in range(len(x)):
            pairs = int((targets[b] >= 0).sum())
            for p in torch.nonzero(targets[b] >= 0).ravel():
                answer = targets[b, p] if pairs != self.wrong_pairs else 0
                logits[b, p, answer] = 1.0
        return logits, None


def test_answer_accuracy_by_pairs_and_distance(mqar):
    r = answer_accuracy(Oracle(64, wrong_pairs=4), str(mqar), 7, "cpu", NO_AUTOCAST)
    assert r["examples"] == 150 and r["answers"] == 50 * (2 + 4 + 8)
    assert {k: (v["accuracy"], v["answers"]) for k, v in r["by_pairs"].items()} == {
        "2": (1.0, 100), "4": (0.0, 200), "8": (1.0, 400)}
    assert r["accuracy"] == pytest.approx(500 / 700)
    # distances from the generator's layout: key j at 2j, its query at an even offset after the 2N pair tokens
    tokens, _, mask = read_split(mqar, "val", 33)
    expected = {}
    for row, marks in zip(tokens, mask):
        n = int(marks.sum())
        for a in np.nonzero(marks)[0]:
            j = list(row[0:2 * n:2]).index(row[a - 1])
            bucket = distance_bucket(a - 1 - 2 * j)
            expected[bucket] = expected.get(bucket, 0) + 1
    assert {k: v["answers"] for k, v in r["by_distance"].items()} == expected
    assert [distance_bucket(d) for d in (1, 2, 3, 4, 7, 8, 31, 32)] == ["1", "2-3", "2-3", "4-7", "4-7", "8-15",
                                                                       "16-31", "32-63"]


def test_exact_val_loss_scores_each_answer_once(mqar):
    model = tiny_gpt("base", vocab_size=64).eval()
    tokens, labels, mask = read_split(mqar, "val", 33)
    r = exact_val_loss(model, str(mqar / "val.bin"), 32, 9, "cpu", NO_AUTOCAST, ExampleLayout(str(mqar), "val"))
    x = torch.from_numpy(tokens[:, :-1])
    y = torch.from_numpy(labels[:, 1:])
    with torch.no_grad():
        logits, _ = model(x, y)
    direct = F.cross_entropy(logits.double().reshape(-1, 64), y.reshape(-1), ignore_index=-1)
    assert r["tokens"] == int(mask.sum()) == 700 and r["windows"] == 150
    assert r["loss"] == pytest.approx(float(direct), rel=1e-5)


# -----------------------------------------------------------------------------
# train.py, eval.py and compare.py on the dataset

def test_train_then_eval_recall(mqar, tmp_path):
    out = tmp_path / "out"
    proc = run_script_in_process("train.py", [TINY, f"--dataset={mqar}", f"--out_dir={out}", "--max_iters=4",
                                              "--eval_interval=4"])
    assert proc.returncode == 0, proc.stderr
    # its last line points at what works on token ids: eval.py's recall, not sample.py
    assert proc.stdout.strip().splitlines()[-1].startswith(f"score its answers with: python3 eval.py --out_dir={out} "
                                                            "--recall=True")
    wrong = run_script_in_process("train.py", [TINY, f"--dataset={mqar}", f"--out_dir={tmp_path / 'no'}",
                                               "--block_size=24"])
    assert wrong.returncode == 2 and "set block_size=32 (now 24)" in wrong.stderr
    assert not (tmp_path / "no").exists()
    proc = run_script_in_process("eval.py", [f"--out_dir={out}", "--recall=True", "--val_loss=True",
                                             "--dtype=float32"])
    assert proc.returncode == 0, proc.stderr
    recall = json.loads((out / "recall.json").read_text())
    val = json.loads((out / "val_loss.json").read_text())
    assert recall["answers"] == val["tokens"] == 700
    assert f"answer accuracy {recall['accuracy']:.4f} over 700 answers of 150 validation examples" in proc.stdout
    assert "by key-value pairs N (a guess among the example's N values scores 1/N): 2: " in proc.stdout
    sample = run_script_in_process("sample.py", [f"--out_dir={out}", "--max_new_tokens=2"])
    assert sample.returncode == 2 and "holds token ids with no text (mqar)" in sample.stderr
    # a dataset without marked answers has no accuracy to give
    plain = run_script_in_process("eval.py", [f"--out_dir={out}", "--recall=True", f"--dataset={ROOT / 'tests'}"])
    assert plain.returncode != 0


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process_on_labelled_examples(mqar, tmp_path):
    """Each rank draws its micro-batches of whole examples and takes their labels as one process does."""
    args = ['--attn_type=diff', '--gradient_accumulation_steps=2', '--max_iters=4', '--eval_interval=4',
            '--eval_iters=2', '--warmup_iters=1', '--lr_decay_iters=4']
    one = run_train_in_process(tmp_path / 'one', mqar, *args)
    two = run_train(tmp_path / 'two', mqar, *args, nproc=2)
    assert '2 process(es)' in two.stdout
    l1, l2 = iter_losses(one.stdout), iter_losses(two.stdout)
    assert sorted(l1) == sorted(l2) == [0, 1, 2, 3]
    assert all(abs(l1[it] - l2[it]) < 1e-5 for it in l1), (l1, l2)
    assert abs(eval_losses(one.stdout)[4] - eval_losses(two.stdout)[4]) < 1e-5


@pytest.mark.slow
def test_compare_sweeps_a_grid_and_reports_accuracy(mqar, tmp_path):
    """Two widths x two variants, two runs at a time: each run trained at its grid point, the accuracy
    and attention-share tables and their paired readings read from each run's recall.json and
    attention_noise.json."""
    out = tmp_path / "sweep"
    # (eval_answers_only: every label of MQAR is an answer already; the report says what its val loss is)
    overrides = f"--dataset={mqar} --max_iters=6 --lr_decay_iters=6 --eval_interval=3 --eval_iters=2 " \
                "--eval_answers_only=True"
    # compare.py in this process (its train.py and eval.py runs are processes all the same)
    args = [f"--base_config={TINY}", f"--overrides={overrides}", "--attn_types=base,linear", "--seeds=1",
            "--grid=--n_embd=16,--n_embd=32", "--samples=False", "--jobs=2", f"--out_dir={out}"]
    proc = run_script_in_process("compare.py", args, env=SCRIPT_VARIABLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "report" / "results.json").read_text())
    report = (out / "report" / "report.md").read_text()
    assert sorted(r["variant"] for r in results["runs"]) == sorted(
        [f"{a} n_embd={w}" for a in ("base", "linear") for w in (16, 32)])
    for r in results["runs"]:
        run_dir = out / "runs" / f"{r['attn_type']}-n_embd{r['variant'].split('=')[1]}-seed{r['seed']}"
        recall = json.loads((run_dir / "recall.json").read_text())
        assert r["accuracy"] == recall["accuracy"]
        assert r["accuracy_by_pairs"] == {k: v["accuracy"] for k, v in recall["by_pairs"].items()}
        shares = json.loads((run_dir / "attention_noise.json").read_text())
        lookup, layer = shares["lookup"], shares["reading_layer"]
        parts = ("value", "key", "signed_value", "signed_key", "answer", "signed_answer", "noise", "pairs", "own",
                 "queries", "filler")
        assert [r[f"{part}_share"] for part in parts] == [lookup[part] for part in parts]
        assert r["lookup_head"] == f"L{lookup['layer']}h{lookup['head']}"
        assert [r[f"layer_{part}_share"] for part in parts] == [layer[part] for part in parts]
        assert r["reading_layer"] == f"L{layer['layer']}"
        after = shares["by_offset"]["+2"]  # the token after the value
        assert (r["after_share"], r["layer_after_share"]) == (after["heads"][lookup["layer"]][lookup["head"]],
                                                              after["layers"][layer["layer"]])
        # 2, 4 and 8 pairs at seq_len 32, 50 examples each: 26, 20 and 8 filler tokens, weighted by answers
        assert r["filler_length"] == pytest.approx((2 * 26 + 4 * 20 + 8 * 8) / 14)
        ckpt = torch.load(run_dir / "ckpt.pt", map_location="cpu", weights_only=False)
        assert ckpt["model_args"]["n_embd"] == int(r["variant"].split("=")[1])
    summary = results["summary"]
    for width in (16, 32):
        linear, base = summary[f"linear n_embd={width}"], summary[f"base n_embd={width}"]
        assert linear["base"] == f"base n_embd={width}"
        mine = {r["seed"]: r["accuracy"] for r in results["runs"] if r["variant"] == f"linear n_embd={width}"}
        theirs = {r["seed"]: r["accuracy"] for r in results["runs"] if r["variant"] == f"base n_embd={width}"}
        assert linear["accuracy_vs_base"]["differences"] == [mine[1] - theirs[1]]
        for key in ("signed_value_share", "signed_answer_share", "noise_share", "layer_signed_value_share",
                    "layer_signed_answer_share", "layer_noise_share"):
            shares = {r["variant"]: r[key] for r in results["runs"]}
            assert linear[f"{key}_vs_base"]["differences"] == \
                [shares[f"linear n_embd={width}"] - shares[f"base n_embd={width}"]], key
        assert base["accuracy"]["values"] == [theirs[1]]
        line = next(line for line in report.splitlines() if line.startswith(f"| `linear n_embd={width}` | 0."))
        assert f"| {mine[1]:.3f} | {mine[1]:.3f} | " in line
    assert "the same fixed batches for every run; over the answers alone, eval_answers_only)" in report
    assert "## Answer accuracy (recall)" in report and (out / "report" / "accuracy.png").stat().st_size > 0
    assert "## Where attention goes" in report and (out / "report" / "attention.png").stat().st_size > 0
    # two widths on the same data (one filler length): a line per width, never their average
    assert sorted(filler_lines(results["runs"])) == sorted(summary)
    one_width = [r for r in results["runs"] if r["variant"].endswith("n_embd=16")]
    assert sorted(filler_lines(one_width)) == ["base", "linear"]
    head_row, layer_row = [line for line in report.splitlines() if line.startswith("| `linear n_embd=16` | 14")]
    s = summary['linear n_embd=16']
    for row, prefix in ((head_row, ''), (layer_row, 'layer_')):
        assert (f"| {s[f'{prefix}answer_share']['mean']:.3f} ({s[f'{prefix}signed_answer_share']['mean']:.3f}) | "
                f"{s[f'{prefix}value_share']['mean']:.3f} ({s[f'{prefix}signed_value_share']['mean']:.3f}) | "
                f"{s[f'{prefix}key_share']['mean']:.3f} ({s[f'{prefix}signed_key_share']['mean']:.3f}) | "
                f"{s[f'{prefix}after_share']['mean']:.3f} |") in row
        assert row.endswith(f"| {reading(s[f'{prefix}signed_value_share_vs_base'])} | "
                            f"{reading(s[f'{prefix}noise_share_vs_base'])} |")

    # an attention_noise.json without the own token's share is an older eval.py's: measured again
    path = out / "runs" / "base-n_embd16-seed1" / "attention_noise.json"
    kept = json.loads(path.read_text())
    older = {part: kept["reading_layer"][part] for part in ("layer", "answer", "pairs")}
    path.write_text(json.dumps({k: v for k, v in kept.items() if k != "reading_layer"} | {"reading_layer": older}))
    proc = run_script_in_process("compare.py", args + ["--report_only=True"], env=SCRIPT_VARIABLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(path.read_text())["reading_layer"] == kept["reading_layer"]
    # and one without by_offset (the token after the value)
    path.write_text(json.dumps({k: v for k, v in kept.items() if k != "by_offset"}))
    proc = run_script_in_process("compare.py", args + ["--report_only=True"], env=SCRIPT_VARIABLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(path.read_text())["by_offset"] == kept["by_offset"]

    # a recall.json that does not say its dtype is an older eval.py's (bfloat16 on a float32-trained run):
    # measured again, though newer than the checkpoint
    path = out / "runs" / "linear-n_embd16-seed1" / "recall.json"
    kept = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in kept.items() if k != "dtype"} | {"accuracy": -1.0}))
    proc = run_script_in_process("compare.py", args + ["--report_only=True"], env=SCRIPT_VARIABLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(path.read_text()) == kept


def test_eval_on_a_recall_dataset_without_its_labels_is_one_line(mqar, tmp_path):
    """val_labels.bin gone (a copy made by hand, an interrupted transfer): every measure that reads the answers
    says which file is missing and how to get it, not a traceback."""
    import shutil
    data = tmp_path / 'data'
    shutil.copytree(mqar, data)
    tiny_checkpoint(tmp_path / 'out', 'base', data, block_size=32, vocab_size=64)
    (data / 'val_labels.bin').unlink()
    for measure in ('--recall=True', '--val_loss=True', '--attention_noise=True'):
        proc = run_script_in_process("eval.py", [f"--out_dir={tmp_path / 'out'}", measure, '--device=cpu'])
        assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"eval.py: error: {data / 'val_labels.bin'} not found: {data}'s meta.json marks labelled answers")
