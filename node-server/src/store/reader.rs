//! [`StoreReader`]: records of `experts.bin` by (layer, expert).
//!
//! Reads are O_DIRECT, one request per record, through io_uring with registered buffers
//! (or a pread pool where io_uring is refused). Concurrent requests for one record share a
//! single read: the first caller (the leader) submits it and finishes it, everyone else
//! waits for the leader's result. A read that fails, comes back short, or whose sha256
//! differs from the manifest fails with a [`ReadError`] naming layer, expert and offset.
//!
//! Checksums: [`ChecksumPolicy::Always`] (the default) checks every record read, against its
//! CRC-32C ([`RecordCheck::Fast`], the default) or its sha256 ([`RecordCheck::Full`], what
//! `verify-store` runs; also the check of a store packed before records carried a CRC).
//! On one core of the development VM (Intel Xeon with SHA-NI and SSE 4.2) sha256 hashes
//! 1.1-1.2 GB/s and CRC-32C 10-11 GB/s (the example `store_bench` measures both), paid by
//! the callers, not the I/O thread: `read_many` checks its records on the rayon pool.
//! `Sample(n)` checks one read in `n`, `Never` none; truncation and I/O errors are caught
//! whatever the policy.

use super::aligned::{AlignedBuf, IoBuf};
use super::io::{DirectOpenError, Engine, PreadEngine, ReadRequest, UringEngine, open_direct};
use super::manifest::{DATA, Manifest, Parts, sha256_hex};
use super::{StoreError, aligned::BufPool};
use rayon::prelude::*;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// io_uring, or the pread pool when io_uring setup is refused.
    Auto,
    Uring,
    Pread,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChecksumPolicy {
    /// Every read is hashed and compared with the manifest.
    Always,
    /// One read in `n` (counted over all reads of this reader) is checked.
    Sample(u64),
    Never,
}

/// The digest a checked read compares with the manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordCheck {
    /// The record's CRC-32C where the manifest has one, else its sha256. A CRC catches what
    /// a read check is for (a flipped bit, a torn or misplaced block) and costs a tenth.
    Fast,
    /// The sha256, and the CRC-32C too where the manifest has one (`verify-store`: the
    /// store against what `pack-store` wrote, every digest).
    Full,
}

#[derive(Clone, Debug)]
pub struct ReaderOptions {
    pub engine: EngineChoice,
    /// io_uring entries; also the most reads the ring keeps in flight.
    pub queue_depth: usize,
    /// Record-sized buffers registered with io_uring (READ_FIXED); reads beyond them get a
    /// buffer of their own. Records handed out keep their buffer until dropped.
    pub registered_buffers: usize,
    /// Threads of the pread engine.
    pub pread_threads: usize,
    pub checksum: ChecksumPolicy,
    /// Which digest a checked read compares.
    pub check: RecordCheck,
    /// Test hook: reads of this (layer, expert) fail with an injected EIO.
    #[doc(hidden)]
    pub fail_record: Option<(usize, usize)>,
    /// Test hook: io_uring setup fails with EPERM, as under a seccomp profile that blocks it.
    #[doc(hidden)]
    pub refuse_uring: bool,
}

impl Default for ReaderOptions {
    fn default() -> ReaderOptions {
        ReaderOptions {
            engine: EngineChoice::Auto,
            queue_depth: 32,
            registered_buffers: 32,
            pread_threads: 8,
            checksum: ChecksumPolicy::Always,
            check: RecordCheck::Fast,
            fail_record: None,
            refuse_uring: false,
        }
    }
}

/// Why reading one record failed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("record of layer {layer}, expert {expert} at offset {offset}: {kind}")]
pub struct ReadError {
    pub layer: usize,
    pub expert: usize,
    pub offset: u64,
    pub kind: ReadErrorKind,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadErrorKind {
    #[error("read failed: {0}")]
    Io(String),
    #[error("truncated: read {got} of {want} bytes")]
    Truncated { got: usize, want: usize },
    #[error("corrupt: {digest} is {found}, the manifest says {expected}")]
    Checksum {
        /// `sha256` or `crc32c`.
        digest: &'static str,
        expected: String,
        found: String,
    },
    #[error("no such record in this store")]
    NoSuchRecord,
}

/// One record read from the store.
pub struct RecordBuf {
    buf: IoBuf,
    layer: usize,
    expert: usize,
    length: usize,
    parts: Arc<Parts>,
}

impl std::fmt::Debug for RecordBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RecordBuf(layer {}, expert {}, {} bytes)",
            self.layer, self.expert, self.length
        )
    }
}

impl RecordBuf {
    pub fn layer(&self) -> usize {
        self.layer
    }

    pub fn expert(&self) -> usize {
        self.expert
    }

    /// The record without its padding: gate | up | down.
    pub fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[..self.length]
    }

    /// Where gate, up and down sit in the record, and their formats and shapes.
    pub fn layout(&self) -> &Parts {
        &self.parts
    }
}

type Outcome = Result<Arc<RecordBuf>, ReadError>;

enum State {
    Pending,
    Raw(IoBuf, std::io::Result<usize>),
    Taken,
    Done(Outcome),
}

/// What a key of a submitted window does: read its record (and share the read), wait for a
/// read already in flight, or fail at once.
enum Role {
    Leader(usize, Arc<Shared>),
    Follower(Arc<Shared>),
    Failed(ReadError),
}

/// One record's read in flight, shared by everyone who asked for it.
struct Shared {
    state: Mutex<State>,
    ready: Condvar,
}

impl Shared {
    fn wait(&self, until: impl Fn(&State) -> bool) -> std::sync::MutexGuard<'_, State> {
        let mut state = self.state.lock().expect("record state");
        while !until(&state) {
            state = self.ready.wait(state).expect("record state");
        }
        state
    }
}

pub struct StoreReader {
    dir: PathBuf,
    manifest: Arc<Manifest>,
    /// Each MoE layer's record layout.
    layouts: HashMap<usize, Arc<Parts>>,
    engine: Box<dyn Engine>,
    in_flight: Mutex<HashMap<usize, Arc<Shared>>>,
    reads: AtomicU64,
    issued: AtomicU64,
    opts: ReaderOptions,
}

impl std::fmt::Debug for StoreReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreReader")
            .field("dir", &self.dir)
            .field("engine", &self.engine.name())
            .field("records", &self.manifest.records.len())
            .finish()
    }
}

impl StoreReader {
    /// Opens the store in `dir`. With `expected_fingerprint`, refuses a store whose
    /// manifest carries neither that full nor that quick fingerprint. Refuses a data file
    /// shorter than the manifest says, naming the first record it cuts.
    pub fn open(
        dir: &Path,
        expected_fingerprint: Option<&str>,
        opts: ReaderOptions,
    ) -> Result<StoreReader, StoreError> {
        let manifest = Manifest::load(dir)?;
        if let Some(expected) = expected_fingerprint
            && expected != manifest.fingerprint
            && expected != manifest.quick_fingerprint
        {
            return Err(StoreError::FingerprintMismatch {
                which: "fingerprint",
                store: dir.display().to_string(),
                store_fingerprint: manifest.fingerprint.clone(),
                model_fingerprint: expected.to_string(),
            });
        }
        let path = dir.join(DATA);
        let file = open_direct(&path, false).map_err(|e| match e {
            DirectOpenError::Unsupported => StoreError::NoDirectIo {
                path: path.display().to_string(),
            },
            DirectOpenError::Io(source) => StoreError::Io {
                path: path.display().to_string(),
                source,
            },
        })?;
        let found = file
            .metadata()
            .map_err(|source| StoreError::Io {
                path: path.display().to_string(),
                source,
            })?
            .len();
        check_length(&manifest, &path, found)?;
        let file = Arc::new(file);
        let engine = make_engine(&file, &manifest, &opts)?;
        let without_crc = manifest
            .records
            .iter()
            .filter(|r| r.crc32c.is_none())
            .count();
        tracing::info!(
            engine = engine.name(),
            queue_depth = opts.queue_depth,
            store = %dir.display(),
            records = manifest.records.len(),
            "expert store opened"
        );
        if without_crc > 0
            && opts.checksum != ChecksumPolicy::Never
            && opts.check == RecordCheck::Fast
        {
            tracing::warn!(
                records = without_crc,
                "records without a CRC-32C (packed by an older glmflash): their reads check sha256, about ten times the CPU; run pack-store on the store again to add the CRCs"
            );
        }
        Ok(StoreReader {
            dir: dir.to_path_buf(),
            layouts: manifest
                .layers
                .iter()
                .map(|&l| (l, Arc::new(manifest.parts_of(l).clone())))
                .collect(),
            manifest: Arc::new(manifest),
            engine,
            in_flight: Mutex::new(HashMap::new()),
            reads: AtomicU64::new(0),
            issued: AtomicU64::new(0),
            opts,
        })
    }

    /// `"io_uring"` or `"pread"`.
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Whether reads go into buffers registered with io_uring (READ_FIXED).
    pub fn fixed_buffers(&self) -> bool {
        self.engine.pool().is_some()
    }

    /// Reads sent to the engine so far (shared reads count once).
    pub fn reads_issued(&self) -> u64 {
        self.issued.load(Ordering::Relaxed)
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Reads one record (blocking), sharing a read already in flight for it.
    pub fn read(&self, layer: usize, expert: usize) -> Result<Arc<RecordBuf>, ReadError> {
        self.read_many(&[(layer, expert)])
            .pop()
            .expect("one result per key")
    }

    /// Reads many records with one submission; results in the order of `keys`. Each
    /// record fails or succeeds on its own.
    pub fn read_many(&self, keys: &[(usize, usize)]) -> Vec<Result<Arc<RecordBuf>, ReadError>> {
        let out: Vec<Mutex<Option<Outcome>>> = (0..keys.len()).map(|_| Mutex::new(None)).collect();
        self.read_each(keys, &|i, outcome| {
            *out[i].lock().expect("result slot") = Some(outcome);
        });
        out.into_iter()
            .map(|o| {
                o.into_inner()
                    .expect("result slot")
                    .expect("every key answered")
            })
            .collect()
    }

    /// Reads many records and hands each to `deliver` (with its index in `keys`) as soon as it
    /// is read and checked, on the current rayon pool's threads: what a caller does with a
    /// record (decode it, start computing with it) overlaps the reads still in flight. Every
    /// key is delivered exactly once, before this returns; a key given twice is read once and
    /// delivered at both indices.
    ///
    /// The keys go to the engine in windows of half its registered buffers (else of half its
    /// queue depth), the next window submitted before the last one's records are delivered: a
    /// record let go once delivered gives its buffer back to the window after next, and the
    /// disk always has a window to read while the callers check and decode the one before.
    /// Submitted at once, reads past the registered buffers each took a fresh allocation that
    /// the read then faulted in, page by page: a layer's batch of misses read at 0.55-0.7 of
    /// the windowed rate (`examples/store_bench.rs`, session 26).
    pub fn read_each(
        &self,
        keys: &[(usize, usize)],
        deliver: &(dyn Fn(usize, Result<Arc<RecordBuf>, ReadError>) + Sync),
    ) {
        let buffers = match self.engine.pool() {
            Some(_) => self.opts.registered_buffers,
            None => self.opts.queue_depth,
        };
        let window = (buffers / 2).max(1);
        // A key asked twice is read once: its record goes to every index that asked (windows
        // end their reads, so a repeat in a later window would read it again).
        let mut unique: Vec<(usize, usize)> = Vec::with_capacity(keys.len());
        let mut asked: Vec<Vec<usize>> = Vec::with_capacity(keys.len());
        let mut first: HashMap<(usize, usize), usize> = HashMap::with_capacity(keys.len());
        for (i, &key) in keys.iter().enumerate() {
            match first.get(&key) {
                Some(&u) => asked[u].push(i),
                None => {
                    first.insert(key, unique.len());
                    unique.push(key);
                    asked.push(vec![i]);
                }
            }
        }
        let deliver_all = |base: usize| {
            let asked = &asked;
            move |u: usize, r: Result<Arc<RecordBuf>, ReadError>| {
                for &i in &asked[base + u] {
                    deliver(i, r.clone());
                }
            }
        };
        let mut pending: Option<(usize, Vec<Role>)> = None;
        for (w, chunk) in unique.chunks(window).enumerate() {
            let submitted = self.submit_window(chunk);
            if let Some((base, roles)) = pending.take() {
                self.deliver_window(roles, &deliver_all(base));
            }
            pending = Some((w * window, submitted));
        }
        if let Some((base, roles)) = pending {
            self.deliver_window(roles, &deliver_all(base));
        }
    }

    /// Submits the reads of one window of [`StoreReader::read_each`] in one submission: each
    /// key's role, in order (a key already in flight follows that read).
    fn submit_window(&self, keys: &[(usize, usize)]) -> Vec<Role> {
        let mut roles = Vec::with_capacity(keys.len());
        let mut requests = Vec::new();
        {
            let mut in_flight = self.in_flight.lock().expect("in-flight map");
            for &(layer, expert) in keys {
                let Some(index) = self.manifest.index(layer, expert) else {
                    roles.push(Role::Failed(ReadError {
                        layer,
                        expert,
                        offset: 0,
                        kind: ReadErrorKind::NoSuchRecord,
                    }));
                    continue;
                };
                if let Some(shared) = in_flight.get(&index) {
                    roles.push(Role::Follower(Arc::clone(shared)));
                    continue;
                }
                let shared = Arc::new(Shared {
                    state: Mutex::new(State::Pending),
                    ready: Condvar::new(),
                });
                in_flight.insert(index, Arc::clone(&shared));
                let signal = Arc::clone(&shared);
                requests.push(ReadRequest {
                    offset: self.manifest.records[index].offset,
                    buf: self.buffer(),
                    done: Box::new(move |buf, result| {
                        *signal.state.lock().expect("record state") = State::Raw(buf, result);
                        signal.ready.notify_all();
                    }),
                });
                roles.push(Role::Leader(index, shared));
            }
        }
        self.issued
            .fetch_add(requests.len() as u64, Ordering::Relaxed);
        self.engine.submit(requests);
        roles
    }

    /// Waits for a submitted window's reads and delivers each (by its index in the window).
    fn deliver_window(
        &self,
        roles: Vec<Role>,
        deliver: &(dyn Fn(usize, Result<Arc<RecordBuf>, ReadError>) + Sync),
    ) {
        // Leaders first (checked, and delivered, on all cores): a follower may be waiting on
        // a leader in this very window.
        let leaders: Vec<(usize, usize, &Arc<Shared>)> = roles
            .iter()
            .enumerate()
            .filter_map(|(i, role)| match role {
                Role::Leader(index, shared) => Some((i, *index, shared)),
                _ => None,
            })
            .collect();
        let finish = |(i, index, shared): (usize, usize, &Arc<Shared>)| {
            deliver(i, self.finish(index, shared));
        };
        if leaders.len() > 1 {
            leaders.into_par_iter().for_each(finish);
        } else {
            leaders.into_iter().for_each(finish);
        }
        for (i, role) in roles.into_iter().enumerate() {
            match role {
                Role::Leader(..) => {}
                Role::Failed(e) => deliver(i, Err(e)),
                Role::Follower(shared) => {
                    let state = shared.wait(|s| matches!(s, State::Done(_)));
                    if let State::Done(outcome) = &*state {
                        deliver(i, outcome.clone());
                    }
                }
            }
        }
    }

    fn buffer(&self) -> IoBuf {
        self.engine
            .pool()
            .and_then(|p| p.lease())
            .map(IoBuf::Fixed)
            .unwrap_or_else(|| IoBuf::Owned(AlignedBuf::new(self.manifest.record_size)))
    }

    /// The leader's part: wait for the I/O, check it, publish the outcome to followers.
    fn finish(&self, index: usize, shared: &Shared) -> Outcome {
        let raw = {
            let mut state = shared.wait(|s| matches!(s, State::Raw(..)));
            std::mem::replace(&mut *state, State::Taken)
        };
        let State::Raw(buf, result) = raw else {
            unreachable!("waited for Raw")
        };
        let outcome = self.check(index, buf, result);
        *shared.state.lock().expect("record state") = State::Done(outcome.clone());
        self.in_flight.lock().expect("in-flight map").remove(&index);
        shared.ready.notify_all();
        outcome
    }

    fn check(&self, index: usize, buf: IoBuf, result: std::io::Result<usize>) -> Outcome {
        let entry = &self.manifest.records[index];
        let fail = |kind| ReadError {
            layer: entry.layer,
            expert: entry.expert,
            offset: entry.offset,
            kind,
        };
        if self.opts.fail_record == Some((entry.layer, entry.expert)) {
            return Err(fail(ReadErrorKind::Io("injected read error (EIO)".into())));
        }
        let got = result.map_err(|e| fail(ReadErrorKind::Io(e.to_string())))?;
        let want = self.manifest.record_size;
        if got < want {
            return Err(fail(ReadErrorKind::Truncated { got, want }));
        }
        let n = self.reads.fetch_add(1, Ordering::Relaxed);
        let verify = match self.opts.checksum {
            ChecksumPolicy::Always => true,
            ChecksumPolicy::Sample(every) => n.is_multiple_of(every.max(1)),
            ChecksumPolicy::Never => false,
        };
        if verify {
            let bytes = &buf.as_slice()[..entry.length];
            if let Some(expected) = entry.crc32c {
                let found = super::manifest::crc32c(bytes);
                if found != expected {
                    return Err(fail(ReadErrorKind::Checksum {
                        digest: "crc32c",
                        expected: format!("{expected:08x}"),
                        found: format!("{found:08x}"),
                    }));
                }
            }
            if entry.crc32c.is_none() || self.opts.check == RecordCheck::Full {
                let found = sha256_hex(bytes);
                if found != entry.sha256 {
                    return Err(fail(ReadErrorKind::Checksum {
                        digest: "sha256",
                        expected: entry.sha256.clone(),
                        found,
                    }));
                }
            }
        }
        Ok(Arc::new(RecordBuf {
            buf,
            layer: entry.layer,
            expert: entry.expert,
            length: entry.length,
            parts: Arc::clone(&self.layouts[&entry.layer]),
        }))
    }
}

/// Refuses a data file shorter than the manifest, naming the first record it cuts.
pub(super) fn check_length(m: &Manifest, path: &Path, found: u64) -> Result<(), StoreError> {
    let expected = m.data_bytes();
    if found >= expected {
        return Ok(());
    }
    let record = (found / m.record_size as u64) as usize;
    let r = &m.records[record];
    Err(StoreError::Truncated {
        path: path.display().to_string(),
        found,
        expected,
        record,
        layer: r.layer,
        expert: r.expert,
        offset: r.offset,
    })
}

fn make_engine(
    file: &Arc<File>,
    manifest: &Manifest,
    opts: &ReaderOptions,
) -> Result<Box<dyn Engine>, StoreError> {
    let pread =
        || -> Box<dyn Engine> { Box::new(PreadEngine::new(Arc::clone(file), opts.pread_threads)) };
    if opts.engine == EngineChoice::Pread {
        return Ok(pread());
    }
    let pool = (opts.registered_buffers > 0)
        .then(|| BufPool::new(manifest.record_size, opts.registered_buffers));
    let uring = if opts.refuse_uring {
        Err(std::io::Error::from_raw_os_error(libc::EPERM))
    } else {
        UringEngine::new(Arc::clone(file), opts.queue_depth, pool)
    };
    match uring {
        Ok(engine) => Ok(Box::new(engine)),
        Err(e) if opts.engine == EngineChoice::Uring => Err(StoreError::Other(format!(
            "io_uring setup refused ({e}) and the uring engine was asked for"
        ))),
        Err(e) => {
            tracing::warn!(error = %e, "io_uring setup refused; reading the store with a pread thread pool");
            Ok(pread())
        }
    }
}
