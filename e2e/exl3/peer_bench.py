#!/usr/bin/env python3
"""Decode speed of exllamav3 and of glmflash on the same EXL3 checkpoint (driver of peer_bench.sh).

  peer_bench.py exl3    --model DIR --out JSON [--batches 1,4] [--prompt-len 32] [--warmup 16] [--steps 128]
                        [--prefill 512,8192]
  peer_bench.py client  --url http://127.0.0.1:PORT --vocab V --out JSON [same options]
  peer_bench.py summary --model DIR --out JSON PART.json...

`exl3` (GPU, exllamav3 importable): loads the model with everything on cuda:0, a Cache and its
Generator (the way exllamav3's examples do), and for each batch size B enqueues B greedy jobs
(ArgmaxSampler, no stop conditions, min_new_tokens = max_new_tokens = warmup + steps + 2) with
distinct random prompts, calls `Generator.iterate()` until they finish, and times each call. The
steady state is the calls after which every job had one more token (decode steps of the full
batch): the first `warmup` of them are dropped, the next `steps` timed (calls between them that
added nothing count in the time). Also records which MoE
path each sparse layer can take (`bc` = the fused bsz<=8 decode kernels, `support_fused`) and a
cache-free forward's logits statistics (finite, spread) as a health check.

With --prefill, also each prompt length's prefill: one job of that many random ids and one new
token through the same Generator, run twice, the second timed (prompt ids / seconds).

`client` (any Python): glmflash's GPU decoder through `serve` (the only command that runs
`GpuDecoder` on a checkpoint directory): for each B, B concurrent streaming /v1/completions
requests with token-id prompts, temperature 0, ignore_eos; each SSE chunk's arrival time is
recorded per stream; the steady state is the window after every stream has `warmup` tokens, up to
the point where the first stream has warmup + steps.

`summary`: merges the parts with the checkpoint's bytes.json (make_random_exl3.py) into one JSON:
tok/s and ms per step per engine and batch, and bytes per decode token (dense EXL3 bytes + top_k
experts per MoE layer) for rooflines.
"""

import argparse
import json
import os
import sys
import threading
import time


def steady(times, counts, batch, warmup, steps):
    """Times and token counts after each call; full-batch decode calls add one token to every job.
    Returns (tokens, seconds, full calls) from the (warmup+1)-th full call through `steps` full
    calls, any calls in between (that added nothing) included in the time."""
    full = [i for i in range(1, len(times)) if counts[i] - counts[i - 1] == batch]
    if len(full) < warmup + 2:
        return None
    sel = full[warmup:warmup + steps]
    first, last = sel[0], sel[-1]
    return (counts[last] - counts[first - 1], times[last] - times[first - 1], len(sel))


def cmd_exl3(args):
    import torch
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.generator.sampler import ArgmaxSampler
    from exllamav3.version import __version__ as exl3_version

    t0 = time.time()
    out = dict(engine="exllamav3", version=exl3_version, torch=torch.__version__,
               gpu=torch.cuda.get_device_name(0), env={k: os.environ.get(k) for k in (
                   "EXL3_GEMV", "EXL3_INT8_GEMV", "NVIDIA_TF32_OVERRIDE", "PYTORCH_CUDA_ALLOC_CONF")},
               runs=[])

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    batches = [int(b) for b in args.batches.split(",")]
    prefill = [int(n) for n in args.prefill.split(",") if n]
    cfg = Config.from_directory(args.model)
    model = Model.from_config(cfg)
    ctx = args.prompt_len + args.warmup + args.steps + 64
    need = max([max(batches) * ctx] + [n + 64 for n in prefill])
    cache = Cache(model, max_num_tokens=max(8192, 256 * ((need + 255) // 256 + 1)))
    model.load(device="cuda:0", progressbar=False)
    tokenizer = Tokenizer.from_config(cfg)
    out["load_s"] = time.time() - t0
    out["vram_gib_after_load"] = torch.cuda.memory_allocated() / 2**30
    print(f"[exl3] loaded in {out['load_s']:.1f}s, {out['vram_gib_after_load']:.1f} GiB", flush=True)

    # Which MoE path each sparse layer can take.
    paths = []

    def walk(m):
        if type(m).__name__ == "BlockSparseMLP":
            paths.append(dict(key=m.key, quantized=getattr(m, "is_quantized", None),
                              support_fused=getattr(m, "support_fused", None),
                              support_bc_bszn=getattr(m, "support_bc_bszn", None),
                              bc=getattr(m, "bc", None) is not None))
        for s in getattr(m, "modules", []) or []:
            walk(s)

    for m in model.modules:
        walk(m)
    out["moe_paths"] = paths
    print(f"[exl3] MoE layers: {paths}", flush=True)

    g = torch.Generator().manual_seed(1234)
    V = cfg.vocab_size
    try:  # a failing health check must not cost the speed figures
        with torch.inference_mode():
            ids = torch.randint(0, V, (1, args.prompt_len), generator=g)
            logits = model.forward(ids, {"attn_mode": "flash_attn_nc"})[0, -1, :V].float()
            out["health"] = dict(finite=bool(torch.isfinite(logits).all()), std=float(logits.std()),
                                 max=float(logits.max()), min=float(logits.min()), argmax=int(logits.argmax()))
    except Exception as e:
        out["health"] = dict(error=repr(e))
    print(f"[exl3] health {out['health']}", flush=True)
    save()

    gen = Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=max(batches))
    for B in batches:
        n_new = args.warmup + args.steps + 2
        jobs = []
        for i in range(B):
            p = torch.randint(0, V, (1, args.prompt_len), generator=g)
            jobs.append(Job(input_ids=p, max_new_tokens=n_new, min_new_tokens=n_new, stop_conditions=[],
                            sampler=ArgmaxSampler(), identifier=i))
            gen.enqueue(jobs[-1])
        times, counts = [time.perf_counter()], [0]
        deadline = time.time() + args.time_limit
        while gen.num_remaining_jobs() and time.time() < deadline:
            gen.iterate()
            times.append(time.perf_counter())
            counts.append(sum(j.new_tokens for j in jobs))
        r = dict(batch=B, calls=len(times) - 1, tokens=counts[-1], finished=not gen.num_remaining_jobs(),
                 text_head=[getattr(j, "full_completion", "")[:80] for j in jobs[:2]])
        if not r["finished"]:
            gen.clear_queue()
        s = steady(times, counts, B, args.warmup, args.steps)
        if s:
            tokens, secs, calls = s
            r.update(tok_s=tokens / secs, ms_per_step=secs * 1e3 / calls, steps_timed=calls)
        out["runs"].append(r)
        print(f"[exl3] batch {B}: {r}", flush=True)
        save()
    out["prefill"] = []
    for n in prefill:
        secs = []
        for _ in range(2):  # the first warms the kernels for this length
            job = Job(input_ids=torch.randint(0, V, (1, n), generator=g), max_new_tokens=1,
                      min_new_tokens=1, stop_conditions=[], sampler=ArgmaxSampler(), identifier="prefill")
            gen.enqueue(job)
            start = time.perf_counter()
            deadline = time.time() + args.time_limit
            while gen.num_remaining_jobs() and time.time() < deadline:
                gen.iterate()
            secs.append(time.perf_counter() - start)
            if gen.num_remaining_jobs():
                gen.clear_queue()
                secs = []
                break
        r = dict(prompt=n, warmup_s=secs[0], seconds=secs[1], tok_s=n / secs[1]) if secs else dict(prompt=n, error="timed out")
        out["prefill"].append(r)
        print(f"[exl3] prefill {r}", flush=True)
        save()
    out["total_s"] = time.time() - t0
    save()


def cmd_client(args):
    import http.client
    from urllib.parse import urlparse

    u = urlparse(args.url)
    out = dict(engine="glmflash-serve", decoder="serve (GpuDecoder when serve_decoder_log says so)", runs=[])

    def stream(prompt, n, arrivals, errors):
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=args.time_limit)
            body = json.dumps(dict(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, stream=True))
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = c.getresponse()
            if resp.status != 200:
                errors.append(f"HTTP {resp.status}: {resp.read()[:300]!r}")
                return
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ch = json.loads(data)
                c0 = (ch.get("choices") or [{}])[0]
                # one chunk per token; the closing chunk (finish_reason, no text) is not a token
                if "text" in c0 and (c0.get("finish_reason") is None or c0["text"]):
                    arrivals.append(time.perf_counter())
        except Exception as e:  # a hung or failed stream must not hide the others' figures
            errors.append(repr(e))

    def scrape():
        """The server's GPU forward calls and seconds, and tokens decoded, from /metrics."""
        murl = getattr(args, "metrics_url", None)
        if not murl:
            return None
        m = urlparse(murl)
        try:
            c = http.client.HTTPConnection(m.hostname, m.port, timeout=10)
            c.request("GET", m.path or "/metrics")
            text = c.getresponse().read().decode()
        except OSError:
            return None
        vals = {}
        for line in text.splitlines():
            for key in ("glmflash_gpu_forward_seconds_sum", "glmflash_gpu_forward_seconds_count",
                        "glmflash_decode_tokens_total"):
                if line.startswith(key + " ") or line.startswith(key + "{"):
                    vals[key] = vals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return vals

    import random
    rnd = random.Random(1234)
    for B in [int(b) for b in args.batches.split(",")]:
        n = args.warmup + args.steps + 2
        arrivals = [[] for _ in range(B)]
        errors = []
        threads = [threading.Thread(target=stream, daemon=True, args=(
            [rnd.randrange(args.vocab) for _ in range(args.prompt_len)], n, arrivals[i], errors)) for i in range(B)]
        before, t_start = scrape(), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.time_limit)
        wall, after = time.perf_counter() - t_start, scrape()
        r = dict(batch=B, tokens_per_stream=[len(a) for a in arrivals], errors=errors[:4])
        if before and after:
            # The whole request's span (prefill included), on the server: how many GPU forward
            # calls (ticks), their time, and the tokens decoded; the rest of the wall time is
            # the engine's host work between forwards and the client's.
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            calls = d.get("glmflash_gpu_forward_seconds_count", 0.0)
            if calls:
                r["server"] = dict(
                    forward_calls=int(calls),
                    forward_ms_per_call=d["glmflash_gpu_forward_seconds_sum"] * 1e3 / calls,
                    tokens_per_call=d.get("glmflash_decode_tokens_total", 0.0) / calls,
                    wall_ms_per_call=wall * 1e3 / calls)
        # Window: from the moment every stream has its warmup tokens to the moment the first
        # stream has warmup + steps tokens (all streams still running in between).
        if all(len(a) > args.warmup + 1 for a in arrivals):
            start = max(a[args.warmup - 1] for a in arrivals)
            end = min(a[min(len(a), args.warmup + args.steps) - 1] for a in arrivals)
            toks = sum(sum(1 for t in a if start < t <= end) for a in arrivals)
            if end > start and toks:
                r.update(tok_s=toks / (end - start), ms_per_step=(end - start) * 1e3 * B / toks, tokens_timed=toks)
        out["runs"].append(r)
        print(f"[client] batch {B}: {r}", flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def cmd_summary(args):
    bytes_ = json.load(open(os.path.join(args.model, "bytes.json")))
    res = dict(checkpoint=bytes_, engines={})
    for name in ("gpu.txt", "glmflash_version.txt"):  # written beside the summary by peer_bench.sh
        path = os.path.join(os.path.dirname(os.path.abspath(args.out)), name)
        if os.path.exists(path):
            res[name.split(".")[0]] = open(path).read().strip()
    for p in args.parts:
        try:
            doc = json.load(open(p))
        except Exception as e:
            res.setdefault("missing", []).append(f"{p}: {e}")
            continue
        name = doc.get("engine", os.path.basename(p))
        if "bench_json" in doc:  # glmflash `bench --model`: one decode run per batch size
            doc["runs"] = [dict(batch=r["streams"], tok_s=r["tok_s"], ms_per_step=r["ms_per_step"])
                           for r in doc["bench_json"].get("decode", [])]
        res["engines"][name] = doc
    table = []
    per_tok = bytes_["decode_bytes_per_token"]
    for name, doc in res["engines"].items():
        for r in doc.get("runs", []):
            if r.get("tok_s"):
                steps_s = 1e3 / r["ms_per_step"]
                # bytes one step reads: the dense weights once and top_k experts per token per MoE
                # layer (distinct experts of a batch overlap in reality, so B > 1 is an upper bound)
                step_bytes = bytes_["rest"] + r["batch"] * (per_tok - bytes_["rest"])
                table.append(dict(engine=name, batch=r["batch"], tok_s=round(r["tok_s"], 2),
                                  ms_per_step=round(r["ms_per_step"], 3),
                                  weight_gb_s_at_most=round(step_bytes * steps_s / 1e9, 1)))
    res["table"] = table
    # Prefill tok/s per prompt length, and glmflash's over exllamav3's.
    peer = {r["prompt"]: r["tok_s"] for r in res["engines"].get("exllamav3", {}).get("prefill", []) if r.get("tok_s")}
    res["prefill_table"] = [
        dict(engine=name, prompt=r["prompt"], tok_s=round(r["tok_s"], 1),
             over_exllamav3=round(r["tok_s"] / peer[r["prompt"]], 3) if r["prompt"] in peer else None)
        for name, doc in res["engines"].items() for r in doc.get("prefill", []) if r.get("tok_s")]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'engine':22} {'batch':>5} {'tok/s':>9} {'ms/step':>9} {'GB/s<=':>8}")
    for t in table:
        print(f"{t['engine']:22} {t['batch']:>5} {t['tok_s']:>9} {t['ms_per_step']:>9} {t['weight_gb_s_at_most']:>8}")
    if res["prefill_table"]:
        print(f"{'engine':22} {'prompt':>6} {'prefill tok/s':>14} {'/ exllamav3':>12}")
        for t in res["prefill_table"]:
            print(f"{t['engine']:22} {t['prompt']:>6} {t['tok_s']:>14} {str(t['over_exllamav3']):>12}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("exl3", "client"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True)
        s.add_argument("--batches", default="1,4")
        s.add_argument("--prompt-len", type=int, default=32)
        s.add_argument("--warmup", type=int, default=16)
        s.add_argument("--steps", type=int, default=128)
        s.add_argument("--time-limit", type=float, default=120.0, help="seconds per batch size")
    sub.choices["exl3"].add_argument("--model", required=True)
    sub.choices["exl3"].add_argument("--prefill", default="",
                                     help="prompt lengths to time a prefill of, comma-separated (e.g. 512,8192)")
    sub.choices["client"].add_argument("--url", required=True)
    sub.choices["client"].add_argument("--vocab", type=int, required=True)
    sub.choices["client"].add_argument("--metrics-url",
                                       help="the server's /metrics: GPU forward time and calls per batch size")
    s = sub.add_parser("summary")
    s.add_argument("--model", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("parts", nargs="*")
    args = ap.parse_args()
    {"exl3": cmd_exl3, "client": cmd_client, "summary": cmd_summary}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
