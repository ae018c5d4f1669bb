//! Helpers the bench variants share.

use rayon::prelude::*;
use std::path::Path;
use std::time::Instant;

/// Sustained read bandwidth of this machine's memory: all threads summing a 512 MiB buffer
/// of integers (an integer sum vectorises, so the loop is bound by memory, not adds).
pub fn measure_read_bandwidth() -> f64 {
    let len = 128 << 20;
    let buf: Vec<u32> = (0..len as u32).collect();
    let mut best = f64::MAX;
    let mut sink = 0u32;
    for _ in 0..3 {
        let started = Instant::now();
        let sum = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u32, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u32::wrapping_add);
        best = best.min(started.elapsed().as_secs_f64());
        sink = sink.wrapping_add(sum);
    }
    std::hint::black_box(sink);
    (len * 4) as f64 / best
}

/// Each tier's share of `lookups` (device, RAM, store), as the benches report it.
pub fn hit_rates(lookups: &[f64]) -> serde_json::Value {
    let total = lookups.iter().sum::<f64>().max(1.0);
    serde_json::json!({
        "vram": lookups[0] / total,
        "ram": lookups[1] / total,
        "nvme": lookups[2] / total,
    })
}

/// The store's O_DIRECT read rate, bytes a second: `keys`' records read in chunks of 32 (the
/// registered buffers) through the default reader (io_uring at depth), with `checksum`.
pub fn store_read_rate(
    store: &Path,
    keys: &[(usize, usize)],
    checksum: crate::store::ChecksumPolicy,
) -> anyhow::Result<f64> {
    let reader = crate::store::StoreReader::open(
        store,
        None,
        crate::store::ReaderOptions {
            checksum,
            ..Default::default()
        },
    )?;
    let record = reader.manifest().record_size as f64;
    let started = Instant::now();
    for chunk in keys.chunks(32) {
        for r in reader.read_many(chunk) {
            r?;
        }
    }
    Ok(keys.len() as f64 * record / started.elapsed().as_secs_f64())
}

/// Rewrites every router's `e_score_correction_bias` in place: the expert of popularity rank
/// `r` (a fixed shuffle of the ids) gets `-skew * ln(1 + r)`; `skew` 0 zeroes the biases.
pub fn set_router_bias(file: &Path, experts: usize, skew: f32) -> anyhow::Result<()> {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)?;
    let mut header = vec![0u8; u64::from_le_bytes(len) as usize];
    f.read_exact(&mut header)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)?;
    let data_start = 8 + u64::from_le_bytes(len);
    let mut rank: Vec<usize> = (0..experts).collect();
    rank.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(7));
    let bias: Vec<u8> = (0..experts)
        .flat_map(|e| (-skew * (1.0 + rank[e] as f32).ln()).to_le_bytes())
        .collect();
    let mut patched = 0;
    for (name, t) in &header {
        if !name.ends_with("mlp.gate.e_score_correction_bias") {
            continue;
        }
        anyhow::ensure!(t["dtype"] == "F32", "{name} is not F32");
        let start = t["data_offsets"][0].as_u64().unwrap_or(0);
        f.seek(SeekFrom::Start(data_start + start))?;
        f.write_all(&bias)?;
        patched += 1;
    }
    anyhow::ensure!(patched > 0, "no router bias in {}", file.display());
    Ok(())
}
