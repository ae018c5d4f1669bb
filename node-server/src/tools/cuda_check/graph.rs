//! Decode steps replayed as CUDA graphs against the same steps run op by op: the same bits
//! (`gpu/graph.rs`). First the indexer's step ops, which read a replay's position on the
//! device, against the ops the host sizes; then whole models with every expert in VRAM, one
//! sequence past its caches' room (a grown cache is a new graph) and batches whose members
//! change.

use super::*;
use crate::backend::CacheDtype;
use crate::tiers::vram::load_model_on_gpu;

/// Decode steps of the lone sequence: past the room its caches are placed with.
const ALONE_STEPS: usize = CACHE_SPARE_TOKENS + 24;
const BATCH_STEPS: usize = 12;

pub(super) fn check_graph(
    cuda: &Arc<Cuda>,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    for dtype in [CacheDtype::F32, CacheDtype::Bf16] {
        step_op_cases(cuda, rng, dtype, cases)?;
    }
    let dir = std::env::temp_dir().join(format!("glmflash-graph-check-{}", std::process::id()));
    let result = (|| -> anyhow::Result<()> {
        // Pools of 4 with a budget of 2: the indexer chooses among many.
        let random = dir.join("random");
        let mut config = scaled_config(512, 256, 8, 1, 16, 256, 4);
        config["index_topk"] = serde_json::json!(8);
        config["index_kpool"] = serde_json::json!(4);
        write_random_checkpoint(&random, &config, rng.random(), DType::F32)?;
        let (model, _) = load_model_on_gpu(&random, cuda.clone(), false)?;
        graph_cases(cuda, &model, "random f32 kpool 4", rng, cases)?;

        let demo = dir.join("demo");
        crate::demo::make_demo_model(&demo, crate::demo::DEFAULT_SEED)?;
        let (model, _) = load_model_on_gpu(&demo, cuda.clone(), false)?;
        graph_cases(cuda, &model, "demo bf16", rng, cases)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Bytes of `values` as a cache of `dtype` holds them.
fn cache_bytes(values: &[f32], dtype: CacheDtype) -> Vec<u8> {
    match dtype {
        CacheDtype::Bf16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        CacheDtype::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        CacheDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// `dsa_pool_step` and `dsa_select_step` at several step counts against `dsa_pool_keys_dev`
/// with `cache_store`, and `dsa_select_dev`, at the positions those counts stand for.
fn step_op_cases(
    cuda: &Cuda,
    rng: &mut ChaCha8Rng,
    dtype: CacheDtype,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let (heads, di, kpool, topk, tokens) = (4, 20, 4, 8, 64);
    let room_pools = tokens / kpool;
    let keys = cuda.upload(&cache_bytes(&randn(rng, tokens * di, 1.7), dtype))?;
    let gates = cuda.upload(&cache_bytes(&randn(rng, tokens * di, 3.0), dtype))?;
    let ape = cuda.upload(&randn(rng, kpool * di, 1.0))?;
    let pool_bytes = room_pools * di * dtype.bytes();
    let (mut by_host, mut by_step) = (
        cuda.stream().alloc_zeros::<u8>(pool_bytes)?,
        cuda.stream().alloc_zeros::<u8>(pool_bytes)?,
    );
    let mut step = cuda.stream().alloc_zeros::<i32>(1)?;
    let name = format!("graph step ops {}", dtype.name());
    // The keys hold 21 + r tokens at step r: pools complete at r = 3, 7, 11, ...
    let first = 21;
    for r in 0..tokens - first {
        let held = first + r;
        if held.is_multiple_of(kpool) {
            let pool = held / kpool - 1;
            let mut key = cuda.alloc_f32(di)?;
            cuda.dsa_pool_keys_dev((&keys, &gates, dtype), &ape, kpool, pool, 1, &mut key)?;
            cuda.cache_store(&key.slice(..), &mut by_host, dtype, pool * di, di, None)?;
        }
        cuda.fill_bits(&mut step, r as u32)?;
        cuda.dsa_pool_step(
            (&keys, &gates, dtype),
            &ape,
            kpool,
            first,
            &step,
            &mut by_step,
        )?;
    }
    let same = cuda.download(&by_host)? == cuda.download(&by_step)?;
    cases.push(exact_case(format!("{name} pool keys"), same));

    let spec = DsaSpec {
        heads,
        dim: di,
        kpool,
        topk,
        select_tail: true,
    };
    let pool_keys = (&by_host, dtype);
    let (q, w) = (
        cuda.upload(&randn(rng, heads * di, 1.0))?,
        cuda.upload(&randn(rng, heads, 1.0))?,
    );
    let (mut want, mut got) = (Vec::new(), Vec::new());
    for r in [0, 1, 2, 3, 17, 30] {
        let pos = first - 1 + r;
        let pools = (pos + 1) / kpool;
        let sel = cuda.dsa_select_dev(&q, &w, pool_keys, pools, spec, &[pos])?;
        let flat = cuda.download(&sel.tokens)?;
        want.push(flat[sel.offsets[0]..sel.offsets[1]].to_vec());
        cuda.fill_bits(&mut step, r as u32)?;
        let sel = cuda.dsa_select_step(&q, &w, pool_keys, room_pools, spec, first - 1, 1, &step)?;
        let planned = sel.planned.as_ref().expect("planned on the device");
        let off = cuda.download(&planned.offsets)?;
        let flat = cuda.download(&sel.tokens)?;
        got.push(flat[off[0] as usize..off[1] as usize].to_vec());
    }
    cases.push(exact_case(format!("{name} selections"), got == want));
    Ok(())
}

/// Two decoders on `model` (its experts in VRAM, shared experts on a second stream), one
/// replaying graphs and one op by op, fed the same tokens: the same logits' bits at every
/// step and the same caches after.
fn graph_cases(
    cuda: &Arc<Cuda>,
    model: &Model,
    name: &str,
    rng: &mut ChaCha8Rng,
    cases: &mut Vec<Case>,
) -> anyhow::Result<()> {
    let graphs = GpuDecoder::with_side_stream(cuda, model, true)?;
    let eager = GpuDecoder::with_side_stream(cuda, model, true)?;
    graphs.dev().set_decode_graphs(true);
    eager.dev().set_decode_graphs(false);
    let vocab = model.cfg.vocab_size as u32;
    let (mut a, mut b, mut next) = (Vec::new(), Vec::new(), Vec::new());
    for len in [40, 23, 1] {
        let prompt: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
        let (logits, cache) = model.prefill(&prompt)?;
        next.push(ops::argmax(&logits) as u32);
        a.push(graphs.sequence(&cache)?);
        b.push(eager.sequence(&cache)?);
    }
    // Alone, past the caches' room.
    let (mut failed, mut token) = (0, next[0]);
    for _ in 0..ALONE_STEPS {
        let got = graphs.step(model, &mut a[0], token)?;
        let want = eager.step(model, &mut b[0], token)?;
        failed += usize::from(
            got.iter()
                .map(|v| v.to_bits())
                .ne(want.iter().map(|v| v.to_bits())),
        );
        token = ops::argmax(&want) as u32;
    }
    cases.push(exact_case(
        format!("{name}: {ALONE_STEPS} steps of one sequence, same bits ({failed} differ)"),
        failed == 0,
    ));
    next[0] = token;
    // Three together, then the last two (a new layout each).
    for members in [0..3, 1..3] {
        for step in 0..BATCH_STEPS {
            let toks = next[members.clone()].to_vec();
            let mut sa: Vec<&mut SeqCache<Gpu>> = a[members.clone()].iter_mut().collect();
            let mut sb: Vec<&mut SeqCache<Gpu>> = b[members.clone()].iter_mut().collect();
            let got = graphs.step_batch(model, &mut sa, &toks)?;
            let want = eager.step_batch(model, &mut sb, &toks)?;
            let same = bits(&got) == bits(&want);
            cases.push(exact_case(
                format!("{name}: batch {members:?} step {step}"),
                same,
            ));
            for (i, wv) in members.clone().zip(&want) {
                next[i] = ops::argmax(wv) as u32;
            }
        }
    }
    for (i, (ga, gb)) in a.iter().zip(&b).enumerate() {
        let same = graphs.to_host(ga)? == eager.to_host(gb)?;
        cases.push(exact_case(format!("{name}: sequence {i}'s caches"), same));
    }
    // One capture per layout: the lone sequence's two (its caches grow once), the two
    // batches', and a batch's again where a member's caches grow; every other step a replay.
    let (captures, replays) = graphs.dev().graph_counts();
    let steps = (ALONE_STEPS + 2 * BATCH_STEPS) as u64;
    cases.push(exact_case(
        format!("{name}: {captures} graphs captured, {replays} replayed, of {steps} steps"),
        (4..=8).contains(&captures) && captures + replays == steps,
    ));
    let (c, r) = eager.dev().graph_counts();
    cases.push(exact_case(
        format!("{name}: none op by op"),
        (c, r) == (0, 0),
    ));
    Ok(())
}

fn bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.concat().iter().map(|x| x.to_bits()).collect()
}
