#!/usr/bin/env python3
"""Independent reference for glmflash's Q4_K / Q8_0 byte layouts.

Uses the `gguf` package (llama.cpp's Python reader) to dequantize

1. random blocks generated here (random quant bytes, random finite f16
   scales of moderate magnitude plus a few edge cases), written as
   DIR/q4_k.bin + DIR/q4_k.f32 and DIR/q8_0.bin + DIR/q8_0.f32, and
2. optionally blocks produced by glmflash's own quantizer (`--ours FILE`,
   written by `cargo test --test quant_gguf export_our_blocks`): each
   FILE (its name must contain `q4_k` or `q8_0`) gets a sibling
   `<stem>.gguf.f32` with gguf's decoding; with `--ours-input` the script also
   checks that gguf's decoding of our blocks is close to the original input.

All `.f32` files are little-endian float32; DIR/meta.json records versions,
seed and block counts. The Rust test `node-server/tests/quant_gguf.rs` then
checks glmflash's decoders and dot kernels against these files.

Usage:
  python e2e/quant_reference.py --out DIR --seed N [--ours FILE ...] [--ours-input FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

Q4K_BYTES = 144
Q80_BYTES = 34
TYPES = {"q4_k": GGMLQuantizationType.Q4_K, "q8_0": GGMLQuantizationType.Q8_0}
BLOCK_BYTES = {"q4_k": Q4K_BYTES, "q8_0": Q80_BYTES}
# Relative RMS error bounds for our quantizer on Gaussian input.
OURS_BOUND = {"q4_k": 0.08, "q8_0": 0.01}


def random_f16(rng: np.random.Generator, n: int, lo_exp: float, hi_exp: float) -> np.ndarray:
    """Random finite f16 values: random sign, log-uniform magnitude."""
    mag = np.exp2(rng.uniform(lo_exp, hi_exp, size=n))
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    out = (sign * mag).astype(np.float16)
    assert np.all(np.isfinite(out))
    return out


def f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def make_q4_k(rng: np.random.Generator, n: int) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n, Q4K_BYTES), dtype=np.uint8)
    d = random_f16(rng, n, -12.0, 2.0)
    dmin = random_f16(rng, n, -12.0, 2.0)
    # Edge cases: zero / negative-zero / subnormal / largest-moderate scales.
    edges = [
        (0.0, 0.5),
        (0.25, 0.0),
        (-0.0, -0.0),
        (np.float16(2.0**-24), np.float16(3 * 2.0**-24)),  # subnormal f16
        (np.float16(6.1e-5), -1.0),
        (-4.0, 4.0),
    ]
    for i, (a, b) in enumerate(edges[: n]):
        d[i], dmin[i] = a, b
    blocks[:, 0:2] = f16_bytes(d)
    blocks[:, 2:4] = f16_bytes(dmin)
    return blocks


def make_q8_0(rng: np.random.Generator, n: int) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n, Q80_BYTES), dtype=np.uint8)
    d = random_f16(rng, n, -14.0, 2.0)
    edges = [0.0, -0.0, np.float16(2.0**-24), np.float16(1000.0 / 1024), -2.0]
    for i, a in enumerate(edges[: n]):
        d[i] = a
    blocks[:, 0:2] = f16_bytes(d)
    return blocks


def gguf_dequant(blocks: np.ndarray, fmt: str) -> np.ndarray:
    flat = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(1, -1)
    out = dequantize(flat, TYPES[fmt]).astype(np.float32).reshape(-1)
    return out


def write(path: str, data: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(data.tobytes())


def format_of(path: str) -> str:
    name = os.path.basename(path)
    found = [f for f in TYPES if f in name]
    if len(found) != 1:
        sys.exit(f"--ours {path}: file name must contain exactly one of {list(TYPES)}")
    return found[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--q4k-blocks", type=int, default=64)
    ap.add_argument("--q80-blocks", type=int, default=128)
    ap.add_argument("--ours", action="append", default=[], help="blocks quantized by glmflash")
    ap.add_argument("--ours-input", help="f32 input that the --ours blocks were quantized from")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    meta: dict = {
        "gguf_version": importlib.metadata.version("gguf"),
        "numpy_version": np.__version__,
        "seed": args.seed,
        "blocks": {},
        "ours": {},
    }
    for fmt, make, n in (("q4_k", make_q4_k, args.q4k_blocks), ("q8_0", make_q8_0, args.q80_blocks)):
        blocks = make(rng, n)
        values = gguf_dequant(blocks, fmt)
        assert values.size == n * (256 if fmt == "q4_k" else 32)
        assert np.all(np.isfinite(values)), fmt
        write(os.path.join(args.out, f"{fmt}.bin"), blocks)
        write(os.path.join(args.out, f"{fmt}.f32"), values.astype("<f4"))
        meta["blocks"][fmt] = n

    failed = False
    ref = None
    if args.ours_input:
        ref = np.fromfile(args.ours_input, dtype="<f4").astype(np.float64)
    for path in args.ours:
        fmt = format_of(path)
        raw = np.fromfile(path, dtype=np.uint8)
        if raw.size % BLOCK_BYTES[fmt]:
            sys.exit(f"{path}: {raw.size} bytes is not a whole number of {fmt} blocks")
        values = gguf_dequant(raw.reshape(-1, BLOCK_BYTES[fmt]), fmt)
        stem = path[: -len(".bin")] if path.endswith(".bin") else path
        write(stem + ".gguf.f32", values.astype("<f4"))
        entry: dict = {"file": os.path.basename(path), "blocks": raw.size // BLOCK_BYTES[fmt]}
        if ref is not None:
            if ref.size != values.size:
                sys.exit(f"{path}: {values.size} values but --ours-input has {ref.size}")
            err = float(np.sqrt(np.sum((values - ref) ** 2) / np.sum(ref**2)))
            entry["rel_rms_vs_input"] = err
            ok = err < OURS_BOUND[fmt]
            print(f"{fmt}: gguf decode of our blocks, relative RMS error {err:.5f} "
                  f"(bound {OURS_BOUND[fmt]}) {'ok' if ok else 'FAIL'}")
            failed |= not ok
        meta["ours"][fmt] = entry

    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out} (gguf {meta['gguf_version']}, numpy {meta['numpy_version']}, seed {args.seed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
