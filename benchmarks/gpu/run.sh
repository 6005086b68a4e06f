#!/usr/bin/env bash
# The reference engine on one CUDA GPU: the embedded pair in bfloat16, every mode, c = 1..64.
#
# Written for a short device lease: one command, parts in order of importance, each under the
# time that is left (BUDGET_S), each writing its own results, so a part that fails or runs out of
# time costs only itself. Everything lands under $OUT/gpu (packed into $OUT/results.tgz after each
# part). Run from the repository root, with the machine's own python3 (torch with CUDA):
#
#     OUT=/tmp/gpu BUDGET_S=480 bash benchmarks/gpu/run.sh
#
# DEVICE=cpu DTYPE=float32 QUICK=1 runs the same parts small, on this CPU (a check of the script).
set -u
OUT=${OUT:?set OUT to a folder for the results}
R=$OUT/gpu
mkdir -p "$R"
DEV=${DEVICE:-cuda}
DT=${DTYPE:-bfloat16}
PY=${PY:-python3}
BUDGET=${BUDGET_S:-480}
QUICK=${QUICK:-0}
START=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

left() { echo $((BUDGET - ($(date +%s) - START))); }
pack() { tar -czf "$OUT/results.tgz" -C "$OUT" gpu; }
# part NAME MIN_SECONDS MAX_SECONDS CMD...: runs CMD (output in $R/NAME.log) for at most
# MAX_SECONDS (and the time left), if MIN_SECONDS are left
part() {
  local name=$1 need=$2 most=$3 t0 rc limit
  shift 3
  if [ "$(left)" -lt "$need" ]; then echo "=== $name: skipped, $(left) s left"; return; fi
  limit=$(left)
  [ "$limit" -gt "$most" ] && limit=$most
  echo "=== $name ($(left) s left, at most $limit s): $*"
  t0=$(date +%s)
  timeout "$limit" "$@" >"$R/$name.log" 2>&1
  rc=$?
  echo "=== $name: rc $rc in $(($(date +%s) - t0)) s"
  grep -v "it/s\]\|s/it\]" "$R/$name.log" | tail -n 25
  pack
}

if [ "$QUICK" = 1 ]; then
  C=1,4; CD=1,4; N="--max-new-tokens 16 --repeats 1"; AD="--per-domain 2 --max-new-tokens 16 --repeats 1 --extra-pairs 0"
else
  C=1,8,32,64; CD=1,8,32; N="--max-new-tokens 64 --repeats 2"; AD="--per-domain 4 --max-new-tokens 64 --repeats 2 --extra-pairs 2"
fi
P16=benchmarks/d2sd/prompts16.jsonl
B="$PY -m sglang_adaflash.cli.main bench --target embedded --drafter embedded --recovery-drafter embedded
   --device $DEV --threads 4 --waves 2 --warm-up full --quiet"

{
  date -u; nvidia-smi 2>&1 | head -n 15
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
  echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} >"$R/environment.txt" 2>&1
cat "$R/environment.txt"

# 1. which configurations run on this device at all (and their T=0 agreement with ar)
part smoke 30 90 $PY benchmarks/gpu/smoke.py --device "$DEV" --dtype "$DT" --out "$R/smoke.json"
MODES=$(sed -n 's/^modes that ran in every case: //p' "$R/smoke.log")
MODES=${MODES:-ar}
has() { case ",$MODES," in *",$1,"*) return 0 ;; esac; return 1; }
ALL=hf
for m in ar dflash adaflash d2sd; do has $m && ALL=$ALL,$m; done
echo "modes to benchmark: $ALL"

# 2. the tests marked gpu (FlashInfer's skip where the package is absent)
part gpu_tests 30 60 $PY -m pytest -p no:cacheprovider -o addopts="" -m gpu tests/gpu -q -rs

# 3. the main table: every mode, c = 1..64, in-domain prompts, bfloat16
# (one timed repeat after the full warm-up: two passes in all, as long as the first lease's two
# repeats after a short warm-up, 348 s)
part bench_bf16 60 420 $B --dtype "$DT" --prompts "$P16" --modes "$ALL" --concurrency $C $N --repeats 1 \
  --out "$R/bench_bf16"

# 4. where a step's time goes, per mode (host syncs, runtime calls, the profiler's top entries)
part profile 40 120 $PY benchmarks/gpu/profile_steps.py --device "$DEV" --dtype "$DT" --concurrency 1,8 --requests 8 \
  --max-new-tokens 32 --out "$R/profile.json"

# 5. losslessness on this device: float32, where a verify and a decode round alike (T=0 equality)
part equality_fp32 40 90 $B --dtype float32 --prompts "$P16" --modes "${ALL#hf,}" --concurrency 1,8 \
  --max-new-tokens 64 --repeats 1 --out "$R/equality_fp32"

# 6. D2SD's wide tree with both tree attentions (cascade in torch; one masked call)
if has d2sd; then
  for att in torch masked; do
    part "d2sd_auto_k4_w4_$att" 40 120 $B --dtype "$DT" --prompts "$P16" --modes ar,dflash,d2sd --concurrency $CD $N \
      --branch-drafter auto --tree-k 4 --branch-width 4 --tree-attention $att --out "$R/d2sd_auto_k4_w4_$att"
  done
  part d2sd_recovery_k4_w4 40 120 $B --dtype "$DT" --prompts "$P16" --modes dflash,d2sd --concurrency $CD $N \
    --tree-k 4 --branch-width 4 --out "$R/d2sd_recovery_k4_w4"
fi

# 7. adaptive verification (in-domain, math, mixed) against ar and dflash
part adaptive 60 300 $PY benchmarks/adaptive/run.py --device "$DEV" --dtype "$DT" --threads 4 --warm-up full --concurrency $C $AD \
  --out "$R/adaptive/results.json"

echo "done in $(($(date +%s) - START)) s"
pack
