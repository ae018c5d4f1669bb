"""Concurrent-stream benchmark of a running server with the official openai client.

Usage: python e2e/api_bench.py URL [--streams 1,4,8] [--max-tokens 128]
                                   [--model-dir DIR --bandwidth-gbs GB/S]
For each concurrency: every stream asks for exactly --max-tokens tokens (ignore_eos), and
the table gives aggregate tok/s, mean per-stream decode tok/s, and TTFT p50/p99.

With --model-dir (the served checkpoint) and --bandwidth-gbs (measured read bandwidth, e.g.
`glmflash-node bench`'s read_bandwidth_gb_s), a roofline column: the measured time of one
decode step (one token of every stream) against the time its bytes need at that bandwidth.
A step reads every non-expert weight once (the embedding table aside: one row per token),
the routed experts the batch picks (E(1 - (1 - k/E)^b) distinct ones per MoE layer for b
tokens picking k of E at random), and every running sequence's cache, whose bytes are
sampled from the server's glmflash_kv_bytes_used while the streams run.
"""

import argparse
import json
import os
import re
import statistics
import struct
import threading
import time
import urllib.request

import openai


def tensor_bytes(model_dir):
    """{name: bytes} from the safetensors headers of a checkpoint directory."""
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                out[name] = t["data_offsets"][1] - t["data_offsets"][0]
    return out


def weight_bytes_per_step(model_dir, batch):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    tensors = tensor_bytes(model_dir)
    expert = re.compile(r"layers\.(\d+)\..*\.experts\.(\d+)\.")
    routed, layers, experts = 0, set(), set()
    for name, b in tensors.items():
        m = expert.search(name)
        if m:
            routed += b
            layers.add(m.group(1))
            experts.add(m.group(2))
    embed = sum(b for name, b in tensors.items() if "embed_tokens" in name)
    other = sum(tensors.values()) - routed - embed
    e, k = len(experts), cfg["num_experts_per_tok"]
    per_expert = routed / max(1, len(layers) * e)
    distinct = e * (1 - (1 - k / e) ** batch)
    return other + len(layers) * distinct * per_expert


def kv_bytes_used(url):
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("glmflash_kv_bytes_used "):
                return float(line.split()[1])
    return 0.0


def one(client, model, max_tokens, out, i, barrier):
    barrier.wait()
    start = time.perf_counter()
    first = None
    tokens = 0
    for c in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Story number {i}, please."}],
        max_tokens=max_tokens,
        stream=True,
        logprobs=True,
        extra_body={"ignore_eos": True},
    ):
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
            if first is None:
                first = time.perf_counter()
            tokens += len(c.choices[0].logprobs.content)
    end = time.perf_counter()
    out[i] = (first - start, tokens, (tokens - 1) / max(end - first, 1e-9), end - start)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--model", default="glm-5.3-flash")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model-dir", help="the served checkpoint (for the roofline column)")
    ap.add_argument("--bandwidth-gbs", type=float, help="measured read bandwidth, GB/s")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.url.rstrip("/") + "/v1", api_key="unused", max_retries=0)
    roofline = a.model_dir is not None and a.bandwidth_gbs is not None
    head = "| streams | aggregate tok/s | per-stream tok/s (mean) | TTFT p50 (s) | TTFT p99 (s) |"
    if roofline:
        head += " step ms (measured) | step bytes (MB) | step ms at roofline | roofline ratio |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for n in [int(x) for x in a.streams.split(",")]:
        out = {}
        barrier = threading.Barrier(n)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(client, a.model, a.max_tokens, out, i, barrier))
                   for i in range(n)]
        for t in threads:
            t.start()
        kv = []
        while any(t.is_alive() for t in threads):
            if roofline:
                used = kv_bytes_used(a.url)
                if used > 0:
                    kv.append(used)
            time.sleep(0.05)
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        ttfts = [v[0] for v in out.values()]
        total = sum(v[1] for v in out.values())
        per = statistics.mean(v[2] for v in out.values())
        row = f"| {n} | {total / wall:.1f} | {per:.1f} | {pct(ttfts, 50):.3f} | {pct(ttfts, 99):.3f} |"
        if roofline:
            step_ms = 1000 / per
            step_bytes = weight_bytes_per_step(a.model_dir, n) + (statistics.mean(kv) if kv else 0)
            roof_ms = step_bytes / (a.bandwidth_gbs * 1e9) * 1000
            row += f" {step_ms:.2f} | {step_bytes / 1e6:.1f} | {roof_ms:.2f} | {roof_ms / step_ms:.2f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
