//! Single-thread dot-product throughput per weight format, portable vs SIMD.
//!
//! `cargo run --release -p glmflash-node --example quant_bench [-- ROWS COLS]`
//! (default 4096 x 4096). Prints GB/s of weight bytes streamed through
//! `dot_row` (matrix-vector product, one row at a time, best of 20 passes), and
//! `quantize_row` throughput.

use std::time::Instant;

/// Best-of-N timing: robust against other processes on a shared machine.
const PASSES: usize = 20;

use glmflash_node::quant::{Format, cpu_features, dot_row_portable, dot_row_simd, quantize_row};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("ROWS COLS must be integers"))
        .collect();
    let (rows, cols) = match args[..] {
        [r, c] => (r, c),
        [] => (4096, 4096),
        _ => panic!("usage: quant_bench [ROWS COLS]"),
    };
    println!("cpu features: {:?}", cpu_features());
    println!("matrix {rows} x {cols}, single thread, best of {PASSES} passes");
    println!(
        "{:<6} {:>10} {:>14} {:>14} {:>8}",
        "format", "MiB", "portable GB/s", "simd GB/s", "speedup"
    );
    // Cheap deterministic pseudo-Gaussian weights and activations.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
    };
    let x: Vec<f32> = (0..cols).map(|_| next()).collect();
    let w: Vec<f32> = (0..cols).map(|_| next() + next() + next()).collect();
    let mut quant_rates = Vec::new();
    for format in Format::ALL {
        let row_bytes = format.row_bytes(cols).expect("cols fits the block size");
        let mut row = vec![0u8; row_bytes];
        let reps = 16;
        let mut best = f64::INFINITY;
        for _ in 0..PASSES {
            let t = Instant::now();
            for _ in 0..reps {
                quantize_row(format, std::hint::black_box(&w), &mut row).unwrap();
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        quant_rates.push((format.name(), (reps * cols) as f64 / best / 1e6));
        // Distinct rows are not needed for bandwidth; replicate one row.
        let matrix: Vec<u8> = row.iter().copied().cycle().take(row_bytes * rows).collect();
        let total = matrix.len() as f64;
        let run = |f: &dyn Fn(&[u8]) -> f32| -> f64 {
            let mut best = f64::INFINITY;
            let mut sink = 0.0f32;
            for _ in 0..PASSES {
                let t = Instant::now();
                for r in matrix.chunks_exact(row_bytes) {
                    sink += f(r);
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            std::hint::black_box(sink);
            total / best / 1e9
        };
        let portable = run(&|r| dot_row_portable(format, r, &x));
        let simd =
            dot_row_simd(format, &row, &x).map(|_| run(&|r| dot_row_simd(format, r, &x).unwrap()));
        let (s, speedup) = match simd {
            Some(s) => (format!("{s:.2}"), format!("{:.1}x", s / portable)),
            None => ("n/a".into(), "-".into()),
        };
        println!(
            "{:<6} {:>10.1} {:>14.2} {:>14} {:>8}",
            format.name(),
            total / (1 << 20) as f64,
            portable,
            s,
            speedup
        );
    }
    println!("quantize_row throughput (single thread, M input values/s):");
    for (name, rate) in quant_rates {
        println!("  {name:<6} {rate:>10.1}");
    }
}
