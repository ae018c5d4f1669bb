#!/usr/bin/env python3
"""Compares two `glmflash-node logits` JSON outputs (e.g. --device cuda against the CPU):
relative L2 error of the logits within a bound, identical greedy continuations. With
--reference, also the fixture's transformers logits for the prompt's last position.
Exit status 1 on any failure; one line per comparison on stdout."""
import argparse
import json
import math
import sys


def rel(a, b):
    if len(a) != len(b):
        return math.inf
    num = sum((x - y) ** 2 for x, y in zip(a, b))
    den = sum(y * y for y in b) or 1e-300
    if any(not math.isfinite(x) for x in a):
        return math.inf
    return math.sqrt(num / den)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("got")
    p.add_argument("want")
    p.add_argument("--reference", help="fixture reference.json (transformers)")
    p.add_argument("--bound", type=float, default=1e-4)
    p.add_argument("--name", default="")
    p.add_argument("--identical", action="store_true",
                   help="require the same bits (the files' logits and greedy equal exactly)")
    p.add_argument("--kl", action="store_true",
                   help="report KL(want || got) of the softmax (near-exact modes); no bound")
    a = p.parse_args()
    got, want = json.load(open(a.got)), json.load(open(a.want))
    ok = True
    if a.identical:
        same = all(got.get(k) == want.get(k) for k in ("logits", "greedy", "decode_logits"))
        print(f"{a.name:<28} {'bit-identical' if same else 'DIFFERS'} ({len(got['logits'])} logits, "
              f"{len(got['greedy'])} greedy tokens)")
        sys.exit(0 if same else 1)
    if a.kl:
        def softmax(v):
            m = max(v)
            e = [math.exp(x - m) for x in v]
            s = sum(e)
            return [x / s for x in e]
        def kl_of(key):
            p_, q_ = softmax(want[key]), softmax(got[key])
            return sum(p * (math.log(p) - math.log(q)) for p, q in zip(p_, q_) if p > 0)
        agree = sum(x == y for x, y in zip(got["greedy"], want["greedy"]))
        kl = kl_of("decode_logits") if want.get("decode_logits") else kl_of("logits")
        print(f"{a.name:<28} decode-step KL {kl:.3e} nats (prefill KL {kl_of('logits'):.1e}); "
              f"greedy agrees on {agree}/{len(want['greedy'])} tokens")
        sys.exit(0 if math.isfinite(kl) else 1)
    e = rel(got["logits"], want["logits"])
    same = got["greedy"] == want["greedy"]
    ok &= e <= a.bound and same
    print(f"{a.name:<28} vs cpu: logits rel err {e:.3e} (bound {a.bound:.0e}), "
          f"greedy {len(got['greedy'])} tokens {'identical' if same else 'DIFFER'}")
    if a.reference:
        ref = json.load(open(a.reference))
        e = rel(got["logits"], ref["prefill_logits"][-1])
        n = len(got["greedy"])
        same = got["greedy"] == ref["greedy"][:n]
        ok &= e <= a.bound and same
        print(f"{a.name:<28} vs transformers: logits rel err {e:.3e}, greedy "
              f"{'identical' if same else 'DIFFER'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
