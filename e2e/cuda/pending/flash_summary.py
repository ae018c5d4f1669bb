# Summary of a `bench --flash` JSON: each run's tok/s, ms a step and roofline ratio (rows_pipe.sh).
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
def walk(v):
    if isinstance(v, dict):
        if "tok_s" in v: yield v
        for x in v.values(): yield from walk(x)
    elif isinstance(v, list):
        for x in v: yield from walk(x)
for r in walk(d):
    print({k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in r
           if not isinstance(r[k], (dict, list)) and (k in ("run", "tok_s", "ms_per_step", "roofline_ratio") or "stream" in k)})
