#!/usr/bin/env bash
# watch.sh NAME [SECONDS]: starts e2e/cuda/pending/NAME_pipe.sh in the background unless it runs or
# ran on this machine (logs in /root/NAME, P.log the progress), prints P.log once it says DONE or
# after SECONDS (560), and keeps a copy of the logs in $OUT (every 20 s: a call cut short by the
# device's time limit still brings back what was done).
cd "$(dirname "$0")/../../.."
P=/root/$1 O=${OUT:-/tmp/out}
if [ ! -f $P/P.log ]; then mkdir -p $P; setsid nohup bash e2e/cuda/pending/$1_pipe.sh > /dev/null 2>&1 < /dev/null & sleep 2; fi
mkdir -p $O
end=$(( $(date +%s) + ${2:-560} )) n=0
while [ $(date +%s) -lt $end ] && ! grep -q DONE $P/P.log; do
  sleep 5; n=$((n + 1))
  if [ $((n % 4)) = 0 ]; then cp $P/P.log $O/P.log.tmp && mv $O/P.log.tmp $O/P.log; fi
done
cat $P/P.log
tar -C $P --exclude='*.csv.gz' -czf $O/$1.tgz . 2>/dev/null; cp $P/P.log $O/P.log
