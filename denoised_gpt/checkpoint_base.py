"""
The foundation of the checkpoint formats: what ckpt.pt (checkpoint.py) and the sharded checkpoints
(sharded_checkpoint.py) share. CheckpointError; the refusal of a file that holds pickled code
(untrusted_file_error), told apart from a damaged one by the zip's CRC-32s; torch's errors cut to their
first sentence; a checkpoint's optimizer state by parameter name. It imports nothing from the package.
"""
import pickle
import re
import reprlib
import sys
import zipfile


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says why and what to do instead."""


MAX_COUNT = 2 ** 63 - 1  # what torch's int64 holds: iteration counts are used in tensor arithmetic


def _is_count(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT


def _is_number(v):
    # nanoGPT stores best_val_loss as the 0-d tensor its evaluation returned
    if hasattr(v, 'dim') and hasattr(v, 'is_floating_point'):
        return v.dim() == 0 and v.is_floating_point()
    return is_float_value(v)


def is_float_value(v):
    """Whether v is a float, or an int that a float holds (10**400 is not: float() of it is an OverflowError)."""
    return isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= sys.float_info.max)


# The train state as train.py writes it (key: (what it must be, the check)); an optional key may be absent
# (a checkpoint of an older version, or nanoGPT's) or None where train.py writes None
TRAIN_STATE = {
    'iter_num': ("a non-negative integer up to 2**63 - 1", _is_count),
    'best_val_loss': ("a number a float holds", _is_number),
    'best_iter': ("a non-negative integer up to 2**63 - 1, or null", lambda v: v is None or _is_count(v)),
    'val_loss': ("a number a float holds, or null", lambda v: v is None or _is_number(v)),
    'train_time': ("a number a float holds", _is_number),
    'model_args': ("a dict", lambda v: isinstance(v, dict)),
    'config': ("a dict", lambda v: isinstance(v, dict)),
    'attn_args': ("a dict", lambda v: isinstance(v, dict)),  # the variant's model_args (checkpoint.py)
}


def train_state_problem(state):
    """What is wrong with the counters and settings of a checkpoint's train state (TRAIN_STATE's keys that
    it has), in words for a message ("iter_num is '5' (a str), not a non-negative integer"), or None. Checked
    on load, so that a file edited or written by other code is refused in one line, not met as a TypeError
    in the middle of a run."""
    for key, (expected, ok) in TRAIN_STATE.items():
        if key in state and not ok(state[key]):
            value = reprlib.repr(state[key])  # bounded as it is built: a small file can nest a huge structure
            value = value if len(value) <= 40 else value[:37] + '...'
            return f"{key} is {value} (a {type(state[key]).__name__}), not {expected}"
    return None


def untrusted_file_error(path, e, opened=None):
    """The CheckpointError for a file (or a folder of them) at path that torch.load(weights_only=True)
    refused (e) because it holds pickled objects other than tensors and plain values; None when e is any
    other error or the file is damaged (bytes that read as garbage, not as code). The message names what
    was refused, and never repeats torch's advice to load the file some other way. opened: a path to the file
    already opened (files.opened_path), read instead of path, which may name another file by now."""
    text = str(e).lower()
    if not isinstance(e, pickle.UnpicklingError) or not ('weights_only' in text or 'weights only' in text) \
            or _is_damaged(opened or path):
        return None
    refused = re.search(r"GLOBAL ([\w.]+)", str(e))
    what = f" (it references {refused[1]})" if refused else ""
    return CheckpointError(f"checkpoint {path} holds Python objects other than tensors and plain values{what}, "
                           f"which are not loaded because unpickling them can run code")


def _is_damaged(path):
    """Whether a record of the file fails its CRC-32 or the zip itself cannot be read."""
    try:
        return first_damaged_record(path) is not None
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, RuntimeError):
        return True


def first_damaged_record(path):
    """The name of the first record of a torch.save zip whose bytes do not match their stored
    CRC-32, or None. Files that carry no CRCs (saved with torch's compute_crc32 off: every CRC is
    0, or torch's legacy non-zip format) cannot be checked and pass."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        if all(info.CRC == 0 for info in archive.infolist()):
            return None
        bad = archive.testzip()  # reads every record: about as long as torch.load's own read
        return None if bad is None else f"record {bad}"


def short_reason(e):
    """e's message up to its first full stop: torch's errors go on for lines (advice included) after the
    sentence that names the problem."""
    line = (str(e).strip().splitlines() or [''])[0]
    return re.split(r'\.\s+(?=[A-Z])', line, maxsplit=1)[0][:200]


def optimizer_state_by_name(checkpoint):
    """checkpoint['optimizer'] keyed by parameter name: ({name: state}, the param groups with names in
    place of slot numbers), or ({}, None) for a checkpoint without optimizer state. Names as
    load_optimizer_state reads them (ours: optimizer_param_names; nanoGPT's: its grouping)."""
    saved = checkpoint['optimizer']
    if saved is None:
        return {}, None
    names = checkpoint.get('optimizer_param_names') or nanogpt_param_names(checkpoint, None)
    groups = [{**group, 'params': [clean_name(n) for n in group_names]}
              for group, group_names in zip(saved['param_groups'], names)]
    state = {name: saved['state'][i] for group, group_names in zip(saved['param_groups'], names)
             for i, name in zip(group['params'], group_names) if i in saved['state']}
    return state, groups


def nanogpt_param_names(checkpoint, model):
    """Slot names in the order nanoGPT's configure_optimizers builds them: named_parameters order
    (= checkpoint['model'] order without the tied lm_head.weight and buffers such as its causal
    mask attn.bias), split into dim >= 2 (decayed) and dim < 2 (not decayed). Older checkpoints of
    ours (attn.c_proj registered before attn.c_attn) follow their own key order the same way."""
    if model is None:  # the checkpoint alone: every tensor but the tied lm_head (read_checkpoint dropped the masks)
        own = {clean_name(k) for k in checkpoint['model']} - {'lm_head.weight'}
    else:
        own = {clean_name(n) for n, _ in model.named_parameters()}  # excludes the tied lm_head, buffers
    weights = [(k, v) for k, v in ((clean_name(k), v) for k, v in checkpoint['model'].items()) if k in own]
    return [[k for k, v in weights if v.dim() >= 2], [k for k, v in weights if v.dim() < 2]]



def clean_name(name):
    return name.removeprefix('_orig_mod.')  # torch.compile's wrapper prefixes every name
