//! The packed expert store: every routed expert of every MoE layer as one 4 KiB-aligned
//! record in `experts.bin`, described by `experts.json`.
//!
//! * A record is `gate | up | down`, zero-padded to `record_size`, the same for every
//!   record. Each weight is either rows in a row format, exactly `Matrix::to_bytes()` (so
//!   `Matrix::from_bytes` rebuilds it bit for bit), or for an EXL3 checkpoint the layer's
//!   trellis, `suh` and `svh` exactly as the checkpoint stores them (the manifest names
//!   rate and codebook); see [`PartFormat`]. The tiers decode records, the store only
//!   moves bytes. Record `i` of the (layer, expert) order is at
//!   byte `i * record_size`, so one O_DIRECT request reads one expert.
//! * [`pack_store`] writes the store with O_DIRECT in one pass over the source, keeping a
//!   journal (`experts.json.partial`) so a killed run resumes where its last synced batch
//!   ended; [`verify_store`] checks every record's sha256 and CRC-32C and compares a sample
//!   with the source.
//! * [`StoreReader`] serves records through io_uring (or a pread pool where io_uring is
//!   refused), shares concurrent reads of one record, and checks every read's CRC-32C (its
//!   sha256 in a store packed before records had one) unless told to sample.
//!
//! The manifest's fingerprints are defined in [`manifest`].

mod aligned;
mod io;
pub mod manifest;
mod pack;
mod random;
mod reader;
mod records;
mod verify;

pub use aligned::{ALIGN, AlignedBuf};
pub use manifest::{
    DATA, JOURNAL, MANIFEST, Manifest, Part, PartFormat, Parts, RecordEntry, crc32c,
    model_fingerprint, quick_fingerprint,
};
pub use pack::{PackOptions, PackOutcome, PackReport, pack_store};
pub use random::{
    random_record, random_record_parts, rebind_random_store, record_parts, write_random_store,
};
pub use reader::{
    ChecksumPolicy, EngineChoice, ReadError, ReadErrorKind, ReaderOptions, RecordBuf, RecordCheck,
    StoreReader,
};
pub use records::RecordFormat;
pub use verify::{VerifyOptions, VerifyReport, verify_store};

use crate::model::checkpoint::CheckpointError;
use crate::model::loader::LoadError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: the filesystem refuses O_DIRECT (EINVAL on open); put the store on a disk \
         filesystem such as ext4 or xfs"
    )]
    NoDirectIo { path: String },
    #[error(
        "{path}: not enough free space: the store needs {needed} more bytes ({:.2} GiB), the \
         filesystem has {available} bytes ({:.2} GiB) free",
        *needed as f64 / GIB, *available as f64 / GIB
    )]
    NoSpace {
        path: String,
        needed: u64,
        available: u64,
    },
    #[error(
        "{path}: disk full while writing record {record} of {total}; free space and rerun \
         pack-store, it resumes from the last synced record"
    )]
    DiskFull {
        path: String,
        record: usize,
        total: usize,
    },
    #[error(
        "store {store} was made from another model: its {which} is {store_fingerprint}, the \
         model's is {model_fingerprint}"
    )]
    FingerprintMismatch {
        store: String,
        /// `"fingerprint"` (full) or `"quick fingerprint"`.
        which: &'static str,
        store_fingerprint: String,
        model_fingerprint: String,
    },
    #[error("{path}: {message}")]
    Manifest { path: String, message: String },
    #[error(
        "{path}: is {found} bytes, the manifest needs {expected} (truncated at record {record}: \
         layer {layer}, expert {expert}, offset {offset})"
    )]
    Truncated {
        path: String,
        found: u64,
        expected: u64,
        record: usize,
        layer: usize,
        expert: usize,
        offset: u64,
    },
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{count} corrupt record(s); first: {first}")]
    Corrupt { count: usize, first: ReadError },
    #[error(
        "record of layer {layer}, expert {expert} (offset {offset}) differs from the source \
         model at byte {byte}"
    )]
    SourceMismatch {
        layer: usize,
        expert: usize,
        offset: u64,
        byte: usize,
    },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{0}")]
    Other(String),
}

impl From<CheckpointError> for StoreError {
    fn from(e: CheckpointError) -> StoreError {
        StoreError::Load(LoadError::Checkpoint(e))
    }
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
