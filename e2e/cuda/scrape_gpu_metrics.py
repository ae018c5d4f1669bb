"""Waits for a glmflash-node server's /ready, sends one completion, scrapes /metrics and checks
the GPU metrics are there with values that show GPU work: expert products on the GPU lane,
VRAM used and total, host-to-device bytes, a sampled MoE step time, and (--registered) RAM
residents registered with CUDA. Standard library only (runs on the device machine)."""
import argparse
import json
import sys
import time
import urllib.request


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", default="serve")
    ap.add_argument("--registered", action="store_true")
    args = ap.parse_args()
    deadline = time.time() + 120
    while True:
        try:
            get(args.url + "/ready")
            break
        except Exception:
            if time.time() > deadline:
                print(f"{args.name}: not ready after 120 s")
                return 1
            time.sleep(0.5)
    # Greedy and past EOS: exactly 16 tokens, so there are decode steps to count (a sampled
    # reply may end after one token).
    body = json.dumps({"model": "glm-5.3-flash", "prompt": "hello there", "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(args.url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        json.load(r)
    text = get(args.url + "/metrics")
    values = {}
    for line in text.splitlines():
        if line.startswith("glmflash_") and " " in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    want = {
        'glmflash_expert_products_total{lane="gpu"}': lambda v: v > 0,
        'glmflash_memory_bytes{kind="vram_used"}': lambda v: v > 0,
        'glmflash_memory_bytes{kind="vram_total"}': lambda v: v > 0,
        "glmflash_gpu_host_to_device_bytes_total": lambda v: v > 0,
        "glmflash_gpu_moe_step_seconds": lambda v: v > 0,
        'glmflash_expert_lookups_total{phase="decode",tier="vram"}': lambda v: v > 0,
        # The sequences ran on the GPU (GpuDecoder): a prompt call and a call per decode step.
        "glmflash_gpu_forward_seconds_count": lambda v: v >= 16,
    }
    if args.registered:
        want['glmflash_memory_bytes{kind="registered_ram"}'] = lambda v: v > 0
    bad = []
    for key, ok in want.items():
        got = values.get(key)
        if got is None or not ok(got):
            bad.append(f"{key} = {got}")
    shown = {k: values.get(k) for k in want}
    print(f"{args.name}: {'ok' if not bad else 'FAILED'} {shown}")
    for b in bad:
        print(f"  unexpected: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
