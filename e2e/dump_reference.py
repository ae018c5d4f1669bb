#!/usr/bin/env python3
"""Dump the reference's named intermediates for a prompt, under the engine's tap names.

    python3 e2e/dump_reference.py --model DIR --tokens 1,2,3 --out ref.safetensors

Names (rows = prompt positions): embed, layers.N.attn_hc.collapsed, layers.N.self_attn,
layers.N.ffn_hc.collapsed, layers.N.mlp, layers.N (the 4 streams, flattened), norm, logits.
Compare with `glmflash-node logits --model DIR --tokens ... --dump ours.safetensors` and
e2e/compare_dumps.py.
"""
import argparse

import torch
from safetensors.torch import save_file
from transformers import Glm5NextForConditionalGeneration


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]

    model = Glm5NextForConditionalGeneration.from_pretrained(args.model, attn_implementation="eager").float().eval()
    lm = model.model.language_model
    dumps = {}

    def keep(name, pick=lambda out: out):
        def hook(_module, _inputs, output):
            t = pick(output)
            dumps[name] = t.detach().reshape(t.shape[1], -1).float().contiguous()

        return hook

    lm.embed_tokens.register_forward_hook(keep("embed"))
    for i, layer in enumerate(lm.layers):
        layer.attn_hc.register_forward_hook(keep(f"layers.{i}.attn_hc.collapsed", lambda o: o[2]))
        layer.self_attn.register_forward_hook(keep(f"layers.{i}.self_attn", lambda o: o[0] if isinstance(o, tuple) else o))
        layer.ffn_hc.register_forward_hook(keep(f"layers.{i}.ffn_hc.collapsed", lambda o: o[2]))
        layer.mlp.register_forward_hook(keep(f"layers.{i}.mlp"))
        layer.register_forward_hook(keep(f"layers.{i}", lambda o: o[0] if isinstance(o, tuple) else o))
    lm.norm.register_forward_hook(keep("norm"))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=False)
    dumps["logits"] = out.logits[0].float().contiguous()
    save_file(dumps, args.out)
    print(f"wrote {len(dumps)} tensors to {args.out}")


if __name__ == "__main__":
    main()
