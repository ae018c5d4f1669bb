#!/bin/bash
# The CPU expert kernels side by side on this machine (issue 16): one decode token's routed
# experts (8 picks of 64, GLM-5.3-Flash's 4096 x 2048 experts), computed by glmflash's CPU lane
# (`bench --lane`: the kernels that compute RAM-resident decode picks in `fast` and `nvme`) and by
# ggml's CPU backend as llama.cpp runs experts with `-ot exps=CPU` (`ggml_moe_bench.cpp`:
# mul_mat_id of gate and up, SwiGLU, mul_mat_id of down; weights repacked as llama.cpp does by
# default for q4_K, and in ggml's plain rows), in turns, ROUNDS times, for each thread count and format.
#
#   bash e2e/peers/cpu_experts.sh [ROUNDS] [THREADS ...]        (default: 3 rounds, 1 and all cores)
#
# Env: BIN (glmflash-node; default: cargo build --release), FORMATS (default "q4_k q8_0"),
# OUT (default .peers/cpu-experts), SDIST_DIR (default .peers-src). llama.cpp's tree comes from
# pack_llamacpp.sh's .peers/llama.cpp.tar.xz when there is one (on the device: carry .peers), else
# from the PyPI source distribution it names (downloaded if missing, ~5 min); its ggml is
# built CPU-only with -march=native (GGML_NATIVE) into .peers/cpu-ggml (git-ignored; ~2 min on 2
# cores). Writes OUT/runs.jsonl (one line a run) and prints the table (GB/s of expert weights).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
shift || true
THREADS=("$@")
[ ${#THREADS[@]} -gt 0 ] || THREADS=(1 "$(nproc)")
FORMATS=${FORMATS:-"q4_k q8_0"}
OUT=${OUT:-.peers/cpu-experts}
SD=${SDIST_DIR:-.peers-src}
VERSION=$(sed -n 's/^VERSION=//p' e2e/peers/pack_llamacpp.sh)
LC=.peers/cpu-ggml/llama.cpp
mkdir -p "$OUT" .peers/cpu-ggml

if [ ! -f "$LC/build/bin/libggml-cpu.so" ]; then
  rm -rf "$LC"
  if [ -f .peers/llama.cpp.tar.xz ]; then
    # pack_llamacpp.sh's pruned tree (what the device carries) has the CPU backend.
    tar -xJf .peers/llama.cpp.tar.xz -C .peers/cpu-ggml
  else
    if ! ls "$SD/xllamacpp-$VERSION.tar.gz" > /dev/null 2>&1; then
      mkdir -p "$SD"
      pip download --no-deps --no-binary :all: "xllamacpp==$VERSION" -d "$SD"
    fi
    rm -rf .peers/cpu-ggml/x
    mkdir -p .peers/cpu-ggml/x
    tar -xzf "$SD/xllamacpp-$VERSION.tar.gz" -C .peers/cpu-ggml/x "xllamacpp-$VERSION/thirdparty/llama.cpp"
    mv ".peers/cpu-ggml/x/xllamacpp-$VERSION/thirdparty/llama.cpp" "$LC"
    rm -rf .peers/cpu-ggml/x
  fi
  cmake -S "$LC" -B "$LC/build" -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$OUT/cmake.log"
  cmake --build "$LC/build" -j"$(nproc)" --target ggml ggml-cpu > "$OUT/build.log"
fi
LIBS=$(dirname "$(find "$LC/build" -name 'libggml-cpu.so' | head -1)")
g++ -O2 -std=c++17 e2e/peers/ggml_moe_bench.cpp -I"$LC/ggml/include" -I"$LC/include" -L"$LIBS" \
  -lggml -lggml-base -lggml-cpu -Wl,-rpath,"$(realpath "$LIBS")" -o "$OUT/ggml_moe_bench"

if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p glmflash-node
  BIN=${CARGO_TARGET_DIR:-target}/release/glmflash-node
fi

: > "$OUT/runs.jsonl"
ggml_type() { case $1 in q4_k) echo q4_K ;; *) echo "$1" ;; esac; }
for round in $(seq 1 "$ROUNDS"); do
  for fmt in $FORMATS; do
    for t in "${THREADS[@]}"; do
      RAYON_NUM_THREADS=$t "$BIN" bench --lane --expert-format "$fmt" --hidden 4096 --expert-width 2048 \
        --top-k 8 --experts 64 2> /dev/null | python3 -c "
import json, sys
d = json.load(sys.stdin)
c = {(x['set'], x['kernel']): x['weights_gb_per_s'] for x in d['cases']}
print(json.dumps({'round': $round, 'format': '$fmt', 'threads': $t, 'engine': 'glmflash lane',
                  'cold': c[('cold', 'lane')], 'hot': c[('hot', 'lane')], 'kernel': d['lane_kernels'],
                  'read_gb_s': d['memory_read_gb_per_s']}))" >> "$OUT/runs.jsonl"
      # The repacked layout for q4_K only: this ggml has no repacked q8_0 layout for x86 (its
      # repack buffer would take the tensor with no layout and crash), so llama.cpp keeps q8_0
      # weights in plain rows: plain is its default for q8_0 here.
      layouts="plain"
      [ "$fmt" = q4_k ] && layouts="repack plain"
      for layout in $layouts; do
        "$OUT/ggml_moe_bench" "$t" "$(ggml_type "$fmt")" 4096 2048 64 8 200 "$layout" 2> /dev/null | python3 -c "
import json, sys
d = json.loads(sys.stdin.readline())
print(json.dumps({'round': $round, 'format': '$fmt', 'threads': $t, 'engine': 'ggml ' + d['layout'] + ' (' + d['weights_buffer'] + ')',
                  'cold': d['cold']['weights_gb_per_s'], 'hot': d['hot']['weights_gb_per_s']}))" >> "$OUT/runs.jsonl"
      done
    done
  done
done

python3 - "$OUT/runs.jsonl" << 'EOF'
import json, sys
from collections import defaultdict
runs = [json.loads(l) for l in open(sys.argv[1])]
by = defaultdict(list)
for r in runs:
    by[(r["format"], r["threads"], r["engine"])].append(r)
print("| format | threads | engine | cold GB/s (each round) | hot GB/s (each round) | cold: glmflash / this |")
print("|---|---|---|---|---|---|")
for (fmt, t, eng), rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "glmflash lane", kv[0][2])):
    ours = by[(fmt, t, "glmflash lane")]
    mean = lambda xs: sum(xs) / len(xs)
    ratio = "" if eng == "glmflash lane" else f"{mean([r['cold'] for r in ours]) / mean([r['cold'] for r in rs]):.2f}x"
    cold = " / ".join(f"{r['cold']:.2f}" for r in rs)
    hot = " / ".join(f"{r['hot']:.2f}" for r in rs)
    print(f"| {fmt} | {t} | {eng} | {cold} | {hot} | {ratio} |")
EOF
