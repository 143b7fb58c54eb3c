"""
Widen the query/key heads of a trained `base` checkpoint to qk_head_size = grow_to, without retraining.

$ python3 grow.py --out_dir=out-narrow --grow_to=32 --method=closed_form --batches=8 --out=out-grown
$ python3 train.py --init_from=resume --out_dir=out-grown --max_iters=3000

Methods (the math is in denoised_gpt/growth.py and docs/grow.md):
  closed_form  per layer and head, the least-squares product Z = X^+ B (X^+)^T with
               B = sqrt(d) S - step_size * dL/dS (a descent step on the scores), averaged over the
               sequences of `batches` training batches, then its best rank-grow_to factors (SVD)
  random       the old columns kept, new ones drawn at init scale (N(0, 0.02^2))
  zero         the old columns kept, new ones zero: the model computes the same function
The 1/sqrt(d) -> 1/sqrt(grow_to) change of the score scale is folded into the factors.

The grown checkpoint keeps the iteration counter, the settings and the data sampler's state; it has
no optimizer state, so train.py --init_from=resume continues it with a fresh AdamW (and says so).
grow.py prints the loss on the collection batches before growth, the first-order predicted loss after
it and the measured one, the val loss before and after, and the growth step's time and peak memory;
the same figures go into the checkpoint under 'grow'.
"""

from configurator import answer_help
from denoised_gpt.cpu_threads import wait_passively_if_busy

answer_help(__file__)  # --help before the heavy imports below
wait_passively_if_busy()  # before torch loads OpenMP, which reads its wait policy once

import os
import time

import torch

from denoised_gpt import growth
from denoised_gpt.batches import TokenBatches, load_meta
from denoised_gpt.checkpoint import CheckpointError, read_checkpoint, save_checkpoint
from denoised_gpt.cli import check_ranges, check_writable_folder, fail, read_config
from denoised_gpt.device import manual_seed, resolve_device, setup, synchronize
from denoised_gpt.run_dir import lock_out_dir, peak_memory_mib
from denoised_gpt.weights import refuse_nonfinite_state
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
out_dir = 'out'  # the trained checkpoint's directory (ckpt.pt)
out = ''  # a new directory for the grown checkpoint (never out_dir: the original is kept)
grow_to = 0  # the new qk_head_size, at least the checkpoint's and at most n_embd
method = 'closed_form'  # 'closed_form', 'random' or 'zero' (see above)
layers = 'all'  # 'all' or comma-separated layer indices grown by `method`; the others get zero columns
batches = 8  # training batches the statistics (and the before / after losses) are taken over
batch_size = 0  # sequences per batch (0: the checkpoint's batch_size)
step_size = 1.0  # closed_form: score step per unit of d(sequence's summed token loss) / dS; 0 refits only
pinv_rtol = 1e-2  # closed_form: singular values of X below this fraction of the largest count as zero
collect_dtype = 'float64'  # 'float64' or 'float32': the model's dtype while X, S and dL/dS are collected
eval_iters = 20  # validation batches for the val loss before and after growth
seed = 1337  # seeds the collection / validation batches and the random columns
device = 'auto'  # 'auto' (cuda > hpu > mps > cpu), 'cpu', 'cuda', ...
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]


COLLECT_DTYPES = {'float64': torch.float64, 'float32': torch.float32}


def parse_layers(text, n_layer):
    if text == 'all':
        return list(range(n_layer))
    try:
        chosen = sorted({int(t) for t in str(text).split(',') if t.strip()})
    except ValueError:
        raise ValueError(f"layers={text!r} must be 'all' or comma-separated layer indices, e.g. 0,2")
    if not chosen or chosen[0] < 0 or chosen[-1] >= n_layer:
        raise ValueError(f"layers={text!r} must name layers between 0 and {n_layer - 1}")
    return chosen


def check_request(model_args):
    """The checkpoint and the settings together: ValueError naming the problem and the fix."""
    if model_args.get('attn_type', 'base') != 'base':
        raise ValueError(f"the checkpoint in {out_dir} has attn_type={model_args['attn_type']!r}; grow.py "
                         f"widens `base` attention only")
    if method not in growth.METHODS:
        raise ValueError(f"method={method!r} must be one of {', '.join(growth.METHODS)}")
    old = model_args.get('qk_head_size') or model_args['n_embd'] // model_args['n_head']
    if not old <= grow_to <= model_args['n_embd']:
        raise ValueError(f"grow_to={grow_to} must be between the checkpoint's qk_head_size {old} and n_embd "
                         f"{model_args['n_embd']}, e.g. --grow_to={min(2 * old, model_args['n_embd'])}")
    if not out or os.path.abspath(out) == os.path.abspath(out_dir):
        raise ValueError(f"out={out!r} must name a new directory for the grown checkpoint (not out_dir, "
                         f"whose checkpoint is kept), e.g. --out={out_dir.rstrip('/')}-grown")
    if os.path.exists(os.path.join(out, 'ckpt.pt')):
        raise ValueError(f"{out} already holds a checkpoint; choose another --out or move it away first")
    if collect_dtype not in COLLECT_DTYPES:
        raise ValueError(f"collect_dtype={collect_dtype!r} must be 'float64' or 'float32'")
    if batches < 1 or eval_iters < 1 or batch_size < 0:
        raise ValueError(f"batches={batches} and eval_iters={eval_iters} must be at least 1, "
                         f"batch_size={batch_size} not negative")
    return old


@torch.no_grad()
def mean_loss(model, xy_batches):
    return sum(model(x, y)[1].item() for x, y in xy_batches) / len(xy_batches)


def draw(data, count, key):
    g = torch.Generator().manual_seed(seed * 1000 + key)  # fixed batches: the same before and after
    return [data.get_batch(generator=g) for _ in range(count)]


def main():
    global device
    globals().update(read_config(__file__, {k: globals()[k] for k in config_keys}))
    try:
        path, ckpt = read_checkpoint(out_dir, map_location='cpu')
        refuse_nonfinite_state(ckpt, path, weights_only=True)  # (the optimizer is dropped)
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        fail(e)
    model_args = dict(ckpt['model_args'])
    try:
        check_ranges({k: globals()[k] for k in config_keys}, seeds=('seed',))
        d_old = check_request(model_args)
        chosen = parse_layers(layers, model_args['n_layer'])
        device = resolve_device(device)
    except ValueError as e:
        fail(e)
    check_writable_folder('out', out)  # now, not after the growth
    setup(device)
    manual_seed(seed)
    model = GPT(GPTConfig(**model_args))
    model.load_state_dict(ckpt['model'])
    model.to(device).eval()

    train_config = ckpt['config']
    data_dir = os.path.join('data', train_config.get('dataset', ''))
    try:
        meta = load_meta(data_dir)
        data = {split: TokenBatches(data_dir, split, model_args['block_size'], batch_size or train_config['batch_size'],
                                    device=device, seed=seed, vocab_size=meta['vocab_size'] if meta else None)
                for split in ('train', 'val')}
    except (FileNotFoundError, ValueError, KeyError) as e:
        fail(f"the checkpoint's training data ({data_dir}) cannot be read: {e}")
    train_xy, val_xy = draw(data['train'], batches, 0), draw(data['val'], eval_iters, 1)
    val_before = mean_loss(model, val_xy)

    print(f"growing qk_head_size {d_old} -> {grow_to} by {method} in layers {layers} "
          f"({batches} batches of {train_xy[0][0].shape[0]} x {train_xy[0][0].shape[1]} tokens)")
    synchronize(device)
    t0 = time.perf_counter()
    # X^+ multiplies B by 1/sigma(X)^2: float32 rounding in S (~1e-7) would come back amplified
    stats, loss_before = growth.collect_statistics(model.to(COLLECT_DTYPES[collect_dtype]), train_xy, chosen,
                                                   method, step_size, pinv_rtol)
    model.float()
    t_collect = time.perf_counter() - t0
    generator = torch.Generator().manual_seed(seed)
    state, predicted = growth.grown_state_dict(model.cpu(), grow_to, method, chosen, stats, generator)
    seconds = time.perf_counter() - t0
    memory = peak_memory_mib(device)

    new_args = {**model_args, 'qk_head_size': grow_to}
    grown = GPT(GPTConfig(**new_args))
    grown.load_state_dict(state)
    grown.to(device).eval()
    loss_after = mean_loss(grown, train_xy)
    val_after = mean_loss(grown, val_xy)
    report = dict(method=method, layers=layers, qk_head_size_before=d_old, qk_head_size_after=grow_to,
                  batches=batches, step_size=step_size, loss_before=loss_before,
                  predicted_loss_after=loss_before + predicted, measured_loss_after=loss_after,
                  val_loss_before=val_before, val_loss_after=val_after, seconds=seconds,
                  collect_seconds=t_collect, peak_memory_mib=memory)
    print(f"loss on the collection batches: before {loss_before:.4f}, predicted after (first order) "
          f"{loss_before + predicted:.4f}, measured after {loss_after:.4f}")
    print(f"val loss ({eval_iters} batches): before {val_before:.4f}, after {val_after:.4f}")
    print(f"growth step: {seconds:.2f} s (collecting {t_collect:.2f} s), peak memory {memory:.0f} MiB")

    grown_ckpt = {k: v for k, v in ckpt.items() if k != 'optimizer_param_names'}
    grown_ckpt.update(model={k: v.cpu() for k, v in grown.state_dict().items()}, optimizer=None,
                      model_args=new_args, config={**train_config, 'qk_head_size': grow_to, 'out_dir': out},
                      grow=report)
    try:  # one writer per folder, as train.py's runs
        lock = lock_out_dir(out)
        if os.path.exists(os.path.join(out, 'ckpt.pt')):  # written there since the check at the start
            raise ValueError(f"{out} already holds a checkpoint; choose another --out or move it away first")
        path = save_checkpoint(grown_ckpt, out)
    except (CheckpointError, ValueError) as e:
        fail(e)
    lock.close()
    print(f"wrote {path}; continue it with: python3 train.py --init_from=resume --out_dir={out}")


if __name__ == '__main__':
    main()
