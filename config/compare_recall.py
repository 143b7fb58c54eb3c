# The recall study (docs/recall.md): every attention variant on MQAR at its own best learning rate, then
# 3 seeds at that rate; 2 layers, width 64 / 8 heads; the data mixes 2, 4 and 8 key-value pairs per
# example at sequence length 32, and the report gives answer accuracy by number of pairs beside the val
# loss and the iteration each run reached val loss 1e-2 (the task solved).
# $ python3 data/mqar/prepare.py
# $ python3 compare.py config/compare_recall.py
# Run it again after an interruption: it resumes. On 2 CPU cores (torch 2.13.0, two one-thread runs at a time):
# about 9.5 hours, 15.9 core-hours of training (the 48 tuning runs 10.5, the 24 compared 5.4; a run that stays
# on the plateau trains all its iterations, ~40-65 ms each on one core).
# Literal assignments only; every key is one of compare.py's settings.

attn_types = ['base', 'symmetric', 'noiseformer_v1', 'noiseformer_v2', 'diff', 'dint', 'dint_lowrank', 'linear']
seeds = [1337, 1338, 1339]
base_config = 'config/train_mqar.py'  # width 64 / 8 heads, a constant rate, a run ends at val loss 1e-2
# 64,000 iterations at most: base at its own best rate left the plateau at 37,750 on one seed (docs/recall.md);
# the rate is constant, so a run continued from a smaller budget is the run this one trains
overrides = '--max_iters=64000 --lr_decay_iters=64000'
out_dir = 'out-compare-recall'
nproc = 1
jobs = 2  # on 2 cores, two one-thread runs at a time train about a third faster than one two-thread run
samples = False  # the examples are token ids, not text
# every variant at its own best learning rate (Zoology sweeps it for every sequence mixer), each constant
# (min_lr follows at the config's ratio, 1), on a tuning seed apart from the comparison's. A candidate that
# reaches the target sooner beats one that reaches it later, which beats one that does not (then the higher
# answer accuracy, then the lower val loss)
tune = {'learning_rate': [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]}
tune_seeds = [1]
