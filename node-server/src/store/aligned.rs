//! 4 KiB-aligned heap buffers for O_DIRECT I/O, and a pool of them that io_uring can
//! register once and lend out (each lent slot is exclusively owned by its [`Lease`]).
#![allow(unsafe_code)]

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Alignment of every buffer, file offset and length handed to O_DIRECT.
pub const ALIGN: usize = 4096;

/// Rounds `n` up to a multiple of [`ALIGN`].
pub fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// A zero-initialised, 4 KiB-aligned byte buffer whose length is a multiple of 4 KiB.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is a uniquely owned heap allocation, like `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes rounded up to a multiple of 4 KiB (at least 4 KiB).
    pub fn new(len: usize) -> AlignedBuf {
        let len = align_up(len.max(1));
        let layout = Layout::from_size_align(len, ALIGN).expect("buffer size overflows");
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The start of the buffer, for writes through raw pointers (taken once, while owned).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).expect("layout was valid at alloc");
        // SAFETY: allocated in `new` with this exact layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// `count` slots of `slot_len` bytes in one aligned allocation, lent out one at a time.
pub struct BufPool {
    /// Owns the slots' memory; only reached through `base`.
    _memory: AlignedBuf,
    base: NonNull<u8>,
    slot_len: usize,
    count: usize,
    free: Mutex<Vec<usize>>,
}

// SAFETY: slots are handed out exclusively through `Lease`; the allocation lives as long as
// the pool (every lease holds an `Arc` to it).
unsafe impl Send for BufPool {}
// SAFETY: as above; the free list is behind a mutex.
unsafe impl Sync for BufPool {}

impl BufPool {
    pub fn new(slot_len: usize, count: usize) -> Arc<BufPool> {
        let slot_len = align_up(slot_len.max(1));
        let mut memory = AlignedBuf::new(slot_len * count.max(1));
        let base = NonNull::new(memory.as_mut_ptr()).expect("allocation is non-null");
        Arc::new(BufPool {
            _memory: memory,
            base,
            slot_len,
            count,
            free: Mutex::new((0..count).rev().collect()),
        })
    }

    /// `(address, length)` of every slot, in slot order, for `io_uring_register_buffers`.
    pub fn regions(&self) -> Vec<(*mut u8, usize)> {
        (0..self.count)
            // SAFETY: `i * slot_len` stays inside the allocation of `count * slot_len` bytes.
            .map(|i| {
                (
                    unsafe { self.base.as_ptr().add(i * self.slot_len) },
                    self.slot_len,
                )
            })
            .collect()
    }

    /// A free slot, or `None` when every slot is lent.
    pub fn lease(self: &Arc<BufPool>) -> Option<Lease> {
        let index = self.free.lock().expect("pool free list").pop()?;
        Some(Lease {
            pool: Arc::clone(self),
            index,
        })
    }
}

/// Exclusive use of one pool slot; the slot returns to the pool on drop.
pub struct Lease {
    pool: Arc<BufPool>,
    index: usize,
}

impl Lease {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: slot `index` is inside the pool allocation and only this lease uses it.
        unsafe {
            std::slice::from_raw_parts(
                self.pool.base.as_ptr().add(self.index * self.pool.slot_len),
                self.pool.slot_len,
            )
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.pool.base.as_ptr().add(self.index * self.pool.slot_len),
                self.pool.slot_len,
            )
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool
            .free
            .lock()
            .expect("pool free list")
            .push(self.index);
    }
}

/// The destination of one read: a registered pool slot or a buffer of its own.
pub enum IoBuf {
    Fixed(Lease),
    Owned(AlignedBuf),
}

impl IoBuf {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            IoBuf::Fixed(l) => l.as_slice(),
            IoBuf::Owned(b) => b.as_slice(),
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            IoBuf::Fixed(l) => l.as_mut_slice(),
            IoBuf::Owned(b) => b.as_mut_slice(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_rounded() {
        let mut b = AlignedBuf::new(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        b.as_mut_slice()[8191] = 7;
        assert_eq!(b.as_slice()[8191], 7);
    }

    #[test]
    fn pool_lends_each_slot_once() {
        let pool = BufPool::new(4096, 2);
        let mut a = pool.lease().unwrap();
        let b = pool.lease().unwrap();
        assert!(pool.lease().is_none());
        assert_ne!(a.index(), b.index());
        a.as_mut_slice()[0] = 1;
        assert_eq!(b.as_slice()[0], 0);
        assert_eq!(a.as_slice().as_ptr() as usize % ALIGN, 0);
        drop(a);
        assert!(pool.lease().is_some());
    }
}
