"""The lm-evaluation-harness adapter (evaluation/lm_eval_adapter.py, eval.py --lm_eval), offline.

Cross-check against code no one here wrote: a tiny random GPT-2 made and saved with `transformers`
(exact GELU, like our MLP), loaded into our GPT, must give through our adapter the same per-example
loglikelihoods as lm-eval's own `hf` model gives through `transformers`, on a local multiple-choice
task (a task YAML over a local jsonl, run by lm_eval.simple_evaluate), and the same rolling
loglikelihoods and greedy generations, including inputs longer than block_size (left truncation).
"""
import json

import pytest
import tiktoken
import torch

import gpt2_bpe
from helpers import (MC_QUESTIONS, NO_AUTOCAST, hf_lm, local_mc_task, per_doc_loglikelihoods, run_script_in_process,
                     save_model_checkpoint)
from model import GPT

# one xdist worker runs this whole file, so its module-scoped fixtures are built once (-n 2 --dist loadfile)

BLOCK = 64
QUESTIONS = MC_QUESTIONS  # the last is longer than BLOCK tokens


@pytest.fixture(scope='module')
def tiny_gpt2(tmp_path_factory):
    """A random 2-layer GPT-2 saved by transformers, with GPT-2's tokenizer, in a local folder."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast
    root = tmp_path_factory.mktemp('lm')
    # tiktoken's GPT-2 files, under the names from_pretrained looks for in transformers 4 and 5 alike
    (root / 'bpe').mkdir()
    (root / 'bpe' / 'vocab.json').write_bytes(gpt2_bpe.gpt2_file('encoder.json'))
    (root / 'bpe' / 'merges.txt').write_bytes(gpt2_bpe.gpt2_file('vocab.bpe'))
    tokenizer = GPT2TokenizerFast.from_pretrained(str(root / 'bpe'))
    assert tokenizer('The capital of France is')['input_ids'] == tiktoken.get_encoding('gpt2').encode('The capital of France is')
    torch.manual_seed(0)
    config = GPT2Config(n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2, activation_function='gelu',
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(config)
    with torch.no_grad():  # a peaked output distribution, so greedy decoding has clear winners
        hf.lm_head.weight.mul_(40)
    hf.save_pretrained(root / 'hf')
    tokenizer.save_pretrained(root / 'hf')
    tasks = local_mc_task(root)
    ours = GPT.from_pretrained(str(root / 'hf'), dict(dropout=0.0)).eval()
    from lm_eval.tasks import TaskManager
    task_manager = TaskManager(include_path=str(tasks))  # indexing lm-eval's task files takes seconds: once
    return dict(root=root, path=str(root / 'hf'), tasks=str(tasks), ours=ours, task_manager=task_manager)


def adapter(model, batch_size=3):
    from denoised_gpt.evaluation.lm_eval_adapter import NanoGPTLM
    return NanoGPTLM(model, tiktoken.get_encoding('gpt2'), 'cpu', NO_AUTOCAST, batch_size=batch_size, max_gen_toks=16)


def test_adapter_matches_lm_evals_hf_model_on_a_local_multiple_choice_task(tiny_gpt2):
    import lm_eval
    from denoised_gpt.evaluation.lm_eval_adapter import run_lm_eval
    table, ours = run_lm_eval(tiny_gpt2['ours'], tiktoken.get_encoding('gpt2'), ['tiny_mc'], batch_size=3,
                              device='cpu', ctx=NO_AUTOCAST, log_samples=True, task_manager=tiny_gpt2['task_manager'])
    theirs = lm_eval.simple_evaluate(model=hf_lm(tiny_gpt2['path']), tasks=['tiny_mc'],
                                     task_manager=tiny_gpt2['task_manager'])
    a, b = per_doc_loglikelihoods(ours, 'tiny_mc'), per_doc_loglikelihoods(theirs, 'tiny_mc')
    assert sorted(a) == list(range(len(QUESTIONS))) and sorted(b) == sorted(a)
    for doc in a:
        assert len(a[doc]) == len(QUESTIONS[doc][1])
        assert a[doc] == pytest.approx(b[doc], abs=1e-4), doc
    assert ours['results']['tiny_mc']['acc,none'] == theirs['results']['tiny_mc']['acc,none']
    assert 'tiny_mc' in table and '|' in table


def test_rolling_loglikelihood_and_greedy_generation_match_hf(tiny_gpt2):
    from lm_eval.api.instance import Instance
    texts = ["A short text.", " ".join(f"token{i}" for i in range(80))]  # the second spans several windows
    rolling = [Instance('loglikelihood_rolling', {}, (t,), i) for i, t in enumerate(texts)]
    gen_args = dict(until=['\n\n'], do_sample=False, max_gen_toks=16)
    prompts = ["Once upon a time", " ".join(["again"] * 80)]  # the second is cut to block_size - 16
    generate = [Instance('generate_until', {}, (p, dict(gen_args)), i) for i, p in enumerate(prompts)]
    ours, hf = adapter(tiny_gpt2['ours']), hf_lm(tiny_gpt2['path'])
    assert len(tiktoken.get_encoding('gpt2').encode(texts[1])) > 2 * BLOCK
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), abs=1e-4)
    ours_text = ours.generate_until(generate)
    assert ours_text == hf.generate_until(generate)
    assert all(len(t) > 0 for t in ours_text)


def test_adapter_batches_do_not_change_loglikelihoods(tiny_gpt2):
    from lm_eval.api.instance import Instance
    reqs = [Instance('loglikelihood', {}, (q, c), i) for i, (q, cs, _) in enumerate(QUESTIONS) for c in cs]
    one = adapter(tiny_gpt2['ours'], batch_size=1).loglikelihood(reqs)
    many = adapter(tiny_gpt2['ours'], batch_size=5).loglikelihood(reqs)
    assert [ll for ll, _ in one] == pytest.approx([ll for ll, _ in many], abs=1e-5)


def test_unknown_task_names_get_a_suggestion(tiny_gpt2):
    from denoised_gpt.evaluation.lm_eval_adapter import check_tasks
    check_tasks(tiny_gpt2['task_manager'], ['tiny_mc', 'hellaswag'])
    with pytest.raises(ValueError, match="unknown task 'tiny_mcc' \\(did you mean 'tiny_mc'\\?\\)"):
        check_tasks(tiny_gpt2['task_manager'], ['tiny_mcc'])


def test_eval_script_runs_a_local_task(tiny_gpt2, tmp_path):
    out = tmp_path / 'out'
    save_model_checkpoint(out, tiny_gpt2['ours'], iter_num=1, best_val_loss=9.0, config={'dataset': 'openwebtext'})
    # in this process, whose lm_eval and transformers are imported already (a subprocess spends 15 s on that)
    r = run_script_in_process('eval.py', [f'--out_dir={out}', '--device=cpu', '--dtype=float32',
                                          f"--lm_eval_include_path={tiny_gpt2['tasks']}", '--lm_eval=tiny_mc'])
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads((out / 'lm_eval.json').read_text())
    assert 0 <= saved['results']['results']['tiny_mc']['acc,none'] <= 1
    assert 'tiny_mc' in r.stdout
