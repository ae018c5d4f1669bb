//! Dense products and row ops on device buffers: `matmul` (cuBLAS for many tokens) and
//! `matvec` over every weight format, SwiGLU, RMSNorm and the gated RMSNorm.

use super::*;
use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

/// The half types of [`Cuda::gemm_half`].
#[derive(Clone, Copy, Debug)]
pub(super) enum HalfType {
    F16,
    Bf16,
}

impl Cuda {
    /// [`Cuda::matvec`]'s product, through cuBLAS SGEMM for many tokens (f32 from
    /// `GEMM_MIN_TOKENS`; f16, bf16, q8_0 and q4_k from `WIDEN_MIN_TOKENS`, widened to f32 a
    /// tile of rows at a time, each value as `matvec` computes it, so the product keeps f32
    /// activations and f32 arithmetic: no TF32; bf16 with [`prompt_gemm`] on the tensor cores
    /// instead, [`Cuda::matmul_bf16x3`]), else through `matvec`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        w: &CudaSlice<u8>,
        format: Format,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let min = match format {
            Format::F32 => GEMM_MIN_TOKENS,
            Format::F16 | Format::Bf16 | Format::Q8_0 | Format::Q4K => WIDEN_MIN_TOKENS,
        };
        if n < min || cols == 0 {
            return self.matvec(w, format, rows, cols, x, n, y);
        }
        check_product(w, format, rows, cols, x, n, y)?;
        if format == Format::Bf16 && prompt_gemm() {
            return self.matmul_bf16x3(
                &w.as_view(),
                rows,
                cols,
                &x.as_view(),
                n,
                &mut y.as_view_mut(),
            );
        }
        let tile = (WIDEN_TILE_VALUES / cols).clamp(1, rows);
        let mut widened = match format {
            Format::F32 => None,
            _ => Some(self.alloc_f32(tile * cols)?),
        };
        for r0 in (0..rows).step_by(tile) {
            let m = tile.min(rows - r0);
            if let Some(out) = widened.as_mut() {
                let fmt = kernel_format_id(format);
                if matches!(format, Format::F16 | Format::Bf16) {
                    let src = w.slice(r0 * cols * 2..(r0 + m) * cols * 2);
                    let count = (m * cols) as i64;
                    let mut b = self.stream.launch_builder(self.kernel("widen_f32"));
                    b.arg(&src).arg(&fmt).arg(&count).arg(&mut *out);
                    // SAFETY: src holds m * cols 2-byte values, out at least as many f32.
                    unsafe { b.launch(LaunchConfig::for_num_elems((m * cols) as u32)) }?;
                } else {
                    // The block formats' values as `row_dots` computes them (`dequant_rows`).
                    let rb = format
                        .row_bytes(cols)
                        .map_err(|e| CudaError::Invalid(format!("matmul rows: {e}")))?;
                    let src = w.slice(r0 * rb..(r0 + m) * rb);
                    let (rows_i, cols_i) = (m as i32, cols as i32);
                    let mut b = self.stream.launch_builder(self.kernel("dequant_rows"));
                    b.arg(&src)
                        .arg(&fmt)
                        .arg(&rows_i)
                        .arg(&cols_i)
                        .arg(&mut *out);
                    // SAFETY: src holds m rows of `cols` values in `format` (check_product),
                    // out at least m * cols f32; a block per row.
                    unsafe { b.launch(block_per_row(m)) }?;
                }
            }
            // SAFETY: an f32 matrix's bytes are rows * cols little-endian f32 (checked
            // above), the device's own byte order; the view covers exactly them.
            let all = match &widened {
                Some(out) => out.slice(..m * cols),
                None => unsafe { w.transmute::<f32>(rows * cols) }
                    .ok_or_else(|| CudaError::Invalid("f32 weights short of their size".into()))?
                    .slice(r0 * cols..(r0 + m) * cols),
            };
            // The tile's rows are y's columns r0.. with y's stride (ldc = rows).
            let mut c = y.slice_mut(r0..n * rows);
            // SAFETY: the tile is m x cols, x holds n x cols, and C's view from r0 covers
            // (n - 1) * rows + m values.
            unsafe { self.sgemm_nt(&all, m, cols, x, n, &mut c, rows) }?;
        }
        Ok(())
    }

    /// [`Cuda::matmul`] for bf16 weights on the tensor cores: x split into three bf16 planes
    /// (`split_bf16x3`: together x's 24 significant bits), and the weights as they are times
    /// each plane by cuBLAS (bf16 inputs, f32 sums), smallest plane first, summed in y. The
    /// products of bf16 values are exact in f32, so what remains from f32 arithmetic is the
    /// summation order. The caller checks the sizes (`w` rows x cols bf16, `x` n x cols, `y`
    /// n x rows).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_bf16x3(
        &self,
        w: &CudaView<u8>,
        rows: usize,
        cols: usize,
        x: &CudaView<f32>,
        n: usize,
        y: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        let count = n * cols;
        // Three planes of `count` halves, two a word.
        let mut planes = self.alloc_f32((3 * count).div_ceil(2))?;
        let count_l = count as i64;
        let mut b = self.stream.launch_builder(self.kernel("split_bf16x3"));
        b.arg(x).arg(&count_l).arg(&mut planes);
        let cfg = LaunchConfig {
            grid_dim: ((count as u32).div_ceil(256).min(65_535), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds n * cols values (check_product), planes 3 * count halves.
        unsafe { b.launch(cfg) }?;
        for (i, plane) in [2usize, 1, 0].into_iter().enumerate() {
            let beta = if i == 0 { 0.0f32 } else { 1.0f32 };
            let (a, _ra) = w.device_ptr(&self.stream);
            let (bp, _rb) = planes.device_ptr(&self.stream);
            let (c, _rc) = y.device_ptr_mut(&self.stream);
            // y^T [rows, n] (+)= W [rows, cols] x^T [cols, n]: W's row-major bytes are its
            // transpose column-major (lda = cols, op T), the plane's rows are x^T's columns
            // (ldb = cols), y's rows y^T's columns (ldc = rows).
            // SAFETY: w holds rows x cols bf16 values (check_product), the plane from its
            // offset n x cols halves, y n x rows floats.
            unsafe {
                self.gemm_half(
                    true,
                    HalfType::Bf16,
                    (rows, n, cols),
                    1.0,
                    (a, cols),
                    (bp + (2 * plane * count) as u64, cols),
                    beta,
                    (c, rows),
                )
            }?;
        }
        Ok(())
    }

    /// Column-major `C [m, n] = alpha op(A) [m, k] B [k, n] + beta C` by cuBLAS with A and B of
    /// a half type at device addresses `a`, `b` (leading dimensions beside them), f32 sums and
    /// f32 C at `c`; op(A) = A^T with `transa`.
    /// # Safety
    /// The addresses hold matrices of the sizes cuBLAS reads and writes for these arguments.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm_half(
        &self,
        transa: bool,
        half: HalfType,
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        (a, lda): (u64, usize),
        (b, ldb): (u64, usize),
        beta: f32,
        (c, ldc): (u64, usize),
    ) -> Result<(), CudaError> {
        use cudarc::cublas::{result::gemm_ex, sys};
        let dtype = match half {
            HalfType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            HalfType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        };
        let op = |t: bool| match t {
            true => sys::cublasOperation_t::CUBLAS_OP_T,
            false => sys::cublasOperation_t::CUBLAS_OP_N,
        };
        let blas = self.blas()?;
        // SAFETY: the caller's; alpha and beta are f32 as the f32 compute type wants.
        unsafe {
            gemm_ex(
                *blas.handle(),
                op(transa),
                op(false),
                m as i32,
                n as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                dtype,
                lda as i32,
                b as *const _,
                dtype,
                ldb as i32,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                ldc as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Invalid(format!("cuBLAS GEMM ({half:?}, f32 sums): {e:?}")))
    }

    /// Row-major `y[n, rows] = x[n, cols] w[rows, cols]^T` in f32 by cuBLAS SGEMM, y's rows
    /// `ldc` apart (column-major y^T = w x^T: w's row-major values are its transpose
    /// column-major, lda = cols, op T).
    /// # Safety
    /// w holds rows x cols values, x n x cols, y (n - 1) ldc + rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn sgemm_nt<W: DevicePtr<f32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
        &self,
        w: &W,
        rows: usize,
        cols: usize,
        x: &X,
        n: usize,
        y: &mut Y,
        ldc: usize,
    ) -> Result<(), CudaError> {
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: rows as i32,
            n: n as i32,
            k: cols as i32,
            alpha: 1.0f32,
            lda: cols as i32,
            ldb: cols as i32,
            beta: 0.0f32,
            ldc: ldc as i32,
        };
        // SAFETY: the caller's.
        unsafe { self.blas()?.gemm(cfg, w, x, y) }
            .map_err(|e| CudaError::Invalid(format!("cuBLAS SGEMM: {e:?}")))
    }

    /// `y[t] = W x[t]` for `n` tokens: `w` holds `rows` rows of `cols` values in `format`,
    /// `x` is `[n, cols]`, `y` is `[n, rows]` (device buffers).
    #[allow(clippy::too_many_arguments)] // the kernel's arguments
    pub fn matvec(
        &self,
        w: &CudaSlice<u8>,
        format: Format,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        check_product(w, format, rows, cols, x, n, y)?;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        let (fmt, rows_i, cols_i, n_i) =
            (kernel_format_id(format), rows as i32, cols as i32, n as i32);
        // A warp per row leaves most of the GPU idle below a few thousand rows (the mHC,
        // router and gate projections): those rows get a block each instead. At four tokens
        // or fewer (decode) every format takes the kernel of the fewest accumulators that
        // hold them: the same bits, more warps resident (gemv.cu's `matvec_t*` for the float
        // formats, at two and four tokens two and four rows a warp sharing their loads of x;
        // `matvec_q_t*` for q8_0, `matvec_q4k_xl_t*` for q4_k, two rows a warp, four at four
        // tokens).
        let split = rows < SPLIT_BELOW_ROWS;
        let float = matches!(format, Format::F32 | Format::F16 | Format::Bf16);
        let tile = self.matvec_tile(n);
        // q4_k rows a warp at a time read x in lane-of-32 order (gemv.cu's `lane32_x`,
        // `matvec_q4k_xl_t*`): a warp's loads of x then touch a quarter of the 128-byte lines.
        // The same bits as `matvec_q_t*`.
        let lane32 = format == Format::Q4K && !split && matches!(tile, 1 | 2 | 4);
        let name = match (float, split, tile) {
            (true, false, 1) => "matvec_t1",
            (true, false, 2) => "matvec_t2",
            (true, false, 4) => "matvec_t4",
            (true, true, 1) => "matvec_split_t1",
            (true, true, 2) => "matvec_split_t2",
            (true, true, 4) => "matvec_split_t4",
            (false, false, 1) if lane32 => "matvec_q4k_xl_t1",
            (false, false, 2) if lane32 => "matvec_q4k_xl_t2",
            (false, false, 4) if lane32 => "matvec_q4k_xl_t4",
            (false, false, 1) => "matvec_q_t1",
            (false, false, 2) => "matvec_q_t2",
            (false, false, 4) => "matvec_q_t4",
            (false, true, 1) => "matvec_q_split_t1",
            (false, true, 2) => "matvec_q_split_t2",
            (false, true, 4) => "matvec_q_split_t4",
            (_, false, _) => "matvec",
            (_, true, _) => "matvec_split",
        };
        let ordered = if lane32 {
            let values = n * cols;
            let mut xl = self.alloc_f32(values)?;
            let values_i = values as i64;
            let mut b = self.stream.launch_builder(self.kernel("lane32_x"));
            b.arg(x).arg(&values_i).arg(&mut xl);
            // SAFETY: x (checked above) and xl hold n rows of cols values, cols a multiple of
            // 256 for q4_k rows; a float4 a thread.
            unsafe { b.launch(LaunchConfig::for_num_elems((values / 4) as u32)) }?;
            Some(xl)
        } else {
            None
        };
        let x = ordered.as_ref().unwrap_or(x);
        let cfg = if split {
            LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (SPLIT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        } else if name == "matvec_t4" || name == "matvec_q4k_xl_t4" {
            // T4_ROWS rows a warp (gemv.cu's `matvec_rows_r`).
            rows_config(rows.div_ceil(t4_rows()), 1)
        } else if name == "matvec_t2" || lane32 {
            // Two rows a warp (gemv.cu's `matvec_rows_r`, `matvec_q4k_pairs`).
            rows_config(rows.div_ceil(2), 1)
        } else {
            rows_config(rows, 1)
        };
        let mut b = self.stream.launch_builder(self.kernel(name));
        b.arg(w)
            .arg(&fmt)
            .arg(&rows_i)
            .arg(&cols_i)
            .arg(x)
            .arg(&n_i)
            .arg(y);
        // SAFETY: every one of these kernels takes `matvec`'s argument list in gemv.cu
        // (`matvec_t*` only float formats, `matvec_q_*` only q8_0 and q4_k, `matvec_q4k_xl_*`
        // only q4_k, which `name` keeps to); the sizes were checked above, and the grid covers
        // `rows` rows (a warp each, two rows a warp for `matvec_t2` and q4_k's
        // `matvec_q4k_xl_t1`/`_t2`, T4_ROWS for `matvec_t4` and `matvec_q4k_xl_t4`, or a block
        // of SPLIT_WARPS warps each).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Clamped SwiGLU over `n` values of device buffers.
    pub fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        limit: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = gate.len().min(up.len()).min(out.len());
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(self.kernel("swiglu"));
        b.arg(gate).arg(up).arg(&limit).arg(&n_i).arg(out);
        // SAFETY: `n` is within all three buffers; arguments match act.cu.
        unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }?;
        Ok(())
    }

    /// RMSNorm of each `width`-wide row of `x` in place (`weight` of `width`, or none).
    pub fn rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        weight: Option<&CudaSlice<f32>>,
        width: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let rows = x.len() / width.max(1);
        if weight.is_some_and(|w| w.len() != width) || rows * width != x.len() {
            return Err(CudaError::Invalid(format!(
                "rms_norm of {} values in rows of {width}",
                x.len()
            )));
        }
        let w = weight.unwrap_or(&self.unread);
        let (has_weight, width_i) = (weight.is_some() as i32, width as i32);
        let mut b = self.stream.launch_builder(self.kernel("rms_norm"));
        b.arg(x).arg(w).arg(&has_weight).arg(&width_i).arg(&eps);
        // SAFETY: one block per row of `width` values; the weight is `width` long or null.
        unsafe { b.launch(norm_config(rows, width)) }?;
        Ok(())
    }

    /// `x = rms_norm(x) * weight * sigmoid(gate)` per row of `width`, in place.
    pub fn gated_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        width: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let rows = x.len() / width.max(1);
        if weight.len() != width || rows * width != x.len() || gate.len() != x.len() {
            return Err(CudaError::Invalid(format!(
                "gated_rms_norm of {} values (gate {}) in rows of {width}",
                x.len(),
                gate.len()
            )));
        }
        let width_i = width as i32;
        let mut b = self.stream.launch_builder(self.kernel("gated_rms_norm"));
        b.arg(x).arg(gate).arg(weight).arg(&width_i).arg(&eps);
        // SAFETY: as in `rms_norm`; `gate` has the shape of `x`.
        unsafe { b.launch(norm_config(rows, width)) }?;
        Ok(())
    }
}
