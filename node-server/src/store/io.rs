//! Read engines behind one trait: io_uring (batched submissions, registered buffers,
//! `READ_FIXED`) and a pread thread pool for kernels or sandboxes that refuse io_uring.
//!
//! Both take requests from a channel and answer each through its own callback, so requests
//! from many threads share the queue depth. The uring engine owns its ring on one thread:
//! it drains the channel up to the queue depth, submits everything it took with one
//! `io_uring_enter`, then reaps completions.
#![allow(unsafe_code)]

use super::aligned::{BufPool, IoBuf};
use io_uring::{IoUring, opcode, types};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// How an O_DIRECT open failed.
#[derive(Debug)]
pub enum DirectOpenError {
    /// The filesystem refuses O_DIRECT (EINVAL on open, e.g. ramfs or old tmpfs).
    Unsupported,
    Io(io::Error),
}

/// Opens `path` with O_DIRECT, for reading, or for writing (created if missing, never
/// truncated).
pub fn open_direct(path: &Path, write: bool) -> Result<File, DirectOpenError> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true).custom_flags(libc::O_DIRECT);
    if write {
        options.write(true).create(true);
    }
    options.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::EINVAL) {
            DirectOpenError::Unsupported
        } else {
            DirectOpenError::Io(e)
        }
    })
}

/// Called once with the buffer and the bytes read (or the error).
pub type Done = Box<dyn FnOnce(IoBuf, io::Result<usize>) + Send>;

/// One read of `buf`'s full length at `offset` (both 4 KiB multiples).
pub struct ReadRequest {
    pub offset: u64,
    pub buf: IoBuf,
    pub done: Done,
}

pub trait Engine: Send + Sync {
    /// `"io_uring"` or `"pread"`.
    fn name(&self) -> &'static str;
    /// Queues `requests` as one batch; each callback runs on an engine thread.
    fn submit(&self, requests: Vec<ReadRequest>);
    /// The registered buffer pool, if this engine reads into one.
    fn pool(&self) -> Option<&Arc<BufPool>>;
}

/// Reads with `pread(2)` on `threads` threads.
pub struct PreadEngine {
    tx: Mutex<Option<Sender<ReadRequest>>>,
    workers: Vec<JoinHandle<()>>,
}

impl PreadEngine {
    pub fn new(file: Arc<File>, threads: usize) -> PreadEngine {
        let (tx, rx) = channel::<ReadRequest>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..threads.max(1))
            .map(|i| {
                let (rx, file) = (Arc::clone(&rx), Arc::clone(&file));
                std::thread::Builder::new()
                    .name(format!("store-pread-{i}"))
                    .spawn(move || {
                        loop {
                            let next = rx.lock().expect("pread queue").recv();
                            let Ok(mut req) = next else { return };
                            let result = read_full(&file, req.buf.as_mut_slice(), req.offset);
                            (req.done)(req.buf, result);
                        }
                    })
                    .expect("spawning a pread thread")
            })
            .collect();
        PreadEngine {
            tx: Mutex::new(Some(tx)),
            workers,
        }
    }
}

/// Reads until `buf` is full or end of file; returns the bytes read.
fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl Engine for PreadEngine {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn submit(&self, requests: Vec<ReadRequest>) {
        let tx = self.tx.lock().expect("pread sender");
        let tx = tx.as_ref().expect("engine is running");
        for r in requests {
            tx.send(r).expect("pread workers are running");
        }
    }

    fn pool(&self) -> Option<&Arc<BufPool>> {
        None
    }
}

impl Drop for PreadEngine {
    fn drop(&mut self) {
        self.tx.lock().expect("pread sender").take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Reads through one io_uring owned by a dedicated thread.
pub struct UringEngine {
    tx: Mutex<Option<Sender<Vec<ReadRequest>>>>,
    worker: Option<JoinHandle<()>>,
    pool: Option<Arc<BufPool>>,
}

impl UringEngine {
    /// Sets up a ring of `queue_depth` entries and registers `pool`'s slots; fails when the
    /// kernel refuses io_uring (old kernel, seccomp, `io_uring_disabled`). A refused buffer
    /// registration (e.g. RLIMIT_MEMLOCK) keeps the ring and reads without fixed buffers.
    pub fn new(
        file: Arc<File>,
        queue_depth: usize,
        pool: Option<Arc<BufPool>>,
    ) -> io::Result<UringEngine> {
        let depth = queue_depth.clamp(1, 4096) as u32;
        let ring: IoUring = IoUring::builder().build(depth.next_power_of_two())?;
        let pool = match pool {
            Some(pool) => {
                let iovecs: Vec<libc::iovec> = pool
                    .regions()
                    .into_iter()
                    .map(|(base, len)| libc::iovec {
                        iov_base: base.cast(),
                        iov_len: len,
                    })
                    .collect();
                // SAFETY: the regions stay valid while the ring lives: the worker thread owns
                // both the ring and an `Arc` of the pool, and drops the ring first.
                match unsafe { ring.submitter().register_buffers(&iovecs) } {
                    Ok(()) => Some(pool),
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring refused to register read buffers; reading without READ_FIXED");
                        None
                    }
                }
            }
            None => None,
        };
        let (tx, rx) = channel();
        let worker_pool = pool.clone();
        let worker = std::thread::Builder::new()
            .name("store-uring".into())
            .spawn(move || uring_loop(ring, file, rx, depth as usize, worker_pool))?;
        Ok(UringEngine {
            tx: Mutex::new(Some(tx)),
            worker: Some(worker),
            pool,
        })
    }
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&self, requests: Vec<ReadRequest>) {
        if requests.is_empty() {
            return;
        }
        let tx = self.tx.lock().expect("uring sender");
        tx.as_ref()
            .expect("engine is running")
            .send(requests)
            .expect("uring thread is running");
    }

    fn pool(&self) -> Option<&Arc<BufPool>> {
        self.pool.as_ref()
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.tx.lock().expect("uring sender").take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A read on the ring: its request and how far it got (short reads are resubmitted).
struct InFlight {
    req: ReadRequest,
    done: usize,
}

fn uring_loop(
    mut ring: IoUring,
    file: Arc<File>,
    rx: Receiver<Vec<ReadRequest>>,
    depth: usize,
    _pool: Option<Arc<BufPool>>,
) {
    let fd = types::Fd(file.as_raw_fd());
    let mut waiting: std::collections::VecDeque<ReadRequest> = Default::default();
    let mut slots: Vec<Option<InFlight>> = (0..depth).map(|_| None).collect();
    let mut in_flight = 0usize;
    let mut open = true;
    loop {
        // Take new work: block only when there is nothing else to do.
        if open {
            if in_flight == 0 && waiting.is_empty() {
                match rx.recv() {
                    Ok(batch) => waiting.extend(batch),
                    Err(_) => open = false,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(batch) => waiting.extend(batch),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
        }
        if !open && in_flight == 0 && waiting.is_empty() {
            return;
        }
        // Fill free slots; everything queued here goes out in one submit.
        while in_flight < depth {
            let Some(req) = waiting.pop_front() else {
                break;
            };
            let slot = slots.iter().position(Option::is_none).expect("a free slot");
            let mut f = InFlight { req, done: 0 };
            let entry = sqe(fd, &mut f, slot);
            slots[slot] = Some(f);
            // SAFETY: the buffer behind the entry lives in `slots[slot]` until its completion.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                let f = slots[slot].take().expect("just stored");
                fail(f, io::Error::other("io_uring submission queue full"));
                continue;
            }
            in_flight += 1;
        }
        if in_flight == 0 {
            continue;
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // The ring is unusable: fail everything rather than hang the callers.
            for f in slots.iter_mut().filter_map(Option::take) {
                fail(f, io::Error::new(e.kind(), e.to_string()));
            }
            in_flight = 0;
            continue;
        }
        let completions: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in completions {
            let slot = slot as usize;
            let Some(mut f) = slots[slot].take() else {
                continue;
            };
            in_flight -= 1;
            if res < 0 {
                fail(f, io::Error::from_raw_os_error(-res));
                continue;
            }
            f.done += res as usize;
            let len = f.req.buf.as_slice().len();
            if res == 0 || f.done >= len {
                let done = f.done;
                (f.req.done)(f.req.buf, Ok(done));
                continue;
            }
            // Short read before the end of the buffer: read the rest.
            let entry = sqe(fd, &mut f, slot);
            slots[slot] = Some(f);
            // SAFETY: as above.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                let f = slots[slot].take().expect("just stored");
                fail(f, io::Error::other("io_uring submission queue full"));
            } else {
                in_flight += 1;
            }
        }
    }
}

fn fail(f: InFlight, e: io::Error) {
    (f.req.done)(f.req.buf, Err(e));
}

/// The read entry for the unread rest of `f`'s buffer.
fn sqe(fd: types::Fd, f: &mut InFlight, slot: usize) -> io_uring::squeue::Entry {
    let offset = f.req.offset + f.done as u64;
    let done = f.done;
    match &mut f.req.buf {
        IoBuf::Fixed(lease) => {
            let index = lease.index() as u16;
            let rest = &mut lease.as_mut_slice()[done..];
            opcode::ReadFixed::new(fd, rest.as_mut_ptr(), rest.len() as u32, index)
                .offset(offset)
                .build()
                .user_data(slot as u64)
        }
        IoBuf::Owned(buf) => {
            let rest = &mut buf.as_mut_slice()[done..];
            opcode::Read::new(fd, rest.as_mut_ptr(), rest.len() as u32)
                .offset(offset)
                .build()
                .user_data(slot as u64)
        }
    }
}
