#!/usr/bin/env bash
# Where a GPU prefill's time goes, all in VRAM, at GLM-5.3-Flash width (issues 16, 17), for
# each checkpoint of MODELS: `exl3` the random EXL3 checkpoint of e2e/exl3/peer_bench.sh (8
# layers), `bf16` the random checkpoint of e2e/peers/make_checkpoint.py --flash (1 dense + 3
# MoE layers of 64 experts: the one llama.cpp runs in e2e/peers), `q4_k` the same with its
# experts converted to q4_k records. For each: `bench --model` prefill tok/s at each PROMPTS
# length (the second of two prompts, warm) and the decode tok/s of the same run; the
# forward's phases at PROFILE_PROMPT tokens (GLMFLASH_GPU_PROFILE=1); under ncu every kernel
# of one prefill of PROFILE_PROMPT tokens (the first NCU_LAUNCHES launches, grouped by kernel
# up to the first forward's end).
#   e2e/cuda/prefill_profile.sh          # env: BIN, OUT, PEER_WORK, MODELS ("exl3"), PROMPTS
#                                        # ("512 2048 8192"), PROFILE_PROMPT (2048),
#                                        # NCU_LAUNCHES (0: no ncu), BUDGET_S (540), GEMM_AB=1 (each
#                                        # prompt also with GLMFLASH_PROMPT_GEMM=0: no cuBLAS
#                                        # for bf16 dense and row-format MoE prompt products)
set -u
cd "$(dirname "$0")/../.."
BIN=${BIN:-.device/glmflash-node}
OUT=${OUT:-$PWD/peer_out}
W=${PEER_WORK:-/root/peerw}
BUDGET=${BUDGET_S:-540}
T0=$(date +%s)
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/prefill.txt") 2>&1
source e2e/cuda/nvrtc_path.sh
export GLMFLASH_KERNEL_CACHE=${GLMFLASH_KERNEL_CACHE:-$W/kernel-cache}
log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
cap() { local l=$(( $(left) - 10 )); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 1 ? l : 1 )); }

# The checkpoint of kind $1, made once in $W: its directory on stdout.
model() {
  case "$1" in
    exl3)
      OUT=$OUT PEER_WORK=$W BUDGET_S=$(cap 200) bash e2e/exl3/peer_bench.sh checkpoint >/dev/null || return 1
      echo "$W/ck_flash" ;;
    bf16)
      [ -f "$W/ck_rows/.done" ] || { python3 e2e/peers/make_checkpoint.py --out "$W/ck_rows" --flash --experts 64 \
        > "$OUT/make_rows.log" 2>&1 && touch "$W/ck_rows/.done"; } || return 1
      echo "$W/ck_rows" ;;
    q4_k)
      local src; src=$(model bf16) || return 1
      [ -f "$W/ck_q4k/.done" ] || { "$BIN" convert-experts --model "$src" --out "$W/ck_q4k" --format q4_k \
        > "$OUT/convert_q4k.log" 2>&1 && touch "$W/ck_q4k/.done"; } || return 1
      echo "$W/ck_q4k" ;;
    *) echo "MODELS: exl3, bf16 or q4_k, not $1" >&2; return 1 ;;
  esac
}
pp=${PROFILE_PROMPT:-2048}
for kind in ${MODELS:-exl3}; do
  ck=$(model "$kind") || { log "$kind: no checkpoint"; continue; }
  for p in ${PROMPTS:-512 2048 8192}; do
    # GEMM_AB=1: each prompt with GLMFLASH_PROMPT_GEMM=0 and =1, one after the other.
    gemms=${GEMM_AB:+0 1}
    for gemm in ${gemms:-${GLMFLASH_PROMPT_GEMM:-1}}; do
      log "$kind: bench --model, prompt $p, GLMFLASH_PROMPT_GEMM=$gemm"
      GLMFLASH_PROMPT_GEMM=$gemm timeout -k 5 "$(cap 120)" "$BIN" bench --model "$ck" --device cuda --prompt-tokens "$p" \
        --streams 1 --decode-tokens 16 > "$W/prefill.json" 2> "$W/prefill.log"
      rc=$?; log "rc=$rc"; [ $rc = 0 ] || tail -3 "$W/prefill.log"
      python3 -c "import json;d=json.load(open('$W/prefill.json'));print('$kind gemm=$gemm prefill', d['prefill_tokens'], 'tok/s %.1f' % d['prefill_tok_s'], '| decode', [round(r['tok_s'], 1) for r in d['decode']])" 2>/dev/null
    done
  done
  log "$kind: phases, prompt $pp"
  GLMFLASH_GPU_PROFILE=1 timeout -k 5 "$(cap 120)" "$BIN" bench --model "$ck" --device cuda --prompt-tokens "$pp" --streams 1 \
    --decode-tokens 4 > "$W/phases.json" 2> "$W/phases.log"
  log "rc=$?"; python3 -c "
import json; d=json.load(open('$W/phases.json')); p=d.get('prefill_gpu_profile_ms', {})
print('$kind prefill %d tok/s %.1f (profiled)' % (d['prefill_tokens'], d['prefill_tok_s']))
for k, (ms, n) in sorted(p.items(), key=lambda kv: -kv[1][0]): print('  %-16s %9.2f ms %5d calls' % (k, ms, n))"
  n=${NCU_LAUNCHES:-0}
  if [ "$n" -gt 0 ] && command -v ncu >/dev/null; then
    log "$kind: ncu, the first $n launches (prompt $pp)"
    timeout -k 5 "$(cap 300)" ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base -c "$n" \
      "$BIN" bench --model "$ck" --device cuda --prompt-tokens "$pp" --streams 1 --decode-tokens 1 > "$W/ncu.csv" 2> "$W/ncu.log"
    log "ncu rc=$?"
    python3 e2e/exl3/ncu_summary.py "$W/ncu.csv" --until stream_mean | head -25
    gzip -c "$W/ncu.csv" > "$OUT/prefill_ncu_$kind.csv.gz"
  fi
done
log "done"
