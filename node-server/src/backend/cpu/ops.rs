//! Elementwise and row-wise ops over f32 slices, in the reference's order of operations.

/// `x / sqrt(mean(x^2) + eps) * weight`, in place, for each row of width `weight.len()`
/// (no weight: the unweighted norm of mHC).
pub fn rms_norm(x: &mut [f32], weight: Option<&[f32]>, width: usize, eps: f32) {
    for row in x.chunks_exact_mut(width) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        match weight {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * inv)),
            None => row.iter_mut().for_each(|v| *v *= inv),
        }
    }
}

/// LayerNorm with weight and bias (biased variance), in place, per row of `weight.len()`.
pub fn layer_norm(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let width = weight.len();
    for row in x.chunks_exact_mut(width) {
        let mean = row.iter().sum::<f32>() / width as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / width as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, w), b) in row.iter_mut().zip(weight).zip(bias) {
            *v = (*v - mean) * inv * w + b;
        }
    }
}

/// `x / sqrt(sum(x^2) + eps)` per row (the FLA l2norm: eps inside the root).
pub fn l2_norm(x: &mut [f32], width: usize, eps: f32) {
    for row in x.chunks_exact_mut(width) {
        let norm = (row.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
        row.iter_mut().for_each(|v| *v /= norm);
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softmax over `x` in place (max-subtracted).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums so the compiler vectorises; the order is fixed, so results repeat.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a * x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// Index of the largest value; the lowest index wins ties.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

/// The `k` largest indices of `scores`, best first; ties go to the lower index so the
/// choice never depends on how many candidates there are.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_breaks_ties_by_index() {
        assert_eq!(top_k(&[0.0, 1.0, 0.0, 1.0, 0.5], 3), vec![1, 3, 4]);
        assert_eq!(top_k(&[0.0, 0.0, 0.0], 2), vec![0, 1]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1e30];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }

    #[test]
    fn rms_norm_unit_rows() {
        let mut x = vec![3.0, 4.0];
        rms_norm(&mut x, None, 2, 0.0);
        let rms = (x[0] * x[0] + x[1] * x[1]) / 2.0;
        assert!((rms - 1.0).abs() < 1e-6);
    }
}
