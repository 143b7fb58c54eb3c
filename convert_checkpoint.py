"""
Turn the sharded checkpoint of a parallel='fsdp' run into the single-file ckpt.pt of every other run
(what nanoGPT's scripts read), and back. Both hold the same training state: a run resumes from either,
on any number of ranks, exactly where it stopped.

$ python3 convert_checkpoint.py --out_dir=out-owt-fsdp                 # newest sharded checkpoint -> ckpt.pt
$ python3 convert_checkpoint.py --out_dir=out-owt --to=sharded         # ckpt.pt -> ckpt.sharded-<iter>/
$ python3 convert_checkpoint.py --out_dir=out-old --trust_old_format=True  # the earlier sharded format -> ckpt.pt

sample.py, eval.py, grow.py and train.py read a sharded checkpoint directly (the newer of the two kinds in
out_dir); convert for nanoGPT's scripts, to copy one file, or to resume a DDP run as an fsdp run whose
ranks read only their shards. The conversion runs in one process and holds the whole state in memory.
"""

from configurator import answer_help

answer_help(__file__)  # --help before the heavy imports below

import os

from denoised_gpt.checkpoint import (CKPT_NAME, CheckpointError, check_optimizer_state, checkpoint_path,
                                     read_checkpoint, save_checkpoint)
from denoised_gpt.cli import fail, read_config
from denoised_gpt.run_dir import lock_out_dir
from denoised_gpt.sharded_checkpoint import (checkpoint_as_sharded, is_sharded_checkpoint, newest_sharded,
                                             pointer_problem, save_sharded)
from denoised_gpt.weights import refuse_nonfinite_state

# -----------------------------------------------------------------------------
out_dir = 'out'  # the run directory
to = 'file'  # 'file': its newest sharded checkpoint -> out_dir/ckpt.pt; 'sharded': out_dir/ckpt.pt -> a sharded one
# the earlier sharded format (DCP's pickled .metadata) is read with DCP's own reader, which can run code:
trust_old_format = False  # read a sharded checkpoint of the earlier format: only for a folder you trust
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]

globals().update(read_config(__file__, {k: globals()[k] for k in config_keys}))
if to not in ('file', 'sharded'):
    fail(f"to={to!r} must be 'file' (sharded checkpoint -> ckpt.pt) or 'sharded' (ckpt.pt -> sharded checkpoint)")
source = newest_sharded(out_dir) if to == 'file' else os.path.join(out_dir, CKPT_NAME)
problem = pointer_problem(out_dir) if to == 'file' else None
if problem:
    fail(problem)
if source is None or not (is_sharded_checkpoint(source) if to == 'file' else os.path.isfile(source)):
    kind = 'sharded checkpoint (ckpt.sharded, written by parallel=fsdp runs)' if to == 'file' else CKPT_NAME
    fail(f"{out_dir} holds no {kind} to convert")
try:  # one writer per out_dir: never beside a training run (or another conversion) there
    out_dir_lock = lock_out_dir(out_dir)
except ValueError as e:
    fail(e)


def iteration(path):
    try:
        return read_checkpoint(path, metadata_only=True)[1]['iter_num']
    except (CheckpointError, OSError, ValueError, KeyError):
        return '?'


newest = checkpoint_path(out_dir)
if not os.path.samefile(newest, source):  # never an older training state over a newer one
    fail(f"{newest} is as new as or newer than {source} (iter {iteration(newest)} against {iteration(source)}): "
         f"converting {source} would put an older state in its place. Convert the newer one "
         f"(--to={'sharded' if to == 'file' else 'file'}), or move {newest} out of {out_dir} first")
try:
    checkpoint = read_checkpoint(source, map_location='cpu', trust_old_format=trust_old_format)[1]
    refuse_nonfinite_state(checkpoint, source)
    try:  # what a resume from the converted one would refuse, refused before writing it
        check_optimizer_state(checkpoint)
    except CheckpointError as e:
        fail(f"{source} is not converted: {e}")
    if to == 'file':
        written = save_checkpoint(checkpoint, out_dir)  # the ckpt.pt there before becomes ckpt.prev.pt
    else:
        written = save_sharded(*checkpoint_as_sharded(checkpoint), out_dir)
except (FileNotFoundError, CheckpointError, ValueError) as e:
    fail(e)
except OSError as e:  # disk full, no permission: the checkpoints already there are intact
    fail(f"could not write the converted checkpoint in {out_dir} ({e.strerror or e}); the checkpoints there are intact")
print(f"wrote {written} from {source}, iter {checkpoint['iter_num']}")
