//! Attention kernels: MLA over the tokens the DSA indexer selects (one kernel for every
//! layout, told by an [`AttnLayout`] where keys and values sit, and one for prompt chunks on
//! the absorbed layout, where all heads share each row),
//! and the indexer itself (pool keys, pool scores, top pools to tokens).
//!
//! Each op has a host-slice entry (upload, launch, download) for checks and the CPU-side
//! callers, and a `_dev` entry on device buffers for callers that keep the cache on the GPU.

use super::{Cuda, CudaError, kernel_format_id};
use crate::backend::{AttnLayout, CacheDtype};
use crate::quant::Format;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, LaunchConfig, PushKernelArg};

/// Threads per block of the attention and top-k kernels.
pub(super) const ATTN_BLOCK: u32 = 256;
/// `ATTN_MAX_DK` in mla.cu: the widest query row the kernel keeps in shared memory.
const ATTN_MAX_DK: usize = 1024;
/// From this many queries in a launch, the absorbed layout runs `mla_attend_shared` (a block
/// per query reading each selected row once for 64 heads); fewer (decode steps) keep a block
/// per (query, head), which spreads a handful of queries over the whole GPU.
pub const MLA_SHARED_MIN_QUERIES: usize = 64;
/// `SH_HEADS` in mla.cu: the heads one `mla_attend_shared` block takes.
const SH_HEADS: usize = 64;

/// Indexer settings for [`Cuda::dsa_select`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DsaSpec {
    pub heads: usize,
    pub dim: usize,
    pub kpool: usize,
    pub topk: usize,
    pub select_tail: bool,
}

/// A sequence cache on the device: its bytes and the dtype they hold.
pub type CacheBytes<'a> = (&'a CudaSlice<u8>, CacheDtype);

/// The kernels' format id of a cache dtype (`FMT_*` in common.cuh).
pub(super) fn cache_format(dtype: CacheDtype) -> i32 {
    kernel_format_id(match dtype {
        CacheDtype::F32 => Format::F32,
        CacheDtype::Bf16 => Format::Bf16,
        CacheDtype::F16 => Format::F16,
    })
}

/// The checks every sparse attention launch makes: the query row fits the kernel's shared
/// memory, each token's heads lie inside its `stride`, `q` and `out` hold `queries` rows.
fn check_attend(
    what: &str,
    layout: &AttnLayout,
    queries: usize,
    q: &CudaSlice<f32>,
    out: &CudaSlice<f32>,
) -> Result<(), CudaError> {
    let AttnLayout {
        heads,
        dk,
        dv,
        stride,
        head_step,
        k_off,
        v_off,
        ..
    } = *layout;
    let rows = queries * heads;
    let reach = (heads.saturating_sub(1) * head_step + (k_off + dk).max(v_off + dv)).max(1);
    if dk > ATTN_MAX_DK || reach > stride || q.len() < rows * dk || out.len() < rows * dv {
        return Err(CudaError::Invalid(format!(
            "{what} {layout:?} for {queries} queries: q {}, out {}",
            q.len(),
            out.len()
        )));
    }
    Ok(())
}

/// Token selections on the device: query `i`'s tokens are `tokens[offsets[i]..offsets[i + 1]]`,
/// the offsets known on the host, or, for a selection a decode graph plans on the device
/// ([`Cuda::dsa_select_step`]), in `planned`.
pub struct DeviceSelections {
    pub tokens: CudaSlice<u32>,
    /// Empty when `planned`.
    pub offsets: Vec<usize>,
    pub planned: Option<Planned>,
}

/// Selection offsets worked out on the device (a decode graph's: they change with each replay).
pub struct Planned {
    /// `[queries + 1]`: query i's tokens are `tokens[offsets[i]..offsets[i + 1]]`.
    pub offsets: CudaSlice<i32>,
    pub queries: usize,
    /// The most tokens a query of this step can select (the attention's scratch per row).
    pub max_picks: usize,
}

impl Cuda {
    /// Attention of each query over its selected tokens: `q` is `[queries, heads, dk]`,
    /// `kv` the token buffer `layout` describes, `sel[i]` query i's tokens. Returns
    /// `[queries, heads, dv]`.
    pub fn mla_sparse_attend(
        &self,
        q: &[f32],
        kv: &[f32],
        layout: &AttnLayout,
        sel: &[Vec<u32>],
    ) -> Result<Vec<f32>, CudaError> {
        let queries = sel.len();
        let mut offsets = Vec::with_capacity(queries + 1);
        offsets.push(0usize);
        for s in sel {
            offsets.push(offsets.last().copied().unwrap_or(0) + s.len());
        }
        let flat: Vec<u32> = sel.iter().flatten().copied().collect();
        let tokens = kv.len().checked_div(layout.stride).unwrap_or(0);
        if let Some(bad) = flat.iter().find(|&&t| t as usize >= tokens) {
            return Err(CudaError::Invalid(format!(
                "mla_sparse_attend selects token {bad}; the cache holds {tokens}"
            )));
        }
        let d_q = self.upload(q)?;
        let d_kv = self.upload_f32_bytes(kv)?;
        let d_sel = DeviceSelections {
            tokens: self.upload(&flat_or_one(flat))?,
            offsets,
            planned: None,
        };
        let mut out = self.alloc_f32(queries * layout.heads * layout.dv)?;
        let kv = (&d_kv, CacheDtype::F32);
        self.mla_sparse_attend_dev(&d_q, kv, layout, &d_sel, &mut out)?;
        let mut y = self.download(&out)?;
        y.truncate(queries * layout.heads * layout.dv);
        Ok(y)
    }

    /// [`Cuda::mla_sparse_attend`] on device buffers, `kv` in its dtype; `out` holds
    /// `[queries, heads, dv]`. The selected tokens must lie inside `kv` (the caller's
    /// selections guarantee it).
    pub fn mla_sparse_attend_dev(
        &self,
        q: &CudaSlice<f32>,
        kv: CacheBytes,
        layout: &AttnLayout,
        sel: &DeviceSelections,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.mla_sparse_attend_part_dev(q, kv, layout, &sel.tokens, &sel.offsets, out)
    }

    /// [`Cuda::mla_sparse_attend_dev`] for the queries whose selections are
    /// `tokens[offsets[i]..offsets[i + 1]]` (a window of a [`DeviceSelections`]' offsets:
    /// they index its whole token buffer); `q` and `out` hold just these queries' rows.
    pub fn mla_sparse_attend_part_dev(
        &self,
        q: &CudaSlice<f32>,
        (kv, kv_dtype): CacheBytes,
        layout: &AttnLayout,
        tokens: &CudaSlice<u32>,
        offsets: &[usize],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let queries = offsets.len().saturating_sub(1);
        check_attend("mla_sparse_attend", layout, queries, q, out)?;
        if tokens.len() < offsets.last().copied().unwrap_or(0) {
            return Err(CudaError::Invalid(format!(
                "mla_sparse_attend: selections up to {:?} in {} tokens",
                offsets.last(),
                tokens.len()
            )));
        }
        if queries * layout.heads == 0 {
            return Ok(());
        }
        let max_picks = offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let offsets_i: Vec<i32> = offsets.iter().map(|&o| o as i32).collect();
        let d_off = self.upload(&offsets_i)?;
        self.attend_offsets(
            q,
            (kv, kv_dtype),
            layout,
            tokens,
            &d_off,
            queries,
            max_picks,
            out,
        )
    }

    /// [`Cuda::mla_sparse_attend_part_dev`] for selections a decode graph planned on the device.
    pub fn mla_sparse_attend_planned(
        &self,
        q: &CudaSlice<f32>,
        kv: CacheBytes,
        layout: &AttnLayout,
        sel: &DeviceSelections,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let Some(p) = &sel.planned else {
            return Err(CudaError::Invalid(
                "mla_sparse_attend_planned of a selection with host offsets".into(),
            ));
        };
        check_attend("mla_sparse_attend_planned", layout, p.queries, q, out)?;
        if sel.tokens.len() < p.queries * p.max_picks || p.offsets.len() < p.queries + 1 {
            return Err(CudaError::Invalid(format!(
                "mla_sparse_attend_planned: {} tokens and {} offsets for {} queries of up to {}",
                sel.tokens.len(),
                p.offsets.len(),
                p.queries,
                p.max_picks
            )));
        }
        let (queries, max_picks) = (p.queries, p.max_picks);
        self.attend_offsets(
            q,
            kv,
            layout,
            &sel.tokens,
            &p.offsets,
            queries,
            max_picks,
            out,
        )
    }

    /// The attention launch for `queries` queries whose selections `d_off` (`[queries + 1]`,
    /// on the device) delimits in `tokens`, none longer than `max_picks`.
    #[allow(clippy::too_many_arguments)]
    fn attend_offsets(
        &self,
        q: &CudaSlice<f32>,
        (kv, kv_dtype): CacheBytes,
        layout: &AttnLayout,
        tokens: &CudaSlice<u32>,
        d_off: &CudaSlice<i32>,
        queries: usize,
        max_picks: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let AttnLayout {
            heads,
            dk,
            dv,
            head_step,
            k_off,
            v_off,
            stride,
            scale,
        } = *layout;
        let rows = queries * heads;
        if rows == 0 {
            return Ok(());
        }
        if queries >= MLA_SHARED_MIN_QUERIES
            && (head_step, k_off, v_off) == (0, 0, 0)
            && dk == dv
            && dk % 4 == 0
            && stride % 4 == 0
        {
            // Scratch rows a multiple of 4 values: the kernel reads them 16 bytes at a time.
            let max_picks = max_picks.next_multiple_of(4);
            let mut scratch = self.alloc_f32(rows * max_picks)?;
            let (kv_fmt, heads_i, dk_i, max_i) = (
                cache_format(kv_dtype),
                heads as i32,
                dk as i32,
                max_picks as i32,
            );
            let stride_l = stride as i64;
            let mut b = self.stream.launch_builder(self.kernel("mla_attend_shared"));
            b.arg(q)
                .arg(kv)
                .arg(&kv_fmt)
                .arg(tokens)
                .arg(d_off)
                .arg(&heads_i)
                .arg(&dk_i)
                .arg(&stride_l)
                .arg(&scale)
                .arg(&max_i)
                .arg(&mut scratch)
                .arg(out);
            let cfg = LaunchConfig {
                grid_dim: (queries as u32, heads.div_ceil(SH_HEADS) as u32, 1),
                block_dim: (ATTN_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: a block per query and tile of 64 heads, rows of q and out as above; the
            // scratch has `max_picks` floats per (query, head); every row lies inside `stride`;
            // d, stride and max_picks are multiples of 4 (its 16- and 8-byte loads are aligned).
            unsafe { b.launch(cfg) }?;
            return Ok(());
        }
        let kv = (kv, kv_dtype);
        self.sparse_attend_rows(q, kv, tokens, d_off, layout, queries, max_picks, None, out)
    }

    /// `mla_sparse_attend` over `queries` queries' rows (sizes checked by the caller), each
    /// query's cache and tokens from `kv` and `tokens` or, with `tables`, from its own
    /// addresses (`kv_of`, `picks_of` in mla.cu).
    #[allow(clippy::too_many_arguments)]
    fn sparse_attend_rows(
        &self,
        q: &CudaSlice<f32>,
        kv: CacheBytes,
        tokens: &CudaSlice<u32>,
        d_off: &CudaSlice<i32>,
        layout: &AttnLayout,
        queries: usize,
        max_picks: usize,
        tables: Option<(&CudaSlice<u64>, &CudaSlice<u64>)>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let AttnLayout {
            heads,
            dk,
            dv,
            stride,
            head_step,
            k_off,
            v_off,
            scale,
        } = *layout;
        let rows = queries * heads;
        let mut scratch = self.alloc_f32(rows * max_picks)?;
        let (kv_fmt, heads_i, dk_i, dv_i, max_i) = (
            cache_format(kv.1),
            heads as i32,
            dk as i32,
            dv as i32,
            max_picks as i32,
        );
        let (stride_l, step_l, k_off_l, v_off_l) =
            (stride as i64, head_step as i64, k_off as i64, v_off as i64);
        let null = 0u64;
        let mut b = self.stream.launch_builder(self.kernel("mla_sparse_attend"));
        b.arg(q)
            .arg(kv.0)
            .arg(&kv_fmt)
            .arg(tokens)
            .arg(d_off)
            .arg(&heads_i)
            .arg(&dk_i)
            .arg(&dv_i)
            .arg(&stride_l)
            .arg(&step_l)
            .arg(&k_off_l)
            .arg(&v_off_l)
            .arg(&scale)
            .arg(&max_i)
            .arg(&mut scratch)
            .arg(out);
        match tables {
            Some((kv_of, picks_of)) => b.arg(kv_of).arg(picks_of),
            None => b.arg(&null).arg(&null),
        };
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ATTN_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per (query, head) row of q and out (sizes checked by the callers);
        // the scratch has `max_picks` floats per row; dk fits the kernel's shared query row;
        // the head offsets stay inside a token's `stride` values; with tables, each query's
        // addresses are a live cache of `kv`'s dtype and its own selection's tokens.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// A decode step's absorbed attention for several sequences in one launch: query `s`
    /// (`q` is `[seqs, heads, dk]`) over `seqs[s]`'s cache and its one query's selection. Each
    /// query's rows get the bits [`Cuda::mla_sparse_attend_part_dev`] gives it alone (the same
    /// kernel and block per row; a lone query never takes `mla_attend_shared`).
    pub fn mla_sparse_attend_seqs(
        &self,
        q: &CudaSlice<f32>,
        seqs: &[(CacheBytes, &DeviceSelections)],
        layout: &AttnLayout,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = seqs.len();
        check_attend("mla_sparse_attend_seqs", layout, n, q, out)?;
        let Some(&((kv0, dtype), sel0)) = seqs.first() else {
            return Ok(());
        };
        let (mut kv_of, mut picks_of, mut offsets) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n + 1),
        );
        offsets.push(0i32);
        // Selections a decode graph planned on the device: their offsets stay there.
        let (mut planned_of, mut planned_max) = (Vec::new(), 0usize);
        let mut guards = Vec::with_capacity(3 * n);
        for ((kv, kv_dtype), sel) in seqs {
            let (start, end) = match (&sel.planned, &sel.offsets[..]) {
                (Some(p), _) if p.queries == 1 => {
                    let (o, guard) = p.offsets.device_ptr(&self.stream);
                    planned_of.push(o);
                    guards.push(guard);
                    planned_max = planned_max.max(p.max_picks);
                    (0, p.max_picks)
                }
                (None, &[start, end]) => (start, end),
                _ => {
                    return Err(CudaError::Invalid(
                        "mla_sparse_attend_seqs takes one query a sequence".into(),
                    ));
                }
            };
            if *kv_dtype != dtype || end < start || sel.tokens.len() < end {
                return Err(CudaError::Invalid(format!(
                    "mla_sparse_attend_seqs: caches of {dtype:?} and {kv_dtype:?}, or a selection \
                     {start}..{end} of {} tokens",
                    sel.tokens.len()
                )));
            }
            let (p, guard) = kv.device_ptr(&self.stream);
            kv_of.push(p);
            guards.push(guard);
            let (p, guard) = sel.tokens.device_ptr(&self.stream);
            picks_of.push(p + 4 * start as u64);
            guards.push(guard);
            offsets.push(offsets.last().copied().unwrap_or(0) + (end - start) as i32);
        }
        if !planned_of.is_empty() && planned_of.len() != n {
            return Err(CudaError::Invalid(
                "mla_sparse_attend_seqs: planned and host selections in one launch".into(),
            ));
        }
        // The tables stay the same for a graph's life (cache addresses are in its key, and
        // the selections are its own allocations).
        let (kv_of, picks_of) = (self.upload_table(&kv_of)?, self.upload_table(&picks_of)?);
        let (d_off, max_picks) = if planned_of.is_empty() {
            let max_picks = offsets.windows(2).map(|w| (w[1] - w[0]) as usize).max();
            (self.upload(&offsets)?, max_picks.unwrap_or(0))
        } else {
            let of = self.upload_table(&planned_of)?;
            let mut d_off = self.stream.alloc_zeros::<i32>(n + 1)?;
            let n_i = n as i32;
            let mut b = self
                .stream
                .launch_builder(self.kernel("sel_offsets_gather"));
            b.arg(&of).arg(&n_i).arg(&mut d_off);
            // SAFETY: one thread reads two offsets of each of the n planned selections and
            // writes n + 1 offsets.
            unsafe { b.launch(LaunchConfig::for_num_elems(1)) }?;
            (d_off, planned_max)
        };
        self.sparse_attend_rows(
            q,
            (kv0, dtype),
            &sel0.tokens,
            &d_off,
            layout,
            n,
            max_picks,
            Some((&kv_of, &picks_of)),
            out,
        )
    }

    /// Keys of pools `first_pool .. first_pool + pools` from the per-token indexer `keys` and
    /// `gates` (`[tokens, di]`) and the position bias `ape` (`[kpool, di]`): `[pools, di]`.
    pub fn dsa_pool_keys(
        &self,
        keys: &[f32],
        gates: &[f32],
        ape: &[f32],
        kpool: usize,
        first_pool: usize,
        pools: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let di = ape.len() / kpool.max(1);
        let (dk, dg) = (self.upload_f32_bytes(keys)?, self.upload_f32_bytes(gates)?);
        let da = self.upload(ape)?;
        let mut out = self.alloc_f32(pools * di)?;
        let cache = (&dk, &dg, CacheDtype::F32);
        self.dsa_pool_keys_dev(cache, &da, kpool, first_pool, pools, &mut out)?;
        let mut y = self.download(&out)?;
        y.truncate(pools * di);
        Ok(y)
    }

    /// [`Cuda::dsa_pool_keys`] on device buffers, `keys` and `gates` in one dtype.
    pub fn dsa_pool_keys_dev(
        &self,
        (keys, gates, dtype): (&CudaSlice<u8>, &CudaSlice<u8>, CacheDtype),
        ape: &CudaSlice<f32>,
        kpool: usize,
        first_pool: usize,
        pools: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let di = ape.len() / kpool.max(1);
        let need = (first_pool + pools) * kpool * di * dtype.bytes();
        if kpool == 0
            || di * kpool != ape.len()
            || keys.len() < need
            || gates.len() < need
            || out.len() < pools * di
        {
            return Err(CudaError::Invalid(format!(
                "dsa_pool_keys of pools {first_pool}..+{pools} (kpool {kpool}, ape {}): key bytes \
                 {}, gate bytes {}, out {}",
                ape.len(),
                keys.len(),
                gates.len(),
                out.len()
            )));
        }
        if pools == 0 || di == 0 {
            return Ok(());
        }
        let (di_i, kpool_i, first_i, pools_i) =
            (di as i32, kpool as i32, first_pool as i32, pools as i32);
        let fmt = cache_format(dtype);
        let mut b = self.stream.launch_builder(self.kernel("dsa_pool_keys"));
        b.arg(keys)
            .arg(gates)
            .arg(&fmt)
            .arg(ape)
            .arg(&di_i)
            .arg(&kpool_i)
            .arg(&first_i)
            .arg(&pools_i)
            .arg(out);
        // SAFETY: one thread per (pool, channel) of `out`; the pools' tokens lie inside keys
        // and gates (checked above).
        unsafe { b.launch(LaunchConfig::for_num_elems((pools * di) as u32)) }?;
        Ok(())
    }

    /// The tokens each query attends to, as `Indexer::select` picks them: `q` is
    /// `[queries, heads, dim]`, `weights` `[queries, heads]` (already scaled),
    /// `pool_keys` `[pools, dim]`, `positions[i]` query i's absolute position.
    pub fn dsa_select(
        &self,
        q: &[f32],
        weights: &[f32],
        pool_keys: &[f32],
        spec: DsaSpec,
        positions: &[usize],
    ) -> Result<Vec<Vec<u32>>, CudaError> {
        let (dq, dw, dk) = (
            self.upload(q)?,
            self.upload(weights)?,
            self.upload_f32_bytes(&flat_or_one(pool_keys.to_vec()))?,
        );
        let pools = pool_keys.len() / spec.dim.max(1);
        let keys = (&dk, CacheDtype::F32);
        let sel = self.dsa_select_dev(&dq, &dw, keys, pools, spec, positions)?;
        let flat = self.download(&sel.tokens)?;
        Ok(sel
            .offsets
            .windows(2)
            .map(|w| flat[w[0]..w[1]].to_vec())
            .collect())
    }

    /// [`Cuda::dsa_select`] on device buffers, `pool_keys` in its dtype; `pools` of them
    /// are complete.
    pub fn dsa_select_dev(
        &self,
        q: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        (pool_keys, keys_dtype): CacheBytes,
        pools: usize,
        spec: DsaSpec,
        positions: &[usize],
    ) -> Result<DeviceSelections, CudaError> {
        let DsaSpec {
            heads,
            dim,
            kpool,
            topk,
            select_tail,
        } = spec;
        let queries = positions.len();
        if kpool == 0
            || q.len() < queries * heads * dim
            || weights.len() < queries * heads
            || pool_keys.len() < pools * dim * keys_dtype.bytes()
        {
            return Err(CudaError::Invalid(format!(
                "dsa_select {spec:?} for {queries} queries over {pools} pools: q {}, weights {}, \
                 pool key bytes {}",
                q.len(),
                weights.len(),
                pool_keys.len()
            )));
        }
        // Per query: the pools it scores and where its tokens go (known here from the
        // positions alone).
        let mut candidates = Vec::with_capacity(queries);
        let mut visible = Vec::with_capacity(queries);
        let mut offsets = Vec::with_capacity(queries + 1);
        offsets.push(0usize);
        for &pos in positions {
            let vis = pos + 1;
            let cand = (vis / kpool).min(pools);
            let tail = if select_tail { vis % kpool } else { 0 };
            let count = (topk / kpool).min(cand) * kpool + tail;
            candidates.push(cand as i32);
            visible.push(vis as i32);
            offsets.push(offsets.last().copied().unwrap_or(0) + count);
        }
        let total = offsets.last().copied().unwrap_or(0);
        let mut tokens = self.unselected(total)?;
        let max_cand = candidates.iter().copied().max().unwrap_or(0).max(0) as usize;
        if queries == 0 {
            return Ok(DeviceSelections {
                tokens,
                offsets,
                planned: None,
            });
        }
        let d_cand = self.upload(&candidates)?;
        let d_vis = self.upload(&visible)?;
        let out_off: Vec<i64> = offsets[..queries].iter().map(|&o| o as i64).collect();
        let d_off = self.upload(&out_off)?;
        let plan = SelectPlan {
            candidates: &d_cand,
            visible: &d_vis,
            out_off: &d_off,
            max_cand,
        };
        self.select_launches(
            q,
            weights,
            (pool_keys, keys_dtype),
            spec,
            queries,
            plan,
            &mut tokens,
        )?;
        Ok(DeviceSelections {
            tokens,
            offsets,
            planned: None,
        })
    }
}

/// Where each query's selection comes from, on the device: its candidate pools and visible
/// tokens, and the first place of its tokens; `max_cand` bounds the candidates (the scores'
/// row length).
pub(super) struct SelectPlan<'a> {
    pub candidates: &'a CudaSlice<i32>,
    pub visible: &'a CudaSlice<i32>,
    pub out_off: &'a CudaSlice<i64>,
    pub max_cand: usize,
}

impl Cuda {
    /// The pool scores and the top pools to tokens of `queries` queries (`dsa_scores` then
    /// `dsa_topk_tokens`) as `plan` places them; the caller has checked q, weights and
    /// pool_keys hold the rows the candidates need, and sized `tokens` for the plan's places.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn select_launches(
        &self,
        q: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        (pool_keys, keys_dtype): CacheBytes,
        spec: DsaSpec,
        queries: usize,
        plan: SelectPlan,
        tokens: &mut CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        let DsaSpec {
            heads,
            dim,
            kpool,
            topk,
            select_tail,
        } = spec;
        let (s, max_cand) = (&self.stream, plan.max_cand);
        let mut scores = self.alloc_f32(queries * max_cand)?;
        let (heads_i, dim_i, max_i) = (heads as i32, dim as i32, max_cand as i32);
        let scale = (dim as f32).powf(-0.5);
        let keys_fmt = cache_format(keys_dtype);
        if max_cand > 0 {
            let mut b = s.launch_builder(self.kernel("dsa_scores"));
            b.arg(q)
                .arg(weights)
                .arg(pool_keys)
                .arg(&keys_fmt)
                .arg(plan.candidates)
                .arg(&heads_i)
                .arg(&dim_i)
                .arg(&scale)
                .arg(&max_i)
                .arg(&mut scores);
            let warps = ATTN_BLOCK / 32;
            let cfg = LaunchConfig {
                grid_dim: ((max_cand as u32).div_ceil(warps), queries as u32, 1),
                block_dim: (ATTN_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: one warp per (pool < candidates[b] <= max_cand, query b); the caller
            // checked q, weights and pool_keys hold those rows; scores has max_cand per query.
            unsafe { b.launch(cfg) }?;
        }
        let (budget_i, kpool_i, tail_i) = ((topk / kpool) as i32, kpool as i32, select_tail as i32);
        let mut b = s.launch_builder(self.kernel("dsa_topk_tokens"));
        b.arg(&scores)
            .arg(plan.candidates)
            .arg(plan.visible)
            .arg(plan.out_off)
            .arg(&max_i)
            .arg(&budget_i)
            .arg(&kpool_i)
            .arg(&tail_i)
            .arg(tokens);
        let cfg = LaunchConfig {
            grid_dim: (queries as u32, 1, 1),
            block_dim: (ATTN_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per query; it writes its count of tokens (the plan's formula, the
        // kernel's own) from its planned place, inside `tokens` (the caller sized it).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

impl Cuda {
    /// A buffer for `len` selected tokens, every entry u32::MAX (which no selection can hold)
    /// until the selection kernels write it.
    pub(super) fn unselected(&self, len: usize) -> Result<CudaSlice<u32>, CudaError> {
        // SAFETY: every word is set below, before any kernel reads the buffer.
        let mut tokens = unsafe { self.stream.alloc::<u32>(len.max(1)) }?;
        self.fill_bits(&mut tokens, u32::MAX)?;
        Ok(tokens)
    }

    /// f32 values as the bytes of an f32 cache.
    fn upload_f32_bytes(&self, values: &[f32]) -> Result<CudaSlice<u8>, CudaError> {
        let bytes: Vec<u8> = flat_or_one(values.iter().flat_map(|v| v.to_le_bytes()).collect());
        self.upload(&bytes)
    }

    /// Stores `src`'s values in `cache` (values of `dtype`) from value `at` on: f32 bit for
    /// bit, bf16 and f16 rounded to nearest even as `half`'s `from_f32` rounds on the host.
    /// With `step` (a replayed decode graph's steps since its capture, on the device), from
    /// `at + step * n` on.
    pub fn cache_store(
        &self,
        src: &CudaView<f32>,
        cache: &mut CudaSlice<u8>,
        dtype: CacheDtype,
        at: usize,
        n: usize,
        step: Option<&CudaSlice<i32>>,
    ) -> Result<(), CudaError> {
        if src.len() < n || cache.len() < (at + n) * dtype.bytes() {
            return Err(CudaError::Invalid(format!(
                "cache_store of {n} values at {at} ({}): {} sources, {} cache bytes",
                dtype.name(),
                src.len(),
                cache.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let (at_l, n_l, fmt) = (at as i64, n as i64, cache_format(dtype));
        let null = 0u64;
        let mut b = self.stream.launch_builder(self.kernel("cache_store"));
        b.arg(src).arg(cache).arg(&fmt).arg(&at_l).arg(&n_l);
        match step {
            Some(step) => b.arg(step),
            None => b.arg(&null),
        };
        // SAFETY: one thread per value; src holds n values and the cache room for values
        // at .. at + n of its dtype (checked above); with a step count, its caller (a decode
        // graph) has made room for every replay's values before it launches one.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        Ok(())
    }
}

/// cudarc cannot allocate zero elements; an empty host list uploads as one unused value.
fn flat_or_one<T: Default>(mut v: Vec<T>) -> Vec<T> {
    if v.is_empty() {
        v.push(T::default());
    }
    v
}
