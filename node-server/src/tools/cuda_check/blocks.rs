//! Checks of the attention and residual blocks' kernels: mHC, KDA, MLA and the DSA indexer.

use super::*;

/// mHC collapse (RMSNorm, projection, weights, collapse: all on the GPU) and expand against
/// `HyperConnection`, then three layers chained on each side (identity sublayers).
pub(super) fn check_mhc(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    // n = 6 and 8: more comb entries than a warp has lanes (two a lane).
    for (n, d) in [(4usize, 4096usize), (4, 100), (3, 257), (6, 130), (8, 64)] {
        let cfg = mhc_config(n, d)?;
        let width = (2 + n) * n;
        let proj = random_matrix(rng, width, n * d, Format::F32)?;
        let w = cuda.upload(&proj.to_bytes().context("a row-format matrix")?)?;
        let base = randn(rng, width, 1.0);
        let scale = [0.5 + rng.random::<f32>(), 0.5 + rng.random::<f32>(), 2.0];
        let hc = HyperConnection::new(&cfg, proj, base.clone(), scale);
        let db = cuda.upload(&base)?;
        let spec = MhcSpec {
            streams: n,
            hidden: d,
            scale,
            hc_eps: cfg.hc_eps,
            sinkhorn_iters: cfg.hc_sinkhorn_iters,
        };
        let norm_w = randn(rng, d, 1.0);
        let dnorm = cuda.upload(&norm_w)?;
        let gpu_collapse =
            |streams: &[f32], tokens: usize, normed: bool| -> anyhow::Result<MhcCollapse> {
                let ds = cuda.upload(streams)?;
                let mut logits = cuda.alloc_f32(tokens * width)?;
                if tokens < GEMM_MIN_TOKENS {
                    // The decode path: the norm folded into the projection, one launch.
                    let eps = cfg.rms_norm_eps;
                    cuda.mhc_project(&w, Format::F32, width, n * d, &ds, tokens, eps, &mut logits)?;
                } else {
                    let mut normed = cuda.upload(streams)?;
                    cuda.rms_norm(&mut normed, None, n * d, cfg.rms_norm_eps)?;
                    cuda.matvec(&w, Format::F32, width, n * d, &normed, tokens, &mut logits)?;
                }
                let mut out = MhcCollapse {
                    collapsed: cuda.alloc_f32(tokens * d)?,
                    post: cuda.alloc_f32(tokens * n)?,
                    comb: cuda.alloc_f32(tokens * n * n)?,
                };
                let norm = normed.then_some((&dnorm, cfg.rms_norm_eps));
                cuda.mhc_collapse_dev(spec, &logits, &db, &ds, tokens, norm, &mut out)?;
                Ok(MhcCollapse {
                    collapsed: cuda.download(&out.collapsed)?,
                    post: cuda.download(&out.post)?,
                    comb: cuda.download(&out.comb)?,
                })
            };
        for tokens in [1usize, 5, 9] {
            let name = format!("mhc n{n} d{d} T={tokens}");
            let streams = randn(rng, tokens * n * d, 2.0);
            let want_mix = hc.collapse(&Host, &streams, tokens)?;
            let want_x = &want_mix.collapsed;
            let got = gpu_collapse(&streams, tokens, false)?;
            let again = gpu_collapse(&streams, tokens, false)?;
            // The collapse with the sublayer's input norm in the same launch (decode batches).
            let mut want_normed = want_x.clone();
            crate::model::device::Device::rms_norm(
                &Host,
                &mut want_normed,
                Some(&norm_w),
                d,
                cfg.rms_norm_eps,
            )?;
            let normed = gpu_collapse(&streams, tokens, true)?;
            cases.push(case(
                format!("{name} collapse + input norm, one launch"),
                &normed.collapsed,
                &want_normed,
                F32_BOUND,
            ));
            cases.push(same_bits_case(
                format!("{name} collapse + input norm: comb as without"),
                &normed.comb,
                &got.comb,
            ));
            cases.push(same_bits_case(
                format!("{name} collapse again: same bits"),
                &again.collapsed,
                &got.collapsed,
            ));
            cases.push(case(
                format!("{name} collapse"),
                &got.collapsed,
                want_x,
                F32_BOUND,
            ));
            cases.push(case(
                format!("{name} post"),
                &got.post,
                &want_mix.post,
                F32_BOUND,
            ));
            cases.push(case(
                format!("{name} comb"),
                &got.comb,
                &want_mix.comb,
                F32_BOUND,
            ));
            let y = randn(rng, tokens * d, 2.0);
            let want = hc.expand(&Host, &want_mix, &streams, &y, tokens)?;
            let got =
                cuda.mhc_expand(spec, &want_mix.post, &want_mix.comb, &streams, &y, tokens)?;
            cases.push(case(format!("{name} expand"), &got, &want, F32_BOUND));

            let (mut cpu, mut gpu) = (streams.clone(), streams);
            for _ in 0..3 {
                let mix = hc.collapse(&Host, &cpu, tokens)?;
                cpu = hc.expand(&Host, &mix, &cpu, &mix.collapsed, tokens)?;
                let c = gpu_collapse(&gpu, tokens, false)?;
                gpu = cuda.mhc_expand(spec, &c.post, &c.comb, &gpu, &c.collapsed, tokens)?;
            }
            cases.push(case(
                format!("{name} 3 layers chained"),
                &gpu,
                &cpu,
                F32_BOUND,
            ));
        }
        // bf16 weights (checkpoints that keep `hc_*_fn` in bf16): the bits of f32 rows holding
        // the widened values.
        let half = random_matrix(rng, width, n * d, Format::Bf16)?;
        let wide = half.convert(Format::F32)?;
        let bytes = |m: &Matrix| m.to_bytes().context("a row-format matrix");
        let (wh, ww) = (cuda.upload(&bytes(&half)?)?, cuda.upload(&bytes(&wide)?)?);
        for tokens in [1usize, 5] {
            let ds = cuda.upload(&randn(rng, tokens * n * d, 2.0))?;
            let project = |w, format| -> anyhow::Result<Vec<f32>> {
                let mut logits = cuda.alloc_f32(tokens * width)?;
                let eps = cfg.rms_norm_eps;
                cuda.mhc_project(w, format, width, n * d, &ds, tokens, eps, &mut logits)?;
                Ok(cuda.download(&logits)?)
            };
            cases.push(same_bits_case(
                format!("mhc_project n{n} d{d} T={tokens} bf16 weights: the widened f32's bits"),
                &project(&wh, Format::Bf16)?,
                &project(&ww, Format::F32)?,
            ));
        }
    }
    Ok(())
}

/// KDA's conv over spans continuing one conv state, then the delta rule (the recurrent and
/// the chunked kernel) over decode steps and prefill spans continuing one recurrent state
/// kept on the device; outputs and both states after every span against the CPU
/// (`kda::conv_step`, `kda::attend`).
pub(super) fn check_kda(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    for (heads, dh, kernel) in [(32usize, 128usize, 4usize), (3, 40, 4), (2, 16, 3)] {
        let spec = KdaSpec {
            heads,
            head_dim: dh,
            kernel,
            l2_eps: kda::L2_EPS,
        };
        let (c, w) = (heads * dh, 3 * heads * dh);
        let shape = format!("H{heads} d{dh}");
        let taps = randn(rng, w * kernel, 0.6);
        let mut cpu_conv = randn(rng, (kernel - 1) * w, 2.0);
        let mut gpu_conv = cpu_conv.clone();
        // Spans shorter than K - 1 shift the state partly; 70 spans two conv segments.
        for (step, len) in [1usize, 2, 70, 1].into_iter().enumerate() {
            let qkv = randn(rng, len * w, 2.0);
            let want = kda::conv_step(&taps, kernel, &qkv, len, &mut cpu_conv);
            let got = cuda.kda_conv(spec, &taps, &qkv, len, &mut gpu_conv)?;
            let name = format!("kda_conv {shape} K{kernel} span {step} T={len}");
            cases.push(case(name.clone(), &got, &want, F32_BOUND));
            cases.push(case(
                format!("{name} state"),
                &gpu_conv,
                &cpu_conv,
                F32_BOUND,
            ));
        }

        // Log decays uniform in [-decay, 0].
        let inputs = |rng: &mut ChaCha8Rng, len: usize, decay: f32| {
            let mixed = randn(rng, len * w, 1.0);
            let g: Vec<f32> = (0..len * c).map(|_| -rng.random::<f32>() * decay).collect();
            let beta: Vec<f32> = (0..len * heads).map(|_| rng.random::<f32>()).collect();
            (mixed, g, beta)
        };
        let s0 = randn(rng, heads * dh * dh, 0.5);
        // Spans through one kernel form continuing one device state, each against the CPU in
        // `mode` continuing its own: the output and both states after every span.
        let mut spans = |rng: &mut ChaCha8Rng,
                         form: KdaForm,
                         mode: KdaMode,
                         lens: &[usize],
                         decay: f32,
                         label: &str|
         -> anyhow::Result<()> {
            let mut cpu_s = s0.clone();
            let mut d_state = cuda.upload(&s0)?;
            for (step, &len) in lens.iter().enumerate() {
                let (mixed, g, beta) = inputs(rng, len, decay);
                let want = kda::attend(&mixed, &g, &beta, heads, dh, &mut cpu_s, mode);
                let mut out = cuda.alloc_f32(len * c)?;
                cuda.kda_delta_dev(
                    spec,
                    form,
                    &cuda.upload(&mixed)?,
                    &cuda.upload(&g)?,
                    &cuda.upload(&beta)?,
                    len,
                    &mut d_state,
                    &mut out,
                )?;
                let name = format!("{label} {shape} span {step} T={len}");
                cases.push(case(name.clone(), &cuda.download(&out)?, &want, F32_BOUND));
                cases.push(case(
                    format!("{name} state"),
                    &cuda.download(&d_state)?,
                    &cpu_s,
                    F32_BOUND,
                ));
            }
            Ok(())
        };
        let (recurrent, chunked) = (KdaForm::Recurrent, KdaForm::Chunked);
        spans(
            rng,
            recurrent,
            KdaMode::Recurrent,
            &[1, 1, 1, 7, 1, 130],
            0.5,
            "kda_recurrent",
        )?;
        // Prefill as the CPU engine runs it (chunked for more than one token): another
        // algorithm, yet on the CPU the two forms agree to ~4e-7 at these shapes.
        spans(
            rng,
            recurrent,
            KdaMode::Auto,
            &[150],
            0.5,
            "kda_recurrent vs chunked",
        )?;
        // The chunked kernel (16-token chunks) against both CPU forms (the CPU's chunks are
        // 64 tokens): one token, a chunk less one, a chunk, a chunk and one, then long spans
        // that end mid-chunk. Its sums run in another order than either CPU form's, as the
        // recurrent kernel's do against the CPU's chunked form above.
        for mode in [KdaMode::Auto, KdaMode::Recurrent] {
            let label = format!("kda_chunked vs {mode:?}");
            spans(rng, chunked, mode, &[1, 15, 16, 17, 150, 1000], 0.5, &label)?;
        }
        // Log decays down to -5 per token (a gate's lower bound): across a chunk the decay
        // reaches exp(-80), which the kernel only meets as exp(G_t - G_s) <= 1 and exp(G_t).
        let label = "kda_chunked strong decay";
        spans(rng, chunked, KdaMode::Recurrent, &[17, 150], 5.0, label)?;
        decode_seqs(cuda, rng, spec, &taps, &s0, cases)?;
        // The host-slice wrapper, once per form.
        for form in [recurrent, chunked] {
            let len = 40;
            let (mixed, g, beta) = inputs(rng, len, 0.5);
            let (mut cpu_s, mut gpu_s) = (s0.clone(), s0.clone());
            let want = kda::attend(&mixed, &g, &beta, heads, dh, &mut cpu_s, KdaMode::Auto);
            let got = cuda.kda_delta(spec, form, &mixed, &g, &beta, len, &mut gpu_s)?;
            let name = format!("kda_delta {form:?} {shape} host slices T={len}");
            cases.push(case(name.clone(), &got, &want, F32_BOUND));
            cases.push(case(format!("{name} state"), &gpu_s, &cpu_s, F32_BOUND));
        }
    }
    Ok(())
}

/// Two decode steps of three sequences through `kda_decode_seqs` (one launch per op for all)
/// against each sequence alone through `kda_conv_dev` and `kda_delta_dev`: the same bits in
/// the outputs and in every state.
fn decode_seqs(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    spec: KdaSpec,
    taps: &[f32],
    s0: &[f32],
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let (n, c, h) = (3, spec.channels(), spec.heads);
    let (w, hist) = (3 * c, spec.kernel - 1);
    let d_taps = cuda.upload(taps)?;
    let new_state = |rng: &mut ChaCha8Rng| -> anyhow::Result<_> {
        let conv = randn(rng, hist.max(1) * w, 2.0);
        let mut rec = s0.to_vec();
        rec.iter_mut().for_each(|v| *v += 0.1 * rng.random::<f32>());
        Ok((cuda.upload(&conv)?, cuda.upload(&rec)?))
    };
    let mut alone: Vec<_> = (0..n)
        .map(|_| new_state(rng))
        .collect::<anyhow::Result<_>>()?;
    let mut together: Vec<_> = alone
        .iter()
        .map(|(a, b)| {
            Ok((
                cuda.upload(&cuda.download(a)?)?,
                cuda.upload(&cuda.download(b)?)?,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let shape = format!("H{h} d{} K{}", spec.head_dim, spec.kernel);
    for step in 0..2 {
        let qkv = randn(rng, n * w, 2.0);
        let g: Vec<f32> = (0..n * c).map(|_| -rng.random::<f32>() * 0.5).collect();
        let beta: Vec<f32> = (0..n * h).map(|_| rng.random::<f32>()).collect();
        let mut want = Vec::with_capacity(n * c);
        for (s, (conv, rec)) in alone.iter_mut().enumerate() {
            let mut mixed = cuda.alloc_f32(w)?;
            let x = cuda.upload(&qkv[s * w..(s + 1) * w])?;
            cuda.kda_conv_dev(spec, &d_taps, &x, 1, conv, &mut mixed)?;
            let (gs, bs) = (&g[s * c..(s + 1) * c], &beta[s * h..(s + 1) * h]);
            let (gs, bs) = (cuda.upload(gs)?, cuda.upload(bs)?);
            let mut out = cuda.alloc_f32(c)?;
            cuda.kda_delta_dev(spec, KdaForm::Recurrent, &mixed, &gs, &bs, 1, rec, &mut out)?;
            want.extend(cuda.download(&out)?.into_iter().take(c));
        }
        let (qkv, g, beta) = (cuda.upload(&qkv)?, cuda.upload(&g)?, cuda.upload(&beta)?);
        let (mut mixed, mut out) = (cuda.alloc_f32(n * w)?, cuda.alloc_f32(n * c)?);
        let mut pairs: Vec<_> = together.iter_mut().map(|(a, b)| (a, b)).collect();
        cuda.kda_decode_seqs(
            spec, &d_taps, &qkv, &g, &beta, &mut pairs, &mut mixed, &mut out,
        )?;
        let mut got = cuda.download(&out)?;
        got.truncate(n * c);
        let name = format!("kda_decode_seqs {shape} step {step}");
        cases.push(same_bits_case(format!("{name}: same bits"), &got, &want));
        for (s, ((ca, ra), (ct, rt))) in alone.iter().zip(&together).enumerate() {
            let (ca, ct) = (cuda.download(ca)?, cuda.download(ct)?);
            let (ra, rt) = (cuda.download(ra)?, cuda.download(rt)?);
            cases.push(same_bits_case(
                format!("{name} seq {s} states: same bits"),
                &[ct, rt].concat(),
                &[ca, ra].concat(),
            ));
        }
    }
    Ok(())
}

/// A selection as the indexer makes one: `topk` tokens of whole pools of `kpool` among the
/// first `visible` tokens, plus the incomplete tail.
pub(super) fn random_selection(
    rng: &mut ChaCha8Rng,
    visible: usize,
    kpool: usize,
    topk: usize,
) -> Vec<u32> {
    let scores = randn(rng, visible / kpool, 1.0);
    select_tokens(&scores, topk, kpool, visible, true)
}

/// MLA attention over selected tokens: absorbed decode over the latent cache (GLM-5.3-Flash:
/// 64 heads, rank 512, 8K cache, 2048 selected of pools of 16) and expanded prefill.
pub(super) fn check_mla(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    // (heads, rank, cached tokens, query positions, kpool, topk); topk >= cache: dense.
    let absorbed = [
        (3usize, 40usize, 37usize, vec![36usize], 4usize, 64usize),
        (5, 72, 300, vec![10, 150, 299], 4, 64),
        (64, 512, 8192, vec![8191], 16, 2048),
        (64, 512, 8192, vec![8189, 8190, 8191], 16, 2048),
        (64, 512, 1500, vec![1499], 16, 2048),
        // Prompt chunks (mla_attend_shared): GLM-5.3-Flash's, dense and sparse; heads under
        // one tile and over it, widths that are no multiple of the kernel's tiles.
        (64, 512, 2300, (2200..2300).collect(), 16, 2048),
        (64, 512, 700, (600..700).collect(), 16, 2048),
        (5, 72, 300, (220..300).collect(), 4, 64),
        (70, 40, 200, (130..200).collect(), 4, 256),
    ];
    // The last shape again over a bf16 cache (its 8-byte loads of the latents), against the
    // CPU on the same rounded values.
    let bf16_chunk = (64, 512, 2300, (2200..2300).collect(), 16, 2048);
    let scale = 256f32.powf(-0.5);
    let shapes = absorbed.into_iter().map(|s| (s, false));
    for ((heads, rank, cached, positions, kpool, topk), bf16) in shapes.chain([(bf16_chunk, true)])
    {
        let mut latents = randn(rng, cached * rank, 1.7);
        if bf16 {
            latents
                .iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
        let sel: Vec<Vec<u32>> = positions
            .iter()
            .map(|&p| random_selection(rng, p + 1, kpool, topk))
            .collect();
        let q = randn(rng, positions.len() * heads * rank, 4.0);
        let layout = AttnLayout::absorbed(heads, rank, scale);
        let want = sparse_attention(&q, &latents, &layout, &sel);
        let got = if bf16 {
            mla_bf16_cache(cuda, &q, &latents, &layout, &sel)?
        } else {
            cuda.mla_sparse_attend(&q, &latents, &layout, &sel)?
        };
        cases.push(case(
            format!(
                "mla absorbed h{heads} r{rank} T={cached} q={} picks={}{}",
                positions.len(),
                sel[0].len(),
                if bf16 { " bf16 cache" } else { "" }
            ),
            &got,
            &want,
            F32_BOUND,
        ));
    }
    // (heads, nope, v_dim, tokens, new tokens at the end, kpool, topk)
    let expanded = [
        (3usize, 24usize, 20usize, 50usize, 7usize, 4usize, 16usize),
        (64, 256, 256, 600, 5, 16, 256),
        (64, 256, 256, 600, 3, 16, 2048),
    ];
    for (heads, nope, vd, tokens, new, kpool, topk) in expanded {
        let layout = AttnLayout::expanded(heads, nope, vd, (nope as f32).powf(-0.5));
        let kv = randn(rng, tokens * layout.stride, 1.7);
        let sel: Vec<Vec<u32>> = (tokens - new..tokens)
            .map(|p| random_selection(rng, p + 1, kpool, topk))
            .collect();
        let q = randn(rng, new * heads * nope, 2.0);
        let want = sparse_attention(&q, &kv, &layout, &sel);
        let got = cuda.mla_sparse_attend(&q, &kv, &layout, &sel)?;
        cases.push(case(
            format!("mla expanded h{heads} nope{nope} v{vd} T={tokens} new={new} topk={topk}"),
            &got,
            &want,
            F32_BOUND,
        ));
    }
    Ok(())
}

/// `Cuda::mla_sparse_attend` over a bf16 cache holding `latents` (values bf16 already holds).
fn mla_bf16_cache(
    cuda: &Cuda,
    q: &[f32],
    latents: &[f32],
    layout: &AttnLayout,
    sel: &[Vec<u32>],
) -> anyhow::Result<Vec<f32>> {
    use crate::model::device::CacheDtype;
    let bytes: Vec<u8> = latents
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    let mut offsets = vec![0usize];
    for s in sel {
        offsets.push(offsets[offsets.len() - 1] + s.len());
    }
    let (d_q, kv) = (cuda.upload(q)?, cuda.upload(&bytes)?);
    let tokens = cuda.upload(&sel.concat())?;
    let mut out = cuda.alloc_f32(q.len())?;
    let cache = (&kv, CacheDtype::Bf16);
    cuda.mla_sparse_attend_part_dev(&d_q, cache, layout, &tokens, &offsets, &mut out)?;
    let mut got = cuda.download(&out)?;
    got.truncate(q.len());
    Ok(got)
}

/// A decode step's attention for several sequences in one launch (`mla_sparse_attend_seqs`:
/// each query over its own cache and selection through address tables) against each sequence
/// alone through `mla_sparse_attend_part_dev`: the same bits, for f32 and bf16 caches.
pub(super) fn check_mla_seqs(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    use crate::backend::cuda::attn::DeviceSelections;
    use crate::model::device::CacheDtype;
    // (heads, rank, each sequence's cached tokens, kpool, topk)
    let shapes = [
        (5usize, 72usize, vec![37usize, 300, 5], 4usize, 64usize),
        (64, 512, vec![1500, 8192, 40, 700], 16, 2048),
    ];
    let scale = 256f32.powf(-0.5);
    for (heads, rank, lens, kpool, topk) in shapes {
        let layout = AttnLayout::absorbed(heads, rank, scale);
        let n = lens.len();
        let q = randn(rng, n * heads * rank, 4.0);
        for dtype in [CacheDtype::F32, CacheDtype::Bf16] {
            let mut caches = Vec::with_capacity(n);
            let mut sels = Vec::with_capacity(n);
            for &len in &lens {
                let values = randn(rng, len * rank, 1.7);
                let bytes: Vec<u8> = match dtype {
                    CacheDtype::Bf16 => values
                        .iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                        .collect(),
                    _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                caches.push(cuda.upload(&bytes)?);
                // A selection behind a few leading tokens, as a window of a longer buffer.
                let sel = random_selection(rng, len, kpool, topk);
                let lead: Vec<u32> = vec![0, 1, 2];
                sels.push(DeviceSelections {
                    tokens: cuda.upload(&[lead.clone(), sel.clone()].concat())?,
                    offsets: vec![lead.len(), lead.len() + sel.len()],
                    planned: None,
                });
            }
            let row = heads * rank;
            let mut want = Vec::with_capacity(n * row);
            for (s, (kv, sel)) in caches.iter().zip(&sels).enumerate() {
                let qs = cuda.upload(&q[s * row..(s + 1) * row])?;
                let mut out = cuda.alloc_f32(row)?;
                cuda.mla_sparse_attend_part_dev(
                    &qs,
                    (kv, dtype),
                    &layout,
                    &sel.tokens,
                    &sel.offsets,
                    &mut out,
                )?;
                want.extend(cuda.download(&out)?.into_iter().take(row));
            }
            let seqs: Vec<_> = caches.iter().map(|kv| (kv, dtype)).zip(&sels).collect();
            let (d_q, mut out) = (cuda.upload(&q)?, cuda.alloc_f32(n * row)?);
            cuda.mla_sparse_attend_seqs(&d_q, &seqs, &layout, &mut out)?;
            let mut got = cuda.download(&out)?;
            got.truncate(n * row);
            cases.push(same_bits_case(
                format!("mla_sparse_attend_seqs h{heads} r{rank} {n} seqs {dtype:?}: same bits"),
                &got,
                &want,
            ));
        }
    }
    Ok(())
}

/// The DSA indexer: pool keys, and selections that must equal the CPU's exactly, ties
/// included (duplicated pool keys, all-zero scores).
pub(super) fn check_dsa(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    struct Shape {
        heads: usize,
        dim: usize,
        kpool: usize,
        topk: usize,
        tokens: usize,
        select_tail: bool,
    }
    let shapes = [
        Shape {
            heads: 2,
            dim: 20,
            kpool: 4,
            topk: 16,
            tokens: 37,
            select_tail: true,
        },
        Shape {
            heads: 1,
            dim: 20,
            kpool: 3,
            topk: 9,
            tokens: 50,
            select_tail: false,
        },
        Shape {
            heads: 40,
            dim: 36,
            kpool: 4,
            topk: 64,
            tokens: 1000,
            select_tail: true,
        },
        Shape {
            heads: 32,
            dim: 128,
            kpool: 16,
            topk: 2048,
            tokens: 8192,
            select_tail: true,
        },
        Shape {
            heads: 32,
            dim: 128,
            kpool: 16,
            topk: 2048,
            tokens: 8199,
            select_tail: true,
        },
    ];
    for sh in shapes {
        let (di, kpool) = (sh.dim, sh.kpool);
        let pools = sh.tokens / kpool;
        let keys = randn(rng, sh.tokens * di, 1.7);
        let gates = randn(rng, sh.tokens * di, 3.0);
        let ape = randn(rng, kpool * di, 1.0);
        let mut want_keys = Vec::with_capacity(pools * di);
        for p in 0..pools {
            let rows = p * kpool * di..(p + 1) * kpool * di;
            want_keys.extend(pool_key(&keys[rows.clone()], &gates[rows], &ape, di, kpool));
        }
        // In two launches, as pools complete over time.
        let half = pools / 2;
        let mut got_keys = cuda.dsa_pool_keys(&keys, &gates, &ape, kpool, 0, half)?;
        got_keys.extend(cuda.dsa_pool_keys(&keys, &gates, &ape, kpool, half, pools - half)?);
        let name = format!(
            "dsa h{} d{di} kpool{kpool} topk{} T={}",
            sh.heads, sh.topk, sh.tokens
        );
        cases.push(case(
            format!("{name} pool keys"),
            &got_keys,
            &want_keys,
            F32_BOUND,
        ));

        // Selections from the CPU's pool keys, so both sides score the same numbers. Ties:
        // every other pool of the last two thirds carries pool 3's key (more of them than
        // the budget on the wide shapes), query 4 scores those best, and query 3 scores
        // every pool -0.0.
        let mut pool_keys = want_keys;
        let dup = pool_keys[3 * di..4 * di].to_vec();
        for p in (pools / 3..pools).step_by(2) {
            pool_keys[p * di..(p + 1) * di].copy_from_slice(&dup);
        }
        let t = sh.tokens;
        let positions = vec![
            0usize,
            kpool - 1,
            kpool,
            t / 2 + 1,
            t - 2,
            sh.topk.min(t - 1),
            t - 1,
        ];
        let queries = positions.len();
        let (hd, h) = (sh.heads * di, sh.heads);
        let mut q = randn(rng, queries * hd, 1.0);
        let mut w = randn(rng, queries * h, 1.0);
        // All-zero dots and negative weights: every term, so every score, is -0.0.
        q[3 * hd..4 * hd].fill(0.0);
        w[3 * h..4 * h].iter_mut().for_each(|v| *v = -v.abs() - 0.1);
        for head in 0..h {
            q[4 * hd + head * di..4 * hd + (head + 1) * di].copy_from_slice(&dup);
        }
        w[4 * h..5 * h].iter_mut().for_each(|v| *v = v.abs() + 0.1);
        let want: Vec<Vec<u32>> = positions
            .iter()
            .enumerate()
            .map(|(i, &pos)| {
                let cand = ((pos + 1) / kpool).min(pools);
                let scores = pool_scores(
                    &q[i * sh.heads * di..(i + 1) * sh.heads * di],
                    &w[i * sh.heads..(i + 1) * sh.heads],
                    &pool_keys[..cand * di],
                    di,
                );
                select_tokens(&scores, sh.topk, kpool, pos + 1, sh.select_tail)
            })
            .collect();
        let spec = DsaSpec {
            heads: sh.heads,
            dim: di,
            kpool,
            topk: sh.topk,
            select_tail: sh.select_tail,
        };
        let got = cuda.dsa_select(&q, &w, &pool_keys, spec, &positions)?;
        cases.push(exact_case(
            format!("{name} select {queries} queries"),
            got == want,
        ));
        // Decode: the last position alone, as one step asks.
        let last = queries - 1;
        let got = cuda.dsa_select(
            &q[last * sh.heads * di..],
            &w[last * sh.heads..],
            &pool_keys,
            spec,
            &positions[last..],
        )?;
        cases.push(exact_case(
            format!("{name} select decode"),
            got[..] == want[last..],
        ));
    }
    Ok(())
}
