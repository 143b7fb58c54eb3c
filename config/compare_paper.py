# The NoiseFormer paper's comparison (arXiv:2601.11619): GPT-2 124M on OpenWebText, base vs
# symmetric vs NoiseFormer v1/v2, plus DIFF and DINT, two seeds each, every run on 8 devices with the
# paper recipe of config/train_gpt2.py (491,520 tokens per iteration, 100k iterations).
# Prepare OpenWebText first (python3 data/openwebtext/prepare.py), then, on one 8-GPU (or 8-Gaudi) node:
# $ python3 compare.py config/compare_paper.py
# Literal assignments only; every key is one of compare.py's settings.

attn_types = ['base', 'symmetric', 'noiseformer_v1', 'noiseformer_v2', 'diff', 'dint']
seeds = [1337, 1338]
base_config = 'config/train_gpt2.py'
overrides = '--wandb_log=True --wandb_project=owt-compare'
out_dir = 'out-compare-paper'
nproc = 8
samples = True
