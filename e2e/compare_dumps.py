#!/usr/bin/env python3
"""Compare two named-intermediate dumps and name the first op that diverges.

    python3 e2e/compare_dumps.py ours.safetensors ref.safetensors [--tol 1e-4]

Walks the names in the order the engine tapped them (metadata `order` of the first file)
and prints max|a-b| / max|b| for each; exits 1 at the first name over the tolerance.
"""
import argparse
import sys

from safetensors import safe_open


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("ref")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    with safe_open(args.ours, "np") as a, safe_open(args.ref, "np") as b:
        order = (a.metadata() or {}).get("order", "").split(",") or list(a.keys())
        ref_names = set(b.keys())
        for name in order:
            if name not in ref_names:
                print(f"{name:40s} (not in reference)")
                continue
            x, y = a.get_tensor(name), b.get_tensor(name)
            if x.shape != y.shape:
                print(f"{name:40s} shape {x.shape} vs reference {y.shape}")
                return 1
            scale = max(float(abs(y).max()), 1e-30)
            err = float(abs(x - y).max()) / scale
            print(f"{name:40s} rel err {err:.3e}")
            if not err <= args.tol:
                print(f"first divergence: {name}")
                return 1
    print("no divergence above tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
