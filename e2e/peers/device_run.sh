#!/bin/bash
# llama.cpp (Q4_K_M) and glmflash (q4_k experts, bf16 dense) side by side on one random glm5_next
# checkpoint at GLM-5.3-Flash width, on one CUDA machine, in two phases that each fit one device
# call (see e2e/peers/README.md):
#
#   bash e2e/peers/device_run.sh build [WAIT_S]   untar .peers/llama.cpp.tar.xz, configure with CUDA and
#                                                 build llama-bench, llama-batched-bench,
#                                                 llama-completion and llama-quantize in the background
#                                                 (setsid: it outlives the call), wait up to WAIT_S
#                                                 (default 540); a later `build` on the still-warm
#                                                 machine resumes waiting for the same build
#   bash e2e/peers/device_run.sh run              checkpoint (make_checkpoint.py), GGUF bf16 -> Q4_K_M,
#                                                 llama-bench and llama-batched-bench with every layer on
#                                                 the GPU and with -ot exps=CPU, glmflash convert-experts
#                                                 q4_k then `serve` all in VRAM and --mode fast with
#                                                 e2e/peers/serve_bench.py, all in VRAM again with the
#                                                 dense weights in q4_k too (like Q4_K_M, whose dense
#                                                 weights are ~5 bits), the agreement check on the small
#                                                 model, then summary.py
#
# Needs (repo-relative): .peers/llama.cpp.tar.xz (pack_llamacpp.sh); optional .peers/llama-bin.tar.xz
# (the bin/ an earlier `build` saved in $OUT: `run` then needs no build); the glmflash binary at $BIN
# (default .device/glmflash-node, a release build with CUDA). python3 with torch and transformers
# 5.x (llama.cpp's converter imports both; our scripts need numpy only).
# Env: OUT (default ./peer_out), BUDGET_S (whole call, default 540), PEERS_WORK (/root/peersw),
# PRESET (--flash; --small for a CPU smoke test), CKPT_ARGS (extra make_checkpoint.py options, e.g.
# "--experts 96"), THREADS (16), PREFILL (512,8192), BATCHES (1,4), STEPS (128), WARMUP (16),
# DEVICE (cuda; cpu: a CPU smoke test), CUDA (1; 0: build llama.cpp for the CPU), SKIP (any of
# llama, batched, glmflash, fast, dense, agree). Results in $OUT: peers.json (summary table), every part
# (llama_bench_*.json, batched_*.jsonl, glmflash_*.json, agree_small.json), log.txt and each step's
# log; every step is time-bounded and writes what it has.
set -u
MODE=${1:?build|run}
REPO=$(pwd)
W=${PEERS_WORK:-/root/peersw}
LC=$W/llama.cpp
OUT=${OUT:-$REPO/peer_out}
BIN=${BIN:-.device/glmflash-node}
BUDGET=${BUDGET_S:-540}
THREADS=${THREADS:-16}
T0=$(date +%s)
mkdir -p "$W" "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 GLMFLASH_LOG_FORMAT=text NO_COLOR=1
export GLMFLASH_KERNEL_CACHE=${GLMFLASH_KERNEL_CACHE:-$W/kernel-cache}
for d in /usr/local/cuda/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH"; done
source e2e/cuda/nvrtc_path.sh

log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# cap CAP_S: a step's timeout, CAP_S or what the budget leaves (minus a reserve for the summary)
cap() { local l=$(( $(left) - 15 )); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 1 ? l : 1 )); }
skip() { [[ ",${SKIP:-}," == *",$1,"* ]]; }
TARGETS="llama-bench llama-batched-bench llama-completion llama-quantize"

build() {
  local wait=${1:-540}
  if [ -f "$W/build.done" ]; then log "llama.cpp already built: $LC/build/bin"; return 0; fi
  if [ -f "$W/build.pid" ] && kill -0 "$(cat "$W/build.pid")" 2>/dev/null; then
    log "llama.cpp build already running (pid $(cat "$W/build.pid")), waiting"
  else
    [ -f .peers/llama.cpp.tar.xz ] || { log "no .peers/llama.cpp.tar.xz (run pack_llamacpp.sh, carry .peers)"; return 1; }
    rm -rf "$LC" && tar -xJf .peers/llama.cpp.tar.xz -C "$W" || { log "untar FAILED"; return 1; }
    local cuda=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real)
    [ "${CUDA:-1}" = 0 ] && cuda=(-DGGML_CUDA=OFF)
    log "llama.cpp: configure + build ($TARGETS) in the background, log build.log"
    # BUILD_SHARED_LIBS: e2e/peers/llama_logits.cpp links libllama. No OpenSSL (no downloads here).
    setsid nohup bash -c "cmake -S '$LC' -B '$LC/build' -G Ninja -DCMAKE_BUILD_TYPE=Release ${cuda[*]} \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=ON \
      && cmake --build '$LC/build' -j $THREADS --target $TARGETS && touch '$W/build.done'" \
      > "$W/build.log" 2>&1 < /dev/null &
    echo $! > "$W/build.pid"
  fi
  local deadline=$(( $(date +%s) + $(cap "$wait") ))
  while kill -0 "$(cat "$W/build.pid")" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
  cp "$W/build.log" "$OUT/build.log"
  if [ ! -f "$W/build.done" ]; then
    if kill -0 "$(cat "$W/build.pid")" 2>/dev/null; then
      log "build still running ($(grep -o '^\[[0-9]*/[0-9]*\]' "$W/build.log" | tail -1)): call build again"
    else
      log "build FAILED"; tail -30 "$W/build.log"
    fi
    return 1
  fi
  log "llama.cpp built: $(ls "$LC/build/bin" | tr '\n' ' ')"
  # Also hand the built bin/ back (carry it as .peers/llama-bin.tar.xz if the machine is lost before
  # `run`: the libraries' rpath is $LC/build/bin, so keep PEERS_WORK the same).
  timeout 45 bash -c "tar -C '$LC/build' -cf - bin | xz -T $THREADS -1 > '$W/llama-bin.tar.xz'" \
    && split -b 15M -d "$W/llama-bin.tar.xz" "$OUT/llama-bin.tar.xz.part" \
    && log "bin/ saved: $(stat -c %s "$W/llama-bin.tar.xz") bytes -> $OUT/llama-bin.tar.xz.part*"
}

# A carried build (.peers/llama-bin.tar.xz from an earlier `build`) instead of building here.
unpack_carried() {
  [ -f "$W/build.done" ] || [ ! -f .peers/llama-bin.tar.xz ] && return 0
  log "using the carried llama.cpp build (.peers/llama-bin.tar.xz)"
  rm -rf "$LC" && tar -xJf .peers/llama.cpp.tar.xz -C "$W" && mkdir -p "$LC/build" \
    && tar -xJf .peers/llama-bin.tar.xz -C "$LC/build" && touch "$W/build.done"
}

# serve_one LABEL SERVE_ARGS...: start `serve` on the checkpoint ($MODEL_DIR, default the q4_k
# experts' one), run serve_bench.py, stop it
serve_one() {
  local label=$1; shift
  local port=18321
  log "glmflash serve ($label): $*"
  setsid "$BIN" serve --model "${MODEL_DIR:-$W/ck_q4k}" --device "${DEVICE:-cuda}" --host 127.0.0.1 --port $port \
    --metrics-port $((port + 1)) --max-batch-size 8 --context-length 16384 "$@" \
    > "$OUT/glmflash_serve_$label.log" 2>&1 < /dev/null &
  local spid=$! deadline=$(( $(date +%s) + $(cap 180) )) ready=0
  until curl -sf "http://127.0.0.1:$port/ready" >/dev/null; do
    if ! kill -0 $spid 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then break; fi
    sleep 2
  done
  curl -sf "http://127.0.0.1:$port/ready" >/dev/null && ready=1
  log "serve ($label) ready=$ready"
  if [ $ready = 1 ]; then
    timeout -k 5 "$(cap 200)" python3 e2e/peers/serve_bench.py --url "http://127.0.0.1:$port" --vocab "$VOCAB" \
      --placement "$label" --out "$OUT/glmflash_$label.json" --batches "${BATCHES:-1,4}" \
      --prefill "${PREFILL-512,8192}" --steps "${STEPS:-128}" --warmup "${WARMUP:-16}" --time-limit 90 \
      > "$OUT/glmflash_client_$label.log" 2>&1
    log "client ($label) rc=$?"; cut -c1-300 "$OUT/glmflash_client_$label.log" | tail -6
  else
    tail -5 "$OUT/glmflash_serve_$label.log"
  fi
  kill $spid 2>/dev/null; sleep 2; kill -9 $spid 2>/dev/null
  # Which decoder serve chose ("sequences run on the GPU" = GpuDecoder; else the host forward).
  local which; which=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/glmflash_serve_$label.log" \
    | grep -m1 -E "sequences run on the GPU|no GPU decoder|host forward" | cut -c1-300)
  log "serve ($label) decoder: ${which:-not logged}"
  python3 -c "import json,sys; p=sys.argv[1]; d=json.load(open(p)); d['serve_decoder_log']=sys.argv[2]; \
json.dump(d, open(p,'w'), indent=1)" "$OUT/glmflash_$label.json" "$which" 2>/dev/null
}

# llama_bench PLACEMENT [-ot ...]: llama-bench (decode tg128, prefill per PREFILL) and
# llama-batched-bench (decode at 1 and 4 streams), every layer offloaded (-ngl 99). A CPU that
# advertises AMX but faults on its tile instructions (SIGILL, rc 132: seen in a VM) kills the CPU
# experts' repacked path; then both run again without repacking, and the log says so.
llama_bench() {
  local placement=$1; shift
  local pp=${PREFILL-512,8192} rc norepack=()
  for attempt in 1 2; do
    log "llama-bench ($placement): -ngl 99 $* ${norepack[*]} -p ${pp:-0} -n 128"
    timeout -k 10 "$(cap 150)" "$LC/build/bin/llama-bench" -m "$W/m-Q4_K_M.gguf" -ngl 99 "$@" "${norepack[@]}" \
      -t "$THREADS" -p "${pp:-0}" -n 128 -r 3 -o json > "$OUT/llama_bench_$placement.json" 2> "$OUT/llama_bench_$placement.log"
    rc=$?
    log "llama-bench ($placement) rc=$rc"
    [ $rc = 132 ] && [ $attempt = 1 ] && { norepack=(--repack 0); log "SIGILL: again with --repack 0"; continue; }
    break
  done
  python3 -c "import json,sys; [print('  n_prompt', r['n_prompt'], 'n_gen', r['n_gen'], 'tok/s', round(r['avg_ts'],1)) \
    for r in json.load(open(sys.argv[1]))]" "$OUT/llama_bench_$placement.json" 2>/dev/null || tail -5 "$OUT/llama_bench_$placement.log"
  if ! skip batched; then
    [ ${#norepack[@]} -gt 0 ] && norepack=(--no-repack)
    timeout -k 10 "$(cap 120)" "$LC/build/bin/llama-batched-bench" -m "$W/m-Q4_K_M.gguf" -ngl 99 "$@" "${norepack[@]}" \
      -t "$THREADS" -c 4096 -npp 32 -ntg 128 -npl "${BATCHES:-1,4}" --output-format jsonl \
      > "$OUT/batched_$placement.jsonl" 2> "$OUT/batched_$placement.log"
    log "llama-batched-bench ($placement) rc=$?"; grep -o '"pl": [0-9]*.*"speed_tg": [0-9.]*' "$OUT/batched_$placement.jsonl"
  fi
}

run() {
  unpack_carried
  [ -f "$W/build.done" ] || [ -f "$W/build.pid" ] || skip llama || { log "no llama.cpp build: run build first"; return 1; }
  if [ ! -f "$W/build.done" ] && ! skip llama; then build "$(cap 120)" || log "llama.cpp not built: its half is skipped"; fi
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null; nproc; } | tee "$OUT/gpu.txt"
  { cat .peers/llama.cpp.version 2>/dev/null; nvcc --version 2>/dev/null | tail -1; "$BIN" --version 2>/dev/null
    echo "glmflash binary sha256 $(sha256sum "$BIN" 2>/dev/null | cut -c1-16)"
    git log -1 --format='glmflash tree commit %h %cI (the git metadata the device got, which may lag the binary)' 2>/dev/null
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
    | tee "$OUT/versions.txt"

  local ck=$W/ck args="${PRESET:---flash} ${CKPT_ARGS:-}"
  if [ "$(cat "$ck/.args" 2>/dev/null)" = "$args" ]; then log "checkpoint reused: $ck"; else
    rm -rf "$W/ck_q4k" "$W/ck_q4kd" "$W"/m-*.gguf
    log "checkpoint: make_checkpoint.py $args"
    timeout "$(cap 150)" python3 e2e/peers/make_checkpoint.py --out "$ck" $args > "$OUT/make_ckpt.log" 2>&1 \
      && echo "$args" > "$ck/.args"
    log "checkpoint rc=$?: $(tail -1 "$OUT/make_ckpt.log")"
  fi
  cp "$ck/bytes.json" "$OUT/checkpoint.json" 2>/dev/null || { log "no checkpoint, stopping"; return 1; }
  VOCAB=$(python3 -c "import json;print(json.load(open('$ck/bytes.json'))['vocab'])")

  # Our q4_k conversion (one thread, ~3 min at flash width) runs beside llama.cpp's converter and
  # quantizer, never beside a timed run.
  local cpid= dpid=
  if ! skip glmflash && [ ! -f "$W/ck_q4k/.done" ]; then
    [ -x "$BIN" ] || { log "no glmflash binary at $BIN"; SKIP="${SKIP:-},glmflash"; }
    if [ -x "$BIN" ]; then
      log "glmflash convert-experts --format q4_k (background)"
      ( timeout "$(cap 300)" "$BIN" convert-experts --model "$ck" --out "$W/ck_q4k" --format q4_k \
          > "$OUT/glmflash_convert.log" 2>&1 && touch "$W/ck_q4k/.done" ) &
      cpid=$!
    fi
  fi
  # The same with the dense weights in q4_k too (attention, KDA, shared experts, dense MLP, head):
  # the bytes a token reads closer to Q4_K_M's.
  if ! skip glmflash && ! skip dense && [ -x "$BIN" ] && [ ! -f "$W/ck_q4kd/.done" ]; then
    log "glmflash convert-experts --format q4_k --dense-format q4_k (background)"
    ( timeout "$(cap 300)" "$BIN" convert-experts --model "$ck" --out "$W/ck_q4kd" --format q4_k \
        --dense-format q4_k > "$OUT/glmflash_convert_dense.log" 2>&1 && touch "$W/ck_q4kd/.done" ) &
    dpid=$!
  fi

  if ! skip llama && [ -f "$W/build.done" ]; then
    if [ ! -f "$W/m-Q4_K_M.gguf" ]; then
      log "convert.py --outtype bf16 --no-mtp"
      timeout "$(cap 300)" python3 e2e/peers/convert.py "$LC" "$ck" --outtype bf16 --outfile "$W/m-bf16.gguf" --no-mtp \
        > "$OUT/convert.log" 2>&1
      log "convert rc=$?: $(grep -v '^Writing' "$OUT/convert.log" | tail -1 | cut -c1-200)"
      log "llama-quantize Q4_K_M"
      timeout "$(cap 200)" "$LC/build/bin/llama-quantize" "$W/m-bf16.gguf" "$W/m-Q4_K_M.tmp.gguf" Q4_K_M "$THREADS" \
        > "$OUT/quantize.log" 2>&1 && mv "$W/m-Q4_K_M.tmp.gguf" "$W/m-Q4_K_M.gguf"
      log "quantize rc=$?: $(grep -E 'model size|quant size' "$OUT/quantize.log" | tr '\n' ' ')"
      rm -f "$W/m-bf16.gguf"
    fi
    # convert-experts is one thread, but no timed run may share the CPU with it.
    if [ -n "$cpid$dpid" ]; then log "waiting for convert-experts before timing"; wait $cpid $dpid; cpid= dpid=; fi
    if [ -f "$W/m-Q4_K_M.gguf" ]; then
      llama_bench gpu
      llama_bench cpu -ot exps=CPU
    fi
  fi

  if ! skip glmflash; then
    if [ -n "$cpid$dpid" ]; then log "waiting for convert-experts"; wait $cpid $dpid; fi
    log "convert-experts: $( [ -f "$W/ck_q4k/.done" ] && echo done || echo FAILED): $(tail -1 "$OUT/glmflash_convert.log" 2>/dev/null | cut -c1-200)"
    if [ -f "$W/ck_q4k/.done" ]; then
      serve_one vram
      skip fast || serve_one fast --mode fast
    fi
    if ! skip dense && [ -f "$W/ck_q4kd/.done" ]; then
      MODEL_DIR=$W/ck_q4kd BATCHES=${BATCHES:-1,4} serve_one vram_dense_q4k
    elif ! skip dense; then
      log "convert-experts --dense-format q4_k: FAILED: $(tail -1 "$OUT/glmflash_convert_dense.log" 2>/dev/null | cut -c1-200)"
    fi
  fi

  if ! skip agree && [ -f "$W/build.done" ] && [ -x "$BIN" ] && [ "$(left)" -gt 60 ]; then agree; fi
  summary
}

# The agreement check on the small model, on this machine's backends: llama.cpp F32 and Q8_0 GGUFs
# (all layers on the GPU when built with CUDA) against glmflash on the bf16 checkpoint.
agree() {
  local s=$W/small
  log "agreement (small model)"
  g++ -O2 -std=c++17 e2e/peers/llama_logits.cpp -I"$LC/include" -I"$LC/ggml/include" -L"$LC/build/bin" \
    -lllama -lggml -lggml-base -Wl,-rpath,"$LC/build/bin" -o "$W/llama_logits" > "$OUT/agree_build.log" 2>&1 \
    || { log "llama_logits build FAILED"; tail -5 "$OUT/agree_build.log"; return; }
  python3 e2e/peers/make_checkpoint.py --small --out "$s" > /dev/null 2>&1 || { log "small checkpoint FAILED"; return; }
  # Q8_0 through llama-quantize, as users make it: the converter's own --outtype q8_0 also quantizes
  # attn_k_b, whose MUL_MAT llama.cpp's CPU backend refuses (the scheduler asserts).
  timeout "$(cap 90)" python3 e2e/peers/convert.py "$LC" "$s" --outtype f32 --outfile "$W/small-f32.gguf" --no-mtp \
    > "$OUT/agree_convert.log" 2>&1 || { log "convert f32 FAILED"; tail -3 "$OUT/agree_convert.log"; return; }
  "$LC/build/bin/llama-quantize" "$W/small-f32.gguf" "$W/small-q8_0.gguf" Q8_0 "$THREADS" > "$OUT/agree_quantize.log" 2>&1 \
    || log "quantize Q8_0 FAILED"
  local hf=; python3 -c "import transformers.models.glm5_next" 2>/dev/null && hf=--hf
  for t in f32 q8_0; do
    [ -f "$W/small-$t.gguf" ] || continue
    timeout "$(cap 120)" python3 e2e/peers/agree.py --model "$s" --gguf "$W/small-$t.gguf" --llama-logits "$W/llama_logits" \
      --glmflash "$BIN" --device "${DEVICE:-cuda}" --ngl 99 --threads "$THREADS" $hf --out "$OUT/agree_small_$t.json" \
      > "$OUT/agree_small_$t.log" 2>&1
    log "agree $t rc=$?: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in \
('prefill_rel_l2', 'prefill_argmax_agree', 'greedy_equal', 'first_disagreement')})" "$OUT/agree_small_$t.json" 2>&1 | cut -c1-300)"
  done
}

summary() {
  python3 e2e/peers/summary.py "$OUT"
  log "done; $OUT:"; ls -la "$OUT"
}

case $MODE in
  build) build "${2:-540}" ;;
  run) run ;;
  *) echo "usage: $0 build [WAIT_S] | run" >&2; exit 2 ;;
esac
