#!/usr/bin/env python3
"""Check shared/reference/exl3.md's tile decoding against exllamav3's own reconstructions (CPU).

Usage:  python3 e2e/exl3/check_tiles.py [--fixtures e2e/fixtures/exl3] [--all]

A slow, plain transcription of the decoding rules written in exl3.md (bit order, tail-biting 16-bit
state, half-integer bit split, tensor-core position order, the three codebooks), compared bit for
bit with tile.{cb}.{tag}.reconstructed (exllamav3_ext.reconstruct). By default every 5th k-tile x
every 3rd n-tile of each entry (12 of 128 tiles); --all checks every tile (a few minutes).
Exits 1 on any mismatch. Needs numpy, torch, safetensors.
"""

import argparse
import os
import sys

import numpy as np
from safetensors.torch import load_file

POS = [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]


def f16_bits(h):
    return np.float32(np.frombuffer(np.uint16(h).tobytes(), np.float16)[0])


def codebook(cb, x):
    if cb == "mul1":
        y = (x * 0x83DCD12D) & 0xFFFFFFFF
        s = sum((y >> (8 * i)) & 0xFF for i in range(4))
        return np.float32(np.float16(np.float32(1774 * s - 905216) / np.float32(2 ** 18)))
    mult, add = (89226354, 64248484) if cb == "3inst" else (0xCBAC1FED, 0)
    y = ((x * mult + add) & 0xFFFFFFFF & 0x8FFF8FFF) ^ 0x3B603B60
    return np.float32(np.float16(f16_bits(y & 0xFFFF) + f16_bits(y >> 16)))


def decode_tile(words, rate, cb):
    """16x16 tile [r along K, c along N] from its 16*rate int16 words."""
    w32 = np.frombuffer(words.astype(np.int16).tobytes(), dtype="<u4")
    nbits = len(w32) * 32
    kb = int(rate)
    half = rate != kb
    out = np.zeros((16, 16), np.float32)
    end = 0
    for p in range(256):
        end += kb + 1 if (half and p % 2 == 1) else kb
        state = 0
        for n in range(end - 16, end):  # the 16 bits ending at p's last bit, wrapping (tail-biting)
            n %= nbits
            state = (state << 1) | ((int(w32[n // 32]) >> (31 - n % 32)) & 1)
        t, j = divmod(p, 8)
        out[2 * (t % 4) + POS[j][0], t // 4 + POS[j][1]] = codebook(cb, state)
    assert end == nbits, (end, nbits)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       "..", "fixtures", "exl3"))
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    T = load_file(os.path.join(args.fixtures, "tiles.safetensors"))
    step_k, step_n = (1, 1) if args.all else (5, 3)
    bad = 0
    for k in sorted(T):
        if not (k.startswith("tile.") and k.endswith(".trellis")):
            continue
        _, cb, tag, _ = k.split(".")
        rate = float(tag.replace("p", "."))
        tr = T[k].numpy()
        rec = T[k[: -len("trellis")] + "reconstructed"].float().numpy()
        mism = n = 0
        for kt in range(0, tr.shape[0], step_k):
            for nt in range(0, tr.shape[1], step_n):
                got = decode_tile(tr[kt, nt], rate, cb)
                mism += int((got != rec[16 * kt:16 * kt + 16, 16 * nt:16 * nt + 16]).sum())
                n += 256
        print(f"{cb:5s} {tag:4s} {n:6d} elements, {mism} mismatching")
        bad += mism
    print("OK: exl3.md's decoding matches exllamav3 bit for bit" if not bad else f"FAIL: {bad} mismatches")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
