"""The scripts' command line: read the settings (configurator.py), refuse bad input in one line (exit 2),
the checks several scripts share, the device set up, and GPT-2's tokenizer. Command-line helpers only,
above the package's other layers: building a model is models.py's, and the scripts call it."""
import contextlib
import difflib
import math
import os
import signal
import sys
import tempfile

from configurator import ConfigError, apply_config, optional_bool
from denoised_gpt.files import write_problem

GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')


def fail(message):
    """A setting or input that cannot work: say what and how to fix it on stderr, exit 2 (no traceback)."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    sys.exit(2)


def quiet_ctrl_c():
    """From now on Ctrl-C ends the script with one line on stderr and exit status 130 (128 + SIGINT, what a
    shell reports), not a KeyboardInterrupt traceback. It raises SystemExit where the script is, so its
    finally blocks still run (a result being written is left whole or not at all)."""
    def interrupted(signum, frame):
        print(f"\n{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130)
    signal.signal(signal.SIGINT, interrupted)


def log(message):
    """Messages go to stderr, so that a script's stdout holds only its results."""
    print(message, file=sys.stderr, flush=True)


def check_writable_folder(key, path):
    """Exit 2 unless the setting's folder is, or can be made, one we can write in: tried now, not when the first
    results are ready. The folders made for the trial are removed again: a run that fails before it writes
    leaves none."""
    made = []  # the missing folders of the path, innermost first
    missing = os.path.abspath(path)
    while not os.path.lexists(missing):
        made.append(missing)
        missing = os.path.dirname(missing)
    try:
        os.makedirs(os.path.abspath(path), exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        what = "is a file, not a folder" if os.path.isfile(path) else f"cannot be written ({write_problem(e)[0]})"
        fail(f"{key}={path!r} {what}: choose another folder with --{key}")
    finally:
        for folder in made:
            if os.path.isdir(folder):
                os.rmdir(folder)


def print_result(text):
    """print(text) to stdout, where a script's results go, flushed now: a stdout that cannot take it (a full
    disk, `> /dev/full`, a closed pipe) ends the script with one line naming where stdout goes and why (exit
    status 1), not a traceback."""
    try:
        print(text, flush=True)
    except OSError as e:
        try:
            where = os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")  # (Linux) the file or device behind it
        except (OSError, ValueError):
            where = ""
        where = where if os.path.isabs(where) else "stdout"  # (a pipe's is 'pipe:[inode]')
        # stdout is given up for good: Python's own flush at exit would fail again, with a second message
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        cause, remedy = write_problem(e)
        print(f"{os.path.basename(sys.argv[0])}: error: cannot write the results to {where}: {cause}; {remedy} "
              f"and run it again", file=sys.stderr)
        sys.exit(1)


def read_config(script, defaults, given=None, optional_bools=()):
    """The script's settings: `defaults` updated by the config files and --key=value overrides on the
    command line (configurator.apply_config); --help prints them and exits. given: a set that receives
    the keys set. optional_bools: keys whose default None means "as the checkpoint says" (True, False
    or None, see configurator.optional_bool)."""
    try:
        config = apply_config(sys.argv[1:], defaults, script=script, given=given)
        return {**config, **{k: optional_bool(k, config[k]) for k in optional_bools}}
    except ConfigError as e:
        fail(e)


def check_before_torch(script):
    """train.py's settings that are wrong on any machine, said in one line (exit 2) before torch loads (1.5 s on an
    idle 2-core CPU, 15-30 s on a busy one): an unknown key or a value of the wrong type, an attn_type model.py
    does not register, a dataset without its token files. train.py checks everything again once torch is in."""
    from configurator import attention_names, script_defaults
    from denoised_gpt.files import check_token_files
    given = set()
    config = read_config(script, script_defaults(script), given)
    names = attention_names()
    if names and config['attn_type'] not in names:
        close = difflib.get_close_matches(str(config['attn_type']), names, n=1, cutoff=0.5)
        fail(f"attn_type={config['attn_type']!r} is not a known attention variant; valid values: {', '.join(names)}."
             + (f" Did you mean {close[0]!r}?" if close else ""))
    if not config['merge_lora'] and (config['init_from'] != 'resume' or 'dataset' in given):  # else the checkpoint's
        try:
            check_token_files(os.path.join('data', config['dataset']))
        except (FileNotFoundError, ValueError) as e:
            fail(e)


def check_attn_types(names, all_allowed=False):
    """A list of attn_type names (compare.py's, bench.py's attn_types): ValueError naming each unknown one,
    with the closest valid name. all_allowed: the setting may also be 'all' (bench.py)."""
    from model import ATTENTION_TYPES
    unknown = []
    for name in names:
        if name not in ATTENTION_TYPES:
            close = difflib.get_close_matches(str(name), ATTENTION_TYPES, n=1, cutoff=0.5)
            unknown.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if unknown or not names:
        choose = "use 'all' or a comma-separated list of" if all_allowed else "choose from"
        raise ValueError(f"attn_types={names!r}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                         f"{choose} {', '.join(ATTENTION_TYPES)}")


def duration(seconds):
    """seconds as '45s', '3m05s', '2h07m' or '3d04h': the two units that matter."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ram_bytes():
    """Bytes of RAM this machine has (None where the system does not say): what no run on its CPU can exceed."""
    try:
        return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    except (ValueError, OSError, AttributeError):
        return None


def human_bytes(n):
    """n bytes in binary units, e.g. '1.5 GiB', '6.4 PiB'."""
    for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'):
        if n < 1024 or unit == 'PiB':
            return f"{n:,.0f} {unit}" if unit == 'B' else f"{n:,.1f} {unit}"
        n /= 1024


def refused_allocation(error):
    """The allocator's words when error is its refusal (MemoryError, torch's OutOfMemoryError, the CPU
    allocator's RuntimeError), else None: a size setting too large for the machine, said in one line."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, MemoryError) or type(error).__name__ == 'OutOfMemoryError' or (
            isinstance(error, RuntimeError) and "can't allocate memory" in text):
        return text[text.find('DefaultCPUAllocator'):] if 'DefaultCPUAllocator' in text else text[:300]
    return None


MAX_BATCH_SIZE = 1 << 16  # batch_size: sequences per forward pass (and rank); GPT-2's recipe uses 12
MAX_STEPS = 10 ** 6  # a benchmark's steps, an evaluation's batches: hours at a millisecond each


def setting_text(key, value):
    """key=value for a message, a value of thousands of digits shortened (one line stays one line)."""
    value = str(value)
    if len(value) > 20:
        value = f"{value[:12]}... ({len(value.lstrip('-')):,} digits)"
    return f"{key}={value}"


def check_ranges(config, at_least_one=(), non_negative=(), unit_interval=(), positive=(), seeds=(), at_most=None):
    """Numeric settings that cannot work: ValueError naming the first one. Every float must be finite
    too (a typed 1e309 is inf); seeds are non-negative integers below 2**63 (torch's generators); at_most:
    {key: (limit, what the limit is of)} for counts that would run for ever or exhaust memory beyond it."""
    def shown(key):
        return setting_text(key, config[key])

    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}={value} must be a finite number")
    for key in at_least_one:
        if config[key] < 1:
            raise ValueError(f"{shown(key)} must be at least 1")
    for key in non_negative:
        if not config[key] >= 0:
            raise ValueError(f"{shown(key)} must not be negative" +
                             (" (0 turns clipping off)" if key == 'grad_clip' else ""))
    for key in unit_interval:
        if not 0 <= config[key] < 1:
            raise ValueError(f"{shown(key)} must be in [0, 1)")
    for key in positive:
        if not config[key] > 0:
            raise ValueError(f"{shown(key)} must be positive")
    for key in seeds:
        if not 0 <= config[key] < 2 ** 63:
            raise ValueError(f"{shown(key)} must be a non-negative integer below 2**63")
    for key, (limit, what) in (at_most or {}).items():
        if config[key] > limit:
            raise ValueError(f"{shown(key)} is over the limit of {limit:,} {what}")


def prepare_device(device, dtype):
    """The device and dtype settings resolved and the device set up, before any model is loaded (a bad one: exit
    2 at once); dtype 'auto' stays 'auto' until the model says what it was trained in (run_dtype)."""
    from denoised_gpt.device import resolve_device, resolve_dtype, setup
    try:
        device = resolve_device(device)
        if dtype != 'auto':
            dtype = resolve_dtype(dtype, device, training=False)  # sample.py and eval.py run a model, never train it
    except ValueError as e:
        fail(e)
    setup(device)
    return device, dtype


def run_dtype(dtype, device, trained_in='auto'):
    """The dtype to run the model in: prepare_device's dtype, or for 'auto' the one the model was trained in
    (models.trained_dtype's) where the device runs it, else the device's own choice."""
    from denoised_gpt.device import resolve_dtype
    if dtype == 'auto' and trained_in != 'auto':
        with contextlib.suppress(ValueError):  # float16 off CUDA: the device's own choice
            return resolve_dtype(trained_in, device, training=False)
    return resolve_dtype(dtype, device, training=False)


def check_inference_source(init_from):
    """sample.py / eval.py run a trained model: 'resume' (out_dir's ckpt.pt), GPT-2's weights, or a folder in
    the Hugging Face format (export_hf.py's, or GPT-2 saved by transformers)."""
    if init_from == 'resume' or init_from.startswith('gpt2') or os.path.isfile(os.path.join(init_from, 'config.json')):
        return
    hint = f" ({init_from} holds a checkpoint: pass --out_dir={init_from})" if os.path.isfile(
        os.path.join(init_from, 'ckpt.pt')) else ""
    fail(f"init_from={init_from!r} must be 'resume' (a checkpoint in out_dir), a GPT-2 model name "
         f"({', '.join(GPT2_NAMES)}) or a folder in the Hugging Face format, with a config.json (export_hf.py "
         f"writes one){hint}")


def gpt2_encoding():
    """tiktoken's GPT-2 BPE; it downloads its files once, so offline it says where to put them. tiktoken's
    'r50k_base' is the same encoding (ranks, split pattern and <|endoftext|>) in its own compact file, which
    loads in a third of the time of the two GPT-2 files behind 'gpt2': used when tiktoken has it cached."""
    import tiktoken
    name = "r50k_base" if _in_tiktoken_cache(R50K_BASE_URL) else "gpt2"
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # offline, tiktoken's download is a network error of some kind
        fail(f"cannot load tiktoken's gpt2 encoding ({type(e).__name__}: {e}); it is downloaded on first "
             f"use: connect once, or point TIKTOKEN_CACHE_DIR at a directory that holds its files")


R50K_BASE_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"


def _in_tiktoken_cache(url):
    """Whether tiktoken's file cache holds url's file (named by the SHA-1 of the url, as tiktoken does)."""
    import hashlib
    import tempfile
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR",
                                                                     os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    return bool(cache_dir) and os.path.isfile(os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))
