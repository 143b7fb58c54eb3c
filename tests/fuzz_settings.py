"""Random invalid settings for one script, run in one process: none may end in a traceback or hang.

$ python3 tests/fuzz_settings.py train.py --cases=50 --seed=0

Each case is the script's command line with one to three --key=value overrides whose values are wrong
for the key's type or range (a negative count, nan, a word for a number, an empty or odd string, ...),
after a few settings that make an accepted command fail fast instead of training or downloading
(a missing dataset or checkpoint, a tiny model). The script runs in this process (runpy, as
tests/helpers.run_script_in_process runs it); a case that raises anything but SystemExit, prints a
traceback, or runs past its time limit is a failure. Prints one JSON line: cases, exit codes seen, and
the failures with their command lines. tests/test_settings_fuzz.py runs it for every script.
"""
import json
import random
import signal
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from configurator import script_defaults  # noqa: E402
from helpers import ROOT, TINY, run_script_in_process  # noqa: E402

BAD_INT = ['-1', '-7', '-99999999999999999999', '1.5', 'abc', '', 'nan', '1e309', "'3'", '[1]']
BAD_FLOAT = ['-1', '-0.5', 'nan', 'inf', '-inf', '1e309', 'abc', '', '[0.1]', 'None']
BAD_BOOL = ['maybe', '2', '', 'yes please', '[True]', '-1']
BAD_STR = ['', '   ', 'no/such/thing', '../../..', 'x' * 300, '\\t', 'None', '-1', 'nan']
BAD_NONE = ['abc', '-5', '1e309', 'nan', '', '[]']
BAD_LIST = ['', 'a,b', '-1', '[1, "a"]', 'nan', '[]']
CASE_SECONDS = 60
# settings that name a file to write: any text is a valid name there, and the case would write it
WRITES = {'json_out'}


def fail_fast_args(script, tmp):
    """Settings under which an accepted command line ends quickly, with an error or a tiny run."""
    missing = tmp / 'missing'
    return {
        'train.py': [str(TINY), f'--dataset={missing}', f'--out_dir={tmp / "out"}', '--device=cpu', '--max_iters=2'],
        'sample.py': [f'--out_dir={missing}', '--device=cpu'],
        'eval.py': [f'--out_dir={missing}', '--val_loss=True', '--device=cpu'],
        'bench.py': ['--attn_types=base', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
                     '--batch_size=1', '--vocab_size=64', '--warmup_iters=1', '--bench_iters=1', '--rounds=1',
                     '--device=cpu', '--compile=False'],
        'compare.py': [f'--out_dir={tmp / "sweep"}', f'--base_config={missing}.py'],
        'grow.py': [f'--out_dir={missing}', '--grow_to=8', f'--out={tmp / "grown"}', '--device=cpu'],
    }[script]


def bad_values(default):
    if isinstance(default, bool):
        return BAD_BOOL
    if isinstance(default, int):
        return BAD_INT
    if isinstance(default, float):
        return BAD_FLOAT
    if isinstance(default, str):
        return BAD_STR
    if isinstance(default, list):
        return BAD_LIST
    return BAD_NONE


class TimeLimit(Exception):
    pass


def on_alarm(signum, frame):
    raise TimeLimit()


def main(script, cases, seed):
    rng = random.Random(seed)
    defaults = script_defaults(str(ROOT / script))
    keys = sorted(set(defaults) - WRITES)
    failures, codes = [], {}
    signal.signal(signal.SIGALRM, on_alarm)
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(cases):
            case_dir = Path(tmp) / str(case)
            case_dir.mkdir()
            overrides = [f"--{key}={rng.choice(bad_values(defaults[key]))}"
                         for key in rng.sample(keys, rng.randint(1, 3))]
            args = fail_fast_args(script, case_dir) + overrides
            signal.alarm(CASE_SECONDS)
            try:
                proc = run_script_in_process(script, args)
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
