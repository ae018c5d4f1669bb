//! The DSA indexer's ops in a decode graph, whose replays each see one more token than the
//! last: the pool a step completes and the step's selections are worked out on the device from
//! the graph's step count (a device value the host sets before each launch), with the bits
//! [`Cuda::dsa_pool_keys_dev`], [`Cuda::cache_store`] and [`Cuda::dsa_select_dev`] give.

use super::attn::{CacheBytes, DeviceSelections, DsaSpec, Planned, SelectPlan, cache_format};
use super::{Cuda, CudaError};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

impl Cuda {
    /// A decode step's pool: `keys` and `gates` hold `tokens + *step` tokens (this step's
    /// included); when that completes a pool, its key goes into `pool_keys` (values of the
    /// caches' dtype) as the pool's row. The caller makes room for each replay's rows before
    /// launching it.
    pub fn dsa_pool_step(
        &self,
        (keys, gates, dtype): (&CudaSlice<u8>, &CudaSlice<u8>, crate::backend::CacheDtype),
        ape: &CudaSlice<f32>,
        kpool: usize,
        tokens: usize,
        step: &CudaSlice<i32>,
        pool_keys: &mut CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let di = ape.len() / kpool.max(1);
        let bytes = dtype.bytes();
        if kpool == 0
            || di == 0
            || di * kpool != ape.len()
            || keys.len() < tokens * di * bytes
            || gates.len() < tokens * di * bytes
            || pool_keys.len() < tokens / kpool * di * bytes
        {
            return Err(CudaError::Invalid(format!(
                "dsa_pool_step at {tokens} tokens (kpool {kpool}, ape {}): key bytes {}, gate \
                 bytes {}, pool key bytes {}",
                ape.len(),
                keys.len(),
                gates.len(),
                pool_keys.len()
            )));
        }
        let (di_i, kpool_i, tokens_l) = (di as i32, kpool as i32, tokens as i64);
        let fmt = cache_format(dtype);
        let mut b = self.stream.launch_builder(self.kernel("dsa_pool_step"));
        b.arg(keys)
            .arg(gates)
            .arg(&fmt)
            .arg(ape)
            .arg(&di_i)
            .arg(&kpool_i)
            .arg(&tokens_l)
            .arg(step)
            .arg(pool_keys);
        // SAFETY: one thread per channel; the pool's tokens and its row lie inside the caches
        // at the capture (checked above) and at each replay (the graph's owner makes room).
        unsafe { b.launch(LaunchConfig::for_num_elems(di as u32)) }?;
        Ok(())
    }

    /// [`Cuda::dsa_select_dev`] for `queries` consecutive queries, the first at position
    /// `pos + *step`, over `pool_keys` with room for `room_pools` pools (every pool the
    /// queries see is complete: [`Cuda::dsa_pool_step`] ran first). The offsets stay on the
    /// device ([`DeviceSelections::planned`]).
    #[allow(clippy::too_many_arguments)]
    pub fn dsa_select_step(
        &self,
        q: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        (pool_keys, keys_dtype): CacheBytes,
        room_pools: usize,
        spec: DsaSpec,
        pos: usize,
        queries: usize,
        step: &CudaSlice<i32>,
    ) -> Result<DeviceSelections, CudaError> {
        let DsaSpec {
            heads,
            dim,
            kpool,
            topk,
            select_tail,
        } = spec;
        if kpool == 0
            || queries == 0
            || q.len() < queries * heads * dim
            || weights.len() < queries * heads
            || pool_keys.len() < room_pools * dim * keys_dtype.bytes()
        {
            return Err(CudaError::Invalid(format!(
                "dsa_select_step {spec:?} for {queries} queries over room for {room_pools} \
                 pools: q {}, weights {}, pool key bytes {}",
                q.len(),
                weights.len(),
                pool_keys.len()
            )));
        }
        let budget = topk / kpool;
        let max_picks = budget * kpool + if select_tail { kpool - 1 } else { 0 };
        let mut tokens = self.unselected(queries * max_picks)?;
        let s = &self.stream;
        let (mut cand, mut vis) = (
            s.alloc_zeros::<i32>(queries)?,
            s.alloc_zeros::<i32>(queries)?,
        );
        let mut out_off = s.alloc_zeros::<i64>(queries)?;
        let mut offsets = s.alloc_zeros::<i32>(queries + 1)?;
        let (vis0, queries_i) = (pos as i64 + 1, queries as i32);
        let (budget_i, kpool_i, tail_i) = (budget as i32, kpool as i32, select_tail as i32);
        let mut b = s.launch_builder(self.kernel("dsa_plan"));
        b.arg(&vis0)
            .arg(step)
            .arg(&queries_i)
            .arg(&kpool_i)
            .arg(&budget_i)
            .arg(&tail_i)
            .arg(&mut cand)
            .arg(&mut vis)
            .arg(&mut out_off)
            .arg(&mut offsets);
        // SAFETY: one thread writes `queries` entries of each table and `queries + 1` offsets.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }?;

        // The scores' rows are as long as the pools there is room for; a query scores only
        // its candidates (the rest of the grid returns at once).
        let plan = SelectPlan {
            candidates: &cand,
            visible: &vis,
            out_off: &out_off,
            max_cand: room_pools,
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
            offsets: Vec::new(),
            planned: Some(Planned {
                offsets,
                queries,
                max_picks,
            }),
        })
    }
}
