"""
Train several attention variants, over several seeds, and write a report (tables, plots, results.json)
of how they compare: each at its own best settings (`tune`), or all at the same settings.

$ python3 compare.py config/compare_shakespeare_char.py
$ python3 compare.py config/compare_shakespeare_char.py --attn_types=base,diff --seeds=1,2,3
$ python3 compare.py config/compare_paper.py              # the NoiseFormer recipe, on 8 GPUs per run

Tuning (`tune`, e.g. {'learning_rate': [1e-3, 3e-3, 1e-2]}; denoised_gpt/tuning.py): first every
candidate (each combination of the values) is trained for every variant on `tune_seeds`, in
out_dir/tune/<attn_type>[-<point>]-<candidate>-seed<seed>; each variant's best candidate by final val
loss (on recall data: answer accuracy, ties by val loss) is chosen, a candidate that diverged ranking
last; then the comparison below runs each variant at its own choice. A setting's values may differ by
variant: {'learning_rate': {'base': [4e-3, 8e-3], 'diff': [5e-4, 1e-3]}} (a list for every attn_type). A learning rate tuned alone takes
min_lr along at base_config's ratio. With train.py's stop_at_val_loss, a run ends at its first
evaluation at or below it, and a candidate that reaches it on every tuning seed ranks above the others,
the sooner the better. With a `grid`, each variant is tuned at every point, or only at `tune_at` (one
of the grid's entries, e.g. the cheapest), and compared at every point with its choice there. The
report opens with the protocol and every candidate's score.
Without `tune`, every variant trains with the same settings, and the report names them.

Every (attn_type, seed) pair is one train.py process: `base_config`, then `overrides`, then
--attn_type, --seed (and, tuned, the variant's chosen settings) and
--out_dir=<out_dir>/runs/<attn_type>-seed<seed>; its output goes to train.log in that folder.
Otherwise the runs share everything: data, batches, schedule and evaluation batches. `grid` adds one
more axis: each of its entries (train.py settings, e.g. '--n_embd=64') is a point every (attn_type,
seed) is trained at, in runs/<attn_type>-<point>-seed<seed>, and each variant is compared with base at
the same point. Running the command again skips finished runs (tuning runs too) and resumes
interrupted ones (train.py's resume is exact, so the numbers equal those of an uninterrupted sweep); a
run that fails is reported and the others go on. Ctrl-C, or SIGTERM / SIGINT sent to compare.py alone
(`kill`, a scheduler's preemption), makes its train.py runs checkpoint and exit (a second Ctrl-C quits at
once, each run keeping its last checkpoint); SIGKILL kills them too (Linux). Either way the next run of the
command resumes them. A stop while the report is written ends it, and its eval.py or sample.py, in one line.

The report (out_dir/report/): report.md, results.json and PNGs. Every number in it is read from the
runs' metrics.jsonl (train.py writes one row per logged iteration and per evaluation): final and
best val loss (train.py's fixed eval_iters batches) as mean +- std over seeds, each seed listed;
parameters; tokens/s (median over logged iterations); peak memory; training time; val loss against
iterations and against training time; what the variants learn (NoiseFormer's sigma, DIFF/DINT's
lambda) over training; one sample per variant (sample.py). Each variant is also compared with base
seed by seed (runs with the same seed share data order and evaluation batches): the differences in
final val loss, their mean +- std, and whether every seed agrees in sign; the report calls a variant
lower or higher than base only when they all do. On a recall dataset (data/mqar: its meta.json marks
the answers), eval.py --recall=True --attention_noise=True scores each finished run, and the report adds
answer accuracy (overall and by number of key-value pairs) and where attention goes (the shares of the
lookup head's attention, and of the reading layer's output, on the answer and, apart, its value and key, the
other pairs, the query's own token, the earlier queries and the filler, docs/eval.md), each with its paired
reading against base (by the signed value share, the ranking's), a plot of accuracy against pairs and one of
accuracy, signed value shares and noise share against filler length.
With `retrieval` (text data), eval.py --retrieval=True reads each compared run (a span of random tokens
written twice into the validation text, docs/eval.md), and the report adds copy accuracy by distance and
where attention goes while copying (the copy head's and the reading layer's shares on the source, the token
to copy and its earlier occurrence, the rest of the span, the own token and the text), each paired with base seed by seed, and a plot against distance.
"""

from configurator import answer_help

answer_help(__file__)  # --help before the heavy imports below

import contextlib
import json
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from tqdm import tqdm

from configurator import ConfigError, apply_config, script_defaults
from denoised_gpt.batches import ExampleLayout
from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, read_checkpoint
from denoised_gpt.cli import check_attn_types, fail, read_config
from denoised_gpt.device import slot_gpus
from denoised_gpt.evaluation import mean_std
from denoised_gpt.evaluation.attention_noise import PARTS as SHARE_PARTS
from denoised_gpt.evaluation.retrieval import PARTS as RETRIEVAL_PARTS
from denoised_gpt.extras import require as require_extra
from denoised_gpt.files import FileError, open_log, parse_json, read_json, write_atomically, write_problem
from denoised_gpt.training import NOT_RESUMED, check_training_settings
from denoised_gpt.run_dir import METRICS_NAME, bounded_lines, dropped_note, lock_out_dir, metrics_rows
from denoised_gpt.tuning import (METRICS, candidate_args, candidate_label, candidate_settings, candidate_tag, candidates,
                                 choose, edge_warnings, outranked, score, variant_tune)
from model import ATTENTION_TYPES, GPT, GPTConfig

# -----------------------------------------------------------------------------
attn_types = []  # variants to train, e.g. ['base', 'diff'] ([]: every attn_type model.py registers)
seeds = [1337, 1338]  # one run per variant and seed: train.py's seed sets initial weights, data order and noise
base_config = 'config/train_shakespeare_char.py'  # the train.py config file every run starts from
overrides = ''  # extra train.py settings for every run, e.g. '--max_iters=500 --eval_interval=100'
grid = []  # settings to sweep besides attn_type and seed: each entry is one point, e.g. ['--n_embd=64', '--n_embd=128']
out_dir = 'out-compare'  # runs in out_dir/runs/<attn_type>-seed<seed>/, the report in out_dir/report/
nproc = 1  # processes per run; more than 1 launches train.py with torchrun --standalone
jobs = 1  # runs trained at the same time, each with its share of the CPU cores (CUDA: nproc GPUs, shared if few)
retrieval = False  # text data: read each compared run with eval.py --retrieval=True (copy accuracy and attention, by distance)
samples = True  # put one sample per variant (sample.py on its first seed's checkpoint) in the report
sample_tokens = 200  # new tokens in each sample
report_only = False  # only write the report from the runs already in out_dir
continue_changed = False  # continue runs that were trained with other settings than this sweep's (the report says so)
# tuning: each variant compared at its own best settings ({} compares every variant at the same settings)
tune = {}  # train.py settings to tune per variant, e.g. {'learning_rate': [1e-3, 3e-3, 1e-2]}: every combination is a candidate, trained on tune_seeds; a value may be {attn_type: [values]}
tune_seeds = [1]  # seeds for tuning only (never one of seeds): a candidate's score is its mean over them
tune_metric = 'auto'  # 'val_loss' (lowest final val loss), 'accuracy' (highest answer accuracy, ties by val loss: recall data) or 'auto' (accuracy on recall data, else val_loss)
tune_at = ''  # one of grid's entries: tune each variant at that point only, and compare it at every point with its choice there ('' tunes at every point)
# or each variant at the settings an earlier tuning chose for it, without tuning again
chosen = {}  # every attn_type's train.py settings, e.g. {'base': {'learning_rate': 3e-4}, 'diff': {'learning_rate': 3e-3}}
chosen_by = ''  # where they were chosen (the earlier study's report), named in this report's protocol
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, list, dict))]

globals().update(read_config(__file__, {k: globals()[k] for k in config_keys}))
attn_types = attn_types or list(ATTENTION_TYPES)
try:
    check_attn_types(attn_types)
    require_extra('matplotlib', "compare.py's report (its plots)")  # said now, not after the training
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
# beside this file, so that compare.py runs from any directory (config paths stay relative to the current one)
TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py')
SAMPLE_SCRIPT = os.path.join(os.path.dirname(TRAIN_SCRIPT), 'sample.py')
EVAL_SCRIPT = os.path.join(os.path.dirname(TRAIN_SCRIPT), 'eval.py')
train_defaults = script_defaults(TRAIN_SCRIPT)
# the settings every run trains with, checked now (a typo fails here, not in the eighth run)
try:
    train_config = apply_config([base_config, *extra], train_defaults)
except ConfigError as e:
    fail(e)
if train_config['init_from'] not in ('scratch',) and not train_config['init_from'].startswith('gpt2'):
    fail("the runs must start from scratch or gpt2 weights: leave init_from out of base_config and overrides "
         "(compare.py resumes interrupted runs itself)")
RESERVED = ('attn_type', 'seed', 'out_dir', 'init_from')  # compare.py sets them for each run


def point_tag(args):
    """A grid point's name in run folders: its train.py arguments without dashes and '=' ('n_embd64')."""
    return '-'.join(a.lstrip('-').replace('=', '') for a in args)


points = []  # (the point's train.py arguments, its name in run folders, its label in the report)
point_configs = {}  # tag -> every train.py setting at that point
for point in grid or ['']:
    if not isinstance(point, str):
        fail(f"grid entry {point!r} must be a string of train.py settings, e.g. '--n_embd=64'")
    args = shlex.split(point)
    try:
        config_at_point = apply_config([base_config, *extra, *args], train_defaults)
    except ConfigError as e:
        fail(f"grid entry {point!r}: {e}")
    if any(a.split('=')[0].lstrip('-') in RESERVED for a in args):
        fail(f"grid entry {point!r}: attn_type, seed, out_dir and init_from are compare.py's to set; sweep other keys")
    tag = point_tag(args)
    point_configs[tag] = config_at_point
    points.append((args, tag, ' '.join(a.lstrip('-') for a in args)))
if len({tag for _, tag, _ in points}) != len(points):
    fail(f"grid={grid!r} repeats a point")
max_iters = {label: point_configs[tag]['max_iters'] for _, tag, label in points}  # a grid entry may set its own


def is_recall_data(config):
    """Whether the runs train on a recall dataset (data/mqar: its meta.json marks the answers)."""
    try:
        return ExampleLayout(os.path.join('data', config['dataset']), 'val').labels_path is not None
    except ValueError:
        return False  # its meta.json is damaged: training says so


if tune:
    def distinct_values(values):
        return isinstance(values, list) and values and len(set(map(repr, values))) == len(values)
    if not all(isinstance(k, str) and distinct_values(v) for k, v in tune.items() if not isinstance(v, dict)):
        fail(f"tune={tune!r} must map train.py settings to lists of distinct values to try, e.g. "
             f"--tune=\"{{'learning_rate': [1e-3, 3e-3, 1e-2]}}\"")
    for key, per_variant in tune.items():
        if isinstance(per_variant, dict) and (sorted(per_variant) != sorted(attn_types)
                                              or not all(map(distinct_values, per_variant.values()))):
            fail(f"tune[{key!r}] gives values per variant: it must map every attn_type of attn_types "
                 f"({', '.join(attn_types)}) to a list of distinct values, e.g. {{'base': [4e-3, 8e-3], ...}}")
    if set(tune) & set(RESERVED):
        fail(f"tune: {', '.join(sorted(set(tune) & set(RESERVED)))} cannot be tuned (compare.py sets them per run)")
    if (not tune_seeds or not all(isinstance(s, int) and s >= 0 for s in tune_seeds)
            or len(set(tune_seeds)) != len(tune_seeds)):
        fail(f"tune_seeds={tune_seeds!r} must be distinct non-negative integers, e.g. --tune_seeds=1,2")
    if set(tune_seeds) & set(seeds):
        fail(f"tune_seeds and seeds share {sorted(set(tune_seeds) & set(seeds))}: the comparison must not reuse "
             f"the runs its settings were chosen on; choose other tune_seeds")
    every_candidate = {candidate_label(c): c for a in attn_types for c in candidates(variant_tune(tune, a))}
    for candidate in every_candidate.values():  # every candidate's settings checked now, at every point
        for args, tag, _ in points:
            settings = candidate_settings(candidate, point_configs[tag])
            try:
                apply_config([base_config, *extra, *args, *candidate_args(settings)], train_defaults)
            except ConfigError as e:
                fail(f"tune candidate {candidate_label(candidate)}: {e}")
if chosen:
    if tune:
        fail("chosen gives each variant its settings and tune chooses them: give one of the two")
    if not chosen_by:
        fail("chosen needs chosen_by: where those settings were chosen (the earlier study's report), for the report")
    if sorted(chosen) != sorted(attn_types) or not all(isinstance(v, dict) and v for v in chosen.values()):
        fail(f"chosen={chosen!r} must give every attn_type of attn_types ({', '.join(attn_types)}) a dict of "
             f"train.py settings, e.g. --chosen=\"{{'base': {{'learning_rate': 3e-4}}}}\"")
    for attn_type, settings in chosen.items():
        if set(settings) & set(RESERVED):
            fail(f"chosen[{attn_type!r}]: {', '.join(sorted(set(settings) & set(RESERVED)))} is compare.py's to set")
        for args, tag, _ in points:
            try:
                apply_config([base_config, *extra, *args, *candidate_args(candidate_settings(settings, point_configs[tag]))],
                             train_defaults)
            except ConfigError as e:
                fail(f"chosen[{attn_type!r}]: {e}")
if tune_at:
    tune_tag = point_tag(shlex.split(tune_at))
    if not tune:
        fail(f"tune_at={tune_at!r} names where to tune, but tune is empty: give tune too, or leave tune_at out")
    if tune_tag not in point_configs:
        fail(f"tune_at={tune_at!r} is not one of grid's entries ({', '.join(map(repr, grid)) or 'grid is empty'}): "
             f"give one of them as written")
missing = sorted({c['dataset'] for c in point_configs.values() if not os.path.isdir(os.path.join('data', c['dataset']))})
if missing:  # how runs are scored (answer accuracy or val loss) is read from the dataset's meta.json
    fail(f"dataset {missing[0]!r} not found ({os.path.join('data', missing[0])}): prepare it first (its "
         f"prepare.py), or run from the folder where it was prepared")
if tune_metric not in ('auto', *METRICS):
    fail(f"tune_metric={tune_metric!r} must be one of 'auto', {', '.join(map(repr, METRICS))}")
if retrieval and any(is_recall_data(c) for c in point_configs.values()):
    fail("retrieval probes models trained on text: on a recall dataset compare.py reads every run with eval.py "
         "--recall and --attention_noise already; leave retrieval out")
if tune and tune_metric == 'accuracy' and not all(is_recall_data(c) for c in point_configs.values()):
    fail("tune_metric='accuracy' needs a recall dataset (data/mqar), whose answers eval.py scores; use 'val_loss'")


def variant_name(attn_type, label):
    """How the report names a variant at a grid point: 'diff' or 'diff n_embd=64'."""
    return f"{attn_type} {label}" if label else attn_type


def check_run_settings():
    """Every run's train.py settings checked as train.py checks them (the schedule, ranges, the model's shape), once,
    before any run starts: a setting that cannot run stops the sweep in one line, not each run as it comes."""
    problems, checked = {}, 0  # problems: the run's name -> why it cannot start
    for args, tag, label in points:
        for a in attn_types:
            options = ([(candidate_label(c), candidate_settings(c, point_configs[tag]))
                        for c in candidates(variant_tune(tune, a))] if tune
                       else [('', candidate_settings(chosen[a], point_configs[tag]))] if chosen else [('', {})])
            for name, settings in options:
                given = set()
                config = apply_config([base_config, *extra, *args, *candidate_args(settings), f'--attn_type={a}',
                                       f'--seed={seeds[0]}', f'--out_dir={out_dir}'], train_defaults, given=given)
                checked += 1
                try:
                    check_training_settings(config, given)
                except ValueError as e:
                    problems[' '.join(filter(None, (variant_name(a, label), name)))] = str(e)
    if problems:
        run, why = next(iter(problems.items()))
        fail(f"every run: {why}" if len(problems) == checked and len(set(problems.values())) == 1 else
             f"run {run}: {why}" if len(problems) == 1 else f"{len(problems)} runs cannot start, e.g. {run}: {why}")


if not report_only:  # (a report of runs already trained needs none to start)
    check_run_settings()


class Run:
    """One train.py run of the sweep: attn_type and seed at a grid point (its train.py arguments, name and
    label), with `settings` on top (a tuning candidate's, or the variant's chosen ones). The comparison's
    runs are in out_dir/runs/<attn_type>[-<point>]-seed<seed>, the tuning runs in out_dir/tune/, named by
    their candidate too."""

    def __init__(self, attn_type, seed, point, settings=None, folder='runs', name=''):
        point_args, self.tag, label = point
        self.attn_type, self.seed, self.settings = attn_type, seed, settings or {}
        self.args = [*point_args, *candidate_args(self.settings)]
        self.config = apply_config([base_config, *extra, *self.args], train_defaults)  # what train.py runs with
        self.variant, self.base = variant_name(attn_type, label), variant_name('base', label)
        self.max_iters = self.config['max_iters']
        self.metric = tune_metric if tune_metric != 'auto' else 'accuracy' if is_recall_data(self.config) else 'val_loss'
        self.dir = os.path.join(out_dir, folder, '-'.join(filter(None, (attn_type, self.tag, name, f'seed{seed}'))))


# the settings an untuned report names as every variant's (the optimiser's, the batch and the schedule)
SHARED_SETTINGS = ('learning_rate', 'min_lr', 'weight_decay', 'beta2', 'warmup_iters', 'batch_size',
                   'gradient_accumulation_steps', 'max_iters', 'dropout')
CHANGES_NAME = 'settings_changes.jsonl'  # in out_dir: each run continued with other settings, and from when
MAX_CHANGES_BYTES = 64 << 20  # a line of some hundred bytes for each time a run was continued so
DIVERGED_NAME = 'diverged.txt'  # in a tuning run's folder: train.py stopped it for a non-finite loss (exit 3)


def changed_settings(run):
    """(the checkpoint's iter, {key: (trained with, this sweep's)}) for a run whose checkpoint's training settings
    differ from what this sweep gives it; the dict is empty when they agree or there is no checkpoint."""
    if not os.path.exists(checkpoint_path(run.dir)):
        return None, {}
    try:
        ckpt = read_checkpoint(run.dir, metadata_only=True)[1]
    except CheckpointError as e:
        fail(e)
    want = {**run.config, 'attn_type': run.attn_type, 'seed': run.seed}
    differ = {k: (ckpt['config'][k], v) for k, v in want.items()
              if k not in NOT_RESUMED + ('wandb_run_name',) and k in ckpt['config'] and ckpt['config'][k] != v}
    return ckpt['iter_num'], differ


def settings_changes(runs):
    """[(attn_type, seed, {key: (trained with, this sweep's)})] for the runs in out_dir that have a checkpoint
    whose training settings differ from what this sweep gives them."""
    found = [(run.variant, run.seed, changed_settings(run)[1]) for run in runs]
    return [(variant, seed, differ) for variant, seed, differ in found if differ]


changes_lock = threading.Lock()


def record_change(run):
    """A run continued with other settings than its checkpoint's: one line in out_dir's CHANGES_NAME, read by
    the report. Written when the run is continued, so a run that is never trained again is not listed."""
    from_iter, differ = changed_settings(run)
    if not differ:
        return
    with changes_lock, open(os.path.join(out_dir, CHANGES_NAME), 'a') as f:
        f.write(json.dumps(dict(run=os.path.relpath(run.dir, out_dir), attn_type=run.variant, seed=run.seed,
                                from_iter=from_iter, changes={k: list(v) for k, v in differ.items()})) + '\n')


def forget_changes(run):
    """A run trained from scratch (its folder was emptied or removed) carries none of the changes recorded for
    an earlier run in its folder: they leave CHANGES_NAME."""
    path, name = os.path.join(out_dir, CHANGES_NAME), os.path.relpath(run.dir, out_dir)
    with changes_lock:
        if not os.path.exists(path):
            return
        lines = list(change_rows(path))
        kept = [line for line, row in lines if row is None or row['run'] != name]
        if len(kept) < len(lines):
            with open(path + '.tmp', 'wb') as f:
                f.writelines(kept)
            os.replace(path + '.tmp', path)


def check_settings_unchanged(runs):
    """A sweep continues its runs only with the settings they were trained with, unless told otherwise; never
    a compared run with another tuned value (the tuning chose anew): that is another candidate's run."""
    changes = settings_changes(runs)
    if not changes:
        return
    # (a tuning run's tuned values are in its folder's name, so only a compared run can differ in them)
    retuned = [(variant, seed, differ) for variant, seed, differ in changes if set(differ) & set(tune)]
    if retuned:
        variant, seed, differ = retuned[0]
        key = next(k for k in differ if k in tune)
        fail(f"{len(retuned)} compared run{'s' if len(retuned) > 1 else ''} (first: {variant} seed {seed}) "
             f"{'were' if len(retuned) > 1 else 'was'} trained at {key}={differ[key][0]!r}, and the tuning now "
             f"chooses {differ[key][1]!r}: move {'their folders' if len(retuned) > 1 else 'its folder'} out of "
             f"{out_dir}/runs to train {'them' if len(retuned) > 1 else 'it'} at the new choice")
    keys = sorted({k for *_, differ in changes for k in differ})
    lines = []
    for k in keys:
        olds, new = sorted({repr(d[k][0]) for *_, d in changes if k in d}), next(d[k][1] for *_, d in changes if k in d)
        n = sum(k in d for *_, d in changes)
        lines.append(f"  {k}: {' / '.join(olds)} in {n} run{'s' if n > 1 else ''}, this sweep {new!r}")
    if not continue_changed:
        fail(f"the runs in {out_dir} were trained with other settings than this sweep gives them:\n"
             + "\n".join(lines) + "\nChoose a new --out_dir for a sweep with these settings, or continue these "
             "runs with them with --continue_changed=True (the report then lists the change)")
    print("continuing runs with changed settings (those trained on are listed in the report):\n" + "\n".join(lines))


def change_rows(path):
    """(line, row) for each line of a CHANGES_NAME file, line as bytes; row None for a line record_change did not
    write as it is (damaged, edited: the report leaves it out); a line too long to be one is skipped (bounded_lines).
    A file that is not a regular one, or larger than any such file is, ends compare.py in one line."""
    try:
        f = open_log(path, MAX_CHANGES_BYTES, "settings changes log",
                     "remove it (it lists runs continued with changed settings)")
    except FileError as e:
        fail(e)
    with f:
        for line in bounded_lines(f, MAX_CHANGES_BYTES):
            if line is None:  # longer than any line record_change writes: left out, never held whole
                continue
            if not line.strip():
                continue
            try:
                row = parse_json(line.decode('utf-8'))
            except ValueError:  # not JSON, not UTF-8
                row = None
            ok = isinstance(row, dict) and isinstance(row.get('run'), str) and isinstance(row.get('attn_type'), str) \
                and 'from_iter' in row and isinstance(row.get('changes'), dict) and all(
                    isinstance(v, list) and len(v) == 2 for v in row['changes'].values())
            yield line, row if ok else None


def recorded_changes():
    path = os.path.join(out_dir, CHANGES_NAME)
    if not os.path.exists(path):
        return []
    rows = [row for _, row in change_rows(path) if row is not None]
    # a run killed before its next checkpoint is continued, and recorded, again with the same change: the first counts
    first = {}
    for row in rows:
        first.setdefault(json.dumps({k: v for k, v in row.items() if k != 'from_iter'}, sort_keys=True), row)
    return list(first.values())


# -----------------------------------------------------------------------------
# training

noted_metrics = set()  # the metrics logs whose damaged lines were named already


def read_metrics(run_dir):
    """(iteration rows, evaluation rows) of a run's metrics.jsonl; ([], []) when it has none. Its lines that
    are not rows train.py writes (damaged, edited) are left out, and named once."""
    path = os.path.join(run_dir, METRICS_NAME)
    if not os.path.exists(path):
        return [], []
    try:
        lines = list(metrics_rows(path))
    except ValueError as e:  # a device, a FIFO
        fail(e)
    except OSError as e:
        fail(f"cannot read {path} ({e.strerror or e}); fix its permissions")
    note = dropped_note(path, [(number, problem) for number, _, _, problem in lines if problem is not None])
    if note and path not in noted_metrics:
        noted_metrics.add(path)
        print(note, file=sys.stderr)
    rows = [row for _, _, row, problem in lines if problem is None]
    return [r for r in rows if 'loss' in r], [r for r in rows if 'val_loss' in r]


def finished(run):
    """Trained to max_iters, or to an evaluation at or below stop_at_val_loss: the final evaluation is logged
    and the checkpoint written after it."""
    _, evals = read_metrics(run.dir)
    return bool(evals) and (evals[-1]['iter'] >= run.max_iters or reached_target(run, evals[-1])) \
        and os.path.exists(checkpoint_path(run.dir))


def reached_target(run, evaluation):
    """Whether the evaluation row is at or below the run's stop_at_val_loss (never, when that is 0)."""
    target = run.config['stop_at_val_loss']
    return bool(target) and evaluation['val_loss'] <= target


def diverged(run):
    return os.path.exists(os.path.join(run.dir, DIVERGED_NAME))


def die_with_parent():
    """Linux: the kernel sends SIGKILL to this child (train.py, eval.py, sample.py) when compare.py dies, so an
    orphan never trains on beside the resumed run, or outlives the sweep; the next compare.py resumes from the
    last checkpoint, exactly."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def job_environment(slot):
    """The environment of a train.py in job slot `slot` of `jobs`: with several jobs, each gets its share
    of the CPU cores (OpenMP threads that outnumber the cores spin-wait and run many times slower) and,
    where there are CUDA GPUs, nproc of them (slot_gpus)."""
    env = dict(os.environ, PYTHONUNBUFFERED='1')  # its lines as they come, not in blocks: for the bar and stopping
    if jobs > 1:
        env['OMP_NUM_THREADS'] = str(max(1, len(os.sched_getaffinity(0)) // (jobs * nproc)))
        if torch.cuda.is_available():
            env['CUDA_VISIBLE_DEVICES'] = ','.join(map(str, slot_gpus(slot, nproc, torch.cuda.device_count())))
    return env


class Progress:
    """The sweep's progress bar: iterations done over all runs, updated from the job threads."""

    def __init__(self, runs, what):
        self.bar = tqdm(total=sum(run.max_iters for run in runs), unit='it', desc=f'{len(runs)} {what}',
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


def train(run, slot, progress, should_stop=lambda: False):
    """One train.py process; returns its exit code (None: not started, the sweep is stopping). Progress goes to
    the bar, output to train.log. After each evaluation, a true should_stop() sends the run SIGTERM: it
    checkpoints and exits."""
    if stopping.is_set():
        return None
    os.makedirs(run.dir, exist_ok=True)
    resume = os.path.exists(checkpoint_path(run.dir))
    if resume:
        record_change(run)
    else:
        forget_changes(run)
    launcher = [sys.executable] if nproc == 1 else [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                                     f'--nproc_per_node={nproc}']
    cmd = [*launcher, TRAIN_SCRIPT, base_config, *extra, *run.args, f'--attn_type={run.attn_type}',
           f'--seed={run.seed}', f'--out_dir={run.dir}', f'--wandb_run_name={os.path.basename(run.dir)}',
           *(['--init_from=resume'] if resume else [])]
    with open(os.path.join(run.dir, 'train.log'), 'a') as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=job_environment(slot), preexec_fn=die_with_parent if sys.platform == 'linux' else None)
        running.add(proc)
        if stopping.is_set():  # the stop came as it started, after train_all passed it on to the runs
            proc.send_signal(signal.SIGTERM)
        evaluated = False
        for line in proc.stdout:
            log.write(line)
            log.flush()  # `tail -f train.log` follows the run
            if line.startswith('iter '):
                it = int(line.split(':')[0].split()[1])
                progress.update(run, it + 1, f"iter {it + 1}/{run.max_iters}")
            if line.startswith('step '):
                evaluated = True
            elif line.startswith('iter ') and evaluated:  # the evaluation's metrics row is on disk by now
                evaluated = False
                if should_stop():
                    proc.send_signal(signal.SIGTERM)
        rc = proc.wait()
        running.discard(proc)
        return rc


running = set()  # the child processes now running: train.py (or its torchrun), eval.py, sample.py
stopping = threading.Event()  # set by the first stop signal
training = False  # while train_all waits for its runs, to which it passes a stop on (they checkpoint)
reporting = False  # once the compared runs are trained: a stop then ends the report
starting = False  # while run_child starts a child not yet in `running`: a stop ends the sweep once it is


def on_stop_signal(signum, frame):
    """SIGTERM (`kill`, a scheduler's preemption) and SIGHUP (the terminal or ssh session closed) stop the sweep
    as Ctrl-C does, its runs checkpointed (they die with compare.py otherwise: PR_SET_PDEATHSIG); SIGINT too
    where the shell that started compare.py in the background set it to be ignored (train.py does the same).
    The first ends the sweep: while runs train, as a KeyboardInterrupt that train_all handles (it passes the stop
    on to them and waits for their checkpoints); anywhere else at once (end_sweep). A Ctrl-C after it quits at
    once (quit_now); a repeated SIGTERM or SIGHUP changes
    nothing (schedulers repeat it), as in train.py."""
    if not stopping.is_set():
        stopping.set()
        if training:
            raise KeyboardInterrupt
        if not starting:
            end_sweep()
    elif signum == signal.SIGINT:
        quit_now()


def say(line):
    """A line on stderr, below the progress bar; none when the terminal is gone (after SIGHUP)."""
    with contextlib.suppress(OSError):
        print(f"\n{line}", file=sys.stderr, flush=True)


def stop_children(sig, grace=10):
    """sig to every child process still running, then wait for them all, at most grace seconds; kill what is
    left (none is left behind: they die with compare.py anyway)."""
    children = list(running)
    for proc in children:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    deadline = time.monotonic() + grace
    for proc in children:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


def end_sweep():
    """The first stop signal, outside train_all: an eval.py or sample.py running is stopped, and compare.py
    ends in one line (exit 130; the SystemExit unwinds what it interrupted, so files are left whole)."""
    stop_children(signal.SIGTERM)
    say("interrupted while writing the report: run the same command again to write it (the runs are intact)"
        if reporting else "interrupted: run the same command again to continue the sweep")
    raise SystemExit(130)


def quit_now():
    """A Ctrl-C after the stop: the child processes get it too (train.py then quits at once, keeping its last
    checkpoint), and compare.py ends in one line without waiting for the runs to save."""
    stop_children(signal.SIGINT)
    say("interrupted again: quit without waiting for the runs to save (each keeps its last checkpoint): run the "
        "same command again to continue the sweep")
    os._exit(130)  # at once: no exception to unwind through the waits this interrupted


for stop_signal in (signal.SIGINT, signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, 'SIGHUP') else [])):
    signal.signal(stop_signal, on_stop_signal)


def run_child(cmd):
    """subprocess.run(cmd, capture_output=True, text=True) for eval.py and sample.py, as a child a stop ends
    (it is in `running`) and that dies with compare.py (Linux), never left behind."""
    global starting
    starting = True  # (a stop signal in Popen, after the fork, would leave the child out of `running`)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=die_with_parent if sys.platform == 'linux' else None)
        running.add(proc)
    finally:
        starting = False
    try:
        if stopping.is_set():  # it came while the child started
            end_sweep()
        while True:  # woken each second: a stop signal that another thread took is handled then
            with contextlib.suppress(subprocess.TimeoutExpired):
                out, err = proc.communicate(timeout=1)
                return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        running.discard(proc)


def outranked_now(rows):
    """outranked() of a variant's tuning runs ([[its Run per tuning seed] per candidate]) as they stand on disk."""
    def so_far(run):
        if diverged(run):
            return None
        _, evals = read_metrics(run.dir)
        return (evals[-1]['iter'], reached_target(run, evals[-1])) if evals else (None, False)
    return outranked([[so_far(run) for run in seed_runs] for seed_runs in rows])


def outranked_dirs(rows):
    """The folders of the runs whose candidate can no longer be chosen (derived from the runs, never stored,
    so it follows any change to them)."""
    losers, _ = outranked_now(rows)
    return {run.dir for c in losers for run in rows[c]}


def train_all(runs, rivals=None):
    """Every unfinished run, `jobs` at a time; returns {(variant, seed): why} for the runs that failed.
    Tuning (rivals: {run.dir: (its variant's [[Run per seed] per candidate], its candidate's index)}): a run
    that diverges is marked so (its candidate ranks last) and not trained again, and one whose candidate can
    no longer be chosen (another reached stop_at_val_loss sooner than it can) stops: it is out-ranked."""
    global training
    tuning = rivals is not None
    failures = {}
    progress = Progress(runs, 'tuning runs' if tuning else 'runs')
    todo = []

    def beaten(run):
        """Whether the tuning run's candidate can no longer be chosen."""
        return bool(run.config['stop_at_val_loss']) and run.dir in outranked_dirs(rivals[run.dir][0])

    for run in runs:
        if finished(run) or tuning and (diverged(run) or beaten(run)):
            progress.update(run, run.max_iters, "already done")
        else:
            todo.append(run)

    slots = queue.SimpleQueue()  # job slot numbers: which CPU share / GPUs a run gets
    for slot in range(jobs):
        slots.put(slot)

    def train_one(run):
        slot = slots.get()
        if tuning and beaten(run):  # beaten while it waited for its slot
            slots.put(slot)
            return progress.update(run, run.max_iters, 'out-ranked')
        progress.update(run, progress.done.get(run.dir, 0), "starting")  # not the previous run's last words
        try:
            rc = train(run, slot, progress, (lambda: beaten(run)) if tuning else (lambda: False))
        finally:
            slots.put(slot)
        if tuning and rc == 0 and not finished(run) and beaten(run):
            return progress.update(run, run.max_iters, 'out-ranked')
        ok = rc == 0 and finished(run)
        if stopping.is_set() and not ok:  # checkpointed on the stop signal: resumed next time, not failed
            progress.update(run, progress.done.get(run.dir, 0), 'stopped')
            return
        if rc == 3 and tuning:  # train.py's exit status for a non-finite loss or gradient
            with open(os.path.join(run.dir, DIVERGED_NAME), 'w') as f:
                f.write("train.py stopped it: non-finite loss or gradient (see train.log)\n")
            progress.write(f"tuning run {run.variant} {candidate_label(run.settings)} seed {run.seed} diverged: "
                           f"ranked below every candidate that did not")
        elif not ok:
            failures[(run.variant, run.seed)] = f"exit code {rc} (see its train.log)"
            with open(os.path.join(run.dir, 'train.log')) as f:
                tail = f.read().strip().splitlines()[-3:]
            progress.write(f"run {run.variant} seed {run.seed} failed (exit {rc}); see {run.dir}/train.log:\n  "
                           + "\n  ".join(tail))
        # train.py logs every log_interval iterations, so its last line is not the run's last iteration:
        # the bar counts the run in full and says how it ended
        progress.update(run, run.max_iters, 'done' if ok else 'failed')

    futures = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            training = True  # (in the try: a stop signal from here on is the KeyboardInterrupt below)
            futures = [pool.submit(train_one, run) for run in todo]
            # Never an endless wait: the kernel may hand SIGINT / SIGTERM to a job thread, and Python then only
            # notes it for the main thread, which acts on it once it wakes (here within a second)
            while wait(futures, timeout=1).not_done:
                pass
            for future in futures:
                future.result()  # a job's exception, raised here
            training = False
        except KeyboardInterrupt:
            # the train.py processes checkpoint and exit: a Ctrl-C in the terminal reached them already (a
            # SIGTERM after it changes nothing); a SIGINT or SIGTERM sent to compare.py alone did not
            for proc in list(running):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            say("stopping: the runs save a checkpoint and exit (Ctrl-C again to quit at once)")
            pool.shutdown(wait=False, cancel_futures=True)  # runs waiting for a slot: cancelled, never done
            while wait([f for f in futures if not f.cancelled()], timeout=1).not_done:  # (a second Ctrl-C: quit_now)
                pass
            progress.bar.close()
            say("interrupted: run the same command again to continue the sweep")
            sys.exit(130)
    progress.bar.close()
    return failures


# -----------------------------------------------------------------------------
# results

def count_params(run_dir):
    """get_num_params of the run's model, built on the meta device from its checkpoint's model_args.
    CheckpointError when the checkpoint cannot be read."""
    with torch.device('meta'):
        model = GPT(GPTConfig(**read_checkpoint(run_dir, metadata_only=True)[1]['model_args']))
    return model.get_num_params()


def run_results(run):
    steps, evals = read_metrics(run.dir)
    return {
        'attn_type': run.attn_type, 'seed': run.seed, 'variant': run.variant, 'base': run.base,
        'point': run.variant[len(run.attn_type) + 1:], 'out_dir': os.path.relpath(run.dir, out_dir),  # runs/<name>
        'params': count_params(run.dir),
        'final_val_loss': evals[-1]['val_loss'], 'best_val_loss': min(r['val_loss'] for r in evals),
        'final_iter': evals[-1]['iter'], 'reached_target': reached_target(run, evals[-1]),
        'tokens_per_s': statistics.median(r['tokens_per_s'] for r in steps) if steps else None,
        'peak_memory_mib': max((r['peak_memory_mib'] or 0) for r in evals) or None,
        'train_time_s': evals[-1]['time'],
        'curve': [{k: r[k] for k in ('iter', 'val_loss', 'train_loss', 'time')} for r in evals],
        'learned': [{k: v for k, v in r.items() if isinstance(v, list)} | {'iter': r['iter']} for r in evals],
        **recall_results(run),
        **retrieval_results(run),
    }


def read_eval_json(path):
    """One of eval.py's JSON results (recall.json, attention_noise.json); FileError when it is damaged."""
    return read_json(path, "delete it, and compare.py has eval.py write it again")


def recall_results(run, attention=True):
    """On a recall dataset: {'accuracy', 'accuracy_by_pairs'} from eval.py --recall=True on the run's final
    checkpoint and, with attention, where its attention goes from --attention_noise=True (the shares of
    SHARE_PARTS and of the token after the value, a lookup can read there, at its lookup head and reading layer,
    which those are, and the filler length per example); {} on other datasets. Read from its recall.json and
    attention_noise.json, computed again when ckpt.pt is newer or an older eval.py wrote them (without dtype:
    a float32-trained model measured in bfloat16; without by_offset, or the answer's value and key apart)."""
    if not is_recall_data(run.config):
        return {}
    measures = {'recall': 'recall.json', **({'attention_noise': 'attention_noise.json'} if attention else {})}
    paths = [os.path.join(run.dir, name) for name in measures.values()]
    if any(not os.path.exists(p) or os.path.getmtime(p) < os.path.getmtime(checkpoint_path(run.dir)) for p in paths) \
            or 'dtype' not in read_eval_json(paths[0]) or (attention and ('by_offset' not in (
                noise := read_eval_json(paths[1])) or 'value' not in noise['reading_layer'])):
        flags = [f'--{m}=True' for m in measures]
        proc = run_child([sys.executable, EVAL_SCRIPT, f'--out_dir={run.dir}', *flags, '--batch_size=64'])
        if proc.returncode != 0:
            raise CheckpointError(f"eval.py {' '.join(flags)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    recall = read_eval_json(paths[0])
    result = {'accuracy': recall['accuracy'],
              'accuracy_by_pairs': {k: v['accuracy'] for k, v in recall['by_pairs'].items()}}
    if attention:
        shares = read_eval_json(paths[1])
        look, layer, after = shares['lookup'], shares['reading_layer'], shares['by_offset']['+2']
        result.update({f'{part}_share': look[part] for part in SHARE_PARTS},
                      lookup_head=f"L{look['layer']}h{look['head']}",
                      **{f'layer_{part}_share': layer[part] for part in SHARE_PARTS},
                      reading_layer=f"L{layer['layer']}", part_words=shares.get('part_words'),
                      after_share=after['heads'][look['layer']][look['head']],
                      layer_after_share=after['layers'][layer['layer']],
                      filler_length=sum(int(k) * v['answers'] for k, v in shares['by_filler'].items()) / shares['answers'])
    return result


def retrieval_results(run):
    """With retrieval: from eval.py --retrieval=True on the run's checkpoint (its retrieval.json, computed again
    when ckpt.pt is newer or an older eval.py wrote it without the token to copy apart), the copy accuracy
    overall and by distance, and the shares of RETRIEVAL_PARTS at the copy head and the reading layer, overall and
    by distance (each a 'copy_...' key: summarize takes them all); {} without it."""
    if not retrieval:
        return {}
    path = os.path.join(run.dir, 'retrieval.json')
    if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(checkpoint_path(run.dir)) \
            or 'copy' not in read_eval_json(path).get('copy_head', {}):
        proc = run_child([sys.executable, EVAL_SCRIPT, f'--out_dir={run.dir}', '--retrieval=True', '--batch_size=16'])
        if proc.returncode != 0:
            raise CheckpointError(f"eval.py --retrieval=True failed: {proc.stderr.strip().splitlines()[-1:]}")
    probe = read_eval_json(path)
    head, layer = probe['copy_head'], probe['reading_layer']
    result = {'copy_accuracy': probe['accuracy'], 'copy_chance': probe['chance'],
              'copy_head': f"L{head['layer']}h{head['head']}", 'copy_reading_layer': f"L{layer['layer']}",
              **{f'copy_{part}_share': head[part] for part in RETRIEVAL_PARTS},
              **{f'copy_layer_{part}_share': layer[part] for part in RETRIEVAL_PARTS}}
    for d, at in probe['by_distance'].items():
        result[f'copy_accuracy@{d}'] = at['accuracy']
        result.update({f'copy_{part}_share@{d}': at['copy_head'][part] for part in RETRIEVAL_PARTS})
        result.update({f'copy_layer_{part}_share@{d}': at['reading_layer'][part] for part in RETRIEVAL_PARTS})
    return result


# what recall_results adds to a run, summarised over seeds like the val loss
RECALL_KEYS = ('accuracy', *(f'{part}_share' for part in SHARE_PARTS),
               *(f'layer_{part}_share' for part in SHARE_PARTS), 'after_share', 'layer_after_share', 'filler_length')


def summarize(results):
    """Per variant: the seeds' numbers and their mean / std, and for each variant but base its
    seed-by-seed difference from base at the same grid point (paired_vs_base)."""
    summary = {}
    for variant in dict.fromkeys(r['variant'] for r in results):  # in the sweep's order
        rs = [r for r in results if r['variant'] == variant]
        s = {'seeds': [r['seed'] for r in rs], 'params': rs[0]['params'], 'base': rs[0]['base']}
        for key in ('final_val_loss', 'best_val_loss', 'tokens_per_s', 'peak_memory_mib', 'train_time_s', *RECALL_KEYS):
            values = [r[key] for r in rs if r.get(key) is not None]
            if key not in RECALL_KEYS or values:
                s[key] = mean_std(values)
        for key in (k for k, v in rs[0].items() if k.startswith('copy_') and isinstance(v, float)):
            s[key] = mean_std(r[key] for r in rs if key in r)
        if 'accuracy_by_pairs' in rs[0]:
            s['accuracy_by_pairs'] = {k: mean_std(r['accuracy_by_pairs'][k] for r in rs)
                                      for k in rs[0]['accuracy_by_pairs']}
        summary[variant] = s
    for variant, s in summary.items():
        if variant != s['base'] and s['base'] in summary:
            s['paired_vs_base'] = paired_vs_base(results, variant, s['base'])
            for key in ('accuracy', 'signed_value_share', 'signed_answer_share', 'noise_share',
                        'layer_signed_value_share', 'layer_signed_answer_share', 'layer_noise_share'):
                if key in s:
                    s[f'{key}_vs_base'] = paired_vs_base(results, variant, s['base'], key=key)
            for key in [k for k in s if k.startswith('copy_') and k != 'copy_chance']:
                if all(key in r for r in results if r['variant'] in (variant, s['base'])):
                    s[f'{key}_vs_base'] = paired_vs_base(results, variant, s['base'], key=key)
    return summary


def tuned_at(point):
    """The tag of the grid point whose tuning chose the settings a run at `point` trains with."""
    return tune_tag if tune_at else point[1]


def tune_variants():
    """Train every candidate of `tune` for every variant (at every grid point, or at tune_at only) on
    tune_seeds, skipping what is trained already, and choose each variant's best. Returns {(attn_type,
    point tag): its tuning record}:
    every candidate's settings, per-seed results and score, the chosen candidate and its settings (None
    when every candidate diverged) and the edge-of-range warnings."""
    options = {a: candidates(variant_tune(tune, a)) for a in attn_types}
    table = {(a, point[1]): [[Run(a, s, point, candidate_settings(c, point_configs[point[1]]), 'tune', candidate_tag(c))
                              for s in tune_seeds] for c in options[a]]
             for point in points if tuned_at(point) == point[1] for a in attn_types}
    every = [run for rows in table.values() for seed_runs in rows for run in seed_runs]
    if not report_only:
        check_settings_unchanged(every)
        train_all(every, rivals={run.dir: (rows, c) for rows in table.values()
                                 for c, seed_runs in enumerate(rows) for run in seed_runs})
    # stopped short of max_iters because beaten (one trained to the end is just ranked)
    beaten = set().union(*(outranked_dirs(rows) for rows in table.values()))
    out = {run.dir for run in every if run.dir in beaten and not finished(run)}
    unfinished = [run for run in every if not finished(run) and not diverged(run) and run.dir not in out]
    if unfinished:
        fail(f"{len(unfinished)} tuning run{'s' if len(unfinished) > 1 else ''} did not finish (first: "
             f"{unfinished[0].dir}, see its train.log), so no variant's best can be chosen yet: run the same "
             f"command again (without --report_only) to train them")
    tuning = {}
    for (attn_type, tag), rows in table.items():
        metric = rows[0][0].metric
        entries = []
        for candidate, seed_runs in zip(options[attn_type], rows):
            per_seed = [None if diverged(run) else tuning_result(run, metric, run.dir in out) for run in seed_runs]
            entries.append({'label': candidate_label(candidate), 'candidate': candidate,
                            'settings': seed_runs[0].settings, 'seeds': list(tune_seeds), 'per_seed': per_seed,
                            'outranked': any(r is not None and r['outranked'] for r in per_seed),
                            **score(per_seed, metric)})
        best = choose(entries, metric)
        for i, entry in enumerate(entries):
            entry['chosen'] = i == best
        tuning[(attn_type, tag)] = {
            'attn_type': attn_type, 'variant': rows[0][0].variant, 'metric': metric, 'candidates': entries,
            'chosen': None if best is None else entries[best]['label'],
            'settings': None if best is None else entries[best]['settings'],
            'warnings': [] if best is None else edge_warnings(variant_tune(tune, attn_type), options[attn_type][best])}
    return tuning


def tuning_result(run, metric, is_outranked):
    _, evals = read_metrics(run.dir)
    result = {'final_val_loss': evals[-1]['val_loss'], 'final_iter': evals[-1]['iter'],
              'reached_target': reached_target(run, evals[-1]), 'outranked': is_outranked}
    if metric == 'accuracy':
        try:
            result['accuracy'] = recall_results(run, attention=False)['accuracy']
        except (CheckpointError, FileError) as e:
            fail(f"tuning run {run.dir}: {e}")
    return result


def sample_text(run_dir):
    cmd = [sys.executable, SAMPLE_SCRIPT, f'--out_dir={run_dir}', '--num_samples=1',
           f'--max_new_tokens={sample_tokens}', '--seed=1337']
    proc = run_child(cmd)
    if proc.returncode != 0:
        return f"(sample.py failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode})"
    return proc.stdout.replace('---------------', '').strip()


# -----------------------------------------------------------------------------
if report_only and not os.path.isdir(out_dir):
    fail(f"out_dir={out_dir!r} does not exist, so there are no runs to report: run the same command without "
         f"--report_only to train them, or point --out_dir at an earlier study")
try:  # one sweep per out_dir at a time (its train.py runs each lock their own folder too)
    sweep_lock = lock_out_dir(out_dir)
except ValueError as e:
    fail(e)
report_dir = os.path.join(out_dir, 'report')


def check_report_dir():
    """A report folder that cannot be one is said before any training, not after it."""
    if os.path.lexists(report_dir) and not os.path.isdir(report_dir):
        fail(f"{report_dir} is not a folder, and compare.py writes its report there: move it away")


check_report_dir()
tuning = tune_variants() if tune else {}
untrainable = {key for key, t in tuning.items() if t['settings'] is None}  # every candidate diverged
runs = [Run(a, s, point, tuning[(a, tuned_at(point))]['settings'] if tuning
            else candidate_settings(chosen[a], point_configs[point[1]]) if chosen else None)
        for point in points for a in attn_types if (a, tuned_at(point)) not in untrainable for s in seeds]
if not report_only:
    check_settings_unchanged(runs)
failures = {} if report_only else train_all(runs)
reporting = True
for key in untrainable:
    failures[(tuning[key]['variant'], 'all')] = "every tuning candidate diverged: nothing to compare it at"
done = [run for run in runs if finished(run)]
if not done:
    fail(f"no finished run in {out_dir}/runs: nothing to report")
results = []
for run in tqdm(done, desc='reading the runs', disable=len(done) < 2 or not sys.stderr.isatty()):
    try:
        results.append(run_results(run))
    except CheckpointError as e:  # a damaged or foreign ckpt.pt among the runs
        failures[(run.variant, run.seed)] = f"its checkpoint cannot be read: {e}"
    except FileError as e:  # a damaged result of eval.py's
        failures[(run.variant, run.seed)] = str(e)
if not results:
    fail(f"no readable finished run in {out_dir}/runs: nothing to report ({'; '.join(failures.values())})")
done = [run for run in done if (run.variant, run.seed) not in failures]
# matplotlib only when reporting
from denoised_gpt.compare_report import WRITE_AGAIN, paired_vs_base, write_plots, write_report  # noqa: E402
summary = summarize(results)
first_run = {}  # variant -> the run of its first seed: the one sampled
for run in done:
    first_run.setdefault(run.variant, run.dir)
texts = {v: sample_text(d) for v, d in first_run.items()} if samples else {}
stop_at_val_loss = train_config['stop_at_val_loss']
protocol = ({'tuned': True, 'tune': tune, 'tune_seeds': tune_seeds, 'metric': sorted({t['metric'] for t in tuning.values()}),
             **({'tuned_at': next(label for _, tag, label in points if tag == tune_tag)} if tune_at else {}),
             **({'stop_at_val_loss': stop_at_val_loss} if stop_at_val_loss else {})}
            if tune else {'tuned': False, 'settings': {k: train_config[k] for k in SHARED_SETTINGS},
                          **({'chosen': chosen, 'chosen_by': chosen_by} if chosen else {})})
check_report_dir()  # again: the study may have run for days
try:  # each file whole or not at all; a failed write is one line (a full disk, ...)
    os.makedirs(report_dir, exist_ok=True)
    plots = write_plots(results, report_dir)
    write_report(report_dir, summary, results, failures, texts, plots,
                 dict(base_config=base_config, overrides=overrides, grid=[label for *_, label in points if label],
                      seeds=seeds, max_iters=max_iters, protocol=protocol, tuning=list(tuning.values()),
                      stop_at_val_loss=stop_at_val_loss, eval_answers_only=train_config['eval_answers_only'],
                      command=shlex.join(['python3', 'compare.py', *sys.argv[1:]]), changes=recorded_changes()))
    write_atomically(os.path.join(report_dir, 'results.json'), lambda f: json.dump(
        {'protocol': protocol, 'tuning': list(tuning.values()), 'summary': summary, 'runs': results,
         'failed': [{'attn_type': a, 'seed': s, 'reason': why} for (a, s), why in failures.items()]}, f, indent=1),
        then=WRITE_AGAIN)
except FileError as e:
    fail(e)
except OSError as e:  # making the folder
    cause, remedy = write_problem(e)
    fail(f"cannot make {report_dir}: {cause}. {remedy.capitalize()}{WRITE_AGAIN}")
print(f"report: {os.path.join(report_dir, 'report.md')} ({len(done)} of {len(runs)} runs"
      f"{f', {len(failures)} failed' if failures else ''})")
if failures:
    sys.exit(1)
