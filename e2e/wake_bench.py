#!/usr/bin/env python3
"""Wake to first token (issue 18, item 5): how long a hibernated server takes from its start
to the first streamed token of a request that was waiting for it, with its store present and
its routing history warm (what a hibernate keeps on the node) against a cold start with no
history; and the tiers' hit rates over the first 100 decoded tokens in each case.

The server runs a tiered mode (`--mode nvme`, a packed store, few slots a layer) so that the
history decides what is resident at start. One warm-up server serves the workload and writes
the history on SIGTERM, as a hibernating pod does; each measured start gets a fresh copy of
it (warm) or none (cold). The request is the one the activator would have held: sent as soon
as the server reports ready; the time counts from the process's start.

  e2e/wake_bench.py --bin target/release/glmflash-node [--runs 3] [--device cpu|cuda]
  e2e/wake_bench.py --device cuda --model DIR --store DIR --vram-slots V --ram-slots R
The first form makes the demo model and its store; the second serves a model and store made
elsewhere (`bench --flash --keep`'s scratch: a GLM-5.3-Flash-width model under the 3090 budget's
slot counts), with a word-per-id tokenizer over its whole vocabulary where it has none (so that
every generated id streams as text).
Prints one JSON object per start and a summary table (Markdown) at the end.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPT = "The history of the expert tiers: which experts a conversation keeps picking, " \
         "and what a server that remembers them can have ready before the first token."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.02)
    raise RuntimeError("the server did not become ready")


def stream_completion(url, tokens):
    """Streams a greedy completion; returns (seconds to the first token, tokens received,
    seconds to the end of the stream)."""
    body = json.dumps({"model": "glm-5.3-flash", "prompt": PROMPT, "max_tokens": tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"content-type": "application/json"})
    started, first, count = time.time(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                count += 1
                if first is None:
                    first = time.time() - started
    return first, count, time.time() - started


def lookups(url):
    """Decode lookups by tier from the server's /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("glmflash_expert_lookups_total{") and 'phase="decode"' in line:
            tier = line.split('tier="')[1].split('"')[0]
            out[tier] = out.get(tier, 0) + float(line.rsplit(" ", 1)[1])
    return out


def write_word_tokenizer(config, out):
    """A tokenizer.json of one word a token id ("t0", "t1", ...) over the model's vocabulary:
    every id the random model generates then decodes to text and streams as a chunk."""
    cfg = json.load(open(config))
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
               "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
               "post_processor": None, "decoder": None,
               "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)},
                         "unk_token": "t0"}}, open(out, "w"))


def start(args, work, port, history):
    cmd = [args.bin, "serve", "--model", f"{work}/model", "--mode", "nvme", "--store",
           args.store or f"{work}/store", "--vram-slots", str(args.vram_slots), "--ram-slots",
           str(args.ram_slots), "--device", args.device, "--host", "127.0.0.1",
           "--port", str(port), "--history", history]
    log = open(f"{work}/serve.{port}.log", "w")
    return subprocess.Popen(cmd + args.serve_arg, stdout=log, stderr=subprocess.STDOUT)


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def one_start(args, work, history):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    proc = start(args, work, port, history)
    try:
        wait_ready(url, proc)
        ready = time.time() - t0
        before = lookups(url)
        ttft, got, whole = stream_completion(url, args.tokens)
        after = lookups(url)
        first_token = ready + ttft
    finally:
        stop(proc)
    # The background fill's own report (experts loaded, seconds), when the server logged it.
    fill = None
    for line in open(f"{work}/serve.{port}.log", errors="replace"):
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        if "tiers warm-started" in line:
            fill = {k: float(v) for k, v in re.findall(r"\b(loaded|secs)=([0-9.]+)", line)}
    seen = {t: after.get(t, 0) - before.get(t, 0) for t in after}
    total = sum(seen.values()) or 1
    return {"ready_s": round(ready, 3), "first_token_s": round(first_token, 3),
            "last_token_s": round(ready + whole, 3), "tokens": got, "fill": fill, "hit_rate": {t: round(v / total, 3) for t, v in sorted(seen.items())}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="target/release/glmflash-node")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vram-slots", type=int, default=2)
    p.add_argument("--ram-slots", type=int, default=3)
    p.add_argument("--model", help="serve this model (with --store) instead of the demo")
    p.add_argument("--store", help="the packed store of --model")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for every `serve` (repeat)")
    a = p.parse_args()
    if bool(a.model) != bool(a.store):
        p.error("--model and --store go together")
    work = tempfile.mkdtemp(prefix="glmflash-wake-", dir=os.environ.get("SCRATCH", "."))
    try:
        subprocess.run([a.bin, "make-demo-model", "--out", f"{work}/demo"], check=True,
                       capture_output=True)
        if a.model:
            # The model's files, linked, and the demo's tokenizer where it has none.
            os.mkdir(f"{work}/model")
            for name in os.listdir(a.model):
                os.symlink(os.path.abspath(os.path.join(a.model, name)), f"{work}/model/{name}")
            if not os.path.exists(f"{work}/model/tokenizer.json"):
                write_word_tokenizer(f"{a.model}/config.json", f"{work}/model/tokenizer.json")
        else:
            os.rename(f"{work}/demo", f"{work}/model")
            subprocess.run([a.bin, "pack-store", "--model", f"{work}/model", "--store",
                            f"{work}/store"], check=True, capture_output=True)
        # The workload before hibernation: the same conversation, served, then SIGTERM.
        history = f"{work}/history.json"
        port = free_port()
        proc = start(a, work, port, history)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            for _ in range(3):
                stream_completion(f"http://127.0.0.1:{port}", a.tokens)
        finally:
            stop(proc)
        if not os.path.exists(history):
            sys.exit("the server wrote no routing history on SIGTERM")
        rows = {"warm": [], "cold": []}
        for run in range(a.runs):
            for kind in ("warm", "cold"):
                h = f"{work}/h.{kind}.{run}.json"
                if kind == "warm":
                    shutil.copy(history, h)
                r = one_start(a, work, h)
                r.update(kind=kind, run=run)
                print(json.dumps(r), flush=True)
                rows[kind].append(r)
        print("\n| start | ready (s) | first token (s) | last token (s) | decode hit rate by tier, "
              f"first {a.tokens} tokens |\n|---|---|---|---|---|")
        for kind, rs in rows.items():
            tiers = sorted({t for r in rs for t in r["hit_rate"]})
            rate = ", ".join(f"{t} {statistics.median(r['hit_rate'].get(t, 0) for r in rs):.3f}"
                             for t in tiers)
            print(f"| {kind} | {statistics.median(r['ready_s'] for r in rs):.3f} | "
                  f"{statistics.median(r['first_token_s'] for r in rs):.3f} | "
                  f"{statistics.median(r['last_token_s'] for r in rs):.3f} | {rate} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
