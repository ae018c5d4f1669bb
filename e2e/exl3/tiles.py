#!/usr/bin/env python3
"""EXL3 tile and linear-layer reference data from exllamav3's own CUDA extension (GPU only).

Usage:  python3 e2e/exl3/tiles.py --out DIR [--seed N]

Writes DIR/tiles.safetensors and DIR/tiles.json (manifest). See e2e/exl3/README.md.

  tile.{cb}.{tag}.trellis        int16 [K/16, N/16, 16*b]   random bits (K = 256, N = 128)
  tile.{cb}.{tag}.reconstructed  fp16  [K, N]               ext.reconstruct(w, trellis, b, mcg, mul1):
                                                            the rotated-basis weight What, no Hadamard,
                                                            no suh/svh
  lin.{cb}.{tag}.suh / .svh      fp16 [K] / [N]             random sign x scale
  lin.{cb}.{tag}.x               fp16 [5, K]
  lin.{cb}.{tag}.y               fp16 [5, N]  LinearEXL3.forward(x) with default settings (rows <= 144:
                                              ext BC_LinearEXL3.run -> exl3_gemm; the GEMV or GEMM kernel
                                              by exllamav3's own heuristic; manifest "path")
  lin.{cb}.{tag}.y_gemm          fp16 [5, N]  same with EXL3_GEMV=0 (Marlin-style GEMM kernel)
  lin.{cb}.{tag}.y_recon         fp16 [5, N]  same with params {"reconstruct": True} (reconstruct What
                                              to fp16, had_r_128 on x, hgemm, had_r_128 on y: the > 144
                                              rows path)
  The lin tensors reuse tile.{cb}.{tag}.trellis as the layer's trellis.
{cb}: 3inst | mcg | mul1; {tag}: rate with '.' -> 'p' (2, 2p5, ...).
"""

import argparse
import json
import math
import os
import sys
import time

import torch

K_IN, N_OUT, ROWS = 256, 128, 5
CODEBOOKS = {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}
CANDIDATE_RATES = [1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8]
LIN_PAIRS = [("mul1", 1.5), ("mul1", 2), ("mul1", 2.5), ("mul1", 3), ("mul1", 3.5), ("mul1", 4),
             ("mul1", 6), ("mul1", 8), ("mcg", 2), ("mcg", 3), ("mcg", 5), ("3inst", 2),
             ("3inst", 3), ("3inst", 4), ("3inst", 6)]


def tag_of(rate):
    return str(rate).replace(".", "p") if rate != int(rate) else str(int(rate))


def words(rate):
    return int(round(16 * rate))


def had128(device):
    n = 128
    i = torch.arange(n)
    pc = torch.zeros((n, n), dtype=torch.int64)
    a = i[:, None] & i[None, :]
    for b in range(7):
        pc += (a >> b) & 1
    return ((1 - 2 * (pc % 2)).double() / math.sqrt(n)).to(device)


def weight_f64(what, suh, svh, H):
    """W = diag(suh) H What H diag(svh) in float64, H block-diagonal 128x128."""
    k, n = what.shape
    w = what.double()
    w = (H @ w.view(k // 128, 128, n)).view(k, n)
    w = w * suh.double()[:, None]
    w = (w.view(k, n // 128, 128) @ H).view(k, n)
    return w * svh.double()[None, :]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device(os.environ.get("EXL3_TILES_DEVICE", "cuda:0"))  # cpu only with a fake ext (tests)
    assert dev.type != "cuda" or torch.cuda.is_available(), "needs a CUDA GPU"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    import exllamav3  # noqa: F401
    from exllamav3.modules.quant.exl3_lib.quantize import codebook_markers
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.quant.exl3 import LinearEXL3
    from exllamav3.version import __version__ as exl3_version
    print(f"[tiles] exllamav3 {exl3_version} imported in {time.time() - t0:.1f}s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    # Crash-resume: a call into the extension that kills the process (seen once: a segfault in
    # ext.reconstruct) is recorded on the next start from the "attempt" file and skipped; everything
    # finished so far is kept in partial.pt. The driver reruns this script until it exits 0.
    part_f, att_f = os.path.join(args.out, "partial.pt"), os.path.join(args.out, "attempt")
    tensors, support, lins, crashed = {}, {}, {}, []
    if os.path.exists(part_f):
        st = torch.load(part_f)
        tensors, support, lins, crashed = st["tensors"], st["support"], st["lins"], st["crashed"]
    if os.path.exists(att_f):
        crashed.append(open(att_f).read().strip())
        print(f"[tiles] previous run died in: {crashed[-1]}", flush=True)
        os.remove(att_f)

    def attempt(item):
        with open(att_f, "w") as f:
            f.write(item)
            f.flush()
            os.fsync(f.fileno())
        print(f"[tiles] try {item}", flush=True)

    def done_item():
        torch.save(dict(tensors=tensors, support=support, lins=lins, crashed=crashed), part_f + ".tmp")
        os.replace(part_f + ".tmp", part_f)
        if os.path.exists(att_f):
            os.remove(att_f)

    g = torch.Generator().manual_seed(1000 + args.seed)

    # ---- codebook x rate support, probed on the extension itself; data for every supported pair
    for cb, (mcg, mul1) in CODEBOOKS.items():
        support.setdefault(cb, {})
        for rate in CANDIDATE_RATES:
            # the trellis of (cb, rate) depends only on (seed, cb, rate), whatever ran before
            gi = torch.Generator().manual_seed(1000 + args.seed * 7 + list(CODEBOOKS).index(cb) * 100
                                               + int(rate * 2))
            tr = torch.randint(-32768, 32768, (K_IN // 16, N_OUT // 16, words(rate)), generator=gi,
                               dtype=torch.int32).to(torch.int16)
            item = f"reconstruct {cb} {rate}"
            if tag_of(rate) in support[cb]:
                continue
            if item in crashed:
                support[cb][tag_of(rate)] = "process crashed (segfault) in ext.reconstruct"
                done_item()
                continue
            attempt(item)
            w = torch.full((K_IN, N_OUT), float("nan"), dtype=torch.half, device=dev)
            try:
                ext.reconstruct(w, tr.to(dev), float(rate), mcg, mul1)
                sync()
                ok, err = True, None
            except RuntimeError as e:
                ok, err = False, str(e).splitlines()[0][:200]
            support[cb][tag_of(rate)] = ok if ok else f"rejected: {err}"
            if not ok:
                done_item()
                continue
            assert not torch.isnan(w).any(), (cb, rate, "reconstruct left NaN (unwritten) elements")
            w2 = torch.zeros_like(w)
            ext.reconstruct(w2, tr.to(dev), float(rate), mcg, mul1)
            assert torch.equal(w.view(torch.int16), w2.view(torch.int16)), (cb, rate, "not deterministic")
            t = f"tile.{cb}.{tag_of(rate)}"
            tensors[t + ".trellis"] = tr.contiguous()
            tensors[t + ".reconstructed"] = w.cpu().contiguous()
            print(f"[tiles] {cb} {rate}: trellis {tuple(tr.shape)} rms {w.float().pow(2).mean().sqrt():.4f}",
                  flush=True)
            done_item()

    # ---- LinearEXL3 forward on a few (codebook, rate) pairs
    H = had128(dev)
    for cb, rate in LIN_PAIRS:
        t = f"tile.{cb}.{tag_of(rate)}"
        item = f"lin {cb} {rate}"
        if f"{cb}.{tag_of(rate)}" in lins:
            continue
        if item in crashed:
            lins[f"{cb}.{tag_of(rate)}"] = "process crashed (segfault) in LinearEXL3 / exl3_gemm"
            done_item()
            continue
        gl = torch.Generator().manual_seed(5000 + args.seed * 7 + list(CODEBOOKS).index(cb) * 100 + int(rate * 2))
        if t + ".trellis" not in tensors:
            lins[f"{cb}.{tag_of(rate)}"] = "skipped: rate unsupported"
            continue
        mcg, mul1 = CODEBOOKS[cb]
        p = f"lin.{cb}.{tag_of(rate)}"
        g = gl
        attempt(item)
        sign_u = torch.randint(0, 2, (K_IN,), generator=g) * 2 - 1
        sign_v = torch.randint(0, 2, (N_OUT,), generator=g) * 2 - 1
        suh = (sign_u * torch.exp(torch.randn(K_IN, generator=g) * 0.25) * 0.05).half()
        svh = (sign_v * torch.exp(torch.randn(N_OUT, generator=g) * 0.25) * 0.05).half()
        x = torch.randn((ROWS, K_IN), generator=g).half()
        markers = {k: v.to(dev) for k, v in codebook_markers({cb: True} if cb != "3inst" else {}).items()}
        trd = tensors[t + ".trellis"].to(dev)
        lin = LinearEXL3(None, K_IN, N_OUT, suh=suh.to(dev), svh=svh.to(dev), trellis=trd,
                         mcg=markers.get("mcg"), mul1=markers.get("mul1"), key=p)
        xd = x.to(dev)
        os.environ.pop("EXL3_GEMV", None)
        y = lin.forward(xd.clone(), {}).float().cpu()
        # the same call, direct, to read the kernel path exl3_gemm took (90 = GEMV, else GEMM shape)
        yc = torch.empty((ROWS, N_OUT), dtype=torch.half, device=dev)
        code_default = ext.exl3_gemm(xd.clone(), trd, yc, lin.suh, torch.empty_like(xd), lin.svh, -1,
                                     mcg, mul1, 0)
        same_default = torch.equal(yc.cpu().float(), y)
        os.environ["EXL3_GEMV"] = "0"
        y_gemm = lin.forward(xd.clone(), {}).float().cpu()
        yc2 = torch.empty_like(yc)
        code_gemm = ext.exl3_gemm(xd.clone(), trd, yc2, lin.suh, torch.empty_like(xd), lin.svh, -1,
                                  mcg, mul1, 0)
        os.environ.pop("EXL3_GEMV", None)
        y_recon = lin.forward(xd.clone(), {"reconstruct": True}).float().cpu()
        sync()
        W = weight_f64(tensors[t + ".reconstructed"].to(dev), suh.to(dev), svh.to(dev), H)
        y64 = (x.double().to(dev) @ W).cpu()

        def rel(a):
            return float((a.double() - y64).norm() / y64.norm())

        tensors[p + ".suh"] = suh
        tensors[p + ".svh"] = svh
        tensors[p + ".x"] = x
        tensors[p + ".y"] = y.half()
        tensors[p + ".y_gemm"] = y_gemm.half()
        tensors[p + ".y_recon"] = y_recon.half()
        lins[f"{cb}.{tag_of(rate)}"] = dict(
            path=("GEMV (exl3_gemv, QTIP-style, returned 90)" if code_default == 90 else
                  f"GEMM (exl3_gemm kernel shape/tag {code_default})"),
            exl3_gemm_return_default=int(code_default), exl3_gemm_return_with_EXL3_GEMV_0=int(code_gemm),
            direct_exl3_gemm_equals_forward=bool(same_default),
            y_equals_y_gemm=bool(torch.equal(y, y_gemm)),
            rel_l2_vs_f64={"y": rel(y), "y_gemm": rel(y_gemm), "y_recon": rel(y_recon)},
        )
        print(f"[tiles] lin {cb} {rate}: {lins[f'{cb}.{tag_of(rate)}']}", flush=True)
        done_item()

    from safetensors.torch import save_file
    save_file(dict(sorted(tensors.items())), os.path.join(args.out, "tiles.safetensors"),
              metadata={"exllamav3": exl3_version, "seed": str(args.seed)})
    manifest = dict(
        exllamav3_version=exl3_version, torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if dev.type == "cuda" else "none",
        seed=args.seed, K=K_IN, N=N_OUT, rows=ROWS,
        codebook_rate_support=support,
        codebook_rate_support_note=(
            "probed with ext.reconstruct on this build; source: exllamav3_ext/quant/bits_k.cuh bits_from_K "
            "(integer 1..8, or 1.5/2.5/3.5) and reconstruct.cu (half-integer rates require mul1); "
            "LinearEXL3.__init__ asserts the same"),
        tensors={k: dict(dtype=str(v.dtype).replace("torch.", ""), shape=list(v.shape))
                 for k, v in sorted(tensors.items())},
        lin=lins,
        crashed=crashed,
        lin_note=("suh/svh: random sign x exp(N(0,0.25^2)) x 0.05 in fp16; rel_l2_vs_f64 compares with "
                  "x @ (diag(suh) H What H diag(svh)) in float64 from the fp16 inputs"),
        reconstruct_call="exllamav3_ext.reconstruct(out fp16 [K,N], trellis int16 [K/16,N/16,16b], float(b), "
                         "mcg, mul1)",
    )
    with open(os.path.join(args.out, "tiles.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.remove(part_f)
    print(f"[tiles] done in {time.time() - t0:.1f}s: {len(tensors)} tensors", flush=True)


if __name__ == "__main__":
    main()
