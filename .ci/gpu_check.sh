#!/usr/bin/env bash
# The GPU checklist in one script, for a short run on a CUDA machine (nothing can be downloaded there).
#   bash .ci/gpu_check.sh --prepare            # here, once: gpu/ (ignored) gets the data and tokenizer files
#   bash .ci/gpu_check.sh OUT_DIR [BUDGET_SECONDS]   # there, with gpu/ carried along
# PARTS picks what runs, in this order (default: all but noise): tests bench compiled profile train sample noise.
#   tests     tests/test_cuda.py (every variant against float64 on cuda, KV cache, train.py resume)
#   bench     bench.py eager, GPT-2 small, bf16, every variant, with generation tokens/s
#   compiled  bench.py compiled, one process per variant (a timeout keeps the ones done; VARIANTS picks them)
#   profile   bench.py --profile for base and noiseformer_v2 (where NoiseFormer's extra time goes)
#   train     train.py compiled on Tiny Shakespeare BPE, a stop + resume, FSDP2 on one GPU (torchrun)
#   sample    sample.py on that run's checkpoint, with and without the KV cache
#   noise     the attention-noise study at sequence 32 and 64 (NOISE_LENGTHS), NOISE_JOBS runs at a time
# Every step is time-boxed (BUDGET, default 480 s, in all) and appends to OUT_DIR/*.log (at most 8 files
# come back from the device), so a step that fails or runs out of time leaves the others' results.
# SMALL=1 DEVICE=cpu shrinks every size: a dry run here. First results: docs/benchmarks.md.
set -u
if [ "${1:-}" = --prepare ]; then
  mkdir -p gpu/data/shakespeare_bpe gpu/tiktoken gpu/nanoGPT && cp ../shared/tiktoken/* gpu/tiktoken/ || exit 1
  cp ../shared/ref/nanoGPT/{bench.py,model.py,configurator.py} gpu/nanoGPT/ || exit 1  # the speed anchor
  grep -qx '/gpu/' .git/info/exclude 2>/dev/null || echo '/gpu/' >> .git/info/exclude
  TIKTOKEN_CACHE_DIR=$PWD/gpu/tiktoken python3 - <<'EOF'
import json, numpy as np, tiktoken
enc = tiktoken.get_encoding("gpt2")
text = open('../shared/data/tinyshakespeare/input.txt').read()
split = int(len(text) * 0.9)
ids = [np.array(enc.encode_ordinary(part), dtype=np.uint16) for part in (text[:split], text[split:])]
for name, a in zip(('train', 'val'), ids):
    a.tofile(f'gpu/data/shakespeare_bpe/{name}.bin')
json.dump({"tokenizer": "gpt2", "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "dtype": "uint16",
           "train_tokens": len(ids[0]), "val_tokens": len(ids[1]), "source": "Tiny Shakespeare (GPU check)"},
          open('gpu/data/shakespeare_bpe/meta.json', 'w'))
print(f"gpu/data/shakespeare_bpe: {len(ids[0]):,} + {len(ids[1]):,} tokens; carry 'gpu' to the device")
EOF
  exit
fi
OUT=${1:?OUT_DIR}; BUDGET=${2:-480}; DEVICE=${DEVICE:-cuda}; PARTS=${PARTS:-tests bench compiled profile train sample}
START=$(date +%s)
export PYTHONUNBUFFERED=1 WANDB_MODE=offline TIKTOKEN_CACHE_DIR=$PWD/gpu/tiktoken OMP_NUM_THREADS=4
DATA=$PWD/gpu/data/shakespeare_bpe
RUNS=/tmp/gpu-runs; rm -rf $RUNS; mkdir -p $RUNS "$OUT"
if [ "${SMALL:-0}" = 1 ]; then
  MODEL="--n_layer=2 --n_head=2 --n_embd=64 --batch_size=2 --block_size=64"; ITERS=20; COMPILE=False
  SIZE="--n_layer=2 --n_head=2 --n_embd=64 --block_size=64"
else
  MODEL="--batch_size=12 --block_size=1024"; ITERS=100; COMPILE=True; SIZE=""
fi
BENCH="bench.py --device=$DEVICE --dtype=bfloat16 $SIZE"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
wants() { [[ " $PARTS " == *" $1 "* ]]; }
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

wants tests && step tests tests.log 150 python3 -m pytest tests/test_cuda.py -q -rA -p no:cacheprovider -n 4

wants bench && step bench-eager bench.log 150 python3 $BENCH --compile=False --rounds=1 --bench_iters=5 \
  --generate=True --json_out=$OUT/bench_eager.json

if wants compiled; then
  # by default every registered variant, these four first (a timeout keeps the ones done)
  ALL=$(python3 -c "from model import ATTENTION_TYPES as A; first = ['base', 'noiseformer_v2', 'diff', 'dint']
print(*first, *(a for a in A if a not in first))")
  for v in ${VARIANTS:-$ALL}; do
    step "bench-compiled $v" bench.log 90 python3 $BENCH --compile=True --attn_types=$v --rounds=1 \
      --bench_iters=10 --json_out=$RUNS/bench_$v.json
    cat $RUNS/bench_$v.json >> "$OUT/bench_compiled.jsonl" 2>/dev/null && echo >> "$OUT/bench_compiled.jsonl"
  done
fi

wants profile && step profile profile.log 60 python3 $BENCH --compile=False --attn_types=base,noiseformer_v2 \
  --rounds=1 --bench_iters=3 --profile=True

# a short real run, compiled: no recompiles / graph breaks after warm-up, loss falling; the same run
# stopped halfway and resumed (CUDA runs agree to rounding, not bitwise: docs/benchmarks.md)
TRAIN="train.py config/train_gpt2.py --dataset=$DATA --device=$DEVICE --dtype=bfloat16 --compile=$COMPILE \
  --wandb_log=False $MODEL --gradient_accumulation_steps=1 --warmup_iters=10 --lr_decay_iters=$ITERS \
  --eval_interval=$((ITERS / 2)) --eval_iters=5 --log_interval=5"
if wants train; then
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
  # FSDP2 on one GPU through torchrun, with its sharded checkpoint, resumed (compile stays off under fsdp)
  FSDP="-m torch.distributed.run --standalone --nproc_per_node=1 $TRAIN --parallel=fsdp --compile=auto --out_dir=$RUNS/fsdp"
  step fsdp-half train.log 90 python3 $FSDP --max_iters=$((ITERS / 2))
  step fsdp-resume train.log 60 python3 $FSDP --max_iters=$ITERS --init_from=resume
fi

# sample.py: the KV cache against nanoGPT's way (the whole context every token); needs the train part
if wants sample; then
  for cache in True False; do
    step "sample kv_cache=$cache" sample.log 40 python3 sample.py --out_dir=$RUNS/full --device=$DEVICE \
      --max_new_tokens=200 --num_samples=3 --kv_cache=$cache --start="ROMEO:"
  done
fi
# the attention-noise study's longer lengths (docs/recall.md), each tuned there (the CPU study tunes at
# length 16 only), NOISE_JOBS runs at a time on the one GPU (compare.py shares it round); not in the
# default PARTS: PARTS=noise. What comes back: noise.log, and
# noise.tgz with every run's metrics, recall and attention results and the report (no checkpoints)
# (its runs stay in gpu/noise-runs, which a later call on the same machine continues from)
if wants noise; then
  for T in ${NOISE_LENGTHS:-32 64}; do
    [ -d data/mqar-noise$T ] || python3 data/mqar/prepare.py --num_kv_pairs 4 --seq_len $T --out_dir data/mqar-noise$T \
      >> "$OUT/noise.log" 2>&1
    step "noise study, length $T" noise.log 600 python3 compare.py config/compare_noise.py \
      --grid="--dataset=mqar-noise$T --block_size=$T" --tune_at= --out_dir=gpu/noise-runs --jobs=${NOISE_JOBS:-8}
  done
  tar -czf "$OUT/noise.tgz" -C gpu --exclude='*.pt' noise-runs 2>> "$OUT/noise.log"
fi
echo "== done at $(( $(date +%s) - START ))s"
