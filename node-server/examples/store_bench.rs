//! Store read throughput: io_uring vs pread at queue depth 1, 8 and 32, the cost of the reads'
//! checks (CRC-32C, and sha256 as well: `verify-store`'s) and of each digest on one core,
//! and `fio` on the same file when it is installed.
//!
//! `cargo run --release -p glmflash-node --example store_bench -- [DIR] [GIB]` builds a
//! synthetic store of about GIB GiB (default 1) of 3 MiB records (bf16 gate/up 512x1024,
//! down 1024x512) in DIR (default: a temporary directory under /tmp), then reads every
//! record once in a shuffled order per configuration. Reads bypass the page cache (O_DIRECT),
//! so the numbers are the disk's. `... -- DIR GIB batch [ROUNDS]` times only the fetch thread's
//! way (one batch, each record decoded where it was checked) against chunks of 32.

use glmflash_node::quant::Format;
use glmflash_node::store::{
    self, ALIGN, ChecksumPolicy, EngineChoice, Manifest, Part, PartFormat, Parts, ReaderOptions,
    RecordCheck, RecordEntry, StoreReader,
};
use glmflash_node::tiers::source::expert_from_record;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tmp;
    let dir = match args.first() {
        Some(d) => Path::new(d).to_path_buf(),
        None => {
            tmp = tempfile::tempdir_in("/tmp")?;
            tmp.path().to_path_buf()
        }
    };
    let gib: f64 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(1.0);
    // `batch [ROUNDS]`: only the fetch thread's way against chunks, in ROUNDS turns (default 2).
    let only_batch = args.get(2).is_some_and(|a| a == "batch");
    let rounds: usize = match only_batch {
        true => args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(2),
        false => 2,
    };
    let m = build_store(&dir, gib)?;
    let total = m.data_bytes() as f64;
    println!(
        "store: {} records x {} bytes = {:.2} GiB in {}",
        m.records.len(),
        m.record_size,
        total / (1u64 << 30) as f64,
        dir.display()
    );

    let mut order: Vec<(usize, usize)> = m.records.iter().map(|r| (r.layer, r.expert)).collect();
    let mut state = 0x9e3779b97f4a7c15u64;
    for i in (1..order.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    // One untimed pass first, so every configuration meets the same host-side caches.
    let warm = StoreReader::open(&dir, None, ReaderOptions::default())?;
    for chunk in order.chunks(32) {
        for r in warm.read_many(chunk) {
            r?;
        }
    }
    drop(warm);
    println!("engine    qd  checksum  GB/s");
    for qd in [1, 8, 32].into_iter().filter(|_| !only_batch) {
        for (engine, name) in [
            (EngineChoice::Uring, "io_uring"),
            (EngineChoice::Pread, "pread"),
        ] {
            for (checksum, check) in [
                (ChecksumPolicy::Never, RecordCheck::Fast),
                (ChecksumPolicy::Always, RecordCheck::Fast),
                (ChecksumPolicy::Always, RecordCheck::Full),
            ] {
                if checksum == ChecksumPolicy::Always && qd != 32 {
                    continue;
                }
                let reader = StoreReader::open(
                    &dir,
                    None,
                    ReaderOptions {
                        engine,
                        queue_depth: qd,
                        registered_buffers: qd,
                        pread_threads: qd,
                        checksum,
                        check,
                        ..ReaderOptions::default()
                    },
                )?;
                assert_eq!(reader.engine_name(), name);
                let started = Instant::now();
                for chunk in order.chunks(qd) {
                    for r in reader.read_many(chunk) {
                        r?;
                    }
                }
                let s = started.elapsed().as_secs_f64();
                println!(
                    "{name:9} {qd:3}  {:8}  {:.2}",
                    match (checksum, check) {
                        (ChecksumPolicy::Never, _) => "off",
                        (_, RecordCheck::Fast) => "crc32c",
                        (_, RecordCheck::Full) => "both",
                    },
                    total / s / 1e9
                );
            }
        }
    }

    // The tiers' fetch thread hands the reader a layer's misses in one batch, beyond the 32
    // registered buffers (the rest read into buffers of their own), against the chunks of 32
    // above; each way twice, in turns.
    for round in 0..rounds {
        for whole in [false, true] {
            let reader = StoreReader::open(&dir, None, ReaderOptions::default())?;
            let started = Instant::now();
            if whole {
                // As the fetch thread reads: each record decoded into an expert (its bytes
                // copied out) where it was checked, then let go.
                let failed = std::sync::atomic::AtomicBool::new(false);
                reader.read_each(&order, &|_, r| {
                    let decoded = r
                        .map_err(anyhow::Error::from)
                        .and_then(|r| expert_from_record(&r, 7.0));
                    if decoded.is_err() {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                });
                anyhow::ensure!(!failed.into_inner(), "a read failed");
            } else {
                for chunk in order.chunks(32) {
                    for r in reader.read_many(chunk) {
                        r?;
                    }
                }
            }
            println!(
                "io_uring   32  crc32c  {:.2}  ({}, round {})",
                total / started.elapsed().as_secs_f64() / 1e9,
                if whole {
                    format!("one batch of {}", order.len())
                } else {
                    "chunks of 32".into()
                },
                round + 1
            );
        }
    }

    if only_batch {
        return Ok(());
    }
    let buf = vec![7u8; 64 << 20];
    let rounds = 4;
    for name in ["sha256", "crc32c"] {
        let started = Instant::now();
        for _ in 0..rounds {
            if name == "sha256" {
                std::hint::black_box(Sha256::digest(&buf));
            } else {
                std::hint::black_box(store::crc32c(&buf));
            }
        }
        let ns_per_mib = started.elapsed().as_nanos() as f64 / (rounds * 64) as f64;
        println!(
            "{name} on one core: {:.0} ns/MiB ({:.2} GB/s)",
            ns_per_mib,
            1048576.0 / ns_per_mib
        );
    }

    fio(&dir.join(store::DATA), m.record_size, total as u64);
    Ok(())
}

/// Writes random records and their manifest (the reader needs only these two files).
fn build_store(dir: &Path, gib: f64) -> anyhow::Result<Manifest> {
    let (rows, cols) = (512, 1024);
    let len = rows * cols * 2;
    let part = |offset, rows, cols| Part {
        format: PartFormat::Rows(Format::Bf16),
        rows,
        cols,
        offset,
        length: len,
    };
    let parts = Parts {
        gate: part(0, rows, cols),
        up: part(len, rows, cols),
        down: part(2 * len, cols, rows),
    };
    let record_size = (parts.length()).div_ceil(ALIGN) * ALIGN;
    let experts = 64;
    let n = ((gib * (1u64 << 30) as f64) / record_size as f64).ceil() as usize;
    let layers: Vec<usize> = (0..n.div_ceil(experts)).collect();
    std::fs::create_dir_all(dir)?;
    let mut file = std::io::BufWriter::new(std::fs::File::create(dir.join(store::DATA))?);
    let mut records = Vec::new();
    let mut state = 1u64;
    let mut record = vec![0u8; record_size];
    for (i, (l, e)) in layers
        .iter()
        .flat_map(|&l| (0..experts).map(move |e| (l, e)))
        .enumerate()
    {
        for chunk in record[..parts.length()].chunks_exact_mut(8) {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            chunk.copy_from_slice(&state.to_le_bytes());
        }
        file.write_all(&record)?;
        records.push(RecordEntry {
            layer: l,
            expert: e,
            offset: (i * record_size) as u64,
            length: parts.length(),
            sha256: hex(&Sha256::digest(&record[..parts.length()])),
            crc32c: Some(store::crc32c(&record[..parts.length()])),
        });
    }
    file.into_inner()?.sync_all()?;
    let m = Manifest {
        format_version: 1,
        fingerprint: "synthetic".into(),
        quick_fingerprint: "synthetic".into(),
        record_size,
        alignment: ALIGN,
        experts_per_layer: experts,
        layers,
        layer_parts: Default::default(),
        parts,
        records,
    };
    std::fs::write(dir.join(store::MANIFEST), serde_json::to_vec(&m)?)?;
    Ok(m)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn fio(file: &Path, block: usize, size: u64) {
    if std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("fio: not installed (apt-get install -y fio)");
        return;
    }
    for qd in [1, 8, 32] {
        let out = std::process::Command::new("fio")
            .args([
                "--name=store",
                "--rw=randread",
                "--direct=1",
                "--ioengine=io_uring",
                "--output-format=json",
                &format!("--bs={block}"),
                &format!("--iodepth={qd}"),
                &format!("--size={size}"),
                "--io_size",
                &size.to_string(),
            ])
            .arg(format!("--filename={}", file.display()))
            .output();
        let bw = out
            .ok()
            .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
            .and_then(|j| j["jobs"][0]["read"]["bw_bytes"].as_f64());
        match bw {
            Some(bw) => println!(
                "fio io_uring randread bs={block} qd {qd:2}: {:.2} GB/s",
                bw / 1e9
            ),
            None => println!("fio qd {qd}: no result"),
        }
    }
}
