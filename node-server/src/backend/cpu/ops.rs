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

/// Index of the largest value; the lowest index wins ties (+0 and -0 tie), a NaN never wins
/// past index 0, and a NaN at index 0 wins: the index a scan keeping the first strictly
/// larger value finds. Chunks of [`ARGMAX_CHUNK`] values get their maximum in 8 lanes (what
/// the compiler vectorises) and are scanned again only when that beats the best so far: a
/// decode step's 154,880 logits in ~1/4 the time of the one-by-one scan.
pub fn argmax(x: &[f32]) -> usize {
    let Some(&first) = x.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let (mut best, mut best_v) = (0, first);
    for (c, chunk) in x.chunks(ARGMAX_CHUNK).enumerate() {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let mut exact = chunk.chunks_exact(8);
        for v in &mut exact {
            for (m, &v) in lanes.iter_mut().zip(v) {
                *m = if v > *m { v } else { *m };
            }
        }
        let top = (lanes.into_iter().chain(exact.remainder().iter().copied()))
            .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m });
        if top > best_v {
            // `top` is a value of the chunk (a NaN never passes `>`); its first place.
            let at = chunk.iter().position(|&v| v == top).unwrap_or(0);
            (best, best_v) = (c * ARGMAX_CHUNK + at, top);
        }
    }
    best
}

/// Values [`argmax`] takes the maximum of before it compares with the best so far.
const ARGMAX_CHUNK: usize = 1024;

/// The `k` largest indices of `scores`, best first; ties go to the lower index so the
/// choice never depends on how many candidates there are. The order is `f32::total_cmp`'s
/// (descending), found by selecting the `k` first keys and sorting only those.
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut keys: Vec<u64> = scores
        .iter()
        .enumerate()
        .map(|(i, &v)| rank_key(v, i))
        .collect();
    let k = k.min(keys.len());
    if k == 0 {
        return Vec::new();
    }
    if k < keys.len() {
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
    }
    keys.sort_unstable();
    keys.into_iter().map(key_index).collect()
}

/// A key whose ascending order is `v` descending by `f32::total_cmp`, then `index` ascending
/// (indices below 2^32).
pub fn rank_key(v: f32, index: usize) -> u64 {
    let bits = v.to_bits();
    // total_cmp's order as unsigned bits: negative values flipped whole, positive ones with
    // the sign bit set; then inverted for descending.
    let ordered = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(!ordered) << 32) | index as u64
}

/// The index a [`rank_key`] was made with.
pub fn key_index(key: u64) -> usize {
    (key & 0xFFFF_FFFF) as usize
}

/// Sorts [`rank_key`]s that come in ascending order of their indices (as made from a slice in
/// order, or a subsequence of those) into the full ascending order, as `sort_unstable` would:
/// a stable radix sort on the value half of the key, three passes of 11 bits, a pass skipped
/// when every key has the same digit (probabilities share most exponent bits). Many times
/// faster than a comparison sort for a vocabulary of keys.
pub fn sort_rank_keys(keys: &mut Vec<u64>) {
    const BITS: u32 = 11;
    if keys.len() < 1024 {
        keys.sort_unstable();
        return;
    }
    debug_assert!(
        keys.windows(2).all(|w| key_index(w[0]) < key_index(w[1])),
        "keys in ascending index order"
    );
    let mut other = vec![0u64; keys.len()];
    for shift in [32, 32 + BITS, 32 + 2 * BITS] {
        let digit = |k: u64| ((k >> shift) & ((1 << BITS) - 1)) as usize;
        let mut start = vec![0usize; 1 << BITS];
        for &k in keys.iter() {
            start[digit(k)] += 1;
        }
        if start.contains(&keys.len()) {
            continue;
        }
        let mut at = 0;
        for s in start.iter_mut() {
            let n = *s;
            *s = at;
            at += n;
        }
        for &k in keys.iter() {
            let d = digit(k);
            other[start[d]] = k;
            start[d] += 1;
        }
        std::mem::swap(keys, &mut other);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values the ordering tests mix in: signed zeros, infinities, NaNs of both signs and the
    /// smallest subnormal.
    const SPECIALS: [f32; 7] = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        1e-45,
    ];

    /// A small deterministic generator for the tests' inputs.
    fn xorshift(mut rng: u64) -> impl FnMut() -> u64 {
        move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        }
    }

    /// `argmax` finds what the scan keeping the first strictly larger value finds, over
    /// ties, signed zeros, infinities and NaNs (at index 0 too), across chunk boundaries.
    #[test]
    fn argmax_is_the_first_strictly_larger_scan() {
        fn scan(x: &[f32]) -> usize {
            let mut best = 0;
            for (i, v) in x.iter().enumerate() {
                if *v > x[best] {
                    best = i;
                }
            }
            best
        }
        let mut next = xorshift(0x9E3779B97F4A7C15);
        let specials = SPECIALS;
        for round in 0..400 {
            let n = (next() % 5000) as usize;
            let x: Vec<f32> = (0..n)
                .map(|_| match next() % 10 {
                    0 => specials[(next() % specials.len() as u64) as usize],
                    // few distinct values: ties across and inside chunks
                    1..=4 => (next() % 4) as f32,
                    _ => (next() % 1000) as f32 / 7.0 - 70.0,
                })
                .collect();
            assert_eq!(argmax(&x), scan(&x), "round {round}, n {n}");
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3000]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
    }

    /// The selection gives the full sort's order (total_cmp descending, index ascending) for
    /// every k, over values with ties, signed zeros, infinities and NaNs of both signs.
    #[test]
    fn top_k_is_the_full_sorts_prefix() {
        let mut next = xorshift(0x2545F4914F6CDD1D);
        let specials = SPECIALS;
        for round in 0..50 {
            let n = 1 + (next() % 300) as usize;
            let scores: Vec<f32> = (0..n)
                .map(|_| match next() % 10 {
                    0 => specials[(next() % specials.len() as u64) as usize],
                    1 => (next() % 4) as f32,
                    _ => (next() % 2000) as f32 / 100.0 - 10.0,
                })
                .collect();
            let mut full: Vec<usize> = (0..n).collect();
            full.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            for k in [0, 1, 2, n / 2, n, n + 3] {
                assert_eq!(top_k(&scores, k), full[..k.min(n)], "round {round} k {k}");
            }
        }
    }

    /// The radix sort gives `sort_unstable`'s order, for keys of any values (ties, specials,
    /// a single shared digit) taken in index order, some indices left out.
    #[test]
    fn rank_keys_radix_sort_is_the_full_sort() {
        let mut next = xorshift(0x9E3779B97F4A7C15);
        for round in 0..40 {
            let n = [1, 5, 1023, 1024, 5000, 70_000][round % 6];
            let mut keys = Vec::new();
            for i in 0..n {
                let r = next();
                if r.is_multiple_of(4) {
                    continue;
                }
                let v = match (round / 6) % 4 {
                    0 => f32::from_bits((r >> 32) as u32),
                    1 => ((r >> 8) % 7) as f32 * 0.125,
                    2 => 0.5,
                    _ => f32::from_bits(0x3000_0000 | ((r >> 32) as u32 & 0x00FF_FFFF)),
                };
                keys.push(rank_key(v, i));
            }
            let mut want = keys.clone();
            want.sort_unstable();
            let mut got = keys;
            sort_rank_keys(&mut got);
            assert_eq!(got, want, "round {round}, {n} values");
        }
    }

    #[test]
    fn top_k_breaks_ties_by_index() {
        assert_eq!(top_k(&[0.0, 1.0, 0.0, 1.0, 0.5], 3), vec![1, 3, 4]);
        assert_eq!(top_k(&[0.0, 0.0, 0.0], 2), vec![0, 1]);
        assert_eq!(top_k(&[1.0, 2.0], 5), vec![1, 0]);
        assert!(top_k(&[1.0], 0).is_empty());
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
