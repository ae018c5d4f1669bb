//! The routed experts of row-format slots (f32, f16, bf16, q8_0, q4_k rows): the fused launches
//! over a step's groups (`kernels/cuda/moe.cu`: a warp per weight row, the picks of a group a
//! tile at a time; gathered token rows once a group is longer than a tile), and, with
//! [`prompt_gemm`], cuBLAS on a slot's widened weights for the slots of a prompt chunk.

use super::groups::{GroupTables, Table};
use super::*;
use cudarc::driver::{CudaView, CudaViewMut};

impl Cuda {
    /// [`Cuda::moe_picks`] for slots holding rows (`kernels/cuda/moe.cu`).
    pub(super) fn moe_rows(
        &self,
        run: &mut MoeRun,
        arena: &CudaSlice<u8>,
        limit: f32,
        tables: &GroupTables,
        gate_up: Format,
        down: Format,
    ) -> Result<(), CudaError> {
        let layout = run.layout;
        let s = &self.stream;
        let (d_base, d_start, d_len, d_list, d_counts) = (
            tables.base(),
            tables.ints(Table::Start),
            tables.ints(Table::Len),
            tables.ints(Table::List),
            tables.ints(Table::Count),
        );
        let (hidden, inter) = (layout.hidden, layout.inter);
        let room = tables.groups() as u32;
        let (gate_fmt, down_fmt) = (kernel_format_id(gate_up), kernel_format_id(down));
        let (up_off, down_off) = (layout.up_offset as i64, layout.down_offset as i64);
        let (inter_i, hidden_i, k_i) = (inter as i32, hidden as i32, run.k as i32);
        // Groups of more than a tile (prompt chunks, host tables): the token rows gathered
        // in entry order, so each weight row is read once a tile of picks (same bits).
        let gathered = if tables.longest > ROWS_TILE {
            let mut xg = self.alloc_f32(tables.entries * hidden)?;
            let d_rows = tables.ints(Table::Rows);
            let mut b = s.launch_builder(self.kernel("moe_gather"));
            b.arg(&run.x).arg(&d_rows).arg(&hidden_i).arg(&mut xg);
            let cfg = LaunchConfig {
                grid_dim: (tables.entries as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: one row of xg per entry (the host's tables: `entries` rows, each a
            // token row of x below `tokens`).
            unsafe { b.launch(cfg) }?;
            Some(xg)
        } else {
            None
        };
        // Under the knob MOE_XL=1, q4_k rows a pick at a time read x, and moe_down's read act,
        // in lane-of-32 order (`lane32_x`): a warp's loads of x then touch a quarter of the
        // lines. Off: session 44 measured the MoE kernels ~5% slower that way.
        let lane32 = |f: Format| gathered.is_none() && f == Format::Q4K && moe_xl();
        let ordered = if lane32(gate_up) {
            let n = run.tokens * hidden;
            let mut xl = self.alloc_f32(n)?;
            let n_i = n as i64;
            let mut b = s.launch_builder(self.kernel("lane32_x"));
            b.arg(&run.x).arg(&n_i).arg(&mut xl);
            // SAFETY: x and xl hold n values (tokens rows of hidden, a multiple of 256 for
            // q4_k rows), a float4 a thread.
            unsafe { b.launch(LaunchConfig::for_num_elems((n / 4) as u32)) }?;
            Some(xl)
        } else {
            None
        };
        let act_lane32 = i32::from(lane32(down));
        let (gate_up_kernel, down_kernel, x) = match (&gathered, &ordered) {
            (Some(xg), _) => ("moe_gate_up_wide", "moe_down_wide", xg),
            (None, Some(xl)) => ("moe_gate_up", "moe_down", xl),
            (None, None) => ("moe_gate_up", "moe_down", &run.x),
        };

        let mut b = s.launch_builder(self.kernel(gate_up_kernel));
        b.arg(arena)
            .arg(&gate_fmt)
            .arg(&d_base)
            .arg(&d_start)
            .arg(&d_len)
            .arg(&d_list)
            .arg(&d_counts)
            .arg(&up_off)
            .arg(&inter_i)
            .arg(&hidden_i)
            .arg(&k_i)
            .arg(&limit)
            .arg(x)
            .arg(&mut run.act);
        if gathered.is_none() {
            b.arg(&act_lane32);
        }
        // q4_k rows a pick at a time: GATE_UP_ROWS gate rows (and their up rows) a warp,
        // moe.cu's `gate_up_q4k_rows`.
        let warps = if gathered.is_none() && gate_up == Format::Q4K {
            inter.div_ceil(gate_up_rows())
        } else {
            inter
        };
        // SAFETY: every slot was checked to lie inside the arena (host tables) or comes from
        // the layer's slot table (device tables), every pick index below `tokens * k` (the
        // rows of act and yp); `warps` warps cover `inter` rows of each group the tables have
        // room for, and blocks past the counted groups return.
        unsafe { b.launch(rows_config(warps, room)) }?;

        let mut b = s.launch_builder(self.kernel(down_kernel));
        b.arg(arena)
            .arg(&down_fmt)
            .arg(&d_base)
            .arg(&d_start)
            .arg(&d_len)
            .arg(&d_list)
            .arg(&d_counts)
            .arg(&down_off)
            .arg(&hidden_i)
            .arg(&inter_i)
            .arg(&run.act)
            .arg(&mut run.yp);
        // q4_k rows a pick at a time: DOWN_ROWS rows a warp (moe.cu's `down_q4k_rows`).
        let warps = if gathered.is_none() && down == Format::Q4K {
            hidden.div_ceil(down_rows())
        } else {
            hidden
        };
        // SAFETY: as above, for `hidden` rows of the down projection (act by entry after the
        // wide gate/up: entries <= tokens * k rows), `warps` warps covering them.
        unsafe { b.launch(rows_config(warps, room)) }?;
        Ok(())
    }

    /// The routed experts of slots with many picks each (`groups`: slot, its pick indices; a
    /// prompt chunk's), a slot at a time: the picks' token rows gathered, `products`' gate and
    /// up of them ([`SlotProduct::GateUp`]), the clamped SwiGLU, `products`' down
    /// ([`SlotProduct::Down`]), the rows scattered back to the picks.
    pub(super) fn moe_slots_gemm(
        &self,
        run: &mut MoeRun,
        limit: f32,
        groups: &[(u32, &[i32])],
        mut products: impl FnMut(u32, usize, SlotProduct<'_>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let (h, i) = (run.layout.hidden, run.layout.inter);
        let most = groups.iter().map(|(_, p)| p.len()).max().unwrap_or(0);
        let (mut xg, mut y) = (self.alloc_f32(most * h)?, self.alloc_f32(most * h)?);
        let (mut g, mut u) = (self.alloc_f32(most * i)?, self.alloc_f32(most * i)?);
        let mut act = self.alloc_f32(most * i)?;
        let hidden_i = h as i32;
        for &(slot, picks) in groups {
            let m = picks.len();
            let rows: Vec<i32> = picks.iter().map(|&p| p / run.k as i32).collect();
            let (d_rows, d_picks) = (
                self.stream.clone_htod(&rows)?,
                self.stream.clone_htod(picks)?,
            );
            let mut b = self.stream.launch_builder(self.kernel("moe_gather"));
            b.arg(&run.x).arg(&d_rows).arg(&hidden_i).arg(&mut xg);
            // SAFETY: m rows of xg, each a token row of x below `tokens`.
            unsafe { b.launch(block_per_row(m)) }?;
            products(
                slot,
                m,
                SlotProduct::GateUp {
                    x: xg.slice(..m * h),
                    g: g.slice_mut(..m * i),
                    u: u.slice_mut(..m * i),
                },
            )?;
            let n = (m * i) as i64;
            let mut b = self.stream.launch_builder(self.kernel("swiglu"));
            b.arg(&g).arg(&u).arg(&limit).arg(&n).arg(&mut act);
            // SAFETY: g, u and act hold at least m * inter values.
            unsafe { b.launch(LaunchConfig::for_num_elems(n as u32)) }?;
            products(
                slot,
                m,
                SlotProduct::Down {
                    act: act.slice(..m * i),
                    y: y.slice_mut(..m * h),
                },
            )?;
            let mut b = self.stream.launch_builder(self.kernel("moe_scatter"));
            b.arg(&y).arg(&d_picks).arg(&hidden_i).arg(&mut run.yp);
            // SAFETY: m rows of y, each to a pick's row of yp (every pick below tokens * k,
            // checked by `moe_picks`).
            unsafe { b.launch(block_per_row(m)) }?;
        }
        Ok(())
    }

    /// Row-format slots with many picks each ([`Cuda::moe_slots_gemm`]): per slot, its gate, up
    /// and down widened to f32 (`dequant_rows`) for cuBLAS SGEMMs. f32 throughout, as the fused
    /// kernels, in another summation order. bf16 parts are not widened: their products run on
    /// the tensor cores as the dense bf16 products of a prompt do ([`Cuda::matmul_bf16x3`]:
    /// exact products, f32 sums).
    pub(super) fn moe_rows_gemm(
        &self,
        run: &mut MoeRun,
        arena: &CudaSlice<u8>,
        limit: f32,
        groups: &[(u32, &[i32])],
        gate_up: Format,
        down: Format,
    ) -> Result<(), CudaError> {
        let layout = run.layout;
        let (h, i) = (layout.hidden, layout.inter);
        let mut w = self.alloc_f32(3 * h * i)?;
        let part = |slot: u32, off: usize, fmt: Format, rows: usize, cols: usize| {
            let base = slot as usize * layout.slot_bytes;
            let bytes = rows
                * fmt
                    .row_bytes(cols)
                    .map_err(|e| CudaError::Invalid(format!("moe slot rows: {e}")))?;
            Ok::<_, CudaError>(arena.slice(base + off..base + off + bytes))
        };
        self.moe_slots_gemm(run, limit, groups, |slot, m, product| match product {
            SlotProduct::GateUp { x, mut g, mut u } => {
                for (at, off, fmt, rows, cols) in [
                    (0, 0, gate_up, i, h),
                    (i * h, layout.up_offset, gate_up, i, h),
                    (2 * i * h, layout.down_offset, down, h, i),
                ] {
                    if fmt == Format::Bf16 {
                        continue;
                    }
                    let src = part(slot, off, fmt, rows, cols)?;
                    let mut dst = w.slice_mut(at..at + rows * cols);
                    let (fmt_i, rows_i, cols_i) = (kernel_format_id(fmt), rows as i32, cols as i32);
                    let mut b = self.stream.launch_builder(self.kernel("dequant_rows"));
                    b.arg(&src)
                        .arg(&fmt_i)
                        .arg(&rows_i)
                        .arg(&cols_i)
                        .arg(&mut dst);
                    // SAFETY: src holds `rows` rows of `cols` values in `fmt` (the slot's
                    // layout), dst rows * cols floats; a block per row.
                    unsafe { b.launch(block_per_row(rows)) }?;
                }
                if gate_up == Format::Bf16 {
                    let gate = part(slot, 0, gate_up, i, h)?;
                    self.matmul_bf16x3(&gate, i, h, &x, m, &mut g)?;
                    let up = part(slot, layout.up_offset, gate_up, i, h)?;
                    self.matmul_bf16x3(&up, i, h, &x, m, &mut u)
                } else {
                    self.sgemm_rows(&w.slice(..i * h), i, h, &x, m, &mut g)?;
                    self.sgemm_rows(&w.slice(i * h..2 * i * h), i, h, &x, m, &mut u)
                }
            }
            SlotProduct::Down { act, mut y } => {
                if down == Format::Bf16 {
                    let d = part(slot, layout.down_offset, down, h, i)?;
                    self.matmul_bf16x3(&d, h, i, &act, m, &mut y)
                } else {
                    self.sgemm_rows(&w.slice(2 * i * h..), h, i, &act, m, &mut y)
                }
            }
        })
    }

    /// Row-major `y[n, rows] = x[n, cols] w[rows, cols]^T` in f32 by cuBLAS, the sizes
    /// checked ([`Cuda::sgemm_nt`]).
    fn sgemm_rows(
        &self,
        w: &CudaView<f32>,
        rows: usize,
        cols: usize,
        x: &CudaView<f32>,
        n: usize,
        y: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        if w.len() < rows * cols || x.len() < n * cols || y.len() < n * rows {
            return Err(CudaError::Invalid(format!(
                "SGEMM of {rows} x {cols} on {n} rows: operands of {}, {} and {}",
                w.len(),
                x.len(),
                y.len()
            )));
        }
        // SAFETY: sizes checked above.
        unsafe { self.sgemm_nt(w, rows, cols, x, n, y, rows) }
    }
}

/// Picks of one row-format slot in a launch from which [`Cuda::moe_picks`] computes them
/// with cuBLAS on the slot's widened weights (prompt chunks) instead of the fused kernels.
pub const MOE_GEMM_MIN_PICKS: usize = 32;

/// Picks a tile of the row kernels takes (`TOK_TILE` in common.cuh): groups longer than this
/// run the gathered (`_wide`) kernels.
const ROWS_TILE: usize = 8;

/// A slot's products in [`Cuda::moe_slots_gemm`], over its `m` picks' rows.
pub(super) enum SlotProduct<'a> {
    /// Gate and up of the gathered token rows `x` (`[m, hidden]`) into `g` and `u`
    /// (`[m, inter]`).
    GateUp {
        x: CudaView<'a, f32>,
        g: CudaViewMut<'a, f32>,
        u: CudaViewMut<'a, f32>,
    },
    /// Down of the activations `act` (`[m, inter]`) into `y` (`[m, hidden]`).
    Down {
        act: CudaView<'a, f32>,
        y: CudaViewMut<'a, f32>,
    },
}
