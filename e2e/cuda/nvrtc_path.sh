# Sourced by the device scripts: puts the first directory holding libnvrtc (the toolkit's,
# else the one a Python package ships) on LD_LIBRARY_PATH, for the node server's kernels, and
# says which in NVRTC_DIR (empty when none was found). Where the script's $BIN is missing and
# $BIN.gz is there, unpacks it first: a stripped binary carried gzipped is ~7 MB instead of ~18,
# which leaves room under the device tool's 64 MiB (the tracked tree alone is ~26 MB).
if [ -n "${BIN:-}" ] && [ ! -x "$BIN" ] && [ -f "$BIN.gz" ]; then
  gunzip -c "$BIN.gz" > "$BIN" && chmod +x "$BIN"
fi
NVRTC_DIR=
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then NVRTC_DIR=$d; export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
done
