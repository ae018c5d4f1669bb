//! MLA attention over a 512-wide latent cache, restricted to the tokens the DSA indexer picks.
//!
//! Only the normalised latent `c = RMSNorm(kv_a(x))` is cached. Prefill expands the latents
//! through `kv_b` into per-head keys and values; decode folds `kv_b` into the query and the
//! output instead ("weight absorption") and attends over the latents directly:
//! `score_j = (W_uk^T q) . c_j`, `o = W_uv (sum_j p_j c_j)`.

use super::config::Config;
use super::device::{CacheDtype, CacheRows, Device, Host, MlaSpec};
use super::dsa::{Indexer, IndexerCache};
use super::loader::{LoadError, Loader};
use crate::backend::AttnLayout;
use crate::backend::cpu::{Matrix, ops};
use rayon::prelude::*;

pub struct Mla<D: Device = Host> {
    pub(crate) q_a: D::Mat,
    pub(crate) q_a_norm: D::Buf,
    pub(crate) q_b: D::Mat,
    pub(crate) kv_a: D::Mat,
    pub(crate) kv_a_norm: D::Buf,
    /// Read by rows as f32 (the absorbed path folds it into queries and outputs).
    pub(crate) kv_b: D::Table,
    pub(crate) o_proj: D::Mat,
    pub indexer: Option<Indexer<D>>,
    pub(crate) spec: MlaSpec,
    pub(crate) eps: f32,
}

/// Per-sequence MLA cache.
pub struct MlaCache<D: Device = Host> {
    /// `[T, kv_lora_rank]`
    pub latents: D::Grow,
    /// Present on layers with a full indexer.
    pub indexer: Option<IndexerCache<D>>,
}

impl MlaCache {
    /// An empty cache in `dtype`, with an indexer cache on a full indexer layer.
    pub fn new(dtype: CacheDtype, full_indexer: bool) -> MlaCache {
        MlaCache {
            latents: CacheRows::new(dtype),
            indexer: full_indexer.then(|| IndexerCache::new(dtype)),
        }
    }
}

impl Clone for MlaCache {
    fn clone(&self) -> Self {
        MlaCache {
            latents: self.latents.clone(),
            indexer: self.indexer.clone(),
        }
    }
}

impl PartialEq for MlaCache {
    fn eq(&self, other: &Self) -> bool {
        self.latents == other.latents && self.indexer == other.indexer
    }
}

impl std::fmt::Debug for MlaCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlaCache")
            .field("latents", &self.latents.len())
            .field("indexer", &self.indexer)
            .finish()
    }
}

impl MlaCache {
    pub fn bytes(&self) -> usize {
        self.latents.bytes() + self.indexer.as_ref().map_or(0, IndexerCache::bytes)
    }

    /// This cache on `dev`, with room for `spare_tokens` more tokens before it grows; an
    /// indexer cache when `indexer` (a full indexer layer) holds `dim`-wide keys in pools of
    /// `kpool`.
    pub fn place<E: Device>(
        &self,
        dev: &E,
        rank: usize,
        indexer: Option<(usize, usize)>,
        spare_tokens: usize,
    ) -> anyhow::Result<MlaCache<E>> {
        let empty = IndexerCache::new(self.latents.dtype());
        Ok(MlaCache {
            latents: dev.grow(&self.latents, spare_tokens * rank)?,
            indexer: match indexer {
                Some((di, kpool)) => Some(self.indexer.as_ref().unwrap_or(&empty).place(
                    dev,
                    di,
                    kpool,
                    spare_tokens,
                )?),
                None => None,
            },
        })
    }
}

impl<D: Device> MlaCache<D> {
    /// This cache on the host.
    pub fn to_host(&self, dev: &D) -> anyhow::Result<MlaCache> {
        Ok(MlaCache {
            latents: dev.grow_download(&self.latents)?,
            indexer: match &self.indexer {
                Some(ic) => Some(ic.to_host(dev)?),
                None => None,
            },
        })
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
            spec: MlaSpec {
                heads: h,
                nope,
                v_dim: vd,
                rank: r,
            },
            eps: cfg.rms_norm_eps,
        })
    }

    /// This block's weights on `dev`.
    pub fn place<E: Device>(&self, dev: &E) -> anyhow::Result<Mla<E>> {
        Ok(Mla {
            q_a: dev.matrix(&self.q_a)?,
            q_a_norm: dev.upload(&self.q_a_norm)?,
            q_b: dev.matrix(&self.q_b)?,
            kv_a: dev.matrix(&self.kv_a)?,
            kv_a_norm: dev.upload(&self.kv_a_norm)?,
            kv_b: dev.table(&self.kv_b)?,
            o_proj: dev.matrix(&self.o_proj)?,
            indexer: self.indexer.as_ref().map(|ix| ix.place(dev)).transpose()?,
            spec: self.spec,
            eps: self.eps,
        })
    }
}

impl<D: Device> Mla<D> {
    /// Runs attention for all sequences' new tokens (`spans[i]`: sequence i's rows of `x`;
    /// `caches[i]` its cache, whose token count before this call is its position). A full
    /// indexer layer replaces `carried` with its fresh selections; a shared layer uses the
    /// last full layer's. A sequence's new latents join its cache before its queries attend,
    /// and each query sees only what its selection (causal) holds.
    pub fn forward(
        &self,
        dev: &D,
        x: &D::Buf,
        spans: &[(usize, usize)],
        caches: &mut [&mut MlaCache<D>],
        carried: &mut Option<Vec<D::Sel>>,
        path: MlaPath,
    ) -> anyhow::Result<D::Buf> {
        let tokens: usize = spans.iter().map(|s| s.1).sum();
        let r = self.spec.rank;
        let mut qr = dev.matmul(&self.q_a, x, tokens)?;
        let q_rank = D::mat_rows(&self.q_a);
        dev.rms_norm(&mut qr, Some(&self.q_a_norm), q_rank, self.eps)?;
        let q = dev.matmul(&self.q_b, &qr, tokens)?;
        let mut latent = dev.matmul(&self.kv_a, x, tokens)?;
        dev.rms_norm(&mut latent, Some(&self.kv_a_norm), r, self.eps)?;

        if let Some(indexer) = &self.indexer {
            *carried = Some(indexer.select(dev, x, &qr, spans, caches)?);
        }
        let Some(selections) = carried.as_ref() else {
            anyhow::bail!("a shared indexer layer with no full indexer layer before it");
        };

        for (&(first, len), cache) in spans.iter().zip(caches.iter_mut()) {
            dev.push(&mut cache.latents, &latent, first, len, r)?;
        }
        // A decode step of several sequences (row s is sequence s's one token): one batched
        // absorbed attention where the device has it (`Auto` absorbs single tokens too).
        let decode = spans.len() > 1 && spans.iter().enumerate().all(|(s, &sp)| sp == (s, 1));
        if decode && path != MlaPath::Expanded {
            let latents: Vec<&D::Grow> = caches.iter().map(|c| &c.latents).collect();
            let sels: Vec<&D::Sel> = selections.iter().collect();
            if let Some(attn) = dev.mla_attend_seqs(self.spec, &self.kv_b, &q, &latents, &sels)? {
                return dev.matmul(&self.o_proj, &attn, tokens);
            }
        }
        self.attend_each(dev, spans, caches, selections, &q, path)
    }

    /// Each sequence's attention over its cache (its new latents already in), through the
    /// output projection: `[tokens, hidden]`.
    fn attend_each(
        &self,
        dev: &D,
        spans: &[(usize, usize)],
        caches: &[&mut MlaCache<D>],
        selections: &[D::Sel],
        q: &D::Buf,
        path: MlaPath,
    ) -> anyhow::Result<D::Buf> {
        let tokens: usize = spans.iter().map(|s| s.1).sum();
        let (h, vd) = (self.spec.heads, self.spec.v_dim);
        // One sequence's output is the whole attention; several are put in their rows.
        let mut attn = (spans.len() != 1)
            .then(|| dev.zeros(tokens * h * vd))
            .transpose()?;
        for ((&(first, len), cache), sel) in spans.iter().zip(caches.iter()).zip(selections) {
            let out = dev.mla_attend(
                self.spec,
                path,
                &self.kv_b,
                q,
                first,
                len,
                &cache.latents,
                sel,
            )?;
            match &mut attn {
                Some(attn) => dev.put_rows(attn, first, h * vd, &out)?,
                None => attn = Some(out),
            }
        }
        let Some(attn) = attn else {
            anyhow::bail!("MLA: no sequence in the batch");
        };
        dev.matmul(&self.o_proj, &attn, tokens)
    }
}

/// Keys and values expanded from the latents (`k_nope`, `v` per token per head), then
/// attention of each query over its selection.
pub(crate) fn attend_expanded(
    spec: MlaSpec,
    kv_b: &Matrix,
    q: &[f32],
    len: usize,
    past: usize,
    latents: &[f32],
    sel: &Selections,
) -> Vec<f32> {
    let (h, nope, vd) = (spec.heads, spec.nope, spec.v_dim);
    let kv = kv_b.matmul(latents, past + len);
    let layout = AttnLayout::expanded(h, nope, vd, spec.scale());
    sparse_attention(q, &kv, &layout, sel)
}

/// Weight-absorbed attention over the latents: `q_lat = W_uk^T q` per head, attention
/// over the latents, then `W_uv` on the weighted latent sum.
pub(crate) fn attend_absorbed(
    spec: MlaSpec,
    kv_b: &Matrix,
    q: &[f32],
    len: usize,
    latents: &[f32],
    sel: &Selections,
) -> Vec<f32> {
    let (h, nope, vd, r) = (spec.heads, spec.nope, spec.v_dim, spec.rank);
    let kv_rows = |head: usize, range: std::ops::Range<usize>| -> Vec<Vec<f32>> {
        range
            .map(|i| kv_b.row_f32(head * (nope + vd) + i))
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
        &AttnLayout::absorbed(h, r, spec.scale()),
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
