#!/usr/bin/env bash
# The EXL3 GEMV's machine code, counted without a GPU: builds one instantiation of
# `exl3_gemv_pass` (kernels/cuda/exl3.cu) for sm_90 with nvcc from NVIDIA's PyPI wheels, and
# prints its registers, its stack (spills) and the instructions of its main loop a tile. The
# GEMV is bound by instruction issue, so this count predicts its speed between builds.
#   bash e2e/exl3/gemv_sass.sh [HALVES...]        # default: 6 (3 bpw) and 12 (6 bpw)
#   CB=0|1|2 (3inst, mcg, mul1: default 2)  ROT=true  SW=4  KERNELS=DIR (another exl3.cu)
#   SASS=FILE also writes the first instantiation's full disassembly there.
# The toolkit (nvcc, cicc, ptxas, cuobjdump, headers: ~150 MB) is downloaded once into
# .cuda-tools/ (git-ignored); the pip that CI installs is enough, no CUDA install or GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
TOOLS="${CUDA_TOOLS:-$PWD/.cuda-tools}"
BIN="$TOOLS/nvidia/cu13/bin"
if [ ! -x "$BIN/nvcc" ] || [ ! -x "$BIN/nvdisasm" ] || [ ! -x "$TOOLS/nvidia/cu13/nvvm/bin/cicc" ]; then
  mkdir -p "$TOOLS/wheels"
  echo "fetching the CUDA compiler wheels into $TOOLS (once)" >&2
  python3 -m pip download -q --no-deps -d "$TOOLS/wheels" nvidia-cuda-nvcc nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm \
    nvidia-cuda-crt nvidia-nvvm nvidia-cuda-runtime nvidia-cuda-cccl >&2
  for w in "$TOOLS"/wheels/*.whl; do python3 -m zipfile -e "$w" "$TOOLS"; done
  chmod +x "$BIN"/* "$TOOLS/nvidia/cu13/nvvm/bin/"* 2>/dev/null || true
fi
export PATH="$BIN:$PATH"
KERNELS="${KERNELS:-$PWD/kernels/cuda}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/one.cu" <<'EOF'
#include "exl3.cu"
extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) gemv_one(
    const u32* __restrict__ trellis, int k, int n, int per, const u32* __restrict__ xs,
    int tokens, float* __restrict__ part, const float* x, const float* suh) {
#ifdef EXL3_SLOT_WORDS  // a block takes a strip of 32 outputs; the sums reduce in the rings
    __shared__ __align__(16) u32 ring[EXL3_GEMV_WARPS][EXL3_RING][EXL3_SLOT_WORDS];
    __shared__ float scratch[EXL3_GEMV_WARPS * 128];
    extern __shared__ __align__(16) u32 xsh[];
    exl3_gemv_pass<G_H, G_CB, G_ROT, G_SW>(trellis, k, n, per, xs, tokens, part, (i64)tokens * n,
                                           ring, scratch, x, suh, xsh);
#else  // builds before it: 16 outputs
    __shared__ float red[EXL3_GEMV_WARPS][TOK_TILE][16];
    __shared__ __align__(16) u32 ring[EXL3_GEMV_WARPS][EXL3_RING][EXL3_RING_WORDS];
    extern __shared__ __align__(16) u32 xsh[];
    exl3_gemv_pass<G_H, G_CB, G_ROT, G_SW>(trellis, k, n, per, xs, tokens, part, (i64)tokens * n, red,
                                   ring[threadIdx.x / WARP], x, suh, xsh);
#endif
}
EOF
sw="${SW:-1}"
min_blocks=$([ "$sw" = 1 ] && echo 4 || echo 2)
for h in "${@:-6 12}"; do
  for H in $h; do
    nvcc -cubin -O3 -arch=sm_90 -std=c++17 -I"$KERNELS" -DG_H="$H" -DG_CB="${CB:-2}" -DG_ROT="${ROT:-false}" \
      -DG_SW="$sw" -DMIN_BLOCKS="$min_blocks" "$WORK/one.cu" -o "$WORK/one.cubin"
    cuobjdump -sass -fun gemv_one "$WORK/one.cubin" > "$WORK/one.sass"
    if [ -n "${SASS:-}" ]; then cp "$WORK/one.sass" "$SASS"; SASS=; fi
    usage=$(cuobjdump -res-usage "$WORK/one.cubin" | grep -A1 gemv_one | tail -1 | grep -oE "REG:[0-9]+|STACK:[0-9]+|SHARED:[0-9]+" | tr '\n' ' ')
    python3 - "$WORK/one.sass" "$H" "$usage" <<'PY'
import re, sys
path, h, usage = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ins = []
for line in open(path):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
at = {a: i for i, (a, _) in enumerate(ins)}
# The main loop: the backward branch spanning the most HMMAs (a tile is two: hi and lo parts).
best = None
for i, (a, text) in enumerate(ins):
    m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
    if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
        continue
    j = at[int(m.group(1), 16)]
    body = [t for _, t in ins[j:i + 1]]
    mma = sum("HMMA" in t for t in body)
    if mma and (best is None or mma > best[1]):
        best = (len(body), mma, body)
if best is None:
    print(f"H={h} ({h / 2:g} bpw): {usage}no loop with tensor-core products found"); sys.exit()
n, mma, body = best
tiles = mma / 2
def opcode(t):
    words = t.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
ops = lambda *names: sum(opcode(t) in names for t in body)
print(f"H={h} ({h / 2:g} bpw): {usage}main loop {n} instructions, {tiles:g} tiles: "
      f"{n / tiles:.1f} a tile (IMAD {ops('IMAD') / tiles:.1f}, IDP {ops('IDP') / tiles:.1f}, "
      f"SHF/LOP3 {ops('SHF', 'LOP3') / tiles:.1f}, LDS {ops('LDS') / tiles:.1f}, "
      f"LDG/LDGSTS {ops('LDG') / tiles:.1f})")
PY
  done
done
