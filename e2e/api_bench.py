"""Concurrent-stream benchmark of a running server with the official openai client.

Usage: python e2e/api_bench.py URL [--streams 1,4,8] [--max-tokens 128]
For each concurrency: every stream asks for exactly --max-tokens tokens (ignore_eos), and
the table gives aggregate tok/s, mean per-stream decode tok/s, and TTFT p50/p99.
"""

import argparse
import statistics
import threading
import time

import openai


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
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.url.rstrip("/") + "/v1", api_key="unused", max_retries=0)
    print("| streams | aggregate tok/s | per-stream tok/s (mean) | TTFT p50 (s) | TTFT p99 (s) |")
    print("|---|---|---|---|---|")
    for n in [int(x) for x in a.streams.split(",")]:
        out = {}
        barrier = threading.Barrier(n)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(client, a.model, a.max_tokens, out, i, barrier))
                   for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        ttfts = [v[0] for v in out.values()]
        total = sum(v[1] for v in out.values())
        per = statistics.mean(v[2] for v in out.values())
        print(f"| {n} | {total / wall:.1f} | {per:.1f} | {pct(ttfts, 50):.3f} | {pct(ttfts, 99):.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
