#!/usr/bin/env python3
"""exllamav3's own view of a converted EXL3 checkpoint (GPU only).

Usage:  python3 e2e/exl3/device_ckpt.py --model EXL3_DIR --out DIR [--prompts 8] [--prompt-len 20]

Writes
  DIR/what.safetensors   for every quantized linear P of the checkpoint: P.what, fp16 [K_pad, N_pad] =
                         exllamav3_ext.reconstruct(trellis, b, mcg, mul1), the rotated-basis weight
                         (exllamav3's own decoder). e2e/exl3/make_reference.py turns it into
                         W = diag(suh) H What H diag(svh) in float32 on the CPU.
  DIR/exl3_logits.json   exllamav3's forward (Model.forward, attn_mode flash_attn_nc, no cache) for
                         several candidate prompts: prefill logits, 16 greedy ids by full recompute and
                         the logits that chose each of them, all float32 values of its float output.
"""

import argparse
import json
import os
import time

import torch

N_GREEDY = 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index-topk-override", type=int, default=None,
                    help="fallback only: run the forward with this index_topk (dense below it)")
    args = ap.parse_args()
    t0 = time.time()
    assert torch.cuda.is_available()
    assert os.environ.get("NVIDIA_TF32_OVERRIDE") == "0", "set NVIDIA_TF32_OVERRIDE=0"
    from exllamav3 import Config, Model
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.version import __version__ as exl3_version
    from safetensors import safe_open
    from safetensors.torch import save_file
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda:0")

    # ---- What of every quantized linear, from the files directly
    tensors = {}
    for fn in sorted(os.listdir(args.model)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(args.model, fn), "pt") as f:
                for k in f.keys():
                    tensors[k] = (fn, f)
    what = {}
    rates = {}
    for k in sorted(tensors):
        if not k.endswith(".trellis"):
            continue
        p = k[: -len(".trellis")]
        with safe_open(os.path.join(args.model, tensors[k][0]), "pt") as f:
            tr = f.get_tensor(k)
        mcg = p + ".mcg" in tensors
        mul1 = p + ".mul1" in tensors
        rate = tr.shape[-1] / 16
        w = torch.full((tr.shape[0] * 16, tr.shape[1] * 16), float("nan"), dtype=torch.half, device=dev)
        ext.reconstruct(w, tr.to(dev), float(rate), mcg, mul1)
        torch.cuda.synchronize()
        assert not torch.isnan(w).any(), p
        what[p + ".what"] = w.cpu().contiguous()
        rates[p] = dict(bits=rate, codebook="mul1" if mul1 else "mcg" if mcg else "3inst")
    save_file(what, os.path.join(args.out, "what.safetensors"), metadata={"exllamav3": exl3_version})
    print(f"[ckpt] {len(what)} quantized linears reconstructed in {time.time() - t0:.1f}s", flush=True)

    # ---- forward
    t1 = time.time()
    cfg = Config.from_directory(args.model)
    if args.index_topk_override:
        cfg.index_topk = args.index_topk_override
    model = Model.from_config(cfg)
    model.load(dev)
    print(f"[ckpt] model loaded in {time.time() - t1:.1f}s", flush=True)
    V = cfg.vocab_size

    @torch.inference_mode()
    def logits_of(ids):
        out = model.forward(torch.tensor([ids], dtype=torch.long), {"attn_mode": "flash_attn_nc"})
        return out[0, :, :V].float().cpu()

    g = torch.Generator().manual_seed(777 + args.seed)
    runs = []
    for i in range(args.prompts):
        prompt = torch.randint(0, V, (args.prompt_len,), generator=g).tolist()
        prefill = logits_of(prompt)
        seq = list(prompt)
        greedy, greedy_logits = [], []
        for _ in range(N_GREEDY):
            last = logits_of(seq)[-1]
            tok = int(torch.argmax(last))
            greedy.append(tok)
            greedy_logits.append(last)
            seq.append(tok)
        again = logits_of(prompt)
        runs.append(dict(
            prompt=prompt,
            prefill_logits=[[float(v) for v in r] for r in prefill],
            greedy=greedy,
            greedy_logits=[[float(v) for v in r] for r in greedy_logits],
            rerun_prefill_max_abs_diff=float((again - prefill).abs().max()),
        ))
        print(f"[ckpt] prompt {i}: greedy {greedy}", flush=True)
    res = dict(
        exllamav3_version=exl3_version, torch=torch.__version__, gpu=torch.cuda.get_device_name(0),
        call='Model.from_config(Config.from_directory(d)); load("cuda:0"); '
             'forward(ids, {"attn_mode": "flash_attn_nc"})[..., :vocab].float()',
        env={k: os.environ.get(k) for k in ("NVIDIA_TF32_OVERRIDE", "EXL3_GEMV", "EXL3_INT8_GEMV")},
        n_greedy=N_GREEDY, rates=rates, runs=runs, index_topk_used=cfg.index_topk,
    )
    with open(os.path.join(args.out, "exl3_logits.json"), "w") as f:
        json.dump(res, f)
    print(f"[ckpt] done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
