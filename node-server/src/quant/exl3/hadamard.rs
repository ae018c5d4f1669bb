//! The 128-point Walsh-Hadamard transform EXL3 rotates activations with.

/// Width of one Hadamard block.
pub(super) const BLOCK: usize = 128;
/// `1 / sqrt(128)`, which makes the transform orthonormal (and its own inverse).
const SCALE: f32 = 0.088_388_35;

/// Replaces every 128-value block of `v` by its orthonormal Hadamard transform, in f32:
/// `v'[i] = sum_j (-1)^popcount(i & j) v[j] / sqrt(128)` (Sylvester order). `v.len()` is a
/// multiple of 128.
pub(super) fn rotate(v: &mut [f32]) {
    for block in v.chunks_exact_mut(BLOCK) {
        let mut h = 1;
        while h < BLOCK {
            for pair in block.chunks_exact_mut(2 * h) {
                let (a, b) = pair.split_at_mut(h);
                for (x, y) in a.iter_mut().zip(b.iter_mut()) {
                    let (s, d) = (*x + *y, *x - *y);
                    *x = s;
                    *y = d;
                }
            }
            h *= 2;
        }
        for x in block.iter_mut() {
            *x *= SCALE;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition_and_is_its_own_inverse() {
        let v: Vec<f32> = (0..2 * BLOCK)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut w = v.clone();
        rotate(&mut w);
        for (b, block) in v.chunks_exact(BLOCK).enumerate() {
            for i in 0..BLOCK {
                let exact: f64 = (0..BLOCK)
                    .map(|j| {
                        let sign = if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        sign * f64::from(block[j])
                    })
                    .sum::<f64>()
                    / (BLOCK as f64).sqrt();
                let got = f64::from(w[b * BLOCK + i]);
                assert!((got - exact).abs() < 1e-5, "{b} {i}: {got} vs {exact}");
            }
        }
        rotate(&mut w);
        for (a, b) in v.iter().zip(&w) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
