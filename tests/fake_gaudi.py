"""A fake Intel Gaudi software stack (`habana_frameworks`) for the tests of train.py's Gaudi path
(test_device.py, test_compile.py): no Gaudi exists here, and this package is the only mock in the
suite. The fake makes 'hpu' tensors CPU tensors, registers 'hccl' as a gloo process group and logs
every call the training code makes into it; torch.cuda APIs raise. conftest.py's `fake_habana`
fixture installs it for a train.py subprocess; events() reads what that process called."""
import importlib.util

HAS_HABANA = importlib.util.find_spec('habana_frameworks') is not None  # a real one: the fake is not used

FAKE_HABANA = {
    '__init__.py': '"""Fake Intel Gaudi software for tests: see tests/fake_gaudi.py."""\n',
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


def install(site):
    """Write the fake habana_frameworks package into the folder `site` (for PYTHONPATH)."""
    for rel, text in FAKE_HABANA.items():
        path = site / 'habana_frameworks' / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return site


def events(log, rank='0'):
    """What the fake logged for one rank, in order: 'mark_step', 'hccl', 'cuda.<name>', ..."""
    lines = log.read_text().split('\n') if log.exists() else []
    return [line.split(' ', 1)[1] for line in lines if line.startswith(f'{rank} ')]
