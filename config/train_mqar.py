# Multi-query associative recall (docs/recall.md): a 2-layer model learns to answer queries for the
# values of keys it saw earlier in the sequence; the loss counts the answers only. On a laptop CPU:
# $ python3 data/mqar/prepare.py
# $ python3 train.py config/train_mqar.py
# $ python3 eval.py --out_dir=out-mqar --recall=True
# Literal assignments only; every key is one of train.py's settings.

out_dir = 'out-mqar'
eval_interval = 250
eval_iters = 20  # batches of whole examples; eval.py --recall=True scores every validation example
log_interval = 50
always_save_checkpoint = True  # the final state, which eval.py and compare.py's accuracy read

dataset = 'mqar'
gradient_accumulation_steps = 1
batch_size = 64
block_size = 32  # the dataset's seq_len: every row of a batch is one whole example

n_layer = 2
n_head = 8  # more heads found the recall circuit sooner than 2 in our CPU runs (docs/recall.md)
n_embd = 64
dropout = 0.0

# the rate held at 1e-2 (min_lr equal to it): base then left the plateau on every seed tried (4 of 4, at
# 2000-14,250 iterations; this seed, 1337, at 2500, stopping at 6500 with val 0.0062 and answer accuracy
# 0.998, ~7 minutes on one core), where a cosine decay to 1e-3 over 8000 left it on about half (docs/recall.md)
learning_rate = 1e-2
min_lr = 1e-2
max_iters = 16000
lr_decay_iters = 16000
# ends at the first evaluation with val loss <= 1e-2 (over the answers): at most 1.4 % of them wrong, solved
stop_at_val_loss = 1e-2
weight_decay = 0.0  # decaying the position embeddings slowed the search for the previous-token head
warmup_iters = 100

device = 'auto'
dtype = 'float32'
compile = False
