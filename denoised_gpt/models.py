"""
A model from any source, built for a script to run or train: out_dir's checkpoint (ckpt.pt or a sharded
checkpoint, whichever is newer), a folder in the Hugging Face format (export_hf.py's, or GPT-2 saved by
transformers), GPT-2's weights from the hub, and a trained model a new run starts from. It sits above the
formats and their readers (checkpoint.py, sharded_checkpoint.py, hf_format.py, weights.py), which never
import it; it knows nothing of the command line: what cannot give a model is a one-line ValueError, which the
scripts print (cli.fail).
"""
import contextlib
import dataclasses
import os
import pickle
import socket
import sys
import urllib.parse

from denoised_gpt.checkpoint import CheckpointError, checkpoint_path, read_checkpoint
from denoised_gpt.checkpoint_base import short_reason, untrusted_file_error
from denoised_gpt.extras import INSTALL
from denoised_gpt.finetune import model_from_checkpoint, new_run_model_args
from denoised_gpt.hf_format import MODEL_TYPE, exported_model_type, exported_run, read_exported
from denoised_gpt.weights import all_finite, model_with_weights, nonfinite_weights, refuse_nonfinite_state
from model import ATTENTION_TYPES, GPT, GPTConfig


def trained_dtype(checkpoint):
    """The dtype a checkpoint (load_model's) was trained in, if it names one ('auto' otherwise). prepare_device's
    'auto' runs the model there: a model trained in float32 (config/train_mqar.py) can answer differently in
    bfloat16 (linear attention on recall did)."""
    return ((checkpoint or {}).get('config') or {}).get('dtype', 'auto')


def load_model(init_from, out_dir, noise_at_eval=None, model_overrides=None):
    """(the model to run, in eval mode on the CPU; the checkpoint it came from; where: the checkpoint file or
    folder read, or init_from). init_from: 'resume' (out_dir's newest checkpoint, or a checkpoint file), a GPT-2
    name, or a Hugging Face folder: a denoised_gpt one (export_hf.py) is read like a checkpoint, a GPT-2 one by
    GPT.from_pretrained. The checkpoint is None for GPT-2's weights; for an exported folder, a dict like
    read_checkpoint's with what its training_run.json records (iter_num, best_val_loss, config); for 'resume'
    its config names the dtype it was trained in (trained_dtype). noise_at_eval: None keeps the checkpoint's
    setting; True / False is refused for a model without NoiseFormer noise. model_overrides: model_args replaced
    where the model has that setting (e.g. noise_per_sample for NoiseFormer). ValueError saying why, in one line, when
    init_from gives no model to run."""
    script = os.path.basename(sys.argv[0])
    try:
        own_code = init_from != 'resume' and exported_model_type(init_from) == MODEL_TYPE
        if init_from != 'resume' and not own_code:  # GPT-2's weights: a name, or a folder saved by transformers
            if noise_at_eval is not None:
                raise ValueError("noise_at_eval applies to NoiseFormer models only; GPT-2's weights are base attention")
            run = exported_run(init_from) if os.path.isdir(init_from) else None
            with contextlib.redirect_stdout(sys.stderr):  # from_pretrained prints progress
                model = load_gpt2(init_from, dict(dropout=0.0)).eval()
            run = run and {**run, 'model_args': dataclasses.asdict(model.config)}
            return refuse_nonfinite(model, init_from), run, init_from
        if own_code:
            source, checkpoint = init_from, read_exported(init_from)
        else:  # model_only: the optimizer state is never read
            source, checkpoint = read_checkpoint(out_dir, map_location='cpu', model_only=True)
    except FileNotFoundError as e:
        hint = "" if init_from != 'resume' else (f"\n({script} loads out_dir/ckpt.pt with init_from='resume'; for "
                                                 f"OpenAI's weights use --init_from=gpt2)")
        raise ValueError(f"{e}{hint}") from e
    except CheckpointError as e:
        raise ValueError(str(e)) from e
    model_args = dict(checkpoint['model_args'])
    attn_type = model_args.get('attn_type', 'base')  # nanoGPT checkpoints have no attn_type
    fields = getattr(ATTENTION_TYPES.get(attn_type), 'config_fields', ())
    if noise_at_eval is not None:
        if 'noise_at_eval' not in fields:
            users = ' / '.join(k for k, cls in ATTENTION_TYPES.items() if 'noise_at_eval' in cls.config_fields)
            raise ValueError(f"noise_at_eval applies to NoiseFormer models ({users}) only; {source} is "
                             f"attn_type={attn_type!r}: drop --noise_at_eval")
        model_args['noise_at_eval'] = noise_at_eval
    model_args.update({k: v for k, v in (model_overrides or {}).items() if k in fields})
    try:
        model = model_with_weights(GPTConfig(**model_args), checkpoint['model'])
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"the {'model in' if own_code else 'checkpoint in'} {source} does not build a model: "
                         f"{short_reason(e)}") from e  # (torch's C++ errors add a stack of lines)
    return refuse_nonfinite(model.eval(), source), checkpoint, source


def refuse_nonfinite(model, source):
    """model, unless a weight is NaN or inf (a diverged run's state): every loss and sample from it would be
    NaN, so the script stops: ValueError in one line naming source."""
    if not all_finite(model.parameters()):
        raise ValueError(nonfinite_weights(source))
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


def load_gpt2(name, override_args):
    """GPT.from_pretrained(name, override_args): OpenAI's GPT-2 weights from the Hugging Face hub (or a
    folder saved by transformers); ValueError saying what to do when they cannot be had. When the hub cannot
    be reached the weights come from the local cache only (HF_HUB_OFFLINE=1), at once."""
    offline = os.environ.get('HF_HUB_OFFLINE', '0').lower() not in ('0', 'false', 'no', '')
    if not os.path.isdir(name) and not offline and not hub_reachable():
        os.environ['HF_HUB_OFFLINE'] = '1'  # read when the hub client is imported, which comes later
        if 'huggingface_hub.constants' in sys.modules:  # already imported: tell it directly
            sys.modules['huggingface_hub.constants'].HF_HUB_OFFLINE = True
        offline = True
    try:
        return GPT.from_pretrained(name, override_args)
    except ImportError as e:
        raise ValueError(f"init_from={name!r} needs transformers, which the light install (requirements.txt) "
                         f"leaves out: {INSTALL}") from e
    except OSError as e:  # offline, or a name the hub does not know
        where = "not in the local cache, and the Hugging Face hub is offline or unreachable" if offline else \
            f"could not be fetched from the Hugging Face hub ({str(e).strip().splitlines()[0][:200]})"
        raise ValueError(f"could not fetch the {name!r} weights: {where}. Connect to the network once (they are "
                         f"cached), or pass --init_from=/path/to/a/folder/saved/by/transformers/save_pretrained") from e
    except ValueError as e:  # weights that do not fit the attn_type asked for
        raise ValueError(f"cannot load the {name!r} weights: {e}") from e
    except pickle.UnpicklingError as e:  # weights_only refused what its pytorch_model.bin holds, or it is damaged
        refused = untrusted_file_error(name, e)
        raise ValueError(str(refused) if refused else f"cannot load the {name!r} weights: {short_reason(e)}") from e


def noise_on(model):
    """Whether the model draws NoiseFormer noise when it runs in eval mode (sampling, evaluation)."""
    return bool('noise_at_eval' in ATTENTION_TYPES[model.config.attn_type].config_fields
                and model.config.noise_at_eval)


def is_checkpoint(init_from):
    """A checkpoint file, a directory holding ckpt.pt or a sharded checkpoint, or a folder export_hf.py wrote
    with the model's own code (config.json's model_type 'denoised_gpt'). A GPT-2 folder (saved by transformers,
    or export_hf.py's of a base model) is a GPT-2 model, read by GPT.from_pretrained as before."""
    return os.path.exists(checkpoint_path(init_from)) or exported_model_type(init_from) == MODEL_TYPE


def read_start_checkpoint(init_from):
    """The checkpoint dict (read_checkpoint's) a new run starts from: any of is_checkpoint's kinds."""
    if exported_model_type(init_from) == MODEL_TYPE:
        return read_exported(init_from)
    return read_checkpoint(init_from, map_location='cpu')[1]


def model_for_new_run(init_from, model_args, given):
    """A new run's model from a trained one (any of is_checkpoint's kinds), converted to the attn_type of
    model_args, this run's (finetune.py): the shape is the checkpoint's, given shape settings must agree with
    it. Returns (the model, its model_args). ValueError, FileNotFoundError or CheckpointError."""
    start = read_start_checkpoint(init_from)  # a ckpt.pt, or a folder export_hf.py wrote with model.py's code
    refuse_nonfinite_state(start, init_from, weights_only=True)  # (a new run: a fresh optimizer)
    model_args = new_run_model_args(start['model_args'], model_args, given)
    model, _ = model_from_checkpoint(start, model_args)  # prints the parameters that are new
    return model, model_args
