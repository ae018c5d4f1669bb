#!/bin/bash
# Decode speed of exllamav3 1.6.5 (the peer) and of glmflash on the same random EXL3 checkpoint at
# GLM-5.3-Flash width, on one CUDA machine, in phases that each fit one device call (see
# e2e/exl3/README.md, "Peer decode benchmark"):
#
#   bash e2e/exl3/peer_bench.sh build [WAIT_S]   install the wheels; JIT-build exllamav3's extension in
#                                                the background (unless .device/ext/exllamav3_ext.so is
#                                                carried), wait up to WAIT_S (default 540) and save the
#                                                built .so as $OUT/ext.so.gz.partNN; a later `build` on a
#                                                still-warm machine resumes waiting for the same build
#   bash e2e/exl3/peer_bench.sh run              checkpoint (make_random_exl3.py --flash), exllamav3's
#                                                Generator at each batch size, glmflash `bench --model`
#                                                (GpuDecoder in-process, each batch size; with GLMFLASH_GPU_PROFILE
#                                                set, its phase profile) and `serve` + streaming client
#                                                (GpuDecoder, each batch size), then a summary
#   bash e2e/exl3/peer_bench.sh profile          checkpoint, then where glmflash's decode time goes: `bench --model`
#                                                plain and with GLMFLASH_GPU_PROFILE (phases), every kernel's
#                                                duration under ncu (ncu.csv; exllamav3's too, exl3_ncu.csv, when its
#                                                extension is there), and the CPU lane's EXL3 products
#                                                on all cores if $EXL3_TEST (the `exl3` test binary) is there
#   bash e2e/exl3/peer_bench.sh checkpoint       only the checkpoint ($PEER_WORK/ck_flash)
#   bash e2e/exl3/peer_bench.sh all              build, then run if the budget leaves time
#
# Needs (repo-relative): .whl/exl3/*.whl (see README), the glmflash binary at $BIN (default
# .device/glmflash-node) for the glmflash half; optional .device/ext/exllamav3_ext.so (skips the JIT).
# Env: OUT (default ./peer_out), BUDGET_S (whole call, default 560), LAYERS (8), EXPERTS (64),
# BATCHES (1,4), PROMPT (32), WARMUP (16), STEPS (128), PREFILL (512,8192: prompt lengths whose prefill
# both engines time; empty: none), PEER_WORK (/root/peerw), SKIP (exl3,glmflash),
# PRESET (--flash; --small), DEVICE (cuda; cpu: with --small, a CPU smoke test of the script),
# SERVE_ARGS (more `serve` flags, e.g. `--mode fast`: the experts in RAM on the CPU lane).
# Results in $OUT: peer_bench.json (summary), exl3.json, glmflash_bench.json, glmflash_serve.json,
# bytes.json, log.txt and every step's own log; each step is time-bounded and writes what it has.
set -u
MODE=${1:?build|run|all}
REPO=$(pwd)
W=${PEER_WORK:-/root/peerw}
OUT=${OUT:-$REPO/peer_out}
BIN=${BIN:-.device/glmflash-node}
BUDGET=${BUDGET_S:-560}
T0=$(date +%s)
mkdir -p "$W" "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export NVIDIA_TF32_OVERRIDE=0 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=$W/torch_ext
export PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH}
# The built extension carried gzipped (`cat ext.so.gz.part* > .device/ext.so.gz`: 16 MB, not 25.6).
if [ ! -f "$REPO/.device/ext/exllamav3_ext.so" ] && [ -f "$REPO/.device/ext.so.gz" ]; then
  mkdir -p "$REPO/.device/ext" && gunzip -c "$REPO/.device/ext.so.gz" > "$REPO/.device/ext/exllamav3_ext.so"
fi
if [ -f "$REPO/.device/ext/exllamav3_ext.so" ]; then export PYTHONPATH=$REPO/.device/ext:$PYTHONPATH; fi
export GLMFLASH_KERNEL_CACHE=${GLMFLASH_KERNEL_CACHE:-$W/kernel-cache}
source e2e/cuda/nvrtc_path.sh

log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# cap CAP_S: the step's timeout, CAP_S or what the budget leaves (minus a reserve for the summary)
cap() { local l=$(( $(left) - 15 )); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 1 ? l : 1 )); }
skip() { [[ ",${SKIP:-}," == *",$1,"* ]]; }

install_wheels() {
  [ -f "$W/site/.installed" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
    .whl/exl3/*.whl && touch "$W/site/.installed"
}

built_so() { ls "$TORCH_EXTENSIONS_DIR"/exllamav3_ext/exllamav3_ext*.so 2>/dev/null | head -1; }

build() {
  local wait=${1:-540}
  install_wheels || { log "wheel install FAILED (is .whl/exl3 carried?)"; return 1; }
  if [ -f "$REPO/.device/ext/exllamav3_ext.so" ]; then log "prebuilt extension carried: no JIT"; return 0; fi
  if [ -n "$(built_so)" ] && [ -f "$W/build.done" ]; then log "extension already built: $(built_so)"; else
    if [ -f "$W/build.pid" ] && kill -0 "$(cat "$W/build.pid")" 2>/dev/null; then
      log "JIT build already running (pid $(cat "$W/build.pid")), waiting"
    else
      rm -f "$W/build.done"
      log "JIT build of exllamav3_ext in the background (log: build.log)"
      setsid nohup bash -c "python3 -c 'import exllamav3.ext as e; print(e.exllamav3_ext.__file__)' \
        && touch '$W/build.done'" > "$W/build.log" 2>&1 < /dev/null &
      echo $! > "$W/build.pid"
    fi
    local deadline=$(( $(date +%s) + $(cap "$wait") ))
    while kill -0 "$(cat "$W/build.pid")" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    cp "$W/build.log" "$OUT/build.log"
    if [ ! -f "$W/build.done" ]; then
      kill -0 "$(cat "$W/build.pid")" 2>/dev/null && log "JIT build still running: call build again" \
        || { log "JIT build FAILED"; tail -30 "$W/build.log"; }
      return 1
    fi
    log "JIT build done"
  fi
  local so; so=$(built_so)
  gzip -1 -c "$so" > "$W/ext.so.gz" && split -b 15M -d "$W/ext.so.gz" "$OUT/ext.so.gz.part" \
    && log "extension saved: $(stat -c %s "$so") bytes -> $OUT/ext.so.gz.part* (cat | gunzip > .device/ext/exllamav3_ext.so)"
}

checkpoint() {
  local ck=$W/ck_flash L=${LAYERS:-8} E=${EXPERTS:-64}
  local args="${PRESET:---flash} --layers $L --experts $E"
  if [ "$(cat "$ck/.args" 2>/dev/null)" = "$args" ]; then log "checkpoint reused: $ck"; else
    log "checkpoint: make_random_exl3.py $args"
    timeout "$(cap 180)" python3 e2e/exl3/make_random_exl3.py --out "$ck" $args > "$OUT/make_ckpt.log" 2>&1 \
      && echo "$args" > "$ck/.args"
    log "checkpoint rc=$?: $(tail -1 "$OUT/make_ckpt.log")"
  fi
  cp "$ck/bytes.json" "$OUT/bytes.json" 2>/dev/null || { log "no checkpoint"; return 1; }
}

profile() {
  local ck=$W/ck_flash
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  checkpoint || return 1
  [ -x "$BIN" ] || { log "no glmflash binary at $BIN"; return 1; }
  local b=(bench --model "$ck" --device cuda --prompt-tokens "${PROMPT:-32}" --streams "${BATCHES:-1,4}")
  log "bench --model (plain)"
  timeout -k 10 "$(cap 150)" "$BIN" "${b[@]}" --decode-tokens "${STEPS:-128}" > "$OUT/bench.json" 2> "$OUT/bench.log"
  log "rc=$?"; python3 -c "import json;[print(r) for r in json.load(open('$OUT/bench.json'))['decode']]"
  log "bench --model, GLMFLASH_GPU_PROFILE=1"
  GLMFLASH_GPU_PROFILE=1 timeout -k 10 "$(cap 150)" "$BIN" "${b[@]}" --decode-tokens 32 > "$OUT/bench_profile.json" 2> "$OUT/bench_profile.log"
  log "rc=$?"; python3 -c "import json;[print(r) for r in json.load(open('$OUT/bench_profile.json'))['decode']]"
  if command -v ncu >/dev/null; then
    log "ncu: every kernel's duration (prompt 8, 1 stream, 2 + 6 decode steps)"
    timeout -k 10 "$(cap 240)" ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      "$BIN" bench --model "$ck" --device cuda --prompt-tokens 8 --streams 1 --decode-tokens 6 \
      > "$OUT/ncu.csv" 2> "$OUT/ncu.log"
    log "ncu rc=$?: $(grep -c gpu__time_duration "$OUT/ncu.csv") kernels"; gzip -f "$OUT/ncu.csv"
    if [ -f "$REPO/.device/ext/exllamav3_ext.so" ] || [ -f "$W/build.done" ]; then
      install_wheels
      log "ncu: exllamav3's kernels (prompt 8, 1 stream, 2 + 6 decode steps)"
      timeout -k 10 "$(cap 200)" ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        python3 e2e/exl3/peer_bench.py exl3 --model "$ck" --out "$OUT/exl3_ncu_run.json" --batches 1 \
        --prompt-len 8 --warmup 2 --steps 6 --time-limit 60 > "$OUT/exl3_ncu.csv" 2> "$OUT/exl3_ncu.log"
      log "ncu rc=$?: $(grep -c gpu__time_duration "$OUT/exl3_ncu.csv") kernels"; gzip -f "$OUT/exl3_ncu.csv"
    fi
  fi
  if [ -x "${EXL3_TEST:-}" ]; then
    for t in 1 4 16; do
      log "CPU lane, RAYON_NUM_THREADS=$t"
      RAYON_NUM_THREADS=$t timeout "$(cap 120)" "$EXL3_TEST" one_row_product_throughput --ignored --nocapture 2>&1 \
        | grep -E "bpw|test result" | tee -a "$OUT/cpu_lane.txt"
    done
  fi
  ls -la "$OUT"
}

run() {
  local ck=$W/ck_flash
  local opts=(--batches "${BATCHES:-1,4}" --prompt-len "${PROMPT:-32}" --warmup "${WARMUP:-16}" --steps "${STEPS:-128}")
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
  install_wheels || log "wheel install FAILED: the exllamav3 half will fail"
  checkpoint || return 1
  local vocab; vocab=$(python3 -c "import json;print(json.load(open('$ck/bytes.json'))['vocab'])")

  if ! skip exl3 && [ ! -f "$REPO/.device/ext/exllamav3_ext.so" ] && [ ! -f "$W/build.done" ]; then
    log "no exllamav3 extension (carry .device/ext or run build first): skipping the exllamav3 half"
  elif ! skip exl3; then
    log "exllamav3 Generator: ${opts[*]}"
    timeout -k 10 "$(cap 300)" python3 e2e/exl3/peer_bench.py exl3 --model "$ck" --out "$OUT/exl3.json" "${opts[@]}" \
      --prefill "${PREFILL-512,8192}" --time-limit 90 > "$OUT/exl3.log" 2>&1
    log "exllamav3 rc=$?"; grep "^\[exl3\]" "$OUT/exl3.log" | cut -c1-400; tail -5 "$OUT/exl3.log"
  fi

  if ! skip glmflash; then
    [ -x "$BIN" ] || { log "no glmflash binary at $BIN: skipping its half"; summary; return 1; }
    "$BIN" --version | tee "$OUT/glmflash_version.txt"
    log "glmflash bench --model (GpuDecoder in-process, all experts in VRAM)"
    timeout -k 10 "$(cap 200)" "$BIN" bench --model "$ck" --device "${DEVICE:-cuda}" --prompt-tokens "${PROMPT:-32}" \
      --streams "${BATCHES:-1,4}" \
      --decode-tokens "${STEPS:-128}" > "$W/bench.json" 2> "$OUT/glmflash_bench.log"
    log "glmflash bench rc=$?"; tail -3 "$OUT/glmflash_bench.log" | cut -c1-300
    # Prefill at each PREFILL length: one sequence, its prompt in the engine's chunks (bench's
    # prefill_tok_s; bench runs a warm-up prefill of its own first).
    local pre=()
    for n in $(echo "${PREFILL-512,8192}" | tr ',' ' '); do
      log "glmflash bench --model: prefill of $n tokens"
      timeout -k 10 "$(cap 120)" "$BIN" bench --model "$ck" --device "${DEVICE:-cuda}" --prompt-tokens "$n" \
        --streams 1 --decode-tokens 1 > "$W/bench_prefill_$n.json" 2>> "$OUT/glmflash_bench.log" && pre+=("$W/bench_prefill_$n.json")
    done
    python3 -c "import json,sys; d=dict(engine='glmflash-bench', decoder='GpuDecoder (bench --model)', \
bench_json=json.load(open('$W/bench.json'))); \
d['prefill']=[dict(prompt=b['prefill_tokens'], tok_s=b['prefill_tok_s']) for b in map(lambda p: json.load(open(p)), sys.argv[1:])]; \
json.dump(d, open('$OUT/glmflash_bench.json','w'), indent=1)" "${pre[@]}" 2>/dev/null

    log "glmflash serve (GpuDecoder) + streaming client"
    local port=18311
    setsid "$BIN" serve --model "$ck" --device "${DEVICE:-cuda}" --host 127.0.0.1 --port $port --metrics-port $((port + 1)) \
      --max-batch-size 8 --context-length 4096 ${SERVE_ARGS:-} > "$OUT/glmflash_serve.log" 2>&1 < /dev/null &
    local spid=$!
    local deadline=$(( $(date +%s) + $(cap 240) ))
    until curl -sf "http://127.0.0.1:$port/ready" >/dev/null; do
      if ! kill -0 $spid 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then log "serve not ready"; break; fi
      sleep 2
    done
    log "serve ready check done"
    timeout -k 5 "$(cap 200)" python3 e2e/exl3/peer_bench.py client --url "http://127.0.0.1:$port" --vocab "$vocab" \
      --metrics-url "http://127.0.0.1:$((port + 1))/metrics" \
      --out "$OUT/glmflash_serve.json" "${opts[@]}" --time-limit 90 > "$OUT/glmflash_client.log" 2>&1
    log "client rc=$?"; cat "$OUT/glmflash_client.log" | cut -c1-400
    kill $spid 2>/dev/null; sleep 2; kill -9 $spid 2>/dev/null
    # Which decoder the engine chose ("sequences run on the GPU" = GpuDecoder; else the host forward).
    local which; which=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/glmflash_serve.log" \
      | grep -m1 -E "sequences run on the GPU|no GPU decoder|host forward" | cut -c1-300)
    log "serve decoder: ${which:-not logged}"
    python3 -c "import json,sys; p='$OUT/glmflash_serve.json'; d=json.load(open(p)); d['serve_decoder_log']=sys.argv[1]; \
json.dump(d, open(p,'w'), indent=1)" "$which" 2>/dev/null
  fi
  summary
}

summary() {
  python3 e2e/exl3/peer_bench.py summary --model "$W/ck_flash" --out "$OUT/peer_bench.json" \
    "$OUT/exl3.json" "$OUT/glmflash_bench.json" "$OUT/glmflash_serve.json"
  log "done; $OUT:"; ls -la "$OUT"
}

case $MODE in
  build) build "${2:-540}" ;;
  checkpoint) checkpoint ;;
  run) run ;;
  profile) profile ;;
  all)
    build "${2:-540}" || exit 1
    if [ "$(left)" -lt 200 ]; then log "built; $(left)s left: run the measurements in a separate call (run)"; exit 0; fi
    run ;;
  *) echo "usage: $0 build [WAIT_S] | checkpoint | run | profile | all" >&2; exit 2 ;;
esac
