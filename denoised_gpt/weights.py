"""
A GPT's weights: a GPT built around given tensors on the meta device (model_with_weights, empty_model),
whether tensors are all finite (a diverged run's are not) and the one-line refusal of a state that is not,
and the names peft gives the layers it wraps.
The foundation, beside checkpoint_base.py: it imports nothing from the package (model.py only).
"""
import torch
import torch.distributed as dist

from model import GPT

PEFT_WRAPPER = '.base_layer'  # peft keeps the wrapped Linear under this name: c_attn.base_layer.weight


def model_with_weights(config, state_dict, prepare=None, source=None):
    """GPT(config) holding state_dict, built on the meta device: no random initialisation for the weights
    to overwrite (a second or more at GPT-2 size), and the state_dict's tensors become the parameters
    themselves, not copies. prepare(model), if given, changes the empty model before the weights go in
    (resume: the LoRA adapters and frozen parameters of the run). Raises ValueError, in one line naming
    source (the checkpoint's path) if given, when a tensor is missing, extra, or of another shape than the
    model's (load_state_dict would list each, in lines)."""
    model = empty_model(config, prepare)
    own = model.state_dict()
    what = f"{f'checkpoint {source}' if source else 'the checkpoint'} does not fit its own model_args"
    missing, extra = [k for k in own if k not in state_dict], [k for k in state_dict if k not in own]
    if missing or extra:
        raise ValueError(f"{what}: {_names('it lacks', missing, 'of the model they describe')}"
                         f"{'; ' if missing and extra else ''}{_names('it has', extra, 'the model has no place for')}"
                         f" (written by another version, or edited): load it with the code that wrote it")
    for name, tensor in state_dict.items():
        if tensor.shape != own[name].shape:
            raise ValueError(f"{what}: its {name} has shape {tuple(tensor.shape)}, the model they describe "
                             f"{tuple(own[name].shape)}")
    model.load_state_dict(state_dict, assign=True)  # requires_grad stays the model's (prepare's freezing)
    # assign gives each key its own Parameter: tie lm_head to the token embedding again, as GPT does
    model.lm_head.weight = model.transformer.wte.weight
    return model


def _names(subject, names, predicate, shown=3):
    """'it has 5 tensors the model has no place for (a, b, c, ...)', or '' for no names."""
    if not names:
        return ''
    listed = ', '.join(names[:shown]) + (', ...' if len(names) > shown else '')
    return f"{subject} {len(names)} tensor{'s' if len(names) > 1 else ''} {predicate} ({listed})"


def empty_model(config, prepare=None):
    """GPT(config) on the meta device, its parameters without storage or values (see model_with_weights)."""
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


def all_finite(tensors):
    """Whether every value of the (floating point) tensors is finite, by one fused max-abs over them all
    (torch's foreach norm with ord=inf): a NaN propagates through the max, and unlike a sum or a 2-norm,
    large finite values do not overflow to inf. FSDP shards (DTensors): each rank checks its own and the
    ranks agree through an all-reduce (a collective: every rank must call it)."""
    tensors, sharded = list(tensors), []
    if dist.is_available() and dist.is_initialized():  # (only then can there be shards: no import otherwise)
        from torch.distributed.tensor import DTensor
        sharded = [t for t in tensors if isinstance(t, DTensor)]
        tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    tensors = [t.detach() for t in tensors if t.is_floating_point() and t.numel() > 0]  # (a shard may be empty)
    norm = torch.nn.utils.get_total_norm(tensors, float('inf')) if tensors else torch.zeros(())
    bad = (~torch.isfinite(norm)).float()
    if sharded:
        bad = bad.to(sharded[0].device)
        dist.all_reduce(bad)  # a count: how NaN goes through a MAX reduction is the backend's
    return not bad.item()


def nonfinite_weights(source):
    """The message for a model whose weights are not all finite (all_finite), from `source` (a path)."""
    return (f"{source} holds non-finite weights (NaN or inf), the state of a run that diverged: every loss and "
            f"sample from it would be NaN. Use an earlier checkpoint (ckpt.prev.pt next to it, if finite), or "
            f"train again with a lower learning_rate")


def optimizer_tensors(state):
    """The tensors of an optimizer's per-parameter state (optimizer.state, or a state_dict's 'state'):
    AdamW's moments and step counts."""
    return [t for per_param in state.values() for t in per_param.values() if torch.is_tensor(t)]


def nonfinite_optimizer_state(source):
    """The message for an optimizer state (AdamW's moments) that is not all finite, from `source` (a path)."""
    return (f"{source} holds a non-finite optimizer state (NaN or inf in AdamW's moments): a parameter whose "
            f"second moment is inf never moves again, and a NaN one turns its weights NaN. Resume from an earlier "
            f"checkpoint (ckpt.prev.pt next to it, if finite), or start a new run from these weights with "
            f"--init_from={source} (a fresh optimizer)")


def refuse_nonfinite_state(checkpoint, source, weights_only=False):
    """ValueError in one line naming source when the checkpoint (read_checkpoint's dict) holds a weight or
    (unless weights_only: a tool that drops the optimizer) an optimizer moment that is NaN or inf: every tool
    that reads a state refuses one, so none is written again."""
    if checkpoint.get('model') is not None and not all_finite(checkpoint['model'].values()):
        raise ValueError(nonfinite_weights(source))
    if not weights_only and checkpoint.get('optimizer') and not all_finite(
            optimizer_tensors(checkpoint['optimizer']['state'])):
        raise ValueError(nonfinite_optimizer_state(source))
