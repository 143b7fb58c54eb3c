"""What train.py decides and prepares around its loop: which settings cannot work, what a resumed run
takes from its checkpoint, when and how its state is saved, the seeds its batches and noise are drawn
from, the compile warm-up and the speed it logs. train.py's own helpers: the top of the package with
cli.py, whose checks they use."""
import dataclasses
import math
import os
import statistics
import time

import numpy as np
import torch

from denoised_gpt.checkpoint import (checkpoint_path, optimizer_param_names, read_checkpoint, restore_rng_state,
                                     restore_training_state, save_checkpoint)
from denoised_gpt.cli import MAX_BATCH_SIZE, MAX_STEPS, check_ranges, duration, setting_text
from denoised_gpt.device import device_type, mark_step
from denoised_gpt.finetune import LORA_KEYS, check_finetune_settings
from denoised_gpt.lr_schedule import check_schedule, get_lr
from denoised_gpt.models import is_checkpoint
from denoised_gpt.run_dir import restart_advice
from denoised_gpt.sharded_checkpoint import (is_sharded_checkpoint, load_sharded_state, model_and_optimizer_state,
                                             save_sharded)
from denoised_gpt.weights import (all_finite, nonfinite_optimizer_state, nonfinite_weights, optimizer_tensors,
                                   refuse_nonfinite_state)
from model import ATTENTION_TYPES, AttentionBase, GPTConfig

# Resuming continues the checkpoint's run: every setting it was trained with (batch size, data,
# schedule, ...) comes from the checkpoint unless given again; the machine-level ones stay this run's.
NOT_RESUMED = ('init_from', 'out_dir', 'eval_only', 'device', 'dtype', 'compile', 'backend', 'merge_lora')
# what trains decides what the optimizer holds: a resumed run keeps the checkpoint's
FIXED_ON_RESUME = ('trainable',) + LORA_KEYS
# model settings that change how the model runs, not what its weights mean (dropout and each variant's
# runtime_fields): a resumed run may change them; the other model settings must match the checkpoint's
RUNTIME_MODEL_ARGS = ('dropout', *dict.fromkeys(f for cls in ATTENTION_TYPES.values() for f in cls.runtime_fields))
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(GPTConfig))
ARCHITECTURE_KEYS = set(MODEL_KEYS) - set(RUNTIME_MODEL_ARGS)
# Far beyond any recipe (GPT-2's: 40 micro-batches of 12 sequences): a larger value is a slip that would run for
# days before the first update, or fail allocating the first batch, so it is refused before any work
MAX_ACCUMULATION = 1 << 20  # gradient_accumulation_steps: micro-batches per iteration, over all ranks
MAX_ITERS = 10 ** 12  # max_iters: past any run (11 days at a step a microsecond), below float's exact integers
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the loss is float32: kl_weight is cast to it
KL_WEIGHT = 5e-6  # train.py's default (the paper's)


def has_kl_term(attn_type):
    """Whether the variant adds a KL term to the loss (its attention class has its own kl_divergence)."""
    attention = ATTENTION_TYPES.get(attn_type)
    return attention is None or attention.kl_divergence is not AttentionBase.kl_divergence  # (unknown: GPTConfig says)


def check_training_settings(config, given):
    """Settings that cannot work (or would silently train nonsense): ValueError before any work."""
    c = config
    check_ranges(c, at_least_one=('eval_interval', 'log_interval', 'eval_iters', 'gradient_accumulation_steps',
                                  'batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'max_skipped_steps'),
                 non_negative=('max_iters', 'grad_clip', 'weight_decay', 'kl_weight', 'warmup_iters',
                               'stop_at_val_loss'),
                 unit_interval=('beta1', 'beta2', 'dropout'), positive=('learning_rate',), seeds=('seed',),
                 at_most={'max_iters': (MAX_ITERS, 'iterations'),
                          'eval_iters': (MAX_STEPS, 'batches per evaluation')})
    if c['gradient_accumulation_steps'] > MAX_ACCUMULATION:
        raise ValueError(f"{setting_text('gradient_accumulation_steps', c['gradient_accumulation_steps'])} is over "
                         f"the limit of {MAX_ACCUMULATION:,} micro-batches per iteration (GPT-2's recipe uses 40): "
                         f"every update would wait for that many forward and backward passes; use fewer, with a "
                         f"larger batch_size")
    if c['batch_size'] > MAX_BATCH_SIZE:
        raise ValueError(f"{setting_text('batch_size', c['batch_size'])} is over the limit of {MAX_BATCH_SIZE:,} "
                         f"sequences per micro-batch (GPT-2's recipe uses 12); use a smaller batch_size, with more "
                         f"gradient_accumulation_steps for the same tokens per iteration")
    if c['kl_weight'] > FLOAT32_MAX:
        raise ValueError(f"kl_weight={c['kl_weight']:g} is past float32's range ({FLOAT32_MAX:.3g}), in which the loss "
                         f"is computed: kl_weight x kl would be inf (or NaN where kl is 0); use a smaller kl_weight")
    if c['kl_weight'] != KL_WEIGHT and not has_kl_term(c['attn_type']):  # (the configs give every variant 5e-6)
        raise ValueError(f"kl_weight={c['kl_weight']:g} weighs the KL term of NoiseFormer's noise, which "
                         f"attn_type={c['attn_type']!r} does not have: leave kl_weight at {KL_WEIGHT:g}, or train a "
                         f"noiseformer attn_type")
    if c['decay_lr']:
        check_schedule(c['learning_rate'], c['warmup_iters'], c['lr_decay_iters'], c['min_lr'])
    if not c['out_dir'].strip():
        raise ValueError("out_dir='' is empty: name a directory for the checkpoints, e.g. --out_dir=out")
    if c['nonfinite'] not in ('stop', 'skip'):
        raise ValueError(f"nonfinite={c['nonfinite']!r} must be 'stop' or 'skip'")
    init_from = c['init_from']
    if init_from not in ('scratch', 'resume') and not init_from.startswith('gpt2') and not os.path.isdir(init_from) \
            and not is_checkpoint(init_from):
        raise ValueError(f"init_from={init_from!r} must be 'scratch', 'resume', a GPT-2 model name (gpt2, "
                         f"gpt2-medium, gpt2-large, gpt2-xl), a checkpoint file or out_dir to start from, "
                         f"or a folder in the Hugging Face format (export_hf.py's, or saved by transformers)")
    check_finetune_settings(c['trainable'], init_from, given, *(c[k] for k in LORA_KEYS))
    GPTConfig(**{k: c[k] for k in MODEL_KEYS if k in c})  # attn_type, head counts, variant settings
    if is_checkpoint(init_from) and os.path.isdir(c['out_dir']) and \
            os.path.samefile(os.path.dirname(checkpoint_path(init_from)) or '.', c['out_dir']):
        # the new run's first save would replace the checkpoint it starts from
        raise ValueError(f"init_from={init_from!r} is in out_dir={c['out_dir']!r}: a new run writes its own "
                         f"checkpoints there; choose another --out_dir (or --init_from=resume to continue that run)")


def resumed_config(saved_config, config, given, out_dir):
    """The settings of a resumed run: the checkpoint's, except the machine-level ones and those given
    again. Returns (config, lines naming the given settings that differ from the checkpoint's).
    ValueError when a given setting cannot change on resume (what trains: the optimizer holds it)."""
    saved = {k: v for k, v in saved_config.items() if k in config and k not in NOT_RESUMED}
    differ = lambda k: k in saved and saved[k] != config[k]  # noqa: E731
    line = lambda k: f"  {k}: checkpoint {saved[k]!r}, this run {config[k]!r}"  # noqa: E731
    fixed = [line(k) for k in FIXED_ON_RESUME if k in given and differ(k)]
    if fixed:
        raise ValueError("init_from='resume' continues the checkpoint's run, whose optimizer holds what it "
                         "trained; these settings cannot change:\n" + "\n".join(fixed) +
                         f"\nStart a new run from it instead: --init_from={out_dir} --out_dir=<a new directory>")
    changes = [line(k) for k in sorted(given) if differ(k) and k not in ARCHITECTURE_KEYS]
    return {**config, **{k: v for k, v in saved.items() if k not in given}}, changes


def resumed_model_args(saved_model_args, model_args, given, meta_vocab_size, dataset, out_dir):
    """The model of a resumed run is the checkpoint's. A model setting this run gives that disagrees
    with it is a mistake to report (a wrong config or out_dir), not something to silently ignore:
    ValueError. Only RUNTIME_MODEL_ARGS are taken from this run."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    saved = {**defaults, **saved_model_args}  # nanoGPT checkpoints lack the variant keys
    changed = [f"  {k}: checkpoint {saved[k]!r}, this run {model_args[k]!r}" for k in model_args
               if k in given and k not in RUNTIME_MODEL_ARGS and saved[k] != model_args[k]]
    if meta_vocab_size is not None and meta_vocab_size > saved['vocab_size']:
        changed.append(f"  vocab_size: checkpoint {saved['vocab_size']}, dataset {dataset!r} has {meta_vocab_size}")
    if changed:
        raise ValueError(f"init_from='resume': the checkpoint in {out_dir} has a different model:\n" +
                         "\n".join(changed) + "\nPass the config it was trained with (saved in the "
                         "checkpoint's 'config'), leave these settings out to take the checkpoint's, or start "
                         "a new out_dir.")
    return {**saved, **{k: model_args[k] for k in RUNTIME_MODEL_ARGS}}


def load_resumed(out_dir, config, given, distributed):
    """What init_from='resume' continues: out_dir's newest checkpoint (ckpt.pt or a sharded checkpoint's
    folder, the newer) and the run's settings (resumed_config's). Returns (checkpoint, config, lines naming
    the given settings that differ, the checkpoint's path, sharded). sharded: an fsdp run under torchrun
    (distributed) reads its shards of a sharded checkpoint itself once its model is sharded
    (resume_training_state): its checkpoint holds no tensors, only the metadata. ValueError,
    FileNotFoundError or CheckpointError when there is nothing to resume from."""
    if not out_dir:
        raise ValueError("out_dir='' is empty: name the directory that holds ckpt.pt")
    path = checkpoint_path(out_dir)
    checkpoint = read_checkpoint(path, map_location='cpu', metadata_only=is_sharded_checkpoint(path))[1]
    config, changes = resumed_config(checkpoint['config'], config, given, out_dir)
    if config['max_iters'] < checkpoint['iter_num'] and not config['eval_only']:
        setting = f"max_iters={config['max_iters']}" + ('' if 'max_iters' in given else " (the checkpoint's)")
        raise ValueError(f"{setting} is below the iteration of the checkpoint in {out_dir} "
                         f"({checkpoint['iter_num']}): nothing to train. Give --max_iters above "
                         f"{checkpoint['iter_num']} to continue its run (--eval_only=True evaluates it)")
    sharded = checkpoint['model'] is None and config['parallel'] == 'fsdp' and distributed
    if checkpoint['model'] is None and not sharded:  # one process or DDP: the whole tensors
        checkpoint = read_checkpoint(path, map_location='cpu')[1]
    refuse_nonfinite_state(checkpoint, path)  # every step from it would be skipped, stop, or not move
    return checkpoint, config, changes, path, sharded


def resume_training_state(checkpoint, path, model, optimizer, scaler, train_batches, device, sharded):
    """A resumed run's state besides the weights in `model`: the optimizer's, the GradScaler's, the RNGs' and
    the training batches' (restore_training_state). sharded (load_resumed's): every rank reads its part of the
    sharded checkpoint at path, weights and AdamW state, however many ranks wrote it. Returns a note for the
    user, or None. CheckpointError when the state does not fit, ValueError for non-finite weights."""
    if sharded:
        load_sharded_state(path, model, optimizer)
    note = restore_training_state(checkpoint, model, optimizer, scaler, train_batches, device_type(device),
                                  optimizer_loaded=sharded)
    if sharded:  # (the whole files were checked when read)
        if not all_finite(model.parameters()):
            raise ValueError(nonfinite_weights(path))
        if not all_finite(optimizer_tensors(optimizer.state)):
            raise ValueError(nonfinite_optimizer_state(path))
    return note


def save_training_state(model, optimizer, state, out_dir, sharded, writer):
    """state (the counters, settings, RNG and sampler states train.py keeps) with `model`'s weights and
    `optimizer`'s state, saved in out_dir: as a sharded checkpoint when sharded (a collective: every rank
    writes its shards, writer is rank 0), else as ckpt.pt with the optimizer's parameter names. Returns the
    path written. CheckpointError when the write fails (the files already there are intact)."""
    if sharded:
        return save_sharded(*model_and_optimizer_state(model, optimizer), state, out_dir, writer=writer)
    return save_checkpoint({'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                            'optimizer_param_names': optimizer_param_names(model, optimizer), **state}, out_dir)


@dataclasses.dataclass
class RunState:
    """What train.py's loop carries from one iteration to the next: the run's counters, its best evaluation, the
    state on disk and the current state's (its evaluation, whether it may be saved), and whether the run stops."""
    iter_num: int = 0
    best_val_loss: float = 1e9
    best_iter: int = None  # the iteration best_val_loss was measured at (None: not known, or none yet)
    train_time: float = 0.0  # seconds spent training (not evaluating), over every process that resumed this run
    saved_iter: int = None  # the iteration of the checkpoint on disk (a finite state; None: none yet)
    saved_val_loss: float = None  # that state's val loss (None: not evaluated, or not known)
    # a stop at (or during) an evaluation saved the state unevaluated: the resumed run evaluates it first, as the
    # uninterrupted run did (checkpoints of earlier versions record no val_loss at all: not owed)
    evaluation_owed: bool = False
    local_iter_num: int = 0  # iterations taken by this process
    val_loss: float = None  # the current state's evaluation (kept when a stop drops the step after it)
    improved: bool = False
    unsaveable: str = None  # why the current state must not be saved: its evaluation or last step was non-finite
    refusal: str = None  # why the last state the loop meant to save was not
    stopping: bool = False
    target_reached: bool = False  # stop_at_val_loss reached
    skipped_in_a_row: int = 0  # non-finite steps skipped in a row

    @classmethod
    def resumed(cls, checkpoint, eval_interval):
        """The state a resumed run starts from: the checkpoint's counters, and that checkpoint on disk."""
        best_val_loss, best_iter = checkpoint['best_val_loss'], checkpoint.get('best_iter')  # (older: no best_iter)
        if not math.isfinite(best_val_loss):  # a NaN best beats nothing (x < nan is False): no best yet
            best_val_loss, best_iter = 1e9, None
        iter_num, val_loss = checkpoint['iter_num'], checkpoint.get('val_loss')
        return cls(iter_num, best_val_loss, best_iter, checkpoint.get('train_time', 0.0), saved_iter=iter_num,
                   saved_val_loss=val_loss,
                   evaluation_owed='val_loss' in checkpoint and val_loss is None and iter_num % eval_interval == 0)

    def evaluates(self, done, eval_interval, eval_only):
        """Whether this iteration evaluates: every eval_interval and at the end, but not while stopping, and not the
        state on disk (a resumed run evaluates only after training further) unless its evaluation is owed."""
        owed, self.evaluation_owed = self.evaluation_owed, False
        return not self.stopping and (self.iter_num % eval_interval == 0 or done) and (
            self.iter_num != self.saved_iter or eval_only or owed)

    def record_evaluation(self, losses, stop_at_val_loss, eval_only):
        """This state's evaluation ({'train': mean loss, 'val': ...}, all-reduced: the same on every rank): its val
        loss, the best one, whether it may be saved, and whether it reaches stop_at_val_loss."""
        self.val_loss = losses['val']
        finite = math.isfinite(losses['train']) and math.isfinite(self.val_loss)
        if not finite:
            self.unsaveable = f"its evaluation is not finite (train loss {losses['train']}, val loss {self.val_loss})"
        self.improved = finite and self.val_loss < self.best_val_loss
        if self.improved:
            self.best_val_loss, self.best_iter = self.val_loss, self.iter_num
        if finite and stop_at_val_loss and self.val_loss <= stop_at_val_loss and not eval_only:
            self.target_reached = True

    def record_save(self, refusal):
        """save()'s answer for the current state: None (saved, now the state on disk) or why it was not."""
        self.refusal = refusal
        if refusal is None:
            self.saved_iter, self.saved_val_loss = self.iter_num, self.val_loss

    def skip_nonfinite_step(self, ce_mean, kl_mean, kl_weight, nonfinite, max_skipped_steps, out_dir, settings):
        """A step with a non-finite loss or gradient on some rank: the line to stop the run with (nonfinite='stop',
        or max_skipped_steps such steps in a row), or None, its update skipped and the state marked unsaveable."""
        cause, advice = divergence_cause(ce_mean, kl_mean, kl_weight, self.local_iter_num == 0, out_dir,
                                         self.saved_iter, settings)
        if nonfinite == 'stop':
            return (f"stopping at iter {self.iter_num}: non-finite loss or gradient{cause} (nonfinite='stop'). "
                    f"{advice}, or set --nonfinite=skip to skip such steps.")
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= max_skipped_steps:
            return (f"stopping at iter {self.iter_num}: {self.skipped_in_a_row} steps in a row had a non-finite loss "
                    f"or gradient (max_skipped_steps={max_skipped_steps}): the run has diverged{cause}. {advice}.")
        self.unsaveable = f"its last step (iter {self.iter_num}) had a non-finite loss or gradient"
        return None

    def next_iteration(self, finite_step, stop_requested):
        """After the update (or its skip): a new state, not evaluated yet."""
        if finite_step:
            self.skipped_in_a_row, self.unsaveable = 0, None
        self.iter_num += 1
        self.local_iter_num += 1
        self.val_loss, self.improved = None, False
        self.stopping = self.stopping or stop_requested


def clip_gradients(model, grad_clip, sharded):
    """The gradients' total norm, clipped to grad_clip (0: only measured, for the non-finite check and the log);
    under FSDP (sharded) the norm over every rank's shards, the same on every rank."""
    if grad_clip != 0.0:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return grad_norm.full_tensor() if sharded else grad_norm


def agree_on_step(loss_sum, ce_sum, kl, grad_norm, scaler_enabled, stop_requested, micro_steps, world_size):
    """What every rank must agree on after the backward, in one all-reduce (world_size > 1): the logged means of the
    loss, cross-entropy and KL over the micro-batches and ranks, how many ranks saw a non-finite loss or gradient,
    and how many were asked to stop. Under fp16 (scaler_enabled) an inf grad norm is the GradScaler's business (it
    skips the step), not an error. Returns (loss, ce, kl, ranks not finite, ranks stopping, this rank not finite)."""
    bad_here = ~torch.isfinite(loss_sum) if scaler_enabled else ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
    stats = torch.stack([loss_sum, ce_sum, kl.detach().float(), bad_here.float(),
                         torch.tensor(float(stop_requested), device=loss_sum.device)])
    if world_size > 1:
        torch.distributed.all_reduce(stats)
    loss_mean, ce_mean, kl_mean, n_bad, n_stop = stats.tolist()
    return (loss_mean / (micro_steps * world_size), ce_mean / (micro_steps * world_size), kl_mean / world_size,
            n_bad, n_stop, bool(bad_here))


def checkpoint_reason(iter_num, val_loss, improved, done, stop, saved_iter, always_save_checkpoint, out_dir):
    """The one rule for writing a checkpoint, asked once per iteration on rank 0 after the evaluation
    (val_loss: None when there was none): the reason to save now, or None. stop: why the run is stopping
    (a signal's name), None while it is not. saved_iter: the iteration of the checkpoint on disk. A stop
    always saves, to resume from; an evaluation after iter 0 saves if the val loss improved or
    always_save_checkpoint; the end of training saves the last state if always_save_checkpoint (else the
    checkpoint stays the best), and always when the run would otherwise leave no checkpoint at all."""
    if iter_num == saved_iter:
        return None
    if stop:
        return stop
    if val_loss is not None and iter_num > 0 and (improved or always_save_checkpoint):
        return f"val loss {val_loss:.4f}"
    if done and (always_save_checkpoint or not os.path.exists(checkpoint_path(out_dir))):
        return "end of training"
    return None


def nonfinite_state(model, optimizer):
    """Why the state must not be saved (it would be resumed from, sampled, and become the fallback): its weights or
    AdamW's moments are not all finite; None when they are."""
    if not all_finite(model.parameters()):
        return "its weights are not all finite"
    if not all_finite(optimizer_tensors(optimizer.state)):
        return "its optimizer state (AdamW's moments) is not all finite"
    return None


def abandon_step(optimizer, step_rng, device, message):
    """A stop between the micro-batches of a step drops the step (however many micro-batches it has, a
    preemption's grace period is short): its gradients go, and the RNGs return to where the step began (step_rng,
    capture_rng_state's then), so the state saved is the last finished step's as it stood, and a run resumed
    from it continues exactly. message: the line to print, or a false value."""
    optimizer.zero_grad(set_to_none=True)
    restore_rng_state(step_rng, device_type(device))
    if message:
        print(message)


def schedule_note(max_iters, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """A note when the run ends before the decaying schedule does (in the warmup, or before lr_decay_iters),
    with the rate it reaches; None when the schedule runs its course."""
    reached = get_lr(max_iters, learning_rate, warmup_iters, lr_decay_iters, min_lr)
    if max_iters < warmup_iters:
        return (f"note: max_iters={max_iters} ends during the warmup (warmup_iters={warmup_iters}): the learning "
                f"rate only reaches {reached:.3g} of learning_rate={learning_rate:g}; for a short run give "
                f"--warmup_iters={max_iters // 10} and --lr_decay_iters={max_iters}")
    if max_iters < lr_decay_iters:
        return (f"note: max_iters={max_iters} ends before lr_decay_iters={lr_decay_iters}: the learning rate decays "
                f"only to {reached:.3g} (min_lr={min_lr:g}); pass --lr_decay_iters={max_iters} to decay over this run")
    return None


# model settings that shape the first forward: one off its default is named when that forward is not finite
FIRST_FORWARD_SETTINGS = ('noise_init_std', 'lowrank_score_divisor', 'qk_head_size')


def divergence_cause(ce_mean, kl_mean, kl_weight, first_step, out_dir, saved_iter, settings=None):
    """(cause, advice) for a non-finite loss or gradient, naming the setting that made it where that can be
    told (a kl_weight past float32's range is refused before the run, check_training_settings): a KL term that
    swamps the cross-entropy is kl_weight's doing. With settings (the run's, its model's among them): a
    learning_rate x weight_decay of 1 or more, at a learning rate below 1, is weight_decay's (AdamW multiplies
    each decayed weight by 1 - their product every step; a tuning sweep may try such values, so they are not
    refused); a first forward
    that is not finite, before any update, is no step size's: the FIRST_FORWARD_SETTINGS off their defaults
    are named, or without one, the model's settings and the data's labels. Else the learning rate. advice
    names the checkpoint to resume from (restart_advice)."""
    settings = settings or {}
    kl_term = kl_weight * kl_mean
    if math.isfinite(ce_mean) and math.isfinite(kl_mean) and not kl_term < 1e3 * ce_mean:
        return (f" (the KL term, kl_weight x kl = {kl_term:.3g}, swamps the cross-entropy, {ce_mean:.4g})",
                restart_advice(out_dir, saved_iter, 'kl_weight'))
    decay = settings.get('learning_rate', 0) * settings.get('weight_decay', 0)
    if decay >= 1 and settings['learning_rate'] < 1:  # (a learning rate of 1 or more is the cause itself, below)
        return (f" (learning_rate x weight_decay = {decay:.3g}: AdamW multiplies each decayed weight by "
                f"1 - {decay:.3g} = {1 - decay:.3g} every step, where it needs a factor between 0 and 1)",
                restart_advice(out_dir, saved_iter, 'weight_decay'))
    if first_step and not math.isfinite(ce_mean):
        defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
        changed = [k for k in FIRST_FORWARD_SETTINGS if k in settings and settings[k] != defaults[k]]
        if changed:
            given = ', '.join(f"{k}={settings[k]:g} (default {defaults[k]})" for k in changed)
            return (f" in the first forward, before any update, so not from the learning rate: {given} "
                    f"make{'s' if len(changed) == 1 else ''} it", f"Start again with {' and '.join(changed)} nearer "
                    f"the default")
        return (" in the first forward, before any update, so not from the learning rate: a setting that shapes the "
                "model (e.g. noise_init_std, lowrank_score_divisor, qk_head_size) or batches without a target make it",
                "Change that setting, or check the data's labels, and start again")
    return "", restart_advice(out_dir, saved_iter, 'learning_rate')


def batch_seed(seed, *key):
    """A 63-bit seed that depends only on (seed, *key): micro-batch m of iteration it is (seed, 0, it, m),
    evaluation batch j of a split is (seed, 2, split, j)."""
    return int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def compile_training_step(model, batch_size, block_size, device, ctx):
    """torch.compile is lazy: compile the training step now, on a batch of zeros, so that the cold compile
    time is said and not charged to iter 0. Nothing carries over: the gradients are dropped and every
    step re-seeds the RNG. Returns the seconds it took. (Not under DDP: there the first step compiles
    inside DDP, which splits the graph at its gradient buckets.)"""
    t0 = time.time()
    inputs, targets = (torch.zeros(batch_size, block_size, dtype=torch.long, device=device) for _ in range(2))
    with ctx:  # two tensors, as in training: the same one twice compiles a graph that training never uses
        _, ce = model(inputs, targets, return_logits=False)
    ce.backward()
    mark_step()
    model.zero_grad(set_to_none=True)
    return time.time() - t0


class StepSpeed:
    """What the log line says about speed. MFU (GPT.estimate_mfu against the device's peak FLOP/s) is shown once
    it rests on settled steps: the median of the first MFU_START measurements, so one slow step (a cold
    cache, another process) does not set it, then a moving average. Not on a CPU: its peak is a measurement
    that moves with the machine's load (one run read 10 % then 54 %), so the line shows ms and tokens/s only;
    there, a note once when step times swing: torch's OpenMP threads spin-wait for each other, so another busy
    process slows every step."""
    MFU_START = 5
    SETTLED_AFTER = 5  # steps of this process before the step time counts (train.py's `settled`)
    SWING = 3.0  # a step this many times the median of the recent ones counts as slowed down
    LEFT_WINDOW = 5  # the time left is at the median of this many recent steps: one slow step does not move it

    def __init__(self, model, fwdbwd_per_iter, peak_flops):
        """peak_flops: the device's peak FLOP/s (device.peak_flops), None on a CPU."""
        self.model, self.fwdbwd_per_iter, self.peak_flops = model, fwdbwd_per_iter, peak_flops
        self.on_cpu = peak_flops is None
        self.first, self.mfu, self.recent, self.warned = [], None, [], False
        self.eval_seconds = 0.0  # the last evaluation's time: each one still to come is counted at it

    def time_left(self, steps_done, max_iters, eval_interval, evaluated=False):
        """'12% done, 3m05s left': the steps still to take at the median of the last LEFT_WINDOW settled ones (so
        it follows the machine's load), and the evaluations still to come (at each multiple of eval_interval and at
        max_iters; evaluated: the one at steps_done is done) at the last one's time; '' before a settled step."""
        if not self.recent:
            return ''
        first = steps_done + evaluated  # the first iteration whose evaluation is still to come
        evaluations = (max_iters // eval_interval - (first - 1) // eval_interval + bool(max_iters % eval_interval)
                       if first <= max_iters else 0)
        step = statistics.median(self.recent[-self.LEFT_WINDOW:])
        seconds = max(0, max_iters - steps_done) * step + evaluations * self.eval_seconds
        return f"{100 * steps_done // max(max_iters, 1)}% done, {duration(seconds)} left"

    def update(self, dt, settled):
        """Record a step of dt seconds; returns the MFU to show (None until it is measured)."""
        if not settled:
            return self.mfu
        if self.peak_flops is not None:
            mfu = self.model.estimate_mfu(self.fwdbwd_per_iter, dt, self.peak_flops)
            if self.mfu is not None:
                self.mfu = 0.9 * self.mfu + 0.1 * mfu
            else:
                self.first.append(mfu)
                self.mfu = statistics.median(self.first) if len(self.first) == self.MFU_START else None
        self.recent = (self.recent + [dt])[-20:]
        note = self.swing_note()
        if note:
            print(note)
        return self.mfu

    def swing_note(self):
        if not self.on_cpu or self.warned or len(self.recent) < 10:
            return None
        typical = statistics.median(self.recent)
        slow = [t for t in self.recent if t > self.SWING * typical]
        if len(slow) < 2:
            return None
        self.warned = True
        note = (f"note: step times swing from {typical * 1000:.0f} ms to {max(slow) * 1000:.0f} ms: other processes "
                f"are competing for the CPU cores")
        if torch.get_num_threads() == 1 or os.environ.get('OMP_WAIT_POLICY', '').upper() == 'PASSIVE':
            return note  # no thread spins waiting for another: nothing to change here
        return (f"{note}, and torch's {torch.get_num_threads()} threads spin while they wait for each other; started "
                f"with OMP_WAIT_POLICY=PASSIVE, they sleep instead (docs/troubleshooting.md)")

