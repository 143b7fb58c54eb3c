"""
Everything that differs between CUDA, Intel Gaudi (HPU), Apple MPS and CPU, in one place, so that
train.py / sample.py / bench.py read the same on every device.

Intel Gaudi: `habana_frameworks` is imported only when the device is 'hpu' (it exists only in
Habana's containers, whose torch is 2.6-2.9: nothing here uses a newer API on that path). In lazy
mode (PT_HPU_LAZY_MODE=1) ops are queued into a graph that runs at `mark_step()`, which the training
loop calls after backward and after the optimizer step; in eager mode `compile_model` uses
torch.compile(backend="hpu_backend"). bf16 autocast needs no GradScaler there.
"""

import contextlib
import functools
import importlib.util
import os
import sys
import time

import torch

from denoised_gpt import cpu_threads

DEVICE_TYPES = ('cuda', 'hpu', 'mps', 'cpu')
DTYPES = ('float32', 'bfloat16', 'float16')

_hpu_ready = False  # habana_frameworks imported and a Gaudi found
_htcore = None  # habana_frameworks.torch.core when that Gaudi runs in lazy mode, else None


# ----------------------------------------------------------------------------------------------
# Which device and dtype

def device_type(device):
    """'cuda:1' -> 'cuda'."""
    return str(device).split(':')[0]


def resolve_device(name):
    """'auto' -> the best available of cuda > hpu > mps > cpu; an explicit name is checked."""
    if name == 'auto':
        if torch.cuda.is_available():
            return 'cuda'
        if importlib.util.find_spec('habana_frameworks') is not None and _init_hpu():
            return 'hpu'
        if torch.backends.mps.is_available():
            return 'mps'
        return 'cpu'
    kind = device_type(name)
    if kind not in DEVICE_TYPES:
        raise ValueError(f"device={name!r} is not supported; use one of auto, {', '.join(DEVICE_TYPES)} "
                         f"(or cuda:N)")
    if kind == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but this torch ({torch.__version__}) sees no CUDA GPU; "
                         f"use --device=auto or --device=cpu")
    if kind == 'mps' and not torch.backends.mps.is_available():
        raise ValueError(f"device={name!r} but MPS is not available here; use --device=auto or --device=cpu")
    if kind == 'hpu':
        if importlib.util.find_spec('habana_frameworks') is None:
            raise ValueError("device='hpu' needs Intel Gaudi's habana_frameworks package (use Habana's "
                             "PyTorch container); use --device=auto or --device=cpu")
        if not _init_hpu():
            raise ValueError("device='hpu' but habana_frameworks sees no Gaudi device")
    return name


def _init_hpu():
    """Import Habana's bridge (which registers the 'hpu' device) and note whether it is in lazy mode."""
    global _hpu_ready, _htcore
    import habana_frameworks.torch.core as htcore
    from habana_frameworks.torch.utils.internal import is_lazy
    _hpu_ready = torch.hpu.is_available()
    _htcore = htcore if _hpu_ready and is_lazy() else None
    return _hpu_ready


@functools.lru_cache(maxsize=None)
def cpu_supports_bf16():
    """True when the CPU has native bf16 matmul (x86 AVX512-BF16 / AMX, or Arm BF16). There, bf16
    matmuls are faster than float32 ones; elsewhere bf16 is emulated and slower."""
    try:
        with open('/proc/cpuinfo') as f:
            words = set(f.read().split())
    except OSError:  # not Linux
        words = set()
    if words & {'avx512_bf16', 'amx_bf16'}:
        return True
    # aarch64 lists its features on 'Features' lines; torch also reports AMX-capable x86 CPUs
    return 'bf16' in words or 'AMX' in torch.backends.cpu.get_cpu_capability()


def resolve_dtype(name, device, training=True):
    """'auto' -> the fastest dtype that trains reliably on the device; an explicit name is checked.
    training: whether the dtype is for training (train.py, bench.py), which its refusals may speak of;
    False for a script that only runs a model (sample.py, eval.py)."""
    kind = device_type(device)
    if name == 'auto':
        if kind == 'cuda':
            return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float16'
        if kind == 'hpu':
            return 'bfloat16'
        if kind == 'cpu' and cpu_supports_bf16():
            return 'bfloat16'
        return 'float32'
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; use auto, {', '.join(DTYPES)}")
    if name == 'float16' and kind != 'cuda':
        why = "needs a GradScaler, which is used on CUDA only" if training else "is supported on CUDA only"
        raise ValueError(f"dtype='float16' {why}; on {kind} use --dtype=bfloat16 or --dtype=float32")
    return name


def setup(device):
    """Per-process device settings before any tensor is made (DDP: device is 'cuda:<local_rank>'). On a CPU:
    says on stderr how torch's threads wait when another process was busy as the script started
    (cpu_threads.wait_passively_if_busy)."""
    if device_type(device) == 'cpu' and cpu_threads.note:
        print(cpu_threads.note, file=sys.stderr)
    if device_type(device) == 'cuda':
        index = torch.device(device).index
        if index is not None:  # plain 'cuda' is the current device; set_device would refuse it
            torch.cuda.set_device(index)
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls on tensor cores (nanoGPT)
        torch.backends.cudnn.allow_tf32 = True


def ddp_backend(device):
    """The torch.distributed backend for the device: nccl (CUDA), hccl (Gaudi), gloo (CPU, MPS)."""
    kind = device_type(device)
    if kind == 'cuda':
        return 'nccl'
    if kind == 'hpu':
        import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers the 'hccl' backend)
        return 'hccl'
    return 'gloo'


def ddp_device_ids(device):
    """device_ids for DistributedDataParallel: the GPU index on CUDA, None elsewhere."""
    return [torch.device(device).index] if device_type(device) == 'cuda' else None


# ----------------------------------------------------------------------------------------------
# Numerics: autocast, GradScaler, seeding

def torch_dtype(dtype):
    return {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]


def autocast_context(device, dtype):
    """Mixed precision for forward passes; float32 runs without autocast."""
    if dtype == 'float32':
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type(device), dtype=torch_dtype(dtype))


def grad_scaler(device, dtype):
    """A GradScaler that is active only for float16 on CUDA (bf16 has float32's range)."""
    enabled = dtype == 'float16' and device_type(device) == 'cuda'
    return torch.amp.GradScaler(device_type(device), enabled=enabled)


def manual_seed(seed, device=None):
    """Seed torch's global generators: with no device all of them (torch.manual_seed: CPU, CUDA, MPS, ...), as
    for a model's first weights; with one, the CPU's and that device's, all that a step draws from:
    torch.manual_seed also seeds every device kind not started in this process, each queueing the seed with a
    stack trace (~1 ms a call on a CPU; train.py seeds every micro-batch). Gaudi's own generator, which
    torch.manual_seed skips, either way."""
    if device is None:
        torch.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)
        if device_type(device) == 'cuda':
            torch.cuda.manual_seed(seed)  # the current device: this rank's (setup's set_device)
        elif device_type(device) == 'mps':
            torch.mps.manual_seed(seed)
    if _hpu_ready:
        import habana_frameworks.torch.hpu.random as htrandom
        htrandom.manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# Gaudi lazy mode, compilation, fused optimizer

def mark_step():
    """Run the ops queued so far (Gaudi lazy mode); a no-op on every other device and HPU eager mode."""
    if _htcore is not None:
        _htcore.mark_step()


def resolve_compile(setting, device):
    """compile=True / False / 'auto' (also 'true' / 'false' as typed on the command line) -> bool.
    'auto' compiles where it measured faster than eager for a training step (docs/benchmarks.md):
    on CUDA, and on Gaudi in eager mode (hpu_backend); lazy mode builds graphs itself. Not on CPU:
    the cold compile takes about a minute there and the step gained at most a few percent (the
    lm_head + loss, most of a small model's step, is already a fused eager kernel), and not on MPS,
    where inductor is still a prototype."""
    if isinstance(setting, str) and setting.lower() in ('true', 'false'):
        setting = setting.lower() == 'true'
    if not (isinstance(setting, bool) or setting == 'auto'):
        raise ValueError(f"compile={setting!r} is not a valid setting; use --compile=True, --compile=False "
                         f"or --compile=auto (on where it measured faster: CUDA, Gaudi eager mode)")
    if setting != 'auto':
        return setting
    kind = device_type(device)
    return kind == 'cuda' or (kind == 'hpu' and _htcore is None)


def compile_model(model, device):
    """torch.compile for the device: 'hpu_backend' in Gaudi eager mode; lazy mode has its own graph
    compiler, so the model is returned unchanged there (with a note)."""
    if device_type(device) == 'hpu':
        if _htcore is not None:
            print("compile=True ignored: Gaudi lazy mode (PT_HPU_LAZY_MODE=1) builds graphs itself; "
                  "set PT_HPU_LAZY_MODE=0 to use torch.compile")
            return model
        return torch.compile(model, backend='hpu_backend')
    return torch.compile(model)


def fused_optimizer(optimizer, device):
    """On Gaudi in lazy mode, Habana's FusedAdamW with the same parameter groups and settings;
    elsewhere the optimizer unchanged (model.configure_optimizers already picks fused on CUDA)."""
    if device_type(device) != 'hpu' or _htcore is None:
        return optimizer
    try:
        from habana_frameworks.torch.hpex.optimizers import FusedAdamW
    except ImportError:  # older / eager-only builds
        return optimizer
    d = optimizer.defaults
    groups = [{'params': g['params'], 'weight_decay': g['weight_decay']} for g in optimizer.param_groups]
    print("using Habana FusedAdamW")
    return FusedAdamW(groups, lr=d['lr'], betas=d['betas'], eps=d['eps'], weight_decay=d['weight_decay'])


# ----------------------------------------------------------------------------------------------
# Timing and memory

def synchronize(device):
    """Wait for queued device work, so wall-clock timings measure it."""
    kind = device_type(device)
    if kind == 'cuda':
        torch.cuda.synchronize(device)
    elif kind == 'hpu':
        mark_step()
        torch.hpu.synchronize()
    elif kind == 'mps':
        torch.mps.synchronize()


def max_memory_allocated(device):
    """Peak bytes allocated by tensors on the device since the start (None where torch cannot tell)."""
    kind = device_type(device)
    if kind == 'cuda':
        return torch.cuda.max_memory_allocated(device)
    if kind == 'hpu':
        return torch.hpu.max_memory_allocated()
    return None


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence what C++ code writes to the process's stderr (torch.profiler's Kineto prints a
    'profiler_start' / 'profiler_stop' line at each use); Python's own messages are not affected."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (an embedded interpreter): nothing to silence
        yield
        return
    try:
        with open(os.devnull, 'w') as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_tensor_peak(fn, live_tensors=()):
    """Run fn() on CPU and return the most bytes its tensors held at once, plus the bytes of
    live_tensors (the model's parameters and optimizer state, already allocated): what
    torch.cuda.max_memory_allocated counts on a GPU, which CPU torch has no counter for. Read from
    torch.profiler's allocation trace (profile_memory=True: every allocation and free with the
    running total), so allocator slack and library scratch space are not in it, unlike the RSS.
    None where this torch's profiler does not expose the trace."""
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)
    try:
        events = sorted((n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
                         if n.tag == _EventType.Allocation and n.extra_fields.device.type == 'cpu'),
                        key=lambda n: n.start_time_ns)
    except AttributeError:
        return None
    # the running total also counts tensors allocated under an earlier profiler and still alive:
    # measure from the total just before fn's first allocation
    start = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size if events else 0
    peak = max((n.extra_fields.total_allocated for n in events), default=start) - start
    seen = set()  # parameters can share storage (GPT's tied embedding and lm_head)
    live = 0
    for t in live_tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            live += t.untyped_storage().nbytes()
    return live + max(peak, 0)


# Dense peak FLOP/s (no sparsity) in TFLOP/s for (bf16/fp16, float32). float32 on NVIDIA Ampere and
# later is TF32 on tensor cores (setup() enables it). Checked in order: a name matches its first
# entry, so more specific names come first ('A100' before 'A10', 'H100 PCIe' before 'H100').
_PEAK_TFLOPS = (
    ('GH200', 989, 494), ('H200', 989, 494), ('H100 PCIe', 756, 378), ('H100', 989, 494),
    ('H800', 989, 494), ('A100', 312, 156), ('A800', 312, 156), ('L40S', 362, 183), ('L40', 181, 90),
    ('L4', 121, 60), ('A10', 125, 62), ('RTX 4090', 165, 83), ('RTX 3090', 71, 36),
    ('V100', 125, 15.7), ('T4', 65, 8.1),
    ('GAUDI3', 1835, None), ('GAUDI2', 432, None),  # Intel spec sheets (bf16 matrix)
)


def device_name(device):
    kind = device_type(device)
    if kind == 'cuda':
        return torch.cuda.get_device_name(device)
    if kind == 'hpu':
        return torch.hpu.get_device_name()
    return kind


def spec_sheet_tflops(device, dtype):
    """The spec-sheet peak TFLOP/s of a known accelerator for matmuls in `dtype`, else None."""
    if device_type(device) in ('cuda', 'hpu'):
        name = device_name(device).upper()
        for key, half, single in _PEAK_TFLOPS:
            if key.upper() in name:
                return half if dtype in ('bfloat16', 'float16') else single
    return None


@functools.lru_cache(maxsize=None)
def peak_flops(device, dtype, measure_seconds=1.0):
    """Peak FLOP/s of one device for matmuls in `dtype`, the denominator of MFU: the spec-sheet
    figure for known accelerators, else (CPU, unknown GPUs) the best matmul throughput measured
    over `measure_seconds`, once per process. Not less than ~1 s: the first few hundred ms of a
    fresh process run slow (thread pool and clock speed ramping up), and 0.25 s measured up to 2x
    too low a peak, i.e. 2x too high an MFU (docs/benchmarks.md)."""
    tflops = spec_sheet_tflops(device, dtype)
    if tflops is not None:
        return tflops * 1e12
    return _measured_matmul_flops(device, dtype, measure_seconds)


def _measured_matmul_flops(device, dtype, seconds):
    n = 1024 if device_type(device) == 'cpu' else 4096
    a = torch.randn(n, n, device=device, dtype=torch_dtype(dtype))
    b = torch.randn(n, n, device=device, dtype=torch_dtype(dtype))
    best = 0.0
    deadline = time.perf_counter() + seconds
    for i in range(10_000):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        dt = time.perf_counter() - t0
        if i > 0:  # the first call pays for allocation and kernel selection
            best = max(best, 2 * n ** 3 / dt)
        if i > 1 and time.perf_counter() > deadline:
            break
    return best


def slot_gpus(slot, nproc, gpus):
    """The GPUs of job slot `slot` when several runs train at a time (compare.py's jobs), nproc each: its own
    where there are enough for every slot, else shared round the `gpus` there are (small models: several runs
    at a time on one GPU, each far from filling it)."""
    return [(slot * nproc + k) % gpus for k in range(nproc)]
