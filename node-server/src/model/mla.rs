//! MLA attention over a 512-wide latent cache, restricted to the tokens the DSA indexer picks.
//!
//! Only the normalised latent `c = RMSNorm(kv_a(x))` is cached. Prefill expands the latents
//! through `kv_b` into per-head keys and values; decode folds `kv_b` into the query and the
//! output instead ("weight absorption") and attends over the latents directly:
//! `score_j = (W_uk^T q) . c_j`, `o = W_uv (sum_j p_j c_j)`.

use super::config::Config;
use super::dsa::{Indexer, IndexerCache};
use super::loader::{LoadError, Loader};
use crate::backend::AttnLayout;
use crate::backend::cpu::{Matrix, ops};
use rayon::prelude::*;

pub struct Mla {
    pub(crate) q_a: Matrix,
    pub(crate) q_a_norm: Vec<f32>,
    pub(crate) q_b: Matrix,
    pub(crate) kv_a: Matrix,
    pub(crate) kv_a_norm: Vec<f32>,
    pub(crate) kv_b: Matrix,
    pub(crate) o_proj: Matrix,
    pub indexer: Option<Indexer>,
    pub(crate) heads: usize,
    pub(crate) nope: usize,
    pub(crate) v_dim: usize,
    pub(crate) rank: usize,
    pub(crate) eps: f32,
}

/// Per-sequence MLA cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlaCache {
    /// `[T, kv_lora_rank]`
    pub latents: Vec<f32>,
    /// Present on layers with a full indexer.
    pub indexer: Option<IndexerCache>,
}

impl MlaCache {
    pub fn bytes(&self) -> usize {
        self.latents.len() * 4 + self.indexer.as_ref().map_or(0, IndexerCache::bytes)
    }
}

/// How attention reads the latent cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaPath {
    /// Expanded keys/values for multi-token spans, absorbed for single-token decode.
    Auto,
    /// Weight absorption for every span.
    Absorbed,
    /// Expanded keys/values for every span.
    Expanded,
}

/// Token selections of one sequence's new tokens: `selection[i]` for new token i.
pub type Selections = Vec<Vec<u32>>;

impl Mla {
    pub fn load(cfg: &Config, vb: Loader, full_indexer: bool) -> Result<Mla, LoadError> {
        let (d, h, q, r) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
        );
        let (nope, vd) = (cfg.qk_nope_head_dim, cfg.v_head_dim);
        Ok(Mla {
            q_a: vb.matrix("q_a_proj.weight", q, d)?,
            q_a_norm: vb.vector("q_a_layernorm.weight", q)?,
            q_b: vb.matrix("q_b_proj.weight", h * nope, q)?,
            kv_a: vb.matrix("kv_a_proj_with_mqa.weight", r, d)?,
            kv_a_norm: vb.vector("kv_a_layernorm.weight", r)?,
            kv_b: vb.matrix("kv_b_proj.weight", h * (nope + vd), r)?,
            o_proj: vb.matrix("o_proj.weight", d, h * vd)?,
            indexer: if full_indexer {
                Some(Indexer::load(cfg, vb.pp("indexer"))?)
            } else {
                None
            },
            heads: h,
            nope,
            v_dim: vd,
            rank: r,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Runs attention for all sequences' new tokens. A full-indexer layer computes fresh
    /// selections and returns them; a shared layer uses `carried` (the last full layer's).
    pub fn forward(
        &self,
        x: &[f32],
        spans: &[(usize, usize)],
        caches: &mut [&mut MlaCache],
        carried: Option<&[Selections]>,
        path: MlaPath,
    ) -> (Vec<f32>, Option<Vec<Selections>>) {
        let tokens: usize = spans.iter().map(|s| s.1).sum();
        let (h, nope, vd, r) = (self.heads, self.nope, self.v_dim, self.rank);
        let mut qr = self.q_a.matmul(x, tokens);
        ops::rms_norm(&mut qr, Some(&self.q_a_norm), self.q_a_norm.len(), self.eps);
        let q = self.q_b.matmul(&qr, tokens);
        let mut latent = self.kv_a.matmul(x, tokens);
        ops::rms_norm(&mut latent, Some(&self.kv_a_norm), r, self.eps);

        let fresh: Option<Vec<Selections>> = self.indexer.as_ref().map(|indexer| {
            let (inputs, keys, gates) = indexer.prepare(x, &qr, tokens);
            let di = keys.len() / tokens.max(1);
            spans
                .iter()
                .zip(caches.iter_mut())
                .map(|(&(start, len), cache)| {
                    let ic = cache.indexer.get_or_insert_with(IndexerCache::default);
                    let past = ic.keys.len() / di.max(1);
                    indexer.append(
                        ic,
                        &keys[start * di..(start + len) * di],
                        &gates[start * di..(start + len) * di],
                    );
                    (0..len)
                        .map(|i| indexer.select(&inputs, start + i, past + i, ic))
                        .collect()
                })
                .collect()
        });
        let selections: &[Selections] = fresh
            .as_deref()
            .or(carried)
            .expect("config validation guarantees a full indexer layer before a shared one");

        let mut attn = vec![0f32; tokens * h * vd];
        for ((&(start, len), cache), sel) in spans.iter().zip(caches.iter_mut()).zip(selections) {
            cache
                .latents
                .extend_from_slice(&latent[start * r..(start + len) * r]);
            let past = cache.latents.len() / r - len;
            let absorbed = match path {
                MlaPath::Auto => len == 1,
                MlaPath::Absorbed => true,
                MlaPath::Expanded => false,
            };
            let q_span = &q[start * h * nope..(start + len) * h * nope];
            let out = if absorbed {
                self.attend_absorbed(q_span, len, &cache.latents, sel)
            } else {
                self.attend_expanded(q_span, len, past, &cache.latents, sel)
            };
            attn[start * h * vd..(start + len) * h * vd].copy_from_slice(&out);
        }
        (self.o_proj.matmul(&attn, tokens), fresh)
    }

    fn scale(&self) -> f32 {
        (self.nope as f32).powf(-0.5)
    }

    /// Keys and values expanded from the latents: `k_nope`, `v` per token per head.
    fn attend_expanded(
        &self,
        q: &[f32],
        len: usize,
        past: usize,
        latents: &[f32],
        sel: &Selections,
    ) -> Vec<f32> {
        let (h, nope, vd) = (self.heads, self.nope, self.v_dim);
        let kv = self.kv_b.matmul(latents, past + len);
        let layout = AttnLayout::expanded(h, nope, vd, self.scale());
        sparse_attention(q, &kv, &layout, sel)
    }

    /// Weight-absorbed attention over the latents: `q_lat = W_uk^T q` per head, attention
    /// over the latents, then `W_uv` on the weighted latent sum.
    fn attend_absorbed(
        &self,
        q: &[f32],
        len: usize,
        latents: &[f32],
        sel: &Selections,
    ) -> Vec<f32> {
        let (h, nope, vd, r) = (self.heads, self.nope, self.v_dim, self.rank);
        let kv_rows = |head: usize, range: std::ops::Range<usize>| -> Vec<Vec<f32>> {
            range
                .map(|i| self.kv_b.row_f32(head * (nope + vd) + i))
                .collect()
        };
        let q_lat_per_head: Vec<Vec<f32>> = (0..h)
            .into_par_iter()
            .map(|head| {
                let uk = kv_rows(head, 0..nope);
                let mut q_lat = vec![0f32; len * r];
                for (i, ql) in q_lat.chunks_exact_mut(r).enumerate() {
                    let qh = &q[(i * h + head) * nope..(i * h + head + 1) * nope];
                    for (qv, row) in qh.iter().zip(&uk) {
                        ops::axpy(ql, *qv, row);
                    }
                }
                q_lat
            })
            .collect();
        let mut q_lat = vec![0f32; len * h * r];
        for (head, ql) in q_lat_per_head.iter().enumerate() {
            for i in 0..len {
                q_lat[(i * h + head) * r..(i * h + head + 1) * r]
                    .copy_from_slice(&ql[i * r..(i + 1) * r]);
            }
        }
        let o_lat = sparse_attention(
            &q_lat,
            latents,
            &AttnLayout::absorbed(h, r, self.scale()),
            sel,
        );
        let per_head: Vec<Vec<f32>> = (0..h)
            .into_par_iter()
            .map(|head| {
                let uv = kv_rows(head, nope..nope + vd);
                let mut head_out = vec![0f32; len * vd];
                for i in 0..len {
                    let ol = &o_lat[(i * h + head) * r..(i * h + head + 1) * r];
                    for (v, row) in uv.iter().enumerate() {
                        head_out[i * vd + v] = ops::dot(row, ol);
                    }
                }
                head_out
            })
            .collect();
        let mut out = vec![0f32; len * h * vd];
        for (head, ho) in per_head.iter().enumerate() {
            for i in 0..len {
                out[(i * h + head) * vd..(i * h + head + 1) * vd]
                    .copy_from_slice(&ho[i * vd..(i + 1) * vd]);
            }
        }
        out
    }
}

/// Softmax attention of every query row over its selected tokens only. `q` is
/// `[queries, heads, dk]`, `kv` holds the tokens as `layout` says, `sel[i]` lists query i's
/// tokens; returns `[queries, heads, dv]`: `sum_j softmax_j(q . k_j * scale) v_j` in
/// selection order.
pub(crate) fn sparse_attention(
    q: &[f32],
    kv: &[f32],
    layout: &AttnLayout,
    sel: &[Vec<u32>],
) -> Vec<f32> {
    let (h, dk, dv) = (layout.heads, layout.dk, layout.dv);
    let at = |j: u32, head: usize, off: usize, n: usize| -> &[f32] {
        &kv[j as usize * layout.stride + head * layout.head_step + off..][..n]
    };
    let mut out = vec![0f32; sel.len() * h * dv];
    out.par_chunks_mut(h * dv).enumerate().for_each(|(i, o)| {
        let picks = &sel[i];
        for head in 0..h {
            let qh = &q[(i * h + head) * dk..(i * h + head + 1) * dk];
            let mut scores: Vec<f32> = picks
                .iter()
                .map(|&j| ops::dot(qh, at(j, head, layout.k_off, dk)) * layout.scale)
                .collect();
            ops::softmax(&mut scores);
            let oh = &mut o[head * dv..(head + 1) * dv];
            for (&j, p) in picks.iter().zip(&scores) {
                ops::axpy(oh, *p, at(j, head, layout.v_off, dv));
            }
        }
    });
    out
}
