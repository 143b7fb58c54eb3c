"""qk_head_size (query/key heads wider than value heads) and grow.py / growth.py: the closed form's
linear algebra in float64, the gradient the hooks collect, 'zero' growth preserving the function
exactly, and a grown checkpoint resumed by train.py (DDP with gloo, bf16 autocast)."""
import math
import os
import subprocess
import sys

import pytest
import torch

from denoised_gpt import growth
from denoised_gpt.checkpoint import read_checkpoint
from helpers import (ROOT, make_dataset, on_small_disk, run_script_in_process, run_train, run_train_in_process,
                     save_model_checkpoint, small_disk_available, subprocess_env, tiny_checkpoint, tiny_gpt,
                     without_root_file_access)
from model import ATTENTION_TYPES, GPT, GPTConfig

VOCAB = 11


def tiny(qk_head_size=None, bias=True, attn_type='base', block_size=16, seed=0):
    """An 8-wide float64 model of VOCAB tokens, in eval mode, its weights moved off their init."""
    model = tiny_gpt(attn_type, seed, n_embd=8, block_size=block_size, vocab_size=VOCAB, bias=bias,
                     qk_head_size=qk_head_size).double().eval()
    with torch.no_grad():  # trained-looking weights: init's zero biases would hide bias mistakes
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def tokens(batch, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, T), generator=g), torch.randint(0, VOCAB, (batch, T), generator=g)


def naive_logits(model, idx):
    """The model's logits from its weights, attention written out with the 1/sqrt(qk_head_size) scale."""
    tr, T = model.transformer, idx.size(1)
    x = tr.wte(idx) + tr.wpe(torch.arange(T))
    for block in tr.h:
        a = block.attn
        h = block.ln_1(x)
        out = a.c_attn(h)
        w = a.n_head * a.qk_head_size
        if a.qk_projections == 2:
            q, k, v = out[..., :w], out[..., w:2 * w], out[..., 2 * w:]
        else:  # symmetric
            q, v = out[..., :w], out[..., w:]
            k = q
        q, k = (t.view(*t.shape[:2], a.n_head, -1).transpose(1, 2) for t in (q, k))
        v = v.view(*v.shape[:2], a.n_head, -1).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / math.sqrt(a.qk_head_size)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float('-inf'))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(*x.shape)
        x = x + a.c_proj(y)
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(tr.ln_f(x))


# ----------------------------------------------------------------------------------------------
# qk_head_size in the model

@pytest.mark.parametrize('attn_type', ['base', 'symmetric'])
def test_qk_head_size_widens_queries_and_keys_only(attn_type):
    default, wide = tiny(attn_type=attn_type), tiny(qk_head_size=12, attn_type=attn_type)
    n_qk = 2 if attn_type == 'base' else 1
    assert default.transformer.h[0].attn.c_attn.weight.shape == ((n_qk + 1) * 8, 8)  # unchanged: n_embd each
    assert wide.transformer.h[0].attn.c_attn.weight.shape == (n_qk * 2 * 12 + 8, 8)
    assert wide.transformer.h[0].attn.c_proj.weight.shape == (8, 8)
    idx, _ = tokens(3, 16)
    for model in (default, wide):
        logits = model(idx, idx)[0]
        torch.testing.assert_close(logits, naive_logits(model, idx), rtol=1e-10, atol=1e-10)
    # the KV cache holds the wider keys: cached and cache-free generation agree
    a = wide.generate(idx[:, :4], 8, temperature=0)
    b = wide.generate(idx[:, :4], 8, temperature=0, use_cache=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize('attn_type', [t for t in ATTENTION_TYPES if t not in ('base', 'symmetric')])
def test_other_variants_refuse_qk_head_size(attn_type):
    with pytest.raises(ValueError, match=f"qk_head_size=12 is only used by attn_type base / symmetric, but "
                                         f"attn_type='{attn_type}'; remove qk_head_size"):
        GPTConfig(n_head=2, n_embd=8, attn_type=attn_type, qk_head_size=12)


@pytest.mark.parametrize('bad', [0, -4, 2.5])
def test_qk_head_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"qk_head_size={bad!r} must be a positive int"):
        GPTConfig(n_head=2, n_embd=8, qk_head_size=bad)


def test_checkpoint_round_trip_with_qk_head_size(tmp_path):
    model = tiny(qk_head_size=12)
    save_model_checkpoint(tmp_path, model, optimizer=None, iter_num=3, best_val_loss=1.0)
    ckpt = read_checkpoint(tmp_path)[1]
    assert ckpt['model_args']['qk_head_size'] == 12 and ckpt['optimizer'] is None
    again = GPT(GPTConfig(**ckpt['model_args'])).double().eval()
    again.load_state_dict(ckpt['model'])
    idx, _ = tokens(2, 16)
    assert torch.equal(again(idx, idx)[0], model(idx, idx)[0])


# ----------------------------------------------------------------------------------------------
# The closed form's linear algebra, float64

@pytest.mark.parametrize('T, n', [(12, 5), (4, 9)])  # tall X (full column rank) and wide X (T < n)
def test_least_squares_product_satisfies_the_normal_equations(T, n):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(T, n, generator=g, dtype=torch.float64)
    B = torch.randn(T, T, generator=g, dtype=torch.float64)
    Z = growth.least_squares_product(X, B)
    XtX = X.T @ X
    torch.testing.assert_close(XtX @ Z @ XtX, X.T @ B @ X, rtol=1e-10, atol=1e-10)
    # and it is the minimiser: any perturbation leaves a residual at least as large
    best = (B - X @ Z @ X.T).square().sum()
    for _ in range(5):
        other = Z + 1e-3 * torch.randn(n, n, generator=g, dtype=torch.float64)
        assert (B - X @ other @ X.T).square().sum() >= best


def test_truncated_factors_reach_the_eckart_young_residual():
    g = torch.Generator().manual_seed(1)
    Z = torch.randn(9, 9, generator=g, dtype=torch.float64)
    sigma = torch.linalg.svdvals(Z)
    for r in (1, 4, 9):
        wq, wk = growth.truncated_factors(Z, r)
        assert wq.shape == wk.shape == (9, r)
        residual = (Z - wq @ wk.T).square().sum()
        torch.testing.assert_close(residual, sigma[r:].square().sum(), rtol=1e-10, atol=1e-12)
        # balanced: both factors carry S^(1/2)
        torch.testing.assert_close(torch.linalg.svdvals(wq), sigma[:r].sqrt(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('T', [5, 16])  # fewer and more tokens than C + 1 = 9
def test_closed_form_with_p0_and_zero_gradient_returns_the_product_on_the_row_space(T):
    model = tiny(bias=True, block_size=16)
    attn = model.transformer.h[1].attn
    idx, _ = tokens(1, T)
    seen = {}
    growth.explicit_forward(model, idx, idx, lambda layer, x, s: seen.setdefault(layer, (x.detach(), s.detach())))
    x, scores = seen[1]
    d = attn.qk_head_size
    stats = growth.GrowthStatistics(2, 9, d, True, step_size=1.0, rtol=None)
    stats.add(x, scores, torch.zeros_like(scores))  # zero gradient
    wq, wk = growth.closed_form_factors(stats.Z / stats.sequences, d, d)  # p = 0
    X = growth.with_ones(x[0], True)
    P = torch.linalg.pinv(X) @ X  # projector onto the row space of X
    old_q, old_k = growth.head_factors(attn)
    for h in range(2):
        M = old_q[h] @ old_k[h].T
        torch.testing.assert_close(wq[h] @ wk[h].T, P @ M @ P, rtol=1e-8, atol=1e-10)
        # so the scores on these tokens are exactly the old ones (P drops only what X cannot see)
        torch.testing.assert_close(X @ wq[h] @ wk[h].T @ X.T, X @ M @ X.T, rtol=1e-8, atol=1e-10)
    # LayerNorm puts every row of X~ = [X, 1] on a hyperplane: even with T > C + 1 tokens, P is a
    # proper projection and the product off the row space is dropped
    assert torch.linalg.matrix_rank(X) < 9


def grown_zero(model, d_new):
    state, _ = growth.grown_state_dict(model, d_new, 'zero', chosen=list(range(model.config.n_layer)))
    grown = GPT(GPTConfig(**{**model.config.__dict__, 'qk_head_size': d_new})).to(model.lm_head.weight.dtype).eval()
    grown.load_state_dict(state)
    return grown


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('d_old, d_new, n_embd', [(1, 16, 16), (4, 64, 64)])
def test_zero_growth_leaves_the_outputs_bit_identical(dtype, bias, d_old, d_new, n_embd):
    # d_new / d_old a power of 16: the folded sqrt(d_new / d_old) and the kernels' split of the
    # 1/sqrt(d) scale over q and k are then powers of two, so every product rounds as before
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=n_embd, block_size=16, vocab_size=VOCAB, bias=bias,
                          qk_head_size=d_old)).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    grown = grown_zero(model, d_new)
    idx, targets = tokens(3, 16)
    logits, loss = model(idx, targets)
    grown_logits, grown_loss = grown(idx, targets)
    assert torch.equal(grown_logits, logits) and torch.equal(grown_loss, loss)
    assert torch.equal(grown.generate(idx[:, :3], 6, temperature=0), model.generate(idx[:, :3], 6, temperature=0))


def test_zero_growth_by_other_ratios_changes_outputs_by_rounding_only():
    model = tiny(qk_head_size=4)
    grown = grown_zero(model, 6)
    idx, targets = tokens(3, 16)
    torch.testing.assert_close(grown(idx, targets)[0], model(idx, targets)[0], rtol=1e-13, atol=1e-13)


def test_random_and_closed_form_keep_values_and_fold_the_scale():
    model = tiny(qk_head_size=4)
    idx, targets = tokens(4, 16)
    stats, _ = growth.collect_statistics(model, [(idx, targets)], [0, 1], 'closed_form', step_size=0.0)
    for method in ('random', 'closed_form'):
        state, _ = growth.grown_state_dict(model, 8, method, [0, 1], stats, torch.Generator().manual_seed(0))
        for l in range(2):
            w = state[f'transformer.h.{l}.attn.c_attn.weight']
            assert w.shape == (2 * 2 * 8 + 8, 8)
            assert torch.equal(w[-8:], model.state_dict()[f'transformer.h.{l}.attn.c_attn.weight'][-8:])  # values
    # closed_form with p > 0 and no step: 4 * 16 tokens > C + 1, so the product and the scores are kept
    state, predicted = growth.grown_state_dict(model, 8, 'closed_form', [0, 1], stats)
    grown = GPT(GPTConfig(**{**model.config.__dict__, 'qk_head_size': 8})).double().eval()
    grown.load_state_dict(state)
    torch.testing.assert_close(grown(idx, targets)[0], model(idx, targets)[0], rtol=1e-8, atol=1e-8)
    assert abs(predicted) < 1e-8


# ----------------------------------------------------------------------------------------------
# The gradient the hooks collect

def test_hooked_score_gradients_equal_autograd():
    model = tiny(qk_head_size=4)
    idx, targets = tokens(3, 16)
    collected = {}
    loss = growth.score_gradients(model, idx, targets, lambda l, x, s, g: collected.__setitem__(l, (x, s, g)))
    assert loss == pytest.approx(model(idx, targets)[1].item(), rel=1e-12)  # the explicit path is the model
    # the same scores built here, their gradient by torch.autograd.grad directly
    kept = []
    direct_loss = growth.explicit_forward(model, idx, targets, lambda l, x, s: kept.append(s))
    direct = torch.autograd.grad(direct_loss, kept)
    for l in range(2):
        torch.testing.assert_close(collected[l][2], direct[l], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient was accumulated
    # independent of the explicit path: the chain rule through the model's own (SDPA) forward gives
    # dL/dW_Q,h = sum_i X_i^T G_ih X_i W_K,h / sqrt(d) for the query rows of c_attn
    model.zero_grad()
    model(idx, targets)[1].backward()
    for l in range(2):
        x, _, G = collected[l]
        wq, wk = growth.head_factors(model.transformer.h[l].attn)
        X = growth.with_ones(x, True)
        for h in range(2):
            grad_q = (X.transpose(1, 2) @ G[:, h] @ X @ wk[h]).sum(0) / math.sqrt(4)  # (C + 1, d)
            rows = slice(h * 4, (h + 1) * 4)
            attn = model.transformer.h[l].attn
            torch.testing.assert_close(grad_q[:-1], attn.c_attn.weight.grad[rows].T, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(grad_q[-1], attn.c_attn.bias.grad[rows], rtol=1e-9, atol=1e-12)


def test_first_order_prediction_matches_a_small_step():
    # no bias and grow_to = n_embd: the SVD truncates nothing, so the new scores are the old ones plus
    # the projected step, and the loss changes by <dL/dS, step> to first order
    model = tiny(qk_head_size=4, bias=False)
    idx, targets = tokens(4, 16)
    step = 1e-3
    stats, before = growth.collect_statistics(model, [(idx, targets)], [0, 1], 'closed_form', step_size=step)
    state, predicted = growth.grown_state_dict(model, 8, 'closed_form', [0, 1], stats)
    grown = GPT(GPTConfig(**{**model.config.__dict__, 'qk_head_size': 8})).double().eval()
    grown.load_state_dict(state)
    measured = grown(idx, targets)[1].item() - before
    assert predicted < 0 and measured < 0  # a descent step
    assert measured == pytest.approx(predicted, rel=1e-2)


# ----------------------------------------------------------------------------------------------
# grow.py end to end: train narrow, grow, resume with DDP and bf16

def run_grow(*args):
    """`python3 grow.py ARGS` in the repo root, in this process: (exit status, stdout, stderr)."""
    proc = run_script_in_process('grow.py', args)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_grow_script_then_train_resumes_with_ddp_and_bf16(tmp_path):
    data = make_dataset(tmp_path)
    narrow = tmp_path / 'narrow'
    run_train_in_process(narrow, data, '--qk_head_size=4', '--max_iters=10', '--lr_decay_iters=10', '--bias=True')
    assert read_checkpoint(narrow)[1]['model_args']['qk_head_size'] == 4
    rc, out, err = run_grow(f'--out_dir={narrow}', '--grow_to=16', '--method=closed_form', '--batches=2',
                            f'--out={tmp_path / "grown"}', '--eval_iters=2', '--device=cpu')
    assert rc == 0, err
    assert "predicted after (first order)" in out and "growth step:" in out
    grown = read_checkpoint(tmp_path / 'grown')[1]
    assert grown['model_args']['qk_head_size'] == 16 and grown['optimizer'] is None and grown['iter_num'] == 10
    assert grown['grow']['measured_loss_after'] == pytest.approx(grown['grow']['loss_before'], abs=0.5)
    assert read_checkpoint(narrow)[1]['model_args']['qk_head_size'] == 4  # the original is untouched
    proc = run_train(tmp_path / 'grown', data, '--init_from=resume', '--max_iters=14', '--lr_decay_iters=14',
                     '--bias=True', '--dtype=bfloat16', nproc=2)
    assert "AdamW starts fresh" in proc.stdout and '2 process(es)' in proc.stdout
    resumed = read_checkpoint(tmp_path / 'grown')[1]
    assert resumed['iter_num'] == 14 and resumed['model_args']['qk_head_size'] == 16
    assert resumed['optimizer']['state']  # now a real AdamW state, resumable as usual


def test_grow_script_rejects_bad_requests_in_one_line(tmp_path):
    save_model_checkpoint(tmp_path / 'a', tiny(qk_head_size=4), optimizer=None)
    (tmp_path / 'taken').mkdir()
    (tmp_path / 'taken' / 'ckpt.pt').write_bytes(b'keep me')
    cases = [(['--grow_to=2', '--out=x'], "grow_to=2 must be between the checkpoint's qk_head_size 4 and n_embd 8"),
             (['--grow_to=8', f'--out={tmp_path / "a"}'], "must name a new directory for the grown checkpoint"),
             (['--grow_to=8', f'--out={tmp_path / "taken"}'], "already holds a checkpoint; choose another --out"),
             (['--grow_to=8', '--out=x', '--method=svd'], "method='svd' must be one of closed_form, random, zero"),
             (['--grow_to=8', '--out=x', '--layers=5'], "layers='5' must name layers between 0 and 1")]
    for args, message in cases:
        rc, out, err = run_grow(f'--out_dir={tmp_path / "a"}', *args)
        assert rc == 2 and err.startswith("grow.py: error: ") and message in err, err
        assert err.count('\n') == 1 and 'Traceback' not in err
    assert (tmp_path / 'taken' / 'ckpt.pt').read_bytes() == b'keep me'
    save_model_checkpoint(tmp_path / 's', tiny(attn_type='symmetric'), optimizer=None)
    rc, _, err = run_grow(f'--out_dir={tmp_path / "s"}', '--grow_to=8', '--out=x')
    assert rc == 2 and "attn_type='symmetric'; grow.py widens `base` attention only" in err


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != 'linux', reason="file modes, capabilities and mount namespaces as on Linux")
def test_grow_script_an_out_it_cannot_write_in_is_one_line_before_growing(tmp_path):
    """--out on a read-only file system, or in a folder without write permission: an OSError traceback at the
    save, after the growth, before; now refused before it."""
    data = make_dataset(tmp_path, n_train=2000, n_val=500)
    tiny_checkpoint(tmp_path / 'narrow', 'base', data)
    grow = [sys.executable, 'grow.py', f"--out_dir={tmp_path / 'narrow'}", '--grow_to=32', '--batches=1',
            '--batch_size=2', '--eval_iters=1', '--device=cpu']
    cases = []
    if small_disk_available():
        proc, left = on_small_disk(tmp_path / 'disk', [*grow, f"--out={tmp_path / 'disk' / 'grown'}"], read_only=True)
        cases.append((proc, f"out='{tmp_path / 'disk' / 'grown'}' cannot be written (read-only file system)"))
        assert left == []
    (tmp_path / 'locked').mkdir()
    (tmp_path / 'locked').chmod(0o555)
    try:
        proc = subprocess.run([*grow, f"--out={tmp_path / 'locked' / 'grown'}"], cwd=ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=120, preexec_fn=without_root_file_access())
    except subprocess.SubprocessError as e:  # prctl refused (a container without CAP_SETPCAP)
        pytest.skip(f"cannot run the script without root's file access: {e}")
    finally:
        (tmp_path / 'locked').chmod(0o755)
    cases.append((proc, f"out='{tmp_path / 'locked' / 'grown'}' cannot be written (permission denied)"))
    for proc, message in cases:
        assert proc.returncode == 2 and proc.stderr.strip() == f"grow.py: error: {message}: choose another folder " \
                                                              f"with --out", proc.stderr
        assert "growing" not in proc.stdout
    assert os.listdir(tmp_path / 'locked') == []


@pytest.mark.slow
def test_grow_script_never_writes_into_a_folder_another_process_holds(tmp_path):
    """--out held by another writer (a training run started there, say) when the grown checkpoint is ready:
    refused in one line, and nothing of grow.py's is written there."""
    data = make_dataset(tmp_path, n_train=2000, n_val=500)
    tiny_checkpoint(tmp_path / 'narrow', 'base', data)
    out = tmp_path / 'grown'
    holder = subprocess.Popen([sys.executable, '-c', 'import sys; from denoised_gpt.run_dir import lock_out_dir; '
                               f'lock = lock_out_dir({str(out)!r}); print("held", flush=True); sys.stdin.read()'],
                              cwd=ROOT, env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        rc, _, err = run_grow(f"--out_dir={tmp_path / 'narrow'}", '--grow_to=32', '--batches=1', '--batch_size=2',
                              '--eval_iters=1', '--device=cpu', f'--out={out}')
    finally:
        holder.communicate('')
    assert rc == 2 and "is in use by another run" in err and err.count('\n') == 1, err
    assert sorted(p.name for p in out.iterdir()) == ['.lock']  # the holder's lock alone
