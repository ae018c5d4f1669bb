//! The one call into the `gemm` crate: `Y = X W^T` with row-major X, W and Y.
#![allow(unsafe_code)]

/// Work (multiply-adds) above which the product is spread over the rayon pool.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// `y[n x rows] = x[n x cols] * w[rows x cols]^T`. `parallel_min_work` overrides the
/// threshold for going parallel (`usize::MAX`: never, for callers already inside rayon).
pub fn gemm_xwt(
    x: &[f32],
    n: usize,
    w: &[f32],
    rows: usize,
    cols: usize,
    y: &mut [f32],
    parallel_min_work: usize,
) {
    assert!(x.len() >= n * cols && w.len() >= rows * cols && y.len() >= n * rows);
    let threshold = if parallel_min_work == 0 {
        PARALLEL_MIN_WORK
    } else {
        parallel_min_work
    };
    let parallelism = if n * rows * cols >= threshold {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above keep every strided access inside the three slices:
    // dst (i, j) at i*rows + j for i < n, j < rows; lhs (i, k) at i*cols + k; rhs (k, j) at
    // j*cols + k. dst is exclusively borrowed and does not alias the inputs.
    unsafe {
        gemm::gemm(
            n,
            rows,
            cols,
            y.as_mut_ptr(),
            1,
            rows as isize,
            false,
            x.as_ptr(),
            1,
            cols as isize,
            w.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}
