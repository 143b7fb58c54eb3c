"""
Starting a run from a trained model: what train.py's init_from=PATH, trainable and lora_* settings do.
PATH is a checkpoint (ours or nanoGPT's, a file or an out_dir) or a folder export_hf.py wrote.

- Conversion: a `base` checkpoint (ours or nanoGPT's) becomes the start of a run of any attn_type
  whose parameters extend base's (diff, dint, dint_lowrank, linear): GPT.load_base_weights copies
  every base tensor, and what the variant adds (dint_lowrank's low-rank factors, lambda vectors and
  norm) keeps its init. A checkpoint of the run's own attn_type loads as it is. The optimizer, the
  iteration counter and the LR schedule start fresh: this is a new run, not a resume.
- trainable='all' trains everything; 'new' freezes every tensor a base model also has and trains
  only what the variant added; 'lora' wraps the Linear layers named in lora_targets with Hugging
  Face peft's LoRA adapters (lora_B starts at zero, so the model starts as the loaded one) and trains
  the adapters plus what the variant added. Which tensors are trainable follows from these settings
  and the model alone, so a resumed run freezes exactly the same ones (its optimizer holds only those).
- merged_checkpoint: a LoRA run's checkpoint with every adapter merged into its Linear
  (W + B A * alpha / r) and peft's wrappers removed: a plain checkpoint with plain parameter names,
  which sample.py, bench.py and eval.py read like any other.
"""

import os

import torch

from denoised_gpt.checkpoint import read_checkpoint, save_checkpoint
from denoised_gpt.weights import PEFT_WRAPPER, model_with_weights
from model import ATTENTION_TYPES, GPT, GPTConfig

TRAINABLE = ('all', 'new', 'lora')
LORA_KEYS = ('lora_rank', 'lora_alpha', 'lora_dropout', 'lora_targets')
# the model's shape, which a converted model takes from its checkpoint (dropout is the run's own)
SHAPE_KEYS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size')
MERGED_DIR = 'merged'  # --merge_lora writes out_dir/merged/ckpt.pt


def check_finetune_settings(trainable, init_from, given, lora_rank, lora_alpha, lora_dropout, lora_targets):
    """ValueError for fine-tuning settings that cannot work, before anything is loaded."""
    if trainable not in TRAINABLE:
        raise ValueError(f"trainable={trainable!r} must be one of {', '.join(map(repr, TRAINABLE))}")
    if trainable != 'all' and init_from == 'scratch':
        raise ValueError(f"trainable={trainable!r} freezes trained weights, but init_from='scratch' has none: "
                         f"start from a trained model (init_from=PATH to a checkpoint, or gpt2)")
    stray = [k for k in LORA_KEYS if k in given] if trainable != 'lora' else []
    if stray:  # almost always a config mistake, as with variant settings on the wrong attn_type
        raise ValueError(f"{', '.join(stray)} only apply with trainable='lora' (this run has trainable="
                         f"{trainable!r}): remove them or set --trainable=lora")
    if trainable == 'lora':
        if lora_rank < 1 or not lora_alpha > 0 or not 0 <= lora_dropout < 1:
            raise ValueError(f"lora_rank={lora_rank} must be at least 1, lora_alpha={lora_alpha} positive and "
                             f"lora_dropout={lora_dropout} in [0, 1)")
        if not lora_target_list(lora_targets):
            raise ValueError("lora_targets='' names no layer: give Linear names, e.g. 'c_attn,c_proj,c_fc'")


def lora_target_list(lora_targets):
    return [name.strip() for name in lora_targets.split(',') if name.strip()]


# ----------------------------------------------------------------------------------------------
# Conversion

def new_run_model_args(saved_args, run_args, given):
    """model_args for a run that starts from a checkpoint with `saved_args`: the shape is the
    checkpoint's (a shape setting this run gives that differs is an error, not a silent change),
    the attn_type, variant settings and dropout are this run's. block_size may be given smaller
    (train.py crops the model)."""
    conflicts = [f"{k}: checkpoint {saved_args[k]!r}, this run {run_args[k]!r}" for k in SHAPE_KEYS
                 if k in given and k != 'block_size' and saved_args[k] != run_args[k]]
    if conflicts:
        raise ValueError("the checkpoint to start from has a different shape (" + "; ".join(conflicts) +
                         "): leave these settings out to take the checkpoint's")
    return {**run_args, **{k: saved_args[k] for k in SHAPE_KEYS}}


def model_from_checkpoint(ckpt, model_args):
    """A GPT of model_args['attn_type'] holding the weights of checkpoint `ckpt` (read_checkpoint's
    dict): converted from `base` with GPT.load_base_weights, or loaded as it is when the checkpoint
    has the run's attn_type. Returns (model, names of the parameters the checkpoint did not have)."""
    source = ckpt['model_args'].get('attn_type', 'base')  # nanoGPT's checkpoints are base
    target = model_args['attn_type']
    if any(PEFT_WRAPPER + '.' in k for k in ckpt['model']):
        raise ValueError("this checkpoint holds LoRA adapters: merge them first (python3 train.py "
                         "--out_dir=<its out_dir> --merge_lora=True) and start from <out_dir>/merged")
    if source != target and source != 'base':
        raise ValueError(f"the checkpoint's attn_type is {source!r}: only a 'base' checkpoint converts to another "
                         f"attn_type (or start a {source!r} run from it with --attn_type={source})")
    if source != target and ATTENTION_TYPES[target].c_attn_projections != 3:  # base's c_attn computes q, k, v
        raise ValueError(f"attn_type={target!r} has no key projection (its scores are Q Q^T): base's query, key "
                         f"and value weights do not fit it. Convert to one of {', '.join(extends_base())}, or "
                         f"train {target!r} from scratch")
    if source == target:  # every tensor comes from the checkpoint: built empty, nothing initialised to throw away
        return model_with_weights(GPTConfig(**model_args), ckpt['model']), []
    model = GPT(GPTConfig(**model_args))  # the conversion's new parameters keep this initialisation
    return model, model.load_base_weights(ckpt['model'])


def extends_base():
    """The attn_types whose parameters extend base's (what a base checkpoint converts to)."""
    return [name for name, cls in ATTENTION_TYPES.items() if name != 'base' and cls.c_attn_projections == 3]


# ----------------------------------------------------------------------------------------------
# What trains

def new_parameter_names(model):
    """Names of the parameters a `base` model of the same shape lacks (or has with another shape):
    what a conversion adds, e.g. dint_lowrank's factors, lambda vectors and norm. Found by building
    that base model on the meta device (no memory, no init cost), so the rule needs no list per
    variant and gives the same answer on resume as at conversion."""
    base_config = GPTConfig(**{k: getattr(model.config, k) for k in SHAPE_KEYS})
    with torch.device('meta'):
        base_shapes = {n: p.shape for n, p in GPT(base_config).named_parameters()}
    return [n for n, p in model.named_parameters()
            if base_shapes.get(unwrapped_name(n)) != p.shape and not is_lora_name(n)]


def unwrapped_name(name):
    """A parameter's name without peft's wrapper: attn.c_attn.base_layer.weight -> attn.c_attn.weight."""
    return name.replace(PEFT_WRAPPER + '.', '.')


def is_lora_name(name):
    return '.lora_' in name


def add_lora(model, rank, alpha, dropout, targets):
    """Wrap the Linear layers whose names end in one of `targets` (comma-separated) with peft's LoRA,
    in place: the model stays our GPT (peft's inject_adapter_in_model, no PeftModel wrapper), its
    forward unchanged, and at init its output equals the unwrapped model's (lora_B is zero)."""
    from peft import LoraConfig, inject_adapter_in_model  # imported only for LoRA runs (4 s)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=lora_target_list(targets),
                        bias='none')
    return inject_adapter_in_model(config, model)


def apply_trainable(model, trainable, lora_rank=8, lora_alpha=16.0, lora_dropout=0.0, lora_targets=''):
    """Freeze what `trainable` says (and add the LoRA adapters), in place. Returns the model, which is
    the same object. ValueError when nothing would train (e.g. 'new' on a variant that adds nothing)."""
    if trainable == 'all':
        return model
    new = set(new_parameter_names(model))
    if trainable == 'lora':
        try:
            add_lora(model, lora_rank, lora_alpha, lora_dropout, lora_targets)
        except ValueError as e:  # peft: no module matched the targets
            raise ValueError(f"lora_targets={lora_targets!r}: {str(e).splitlines()[0]} (the Linear layers are "
                             f"c_attn, c_proj, c_fc and the variant's own, e.g. q2_down)") from e
    for name, p in model.named_parameters():
        p.requires_grad_(name in new or (trainable == 'lora' and is_lora_name(name)))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"trainable={trainable!r} leaves nothing to train: attn_type={model.config.attn_type!r} "
                         f"adds no parameters to base's; use trainable='all' or 'lora'")
    return model


def trainable_summary(model):
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%)"


# ----------------------------------------------------------------------------------------------
# Merging LoRA adapters into a plain checkpoint

def merge_lora(model):
    """Merge every peft LoRA layer into its Linear (peft's own merge) and put the plain Linear back
    in its place. In place; returns the model, now with the parameter names of an unwrapped one."""
    from peft.tuners.lora import LoraLayer
    wrapped = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    for name, module in wrapped:
        module.merge()
        parent_name, _, child = name.rpartition('.')
        setattr(model.get_submodule(parent_name), child, module.get_base_layer())
    return model


def merged_checkpoint(ckpt):
    """checkpoint dict of a trainable='lora' run -> a plain checkpoint dict: adapters merged, plain
    names, in the checkpoint's own dtype. Its optimizer is None, as grow.py's: Adam's moments of the
    adapters do not fit the merged weights. init_from=<its dir> starts a new run from it; 'resume'
    continues its iteration count and LR schedule with a fresh AdamW."""
    config = ckpt['config']
    if config.get('trainable') != 'lora':
        raise ValueError(f"this checkpoint is of a trainable={config.get('trainable', 'all')!r} run: it has no "
                         f"LoRA adapters to merge, and sample.py / eval.py read it as it is")
    dtype = next(iter(ckpt['model'].values())).dtype
    model = GPT(GPTConfig(**ckpt['model_args'])).to(dtype)
    add_lora(model, config['lora_rank'], config['lora_alpha'], config['lora_dropout'], config['lora_targets'])
    model.load_state_dict(ckpt['model'])
    merge_lora(model)
    resume_only = ('optimizer_param_names', 'rng', 'train_batches', 'scaler')  # a fresh start only
    return {**{k: v for k, v in ckpt.items() if k not in resume_only}, 'model': model.state_dict(),
            'optimizer': None, 'config': {**config, 'trainable': 'all'}}


def write_merged_checkpoint(out_dir):
    """out_dir/ckpt.pt of a LoRA run -> out_dir/merged/ckpt.pt with the adapters merged. Returns the path."""
    path, checkpoint = read_checkpoint(out_dir, map_location='cpu')
    return save_checkpoint(merged_checkpoint(checkpoint), os.path.join(os.path.dirname(path), MERGED_DIR))
