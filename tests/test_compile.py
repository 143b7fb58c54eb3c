"""torch.compile with the fused loss: the training step compiles into one graph in which the fused
lm_head + cross-entropy is one opaque custom-op node (traced, its chunk loop made a CPU step 15x
slower), compiled losses and gradients equal eager ones for every attn_type; compile=True / False / 'auto'.

Inductor's cold compile takes tens of seconds per model on this CPU, so every variant is checked
with the cheap backends: torch._dynamo.explain (tracing only: graphs and graph breaks) and
'aot_eager' (forward and backward traced through AOTAutograd, run without code generation);
train.py's compile step runs against the fake Gaudi of tests/fake_gaudi.py, whose backend runs
dynamo's graph as traced. The one inductor test (train.py on the tiny test model) runs with INDUCTOR_TESTS=1."""
import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from configurator import apply_config
from denoised_gpt.device import resolve_compile
from fake_gaudi import HAS_HABANA, events
from helpers import ITER_LINE, ROOT, TINY_MODEL, make_dataset, run_train, run_train_in_process, subprocess_env, tiny_gpt
from model import ATTENTION_TYPES

pytestmark = pytest.mark.slow  # compiles and compiled training runs (conftest.py: slow)

VOCAB = 96  # TINY_MODEL with another vocabulary size than make_dataset's


def tiny_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(VOCAB, (2, TINY_MODEL['block_size']), generator=g)
    y = torch.randint(VOCAB, (2, TINY_MODEL['block_size']), generator=g)
    y[0, :5] = -1  # ignored targets: the fused loss's masked path
    return x, y


def loss_and_grads(net, model, x, y):
    """The fused training loss of `net` (model or a compiled model) and the gradients it leaves on
    model's parameters."""
    torch.manual_seed(2)  # the same noise draws (noiseformer) for eager and compiled
    _, loss = net(x, y, return_logits=False)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize('attn_type', ATTENTION_TYPES)
def test_the_training_step_compiles_into_one_graph_with_the_fused_loss_as_one_node(attn_type):
    model = tiny_gpt(attn_type, vocab_size=VOCAB)
    x, y = tiny_batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, y, return_logits=False)
    assert explained.graph_count == 1 and explained.graph_break_count == 0 and explained.break_reasons == []
    nodes = list(explained.graphs[0].graph.nodes)
    # the fused loss is a custom op: one opaque node, its chunk loop never traced
    assert [str(n.target) for n in nodes if 'lm_head_cross_entropy' in str(n.target)] == \
        ['denoised_gpt.lm_head_cross_entropy.default']
    # ... and the graph holds the whole transformer: ln_1 and ln_2 of every block, then ln_f
    layer_norms = [n for n in nodes if n.target is F.layer_norm]
    assert len(layer_norms) == 2 * TINY_MODEL['n_layer'] + 1


def test_importing_the_model_does_not_import_the_compiler():
    """torch._dynamo costs about a second to import; a script that never compiles never pays it."""
    code = "import sys, model; sys.exit('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=subprocess_env()).returncode == 0


def test_loading_and_sampling_a_model_does_not_import_the_compiler():
    """sample.py / eval.py build the model on the meta device (weights.model_with_weights), where torch runs
    random draws and arithmetic through code that imports torch._dynamo: the build skips them, for every
    attn_type, and generating from the model imports nothing of the compiler either."""
    code = """if True:
        import sys, torch
        from denoised_gpt.weights import model_with_weights
        from model import ATTENTION_TYPES, GPT, GPTConfig
        for attn_type in ATTENTION_TYPES:
            config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, attn_type=attn_type,
                               **({'lowrank_rank': 4} if attn_type == 'dint_lowrank' else {}))
            weights = GPT(config).state_dict()
            model = model_with_weights(config, weights).eval()
            assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), weights.values()))
            model.generate(torch.zeros(3, 2, dtype=torch.long), 3, top_k=5)
        sys.exit('torch._dynamo' in sys.modules)"""
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr or "torch._dynamo was imported"


def test_plain_loss_compiles_without_any_break():
    # return_logits=True (evaluation, nanoGPT's API): lm_head + F.cross_entropy, all in one graph
    model = tiny_gpt('base', vocab_size=VOCAB)
    x, y = tiny_batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, y)
    assert explained.graph_count == 1 and explained.break_reasons == []


@pytest.mark.parametrize('attn_type', ATTENTION_TYPES)
def test_compiled_loss_and_gradients_equal_eager(attn_type):
    """float32; 'aot_eager' runs the same kernels as eager, only traced and ordered by AOTAutograd,
    so the loss and every gradient agree to 1e-6 relative (plus 1e-8 absolute, for gradients near
    zero); measured: equal to the last bit or within a few float32 ulps."""
    model = tiny_gpt(attn_type, vocab_size=VOCAB)
    x, y = tiny_batch()
    loss_eager, grads_eager = loss_and_grads(model, model, x, y)
    torch._dynamo.reset()
    loss_compiled, grads_compiled = loss_and_grads(torch.compile(model, backend='aot_eager'), model, x, y)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-6, atol=1e-8)
    assert grads_compiled.keys() == grads_eager.keys()
    for name, grad in grads_eager.items():
        # every parameter is trained; NoiseFormer's mu only through the KL term (dCE/dmu is exactly 0)
        assert grad.abs().sum() > 0 or name.endswith(('wpe.weight', 'noise_mu')), name
        torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-6, atol=1e-8, msg=name)


def iter_losses(proc):
    return [float(m[1]) for m in ITER_LINE.findall(proc.stdout)]


GAUDI_ARGS = ('--device=hpu', '--max_iters=3', '--eval_interval=100', '--eval_iters=1')


@pytest.mark.skipif(HAS_HABANA, reason="a real habana_frameworks is installed")
def test_train_auto_compiles_in_gaudi_eager_mode_and_prints_the_compile_time(tmp_path, fake_habana):
    """train.py's compile step on (fake) Gaudi in eager mode, whose 'hpu_backend' runs dynamo's
    graph as traced: compile='auto' compiles, prints the compile time, and the float32 losses equal
    the uncompiled run's exactly. Eager mode has no mark_step, no FusedAdamW (CUDA-only here) and
    never touches torch.cuda."""
    env, log = fake_habana
    env['PT_HPU_LAZY_MODE'] = '0'
    data = make_dataset(tmp_path)
    plain = run_train(tmp_path / 'plain', data, '--compile=False', *GAUDI_ARGS, env=env)
    assert 'hpu_backend' not in events(log)
    auto = run_train(tmp_path / 'auto', data, '--compile=auto', *GAUDI_ARGS, env=env)
    ev = events(log)
    assert 'hpu_backend' in ev and 'mark_step' not in ev and 'FusedAdamW' not in ev
    assert not [e for e in ev if e.startswith('cuda.')], ev
    assert 'device hpu (float32)' in auto.stdout  # the test config asks for float32
    assert re.search(r"^compiled the training step in \d+\.\d s", auto.stdout, re.M), auto.stdout
    assert len(iter_losses(plain)) == 3 and iter_losses(auto) == iter_losses(plain)


@pytest.mark.skipif(HAS_HABANA, reason="a real habana_frameworks is installed")
def test_train_auto_leaves_gaudi_lazy_mode_to_its_own_graphs(tmp_path, fake_habana):
    env, log = fake_habana
    env['PT_HPU_LAZY_MODE'] = '1'
    proc = run_train(tmp_path / 'out', make_dataset(tmp_path), '--compile=auto', *GAUDI_ARGS, env=env)
    assert 'hpu_backend' not in events(log) and 'compiled the training step' not in proc.stdout
    assert 'compile=True ignored' not in proc.stdout  # that note is for an explicit compile=True
    assert len(iter_losses(proc)) == 3


def test_the_warm_up_compile_is_the_graph_training_runs():
    """compile_training_step compiles on a dummy batch so iter 0 is not charged the compile; with one
    tensor as both inputs and targets dynamo guarded on `idx is targets`, and training's first step
    compiled again (on the H200: 22 s wasted, iter 0 16 s). After the warm-up, a step on two
    tensors and the next one compile nothing."""
    from denoised_gpt.training import compile_training_step
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    model = tiny_gpt('base', vocab_size=VOCAB)
    compiled = torch.compile(model, backend=counting_backend)
    compile_training_step(compiled, 2, TINY_MODEL['block_size'], 'cpu', contextlib.nullcontext())
    assert len(graphs) == 1
    x, y = tiny_batch()
    for _ in range(2):
        _, loss = compiled(x, y, return_logits=False)
        loss.backward()
    assert len(graphs) == 1


@pytest.mark.skipif(not os.environ.get('INDUCTOR_TESTS'), reason="inductor's cold compile takes 30-90 s on "
                    "2 cores (train step and evaluation); INDUCTOR_TESTS=1 runs this test")
def test_train_compiles_with_inductor_prints_the_compile_time_and_matches_eager(tmp_path):
    """The real thing on the tiny test model: train.py --compile=True (inductor on CPU) logs the
    same float32 losses as eager to 1e-5 relative (inductor fuses and reorders float32 sums: a few
    ulps per op), and prints the cold compile time."""
    data = make_dataset(tmp_path)
    args = ('--max_iters=3', '--eval_interval=100', '--eval_iters=1')
    eager = run_train(tmp_path / 'eager', data, '--compile=False', *args)
    compiled = run_train(tmp_path / 'compiled', data, '--compile=True', *args)
    assert 'compiled the training step' not in eager.stdout
    seconds = re.search(r"^compiled the training step in (\d+\.\d) s", compiled.stdout, re.M)
    assert seconds and float(seconds.group(1)) > 0, compiled.stdout
    assert len(iter_losses(eager)) == 3
    assert iter_losses(compiled) == pytest.approx(iter_losses(eager), rel=1e-5)


@pytest.mark.parametrize('setting, on_cpu, on_cuda', [
    (True, True, True), (False, False, False), ('auto', False, True),
    ('True', True, True), ('false', False, False),  # as typed on the command line
])
def test_compile_setting(setting, on_cpu, on_cuda):
    assert resolve_compile(setting, 'cpu') is on_cpu
    assert resolve_compile(setting, 'cuda:1') is on_cuda
    assert resolve_compile(setting, 'mps') is on_cpu  # inductor on MPS is a prototype


@pytest.mark.parametrize('bad', ['yes', 'on', 1, 0, None])
def test_bad_compile_setting_names_the_valid_ones(bad):
    with pytest.raises(ValueError, match=r"compile=.* is not a valid setting; use --compile=True, "
                                         r"--compile=False or --compile=auto"):
        resolve_compile(bad, 'cpu')


def test_config_files_and_overrides_give_compile_as_bool_or_auto(tmp_path):
    # a default of 'auto' takes True / False from a config file (nanoGPT's configs say compile = False)
    config = tmp_path / 'c.py'
    config.write_text("compile = False\n")
    defaults = {'compile': 'auto', 'out_dir': 'out'}
    assert apply_config([str(config)], defaults)['compile'] is False
    assert resolve_compile(apply_config(['--compile=True'], defaults)['compile'], 'cpu') is True
    assert apply_config(['--compile=auto'], defaults)['compile'] == 'auto'
    # other keys keep their types: a bool is still no out_dir
    config.write_text("out_dir = True\n")
    with pytest.raises(ValueError, match="out_dir must be a str"):
        apply_config([str(config)], defaults)


def test_train_rejects_a_bad_compile_setting(tmp_path):
    data = make_dataset(tmp_path)
    proc = run_train_in_process(tmp_path / 'out', data, '--compile=yes', expect_rc=2)
    assert proc.stderr.strip().splitlines() == [
        "train.py: error: compile='yes' is not a valid setting; use --compile=True, --compile=False or "
        "--compile=auto (on where it measured faster: CUDA, Gaudi eager mode)"]
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()
