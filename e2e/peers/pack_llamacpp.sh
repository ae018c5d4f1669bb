#!/bin/bash
# Pack the llama.cpp tree vendored in xllamacpp's PyPI source distribution into a pruned tarball
# that fits the device tool's carry limit (64 MiB for everything carried): only what the CMake build
# of llama-bench, llama-completion and llama-quantize with GGML_CUDA needs (CPU and CUDA backends,
# src, common, vendor, the tools CMake adds unconditionally), plus the converter
# (convert_hf_to_gguf.py, conversion/, gguf-py). Docs, models, tests, examples, the server and web
# UI and every other ggml backend stay out.
#
#   bash e2e/peers/pack_llamacpp.sh [SDIST_DIR]     (default .peers-src; downloads the sdist there if missing)
#
# Writes .peers/llama.cpp.tar.xz (top folder llama.cpp/) and .peers/llama.cpp.version. .peers is
# git-ignored (peers' sources are never committed) and is what the device run carries.
set -euo pipefail
VERSION=2026.10.11549
SD=${1:-.peers-src}
mkdir -p "$SD" .peers
if ! ls "$SD"/xllamacpp-$VERSION.tar.gz >/dev/null 2>&1; then
  pip download --no-deps --no-binary :all: "xllamacpp==$VERSION" -d "$SD"   # ~5 min (sdist metadata)
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
tar -xzf "$SD/xllamacpp-$VERSION.tar.gz" -C "$TMP" "xllamacpp-$VERSION/thirdparty/llama.cpp"
mv "$TMP/xllamacpp-$VERSION/thirdparty/llama.cpp" "$TMP/llama.cpp"
L=$TMP/llama.cpp
test -f "$L/src/models/glm5-next.cpp" || { echo "no src/models/glm5-next.cpp in this tree" >&2; exit 1; }
grep -q "class Glm5NextModel" "$L/conversion/glm.py" || { echo "no Glm5NextModel in conversion/glm.py" >&2; exit 1; }
rm -rf "$L"/{docs,models,tests,examples,pocs,benches,media,app,ci,skills,grammars,.github,.devops}
rm -rf "$L"/tools/{server,ui,cli,rpc,tuning}
for b in cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "$L/ggml/src/ggml-$b"
done
# The sdist has no git metadata: build-info falls back to "unknown"; record the version instead.
echo "llama.cpp from xllamacpp==$VERSION (PyPI sdist, thirdparty/llama.cpp)" > .peers/llama.cpp.version
tar -C "$TMP" -cf - llama.cpp | xz -T2 -6 > .peers/llama.cpp.tar.xz
ls -la .peers/llama.cpp.tar.xz
