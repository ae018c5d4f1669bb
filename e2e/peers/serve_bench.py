#!/usr/bin/env python3
"""glmflash's decode and prefill speed through `serve` (driver of e2e/peers/device_run.sh).

Usage:  python3 e2e/peers/serve_bench.py --url http://127.0.0.1:PORT --vocab V --out JSON
            [--placement vram] [--batches 1,4] [--prompt-len 32] [--warmup 16] [--steps 128]
            [--prefill 512,8192] [--time-limit 90]

Decode: e2e/exl3/peer_bench.py's streaming client (B concurrent greedy /v1/completions with
token-id prompts, ignore_eos; tok/s over the window where all B streams run, warm-up dropped).
Prefill: for each N, one request with N random token ids and max_tokens 1 (not streamed), timed
end to end; the first at each N is a warm-up (kernel compiles, first-touch allocations), the
second is reported as N / seconds (one decode step and the HTTP round trip included, a few ms).
"""

import argparse
import http.client
import json
import os
import random
import sys
import time
from types import SimpleNamespace
from urllib.parse import urlparse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "exl3"))
import peer_bench  # noqa: E402


def prefill(url, vocab, n, time_limit, rnd):
    u = urlparse(url)
    body = json.dumps(dict(prompt=[rnd.randrange(vocab) for _ in range(n)], max_tokens=1, temperature=0,
                           ignore_eos=True))
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=time_limit)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = c.getresponse()
    data = resp.read()
    secs = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
    return secs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--placement", default="vram", help="label: vram (every expert on the GPU) or fast")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill", default="512,8192", help="prompt lengths; empty: none")
    ap.add_argument("--time-limit", type=float, default=90.0, help="seconds per measurement")
    args = ap.parse_args()
    out = dict(engine="glmflash", placement=args.placement, decode=[], prefill=[])

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    # Prefill first: a long prompt compiles the large-shape kernels the decode runs never need.
    rnd = random.Random(4321)
    for n in [int(x) for x in args.prefill.split(",") if x]:
        r = dict(prompt=n)
        try:
            r["warmup_s"] = prefill(args.url, args.vocab, n, args.time_limit, rnd)
            r["seconds"] = prefill(args.url, args.vocab, n, args.time_limit, rnd)
            r["tok_s"] = n / r["seconds"]
        except Exception as e:  # one failed length must not hide the other figures
            r["error"] = repr(e)
        out["prefill"].append(r)
        print(f"[serve_bench] prefill {r}", flush=True)
        save()

    part = args.out + ".decode.json"
    peer_bench.cmd_client(SimpleNamespace(url=args.url, vocab=args.vocab, out=part, batches=args.batches,
                                          prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps,
                                          time_limit=args.time_limit))
    out["decode"] = json.load(open(part))["runs"]
    os.remove(part)
    save()


if __name__ == "__main__":
    main()
