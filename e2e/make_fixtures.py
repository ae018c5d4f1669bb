#!/usr/bin/env python3
"""Build tiny random glm5_next checkpoints and record reference outputs.

Usage:  python3 e2e/make_fixtures.py --out DIR [--seed N] [--only NAME ...]

The reference is Hugging Face transformers 5.23.0 (`Glm5NextForConditionalGeneration`,
eager attention, float32 compute, CPU). Pinned versions: e2e/requirements.txt.

For every fixture NAME, DIR/NAME/ holds
  config.json                       written by save_pretrained (tiny_mixed rewritten flat, see below)
  model.safetensors  or  model.safetensors.index.json + model-0000k-of-0000n.safetensors
  reference.json                    {
      "prompt":        [token ids]                       (the prompt fed to the model)
      "prefill_logits":[[vocab floats] per prompt position] (one full-prompt forward, no cache)
      "greedy":        [32 token ids]                     greedily generated after the prompt
      "greedy_logits": [[vocab floats] per greedy step]   logits (last position) that chose greedy[i]
      "seed":          N
      "versions":      {"torch", "transformers", "safetensors", "numpy", "python"}
      "notes":         free text: covered features, cached-vs-uncached comparison, margins
      "fixture":       NAME
      "checks":        machine-readable numbers behind the notes
  }
Floats are float32 values written as JSON numbers (Python repr of the exact float value).
Greedy generation is done by FULL RECOMPUTE (no cache) each step: argmax over the float32
logits of the last position (ties would break to the lowest id; the script asserts there are
none). The cached path (use_cache=True, one token per step with past_key_values) is also run and
its agreement is reported in "notes"/"checks"; it is NOT the reference.

The reference logits are always computed from the model RE-LOADED from DIR/NAME with
from_pretrained (then .float()), so they match exactly what is on disk (bf16 rounding included).

Fixtures
--------
tiny_mixed   (flat config.json: text fields at top level + tiny vision_config; original per-expert
             layout, float32, one model.safetensors)
             6 layers: layer_types   [linear, indexed, indexed, linear, indexed, indexed]
                       indexer_types [full,   full,    shared,  full,   full,    shared]
                       mlp_layer_types [dense, sparse x5]
             KDA (2 heads x 16, conv 4), MLA (2 heads, q_lora 32, kv_lora 32, nope 16, v 16, NoPE),
             DSA indexer full + shared (shared right after a full MLA layer), index_n_heads 8 x 16,
             kpool 4, index_topk 8 (2 pools) with a 40-token prompt -> tokens genuinely dropped,
             incomplete tail pool appended; MoE 16 experts, n_group 4, topk_group 2, top-4,
             moe_intermediate 8, 1 shared expert, routed_scaling_factor 2.5, swiglu_limit 1.5 (clamps trigger in dense,
             shared and routed experts); mHC hc_mult 4, 20 Sinkhorn iters. vocab 128, hidden 64.
tiny_nested  (config.json nested under text_config, as Glm5NextConfig.save_pretrained writes it;
             original layout, float32)
             hidden 48, KDA-heavy: [linear, linear, indexed(full), linear, linear], n_group 1
             (8 experts, top-2), mlp [dense, dense, sparse, sparse, sparse], kpool 2, index_topk 4,
             24-token prompt, linear head dim 24 / 2 heads, MLA 3 heads, vocab 96, hc_mult 4.
tiny_bf16    (nested config; original layout; tensors stored in bfloat16 EXCEPT the ones
             transformers keeps in float32 for this model (_keep_in_fp32_modules_strict:
             e_score_correction_bias, *_conv1d, dt_bias, A_log, hc_*_base, hc_*_scale), exactly
             like a real bf16 checkpoint; the reference is computed in float32 from the rounded
             weights) 4 layers [linear, indexed(full), indexed(shared), linear],
             mlp [dense, sparse x3], 8 experts n_group 2 topk_group 1 top-2, 20-token prompt.
tiny_fused   (nested config; FUSED layout save_original_format=False: mlp.experts.gate_up_proj
             [E,2I,D], mlp.experts.down_proj [E,D,I], self_attn.conv1d.weight [3C,1,K],
             self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias,A_log}, attn_hc.fn/base/scale,
             ffn_hc.*; float32; SHARDED: model.safetensors.index.json + several shards)
             4 layers [linear, indexed(full), linear, indexed(full)], mlp [sparse x4]
             (no dense layer), 8 experts n_group 4 (2 per group) topk_group 2 top-3, 20-token prompt.

Weights are perturbed after init (see `perturb`) so logits are not flat. For every fixture the
script asserts: logits std over vocab > 0.1, greedy output not one repeated token, greedy argmax
margins, router top-k / group margins and DSA pool-selection margins (no near-ties anywhere the
engine makes a discrete choice), retrying with another perturbation seed otherwise.
Counts in "checks" are summed over all 33 uncached forwards (prefill + 32 greedy recomputes).

Reference behaviours these fixtures pin down (transformers 5.23.0, modeling_glm5_next.py)
- Glm5NextTextIndexer.forward / append_visible_tail: a query at position p with (p+1) % kpool == 0
  has no tail; its own just-completed pool is an ordinary candidate, and if it is not among the
  top index_topk/kpool pools the query does NOT attend to itself. The fixtures contain such rows.
- Glm5NextTextAttention.__init__ (next_skip_topk): a full layer hands its selection only to the
  immediately next layer; every "shared" layer here directly follows a full MLA layer.
- chunk_kimi_delta_attention (prefill, chunk 64) vs recurrent_kimi_delta_attention (decode):
  the greedy recomputes reach 72 tokens in tiny_mixed, so the 2-chunk path is exercised.
- Prefix logits of the same tokens differ by ~3e-6 between sequence lengths (float32 summation
  order), so compare with a tolerance (~1e-4 abs), not bitwise.
- Glm5NextTextConfig default pad_token_id (154820) asserts in nn.Embedding for a small vocab:
  fixtures set pad_token_id null.
"""

import argparse
import json
import math
import os
import platform
import re
import shutil
import sys

import numpy as np
import torch

import transformers
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next import modeling_glm5_next as M

N_GREEDY = 32
# Minimum separation (absolute) between the last selected and the first rejected candidate at every
# discrete choice, so that an f32 engine with a different summation order makes the same choice.
MIN_GAP_LOGIT = 1e-3
MIN_GAP_ROUTER = 1e-5
MIN_GAP_POOL = 1e-4
MAX_ATTEMPTS = 20

TINY_VISION = dict(
    depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16,
    projection_intermediate_size=16, patch_size=2, image_size=4, spatial_merge_size=2,
    temporal_patch_size=1,
)

COMMON_TEXT = dict(
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5, qk_rope_head_dim=0,
    linear_conv_kernel_dim=4, linear_lower_bound=-5.0, norm_topk_prob=True,
    tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    max_position_embeddings=4096, index_kpool_always_select_tail=True,
)

FIXTURES = {
    "tiny_mixed": dict(
        layout="flat", dtype="float32", fused=False, shard=None, prompt_len=40,
        text=dict(
            vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=8,
            num_hidden_layers=6,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                         "linear_attention", "indexed_attention", "indexed_attention"],
            indexer_types=["full", "full", "shared", "full", "full", "shared"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, v_head_dim=16,
            index_n_heads=8, index_head_dim=16, index_kpool=4, index_topk=8,
            linear_num_heads=2, linear_head_dim=16,
            n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
            n_shared_experts=1, routed_scaling_factor=2.5, swiglu_limit=1.5,
        ),
    ),
    "tiny_nested": dict(
        layout="nested", dtype="float32", fused=False, shard=None, prompt_len=24,
        text=dict(
            vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=5,
            layer_types=["linear_attention", "linear_attention", "indexed_attention",
                         "linear_attention", "linear_attention"],
            indexer_types=["full"] * 5,
            mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
            num_attention_heads=3, num_key_value_heads=3, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, v_head_dim=12,
            index_n_heads=8, index_head_dim=8, index_kpool=2, index_topk=4,
            linear_num_heads=2, linear_head_dim=24,
            n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
            n_shared_experts=1, routed_scaling_factor=2.5, swiglu_limit=2.0,
        ),
    ),
    "tiny_bf16": dict(
        layout="nested", dtype="bfloat16", fused=False, shard=None, prompt_len=20,
        text=dict(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=4,
            layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                         "linear_attention"],
            indexer_types=["full", "full", "shared", "full"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, v_head_dim=8,
            index_n_heads=8, index_head_dim=8, index_kpool=4, index_topk=8,
            linear_num_heads=2, linear_head_dim=8,
            n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
            n_shared_experts=1, routed_scaling_factor=2.5, swiglu_limit=2.0,
        ),
    ),
    "tiny_fused": dict(
        layout="nested", dtype="float32", fused=True, shard="120KB", prompt_len=20,
        text=dict(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=4,
            layer_types=["linear_attention", "indexed_attention", "linear_attention",
                         "indexed_attention"],
            indexer_types=["full", "full", "full", "full"],
            mlp_layer_types=["sparse", "sparse", "sparse", "sparse"],
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
            qk_nope_head_dim=8, v_head_dim=8,
            index_n_heads=8, index_head_dim=8, index_kpool=4, index_topk=8,
            linear_num_heads=2, linear_head_dim=8,
            n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
            n_shared_experts=1, routed_scaling_factor=2.5, swiglu_limit=2.0,
        ),
    ),
}

KEEP_FP32 = M.Glm5NextPreTrainedModel._keep_in_fp32_modules_strict


def build_config(spec):
    text = dict(COMMON_TEXT)
    text.update(spec["text"])
    return Glm5NextConfig(text_config=text, vision_config=dict(TINY_VISION))


@torch.no_grad()
def perturb(model, gen):
    """Deterministic re-initialisation so nothing is flat or tied."""

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    def uniform(p, lo, hi):
        p.copy_(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)

    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, p in named:
        if not p.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        if "embed_tokens" in name:
            normal(p, 1.0)
        elif name.endswith("_hc.fn"):
            # input is RMS-normed (rms 1) over N*D values -> pre-activation std ~0.7
            normal(p, 0.7 / math.sqrt(p.shape[1]))
        elif name.endswith("_hc.base"):
            normal(p, 0.3)
        elif name.endswith("_hc.scale"):
            uniform(p, 0.7, 1.3)
        elif leaf == "A_log":
            normal(p, 0.5)
        elif leaf == "dt_bias":
            normal(p, 0.5)
        elif leaf == "e_score_correction_bias":
            normal(p, 0.05)
        elif leaf == "index_kpool_compress_ape":
            normal(p, 1.0)
        elif leaf == "index_kpool_compress_gate":
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        elif "conv1d" in name and p.dim() == 3 and "visual" not in name:
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
        elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
        elif p.dim() == 1 and (leaf == "weight"):
            # RMSNorm / LayerNorm / gated-norm weights
            uniform(p, 0.8, 1.2)
        elif p.dim() == 1 and leaf == "bias":
            normal(p, 0.1)
        elif p.dim() >= 2:
            fan_in = int(np.prod(p.shape[1:]))
            normal(p, 1.0 / math.sqrt(fan_in))
        else:
            normal(p, 0.1)


# --------------------------------------------------------------------------------------------
# Instrumentation: record every discrete choice's margin during the reference (uncached) runs.
# --------------------------------------------------------------------------------------------
class Probe:
    def __init__(self):
        self.reset()

    def reset(self):
        self.pool_gaps = []      # per full-indexer call: min gap (last selected - best rejected)
        self.pool_drops = 0      # queries where visible complete pools > selected pools
        self.self_excluded = 0   # query rows whose own token is not in the DSA selection
        self.router_gaps = []
        self.group_gaps = []
        self.clamp_hits = 0
        self.clamp_total = 0
        self.active = True


PROBE = Probe()


def _indexer_scores(mod, hidden_states, q_resid, attention_mask):
    """Recompute the indexer's pool scores exactly as Glm5NextTextIndexer.forward (no cache)."""
    b, s = hidden_states.shape[:2]
    q = mod.wq_b(q_resid).view(b, s, -1, mod.head_dim)
    k = mod.k_norm(mod.wk(hidden_states)).view(b, s, -1, mod.head_dim).squeeze(2)
    gate_scores = torch.nn.functional.linear(hidden_states, mod.index_kpool_compress_gate)
    valid_channel = attention_mask.to(k.dtype)[..., None]
    packed = torch.cat([k, gate_scores, valid_channel], dim=-1)
    valid_keys = packed[..., -1].bool()
    visible = mod.get_visible_tokens(valid_keys=valid_keys, q_length=s, current_length=s)
    pool_keys, pool_indices, pool_valid = mod.get_pooled_states(packed_states=packed)
    scores = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))
    scores = torch.relu(scores * mod.softmax_scale)
    w = mod.weights_proj(hidden_states).float() * (mod.n_heads ** -0.5)
    idx = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [B,S,P]
    pool_end = pool_indices[..., -1].clamp(0, s - 1)
    pool_vis = visible.gather(-1, pool_end[:, None, :].expand(b, s, -1))
    cand = pool_vis & pool_valid[:, None]
    return idx, cand


def _indexer_hook(mod, args, kwargs, out):
    if not PROBE.active or kwargs.get("past_key_values") is not None:
        return
    idx, cand = _indexer_scores(mod, kwargs["hidden_states"], kwargs["q_resid"], kwargs["attention_mask"])
    k = mod.index_topk // mod.index_kpool
    gaps = []
    for qi in range(idx.shape[1]):
        sc = idx[0, qi][cand[0, qi]]
        if sc.numel() > k:
            PROBE.pool_drops += 1
            srt = torch.sort(sc, descending=True).values
            gaps.append(float(srt[k - 1] - srt[k]))
    if gaps:
        PROBE.pool_gaps.append(min(gaps))
    sel = out[0]
    for qi in range(sel.shape[0]):
        if qi not in set(sel[qi].tolist()):
            PROBE.self_excluded += 1


def _router_hook(mod, args, out):
    if not PROBE.active:
        return
    x = args[0].reshape(-1, mod.hidden_dim).float()
    scores = torch.sigmoid(x @ mod.weight.float().t()) + mod.e_score_correction_bias
    if 1 < mod.num_group and mod.topk_group < mod.num_group:
        gs = scores.view(-1, mod.num_group, mod.num_experts // mod.num_group).topk(2, dim=-1)[0].sum(-1)
        srt = torch.sort(gs, dim=-1, descending=True).values
        PROBE.group_gaps.append(float((srt[:, mod.topk_group - 1] - srt[:, mod.topk_group]).min()))
        gidx = torch.topk(gs, k=mod.topk_group, dim=-1).indices
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1).bool()
        smask = gmask.unsqueeze(-1).expand(-1, mod.num_group, mod.num_experts // mod.num_group).reshape(
            -1, mod.num_experts)
        scores = scores.masked_fill(~smask, float("-inf"))
    srt = torch.sort(scores, dim=-1, descending=True).values
    PROBE.router_gaps.append(float((srt[:, mod.top_k - 1] - srt[:, mod.top_k]).min()))


def _clamp_hook_linear(limit, is_gate):
    def hook(mod, args, out):
        if not PROBE.active:
            return
        PROBE.clamp_total += out.numel()
        PROBE.clamp_hits += int((out > limit).sum()) if is_gate else int((out.abs() > limit).sum())
    return hook


_orig_apply_gate = M.Glm5NextTextExperts._apply_gate


def _apply_gate_probe(self, gate_up):
    if PROBE.active:
        gate, up = gate_up.chunk(2, dim=-1)
        PROBE.clamp_total += gate.numel() + up.numel()
        PROBE.clamp_hits += int((gate > self.swiglu_limit).sum()) + int((up.abs() > self.swiglu_limit).sum())
    return _orig_apply_gate(self, gate_up)


M.Glm5NextTextExperts._apply_gate = _apply_gate_probe


def instrument(model):
    limit = model.config.text_config.swiglu_limit
    for name, mod in model.named_modules():
        if "visual" in name:
            continue
        if isinstance(mod, M.Glm5NextTextIndexer):
            mod.register_forward_hook(_indexer_hook, with_kwargs=True)
        elif isinstance(mod, M.Glm5NextTextTopkRouter):
            mod.register_forward_hook(_router_hook)
        elif isinstance(mod, M.Glm5NextTextMLP):
            mod.gate_proj.register_forward_hook(_clamp_hook_linear(limit, True))
            mod.up_proj.register_forward_hook(_clamp_hook_linear(limit, False))


# --------------------------------------------------------------------------------------------
@torch.no_grad()
def logits_of(model, ids):
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def run_reference(model, prompt):
    PROBE.reset()
    prefill = logits_of(model, prompt)
    seq = list(prompt)
    greedy, greedy_logits, logit_gaps = [], [], []
    for _ in range(N_GREEDY):
        last = logits_of(model, seq)[-1]
        srt = torch.sort(last, descending=True).values
        logit_gaps.append(float(srt[0] - srt[1]))
        tok = int(torch.argmax(last))
        greedy.append(tok)
        greedy_logits.append(last)
        seq.append(tok)
    # consistency: recompute of the prompt prefix must equal the prefill forward
    check = logits_of(model, seq)
    prefix_diff = float((check[: len(prompt)] - prefill).abs().max())
    PROBE.active = False
    return prefill, greedy, torch.stack(greedy_logits), logit_gaps, prefix_diff


@torch.no_grad()
def run_cached(model, prompt, greedy, greedy_logits):
    """Reference's own cache path: prefill with use_cache=True, then one token per step."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    pkv = out.past_key_values
    cached_tokens, max_diff_forced = [], 0.0
    last = out.logits[0, -1].float()
    # teacher-forced on the reference greedy tokens so the logits stay comparable
    first_mismatch = None
    for i in range(N_GREEDY):
        max_diff_forced = max(max_diff_forced, float((last - greedy_logits[i]).abs().max()))
        tok = int(torch.argmax(last))
        cached_tokens.append(tok)
        if tok != greedy[i] and first_mismatch is None:
            first_mismatch = i
        out = model(input_ids=torch.tensor([[greedy[i]]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        last = out.logits[0, -1].float()
    return dict(max_abs_logit_diff_teacher_forced=max_diff_forced,
                argmax_agrees_all_steps=first_mismatch is None,
                first_argmax_mismatch_step=first_mismatch)


def f32list(t):
    return [float(x) for x in t.detach().to(torch.float32).numpy().astype(np.float32).tolist()]


def flatten_config(path):
    """Rewrite a nested Glm5NextConfig config.json with the text fields at the top level."""
    cfg = json.load(open(path))
    text = cfg.pop("text_config")
    flat = {}
    for key, val in text.items():
        if key in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype"):
            continue
        flat[key] = val
    for key, val in cfg.items():
        flat[key] = val  # model_type "glm5_next", architectures, vision_config, multimodal ids, dtype
    with open(path, "w") as f:
        json.dump(flat, f, indent=2, sort_keys=True)
        f.write("\n")


def list_keys(d):
    from safetensors import safe_open
    keys = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                for k in f.keys():
                    keys[k] = (str(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape()), fn)
    return keys


def check_layout(name, spec, keys, cfg):
    tc = cfg.text_config
    lang = "model.language_model.layers."
    L = tc.num_hidden_layers
    sparse = [i for i in range(L) if tc.mlp_layer_types[i] == "sparse"]
    kda = [i for i in range(L) if tc.layer_types[i] == "linear_attention"]
    assert "lm_head.weight" in keys and "model.language_model.embed_tokens.weight" in keys
    if spec["fused"]:
        for i in sparse:
            assert keys[f"{lang}{i}.mlp.experts.gate_up_proj"][1] == [
                tc.n_routed_experts, 2 * tc.moe_intermediate_size, tc.hidden_size]
            assert keys[f"{lang}{i}.mlp.experts.down_proj"][1] == [
                tc.n_routed_experts, tc.hidden_size, tc.moe_intermediate_size]
        for i in kda:
            assert f"{lang}{i}.self_attn.conv1d.weight" in keys
            assert f"{lang}{i}.self_attn.forget_gate.A_log" in keys
        assert f"{lang}0.attn_hc.fn" in keys
        assert not any(".experts.0." in k for k in keys)
    else:
        for i in sparse:
            for e in range(tc.n_routed_experts):
                for p in ("gate_proj", "up_proj", "down_proj"):
                    assert f"{lang}{i}.mlp.experts.{e}.{p}.weight" in keys, (name, i, e, p)
        for i in kda:
            for c in ("q", "k", "v"):
                assert f"{lang}{i}.self_attn.{c}_conv1d.weight" in keys
            assert f"{lang}{i}.self_attn.A_log" in keys
        assert f"{lang}0.hc_attn_fn" in keys and f"{lang}0.hc_ffn_scale" in keys
        assert not any("gate_up_proj" in k for k in keys)
    dtypes = sorted({v[0] for v in keys.values()})
    return dtypes


def make_one(name, spec, out_dir, seed):
    d = os.path.join(out_dir, name)
    fixture_seed = seed * 1000 + sorted(FIXTURES).index(name)
    last_err = None
    for attempt in range(MAX_ATTEMPTS):
        if os.path.exists(d):
            shutil.rmtree(d)
        torch.manual_seed(fixture_seed)
        cfg = build_config(spec)
        model = Glm5NextForConditionalGeneration(cfg).eval().float()
        gen = torch.Generator().manual_seed(fixture_seed * 7919 + attempt)
        perturb(model, gen)
        if spec["dtype"] == "bfloat16":
            for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
                if p.is_floating_point() and not any(k in pname for k in KEEP_FP32):
                    p.data = p.data.to(torch.bfloat16)
        kw = dict(safe_serialization=True)
        if spec["fused"]:
            kw["save_original_format"] = False
        if spec["shard"]:
            kw["max_shard_size"] = spec["shard"]
        model.save_pretrained(d, **kw)
        saved_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
        if spec["layout"] == "flat":
            flatten_config(os.path.join(d, "config.json"))

        # Re-load exactly what is on disk; compute in float32 with eager attention.
        ref = Glm5NextForConditionalGeneration.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager").eval().float()
        loaded_cfg = ref.config
        for k, v in spec["text"].items():
            assert getattr(loaded_cfg.text_config, k) == v, (name, k, getattr(loaded_cfg.text_config, k), v)
        loaded_state = ref.state_dict()
        assert set(loaded_state) == set(saved_state), set(loaded_state) ^ set(saved_state)
        for k, v in saved_state.items():
            # exact: the re-loaded (float32) weights are the saved ones (bf16 upcast is exact)
            assert torch.equal(loaded_state[k].float(), v.float()), (name, k)
        del saved_state, loaded_state
        keys = list_keys(d)
        dtypes = check_layout(name, spec, keys, loaded_cfg)
        instrument(ref)

        g = torch.Generator().manual_seed(fixture_seed * 31 + attempt)
        prompt = torch.randint(0, cfg.text_config.vocab_size, (spec["prompt_len"],), generator=g).tolist()
        prefill, greedy, greedy_logits, logit_gaps, prefix_diff = run_reference(ref, prompt)
        pr = PROBE
        problems = []
        std_min = float(torch.cat([prefill, greedy_logits]).std(dim=-1).min())
        if std_min <= 0.1:
            problems.append(f"flat logits (min std {std_min})")
        if len(set(greedy)) < 4:
            problems.append(f"greedy too repetitive {greedy}")
        if min(logit_gaps) < MIN_GAP_LOGIT:
            problems.append(f"greedy argmax near-tie {min(logit_gaps)}")
        if pr.router_gaps and min(pr.router_gaps) < MIN_GAP_ROUTER:
            problems.append(f"router near-tie {min(pr.router_gaps)}")
        if pr.group_gaps and min(pr.group_gaps) < MIN_GAP_ROUTER:
            problems.append(f"group near-tie {min(pr.group_gaps)}")
        if "indexed_attention" in spec["text"]["layer_types"]:
            if not pr.pool_gaps or pr.pool_drops == 0:
                problems.append("DSA never drops a pool")
            elif min(pr.pool_gaps) < MIN_GAP_POOL:
                problems.append(f"pool score near-tie {min(pr.pool_gaps)}")
        if prefix_diff > 1e-4:
            problems.append(f"prefix recompute differs {prefix_diff}")
        if spec["text"]["swiglu_limit"] and pr.clamp_hits == 0:
            problems.append("swiglu clamp never triggers")
        if problems:
            last_err = problems
            print(f"  {name}: attempt {attempt} rejected: {problems}", file=sys.stderr)
            continue

        cached = run_cached(ref, prompt, greedy, greedy_logits)
        checks = dict(
            attempt=attempt,
            min_logit_std=std_min,
            min_greedy_top1_top2_gap=min(logit_gaps),
            min_router_topk_gap=min(pr.router_gaps) if pr.router_gaps else None,
            min_group_topk_gap=min(pr.group_gaps) if pr.group_gaps else None,
            min_pool_select_gap=min(pr.pool_gaps) if pr.pool_gaps else None,
            dsa_queries_with_dropped_pools=pr.pool_drops,
            dsa_queries_not_attending_to_self=pr.self_excluded,
            swiglu_clamped_fraction=pr.clamp_hits / max(pr.clamp_total, 1),
            prefix_recompute_max_abs_diff=prefix_diff,
            safetensors_dtypes=dtypes,
            safetensors_files=sorted({v[2] for v in keys.values()}),
            num_tensors=len(keys),
            cached_path=cached,
        )
        notes = (
            f"{name}: {spec['layout']} config, {'fused' if spec['fused'] else 'original'} layout, "
            f"stored {spec['dtype']}{' (fp32 kept for ' + ','.join(KEEP_FP32) + ')' if spec['dtype'] == 'bfloat16' else ''}"
            f"{', sharded ' + str(len(checks['safetensors_files'])) + ' files' if spec['shard'] else ''}. "
            f"Reference: transformers {transformers.__version__} eager, float32, CPU, weights re-loaded from "
            f"this directory. Greedy = full recompute without cache, argmax of last-position logits. "
            f"Cached path (use_cache=True, one token per step, teacher-forced on the greedy tokens): "
            f"max |logit diff| = {cached['max_abs_logit_diff_teacher_forced']:.3g}, argmax "
            f"{'agreed at all 32 steps' if cached['argmax_agrees_all_steps'] else 'DISAGREED first at step ' + str(cached['first_argmax_mismatch_step'])}. "
            f"Margins: greedy top1-top2 >= {min(logit_gaps):.3g}, router top-k >= "
            f"{checks['min_router_topk_gap']}, DSA pool selection >= {checks['min_pool_select_gap']} "
            f"({pr.pool_drops} indexer query rows dropped pools, {pr.self_excluded} query rows whose own "
            f"just-completed pool was not selected so they do not attend to themselves); swiglu clamp fraction "
            f"{checks['swiglu_clamped_fraction']:.3f}."
        )
        refj = dict(
            fixture=name,
            prompt=prompt,
            prefill_logits=[f32list(r) for r in prefill],
            greedy=greedy,
            greedy_logits=[f32list(r) for r in greedy_logits],
            seed=seed,
            versions=versions(),
            notes=notes,
            checks=checks,
        )
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(refj, f)
            f.write("\n")
        print(f"{name}: ok. {notes}")
        return
    raise SystemExit(f"{name}: no acceptable perturbation in {MAX_ATTEMPTS} attempts: {last_err}")


def versions():
    import safetensors
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    assert transformers.__version__ == "5.23.0", transformers.__version__
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # summation order independent of the machine
    os.makedirs(args.out, exist_ok=True)
    for name, spec in FIXTURES.items():
        if args.only and name not in args.only:
            continue
        make_one(name, spec, args.out, args.seed)


if __name__ == "__main__":
    main()
