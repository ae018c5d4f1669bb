#!/usr/bin/env bash
# The CUDA proof, in one device call (see BENCHMARKS.md and the issue notes for results):
#   1. every kernel against the CPU backend on fresh random inputs (cuda-check --wide),
#   2. compute-sanitizer memcheck and racecheck over the kernel checks,
#   3. the whole model with experts on the GPU against the CPU on every fixture, a
#      the demo model with bf16, q4_k and q8_0 experts (logits + greedy), and against transformers,
#   3b. exllamav3's EXL3 fixture: GPU vs CPU vs transformers, and every tier mode from exl3 records,
#   4. the GPU metrics a serving process exports (all in VRAM, and tiered), and the server's
#      greedy texts with GPU decode (batched) against the CPU's,
#   5. the kernels' register/spill report for sm_90 (nvcc -Xptxas -v).
# Runs where a prebuilt binary is at $BIN (default .device/glmflash-node) and a GPU exists.
#   [ONLY=step,step] e2e/cuda/device_check.sh [OUTDIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN="${BIN:-.device/glmflash-node}"
OUT="${1:-${OUT:-/tmp/device-out}}"
mkdir -p "$OUT"
fail=0
step() { echo; echo "== $*"; }
# ONLY=serve,speed runs those steps (kernels, sanitizer, model, tiers, exl3, cache, serve, speed, ptxas;
# tiers needs model). SANITIZE_ONLY=matvec,kda limits the sanitizer to those check groups,
# CHECK_ONLY the kernels step.
want() { [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
# NVRTC for the kernels: the toolkit's, else the one a Python package ships.
source e2e/cuda/nvrtc_path.sh
[ -n "$NVRTC_DIR" ] && echo "nvrtc from $NVRTC_DIR"
export GLMFLASH_KERNEL_CACHE="${GLMFLASH_KERNEL_CACHE:-/tmp/glmflash-kernel-cache}"

work="$(mktemp -d)"

tokens_of() { python3 -c "import json,sys;print(','.join(map(str,json.load(open(sys.argv[1]))['prompt'])))" "$1"; }
# A fixture's logits and 16 greedy tokens on the GPU against the CPU and its reference.json;
# leaves $work/NAME.cpu.json and $work/NAME.cuda.json for later steps.
check_fixture() {
  local fx=$1 name tok
  name=$(basename "$fx"); tok=$(tokens_of "$fx/reference.json")
  "$BIN" logits --model "$fx" --tokens "$tok" --greedy 16 > "$work/$name.cpu.json" 2>/dev/null || fail=1
  "$BIN" logits --model "$fx" --tokens "$tok" --greedy 16 --device cuda > "$work/$name.cuda.json" 2>"$work/$name.err" || { fail=1; tail -3 "$work/$name.err"; }
  # A failing device product falls back to the CPU (and says so once): that must not pass.
  if grep -q "device product failed" "$work/$name.err"; then echo "$name: a device product failed"; fail=1; fi
  grep -E "dense weights on the GPU|every routed expert in VRAM" "$work/$name.err" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-160
  python3 e2e/cuda/compare_logits.py "$work/$name.cuda.json" "$work/$name.cpu.json" --reference "$fx/reference.json" --name "$name" || fail=1
}
# A tiered run without --vram-host-copies must have copied VRAM victims down (with one or two VRAM
# slots every run evicts), else its identity proves nothing about the copy-down.
copied() {
  case "$1" in *--vram-host-copies*|*--mode\ exact*|*--mode\ fast*) ;;
    *) grep -qE "[1-9][0-9]* victims copied down" "$work/t.err" || { echo "$1: no VRAM victim was copied down"; fail=1; } ;;
  esac
}
# The tier modes on the GPU for MODEL and TOKENS (GREEDY steps) against REF (the untiered GPU run),
# over the packed STORE: `identical` runs nvme-exact (copy-down and --vram-host-copies, at 2 and 1
# VRAM slots) and exact, bit for bit; `kl` runs nvme (CPU lane) both ways and fast, within the KL bound.
tier_modes() {
  local model=$1 tokens=$2 greedy=$3 ref=$4 name=$5 store=$6 how=$7 args runs
  if [ "$how" = identical ]; then
    runs=("--mode nvme-exact --store $store --vram-slots 2 --ram-slots 3" \
          "--mode nvme-exact --store $store --vram-slots 1 --ram-slots 1" \
          "--mode nvme-exact --vram-host-copies --store $store --vram-slots 2 --ram-slots 3" \
          "--mode nvme-exact --vram-host-copies --store $store --vram-slots 1 --ram-slots 1" \
          "--mode exact")
  else
    runs=("--mode nvme --store $store --vram-slots 2 --ram-slots 3" \
          "--mode nvme --vram-host-copies --store $store --vram-slots 2 --ram-slots 3" "--mode fast")
  fi
  for args in "${runs[@]}"; do
    "$BIN" logits --model "$model" --tokens "$tokens" --greedy "$greedy" --device cuda $args > "$work/t.json" 2>"$work/t.err" || { fail=1; tail -3 "$work/t.err"; }
    copied "$args"
    if [ "$how" = identical ]; then
      python3 e2e/cuda/compare_logits.py "$work/t.json" "$ref" --identical --name "$name ${args%% --store*}" || fail=1
    else
      python3 e2e/cuda/compare_logits.py "$work/t.json" "$ref" --kl --name "$name ${args%% --store*} vs exact" || fail=1
    fi
  done
}
"$BIN" make-demo-model --out "$work/demo" >/dev/null 2>&1 || fail=1
demo_tokens=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20

if want kernels; then
step "kernels against the CPU backend (wide shapes)"
"$BIN" cuda-check --wide ${CHECK_ONLY:+--only "$CHECK_ONLY"} 2>&1 | tee "$OUT/cuda_check.txt" | tail -n 200 || fail=1
grep -q " 0 failed" "$OUT/cuda_check.txt" || fail=1

fi

if want sanitizer; then
step "compute-sanitizer"
for tool in memcheck racecheck; do
  if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool $tool --error-exitcode 9 "$BIN" cuda-check ${SANITIZE_ONLY:+--only "$SANITIZE_ONLY"} > "$OUT/sanitizer_$tool.txt" 2>&1
    rc=$?; echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.txt" | tail -1)"
    [ $rc -eq 0 ] || fail=1
  else echo "compute-sanitizer not found"; fi
done

fi

if want model || want tiers; then  # tiers compares against the model step's runs
step "whole model: experts on the GPU vs the CPU"
for fx in e2e/fixtures/tiny_*; do check_fixture "$fx"; done
for fmt in bf16 q4_k q8_0; do
  model="$work/demo"
  if [ $fmt != bf16 ]; then
    model="$work/demo_$fmt"
    "$BIN" convert-experts --model "$work/demo" --out "$model" --format $fmt >/dev/null 2>&1 || { echo "convert-experts $fmt failed"; fail=1; }
  fi
  "$BIN" logits --model "$model" --tokens $demo_tokens --greedy 24 > "$work/$fmt.cpu.json" 2>/dev/null || fail=1
  "$BIN" logits --model "$model" --tokens $demo_tokens --greedy 24 --device cuda > "$work/$fmt.cuda.json" 2>"$work/$fmt.err" || fail=1
  if grep -q "device product failed" "$work/$fmt.err"; then echo "demo $fmt: a device product failed"; fail=1; fi
  python3 e2e/cuda/compare_logits.py "$work/$fmt.cuda.json" "$work/$fmt.cpu.json" --name "demo model, $fmt experts" || fail=1
done
# Prompt chunks long enough for the GEMM paths (bf16 dense products from 64 tokens, row-format
# MoE slots from 32 picks of one expert: 400 tokens x top-4 over 32 experts), GPU vs CPU, with
# the prompt GEMMs (the default) and without (GLMFLASH_PROMPT_GEMM=0).
long_tokens=$(python3 -c "print(','.join(str(1 + i * 7 % 509) for i in range(400)))")
for fmt in bf16 q4_k; do
  model="$work/demo"; [ $fmt = bf16 ] || model="$work/demo_$fmt"
  "$BIN" logits --model "$model" --tokens "$long_tokens" --greedy 8 > "$work/long.cpu.json" 2>/dev/null || fail=1
  for gemm in 1 0; do
    GLMFLASH_PROMPT_GEMM=$gemm "$BIN" logits --model "$model" --tokens "$long_tokens" --greedy 8 --device cuda \
      > "$work/long.cuda.json" 2>"$work/long.err" || { fail=1; tail -3 "$work/long.err"; }
    if grep -q "device product failed" "$work/long.err"; then echo "demo $fmt long: a device product failed"; fail=1; fi
    python3 e2e/cuda/compare_logits.py "$work/long.cuda.json" "$work/long.cpu.json" \
      --name "demo $fmt, 400 tokens, GEMM=$gemm" || fail=1
    [ $gemm = 0 ] || cp "$work/long.cuda.json" "$work/long.$fmt.cuda.json"
  done
done

fi

if want tiers; then
step "tiers on the GPU: nvme-exact and exact give the untiered GPU bits; nvme (CPU lane) KL"
for fmt in bf16 q4_k; do
  model="$work/demo"; [ $fmt = bf16 ] || model="$work/demo_$fmt"
  store="$(mktemp -d -p "$PWD" .store.XXXX)"
  "$BIN" pack-store --model "$model" --store "$store/s" >/dev/null 2>&1 || { echo "pack-store failed"; fail=1; }
  tier_modes "$model" "$demo_tokens" 24 "$work/$fmt.cuda.json" "$fmt" "$store/s" identical
  # A 400-token prompt: slots of 32+ picks through cuBLAS, tiered as untiered.
  for down in "" --vram-host-copies; do
    args="--mode nvme-exact $down --store $store/s --vram-slots 2 --ram-slots 3"
    "$BIN" logits --model "$model" --tokens "$long_tokens" --greedy 8 --device cuda $args > "$work/t.json" 2>"$work/t.err" || { fail=1; tail -3 "$work/t.err"; }
    copied "$args"
    python3 e2e/cuda/compare_logits.py "$work/t.json" "$work/long.$fmt.cuda.json" --identical --name "$fmt 400 tokens nvme-exact $down" || fail=1
  done
  tier_modes "$model" "$demo_tokens" 24 "$work/$fmt.cuda.json" "$fmt" "$store/s" kl
  rm -rf "$store"
done

fi

if want exl3; then
step "EXL3 (exllamav3's checkpoint): GPU vs CPU vs transformers; tiers on the GPU from exl3 records"
for fx in e2e/fixtures/exl3/exl3_*; do
  check_fixture "$fx"; name=$(basename "$fx"); tok=$(tokens_of "$fx/reference.json")
  store="$(mktemp -d -p "$PWD" .store.XXXX)"
  "$BIN" pack-store --model "$fx" --store "$store/s" >/dev/null 2>&1 || { echo "pack-store $name failed"; fail=1; }
  tier_modes "$fx" "$tok" 16 "$work/$name.cuda.json" "$name" "$store/s" identical
  tier_modes "$fx" "$tok" 16 "$work/$name.cuda.json" "$name" "$store/s" kl
  rm -rf "$store"
done

fi

if want cache; then
step "KV/pool caches stored as bf16 and f16: the GPU against the CPU at each dtype; q8_0 dense weights"
"$BIN" convert-experts --model "$work/demo" --out "$work/demo_q8dense" --format q4_k --dense-format q8_0 >/dev/null 2>&1 \
  || { echo "convert-experts --dense-format q8_0 failed"; fail=1; }
for model in demo demo_q8dense; do
  for dt in f32 bf16 f16; do
    "$BIN" logits --model "$work/$model" --tokens $demo_tokens --greedy 24 --cache-dtype $dt > "$work/c.cpu.json" 2>/dev/null || fail=1
    "$BIN" logits --model "$work/$model" --tokens $demo_tokens --greedy 24 --cache-dtype $dt --device cuda > "$work/c.cuda.json" 2>"$work/c.err" || { fail=1; tail -3 "$work/c.err"; }
    if grep -q "device product failed" "$work/c.err"; then echo "$model $dt: a device product failed"; fail=1; fi
    python3 e2e/cuda/compare_logits.py "$work/c.cuda.json" "$work/c.cpu.json" --name "$model, $dt caches" || fail=1
    [ $dt = f32 ] && cp "$work/c.cpu.json" "$work/c.f32.json"
    [ $dt = f32 ] || python3 e2e/cuda/compare_logits.py "$work/c.cpu.json" "$work/c.f32.json" --kl --name "$model $dt vs f32 (cpu)" || fail=1
  done
done

fi

if want serve; then
step "GPU metrics scraped from a serving process: all in VRAM, and tiered (nvme-exact, RAM registered with CUDA)"
store="$(mktemp -d -p "$PWD" .store.XXXX)"
"$BIN" pack-store --model "$work/demo" --store "$store/s" >/dev/null 2>&1 || { echo "pack-store failed"; fail=1; }
for args in "" "--mode nvme-exact --store $store/s --vram-slots 2 --ram-slots 8"; do
  "$BIN" serve --model "$work/demo" --device cuda --host 127.0.0.1 --port 30111 $args > "$work/serve.log" 2>&1 &
  pid=$!
  python3 e2e/cuda/scrape_gpu_metrics.py --url http://127.0.0.1:30111 --name "serve ${args:-(all in VRAM)}" ${args:+--registered} || { fail=1; tail -5 "$work/serve.log"; }
  kill -TERM $pid; wait $pid 2>/dev/null
done

fi

if want serve; then
step "the server's GPU forward (GpuDecoder: prompts and batched decode) gives the CPU's greedy text"
complete() {  # port prompt -> text of a greedy completion of 32 tokens
  python3 - "$1" "$2" <<'PY'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(240):
    try:
        urllib.request.urlopen(url + "/ready", timeout=2); break
    except Exception:
        time.sleep(0.5)
body = json.dumps({"model": "glm-5.3-flash", "prompt": sys.argv[2], "max_tokens": 32, "temperature": 0}).encode()
req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]))
PY
}
run=0
# nvme: RAM-resident decode picks on the CPU lane, so the GPU forward's rows come down for them.
for args in "--device cpu" "--device cuda" "--device cuda --gpu-forward false" \
            "--device cuda --mode nvme-exact --store $store/s --vram-slots 2 --ram-slots 8" \
            "--device cuda --mode nvme --store $store/s --vram-slots 2 --ram-slots 8"; do
  run=$((run + 1))
  [ "${args#*--store}" != "$args" ] && [ ! -d "$store/s" ] && { "$BIN" pack-store --model "$work/demo" --store "$store/s" >/dev/null 2>&1 || true; }
  "$BIN" serve --model "$work/demo" --host 127.0.0.1 --port 30112 $args > "$work/serve2.log" 2>&1 &
  pid=$!
  # Three requests at once, so the GPU decoder steps a batch of sequences together.
  for p in "the quick brown fox" "hello there" "one two three four five six"; do complete 30112 "$p" > "$work/text.$(echo $p | md5sum | cut -c1-8)" & done
  wait $(jobs -p | grep -v "^$pid$") 2>/dev/null
  cat "$work"/text.* > "$work/texts.$run"; rm -f "$work"/text.*
  grep -E "sequences run on the GPU|caches live on the GPU|no room" "$work/serve2.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-200
  kill -TERM $pid; wait $pid 2>/dev/null
  if [ -s "$work/texts.$run" ] && cmp -s "$work/texts.1" "$work/texts.$run"; then echo "${args%% --store*}: same greedy texts as the CPU"
  else echo "${args%% --store*}: DIFFERENT texts"; diff "$work/texts.1" "$work/texts.$run"; fail=1; fi
done
rm -rf "$store"

fi

if want speed; then
step "speed: the same random model on the CPU (16 cores) and on the GPU"
for dev in cpu cuda; do
  "$BIN" bench --device $dev --hidden 2048 --layers 4 --experts 32 --expert-width 512 --top-k 8 \
    --expert-format q4_k --prompt-tokens 512 --decode-tokens 64 > "$OUT/bench_$dev.json" 2>"$work/bench_$dev.err" || { fail=1; tail -3 "$work/bench_$dev.err"; }
  python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[2], {k:d[k] for k in ('device','decoder','prefill_tok_s','read_bandwidth_gb_s')}, d['decode'])" "$OUT/bench_$dev.json" $dev || fail=1
done

fi

if want ptxas; then
step "kernel resources, sm_90"
for f in kernels/cuda/*.cu; do
  nvcc -cubin -arch=sm_90 -std=c++17 -Ikernels/cuda -Xptxas -v -o /dev/null "$f" 2>&1 \
    | grep -E "Compiling entry|registers|spill" | sed 's/ptxas info    : //' | paste - - - 2>/dev/null | cut -c1-220
done > "$OUT/ptxas.txt"
grep -c "0 bytes spill stores" "$OUT/ptxas.txt" | xargs echo "entries without spills:"; grep -v " 0 bytes spill stores" "$OUT/ptxas.txt" | head -5
fi

echo; echo "device check: $([ $fail -eq 0 ] && echo PASSED || echo FAILED)"
exit $fail
