# The recall study (docs/recall.md): every attention variant on MQAR, 3 seeds, 2 layers, two widths;
# the data mixes 2, 4 and 8 key-value pairs per example at sequence length 32 (the difficulty
# levels), and the report gives answer accuracy by number of pairs beside the val loss.
# $ python3 data/mqar/prepare.py
# $ python3 compare.py config/compare_recall.py
# 48 runs of config/train_mqar.py's 8000 iterations (past the plateau where recall forms), two at a
# time: about 2.5 hours on 2 CPU cores (measured: 2 h 25 min of training). Run it again after an
# interruption: it resumes. docs/recall.md has this study and the earlier 2000-iteration one, which
# overrides = '--max_iters=2000 --lr_decay_iters=2000' reproduces (out_dir another folder).
# Literal assignments only; every key is one of compare.py's settings.

attn_types = ['base', 'symmetric', 'noiseformer_v1', 'noiseformer_v2', 'diff', 'dint', 'dint_lowrank', 'linear']
seeds = [1337, 1338, 1339]
base_config = 'config/train_mqar.py'
overrides = ''
grid = ['--n_embd=32 --n_head=4', '--n_embd=64 --n_head=8']
out_dir = 'out-compare-recall'
nproc = 1
jobs = 2  # on 2 cores, two one-thread runs at a time train about a third faster than one two-thread run
samples = False  # the examples are token ids, not text
