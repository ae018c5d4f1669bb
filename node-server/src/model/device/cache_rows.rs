//! The host's growable cache buffer: values in the cache's dtype (f32 as they come; bf16 or
//! f16 rounded to nearest even when pushed, as the GPU's `cache_store` kernel rounds), read
//! back as f32. The GPU keeps the same bytes (`GrowBuf`), so a cache moves between the
//! devices without a conversion.

use crate::backend::CacheDtype;
use half::{bf16, f16};
use std::borrow::Cow;
use std::ops::Range;

/// Values that grow by appended rows, stored in a [`CacheDtype`].
#[derive(Clone, Debug, PartialEq)]
pub enum CacheRows {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl CacheRows {
    /// No values yet.
    pub fn new(dtype: CacheDtype) -> CacheRows {
        match dtype {
            CacheDtype::F32 => CacheRows::F32(Vec::new()),
            CacheDtype::Bf16 => CacheRows::Bf16(Vec::new()),
            CacheDtype::F16 => CacheRows::F16(Vec::new()),
        }
    }

    /// `values` rounded to `dtype`.
    pub fn from_f32(dtype: CacheDtype, values: &[f32]) -> CacheRows {
        let mut rows = CacheRows::new(dtype);
        rows.push(values);
        rows
    }

    pub fn dtype(&self) -> CacheDtype {
        match self {
            CacheRows::F32(_) => CacheDtype::F32,
            CacheRows::Bf16(_) => CacheDtype::Bf16,
            CacheRows::F16(_) => CacheDtype::F16,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            CacheRows::F32(v) => v.len(),
            CacheRows::Bf16(v) => v.len(),
            CacheRows::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the values take.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().bytes()
    }

    /// Appends `values`, rounded to the dtype.
    pub fn push(&mut self, values: &[f32]) {
        match self {
            CacheRows::F32(v) => v.extend_from_slice(values),
            CacheRows::Bf16(v) => v.extend(values.iter().map(|&x| bf16::from_f32(x))),
            CacheRows::F16(v) => v.extend(values.iter().map(|&x| f16::from_f32(x))),
        }
    }

    /// Values `range` as f32 (borrowed when stored as f32).
    pub fn f32s(&self, range: Range<usize>) -> Cow<'_, [f32]> {
        match self {
            CacheRows::F32(v) => Cow::Borrowed(&v[range]),
            CacheRows::Bf16(v) => Cow::Owned(v[range].iter().map(|x| x.to_f32()).collect()),
            CacheRows::F16(v) => Cow::Owned(v[range].iter().map(|x| x.to_f32()).collect()),
        }
    }

    /// Every value as f32.
    pub fn to_f32(&self) -> Cow<'_, [f32]> {
        self.f32s(0..self.len())
    }

    /// The stored bits, little-endian, `dtype().bytes()` per value (as the GPU holds them).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            CacheRows::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CacheRows::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CacheRows::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Values of `dtype` from their little-endian bits (whole values only).
    pub fn from_le_bytes(dtype: CacheDtype, bytes: &[u8]) -> CacheRows {
        match dtype {
            CacheDtype::F32 => CacheRows::F32(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            CacheDtype::Bf16 => CacheRows::Bf16(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            ),
            CacheDtype::F16 => CacheRows::F16(
                bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_values_round_to_nearest_even_and_read_back_as_f32() {
        // 1 + 2^-8 lies halfway between two bf16 values: it rounds to the even one (1.0);
        // 1 + 3 * 2^-8 rounds up. f16 keeps both (10 mantissa bits).
        let x = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5, 1e-3];
        let b = CacheRows::from_f32(CacheDtype::Bf16, &x);
        assert_eq!(
            &*b.to_f32(),
            &[1.0, 1.0 + 4.0 / 256.0, -2.5, bf16::from_f32(1e-3).to_f32()]
        );
        let h = CacheRows::from_f32(CacheDtype::F16, &x);
        assert_eq!(&h.f32s(0..3)[..], &x[..3]);
        let f = CacheRows::from_f32(CacheDtype::F32, &x);
        assert!(matches!(f.f32s(1..4), Cow::Borrowed(s) if s == &x[1..]));
        for rows in [b, h, f] {
            assert_eq!(rows.bytes(), 4 * rows.dtype().bytes());
            let back = CacheRows::from_le_bytes(rows.dtype(), &rows.to_le_bytes());
            assert_eq!(back, rows);
        }
    }
}
