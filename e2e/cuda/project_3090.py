#!/usr/bin/env python3
"""Decode tok/s of the real model on a 3090 box, projected from a measured `bench --flash` run
(issue 17): the memory plan's slot counts and byte traffic (`glmflash-node plan --json`: 42 MoE
layers, the box's bandwidths) costed with the rates the bench run achieved per part.

  glmflash-node plan --json [--expert-format q4_k ...] > plan.json
  e2e/cuda/project_3090.py flash.json plan.json [--layers 45] [--decoder gpu]

From the bench run (one stream of each run, decoder --decoder):
  - `vram`: the GPU's fixed cost a layer a step = (step - its HBM bytes at the run's HBM rate) /
    the model's layers: launches, host work and kernels below their bandwidth;
  - `fast`: the CPU lane's achieved GB/s of expert bytes (its `compute` part, every pick there),
    and the tiers' bookkeeping a pick (`resolve` + `write_back`);
  - `budget`: the store's achieved share of its O_DIRECT rate (`fetch` part against its bytes),
    and the cost of admitting what it read into the RAM tier (pinning) per GB read.
Assumptions, printed with the result: the per-layer fixed cost carries over from the bench
machine (its host and launch costs, not the 3090's slower kernels); the lane's rate scales with
the box's RAM bandwidth over the bench host's (at most 1x); the store keeps its achieved share of
the disk's rate; uniform routing (every expert alike: the worst case); the parts one after
another (today's code) and fully overlapped (issue 17, item 5).
"""
import argparse
import json
import sys


def runs_of(flash, decoder):
    """The one-stream run of each name: {run name: figures}."""
    out = {}
    for r in flash.get("runs", []):
        if r.get("streams") == 1 and r.get("decoder", decoder) == decoder and "run" in r:
            out.setdefault(r["run"], r)
    return out


def measured_rates(flash, decoder):
    runs = runs_of(flash, decoder)
    missing = [n for n in ("vram", "fast", "budget") if n not in runs]
    if missing:
        sys.exit(f"the bench run lacks the one-stream {', '.join(missing)} run(s) of decoder {decoder}: "
                 "run bench --flash with --flash-runs budget,vram,fast")
    bw = flash["bandwidths"]
    layers, moe_layers, k = flash["layers"], flash["moe_layers"], flash["top_k"]
    vram = runs["vram"]
    b = vram["bytes_per_token"]
    hbm_ms = (b["dense_hbm"] + b["vram_experts"]) / (bw["hbm_gb_s"] * 1e9) * 1e3
    fixed_ms = max(vram["ms_per_step"] - hbm_ms, 0.0) / layers
    fast = runs["fast"]
    parts = fast["tier_ms_per_step"]
    lane_bytes = fast["bytes_per_token"]["ram_experts"]
    lane_gbs = lane_bytes / (parts["compute"] / 1e3) / 1e9 if parts["compute"] > 0 else float("inf")
    pick_ms = (parts["resolve"] + parts["write_back"]) / (moe_layers * k)
    budget = runs["budget"]
    # The store's own reading time: the fetch thread's (benches since session 25, whose
    # `fetch` part is the products' wait for records), else the `fetch` part (read first).
    fetch_ms = budget.get("fetch_busy_ms_per_step", budget["tier_ms_per_step"]["fetch"])
    store_bytes = budget["bytes_per_token"]["nvme"]
    store_gbs = store_bytes / (fetch_ms / 1e3) / 1e9 if fetch_ms > 0 else bw["store_o_direct_gb_s"]
    # Admitting what the store read into the RAM tier (the tiers' `resolve` and `write_back`
    # past their lookups: pinning, the registration with CUDA), on the step's path, per GB
    # admitted: the `fast` run admits nothing, so its per-pick cost leaves this out.
    bp = budget["tier_ms_per_step"]
    picks_per_step = budget["streams"] * k * moe_layers
    admit_ms = max(bp["resolve"] + bp["write_back"] - pick_ms * picks_per_step, 0.0)
    step_store_gb = store_bytes * budget["streams"] / 1e9
    admit_ms_per_gb = admit_ms / step_store_gb if step_store_gb > 0 else 0.0
    return {
        "gpu_fixed_ms_per_layer": fixed_ms,
        "lane_gb_s": lane_gbs,
        "bench_ram_gb_s": bw["ram_read_gb_s"],
        "tier_ms_per_pick": pick_ms,
        "store_share_of_o_direct": min(store_gbs / bw["store_o_direct_gb_s"], 1.0),
        "admit_ms_per_gb": admit_ms_per_gb,
    }


def project(plan, rates, layers):
    traffic = {t["tier"]: t for t in plan["traffic"]}
    picks = plan["moe_layers"] * plan["experts_per_token"]
    ram_gbs = traffic["ram"]["gbs"]
    lane_gbs = rates["lane_gb_s"] * min(1.0, ram_gbs / rates["bench_ram_gb_s"])
    gpu = traffic["hbm"]["seconds"] * 1e3 + rates["gpu_fixed_ms_per_layer"] * layers
    # The lane computes the RAM residents and, in `nvme` mode, the store's misses once read.
    lane = (traffic["ram"]["bytes"] + traffic["nvme"]["bytes"]) / (lane_gbs * 1e9) * 1e3
    store = traffic["nvme"]["bytes"] / (rates["store_share_of_o_direct"] * traffic["nvme"]["gbs"] * 1e9) * 1e3
    h2d = traffic["h2d"]["seconds"] * 1e3
    tiers = rates["tier_ms_per_pick"] * picks
    admit = rates["admit_ms_per_gb"] * traffic["nvme"]["bytes"] / 1e9
    parts = {"gpu": gpu, "cpu lane": lane, "store": store, "h2d": h2d, "tier bookkeeping": tiers,
             "ram admissions": admit}
    serial = sum(parts.values())
    # Bookkeeping and admissions run on the step's thread, beside none of the others.
    overlapped = max(gpu, lane, store, h2d) + tiers + admit
    return parts, serial, overlapped, lane_gbs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("flash", help="bench --flash's JSON (e2e/cuda/bench_flash.sh: flash.json)")
    ap.add_argument("plan", help="glmflash-node plan --json's output for the box")
    ap.add_argument("--layers", type=int, default=45, help="the real model's layers (GLM-5.3-Flash: 45)")
    ap.add_argument("--decoder", default="gpu", help="which decoder's runs to read (gpu, host)")
    a = ap.parse_args()
    flash, plan = json.load(open(a.flash)), json.load(open(a.plan))
    rates = measured_rates(flash, a.decoder)
    parts, serial, overlapped, lane_gbs = project(plan, rates, a.layers)
    t = {x["tier"]: x for x in plan["traffic"]}
    print(f"measured ({a.flash}: {flash.get('device', '?')}, {flash['moe_layers']} MoE layers of "
          f"{flash['experts']}, {flash['expert_format']}):")
    print(f"  GPU fixed cost {rates['gpu_fixed_ms_per_layer']:.3f} ms a layer a step; CPU lane "
          f"{rates['lane_gb_s']:.1f} GB/s (host RAM {rates['bench_ram_gb_s']:.1f}); tiers "
          f"{rates['tier_ms_per_pick'] * 1e3:.1f} us a pick; RAM admissions {rates['admit_ms_per_gb']:.1f} ms "
          f"a GB read; store at {rates['store_share_of_o_direct']:.2f} of its O_DIRECT rate")
    print(f"projected ({plan['moe_layers']} MoE layers, {a.layers} layers; slots a layer: VRAM "
          f"{plan['vram_expert_slots_per_layer']}, RAM {plan['ram_expert_slots_per_layer']}, store "
          f"{plan['experts_per_layer'] - plan['vram_expert_slots_per_layer'] - plan['ram_expert_slots_per_layer']}"
          f" of {plan['experts_per_layer']}; HBM {t['hbm']['gbs']:.0f}, H2D {t['h2d']['gbs']:.0f}, RAM "
          f"{t['ram']['gbs']:.0f}, NVMe {t['nvme']['gbs']:.1f} GB/s; the lane at {lane_gbs:.1f} GB/s):")
    for name, ms in parts.items():
        print(f"  {name:<17} {ms:9.2f} ms a token")
    print(f"  one after another {1e3 / serial:7.2f} tok/s ({serial:.1f} ms)")
    print(f"  fully overlapped  {1e3 / overlapped:7.2f} tok/s ({overlapped:.1f} ms)")
    print(f"  bytes alone (plan) {plan['tok_s_serial']:.2f} / {plan['tok_s_overlapped']:.2f} tok/s")
    # The bench's own overlap, where its build reports it (session 27 on): the budget run's
    # sampled MoE steps timed part by part, against the step the run measured.
    budget = runs_of(flash, a.decoder).get("budget", {})
    p = budget.get("moe_step_parts")
    if p and p.get("sampled_steps"):
        ms = p["ms"]
        print(f"measured overlap (budget run, {p['sampled_steps']} sampled MoE steps, ms each part alone): "
              f"gpu {ms['gpu']:.3f}, lane {ms['lane']:.3f}, staged {ms['staged']:.3f}; sum {p['sum_ms']:.3f}, "
              f"slowest {p['slowest_ms']:.3f}; roofline serial {budget['roofline_ratio']:.2f}, "
              f"overlapped {budget.get('roofline_ratio_overlapped', float('nan')):.2f}")


if __name__ == "__main__":
    main()
