# The quickstart: a small character-level Shakespeare model that trains on a laptop CPU in a few
# minutes and already writes Shakespeare-shaped text. Prepare the data, train, sample:
# $ python data/shakespeare_char/prepare.py
# $ python train.py config/train_shakespeare_char.py
# $ python sample.py --out_dir=out-shakespeare-char
# On a GPU, nanoGPT's bigger baby GPT (n_layer=6, n_head=6, n_embd=384, block_size=256,
# batch_size=64, max_iters=5000, dropout=0.2) reaches a val loss of about 1.47.
# Literal assignments only; every key is one of train.py's settings.

out_dir = 'out-shakespeare-char'
eval_interval = 250  # the model is small and overfits late, so evaluate and keep the best often
eval_iters = 20
log_interval = 25
always_save_checkpoint = False  # keep the checkpoint with the best val loss

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 16
block_size = 128  # context of up to 128 previous characters

# a baby GPT model :)
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 2e-3  # with baby networks can afford to go a bit higher
max_iters = 1500
lr_decay_iters = 1500  # make equal to max_iters usually
min_lr = 2e-4  # learning_rate / 10 usually
beta2 = 0.99  # make a bit bigger because number of tokens per iter is small
warmup_iters = 50

device = 'auto'  # a GPU if there is one, else the CPU
dtype = 'auto'  # bfloat16 where the hardware has it (recent x86 CPUs too), else float32
compile = False  # not worth its start-up time for a few minutes of training
