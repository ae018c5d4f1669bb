#!/usr/bin/env python3
"""Merge device_run.sh's parts into one table: llama.cpp Q4_K_M against glmflash (q4_k experts, bf16
dense) on the same checkpoint, per placement, decode at 1 and 4 streams and prefill per prompt length.

Usage:  python3 e2e/peers/summary.py OUT_DIR      (writes OUT_DIR/peers.json, prints the table)

Parts read from OUT_DIR (any may be missing; the row then shows null):
  llama_bench_{gpu,cpu}.json   llama-bench -o json (tg128 = decode 1 stream, pp512 / pp8192 = prefill)
  batched_{gpu,cpu}.jsonl      llama-batched-bench --output-format jsonl (speed_tg at pl 1 and 4)
  glmflash_{vram,fast,vram_dense_q4k}.json    e2e/peers/serve_bench.py
  checkpoint.json, agree*.json, gpu.txt, versions.txt
Placements: gpu = llama.cpp -ngl 99 vs glmflash every expert in VRAM; gpu_dense_q4k = the same with
our dense weights in q4_k too (Q4_K_M keeps them at ~5 bits; ours bf16 otherwise); cpu = llama.cpp
-ngl 99 -ot exps=CPU vs glmflash --mode fast (experts in RAM on the CPU lane). ratio = glmflash /
llama.cpp.
"""

import json
import os
import sys


def load(path):
    try:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in open(path) if line.startswith("{")]
        return json.load(open(path))
    except Exception:
        return None


def llama_bench(doc, n_prompt, n_gen):
    for r in doc or []:
        if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen:
            return r.get("avg_ts")
    return None


def batched(doc, pl):
    for r in doc or []:
        if r.get("pl") == pl:
            return r.get("speed_tg")
    return None


def ours_decode(doc, batch):
    for r in (doc or {}).get("decode", []):
        if r.get("batch") == batch:
            return r.get("tok_s")
    return None


def ours_prefill(doc, n):
    for r in (doc or {}).get("prefill", []):
        if r.get("prompt") == n:
            return r.get("tok_s")
    return None


def main():
    d = sys.argv[1]
    res = dict(checkpoint=load(os.path.join(d, "checkpoint.json")), table=[])
    for name in ("gpu.txt", "versions.txt"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            res[name.split(".")[0]] = open(p).read().strip()
    for name in sorted(os.listdir(d)):
        if name.startswith("agree") and name.endswith(".json"):
            a = load(os.path.join(d, name)) or {}
            res[name[:-5]] = {k: a.get(k) for k in ("gguf", "prefill_rel_l2", "prefill_argmax_agree",
                                                    "greedy_equal", "first_disagreement")}
    prefill_lengths = sorted({r.get("prompt") for p in ("vram", "fast", "vram_dense_q4k")
                              for r in (load(os.path.join(d, f"glmflash_{p}.json")) or {}).get("prefill", [])}
                             | {512, 8192})
    for placement, ours_name, llama_label in (("gpu", "vram", "-ngl 99"),
                                              ("gpu_dense_q4k", "vram_dense_q4k", "-ngl 99"),
                                              ("cpu", "fast", "-ngl 99 -ot exps=CPU")):
        peer = placement.split("_")[0]
        lb = load(os.path.join(d, f"llama_bench_{peer}.json"))
        bb = load(os.path.join(d, f"batched_{peer}.jsonl"))
        ours = load(os.path.join(d, f"glmflash_{ours_name}.json"))
        rows = [("decode", "1 stream", llama_bench(lb, 0, 128), ours_decode(ours, 1)),
                ("decode", "1 stream (batched-bench)", batched(bb, 1), ours_decode(ours, 1)),
                ("decode", "4 streams", batched(bb, 4), ours_decode(ours, 4))]
        rows += [("prefill", f"{n} tokens", llama_bench(lb, n, 0), ours_prefill(ours, n)) for n in prefill_lengths]
        for kind, what, peer, us in rows:
            res["table"].append(dict(
                placement=placement, llama_cpp=llama_label, glmflash=ours_name, kind=kind, what=what,
                llama_tok_s=None if peer is None else round(peer, 1),
                glmflash_tok_s=None if us is None else round(us, 1),
                ratio=None if not (peer and us) else round(us / peer, 3)))
    with open(os.path.join(d, "peers.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'placement':13} {'kind':8} {'what':26} {'llama.cpp':>10} {'glmflash':>10} {'ratio':>7}")
    for t in res["table"]:
        print(f"{t['placement']:13} {t['kind']:8} {t['what']:26} {str(t['llama_tok_s']):>10} "
              f"{str(t['glmflash_tok_s']):>10} {str(t['ratio']):>7}")
    for k, v in res.items():
        if k.startswith("agree"):
            print(k, json.dumps(v))


if __name__ == "__main__":
    main()
