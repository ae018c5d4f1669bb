//! The router and the routed experts on the GPU: `route`, the fused MoE launches over expert
//! slots, and the slot arena they read.

use super::*;

impl Cuda {
    /// The router's choice from its logits (`[tokens, experts]`): ids and weights `[tokens, k]`.
    pub fn route(
        &self,
        logits: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        spec: RouteSpec,
        tokens: usize,
    ) -> Result<(Vec<u32>, Vec<f32>), CudaError> {
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
        {
            return Err(CudaError::Invalid(format!(
                "route: {spec:?} for {tokens} tokens"
            )));
        }
        if tokens == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut ids = self.stream.clone_htod(&vec![-1i32; tokens * k])?;
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
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: experts <= 1024 (the kernel's shared arrays), buffers sized above.
        unsafe { b.launch(cfg) }?;
        let ids = self.download(&ids)?.into_iter().map(|i| i as u32).collect();
        Ok((ids, self.download(&weights)?))
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
    /// Each pick's output depends only on its token row and its slot's bytes, never on
    /// which other picks share the launch.
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
        let base: Vec<i64> = slot_of_group
            .iter()
            .map(|&s| (s as usize * layout.slot_bytes) as i64)
            .collect();
        let mut start = Vec::with_capacity(members.len());
        let mut len = Vec::with_capacity(members.len());
        let mut list = Vec::with_capacity(picks.len());
        for m in &members {
            start.push(list.len() as i32);
            len.push(m.len() as i32);
            list.extend_from_slice(m);
        }
        let s = &self.stream;
        let (d_base, d_start, d_len, d_list) = (
            s.clone_htod(&base)?,
            s.clone_htod(&start)?,
            s.clone_htod(&len)?,
            s.clone_htod(&list)?,
        );
        let (hidden, inter) = (layout.hidden, layout.inter);
        let groups = members.len() as u32;
        let (gate_fmt, down_fmt) = (
            kernel_format_id(layout.gate_up),
            kernel_format_id(layout.down),
        );
        let (up_off, down_off) = (layout.up_offset as i64, layout.down_offset as i64);
        let (inter_i, hidden_i, k_i) = (inter as i32, hidden as i32, run.k as i32);

        let mut b = s.launch_builder(self.kernel("moe_gate_up"));
        b.arg(arena)
            .arg(&gate_fmt)
            .arg(&d_base)
            .arg(&d_start)
            .arg(&d_len)
            .arg(&d_list)
            .arg(&up_off)
            .arg(&inter_i)
            .arg(&hidden_i)
            .arg(&k_i)
            .arg(&limit)
            .arg(&run.x)
            .arg(&mut run.act);
        // SAFETY: every slot was checked to lie inside the arena and every pick index below
        // `tokens * k` (the rows of act and yp); the grid covers `inter` rows of each group.
        unsafe { b.launch(rows_config(inter, groups)) }?;

        let mut b = s.launch_builder(self.kernel("moe_down"));
        b.arg(arena)
            .arg(&down_fmt)
            .arg(&d_base)
            .arg(&d_start)
            .arg(&d_len)
            .arg(&d_list)
            .arg(&down_off)
            .arg(&hidden_i)
            .arg(&inter_i)
            .arg(&run.act)
            .arg(&mut run.yp);
        // SAFETY: as above, for `hidden` rows of the down projection.
        unsafe { b.launch(rows_config(hidden, groups)) }?;
        Ok(())
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
        let (tokens, k, hidden) = (run.tokens, run.k, run.layout.hidden);
        if weights.len() != tokens * k || tokens == 0 {
            return Err(CudaError::Invalid(format!(
                "moe combine of {tokens} x {k} picks with {} weights",
                weights.len()
            )));
        }
        let s = &self.stream;
        let d_w = s.clone_htod(weights)?;
        let mut out = self.alloc_f32(tokens * hidden)?;
        let (tokens_i, k_i, hidden_i) = (tokens as i32, k as i32, hidden as i32);
        let mut b = s.launch_builder(self.kernel("moe_combine"));
        b.arg(&run.yp)
            .arg(&d_w)
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
    layout: MoeLayout,
    tokens: usize,
    k: usize,
    x: CudaSlice<f32>,
    yp: CudaSlice<f32>,
    act: CudaSlice<f32>,
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

/// Where gate, up and down sit inside one expert slot, and their formats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeLayout {
    pub hidden: usize,
    pub inter: usize,
    /// Format of gate and up (`[inter, hidden]` each).
    pub gate_up: Format,
    /// Format of down (`[hidden, inter]`).
    pub down: Format,
    pub up_offset: usize,
    pub down_offset: usize,
    /// Bytes between slot starts (a multiple of 4 KiB).
    pub slot_bytes: usize,
}

impl MoeLayout {
    /// Gate, up and down back to back, each 256-byte aligned, the slot rounded to 4 KiB.
    pub fn new(
        hidden: usize,
        inter: usize,
        gate_up: Format,
        down: Format,
    ) -> Result<MoeLayout, CudaError> {
        let bad = |e: crate::quant::QuantError| CudaError::Invalid(e.to_string());
        let gate_bytes = inter * gate_up.row_bytes(hidden).map_err(bad)?;
        let down_bytes = hidden * down.row_bytes(inter).map_err(bad)?;
        let up_offset = gate_bytes.next_multiple_of(256);
        let down_offset = (up_offset + gate_bytes).next_multiple_of(256);
        Ok(MoeLayout {
            hidden,
            inter,
            gate_up,
            down,
            up_offset,
            down_offset,
            slot_bytes: (down_offset + down_bytes).next_multiple_of(4096),
        })
    }

    /// Bytes of gate (and of up).
    pub fn gate_bytes(&self) -> usize {
        self.inter * self.gate_up.row_bytes(self.hidden).unwrap_or(0)
    }

    pub fn down_bytes(&self) -> usize {
        self.hidden * self.down.row_bytes(self.inter).unwrap_or(0)
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

    /// Copies one expert's gate, up and down bytes into slot `slot`, on `stream` (the
    /// kernel stream, or the copy stream for slots its user orders with events).
    pub fn write(
        &mut self,
        stream: &Arc<CudaStream>,
        slot: usize,
        gate: &[u8],
        up: &[u8],
        down: &[u8],
    ) -> Result<(), CudaError> {
        let l = self.layout;
        let gb = l.gate_bytes();
        if slot >= self.slots || gate.len() != gb || up.len() != gb || down.len() != l.down_bytes()
        {
            return Err(CudaError::Invalid(format!(
                "slot {slot} of {}: gate {} up {} down {} bytes, the layout wants {gb}, {gb}, {}",
                self.slots,
                gate.len(),
                up.len(),
                down.len(),
                l.down_bytes()
            )));
        }
        let base = slot * l.slot_bytes;
        for (off, bytes) in [(0, gate), (l.up_offset, up), (l.down_offset, down)] {
            let mut dst = self.buf.slice_mut(base + off..base + off + bytes.len());
            stream.memcpy_htod(bytes, &mut dst)?;
        }
        Ok(())
    }
}
