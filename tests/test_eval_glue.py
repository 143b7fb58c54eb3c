"""The GLUE frozen-backbone probe (evaluation/glue.py and eval.py --glue), offline: a local dataset folder
in nyu-mll/glue's layout (parquet files + the README's config list), read by the real `datasets`
loader. A synthetic task whose label is the last token must be learned (~100 %); the same texts with
shuffled labels must stay at chance. Features are cached in chunks and reused after an interruption.
"""
import json
import os
import random
import subprocess
import sys

import pytest
import tiktoken
import torch

import gpt2_bpe
from denoised_gpt.evaluation import final_hidden_states, glue
from helpers import NO_AUTOCAST, ROOT, save_model_checkpoint, subprocess_env, tiny_gpt

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

WORDS = 'the a cat dog sat ran on under red blue house tree quickly slowly'.split()


def gpt2_vocab_model(attn_type='base', seed=0):
    """helpers.TINY_MODEL with biases and GPT-2's (padded) vocabulary, in eval mode."""
    return tiny_gpt(attn_type, seed, vocab_size=50304, bias=True).eval()


def synthetic_rows(n, rng, shuffle_labels=False):
    """SST-2's columns; the label is 1 when the sentence ends in ' good', 0 when it ends in ' bad'."""
    rows = []
    for i in range(n):
        label = rng.randrange(2)
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))] + ['good' if label else 'bad']
        rows.append(dict(sentence=' '.join(words), label=label, idx=i))
    if shuffle_labels:
        labels = [rng.randrange(2) for _ in rows]  # independent of the text
        rows = [{**r, 'label': l} for r, l in zip(rows, labels)]
    return rows


def write_glue_folder(root, tables):
    """tables: {config: {split: rows}} -> a folder that datasets.load_dataset(root, config) reads as
    it reads nyu-mll/glue: parquet files per config and split, declared in README.md's YAML header."""
    import datasets
    readme = ['---', 'configs:']
    for config, splits in tables.items():
        readme += [f'- config_name: {config}', '  data_files:']
        for split, rows in splits.items():
            (root / config).mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_list(rows).to_parquet(str(root / config / f'{split}-00000-of-00001.parquet'))
            readme += [f'  - split: {split}', f'    path: {config}/{split}-*']
    (root / 'README.md').write_text('\n'.join(readme + ['---', '']))
    return root


@pytest.fixture(scope='module')
def glue_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp('glue')
    rng = random.Random(0)
    learnable = write_glue_folder(root / 'learnable', {'sst2': {'train': synthetic_rows(96, rng),
                                                                'validation': synthetic_rows(64, rng)}})
    shuffled = write_glue_folder(root / 'shuffled', {'sst2': {'train': synthetic_rows(96, rng, True),
                                                              'validation': synthetic_rows(64, rng, True)}})
    return dict(root=root, learnable=learnable, shuffled=shuffled)


def run_probe(model, path, cache_dir, seeds=(0,)):
    settings = dict(epochs=40, lr=1e-2, weight_decay=0.0, batch_size=0, max_examples=0, noise_draws=1,
                    seeds=list(seeds))
    info = dict(identity='test-model', noise_on=False)
    return glue.run(model, info, tiktoken.get_encoding('gpt2'), ['sst2'], str(path), str(cache_dir), settings,
                    extract_batch_size=4, device='cpu', ctx=NO_AUTOCAST, seed=0, dtype='float32',
                    log=lambda m: None)


def test_probe_learns_a_last_token_label_and_stays_at_chance_on_shuffled_labels(glue_dirs, tmp_path):
    gpt2_bpe.require()  # tiktoken's GPT-2 files: skipped only when neither cached nor downloadable
    model = gpt2_vocab_model()
    learned = run_probe(model, glue_dirs['learnable'], tmp_path / 'c1', seeds=(0, 1))
    acc = learned['sst2']['splits']['validation']['accuracy']
    assert len(acc['values']) == 2 and min(acc['values']) >= 0.95
    assert learned['sst2']['batch_size'] == 32  # the paper's rule for a small training set
    chance = run_probe(model, glue_dirs['shuffled'], tmp_path / 'c2')
    assert 0.3 <= chance['sst2']['splits']['validation']['accuracy']['mean'] <= 0.7


def test_metrics_agree_with_scikit_learn():
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        gold, pred = torch.randint(2, (50,), generator=g), torch.randint(2, (50,), generator=g)
        assert glue.accuracy(pred, gold) == pytest.approx(accuracy_score(gold, pred))
        assert glue.f1_score(pred, gold) == pytest.approx(f1_score(gold, pred))
        assert glue.matthews_corrcoef(pred, gold) == pytest.approx(matthews_corrcoef(gold, pred))


def test_pairs_are_joined_by_a_newline_and_long_texts_keep_their_end():
    gpt2_bpe.require()  # tiktoken's GPT-2 files: skipped only when neither cached nor downloadable
    enc = tiktoken.get_encoding('gpt2')
    rows = [dict(sentence1='Hello there.', sentence2='General Kenobi!')]
    assert glue.encode_examples(enc, rows, ('sentence1', 'sentence2'), 100) == [enc.encode('Hello there.\nGeneral Kenobi!')]
    long = [dict(sentence=' '.join(['word'] * 50) + ' end')]
    ids = glue.encode_examples(enc, long, ('sentence',), 8)[0]
    assert len(ids) == 8 and enc.decode(ids[-1:]) == ' end'


@pytest.mark.parametrize('attn_type', ['base', 'dint', 'linear'])
def test_padded_batches_give_the_features_of_one_sequence_at_a_time(attn_type):
    model = gpt2_vocab_model(attn_type)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(50257, (n,), generator=g).tolist() for n in (5, 12, 1, 9, 12, 3)]
    batched = glue.pooled_features(model, seqs, tokens_per_batch=40, device='cpu', ctx=NO_AUTOCAST, noise_draws=1)
    for s, f in zip(seqs, batched):
        alone = final_hidden_states(model, torch.tensor([s]))[0, -1]
        assert torch.allclose(f, alone, atol=1e-5)


def test_an_interrupted_extraction_reuses_the_chunks_it_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(glue, 'CHUNK', 4)
    model = gpt2_vocab_model()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(50257, (6,), generator=g).tolist() for _ in range(10)]  # chunks of 4, 4, 2
    path = str(tmp_path / 'f.pt')
    args = dict(tokens_per_batch=6 * 4, device='cpu', ctx=NO_AUTOCAST, noise_draws=1, seed=0, desc='test')
    full = glue.cached_features(model, seqs, path, **args)
    assert torch.allclose(full, glue.pooled_features(model, seqs, 24, 'cpu', NO_AUTOCAST, 1))
    assert not os.path.exists(path + '.parts')  # joined into one file once finished
    # a run killed after its first chunk: only part 0 on disk (marked, to see that it is read, not recomputed)
    os.remove(path)
    os.makedirs(path + '.parts')
    torch.save(torch.full((4, 32), 7.0), os.path.join(path + '.parts', '000000.pt'))
    calls = []
    handle = model.register_forward_hook(lambda m, a, o: calls.append(a[0].size(0)))
    resumed = glue.cached_features(model, seqs, path, **args)
    handle.remove()
    assert torch.all(resumed[:4] == 7.0) and torch.allclose(resumed[4:], full[4:])
    assert sum(calls) == 6  # only the 6 examples of the missing chunks went through the model
    calls.clear()
    handle = model.register_forward_hook(lambda m, a, o: calls.append(a[0].size(0)))
    again = glue.cached_features(model, seqs, path, **args)  # finished cache: no forward pass at all
    handle.remove()
    assert calls == [] and torch.equal(again, resumed)


def test_eval_script_writes_the_glue_table_json_and_feature_cache(glue_dirs, tmp_path):
    gpt2_bpe.require()  # tiktoken's GPT-2 files: skipped only when neither cached nor downloadable
    model = gpt2_vocab_model()
    out = tmp_path / 'out-gpt2-vocab'
    save_model_checkpoint(out, model, iter_num=3, best_val_loss=9.0, config={'dataset': 'openwebtext'})
    args = [sys.executable, str(ROOT / 'eval.py'), f'--out_dir={out}', '--glue=sst2', '--device=cpu', '--dtype=float32',
            f"--glue_path={glue_dirs['learnable']}", '--glue_epochs=40', '--glue_lr=1e-2', '--seeds=0,1']
    r = subprocess.run(args, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    result = json.loads((out / 'glue.json').read_text())
    acc = result['results']['sst2']['splits']['validation']['accuracy']
    assert acc['values'] == pytest.approx(run_probe(model, glue_dirs['learnable'], tmp_path / 'c',
                                                      seeds=(0, 1))['sst2']['splits']['validation']['accuracy']['values'])
    header, rule, row = r.stdout.strip().splitlines()[:3]
    assert header == '| Model | SST-2 (acc) |' and row.startswith('| out-gpt2-vocab | ') and ' ± ' in row
    assert (out / 'glue.md').read_text().startswith(header)
    cached = sorted(p.name for p in (out / 'glue_cache').iterdir())
    assert len(cached) == 2 and cached[0].startswith('sst2-train-') and cached[1].startswith('sst2-validation-')


def test_task_names_are_checked_with_the_list_of_valid_ones():
    assert glue.parse_tasks('all') == ['mrpc', 'cola', 'mnli', 'qqp', 'rte', 'qnli', 'sst2']
    assert glue.parse_tasks('SST-2, mnli') == ['sst2', 'mnli']
    with pytest.raises(glue.GlueError, match="unknown task colaa; use 'all' or a comma-separated list of mrpc"):
        glue.parse_tasks('sst2,colaa')


def test_noiseformer_features_are_seeded_and_averaged_over_draws(tmp_path):
    model = gpt2_vocab_model('noiseformer_v2')
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.noise_sigma.fill_(3.0)  # loud enough to move the features
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(50257, (8,), generator=g).tolist() for _ in range(6)]
    args = dict(tokens_per_batch=48, device='cpu', ctx=NO_AUTOCAST, seed=5, desc='test')
    one = glue.cached_features(model, seqs, str(tmp_path / 'a.pt'), noise_draws=1, **args)
    again = glue.cached_features(model, seqs, str(tmp_path / 'b.pt'), noise_draws=1, **args)
    four = glue.cached_features(model, seqs, str(tmp_path / 'c.pt'), noise_draws=4, **args)
    assert torch.equal(one, again)  # the same seed draws the same noise
    assert not torch.allclose(one, four, atol=1e-3)
    # the mean over 4 draws is the mean of 4 single-draw features taken in the same order from the same seed
    torch.manual_seed(5)
    singles = [glue.pooled_features(model, seqs, 48, 'cpu', NO_AUTOCAST, 1) for _ in range(4)]
    assert torch.allclose(four, sum(singles) / 4, atol=1e-5)
    model.transformer.h[0].attn.noise_at_eval = model.transformer.h[1].attn.noise_at_eval = False
    quiet = glue.pooled_features(model, seqs, 48, 'cpu', NO_AUTOCAST, 1)
    assert not torch.allclose(one, quiet, atol=1e-3) and torch.equal(quiet, glue.pooled_features(model, seqs, 48, 'cpu', NO_AUTOCAST, 1))
