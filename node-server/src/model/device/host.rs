//! The host device: buffers are `Vec<f32>` in RAM (caches [`CacheRows`] in their dtype),
//! weights the CPU backend's [`Matrix`], every op the CPU reference the GPU is checked
//! against.

use super::*;
use crate::backend::cpu::ops;
use crate::model::{dsa, kda, mhc, mla, moe};

/// The CPU: values in host memory, products through the CPU backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct Host;

fn span(first: usize, count: usize, width: usize) -> std::ops::Range<usize> {
    first * width..(first + count) * width
}

impl Device for Host {
    type Buf = Vec<f32>;
    type Mat = Matrix;
    type Table = Matrix;
    type Grow = CacheRows;
    type Sel = mla::Selections;

    fn matrix(&self, m: &Matrix) -> anyhow::Result<Matrix> {
        Ok(m.clone())
    }

    fn table(&self, m: &Matrix) -> anyhow::Result<Matrix> {
        Ok(m.clone())
    }

    fn mat_rows(m: &Matrix) -> usize {
        m.rows()
    }

    fn upload(&self, values: &[f32]) -> anyhow::Result<Vec<f32>> {
        Ok(values.to_vec())
    }

    fn download(&self, b: &Vec<f32>) -> anyhow::Result<Vec<f32>> {
        Ok(b.clone())
    }

    fn take(&self, values: Vec<f32>) -> anyhow::Result<Vec<f32>> {
        Ok(values)
    }

    fn download_owned(&self, b: Vec<f32>) -> anyhow::Result<Vec<f32>> {
        Ok(b)
    }

    fn zeros(&self, n: usize) -> anyhow::Result<Vec<f32>> {
        Ok(vec![0f32; n])
    }

    fn grow(&self, values: &CacheRows, _spare: usize) -> anyhow::Result<CacheRows> {
        Ok(values.clone())
    }

    fn grow_download(&self, g: &CacheRows) -> anyhow::Result<CacheRows> {
        Ok(g.clone())
    }

    fn selections(&self, sel: &[Vec<u32>]) -> anyhow::Result<mla::Selections> {
        Ok(sel.to_vec())
    }

    fn selections_download(&self, sel: &mla::Selections) -> anyhow::Result<Vec<Vec<u32>>> {
        Ok(sel.clone())
    }

    fn grow_len(g: &CacheRows) -> usize {
        g.len()
    }

    fn push(
        &self,
        g: &mut CacheRows,
        src: &Vec<f32>,
        first: usize,
        count: usize,
        width: usize,
    ) -> anyhow::Result<()> {
        g.push(&src[span(first, count, width)]);
        Ok(())
    }

    fn rows(
        &self,
        src: &Vec<f32>,
        first: usize,
        count: usize,
        width: usize,
    ) -> anyhow::Result<Vec<f32>> {
        Ok(src[span(first, count, width)].to_vec())
    }

    fn put_rows(
        &self,
        dst: &mut Vec<f32>,
        first: usize,
        width: usize,
        src: &Vec<f32>,
    ) -> anyhow::Result<()> {
        dst[first * width..first * width + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn matmul(&self, w: &Matrix, x: &Vec<f32>, n: usize) -> anyhow::Result<Vec<f32>> {
        Ok(w.matmul(x, n))
    }

    fn rms_norm(
        &self,
        x: &mut Vec<f32>,
        weight: Option<&Vec<f32>>,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<()> {
        ops::rms_norm(x, weight.map(|w| w.as_slice()), width, eps);
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &mut Vec<f32>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        _width: usize,
        eps: f32,
        _rows: usize,
    ) -> anyhow::Result<()> {
        ops::layer_norm(x, weight, bias, eps);
        Ok(())
    }

    fn gated_rms_norm(
        &self,
        x: &mut Vec<f32>,
        gate: &Vec<f32>,
        weight: &Vec<f32>,
        width: usize,
        eps: f32,
    ) -> anyhow::Result<()> {
        for (o, g) in x.chunks_exact_mut(width).zip(gate.chunks_exact(width)) {
            ops::rms_norm(o, Some(weight), width, eps);
            o.iter_mut()
                .zip(g)
                .for_each(|(o, g)| *o *= ops::sigmoid(*g));
        }
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32, count: usize) -> anyhow::Result<()> {
        x[..count].iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn add(&self, y: &mut Vec<f32>, x: &Vec<f32>, count: usize) -> anyhow::Result<()> {
        y[..count]
            .iter_mut()
            .zip(&x[..count])
            .for_each(|(o, s)| *o += s);
        Ok(())
    }

    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>, limit: f32) -> anyhow::Result<Vec<f32>> {
        Ok(crate::model::mlp::swiglu(gate, up, limit))
    }

    fn interleave3(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        n: usize,
        c: usize,
    ) -> anyhow::Result<Vec<f32>> {
        let mut qkv = vec![0f32; n * 3 * c];
        for (t, row) in qkv.chunks_exact_mut(3 * c).enumerate() {
            for (dst, part) in row.chunks_exact_mut(c).zip([q, k, v]) {
                dst.copy_from_slice(&part[t * c..(t + 1) * c]);
            }
        }
        Ok(qkv)
    }

    fn mhc_collapse(
        &self,
        spec: MhcSpec,
        logits: &Vec<f32>,
        base: &Vec<f32>,
        streams: &Vec<f32>,
        t: usize,
    ) -> anyhow::Result<MhcCollapse<Vec<f32>>> {
        Ok(mhc::collapse_mix(spec, logits, base, streams, t))
    }

    fn mhc_expand(
        &self,
        spec: MhcSpec,
        post: &Vec<f32>,
        comb: &Vec<f32>,
        streams: &Vec<f32>,
        y: &Vec<f32>,
        t: usize,
    ) -> anyhow::Result<Vec<f32>> {
        Ok(mhc::expand(spec, post, comb, streams, y, t))
    }

    fn kda_gates(
        &self,
        spec: KdaGates,
        g: &mut Vec<f32>,
        dt_bias: &Vec<f32>,
        a_log: &Vec<f32>,
        beta: &mut Vec<f32>,
        rows: usize,
    ) -> anyhow::Result<()> {
        kda::gates(spec, g, dt_bias, a_log, rows);
        beta.iter_mut().for_each(|b| *b = ops::sigmoid(*b));
        Ok(())
    }

    fn kda_conv(
        &self,
        spec: KdaSpec,
        taps: &Vec<f32>,
        qkv: &Vec<f32>,
        first: usize,
        len: usize,
        state: &mut Vec<f32>,
    ) -> anyhow::Result<Vec<f32>> {
        let w = 3 * spec.channels();
        Ok(kda::conv_step(
            taps,
            spec.kernel,
            &qkv[span(first, len, w)],
            len,
            state,
        ))
    }

    fn kda_delta(
        &self,
        spec: KdaSpec,
        mode: KdaMode,
        mixed: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        first: usize,
        len: usize,
        state: &mut Vec<f32>,
    ) -> anyhow::Result<Vec<f32>> {
        let (h, c) = (spec.heads, spec.channels());
        Ok(kda::attend(
            mixed,
            &g[span(first, len, c)],
            &beta[span(first, len, h)],
            h,
            spec.head_dim,
            state,
            mode,
        ))
    }

    fn mla_attend(
        &self,
        spec: MlaSpec,
        path: MlaPath,
        kv_b: &Matrix,
        q: &Vec<f32>,
        first: usize,
        len: usize,
        latents: &CacheRows,
        sel: &mla::Selections,
    ) -> anyhow::Result<Vec<f32>> {
        let latents = latents.to_f32();
        let q_span = &q[span(first, len, spec.heads * spec.nope)];
        let absorbed = match path {
            MlaPath::Auto => len == 1,
            MlaPath::Absorbed => true,
            MlaPath::Expanded => false,
        };
        Ok(if absorbed {
            mla::attend_absorbed(spec, kv_b, q_span, len, &latents, sel)
        } else {
            let past = latents.len() / spec.rank - len;
            mla::attend_expanded(spec, kv_b, q_span, len, past, &latents, sel)
        })
    }

    fn dsa_pools(
        &self,
        spec: DsaSpec,
        ape: &Vec<f32>,
        keys: &CacheRows,
        gates: &CacheRows,
        pool_keys: &mut CacheRows,
    ) -> anyhow::Result<()> {
        let (di, kpool) = (spec.dim, spec.kpool);
        let tokens = keys.len() / di;
        let mut pool = pool_keys.len() / di;
        while (pool + 1) * kpool <= tokens {
            let rows = pool * kpool * di..(pool + 1) * kpool * di;
            let (k, g) = (keys.f32s(rows.clone()), gates.f32s(rows));
            pool_keys.push(&dsa::pool_key(&k, &g, ape, di, kpool));
            pool += 1;
        }
        Ok(())
    }

    fn dsa_select(
        &self,
        spec: DsaSpec,
        q: &Vec<f32>,
        weights: &Vec<f32>,
        first: usize,
        len: usize,
        pos: usize,
        pool_keys: &CacheRows,
    ) -> anyhow::Result<mla::Selections> {
        let (di, hi) = (spec.dim, spec.heads);
        let pool_keys = pool_keys.to_f32();
        Ok((0..len)
            .map(|i| {
                let row = first + i;
                let visible = pos + i + 1;
                let candidates = (visible / spec.kpool).min(pool_keys.len() / di);
                let scores = dsa::pool_scores(
                    &q[row * hi * di..(row + 1) * hi * di],
                    &weights[row * hi..(row + 1) * hi],
                    &pool_keys[..candidates * di],
                    di,
                );
                dsa::select_tokens(&scores, spec.topk, spec.kpool, visible, spec.select_tail)
            })
            .collect())
    }

    fn route(
        &self,
        weight: &Matrix,
        bias: &Vec<f32>,
        spec: RouteSpec,
        x: &Vec<f32>,
        n: usize,
    ) -> anyhow::Result<(Vec<u32>, Vec<f32>)> {
        let logits = weight.matmul(x, n);
        Ok(moe::choose(spec, bias, &logits, n))
    }

    fn experts(
        &self,
        experts: &dyn ExpertProvider,
        layer: usize,
        x: &Vec<f32>,
        routing: &Routing,
        hidden: usize,
    ) -> anyhow::Result<Vec<f32>> {
        let mut out = vec![0f32; routing.tokens() * hidden];
        experts.forward(layer, x, routing, &mut out)?;
        Ok(out)
    }

    fn stream_mean(
        &self,
        streams: &Vec<f32>,
        rows: &[usize],
        n: usize,
        d: usize,
    ) -> anyhow::Result<Vec<f32>> {
        let mut h = Vec::with_capacity(rows.len() * d);
        for &r in rows {
            let s = &streams[r * n * d..(r + 1) * n * d];
            h.extend((0..d).map(|k| (0..n).map(|i| s[i * d + k]).sum::<f32>() / n as f32));
        }
        Ok(h)
    }
}
