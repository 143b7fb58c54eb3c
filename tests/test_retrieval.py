"""eval.py --retrieval: the probe's examples (a span written twice into the validation text), its copy accuracy
against generation's own next-token choice, its attention shares against an explicit float64 loop for every
attn_type, causality, and eval.py on a char-level and a GPT-2 BPE checkpoint as a user runs it."""
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import gpt2_bpe
from denoised_gpt.evaluation.attention_noise import layer_part_shares
from denoised_gpt.evaluation.retrieval import (PARTS, candidate_ids, copy_parts, default_distances, heatmap_panels,
                                               probe_examples, retrieval)
from denoised_gpt.evaluation.entropy import plot_heatmaps
from helpers import NO_AUTOCAST, run_script_in_process, tiny_checkpoint
from model import ATTENTION_TYPES
from naive_attention import naive_part_shares
from test_attention_noise import peaked_model

REPO = Path(__file__).resolve().parents[1]
L, K = 16, 3  # window and span of the small probes below: distances 1 .. L - 2K


def write_text(folder, tokens):
    """A dataset folder with val.bin (uint16 ids) and a char-level meta.json."""
    folder.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=np.uint16).tofile(folder / 'val.bin')
    (folder / 'meta.json').write_text(json.dumps({'tokenizer': 'char', 'vocab_size': 64}))
    return folder


def text_tokens(n=400, ids=range(5, 45), seed=0):
    return np.random.default_rng(seed).choice(list(ids), size=n)


def test_examples_write_the_span_twice_into_a_window_of_the_text(tmp_path):
    data = text_tokens()
    path = write_text(tmp_path, data) / 'val.bin'
    tokens, first, dist, spans, candidates = probe_examples(str(path), 64, L, K, [1, 4, 10], 5, seed=3)
    assert tokens.shape == (15, L) and candidates == len(np.unique(data)) == 40
    assert dist.tolist() == [1] * 5 + [4] * 5 + [10] * 5
    for row, a, d, span in zip(tokens, first, dist, spans):
        assert a == L - 2 * K - d  # the second copy ends at the window's last position
        assert row[a:a + K].tolist() == row[L - K:].tolist() == span.tolist()
        assert len(set(span.tolist())) == K and set(span.tolist()) <= set(data.tolist())  # distinct ids of the text
        # everything else is one window of the text, in order
        text = [j for j in range(L) if not (a <= j < a + K or j >= L - K)]
        starts = [s for s in range(len(data) - L + 1) if all(row[j] == data[s + j] for j in text)]
        assert starts, "the tokens around the copies are not a window of the text"
    again = probe_examples(str(path), 64, L, K, [1, 4, 10], 5, seed=3)
    other = probe_examples(str(path), 64, L, K, [1, 4, 10], 5, seed=4)
    assert torch.equal(again[0], tokens) and not torch.equal(other[0], tokens)


def test_default_distances_span_the_window_and_misfits_are_errors(tmp_path):
    assert default_distances(128, 10) == [6, 13, 26, 53, 107]  # 128 - 20 - 1, halved four times
    assert default_distances(1024, 10) == [62, 125, 250, 501, 1003]
    assert default_distances(8, 3) == [1]
    with pytest.raises(ValueError, match="cannot hold a span of 4 twice"):
        default_distances(8, 4)
    path = str(write_text(tmp_path, text_tokens()) / 'val.bin')
    with pytest.raises(ValueError, match="distance 11 does not fit"):
        probe_examples(path, 64, L, K, [11], 1, seed=0)
    with pytest.raises(ValueError, match="fewer than the span"):
        probe_examples(str(write_text(tmp_path / 'few', [1, 2] * 20) / 'val.bin'), 64, L, K, [1], 1, seed=0)
    assert candidate_ids(path, 30).tolist() == list(range(5, 30))  # ids the model has no embedding for left out


def probe_queries(first):
    """[(row, p, part(j))] for every copy position of examples whose first copy starts at `first`, with the
    parts written out from the module docstring: copy, occurrence, span, own, text."""
    queries = []
    for row, a in enumerate(first.tolist()):
        for i in range(K - 1):
            p = L - K + i

            def part(j, a=a, i=i, p=p):
                if j == a + i + 1:
                    return 0
                if j == a + i:
                    return 1
                if a <= j < a + K or L - K <= j < p:
                    return 2
                return 3 if j == p else 4
            queries.append((row, p, part))
    return queries


@pytest.mark.parametrize('attn_type', list(ATTENTION_TYPES))
def test_shares_equal_a_float64_loop_over_the_parts(tmp_path, attn_type):
    path = str(write_text(tmp_path, text_tokens()) / 'val.bin')
    model = peaked_model(attn_type, block_size=L)
    torch.manual_seed(3)
    r = retrieval(model, path, 8, 'cpu', NO_AUTOCAST, span=K, distances=[2, 8], per_distance=2, seed=1)
    tokens, first, dist, _, _ = probe_examples(path, 64, L, K, [2, 8], 2, seed=1)
    expected, expected_layers = naive_part_shares(model, tokens, 3, probe_queries(first), parts=5)
    got = torch.tensor([r['shares'][part] for part in PARTS], dtype=torch.float64).permute(1, 2, 0)
    got_layers = torch.tensor([r['layer_shares'][part] for part in PARTS], dtype=torch.float64).T
    assert torch.allclose(got, expected, rtol=1e-9, atol=1e-12)
    assert torch.allclose(got_layers, expected_layers, rtol=1e-9, atol=1e-12)
    # the parts split the row, every part has weight somewhere, and the heads differ: equality says something
    assert torch.allclose(got[..., :5].sum(-1), torch.ones_like(got[..., 0]))
    assert (expected[..., :5].amax(dim=(0, 1)) > 1e-4).all()
    assert (expected[..., :5].amax(dim=(0, 1)) - expected[..., :5].amin(dim=(0, 1))).max() > 0.05
    # the token to copy and the earlier occurrence apart: their shares differ, and add up to the source's
    assert (got[..., 0] - got[..., 1]).abs().max() > 1e-3
    assert torch.allclose(got[..., PARTS.index('source')], got[..., 0] + got[..., 1])
    # the copy head and the reading layer: the highest signed share on the token to copy
    rank = got[..., PARTS.index('signed_copy')]
    assert (r['copy_head']['layer'], r['copy_head']['head']) == divmod(int(rank.argmax()), rank.size(1))
    assert r['reading_layer']['layer'] == int(got_layers[:, PARTS.index('signed_copy')].argmax())
    # by distance: the same measure over that distance's queries, at the copy head chosen over all of them
    near = [q for q in probe_queries(first) if dist[q[0]] == 2]
    near_heads, _ = naive_part_shares(model, tokens, 3, near, parts=5)  # the same draws: one per layer and batch
    layer, head = r['copy_head']['layer'], r['copy_head']['head']
    assert r['by_distance']['2']['copy_head']['copy'] == pytest.approx(float(near_heads[layer, head, 0]), rel=1e-9)
    assert r['by_distance']['2']['copies'] == r['by_distance']['8']['copies'] == 2 * (K - 1)
    assert r['copies'] == 4 * (K - 1) and r['examples'] == 4


def test_copy_accuracy_is_what_generation_would_predict(tmp_path):
    """The accuracy counts the second copy's targets that the next token generation would choose (the model's
    last-position logits, without targets) gets right, over positions 0 .. K - 2 of the copy."""
    data = text_tokens(ids=range(4))  # four ids: a target is one of 3, so hits and misses both occur
    path = str(write_text(tmp_path, data) / 'val.bin')
    model = peaked_model('base', block_size=L)
    with torch.no_grad():
        model.transformer.wte.weight[4:] = 0  # the untied logits of ids the text lacks stay 0 (wte is lm_head)
    r = retrieval(model, path, 8, 'cpu', NO_AUTOCAST, span=K, distances=[1, 6], per_distance=20, seed=2)
    tokens, _, dist, spans, _ = probe_examples(path, 64, L, K, [1, 6], 20, seed=2)
    hits = torch.zeros(len(tokens), K - 1)
    with torch.no_grad():
        for row in range(len(tokens)):
            for i in range(K - 1):
                logits, _ = model(tokens[row:row + 1, :L - K + i + 1])
                hits[row, i] = float(int(logits[0, -1].argmax()) == int(spans[row, i + 1]))
    assert 0.05 < hits.mean() < 0.95
    assert r['accuracy'] == pytest.approx(float(hits.mean()))
    assert r['by_distance']['6']['accuracy'] == pytest.approx(float(hits[dist == 6].mean()))
    assert r['by_offset'] == pytest.approx({str(i): float(hits[:, i].mean()) for i in range(K - 1)})
    assert r['chance'] == pytest.approx(1 / 4) and r['candidates'] == 4


@pytest.mark.parametrize('attn_type', list(ATTENTION_TYPES))
def test_no_share_comes_from_a_later_token(attn_type):
    model = peaked_model(attn_type, block_size=L)
    x = torch.from_numpy(text_tokens(n=L, seed=5)).long()[None]
    a = torch.tensor([4])
    for i in range(K - 1):
        p = L - K + i
        later, earlier = x.clone(), x.clone()
        later[0, p + 1:] = (later[0, p + 1:] * 7 + 1) % 64
        earlier[0, p - 1] = (earlier[0, p - 1] + 1) % 64
        measured = []
        for tokens in (x, later, earlier):
            torch.manual_seed(3)
            heads, layers, _ = layer_part_shares(model, tokens, torch.tensor([0]), torch.tensor([p]),
                                                 copy_parts(L, K, a, torch.tensor([i])), 'cpu', NO_AUTOCAST)
            measured.append(torch.cat([heads.flatten(), layers.flatten()]))
        assert torch.equal(measured[0], measured[1])
        assert not torch.equal(measured[0], measured[2])  # while an earlier token reaches them


# ----------------------------------------------------------------------------- eval.py as a user runs it

def test_eval_script_probes_a_char_model_beside_another(tmp_path):
    data = write_text(tmp_path / 'data', text_tokens(n=2000))
    diff = tiny_checkpoint(tmp_path / 'out-diff', 'diff', data, seed=1, block_size=32, vocab_size=64)
    base = tiny_checkpoint(tmp_path / 'out-base', 'base', data, block_size=32, vocab_size=64)
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out-diff'}", '--retrieval=True', '--device=cpu',
                                          '--dtype=float32', '--seed=5', '--retrieval_examples=3',
                                          '--retrieval_span=4', f"--compare_to={tmp_path / 'out-base'}"])
    assert r.returncode == 0, r.stderr
    out = tmp_path / 'out-diff'
    at_chance = 0
    for name, model in (('retrieval.json', diff), ('retrieval_out-base.json', base)):
        written = json.loads((out / name).read_text())
        at_chance += written['accuracy'] < 2 * written['chance']
        torch.manual_seed(5)
        expected = retrieval(model.eval(), str(data / 'val.bin'), 8, 'cpu', NO_AUTOCAST, span=4, per_distance=3,
                             seed=5)
        assert written['distances'] == default_distances(32, 4) == [1, 2, 5, 11, 23]
        assert written['accuracy'] == pytest.approx(expected['accuracy'])
        assert torch.allclose(torch.tensor([written['shares'][part] for part in PARTS]),
                              torch.tensor([expected['shares'][part] for part in PARTS]), atol=1e-6)
        assert written['attn_type'] == model.config.attn_type and written['examples'] == 3 * len(written['distances'])
    for png in ('retrieval.png', 'retrieval_vs_out-base.png'):
        assert (out / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
        width, height = struct.unpack('>II', (out / png).read_bytes()[16:24])  # the PNG header's IHDR
        assert width <= 1100 and height > width / 3  # six and twelve panels in rows: readable at a page's width
    assert r.stdout.count('copy accuracy') == r.stdout.count('copy head L') == 2
    # untrained models do not copy: each one's copy head comes with that word, in one line
    assert at_chance == 2 and r.stdout.count('this model does not copy (accuracy') == 2


def test_eval_script_probes_a_gpt2_bpe_model(tmp_path):
    """A model with GPT-2's vocabulary on BPE tokens of real text: the span's ids come from that text."""
    gpt2_bpe.require()
    import tiktoken
    ids = tiktoken.get_encoding('gpt2').encode_ordinary((REPO / 'README.md').read_text()[:20_000])
    data = write_text(tmp_path / 'data', ids)
    tiny_checkpoint(tmp_path / 'out', 'dint', data, block_size=48, vocab_size=50257)
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out'}", '--retrieval=True', '--device=cpu',
                                          '--retrieval_examples=2', '--retrieval_distances=4,20'])
    assert r.returncode == 0, r.stderr
    written = json.loads((tmp_path / 'out' / 'retrieval.json').read_text())
    assert written['distances'] == [4, 20] and written['candidates'] == len(set(ids)) > 255
    assert written['chance'] == pytest.approx(1 / len(set(ids)))


def test_heatmap_shows_the_signed_copy_share_and_accuracy_at_each_distance_and_the_layer_as_a_whole(tmp_path):
    path = str(write_text(tmp_path, text_tokens()) / 'val.bin')
    result = retrieval(peaked_model('dint', block_size=L), path, 8, 'cpu', NO_AUTOCAST, span=K, distances=[2, 8],
                       per_distance=2, seed=1)
    fig = plot_heatmaps([('out-dint', heatmap_panels(result))], 'share')
    panels = [ax for ax in fig.axes if ax.images]
    # a uniform row over keys 0 .. p gives the token to copy 1 / (p + 1), p = L - K + i
    uniform = sum(1 / (L - K + i + 1) for i in range(K - 1)) / (K - 1)
    for ax, d in zip(panels, ('2', '8')):
        at = result['by_distance'][d]
        assert ax.get_title().split('\n')[1:3] == [
            f"token to copy, signed, D={d}; copy head boxed",
            f"accuracy {at['accuracy']:.3f} (chance {result['chance']:.3f}), uniform row {uniform:.3f} "
            f"(mean {float(torch.tensor(at['shares']['signed_copy']).mean()):.3f})"]
        assert ax.images[0].get_array().ravel().tolist() == pytest.approx(sum(at['shares']['signed_copy'], []))
        assert ax.images[0].get_clim() == (-1, 1)  # signed: a scale of its own
        head = result['copy_head']
        assert [p.get_xy() for p in ax.patches] == [(head['head'] - 0.5, head['layer'] - 0.5)]
    u = result['uniform']
    assert [t.get_text() for t in panels[2].get_xticklabels()] == [
        f"token to copy ({u['copy']:.3f})", f"earlier occurrence ({u['occurrence']:.3f})", f"span ({u['span']:.3f})",
        f"own token ({u['own']:.3f})", f"text ({u['text']:.3f})"]
    assert [p.get_xy() for p in panels[2].patches] == [(-0.5, result['reading_layer']['layer'] - 0.5)]
    assert_no_overlap(fig, panels[2].get_xticklabels())


def assert_no_overlap(fig, labels):
    """The labels, drawn, share no pixel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    renderer = FigureCanvasAgg(fig).get_renderer()
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_eval_script_says_what_is_wrong_with_the_probe_settings(tmp_path):
    data = write_text(tmp_path / 'data', text_tokens(n=100))
    tiny_checkpoint(tmp_path / 'out', 'base', data, block_size=16, vocab_size=64)
    for args, message in ((['--retrieval_distances=0'], 'must be positive integers'),
                          (['--retrieval_distances=11'], 'distance 11 does not fit'),
                          (['--retrieval_span=8'], 'cannot hold a span of 8 twice')):
        r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out'}", '--retrieval=True', '--device=cpu',
                                              '--retrieval_span=3', *args])
        assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
        assert message in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / 'out' / 'retrieval.json').exists()


def test_a_variant_without_attention_maps_is_one_line(tmp_path, monkeypatch):
    """A new attention class registered in model.py trains and samples; eval.py's attention measures say what it
    lacks instead of a traceback."""
    from model import AttentionBase

    class Unmapped(AttentionBase):
        def forward(self, x, cache=None):
            return self.c_proj(x)
    monkeypatch.setitem(ATTENTION_TYPES, 'unmapped', Unmapped)
    data = write_text(tmp_path / 'data', text_tokens(n=200))
    tiny_checkpoint(tmp_path / 'out', 'unmapped', data, block_size=32, vocab_size=64)
    for measure in ('--retrieval=True', '--entropy=True'):
        r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out'}", measure, '--device=cpu'])
        assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
        assert "Unmapped has no attention_maps: define them in model.py" in r.stderr.strip().splitlines()[-1]


def test_a_compared_model_with_a_shorter_block_sees_the_same_windows(tmp_path):
    data = write_text(tmp_path / 'data', text_tokens(n=1000))
    tiny_checkpoint(tmp_path / 'out-long', 'base', data, block_size=32, vocab_size=64)
    tiny_checkpoint(tmp_path / 'out-short', 'diff', data, seed=1, block_size=20, vocab_size=64)
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out-long'}", '--retrieval=True', '--device=cpu',
                                          '--retrieval_examples=2', '--retrieval_span=3',
                                          f"--compare_to={tmp_path / 'out-short'}"])
    assert r.returncode == 0, r.stderr
    mine = json.loads((tmp_path / 'out-long' / 'retrieval.json').read_text())
    theirs = json.loads((tmp_path / 'out-long' / 'retrieval_out-short.json').read_text())
    assert mine['length'] == theirs['length'] == 20 and mine['distances'] == theirs['distances'] == \
        default_distances(20, 3)


def test_a_compared_model_with_another_vocabulary_is_refused_before_anything_is_written(tmp_path):
    data = write_text(tmp_path / 'data', text_tokens(n=400))
    tiny_checkpoint(tmp_path / 'out-a', 'base', data, block_size=32, vocab_size=64)
    tiny_checkpoint(tmp_path / 'out-b', 'base', data, block_size=32, vocab_size=96)
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out-a'}", '--retrieval=True', '--device=cpu',
                                          '--retrieval_examples=1', f"--compare_to={tmp_path / 'out-b'}"])
    assert r.returncode == 2 and "compare_to's model has 96 token ids, this one 64" in r.stderr.splitlines()[-1]
    assert not list((tmp_path / 'out-a').glob('retrieval*'))
