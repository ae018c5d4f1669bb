#!/usr/bin/env bash
# Compiles every CUDA kernel file to PTX for the RTX 3090 (sm_86) and the H200 (sm_90) with
# nvcc from the PyPI package nvidia-cuda-nvcc: no GPU needed. Also checks that each file's
# `extern "C"` kernels appear as PTX entries (the names the node server loads).
#   e2e/kernels_ptx.sh        # needs: pip install -r e2e/requirements-cuda.txt
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
nvcc="$("$py" -c 'import nvidia, os, glob; print(next(p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "cu*", "bin", "nvcc"))))')"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$nvcc" --version | tail -2
for f in kernels/cuda/*.cu; do
  for arch in sm_86 sm_90; do
    ptx="$out/$(basename "$f" .cu).$arch.ptx"
    "$nvcc" -ptx -arch="$arch" -std=c++17 -Ikernels/cuda -Werror all-warnings -o "$ptx" "$f"
    for k in $(grep -oE 'extern "C" __global__ void (__launch_bounds__\([A-Z0-9_, ]+\) )?[a-z_0-9]+' "$f" | awk '{print $NF}'); do
      grep -q "\.entry $k(" "$ptx" || { echo "$f ($arch): no PTX entry for $k"; exit 1; }
    done
    printf '%-12s %-6s %7d lines of PTX\n' "$(basename "$f")" "$arch" "$(wc -l < "$ptx")"
  done
done
echo "every kernel compiles for sm_86 and sm_90"

# Programmatic dependent launch (PDL=1, sm_90): a kernel may start before the one it follows has
# finished, so each must reach griddepcontrol.wait before it touches global memory (loads,
# stores, atomics, cp.async copies from it).
for f in kernels/cuda/*.cu; do
  ptx="$out/$(basename "$f" .cu).pdl.ptx"
  "$nvcc" -ptx -arch=sm_90 -std=c++17 -Ikernels/cuda -DPDL=1 -Werror all-warnings -o "$ptx" "$f"
  awk -v file="$f" '
    /^\.visible \.entry/ { if (k != "" && !w) { print file ": " k " never waits"; bad = 1 }
                            k = $3; sub(/\(.*/, "", k); w = 0 }
    /griddepcontrol\.wait/ { w = 1 }
    k != "" && !w && $1 ~ /^(ld|ldu|st|atom|red|prefetch|cp\.async|cp\.reduce|tex|suld|sust)\./ && $1 !~ /^(ld\.param|ld\.shared|st\.shared|ld\.local|st\.local|cp\.async\.(commit|wait))/ {
      print file ": " k " touches memory before its grid_wait: " $0; bad = 1 }
    END { if (k != "" && !w) { print file ": " k " never waits"; bad = 1 } exit bad }' "$ptx" || exit 1
done
echo "every kernel waits (PDL) before it touches global memory"
