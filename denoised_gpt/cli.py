"""What every script does the same way: read its settings, refuse bad input in one line, load a model
to run (a checkpoint, GPT-2's weights or a folder in the Hugging Face format) and GPT-2's tokenizer."""
import contextlib
import dataclasses
import difflib
import math
import os
import pickle
import socket
import sys
import urllib.parse

import torch

from configurator import ConfigError, apply_config, optional_bool

GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')


def fail(message):
    """A setting or input that cannot work: say what and how to fix it on stderr, exit 2 (no traceback)."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    sys.exit(2)


def log(message):
    """Messages go to stderr, so that a script's stdout holds only its results."""
    print(message, file=sys.stderr, flush=True)


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


def check_ranges(config, at_least_one=(), non_negative=(), unit_interval=(), positive=(), seeds=()):
    """Numeric settings that cannot work: ValueError naming the first one. Every float must be finite
    too (a typed 1e309 is inf); seeds are non-negative integers below 2**63 (torch's generators)."""
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}={value} must be a finite number")
    for key in at_least_one:
        if config[key] < 1:
            raise ValueError(f"{key}={config[key]} must be at least 1")
    for key in non_negative:
        if not config[key] >= 0:
            raise ValueError(f"{key}={config[key]} must not be negative" +
                             (" (0 turns clipping off)" if key == 'grad_clip' else ""))
    for key in unit_interval:
        if not 0 <= config[key] < 1:
            raise ValueError(f"{key}={config[key]} must be in [0, 1)")
    for key in positive:
        if not config[key] > 0:
            raise ValueError(f"{key}={config[key]} must be positive")
    for key in seeds:
        if not 0 <= config[key] < 2 ** 63:
            raise ValueError(f"{key}={config[key]} must be a non-negative integer below 2**63")


def trained_dtype(init_from, out_dir):
    """The dtype out_dir's checkpoint was trained in, if it names one ('auto' otherwise). prepare_device's
    'auto' runs the model there: a model trained in float32 (config/train_mqar.py) can answer differently in
    bfloat16 (linear attention on recall did)."""
    from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
    if init_from != 'resume' or not os.path.exists(checkpoint_path(out_dir)):
        return 'auto'
    try:
        return load_checkpoint(out_dir, metadata_only=True)['config'].get('dtype', 'auto')
    except CheckpointError:  # loading the model says why, in one line
        return 'auto'


def prepare_device(device, dtype, trained_in='auto'):
    """The device and dtype settings ('auto' or a name) resolved, and the device set up; exit 2 on a bad one.
    trained_in: the dtype the model was trained in (trained_dtype's), which 'auto' takes where the device runs it."""
    from denoised_gpt.device import resolve_device, resolve_dtype, setup
    try:
        device = resolve_device(device)
        if dtype == 'auto' and trained_in != 'auto':
            with contextlib.suppress(ValueError):  # float16 off CUDA: the device's own choice
                dtype = resolve_dtype(trained_in, device, training=False)
        dtype = resolve_dtype(dtype, device, training=False)  # sample.py and eval.py run a model, never train it
    except ValueError as e:
        fail(e)
    setup(device)
    return device, dtype


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


def load_model(init_from, out_dir, noise_at_eval=None, model_overrides=None):
    """The model to run, in eval mode on the CPU, and the checkpoint it came from. init_from: 'resume'
    (out_dir's ckpt.pt, or a checkpoint file), a GPT-2 name, or a Hugging Face folder: a denoised_gpt one
    (export_hf.py) is read like a checkpoint, a GPT-2 one by GPT.from_pretrained. The checkpoint is None for
    GPT-2's weights; for an exported folder, a dict like load_checkpoint's with what its training_run.json
    records (iter_num, best_val_loss, config). noise_at_eval: None keeps the checkpoint's setting; True /
    False is refused for a model without NoiseFormer noise. model_overrides: model_args replaced where the
    model has that setting (e.g. noise_per_sample for NoiseFormer)."""
    from model import ATTENTION_TYPES, GPTConfig
    from denoised_gpt.checkpoint import CheckpointError, load_checkpoint
    from denoised_gpt.hf_format import MODEL_TYPE, exported_model_type, exported_run, read_exported
    script = os.path.basename(sys.argv[0])
    try:
        own_code = init_from != 'resume' and exported_model_type(init_from) == MODEL_TYPE
        if init_from != 'resume' and not own_code:  # GPT-2's weights: a name, or a folder saved by transformers
            if noise_at_eval is not None:
                fail("noise_at_eval applies to NoiseFormer models only; GPT-2's weights are base attention")
            run = exported_run(init_from) if os.path.isdir(init_from) else None
            with contextlib.redirect_stdout(sys.stderr):  # from_pretrained prints progress
                model = load_gpt2(init_from, dict(dropout=0.0)).eval()
            return refuse_nonfinite(model, init_from), run and {**run, 'model_args': dataclasses.asdict(model.config)}
        if own_code:
            source, checkpoint = init_from, read_exported(init_from)
        else:
            # model_only: the optimizer state is never read
            source, checkpoint = out_dir, load_checkpoint(out_dir, map_location='cpu', model_only=True)
    except FileNotFoundError as e:
        hint = "" if init_from != 'resume' else (f"\n({script} loads out_dir/ckpt.pt with init_from='resume'; for "
                                                 f"OpenAI's weights use --init_from=gpt2)")
        fail(f"{e}{hint}")
    except (CheckpointError, ValueError) as e:
        fail(e)
    model_args = dict(checkpoint['model_args'])
    attn_type = model_args.get('attn_type', 'base')  # nanoGPT checkpoints have no attn_type
    fields = getattr(ATTENTION_TYPES.get(attn_type), 'config_fields', ())
    if noise_at_eval is not None:
        if 'noise_at_eval' not in fields:
            users = ' / '.join(k for k, cls in ATTENTION_TYPES.items() if 'noise_at_eval' in cls.config_fields)
            fail(f"noise_at_eval applies to NoiseFormer models ({users}) only; {source} is "
                 f"attn_type={attn_type!r}: drop --noise_at_eval")
        model_args['noise_at_eval'] = noise_at_eval
    model_args.update({k: v for k, v in (model_overrides or {}).items() if k in fields})
    try:
        model = model_with_weights(GPTConfig(**model_args), checkpoint['model'])
    except (TypeError, ValueError, RuntimeError) as e:
        fail(f"the {'model in' if own_code else 'checkpoint in'} {source} does not build a model: {e}")
    from denoised_gpt.checkpoint import checkpoint_path
    return refuse_nonfinite(model.eval(), source if own_code else checkpoint_path(out_dir)), checkpoint


def refuse_nonfinite(model, source):
    """model, unless a weight is NaN or inf (a diverged run's state): every loss and sample from it would be
    NaN, so the script stops in one line naming source."""
    from denoised_gpt.training import all_finite, nonfinite_weights  # (training imports this module)
    if not all_finite(model.parameters()):
        fail(nonfinite_weights(source))
    return model


def hub_reachable(seconds=3.0):
    """Whether the Hugging Face hub (HF_ENDPOINT, else huggingface.co) answers a TCP connection within
    `seconds`. Without this check an unreachable hub costs ~50 s of the hub client's retries."""
    url = urllib.parse.urlparse(os.environ.get('HF_ENDPOINT') or 'https://huggingface.co')
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == 'http' else 443)),
                                 timeout=seconds).close()
        return True
    except OSError:
        return False


def model_with_weights(config, state_dict, prepare=None):
    """GPT(config) holding state_dict, built on the meta device: no random initialisation for the weights
    to overwrite (a second or more at GPT-2 size), and the state_dict's tensors become the parameters
    themselves, not copies. prepare(model), if given, changes the empty model before the weights go in
    (resume: the LoRA adapters and frozen parameters of the run). Raises RuntimeError (load_state_dict's)
    when a tensor is missing or does not fit."""
    model = empty_model(config, prepare)
    model.load_state_dict(state_dict, assign=True)  # requires_grad stays the model's (prepare's freezing)
    # assign gives each key its own Parameter: tie lm_head to the token embedding again, as GPT does
    model.lm_head.weight = model.transformer.wte.weight
    return model


def empty_model(config, prepare=None):
    """GPT(config) on the meta device, its parameters without storage or values (see model_with_weights)."""
    from model import GPT
    with torch.device('meta'), _NoRandomDraws():
        model = GPT(config)
        if prepare is not None:
            prepare(model)
    return model


class _NoRandomDraws(torch.overrides.TorchFunctionMode):
    """While a model is built to take a checkpoint's tensors, its random initialisation has nothing to do:
    normal_ on a meta tensor is skipped, and the variants' small torch.randn vectors become zeros on the
    CPU. On meta tensors torch runs such ops through Python reference code that imports its compiler
    (torch._dynamo: about 1.7 s of start-up for sample.py and eval.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_ or func is torch.Tensor.normal_:
            return kwargs['tensor'] if 'tensor' in kwargs else args[0]
        if func is torch.randn:
            return torch.zeros(*args, **{**kwargs, 'device': 'cpu'})
        return func(*args, **kwargs)


def load_gpt2(name, override_args):
    """GPT.from_pretrained(name, override_args): OpenAI's GPT-2 weights from the Hugging Face hub (or a
    folder saved by transformers), failing with what to do when they cannot be had. When the hub cannot
    be reached the weights come from the local cache only (HF_HUB_OFFLINE=1), at once."""
    from model import GPT
    offline = os.environ.get('HF_HUB_OFFLINE', '0').lower() not in ('0', 'false', 'no', '')
    if not os.path.isdir(name) and not offline and not hub_reachable():
        os.environ['HF_HUB_OFFLINE'] = '1'  # read when the hub client is imported, which comes later
        if 'huggingface_hub.constants' in sys.modules:  # already imported: tell it directly
            sys.modules['huggingface_hub.constants'].HF_HUB_OFFLINE = True
        offline = True
    try:
        return GPT.from_pretrained(name, override_args)
    except ImportError:
        fail(f"init_from={name!r} needs the transformers package: pip install transformers")
    except OSError as e:  # offline, or a name the hub does not know
        where = "not in the local cache, and the Hugging Face hub is offline or unreachable" if offline else \
            f"could not be fetched from the Hugging Face hub ({str(e).strip().splitlines()[0][:200]})"
        fail(f"could not fetch the {name!r} weights: {where}. Connect to the network once (they are cached), "
             f"or pass --init_from=/path/to/a/folder/saved/by/transformers/save_pretrained")
    except ValueError as e:  # weights that do not fit the attn_type asked for
        fail(f"cannot load the {name!r} weights: {e}")
    except pickle.UnpicklingError as e:  # weights_only refused what its pytorch_model.bin holds, or it is damaged
        from denoised_gpt.checkpoint_base import short_reason, untrusted_file_error
        fail(untrusted_file_error(name, e) or f"cannot load the {name!r} weights: {short_reason(e)}")


def noise_on(model):
    """Whether the model draws NoiseFormer noise when it runs in eval mode (sampling, evaluation)."""
    from model import ATTENTION_TYPES
    return bool('noise_at_eval' in ATTENTION_TYPES[model.config.attn_type].config_fields
                and model.config.noise_at_eval)


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
