"""device.py: device and dtype resolution, autocast, DDP backend, peak FLOP/s; and the Intel Gaudi
path of train.py, run against a fake `habana_frameworks` (no Gaudi exists here: that package is the
only mock in the suite). The fake makes 'hpu' tensors CPU tensors, registers 'hccl' as a gloo
process group and logs every call the training code makes into it; torch.cuda APIs raise."""
import contextlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from denoised_gpt import device
from test_train import ROOT, make_dataset, run_train, subprocess_env

HAS_CUDA = torch.cuda.is_available()
HAS_HABANA = importlib.util.find_spec('habana_frameworks') is not None


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
# Intel Gaudi path against a fake habana_frameworks

FAKE_HABANA = {
    '__init__.py': '"""Fake Intel Gaudi software for tests: see tests/test_device.py."""\n',
    'torch/__init__.py': '''
import functools, os, sys, types
import torch

def log(event):
    with open(os.environ['FAKE_HPU_LOG'], 'a') as f:
        f.write(f"{os.environ.get('RANK', '0')} {event}\\n")

# 'hpu' tensors are CPU tensors
def _cpu(d):
    if isinstance(d, str) and d.split(':')[0] == 'hpu':
        return 'cpu'
    if isinstance(d, torch.device) and d.type == 'hpu':
        return torch.device('cpu')
    return d

def _with_cpu_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = tuple(_cpu(a) for a in args)
        if 'device' in kwargs:
            kwargs['device'] = _cpu(kwargs['device'])
        return fn(*args, **kwargs)
    return wrapper

for _name in ('zeros', 'ones', 'empty', 'tensor', 'randn', 'rand', 'randint', 'arange', 'full', 'as_tensor'):
    setattr(torch, _name, _with_cpu_device(getattr(torch, _name)))
torch.Tensor.to = _with_cpu_device(torch.Tensor.to)
torch.nn.Module.to = _with_cpu_device(torch.nn.Module.to)

hpu = types.ModuleType('torch.hpu')
hpu.is_available = lambda: True
hpu.device_count = lambda: 1
hpu.get_device_name = lambda *a: 'GAUDI2'
hpu.synchronize = lambda *a: log('synchronize')
hpu.max_memory_allocated = lambda *a: 0
torch.hpu = sys.modules['torch.hpu'] = hpu

# a Gaudi machine has no CUDA: the project's code on the HPU path must not call these (torch's own
# internals, e.g. dynamo asking torch.cuda.is_available(), are let through)
_TORCH_DIR = os.path.dirname(torch.__file__)

def _forbidden(name, original):
    def call(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename.startswith(_TORCH_DIR):
            return original(*args, **kwargs)
        log(f'cuda.{name}')
        raise RuntimeError(f'the HPU path called torch.cuda.{name}')
    return call

for _name in ('is_available', 'synchronize', 'set_device', 'max_memory_allocated', 'get_device_name',
              'get_device_properties', 'is_bf16_supported', 'current_device', 'device_count',
              'get_rng_state_all', 'set_rng_state_all', 'get_rng_state', 'set_rng_state'):
    setattr(torch.cuda, _name, _forbidden(_name, getattr(torch.cuda, _name)))

if os.environ.get('PT_HPU_LAZY_MODE', '1') == '0':
    from torch._dynamo import register_backend

    @register_backend(name='hpu_backend')
    def hpu_backend(gm, example_inputs):
        log('hpu_backend')
        return gm.forward
''',
    'torch/core/__init__.py': '''
from habana_frameworks.torch import log

def mark_step(device_str='', sync=False):
    log('mark_step')
''',
    'torch/utils/__init__.py': '',
    'torch/utils/internal.py': '''
import os

def is_lazy():
    return os.environ.get('PT_HPU_LAZY_MODE', '1') == '1'
''',
    'torch/hpu/__init__.py': '',
    'torch/hpu/random.py': '''
import torch
from habana_frameworks.torch import log

def manual_seed(seed):
    log('hpu.manual_seed')
    torch.manual_seed(seed)
''',
    'torch/distributed/__init__.py': '',
    'torch/distributed/hccl.py': '''
import torch.distributed as dist
from habana_frameworks.torch import log

def _hccl(store, rank, size, timeout):
    log('hccl')
    return dist.ProcessGroupGloo(store, rank, size, timeout)

if 'hccl' not in dist.Backend.backend_list:
    dist.Backend.register_backend('hccl', _hccl, devices=['cpu'])
''',
    'torch/hpex/__init__.py': '',
    'torch/hpex/optimizers/__init__.py': '''
import torch
from habana_frameworks.torch import log

class FusedAdamW(torch.optim.AdamW):
    def __init__(self, *args, **kwargs):
        log('FusedAdamW')
        super().__init__(*args, **kwargs)
''',
}


@pytest.fixture
def fake_habana(tmp_path):
    """(env, log path): PYTHONPATH puts the fake habana_frameworks first."""
    site = tmp_path / 'fake_site'
    for rel, text in FAKE_HABANA.items():
        path = site / 'habana_frameworks' / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    log = tmp_path / 'hpu.log'
    env = subprocess_env(PYTHONPATH=f"{site}{os.pathsep}{ROOT}", FAKE_HPU_LOG=str(log))
    return env, log


def events(log, rank='0'):
    lines = log.read_text().split('\n') if log.exists() else []
    return [line.split(' ', 1)[1] for line in lines if line.startswith(f'{rank} ')]


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
