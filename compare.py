"""
Train several attention variants under identical conditions, over several seeds, and write a report
(tables, plots, results.json) of how they compare.

$ python3 compare.py config/compare_shakespeare_char.py
$ python3 compare.py config/compare_shakespeare_char.py --attn_types=base,diff --seeds=1,2,3
$ python3 compare.py config/compare_paper.py              # the NoiseFormer recipe, on 8 GPUs per run

Every (attn_type, seed) pair is one train.py process: `base_config`, then `overrides`, then
--attn_type, --seed and --out_dir=<out_dir>/runs/<attn_type>-seed<seed>; its output goes to
train.log in that folder. Only attn_type and seed differ between runs: same data, batches, schedule
and evaluation batches. `grid` adds one more axis: each of its entries (train.py settings, e.g.
'--n_embd=64') is a point every (attn_type, seed) is trained at, in runs/<attn_type>-<point>-seed<seed>,
and each variant is compared with base at the same point. Running the command again skips finished runs and resumes interrupted ones
(train.py's resume is exact, so the numbers equal those of an uninterrupted sweep); a run that fails
is reported and the others go on. Killing compare.py kills its train.py too (Linux), to be resumed.

The report (out_dir/report/): report.md, results.json and PNGs. Every number in it is read from the
runs' metrics.jsonl (train.py writes one row per logged iteration and per evaluation): final and
best val loss (train.py's fixed eval_iters batches) as mean +- std over seeds, each seed listed;
parameters; tokens/s (median over logged iterations); peak memory; training time; val loss against
iterations and against training time; what the variants learn (NoiseFormer's sigma, DIFF/DINT's
lambda) over training; one sample per variant (sample.py). Each variant is also compared with base
seed by seed (runs with the same seed share data order and evaluation batches): the differences in
final val loss, their mean +- std, and whether every seed agrees in sign; the report calls a variant
lower or higher than base only when they all do. On a recall dataset (data/mqar: its meta.json marks
the answers), eval.py --recall=True scores each finished run, and the report adds answer accuracy:
overall and by number of key-value pairs, its paired reading against base, and a plot of accuracy
against pairs per variant.
"""

from configurator import answer_help

answer_help(__file__)  # --help before the heavy imports below

import json
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from configurator import ConfigError, apply_config, script_defaults
from denoised_gpt.batches import ExampleLayout
from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from denoised_gpt.cli import check_attn_types, fail, read_config
from denoised_gpt.evaluation import mean_std
from denoised_gpt.training import NOT_RESUMED
from denoised_gpt.run_dir import lock_out_dir
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
attn_types = ['base', 'symmetric', 'noiseformer_v1', 'noiseformer_v2', 'diff', 'dint', 'dint_lowrank', 'linear']  # variants to train
seeds = [1337, 1338]  # one run per variant and seed: train.py's seed sets initial weights, data order and noise
base_config = 'config/train_shakespeare_char.py'  # the train.py config file every run starts from
overrides = ''  # extra train.py settings for every run, e.g. '--max_iters=500 --eval_interval=100'
grid = []  # settings to sweep besides attn_type and seed: each entry is one point, e.g. ['--n_embd=64', '--n_embd=128']
out_dir = 'out-compare'  # runs in out_dir/runs/<attn_type>-seed<seed>/, the report in out_dir/report/
nproc = 1  # processes per run; more than 1 launches train.py with torchrun --standalone
jobs = 1  # runs trained at the same time, each with its share of the CPU cores (and its own nproc GPUs, on CUDA)
samples = True  # put one sample per variant (sample.py on its first seed's checkpoint) in the report
sample_tokens = 200  # new tokens in each sample
report_only = False  # only write the report from the runs already in out_dir
continue_changed = False  # continue runs that were trained with other settings than this sweep's (the report says so)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, list))]

globals().update(read_config(__file__, {k: globals()[k] for k in config_keys}))
try:
    check_attn_types(attn_types)
except ValueError as e:
    fail(e)
if not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
    fail(f"seeds={seeds!r} must be distinct non-negative integers, e.g. --seeds=1337,1338")
if not 1 <= nproc <= (os.cpu_count() or 1):  # torchrun would wait for ever for processes it cannot start
    fail(f"nproc={nproc} must be between 1 and this machine's {os.cpu_count()} CPU cores (one train.py process "
         f"per GPU or core)")
if not 1 <= jobs * nproc <= (os.cpu_count() or 1):
    fail(f"jobs={jobs} runs of nproc={nproc} processes must fit this machine's {os.cpu_count()} CPU cores "
         f"(jobs x nproc at most {os.cpu_count()})")
extra = shlex.split(overrides)
# the settings every run trains with, checked now (a typo fails here, not in the eighth run)
try:
    train_config = apply_config([base_config, *extra], script_defaults('train.py'))
except ConfigError as e:
    fail(e)
if train_config['init_from'] not in ('scratch',) and not train_config['init_from'].startswith('gpt2'):
    fail("the runs must start from scratch or gpt2 weights: leave init_from out of base_config and overrides "
         "(compare.py resumes interrupted runs itself)")
points = []  # (the point's train.py arguments, its name in run folders, its label in the report)
point_configs = {}  # tag -> every train.py setting at that point
for point in grid or ['']:
    if not isinstance(point, str):
        fail(f"grid entry {point!r} must be a string of train.py settings, e.g. '--n_embd=64'")
    args = shlex.split(point)
    try:
        config_at_point = apply_config([base_config, *extra, *args], script_defaults('train.py'))
    except ConfigError as e:
        fail(f"grid entry {point!r}: {e}")
    if any(a.split('=')[0].lstrip('-') in ('attn_type', 'seed', 'out_dir', 'init_from') for a in args):
        fail(f"grid entry {point!r}: attn_type, seed, out_dir and init_from are compare.py's to set; sweep other keys")
    tag = '-'.join(a.lstrip('-').replace('=', '') for a in args)
    point_configs[tag] = config_at_point
    points.append((args, tag, ' '.join(a.lstrip('-') for a in args)))
if len({tag for _, tag, _ in points}) != len(points):
    fail(f"grid={grid!r} repeats a point")
max_iters = train_config['max_iters']


def variant_name(attn_type, label):
    """How the report names a variant at a grid point: 'diff' or 'diff n_embd=64'."""
    return f"{attn_type} {label}" if label else attn_type


class Run:
    """One train.py run of the sweep: attn_type and seed at a grid point (args: its train.py settings)."""

    def __init__(self, attn_type, seed, args, tag, label):
        self.attn_type, self.seed, self.args, self.tag = attn_type, seed, args, tag
        self.variant, self.base = variant_name(attn_type, label), variant_name('base', label)
        self.max_iters = point_configs[tag]['max_iters']
        self.dir = os.path.join(out_dir, 'runs', f'{attn_type}-{tag}-seed{seed}' if tag else f'{attn_type}-seed{seed}')


runs = [Run(a, s, args, tag, label) for args, tag, label in points for a in attn_types for s in seeds]
CHANGES_NAME = 'settings_changes.jsonl'  # in out_dir: each run continued with other settings, and from when


def settings_changes():
    """[(attn_type, seed, the checkpoint's iter, {key: (trained with, this sweep's)})] for the runs in out_dir
    that have a checkpoint whose training settings differ from what this sweep gives them."""
    found = []
    for run in runs:
        if not os.path.exists(checkpoint_path(run.dir)):
            continue
        try:
            ckpt = load_checkpoint(run.dir, metadata_only=True)
        except CheckpointError as e:
            fail(e)
        want = {**point_configs[run.tag], 'attn_type': run.attn_type, 'seed': run.seed}
        differ = {k: (ckpt['config'][k], v) for k, v in want.items()
                  if k not in NOT_RESUMED + ('wandb_run_name',) and k in ckpt['config'] and ckpt['config'][k] != v}
        if differ:
            found.append((run.variant, run.seed, ckpt['iter_num'], differ))
    return found


def check_settings_unchanged():
    """A sweep continues its runs only with the settings they were trained with, unless told otherwise."""
    changes = settings_changes()
    if not changes:
        return
    keys = sorted({k for *_, differ in changes for k in differ})
    lines = []
    for k in keys:
        olds, new = sorted({repr(d[k][0]) for *_, d in changes if k in d}), next(d[k][1] for *_, d in changes if k in d)
        n = sum(k in d for *_, d in changes)
        lines.append(f"  {k}: {' / '.join(olds)} in {n} run{'s' if n > 1 else ''}, this sweep {new!r}")
    if not continue_changed:
        fail(f"the runs in {out_dir}/runs were trained with other settings than this sweep gives them:\n"
             + "\n".join(lines) + "\nChoose a new --out_dir for a sweep with these settings, or continue these "
             "runs with them with --continue_changed=True (the report then lists the change)")
    print("continuing runs with changed settings (listed in the report):\n" + "\n".join(lines))
    with open(os.path.join(out_dir, CHANGES_NAME), 'a') as f:
        for attn_type, seed, it, differ in changes:
            f.write(json.dumps(dict(attn_type=attn_type, seed=seed, from_iter=it,
                                    changes={k: list(v) for k, v in differ.items()})) + '\n')


def recorded_changes():
    path = os.path.join(out_dir, CHANGES_NAME)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -----------------------------------------------------------------------------
# training

def read_metrics(run_dir):
    """(iteration rows, evaluation rows) of a run's metrics.jsonl; ([], []) when it has none."""
    path = os.path.join(run_dir, 'metrics.jsonl')
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if 'loss' in r], [r for r in rows if 'val_loss' in r]


def finished(run):
    """Trained to max_iters: the final evaluation is logged and the checkpoint written after it."""
    _, evals = read_metrics(run.dir)
    return bool(evals) and evals[-1]['iter'] >= run.max_iters and os.path.exists(checkpoint_path(run.dir))


def die_with_parent():
    """Linux: the kernel sends SIGKILL to this train.py when compare.py dies, so an orphan never trains
    on beside the resumed run; the next compare.py resumes from the last checkpoint, exactly."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def job_environment(slot):
    """The environment of a train.py in job slot `slot` of `jobs`: with several jobs, each gets its share
    of the CPU cores (OpenMP threads that outnumber the cores spin-wait and run many times slower) and,
    where there are CUDA GPUs, its own nproc of them."""
    env = dict(os.environ)
    if jobs > 1:
        env['OMP_NUM_THREADS'] = str(max(1, len(os.sched_getaffinity(0)) // (jobs * nproc)))
        if torch.cuda.is_available():
            env['CUDA_VISIBLE_DEVICES'] = ','.join(str(slot * nproc + k) for k in range(nproc))
    return env


class Progress:
    """The sweep's progress bar: iterations done over all runs, updated from the job threads."""

    def __init__(self):
        self.bar = tqdm(total=sum(run.max_iters for run in runs), unit='it', desc=f'{len(runs)} runs',
                        dynamic_ncols=True)
        self.done, self.lock = {}, threading.Lock()

    def update(self, run, iters, text):
        with self.lock:
            self.done[run.dir] = iters
            self.bar.n = sum(self.done.values())
            self.bar.set_postfix_str(f"{run.variant} seed {run.seed}: {text}")

    def write(self, text):
        with self.lock:
            self.bar.write(text)


def train(run, slot, progress):
    """One train.py process; returns its exit code. Progress goes to the bar, output to train.log."""
    os.makedirs(run.dir, exist_ok=True)
    resume = os.path.exists(checkpoint_path(run.dir))
    launcher = [sys.executable] if nproc == 1 else [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                                     f'--nproc_per_node={nproc}']
    cmd = [*launcher, 'train.py', base_config, *extra, *run.args, f'--attn_type={run.attn_type}', f'--seed={run.seed}',
           f'--out_dir={run.dir}', f'--wandb_run_name={os.path.basename(run.dir)}',
           *(['--init_from=resume'] if resume else [])]
    with open(os.path.join(run.dir, 'train.log'), 'a') as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=job_environment(slot), preexec_fn=die_with_parent if sys.platform == 'linux' else None)
        for line in proc.stdout:
            log.write(line)
            log.flush()  # `tail -f train.log` follows the run
            if line.startswith('iter '):
                it = int(line.split(':')[0].split()[1])
                progress.update(run, it + 1, f"iter {it + 1}/{run.max_iters}")
        return proc.wait()


def train_all():
    """Every unfinished run, `jobs` at a time; returns {(variant, seed): why} for the runs that failed."""
    failures = {}
    progress = Progress()
    todo = []
    for run in runs:
        if finished(run):
            progress.update(run, run.max_iters, "already done")
        else:
            todo.append(run)
    slots = queue.SimpleQueue()  # job slot numbers: which CPU share / GPUs a run gets
    for slot in range(jobs):
        slots.put(slot)

    def train_one(run):
        slot = slots.get()
        progress.update(run, progress.done.get(run.dir, 0), "starting")  # not the previous run's last words
        try:
            rc = train(run, slot, progress)
        finally:
            slots.put(slot)
        ok = rc == 0 and finished(run)
        if not ok:
            failures[(run.variant, run.seed)] = f"exit code {rc} (see its train.log)"
            with open(os.path.join(run.dir, 'train.log')) as f:
                tail = f.read().strip().splitlines()[-3:]
            progress.write(f"run {run.variant} seed {run.seed} failed (exit {rc}); see {run.dir}/train.log:\n  "
                           + "\n  ".join(tail))
        # train.py logs every log_interval iterations, so its last line is not the run's last iteration:
        # the bar counts the run in full and says how it ended
        progress.update(run, run.max_iters, 'done' if ok else 'failed')

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            for future in [pool.submit(train_one, run) for run in todo]:
                future.result()
        except KeyboardInterrupt:  # Ctrl-C reached the train.py processes too: they checkpoint and exit
            pool.shutdown(wait=True, cancel_futures=True)
            progress.bar.close()
            print("\ninterrupted: run the same command again to continue the sweep", file=sys.stderr)
            sys.exit(130)
    progress.bar.close()
    return failures


# -----------------------------------------------------------------------------
# results

def count_params(run_dir):
    """get_num_params of the run's model, built on the meta device from its checkpoint's model_args.
    CheckpointError when the checkpoint cannot be read."""
    with torch.device('meta'):
        model = GPT(GPTConfig(**load_checkpoint(run_dir, metadata_only=True)['model_args']))
    return model.get_num_params()


def run_results(run):
    steps, evals = read_metrics(run.dir)
    return {
        'attn_type': run.attn_type, 'seed': run.seed, 'variant': run.variant, 'base': run.base,
        'point': run.variant[len(run.attn_type) + 1:], 'out_dir': run.dir,
        'params': count_params(run.dir),
        'final_val_loss': evals[-1]['val_loss'], 'best_val_loss': min(r['val_loss'] for r in evals),
        'final_iter': evals[-1]['iter'],
        'tokens_per_s': statistics.median(r['tokens_per_s'] for r in steps) if steps else None,
        'peak_memory_mib': max((r['peak_memory_mib'] or 0) for r in evals) or None,
        'train_time_s': evals[-1]['time'],
        'curve': [{k: r[k] for k in ('iter', 'val_loss', 'train_loss', 'time')} for r in evals],
        'learned': [{k: v for k, v in r.items() if isinstance(v, list)} | {'iter': r['iter']} for r in evals],
        **recall_results(run),
    }


def recall_results(run):
    """On a recall dataset: {'accuracy', 'accuracy_by_pairs'} from eval.py --recall=True on the run's final
    checkpoint (its recall.json, computed again only when ckpt.pt is newer); {} on other datasets."""
    data_dir = os.path.join('data', point_configs[run.tag]['dataset'])
    try:
        if ExampleLayout(data_dir, 'val').labels_path is None:
            return {}
    except ValueError:
        return {}  # its meta.json is damaged: training said so already
    path = os.path.join(run.dir, 'recall.json')
    if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(checkpoint_path(run.dir)):
        cmd = [sys.executable, 'eval.py', f'--out_dir={run.dir}', '--recall=True', '--batch_size=64']
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CheckpointError(f"eval.py --recall=True failed: {proc.stderr.strip().splitlines()[-1:]}")
    with open(path) as f:
        recall = json.load(f)
    return {'accuracy': recall['accuracy'],
            'accuracy_by_pairs': {k: v['accuracy'] for k, v in recall['by_pairs'].items()}}


def summarize(results):
    """Per variant: the seeds' numbers and their mean / std, and for each variant but base its
    seed-by-seed difference from base at the same grid point (paired_vs_base)."""
    summary = {}
    for variant in dict.fromkeys(r['variant'] for r in results):  # in the sweep's order
        rs = [r for r in results if r['variant'] == variant]
        s = {'seeds': [r['seed'] for r in rs], 'params': rs[0]['params'], 'base': rs[0]['base']}
        for key in ('final_val_loss', 'best_val_loss', 'tokens_per_s', 'peak_memory_mib', 'train_time_s', 'accuracy'):
            values = [r[key] for r in rs if r.get(key) is not None]
            if key != 'accuracy' or values:
                s[key] = mean_std(values)
        if 'accuracy_by_pairs' in rs[0]:
            s['accuracy_by_pairs'] = {k: mean_std(r['accuracy_by_pairs'][k] for r in rs)
                                      for k in rs[0]['accuracy_by_pairs']}
        summary[variant] = s
    for variant, s in summary.items():
        if variant != s['base'] and s['base'] in summary:
            s['paired_vs_base'] = paired_vs_base(results, variant, s['base'])
            if 'accuracy' in s:
                s['accuracy_vs_base'] = paired_vs_base(results, variant, s['base'], key='accuracy')
    return summary


def sample_text(run_dir):
    cmd = [sys.executable, 'sample.py', f'--out_dir={run_dir}', '--num_samples=1',
           f'--max_new_tokens={sample_tokens}', '--seed=1337']
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"(sample.py failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode})"
    return proc.stdout.replace('---------------', '').strip()


# -----------------------------------------------------------------------------
try:  # one sweep per out_dir at a time (its train.py runs each lock their own folder too)
    sweep_lock = lock_out_dir(out_dir)
except ValueError as e:
    fail(e)
if not report_only:
    check_settings_unchanged()
failures = {} if report_only else train_all()
done = [run for run in runs if finished(run)]
if not done:
    fail(f"no finished run in {out_dir}/runs: nothing to report")
results = []
for run in tqdm(done, desc='reading the runs', disable=len(done) < 2 or not sys.stderr.isatty()):
    try:
        results.append(run_results(run))
    except CheckpointError as e:  # a damaged or foreign ckpt.pt among the runs
        failures[(run.variant, run.seed)] = f"its checkpoint cannot be read: {e}"
if not results:
    fail(f"no readable finished run in {out_dir}/runs: nothing to report ({'; '.join(failures.values())})")
done = [run for run in done if (run.variant, run.seed) not in failures]
# matplotlib only when reporting
from denoised_gpt.compare_report import paired_vs_base, write_plots, write_report  # noqa: E402
summary = summarize(results)
report_dir = os.path.join(out_dir, 'report')
os.makedirs(report_dir, exist_ok=True)
first_run = {}  # variant -> the run of its first seed: the one sampled
for run in done:
    first_run.setdefault(run.variant, run.dir)
texts = {v: sample_text(d) for v, d in first_run.items()} if samples else {}
plots = write_plots(results, report_dir)
write_report(report_dir, summary, results, failures, texts, plots,
             dict(base_config=base_config, overrides=overrides, grid=[label for *_, label in points if label],
                  seeds=seeds, max_iters=max_iters,
                  command=shlex.join(['python3', 'compare.py', *sys.argv[1:]]), changes=recorded_changes()))
with open(os.path.join(report_dir, 'results.json'), 'w') as f:
    json.dump({'summary': summary, 'runs': results,
               'failed': [{'attn_type': a, 'seed': s, 'reason': why} for (a, s), why in failures.items()]},
              f, indent=1)
print(f"report: {os.path.join(report_dir, 'report.md')} ({len(done)} of {len(runs)} runs"
      f"{f', {len(failures)} failed' if failures else ''})")
if failures:
    sys.exit(1)
