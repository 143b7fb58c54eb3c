# GPT-2 (124M) on OpenWebText with symmetric dot-product attention, K := Q (Courtois et al., arXiv:2406.06366).
# Prepare the data (python data/openwebtext/prepare.py), then launch, e.g. in a screen session:
# $ torchrun --standalone --nproc_per_node=8 train.py config/symmetric.py
# Literal assignments only; every key is one of train.py's settings.

wandb_log = True
wandb_project = 'owt'
wandb_run_name = 'gpt2-124M-symmetric'
out_dir = 'out-symmetric'
dataset = 'openwebtext'

attn_type = 'symmetric'

# The paper recipe (NoiseFormer, arXiv:2601.11619), on 8 devices:
# 12 batch size * 1024 block size * 5 grad accum * 8 devices = 491,520 tokens per iteration.
# gradient_accumulation_steps is the total over all ranks (nanoGPT): each of 8 ranks does 5.
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 5 * 8

# AdamW, warmup 2000 then cosine towards 6e-5 at 600k; training stops at 100k (49B tokens)
learning_rate = 6e-4
beta1 = 0.9
beta2 = 0.95
weight_decay = 1e-1
grad_clip = 1.0
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
max_iters = 100000

# eval every 1000 iters on the same 200 batches per split
eval_interval = 1000
eval_iters = 200
log_interval = 10

kl_weight = 5e-6  # NoiseFormer's KL term; the KL is zero for variants without noise
dtype = 'float32'  # the paper trained in FP32 (TF32 matmuls on NVIDIA); --dtype=auto (bf16) is faster
compile = 'auto'  # on GPUs (the paper's recipe); off on CPU, where it is no faster (docs/benchmarks.md)
