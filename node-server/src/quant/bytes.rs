//! A weight's encoded bytes: a buffer of its own, or a range of memory another owner keeps
//! (a slot of the RAM tier's pinned arena), held alive as long as the weight.

use std::sync::Arc;

/// Memory that weights may borrow a range of, kept alive by the `Arc` each borrower holds.
pub trait Backing: Send + Sync {
    fn bytes(&self) -> &[u8];
    /// Whether the memory is locked in RAM (mlocked, or registered with a GPU) already, so a
    /// weight in it needs no pinning of its own.
    fn pinned(&self) -> bool;
}

/// Encoded weight bytes, read through `Deref<Target = [u8]>`.
#[derive(Clone)]
pub enum Bytes {
    Owned(Vec<u8>),
    Shared {
        backing: Arc<dyn Backing>,
        offset: usize,
        len: usize,
    },
}

impl Bytes {
    /// `len` bytes of `backing` from `offset` (panics when they are not inside it).
    pub fn shared(backing: Arc<dyn Backing>, offset: usize, len: usize) -> Bytes {
        assert!(
            offset + len <= backing.bytes().len(),
            "{len} bytes at {offset} of a backing of {}",
            backing.bytes().len()
        );
        Bytes::Shared {
            backing,
            offset,
            len,
        }
    }

    /// Whether the bytes live in memory that is pinned already (see [`Backing::pinned`]).
    pub fn pinned_backing(&self) -> bool {
        match self {
            Bytes::Owned(_) => false,
            Bytes::Shared { backing, .. } => backing.pinned(),
        }
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Owned(v) => v,
            Bytes::Shared {
                backing,
                offset,
                len,
            } => &backing.bytes()[*offset..*offset + *len],
        }
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(v: Vec<u8>) -> Bytes {
        Bytes::Owned(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Block(Vec<u8>);
    impl Backing for Block {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn pinned(&self) -> bool {
            true
        }
    }

    #[test]
    fn shared_bytes_read_their_range_and_keep_the_backing() {
        let block: Arc<dyn Backing> = Arc::new(Block((0..16).collect()));
        let b = Bytes::shared(block.clone(), 4, 3);
        assert_eq!(&b[..], &[4, 5, 6]);
        assert!(b.pinned_backing());
        assert_eq!(Arc::strong_count(&block), 2);
        drop(b);
        assert_eq!(Arc::strong_count(&block), 1);
        let own = Bytes::from(vec![1u8, 2]);
        assert_eq!(&own[..], &[1, 2]);
        assert!(!own.pinned_backing());
    }

    #[test]
    #[should_panic(expected = "bytes at")]
    fn a_range_past_the_backing_is_refused() {
        let block: Arc<dyn Backing> = Arc::new(Block(vec![0; 8]));
        let _ = Bytes::shared(block, 4, 5);
    }
}
