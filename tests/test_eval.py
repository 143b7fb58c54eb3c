"""eval.py: exact validation loss, attention entropy (and the analysis-only attention maps of model.py),
and the script run as a user runs it on tiny checkpoints made here. GLUE: test_eval_glue.py;
lm-evaluation-harness: test_eval_lm.py.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from denoised_gpt.evaluation import exact_val_loss
from denoised_gpt.evaluation.entropy import (attention_entropy, file_name_part, normalised_row_entropy, plot_entropy,
                                             run_name)
from helpers import (NO_AUTOCAST, ROOT, run_script_in_process, subprocess_env, tiny_checkpoint, tiny_gpt,
                     write_tokens)
from model import ATTENTION_TYPES, GPT, GPTConfig, split_heads

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

# the models here: helpers.TINY_MODEL 16 wide, with a context of 16, biases and 40 tokens
SHAPE = dict(block_size=16, vocab_size=40, n_embd=16, bias=True)


def tiny_model(attn_type='base', seed=0, **overrides):
    """tiny_gpt of SHAPE, overrides applied (dint_lowrank at rank 4), in eval mode."""
    return tiny_gpt(attn_type, seed, lowrank_rank=4, **{**SHAPE, **overrides}).eval()


# ----------------------------------------------------------------------------- exact val loss

@pytest.mark.parametrize('n_tokens', [3 * 16 + 1, 3 * 16 + 1 + 5])  # whole windows; plus a short last one
def test_exact_val_loss_predicts_every_token_once_from_its_window(tmp_path, n_tokens):
    model = tiny_model()
    tokens = torch.randint(40, (n_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    path = write_tokens(tmp_path / 'val.bin', tokens)
    # independently: token t is predicted from the tokens since the start of its window (windows of
    # 16 targets starting at 0, 16, 32, ...), one forward pass per token, last-position logits
    nll = []
    with torch.no_grad():
        for t in range(1, n_tokens):
            start = (t - 1) // 16 * 16
            logits, _ = model(torch.tensor([tokens[start:t]]))
            nll.append(-F.log_softmax(logits[0, -1].double(), dim=-1)[tokens[t]].item())
    for bs in (1, 2, 8):
        r = exact_val_loss(model, path, 16, bs, 'cpu', NO_AUTOCAST)
        assert r['tokens'] == n_tokens - 1
        assert r['windows'] == math.ceil((n_tokens - 1) / 16)
        assert r['loss'] == pytest.approx(sum(nll) / len(nll), abs=1e-5)


# ----------------------------------------------------------------------------- entropy

def test_normalised_row_entropy_uniform_is_one_one_hot_is_zero_and_signed_uses_magnitudes():
    T = 6
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1).view(-1, 1)
    assert torch.allclose(normalised_row_entropy(uniform), torch.ones(T - 1, dtype=torch.float64))
    one_hot = torch.eye(T)
    assert torch.allclose(normalised_row_entropy(one_hot), torch.zeros(T - 1, dtype=torch.float64))
    # a signed row with equal magnitudes on its 2 visible keys: |p| uniform -> 1
    signed = torch.tensor([[1.0, 0.0], [0.7, -0.7]])
    assert normalised_row_entropy(signed).item() == pytest.approx(1.0)
    # half the mass on one of 3 keys, a quarter on each other: H = 1.5 log 2, max log 3
    row = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.5, -0.25, 0.25]])
    assert normalised_row_entropy(row)[-1].item() == pytest.approx(1.5 * math.log(2) / math.log(3))


def positional_model(attn_type, q_scale):
    """One layer, two heads of 16 dims, whose input at position t is LayerNorm(wpe[t]) with token
    embeddings zero and wpe[t] one-hot at t in each head's half; q = k = q_scale * input. q_scale = 0:
    every score 0, uniform causal attention. Large q_scale: each head's inputs are distinct vectors of
    equal norm, so by Cauchy-Schwarz the diagonal score wins by a wide margin: one-hot attention."""
    T, C = 16, 32
    model = tiny_model(attn_type, n_layer=1, block_size=T, n_head=2, n_embd=C, bias=False)
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.copy_(torch.cat([torch.eye(T), torch.eye(T)], dim=1))
        w = model.transformer.h[0].attn.c_attn.weight
        w[:2 * C] = 0
        w[:C] = q_scale * torch.eye(C)  # queries (and the keys of symmetric attention)
        if attn_type == 'base':
            w[C:2 * C] = q_scale * torch.eye(C)  # keys
    return model


@pytest.mark.parametrize('attn_type', ['base', 'symmetric'])
def test_entropy_of_a_hand_set_model_uniform_gives_one_one_hot_gives_zero(attn_type):
    idx = torch.randint(40, (3, 16), generator=torch.Generator().manual_seed(0))
    uniform = attention_entropy(positional_model(attn_type, 0.0), [idx], NO_AUTOCAST)
    assert list(uniform) == ['attn'] and len(uniform['attn']) == 1 and len(uniform['attn'][0]) == 2
    assert uniform['attn'][0] == pytest.approx([1.0, 1.0], abs=1e-6)
    one_hot = attention_entropy(positional_model(attn_type, 200.0), [idx], NO_AUTOCAST)
    assert one_hot['attn'][0] == pytest.approx([0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize('attn_type', ['diff', 'dint', 'dint_lowrank'])
def test_differential_entropy_reports_both_branches_and_the_combined_map(attn_type):
    model = tiny_model(attn_type, n_head=4, n_embd=16)
    for block in model.transformer.h:  # zero queries: both branches uniform
        with torch.no_grad():
            block.attn.c_attn.weight[:16] = 0
            block.attn.c_attn.bias[:16] = 0
            if attn_type == 'dint_lowrank':
                block.attn.q2_up.weight.zero_()
    idx = torch.randint(40, (2, 16), generator=torch.Generator().manual_seed(0))
    ent = attention_entropy(model, [idx], NO_AUTOCAST)
    assert sorted(ent) == ['branch1', 'branch2', 'combined']
    heads = model.transformer.h[0].attn.n_diff_heads
    for name in ent:
        assert len(ent[name]) == 2 and all(len(layer) == heads for layer in ent[name])
    assert ent['branch1'][1] == pytest.approx([1.0] * heads, abs=1e-6)
    assert ent['branch2'][1] == pytest.approx([1.0] * heads, abs=1e-6)
    if attn_type == 'diff':  # (1 - lambda) x uniform: the magnitudes are uniform
        assert ent['combined'][1] == pytest.approx([1.0] * heads, abs=1e-6)
    else:  # DINT's integral term A3 leans on early keys, so the combined map is less than uniform
        assert all(0.5 < h < 1 - 1e-3 for h in ent['combined'][1])


def test_attention_maps_times_values_give_each_variants_attention_output():
    """The analysis maps are the matrices the fast paths multiply V by (float64, noise off)."""
    x = torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for attn_type in ATTENTION_TYPES:
        extra = dict(noise_at_eval=False) if 'noise_at_eval' in ATTENTION_TYPES[attn_type].config_fields else {}
        model = tiny_model(attn_type, n_head=4, n_embd=16, **extra).double()
        attn = model.transformer.h[1].attn
        maps = attn.attention_maps(x)
        for a in maps.values():
            assert a.shape[-2:] == (9, 9) and torch.all(a.triu(1) == 0)  # causal
        if 'combined' in maps:
            o1, o2 = attn.branches(x, None)
            lam = attn.lambda_full()
            v = attn.c_attn(x).split(16, dim=2)[2]
            v = split_heads(v, attn.n_diff_heads if attn.heads_per_diff_head == 2 else attn.n_head)
            assert torch.allclose(maps['branch1'] @ v, o1, atol=1e-10)
            assert torch.allclose(maps['branch2'] @ v, o2, atol=1e-10)
            assert torch.allclose(maps['combined'] @ v, attn.combine(o1, o2, lam, None), atol=1e-10)
        else:
            v = split_heads(attn.c_attn(x).split(16, dim=2)[-1], 4)
            assert torch.allclose(attn.c_proj(_merge(maps['attn'] @ v)), attn(x), atol=1e-10), attn_type


def _merge(t):
    B, H, T, d = t.shape
    return t.transpose(1, 2).reshape(B, T, H * d)


def test_side_by_side_figure_shows_only_the_maps_that_exist_each_titled_by_run_and_map(tmp_path):
    def layers(value):
        return [[value, value / 2], [value / 3, value / 4]]  # 2 layers x 2 heads
    dint = {'branch1': layers(0.9), 'branch2': layers(0.8), 'combined': layers(0.7)}
    base = {'attn': layers(0.6)}
    fig = plot_entropy([('out-x/merged', dint), ('out-base', base)], tmp_path / 'vs.png')
    assert (tmp_path / 'vs.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    panels = [ax for ax in fig.axes if ax.images]
    expected = [('out-x/merged', 'branch1'), ('out-x/merged', 'branch2'), ('out-x/merged', 'combined'),
                ('out-base', 'attn')]
    assert len(panels) == len(expected)  # no panel for a map a run does not have
    for ax, (run, name), values in zip(panels, expected, [dint['branch1'], dint['branch2'], dint['combined'],
                                                           base['attn']]):
        run_line, map_line = ax.get_title().split('\n')
        assert run_line == run and map_line.startswith(f"{name} (mean ")
        assert ax.images[0].get_clim() == (0, 1)
        assert ax.images[0].get_array().ravel().tolist() == pytest.approx(sum(values, []))  # rows: layers
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, 'get_text'))]
    assert not any('has no' in t for t in texts)  # no placeholder panels
    assert len(fig.axes) == len(panels) + 1  # and nothing else but the colour bar
    # three panels a row, so the figure reads at a page's width; the colour bar below them, in words
    rows = [round(ax.get_position().y0, 3) for ax in panels]
    assert rows[0] == rows[1] == rows[2] > rows[3]
    assert fig.axes[-1].get_xlabel() == 'normalised entropy H / log(keys)'
    assert fig.get_size_inches()[0] * 100 <= 1100


def test_run_name_identifies_a_run_whose_directory_name_is_generic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_name('out-x/merged') == run_name('out-x/merged/') == 'out-x/merged'
    assert run_name(tmp_path / 'out-finetune-linear-lora' / 'merged') == 'out-finetune-linear-lora/merged'
    assert run_name('out-x') == run_name('./out-x/') == 'out-x'
    assert run_name('out-x/ckpt.prev.pt') == 'out-x/ckpt.prev.pt'  # a checkpoint file: its run too
    (tmp_path / 'merged').mkdir()
    monkeypatch.chdir(tmp_path / 'merged')
    assert run_name('.') == f"{tmp_path.name}/merged"
    assert file_name_part('out-x/merged') == 'out-x_merged' and file_name_part('out-x') == 'out-x'


# ----------------------------------------------------------------------------- eval.py as a user runs it
# (a subprocess; its refusals run in this process, which spares each a torch start-up)

def launch(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / 'eval.py'), *map(str, args)], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=240)


def refused(*args):
    return run_script_in_process('eval.py', args)


@pytest.fixture(scope='module')
def char_run(tmp_path_factory):
    root = tmp_path_factory.mktemp('eval')
    data = root / 'data-char'
    chars = sorted(set('abcdefghij \n'))
    data.mkdir()
    (data / 'meta.json').write_text(json.dumps({'vocab_size': len(chars), 'tokenizer': 'char', 'chars': chars}))
    tokens = torch.randint(len(chars), (300,), generator=torch.Generator().manual_seed(5)).tolist()
    write_tokens(data / 'val.bin', tokens)
    # untrained models saved as train.py saves them, with a context of 32
    shape = {**SHAPE, 'block_size': 32, 'vocab_size': len(chars)}
    base_dir, diff_dir = root / 'out-base', root / 'out-diff'
    base = tiny_checkpoint(base_dir, 'base', data, **shape)
    tiny_checkpoint(diff_dir, 'diff', data, seed=1, **shape)
    return dict(root=root, data=data, base_dir=base_dir, base=base, diff_dir=diff_dir)


@pytest.mark.slow
def test_eval_script_val_loss_and_entropy_with_a_side_by_side(char_run):
    r = launch(f"--out_dir={char_run['diff_dir']}", '--val_loss=True', '--entropy=True', '--device=cpu',
               '--dtype=float32', '--entropy_batches=2', '--batch_size=3', f"--compare_to={char_run['base_dir']}")
    assert r.returncode == 0, r.stderr
    out = char_run['diff_dir']
    val = json.loads((out / 'val_loss.json').read_text())
    diff_model = GPT(GPTConfig(**{**dataclasses.asdict(char_run['base'].config), 'attn_type': 'diff'}))
    diff_model.load_state_dict(torch.load(out / 'ckpt.pt', weights_only=True)['model'])
    expected = exact_val_loss(diff_model.eval(), char_run['data'] / 'val.bin', 32, 5, 'cpu', NO_AUTOCAST)
    assert val['tokens'] == 299 and val['loss'] == pytest.approx(expected['loss'], abs=1e-6)
    assert f"val loss {expected['loss']:.4f}" in r.stdout
    ent = json.loads((out / 'entropy.json').read_text())
    assert sorted(ent['entropy']) == ['branch1', 'branch2', 'combined']
    assert all(0 < h <= 1 for layer in ent['entropy']['combined'] for h in layer)
    theirs = json.loads((out / 'entropy_out-base.json').read_text())
    assert list(theirs['entropy']) == ['attn'] and theirs['attn_type'] == 'base'
    for png in ('entropy.png', 'entropy_vs_out-base.png'):
        assert (out / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('trained_in', ['float32', 'bfloat16'])
def test_eval_script_measures_a_checkpoint_in_the_dtype_it_was_trained_in(char_run, tmp_path, trained_in):
    """dtype='auto' takes the run's training dtype (where the device runs it), not the device's fastest: a
    model trained in float32 can answer differently in bfloat16 (linear attention on recall did)."""
    from helpers import save_model_checkpoint
    save_model_checkpoint(tmp_path, char_run['base'], config={'dataset': str(char_run['data']), 'dtype': trained_in})
    r = run_script_in_process('eval.py', [f'--out_dir={tmp_path}', '--val_loss=True', '--device=cpu'])
    assert r.returncode == 0, r.stderr
    assert f"device cpu ({trained_in})" in r.stderr
    if trained_in == 'float32':
        expected = exact_val_loss(char_run['base'].eval(), char_run['data'] / 'val.bin', 32, 5, 'cpu', NO_AUTOCAST)
        assert json.loads((tmp_path / 'val_loss.json').read_text())['loss'] == pytest.approx(expected['loss'], abs=1e-6)


@pytest.mark.parametrize('args, message', [
    (['--entropy=True', '--batch_size=100000000'],
     "batch_size=100000000 is over the limit of 65,536 sequences per forward pass"),  # (numpy's allocator raised)
    (['--entropy=True', f'--entropy_batches={10**40}'],
     "entropy_batches=100000000000... (41 digits) is over the limit of 1,000,000 batches"),
])
def test_counts_past_any_real_use_are_refused_before_any_work(tmp_path, args, message):
    r = run_script_in_process('eval.py', [f'--out_dir={tmp_path}', '--device=cpu', *args])
    assert r.returncode == 2 and r.stderr.strip() == f"eval.py: error: {message}", r.stderr


def test_eval_script_refuses_glue_and_lm_eval_for_a_char_level_model(char_run):
    for arg in ('--glue=all', '--lm_eval=hellaswag'):
        r = refused(f"--out_dir={char_run['base_dir']}", arg, '--device=cpu')
        assert r.returncode == 2
        assert 'Traceback' not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith('eval.py: error:') and 'GPT-2 vocabulary' in r.stderr


def test_eval_script_bad_settings_fail_in_one_line(char_run):
    cases = [([], 'nothing to evaluate'),
             (['--val_loss=True', '--dataset=no-such-data'], 'val.bin not found'),
             (['--val_loss=True', '--noise_at_eval=False'], 'NoiseFormer')]
    for args, message in cases:
        r = refused(f"--out_dir={char_run['base_dir']}", '--device=cpu', *args)
        assert r.returncode == 2, args
        assert message in r.stderr and 'Traceback' not in r.stderr, (args, r.stderr)


def test_eval_script_a_bad_id_met_while_drawing_entropy_batches_is_one_line(char_run, tmp_path, monkeypatch):
    """A val.bin too large to scan up front (FULL_SCAN_TOKENS, lowered here) whose meta.json vouches for its
    ids, rewritten since with an id past the vocabulary: the batch that draws it stops eval.py in one line."""
    import denoised_gpt.batches as batches
    monkeypatch.setattr(batches, 'FULL_SCAN_TOKENS', 0)
    data = tmp_path / 'data-changed'
    data.mkdir()
    meta = json.loads((char_run['data'] / 'meta.json').read_text())
    (data / 'meta.json').write_text(json.dumps({**meta, 'val_tokens': 300, 'val_max_id': meta['vocab_size'] - 1}))
    write_tokens(data / 'val.bin', [meta['vocab_size']] * 300)
    r = run_script_in_process('eval.py', [f"--out_dir={char_run['base_dir']}", f"--eval_dir={tmp_path / 'eval'}",
                                          '--entropy=True', f'--dataset={data}', '--device=cpu',
                                          '--entropy_batches=1', '--batch_size=2'])
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith('eval.py: error: ')]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.stderr
    assert f"holds token id {meta['vocab_size']} at position" in errors[0] and "so the file changed" in errors[0]


def test_eval_script_data_of_another_tokenizer_gets_a_fix_eval_can_take(char_run, tmp_path):
    """The model's vocabulary is its checkpoint's: the fix is other data (eval.py has no vocab_size)."""
    data = tmp_path / 'data-other'
    data.mkdir()
    meta = json.loads((char_run['data'] / 'meta.json').read_text())
    (data / 'meta.json').write_text(json.dumps({**meta, 'vocab_size': meta['vocab_size'] + 10}))
    write_tokens(data / 'val.bin', [1] * 50 + [meta['vocab_size'] + 5] * 250)
    r = run_script_in_process('eval.py', [f"--out_dir={char_run['base_dir']}", f"--eval_dir={tmp_path / 'eval'}",
                                          '--val_loss=True', f'--dataset={data}', '--device=cpu'])
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"eval.py: error: {data / 'val.bin'} holds token id {meta['vocab_size'] + 5} at position 50, but vocab_size "
        f"is {meta['vocab_size']}: the file was made with another tokenizer than the model's: prepare it again with "
        f"its prepare.py, or give the data the model was trained on (--dataset)")


@pytest.mark.parametrize('wrong', ['missing', 'no_checkpoint_inside', 'not_a_checkpoint'])
def test_eval_script_a_wrong_compare_to_fails_before_any_entropy_is_computed(char_run, tmp_path, wrong):
    compare_to = {'missing': tmp_path / 'out-bsae', 'no_checkpoint_inside': char_run['root'],
                  'not_a_checkpoint': tmp_path / 'notes.txt'}[wrong]
    (tmp_path / 'notes.txt').write_text('not a checkpoint\n')
    eval_dir = tmp_path / 'eval'
    r = run_script_in_process('eval.py', [f"--out_dir={char_run['diff_dir']}", f"--eval_dir={eval_dir}",
                                          '--entropy=True', '--val_loss=True', f"--compare_to={compare_to}",
                                          '--device=cpu', '--entropy_batches=1', '--batch_size=2'])
    assert r.returncode == 2
    assert r.stdout == ''  # no val loss, no entropy printed
    assert not (eval_dir / 'entropy.json').exists() and not (eval_dir / 'val_loss.json').exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"eval.py: error: compare_to={str(compare_to)!r}: ")
    assert 'out_dir at' not in lines[0]  # read_checkpoint's advice for out_dir, the wrong flag here
    if wrong != 'not_a_checkpoint':
        assert f"no checkpoint at {compare_to / 'ckpt.pt'}; give the out_dir of the run to compare with" in lines[0]


def test_eval_script_names_a_merged_run_by_its_run_directory_too(char_run, tmp_path):
    merged = tmp_path / 'out-x' / 'merged'
    tiny_checkpoint(merged, 'base', char_run['data'], seed=2, **{**SHAPE, 'block_size': 32,
                                                              'vocab_size': char_run['base'].config.vocab_size})
    eval_dir = tmp_path / 'eval'
    r = run_script_in_process('eval.py', [f"--out_dir={char_run['diff_dir']}", f"--eval_dir={eval_dir}",
                                          '--entropy=True', f"--compare_to={merged}", '--device=cpu',
                                          '--dtype=float32', '--entropy_batches=1', '--batch_size=2'])
    assert r.returncode == 0, r.stderr
    theirs = json.loads((eval_dir / 'entropy_out-x_merged.json').read_text())
    assert list(theirs['entropy']) == ['attn'] and theirs['checkpoint'] == str(merged / 'ckpt.pt')
    assert (eval_dir / 'entropy_vs_out-x_merged.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert 'compare_to out-x/merged (attn):' in r.stdout


def test_eval_script_an_eval_dir_it_cannot_write_in_fails_in_one_line_before_the_model_loads(char_run, tmp_path):
    """A file, a path through a file, a name too long; glue_cache_dir likewise (checked before the char-level
    model is refused GLUE, so before it loads). A nested eval_dir made for the check is removed again when
    the run then fails (here: no checkpoint)."""
    too_long = tmp_path / ('x' * 300)
    notes = tmp_path / 'notes.txt'
    notes.write_text('mine\n')
    cases = [(['--val_loss=True', f"--eval_dir={notes}"],
              f"eval_dir={str(notes)!r} is a file, not a folder: choose another folder with --eval_dir"),
             (['--val_loss=True', f"--eval_dir={notes / 'eval'}"],
              f"eval_dir={str(notes / 'eval')!r} cannot be written (Not a directory)"),
             (['--val_loss=True', f"--eval_dir={too_long}"],
              f"eval_dir={str(too_long)!r} cannot be written (File name too long)"),
             (['--glue=sst2', f"--eval_dir={tmp_path / 'eval'}", f"--glue_cache_dir={notes}"],
              f"glue_cache_dir={str(notes)!r} is a file, not a folder")]
    for args, message in cases:
        r = run_script_in_process('eval.py', [f"--out_dir={char_run['base_dir']}", '--device=cpu', *args])
        assert r.returncode == 2 and r.stdout == '', (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(f"eval.py: error: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt']
    r = run_script_in_process('eval.py', [f"--out_dir={tmp_path / 'no-run'}", '--val_loss=True',
                                          f"--eval_dir={tmp_path / 'new' / 'eval'}"])
    assert r.returncode == 2 and 'no checkpoint at' in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt']


def test_eval_script_a_full_disk_when_writing_results_is_one_line_and_keeps_the_earlier_file(char_run, tmp_path):
    """val_loss.json.tmp a link to /dev/full: every write to it fails with ENOSPC (a traceback before, and
    the .tmp left behind); an entropy heatmap likewise."""
    eval_dir = tmp_path / 'eval'
    eval_dir.mkdir()
    for measure, name in (('--val_loss=True', 'val_loss.json'), ('--entropy=True', 'entropy.png')):
        (eval_dir / name).write_text('the earlier result\n')
        (eval_dir / f"{name}.tmp").symlink_to('/dev/full')
        r = run_script_in_process('eval.py', [f"--out_dir={char_run['base_dir']}", f"--eval_dir={eval_dir}", measure,
                                              '--device=cpu', '--entropy_batches=1'])
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines()[-1] == (
            f"eval.py: error: cannot write {eval_dir / name}: no space left on device; the file there before is "
            f"intact. Free some space and evaluate again")
        assert not os.path.lexists(eval_dir / f"{name}.tmp") and (eval_dir / name).read_text() == 'the earlier result\n'


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists('/dev/full'), reason="needs /dev/full (every write: ENOSPC)")
def test_eval_script_a_stdout_that_cannot_take_the_results_is_one_line(char_run, tmp_path):
    """`eval.py > /dev/full`: a full disk behind stdout was an OSError traceback."""
    with open('/dev/full', 'w') as full:
        proc = subprocess.run([sys.executable, str(ROOT / 'eval.py'), f"--out_dir={char_run['base_dir']}",
                               f"--eval_dir={tmp_path / 'eval'}", '--val_loss=True', '--device=cpu'], cwd=ROOT,
                              env=subprocess_env(), text=True, stdout=full, stderr=subprocess.PIPE, timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("eval.py: error: cannot write the results to /dev/full: no space "
                                                    "left on device; free some space and run it again")
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
