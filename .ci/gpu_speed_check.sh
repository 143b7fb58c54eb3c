#!/usr/bin/env bash
# One call on a GPU: NoiseFormer's Triton kernel tested on the card, then our bench.py beside nanoGPT's bench.py, on
# the same card in the same call:
#   bash .ci/gpu_check.sh --prepare                    # here, once (gpu/ gets nanoGPT's scripts too)
#   bash .ci/gpu_speed_check.sh OUT_DIR [BUDGET_SECONDS]   # there, with gpu/ carried along
# Phase 1, in parallel: the kernel's tests (tests/test_noise_kernel.py, tests/test_cuda.py: OUT/tests.log) and one
# short compiled run of every timed setting below, which fills the inductor and Triton caches. Phase 2, one at a
# time: NoiseFormer's attention alone (.ci/noise_attention_bench.py), then each setting timed (bench.py, median of
# 10 steps; nanoGPT's bench.py, mean of 20), so the cold compile of one never overlaps another's timing.
# DEVICE=cpu SMALL=1: a dry run here.
set -u
OUT=${1:?OUT_DIR}; BUDGET=${2:-520}; DEVICE=${DEVICE:-cuda}; START=$(date +%s)
export PYTHONUNBUFFERED=1 WANDB_MODE=offline OMP_NUM_THREADS=2
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); REPO=$PWD
if [ "${SMALL:-0}" = 1 ]; then SIZE="--n_layer=2 --n_head=2 --n_embd=64 --block_size=64"; NANO_SIZE="--block_size=64 --batch_size=2"
  ATTN_SIZE="--B=1 --H=2 --T=64 --d=32 --iters=2"
else SIZE=""; NANO_SIZE=""; ATTN_SIZE=""; fi
# bench.py's result rows start with an attn_type: every registered one
VARIANTS=$(python3 -c "from model import ATTENTION_TYPES; print('|'.join(ATTENTION_TYPES))") || exit 1
# setting NAME: directory, then the command's arguments (nanoGPT's own bench.py for the nanogpt* ones)
declare -A DIR ARGS
add() { DIR[$1]=$2; ARGS[$1]="${*:3}"; NAMES+=("$1"); }
NAMES=()
BENCH="bench.py --device=$DEVICE --dtype=bfloat16 --compile=True --rounds=1 $SIZE"
NANO="bench.py --device=$DEVICE --real_data=False --compile=True $NANO_SIZE"
add base $REPO $BENCH --attn_types=base
add nanogpt $REPO/gpu/nanoGPT $NANO
add base_noclip $REPO $BENCH --attn_types=base --grad_clip=0  # nanoGPT's bench.py does not clip
add base_profile $REPO $BENCH --attn_types=base --profile=True  # where base's step goes (top kernels)
add nf2 $REPO $BENCH --attn_types=noiseformer_v2
add nf1 $REPO $BENCH --attn_types=noiseformer_v1
add nf2_triton $REPO $BENCH --attn_types=noiseformer_v2 --noise_kernel=triton
add nf1_triton $REPO $BENCH --attn_types=noiseformer_v1 --noise_kernel=triton
add base_b24 $REPO $BENCH --attn_types=base --batch_size=24
add nanogpt_b24 $REPO/gpu/nanoGPT $NANO --batch_size=24
add base_b32 $REPO $BENCH --attn_types=base --batch_size=32
add diff $REPO $BENCH --attn_types=diff
add dint $REPO $BENCH --attn_types=dint

nvidia-smi > "$OUT/env.log" 2>&1
python3 -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())" >> "$OUT/env.log" 2>&1
echo "== phase 1 at $(( $(date +%s) - START ))s: the kernel's tests, warm compiles" | tee -a "$OUT/bench.log"
(timeout -k 5 $(( BUDGET / 2 - 20 )) python3 -m pytest tests/test_noise_kernel.py tests/test_cuda.py -q -p no:cacheprovider \
   > "$OUT/tests.log" 2>&1; echo "tests: exit $? at $(( $(date +%s) - START ))s" >> "$OUT/tests.log") &
for name in "${NAMES[@]}"; do
  if [[ $name == nanogpt* ]]; then cmd="${ARGS[$name]}"; else cmd="${ARGS[$name]} --warmup_iters=1 --bench_iters=1"; fi
  (cd ${DIR[$name]} && TORCHINDUCTOR_COMPILE_THREADS=2 timeout -k 5 $(( BUDGET / 2 - 20 )) python3 $cmd > /tmp/warm-$name.log 2>&1
   echo "warm $name: exit $? at $(( $(date +%s) - START ))s" >> "$OUT/warm.log"; tail -3 /tmp/warm-$name.log >> "$OUT/warm.log") &
done
wait
echo "== phase 2 at $(( $(date +%s) - START ))s: timings, one at a time" | tee -a "$OUT/bench.log"
# NoiseFormer's attention alone (SDPA path against the Triton kernel, beside base's flash attention)
timeout -k 5 120 python3 .ci/noise_attention_bench.py --device=$DEVICE $ATTN_SIZE >> "$OUT/bench.log" 2>&1
for name in "${NAMES[@]}"; do
  t=$(( BUDGET - ($(date +%s) - START) - 5 )); [ $t -gt 90 ] && t=90
  if [ $t -lt 15 ]; then echo "== SKIPPED (no time left): $name" | tee -a "$OUT/bench.log"; continue; fi
  if [[ $name == nanogpt* ]]; then cmd="${ARGS[$name]}"; else cmd="${ARGS[$name]} --warmup_iters=3 --bench_iters=10 --json_out=/tmp/bench-$name.json"; fi
  echo "== $name (timeout ${t}s, at $(( $(date +%s) - START ))s): cd ${DIR[$name]} && python3 $cmd" | tee -a "$OUT/bench.log"
  (cd ${DIR[$name]} && timeout -k 5 $t python3 $cmd > /tmp/time-$name.log 2>&1; echo "== $name: exit $?" >> "$OUT/bench.log")
  grep -E "time per iteration|ms/iter|^ *($VARIANTS)\b" /tmp/time-$name.log >> "$OUT/bench.log"
  [ -f /tmp/bench-$name.json ] && { printf '{"setting": "%s", "result": ' $name; cat /tmp/bench-$name.json; echo '}'; } >> "$OUT/bench.jsonl"
done
tail -n 40 /tmp/time-*.log /tmp/warm-*.log > "$OUT/all_tails.log" 2>&1
cp /tmp/time-base_profile.log "$OUT/profile.log" 2>/dev/null
echo "== done at $(( $(date +%s) - START ))s" | tee -a "$OUT/bench.log"
