# The attention-noise study (docs/recall.md, "Recall as irrelevant context grows"): does a variant that
# claims to cancel attention noise (DIFF, DINT, low-rank DINT, NoiseFormer) keep its recall and its attention
# on the answer as random filler grows? 4 key-value pairs per example at sequence lengths 16, 32 and 64 over
# the same 64 token ids: 4, 20 and 52 filler tokens per example (neither pairs nor queries, uniformly
# random, so a filler token repeats a key 1 time in 8). Every variant tuned at length 16 on two seeds, then
# three seeds at its length-16 choice at every length; the report gives answer accuracy and the lookup head's
# attention shares (eval.py --attention_noise) against filler length, each paired with base seed by seed.
# $ for T in 16 32 64; do python3 data/mqar/prepare.py --num_kv_pairs 4 --seq_len $T --out_dir data/mqar-noise$T; done
# $ python3 compare.py config/compare_noise.py
# Run it again after an interruption: it resumes. Measured on a 2-core CPU (docs/recall.md): 31.8 core-hours
# of training, 16 hours at two runs at a time (length 16's tuning 12.3; the compared runs 2.25, 5.07 and
# 12.16 at lengths 16, 32 and 64; linear attention alone 10.3 of the 31.8). Tuning at
# lengths 32 and 64 as well would add 50 core-hours (if the filler left the iterations to the target
# unchanged) to about 170 (if they doubled with the length): that does not fit this CPU, so the rates are
# tuned at the shortest length only (a GPU can tune at every length: --tune_at='').
# Literal assignments only; every key is one of compare.py's settings.

# base the baseline; the four that claim to denoise; symmetric (NoiseFormer without its noise); linear
# attention, the known-weak control
attn_types = ['base', 'diff', 'dint', 'noiseformer_v2', 'dint_lowrank', 'symmetric', 'linear']
seeds = [1337, 1338, 1339]
base_config = 'config/train_mqar.py'  # 2 layers, width 64 / 8 heads, batch 64, constant rate, stop at val 1e-2
grid = ['--dataset=mqar-noise16 --block_size=16', '--dataset=mqar-noise32 --block_size=32',
        '--dataset=mqar-noise64 --block_size=64']
# a run ends at its first evaluation with val loss <= 1e-2 (solved: at most 1.4 % of the evaluated answers
# wrong); 32,000 iterations at most
overrides = '--max_iters=32000 --lr_decay_iters=32000'
out_dir = 'out-compare-noise'
nproc = 1
jobs = 2  # on 2 cores, two one-thread runs at a time
samples = False  # the examples are token ids, not text
# each variant at its own best constant rate: the tuned recall study chose 1e-2 for base, 1e-3 for symmetric,
# NoiseFormer, DIFF and linear attention, 3e-4 for low-rank DINT and 1e-4 for DINT; these five half-decades
# hold each choice with a value on either side but base's (the range grows where a choice lands on an edge).
# Two tuning seeds: with one, DINT's choice fell between close candidates, and base's one-seed choice
# stayed on the plateau for tens of thousands of iterations on a comparison seed
# listed middle out (the order they train in): a candidate that reaches the target soon stops the slower
# ones at its iteration count (out-ranked), so the slow edges cost least when they train last
tune = {'learning_rate': [1e-3, 3e-4, 3e-3, 1e-4, 1e-2]}
tune_seeds = [1, 2]
tune_at = '--dataset=mqar-noise16 --block_size=16'  # each variant's choice there trains at every length
