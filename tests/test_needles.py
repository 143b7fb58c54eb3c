"""data/needles/prepare.py: needles at random depths in a window of a text's own split, their keys asked at the end,
every position and label checked against the meta; its bad inputs are one line; eval.py --attention_noise reads
it with the parts answer value / answer key / other needles / own token / earlier queries / text, against an
explicit float64 loop, and eval.py --recall scores the queries alone."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from denoised_gpt.batches import TokenBatches
from denoised_gpt.evaluation.attention_noise import PARTS, attention_noise
from denoised_gpt.evaluation.recall import answer_accuracy
from helpers import (NO_AUTOCAST, SCRIPT_VARIABLES, TINY, eval_losses, run_script_in_process, run_train_in_process,
                     tiny_checkpoint)
from naive_attention import naive_part_shares
from test_attention_noise import peaked_model

# loaded under its own name: data/mqar's script is the `prepare` module of test_recall.py
_spec = importlib.util.spec_from_file_location('needles_prepare',
                                               Path(__file__).resolve().parents[1] / 'data' / 'needles' / 'prepare.py')
_needles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_needles)
prepare_needles = _needles.main

V, K, M = 20, 16, 16  # the text's ids, then key and value ids: 52 ids, within the tiny models' 64
T, N = 12, 2  # 6 text tokens an example


def write_text(folder, seed=0):
    """A char-level text dataset: train.bin and val.bin of different ids, so a window says which split it is."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    splits = {'train': rng.integers(0, 10, size=300), 'val': rng.integers(10, V, size=60)}
    for split, ids in splits.items():
        ids.astype(np.uint16).tofile(folder / f'{split}.bin')
    (folder / 'meta.json').write_text(json.dumps({'tokenizer': 'char', 'vocab_size': V}))
    return {split: ids.tolist() for split, ids in splits.items()}


def prepare(tmp_path, *extra, T=T, N=N, examples=40):
    text = write_text(tmp_path / 'text')
    prepare_needles(['--text', str(tmp_path / 'text'), '--out_dir', str(tmp_path / 'needles'), '--seq_len', str(T),
                     '--num_needles', str(N), '--key_ids', str(K), '--value_ids', str(M), '--train_examples',
                     str(examples), '--val_examples', str(examples), *extra])
    return text, tmp_path / 'needles'


def read(folder, split, T=T, N=N):
    tokens = np.fromfile(folder / f'{split}.bin', dtype=np.uint16).reshape(-1, T + 1)
    labels = np.fromfile(folder / f'{split}_labels.bin', dtype=np.int32).reshape(-1, T + 1)
    placed = np.fromfile(folder / f'{split}_needles.bin', dtype=np.int32).reshape(len(tokens), N, 2)
    return tokens, labels, placed


@pytest.mark.parametrize('text_labels', [False, True])
def test_needles_and_queries_stand_where_the_meta_says_in_a_window_of_the_split(tmp_path, text_labels):
    text, folder = prepare(tmp_path, *(['--text_labels'] if text_labels else []), T=16, N=3)
    meta = json.loads((folder / 'meta.json').read_text())
    assert meta['task'] == 'needles' and meta['vocab_size'] == V + K + M and meta['example_tokens'] == 17
    assert meta['key_ids'] == [V, V + K - 1] and meta['value_ids'] == [V + K, V + K + M - 1]
    depths = set()
    for split in ('train', 'val'):
        tokens, labels, placed = read(folder, split, T=16, N=3)
        for row, label, needles in zip(tokens.tolist(), labels.tolist(), placed.tolist()):
            key_at, query_at = zip(*needles)
            # each needle: a key, then its value; its key asked once, at the end, the value the query's label
            assert list(key_at) == sorted(key_at) and sorted(query_at) == [13, 14, 15]
            keys, values = [row[k] for k in key_at], [row[k + 1] for k in key_at]
            assert all(V <= k < V + K for k in keys) and all(V + K <= v < V + K + M for v in values)
            assert len(set(keys)) == len(set(values)) == 3
            assert [row[q] for q in query_at] == keys and [label[q + 1] for q in query_at] == values
            depths.update(key_at)
            # everything else is one window of the split's own text, in order; the haystack's next tokens labelled
            # with --text_labels, nothing else
            free = [j for j in range(17) if j not in (*key_at, *(k + 1 for k in key_at), *query_at)]
            window = [row[j] for j in free]
            assert len(window) == 16 - 9 + 1
            assert any(text[split][s:s + len(window)] == window for s in range(len(text[split]) - len(window) + 1))
            expected = [-1] * 17
            for q, v in zip(query_at, values):
                expected[q + 1] = v
            if text_labels:
                for j in range(16):
                    if j in free and j + 1 in free and j + 1 < 13:
                        expected[j + 1] = row[j + 1]
            assert label == expected
    assert len(depths) > 6  # the depths are drawn, not fixed


def test_the_same_seeds_give_the_same_bytes(tmp_path):
    _, first = prepare(tmp_path / 'a')
    _, again = prepare(tmp_path / 'b')
    for name in ('train.bin', 'val_labels.bin', 'val_needles.bin'):
        assert (first / name).read_bytes() == (again / name).read_bytes()


def test_answers_only_keeps_exactly_the_labels_a_preparation_without_text_labels_writes(tmp_path):
    # the same seeds with and without --text_labels: the same tokens, and labels that differ on the text alone
    _, labelled = prepare(tmp_path / 'with', '--text_labels')
    _, answers = prepare(tmp_path / 'without')
    assert (labelled / 'val.bin').read_bytes() == (answers / 'val.bin').read_bytes()
    for split in ('train', 'val'):
        with_text, without = (TokenBatches(str(d), split, T, 16) for d in (labelled, answers))
        x, y = with_text.get_batch(torch.Generator().manual_seed(3))
        x_answers, y_answers = without.get_batch(torch.Generator().manual_seed(3))
        assert torch.equal(x, x_answers) and (y >= 0).sum() > (y_answers >= 0).sum()  # the text is labelled
        assert torch.equal(with_text.layout.answers_only(y), y_answers)
        assert torch.equal(without.layout.answers_only(y_answers), y_answers)  # already the answers alone
    # a meta.json that labels the text but does not say which ids answer: refused, not scored as all labels
    meta = json.loads((labelled / 'meta.json').read_text())
    (labelled / 'meta.json').write_text(json.dumps({k: v for k, v in meta.items() if k != 'value_ids'}))
    with pytest.raises(ValueError, match=r"says its text is labelled but not which ids are the answers \(value_ids\)"):
        TokenBatches(str(labelled), 'val', T, 16)


def test_train_evaluates_the_answers_alone_where_asked(tmp_path):
    _, labelled = prepare(tmp_path / 'with', '--text_labels')
    _, answers = prepare(tmp_path / 'without')
    common = ['--max_iters=0', f'--block_size={T}', '--device=cpu', '--dtype=float32', '--compile=False']
    val = {}
    for name, data, extra in [('answers only', labelled, ['--eval_answers_only=True']), ('all labels', labelled, []),
                              ('answer data', answers, [])]:
        r = run_train_in_process(tmp_path / name, data, *common, *extra)
        val[name] = eval_losses(r.stdout)[0]
        assert ('(answers only)' in r.stdout) == bool(extra)
    # at the same initial weights: the text-labelled data's answers score what the answers-only data scores
    assert val['answers only'] == val['answer data'] != val['all labels']
    # a dataset without answers: one line, before any work
    r = run_train_in_process(tmp_path / 'text-run', tmp_path / 'with' / 'text', *common, '--eval_answers_only=True',
                             expect_rc=2)
    assert r.stderr.count('\n') == 1 and 'eval_answers_only=True' in r.stderr and 'has no answers' in r.stderr
    assert 'number of parameters' not in r.stdout and not (tmp_path / 'text-run').exists()


@pytest.mark.parametrize('args, message', [
    (['--text', '{tmp}/nowhere'], 'is not a prepared dataset'),
    (['--text', '{tmp}/examples'], 'is a dataset of examples'),
    (['--seq_len', '6'], 'must be at least 3 x num_needles + 1 = 7'),
    (['--key_ids', '1'], 'must each be at least num_needles'),
    (['--value_ids', '70000'], 'exceed the 65,536'),
    (['--val_seed', '0'], 'must differ'),
    (['--out_dir', '{tmp}/text'], "is the text's own folder"),
    (['--seq_len', '100'], 'val.bin holds 60 tokens, fewer than the 95'),
    (['--train_examples', '0'], 'must be at least 1'),
    (['--out_dir', ''], '--out_dir is empty'),
])
def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys, args, message):
    write_text(tmp_path / 'text')
    (tmp_path / 'examples').mkdir()
    (tmp_path / 'examples' / 'meta.json').write_text(json.dumps({'tokenizer': 'ids', 'vocab_size': 64,
                                                                  'example_tokens': 33, 'labels': 'answers'}))
    args = [a.format(tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as e:
        prepare_needles(['--text', str(tmp_path / 'text'), '--out_dir', str(tmp_path / 'out'), '--num_needles', '2',
                         *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / 'out').exists()
    assert sorted(p.name for p in (tmp_path / 'text').iterdir()) == ['meta.json', 'train.bin', 'val.bin']


def test_a_gpt2_text_takes_ids_after_its_50257(tmp_path):
    write_text(tmp_path / 'text')
    (tmp_path / 'text' / 'meta.json').write_text(json.dumps({'tokenizer': 'gpt2', 'vocab_size': 50257}))
    prepare_needles(['--text', str(tmp_path / 'text'), '--out_dir', str(tmp_path / 'out'), '--seq_len', '16',
                     '--num_needles', '3', '--train_examples', '5', '--val_examples', '5'])
    meta = json.loads((tmp_path / 'out' / 'meta.json').read_text())
    assert meta['text_tokenizer'] == 'gpt2' and meta['vocab_size'] == 50257 + 64
    tokens, _, placed = read(tmp_path / 'out', 'val', T=16, N=3)
    keys = tokens[np.arange(5)[:, None], placed[..., 0]]
    assert (keys >= 50257).all() and (keys < 50257 + 32).all() and (tokens[tokens < 50257] < V).all()


def test_positions_from_another_preparation_are_one_line(tmp_path):
    _, folder = prepare(tmp_path, examples=4)
    np.full((4, N, 2), T, dtype=np.int32).tofile(folder / 'val_needles.bin')  # past the examples' end
    with pytest.raises(ValueError, match="places a needle or query outside the examples' 12 tokens"):
        attention_noise(peaked_model('base'), str(folder), 8, 'cpu', NO_AUTOCAST)


def reference(model, folder, seed):
    """(layers, heads, PARTS) and (layers, PARTS) means over every query of val, with the parts written out
    from the positions file: value, key, other needles, own, earlier queries, text."""
    tokens, _, placed = read(folder, 'val')
    queries = []
    for row, needles in enumerate(placed.tolist()):
        asked_at = [q for _, q in needles]
        in_needles = {k + i for k, _ in needles for i in (0, 1)}
        for key_at, p in needles:
            def part(j, key_at=key_at, p=p, asked_at=asked_at, in_needles=in_needles):
                if j == key_at + 1:
                    return 0
                if j == key_at:
                    return 1
                if j in in_needles:
                    return 2
                return 3 if j == p else 4 if j in asked_at else 5
            queries.append((row, p, part))
    return naive_part_shares(model, torch.from_numpy(tokens[:, :T].astype(np.int64)), seed, queries, parts=6)


@pytest.mark.parametrize('attn_type', ['base', 'diff', 'dint', 'noiseformer_v2'])
def test_attention_parts_on_needles_equal_a_float64_loop(tmp_path, attn_type):
    _, folder = prepare(tmp_path, '--text_labels', examples=6)
    model = peaked_model(attn_type, seed=2 if attn_type == 'noiseformer_v2' else 0)
    torch.manual_seed(3)
    r = attention_noise(model, str(folder), 8, 'cpu', NO_AUTOCAST)  # one batch: NoiseFormer draws once
    expected, expected_layers = reference(model, folder, seed=3)
    got = torch.tensor([r['shares'][part] for part in PARTS], dtype=torch.float64).permute(1, 2, 0)
    got_layers = torch.tensor([r['layer_shares'][part] for part in PARTS], dtype=torch.float64).T
    assert torch.allclose(got, expected, rtol=1e-9, atol=1e-12)
    assert torch.allclose(got_layers, expected_layers, rtol=1e-9, atol=1e-12)
    # the text's labels are no queries: every needle is asked once, and only the queries are read
    assert r['answers'] == 6 * N and r['examples'] == 6 and list(r['by_pairs']) == [str(N)]
    assert r['part_words']['pairs'] == 'other needles' and r['part_words']['filler'] == 'text'
    # every part has weight somewhere, so the equality says something
    assert (torch.maximum(expected[..., :6].amax(dim=(0, 1)), expected_layers[:, :6].amax(0)) > 1e-4).all()


def test_eval_reads_needles_as_a_user_runs_it(tmp_path):
    _, folder = prepare(tmp_path, '--text_labels', examples=8)
    model = tiny_checkpoint(tmp_path / 'out', 'diff', folder, block_size=T, vocab_size=V + K + M, n_head=4)
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out'}", '--attention_noise=True', '--recall=True',
                                          '--device=cpu', '--dtype=float32', '--seed=5'])
    assert r.returncode == 0, r.stderr
    assert 'other needles' in r.stdout and 'earlier queries' in r.stdout and ', text ' in r.stdout
    shares = json.loads((tmp_path / 'out' / 'attention_noise.json').read_text())
    assert f"a uniform row (every key alike) would score: answer value {shares['uniform']['value']:.3f}" in r.stdout
    assert shares['answers'] == 8 * N and shares['ranked_by'] == 'signed_value'
    # the answer accuracy counts the queries alone, not the text's labels
    recall = json.loads((tmp_path / 'out' / 'recall.json').read_text())
    expected = answer_accuracy(model.eval(), str(folder), 8, 'cpu', NO_AUTOCAST)
    assert recall['answers'] == 8 * N and recall['accuracy'] == pytest.approx(expected['accuracy'])


@pytest.mark.slow
def test_compare_reports_needles_in_their_own_words_read_where_each_run_stopped(tmp_path):
    """compare.py over a needle dataset: its tables name the text and the other needles (not MQAR's filler and
    pairs), and say that a run that reached stop_at_val_loss (here on the answers alone) is read where it stopped."""
    _, folder = prepare(tmp_path, '--text_labels', examples=16)
    out = tmp_path / 'sweep'
    overrides = (f"--dataset={folder} --block_size={T} --max_iters=8 --lr_decay_iters=8 --eval_interval=4 "
                 "--eval_iters=2 --eval_answers_only=True --stop_at_val_loss=50")  # reached at the first evaluation
    args = [f"--base_config={TINY}", f"--overrides={overrides}", "--attn_types=base,diff", "--seeds=1",
            "--samples=False", f"--out_dir={out}"]
    proc = run_script_in_process("compare.py", args, env=SCRIPT_VARIABLES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (out / "report" / "report.md").read_text()
    results = json.loads((out / "report" / "results.json").read_text())
    assert all(r['reached_target'] and r['final_iter'] == 0 for r in results['runs'])
    header = next(line for line in report.splitlines() if line.startswith('| variant | text tokens |'))
    assert '| other needles | own token | earlier queries | text |' in header
    assert 'filler' not in header and 'other pairs' not in header
    assert f"| variant | accuracy | per seed | {N} needles | reading |" in report
    assert "which for a run that reached val loss 50 is where it stopped" in report
    assert "noise = other needles + earlier queries + text" in report
