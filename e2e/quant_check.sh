#!/usr/bin/env bash
# CI check of glmflash's Q4_K / Q8_0 layouts against the Python `gguf` package.
#
#   pip install -r e2e/requirements-quant.txt
#   e2e/quant_check.sh [SEED]        # default: a random seed
#
# 1. Rust writes blocks quantized by glmflash (fixed Gaussian input).
# 2. gguf dequantizes them plus fresh random blocks (seed SEED) and checks
#    its decoding of our blocks is close to the input.
# 3. Rust checks dequantize_row is bit-exact vs gguf and every dot path agrees.
# Then the committed fixture (seed 0) is checked too.
set -euo pipefail
cd "$(dirname "$0")/.."
seed="${1:-$(( (RANDOM << 15) | RANDOM ))}"
dir="$(mktemp -d)"
# On failure the seed is said last too (CI shows the end of the log): rerun with it.
trap 'rc=$?; rm -rf "$dir"; [ $rc = 0 ] || echo "quant check FAILED with seed $seed (rerun: e2e/quant_check.sh $seed)"' EXIT
echo "quant check: seed $seed, dir $dir"
GLMFLASH_QUANT_OURS_OUT="$dir" cargo test -q -p glmflash-node --test quant_gguf export_our_blocks
python3 e2e/quant_reference.py --out "$dir" --seed "$seed" \
  --ours "$dir/ours_q4_k.bin" --ours "$dir/ours_q8_0.bin" --ours-input "$dir/ours_input.f32"
GLMFLASH_QUANT_FIXTURES="$dir" cargo test -q -p glmflash-node --test quant_gguf
GLMFLASH_FORCE_PORTABLE=1 GLMFLASH_QUANT_FIXTURES="$dir" cargo test -q -p glmflash-node --test quant_gguf
cargo test -q -p glmflash-node --test quant_gguf
