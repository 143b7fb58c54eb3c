# How much of a model must a low-rank update touch? Convert a pretrained GPT-2 (124M) to linear
# attention (phi = elu + 1; it reuses base's c_attn and c_proj unchanged, nothing is new) and
# fine-tune only rank-16 LoRA adapters (Hugging Face peft) on every attention and MLP Linear.
# Vary --lora_rank (4, 16, 64) or compare with --trainable=all. See docs/finetune.md.
# Prepare the data (python data/openwebtext/prepare.py), then:
# $ python train.py config/finetune_linear_lora.py
# $ python train.py --out_dir=out-finetune-linear-lora --merge_lora=True   # -> out-finetune-linear-lora/merged
# $ python sample.py --out_dir=out-finetune-linear-lora/merged
# From a base checkpoint of ours or nanoGPT's instead of GPT-2: --init_from=out-owt-base.
# Literal assignments only; every key is one of train.py's settings.

init_from = 'gpt2'  # or a base checkpoint: a file or an out_dir
attn_type = 'linear'
trainable = 'lora'
lora_rank = 16
lora_alpha = 32.0  # the update B A is scaled by lora_alpha / lora_rank = 2
lora_dropout = 0.05
lora_targets = 'c_attn,c_proj,c_fc'  # c_proj: both attention's and the MLP's

out_dir = 'out-finetune-linear-lora'
dataset = 'openwebtext'
wandb_log = False
wandb_project = 'owt'
wandb_run_name = 'ft-linear-lora16'

# a short fine-tune on one device: 8 * 1024 * 4 = 32,768 tokens per iteration
batch_size = 8
block_size = 1024
gradient_accumulation_steps = 4
max_iters = 2000
eval_interval = 250
eval_iters = 100
log_interval = 10

learning_rate = 3e-4
warmup_iters = 100
lr_decay_iters = 2000
min_lr = 3e-5
weight_decay = 0.0  # no decay pulling the adapters back to zero
beta2 = 0.95
dropout = 0.0
