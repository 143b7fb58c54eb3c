"""Random invalid settings for one script, run in one process: none may end in a traceback or hang.

$ python3 tests/fuzz_settings.py train.py --cases=50 --seed=0
$ python3 tests/fuzz_settings.py data/mqar/prepare.py --cases=30 --seed=0

Each case is the script's command line with one to three --key=value overrides whose values are wrong
for the key's type or range (a negative count, nan, a word for a number, an empty or odd string, a size
no machine holds, ...), after a few settings that make an accepted command fail fast instead of training
or downloading (a missing dataset or checkpoint, a tiny model, a tiny input). The script runs in this
process (runpy, as tests/helpers.run_script_in_process runs it); a case that raises anything but
SystemExit, prints a traceback, or runs past its time limit is a failure. Prints one JSON line: cases,
exit codes seen, and the failures with their command lines. tests/test_settings_fuzz.py runs it for every
script.

The scripts read by configurator.py name their settings and defaults at the top (script_defaults); the
data preparation scripts (data/*/prepare.py) take argparse options, whose names, types and defaults come
from the parser each builds (caught as it parses, before it does anything). Those need no torch, and
this file imports it only for the others.
"""
import argparse
import contextlib
import io
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / 'tests'), str(ROOT)]

from configurator import script_defaults  # noqa: E402

BAD_INT = ['-1', '-7', '-99999999999999999999', '1.5', 'abc', '', 'nan', '1e309', "'3'", '[1]']
BAD_FLOAT = ['-1', '-0.5', 'nan', 'inf', '-inf', '1e309', 'abc', '', '[0.1]', 'None', '1e300']
BAD_BOOL = ['maybe', '2', '', 'yes please', '[True]', '-1']
BAD_STR = ['', '   ', 'no/such/thing', '../../..', 'x' * 300, '\\t', 'None', '-1', 'nan']
BAD_NONE = ['abc', '-5', '1e309', 'nan', '', '[]']
BAD_LIST = ['', 'a,b', '-1', '[1, "a"]', 'nan', '[]']
CASE_SECONDS = 60
# settings that name a file or folder to write: any text is a valid name there, and the case would write it
WRITES = {'json_out'}
DATA_WRITES = {'out_dir', 'cache_dir'}  # (the other scripts' out_dir is read, or refused before writing)
DATA_SCRIPTS = ['data/openwebtext/prepare.py', 'data/fineweb_edu/prepare.py', 'data/mqar/prepare.py',
                'data/shakespeare_char/prepare.py']


def fail_fast_args(script, tmp):
    """Settings under which an accepted command line ends quickly, with an error or a tiny run."""
    missing = tmp / 'missing'
    out = f'--out_dir={tmp / "out"}'
    return {
        # token files that are there (train.py looks for them before torch loads) but too short for a batch
        'train.py': [str(ROOT / 'tests' / 'config_tiny.py'), f'--dataset={tmp.parent / "empty_data"}', out,
                     '--device=cpu', '--max_iters=2'],
        'sample.py': [f'--out_dir={missing}', '--device=cpu'],
        'eval.py': [f'--out_dir={missing}', '--val_loss=True', '--device=cpu'],
        'bench.py': ['--attn_types=base', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
                     '--batch_size=1', '--vocab_size=64', '--warmup_iters=1', '--bench_iters=1', '--rounds=1',
                     '--device=cpu', '--compile=False'],
        'compare.py': [f'--out_dir={tmp / "sweep"}', f'--base_config={missing}.py'],
        'grow.py': [f'--out_dir={missing}', '--grow_to=8', f'--out={tmp / "grown"}', '--device=cpu'],
        # local inputs of a few documents (made once, beside the cases): never the hub, never a download
        'data/openwebtext/prepare.py': [f'--input={tmp.parent / "docs.jsonl"}', out, '--num_proc=1'],
        'data/fineweb_edu/prepare.py': [f'--input={tmp.parent / "docs.jsonl"}', out, '--num_proc=1'],
        'data/mqar/prepare.py': ['--train_examples=20', '--val_examples=5', out],
        'data/shakespeare_char/prepare.py': [f'--input={tmp.parent / "input.txt"}', out],
    }[script]


def write_inputs(tmp):
    """The small inputs fail_fast_args names."""
    docs = [f"document {i}: " + "words of text " * (i % 7) for i in range(40)]
    (tmp / 'docs.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    (tmp / 'empty_data').mkdir()
    for split in ('train', 'val'):
        (tmp / 'empty_data' / f'{split}.bin').touch()
    (tmp / 'input.txt').write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20)


def huge(default):
    """Counts and sizes no machine holds, derived from the default: a billion times it, 10^11, and 2^63 (one
    past the largest 64-bit integer)."""
    default = default if isinstance(default, int) else 0  # (None, or a list for nargs='+')
    return [str(max(default, 2) * 10 ** 9), str(10 ** 11), str(2 ** 63)]


def bad_values(key, default, kind=None):
    """Wrong values for a setting of this default (configurator's scripts) or argparse type (kind)."""
    kind = kind or type(default)
    if kind is bool:
        return BAD_BOOL
    if kind is int:
        return BAD_INT + huge(default)
    if kind is float:
        return BAD_FLOAT
    if kind is str:
        return BAD_STR
    if kind is list:
        return BAD_LIST
    return BAD_NONE


class Parsed(Exception):
    """Raised in place of parse_args: the script's parser, caught before the script does anything."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def run_in_process(script, args):
    """`python3 SCRIPT ARGS` in the repo root, in this process (runpy, as __main__), for the data scripts:
    they need none of what tests/helpers.run_script_in_process restores (torch's threads, signal handlers), nor
    its torch import. A CompletedProcess; an exception other than SystemExit propagates."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, os.getcwd(), list(sys.path)
    sys.argv = [script, *map(str, args)]
    os.chdir(ROOT)
    rc = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / script), run_name='__main__')
    except SystemExit as e:
        rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved[0]
        os.chdir(saved[1])
        sys.path[:] = saved[2]  # (each script puts data/ in front again)
    return subprocess.CompletedProcess([script, *args], rc, out.getvalue(), err.getvalue())


def argparse_settings(script):
    """{key: bad values} for a data script's options (--key), from the parser it builds."""
    parse_args = argparse.ArgumentParser.parse_args

    def caught(parser, *args, **kwargs):
        raise Parsed(parser)
    argparse.ArgumentParser.parse_args = caught
    try:
        run_in_process(script, [])
        raise RuntimeError(f"{script} never parsed its command line")
    except Parsed as parsed:
        parser = parsed.parser
    finally:
        argparse.ArgumentParser.parse_args = parse_args
    values = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        key = action.option_strings[-1].lstrip('-')
        kind = str if action.choices or action.type is None else action.type
        values[key] = bad_values(key, action.default if kind is not str else '', kind)
    return values


class TimeLimit(Exception):
    pass


def on_alarm(signum, frame):
    raise TimeLimit()


def main(script, cases, seed):
    rng = random.Random(seed)
    if script in DATA_SCRIPTS:
        values, run = argparse_settings(script), run_in_process
    else:
        from helpers import run_script_in_process  # (torch, for the scripts that train or run a model)
        defaults = script_defaults(str(ROOT / script))
        values, run = {k: bad_values(k, v) for k, v in defaults.items()}, run_script_in_process
    keys = sorted(set(values) - WRITES - (DATA_WRITES if script in DATA_SCRIPTS else set()))
    failures, codes = [], {}
    signal.signal(signal.SIGALRM, on_alarm)
    with tempfile.TemporaryDirectory() as tmp:
        write_inputs(Path(tmp))
        for case in range(cases):
            case_dir = Path(tmp) / str(case)
            case_dir.mkdir()
            chosen = rng.sample(keys, rng.randint(1, min(3, len(keys))))
            overrides = [f"--{key}={rng.choice(values[key])}" for key in chosen]
            args = fail_fast_args(script, case_dir) + overrides
            signal.alarm(CASE_SECONDS)
            try:
                proc = run(script, args)
                if 'Traceback' in proc.stderr:
                    failures.append(dict(args=args, traceback=proc.stderr[-2000:]))
                codes[proc.returncode] = codes.get(proc.returncode, 0) + 1
            except TimeLimit:
                failures.append(dict(args=args, hang=f"still running after {CASE_SECONDS} s"))
            except BaseException as e:  # the script raised: a traceback a user would see
                failures.append(dict(args=args, traceback=f"{type(e).__name__}: {e}"))
            finally:
                signal.alarm(0)
    print(json.dumps(dict(script=script, cases=cases, exit_codes=codes, failures=failures)))


if __name__ == '__main__':
    options = dict(a[2:].split('=', 1) for a in sys.argv[2:])
    main(sys.argv[1], int(options.get('cases', 50)), int(options.get('seed', 0)))
