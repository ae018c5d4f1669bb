//! The per-op check, in the spirit of llama.cpp's `test-backend-ops`: every op of the
//! [`Device`] interface the model's blocks are written over, run on the host (the
//! reference) and on the GPU on the same fresh random inputs, each output (and each state an
//! op advances) compared. Each case is one generic function run on both devices; outputs
//! on the GPU are poisoned (NaN) before each launch, so an unwritten value fails.

use super::*;
use crate::model::device::{CacheDtype, CacheRows, Device, DsaSpec, KdaGates, KdaSpec, MlaSpec};
use crate::model::mla::MlaPath;
use crate::model::moe::{ExpertProvider, Routing};

/// Compares the host's outputs with the GPU's, output by output (named by `labels`).
fn compare(
    cases: &mut Vec<Case>,
    name: &str,
    labels: &[&str],
    want: &[Vec<f32>],
    got: &[Vec<f32>],
    bound: f64,
) {
    for (i, label) in labels.iter().enumerate() {
        let (w, g) = (
            want.get(i).map_or(&[][..], |v| v),
            got.get(i).map_or(&[][..], |v| v),
        );
        cases.push(case(format!("op {name} {label}"), g, w, bound));
    }
}

/// Every op of the interface on both devices.
pub(super) fn check_ops<G: Device>(
    gpu: &G,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    memory_ops(gpu, rng, cases)?;
    products(gpu, rng, wide, cases)?;
    elementwise(gpu, rng, cases)?;
    mhc(gpu, rng, cases)?;
    kda(gpu, rng, cases)?;
    mla(gpu, rng, cases)?;
    dsa(gpu, rng, cases)?;
    routing(gpu, rng, cases)?;
    Ok(())
}

fn memory<D: Device>(d: &D, x: &[f32], width: usize) -> anyhow::Result<Vec<Vec<f32>>> {
    let rows_n = x.len() / width;
    let b = d.upload(x)?;
    let mid = d.rows(&b, 1, rows_n - 2, width)?;
    let mut z = d.zeros(x.len())?;
    d.put_rows(&mut z, 2, width, &mid)?;
    Ok(vec![
        d.download(&b)?,
        d.download(&mid)?,
        d.download(&z)?[..x.len()].to_vec(),
    ])
}

/// A growable buffer of `dtype` made from `x`'s first row, then grown by pushes.
fn grow_push<D: Device>(
    d: &D,
    x: &[f32],
    width: usize,
    dtype: CacheDtype,
) -> anyhow::Result<CacheRows> {
    let rows_n = x.len() / width;
    let b = d.upload(x)?;
    let mut g = d.grow(&CacheRows::from_f32(dtype, &x[..width]), 1)?;
    // Grows past its room twice.
    d.push(&mut g, &b, 0, rows_n, width)?;
    d.push(&mut g, &b, rows_n - 3, 3, width)?;
    d.grow_download(&g)
}

fn memory_ops<G: Device>(
    gpu: &G,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let (rows, width) = (9, 77);
    let x = randn(rng, rows * width, 1.0);
    let (want, got) = (memory(&Host, &x, width)?, memory(gpu, &x, width)?);
    let labels = ["upload", "rows", "zeros+put_rows"];
    for (i, label) in labels.iter().enumerate() {
        cases.push(exact_case(format!("op {label}"), want[i] == got[i]));
    }
    // The GPU rounds pushed rows to the cache dtype bit for bit as the host does.
    for dtype in CacheDtype::ALL {
        let want = grow_push(&Host, &x, width, dtype)?.to_le_bytes();
        let got = grow_push(gpu, &x, width, dtype)?.to_le_bytes();
        let name = format!("op grow+push {}", dtype.name());
        cases.push(exact_case(name, want == got));
    }
    Ok(())
}

fn matmul<D: Device>(d: &D, m: &Matrix, x: &[f32], n: usize) -> anyhow::Result<Vec<Vec<f32>>> {
    let w = d.matrix(m)?;
    let y = d.matmul(&w, &d.upload(x)?, n)?;
    Ok(vec![d.download(&y)?[..n * m.rows()].to_vec()])
}

/// Products of every storage format through `Device::matmul` (matvec kernels for a few
/// rows, cuBLAS for f32 from 9 tokens, widened f16/bf16 tiles from 64).
fn products<G: Device>(
    gpu: &G,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let mut shapes = vec![(37usize, 512usize), (1000, 1536)];
    if wide {
        shapes.push((4096, 2048));
    }
    for format in Format::ALL {
        for &(rows, cols) in &shapes {
            let m = random_matrix(rng, rows, cols, format)?;
            for n in [1usize, 3, 9, 64] {
                let x = randn(rng, n * cols, 1.0);
                let name = format!("matmul {} {rows}x{cols} n={n}", format.name());
                let (want, got) = (matmul(&Host, &m, &x, n)?, matmul(gpu, &m, &x, n)?);
                compare(cases, &name, &["y"], &want, &got, F32_BOUND);
            }
        }
    }
    Ok(())
}

struct Rows {
    x: Vec<f32>,
    g: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    rows: usize,
    width: usize,
}

fn elementwise_on<D: Device>(d: &D, r: &Rows) -> anyhow::Result<Vec<Vec<f32>>> {
    let (rows, width) = (r.rows, r.width);
    let n = rows * width;
    let (x, g, w, b) = (
        d.upload(&r.x)?,
        d.upload(&r.g)?,
        d.upload(&r.w)?,
        d.upload(&r.b)?,
    );
    let mut out = Vec::new();
    let mut y = d.upload(&r.x)?;
    d.rms_norm(&mut y, None, width, 1e-6)?;
    out.push(d.download(&y)?);
    let mut y = d.upload(&r.x)?;
    d.rms_norm(&mut y, Some(&w), width, 1e-6)?;
    out.push(d.download(&y)?);
    let mut y = d.upload(&r.x)?;
    d.layer_norm(&mut y, &w, &b, width, 1e-6, rows)?;
    out.push(d.download(&y)?);
    let mut y = d.upload(&r.x)?;
    d.gated_rms_norm(&mut y, &g, &w, width, 1e-6)?;
    out.push(d.download(&y)?);
    let mut y = d.upload(&r.x)?;
    d.scale(&mut y, 0.37, n)?;
    out.push(d.download(&y)?);
    let mut y = d.upload(&r.x)?;
    d.add(&mut y, &g, n)?;
    out.push(d.download(&y)?);
    out.push(d.download(&d.swiglu(&x, &g, 7.0)?)?);
    // Three [rows, width / 3] parts interleaved per row.
    let c = width / 3;
    let (q, k, v) = (
        d.rows(&x, 0, 1, rows * c)?,
        d.rows(&g, 0, 1, rows * c)?,
        d.rows(&x, 1, 1, rows * c)?,
    );
    out.push(d.download(&d.interleave3(&q, &k, &v, rows, c)?)?);
    // The stream mean of every other row, rows seen as 3 streams of width / 3.
    let picks: Vec<usize> = (0..rows).step_by(2).collect();
    out.push(d.download(&d.stream_mean(&x, &picks, 3, c)?)?);
    // Every row four times (the embedding as the mHC streams).
    out.push(d.download(&d.take_repeated(r.x.clone(), width, 4)?)?);
    Ok(out)
}

fn elementwise<G: Device>(
    gpu: &G,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let labels = [
        "rms_norm",
        "rms_norm weighted",
        "layer_norm",
        "gated_rms_norm",
        "scale",
        "add",
        "swiglu",
        "interleave3",
        "stream_mean",
        "repeat_rows",
    ];
    for (rows, width) in [
        (1usize, 66usize),
        (7, 129),
        (33, 4095),
        (5, 1002),
        (3, 16383),
        (2, 20001),
    ] {
        let r = Rows {
            x: randn(rng, rows * width, 20.0),
            g: randn(rng, rows * width, 20.0),
            w: randn(rng, width, 1.0),
            b: randn(rng, width, 1.0),
            rows,
            width,
        };
        let (want, got) = (elementwise_on(&Host, &r)?, elementwise_on(gpu, &r)?);
        let name = format!("{rows}x{width}");
        compare(cases, &name, &labels, &want, &got, F32_BOUND);
    }
    Ok(())
}

/// mHC's collapse (RMSNorm, projection, weights, collapse) and expand through
/// `HyperConnection`'s generic forward, then three layers chained (identity sublayers).
fn mhc_on<D: Device>(
    d: &D,
    hc: &HyperConnection,
    streams: &[f32],
    y: &[f32],
    tokens: usize,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let hc = hc.place(d)?;
    let s = d.upload(streams)?;
    let mix = hc.collapse(d, &s, tokens)?;
    let expanded = hc.expand(d, &mix, &s, &d.upload(y)?, tokens)?;
    let mut chained = d.upload(streams)?;
    for _ in 0..3 {
        let m = hc.collapse(d, &chained, tokens)?;
        chained = hc.expand(d, &m, &chained, &m.collapsed, tokens)?;
    }
    Ok(vec![
        d.download(&mix.collapsed)?,
        d.download(&mix.post)?,
        d.download(&mix.comb)?,
        d.download(&expanded)?,
        d.download(&chained)?,
    ])
}

fn mhc<G: Device>(gpu: &G, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    for (n, d) in [(4usize, 4096usize), (4, 100), (3, 257)] {
        let cfg = mhc_config(n, d)?;
        let width = (2 + n) * n;
        let proj = random_matrix(rng, width, n * d, Format::F32)?;
        let scale = [0.5 + rng.random::<f32>(), 0.5 + rng.random::<f32>(), 2.0];
        let hc = HyperConnection::new(&cfg, proj, randn(rng, width, 1.0), scale);
        for tokens in [1usize, 5] {
            let streams = randn(rng, tokens * n * d, 2.0);
            let y = randn(rng, tokens * d, 2.0);
            let want = mhc_on(&Host, &hc, &streams, &y, tokens)?;
            let got = mhc_on(gpu, &hc, &streams, &y, tokens)?;
            let labels = ["collapse", "post", "comb", "expand", "3 layers chained"];
            let name = format!("mhc n{n} d{d} T={tokens}");
            compare(cases, &name, &labels, &want, &got, F32_BOUND);
        }
    }
    Ok(())
}

/// KDA inputs of one shape: conv taps and states, and per span the conv input, the gates'
/// pre-activations and the delta rule's inputs.
struct KdaCase {
    spec: KdaSpec,
    gates: KdaGates,
    taps: Vec<f32>,
    conv: Vec<f32>,
    state: Vec<f32>,
    dt_bias: Vec<f32>,
    a_log: Vec<f32>,
    /// Per span: (qkv, g pre-activation, beta pre-activation, mixed, log decay, beta).
    spans: Vec<[Vec<f32>; 6]>,
    mode: KdaMode,
}

/// The gates over all spans' rows, then per span the conv and the delta rule continuing the
/// states kept on the device; every span's outputs and both states after it.
fn kda_on<D: Device>(d: &D, k: &KdaCase) -> anyhow::Result<Vec<Vec<f32>>> {
    let (c, h) = (k.spec.channels(), k.spec.heads);
    let (taps, dt, al) = (
        d.upload(&k.taps)?,
        d.upload(&k.dt_bias)?,
        d.upload(&k.a_log)?,
    );
    let mut conv = d.upload(&k.conv)?;
    let mut state = d.upload(&k.state)?;
    let mut out = Vec::new();
    for [qkv, g_pre, b_pre, mixed, g, beta] in &k.spans {
        let len = beta.len() / h;
        let (mut gg, mut bb) = (d.upload(g_pre)?, d.upload(b_pre)?);
        d.kda_gates(k.gates, &mut gg, &dt, &al, &mut bb, len)?;
        out.push(d.download(&gg)?);
        out.push(d.download(&bb)?);
        // Rows 1.. of a buffer with one leading row: a sequence's share of a batch.
        let lead = |v: &[f32], w: usize| -> anyhow::Result<D::Buf> {
            let mut padded = vec![0.5f32; w];
            padded.extend_from_slice(v);
            d.upload(&padded)
        };
        let mixed_conv = d.kda_conv(k.spec, &taps, &lead(qkv, 3 * c)?, 1, len, &mut conv)?;
        out.push(d.download(&mixed_conv)?);
        out.push(d.download(&conv)?[..k.conv.len()].to_vec());
        let o = d.kda_delta(
            k.spec,
            k.mode,
            &d.upload(mixed)?,
            &lead(g, c)?,
            &lead(beta, h)?,
            1,
            len,
            &mut state,
        )?;
        out.push(d.download(&o)?);
        out.push(d.download(&state)?);
    }
    Ok(out)
}

fn kda<G: Device>(gpu: &G, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    let modes = [
        (KdaMode::Recurrent, vec![1usize, 1, 7, 1, 130]),
        (KdaMode::Auto, vec![150, 1, 15, 16, 17, 1000]),
    ];
    for (heads, dh, kernel) in [(32usize, 128usize, 4usize), (3, 40, 4), (2, 16, 3)] {
        for (mode, lens) in &modes {
            for lower_bound in [None, Some(-5.0f32)] {
                let spec = KdaSpec {
                    heads,
                    head_dim: dh,
                    kernel,
                    l2_eps: kda::L2_EPS,
                };
                let (c, w) = (heads * dh, 3 * heads * dh);
                let spans = lens
                    .iter()
                    .map(|&len| {
                        [
                            randn(rng, len * w, 2.0),
                            randn(rng, len * c, 3.0),
                            randn(rng, len * heads, 3.0),
                            randn(rng, len * w, 1.0),
                            (0..len * c).map(|_| -rng.random::<f32>() * 0.5).collect(),
                            (0..len * heads).map(|_| rng.random::<f32>()).collect(),
                        ]
                    })
                    .collect();
                let k = KdaCase {
                    spec,
                    gates: KdaGates {
                        heads,
                        head_dim: dh,
                        lower_bound,
                    },
                    taps: randn(rng, w * kernel, 0.6),
                    conv: randn(rng, (kernel - 1) * w, 2.0),
                    state: randn(rng, heads * dh * dh, 0.5),
                    dt_bias: randn(rng, c, 1.0),
                    a_log: randn(rng, heads, 1.0),
                    spans,
                    mode: *mode,
                };
                let (want, got) = (kda_on(&Host, &k)?, kda_on(gpu, &k)?);
                let bound = if lower_bound.is_some() {
                    "bounded"
                } else {
                    "softplus"
                };
                for (i, len) in lens.iter().enumerate() {
                    let name =
                        format!("kda H{heads} d{dh} K{kernel} {mode:?} {bound} span {i} T={len}");
                    let at = |v: &[Vec<f32>]| v[6 * i..6 * i + 6].to_vec();
                    let labels = [
                        "gates g",
                        "gates beta",
                        "conv",
                        "conv state",
                        "delta",
                        "state",
                    ];
                    compare(cases, &name, &labels, &at(&want), &at(&got), F32_BOUND);
                }
            }
        }
    }
    Ok(())
}

/// MLA's attention core for a sequence's new queries over its latents (pushed onto a
/// growable cache first), each query over its selection.
#[allow(clippy::too_many_arguments)]
fn mla_on<D: Device>(
    d: &D,
    spec: MlaSpec,
    kv_b: &Matrix,
    q: &[f32],
    past: &[f32],
    new: &[f32],
    sel: &[Vec<u32>],
    path: MlaPath,
    dtype: CacheDtype,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let len = sel.len();
    let mut latents = d.grow(&CacheRows::from_f32(dtype, past), 3 * spec.rank)?;
    d.push(&mut latents, &d.upload(new)?, 0, len, spec.rank)?;
    let mut padded = vec![0.25f32; spec.heads * spec.nope];
    padded.extend_from_slice(q);
    let table = d.table(kv_b)?;
    let sel = d.selections(sel)?;
    let out = d.mla_attend(
        spec,
        path,
        &table,
        &d.upload(&padded)?,
        1,
        len,
        &latents,
        &sel,
    )?;
    Ok(vec![d.download(&out)?])
}

fn mla<G: Device>(gpu: &G, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    // (heads, nope, v_dim, rank, cached tokens, new queries, kpool, topk, kv_b format)
    let shapes = [
        (
            3usize,
            24usize,
            20usize,
            40usize,
            37usize,
            1usize,
            4usize,
            64usize,
            Format::F32,
        ),
        (5, 16, 16, 72, 300, 3, 4, 64, Format::F32),
        (64, 192, 256, 512, 8192, 1, 16, 2048, Format::Bf16),
        (64, 192, 256, 512, 8192, 3, 16, 2048, Format::F32),
        (64, 192, 256, 512, 1500, 300, 16, 2048, Format::Bf16),
    ];
    for (heads, nope, vd, rank, tokens, new, kpool, topk, format) in shapes {
        let spec = MlaSpec {
            heads,
            nope,
            v_dim: vd,
            rank,
        };
        let kv_b = random_matrix(rng, heads * (nope + vd), rank, format)?;
        let latents = randn(rng, tokens * rank, 1.7);
        let (past, fresh) = latents.split_at((tokens - new) * rank);
        let sel: Vec<Vec<u32>> = (tokens - new..tokens)
            .map(|p| blocks::random_selection(rng, p + 1, kpool, topk))
            .collect();
        let q = randn(rng, new * heads * nope, 2.0);
        let path = MlaPath::Absorbed;
        // Each cache dtype against the host with the same dtype: both read the same rounded
        // latents, so f32 arithmetic bounds the difference as for f32.
        for dtype in CacheDtype::ALL {
            let want = mla_on(&Host, spec, &kv_b, &q, past, fresh, &sel, path, dtype)?;
            let got = mla_on(gpu, spec, &kv_b, &q, past, fresh, &sel, path, dtype)?;
            let name = format!(
                "mla_attend h{heads} nope{nope} v{vd} r{rank} T={tokens} new={new} {} {}",
                format.name(),
                dtype.name()
            );
            compare(cases, &name, &["absorbed"], &want, &got, F32_BOUND);
        }
    }
    Ok(())
}

/// The indexer's pool keys over keys and gates that arrive in two pushes.
fn pools_on<D: Device>(
    d: &D,
    spec: DsaSpec,
    keys: &[f32],
    gates: &[f32],
    ape: &[f32],
    dtype: CacheDtype,
) -> anyhow::Result<Vec<f32>> {
    let di = spec.dim;
    let tokens = keys.len() / di;
    let (k, g, ape) = (d.upload(keys)?, d.upload(gates)?, d.upload(ape)?);
    let empty = CacheRows::new(dtype);
    let (mut kc, mut gc) = (d.grow(&empty, 8 * di)?, d.grow(&empty, 8 * di)?);
    let mut pc = d.grow(&empty, di)?;
    let half = tokens / 2;
    for (first, count) in [(0, half), (half, tokens - half)] {
        d.push(&mut kc, &k, first, count, di)?;
        d.push(&mut gc, &g, first, count, di)?;
        d.dsa_pools(spec, &ape, &kc, &gc, &mut pc)?;
    }
    Ok(d.grow_download(&pc)?.to_f32().into_owned())
}

/// The selections of the queries at `positions` (rows of `q` and `w`) over `pool_keys`: all
/// queries in one call, then the last alone (a decode step).
fn select_on<D: Device>(
    d: &D,
    spec: DsaSpec,
    pool_keys: &[f32],
    q: &[f32],
    w: &[f32],
    positions: &[usize],
    dtype: CacheDtype,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let pools = d.grow(&CacheRows::from_f32(dtype, pool_keys), 0)?;
    let (qb, wb) = (d.upload(q)?, d.upload(w)?);
    let mut sel = Vec::new();
    // Consecutive positions in one call (as a prompt chunk asks), others one by one.
    for (i, &pos) in positions.iter().enumerate() {
        let s = d.dsa_select(spec, &qb, &wb, i, 1, pos, &pools)?;
        sel.extend(d.selections_download(&s)?);
    }
    let n = positions.len();
    let last = positions[n - 1];
    let s = d.dsa_select(spec, &qb, &wb, n - 3, 3, last - 2, &pools)?;
    sel.extend(d.selections_download(&s)?);
    Ok(sel)
}

fn dsa<G: Device>(gpu: &G, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    // (heads, dim, kpool, topk, tokens, select_tail)
    let shapes = [
        (2usize, 20usize, 4usize, 16usize, 37usize, true),
        (1, 20, 3, 9, 50, false),
        (40, 36, 4, 64, 1000, true),
        (32, 128, 16, 2048, 8199, true),
    ];
    for (heads, di, kpool, topk, tokens, select_tail) in shapes {
        let spec = DsaSpec {
            heads,
            dim: di,
            kpool,
            topk,
            select_tail,
        };
        let name = format!("op dsa h{heads} d{di} kpool{kpool} topk{topk} T={tokens}");
        let keys = randn(rng, tokens * di, 1.7);
        let gates = randn(rng, tokens * di, 3.0);
        let ape = randn(rng, kpool * di, 1.0);
        for dtype in [CacheDtype::Bf16, CacheDtype::F16] {
            let want = pools_on(&Host, spec, &keys, &gates, &ape, dtype)?;
            let got = pools_on(gpu, spec, &keys, &gates, &ape, dtype)?;
            let label = format!("{name} pools {}", dtype.name());
            cases.push(case(label, &got, &want, stored_pool_bound(dtype)));
        }
        let want = pools_on(&Host, spec, &keys, &gates, &ape, CacheDtype::F32)?;
        let got = pools_on(gpu, spec, &keys, &gates, &ape, CacheDtype::F32)?;
        cases.push(case(format!("{name} pools"), &got, &want, F32_BOUND));

        // Selections over the host's pool keys, so both sides score the same numbers. Ties:
        // every other pool of the last two thirds carries pool 3's key, query 4 scores
        // those best, and query 3 scores every pool -0.0. The last three positions are
        // consecutive.
        let pools = want.len() / di;
        let mut pool_keys = want;
        let dup = pool_keys[3 * di..4 * di].to_vec();
        for p in (pools / 3..pools).step_by(2) {
            pool_keys[p * di..(p + 1) * di].copy_from_slice(&dup);
        }
        let t = tokens;
        let positions = [0, kpool - 1, kpool, t / 2 + 1, t - 3, t - 2, t - 1];
        let (hd, h) = (heads * di, heads);
        let mut q = randn(rng, positions.len() * hd, 1.0);
        let mut w = randn(rng, positions.len() * h, 1.0);
        q[3 * hd..4 * hd].fill(0.0);
        w[3 * h..4 * h].iter_mut().for_each(|v| *v = -v.abs() - 0.1);
        for head in 0..h {
            q[4 * hd + head * di..4 * hd + (head + 1) * di].copy_from_slice(&dup);
        }
        w[4 * h..5 * h].iter_mut().for_each(|v| *v = v.abs() + 0.1);
        // Each cache dtype: both devices score the same rounded keys, so the same picks.
        for dtype in CacheDtype::ALL {
            let want = select_on(&Host, spec, &pool_keys, &q, &w, &positions, dtype)?;
            let got = select_on(gpu, spec, &pool_keys, &q, &w, &positions, dtype)?;
            let label = match dtype {
                CacheDtype::F32 => format!("{name} select"),
                _ => format!("{name} select {}", dtype.name()),
            };
            cases.push(exact_case(label, got == want));
        }
    }
    Ok(())
}

/// Pool keys stored in a 2-byte dtype: the devices' f32 keys (their `exp`s may differ in the
/// last bit) can round to neighbouring values, a relative step of at most the dtype's unit
/// roundoff in a few channels; the bit-exact rounding itself is `op grow+push`'s case.
fn stored_pool_bound(dtype: CacheDtype) -> f64 {
    match dtype {
        CacheDtype::F32 => F32_BOUND,
        CacheDtype::Bf16 => 2f64.powi(-8),
        CacheDtype::F16 => 2f64.powi(-11),
    }
}

/// A provider whose experts are random f32 SwiGLUs, on host rows (both devices call it).
struct TestExperts {
    experts: Vec<SwiGlu>,
    hidden: usize,
}

impl ExpertProvider for TestExperts {
    fn forward(&self, _: usize, x: &[f32], r: &Routing, out: &mut [f32]) -> anyhow::Result<()> {
        let n = self.experts.len();
        combine_experts(self.hidden, x, r, n, out, |e, rows, t| {
            Ok(self.experts[e].forward(rows, t))
        })
    }

    fn weight_bytes(&self) -> usize {
        0
    }
}

fn route_on<D: Device>(
    d: &D,
    router: &Router,
    experts: &TestExperts,
    x: &[f32],
    tokens: usize,
) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let r = router.place(d)?;
    let xb = d.upload(x)?;
    let routing = r.route(d, &xb, tokens)?;
    let y = d.experts(experts, 0, &xb, &routing, experts.hidden)?;
    Ok((routing.ids.clone(), vec![routing.weights, d.download(&y)?]))
}

fn routing<G: Device>(gpu: &G, rng: &mut ChaCha8Rng, cases: &mut Vec<Case>) -> anyhow::Result<()> {
    for (n_experts, groups, topk_groups, k, normalize) in [
        (16usize, 1usize, 1usize, 4usize, true),
        (64, 8, 4, 8, true),
        (288, 8, 4, 8, false),
    ] {
        let (tokens, hidden, inter) = (37, 64, 32);
        let router = Router::new(
            random_matrix(rng, n_experts, hidden, Format::F32)?,
            randn(rng, n_experts, 0.1),
            k,
            groups,
            topk_groups,
            normalize,
            2.5,
        );
        let experts = TestExperts {
            experts: (0..n_experts)
                .map(|_| -> anyhow::Result<SwiGlu> {
                    Ok(SwiGlu {
                        gate: random_matrix(rng, inter, hidden, Format::F32)?,
                        up: random_matrix(rng, inter, hidden, Format::F32)?,
                        down: random_matrix(rng, hidden, inter, Format::F32)?,
                        limit: 7.0,
                    })
                })
                .collect::<anyhow::Result<_>>()?,
            hidden,
        };
        let x = randn(rng, tokens * hidden, 3.0);
        let (want_ids, want) = route_on(&Host, &router, &experts, &x, tokens)?;
        let (got_ids, got) = route_on(gpu, &router, &experts, &x, tokens)?;
        let name = format!("route E={n_experts} groups={groups}/{topk_groups} k={k}");
        cases.push(exact_case(format!("op {name} ids"), got_ids == want_ids));
        compare(
            cases,
            &name,
            &["weights", "experts"],
            &want,
            &got,
            F32_BOUND,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness itself, host against host: every case runs and every comparison holds
    /// exactly (the GPU run needs a device: `cuda-check --only ops`).
    #[test]
    fn every_op_case_runs_host_against_host() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut cases = Vec::new();
        check_ops(&Host, &mut rng, false, &mut cases).unwrap();
        assert!(cases.len() > 200, "{} cases", cases.len());
        for c in &cases {
            assert!(c.finite && c.rel == 0.0, "{}: {}", c.name, c.rel);
        }
    }
}
