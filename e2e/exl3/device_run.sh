#!/bin/bash
# Runs exllamav3 1.6.5 on a CUDA machine for the EXL3 fixtures (see e2e/exl3/README.md).
#
#   bash e2e/exl3/device_run.sh start WAIT_S [VARIANT...]   install, build, launch the pipeline in the
#                                                           background, wait up to WAIT_S, collect
#   bash e2e/exl3/device_run.sh collect WAIT_S              wait up to WAIT_S for a running pipeline, collect
#
# Needs (repo-relative): .whl/exl3/*.whl (exllamav3==1.6.5 + pydantic, pydantic-core, annotated-types,
# typing-inspection, marisa-trie wheels for cp312), .device/exl3src (python3 e2e/exl3/make_source.py
# --out .device/exl3src). Optional: .device/ext/exllamav3_ext.so from an earlier build (skips the JIT).
# Results go to $OUT (default ./exl3_out): log.txt, tiles.tar, ck_<variant>.tar, and the built
# extension as ext.so.gz.partNN (cat them, gunzip, put at .device/ext/exllamav3_ext.so to skip the JIT).
# VARIANT: name:bits:codebook, default exl3_mul1_3bpw:3:mul1 exl3_3inst_2p5bpw:2.5:3inst exl3_mcg_4bpw:4:mcg
set -u
MODE=${1:?start|collect|pipeline}
WAIT=${2:-500}
shift 2 || true
REPO=$(pwd)
W=${EXL3_WORK:-/root/exl3w}
OUT=${OUT:-$REPO/exl3_out}
mkdir -p "$W" "$OUT"
export NVIDIA_TF32_OVERRIDE=0 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=$W/torch_ext
export PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH}
if [ -f "$REPO/.device/ext/exllamav3_ext.so" ]; then export PYTHONPATH=$REPO/.device/ext:$PYTHONPATH; fi
log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
T0=${EXL3_T0:-$(date +%s)}
export EXL3_T0=$T0

pipeline() {
  local variants=("$@")
  [ ${#variants[@]} -eq 0 ] && variants=(exl3_mul1_3bpw:3:mul1 exl3_3inst_2p5bpw:2.5:3inst exl3_mcg_4bpw:4:mcg)
  log "pipeline start; variants ${variants[*]}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  local t=$(date +%s)
  python3 -c "import exllamav3.ext as e, exllamav3; print('ext', e.exllamav3_ext.__file__)" || { log "EXT BUILD FAILED"; touch $W/DONE; return; }
  log "ext import (JIT build if not prebuilt) took $(( $(date +%s) - t ))s"
  local so=$(python3 -c "import exllamav3.ext as e; print(e.exllamav3_ext.__file__)")
  (gzip -1 -c "$so" > $W/ext.so.gz && log "ext .so $(stat -c %s "$so") bytes, gz $(stat -c %s $W/ext.so.gz)") &
  touch $W/BUILT
  t=$(date +%s)
  mkdir -p $W/tiles
  for i in $(seq 1 20); do   # tiles.py resumes after a crash inside the extension, skipping that call
    python3 e2e/exl3/tiles.py --out $W/tiles && { touch $W/tiles/OK; break; }
    log "tiles.py exited $? (run $i), resuming"
  done
  log "tiles took $(( $(date +%s) - t ))s"
  # exllamav3 1.6.5's calibration pass runs module by module and does not carry a full DSA layer's
  # top-k selection to the next "shared" layer (params are per module): with the sparse path active
  # (context > index_topk) a shared layer asserts. Calibrate with index_topk = cal_cols (dense), then
  # write the model's real index_topk back into the converted config.json (a runtime setting, no weight
  # depends on it).
  rm -rf $W/src_cal; cp -r .device/exl3src $W/src_cal
  python3 - $W/src_cal/config.json <<'PY'
import json, sys
p = sys.argv[1]; c = json.load(open(p)); c["text_config"]["index_topk"] = 512
json.dump(c, open(p, "w"), indent=2, sort_keys=True)
PY
  for v in "${variants[@]}"; do
    IFS=: read -r name bits cb <<< "$v"
    local d=$W/ck/$name
    rm -rf $d; mkdir -p $d
    t=$(date +%s)
    log "convert $name: -b $bits -cb $cb -hb 6"
    timeout 420 python3 -m exllamav3.conversion.convert_model -i $W/src_cal -o $d/exl3 -w $d/work \
      -b $bits -hb 6 -cb $cb -vb 16 -cr 32 -cc 512 > $d/convert.log 2>&1
    local rc=$?
    log "convert $name rc=$rc took $(( $(date +%s) - t ))s"; tail -5 $d/convert.log
    if [ $rc -ne 0 ]; then tail -60 $d/convert.log; continue; fi
    echo "$(( $(date +%s) - t ))" > $d/convert_seconds
    python3 - $d/exl3/config.json .device/exl3src/config.json <<'PY'
import json, sys
p, src = sys.argv[1], sys.argv[2]; c = json.load(open(p))
c["text_config"]["index_topk"] = json.load(open(src))["text_config"]["index_topk"]
json.dump(c, open(p, "w"), indent=2, sort_keys=True)
PY
    t=$(date +%s)
    timeout 240 python3 e2e/exl3/device_ckpt.py --model $d/exl3 --out $d/dev > $d/ckpt.log 2>&1
    rc=$?
    log "device_ckpt $name rc=$rc took $(( $(date +%s) - t ))s"; tail -3 $d/ckpt.log
    if [ $rc -ne 0 ]; then
      tail -40 $d/ckpt.log
      log "device_ckpt $name: retrying with index_topk 512 (dense) as a fallback"
      timeout 240 python3 e2e/exl3/device_ckpt.py --model $d/exl3 --out $d/dev --index-topk-override 512 > $d/ckpt_dense.log 2>&1
      log "device_ckpt dense $name rc=$?"; tail -3 $d/ckpt_dense.log
    fi
    rm -rf $d/work
    touch $d/OK
  done
  wait
  log "pipeline done"
  touch $W/DONE
}

collect() {
  local deadline=$(( $(date +%s) + WAIT ))
  while [ ! -f $W/DONE ] && [ $(date +%s) -lt $deadline ]; do sleep 3; done
  [ -f $W/DONE ] && log "collect: pipeline finished" || log "collect: pipeline still running, collecting partial results"
  cp $W/pipeline.log $OUT/log.txt 2>/dev/null
  [ -f $W/tiles/OK ] && tar -C $W -cf $OUT/tiles.tar tiles
  for d in $W/ck/*/; do
    local n=$(basename $d)
    [ -f $d/OK ] || [ -f $d/convert.log ] || continue
    tar -C $W/ck -cf $OUT/ck_$n.tar --exclude=work $n
  done
  if [ -f $W/ext.so.gz ] && [ ! -f "$REPO/.device/ext/exllamav3_ext.so" ]; then
    split -b 15M -d $W/ext.so.gz $OUT/ext.so.gz.part
  fi
  ls -la $OUT
}

case $MODE in
  start)
    rm -rf $W/DONE $W/BUILT $W/tiles $W/ck
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .whl/exl3/*.whl || exit 1
    setsid nohup bash e2e/exl3/device_run.sh pipeline 0 "$@" > $W/pipeline.log 2>&1 < /dev/null &
    sleep 2
    collect
    cat $OUT/log.txt | tail -80
    ;;
  collect) collect; tail -60 $OUT/log.txt ;;
  pipeline) pipeline "$@" ;;
esac
