"""device.py: device and dtype resolution, autocast, DDP backend, peak FLOP/s; and the Intel Gaudi
path of train.py, run against a fake `habana_frameworks` (no Gaudi exists here: that package,
tests/fake_gaudi.py, is the only mock in the suite). The fake makes 'hpu' tensors CPU tensors,
registers 'hccl' as a gloo process group and logs every call the training code makes into it;
torch.cuda APIs raise."""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from denoised_gpt import cpu_threads, device
from fake_gaudi import HAS_HABANA, events
from helpers import ROOT, make_dataset, run_script_in_process, run_train, subprocess_env

HAS_CUDA = torch.cuda.is_available()


def cpu_flags():
    try:
        return set(Path('/proc/cpuinfo').read_text().split())
    except OSError:
        return set()


def test_auto_device_and_explicit_names():
    expected = 'cuda' if HAS_CUDA else 'hpu' if HAS_HABANA else 'mps' if torch.backends.mps.is_available() else 'cpu'
    assert device.resolve_device('auto') == expected
    assert device.resolve_device('cpu') == 'cpu'
    with pytest.raises(ValueError, match="not supported; use one of auto, cuda, hpu, mps, cpu"):
        device.resolve_device('tpu')
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="sees no CUDA GPU; use --device=auto or --device=cpu"):
            device.resolve_device('cuda')
    if not HAS_HABANA:
        with pytest.raises(ValueError, match="needs Intel Gaudi's habana_frameworks"):
            device.resolve_device('hpu')


def test_setup_selects_a_cuda_device_only_when_one_is_named(monkeypatch):
    """train.py --device=cuda: torch.cuda.set_device('cuda') raises (it wants an index), which stopped every
    single-GPU run on the first CUDA machine. torch's own index check is kept; only the call is recorded."""
    chosen = []
    monkeypatch.setattr(torch.cuda, 'set_device',
                        lambda d: chosen.append(torch.cuda._utils._get_device_index(d)))
    device.setup('cuda')
    device.setup('cuda:3')
    assert chosen == [3]
    with pytest.raises(ValueError, match="specified index"):  # what the plain name did before
        torch.cuda._utils._get_device_index('cuda')


def test_dtype_resolution():
    native_bf16 = bool(cpu_flags() & {'avx512_bf16', 'amx_bf16'})
    if native_bf16:
        assert device.resolve_dtype('auto', 'cpu') == 'bfloat16'
    elif Path('/proc/cpuinfo').exists() and 'bf16' not in cpu_flags():
        assert device.resolve_dtype('auto', 'cpu') == 'float32'
    assert device.resolve_dtype('auto', 'mps') == 'float32'
    assert device.resolve_dtype('bfloat16', 'cpu') == 'bfloat16'
    with pytest.raises(ValueError, match="float16' needs a GradScaler.*--dtype=bfloat16"):
        device.resolve_dtype('float16', 'cpu')
    with pytest.raises(ValueError, match="dtype='fp8' is not supported"):
        device.resolve_dtype('fp8', 'cpu')


@pytest.mark.parametrize("kind", ["cpu", "mps"])
def test_float16_refusal_for_a_script_that_does_not_train(kind):
    # no GradScaler runs outside training: the refusal gives the fix without one; training keeps its reason
    with pytest.raises(ValueError) as e:
        device.resolve_dtype('float16', kind, training=False)
    assert str(e.value) == (f"dtype='float16' is supported on CUDA only; on {kind} use --dtype=bfloat16 or "
                            f"--dtype=float32")
    with pytest.raises(ValueError, match=f"float16' needs a GradScaler, which is used on CUDA only; on {kind} use"):
        device.resolve_dtype('float16', kind)


def test_sample_float16_on_cpu_is_refused_without_a_gradscaler():
    # refused before any model is loaded (gpt2's weights are never needed)
    proc = run_script_in_process('sample.py', ['--init_from=gpt2', '--device=cpu', '--dtype=float16'])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sample.py: error: dtype='float16' is supported on CUDA only; on cpu use --dtype=bfloat16 or --dtype=float32"]


def test_autocast_and_grad_scaler():
    a = torch.randn(4, 4)
    assert isinstance(device.autocast_context('cpu', 'float32'), contextlib.nullcontext)
    with device.autocast_context('cpu', 'bfloat16'):
        assert (a @ a).dtype == torch.bfloat16
    assert not device.grad_scaler('cpu', 'bfloat16').is_enabled()
    assert not device.grad_scaler('cpu', 'float32').is_enabled()


def test_ddp_backend_and_device_ids():
    assert device.ddp_backend('cpu') == 'gloo'
    assert device.ddp_backend('cuda:3') == 'nccl'
    assert device.ddp_device_ids('cuda:3') == [3]
    assert device.ddp_device_ids('cpu') is None


def test_cpu_peak_flops_is_a_measured_matmul_rate():
    peak = device.peak_flops('cpu', 'float32')
    assert device.peak_flops('cpu', 'float32') == peak  # cached: measured once per process
    assert 1e8 < peak < 1e14  # FLOP/s (not GFLOP/s, not seconds) for any CPU from tiny to huge


def test_cpu_tensor_peak_counts_the_most_bytes_held_at_once():
    """The CPU stand-in for max_memory_allocated: with 4 and 8 MB held, then 8 and 4 MB, then 12 MB
    alone, the peak is 12 MB (not the 28 MB ever allocated, not the 12 MB at the end by chance: the
    last tensor is made smaller to tell them apart), plus the live tensors given, a shared
    storage counted once. A second call is not confused by tensors the first one left alive."""
    kept = []

    def fn():
        a = torch.empty(1_000_000, dtype=torch.float32)   # 4 MB
        b = torch.empty(1_000_000, dtype=torch.float64)   # + 8 MB = 12 MB
        del a
        c = torch.empty(500_000, dtype=torch.float64)     # 8 + 4 = 12 MB
        del b, c
        kept.append(torch.empty(2_000_000, dtype=torch.int32))  # 8 MB, outlives fn

    live = torch.empty(1000, dtype=torch.float32)
    assert device.cpu_tensor_peak(fn, [live, live[:10]]) == 12_000_000 + 4000
    assert device.cpu_tensor_peak(fn) == 12_000_000


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989), ("NVIDIA H100 PCIe", "bfloat16", 756),
    ("NVIDIA H100 PCIe", "float32", 378), ("NVIDIA A100-SXM4-80GB", "float16", 312),
    ("NVIDIA A10", "bfloat16", 125), ("NVIDIA L40S", "bfloat16", 362), ("NVIDIA L40", "bfloat16", 181),
    ("NVIDIA GH200 480GB", "bfloat16", 989), ("Tesla V100-SXM2-16GB", "float32", 15.7),
    ("NVIDIA GeForce GTX 1080", "bfloat16", None)])
def test_spec_sheet_peak_matches_the_most_specific_name(monkeypatch, name, dtype, tflops):
    # 'H100 PCIe' before 'H100', 'A100' before 'A10', 'L40S' before 'L40', 'GH200' before 'H200'
    monkeypatch.setattr(device, "device_name", lambda d: name)
    assert device.spec_sheet_tflops("cuda:0", dtype) == tflops
    assert device.spec_sheet_tflops("cpu", dtype) is None


def test_hpu_helpers_do_nothing_off_hpu():
    device.mark_step()  # no Gaudi in use: nothing to flush, no error
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert device.fused_optimizer(optimizer, 'cpu') is optimizer


# -----------------------------------------------------------------------------
# Intel Gaudi path against a fake habana_frameworks (tests/fake_gaudi.py; the fake_habana fixture: conftest.py)

@pytest.mark.slow
@pytest.mark.skipif(HAS_HABANA, reason="a real habana_frameworks is installed")
def test_hpu_lazy_ddp_run(tmp_path, fake_habana):
    """torchrun, 2 ranks, lazy mode: hccl, mark_step after every backward and optimizer step (and
    after each evaluation batch), Habana's FusedAdamW, bf16, and no CUDA call anywhere."""
    env, log = fake_habana
    data = make_dataset(tmp_path)
    max_iters, eval_interval, eval_iters, accum, world = 6, 3, 4, 4, 2
    proc = run_train(tmp_path / 'out', data, '--device=auto', '--dtype=auto', f'--max_iters={max_iters}',
                     f'--eval_interval={eval_interval}', f'--eval_iters={eval_iters}',
                     f'--gradient_accumulation_steps={accum}', nproc=world, env=env)
    assert 'device hpu (bfloat16), 2 process(es)' in proc.stdout
    n_evals = max_iters // eval_interval + 1  # at 0, 3, 6
    for rank in ('0', '1'):
        ev = events(log, rank)
        assert not [e for e in ev if e.startswith('cuda.')], ev
        assert ev.count('hccl') >= 1 and ev.count('FusedAdamW') == 1
        assert 'hpu.manual_seed' in ev
        eval_batches = 2 * len(range(int(rank), eval_iters, world))  # train and val splits
        expected = max_iters * (accum // world + 1) + n_evals * eval_batches
        assert ev.count('mark_step') == expected
    assert (tmp_path / 'out' / 'ckpt.pt').exists()


# Gaudi eager mode (hpu_backend, no mark_step, no FusedAdamW, no torch.cuda): test_compile.py's
# test_train_auto_compiles_in_gaudi_eager_mode_and_prints_the_compile_time, one run for both files.


def test_job_slots_get_their_own_gpus_where_there_are_enough_and_share_them_where_not():
    assert [device.slot_gpus(s, 2, 8) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # 4 jobs x 2 ranks
    assert [device.slot_gpus(s, 1, 1) for s in range(8)] == [[0]] * 8  # 8 small runs on the one GPU
    assert [device.slot_gpus(s, 1, 2) for s in range(4)] == [[0], [1], [0], [1]]


def test_seeding_the_device_in_use_draws_as_seeding_every_generator():
    """train.py seeds every micro-batch with manual_seed(s, device): only the CPU's generator and the device's
    (torch.manual_seed also queues a seed, with a stack trace, for each device kind not started), drawing the
    same numbers as torch.manual_seed(s) from whatever state the generators were in."""
    torch.manual_seed(1)
    torch.randn(7)  # some other state first
    device.manual_seed(3, 'cpu')
    ours = torch.randn(5), torch.rand(3), torch.nn.functional.dropout(torch.ones(8), 0.5)
    torch.manual_seed(3)
    theirs = torch.randn(5), torch.rand(3), torch.nn.functional.dropout(torch.ones(8), 0.5)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


# ----------------------------------------------------------------------------- CPU threads on a busy machine

def test_idle_cores_are_read_from_the_kernels_counters():
    """Between two reads of /proc/stat, 150 of 200 ticks idle (idle + iowait) on a 2-core machine: 1.5 cores."""
    snapshots = iter(["cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 0 0 0 0 0 0 0\ncpu1 1 0 0 0 0 0 0 0\nintr 5\n",
                      "cpu  130 0 120 820 130 0 0 0 0 0\ncpu0 1 0 0 0 0 0 0 0\ncpu1 1 0 0 0 0 0 0 0\nintr 9\n"])
    assert cpu_threads.idle_cores(0, read_stat=lambda: next(snapshots)) == (pytest.approx(1.5), 2)

    def missing():
        raise OSError("no /proc here")
    assert cpu_threads.idle_cores(0, read_stat=missing) is None


WAIT_POLICY = """
import json, os, sys
from denoised_gpt import cpu_threads
note = cpu_threads.wait_passively_if_busy(measured=tuple(json.loads(sys.argv[1])))
print(json.dumps([note, os.environ.get('OMP_WAIT_POLICY')]))
"""


@pytest.mark.parametrize('measured, env, policy', [
    ((0.3, 2), {}, 'PASSIVE'),  # another process keeps 1.7 cores busy
    ((1.4, 2), {'OMP_NUM_THREADS': '2'}, 'PASSIVE'),  # half a core or more busy
    ((1.7, 2), {}, None),  # idle enough: torch's own (spinning) threads are the fastest
    ((0.0, 2), {'OMP_WAIT_POLICY': 'ACTIVE'}, 'ACTIVE'),  # the user's choice wins
    ((0.0, 2), {'OMP_NUM_THREADS': '1'}, None),  # one thread never waits for another
], ids=['busy', 'half-busy', 'idle', 'user-policy', 'one-thread'])
def test_a_busy_cpu_makes_torchs_threads_sleep_while_they_wait(measured, env, policy):
    """Decided in a process without torch (OpenMP reads the policy once, as torch loads it)."""
    env = {k: v for k, v in os.environ.items() if k not in ('OMP_WAIT_POLICY', 'OMP_NUM_THREADS')} | env
    proc = subprocess.run([sys.executable, '-c', WAIT_POLICY, json.dumps(measured)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    note, chosen = json.loads(proc.stdout)
    assert chosen == policy
    if env.get('OMP_WAIT_POLICY') is None and policy == 'PASSIVE':
        assert note == (f"CPU: {measured[0]:.1f} of 2 cores idle, so torch's threads sleep while they wait for each "
                        f"other (OMP_WAIT_POLICY=PASSIVE; set it to choose)")
    else:
        assert note is None
    assert cpu_threads.wait_passively_if_busy(measured=(0.0, 2)) is None  # torch is loaded here: too late


# modules the scripts import before the wait policy is settled: none of them imports torch (checked below)
TORCH_FREE = ('configurator', 'denoised_gpt.cpu_threads', 'denoised_gpt.cli')


def test_the_modules_imported_before_the_wait_policy_do_not_import_torch():
    code = f"import sys; import {', '.join(TORCH_FREE)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == 'False', out.stdout + out.stderr


@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'eval.py', 'bench.py', 'grow.py'])
def test_the_scripts_settle_the_wait_policy_before_anything_imports_torch(script):
    """The call comes before the first import other than configurator and cpu_threads (which import no torch);
    test_sample_on_a_busy_cpu_says_how_the_threads_wait runs one end to end."""
    import ast
    body = ast.parse((ROOT / script).read_text()).body
    calls = [i for i, node in enumerate(body) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             and getattr(node.value.func, 'id', None) == 'wait_passively_if_busy']
    imports = [i for i, node in enumerate(body) if isinstance(node, (ast.Import, ast.ImportFrom))
               and getattr(node, 'module', None) not in TORCH_FREE]
    assert len(calls) == 1 and calls[0] < imports[0], script


@pytest.mark.slow
def test_sample_on_a_busy_cpu_says_how_the_threads_wait(tmp_path):
    """sample.py in a process whose idle_cores reads a busy machine: the policy is set before torch loads and
    said on stderr."""
    import pickle
    from helpers import VOCAB, tiny_checkpoint
    data = make_dataset(tmp_path)
    chars = [chr(ord('0') + i) for i in range(VOCAB)]
    with open(data / 'meta.pkl', 'wb') as f:  # the characters, for sample.py
        pickle.dump({'vocab_size': VOCAB, 'itos': dict(enumerate(chars)), 'stoi': {c: i for i, c in enumerate(chars)}}, f)
    tiny_checkpoint(tmp_path / 'out', 'base', data)
    run = ("import runpy, sys\nfrom denoised_gpt import cpu_threads\ncpu_threads.idle_cores = lambda: (0.2, 2)\n"
           "sys.argv = sys.argv[1:]\nrunpy.run_path('sample.py', run_name='__main__')")
    env = {k: v for k, v in subprocess_env().items() if k not in ('OMP_WAIT_POLICY', 'OMP_NUM_THREADS')}
    proc = subprocess.run([sys.executable, '-c', run, 'sample.py', f'--out_dir={tmp_path / "out"}', '--device=cpu',
                           '--num_samples=1', '--max_new_tokens=2', '--start=1'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "CPU: 0.2 of 2 cores idle, so torch's threads sleep while they wait for each other" in proc.stderr
