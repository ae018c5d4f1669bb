//! Small device ops of the GPU forward on buffers already on the device (kernels in
//! kernels/cuda/elementwise.cu and mla.cu): stream mean, value scaling and sums, LayerNorm,
//! KDA's gates, packing q|k|v, and MLA's absorbed query and output products.
#![allow(unsafe_code)] // kernel launches; each block says why it holds

use super::{Cuda, CudaError, norm_config, rows_config};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Threads per block of the elementwise and column kernels.
const ELEM_BLOCK: u32 = 256;

fn elem_config(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(ELEM_BLOCK).max(1), 1, 1),
        block_dim: (ELEM_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// KDA's gate settings for [`Cuda::kda_gates`].
#[derive(Clone, Copy, Debug)]
pub struct KdaGates {
    /// Heads and their width; channels = heads x head_dim.
    pub heads: usize,
    pub head_dim: usize,
    /// The forget gate's lower bound, when the config sets one.
    pub lower_bound: Option<f32>,
}

impl Cuda {
    /// `dst[c] = mean over the n streams of src[s * d + c]` for one token's `n x d` streams.
    pub fn stream_mean(
        &self,
        src: &CudaView<f32>,
        n: usize,
        d: usize,
        dst: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        let (n_i, d_i) = (n as i32, d as i32);
        let mut l = self.stream.launch_builder(self.kernel("stream_mean"));
        l.arg(src).arg(&n_i).arg(&d_i).arg(dst);
        // SAFETY: src holds n * d values, dst d; one thread per column.
        unsafe { l.launch(elem_config(d)) }?;
        Ok(())
    }

    /// Each of the rows of `src` (`width` values) `copies` times in a row, into `dst`
    /// (`src.len() * copies` values).
    pub fn repeat_rows(
        &self,
        src: &CudaSlice<f32>,
        width: usize,
        copies: usize,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let total = src.len() * copies;
        if width == 0 || !src.len().is_multiple_of(width) || dst.len() < total {
            return Err(CudaError::Invalid(format!(
                "repeat_rows: {} values in rows of {width}, {copies} copies into {}",
                src.len(),
                dst.len()
            )));
        }
        if total == 0 {
            return Ok(());
        }
        let (w_i, c_i, t_i) = (width as i32, copies as i32, total as i64);
        let mut l = self.stream.launch_builder(self.kernel("repeat_rows"));
        l.arg(src).arg(&w_i).arg(&c_i).arg(&t_i).arg(dst);
        // SAFETY: src holds whole rows of width values, dst copies times as many (checked);
        // one thread per value of dst.
        unsafe { l.launch(elem_config(total)) }?;
        Ok(())
    }

    /// KDA's forget gates and betas in place over `rows` token rows: `g` (`[rows, channels]`)
    /// becomes the log decay from `dt_bias` (channels) and `a_log` (heads), `beta`
    /// (`[rows, heads]`) its sigmoid.
    pub fn kda_gates(
        &self,
        spec: KdaGates,
        g: &mut CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        beta: &mut CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let (h, dh) = (spec.heads, spec.head_dim);
        let c = h * dh;
        let (dh_i, c_i, h_i) = (dh as i32, c as i32, h as i32);
        let (has_bound, bound) = match spec.lower_bound {
            Some(b) => (1i32, b),
            None => (0i32, 0.0f32),
        };
        let mut l = self.stream.launch_builder(self.kernel("kda_gates"));
        l.arg(g)
            .arg(dt_bias)
            .arg(a_log)
            .arg(&dh_i)
            .arg(&c_i)
            .arg(&has_bound)
            .arg(&bound)
            .arg(beta)
            .arg(&h_i);
        let mut grid = elem_config(c.max(h));
        grid.grid_dim.1 = rows as u32;
        // SAFETY: g holds rows of c values, beta rows of h (h <= c), dt_bias c and a_log h;
        // one thread per channel of a row (grid y over the rows), the first h of a row also
        // do its beta.
        unsafe { l.launch(grid) }?;
        Ok(())
    }

    /// Packs `len` tokens' q, k and v (`[len, c]` each) into `out` (`[len, 3c]`, q|k|v per
    /// token).
    pub fn interleave3(
        &self,
        q: &CudaView<f32>,
        k: &CudaView<f32>,
        v: &CudaView<f32>,
        len: usize,
        c: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (len_i, c_i) = (len as i32, c as i32);
        let mut l = self.stream.launch_builder(self.kernel("interleave3"));
        l.arg(q).arg(k).arg(v).arg(&len_i).arg(&c_i).arg(out);
        // SAFETY: q, k and v hold len * c values, out len * 3c; one thread per value of a
        // projection.
        unsafe { l.launch(elem_config(len * c)) }?;
        Ok(())
    }

    /// MLA's absorbed queries: `out[t, h] = q[t, h] (nope) x kv_b's key rows of head h`
    /// (`[tokens, heads, rank]`), `kv_b` being `heads x (nope + v_dim)` rows of `rank`.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_absorb_q(
        &self,
        q: &CudaView<f32>,
        kv_b: &CudaSlice<f32>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        rank: usize,
        tokens: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if tokens >= super::attn::MLA_SHARED_MIN_QUERIES {
            // Per head, row-major q_lat[t, rank] = q[t, nope] kv_b_h[nope, rank]: column-major
            // q_lat^T = kv_b_h^T q^T, both operands as they lie (kv_b_h's rows of `rank`, q's
            // rows strided by the heads), a batch over the heads.
            let cfg = StridedBatchedConfig {
                gemm: GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_N,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: rank as i32,
                    n: tokens as i32,
                    k: nope as i32,
                    alpha: 1.0f32,
                    lda: rank as i32,
                    ldb: (heads * nope) as i32,
                    beta: 0.0f32,
                    ldc: (heads * rank) as i32,
                },
                batch_size: heads as i32,
                stride_a: ((nope + v_dim) * rank) as i64,
                stride_b: nope as i64,
                stride_c: rank as i64,
            };
            check_absorb(
                q.len(),
                tokens * heads * nope,
                out.len(),
                tokens * heads * rank,
            )?;
            check_absorb(kv_b.len(), heads * (nope + v_dim) * rank, 0, 0)?;
            // SAFETY: sizes checked just above; every head's operands lie inside them.
            return unsafe { self.blas()?.gemm_strided_batched(cfg, kv_b, q, out) }
                .map_err(|e| CudaError::Invalid(format!("cuBLAS batched SGEMM: {e:?}")));
        }
        let (nope_i, vd_i, r_i) = (nope as i32, v_dim as i32, rank as i32);
        let mut l = self.stream.launch_builder(self.kernel("mla_absorb_q"));
        l.arg(q)
            .arg(kv_b)
            .arg(&nope_i)
            .arg(&vd_i)
            .arg(&r_i)
            .arg(out);
        let grid = LaunchConfig {
            grid_dim: (
                (rank as u32).div_ceil(ELEM_BLOCK),
                heads as u32,
                tokens as u32,
            ),
            block_dim: (ELEM_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: q holds tokens * heads * nope values, kv_b heads * (nope + v_dim) rows of
        // rank, out tokens * heads * rank; one thread per (column < rank, head, token).
        unsafe { l.launch(grid) }?;
        Ok(())
    }

    /// MLA's absorbed output: `out[t, h] = o_lat[t, h] (rank) x kv_b's value rows of head h`
    /// (`[tokens, heads, v_dim]`).
    #[allow(clippy::too_many_arguments)]
    pub fn mla_absorb_out(
        &self,
        o_lat: &CudaSlice<f32>,
        kv_b: &CudaSlice<f32>,
        heads: usize,
        nope: usize,
        v_dim: usize,
        rank: usize,
        tokens: usize,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        if tokens >= super::attn::MLA_SHARED_MIN_QUERIES {
            // Per head, row-major out[t, v_dim] = o_lat[t, rank] kv_b_v^T (kv_b's value rows
            // of `rank`): column-major out^T = kv_b_v o_lat^T, kv_b_v transposed as it lies.
            let cfg = StridedBatchedConfig {
                gemm: GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_T,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: v_dim as i32,
                    n: tokens as i32,
                    k: rank as i32,
                    alpha: 1.0f32,
                    lda: rank as i32,
                    ldb: (heads * rank) as i32,
                    beta: 0.0f32,
                    ldc: (heads * v_dim) as i32,
                },
                batch_size: heads as i32,
                stride_a: ((nope + v_dim) * rank) as i64,
                stride_b: rank as i64,
                stride_c: v_dim as i64,
            };
            check_absorb(
                o_lat.len(),
                tokens * heads * rank,
                out.len(),
                tokens * heads * v_dim,
            )?;
            check_absorb(kv_b.len(), heads * (nope + v_dim) * rank, 0, 0)?;
            let values = kv_b.slice(nope * rank..);
            // SAFETY: sizes checked just above; every head's value rows start `nope` rows
            // into its block of kv_b and stay inside it.
            return unsafe { self.blas()?.gemm_strided_batched(cfg, &values, o_lat, out) }
                .map_err(|e| CudaError::Invalid(format!("cuBLAS batched SGEMM: {e:?}")));
        }
        let (h_i, nope_i, vd_i, r_i) = (heads as i32, nope as i32, v_dim as i32, rank as i32);
        let mut l = self.stream.launch_builder(self.kernel("mla_absorb_out"));
        l.arg(o_lat)
            .arg(kv_b)
            .arg(&h_i)
            .arg(&nope_i)
            .arg(&vd_i)
            .arg(&r_i)
            .arg(out);
        // SAFETY: o_lat holds tokens * heads * rank values, out tokens * heads * v_dim; one
        // warp per row of a token's heads * v_dim (grid y over the tokens), reading kv_b's
        // value rows.
        unsafe { l.launch(rows_config(heads * v_dim, tokens as u32)) }?;
        Ok(())
    }

    /// LayerNorm in place over `rows` rows of `width` values.
    pub fn layer_norm(
        &self,
        x: &mut CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        width: usize,
        eps: f32,
        rows: usize,
    ) -> Result<(), CudaError> {
        let width_i = width as i32;
        let mut l = self.stream.launch_builder(self.kernel("layer_norm"));
        l.arg(x).arg(weight).arg(bias).arg(&width_i).arg(&eps);
        // SAFETY: one block per row of width values of x (rows rows), weight and bias width.
        unsafe { l.launch(norm_config(rows, width)) }?;
        Ok(())
    }

    /// `x *= scale` over the first `count` values.
    pub fn scale_values(
        &self,
        x: &mut CudaSlice<f32>,
        scale: f32,
        count: usize,
    ) -> Result<(), CudaError> {
        let count_i = count as i32;
        let mut l = self.stream.launch_builder(self.kernel("scale_values"));
        l.arg(x).arg(&scale).arg(&count_i);
        // SAFETY: x holds at least count values, one thread each.
        unsafe { l.launch(elem_config(count)) }?;
        Ok(())
    }

    /// `y += s` over the first `count` values.
    pub fn add_values(
        &self,
        y: &mut CudaSlice<f32>,
        s: &CudaSlice<f32>,
        count: usize,
    ) -> Result<(), CudaError> {
        let count_i = count as i32;
        let mut l = self.stream.launch_builder(self.kernel("add_values"));
        l.arg(y).arg(s).arg(&count_i);
        // SAFETY: y and s hold at least count values each, one thread per value.
        unsafe { l.launch(elem_config(count)) }?;
        Ok(())
    }
}

/// Host microseconds per CUDA call of the kinds a decode step makes (see [`Cuda::call_costs`]).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct CallCosts {
    /// A 4,096-value `scale_values` launch on the compute stream.
    pub launch_us: f64,
    /// The same launch on a fresh non-blocking stream (the compute stream is one too; this
    /// one has no other work queued).
    pub launch_own_stream_us: f64,
    /// A stream-ordered allocation of 16 KiB and its free.
    pub alloc_free_us: f64,
    /// An allocation, a launch writing it and the free: what most ops of a step cost.
    pub alloc_launch_free_us: f64,
    /// A 64-byte upload from pageable host memory (positions, offsets).
    pub upload_us: f64,
    /// Device microseconds a kernel of a chain of dependent launches on one stream, each
    /// launched by the host ([`ChainCosts`]).
    pub chain: ChainCosts,
}

/// Microseconds a kernel of a chain of [`CHAIN`] dependent `scale_values` launches takes,
/// between two synchronisations, launched one by one and replayed as one captured graph: tiny
/// kernels (4,096 values: the host's launch cost one by one, the device's floor a kernel as a
/// graph) and 4 Mi-value kernels (~11 µs of HBM each on an H100, so the device is the bound
/// either way, and the difference is the gap between dependent launches that a graph of a
/// whole decode step would save, issue 17 item 1).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct ChainCosts {
    pub tiny_launched_us: f64,
    pub tiny_graph_us: f64,
    pub large_launched_us: f64,
    pub large_graph_us: f64,
}

/// Kernels in one chain of [`ChainCosts`].
pub const CHAIN: usize = 256;

impl Cuda {
    /// Times `reps` of each call kind back to back on the host (the device runs behind; each
    /// kind ends with a synchronisation, outside its timing).
    pub fn call_costs(&self, reps: usize) -> Result<CallCosts, CudaError> {
        let own = self.ctx.new_stream()?;
        let mut x = self.stream.alloc_zeros::<f32>(4096)?;
        let time = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<f64, CudaError> {
            for _ in 0..reps / 10 + 1 {
                f()?;
            }
            self.synchronize()?;
            own.synchronize()?;
            let started = std::time::Instant::now();
            for _ in 0..reps {
                f()?;
            }
            let us = started.elapsed().as_secs_f64() * 1e6 / reps as f64;
            self.synchronize()?;
            own.synchronize()?;
            Ok(us)
        };
        let launch_us = time(&mut || self.scale_values(&mut x, 1.0, 4096))?;
        let mut y = own.alloc_zeros::<f32>(4096)?;
        let launch_own_stream_us = time(&mut || {
            let n = 4096i32;
            let mut l = own.launch_builder(self.kernel("scale_values"));
            l.arg(&mut y).arg(&1f32).arg(&n);
            // SAFETY: y holds 4,096 values, one thread each.
            unsafe { l.launch(elem_config(4096)) }?;
            Ok(())
        })?;
        let alloc_free_us = time(&mut || {
            drop(self.alloc_f32(4096)?);
            Ok(())
        })?;
        let alloc_launch_free_us = time(&mut || {
            let mut b = self.alloc_f32(4096)?;
            self.scale_values(&mut b, 1.0, 4096)
        })?;
        let host = [0u32; 16];
        let upload_us = time(&mut || {
            drop(self.upload(&host)?);
            Ok(())
        })?;
        let (tiny_launched_us, tiny_graph_us) = self.chain_us(&own, 4096, 20)?;
        let (large_launched_us, large_graph_us) = self.chain_us(&own, 4 << 20, 4)?;
        Ok(CallCosts {
            launch_us,
            launch_own_stream_us,
            alloc_free_us,
            alloc_launch_free_us,
            upload_us,
            chain: ChainCosts {
                tiny_launched_us,
                tiny_graph_us,
                large_launched_us,
                large_graph_us,
            },
        })
    }

    /// (launched one by one, replayed as a graph): microseconds a kernel of [`CHAIN`]
    /// dependent `scale_values` launches over `len` values on `own` (a non-blocking stream
    /// with nothing else queued), over `rounds` chains after a warm-up.
    fn chain_us(
        &self,
        own: &std::sync::Arc<cudarc::driver::CudaStream>,
        len: usize,
        rounds: usize,
    ) -> Result<(f64, f64), CudaError> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let mut buf = own.alloc_zeros::<f32>(len)?;
        let n = len as i32;
        let launch = |buf: &mut CudaSlice<f32>| -> Result<(), CudaError> {
            let mut l = own.launch_builder(self.kernel("scale_values"));
            l.arg(buf).arg(&1f32).arg(&n);
            // SAFETY: buf holds len values, one thread each.
            unsafe { l.launch(elem_config(len)) }?;
            Ok(())
        };
        let time = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<f64, CudaError> {
            f()?;
            own.synchronize()?;
            let started = std::time::Instant::now();
            for _ in 0..rounds {
                f()?;
            }
            own.synchronize()?;
            Ok(started.elapsed().as_secs_f64() * 1e6 / (rounds * CHAIN) as f64)
        };
        let launched = time(&mut || (0..CHAIN).try_for_each(|_| launch(&mut buf)))?;
        own.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        // The capture ends whatever the launches did, so the stream is usable after an error.
        let captured = (0..CHAIN).try_for_each(|_| launch(&mut buf));
        let graph = own.end_capture(CUgraphInstantiate_flags(0))?;
        captured?;
        let graph =
            graph.ok_or_else(|| CudaError::Invalid("the stream capture made no graph".into()))?;
        let graphed = time(&mut || Ok(graph.launch()?))?;
        Ok((launched, graphed))
    }
}

/// The absorption's operands hold at least what its shapes say (`have_a >= need_a`, and so b).
fn check_absorb(
    have_a: usize,
    need_a: usize,
    have_b: usize,
    need_b: usize,
) -> Result<(), CudaError> {
    if have_a < need_a || have_b < need_b {
        return Err(CudaError::Invalid(format!(
            "MLA absorption: operands of {have_a} and {have_b} values, the shapes need {need_a} and {need_b}"
        )));
    }
    Ok(())
}
