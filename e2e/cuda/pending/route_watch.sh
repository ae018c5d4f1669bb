#!/usr/bin/env bash
# Starts route_pipe.sh unless it runs or ran; prints its progress until DONE or $1 seconds; copies logs to $OUT.
cd "$(dirname "$0")/../../.."
P=/root/pipe
if [ ! -f $P/P.log ]; then mkdir -p $P; setsid nohup bash e2e/cuda/pending/route_pipe.sh > /dev/null 2>&1 < /dev/null & sleep 2; fi
end=$(( $(date +%s) + ${1:-560} ))
while [ $(date +%s) -lt $end ] && ! grep -q DONE $P/P.log; do sleep 5; done
cat $P/P.log
mkdir -p ${OUT:-/tmp/out}; tar -C $P -czf ${OUT:-/tmp/out}/pipe.tgz . 2>/dev/null
