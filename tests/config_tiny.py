# A model small enough for the test suite (tests/test_train.py), not a recipe for users: trains on
# one CPU core in well under a second per dozen iterations. The tests set dataset (an absolute
# path to tiny token files) and out_dir.
# Literal assignments only; every key is one of train.py's settings.

out_dir = 'out-test-tiny'
eval_interval = 10
eval_iters = 4
log_interval = 1
always_save_checkpoint = True

gradient_accumulation_steps = 2
batch_size = 4
block_size = 32

n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
bias = False

learning_rate = 3e-3
max_iters = 20
warmup_iters = 5
lr_decay_iters = 20
min_lr = 3e-4
beta2 = 0.99
weight_decay = 1e-1
grad_clip = 1.0

device = 'cpu'
dtype = 'float32'  # exact comparisons in the tests; bf16 autocast would pass too
compile = False
