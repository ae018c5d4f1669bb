//! The router and the routed experts on the GPU: `route`, the fused MoE launches over expert
//! slots, and the slot arena they read.

use super::groups::{GROUP_MAX_PICKS, GroupTables, PickGroups};
use super::*;
use crate::quant::exl3::{Codebook, Rate};
use cudarc::driver::CudaView;

impl Cuda {
    /// The router's choice from its logits (`[tokens, experts]`): ids and weights `[tokens, k]`.
    pub fn route(
        &self,
        logits: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        spec: RouteSpec,
        tokens: usize,
    ) -> Result<(Vec<u32>, Vec<f32>), CudaError> {
        if tokens == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let (ids, weights) = self.route_dev(logits, bias, spec, tokens)?;
        let ids = self.download(&ids)?.into_iter().map(|i| i as u32).collect();
        Ok((ids, self.download(&weights)?))
    }

    /// [`Cuda::route`] leaving the ids (int32) and weights on the device.
    pub fn route_dev(
        &self,
        logits: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        spec: RouteSpec,
        tokens: usize,
    ) -> Result<(CudaSlice<i32>, CudaSlice<f32>), CudaError> {
        let RouteSpec {
            experts,
            groups,
            topk_groups,
            k,
            normalize,
            scale,
        } = spec;
        if experts > 1024
            || groups == 0
            || experts % groups != 0
            || k > experts
            || logits.len() < tokens * experts
            || bias.len() != experts
            || tokens == 0
        {
            return Err(CudaError::Invalid(format!(
                "route: {spec:?} for {tokens} tokens"
            )));
        }
        // SAFETY: the kernel writes all `k` ids and weights of every token.
        let mut ids = unsafe { self.stream.alloc::<i32>(tokens * k) }?;
        let mut weights = self.alloc_f32(tokens * k)?;
        let (e, g, tg, k_i, norm) = (
            experts as i32,
            groups as i32,
            topk_groups as i32,
            k as i32,
            normalize as i32,
        );
        let mut b = self.stream.launch_builder(self.kernel("route"));
        b.arg(logits)
            .arg(bias)
            .arg(&e)
            .arg(&g)
            .arg(&tg)
            .arg(&k_i)
            .arg(&norm)
            .arg(&scale)
            .arg(&mut ids)
            .arg(&mut weights);
        let cfg = LaunchConfig {
            grid_dim: (tokens as u32, 1, 1),
            // router.cu's ROUTE_THREADS.
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: experts <= 1024 (the kernel's shared arrays), buffers sized above.
        unsafe { b.launch(cfg) }?;
        Ok((ids, weights))
    }

    /// The routed-expert step with the router's picks on the device (`ids`, `weights`:
    /// `[tokens, k]` from [`Cuda::route_dev`]) and every expert of the layer in `arena`
    /// (`slot_of`: each expert's slot): the picks are grouped by a launch, so nothing comes
    /// to the host. Same bits as [`Cuda::moe_picks`] then [`Cuda::moe_combine`] on the same
    /// picks. At most [`GROUP_MAX_PICKS`] picks.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_routed(
        &self,
        arena: &CudaSlice<u8>,
        layout: MoeLayout,
        limit: f32,
        x: &CudaSlice<f32>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        slot_of: &CudaView<'_, i32>,
        tokens: usize,
        k: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        if weights.len() < tokens * k {
            return Err(CudaError::Invalid(format!(
                "moe step of {tokens} x {k} picks with {} weights",
                weights.len()
            )));
        }
        let tables = GroupTables::on_device(
            self,
            ids,
            slot_of,
            slot_of.len(),
            tokens,
            k,
            layout.slot_bytes,
        )?;
        let mut run = self.moe_begin_dev(layout, tokens, k, x)?;
        self.moe_grouped(&mut run, arena, limit, &tables)?;
        self.moe_combine_dev(run, weights)
    }

    /// Whether [`Cuda::moe_routed`] takes a step of `picks` picks: one grouping launch
    /// holds at most [`GROUP_MAX_PICKS`].
    pub fn moe_routes(picks: usize) -> bool {
        picks > 0 && picks <= GROUP_MAX_PICKS
    }

    /// The routed-expert step for expert records already in `arena`; see [`MoeStep`].
    pub fn moe(
        &self,
        arena: &CudaSlice<u8>,
        step: &MoeStep,
        x: &[f32],
    ) -> Result<Vec<f32>, CudaError> {
        step.check(arena.len(), x.len())?;
        let mut run = self.moe_begin(step.layout, step.tokens, step.k, x)?;
        let picks: Vec<(usize, u32)> = step.slots.iter().copied().enumerate().collect();
        self.moe_picks(&mut run, arena, step.limit, &picks)?;
        self.moe_finish(run, step.weights)
    }

    /// Starts a routed-expert step over `tokens` rows of `x` with `k` picks each: per-pick
    /// outputs are filled by [`Cuda::moe_picks`] (GPU) or [`Cuda::moe_set_rows`] (computed
    /// elsewhere), then [`Cuda::moe_finish`] combines them in pick order.
    pub fn moe_begin(
        &self,
        layout: MoeLayout,
        tokens: usize,
        k: usize,
        x: &[f32],
    ) -> Result<MoeRun, CudaError> {
        if x.len() != tokens * layout.hidden {
            return Err(CudaError::Invalid(format!(
                "moe step of {tokens} tokens of {}: {} inputs",
                layout.hidden,
                x.len()
            )));
        }
        Ok(MoeRun {
            layout,
            tokens,
            k,
            x: self.stream.clone_htod(x)?,
            yp: self.alloc_f32(tokens * k * layout.hidden)?,
            act: self.alloc_f32(tokens * k * layout.inter)?,
        })
    }

    /// [`Cuda::moe_begin`] on token rows already on the device (`x`: at least
    /// `tokens * hidden` values).
    pub fn moe_begin_dev(
        &self,
        layout: MoeLayout,
        tokens: usize,
        k: usize,
        x: &CudaSlice<f32>,
    ) -> Result<MoeRun, CudaError> {
        let n = tokens * layout.hidden;
        if x.len() < n {
            return Err(CudaError::Invalid(format!(
                "moe step of {tokens} tokens of {}: {} inputs",
                layout.hidden,
                x.len()
            )));
        }
        let mut rows = self.alloc_f32(n.max(1))?;
        self.stream.memcpy_dtod(&x.slice(..n), &mut rows)?;
        Ok(MoeRun {
            layout,
            tokens,
            k,
            x: rows,
            yp: self.alloc_f32(tokens * k * layout.hidden)?,
            act: self.alloc_f32(tokens * k * layout.inter)?,
        })
    }

    /// Computes the outputs of `picks` (`(pick index t * k + j, arena slot)`) on the GPU.
    /// Each pick's output depends only on its token row, its slot's bytes and how many picks
    /// its slot has in the launch (with [`prompt_gemm`], a row-format slot with
    /// [`MOE_GEMM_MIN_PICKS`] or more goes through cuBLAS), never on which other slots share
    /// the launch.
    pub fn moe_picks(
        &self,
        run: &mut MoeRun,
        arena: &CudaSlice<u8>,
        limit: f32,
        picks: &[(usize, u32)],
    ) -> Result<(), CudaError> {
        let layout = run.layout;
        let slots = arena.len() / layout.slot_bytes.max(1);
        let total = run.tokens * run.k;
        if let Some(bad) = picks
            .iter()
            .find(|(p, s)| *p >= total || *s as usize >= slots)
        {
            return Err(CudaError::Invalid(format!(
                "moe pick {bad:?}: {total} picks, the arena holds {slots} slots"
            )));
        }
        if picks.is_empty() {
            return Ok(());
        }
        // Group the picks by slot, in order of first appearance.
        let mut group_of: HashMap<u32, usize> = HashMap::new();
        let mut members: Vec<Vec<i32>> = Vec::new();
        let mut slot_of_group: Vec<u32> = Vec::new();
        for &(p, s) in picks {
            let g = *group_of.entry(s).or_insert_with(|| {
                members.push(Vec::new());
                slot_of_group.push(s);
                members.len() - 1
            });
            members[g].push(p as i32);
        }
        if prompt_gemm() {
            // Slots with a prompt chunk's worth of picks: their weights widened once (row
            // formats) or decoded once (EXL3) and cuBLAS over the gathered rows; the rest
            // through the fused launches.
            let (big, small): (Vec<usize>, Vec<usize>) =
                (0..members.len()).partition(|&g| members[g].len() >= MOE_GEMM_MIN_PICKS);
            if !big.is_empty() {
                let groups: Vec<(u32, &[i32])> = big
                    .iter()
                    .map(|&g| (slot_of_group[g], members[g].as_slice()))
                    .collect();
                match layout.format {
                    SlotFormat::Rows { gate_up, down } => {
                        self.moe_rows_gemm(run, arena, limit, &groups, gate_up, down)?
                    }
                    SlotFormat::Exl3 { gate_up, down } => {
                        self.moe_exl3_gemm(run, arena, limit, &groups, gate_up, down)?
                    }
                }
                if small.is_empty() {
                    return Ok(());
                }
                let members: Vec<Vec<i32>> = small.iter().map(|&g| members[g].clone()).collect();
                let slots: Vec<u32> = small.iter().map(|&g| slot_of_group[g]).collect();
                let groups = PickGroups::new(&members, &slots, layout.slot_bytes);
                let tables = GroupTables::upload(self, &groups, run.k)?;
                return self.moe_grouped(run, arena, limit, &tables);
            }
        }
        let groups = PickGroups::new(&members, &slot_of_group, layout.slot_bytes);
        let tables = GroupTables::upload(self, &groups, run.k)?;
        self.moe_grouped(run, arena, limit, &tables)
    }

    /// The picks of `tables` on the GPU, by the slots' format.
    fn moe_grouped(
        &self,
        run: &mut MoeRun,
        arena: &CudaSlice<u8>,
        limit: f32,
        tables: &GroupTables,
    ) -> Result<(), CudaError> {
        match run.layout.format {
            SlotFormat::Rows { gate_up, down } => {
                self.moe_rows(run, arena, limit, tables, gate_up, down)
            }
            SlotFormat::Exl3 { gate_up, down } => {
                self.moe_exl3(run, arena, limit, tables, gate_up, down)
            }
        }
    }

    /// Sets the output of pick `pick` to `values` (computed off the GPU, e.g. the CPU lane).
    pub fn moe_set_rows(
        &self,
        run: &mut MoeRun,
        pick: usize,
        values: &[f32],
    ) -> Result<(), CudaError> {
        let h = run.layout.hidden;
        if pick >= run.tokens * run.k || values.len() != h {
            return Err(CudaError::Invalid(format!(
                "moe row {pick} of {} values; {} picks of {h}",
                values.len(),
                run.tokens * run.k
            )));
        }
        let mut dst = run.yp.slice_mut(pick * h..(pick + 1) * h);
        self.stream.memcpy_htod(values, &mut dst)?;
        Ok(())
    }

    /// `out[t] = sum_j weights[t, j] * pick(t * k + j)` in pick order, on the GPU.
    pub fn moe_finish(&self, run: MoeRun, weights: &[f32]) -> Result<Vec<f32>, CudaError> {
        let n = run.tokens * run.layout.hidden;
        if run.tokens == 0 {
            return Ok(Vec::new());
        }
        let out = self.moe_combine(run, weights)?;
        let mut y = self.stream.clone_dtoh(&out)?;
        y.truncate(n);
        Ok(y)
    }

    /// [`Cuda::moe_finish`] leaving the result on the device (`[tokens, hidden]`).
    pub fn moe_combine(&self, run: MoeRun, weights: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        let (tokens, k) = (run.tokens, run.k);
        if weights.len() != tokens * k || tokens == 0 {
            return Err(CudaError::Invalid(format!(
                "moe combine of {tokens} x {k} picks with {} weights",
                weights.len()
            )));
        }
        let d_w = self.stream.clone_htod(weights)?;
        self.moe_combine_dev(run, &d_w)
    }

    /// [`Cuda::moe_combine`] with the weights on the device (`[tokens, k]`).
    pub fn moe_combine_dev(
        &self,
        run: MoeRun,
        d_w: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let (tokens, k, hidden) = (run.tokens, run.k, run.layout.hidden);
        if d_w.len() < tokens * k || tokens == 0 {
            return Err(CudaError::Invalid(format!(
                "moe combine of {tokens} x {k} picks with {} weights",
                d_w.len()
            )));
        }
        let s = &self.stream;
        let mut out = self.alloc_f32(tokens * hidden)?;
        let (tokens_i, k_i, hidden_i) = (tokens as i32, k as i32, hidden as i32);
        let mut b = s.launch_builder(self.kernel("moe_combine"));
        b.arg(&run.yp)
            .arg(d_w)
            .arg(&tokens_i)
            .arg(&k_i)
            .arg(&hidden_i)
            .arg(&mut out);
        // SAFETY: `tokens * hidden` outputs from `tokens * k` pick rows and weights.
        unsafe { b.launch(LaunchConfig::for_num_elems((tokens * hidden) as u32)) }?;
        Ok(out)
    }
}

/// A routed-expert step in progress (see [`Cuda::moe_begin`]).
pub struct MoeRun {
    pub(super) layout: MoeLayout,
    pub(super) tokens: usize,
    pub(super) k: usize,
    /// Token rows `[tokens, hidden]`.
    pub(super) x: CudaSlice<f32>,
    /// Per-pick outputs `[tokens * k, hidden]`.
    pub(super) yp: CudaSlice<f32>,
    /// Per-pick activations `[tokens * k, inter]` (an EXL3 step: the down input, rotated).
    pub(super) act: CudaSlice<f32>,
}

/// Router settings for [`Cuda::route`].
#[derive(Clone, Copy, Debug)]
pub struct RouteSpec {
    pub experts: usize,
    pub groups: usize,
    pub topk_groups: usize,
    pub k: usize,
    pub normalize: bool,
    pub scale: f32,
}

/// How an expert slot stores gate, up and down.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SlotFormat {
    /// Rows in one format each (gate and up share theirs).
    Rows { gate_up: Format, down: Format },
    /// EXL3 layers: each matrix's trellis as its checkpoint stores it, then its `suh` and
    /// `svh` as f32, each part 256-byte aligned.
    Exl3 { gate_up: Exl3Form, down: Exl3Form },
}

/// The rate and codebook of an EXL3 layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exl3Form {
    pub rate: Rate,
    pub codebook: Codebook,
}

/// Where gate, up and down sit inside one expert slot, and their formats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeLayout {
    pub hidden: usize,
    pub inter: usize,
    pub format: SlotFormat,
    pub up_offset: usize,
    pub down_offset: usize,
    /// Bytes between slot starts (a multiple of 4 KiB).
    pub slot_bytes: usize,
}

impl MoeLayout {
    /// Gate, up and down as rows, back to back, each 256-byte aligned, the slot rounded to
    /// 4 KiB.
    pub fn new(
        hidden: usize,
        inter: usize,
        gate_up: Format,
        down: Format,
    ) -> Result<MoeLayout, CudaError> {
        let bad = |e: crate::quant::QuantError| CudaError::Invalid(e.to_string());
        gate_up.row_bytes(hidden).map_err(bad)?;
        down.row_bytes(inter).map_err(bad)?;
        Ok(MoeLayout::place(
            hidden,
            inter,
            SlotFormat::Rows { gate_up, down },
        ))
    }

    /// Gate, up and down as EXL3 layers (`hidden` and `inter` multiples of 128).
    pub fn exl3(
        hidden: usize,
        inter: usize,
        gate_up: Exl3Form,
        down: Exl3Form,
    ) -> Result<MoeLayout, CudaError> {
        if hidden == 0 || inter == 0 || !hidden.is_multiple_of(128) || !inter.is_multiple_of(128) {
            return Err(CudaError::Invalid(format!(
                "EXL3 experts of {hidden} x {inter}: both must be positive multiples of 128"
            )));
        }
        for form in [gate_up, down] {
            if form.rate.is_half() && form.codebook != Codebook::Mul1 {
                return Err(CudaError::Invalid(format!(
                    "EXL3 at {} bpw needs the mul1 codebook, not {}",
                    form.rate, form.codebook
                )));
            }
        }
        Ok(MoeLayout::place(
            hidden,
            inter,
            SlotFormat::Exl3 { gate_up, down },
        ))
    }

    fn place(hidden: usize, inter: usize, format: SlotFormat) -> MoeLayout {
        let mut layout = MoeLayout {
            hidden,
            inter,
            format,
            up_offset: 0,
            down_offset: 0,
            slot_bytes: 0,
        };
        let gate_bytes = layout.matrix_bytes(Part::GateUp);
        layout.up_offset = gate_bytes.next_multiple_of(256);
        layout.down_offset = (layout.up_offset + gate_bytes).next_multiple_of(256);
        layout.slot_bytes =
            (layout.down_offset + layout.matrix_bytes(Part::Down)).next_multiple_of(4096);
        layout
    }

    /// Bytes of gate (and of up) or of down, with their alignment padding inside.
    fn matrix_bytes(&self, part: Part) -> usize {
        let (rows, cols) = part.shape(self);
        match self.format {
            SlotFormat::Rows { gate_up, down } => {
                rows * part.pick(gate_up, down).row_bytes(cols).unwrap_or(0)
            }
            SlotFormat::Exl3 { gate_up, down } => {
                let [_, (svh, n)] = self.exl3_scales(part, part.pick(gate_up, down));
                svh + 4 * n
            }
        }
    }

    /// Each stored piece of a slot as `(byte offset, bytes)`, in the order
    /// [`SlotArena::write`] takes them: gate, up, down as rows; or per matrix its trellis,
    /// `suh` and `svh` (f32) for EXL3.
    pub fn pieces(&self) -> Vec<(usize, usize)> {
        let bases = [0, self.up_offset, self.down_offset];
        match self.format {
            SlotFormat::Rows { .. } => [Part::GateUp, Part::GateUp, Part::Down]
                .iter()
                .zip(bases)
                .map(|(&p, base)| (base, self.matrix_bytes(p)))
                .collect(),
            SlotFormat::Exl3 { gate_up, down } => [Part::GateUp, Part::GateUp, Part::Down]
                .iter()
                .zip(bases)
                .flat_map(|(&p, base)| {
                    let form = p.pick(gate_up, down);
                    let [(suh, k), (svh, n)] = self.exl3_scales(p, form);
                    [
                        (base, form.rate.trellis_bytes(k, n)),
                        (base + suh, 4 * k),
                        (base + svh, 4 * n),
                    ]
                })
                .collect(),
        }
    }

    /// An EXL3 matrix's `suh` and `svh` as (offset from the matrix's start, values).
    pub(super) fn exl3_scales(&self, part: Part, form: Exl3Form) -> [(usize, usize); 2] {
        // EXL3 matrices are stored as `y = x W`: K inputs, N outputs.
        let (n, k) = part.shape(self);
        let suh = form.rate.trellis_bytes(k, n).next_multiple_of(256);
        [(suh, k), ((suh + 4 * k).next_multiple_of(256), n)]
    }
}

/// The two shapes of a slot's matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    /// Gate or up: `[inter, hidden]`.
    GateUp,
    /// Down: `[hidden, inter]`.
    Down,
}

impl Part {
    /// (rows, cols) of the matrix `y = W x`.
    pub(super) fn shape(self, l: &MoeLayout) -> (usize, usize) {
        match self {
            Part::GateUp => (l.inter, l.hidden),
            Part::Down => (l.hidden, l.inter),
        }
    }

    pub(super) fn pick<T>(self, gate_up: T, down: T) -> T {
        match self {
            Part::GateUp => gate_up,
            Part::Down => down,
        }
    }
}

/// One routed-expert step: `out[t] = sum_j weights[t, j] * expert(slots[t * k + j])(x[t])`,
/// the sum in pick order.
#[derive(Clone, Copy, Debug)]
pub struct MoeStep<'a> {
    pub layout: MoeLayout,
    pub tokens: usize,
    pub k: usize,
    pub limit: f32,
    /// Arena slot of every pick, `[tokens * k]`.
    pub slots: &'a [u32],
    /// `[tokens * k]`
    pub weights: &'a [f32],
}

impl MoeStep<'_> {
    fn check(&self, arena_bytes: usize, x_len: usize) -> Result<(), CudaError> {
        let picks = self.tokens * self.k;
        let slots = arena_bytes / self.layout.slot_bytes.max(1);
        if self.slots.len() != picks
            || self.weights.len() != picks
            || x_len != self.tokens * self.layout.hidden
        {
            return Err(CudaError::Invalid(format!(
                "moe step of {} tokens x {} picks: {} slots, {} weights, {} inputs",
                self.tokens,
                self.k,
                self.slots.len(),
                self.weights.len(),
                x_len
            )));
        }
        if let Some(s) = self.slots.iter().find(|&&s| s as usize >= slots) {
            return Err(CudaError::Invalid(format!(
                "moe step names slot {s}; the arena holds {slots}"
            )));
        }
        Ok(())
    }
}

/// Expert slots in one device allocation.
pub struct SlotArena {
    pub buf: CudaSlice<u8>,
    pub layout: MoeLayout,
    pub slots: usize,
}

impl SlotArena {
    pub fn new(cuda: &Cuda, layout: MoeLayout, slots: usize) -> Result<SlotArena, CudaError> {
        let bytes = layout.slot_bytes * slots.max(1);
        // SAFETY: the arena is written slot by slot before any kernel reads a slot.
        let buf = unsafe { cuda.stream.alloc::<u8>(bytes) }?;
        Ok(SlotArena { buf, layout, slots })
    }

    /// Copies one expert's pieces ([`MoeLayout::pieces`]: gate, up and down, or for EXL3
    /// each one's trellis, `suh` and `svh`) into slot `slot`, on `stream` (the kernel stream,
    /// or the copy stream for slots its user orders with events).
    pub fn write(
        &mut self,
        stream: &Arc<CudaStream>,
        slot: usize,
        pieces: &[&[u8]],
    ) -> Result<(), CudaError> {
        let want = self.layout.pieces();
        let fits = pieces.len() == want.len()
            && pieces
                .iter()
                .zip(&want)
                .all(|(p, (_, len))| p.len() == *len);
        if slot >= self.slots || !fits {
            let got: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
            let want: Vec<usize> = want.iter().map(|w| w.1).collect();
            return Err(CudaError::Invalid(format!(
                "slot {slot} of {}: pieces of {got:?} bytes, the layout wants {want:?}",
                self.slots
            )));
        }
        let base = slot * self.layout.slot_bytes;
        for ((off, len), bytes) in want.into_iter().zip(pieces) {
            let mut dst = self.buf.slice_mut(base + off..base + off + len);
            stream.memcpy_htod(*bytes, &mut dst)?;
        }
        Ok(())
    }

    /// Slot `slot`'s bytes on the host, copied on `stream` after the work queued on it (the
    /// slot's own write included); returns once they are here.
    pub fn read(&self, stream: &Arc<CudaStream>, slot: usize) -> Result<Vec<u8>, CudaError> {
        if slot >= self.slots {
            return Err(CudaError::Invalid(format!(
                "slot {slot} of an arena of {}",
                self.slots
            )));
        }
        let base = slot * self.layout.slot_bytes;
        Ok(stream.clone_dtoh(&self.buf.slice(base..base + self.layout.slot_bytes))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An EXL3 slot's pieces are the checkpoint's trellis and f32 scales of each matrix,
    /// 256-byte aligned (the kernels read them as u32 and f32), disjoint and inside the slot.
    #[test]
    fn exl3_pieces_are_aligned_disjoint_and_inside_the_slot() {
        let form = |bits: f32, codebook| Exl3Form {
            rate: Rate::from_bits(bits).expect("a rate"),
            codebook,
        };
        let (hidden, inter) = (4096, 2048);
        let l = MoeLayout::exl3(
            hidden,
            inter,
            form(3.0, Codebook::Mul1),
            form(2.5, Codebook::Mul1),
        )
        .expect("a layout");
        let p = l.pieces();
        let sizes: Vec<usize> = p.iter().map(|x| x.1).collect();
        let (g3, d25) = (inter * hidden * 3 / 8, hidden * inter * 5 / 16);
        assert_eq!(
            sizes,
            [
                g3,
                4 * hidden,
                4 * inter,
                g3,
                4 * hidden,
                4 * inter,
                d25,
                4 * inter,
                4 * hidden
            ]
        );
        assert_eq!(p[3].0, l.up_offset);
        assert_eq!(p[6].0, l.down_offset);
        for w in p.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
        }
        assert!(p.iter().all(|(off, _)| off % 256 == 0));
        let end = p.last().map(|(o, n)| o + n).unwrap_or(0);
        assert!(
            end <= l.slot_bytes && l.slot_bytes - end < 4096 && l.slot_bytes.is_multiple_of(4096)
        );
        // 3 bpw mul1 experts at GLM-5.3-Flash width: within 40 KiB of exllamav3's 9.47 MB
        // (the scales are f32 here, f16 there).
        let seed = MoeLayout::exl3(
            hidden,
            inter,
            form(3.0, Codebook::Mul1),
            form(3.0, Codebook::Mul1),
        )
        .expect("a layout");
        let record = 3 * (hidden * inter * 3 / 8 + 2 * (hidden + inter));
        assert!(seed.slot_bytes >= record && seed.slot_bytes - record < 40 << 10);
        assert!(
            MoeLayout::exl3(
                100,
                128,
                form(3.0, Codebook::Mul1),
                form(3.0, Codebook::Mul1)
            )
            .is_err()
        );
        assert!(
            MoeLayout::exl3(
                128,
                128,
                form(2.5, Codebook::Mcg),
                form(3.0, Codebook::Mul1)
            )
            .is_err()
        );
    }

    /// The rows layout is unchanged: gate, up and down back to back.
    #[test]
    fn rows_pieces_are_gate_up_down() {
        let l = MoeLayout::new(512, 256, Format::Q4K, Format::Q8_0).expect("a layout");
        let p = l.pieces();
        let gate = 256 * Format::Q4K.row_bytes(512).unwrap();
        let down = 512 * Format::Q8_0.row_bytes(256).unwrap();
        assert_eq!(p, [(0, gate), (l.up_offset, gate), (l.down_offset, down)]);
    }
}
