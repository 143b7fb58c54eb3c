"""
How fast each attention variant trains (and, optionally, generates) on this device.

$ python bench.py                                  # every attn_type, at a size that fits the device (below)
$ python bench.py --attn_types=base,diff,dint --batch_size=8 --block_size=256 --n_layer=4 --n_head=4 --n_embd=256
$ python bench.py --attn_types=base --compile=both --fused_loss=False   # eager vs torch.compile, plain loss
$ python bench.py --attn_types=base --dtype=float32 --json_out=bench-fp32.json
$ python bench.py --generate=True                  # also: tokens/s of generation with / without the KV cache
$ python bench.py --plan=True --attn_types=base,noiseformer_v2   # memory per GPU before renting any (no timing)

Size: GPT-2 small at batch 12, block 1024 (nanoGPT's bench.py) on CUDA and Gaudi; on CPU and MPS,
where that takes minutes per step, a 4-layer 256-wide model at batch 8, block 256. A size key given
on the command line or in a config file always wins; the first line printed says which size ran. A size
whose training step cannot fit the device (at least: weights, gradients and AdamW state, each block's
input, the batch) is refused before anything is allocated, in one line naming the setting and the memory.

For each attn_type: build the model (same seed), run warmup_iters training steps, then time
bench_iters steps one at a time (the device synchronised around each) and report the median:
ms/iter, tokens/s, MFU (model.estimate_mfu against device.peak_flops: the spec-sheet peak of known
GPUs and Gaudis; on CPU and unknown devices the best measured matmul throughput), peak memory, and
the ratio of ms/iter to base's in the same run. The step is train.py's: autocast forward, loss =
cross-entropy + kl_weight * KL, backward, gradient clipping, AdamW (model.configure_optimizers),
zero_grad. Fetching the batch is not timed. rounds > 1 repeats the whole list, interleaved
(base, diff, base, diff, ...), and reports the median over every timed step, so that background
load on a shared machine hits all variants alike. compile='both' times every variant eager and
compiled, one after the other; '1st step' is the first warm-up step in seconds, which for a
compiled model is the cold compile (forward and backward graphs) plus one step.

Peak memory: tensors only, so that CPU and GPU figures compare. CUDA / Gaudi: max_memory_allocated.
CPU: the parameters' and optimizer state's bytes plus the most bytes that one more training step's
tensors held at once, read from torch.profiler's allocation trace (device.cpu_tensor_peak). Where
that trace is missing, on Linux: the peak resident set size while the variant ran minus the size
just before the model was built (reset through /proc/self/clear_refs, glibc's free memory handed
back first), an upper bound that also counts allocator slack and oneDNN scratch space, and moves
with them (1.24x to 1.36x base for the same variant in different runs, measured on CPU). Elsewhere: n/a.
"""

from configurator import answer_help, variant_settings
from denoised_gpt.cpu_threads import wait_passively_if_busy

answer_help(__file__)  # --help before the heavy imports below
wait_passively_if_busy()  # before torch loads OpenMP, which reads its wait policy once

import builtins
import contextlib
import ctypes
import dataclasses
import gc
import io
import json
import os
import platform
import statistics
import sys
import time

import torch

from denoised_gpt.cli import (MAX_STEPS, check_attn_types, check_ranges, duration, fail, human_bytes, print_result,
                              ram_bytes, read_config, refused_allocation)
from denoised_gpt.device import (autocast_context, compile_model, cpu_tensor_peak, device_name, device_type,
                    fused_optimizer, grad_scaler, manual_seed, mark_step, max_memory_allocated, peak_flops,
                    resolve_compile, resolve_device, resolve_dtype, setup, spec_sheet_tflops,
                    synchronize)
from denoised_gpt.files import FileError, write_atomically
from model import ATTENTION_TYPES, GPT, GPTConfig

# -----------------------------------------------------------------------------
attn_types = 'all'  # comma-separated attn_type values (e.g. 'base,diff'), or 'all'
# model: GPT-2 small (nanoGPT's bench.py); on cpu / mps, each size key not given takes the value in ()
batch_size = 12  # sequences per step (cpu / mps: 8 unless given)
block_size = 1024  # context length in tokens (cpu / mps: 256 unless given)
n_layer = 12  # transformer blocks (cpu / mps: 4 unless given)
n_head = 12  # attention heads per block (cpu / mps: 4 unless given)
n_embd = 768  # model width (cpu / mps: 256 unless given)
vocab_size = 50304  # with --dataset, the dataset's own vocabulary size when it has one
bias = False  # biases in Linear and LayerNorm layers
dropout = 0.0  # dropout probability
globals().update(variant_settings())  # each variant's own settings: model.py's GPTConfig fields, defaults, meanings
dataset = ''  # '' = synthetic random tokens, else real batches from data/<dataset>/train.bin
# the training step (as in train.py)
learning_rate = 6e-4  # AdamW learning rate
weight_decay = 1e-1  # AdamW weight decay
beta1 = 0.9  # AdamW beta1
beta2 = 0.95  # AdamW beta2
grad_clip = 1.0  # gradient clipping (0 = off)
kl_weight = 5e-6  # loss = cross-entropy + kl_weight * KL (NoiseFormer)
fused_loss = True  # train.py's loss (the fused, chunked one; compiled on CUDA, inductor's); False: lm_head + F.cross_entropy
# timing
warmup_iters = 3  # untimed steps first (allocator, kernel selection, compile)
bench_iters = 5  # timed steps per variant and round; the median over all rounds is reported
rounds = 3  # run the whole list this many times, interleaved (one round is too noisy to compare variants)
profile = False  # after timing, print torch.profiler's top operators of 3 steps for each variant
# generation benchmark
generate = False  # also time model.generate with and without the KV cache
max_new_tokens = 100  # tokens generated per timed generation
gen_prompt_len = 1  # prompt tokens (random ids); generation uses temperature 0.8, top_k 200 like sample.py
# system
device = 'auto'  # 'auto' (cuda > hpu > mps > cpu), 'cpu', 'cuda', 'cuda:1', 'hpu', 'mps'
dtype = 'auto'  # 'auto', 'float32', 'bfloat16' or 'float16'
compile = 'auto'  # torch.compile: True, False, 'auto' (where it measured faster: CUDA, Gaudi eager) or 'both'
seed = 1337  # the same initial weights and batches for every variant
json_out = ''  # write the results here as JSON too
# memory plan (no device needed, nothing is timed): bytes per GPU for GPT-2 small / medium / large / XL
plan = False  # print the memory plan for every attn_type x (ddp, fsdp) x activation checkpointing off / on, and exit
plan_world_size = 8  # plan: GPUs that FSDP shards the weights, gradients and AdamW state over
plan_usable_fraction = 0.9  # plan: share of each device's memory planned for (the rest: CUDA context, fragmentation)
plan_micro_steps = 1  # plan: micro-batches per rank per optimizer step (train.py's gradient_accumulation_steps / ranks)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))]
SIZE_KEYS = ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd')
# GPT-2 small takes minutes per step on a CPU: there, the model of docs/benchmarks.md
SMALL_DEVICE_SIZE = dict(batch_size=8, block_size=256, n_layer=4, n_head=4, n_embd=256)


DEFAULTS = {k: globals()[k] for k in config_keys}  # before any config file or override
given = set()  # the keys a config file or --key=value set
globals().update(read_config(__file__, {k: globals()[k] for k in config_keys}, given))


def print(*args, **kwargs):
    """The builtin print, flushed at once: a stdout that cannot take the results (a full disk, a closed pipe)
    ends the script in one line (cli.print_result's), not a traceback now or at exit."""
    try:
        builtins.print(*args, **{**kwargs, 'flush': True})
    except OSError:
        print_result('')  # fails again on the same stdout, and says where and why in one line


def least_parameters(s):
    """A lower bound of the parameters at the sizes s (n_layer, n_embd, block_size, vocab_size), whatever the
    attn_type, from arithmetic alone (building a model of 10^11 layers, even on the meta device, never ends):
    the embeddings, the MLPs (8 C^2 a layer) and the smallest attention (symmetric's 3 C^2)."""
    return (s['vocab_size'] + s['block_size']) * s['n_embd'] + s['n_layer'] * 11 * s['n_embd'] ** 2


def least_step_bytes(s):
    """A lower bound of one training step's memory at the sizes s (least_parameters' and batch_size): float32
    weights, gradients and AdamW's two moments (16 bytes a parameter), each block's float32 input kept for the
    backward, and the batch's int64 inputs and targets."""
    tokens = s['batch_size'] * s['block_size']
    return 16 * least_parameters(s) + 4 * s['n_layer'] * tokens * s['n_embd'] + 16 * tokens


def machine_memory(device):
    """Bytes of memory the device has: a CUDA GPU's own, else this machine's RAM (the CPU's, MPS's unified
    memory); None where it is not known (Gaudi)."""
    if device_type(device) == 'cuda':
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    if device_type(device) in ('cpu', 'mps'):
        return ram_bytes()
    return None


def check_fits(sizes, need, room, where, fix, defaults=DEFAULTS):
    """ValueError when need(sizes) bytes exceed room: one line naming the memory needed and the size setting
    that, given above its default and put back there, lowers the need most (the culprit); `fix` ends the line,
    with {} for the culprit's name."""
    needed = need(sizes)
    if room is None or needed <= room:
        return
    suspects = [k for k in sizes if k in given and sizes[k] > defaults[k]]
    culprit = min(suspects, key=lambda k: need({**sizes, k: defaults[k]}), default=None)
    at = ', '.join(f"{k}={v}" for k, v in sizes.items())
    what = f"{culprit}={sizes[culprit]} is too large: " if culprit else ""
    fix = fix.format(culprit) if culprit else fix.replace('a smaller {}', 'smaller sizes')
    raise ValueError(f"{what}{where} at {at} would need at least {human_bytes(needed)}, more than the "
                     f"{human_bytes(room)} {fix}")


@contextlib.contextmanager
def refused_memory(what):
    """The allocator's refusal (cli.refused_allocation) inside the block: one line naming the sizes, exit 2."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if refused_allocation(e) is None:
            raise
        sizes = ', '.join(f"{k}={globals()[k]}" for k in SIZE_KEYS + ('vocab_size',))
        fail(f"cannot {what} at {sizes}: {refused_allocation(e)}; choose smaller sizes")


def check_json_out():
    """Exit 2 unless json_out names a file this run can write, asked now, not after the benchmark has run:
    its folder exists, and it is not a folder itself."""
    folder = os.path.dirname(os.path.abspath(json_out))
    if os.path.isdir(json_out):
        fail(f"json_out={json_out!r} is a folder; name a file in it, e.g. "
             f"--json_out={os.path.join(json_out, 'bench.json')}")
    if not os.path.isdir(folder):
        fail(f"json_out={json_out!r}: its folder {folder} does not exist; create it or name a file in another folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        fail(f"json_out={json_out!r}: no permission to write in {folder}; name a file in a folder you can write in")


def write_json_out(report):
    """The results as JSON at json_out, written whole or not at all (files.write_atomically): a full disk
    leaves the file there before intact and ends the script in one line (exit 1); the results are on stdout."""
    try:
        write_atomically(json_out, lambda f: json.dump(report, f, indent=2),
                         then=", then run bench.py again (the results above are complete)")
    except FileError as e:
        builtins.print(f"bench.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"\nwrote {json_out}")


def model_config(attn_type):
    """The GPTConfig of one variant: this script's settings that are GPTConfig fields, as they are now."""
    return GPTConfig(attn_type=attn_type, **{f.name: globals()[f.name] for f in dataclasses.fields(GPTConfig)
                                             if f.name in config_keys})


variants = list(ATTENTION_TYPES) if attn_types == 'all' else [a.strip() for a in attn_types.split(',') if a.strip()]
try:
    check_attn_types(variants, all_allowed=True)
except ValueError as e:
    fail(e)
variants = list(dict.fromkeys(variants))  # drop repeats, keep the order

if plan:  # arithmetic on the model's shapes only: before any device is touched
    from denoised_gpt.memory_plan import DEVICE_GIB, GPT2_SIZES, format_plan, plan as memory_plan
    sizes = GPT2_SIZES
    if given & {'n_layer', 'n_head', 'n_embd'}:
        sizes = {f'{n_layer}/{n_embd}/{n_head}': (n_layer, n_head, n_embd)}
    try:
        check_ranges({'plan_world_size': plan_world_size, 'block_size': block_size, 'vocab_size': vocab_size,
                      'plan_micro_steps': plan_micro_steps},
                     at_least_one=('plan_world_size', 'block_size', 'vocab_size', 'plan_micro_steps'))
        if not 0 < plan_usable_fraction <= 1:
            raise ValueError(f"plan_usable_fraction={plan_usable_fraction} must be in (0, 1]")
        # a size whose weights, gradients and AdamW state alone fill every planned device, sharded over all of
        # them: its plan is all zeros, and building it (even on the meta device) may never end
        largest = max(DEVICE_GIB) * 2 ** 30
        for n_layer_, n_head_, n_embd_ in sizes.values():
            check_fits(dict(n_layer=n_layer_, n_embd=n_embd_, block_size=block_size, vocab_size=vocab_size),
                       lambda s: 16 * least_parameters(s) / plan_world_size, largest,
                       f"the weights, gradients and AdamW state per GPU (16 bytes a parameter, sharded over "
                       f"plan_world_size={plan_world_size} GPUs)",
                       "of the largest device planned for; choose a smaller {} or a larger plan_world_size")
        if json_out:
            check_json_out()
        plan_rows = memory_plan(variants, sizes, block_size, vocab_size, bias, plan_world_size, plan_usable_fraction,
                                plan_micro_steps)
    except ValueError as e:
        fail(e)
    print(format_plan(plan_rows, plan_world_size, plan_usable_fraction, plan_micro_steps))
    if json_out:
        write_json_out(dict(command=' '.join(['python', 'bench.py'] + sys.argv[1:]), world_size=plan_world_size,
                            usable_fraction=plan_usable_fraction, micro_steps=plan_micro_steps, rows=plan_rows))
    sys.exit(0)
try:
    # warm-up at least 1: the first step pays for allocation, kernel selection, compiling
    check_ranges({k: globals()[k] for k in config_keys},
                 at_least_one=('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'vocab_size', 'warmup_iters',
                               'bench_iters', 'rounds', 'max_new_tokens', 'gen_prompt_len'),
                 non_negative=('grad_clip', 'weight_decay', 'kl_weight'), unit_interval=('beta1', 'beta2', 'dropout'),
                 positive=('learning_rate',), seeds=('seed',),
                 at_most={'warmup_iters': (MAX_STEPS, "steps"), 'bench_iters': (MAX_STEPS, "steps"),
                          'rounds': (MAX_STEPS, "rounds")})
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if device_type(device) in ('cpu', 'mps'):
        globals().update({k: v for k, v in SMALL_DEVICE_SIZE.items() if k not in given})
    size_note = 'size as given' if given & set(SIZE_KEYS) else f'the default size on {device_type(device)}'
    compile_modes = [False, True] if compile == 'both' else [resolve_compile(compile, device)]
    for a in variants:  # every variant's shape checks before anything runs
        model_config(a)
    # sizes no machine of this kind holds: refused now, in one line, not by the allocator's traceback
    memory = machine_memory(device)
    device_defaults = {**DEFAULTS, **(SMALL_DEVICE_SIZE if device_type(device) in ('cpu', 'mps') else {})}
    check_fits({k: globals()[k] for k in SIZE_KEYS + ('vocab_size',) if k != 'n_head'}, least_step_bytes, memory,
               "one training step", f"of memory this {device_type(device)} has; choose a smaller {{}}",
               device_defaults)
    if generate:
        check_fits(dict(gen_prompt_len=gen_prompt_len, max_new_tokens=max_new_tokens),
                   lambda s: 8 * (s['gen_prompt_len'] + s['max_new_tokens']), memory, "the generated token ids alone",
                   f"of memory this {device_type(device)} has; choose a smaller {{}}")
    if json_out:
        check_json_out()
except ValueError as e:
    fail(f"{e}{' (or, in bench.py, --compile=both)' if str(e).startswith('compile=') else ''}")
config = {k: globals()[k] for k in config_keys}
setup(device)
kind = device_type(device)
ctx = autocast_context(device, dtype)

# data: one fixed random batch (nanoGPT's real_data=False), or windows of a prepared dataset
batches = None
if dataset:
    from denoised_gpt.batches import TokenBatches, TokenIdError, load_meta
    data_dir = os.path.join('data', dataset)
    try:
        meta = load_meta(data_dir)
        if meta is not None:
            vocab_size = meta['vocab_size']
        batches = TokenBatches(data_dir, 'train', block_size, batch_size, device=device, seed=seed,
                               vocab_size=vocab_size)
    except (FileNotFoundError, ValueError) as e:
        fail(f"{e}; or leave --dataset empty for synthetic tokens")  # e says what to prepare, and where
else:
    g = torch.Generator().manual_seed(seed)
    with refused_memory("make the batch"):
        X = torch.randint(vocab_size, (batch_size, block_size), generator=g).to(device)
        Y = torch.randint(vocab_size, (batch_size, block_size), generator=g).to(device)


def get_batch():
    if batches is None:
        return X, Y
    try:
        return batches.get_batch()
    except TokenIdError as e:  # an id the embedding has no row for, in a file too large to scan up front
        fail(e)


# -----------------------------------------------------------------------------
# peak memory


def _libc():
    try:
        return ctypes.CDLL('libc.so.6')
    except OSError:
        return None


LIBC = _libc() if kind == 'cpu' and sys.platform.startswith('linux') else None


def proc_status_kib(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    raise KeyError(field)


def cpu_peak_rss_supported():
    try:
        proc_status_kib('VmHWM')
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except (OSError, KeyError):
        return False


if kind in ('cuda', 'hpu'):
    memory_method = f'{kind} max_memory_allocated'
elif kind == 'cpu' and cpu_tensor_peak(lambda: torch.ones(1)) is not None:
    memory_method = 'tensors: parameters + optimizer state + one step (torch.profiler allocation trace)'
elif kind == 'cpu' and cpu_peak_rss_supported():
    memory_method = 'peak RSS delta (Linux /proc/self/status VmHWM)'
else:
    memory_method = None


def memory_start():
    """Forget earlier variants' memory; return the baseline to subtract (bytes)."""
    gc.collect()
    if kind == 'cuda':
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    elif kind == 'hpu' and hasattr(torch.hpu, 'reset_peak_memory_stats'):
        torch.hpu.reset_peak_memory_stats()
    elif memory_method is not None and memory_method.startswith('peak RSS'):
        if LIBC is not None and hasattr(LIBC, 'malloc_trim'):
            LIBC.malloc_trim(0)
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')  # resets VmHWM to the current VmRSS
        return proc_status_kib('VmRSS') * 1024
    return 0


def memory_peak(baseline, step, model, optimizer):
    if memory_method is None:
        return None
    if kind in ('cuda', 'hpu'):
        return max_memory_allocated(device)
    if memory_method.startswith('tensors'):
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return cpu_tensor_peak(step, list(model.parameters()) + list(model.buffers()) + state)
    return proc_status_kib('VmHWM') * 1024 - baseline


# -----------------------------------------------------------------------------
# one variant


def build(attn_type):
    manual_seed(seed)
    model = GPT(model_config(attn_type))
    model.to(device)
    return model


def train_steps(attn_type, compiled):
    """Warm up, time bench_iters steps; returns (per-step seconds, first step seconds, peak memory
    bytes, params, model)."""
    baseline = memory_start()
    model = build(attn_type)
    with contextlib.redirect_stdout(io.StringIO()):  # configure_optimizers reports its groups
        optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), kind)
        optimizer = fused_optimizer(optimizer, device)
    scaler = grad_scaler(device, dtype)
    raw_model = model
    if compiled:
        model = compile_model(model, device)

    def step():
        x, y = get_batch()
        synchronize(device)
        t0 = time.perf_counter()
        with ctx:
            _, ce = model(x, y, return_logits=not fused_loss)  # train.py: the fused loss
            loss = ce + kl_weight * raw_model.kl_divergence()
        scaler.scale(loss).backward()
        mark_step()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        mark_step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - t0

    first = step()  # compiles, when compiled
    for _ in range(warmup_iters - 1):
        step()
    times = [step() for _ in range(bench_iters)]
    peak_mem = memory_peak(baseline, step, raw_model, optimizer)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == 'cuda' else [])
        with torch_profile(activities=activities) as prof:
            for _ in range(3):
                step()
        sort = 'self_cuda_time_total' if kind == 'cuda' else 'self_cpu_time_total'
        print(f"\n--- {attn_type}{' (compiled)' if compiled else ''}: top operators over 3 steps ---")
        print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    return times, first, peak_mem, raw_model.get_num_params(), raw_model


def generation(model):
    """Seconds to generate max_new_tokens tokens after a gen_prompt_len prompt, with and without the cache."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (1, gen_prompt_len), generator=g).to(device)
    out = {}
    for use_cache in (True, False):
        with torch.no_grad(), ctx:
            model.generate(prompt, min(5, max_new_tokens), temperature=0.8, top_k=200, use_cache=use_cache)  # warm-up
            manual_seed(seed)
            synchronize(device)
            t0 = time.perf_counter()
            model.generate(prompt, max_new_tokens, temperature=0.8, top_k=200, use_cache=use_cache)
            synchronize(device)
        out[use_cache] = time.perf_counter() - t0
    model.train()
    return out


# -----------------------------------------------------------------------------
# run

if generate and gen_prompt_len + max_new_tokens > block_size:
    print(f"note: gen_prompt_len + max_new_tokens = {gen_prompt_len + max_new_tokens} > block_size = "
          f"{block_size}: past block_size, generate() crops the context and recomputes it every token, "
          f"with or without the cache")
peak = peak_flops(device, dtype)  # a known accelerator's spec-sheet figure, else a measured matmul rate
known = spec_sheet_tflops(device, dtype) is not None
peak_source = f"{device_name(device)} spec sheet" if known else f"measured {dtype} matmul"
cpu_name = platform.processor() or platform.machine()
if sys.platform.startswith('linux'):
    with contextlib.suppress(OSError), open('/proc/cpuinfo') as f:
        names = [l.split(':', 1)[1].strip() for l in f if l.startswith('model name')]
        cpu_name = names[0] if names else cpu_name
hardware = device_name(device) if kind in ('cuda', 'hpu') else f"{cpu_name}, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}" if kind == 'cpu' else kind
tokens_per_iter = batch_size * block_size
print(f"device {device} ({dtype}): {hardware}; torch {torch.__version__}")
print(f"model ({size_note}): n_layer {n_layer}, n_head {n_head}, n_embd {n_embd}, block_size {block_size}, "
      f"vocab_size {vocab_size}, bias {bias}; batch_size {batch_size} ({tokens_per_iter:,} tokens/iter), "
      f"{os.path.join('data', dataset) if dataset else 'synthetic tokens'}")
loss_note = "train.py's (fused lm_head + cross-entropy; inductor's compiled on CUDA)" if fused_loss else \
    'lm_head + F.cross_entropy'
print(f"step: {loss_note}, "
      f"{' and '.join('compiled' if c else 'eager' for c in compile_modes)} (compile={compile!r})")
print(f"MFU against {peak / 1e12:.3g} TFLOP/s ({peak_source}); peak memory: {memory_method or 'n/a on this device'}")
if batches is not None and batches.layout.labels_path:
    print("answer-only targets: the fused loss runs the lm_head at the labelled positions only, while MFU counts "
          "it at every position (so MFU reads high)")
print(f"timing: {warmup_iters} warm-up + {bench_iters} timed steps per variant, {rounds} round(s), "
      f"median per step", flush=True)

# one small training step first: libraries initialise lazily (thread pools, kernel caches), and
# that one-time memory and time should not be charged to whichever variant happens to run first
with contextlib.redirect_stdout(io.StringIO()):
    _m = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)).to(device)
    _opt = _m.configure_optimizers(0.0, 1e-3, (0.9, 0.95), kind)
    with ctx:
        _loss = _m(torch.zeros(1, 16, dtype=torch.long, device=device), torch.zeros(1, 16, dtype=torch.long, device=device))[1]
    _loss.backward()
    _opt.step()
    synchronize(device)
    del _m, _opt, _loss

runs = [(a, c) for a in variants for c in compile_modes]  # (attn_type, compiled), in running order
# each variant's graph is one more entry in dynamo's cache of GPT.forward (later rounds reuse it);
# past the recompile limit (8 by default) dynamo would silently run the rest eager
torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(variants))  # Gaudi: torch 2.6
step_times = {run: [] for run in runs}
round_medians = {run: [] for run in runs}  # each round's median step: how far the rounds agree
first_step = {}  # seconds of a run's first step in the first round: the cold compile when compiled
peak_memory = {run: None for run in runs}
num_params = {}
flops_per_iter = {}  # estimate_mfu at 1 s/iter against 1 FLOP/s = the FLOPs of one iteration
gen_times = {a: {True: [], False: []} for a in variants}
t_start = time.perf_counter()
for r in range(rounds):
    if r == 1:  # the first round, cold compiles and all, says how long the rest will take
        print(f"  round 1 took {time.perf_counter() - t_start:.0f} s: {rounds - 1} more to go, about "
              f"{(rounds - 1) * (time.perf_counter() - t_start - sum(first_step.values())):.0f} s", flush=True)
    for i, (a, c) in enumerate(runs):
        label = f"{a}{' compiled' if c else ''}"
        print(f"  round {r + 1}/{rounds}, {i + 1}/{len(runs)} {label}: ", end='', flush=True)
        t_run = time.perf_counter()
        with refused_memory(f"train {label}"):
            times, first, mem, n_params, model = train_steps(a, c)
        step_times[a, c] += times
        round_medians[a, c].append(statistics.median(times))
        first_step.setdefault((a, c), first)
        num_params[a] = n_params
        flops_per_iter[a] = model.estimate_mfu(batch_size, 1.0, 1.0)
        if mem is not None:
            peak_memory[a, c] = max(mem, peak_memory[a, c] or 0)
        if generate and c == compile_modes[0]:  # generation is eager either way: once per variant
            with refused_memory(f"generate with {a}"):
                generated = generation(model)
            for use_cache, t in generated.items():
                gen_times[a][use_cache].append(t)
        del model
        print(f"{statistics.median(times) * 1000:.1f} ms/iter (1st step {first:.1f} s, "
              f"{time.perf_counter() - t_run:.0f} s in all)", flush=True)
        if r == i == 0 and len(runs) * rounds > 1:  # the whole run's length, long before round 1 ends
            took = time.perf_counter() - t_run
            whole = len(runs) * took + len(runs) * (rounds - 1) * (took - first)  # later rounds: no one-time work
            print(f"  the whole benchmark: about {duration(whole)} ({len(runs)} run(s) x {rounds} round(s) at "
                  f"{label}'s {took:.0f} s; other variants take more or less)", flush=True)

results = []
for a, c in runs:
    ms = statistics.median(step_times[a, c]) * 1000
    base_ms = statistics.median(step_times['base', c]) * 1000 if 'base' in variants else None
    eager_ms = statistics.median(step_times[a, False]) * 1000 if (a, False) in step_times else None
    results.append(dict(attn_type=a, compile=c, fused_loss=fused_loss, params=num_params[a], ms_per_iter=ms,
                        ms_per_iter_min=min(step_times[a, c]) * 1000, tokens_per_s=tokens_per_iter / (ms / 1000),
                        mfu=flops_per_iter[a] / (ms / 1000) / peak, peak_memory_bytes=peak_memory[a, c],
                        first_step_s=first_step[a, c], ratio_to_base=ms / base_ms if base_ms else None,
                        ratio_to_eager=ms / eager_ms if eager_ms else None,
                        round_ms=[t * 1000 for t in round_medians[a, c]],
                        round_spread=(max(round_medians[a, c]) - min(round_medians[a, c])) / (ms / 1000)))
    if generate and c == compile_modes[0]:
        cached, uncached = (statistics.median(gen_times[a][c]) for c in (True, False))
        results[-1].update(gen_tokens_per_s_cache=max_new_tokens / cached,
                           gen_tokens_per_s_no_cache=max_new_tokens / uncached, gen_cache_speedup=uncached / cached)


def fmt_bytes(b):
    return 'n/a' if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def fmt_ratio(x):
    return f"{x:.2f}x" if x is not None else '-'


MAX_ROUND_SPREAD = 0.25  # rounds whose medians differ by more than this share of the median: not a measurement
both = len(compile_modes) > 1  # 'vs eager' only says something when a variant ran both ways
print()
print(f"{'attn_type':<16}{'compile':>8}{'params':>9}{'ms/iter':>10}{'tokens/s':>10}{'MFU':>8}{'peak mem':>11}"
      f"{'1st step':>10}{'vs base':>9}" + (f"{'vs eager':>10}" if both else ''))
for r in results:
    print(f"{r['attn_type']:<16}{'yes' if r['compile'] else 'no':>8}{r['params'] / 1e6:>8.2f}M{r['ms_per_iter']:>10.1f}"
          f"{r['tokens_per_s']:>10,.0f}{r['mfu'] * 100:>7.1f}%{fmt_bytes(r['peak_memory_bytes']):>11}"
          f"{r['first_step_s']:>9.1f}s{fmt_ratio(r['ratio_to_base']):>9}"
          + (f"{fmt_ratio(r['ratio_to_eager']):>10}" if both else ''))
unsteady = [r for r in results if r['round_spread'] > MAX_ROUND_SPREAD]
if unsteady:
    worst = max(unsteady, key=lambda r: r['round_spread'])
    print(f"\nwarning: the rounds disagree: {worst['attn_type']} took "
          f"{' / '.join(f'{t:.0f}' for t in worst['round_ms'])} ms per step in its {rounds} rounds (spread "
          f"{worst['round_spread']:.0%} of the median; {len(unsteady)} of {len(results)} runs above "
          f"{MAX_ROUND_SPREAD:.0%}): something else is using the device, and the ratios above are not to be "
          f"trusted. Measure on an idle machine" + (", with OMP_NUM_THREADS=1," if kind == 'cpu' else '')
          + " or with more --rounds")
elif rounds > 1:
    print(f"\nthe rounds agree: every run's round medians within {MAX_ROUND_SPREAD:.0%} of its median")
if 'base' not in variants:
    print("\n(add base to --attn_types for the 'vs base' column)")
if generate:
    print()
    print(f"generation: {max_new_tokens} new tokens after a {gen_prompt_len}-token prompt, batch 1, "
          f"temperature 0.8, top_k 200")
    print(f"{'attn_type':<16}{'KV cache tok/s':>16}{'no cache tok/s':>16}{'speed-up':>10}")
    for r in (r for r in results if 'gen_tokens_per_s_cache' in r):
        print(f"{r['attn_type']:<16}{r['gen_tokens_per_s_cache']:>16.1f}{r['gen_tokens_per_s_no_cache']:>16.1f}"
              f"{r['gen_cache_speedup']:>9.2f}x")

if json_out:
    write_json_out(dict(device=device, device_name=hardware, dtype=dtype, torch=torch.__version__,
                        peak_flops=peak, peak_flops_source=peak_source, memory_method=memory_method,
                        tokens_per_iter=tokens_per_iter, command=' '.join(['python', 'bench.py'] + sys.argv[1:]),
                        config=config, results=results))
