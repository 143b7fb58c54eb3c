"""
This training script runs on a single device (CUDA GPU, Intel Gaudi, Apple MPS or CPU) or with
distributed data parallel (DDP) over many.

On one device:
$ python train.py config/train_shakespeare_char.py --max_iters=2000

With DDP on 8 devices of one node (the paper recipe):
$ torchrun --standalone --nproc_per_node=8 train.py config/noiseformer_v2.py
With FSDP2 instead (weights, gradients and AdamW state sharded over the ranks, for models whose
training state does not fit one device): the same command with --parallel=fsdp.

Across 2 nodes (8 devices each): on the first (master) node, with IP address 10.0.0.1:
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=1234 train.py
and on the worker node the same with --node_rank=1.
(If your cluster does not have an Infiniband interconnect, prepend NCCL_IB_DISABLE=1.)

Data order and randomness: micro-batch m of iteration it (m counts the iteration's
gradient_accumulation_steps micro-batches over all ranks) is drawn by a generator seeded from
(seed, it, m), and the model's own randomness (NoiseFormer's noise, dropout) is re-seeded from the
same numbers before its forward pass. Rank r of W does micro-batches r, W + r, 2W + r, ..., so the
W ranks together do exactly what one process does with the same gradient_accumulation_steps (the
total over all ranks, as in nanoGPT), and a resumed run continues exactly where the checkpoint
left off (same device type and world size, so that the arithmetic is the same too).
Evaluation uses a fixed set of eval_iters batches per split (seeded the same way), shared out
over the ranks, so val losses compare across evals, runs and attention variants.
"""

from configurator import answer_help, variant_settings
from denoised_gpt.cli import check_before_torch
from denoised_gpt.cpu_threads import wait_passively_if_busy

answer_help(__file__)  # --help before the heavy imports below
wait_passively_if_busy()  # before torch loads OpenMP, which reads its wait policy once
check_before_torch(__file__)  # a mistyped key, attn_type or dataset: said at once, not after torch's import

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from denoised_gpt.batches import TokenBatches, TokenIdError, load_meta
from denoised_gpt.checkpoint import CheckpointError, capture_rng_state, checkpoint_path
from denoised_gpt.cli import fail, read_config, refused_allocation
from denoised_gpt.extras import require as require_extra
from denoised_gpt.files import check_token_files
from denoised_gpt.device import (autocast_context, compile_model, ddp_backend, ddp_device_ids, device_type,
                                 fused_optimizer, grad_scaler, manual_seed, mark_step, peak_flops, resolve_compile,
                                 resolve_device, resolve_dtype, setup)
from denoised_gpt.finetune import apply_trainable, trainable_summary, write_merged_checkpoint
from denoised_gpt.lr_schedule import get_lr
from denoised_gpt.models import is_checkpoint, load_gpt2, model_for_new_run
from denoised_gpt.parallel import (broadcast_from_rank0, check_parallel, learned_values, shard_model,
                                   shard_optimizer_state, sharded_kl)
from denoised_gpt.run_dir import (StopRequest, checkpoint_note, log_row, next_step, peak_memory_mib, prepare_out_dir,
                                  restart_advice, start_wandb, stop_diverged, wandb_learned_values)
from denoised_gpt.training import (MODEL_KEYS, RunState, StepSpeed, abandon_step, agree_on_step, batch_seed,
                                   check_training_settings, checkpoint_reason, clip_gradients, compile_training_step,
                                   load_resumed, nonfinite_state, resume_training_state, resumed_model_args,
                                   save_training_state, schedule_note)
from denoised_gpt.weights import empty_model, model_with_weights
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
# default config values designed to train a gpt2 (124M) on OpenWebText
# I/O
out_dir = 'out'  # where ckpt.pt (and ckpt.prev.pt) are written and resumed from (fsdp runs: sharded checkpoints)
eval_interval = 2000  # evaluate (and checkpoint) every this many iterations
log_interval = 1  # print the training loss every this many iterations
eval_iters = 200  # batches per split in each evaluation (the same batches every time)
eval_only = False  # if True, script exits right after the first eval
always_save_checkpoint = True  # if True, always save a checkpoint after each eval
stop_at_val_loss = 0.0  # end training at the first eval whose val loss is at or below this (0: train to max_iters)
eval_answers_only = False  # needle data with its text labelled: evaluate on the answers alone (stop_at_val_loss too)
init_from = 'scratch'  # 'scratch', 'resume' (from out_dir/ckpt.pt), 'gpt2*', or a trained model to start a new run from: a checkpoint (file or out_dir, ours or nanoGPT's) or a folder export_hf.py wrote
overwrite = False  # scratch run into an out_dir holding a checkpoint: False keeps that one aside, True deletes it
# starting from a trained model (init_from=a checkpoint or gpt2*): see finetune.py and docs/finetune.md
trainable = 'all'  # 'all', 'new' (only what attn_type adds to base's weights) or 'lora' (adapters + what attn_type adds)
lora_rank = 8  # trainable='lora': rank r of each adapter
lora_alpha = 16.0  # trainable='lora': the adapter's update B A is scaled by lora_alpha / lora_rank
lora_dropout = 0.0  # trainable='lora': dropout on the adapters' input
lora_targets = 'c_attn,c_proj,c_fc'  # trainable='lora': the Linear layers to adapt, comma-separated
merge_lora = False  # export step: merge out_dir's LoRA adapters into out_dir/merged/ckpt.pt (a plain checkpoint) and exit
# wandb logging
wandb_log = False  # log to wandb (offline, into out_dir/wandb, when not logged in)
wandb_project = 'owt'  # wandb project name
wandb_run_name = 'gpt2'  # wandb run name
# data
dataset = 'openwebtext'  # a folder under data/, or an absolute path to one
gradient_accumulation_steps = 5 * 8  # micro-batches per iteration, summed over all ranks
batch_size = 12  # micro-batch size (sequences per rank per micro-step)
block_size = 1024  # context length in tokens
# model
n_layer = 12  # transformer blocks
n_head = 12  # attention heads per block
n_embd = 768  # model width
dropout = 0.0  # for pretraining 0 is good, for finetuning try 0.1+
bias = False  # do we use bias inside LayerNorm and Linear layers?
attn_type = 'base'  # the attention variant: a key of model.py's ATTENTION_TYPES (README: the table)
globals().update(variant_settings())  # each variant's own settings: model.py's GPTConfig fields, defaults, meanings
kl_weight = 5e-6  # loss = cross-entropy + kl_weight * KL(noise || N(0, 1)); KL is 0 without noise
# adamw optimizer
learning_rate = 6e-4  # max learning rate
max_iters = 600000  # total number of training iterations
weight_decay = 1e-1  # AdamW weight decay of matrices (never of norms, biases, noise, lambdas)
beta1 = 0.9  # AdamW beta1, in [0, 1)
beta2 = 0.95  # AdamW beta2, in [0, 1)
grad_clip = 1.0  # clip gradients at this value, or disable if == 0.0
nonfinite = 'stop'  # non-finite loss or grad norm: 'stop' (exit 3) or 'skip' the step
max_skipped_steps = 10  # nonfinite='skip': stop (exit 3) after this many skipped steps in a row
# learning rate decay settings
decay_lr = True  # whether to decay the learning rate
warmup_iters = 2000  # how many steps to warm up for
lr_decay_iters = 600000  # should be ~= max_iters per Chinchilla
min_lr = 6e-5  # minimum learning rate, should be ~= learning_rate/10 per Chinchilla
# system
device = 'auto'  # 'auto' (cuda > hpu > mps > cpu), 'cuda', 'cuda:1', 'hpu', 'mps', 'cpu'
dtype = 'auto'  # 'auto', 'float32', 'bfloat16' or 'float16' (float16 only on CUDA, with a GradScaler)
compile = 'auto'  # torch.compile: True, False or 'auto' (on where it measured faster: CUDA, Gaudi eager mode)
backend = 'auto'  # DDP backend: 'auto' follows the device (nccl / hccl / gloo)
parallel = 'ddp'  # under torchrun: 'ddp' (every rank holds the whole model) or 'fsdp' (FSDP2: weights, gradients and AdamW state sharded over the ranks)
seed = 1337  # initial weights, data order and noise all follow from it (a non-negative int)
activation_checkpointing = False  # recompute each block's forward in the backward: far less activation memory for ~1/3 more compute (bench.py --plan=True)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))]
given = set()  # the keys a config file or --key=value set (even to the default's value)
config = read_config(__file__, {k: globals()[k] for k in config_keys}, given)
globals().update(config)  # config is also useful for logging and checkpoints
# -----------------------------------------------------------------------------

checkpoint = None
resume_changes = []  # given settings that differ from the resumed checkpoint's
sharded_resume = False  # an fsdp run resuming from a sharded checkpoint: each rank reads its shards, later
if init_from == 'resume':  # every setting the run was trained with comes from its checkpoint unless given
    try:  # resume_from: ckpt.pt, or a sharded checkpoint's folder (the newer)
        checkpoint, config, resume_changes, resume_from, sharded_resume = load_resumed(out_dir, config, given,
                                                                                        'RANK' in os.environ)
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        fail(e)
    globals().update(config)
try:
    check_training_settings(config, given)
    device = resolve_device(device)
    check_parallel(parallel, trainable, compile, device, resolve_dtype(dtype, device))
    if trainable == 'lora' or merge_lora:
        require_extra('peft', "trainable='lora'" if trainable == 'lora' else "merge_lora")
except ValueError as e:
    fail(e)

if merge_lora:  # an export step, not a training run
    try:
        merged_path = write_merged_checkpoint(out_dir)
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        fail(e)
    print(f"merged the LoRA adapters of {out_dir} into {merged_path}: sample, evaluate or fine-tune it further "
          f"with --out_dir={os.path.dirname(merged_path)} (sample.py, eval.py) or --init_from={os.path.dirname(merged_path)}")
    sys.exit(0)

# various inits, derived attributes, I/O setup
ddp = int(os.environ.get('RANK', -1)) != -1  # is this a ddp run?
if ddp:
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    # world_size processes train simultaneously: each does its share of the micro-batches
    if gradient_accumulation_steps % ddp_world_size != 0:
        fail(f"gradient_accumulation_steps={gradient_accumulation_steps} (the total over all ranks) "
             f"must be divisible by the number of processes, {ddp_world_size}; use a multiple of "
             f"{ddp_world_size}, e.g. {ddp_world_size * max(1, gradient_accumulation_steps // ddp_world_size)}")
    gradient_accumulation_steps //= ddp_world_size
    if device_type(device) == 'cuda':
        device = f'cuda:{ddp_local_rank}'
    setup(device)
    dist.init_process_group(backend=ddp_backend(device) if backend == 'auto' else backend)
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    if master_process and parallel == 'fsdp':
        print(f"FSDP2: weights, gradients and AdamW state sharded over {ddp_world_size} ranks")
else:
    # if not ddp, we are running on a single device and one process
    setup(device)
    master_process = True
    ddp_rank = 0
    ddp_world_size = 1
fsdp = ddp and parallel == 'fsdp'  # (one process has nothing to shard: it trains as without)
try:
    dtype = resolve_dtype(dtype, device)
    compile = resolve_compile(compile, device)  # True / False / 'auto' (where it measured faster) -> bool
except ValueError as e:
    fail(e)
if compile and fsdp:  # compile=True was refused (check_parallel): this is 'auto'
    compile = False
    if master_process:
        print("compile=auto stays off under parallel='fsdp' (not supported with it yet)")

if master_process:
    print(f"device {device} ({dtype}), {ddp_world_size} process(es)")
ctx = autocast_context(device, dtype)

# data: the vocabulary now; the batch loaders below, once the model (and block_size) is settled.
# Random windows of the token files, drawn by a generator we seed per micro-batch.
data_dir = os.path.join('data', dataset)
try:
    meta = load_meta(data_dir)
    check_token_files(data_dir)  # a missing dataset is said before a model is built
except (FileNotFoundError, ValueError) as e:
    fail(e)
if eval_answers_only and not (meta or {}).get('labels'):
    fail(f"eval_answers_only=True: {data_dir} has no answers (its meta.json names no labels): it is for the needle "
         f"and recall datasets (data/needles, data/mqar); leave eval_answers_only off here")
meta_vocab_size = meta['vocab_size'] if meta else None
data_generator = torch.Generator()
SPLIT_KEYS = {'train': 0, 'val': 1}


def get_batch(split, seed_value):
    data_generator.manual_seed(seed_value)
    try:
        return batches[split].get_batch(generator=data_generator)
    except TokenIdError as e:  # an id the embedding has no row for, in a file too large to scan up front
        fail(e)


# model init
model_args = {k: config[k] for k in MODEL_KEYS if k != 'vocab_size'}  # vocab_size: from the data or weights
manual_seed(seed)  # the same initial weights in every run and on every rank
run = RunState()  # the loop's counters (iteration, best val loss, the checkpoint on disk, ...)
try:
    if init_from == 'scratch':
        if master_process:
            print("Initializing a new model from scratch")
        if meta_vocab_size is None and master_process:
            print("defaulting to vocab_size of GPT-2 to 50304 (50257 rounded up for efficiency)")
        model_args['vocab_size'] = meta_vocab_size if meta_vocab_size is not None else 50304
        model = GPT(GPTConfig(**model_args))
    elif init_from == 'resume':
        if master_process:
            print(f"Resuming training from {out_dir}")
        model_args = resumed_model_args(checkpoint['model_args'], model_args, given, meta_vocab_size, dataset, out_dir)
        block_size = model_args['block_size']
        # built empty (meta device), then the checkpoint's tensors become its parameters: no initialisation
        # to throw away. The same LoRA adapters and frozen parameters as the run, before the weights go in.
        prepare = lambda m: apply_trainable(m, trainable, lora_rank, lora_alpha, lora_dropout, lora_targets)
        if sharded_resume:  # each rank reads its shards once the model is sharded (below)
            model = empty_model(GPTConfig(**model_args), prepare)
        else:
            model = model_with_weights(GPTConfig(**model_args), checkpoint['model'], prepare, resume_from)
        run = RunState.resumed(checkpoint, eval_interval)
    elif is_checkpoint(init_from):  # a new run from a trained model, converted to attn_type (finetune.py)
        if master_process:
            print(f"Initializing from the checkpoint {init_from} as attn_type={attn_type!r} (a new run: fresh "
                  f"optimizer and LR schedule, iter 0)")
        model, model_args = model_for_new_run(init_from, model_args, given)  # the checkpoint's shape
        if 'block_size' not in given:
            block_size = model_args['block_size']
    else:  # a GPT-2 name or a local transformers directory
        if master_process:
            print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
        model = load_gpt2(init_from, dict(dropout=dropout, attn_type=attn_type))
        model_args = dataclasses.asdict(model.config)
    # crop down the model block size if desired, using model surgery
    if block_size < model.config.block_size:
        model.crop_block_size(block_size)
        model_args['block_size'] = block_size  # so that the checkpoint will have the right value
    elif block_size > model.config.block_size:
        fail(f"block_size={block_size} is longer than {init_from}'s context of {model.config.block_size}")
    if init_from != 'resume':  # (resume did this before loading the LoRA weights)
        apply_trainable(model, trainable, lora_rank, lora_alpha, lora_dropout, lora_targets)
except (ValueError, FileNotFoundError, CheckpointError) as e:
    fail(e)
except (MemoryError, RuntimeError) as e:  # sizes the machine cannot hold: one line, not the allocator's traceback
    if refused_allocation(e) is None:
        raise
    fail(f"cannot allocate the model (n_layer={n_layer}, n_embd={n_embd}, block_size={block_size}, "
         f"vocab_size={model_args.get('vocab_size')}): {refused_allocation(e)}; choose smaller sizes")
if master_process:
    print(f"number of parameters: {model.get_num_params() / 1e6:.2f}M ({model.config.attn_type}); "
          f"{trainable_summary(model)}")
if not fsdp:  # FSDP moves each rank's shard to the device as it shards (shard_model, below)
    model.to(device)
model.activation_checkpointing = activation_checkpointing

# data loaders
try:
    batches = {split: TokenBatches(data_dir, split, block_size, batch_size, device=device, seed=seed,
                                   vocab_size=model.config.vocab_size) for split in ('train', 'val')}
except (FileNotFoundError, ValueError) as e:
    fail(e)
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")

# out_dir is touched only now, after every check that can refuse the run: one writer at a time (the lock
# is the OS's and dies with this process), and a new run never destroys another run's checkpoint
if master_process:
    try:
        out_dir_lock, message = prepare_out_dir(out_dir, run.saved_iter, overwrite,
                                                eval_only)
    except ValueError as e:  # in use, unwritable, a full disk
        fail(e)
    if message:
        print(message)
    if resume_changes:
        print("resuming with these settings changed from the checkpoint's (the others are the checkpoint's):\n"
              + "\n".join(resume_changes))
    if init_from == 'resume' and run.iter_num == max_iters and not eval_only:
        print(f"note: max_iters={max_iters} is the checkpoint's iteration: nothing to train (give --max_iters above "
              f"{max_iters} to continue the run)")

# initialize a GradScaler. If enabled=False scaler is a no-op
scaler = grad_scaler(device, dtype)

# FSDP: shard before building the optimizer, whose state then lives next to each rank's shard
if fsdp:
    shard_model(model, device, dtype)
    if sharded_resume:  # room for this rank's shards, read below
        model.to_empty(device=device)

# optimizer
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type(device))
optimizer = fused_optimizer(optimizer, device)
if init_from == 'resume':  # the optimizer, GradScaler, RNG and sampler states (under FSDP: this rank's shards)
    try:
        note = resume_training_state(checkpoint, resume_from, model, optimizer, scaler, batches['train'], device,
                                     sharded_resume)
    except (CheckpointError, ValueError) as e:
        fail(e)
    if fsdp and not sharded_resume:  # every rank read the whole file: each keeps its shard
        shard_optimizer_state(optimizer)
    if note and master_process:
        print(note)
checkpoint = None  # free up memory

raw_model = model  # the plain module: its state_dict, KL and MFU, whatever wraps it below
# under FSDP the noise parameters are shards after the forward: the KL is summed over the ranks
kl_divergence = sharded_kl(raw_model) if fsdp else raw_model.kl_divergence
if compile:
    model = compile_model(model, device)
    if model is not raw_model and not ddp:  # under DDP the first step compiles, inside DDP
        seconds = compile_training_step(model, batch_size, block_size, device, ctx)
        print(f"compiled the training step in {seconds:.1f} s (cold compile; evaluation compiles at its first call)")
    elif model is not raw_model and master_process:
        print("compiling the model at the first step (takes a minute or more; iter 0's time includes it)")

# wrap model into DDP container (FSDP2 works on the module itself: shard_model above)
if ddp and not fsdp:
    model = DDP(model, device_ids=ddp_device_ids(device))


@torch.no_grad()
def estimate_loss():
    """Mean cross-entropy over the same eval_iters batches of each split at every call: batch j is
    seeded by (seed, split, j) for its data and noise, rank r evaluates batches r, r + W, ...,
    and sums of losses and counts are all-reduced. None when a stop signal arrives on any rank before
    it ends."""
    out = {}
    net = model.module if ddp and not fsdp else model  # no DDP: no gradients here, and ranks do unequal counts
    net.eval()
    for split in ('train', 'val'):
        totals = torch.zeros(2, device=device)
        for first in range(0, eval_iters, ddp_world_size):  # a round: batch first + r on rank r
            if stop_request.requested():  # (every rank asks once a round) a preemption's grace period is short
                net.train()
                return None
            j = first + ddp_rank
            # FSDP: each forward gathers weights with every rank, so a rank with no batch left evaluates
            # one again and does not count it
            if j >= eval_iters and not fsdp:
                continue
            s = batch_seed(seed, 2, SPLIT_KEYS[split], j % eval_iters)  # 2: evaluation (training uses (0, it, m))
            X, Y = get_batch(split, s)
            if eval_answers_only:  # (where every label is an answer, Y as it is)
                Y = batches[split].layout.answers_only(Y)
            manual_seed(s, device)  # the same noise every evaluation
            with ctx:
                _, loss = net(X, Y)
            if j < eval_iters:
                totals[0] += loss.float()
                totals[1] += 1
            mark_step()
        if ddp:
            dist.all_reduce(totals)
        out[split] = (totals[0] / totals[1]).item()
    net.train()
    return out


def save(reason, val_loss):
    """Every rank calls this: rank 0 writes ckpt.pt, or under FSDP every rank writes its shards
    (sharded_checkpoint.py). A state is never saved when its evaluation (val_loss: this iteration's, or None)
    or last step was non-finite, or its weights or optimizer moments are: it would be resumed from, sampled,
    and become the fallback. Returns why it was not saved, or None (saved)."""
    refusal = run.unsaveable or nonfinite_state(raw_model, optimizer)
    if refusal:
        if master_process:
            kept = (f"{checkpoint_path(out_dir)} still holds iter {run.saved_iter}" if run.saved_iter is not None
                    else "no checkpoint has been written")
            print(f"not saving iter {run.iter_num} ({reason}): {refusal}; {kept}", file=sys.stderr)
        return refusal
    if not master_process and not fsdp:
        return None
    state = {
        'model_args': model_args,
        'iter_num': run.iter_num,
        'val_loss': val_loss,  # this state's (None: not evaluated), for the run's last line after a resume
        'best_val_loss': run.best_val_loss,
        'best_iter': run.best_iter,
        'train_time': run.train_time,
        'config': config,
        'scaler': scaler.state_dict(),
        # batches and model noise are re-seeded from (seed, iter, micro-batch) anyway; these make
        # any other use of randomness resume exactly too
        'rng': capture_rng_state(device_type(device)),
        'train_batches': batches['train'].state_dict(),
    }
    stop_request.saving = True  # (a second Ctrl-C now says so)
    try:  # under FSDP a sharded checkpoint, every rank writing its shards
        path = save_training_state(raw_model, optimizer, state, out_dir, fsdp, writer=master_process)
    except CheckpointError as e:  # disk full, ...: the files already there are intact
        fail(e)
    finally:
        stop_request.saving = False
    if master_process:
        print(f"saved checkpoint to {path} (iter {run.iter_num}, {reason})")
    return None


# SIGTERM or Ctrl-C: stop at the next micro-batch, save the last finished step, exit 0 (a second Ctrl-C: exit 130 now)
stop_request = StopRequest(out_dir if master_process else None, distributed=ddp)
if wandb_log and master_process:
    wandb = start_wandb(wandb_project, wandb_run_name, config, out_dir)
speed = StepSpeed(raw_model, batch_size * gradient_accumulation_steps,
                  None if device_type(device) == 'cpu' else peak_flops(device, dtype)) if master_process else None
if master_process and decay_lr and (note := schedule_note(max_iters, learning_rate, warmup_iters, lr_decay_iters,
                                                          min_lr)):
    print(note)



def report_evaluation(losses, lr):
    """Rank 0 prints the evaluation and logs it with the learned values (under FSDP every rank gathers them)."""
    learned = learned_values(raw_model) if fsdp else raw_model.learned_values() if master_process else None
    if not master_process:
        return
    speed.eval_seconds = time.time() - t0  # (t0: the end of the last step)
    left = speed.time_left(run.iter_num, max_iters, eval_interval, evaluated=True)
    print(f"step {run.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
          + (" (answers only)" if eval_answers_only else "") + (f" ({left})" if left else ""))
    if run.target_reached and run.iter_num < max_iters:
        print(f"val loss {run.val_loss:.4f} <= stop_at_val_loss={stop_at_val_loss:g}: training ends at iter "
              f"{run.iter_num} of max_iters={max_iters}")
    row = {"iter": run.iter_num, "train_loss": losses['train'], "val_loss": losses['val'], "lr": lr,
           "time": run.train_time, "peak_memory_mib": peak_memory_mib(device)}
    if not eval_only:
        log_row(out_dir, {**row, **learned})  # e.g. {'sigma': [[per head] per layer]}
    if wandb_log:
        wandb.log({**row, **wandb_learned_values(learned)})


def report_step(loss_mean, ce_mean, kl_mean, lr, dt):
    """Rank 0's log line of a step, and its row in metrics.jsonl (and wandb)."""
    mfu = speed.update(dt, settled=run.local_iter_num >= speed.SETTLED_AFTER)  # None until measured from settled steps
    mfu_text = f", mfu {mfu * 100:.2f}%" if mfu is not None else ""
    left = speed.time_left(run.iter_num + 1, max_iters, eval_interval)
    print(f"iter {run.iter_num}: loss {loss_mean:.6f}, ce {ce_mean:.6f}, kl {kl_mean:.4g}, lr {lr:.3e}, "
          f"{dt * 1000:.2f}ms/iter, {tokens_per_iter / dt:,.0f} tok/s{mfu_text}" + (f", {left}" if left else ""))
    row = {"iter": run.iter_num, "loss": loss_mean, "ce": ce_mean, "kl": kl_mean, "lr": lr, "ms": dt * 1000,
           "time": run.train_time, "tokens_per_s": tokens_per_iter / dt}
    if mfu is not None:
        row["mfu"] = mfu * 100
    log_row(out_dir, row)
    if wandb_log:
        wandb.log(row)


# training loop
t0 = time.time()
# stop_at_val_loss reached: a resumed run whose checkpoint reached it has nothing left to train
run.target_reached = (bool(stop_at_val_loss) and run.saved_val_loss is not None
                      and run.saved_val_loss <= stop_at_val_loss)
while True:

    # determine and set the learning rate for this iteration
    lr = get_lr(run.iter_num, learning_rate, warmup_iters, lr_decay_iters, min_lr) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    # evaluate the loss on train/val sets and write checkpoints
    done = eval_only or run.stopping or run.iter_num >= max_iters or run.target_reached
    if run.evaluates(done, eval_interval, eval_only):
        losses = estimate_loss()
        if losses is None:  # stopped part-way: save this state unevaluated (it is a finished step)
            run.stopping = done = True
            if master_process:
                print(f"{stop_request.signal or 'stop signal'} received during the evaluation at iter {run.iter_num}: "
                      f"stopping without it")
        else:
            run.record_evaluation(losses, stop_at_val_loss, eval_only)
            done = done or run.target_reached
            report_evaluation(losses, lr)
            t0 = time.time()  # evaluation time is not training time
    stop = (stop_request.signal or "stop signal") if run.stopping else None  # (SIGTERM / Ctrl-C: always saved)
    reason = checkpoint_reason(run.iter_num, run.val_loss, run.improved, done, stop, run.saved_iter,
                               always_save_checkpoint, out_dir) if master_process and not eval_only else None
    if ddp and (run.val_loss is not None or done or run.stopping):  # every rank learns what is on disk (and
        reason = broadcast_from_rank0(reason)                       # under FSDP takes part in gathering the state)
    if reason:
        run.record_save(save(reason, run.val_loss))
    if done:
        break

    # forward backward update, with optional gradient accumulation to simulate larger batch size
    # and using the GradScaler if data type is float16
    # what a stop within the step puts back (abandon_step); a step of one micro-batch is never stopped within
    step_rng = capture_rng_state(device_type(device)) if gradient_accumulation_steps > 1 else None
    loss_sum = torch.zeros((), device=device)
    ce_sum = torch.zeros((), device=device)
    m = ddp_rank  # index of this rank's micro-batch among the iteration's micro-batches
    s = batch_seed(seed, 0, run.iter_num, m)
    X, Y = get_batch('train', s)
    for micro_step in range(gradient_accumulation_steps):
        # a stop waits for one micro-batch, not the whole step (under DDP an all-reduce, from the second on)
        if micro_step and stop_request.requested():
            run.stopping = True
            break
        if fsdp:  # the same for FSDP: reduce-scatter the gradients after the last micro step only
            model.set_requires_gradient_sync(micro_step == gradient_accumulation_steps - 1)
        elif ddp:
            # in DDP training we only need to sync gradients at the last micro step.
            # the official way to do this is with model.no_sync() context manager, but
            # I really dislike that this bloats the code and forces us to repeat code
            # looking at the source of that context manager, it just toggles this variable
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        manual_seed(s, device)  # noise and dropout of micro-batch m
        with ctx:
            _, ce = model(X, Y, return_logits=False)  # fused, chunked lm_head + cross-entropy
            kl = kl_divergence()
            loss = ce + kl_weight * kl
        loss_sum += loss.detach().float()
        ce_sum += ce.detach().float()
        # immediately async prefetch next batch while model is doing the forward pass on the device
        if micro_step < gradient_accumulation_steps - 1:
            m += ddp_world_size
            s = batch_seed(seed, 0, run.iter_num, m)
            X, Y = get_batch('train', s)
        # backward pass, with gradient scaling if training in fp16
        scaler.scale(loss / gradient_accumulation_steps).backward()
        mark_step()
    if run.stopping:  # the step is dropped: the state saved is the last finished step's, which a resume continues
        abandon_step(optimizer, step_rng, device, master_process and f"{stop_request.signal or 'stop signal'} "
                     f"received during iter {run.iter_num} ({micro_step} of its {gradient_accumulation_steps} "
                     f"micro-batches done): stopping without it")
        continue
    # clip the gradient (with clipping off, only measure it), then agree over the ranks on the step's means, on
    # whether it was finite everywhere, and on a stop signal
    scaler.unscale_(optimizer)
    grad_norm = clip_gradients(raw_model, grad_clip, fsdp)
    loss_mean, ce_mean, kl_mean, n_bad, n_stop, bad_here = agree_on_step(
        loss_sum, ce_sum, kl, grad_norm, scaler.is_enabled(), stop_request.signal is not None,
        gradient_accumulation_steps, ddp_world_size)
    if n_bad > 0:
        if bad_here:
            print(f"rank {ddp_rank}: non-finite loss or gradient at iter {run.iter_num} "
                  f"(loss {loss_sum.item() / gradient_accumulation_steps}, grad norm {grad_norm.item()})",
                  file=sys.stderr)
        if why := run.skip_nonfinite_step(ce_mean, kl_mean, kl_weight, nonfinite, max_skipped_steps, out_dir,
                                          {**config, **model_args}):
            stop_diverged(why, master_process, ddp)
        if master_process:
            print(f"iter {run.iter_num}: skipping the update (non-finite loss or gradient, nonfinite='skip')")
    else:
        scaler.step(optimizer)  # step the optimizer and scaler if training in fp16
    scaler.update()
    mark_step()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)

    # timing and logging
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    run.train_time += dt
    if run.iter_num % log_interval == 0 and master_process:
        report_step(loss_mean, ce_mean, kl_mean, lr, dt)
    run.next_iteration(finite_step=n_bad == 0, stop_requested=n_stop > 0)
    if n_stop > 0 and master_process:
        print(f"{stop_request.signal or 'stop signal'} received: stopping after iter {run.iter_num - 1}")

if run.saved_iter is None and not eval_only:  # (every rank) the state the run ended with was not saved
    stop_diverged(f"stopping at iter {run.iter_num} without a checkpoint: {run.refusal}. "
                  f"{restart_advice(out_dir, None)}.", master_process, ddp)
if master_process and not eval_only:
    keeps_best = always_save_checkpoint and bool(run.best_iter) and not stop_request.signal
    print(checkpoint_note(checkpoint_path(out_dir), run.saved_iter, run.saved_val_loss, run.best_iter,
                          run.best_val_loss, run.iter_num, keeps_best))
    print(next_step(out_dir, lora=trainable == 'lora', meta=meta))
if wandb_log and master_process:
    wandb.finish()
if master_process:
    out_dir_lock.close()  # the next run may write to out_dir
if ddp:
    dist.barrier()  # rank 0 may still be writing the checkpoint: leave together
    dist.destroy_process_group()
