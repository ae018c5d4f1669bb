//! MLA's weight absorption around the GPU's sparse attention (see `mla.rs`).

use super::*;

impl Gpu {
    /// Absorbed MLA attention for query rows `first .. first + len` of `q` (`[.., heads,
    /// nope]`), in launches of at most `per` rows: each launch absorbs its rows' queries,
    /// `attend(a, m, q_lat, o_lat)` attends rows `a .. a + m` (counted from `first`), and the
    /// values are absorbed out into `[len, heads, v_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn absorbed(
        &self,
        spec: MlaSpec,
        kv_b: &Buf,
        q: &Buf,
        first: usize,
        len: usize,
        per: usize,
        attend: impl Fn(usize, usize, &Buf, &mut Buf) -> anyhow::Result<()>,
    ) -> anyhow::Result<Buf> {
        let cuda = &*self.cuda;
        let MlaSpec {
            heads: h,
            nope,
            v_dim: vd,
            rank: r,
        } = spec;
        let mut attn = self.alloc(len * h * vd)?;
        for a in (0..len).step_by(per.max(1)) {
            let m = per.min(len - a);
            let t0 = first + a;
            let mut q_lat = self.alloc(m * h * r)?;
            let qi = q.slice(t0 * h * nope..(t0 + m) * h * nope);
            cuda.mla_absorb_q(&qi, kv_b, h, nope, vd, r, m, &mut q_lat)?;
            let mut o_lat = self.alloc(m * h * r)?;
            attend(a, m, &q_lat, &mut o_lat)?;
            let mut dst = attn.slice_mut(a * h * vd..(a + m) * h * vd);
            cuda.mla_absorb_out(&o_lat, kv_b, h, nope, vd, r, m, &mut dst)?;
        }
        Ok(attn)
    }
}
