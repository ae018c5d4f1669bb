#!/usr/bin/env python3
"""float32 HF checkpoint + transformers reference for a converted EXL3 checkpoint (CPU).

Usage:
  python3 e2e/exl3/make_reference.py --exl3 FIXDIR --device-out DEVDIR --hf-out HFDIR [--source SRCDIR]

  FIXDIR      the EXL3 checkpoint exllamav3 wrote (e2e/fixtures/exl3/<name>); reference.json and
              exllamav3_logits.json are written here
  DEVDIR      what e2e/exl3/device_ckpt.py wrote for it: what.safetensors (exllamav3_ext.reconstruct
              of every trellis) and exl3_logits.json (exllamav3's own forward)
  HFDIR       output: HF-layout float32 checkpoint (config.json, model.safetensors; the MTP layer in
              mtp.safetensors, which transformers does not read). Not committed.
  SRCDIR      optional: the source HF checkpoint (e2e/exl3/make_source.py), for sanity numbers only

(b) Every quantized linear P becomes W = diag(suh) H What H diag(svh) in float32 (H: 128x128
Sylvester-Hadamard blocks / sqrt(128); What from exllamav3's own reconstruct), stored transposed as
the HF weight [out, in]; the fused KDA qkv_proj is split back into q_proj/k_proj/v_proj and the
fused conv1d into q_conv1d/k_conv1d/v_conv1d; every unquantized tensor is the EXL3 checkpoint's
own value upcast to float32. transformers 5.23 (eager, float32, CPU, 1 thread) then gives prefill
logits and 16 greedy tokens (full recompute) -> reference.json, same shape as e2e/fixtures/tiny_*.
The prompt is the first of device_ckpt.py's candidate prompts whose reference passes the margin
checks of e2e/make_fixtures.py (chosen on the reference alone); (c) exllamav3's logits for it ->
exllamav3_logits.json, with the (c)-vs-(b) numbers.
"""

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # e2e/
sys.path.insert(0, HERE)
import make_fixtures as MF  # noqa: E402
import transformers  # noqa: E402
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file, load_file  # noqa: E402

N_GREEDY = 16
# Margins large enough that exllamav3's fp16 activations cannot flip a discrete choice (measured: the
# (c)-vs-(b) outliers are router top-k flips at gaps of 1e-4..8e-4); preferred when choosing the prompt.
FP16_GAP_ROUTER, FP16_GAP_POOL, FP16_GAP_LOGIT = 2e-3, 1e-2, 1e-2
LANG = "model.language_model.layers."


def hadamard128():
    i = torch.arange(128)
    a = i[:, None] & i[None, :]
    pc = sum(((a >> b) & 1) for b in range(7))
    return (1 - 2 * (pc % 2)).float() / math.sqrt(128)


def weight_f32(what, suh, svh, H):
    """W = diag(suh) H What H diag(svh), float32, [K, N] (exllamav3 orientation: y = x W)."""
    k, n = what.shape
    w = what.float()
    w = torch.matmul(H, w.view(k // 128, 128, n)).reshape(k, n)
    w = w * suh.float()[:, None]
    w = torch.matmul(w.view(k, n // 128, 128), H).reshape(k, n)
    return w * svh.float()[None, :]


def read_all(d):
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                for k in f.keys():
                    assert k not in out, k
                    out[k] = f.get_tensor(k)
    return out


def hf_config_from_exl3(exl3_dir):
    cfg = json.load(open(os.path.join(exl3_dir, "config.json")))
    tc = dict(cfg["text_config"])
    tc["layer_types"] = ["indexed_attention" if t == "deepseek_sparse_attention" else t for t in tc["layer_types"]]
    n_mtp = tc.pop("num_nextn_predict_layers", 0)
    tc.pop("linear_attn_config", None)
    for k in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype"):
        tc.pop(k, None)
    vc = dict(cfg["vision_config"])
    for k in ("model_type", "transformers_version", "dtype", "torch_dtype"):
        vc.pop(k, None)
    top = {k: v for k, v in cfg.items() if k.endswith("_token_id")}
    return Glm5NextConfig(text_config=tc, vision_config=vc, **top), n_mtp, cfg.get("quantization_config")


def build_hf(exl3_dir, what_path, hf_out, source=None):
    cfg, n_mtp, qcfg = hf_config_from_exl3(exl3_dir)
    tc = cfg.text_config
    L = tc.num_hidden_layers
    # skeleton: the exact on-disk keys and shapes transformers expects (original layout)
    if os.path.exists(hf_out):
        shutil.rmtree(hf_out)
    torch.manual_seed(0)
    skel = Glm5NextForConditionalGeneration(cfg).eval().float()
    skel.save_pretrained(hf_out, safe_serialization=True)
    del skel
    want = {k: v[1] for k, v in MF.list_keys(hf_out).items()}
    os.remove(os.path.join(hf_out, "model.safetensors"))

    ex = read_all(exl3_dir)
    what = load_file(what_path)
    H = hadamard128()
    out, mtp, notes = {}, {}, dict(reshaped=[], dropped=[], split=[], quantized={})

    def put(k, v):
        v = v.float().contiguous()
        if k.startswith(f"{LANG}{L}.") or (n_mtp and any(k.startswith(f"{LANG}{L + j}.") for j in range(n_mtp))):
            mtp[k] = v
            return
        if k not in want:
            notes["dropped"].append(k)
            return
        if list(v.shape) != want[k]:
            assert v.numel() == int(np.prod(want[k])), (k, list(v.shape), want[k])
            notes["reshaped"].append(f"{k}: {list(v.shape)} -> {want[k]}")
            v = v.reshape(want[k])
        assert k not in out, k
        out[k] = v

    prefixes = sorted(k[: -len(".trellis")] for k in ex if k.endswith(".trellis"))
    for p in prefixes:
        tr = ex[p + ".trellis"]
        wh = what[p + ".what"]
        assert wh.shape == (tr.shape[0] * 16, tr.shape[1] * 16), p
        W = weight_f32(wh, ex[p + ".suh"], ex[p + ".svh"], H).t()  # [N_pad, K_pad] = HF [out, in]
        cb = "mul1" if p + ".mul1" in ex else "mcg" if p + ".mcg" in ex else "3inst"
        notes["quantized"][p] = dict(bits=tr.shape[-1] / 16, codebook=cb, padded=list(W.shape))
        if p.endswith("self_attn.qkv_proj"):
            base = p[: -len("qkv_proj")]
            sizes = [want[base + c + "_proj.weight"][0] for c in "qkv"]
            kin = want[base + "q_proj.weight"][1]
            assert W.shape[0] >= sum(sizes), (p, W.shape, sizes)
            parts = torch.split(W[: sum(sizes), :kin], sizes, dim=0)
            for c, t in zip("qkv", parts):
                put(base + c + "_proj.weight", t)
            notes["split"].append(f"{p} -> q/k/v_proj {sizes}")
        else:
            k = p + ".weight"
            shape = want.get(k)
            if shape is None:  # MTP layer or unknown: keep unpadded only if known from source
                put(k, W)
            else:
                put(k, W[: shape[0], : shape[1]])
        if p + ".bias" in ex:
            put(p + ".bias", ex[p + ".bias"])
    skip_suffix = (".trellis", ".suh", ".svh", ".mcg", ".mul1", ".su", ".sv")
    for k, v in ex.items():
        if k.endswith(skip_suffix) or any(k == p + ".bias" for p in prefixes):
            continue
        if k.endswith("self_attn.conv1d.weight"):
            base = k[: -len("conv1d.weight")]
            sizes = [want[base + c + "_conv1d.weight"][0] for c in "qkv"]
            assert v.shape[0] == sum(sizes), (k, v.shape, sizes)
            for c, t in zip("qkv", torch.split(v, sizes, dim=0)):
                put(base + c + "_conv1d.weight", t)
            notes["split"].append(f"{k} -> q/k/v_conv1d {sizes}")
            continue
        put(k, v)
    missing = sorted(set(want) - set(out))
    assert not missing, f"HF tensors not found in the EXL3 checkpoint: {missing[:20]}"
    save_file(dict(sorted(out.items())), os.path.join(hf_out, "model.safetensors"), metadata={"format": "pt"})
    if mtp:
        save_file(dict(sorted(mtp.items())), os.path.join(hf_out, "mtp.safetensors"), metadata={"format": "pt"})

    sanity = None
    if source:
        src = read_all(source)
        rel_q, rel_u = [], []
        qkeys = set()
        for p in prefixes:
            if p.endswith("qkv_proj"):
                qkeys |= {p[:-8] + c + "_proj.weight" for c in "qkv"}
            else:
                qkeys.add(p + ".weight")
        for k, v in list(out.items()) + list(mtp.items()):
            s = src.get(k)
            if s is None or "visual" in k:
                continue
            s = s.float().reshape(v.shape)
            r = float((v - s).norm() / s.norm().clamp_min(1e-30))
            (rel_q if k in qkeys else rel_u).append((r, k))
        rel_q.sort()
        rel_u.sort()
        sanity = dict(
            quantized_rel_l2_vs_source=dict(n=len(rel_q), min=rel_q[0][0], median=rel_q[len(rel_q) // 2][0],
                                            max=rel_q[-1][0], max_key=rel_q[-1][1]) if rel_q else None,
            unquantized_rel_l2_vs_source=dict(n=len(rel_u), max=rel_u[-1][0], max_key=rel_u[-1][1]) if rel_u else None,
        )
    return cfg, notes, sanity, qcfg, len(out), len(mtp)


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exl3", required=True)
    ap.add_argument("--device-out", required=True)
    ap.add_argument("--hf-out", required=True)
    ap.add_argument("--source", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assert transformers.__version__ == "5.23.0", transformers.__version__
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    MF.N_GREEDY = N_GREEDY
    name = os.path.basename(os.path.normpath(args.exl3))

    cfg, notes, sanity, qcfg, n_hf, n_mtp = build_hf(
        args.exl3, os.path.join(args.device_out, "what.safetensors"), args.hf_out, args.source)
    print(f"{name}: HF f32 checkpoint {args.hf_out}: {n_hf} tensors (+{n_mtp} MTP); sanity {sanity}")

    ref = Glm5NextForConditionalGeneration.from_pretrained(
        args.hf_out, dtype=torch.float32, attn_implementation="eager").eval().float()
    MF.instrument(ref)
    dev = json.load(open(os.path.join(args.device_out, "exl3_logits.json")))
    tcfg = ref.config.text_config
    chosen, tried = None, []
    for i, run in enumerate(dev["runs"]):
        prompt = run["prompt"]
        prefill, greedy, greedy_logits, gaps, prefix_diff = MF.run_reference(ref, prompt)
        pr = MF.PROBE
        problems = []
        std_min = float(torch.cat([prefill, greedy_logits]).std(dim=-1).min())
        if std_min <= 0.1:
            problems.append(f"flat logits {std_min}")
        if len(set(greedy)) < 4:
            problems.append("greedy too repetitive")
        if min(gaps) < MF.MIN_GAP_LOGIT:
            problems.append(f"greedy near-tie {min(gaps)}")
        if pr.router_gaps and min(pr.router_gaps) < MF.MIN_GAP_ROUTER:
            problems.append(f"router near-tie {min(pr.router_gaps)}")
        if not pr.pool_gaps or pr.pool_drops == 0:
            problems.append("DSA never drops a pool")
        elif min(pr.pool_gaps) < MF.MIN_GAP_POOL:
            problems.append(f"pool near-tie {min(pr.pool_gaps)}")
        if prefix_diff > 1e-4:
            problems.append(f"prefix recompute differs {prefix_diff}")
        if pr.clamp_hits == 0:
            problems.append("swiglu clamp never triggers")
        c_pre = torch.tensor(run["prefill_logits"])
        cmp = dict(
            prefill_rel_l2=rel_l2(c_pre, prefill),
            prefill_argmax_agree=float((c_pre.argmax(-1) == prefill.argmax(-1)).float().mean()),
            greedy_ids_equal=run["greedy"] == greedy,
        )
        # the prompt's own forward comes first: its router calls (one per MoE layer) and indexer calls
        n_moe = sum(t == "sparse" for t in tcfg.mlp_layer_types)
        n_full = sum(lt == "indexed_attention" and it == "full" for lt, it in zip(tcfg.layer_types, tcfg.indexer_types))
        pre_router = min(pr.router_gaps[:n_moe]) if pr.router_gaps else None
        pre_pool = min(pr.pool_gaps[:n_full]) if pr.pool_gaps else None
        fp16_robust = (not problems and min(gaps) >= FP16_GAP_LOGIT
                       and (pre_router is None or pre_router >= FP16_GAP_ROUTER)
                       and (pre_pool is None or pre_pool >= FP16_GAP_POOL))
        tried.append(dict(candidate=i, problems=problems, fp16_robust_margins=fp16_robust,
                          min_router_gap=min(pr.router_gaps) if pr.router_gaps else None,
                          min_pool_gap=min(pr.pool_gaps) if pr.pool_gaps else None,
                          min_greedy_gap=min(gaps), prompt_forward_min_router_gap=pre_router,
                          prompt_forward_min_pool_gap=pre_pool, **cmp))
        print(f"  candidate {i}: problems {problems} fp16-robust {fp16_robust} (c)-vs-(b) {cmp}")
        if not problems and (chosen is None or (fp16_robust and not chosen[-1])):
            chosen = (i, prompt, prefill, greedy, greedy_logits, gaps, prefix_diff, std_min,
                      dict(router=list(pr.router_gaps), pool=list(pr.pool_gaps), drops=pr.pool_drops,
                           self_ex=pr.self_excluded, clamp=pr.clamp_hits / max(pr.clamp_total, 1)),
                      fp16_robust)
    if chosen is None:
        raise SystemExit(f"{name}: no candidate prompt passes the margin checks: {tried}")
    i, prompt, prefill, greedy, greedy_logits, gaps, prefix_diff, std_min, pm, robust = chosen
    MF.PROBE.active = False
    cached = MF.run_cached(ref, prompt, greedy, greedy_logits)

    run = dev["runs"][i]
    c_pre = torch.tensor(run["prefill_logits"])
    c_greedy = run["greedy"]
    c_gl = torch.tensor(run["greedy_logits"])
    first_mis = next((j for j in range(N_GREEDY) if c_greedy[j] != greedy[j]), None)
    agree_steps = N_GREEDY if first_mis is None else first_mis
    # greedy-step logits are comparable while both token sequences agree (step j's input is
    # prompt + greedy[:j]); step first_mis itself is still comparable (same inputs, different argmax)
    comparable = N_GREEDY if first_mis is None else first_mis + 1
    cvb = dict(
        prefill_rel_l2=rel_l2(c_pre, prefill),
        prefill_max_abs_diff=float((c_pre - prefill).abs().max()),
        prefill_argmax_agreement=float((c_pre.argmax(-1) == prefill.argmax(-1)).float().mean()),
        prefill_argmax_agree_positions=int((c_pre.argmax(-1) == prefill.argmax(-1)).sum()),
        prefill_positions=len(prompt),
        prefill_rel_l2_per_position=[rel_l2(c_pre[j], prefill[j]) for j in range(len(prompt))],
        greedy_first_mismatch_step=first_mis,
        greedy_steps_agreeing=agree_steps,
        greedy_logits_rel_l2_comparable_steps=rel_l2(c_gl[:comparable], greedy_logits[:comparable]),
        comparable_greedy_steps=comparable,
        all_candidates=tried,
    )
    qs = notes["quantized"]
    by_rate = {}
    for p, q in qs.items():
        by_rate.setdefault(f"{q['codebook']}@{q['bits']:g}", []).append(p)
    checks = dict(
        candidate_prompt_index=i,
        prompt_has_fp16_robust_margins=robust,
        min_logit_std=std_min,
        min_greedy_top1_top2_gap=min(gaps),
        min_router_topk_gap=min(pm["router"]) if pm["router"] else None,
        min_pool_select_gap=min(pm["pool"]) if pm["pool"] else None,
        dsa_queries_with_dropped_pools=pm["drops"],
        dsa_queries_not_attending_to_self=pm["self_ex"],
        swiglu_clamped_fraction=pm["clamp"],
        prefix_recompute_max_abs_diff=prefix_diff,
        cached_path=cached,
        exl3_quantization_config=qcfg,
        exl3_quantized_linears=len(qs),
        exl3_rates=dict(sorted((k, len(v)) for k, v in by_rate.items())),
        hf_f32_from_exl3=dict(tensors=n_hf, mtp_tensors=n_mtp, split=notes["split"], reshaped=notes["reshaped"],
                              dropped_not_in_hf=notes["dropped"]),
        sanity_vs_source=sanity,
        exllamav3_vs_reference=cvb,
    )
    text = (
        f"{name}: reference (b) for the EXL3 checkpoint in this directory (exllamav3 {dev['exllamav3_version']}, "
        f"{qcfg.get('bits') if qcfg else '?'} bpw {qcfg.get('codebook') if qcfg else ''}). Weights: every quantized "
        f"linear W = diag(suh) H What H diag(svh) in float32 with What = exllamav3_ext.reconstruct (its own decoder, "
        f"on {dev['gpu']}), H = 128x128 Sylvester-Hadamard / sqrt(128) blocks, HF weight = W^T; fused qkv_proj and "
        f"conv1d split back into q/k/v; unquantized tensors are this checkpoint's fp16/bf16/f32 values upcast. "
        f"Reference: transformers {transformers.__version__} eager, float32, CPU, 1 thread. Greedy = {N_GREEDY} "
        f"tokens by full recompute, argmax of last-position logits. Prompt = candidate {i} of device_ckpt.py's "
        f"{len(dev['runs'])} random prompts, the first whose reference passes make_fixtures.py's margin checks and "
        f"{'also' if robust else 'NOT (none did)'} has, in the prompt's own forward, router top-k gaps >= "
        f"{FP16_GAP_ROUTER:g} and DSA pool gaps >= {FP16_GAP_POOL:g}, and greedy top1-top2 gaps >= {FP16_GAP_LOGIT:g} "
        f"(so exllamav3's fp16 noise is unlikely to flip a discrete choice; chosen on the reference alone). Cached path (teacher-forced): max |diff| "
        f"{cached['max_abs_logit_diff_teacher_forced']:.3g}, argmax "
        f"{'agreed at all steps' if cached['argmax_agrees_all_steps'] else 'disagreed'}. Margins: greedy top1-top2 >= "
        f"{min(gaps):.3g}, router top-k >= {checks['min_router_topk_gap']}, DSA pool selection >= "
        f"{checks['min_pool_select_gap']} ({pm['drops']} indexer query rows dropped pools). exllamav3's own forward "
        f"(c) vs this reference: prefill rel L2 {cvb['prefill_rel_l2']:.4g}, prefill argmax agreement "
        f"{cvb['prefill_argmax_agree_positions']}/{len(prompt)}, its own greedy ids equal this one's for "
        f"{agree_steps}/{N_GREEDY} steps (exllamav3_logits.json)."
    )
    refj = dict(
        fixture=name,
        prompt=prompt,
        prefill_logits=[MF.f32list(r) for r in prefill],
        greedy=greedy,
        greedy_logits=[MF.f32list(r) for r in greedy_logits],
        seed=args.seed,
        versions=MF.versions(),
        notes=text,
        checks=checks,
    )
    with open(os.path.join(args.exl3, "reference.json"), "w") as f:
        json.dump(refj, f)
        f.write("\n")
    exj = dict(
        fixture=name,
        exllamav3_version=dev["exllamav3_version"], torch=dev["torch"], gpu=dev["gpu"], call=dev["call"],
        env=dev["env"],
        prompt=prompt,
        prefill_logits=run["prefill_logits"],
        greedy=c_greedy,
        greedy_logits=run["greedy_logits"],
        rerun_prefill_max_abs_diff=run["rerun_prefill_max_abs_diff"],
        vs_reference=cvb,
        notes=("exllamav3's own forward on this EXL3 checkpoint (fp16 activations, its kernels), prefill logits for "
               "reference.json's prompt and its own 16 greedy tokens by full recompute; the values are its float "
               "output written as float32. vs_reference compares with reference.json (b)."),
    )
    with open(os.path.join(args.exl3, "exllamav3_logits.json"), "w") as f:
        json.dump(exj, f)
        f.write("\n")
    print(f"{name}: ok. {text}")
    print("per-position prefill rel L2:", " ".join(f"{x:.3f}" for x in cvb["prefill_rel_l2_per_position"]))


if __name__ == "__main__":
    main()
