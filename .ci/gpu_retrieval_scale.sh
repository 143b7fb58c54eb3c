#!/usr/bin/env bash
# One call on a GPU: at which scale does a base model trained on Tiny Shakespeare (character level) copy?
# (docs/retrieval.md: none that a 2-core CPU trains does). Base models of three sizes train at once on the
# GPU for BUDGET/2 seconds; every checkpoint they save (always_save_checkpoint, every EVERY iterations) is
# copied aside, then read with eval.py --retrieval=True: copy accuracy against training tokens, per size.
#   bash .ci/gpu_retrieval_scale.sh OUT_DIR [BUDGET_SECONDS]
# DEVICE=cpu SMALL=1: a dry run here (tiny sizes, a few iterations).
set -u
OUT=${1:?OUT_DIR}; BUDGET=${2:-300}; DEVICE=${DEVICE:-cuda}; EVERY=${EVERY:-1000}; START=$(date +%s)
export PYTHONUNBUFFERED=1 WANDB_MODE=offline OMP_NUM_THREADS=2
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); WORK=$(mktemp -d)
[ -f data/shakespeare_char/train.bin ] || python3 data/shakespeare_char/prepare.py --input="${TINY_SHAKESPEARE:?}" > "$OUT/prepare.log" 2>&1
COMMON="config/train_shakespeare_char.py --device=$DEVICE --compile=False --eval_interval=$EVERY --eval_iters=20
        --always_save_checkpoint=True --max_iters=1000000 --lr_decay_iters=1000000 --warmup_iters=100"
declare -A SIZE
if [ "${SMALL:-0}" = 1 ]; then
  SIZE[tiny]="--n_layer=2 --n_embd=32 --n_head=2 --block_size=64 --batch_size=8 --learning_rate=2e-3 --min_lr=2e-3"
else
  # the quickstart's model with a longer context and batch; nanoGPT's shakespeare-char model; one between
  SIZE[q256]="--n_layer=4 --n_head=4 --n_embd=128 --block_size=256 --batch_size=64 --learning_rate=2e-3 --min_lr=2e-3"
  SIZE[w256]="--n_layer=4 --n_head=4 --n_embd=256 --block_size=256 --batch_size=64 --learning_rate=1e-3 --min_lr=1e-3"
  SIZE[nano]="--n_layer=6 --n_head=6 --n_embd=384 --block_size=256 --batch_size=64 --learning_rate=1e-3 --min_lr=1e-3"
fi
nvidia-smi > "$OUT/env.log" 2>&1
for name in "${!SIZE[@]}"; do
  (timeout -s INT -k 20 $(( BUDGET / 2 )) python3 train.py $COMMON ${SIZE[$name]} --out_dir=$WORK/$name \
     > "$OUT/train-$name.log" 2>&1) &
done
# copy each new checkpoint aside while they train
while [ -n "$(jobs -r)" ]; do
  for name in "${!SIZE[@]}"; do
    it=$(grep -o "^step [0-9]*" "$OUT/train-$name.log" 2>/dev/null | tail -1 | cut -d' ' -f2)
    [ -n "$it" ] && [ ! -d "$WORK/keep/$name-$it" ] && [ -f "$WORK/$name/ckpt.pt" ] && \
      mkdir -p "$WORK/keep/$name-$it" && cp "$WORK/$name/ckpt.pt" "$WORK/keep/$name-$it/"
  done
  sleep 2
done
echo "trained at $(( $(date +%s) - START ))s" > "$OUT/probe.log"
for dir in $(ls -d $WORK/keep/* 2>/dev/null | sort -V); do
  python3 eval.py --out_dir=$dir --retrieval=True --device=$DEVICE --batch_size=32 --eval_dir=$OUT/$(basename $dir) \
    2>&1 | grep -E "copy accuracy" | sed "s|^|$(basename $dir): |" >> "$OUT/probe.log"
  [ $(( $(date +%s) - START )) -gt $(( BUDGET - 15 )) ] && echo "out of time" >> "$OUT/probe.log" && break
done
cat "$OUT/probe.log"
