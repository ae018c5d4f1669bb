#!/usr/bin/env python3
"""Write a random glm5_next checkpoint (bf16, HF nested layout) that both llama.cpp's converter and
glmflash load.

Usage:  python3 e2e/peers/make_checkpoint.py --out DIR [--flash | --small] [--pattern KFSK]
                                              [--dense 1] [--experts E] [--vocab V] [--seed S]

Presets: `--flash` is GLM-5.3-Flash width (hidden 4096, routed experts 2048 x 4096, MLA 64 heads
of 256 (NoPE) with q_lora 1536 / kv_lora 512, DSA indexer 32 x 128 with kpool 16 and index_topk
2048, KDA 64 x 128, dense MLP 12288, 8 of 64 experts a token, vocab 8192 instead of 154,880);
`--small` is a CPU-sized model with the same structure (hidden 256, 4 heads, 16 experts of 256).
`--pattern` gives the layers' attention, one letter each: K = KDA (linear_attention), F = MLA with
its own (full) DSA indexer, S = MLA sharing the previous layer's selection (it must follow an F);
the first `--dense` layers have a dense MLP, the rest MoE. Default KFSK with 1 dense layer: both
attention kinds, both indexer kinds, 3 MoE layers.

Layout (what transformers 5.23's Glm5NextForConditionalGeneration.save_pretrained writes, original
per-expert names, e.g. e2e/fixtures/tiny_bf16): `model.language_model.layers.N.*`, `lm_head.weight`,
config.json with a `text_config`, `tie_word_embeddings: false` at both levels. Floats are bf16
except what transformers keeps in float32 (A_log, dt_bias, the conv1d weights,
e_score_correction_bias, hc_*_base, hc_*_scale). Values are fan-in scaled normals as
e2e/make_fixtures.py `perturb` initialises them, seeded per tensor (the output does not depend on
--jobs). For llama.cpp's converter (conversion/glm.py, Glm5NextModel) the text_config also has
`mla_use_nope`, `first_k_dense_replace`, `linear_attn_config` and `num_nextn_predict_layers: 0`
(no MTP layer); glmflash reads the same fields. KDA and MLA have the same head count because
llama.cpp's graph uses one n_head for both.

Tokenizer: a byte-level BPE (tokenizer.json + tokenizer_config.json) whose ids 0..127 are the ASCII
bytes, then two- and three-character printable ASCII tokens, each with its merge, and the last four
ids the GLM specials `<|endoftext|>`, `[gMASK]`, `<|user|>`, `<|observation|>` (llama.cpp's
`_set_vocab_glm` looks them up). Every id decodes to whole ASCII characters, so a streaming
detokenizer sends one chunk per token. Its pre-tokenizer hash is not one llama.cpp knows:
e2e/peers/convert.py declares it `glm4`.

Writes DIR/bytes.json too: bytes by class and what one decode token reads.
"""

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "exl3"))
import make_random_exl3 as R  # noqa: E402  (safetensors layout, seeded fill, pwrite workers)

FLASH = dict(
    vocab_size=8192, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
    num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256,
    index_n_heads=32, index_head_dim=128, index_kpool=16, index_topk=2048,
    linear_head_dim=128, n_routed_experts=64, num_experts_per_tok=8, swiglu_limit=10.0,
)
SMALL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
    num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, v_head_dim=64,
    # 16 indexer heads: with few, a pool's score (a sum of ReLUs) is often exactly 0 for several
    # pools, and engines break such ties differently (glmflash: the earlier pool; transformers
    # and llama.cpp took the later one here), which is not what the agreement check is about.
    index_n_heads=16, index_head_dim=64, index_kpool=4, index_topk=16,
    linear_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, swiglu_limit=3.0,
)
SPECIALS = ["<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>"]
HC = 4  # mHC streams (llama.cpp supports only 4)


def text_config(dims, pattern, dense, vocab, experts):
    layers = len(pattern)
    assert set(pattern) <= set("KFS"), "--pattern: letters K, F, S only"
    for i, c in enumerate(pattern):
        assert c != "S" or (i > 0 and pattern[i - 1] == "F"), "--pattern: an S must follow an F"
    assert 0 <= dense < layers, "--dense: fewer than the layers"
    tc = dict(dims)
    tc.update(
        vocab_size=vocab, n_routed_experts=experts, num_hidden_layers=layers,
        # transformers 5.17 (which llama.cpp's converter loads the config with) accepts MLA layers
        # only as deepseek_sparse_attention; 5.23 writes indexed_attention. glmflash reads both.
        layer_types=["linear_attention" if c == "K" else "deepseek_sparse_attention" for c in pattern],
        indexer_types=["shared" if c == "S" else "full" for c in pattern],
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        first_k_dense_replace=dense,
        num_key_value_heads=dims["num_attention_heads"],
        linear_num_heads=dims["num_attention_heads"], linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        linear_attn_config=dict(num_heads=dims["num_attention_heads"], head_dim=dims["linear_head_dim"],
                                short_conv_kernel_size=4, gate_lower_bound=-5.0),
        mla_use_nope=True, qk_rope_head_dim=0, qk_head_dim=dims["qk_nope_head_dim"], head_dim=0,
        n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        hc_mult=HC, hc_eps=1e-6, hc_sinkhorn_iters=20, index_kpool_always_select_tail=True,
        hidden_act="silu", attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, num_nextn_predict_layers=0, tie_word_embeddings=False,
        model_type="glm5_next_text", initializer_range=0.02, use_cache=True,
        bos_token_id=None, pad_token_id=None, eos_token_id=vocab - len(SPECIALS),
    )
    return tc


def plan_tensors(tc):
    """(name, dtype, shape, fill spec) for every tensor, HF names and [out, in] shapes."""
    H, V = tc["hidden_size"], tc["vocab_size"]
    out = []

    def add(name, dtype, shape, spec):
        out.append((name, dtype, tuple(shape), spec))

    def lin(name, n_out, n_in):
        add(name + ".weight", "BF16", (n_out, n_in), ("normal", 1.0 / math.sqrt(n_in), 0.0))

    def norm(name, n):
        add(name + ".weight", "BF16", (n,), ("uniform", 0.8, 1.2))

    pre = "model.language_model"
    add(f"{pre}.embed_tokens.weight", "BF16", (V, H), ("normal", 1.0, 0.0))
    for i in range(tc["num_hidden_layers"]):
        L = f"{pre}.layers.{i}"
        mix = (2 + HC) * HC
        for tag in ("attn", "ffn"):
            add(f"{L}.hc_{tag}_fn", "BF16", (mix, HC * H), ("normal", 0.7 / math.sqrt(HC * H), 0.0))
            add(f"{L}.hc_{tag}_base", "F32", (mix,), ("normal", 0.3, 0.0))
            add(f"{L}.hc_{tag}_scale", "F32", (3,), ("uniform", 0.7, 1.3))
        norm(f"{L}.input_layernorm", H)
        norm(f"{L}.post_attention_layernorm", H)
        a = f"{L}.self_attn"
        nh = tc["num_attention_heads"]
        if tc["layer_types"][i] == "linear_attention":
            hd = tc["linear_head_dim"]
            C = nh * hd
            for p in ("q", "k", "v"):
                lin(f"{a}.{p}_proj", C, H)
                add(f"{a}.{p}_conv1d.weight", "F32", (C, 1, 4), ("normal", 0.5, 0.0))
            lin(f"{a}.b_proj", nh, H)
            lin(f"{a}.f_a_proj", hd, H)
            lin(f"{a}.f_b_proj", C, hd)
            lin(f"{a}.g_a_proj", hd, H)
            lin(f"{a}.g_b_proj", C, hd)
            norm(f"{a}.o_norm", hd)
            lin(f"{a}.o_proj", H, C)
            add(f"{a}.A_log", "F32", (nh,), ("normal", 0.5, 0.0))
            add(f"{a}.dt_bias", "F32", (C,), ("normal", 0.5, 0.0))
        else:
            ql, kl, nope, vd = tc["q_lora_rank"], tc["kv_lora_rank"], tc["qk_nope_head_dim"], tc["v_head_dim"]
            lin(f"{a}.q_a_proj", ql, H)
            norm(f"{a}.q_a_layernorm", ql)
            lin(f"{a}.q_b_proj", nh * nope, ql)
            lin(f"{a}.kv_a_proj_with_mqa", kl, H)
            norm(f"{a}.kv_a_layernorm", kl)
            lin(f"{a}.kv_b_proj", nh * (nope + vd), kl)
            lin(f"{a}.o_proj", H, nh * vd)
            if tc["indexer_types"][i] == "full":
                x, ih, idim = f"{a}.indexer", tc["index_n_heads"], tc["index_head_dim"]
                lin(f"{x}.wq_b", ih * idim, ql)
                lin(f"{x}.wk", idim, H)
                norm(f"{x}.k_norm", idim)
                add(f"{x}.k_norm.bias", "BF16", (idim,), ("normal", 0.1, 0.0))
                lin(f"{x}.weights_proj", ih, H)
                add(f"{x}.index_kpool_compress_ape", "BF16", (tc["index_kpool"], idim), ("normal", 1.0, 0.0))
                add(f"{x}.index_kpool_compress_gate", "BF16", (idim, H), ("normal", 1.0 / math.sqrt(H), 0.0))
        m = f"{L}.mlp"
        if tc["mlp_layer_types"][i] == "dense":
            I = tc["intermediate_size"]
            lin(f"{m}.gate_proj", I, H)
            lin(f"{m}.up_proj", I, H)
            lin(f"{m}.down_proj", H, I)
        else:
            E, W = tc["n_routed_experts"], tc["moe_intermediate_size"]
            lin(f"{m}.gate", E, H)
            add(f"{m}.gate.e_score_correction_bias", "F32", (E,), ("normal", 0.05, 0.0))
            for e in range(E):
                lin(f"{m}.experts.{e}.gate_proj", W, H)
                lin(f"{m}.experts.{e}.up_proj", W, H)
                lin(f"{m}.experts.{e}.down_proj", H, W)
            S = W * tc["n_shared_experts"]
            lin(f"{m}.shared_experts.gate_proj", S, H)
            lin(f"{m}.shared_experts.up_proj", S, H)
            lin(f"{m}.shared_experts.down_proj", H, S)
    norm(f"{pre}.norm", H)
    lin("lm_head", V, H)
    return out


def tokenizer_files(vocab):
    """tokenizer.json (byte-level BPE with merges) and tokenizer_config.json, see the module doc."""
    printable = [chr(c) for c in range(ord("!"), ord("~") + 1)]  # bytes GPT-2's map keeps as themselves
    others = [b for b in range(256) if not (ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xFF) or b == 0xAD]
    byte_sym = {b: (chr(b) if ord("!") <= b <= ord("~") else chr(256 + others.index(b))) for b in range(128)}
    v = {byte_sym[b]: b for b in range(128)}
    merges = []
    n_plain = vocab - len(SPECIALS)
    pairs = ((a, b) for a in printable for b in printable)
    triples = ((a + b, c) for a in printable[:40] for b in printable for c in printable)
    for left, right in (p for gen in (pairs, triples) for p in gen):
        if len(v) >= n_plain:
            break
        if left in v and left + right not in v:
            v[left + right] = len(v)
            merges.append(f"{left} {right}")
    assert len(v) == n_plain, f"--vocab {vocab} is more than this tokenizer can fill"
    added = []
    for j, s in enumerate(SPECIALS):
        v[s] = n_plain + j
        added.append({"id": n_plain + j, "content": s, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": v, "merges": merges},
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 131072,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in a if k != "id"} for a in added},
        "chat_template": "[gMASK]{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    }
    return tok, cfg


def byte_classes(tensors, tc):
    """Bytes by class and what one decode token reads (every weight but the embedding once, and
    num_experts_per_tok experts per MoE layer)."""
    routed = sum(R.nbytes(t[1], t[2]) for t in tensors if ".mlp.experts." in t[0])
    embed = sum(R.nbytes(t[1], t[2]) for t in tensors if "embed_tokens" in t[0])
    total = sum(R.nbytes(t[1], t[2]) for t in tensors)
    moe = tc["mlp_layer_types"].count("sparse")
    expert = routed // max(1, moe * tc["n_routed_experts"])
    return dict(total=total, routed_experts=routed, embedding=embed, rest=total - routed - embed,
                expert_bytes=expert, moe_layers=moe, experts=tc["n_routed_experts"],
                top_k=tc["num_experts_per_tok"], layers=tc["num_hidden_layers"], hidden=tc["hidden_size"],
                vocab=tc["vocab_size"],
                decode_bytes_per_token=total - routed - embed + moe * tc["num_experts_per_tok"] * expert)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--flash", action="store_true", help="GLM-5.3-Flash width (the default)")
    g.add_argument("--small", action="store_true", help="CPU-sized dims, same structure")
    ap.add_argument("--pattern", default="KFSK", help="attention per layer: K (KDA), F (MLA, full indexer), "
                    "S (MLA, shared indexer, after an F)")
    ap.add_argument("--dense", type=int, default=1, help="leading layers with a dense MLP; the rest are MoE")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (flash 64, small 16)")
    ap.add_argument("--vocab", type=int, default=None, help="flash 8192, small 512")
    ap.add_argument("--index-topk", type=int, default=None, help="DSA keys kept per query (flash 2048, small 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--shard-gb", type=float, default=4.0)
    args = ap.parse_args()
    t0 = time.time()
    dims = dict(SMALL if args.small else FLASH)
    vocab = args.vocab or dims.pop("vocab_size")
    dims.pop("vocab_size", None)
    experts = args.experts or dims.pop("n_routed_experts")
    dims.pop("n_routed_experts", None)
    if args.index_topk:
        dims["index_topk"] = args.index_topk
    tc = text_config(dims, args.pattern, args.dense, vocab, experts)
    tensors = plan_tensors(tc)

    d = args.out
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    shards = R.layout(tensors, int(args.shard_gb * 1e9))
    index = {t[0]: i for i, t in enumerate(tensors)}
    jobs = []
    for fname, hb, data_bytes, items in shards:
        path = os.path.join(d, fname)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            f.truncate(8 + len(hb) + data_bytes)
        batch, size = [], 0
        for t, off in items:  # ~64 MB per job so the pool balances
            batch.append((index[t[0]], t, off))
            size += R.nbytes(t[1], t[2])
            if size >= 64 << 20:
                jobs.append((path, batch, args.seed))
                batch, size = [], 0
        if batch:
            jobs.append((path, batch, args.seed))
    written = 0
    with mp.get_context("fork").Pool(max(1, args.jobs)) as pool:
        for n in pool.imap_unordered(R.work, jobs):
            written += n
    if len(shards) > 1:
        wm = {t[0]: fname for fname, _, _, items in shards for t, _ in items}
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(s[2] for s in shards)}, "weight_map": wm}, f, indent=1)

    cfg = {
        "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "dtype": "bfloat16",
        "text_config": tc, "tie_word_embeddings": False, "transformers_version": "5.23.0",
        "image_start_token_id": 154830, "image_end_token_id": 154831, "image_token_id": 154854,
        "video_start_token_id": 154832, "video_end_token_id": 154833, "video_token_id": 154855,
        "vision_config": R.VISION,
    }
    tok, tok_cfg = tokenizer_files(vocab)
    files = {
        "config.json": cfg, "tokenizer.json": tok, "tokenizer_config.json": tok_cfg,
        "generation_config.json": {"_from_model_config": True, "eos_token_id": tc["eos_token_id"],
                                   "transformers_version": "5.23.0"},
        "bytes.json": byte_classes(tensors, tc),
    }
    for name, doc in files.items():
        with open(os.path.join(d, name), "w") as f:
            json.dump(doc, f, indent=None if name == "tokenizer.json" else 1, sort_keys=name == "config.json")
            f.write("\n")
    secs = time.time() - t0
    print(f"{d}: {len(tensors)} tensors, {written / 1e9:.2f} GB in {len(shards)} shard(s), {secs:.1f}s; "
          f"decode reads {files['bytes.json']['decode_bytes_per_token'] / 1e9:.3f} GB/token", flush=True)


if __name__ == "__main__":
    main()
