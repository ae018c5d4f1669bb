#!/usr/bin/env python3
"""Do llama.cpp and glmflash compute the same model? Logits of one fixed prompt, both engines, one
checkpoint (make_checkpoint.py) and its GGUF (convert.py).

Usage:  python3 e2e/peers/agree.py --model CKPT_DIR --gguf M.gguf --llama-logits BIN --glmflash BIN
                                   [--prompt-len 40] [--greedy 16] [--device cpu] [--ngl 0]
                                   [--threads N] [--out agree.json] [--max-rel-l2 X]

Prompt: `--prompt-len` ids drawn with a fixed seed below the GLM specials. llama.cpp runs through
e2e/peers/llama_logits.cpp (every prompt position's logits in one batch, then greedy steps decoded
with its cache). glmflash runs `logits --tokens P --greedy N` (its own cached greedy ids) and, for
the per-position logits, `logits --dump` over the prompt followed by llama.cpp's greedy tokens
(teacher forcing), so step k of both is the distribution after the same context.

With --hf, transformers (Glm5NextForConditionalGeneration, float32, no cache) runs the same prompt
too, and each engine's prefill logits are also compared with it, so a disagreement can be laid at
one engine's door.

Reports (stdout and --out JSON): prefill rel L2 (||a - b|| / ||b||, b = glmflash) over all positions
and per position, argmax agreement per position, greedy ids of both and the first position where
they differ with both engines' top-5 (id, logit) there. Exit status 1 when the greedy ids differ or
the prefill rel L2 exceeds --max-rel-l2 (default: no bound; pass one for an F32 GGUF).
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np


def dump_logits(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        t = h["logits"]
        assert t["dtype"] == "F32", t
        a, b = t["data_offsets"]
        f.seek(8 + n + a)
        return np.frombuffer(f.read(b - a), dtype=np.float32).reshape(t["shape"])


def glmflash(args, tokens, greedy, dump=None):
    cmd = [args.glmflash, "logits", "--model", args.model, "--device", args.device,
           "--tokens", ",".join(map(str, tokens)), "--greedy", str(greedy)]
    if dump:
        cmd += ["--dump", dump]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"glmflash logits failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def top5(row):
    idx = np.argsort(-row, kind="stable")[:5]
    return [[int(i), round(float(row[i]), 5)] for i in idx]


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def hf_logits(model, prompt):
    """transformers' float32 prefill logits (the reference our fixtures come from)."""
    import contextlib

    import torch
    from transformers import Glm5NextForConditionalGeneration

    with contextlib.redirect_stdout(sys.stderr):  # its load report (the vision tower's missing tensors)
        m = Glm5NextForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].double().numpy()


def versus(a, ref):
    per = [rel_l2(a[i], ref[i]) for i in range(len(ref))]
    return dict(rel_l2=rel_l2(a, ref), max_position=int(np.argmax(per)), max_rel_l2=max(per),
                positions_over_0_01=[i for i, x in enumerate(per) if x > 1e-2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llama-logits", required=True, help="the built e2e/peers/llama_logits.cpp")
    ap.add_argument("--glmflash", required=True, help="the glmflash-node binary")
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--device", default="cpu", help="glmflash --device")
    ap.add_argument("--ngl", type=int, default=0, help="llama.cpp layers on the GPU")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-rel-l2", type=float, default=None)
    ap.add_argument("--hf", action="store_true", help="also compare both with transformers (needs torch)")
    args = ap.parse_args()

    cfg = json.load(open(os.path.join(args.model, "config.json")))
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(0, vocab - 4, args.prompt_len)]

    with tempfile.TemporaryDirectory() as tmp:
        lj = os.path.join(tmp, "llama.json")
        r = subprocess.run([args.llama_logits, args.gguf, ",".join(map(str, prompt)), str(args.greedy), lj,
                            str(args.ngl), str(args.threads)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"llama_logits failed ({r.returncode}): {r.stderr[-3000:]}")
        lm = json.load(open(lj))
        ours = glmflash(args, prompt, args.greedy)
        forced = prompt + lm["greedy"][:-1]
        dump = os.path.join(tmp, "dump.safetensors")
        glmflash(args, forced, 0, dump)
        ours_all = dump_logits(dump)

    P = len(prompt)
    a_pre, b_pre = np.array(lm["prefill_logits"], dtype=np.float64), ours_all[:P].astype(np.float64)
    a_gr, b_gr = np.array(lm["greedy_logits"], dtype=np.float64), ours_all[P - 1:].astype(np.float64)
    per_pos = [rel_l2(a_pre[i], b_pre[i]) for i in range(P)]
    per_step = [rel_l2(a_gr[i], b_gr[i]) for i in range(len(a_gr))]
    argmax_eq = [bool(a_pre[i].argmax() == b_pre[i].argmax()) for i in range(P)]
    first = next((k for k, (x, y) in enumerate(zip(lm["greedy"], ours["greedy"])) if x != y), None)
    res = dict(
        model=args.model, gguf=os.path.basename(args.gguf), prompt=prompt,
        prefill_rel_l2=rel_l2(a_pre, b_pre), prefill_rel_l2_max_position=max(per_pos),
        prefill_rel_l2_per_position=[round(x, 6) for x in per_pos],
        prefill_argmax_agree=f"{sum(argmax_eq)}/{P}",
        greedy_llama=lm["greedy"], greedy_glmflash=ours["greedy"],
        greedy_equal=f"{sum(x == y for x, y in zip(lm['greedy'], ours['greedy']))}/{args.greedy}",
        greedy_step_rel_l2=[round(x, 6) for x in per_step],
        first_disagreement=None,
    )
    if args.hf:
        ref = hf_logits(args.model, prompt)
        res["llama_vs_transformers"] = versus(a_pre, ref)
        res["glmflash_vs_transformers"] = versus(b_pre, ref)
    if first is not None:
        res["first_disagreement"] = dict(step=first, llama_top5=top5(a_gr[first]), glmflash_top5=top5(b_gr[first]))
    print(json.dumps({k: v for k, v in res.items() if k not in ("prompt", "prefill_rel_l2_per_position")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    bad = first is not None or (args.max_rel_l2 is not None and res["prefill_rel_l2"] > args.max_rel_l2)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
