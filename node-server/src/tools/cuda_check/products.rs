//! Checks of the products: matvec, dense matmul, the fused MoE launches, the small row ops
//! and the router.

use super::*;
use crate::quant::exl3::Codebook;

pub(super) fn check_matvec(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    // Below 2048 rows `matvec_split` (a block per row; 37 x 512 leaves most of its warps
    // without columns), from 2048 the warp per row (two rows a warp at 2 tokens and q4_k's 1,
    // four at 4 tokens: 2049 and 2051 rows leave the last warp one and three rows);
    // 24 x 16384 is mHC's projection.
    let mut shapes = vec![
        (37, 512),
        (256, 768),
        (1024, 2048),
        (24, 16384),
        (2049, 512),
        (2051, 256),
    ];
    if wide {
        shapes.extend([(2048, 4096), (4096, 2048), (6144, 4096)]);
    }
    for format in Format::ALL {
        // Columns not a multiple of 8 take the float formats' scalar loads.
        let odd = [(5, 260), (2101, 100)];
        let float = matches!(format, Format::F32 | Format::F16 | Format::Bf16);
        for &(rows, cols) in shapes.iter().chain(odd.iter().filter(|_| float)) {
            let m = random_matrix(rng, rows, cols, format)?;
            let w = cuda.upload(&m.to_bytes().context("a row-format matrix")?)?;
            for n in [1usize, 2, 3, 4, 5, 8, 9, 17] {
                let x = randn(rng, n * cols, 1.0);
                let want = m.matmul(&x, n);
                let dx = cuda.upload(&x)?;
                let mut dy = cuda.alloc_f32(n * rows)?;
                cuda.matvec(&w, format, rows, cols, &dx, n, &mut dy)?;
                let got = cuda.download(&dy)?;
                cases.push(case(
                    format!("matvec {} {rows}x{cols} n={n}", format.name()),
                    &got[..n * rows],
                    &want,
                    F32_BOUND,
                ));
                // The token tile fitted to n against the widest: the same sums, same bits.
                cuda.set_matvec_wide_tile(true);
                let mut dy = cuda.alloc_f32(n * rows)?;
                let wide_tile = cuda
                    .matvec(&w, format, rows, cols, &dx, n, &mut dy)
                    .and_then(|()| cuda.download(&dy));
                cuda.set_matvec_wide_tile(false);
                cases.push(same_bits_case(
                    format!(
                        "matvec {} {rows}x{cols} n={n} widest tile: same bits",
                        format.name()
                    ),
                    &wide_tile?[..n * rows],
                    &got[..n * rows],
                ));
            }
        }
    }
    if wide {
        matvec_speed(cuda, rng)?;
    }
    Ok(())
}

/// Prints `matvec`'s time and weight bytes read per second for GLM-5.3-Flash-width bf16 and
/// q4_k matrices (the lm head, the dense MLP's gate and down, KDA's projections and output, the
/// shared expert's gate and down, a square one) at 1 and 4 tokens, with the token tile fitted to
/// the tokens and with the widest (the kernel before the fitted tiles), against the device's
/// copy rate (bytes read plus written a second: what HBM moves). Calls rotate over enough copies
/// of a matrix to pass `ROTATE_BYTES`, so a matrix smaller than the L2 cache is read from HBM
/// as in a step, not from the cache its last call filled.
fn matvec_speed(cuda: &Cuda, rng: &mut ChaCha8Rng) -> anyhow::Result<()> {
    const ROTATE_BYTES: usize = 192 << 20;
    let copy = copy_rate_for_speeds(cuda)?;
    for format in [Format::Bf16, Format::Q4K] {
        for (rows, cols) in [
            (154_880usize, 4096usize),
            (12_288, 4096),
            (4096, 12_288),
            (8192, 4096),
            (4096, 8192),
            (4096, 4096),
            (2048, 4096),
            (4096, 2048),
        ] {
            // A random row repeated: the values do not matter to the speed.
            let row = random_matrix(rng, 1, cols, format)?
                .to_bytes()
                .context("a row-format matrix")?;
            let bytes = row.repeat(rows);
            let copies = ROTATE_BYTES.div_ceil(bytes.len()).max(1);
            let ws = (0..copies)
                .map(|_| cuda.upload(&bytes))
                .collect::<Result<Vec<_>, _>>()?;
            let size = bytes.len() as f64;
            drop(bytes);
            for n in [1usize, 4] {
                let dx = cuda.upload(&randn(rng, n * cols, 1.0))?;
                let mut dy = cuda.alloc_f32(n * rows)?;
                for wide_tile in [false, true] {
                    cuda.set_matvec_wide_tile(wide_tile);
                    let mut call = 0;
                    let secs = seconds_per_call(cuda, 30.max(2 * copies), || {
                        call += 1;
                        cuda.matvec(&ws[call % copies], format, rows, cols, &dx, n, &mut dy)
                    })?;
                    println!(
                        "matvec {} {rows}x{cols} n={n} {} tile: {:.1} us, {:.0} GB/s of weights ({:.2} of the copy rate; {copies} copies)",
                        format.name(),
                        if wide_tile { "widest" } else { "fitted" },
                        secs * 1e6,
                        size / secs / 1e9,
                        size / secs / copy
                    );
                }
                cuda.set_matvec_wide_tile(false);
            }
        }
    }
    cuda.set_poison(true);
    Ok(())
}

/// Dense matrices placed on the GPU as a model load places them (`Cuda::matmul`: cuBLAS for
/// many tokens of f32, and of f16/bf16/q8_0/q4_k widened a tile at a time: 4100 x 4096 is
/// three tiles, the last of 4 rows).
pub(super) fn check_dense(
    cuda: &Arc<Cuda>,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let placer = CudaPlacer::new(cuda.clone(), 1)?;
    for format in Format::ALL {
        for (rows, cols) in [(512usize, 256usize), (1000, 1536), (4100, 4096)] {
            let m = random_matrix(rng, rows, cols, format)?;
            // Called directly, not through Matrix::matmul, whose CPU fallback would hide a
            // failing device product.
            let device = placer
                .place(&m)
                .with_context(|| format!("placing {m:?} failed: {:?}", placer.failure()))?;
            for n in [1usize, 9, 64, 300] {
                let x = randn(rng, n * cols, 1.0);
                let want = m.matmul(&x, n);
                let mut got = vec![f32::NAN; n * rows];
                device.matmul_into(&x, n, &mut got)?;
                cases.push(case(
                    format!("dense {} {rows}x{cols} n={n}", format.name()),
                    &got,
                    &want,
                    F32_BOUND,
                ));
            }
        }
    }
    Ok(())
}

pub(super) fn check_moe(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    wide: bool,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let mut shapes = vec![(512, 256, 16, 4)];
    if wide {
        shapes.push((4096, 2048, 12, 8));
    }
    for (hidden, inter, experts, k) in shapes {
        let rows = [
            (Format::F32, Format::F32),
            (Format::Bf16, Format::Bf16),
            (Format::F16, Format::F16),
            (Format::Q8_0, Format::Q8_0),
            (Format::Q4K, Format::Q4K),
            (Format::Q4K, Format::Q8_0),
            (Format::Q8_0, Format::Q4K),
        ]
        .map(|(gu, down)| ExpertForm::Rows(gu, down));
        // EXL3 (tile words, codebook) of gate/up and of down: 3 bpw mul1 as the seed's
        // checkpoint, a half rate, the other codebooks, and different rates per matrix.
        let exl3 = [
            ((48, Codebook::Mul1), (48, Codebook::Mul1)),
            ((40, Codebook::Mul1), (56, Codebook::Mul1)),
            ((32, Codebook::Mcg), (64, Codebook::Mcg)),
            ((64, Codebook::Inst3), (32, Codebook::Inst3)),
        ]
        .map(|(gu, down)| ExpertForm::Exl3(gu, down));
        for form in rows.into_iter().chain(exl3) {
            let limit = 7.0;
            // Slots in reverse order, so slot and expert numbers differ.
            let (ex, layout, arena) = form.in_arena(cuda, rng, (hidden, inter), experts, true)?;
            let name = form.name();
            // A victim copied down (issue 17 item 4): every slot read back and rebuilt gives
            // its expert's products, bit for bit.
            let probe = randn(rng, 3 * hidden, 1.0);
            let (mut back, mut orig) = (Vec::new(), Vec::new());
            for (e, expert) in ex.iter().enumerate() {
                let bytes = arena.read(cuda.stream(), experts - 1 - e)?;
                let copy = crate::tiers::vram::expert_from_slot(&layout, &bytes, limit)?;
                back.extend(copy.forward(&probe, 3));
                orig.extend(expert.forward(&probe, 3));
            }
            cases.push(same_bits_case(
                format!("moe {name} slots read back (copy-down): same bits"),
                &back,
                &orig,
            ));
            // EXL3 at 100 tokens: groups of ~25 picks, a prompt chunk's (the kernel that
            // decodes a tile once for several passes). Only with --wide: racecheck runs out of
            // host memory on the other kernels of this case (measured 2026-12-04: 130 GB);
            // the wide kernel alone is racecheck-clean.
            // At 200 tokens (--wide): groups of ~50 picks, which go through cuBLAS on the
            // slot's widened (row formats) or decoded (EXL3) weights.
            if hidden == 4096 && matches!(name.as_str(), "q4_k/q4_k" | "exl3 3mul1/3mul1") {
                moe_speed(cuda, rng, &arena.buf, layout, experts, k, &name)?;
            }
            let counts: &[usize] = match form {
                ExpertForm::Exl3(..) if hidden == 512 && wide => &[1, 4, 33, 100, 200],
                ExpertForm::Rows(..) if hidden == 512 && wide => &[1, 4, 33, 200],
                _ => &[1, 4, 33],
            };
            for &tokens in counts {
                let x = randn(rng, tokens * hidden, 2.0);
                let routing = random_routing(rng, tokens, experts, k);
                let mut want = vec![0f32; tokens * hidden];
                combine_experts(hidden, &x, &routing, experts, &mut want, |e, rows, n| {
                    Ok(ex[e].forward(rows, n))
                })?;
                let slots: Vec<u32> = routing
                    .ids
                    .iter()
                    .map(|&e| (experts - 1 - e as usize) as u32)
                    .collect();
                let step = MoeStep {
                    layout,
                    tokens,
                    k,
                    limit,
                    slots: &slots,
                    weights: &routing.weights,
                };
                let got = cuda.moe(&arena.buf, &step, &x)?;
                cases.push(case(
                    format!("moe {name} h{hidden} i{inter} T={tokens} k={k}"),
                    &got,
                    &want,
                    F32_BOUND,
                ));
                // The same step in two launches with the odd picks computed on the CPU (as
                // the CPU lane does) must agree, and the GPU picks split across launches must
                // give the single launch's bits for an all-GPU split.
                let mut run = cuda.moe_begin(layout, tokens, k, &x)?;
                let (even, odd): (Vec<Pick>, Vec<Pick>) = slots
                    .iter()
                    .copied()
                    .enumerate()
                    .partition(|(p, _)| p % 2 == 0);
                cuda.moe_picks(&mut run, &arena.buf, limit, &even)?;
                for &(p, _) in &odd {
                    let (t, e) = (p / k, routing.ids[p] as usize);
                    let y = ex[e].forward(&x[t * hidden..(t + 1) * hidden], 1);
                    cuda.moe_set_rows(&mut run, p, &y)?;
                }
                let mixed = cuda.moe_finish(run, &routing.weights)?;
                cases.push(case(
                    format!("moe {name} T={tokens} half on the CPU lane"),
                    &mixed,
                    &want,
                    F32_BOUND,
                ));
                if Cuda::moe_routes(tokens * k) {
                    // The picks grouped on the device, as a step whose router's ids never
                    // come to the host: the host-grouped launch's bits.
                    let ids: Vec<i32> = routing.ids.iter().map(|&e| e as i32).collect();
                    let slot_of: Vec<i32> =
                        (0..experts).map(|e| (experts - 1 - e) as i32).collect();
                    let (d_ids, d_w, d_slots) = (
                        cuda.upload(&ids)?,
                        cuda.upload(&routing.weights)?,
                        cuda.upload(&slot_of)?,
                    );
                    let d_x = cuda.upload(&x)?;
                    let y = cuda.moe_routed(
                        &arena.buf,
                        layout,
                        limit,
                        &d_x,
                        &d_ids,
                        &d_w,
                        &d_slots.slice(..),
                        tokens,
                        k,
                    )?;
                    let mut routed = cuda.download(&y)?;
                    routed.truncate(tokens * hidden);
                    cases.push(same_bits_case(
                        format!("moe {name} T={tokens} grouped on the device: same bits"),
                        &routed,
                        &got,
                    ));
                }
                // Split by expert, as the tiers split a step (an expert's picks all go where
                // it resides): a group's products, cuBLAS's included, depend on its picks only.
                let (odd_e, even_e): (Vec<Pick>, Vec<Pick>) = slots
                    .iter()
                    .copied()
                    .enumerate()
                    .partition(|&(_, s)| s % 2 == 1);
                let mut run = cuda.moe_begin(layout, tokens, k, &x)?;
                cuda.moe_picks(&mut run, &arena.buf, limit, &odd_e)?;
                cuda.moe_picks(&mut run, &arena.buf, limit, &even_e)?;
                let split = cuda.moe_finish(run, &routing.weights)?;
                cases.push(same_bits_case(
                    format!("moe {name} T={tokens} two launches by expert: same bits"),
                    &split,
                    &got,
                ));
                if tokens * k > 64 {
                    // Launches of 8 picks: groups of at most a tile, too small for the kernels
                    // the whole step's groups take (EXL3's that decode a tile once for many
                    // passes, the row formats' that read gathered token rows).
                    let picks: Vec<Pick> = slots.iter().copied().enumerate().collect();
                    let mut run = cuda.moe_begin(layout, tokens, k, &x)?;
                    for few in picks.chunks(8) {
                        cuda.moe_picks(&mut run, &arena.buf, limit, few)?;
                    }
                    let narrow = cuda.moe_finish(run, &routing.weights)?;
                    let mut per_expert = vec![0usize; experts];
                    for &e in &routing.ids {
                        per_expert[e as usize] += 1;
                    }
                    let longest = per_expert.into_iter().max().unwrap_or(0);
                    if crate::backend::cuda::prompt_gemm()
                        && longest >= crate::backend::cuda::MOE_GEMM_MIN_PICKS
                    {
                        cases.push(case(
                            format!("moe {name} T={tokens} launches of 8 picks vs cuBLAS"),
                            &narrow,
                            &got,
                            F32_BOUND,
                        ));
                    } else {
                        cases.push(same_bits_case(
                            format!("moe {name} T={tokens} launches of 8 picks: same bits"),
                            &narrow,
                            &got,
                        ));
                    }
                }
            }
        }
    }
    if wide {
        // A prompt chunk of more picks than a grid's y dimension holds (65,535), ~16,400 a
        // slot: the launches over entries must still take every one.
        let (hidden, inter, experts, k, tokens) = (64usize, 32usize, 4usize, 4usize, 16_400usize);
        let form = ExpertForm::Rows(Format::F32, Format::F32);
        let (ex, layout, arena) = form.in_arena(cuda, rng, (hidden, inter), experts, false)?;
        let x = randn(rng, tokens * hidden, 2.0);
        let routing = random_routing(rng, tokens, experts, k);
        let mut want = vec![0f32; tokens * hidden];
        combine_experts(hidden, &x, &routing, experts, &mut want, |e, rows, n| {
            Ok(ex[e].forward(rows, n))
        })?;
        let slots: Vec<u32> = routing.ids.clone();
        let step = MoeStep {
            layout,
            tokens,
            k,
            limit: 7.0,
            slots: &slots,
            weights: &routing.weights,
        };
        let got = cuda.moe(&arena.buf, &step, &x)?;
        cases.push(case(
            format!(
                "moe f32 h{hidden} i{inter} T={tokens} k={k} ({} picks)",
                tokens * k
            ),
            &got,
            &want,
            F32_BOUND,
        ));
    }
    Ok(())
}

/// Only the routed-expert step's timings of `check_moe --wide` (`--only moe-speed`): q4_k and
/// 3 bpw mul1 EXL3 experts at GLM-5.3-Flash width, 12 in the arena.
pub(super) fn moe_speeds(cuda: &Cuda, rng: &mut ChaCha8Rng) -> anyhow::Result<()> {
    let (hidden, inter, experts, k) = (4096, 2048, 12, 8);
    for form in [
        ExpertForm::Rows(Format::Q4K, Format::Q4K),
        ExpertForm::Exl3((48, Codebook::Mul1), (48, Codebook::Mul1)),
    ] {
        let (_, layout, arena) = form.in_arena(cuda, rng, (hidden, inter), experts, true)?;
        moe_speed(cuda, rng, &arena.buf, layout, experts, k, &form.name())?;
    }
    Ok(())
}

/// Prints the routed-expert step's time (`moe_routed`: the device grouping, both launches and
/// the combine, as a decode step runs it) at 1 and 4 tokens over the `experts` slots of
/// `arena`, and the bytes of the distinct experts it reads a second against the copy rate.
fn moe_speed(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    arena: &cudarc::driver::CudaSlice<u8>,
    layout: crate::backend::cuda::MoeLayout,
    experts: usize,
    k: usize,
    name: &str,
) -> anyhow::Result<()> {
    let copy = copy_rate_for_speeds(cuda)?;
    let slot_of: Vec<i32> = (0..experts).map(|e| (experts - 1 - e) as i32).collect();
    let d_slots = cuda.upload(&slot_of)?;
    for tokens in [1usize, 4] {
        let routing = random_routing(rng, tokens, experts, k);
        let mut distinct = routing.ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let ids: Vec<i32> = routing.ids.iter().map(|&e| e as i32).collect();
        let (d_ids, d_w) = (cuda.upload(&ids)?, cuda.upload(&routing.weights)?);
        let d_x = cuda.upload(&randn(rng, tokens * layout.hidden, 1.0))?;
        let secs = seconds_per_call(cuda, 50, || {
            cuda.moe_routed(
                arena,
                layout,
                7.0,
                &d_x,
                &d_ids,
                &d_w,
                &d_slots.slice(..),
                tokens,
                k,
            )
            .map(drop)
        })?;
        let bytes = (distinct.len() * layout.slot_bytes) as f64;
        println!(
            "moe {name} h{} i{} T={tokens} k={k} ({} experts): {:.1} us, {:.0} GB/s of experts ({:.2} of the copy rate)",
            layout.hidden,
            layout.inter,
            distinct.len(),
            secs * 1e6,
            bytes / secs / 1e9,
            bytes / secs / copy
        );
    }
    cuda.set_poison(true);
    Ok(())
}

/// How a check's experts store their matrices: rows (gate/up, down formats), or EXL3 (tile
/// words and codebook of gate/up, of down).
#[derive(Clone, Copy)]
enum ExpertForm {
    Rows(Format, Format),
    Exl3((usize, Codebook), (usize, Codebook)),
}

impl ExpertForm {
    fn expert(
        self,
        rng: &mut ChaCha8Rng,
        hidden: usize,
        inter: usize,
        limit: f32,
    ) -> anyhow::Result<SwiGlu> {
        Ok(match self {
            ExpertForm::Rows(gu, down) => SwiGlu {
                gate: random_matrix(rng, inter, hidden, gu)?,
                up: random_matrix(rng, inter, hidden, gu)?,
                down: random_matrix(rng, hidden, inter, down)?,
                limit,
            },
            ExpertForm::Exl3((gl, gc), (dl, dc)) => {
                let mut lin = |k, n, len, cb| -> anyhow::Result<Matrix> {
                    Ok(Matrix::from_exl3(super::exl3::random_linear(
                        rng, k, n, len, cb, false,
                    )?))
                };
                SwiGlu {
                    gate: lin(hidden, inter, gl, gc)?,
                    up: lin(hidden, inter, gl, gc)?,
                    down: lin(inter, hidden, dl, dc)?,
                    limit,
                }
            }
        })
    }

    /// `experts` random experts of this form (limit 7) written to the slots of a new arena,
    /// expert e in slot e, or in slot `experts - 1 - e` when `reversed`.
    fn in_arena(
        self,
        cuda: &Cuda,
        rng: &mut ChaCha8Rng,
        (hidden, inter): (usize, usize),
        experts: usize,
        reversed: bool,
    ) -> anyhow::Result<(Vec<SwiGlu>, crate::backend::cuda::MoeLayout, SlotArena)> {
        let ex: Vec<SwiGlu> = (0..experts)
            .map(|_| self.expert(rng, hidden, inter, 7.0))
            .collect::<anyhow::Result<_>>()?;
        let layout = crate::tiers::vram::layout_of(&ex[0])?;
        let mut arena = SlotArena::new(cuda, layout, experts)?;
        for (e, expert) in ex.iter().enumerate() {
            let slot = if reversed { experts - 1 - e } else { e };
            write_slot(cuda.stream(), &mut arena, slot, expert)?;
        }
        Ok((ex, layout, arena))
    }

    fn name(self) -> String {
        match self {
            ExpertForm::Rows(gu, down) => format!("{}/{}", gu.name(), down.name()),
            ExpertForm::Exl3((gl, gc), (dl, dc)) => {
                format!("exl3 {}{gc}/{}{dc}", gl as f32 / 16.0, dl as f32 / 16.0)
            }
        }
    }
}

/// `(pick index, arena slot)`.
type Pick = (usize, u32);

/// `k` distinct experts per token with positive weights.
pub(super) fn random_routing(
    rng: &mut ChaCha8Rng,
    tokens: usize,
    experts: usize,
    k: usize,
) -> Routing {
    let mut ids = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut picked: Vec<u32> = Vec::with_capacity(k);
        while picked.len() < k {
            let e = rng.random_range(0..experts) as u32;
            if !picked.contains(&e) {
                picked.push(e);
            }
        }
        ids.extend(picked);
        weights.extend((0..k).map(|_| rng.random::<f32>() + 0.1));
    }
    Routing {
        k,
        ids,
        weights,
        phases: Vec::new(),
    }
}

pub(super) fn check_small_ops(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    for (rows, width) in [(1usize, 64usize), (7, 128), (33, 4096), (5, 1000)] {
        let x = randn(rng, rows * width, 3.0);
        let w = randn(rng, width, 1.0);
        let g = randn(rng, rows * width, 4.0);
        for weighted in [false, true] {
            let mut want = x.clone();
            ops::rms_norm(&mut want, weighted.then_some(&w[..]), width, 1e-6);
            let mut dx = cuda.upload(&x)?;
            let dw = cuda.upload(&w)?;
            cuda.rms_norm(&mut dx, weighted.then_some(&dw), width, 1e-6)?;
            let got = cuda.download(&dx)?;
            cases.push(case(
                format!("rms_norm {rows}x{width} weight={weighted}"),
                &got,
                &want,
                F32_BOUND,
            ));
        }
        let mut want = x.clone();
        for (o, gg) in want.chunks_exact_mut(width).zip(g.chunks_exact(width)) {
            ops::rms_norm(o, Some(&w), width, 1e-6);
            o.iter_mut()
                .zip(gg)
                .for_each(|(o, gg)| *o *= ops::sigmoid(*gg));
        }
        let mut dx = cuda.upload(&x)?;
        let (dg, dw) = (cuda.upload(&g)?, cuda.upload(&w)?);
        cuda.gated_rms_norm(&mut dx, &dg, &dw, width, 1e-6)?;
        cases.push(case(
            format!("gated_rms_norm {rows}x{width}"),
            &cuda.download(&dx)?,
            &want,
            F32_BOUND,
        ));
    }
    for n in [1usize, 1000, 100_003] {
        let gate = randn(rng, n, 20.0);
        let up = randn(rng, n, 20.0);
        let want = swiglu(&gate, &up, 7.0);
        let (dg, du) = (cuda.upload(&gate)?, cuda.upload(&up)?);
        let mut out = cuda.alloc_f32(n)?;
        cuda.swiglu(&dg, &du, 7.0, &mut out)?;
        cases.push(case(
            format!("swiglu n={n}"),
            &cuda.download(&out)?,
            &want,
            F32_BOUND,
        ));
    }
    Ok(())
}

pub(super) fn check_router(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    // The last three: exact ties (no bias, logits of a few values, sigmoid saturating to 1 and
    // 0 at +-inf and beyond ~17), groups of one expert, and every expert picked.
    for (experts, groups, topk_groups, k, normalize, ties) in [
        (16usize, 1usize, 1usize, 4usize, true, false),
        (64, 8, 4, 8, true, false),
        (288, 1, 1, 8, true, false),
        (288, 8, 4, 8, false, false),
        (288, 1, 1, 8, true, true),
        (8, 8, 4, 2, true, true),
        (16, 1, 1, 16, true, false),
    ] {
        let tokens = 37;
        let hidden = 8;
        let bias = if ties {
            vec![0.0; experts]
        } else {
            randn(rng, experts, 0.1)
        };
        let router = Router::new(
            Matrix::from_f32(experts, hidden, randn(rng, experts * hidden, 1.0)),
            bias,
            k,
            groups,
            topk_groups,
            normalize,
            2.5,
        );
        let mut logits = randn(rng, tokens * experts, 4.0);
        if ties {
            let special = [f32::INFINITY, f32::NEG_INFINITY, 30.0, -30.0];
            for (i, v) in logits.iter_mut().enumerate() {
                *v = if i % 7 == 0 {
                    special[(i / 7) % special.len()]
                } else {
                    (*v / 2.0).round()
                };
            }
        }
        // Exact ties in the choice must go to the lower index, as on the CPU.
        logits[3] = logits[5];
        let name = format!(
            "route E={experts} groups={groups}/{topk_groups} k={k}{}",
            if ties { " ties" } else { "" }
        );
        let want = router.choose(&logits, tokens);
        let (dl, db) = (cuda.upload(&logits)?, cuda.upload(router.bias())?);
        let spec = RouteSpec {
            experts,
            groups,
            topk_groups,
            k,
            normalize,
            scale: 2.5,
        };
        let (ids, weights) = cuda.route(&dl, &db, spec, tokens)?;
        let same_ids = ids == want.ids;
        cases.push(Case {
            name: format!("{name} ids"),
            rel: if same_ids { 0.0 } else { f64::INFINITY },
            bound: 0.0,
            finite: true,
        });
        cases.push(case(
            format!("{name} weights"),
            &weights,
            &want.weights,
            F32_BOUND,
        ));
    }
    Ok(())
}
