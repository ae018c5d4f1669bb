# Sourced by the device scripts: puts the first directory holding libnvrtc (the toolkit's,
# else the one a Python package ships) on LD_LIBRARY_PATH, for the node server's kernels, and
# says which in NVRTC_DIR (empty when none was found).
NVRTC_DIR=
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia,os;print(" ".join(os.path.join(p,"cu13","lib") for p in nvidia.__path__))' 2>/dev/null); do
  if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then NVRTC_DIR=$d; export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; fi
done
