# The attention-noise study on text (docs/recall.md, "Needles in a text haystack"): the noise study's question
# (does a variant that claims to cancel attention noise keep its recall, and its attention on the answer, as the
# context grows?) where the context is text the model also has to model. 4 key-value needles at random depths in
# windows of Tiny Shakespeare's characters, their keys asked at the end, the text labelled too (a language model
# of the haystack): 20 and 52 text tokens at sequence lengths 32 and 64. Each variant tuned at length 32 on two
# seeds, then three seeds at its choice at both lengths. Every run is evaluated on its answers alone
# (eval_answers_only) and ends at the first evaluation whose answer val loss is <= 0.1 (base's first run stood at
# 0.056 with 0.979 of the answers right): every model that gets there is read at that same loss. The report gives
# answer accuracy and the lookup head's and reading layer's shares on the answer value, the answer key and the text,
# paired with base seed by seed.
# $ for T in 32 64; do python3 data/needles/prepare.py --text data/shakespeare_char --seq_len $T --num_needles 4 \
#       --text_labels --train_examples 200000 --out_dir data/needles-$T; done
# $ python3 compare.py config/compare_needles.py
# Run it again after an interruption: it resumes. Cost on the 2-core CPU (two one-thread runs at a time): a length-32
# run of 20,000 iterations took 23-31 minutes (the tuning: 9.9 hours of run time over 26 runs), a length-64 run about
# twice that per iteration, with 30,000 at most: some 30 core-hours in all, less where runs stop at the target.
# Literal assignments only; every key is one of compare.py's settings.

attn_types = ['base', 'diff', 'dint', 'noiseformer_v2']  # the baseline and three that claim to denoise
seeds = [1337, 1338, 1339]
base_config = 'config/train_mqar.py'  # 2 layers, width 64 / 8 heads, batch 64, constant rate
# 52 text tokens take base longer (17,750 iterations on one seed at 1e-3): that point has a larger budget
grid = ['--dataset=needles-32 --block_size=32',
        '--dataset=needles-64 --block_size=64 --max_iters=30000 --lr_decay_iters=30000']
overrides = '--max_iters=20000 --lr_decay_iters=20000 --eval_answers_only=True --stop_at_val_loss=0.1'
out_dir = 'out-compare-needles'
nproc = 1
jobs = 2  # on 2 cores, two one-thread runs at a time
samples = False  # the model reads text, but the examples end in needles and queries: nothing to sample
# base left the plateau at 1e-3 and not at 3e-4 or 1e-2 (single runs); DIFF and DINT stayed on it at 1e-3 (and DIFF at
# 3e-3). On MQAR (docs/recall.md) DINT did best at 1e-4, the others at 1e-3 or above: DINT also tries 1e-4
tune = {'learning_rate': {'base': [1e-3, 3e-4, 3e-3], 'diff': [1e-3, 3e-4, 3e-3], 'dint': [1e-3, 3e-4, 3e-3, 1e-4],
                          'noiseformer_v2': [1e-3, 3e-4, 3e-3]}}
tune_seeds = [1, 2]
tune_at = '--dataset=needles-32 --block_size=32'  # each variant's choice there trains at both lengths
