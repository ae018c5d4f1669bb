//! The GPU forward's blocks: mHC collapse and expand, KDA, MLA with the DSA indexer, the
//! dense MLP and the MoE sublayer, each over the batch's token rows.

use super::*;
use crate::backend::AttnLayout;
use crate::backend::cuda::KdaGates;
use crate::backend::cuda::MhcCollapse;
use crate::model::dsa::K_NORM_EPS;
use crate::model::moe::Routing;
impl GpuDecoder {
    /// mHC's collapse of `b` tokens' streams: unweighted RMSNorm of each token's streams,
    /// the projection, then the weights and the pre-weighted sum (`mhc_collapse`).
    pub(super) fn collapse(
        &self,
        hc: &DevHc,
        streams: &Buf,
        b: usize,
    ) -> anyhow::Result<MhcCollapse<Buf>> {
        let cuda = &*self.cuda;
        let (n, d) = (hc.spec.streams, hc.spec.hidden);
        let mut normed = cuda.alloc_f32(b * n * d)?;
        cuda.stream()
            .memcpy_dtod(&streams.slice(..b * n * d), &mut normed)?;
        cuda.rms_norm(&mut normed, None, n * d, hc.norm_eps)?;
        let logits = hc.proj.apply(&normed, b)?;
        let mut out = MhcCollapse {
            collapsed: cuda.alloc_f32(b * d)?,
            post: cuda.alloc_f32(b * n)?,
            comb: cuda.alloc_f32(b * n * n)?,
        };
        cuda.mhc_collapse_dev(hc.spec, &logits, &hc.base, streams, b, &mut out)?;
        Ok(out)
    }

    pub(super) fn expand(
        &self,
        hc: &DevHc,
        post: &Buf,
        comb: &Buf,
        streams: &Buf,
        y: &Buf,
        b: usize,
    ) -> anyhow::Result<Buf> {
        let mut out = self.cuda.alloc_f32(b * hc.spec.streams * hc.spec.hidden)?;
        self.cuda
            .mhc_expand_dev(hc.spec, post, comb, streams, y, b, &mut out)?;
        Ok(out)
    }

    /// Rows `first .. first + count` of `[.., width]` values, in a buffer of their own.
    pub(super) fn rows(
        &self,
        src: &Buf,
        first: usize,
        count: usize,
        width: usize,
    ) -> anyhow::Result<Buf> {
        let mut dst = self.cuda.alloc_f32(count * width)?;
        self.cuda
            .stream()
            .memcpy_dtod(&src.slice(first * width..(first + count) * width), &mut dst)?;
        Ok(dst)
    }

    /// `Kda::forward` for each sequence's tokens (`x` is `[rows, d]`; `spans[i]` sequence
    /// i's rows, `states[i]` its conv and recurrent state): the delta rule runs over a
    /// sequence's tokens in order (the chunked form over a prompt chunk, the recurrent one
    /// over decode steps).
    pub(super) fn kda(
        &self,
        w: &DevKda,
        x: &Buf,
        states: &mut [(&mut Buf, &mut Buf)],
        spans: &[(usize, usize)],
    ) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let (c, h, dh) = (w.spec.channels(), w.spec.heads, w.spec.head_dim);
        let [q, k, v] = [&w.q, &w.k, &w.v].map(|m| m.apply(x, total));
        let (q, k, v) = (q?, k?, v?);
        let mut g = w.f_b.apply(&w.f_a.apply(x, total)?, total)?;
        let mut beta = w.b_proj.apply(x, total)?;
        let gates = KdaGates {
            heads: h,
            head_dim: dh,
            lower_bound: w.lower_bound,
        };
        cuda.kda_gates(gates, &mut g, &w.dt_bias, &w.a_log, &mut beta, total)?;

        let mut core = cuda.alloc_f32(total * c)?;
        for ((conv, recurrent), &(first, len)) in states.iter_mut().zip(spans) {
            let mut qkv = cuda.alloc_f32(len * 3 * c)?;
            let (qs, ks, vs) = (
                q.slice(first * c..(first + len) * c),
                k.slice(first * c..(first + len) * c),
                v.slice(first * c..(first + len) * c),
            );
            cuda.interleave3(&qs, &ks, &vs, len, c, &mut qkv)?;
            let mut mixed = cuda.alloc_f32(len * 3 * c)?;
            cuda.kda_conv_dev(w.spec, &w.conv, &qkv, len, conv, &mut mixed)?;
            let gi = self.rows(&g, first, len, c)?;
            let bi = self.rows(&beta, first, len, h)?;
            let mut out = cuda.alloc_f32(len * c)?;
            let form = w.spec.form_for(len);
            cuda.kda_delta_dev(w.spec, form, &mixed, &gi, &bi, len, recurrent, &mut out)?;
            let mut dst = core.slice_mut(first * c..(first + len) * c);
            cuda.stream().memcpy_dtod(&out, &mut dst)?;
        }
        let out_gate = w.g_b.apply(&w.g_a.apply(x, total)?, total)?;
        cuda.gated_rms_norm(&mut core, &out_gate, &w.o_norm, dh, w.eps)?;
        Ok(w.o_proj.apply(&core, total)?)
    }

    /// `Mla::forward` for each sequence's tokens on the absorbed path (`states`: each
    /// sequence's latents and indexer cache, `spans` its rows of `x`, `positions` its tokens
    /// before this call); a full indexer layer replaces each sequence's `carried` selection
    /// with its fresh one. A sequence's new latents join its cache before its queries
    /// attend, and each query sees only what its selection (causal) holds.
    pub(super) fn mla(
        &self,
        w: &DevMla,
        x: &Buf,
        states: &mut [(&mut DevVec, Option<&mut DevIndexerCache>)],
        spans: &[(usize, usize)],
        positions: &[usize],
        carried: &mut [Option<DeviceSelections>],
    ) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let (h, nope, vd, r) = (w.heads, w.nope, w.v_dim, w.rank);
        let mut qr = w.q_a.apply(x, total)?;
        cuda.rms_norm(&mut qr, Some(&w.q_a_norm), w.q_a.rows(), w.eps)?;
        let q = w.q_b.apply(&qr, total)?;
        let mut latent = w.kv_a.apply(x, total)?;
        cuda.rms_norm(&mut latent, Some(&w.kv_a_norm), r, w.eps)?;

        if let Some(ix) = &w.indexer {
            let mut caches = Vec::with_capacity(states.len());
            for (_, ic) in states.iter_mut() {
                let Some(ic) = ic.as_deref_mut() else {
                    bail!("a full indexer layer's cache has no indexer state");
                };
                caches.push(ic);
            }
            for (slot, sel) in
                carried
                    .iter_mut()
                    .zip(self.select(ix, &mut caches, x, &qr, spans, positions)?)
            {
                *slot = Some(sel);
            }
        }

        let layout = AttnLayout::absorbed(h, r, (nope as f32).powf(-0.5));
        let mut attn = cuda.alloc_f32(total * h * vd)?;
        for (i, ((latents, _), &(first, len))) in states.iter_mut().zip(spans).enumerate() {
            let Some(sel) = carried[i].as_ref() else {
                bail!("a shared indexer layer with no full indexer layer before it");
            };
            latents.push(cuda, &latent.slice(first * r..(first + len) * r))?;
            // Queries in groups, so the attention's scratch (a score per selected token of
            // each query and head) stays bounded on long prompt chunks.
            for a in (0..len).step_by(ATTN_QUERIES) {
                let m = ATTN_QUERIES.min(len - a);
                let t0 = first + a;
                let mut q_lat = cuda.alloc_f32(m * h * r)?;
                let qi = q.slice(t0 * h * nope..(t0 + m) * h * nope);
                cuda.mla_absorb_q(&qi, &w.kv_b, h, nope, vd, r, m, &mut q_lat)?;

                let mut o_lat = cuda.alloc_f32(m * h * r)?;
                cuda.mla_sparse_attend_part_dev(
                    &q_lat,
                    &latents.buf,
                    &layout,
                    &sel.tokens,
                    &sel.offsets[a..=a + m],
                    &mut o_lat,
                )?;

                let mut dst = attn.slice_mut(t0 * h * vd..(t0 + m) * h * vd);
                cuda.mla_absorb_out(&o_lat, &w.kv_b, h, nope, vd, r, m, &mut dst)?;
            }
        }
        Ok(w.o_proj.apply(&attn, total)?)
    }

    /// The indexer of a full layer for each sequence's new tokens (`spans` its rows,
    /// `positions` its tokens before them): their keys and gates appended (and the keys of
    /// the pools they complete), then the selection of each token (`Indexer::select`).
    pub(super) fn select(
        &self,
        ix: &DevIndexer,
        caches: &mut [&mut DevIndexerCache],
        x: &Buf,
        qr: &Buf,
        spans: &[(usize, usize)],
        positions: &[usize],
    ) -> anyhow::Result<Vec<DeviceSelections>> {
        let cuda = &*self.cuda;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let (di, hi, kpool) = (ix.spec.dim, ix.spec.heads, ix.spec.kpool);
        let mut keys = ix.wk.apply(x, total)?;
        cuda.layer_norm(
            &mut keys,
            &ix.k_norm_weight,
            &ix.k_norm_bias,
            di,
            K_NORM_EPS,
            total,
        )?;
        let gates = ix.gate.apply(x, total)?;
        let mut weights = ix.weights_proj.apply(x, total)?;
        cuda.scale_values(&mut weights, (hi as f32).powf(-0.5), total * hi)?;
        let q = ix.wq_b.apply(qr, total)?;

        let mut out = Vec::with_capacity(caches.len());
        for ((ic, &(first, len)), &pos) in caches.iter_mut().zip(spans).zip(positions) {
            ic.keys
                .push(cuda, &keys.slice(first * di..(first + len) * di))?;
            ic.gates
                .push(cuda, &gates.slice(first * di..(first + len) * di))?;
            let pool = ic.pool_keys.len / di;
            let complete = (ic.keys.len / di) / kpool;
            if complete > pool {
                let mut key = cuda.alloc_f32((complete - pool) * di)?;
                cuda.dsa_pool_keys_dev(
                    &ic.keys.buf,
                    &ic.gates.buf,
                    &ix.ape,
                    kpool,
                    pool,
                    complete - pool,
                    &mut key,
                )?;
                ic.pool_keys
                    .push(cuda, &key.slice(..(complete - pool) * di))?;
            }
            let qi = self.rows(&q, first, len, hi * di)?;
            let wi = self.rows(&weights, first, len, hi)?;
            let at: Vec<usize> = (pos..pos + len).collect();
            out.push(cuda.dsa_select_dev(
                &qi,
                &wi,
                &ic.pool_keys.buf,
                complete.max(pool),
                ix.spec,
                &at,
            )?);
        }
        Ok(out)
    }

    pub(super) fn mlp(&self, w: &DevMlp, x: &Buf, b: usize) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let gate = w.gate.apply(x, b)?;
        let up = w.up.apply(x, b)?;
        let mut act = cuda.alloc_f32(b * w.gate.rows())?;
        cuda.swiglu(&gate, &up, w.limit, &mut act)?;
        Ok(w.down.apply(&act, b)?)
    }

    /// `Moe::forward` for the batch's tokens: routing on the device, the routed experts
    /// through the model's provider (all the batch's picks in one call; on the device rows
    /// when the provider computes on this GPU, else on host rows), plus the shared expert.
    pub(super) fn moe(
        &self,
        model: &Model,
        layer: usize,
        w: &DevMoe,
        x: &Buf,
        phases: &[Phase],
    ) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let (d, b) = (self.cfg.hidden_size, phases.len());
        let (ids, weights) = self.timed("moe route", || {
            let logits = w.router.apply(x, b)?;
            Ok(cuda.route(&logits, &w.bias, w.spec, b)?)
        })?;
        let routing = Routing {
            k: w.spec.k,
            ids,
            weights,
            phases: phases.to_vec(),
        };
        let experts = model.experts();
        let mut y = self.timed("moe experts", || match experts.on_device() {
            // The rows stay on this device: the provider takes them where they are.
            Some(dev) if Arc::ptr_eq(dev.device(), &self.cuda) => {
                dev.forward_device(layer, x, &routing)
            }
            _ => {
                let mut xh = cuda.download(x)?;
                xh.truncate(b * d);
                let mut out = vec![0f32; b * d];
                experts.forward(layer, &xh, &routing, &mut out)?;
                Ok(cuda.upload(&out)?)
            }
        })?;
        if let Some(shared) = &w.shared {
            let s = self.timed("moe shared", || self.mlp(shared, x, b))?;
            cuda.add_values(&mut y, &s, b * d)?;
        }
        Ok(y)
    }
}
