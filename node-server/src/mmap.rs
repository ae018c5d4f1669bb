//! Read-only memory maps of checkpoint files.
#![allow(unsafe_code)]

use memmap2::Mmap;
use std::fs::File;

/// Maps `file` read-only.
pub fn map_readonly(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: checkpoints are opened read-only and treated as immutable for the life of the
    // process; a concurrent writer truncating the file is outside what we support, as for
    // every mmap-based model loader.
    unsafe { Mmap::map(file) }
}
