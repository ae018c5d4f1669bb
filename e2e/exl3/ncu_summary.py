#!/usr/bin/env python3
"""Where a decode step's GPU time goes, from `ncu --csv --metrics gpu__time_duration.sum`
output (peer_bench.sh profile writes ncu.csv.gz for glmflash and exl3_ncu.csv.gz for
exllamav3): launches and microseconds per kernel name, largest first.

  ncu_summary.py ncu.csv.gz [--marker NAME --steps N | --last N --per K | --until NAME]

--marker NAME --steps N: the launches between the last N + 1 launches of kernel NAME (one a
forward, e.g. glmflash's `stream_mean`), i.e. the run's last N steps, per step. --last N keeps
the run's last N launches and --per K divides by K. --until NAME keeps the launches up to the
first of kernel NAME (one forward's, e.g. a prefill's). Lines that are not ncu's CSV rows (the
program's own output mixed into stdout) are skipped.
"""
import argparse
import collections
import csv
import gzip
import io
import sys


def rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.DictReader(io.StringIO("".join(lines)))
    for r in reader:
        if r.get("Metric Name") == "gpu__time_duration.sum":
            yield r["Kernel Name"], float(r["Metric Value"].replace(",", ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--last", type=int, default=0)
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--marker")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--until")
    a = ap.parse_args()
    launches = list(rows(a.csv))
    if not launches:
        sys.exit(f"{a.csv}: no gpu__time_duration rows")
    if a.marker:
        at = [i for i, (name, _) in enumerate(launches) if name.split("(")[0].startswith(a.marker)]
        if len(at) < a.steps + 1:
            sys.exit(f"{a.marker}: {len(at)} launches, fewer than --steps + 1")
        launches, a.per = launches[at[-a.steps - 1] + 1 : at[-1] + 1], a.steps
    elif a.until:
        at = [i for i, (name, _) in enumerate(launches) if name.split("(")[0].startswith(a.until)]
        if not at:
            sys.exit(f"{a.until}: no launch")
        launches = launches[: at[0] + 1]
    elif a.last:
        launches = launches[-a.last:]
    count, ns = collections.Counter(), collections.Counter()
    for name, t in launches:
        short = name.split("(")[0].split("<")[0].strip()
        count[short] += 1
        ns[short] += t
    total = sum(ns.values())
    print(f"{len(launches) / a.per:.0f} launches, {total / a.per / 1e3:.1f} us of kernels per step")
    for name, t in ns.most_common():
        print(f"{count[name] / a.per:8.1f} x {t / count[name] / 1e3:8.2f} us = {t / a.per / 1e3:8.1f} us  {t / total:5.1%}  {name[:90]}")


if __name__ == "__main__":
    main()
