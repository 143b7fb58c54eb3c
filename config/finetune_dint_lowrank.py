# Denoise a pretrained GPT-2 (124M) cheaply: convert it to low-rank DINT (docs/attention.md) and train
# only what the conversion adds (the rank-32 factors, lambda vectors and norm: about 1% of the
# weights); every GPT-2 tensor stays frozen and bit-identical. See docs/finetune.md.
# Prepare the data (python data/openwebtext/prepare.py), then:
# $ python train.py config/finetune_dint_lowrank.py
# From a base checkpoint of ours or nanoGPT's instead of GPT-2: --init_from=out-owt-base (its out_dir
# or ckpt.pt). Train everything: --trainable=all. LoRA adapters on top: --trainable=lora.
# Literal assignments only; every key is one of train.py's settings.

init_from = 'gpt2'  # or a base checkpoint: a file or an out_dir
attn_type = 'dint_lowrank'
lowrank_rank = 32
trainable = 'new'  # only the low-rank branch, lambda vectors and norm train

out_dir = 'out-finetune-dint-lowrank'
dataset = 'openwebtext'
wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'ft-dint-lowrank'

# a short fine-tune on one device: 8 * 1024 * 4 = 32,768 tokens per iteration
batch_size = 8
block_size = 1024
gradient_accumulation_steps = 4
max_iters = 2000
eval_interval = 250
eval_iters = 100
log_interval = 10

# the new parameters start from scratch and can take a pretraining-sized learning rate
learning_rate = 6e-4
warmup_iters = 100
lr_decay_iters = 2000
min_lr = 6e-5
weight_decay = 1e-1
beta2 = 0.95
dropout = 0.0
