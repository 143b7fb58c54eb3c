#!/usr/bin/env bash
# The GPU checklist in one script, for a short loan of a CUDA machine (nothing to download there).
#   bash .ci/gpu_check.sh OUT_DIR [BUDGET_SECONDS]
# Needs gpu/data/shakespeare_bpe (GPT-2 BPE Tiny Shakespeare: train.bin, val.bin, meta.json) and
# gpu/tiktoken (../shared/tiktoken) beside the repo's files. Every step is time-boxed and appends to
# OUT_DIR/*.log, so a step that fails or runs out of time leaves the others' results.
# SMALL=1 shrinks every size, for a dry run on the CPU (DEVICE=cpu).
set -u
OUT=${1:?OUT_DIR}; BUDGET=${2:-480}; DEVICE=${DEVICE:-cuda}
START=$(date +%s)
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TIKTOKEN_CACHE_DIR=$PWD/gpu/tiktoken OMP_NUM_THREADS=4
DATA=$PWD/gpu/data/shakespeare_bpe
RUNS=/tmp/gpu-runs; rm -rf $RUNS; mkdir -p $RUNS "$OUT"
if [ "${SMALL:-0}" = 1 ]; then
  MODEL="--n_layer=2 --n_head=2 --n_embd=64 --batch_size=2 --block_size=64"; ITERS=20; COMPILE=False
else
  MODEL="--batch_size=12 --block_size=1024"; ITERS=100; COMPILE=True
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# step NAME LOG MAX_SECONDS COMMAND...: run with a timeout of min(MAX, time left - 10), or skip
step() {
  local name=$1 log=$2 max=$3; shift 3
  local t=$(( $(left) - 10 )); [ "$t" -gt "$max" ] && t=$max
  if [ "$t" -lt 15 ]; then echo "== SKIPPED (no time left): $name" | tee -a "$OUT/$log"; return; fi
  echo "== $name (timeout ${t}s, at $(( $(date +%s) - START ))s): $*" | tee -a "$OUT/$log"
  local t0=$(date +%s)
  timeout -k 5 "$t" "$@" >> "$OUT/$log" 2>&1; local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/$log"
}

step env env.log 30 bash -c 'nvidia-smi; python3 -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"; python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|numpy|tiktoken|datasets|wandb|pytest|pytest-xdist) "'

# 1. the CUDA tests, beside the compile-heavy real run (correctness only: no timing overlaps them)
( step tests tests.log 200 python3 -m pytest tests/test_cuda.py -q -rA -p no:cacheprovider -n 4 ) &
TESTS=$!

# 3. a short real run, compiled: no recompiles / graph breaks after warm-up, loss falling,
#    then the same run stopped halfway and resumed must give the same losses
TRAIN="train.py config/train_gpt2.py --dataset=$DATA --device=$DEVICE --dtype=bfloat16 --compile=$COMPILE \
  --wandb_log=False $MODEL --gradient_accumulation_steps=1 --warmup_iters=10 --lr_decay_iters=$ITERS \
  --eval_interval=$((ITERS / 2)) --eval_iters=5 --log_interval=5"
step train-full train.log 150 env TORCH_LOGS=recompiles,graph_breaks python3 $TRAIN --out_dir=$RUNS/full --max_iters=$ITERS
step train-half train.log 60 python3 $TRAIN --out_dir=$RUNS/half --max_iters=$((ITERS / 2))
step train-resume train.log 60 python3 $TRAIN --out_dir=$RUNS/half --max_iters=$ITERS --init_from=resume
step train-compare train.log 30 python3 - "$RUNS" <<'EOF'
import json, sys, torch
runs = sys.argv[1]
rows = {n: {r['iter']: r['loss'] for r in map(json.loads, open(f'{runs}/{n}/metrics.jsonl')) if 'loss' in r}
        for n in ('full', 'half')}
same = [i for i in rows['full'] if rows['half'].get(i) == rows['full'][i]]
print(f"resume: {len(same)} of {len(rows['full'])} iteration losses bitwise equal; "
      f"first loss {rows['full'][0]:.4f}, last {rows['full'][max(rows['full'])]:.4f}")
a, b = (torch.load(f'{runs}/{n}/ckpt.pt', map_location='cpu', weights_only=True) for n in ('full', 'half'))
diff = [k for k in a['model'] if not torch.equal(a['model'][k], b['model'][k])]
print(f"resume: {len(a['model']) - len(diff)} of {len(a['model'])} weights bitwise equal; differing: {diff[:5]}")
EOF
# FSDP2 on one GPU through torchrun, with its sharded checkpoint, resumed
FSDP="-m torch.distributed.run --standalone --nproc_per_node=1 $TRAIN --parallel=fsdp --compile=auto --out_dir=$RUNS/fsdp"
step fsdp-half train.log 90 python3 $FSDP --max_iters=$((ITERS / 2))
step fsdp-resume train.log 60 python3 $FSDP --max_iters=$ITERS --init_from=resume
ls -la $RUNS/fsdp >> "$OUT/train.log" 2>&1
wait $TESTS

# 5. sample.py on the real run: the KV cache against nanoGPT's way (the whole context every token)
for cache in True False; do
  step "sample kv_cache=$cache" sample.log 40 python3 sample.py --out_dir=$RUNS/full --device=$DEVICE \
    --max_new_tokens=200 --num_samples=3 --kv_cache=$cache --start="ROMEO:"
done

# 2. bench.py, GPT-2 small, bf16: eager for every variant (test_cuda.py prints each one's SDPA kernels), then compiled
#    one variant per process so that a timeout keeps the variants already done
SIZE=""; [ "${SMALL:-0}" = 1 ] && SIZE="--n_layer=2 --n_head=2 --n_embd=64 --block_size=64"
step bench-eager bench.log 150 python3 bench.py --device=$DEVICE --dtype=bfloat16 --compile=False $SIZE \
  --rounds=1 --bench_iters=5 --generate=True --json_out=$OUT/bench_eager.json
for v in base noiseformer_v2 diff dint noiseformer_v1 symmetric dint_lowrank linear; do
  step "bench-compiled $v" bench_compiled.log 120 python3 bench.py --device=$DEVICE --dtype=bfloat16 \
    --compile=True $SIZE --attn_types=$v --rounds=1 --bench_iters=10 --json_out=$RUNS/bench_$v.json
  cat $RUNS/bench_$v.json >> "$OUT/bench_compiled.jsonl" 2>/dev/null; echo >> "$OUT/bench_compiled.jsonl"
done
echo "== done at $(( $(date +%s) - START ))s"
