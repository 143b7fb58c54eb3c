"""eval.py --attention_noise: the share of each query's effective attention row on its answer span and on
the rest, for every attn_type, against a float64 computation from the variant's equations
(naive_attention.py's maps, recomputed from the layer's weights), causal, and as a user runs it."""
import json

import pytest
import torch

from denoised_gpt.evaluation.attention_noise import PARTS, attention_noise, heatmap_panels
from denoised_gpt.evaluation.entropy import plot_heatmaps
from helpers import NO_AUTOCAST, run_script_in_process, tiny_checkpoint, tiny_gpt
from model import ATTENTION_TYPES, TwoBranchAttention
from naive_attention import naive_part_shares

T = 12
# Two handmade examples (T + 1 tokens: the model reads the first T) and their answers, by construction:
# (position of the query key, position of that key in the pairs, number of pairs). Keys below 32, values
# from 32; in the first, key 3's query at 8 has a copy of key 3 in the filler at 7, which is noise.
EXAMPLES = [
    ([3, 40, 5, 50, 5, 9, 7, 3, 3, 11, 12, 13, 1], {4: 50, 8: 40}),
    ([4, 33, 6, 44, 8, 55, 8, 1, 4, 2, 6, 0, 1], {6: 55, 8: 33, 10: 44}),
]
ANSWERS = [[(4, 2, 2), (8, 0, 2)], [(6, 4, 3), (8, 0, 3), (10, 2, 3)]]


def write_examples(data_dir, examples):
    """A recall dataset as data/mqar/prepare.py writes one: tokens, labels (each answer one position after
    its query) and meta.json."""
    data_dir.mkdir(parents=True, exist_ok=True)
    tokens = torch.tensor([t for t, _ in examples], dtype=torch.int64)
    labels = torch.full_like(tokens, -1)
    for row, (_, values) in enumerate(examples):
        for p, value in values.items():
            labels[row, p + 1] = value
    tokens.numpy().astype('uint16').tofile(data_dir / 'val.bin')
    labels.numpy().astype('int32').tofile(data_dir / 'val_labels.bin')
    (data_dir / 'meta.json').write_text(json.dumps({'tokenizer': 'ids', 'vocab_size': 64, 'example_tokens': T + 1,
                                                    'labels': 'answers'}))
    return data_dir


def peaked_model(attn_type, seed=0, block_size=T):
    """A tiny float64 model whose maps are far from uniform (and, for DIFF / DINT, have negative entries)."""
    model = tiny_gpt(attn_type, seed, block_size=block_size, vocab_size=64, n_head=4, lowrank_rank=4).double().eval()
    with torch.no_grad():
        for block in model.transformer.h:
            attn = block.attn
            attn.c_attn.weight.mul_(40)
            if hasattr(attn, 'lambda_q1'):
                attn.lambda_q1.fill_(0.5)
                attn.lambda_k1.fill_(0.5)  # lambda = exp(0.25 d) - ... : well above 1
            if hasattr(attn, 'q2_down'):
                for lin in (attn.q2_down, attn.q2_up, attn.k2_down, attn.k2_up):
                    lin.weight.mul_(10)
            if hasattr(attn, 'noise_sigma'):
                attn.noise_sigma.fill_(2.0)  # noise that moves the maps
    return model


def reference_shares(model, idx, seed):
    """(layers, heads, PARTS) and (layers, PARTS) means over ANSWERS, with explicit float64 loops
    (naive_part_shares)."""
    queries = []
    for row, asked in enumerate(ANSWERS):
        asked_at = [q for q, _, _ in asked]
        for p, key_at, pairs in asked:
            def part(j, p=p, key_at=key_at, pairs=pairs, asked_at=asked_at):
                # value, key, pairs, own, queries, filler: indices into the first six PARTS
                if j == key_at + 1:
                    return 0
                if j == key_at:
                    return 1
                if j < 2 * pairs:
                    return 2
                return 3 if j == p else 4 if j in asked_at else 5
            queries.append((row, p, part))
    return naive_part_shares(model, idx, seed, queries, parts=6)


@pytest.mark.parametrize('attn_type', list(ATTENTION_TYPES))
def test_shares_equal_a_float64_computation_from_the_equations(tmp_path, attn_type):
    data = write_examples(tmp_path / 'data', EXAMPLES)
    # seeds whose maps put weight on every part (seed 0's NoiseFormer v2 gives the values almost none)
    model = peaked_model(attn_type, seed=2 if attn_type == 'noiseformer_v2' else 0)
    idx = torch.tensor([t[:T] for t, _ in EXAMPLES])
    torch.manual_seed(3)
    r = attention_noise(model, str(data), 8, 'cpu', NO_AUTOCAST)
    expected, expected_layers = reference_shares(model, idx, seed=3)
    got = torch.tensor([r['shares'][part] for part in PARTS], dtype=torch.float64).permute(1, 2, 0)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-9, atol=1e-12)
    # the layer as a whole: the norm of what each key adds to the layer's output
    got_layers = torch.tensor([r['layer_shares'][part] for part in PARTS], dtype=torch.float64).T
    assert torch.allclose(got_layers, expected_layers, rtol=1e-9, atol=1e-12)
    signed = PARTS.index('signed_value')
    reading = int(expected_layers[:, signed].argmax())
    assert r['reading_layer'] == pytest.approx(dict(layer=reading, **dict(zip(PARTS, expected_layers[reading].tolist()))))
    # a layer's share is not a mean of its heads' shares: values and c_proj weigh the heads
    answer = PARTS.index('answer')
    assert (got_layers[:, answer] - got[..., answer].mean(-1)).abs().max() > 1e-3
    # the value and the key apart: their shares differ, and add up to the answer's
    assert (got[..., 0] - got[..., 1]).abs().max() > 1e-3
    assert torch.allclose(got[..., PARTS.index('answer')], got[..., 0] + got[..., 1])
    assert r['answers'] == 5 and r['examples'] == 2
    # the heads' shares differ widely (the maps are far from uniform), so equality says something; DIFF /
    # DINT maps have negative weight; every part has weight somewhere (in a head or in a layer as a whole)
    assert expected[..., answer].max() - expected[..., answer].min() > 0.05
    assert (torch.maximum(expected[..., :6].amax(dim=(0, 1)), expected_layers[:, :6].amax(0)) > 1e-3).all()
    if issubclass(ATTENTION_TYPES[attn_type], TwoBranchAttention):
        assert (expected[..., signed] - expected[..., 0]).abs().max() > 1e-3
    # the six parts split the row's absolute mass; noise is everything but the answer and the own token
    for shares in (got, got_layers):
        assert torch.allclose(shares[..., :6].sum(-1), torch.ones_like(shares[..., 0]))
        assert torch.allclose(shares[..., PARTS.index('noise')], 1 - shares[..., 0] - shares[..., 1] - shares[..., 3])
        assert (shares[..., signed].abs() <= shares[..., 0] + 1e-12).all()
    # the best head of each layer, and the lookup head: the highest signed value share
    rank = got[..., signed]
    for layer, best in enumerate(r['best_head']):
        assert best['layer'] == layer and best['head'] == int(rank[layer].argmax())
    layer, head = divmod(int(rank.argmax()), rank.size(1))
    assert (r['lookup']['layer'], r['lookup']['head']) == (layer, head)
    assert r['lookup']['value'] == pytest.approx(float(expected[layer, head, 0]))
    assert r['lookup']['signed_value'] == pytest.approx(float(expected[layer, head, signed]))
    # groups: the first example has 2 pairs and 12 - 6 filler tokens, the second 3 and 12 - 9
    assert {k: v['answers'] for k, v in r['by_pairs'].items()} == {'2': 2, '3': 3}
    assert {k: v['answers'] for k, v in r['by_filler'].items()} == {'3': 3, '6': 2}
    assert sum(v['answers'] for v in r['by_distance'].values()) == 5
    assert all((v['lookup']['layer'], v['lookup']['head']) == (layer, head) for v in r['by_pairs'].values())


@pytest.mark.parametrize('attn_type', ['base', 'diff', 'dint'])
def test_shares_by_offset_from_the_key_equal_a_float64_computation(tmp_path, attn_type):
    """by_offset: the signed share of the key at each offset from the queried key (+2: the token after the value,
    where a lookup reads a value its layer below moved forward), per head and per layer as a whole, against
    naive_part_shares with that one key as the part read; 0 where the offset falls outside 0 .. query - 1."""
    data = write_examples(tmp_path / 'data', EXAMPLES)
    model = peaked_model(attn_type)
    torch.manual_seed(3)
    r = attention_noise(model, str(data), 8, 'cpu', NO_AUTOCAST)
    idx = torch.tensor([t[:T] for t, _ in EXAMPLES])
    signed = PARTS.index('signed_value')
    for offset in (-1, 2, 3):
        queries = [(row, p, lambda j, p=p, at=key_at + offset: 3 if j == p else 0 if j == at else 2)
                   for row, asked in enumerate(ANSWERS) for p, key_at, _ in asked]
        heads, layers = naive_part_shares(model, idx, 3, queries, parts=4)
        got = r['by_offset'][f'{offset:+d}']
        assert torch.allclose(torch.tensor(got['heads'], dtype=torch.float64), heads[..., signed], atol=1e-12)
        assert torch.allclose(torch.tensor(got['layers'], dtype=torch.float64), layers[:, signed], atol=1e-12)
        assert heads[..., signed].abs().max() > 1e-3  # some head puts weight there: equality says something
    # the value and the key themselves: the signed shares the parts give them
    for offset, part in (('+1', 'signed_value'), ('+0', 'signed_key')):
        for kind, parts in (('heads', r['shares']), ('layers', r['layer_shares'])):
            assert torch.allclose(torch.tensor(r['by_offset'][offset][kind]), torch.tensor(parts[part]), atol=1e-12)


@pytest.mark.parametrize('attn_type', list(ATTENTION_TYPES))
def test_no_share_comes_from_a_later_token(tmp_path, attn_type):
    """Tokens after every query changed: no query's shares move (a map with weight on a later key, or a
    mean term that looked ahead, would move them)."""
    last_query = max(p for _, values in EXAMPLES for p in values)
    later = [([*t[:last_query + 1], *[(x * 7 + 1) % 64 for x in t[last_query + 1:]]], v) for t, v in EXAMPLES]
    assert later != EXAMPLES
    model = peaked_model(attn_type)
    results = []
    for name, examples in (('data', EXAMPLES), ('later', later)):
        torch.manual_seed(3)
        results.append(attention_noise(model, str(write_examples(tmp_path / name, examples)), 8, 'cpu', NO_AUTOCAST))
    assert results[0]['shares'] == results[1]['shares']
    # while changing a token before a query does move them
    (tokens, values), second = EXAMPLES
    earlier = [([*tokens[:6], 20, *tokens[7:]], values), second]  # filler at 6, before the query at 8
    torch.manual_seed(3)
    moved = attention_noise(model, str(write_examples(tmp_path / 'earlier', earlier)), 8, 'cpu', NO_AUTOCAST)
    assert moved['shares'] != results[0]['shares']


# ----------------------------------------------------------------------------- eval.py as a user runs it

def test_eval_script_writes_the_shares_and_heatmaps_side_by_side(tmp_path):
    data = write_examples(tmp_path / 'data', EXAMPLES)
    shape = dict(block_size=T, vocab_size=64, n_head=4)
    diff = tiny_checkpoint(tmp_path / 'out-diff', 'diff', data, seed=1, **shape)
    base = tiny_checkpoint(tmp_path / 'out-base', 'base', data, **shape)
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out-diff'}", '--attention_noise=True',
                                          '--device=cpu', '--dtype=float32', '--seed=5',
                                          f"--compare_to={tmp_path / 'out-base'}"])
    assert r.returncode == 0, r.stderr
    out = tmp_path / 'out-diff'
    for name, model in (('attention_noise.json', diff), ('attention_noise_out-base.json', base)):
        written = json.loads((out / name).read_text())
        torch.manual_seed(5)
        expected = attention_noise(model.eval(), str(data), 8, 'cpu', NO_AUTOCAST)
        assert torch.allclose(torch.tensor([written['shares'][part] for part in PARTS]),
                              torch.tensor([expected['shares'][part] for part in PARTS]), atol=1e-6)
        assert (written['lookup']['layer'], written['lookup']['head']) == \
            (expected['lookup']['layer'], expected['lookup']['head'])
        assert written['attn_type'] == model.config.attn_type and written['normalisation'] == 'abs'
    for png in ('attention_noise.png', 'attention_noise_vs_out-base.png'):
        assert (out / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert r.stdout.count('lookup head L') == r.stdout.count('reading layer L') == 2


def test_heatmap_shows_signed_shares_the_chosen_head_and_layer_and_the_uniform_level(tmp_path):
    from test_retrieval import assert_no_overlap
    model = peaked_model('diff')
    result = attention_noise(model, str(write_examples(tmp_path / 'data', EXAMPLES)), 8, 'cpu', NO_AUTOCAST)
    fig = plot_heatmaps([('out-diff', heatmap_panels(result))], 'share')
    panels = [ax for ax in fig.axes if ax.images]
    # a uniform row over keys 0 .. p gives the value 1 / (p + 1): the answers' p are 4, 8, 6, 8, 10
    uniform = sum(1 / (p + 1) for p in (4, 8, 6, 8, 10)) / 5
    assert result['uniform']['value'] == pytest.approx(uniform)
    assert [ax.get_title().split('\n')[1] for ax in panels] == \
        ['answer value, signed; lookup head boxed', 'answer key, signed', 'own token',
         'noise: other pairs, earlier queries,', 'layer as a whole; reading layer boxed']
    assert panels[0].get_title().split('\n')[2].startswith(f"uniform row {uniform:.3f} (mean")
    for ax, part in zip(panels[:4], ('signed_value', 'signed_key', 'own', 'noise')):  # layers x heads
        assert ax.images[0].get_array().ravel().tolist() == pytest.approx(sum(result['shares'][part], []))
        assert ax.images[0].get_clim() == ((-1, 1) if part.startswith('signed') else (0, 1))
    look = result['lookup']
    assert [p.get_xy() for p in panels[0].patches] == [(look['head'] - 0.5, look['layer'] - 0.5)]
    layer_panel = panels[4]  # layers x the six parts, named with a uniform row's level, the reading layer boxed
    columns = ('value', 'key', 'pairs', 'own', 'queries', 'filler')
    u = result['uniform']
    assert [t.get_text() for t in layer_panel.get_xticklabels()] == [
        f"answer value ({u['value']:.3f})", f"answer key ({u['key']:.3f})", f"other pairs ({u['pairs']:.3f})",
        f"own token ({u['own']:.3f})", f"earlier queries ({u['queries']:.3f})", f"filler ({u['filler']:.3f})"]
    assert layer_panel.images[0].get_array().ravel().tolist() == pytest.approx(
        [v for row in zip(*(result['layer_shares'][part] for part in columns)) for v in row])
    assert [p.get_xy() for p in layer_panel.patches] == [(-0.5, result['reading_layer']['layer'] - 0.5)]
    assert layer_panel.get_xlabel() == 'part (all heads together)' and panels[0].get_xlabel() == 'head'
    assert_no_overlap(fig, layer_panel.get_xticklabels())


def test_eval_script_refuses_attention_noise_on_data_without_answers(tmp_path):
    data = tmp_path / 'data'
    data.mkdir()
    torch.arange(40, dtype=torch.int32).numpy().astype('uint16').tofile(data / 'val.bin')
    tiny_checkpoint(tmp_path / 'out', 'base', data, block_size=T, vocab_size=64)
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'out'}", '--attention_noise=True', '--device=cpu'])
    assert r.returncode == 2 and 'Traceback' not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith('eval.py: error:') and 'not a recall dataset' in r.stderr
    assert r.stderr.strip().endswith('probe a model trained on text with --retrieval=True')  # whole, with the fix
    assert 'parameters' not in r.stdout + r.stderr  # refused before the model is loaded (and announced)
    assert not (tmp_path / 'out' / 'attention_noise.json').exists()


def test_a_split_without_labelled_answers_is_a_one_line_error(tmp_path):
    data = write_examples(tmp_path / 'data', [(tokens, {}) for tokens, _ in EXAMPLES])
    with pytest.raises(ValueError, match=r"val_labels.bin scores no position \(every label is -1"):
        attention_noise(peaked_model('base'), str(data), 8, 'cpu', NO_AUTOCAST)
