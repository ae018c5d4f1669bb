#!/usr/bin/env python3
"""Build the tiny random glm5_next HF checkpoint that exllamav3's converter takes as input.

Usage:  python3 e2e/exl3/make_source.py --out DIR [--seed N]

Reuses e2e/make_fixtures.py (build_config, perturb) and adds what exllamav3 1.6.5's glm5_next
converter needs on top of a transformers 5.23 save_pretrained (see e2e/exl3/README.md):
  * config.json rewritten as exllamav3 reads it: text_config.layer_types uses
    "deepseek_sparse_attention" (transformers writes "indexed_attention", which exllamav3 rejects),
    text_config.linear_attn_config {num_heads, head_dim, short_conv_kernel_size, gate_lower_bound}
    (required by exllamav3; transformers writes flat linear_* fields, kept too),
    text_config.num_nextn_predict_layers = 1;
  * an MTP layer model.language_model.layers.{L}.* (L = num_hidden_layers): eh_proj, enorm,
    hnorm, shared_head.norm, input/post_attention layernorm, a full-indexer MLA self_attn and a
    MoE mlp (no mHC tensors), in model-mtp.safetensors;
  * index_kpool_compress_{ape,gate} on "shared" indexer layers (exllamav3 1.6.5 loads them on every
    MLA layer; transformers has none there; never used by either), also in model-mtp.safetensors;
  * processor_config.json with an image_processor block;
  * tokenizer.json: byte-level BPE over the 256 byte symbols, no merges (vocab_size = 256), so the
    converter's bundled calibration text tokenizes.
Every linear dimension is a multiple of 128, so exllamav3 pads nothing and a trimmed f32
reconstruction computes exactly what exllamav3 computes.
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # e2e/
import make_fixtures as MF  # noqa: E402
from transformers import Glm5NextForConditionalGeneration  # noqa: E402

L = 3  # trunk layers; the MTP layer is layers.3
SPEC = dict(
    layout="nested", dtype="float32", fused=False, shard=None, prompt_len=20,
    text=dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=L,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        indexer_types=["full", "full", "shared"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=128, v_head_dim=128,
        index_n_heads=4, index_head_dim=128, index_kpool=4, index_topk=8,
        linear_num_heads=2, linear_head_dim=128,
        n_routed_experts=16, n_group=1, topk_group=1, num_experts_per_tok=4,
        n_shared_experts=1, routed_scaling_factor=2.5, swiglu_limit=3.0,
    ),
)

PROCESSOR = {
    "image_processor": {
        "image_processor_type": "Glm5NextImageProcessor",
        "patch_size": MF.TINY_VISION["patch_size"],
        "temporal_patch_size": MF.TINY_VISION["temporal_patch_size"],
        "merge_size": MF.TINY_VISION["spatial_merge_size"],
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_image_tokens": 4,
        "max_image_tokens": 64,
    },
    "processor_class": "Glm5NextProcessor",
}


def byte_tokenizer_json():
    """Byte-level BPE, 256 byte symbols (GPT-2 byte->unicode map), no merges, no specials."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    assert len(vocab) == 256 and sorted(vocab.values()) == list(range(256))
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def exl3_config(path, spec):
    cfg = json.load(open(path))
    tc = cfg["text_config"]
    assert tc["layer_types"] == spec["text"]["layer_types"]
    tc["layer_types"] = ["deepseek_sparse_attention" if t == "indexed_attention" else t
                         for t in tc["layer_types"]]
    tc["linear_attn_config"] = {
        "num_heads": tc["linear_num_heads"], "head_dim": tc["linear_head_dim"],
        "short_conv_kernel_size": tc["linear_conv_kernel_dim"],
        "gate_lower_bound": tc["linear_lower_bound"],
    }
    tc["num_nextn_predict_layers"] = 1
    tc.setdefault("hidden_act", "silu")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return cfg


@torch.no_grad()
def mtp_tensors(cfg, seed, tmp):
    """MTP layer L: attention/MoE/norms of a second perturbed model's layer 1 (full MLA + MoE),
    read back from its save_pretrained (original layout), without the mHC tensors."""
    from safetensors.torch import load_file
    torch.manual_seed(seed + 1)
    donor = Glm5NextForConditionalGeneration(cfg).eval().float()
    MF.perturb(donor, torch.Generator().manual_seed(seed * 7919 + 17))
    donor.save_pretrained(tmp, safe_serialization=True)
    del donor
    sd = load_file(os.path.join(tmp, "model.safetensors"))
    shutil.rmtree(tmp)
    src = "model.language_model.layers.1."
    dst = f"model.language_model.layers.{L}."
    out = {}
    for k, v in sd.items():
        if k.startswith(src) and not k[len(src):].startswith("hc_"):
            out[dst + k[len(src):]] = v.float().contiguous()
    assert any(".self_attn.indexer.wq_b." in k for k in out) and any(".experts.15.down_proj" in k for k in out)
    g = torch.Generator().manual_seed(seed * 31 + 5)
    H = cfg.text_config.hidden_size
    out[dst + "eh_proj.weight"] = torch.randn((H, 2 * H), generator=g) / math.sqrt(2 * H)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        out[dst + n + ".weight"] = torch.rand((H,), generator=g) * 0.4 + 0.8
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assert MF.transformers.__version__ == "5.23.0", MF.transformers.__version__
    torch.set_num_threads(1)
    d = args.out
    if os.path.exists(d):
        shutil.rmtree(d)
    seed = 5300 + args.seed
    torch.manual_seed(seed)
    cfg = MF.build_config(SPEC)
    model = Glm5NextForConditionalGeneration(cfg).eval().float()
    MF.perturb(model, torch.Generator().manual_seed(seed * 7919))
    model.save_pretrained(d, safe_serialization=True)
    del model
    from safetensors.torch import save_file, safe_open
    keys = MF.list_keys(d)
    MF.check_layout("exl3_source", SPEC, keys, cfg)
    mtp = mtp_tensors(cfg, seed, d + '.donor')
    assert not set(mtp) & set(keys)
    # exllamav3 1.6.5 (MLAttention.load_local) reads index_kpool_compress_{ape,gate} on every MLA
    # layer, "shared" ones included, although only "full" layers use them; transformers has no
    # indexer on shared layers. Give shared layers such tensors (random, never used).
    g = torch.Generator().manual_seed(seed * 131 + 7)
    tc = cfg.text_config
    for i in range(L):
        if tc.layer_types[i] == "indexed_attention" and tc.indexer_types[i] == "shared":
            p = f"model.language_model.layers.{i}.self_attn.indexer."
            mtp[p + "index_kpool_compress_ape"] = torch.randn((tc.index_kpool, tc.index_head_dim), generator=g)
            mtp[p + "index_kpool_compress_gate"] = torch.randn(
                (tc.index_head_dim, tc.hidden_size), generator=g) / math.sqrt(tc.hidden_size)
    save_file(mtp, os.path.join(d, "model-mtp.safetensors"), metadata={"format": "pt"})
    # one model.safetensors + model-mtp.safetensors: write an index covering both
    wm = {k: "model.safetensors" for k in keys}
    wm.update({k: "model-mtp.safetensors" for k in mtp})
    assert os.path.exists(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(wm.items()))}, f, indent=1)
    exl3_config(os.path.join(d, "config.json"), SPEC)
    with open(os.path.join(d, "processor_config.json"), "w") as f:
        json.dump(PROCESSOR, f, indent=2)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(byte_tokenizer_json(), f, ensure_ascii=False)
    print(f"wrote {d}: {len(wm)} tensors ({len(mtp)} MTP)")


if __name__ == "__main__":
    main()
