"""What several test files share: paths, synthetic datasets, running the scripts (as subprocesses or
in this process), tiny models and checkpoints, and a local lm-eval task. A plain module, not a test file.

The tiny model is tests/config_tiny.py's (2 layers, 2 heads, 32 wide, context 32, no bias) over
VOCAB tokens; each builder takes keyword overrides for the files that need another size.
"""
import contextlib
import dataclasses
import gc
import io
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from denoised_gpt.checkpoint import save_checkpoint
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / 'tests' / 'config_tiny.py'  # the train.py config of the tests' training runs
VOCAB = 48  # make_dataset's vocabulary

# config_tiny.py's model over make_dataset's vocabulary (test_train checks that they agree)
TINY_MODEL = dict(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, bias=False)

NO_AUTOCAST = torch.autocast('cpu', enabled=False)  # float32 evaluation on CPU


# -----------------------------------------------------------------------------
# data

def write_tokens(path, tokens):
    """A token file as data/<name>/ holds one (flat uint16), at path (its folder made if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return path


def make_dataset(tmp_path, n_train=30_000, n_val=6_000, seed=0):
    """Token files as data/<name>/ holds them (train.bin, val.bin: flat uint16; meta.json), from a
    Markov chain that mostly follows a fixed random successor table: learnable in a few dozen
    iterations, unlike uniform noise."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(VOCAB)
    tokens = np.empty(n_train + n_val, dtype=np.uint16)
    tokens[0] = 0
    jump = rng.random(len(tokens)) < 0.15
    random_tokens = rng.integers(0, VOCAB, len(tokens))
    for i in range(1, len(tokens)):
        tokens[i] = random_tokens[i] if jump[i] else successor[tokens[i - 1]]
    data = tmp_path / 'data'
    data.mkdir(exist_ok=True)
    tokens[:n_train].tofile(data / 'train.bin')
    tokens[n_train:].tofile(data / 'val.bin')
    (data / 'meta.json').write_text(json.dumps({'tokenizer': 'char', 'vocab_size': VOCAB, 'train_tokens': n_train,
                                                'val_tokens': n_val, 'source': 'synthetic (tests)'}))
    return data


# -----------------------------------------------------------------------------
# running the scripts

# one OpenMP thread (a tiny model gains nothing from two, and spinning threads run ten times slower when
# other processes keep the second core busy), unbuffered output, wandb offline and quiet
SCRIPT_VARIABLES = {'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', 'WANDB_MODE': 'offline', 'WANDB_SILENT': 'true'}


def subprocess_env(**extra):
    """The environment of a script run as a subprocess: this one with SCRIPT_VARIABLES; extra adds or
    replaces variables."""
    return {**os.environ, **SCRIPT_VARIABLES, **extra}


def train_command(out_dir, data, *args, nproc=1):
    """`python3 train.py tests/config_tiny.py --dataset=DATA --out_dir=OUT ARGS` (torchrun for nproc > 1)."""
    launcher = [sys.executable, 'train.py'] if nproc == 1 else [
        sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}', 'train.py']
    return launcher + [str(TINY), f'--dataset={data}', f'--out_dir={out_dir}', *args]


def run_train(out_dir, data, *args, nproc=1, env=None, expect_rc=0):
    """train_command run to the end in the repo root; its exit status must be expect_rc."""
    proc = subprocess.run(train_command(out_dir, data, *args, nproc=nproc), cwd=ROOT, env=env or subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_train_in_process(out_dir, data, *args, expect_rc=0):
    """run_train's one-process run, in this process (run_script_in_process: one thread, as a subprocess's
    OMP_NUM_THREADS=1, and no torch start-up), where nothing is process-level (no signal, no launcher)."""
    proc = run_script_in_process('train.py', [TINY, f'--dataset={data}', f'--out_dir={out_dir}', *args])
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_script_in_process(script, args, env=None):
    """`python3 SCRIPT ARGS` in the repo root, run in this process (runpy, as __main__), which spares
    it torch's start-up: a CompletedProcess with its exit status, stdout and stderr. An uncaught
    exception other than SystemExit fails the calling test with its traceback. env: variables set
    while it runs (SCRIPT_VARIABLES, say, for the train.py processes compare.py starts). The working
    directory, sys.argv, the environment, the stop signals' handlers (train.py sets its own) and
    torch's thread count (one while it runs) are restored afterwards, and what the script left open is
    closed (its out_dir lock, say), as the end of its process would."""
    args = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    stop_signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]
    saved = (sys.argv, os.getcwd(), [signal.getsignal(s) for s in stop_signals],
             torch.get_num_threads(), {k: os.environ.get(k) for k in env or {}})
    sys.argv = [script, *args]
    os.chdir(ROOT)  # the scripts read data/<dataset> relative to where they run
    os.environ.update(env or {})
    torch.set_num_threads(1)
    # what exists now is not the script's: the collection at the end skips it (measured: a full collection
    # takes 0.4 s once transformers and lm-eval are imported, and a test file may run scripts hundreds of times)
    gc.freeze()
    rc = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / script), run_name='__main__')
    except SystemExit as e:
        rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
        for sig, handler in zip(stop_signals, saved[2]):
            signal.signal(sig, handler)
        torch.set_num_threads(saved[3])
        for name, value in saved[4].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        gc.collect()  # the script's globals are gone: finalise its objects (files close, locks are released)
        gc.unfreeze()
    return subprocess.CompletedProcess([script, *args], rc, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def ends_if_it_hangs(seconds, what):
    """Inside, SIGALRM raises TimeoutError(what) after `seconds`: a test of a read that must never block (a FIFO
    swapped in) fails instead of hanging."""
    def hung(*args):
        raise TimeoutError(what)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


ITER_LINE = re.compile(r"^iter (\d+): loss (\S+), ce (\S+), kl (\S+),", re.M)
EVAL_LINE = re.compile(r"^step (\d+): train loss (\S+), val loss (\S+)", re.M)


def iter_losses(stdout):
    """{iter: printed loss} (the printed value is the global mean, to 6 decimals)."""
    return {int(m[1]): float(m[2]) for m in ITER_LINE.finditer(stdout)}


def logged_losses(out_dir):
    """{iter: loss} as train.py logged it in out_dir/metrics.jsonl: the float32 value, not the printed digits."""
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {row['iter']: row['loss'] for row in rows if 'loss' in row}


def eval_losses(stdout):
    """{iter: printed val loss} of train.py's evaluation lines."""
    return {int(m[1]): float(m[3]) for m in EVAL_LINE.finditer(stdout)}


# -----------------------------------------------------------------------------
# full and read-only disks, missing permissions

def small_disk_available():
    """Whether on_small_disk can run here: `unshare -rm` (user and mount namespaces) mounting a tmpfs."""
    if sys.platform != 'linux' or not shutil.which('unshare'):
        return False
    probe = subprocess.run(['unshare', '-rm', 'sh', '-c', 'mount -t tmpfs -o size=64k tmpfs /tmp'],
                           capture_output=True)
    return probe.returncode == 0


def on_small_disk(folder, command, size='64k', read_only=False, before='', timeout=120):
    """Run command (a list, in the repo root) where folder is a fresh tmpfs of `size`: a real full disk
    once filled, or with read_only a read-only file system (EROFS). It is seen by this process alone (a
    user and a mount namespace: `unshare -rm`) and vanishes with it, so the names left in it are listed
    when the command ends: returns (the CompletedProcess, those names). before: shell commands run once it
    is mounted, before it is made read-only (e.g. copying a file in)."""
    folder.mkdir(parents=True, exist_ok=True)
    listing = folder.parent / f"{folder.name}.left"
    steps = ['dir="$1" left="$2"', 'shift 2', 'mount -t tmpfs -o size=$SIZE tmpfs "$dir" || exit 99', before,
             'mount -o remount,ro "$dir"' if read_only else '', '"$@"', 'rc=$?', 'ls -A "$dir" > "$left"', 'exit $rc']
    script = '; '.join(step for step in steps if step)
    proc = subprocess.run(['unshare', '-rm', 'sh', '-c', script, 'sh', str(folder), str(listing),
                           *map(str, command)], cwd=ROOT, env=subprocess_env(SIZE=size), capture_output=True,
                          text=True, timeout=timeout)
    return proc, listing.read_text().split() if listing.exists() else None


def without_root_file_access():
    """preexec_fn for a script that must meet file permissions: root reads and writes any file
    whatever its mode (capabilities CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), so when the tests run
    as root the script is started with those two dropped from its capability bounding set."""
    if os.geteuid() != 0:
        return None
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def drop():
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    return drop


# -----------------------------------------------------------------------------
# tiny models and checkpoints

def tiny_gpt(attn_type='base', seed=0, lowrank_rank=None, **overrides):
    """TINY_MODEL as a GPT of attn_type, initialised after torch.manual_seed(seed); overrides set
    any other GPTConfig field. lowrank_rank applies to dint_lowrank only (the other variants refuse
    the field), so a caller looping over every attn_type can give it once."""
    if lowrank_rank is not None and attn_type == 'dint_lowrank':
        overrides['lowrank_rank'] = lowrank_rank
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY_MODEL, 'attn_type': attn_type, **overrides}))


def save_model_checkpoint(out_dir, model, **fields):
    """out_dir/ckpt.pt holding `model` as train.py saves it: its weights and full model_args, no
    optimizer state, iteration 0, no evaluation yet, no run settings; fields replace any of those
    entries (iter_num, best_val_loss, config, optimizer, model_args, ...) or add others."""
    save_checkpoint({'model': model.state_dict(), 'optimizer': {}, 'model_args': dataclasses.asdict(model.config),
                     'iter_num': 0, 'best_val_loss': 1e9, 'config': {}, **fields}, out_dir)
    return out_dir


def tiny_checkpoint(out_dir, attn_type, dataset, seed=0, tweak=None, iter_num=7, best_val_loss=2.5, **overrides):
    """An untrained tiny_gpt(attn_type, seed, **overrides) saved as train.py saves it after
    iter_num iterations of a run on `dataset` (what sample.py and eval.py read its vocabulary
    from); tweak(model), if given, sets weights first. Returns the model."""
    model = tiny_gpt(attn_type, seed, **overrides)
    if tweak is not None:
        with torch.no_grad():
            tweak(model)
    save_model_checkpoint(out_dir, model, iter_num=iter_num, best_val_loss=best_val_loss,
                          config={'dataset': str(dataset)})
    return model


# -----------------------------------------------------------------------------
# lm-evaluation-harness, offline: a local multiple-choice task and lm-eval's own `hf` model

# (question, choices, index of the right one); the last is longer than a context of 64 GPT-2 tokens, so
# both sides must cut the same left part of it
MC_QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " a city by the sea"], 0),
    ("Two plus two equals", [" four", " five"], 1),
    ("Question: what do cats chase? Answer:", [" mice", " cars", " their own tails all day"], 0),
    (" ".join(["word"] * 90) + " and finally", [" the end", " more words"], 0),
]


def local_mc_task(root, name='tiny_mc', questions=MC_QUESTIONS):
    """The lm-eval task `name`: a task YAML in root/tasks (TaskManager's include_path, returned) over a
    local jsonl of `questions`, scored by lm-eval's multiple-choice code (acc)."""
    rows = [dict(question=q, choices=c, answer=a) for q, c, a in questions]
    (root / f'{name}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    tasks = root / 'tasks'
    tasks.mkdir(exist_ok=True)
    (tasks / f'{name}.yaml').write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / f'{name}.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return tasks


def hf_lm(path, **kwargs):
    """lm-eval's own `hf` model (transformers' AutoModelForCausalLM and AutoTokenizer) on a local folder."""
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=str(path), tokenizer=str(path), device='cpu', batch_size=2, **kwargs)


def per_doc_loglikelihoods(results, task):
    """{doc_id: [loglikelihood of each choice]} of lm_eval.simple_evaluate(..., log_samples=True)."""
    return {s['doc_id']: [r[0][0] for r in s['resps']] for s in results['samples'][task]}
