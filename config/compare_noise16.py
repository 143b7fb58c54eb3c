# The attention-noise study (config/compare_noise.py) read again with the query's own token, the earlier
# queries and the filler apart (docs/eval.md), at its shortest length: 4 key-value pairs at sequence 16 (4
# filler tokens), the six variants other than linear attention (the control, 1.3 of the 2.25 core-hours
# this length cost), each at the rate the study's tuning chose for it at this length, 3 seeds, every
# model read at val loss 1e-2.
# $ python3 data/mqar/prepare.py --num_kv_pairs 4 --seq_len 16 --out_dir data/mqar-noise16
# $ python3 compare.py config/compare_noise16.py
# Measured on an idle 2-core CPU (docs/recall.md): 23 minutes at two runs at a time, 0.62 core-hours of
# training (each run stops at its first evaluation at val loss <= 1e-2).
# Literal assignments only; every key is one of compare.py's settings.

attn_types = ['base', 'diff', 'dint', 'noiseformer_v2', 'dint_lowrank', 'symmetric']
seeds = [1337, 1338, 1339]
base_config = 'config/train_mqar.py'  # 2 layers, width 64 / 8 heads, batch 64, constant rate, stop at val 1e-2
overrides = '--dataset=mqar-noise16 --block_size=16 --max_iters=32000 --lr_decay_iters=32000'
out_dir = 'out-compare-noise16'
nproc = 1
jobs = 2  # on 2 cores, two one-thread runs at a time
samples = False  # the examples are token ids, not text
chosen = {'base': {'learning_rate': 3e-4}, 'diff': {'learning_rate': 3e-3}, 'dint': {'learning_rate': 3e-3},
          'noiseformer_v2': {'learning_rate': 3e-4}, 'dint_lowrank': {'learning_rate': 3e-4},
          'symmetric': {'learning_rate': 3e-4}}
chosen_by = "the attention-noise study's tuning at length 16, docs/compare-noise/report.md"
