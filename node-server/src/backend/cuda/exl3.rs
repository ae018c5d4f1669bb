//! EXL3 layers on the GPU, computed from the trellis as the checkpoint stores it (see
//! kernels/cuda/exl3.cu). A product `y = x W` is the input rotation (`x * suh`, Hadamard),
//! `xr What`, and the output rotation (Hadamard, `* svh`, `+ bias`). For fewer than
//! [`WIDEN_MIN_TOKENS`] token rows `xr What` is the GEMV that decodes each tile inside the dot,
//! its K split into slices so a narrow layer still fills the GPU (the last block of each 128
//! outputs sums the slices in order and rotates them in the same launch, so results repeat bit
//! for bit); from there `What` is decoded to f16 [`WIDEN_TILE_VALUES`] at a time and
//! multiplied on the tensor cores by cuBLAS, the inputs split into f16 hi and lo halves as the
//! GEMV splits them (22 of their 24 bits kept) and the sums in f32.

use super::groups::{GroupTables, Table};
use super::moe::{Exl3Form, MoeRun, Part};
use super::moe_rows::SlotProduct;
use super::*;
use crate::quant::exl3::Exl3Linear;
use cudarc::driver::{CudaView, CudaViewMut};

/// Blocks the GEMV aims for, counted as N/16 strips times the K slices (it launches half as
/// many: a block takes two of those strips).
pub const GEMV_BLOCKS: usize = 512;
/// Threads of a GEMV block: `EXL3_GEMV_WARPS` warps.
const GEMV_THREADS: u32 = 256;
/// Outputs of a GEMV block (`EXL3_STRIP`: two 16-wide n-tiles). The K split still counts
/// 16-wide strips, as it did when a block took one: the same slices, so the same sums.
const STRIP: usize = 32;
/// Warps of an `exl3_reconstruct` block (a tile each).
const RECONSTRUCT_WARPS: u32 = 8;
/// Rows and columns of one Hadamard block (a rotation launch's block).
const HADAMARD: usize = 128;
/// Token rows of one product: a rotation launch has a row of blocks per token.
const MAX_GRID_Y: usize = 65_535;
/// Blocks an expert matrix's grouped GEMV aims for per slot (N/16 strips times K slices, half
/// as many launched, as for `GEMV_BLOCKS`); a function of the shape alone, so a pick's sums
/// never depend on what shares its launch.
const MOE_GEMV_BLOCKS: usize = 256;

/// An EXL3 layer's tensors on one GPU: `K` inputs, `N` outputs.
pub struct Exl3Weights {
    /// int16 `[K/16, N/16, 16 * bits]`, as in the checkpoint.
    trellis: CudaSlice<u8>,
    suh: CudaSlice<f32>,
    svh: CudaSlice<f32>,
    /// `N` values, or one unread zero when the layer has none.
    bias: CudaSlice<f32>,
    has_bias: bool,
    k: usize,
    n: usize,
    /// Twice the bits per weight.
    halves: i32,
    /// The codebook's number (`EXL3_*` in exl3.cu).
    codebook: i32,
}

impl Exl3Weights {
    pub fn upload(cuda: &Cuda, lin: &Exl3Linear) -> Result<Exl3Weights, CudaError> {
        Ok(Exl3Weights {
            trellis: cuda.upload(&lin.checkpoint_trellis())?,
            suh: cuda.upload(lin.suh())?,
            svh: cuda.upload(lin.svh())?,
            bias: cuda.upload(lin.bias().unwrap_or(&[0.0]))?,
            has_bias: lin.bias().is_some(),
            k: lin.in_features(),
            n: lin.out_features(),
            halves: i32::from(lin.rate().halves()),
            codebook: lin.codebook() as i32,
        })
    }

    /// Inputs `K`.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Outputs `N`.
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Device bytes: the trellis and the f32 scales and bias.
    pub fn bytes(&self) -> usize {
        self.trellis.len() + 4 * (self.k + self.n + self.bias.len())
    }
}

/// An EXL3 matrix's device tensors, borrowed: a layer's own ([`Exl3Weights::matrix`]) or a
/// routed expert's pieces inside its slot ([`Cuda::moe_exl3_gemm`]).
pub(super) struct Exl3Matrix<'a> {
    /// `[K/16, N/16, 16 * bits]` int16, as in the checkpoint.
    trellis: CudaView<'a, u8>,
    suh: CudaView<'a, f32>,
    svh: CudaView<'a, f32>,
    /// `N` values.
    bias: Option<CudaView<'a, f32>>,
    k: usize,
    n: usize,
    halves: i32,
    codebook: i32,
}

impl Exl3Weights {
    pub(super) fn matrix(&self) -> Exl3Matrix<'_> {
        Exl3Matrix {
            trellis: self.trellis.as_view(),
            suh: self.suh.as_view(),
            svh: self.svh.as_view(),
            bias: self.has_bias.then(|| self.bias.as_view()),
            k: self.k,
            n: self.n,
            halves: self.halves,
            codebook: self.codebook,
        }
    }
}

impl Cuda {
    /// `y[t] = x[t] W` for `n` token rows of `x` (`[n, K]`) into `y` (`[n, N]`), device buffers.
    pub fn exl3_matmul(
        &self,
        w: &Exl3Weights,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.exl3_product(w, x, n, y, true)
    }

    /// [`Cuda::exl3_matmul`] with the input rotated by a launch of its own even where the
    /// GEMV's blocks would rotate it (for checks: the results must have the same bits).
    pub fn exl3_matmul_rotating_first(
        &self,
        w: &Exl3Weights,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.exl3_product(w, x, n, y, false)
    }

    fn exl3_product(
        &self,
        w: &Exl3Weights,
        x: &CudaSlice<f32>,
        n: usize,
        y: &mut CudaSlice<f32>,
        inside: bool,
    ) -> Result<(), CudaError> {
        let (k, out) = (w.k, w.n);
        if x.len() < n * k || y.len() < n * out || n > MAX_GRID_Y {
            return Err(CudaError::Invalid(format!(
                "exl3 product {k}x{out} of {n} rows: x {} of {}, y {} of {}",
                x.len(),
                n * k,
                y.len(),
                n * out
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let gemv = n < WIDEN_MIN_TOKENS;
        let plan = gemv.then(|| {
            let blocks = self
                .settings
                .gemv_blocks
                .load(std::sync::atomic::Ordering::Relaxed);
            GemvPlan::of(w.k, w.n, n, blocks)
        });
        let Some(plan) = &plan else {
            let (x, mut y) = (x.slice(..n * k), y.slice_mut(..n * out));
            return self.exl3_gemm_product(&w.matrix(), &x, n, &mut y);
        };
        if inside && plan.rotates_inside() {
            return self.exl3_gemv(w, Input::Raw(x), n, plan, y);
        }
        // The GEMV's split form (a word a value).
        let mut xr = self.alloc_f32(n * k)?;
        let (k_i, cfg) = (k as i32, rotation_config(k, n));
        let mut b = self.stream.launch_builder(self.kernel("exl3_rotate_input"));
        b.arg(x).arg(&w.suh).arg(&k_i).arg(&1i32).arg(&mut xr);
        // SAFETY: x and xr hold n rows of K values (checked above; the GEMV's split form is a
        // word a value too), suh K; one block per 128 values of a row.
        unsafe { b.launch(cfg) }?;
        self.exl3_gemv(w, Input::Rotated(&xr), n, plan, y)
    }

    /// `y = x W` (`x` `[n, K]`, `y` `[n, N]`) for many token rows: the input rotated into the
    /// GEMM's two f16 planes, `What` decoded to f16 for cuBLAS ([`Cuda::exl3_gemm`]), and the
    /// output rotation. The sizes are the caller's to check (n at most 65,535: a rotation's
    /// grid has a row a token).
    pub(super) fn exl3_gemm_product(
        &self,
        w: &Exl3Matrix,
        x: &CudaView<f32>,
        n: usize,
        y: &mut CudaViewMut<f32>,
    ) -> Result<(), CudaError> {
        let (k, out) = (w.k, w.n);
        if x.len() < n * k || y.len() < n * out || n > MAX_GRID_Y {
            return Err(CudaError::Invalid(format!(
                "exl3 GEMM {k}x{out} of {n} rows: x {}, y {}",
                x.len(),
                y.len()
            )));
        }
        // The GEMM's two f16 planes: as many bytes as n x K floats.
        let mut xr = self.alloc_f32(n * k)?;
        let k_i = k as i32;
        let mut b = self.stream.launch_builder(self.kernel("exl3_rotate_input"));
        b.arg(x).arg(&w.suh).arg(&k_i).arg(&2i32).arg(&mut xr);
        // SAFETY: x holds n rows of K values and xr two planes of n x K halves (checked
        // above), suh K; one block per 128 values of a row.
        unsafe { b.launch(rotation_config(k, n)) }?;
        let part = self.exl3_gemm(w, &xr, n)?;
        let (n_i, out_i, has_bias) = (n as i32, out as i32, w.bias.is_some() as i32);
        let mut b = self
            .stream
            .launch_builder(self.kernel("exl3_rotate_output"));
        b.arg(&part).arg(&1i32).arg(&n_i).arg(&out_i).arg(&w.svh);
        // Without a bias the kernel reads none: svh stands in for the pointer.
        match &w.bias {
            Some(bias) => b.arg(bias),
            None => b.arg(&w.svh),
        };
        b.arg(&has_bias).arg(y);
        // SAFETY: part holds n x N values (one slice), y n x N, svh and the bias N (or the
        // kernel does not read the bias); one block per 128 outputs of a row.
        unsafe { b.launch(rotation_config(out, n)) }?;
        Ok(())
    }

    /// `y = xr What H diag(svh) + bias` (`[n, N]`) by the GEMV over slices of K, each 128
    /// outputs finished by the last of their blocks (the slices' sums in order, the rotation,
    /// the scale and the bias); `xr` given in the GEMV's split form, or made by each block for
    /// its slice from the raw input.
    fn exl3_gemv(
        &self,
        w: &Exl3Weights,
        input: Input,
        n: usize,
        plan: &GemvPlan,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if w.n / HADAMARD > TICKETS {
            return Err(CudaError::Invalid(format!(
                "exl3 GEMV of {} outputs: at most {} (a ticket per 128)",
                w.n,
                TICKETS * HADAMARD
            )));
        }
        let part = self.alloc_f32(plan.splits * n * w.n)?;
        let (k_i, n_i, per_i, tokens) = (w.k as i32, w.n as i32, plan.per as i32, n as i32);
        let has_bias = w.has_bias as i32;
        let (xs, x, rotate, shared) = match input {
            Input::Rotated(xr) => (xr, &self.unread, 0i32, 0),
            Input::Raw(x) => (&self.unread, x, 1, plan.shared_bytes),
        };
        let mut b = self.stream.launch_builder(self.kernel("exl3_gemv"));
        b.arg(&w.trellis)
            .arg(&w.halves)
            .arg(&w.codebook)
            .arg(&k_i)
            .arg(&n_i)
            .arg(&per_i)
            .arg(xs)
            .arg(&tokens)
            .arg(&part)
            .arg(&w.svh)
            .arg(&w.bias)
            .arg(&has_bias)
            .arg(&self.tickets)
            .arg(y)
            .arg(x)
            .arg(&w.suh)
            .arg(&rotate);
        let cfg = LaunchConfig {
            grid_dim: ((w.n / STRIP) as u32, plan.splits as u32, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        // SAFETY: the trellis holds K/16 x N/16 tiles of 4 * halves words (as uploaded); the
        // input is n rows of K (the caller checked), rotated in the split form or raw with suh
        // K long and `shared` bytes for a pass's slice (per a multiple of 8: GemvPlan); part
        // holds splits x n x N values, y n x N, svh and the bias N (or the kernel does not read
        // the bias); one block per (strip, slice), a ticket per 128 outputs (checked).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `xr What` (`[n, N]`) on the tensor cores: `What` decoded to f16 (exact: every EXL3
    /// weight is an f16 value) a slice of K-tiles at a time, and for each slice two cuBLAS
    /// GEMMs with f32 accumulators, one on the inputs' hi halves and one on their lo halves
    /// (`xs`: the two f16 planes of `exl3_rotate_input`'s split 2, each input times 1/16 as
    /// hi + lo 2^-11, as the GEMV takes it), scaled back by their alphas (powers of two).
    fn exl3_gemm(
        &self,
        w: &Exl3Matrix,
        xs: &CudaSlice<f32>,
        n: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (k, out) = (w.k, w.n);
        let tiles_per_slice = (WIDEN_TILE_VALUES / out / 16).clamp(1, k / 16);
        // f16 weights, two a word.
        let mut widened = self.alloc_f32((16 * tiles_per_slice * out).div_ceil(2))?;
        let mut z = self.alloc_f32(n * out)?;
        for kt0 in (0..k / 16).step_by(tiles_per_slice) {
            let kt1 = (kt0 + tiles_per_slice).min(k / 16);
            self.exl3_reconstruct_into(w, kt0, kt1, true, &mut widened)?;
            let rows = 16 * (kt1 - kt0);
            for (plane, alpha) in [
                (0usize, EXL3_XUNSCALE),
                (1, EXL3_XUNSCALE * EXL3_LO_UNSCALE),
            ] {
                let beta = if kt0 == 0 && plane == 0 {
                    0.0f32
                } else {
                    1.0f32
                };
                let (a, _ra) = widened.device_ptr(&self.stream);
                let (b, _rb) = xs.device_ptr(&self.stream);
                let (c, _rc) = z.device_ptr_mut(&self.stream);
                // Column-major, z^T [N, n] += alpha What_slice^T [N, rows] x_slice^T [rows,
                // n]: the slice's row-major [rows, N] halves are its transpose column-major
                // (lda = N); the plane's rows from column 16 kt0 are columns of ldb = K.
                let b = b + (2 * (plane * n * k + 16 * kt0)) as u64;
                // SAFETY: A holds rows x N halves, B from its offset (n - 1) K + rows halves of
                // its plane (xs holds two planes of n x K halves), z n x N floats.
                unsafe {
                    self.gemm_half(
                        false,
                        super::dense::HalfType::F16,
                        (out, n, rows),
                        alpha,
                        (a, out),
                        (b, k),
                        beta,
                        (c, out),
                    )
                }?;
            }
        }
        Ok(z)
    }

    /// Rows `16 kt0 .. 16 kt1` of `What` (row-major, `N` wide) into `out`: the decoded weights
    /// before rotation and scaling, each an f16 value, as the CPU's `reconstruct` gives them.
    pub fn exl3_reconstruct(
        &self,
        w: &Exl3Weights,
        kt0: usize,
        kt1: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        self.exl3_reconstruct_into(&w.matrix(), kt0, kt1, false, out)
    }

    /// [`Cuda::exl3_reconstruct`] as f32 values, or as their f16 bits with `half` (two a
    /// word of `out`).
    fn exl3_reconstruct_into(
        &self,
        w: &Exl3Matrix,
        kt0: usize,
        kt1: usize,
        half: bool,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let values = 16 * (kt1.max(kt0) - kt0) * w.n;
        let room = if half { 2 * out.len() } else { out.len() };
        if kt0 > kt1 || kt1 > w.k / 16 || room < values {
            return Err(CudaError::Invalid(format!(
                "exl3 reconstruct of k-tiles {kt0}..{kt1} of {}x{} into {} values",
                w.k, w.n, room
            )));
        }
        let tiles = (kt1 - kt0) * (w.n / 16);
        if tiles == 0 {
            return Ok(());
        }
        let (n_i, kt0_i, kt1_i, half_i) = (w.n as i32, kt0 as i32, kt1 as i32, i32::from(half));
        let mut b = self.stream.launch_builder(self.kernel("exl3_reconstruct"));
        b.arg(&w.trellis)
            .arg(&w.halves)
            .arg(&w.codebook)
            .arg(&n_i)
            .arg(&kt0_i)
            .arg(&kt1_i)
            .arg(&half_i)
            .arg(out);
        let cfg = LaunchConfig {
            grid_dim: ((tiles as u32).div_ceil(RECONSTRUCT_WARPS), 1, 1),
            block_dim: (32 * RECONSTRUCT_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: a warp per tile of k-tiles kt0..kt1 (the kernel skips warps past them), out
        // holds their 16 (kt1 - kt0) rows of N values, as f32 or f16 (checked above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

impl Cuda {
    /// [`Cuda::moe_picks`] for slots holding EXL3 layers (see `kernels/cuda/exl3.cu`): the
    /// gate and up inputs rotated per pick, one grouped GEMV for both, the activation with the
    /// down input's rotation, the down GEMV, and the output rotation into the pick's row.
    pub(super) fn moe_exl3(
        &self,
        run: &mut MoeRun,
        arena: &CudaSlice<u8>,
        limit: f32,
        tables: &GroupTables,
        gate_up: Exl3Form,
        down: Exl3Form,
    ) -> Result<(), CudaError> {
        let l = run.layout;
        let (hidden, inter, entries) = (l.hidden, l.inter, tables.entries);
        let s = &self.stream;
        let d_ebase = tables.entry_base();
        let (d_rows, d_list) = (tables.ints(Table::Rows), tables.ints(Table::List));
        let [(g_suh, _), (g_svh, _)] = l.exl3_scales(Part::GateUp, gate_up);
        let [(d_suh, _), (d_svh, _)] = l.exl3_scales(Part::Down, down);
        let (gate, up, dn) = (0i64, l.up_offset as i64, l.down_offset as i64);
        let (hidden_i, inter_i, entries_i) = (hidden as i32, inter as i32, entries as i32);

        let mut xr = self.alloc_f32(2 * entries * hidden)?;
        let (suh_g, suh_u) = (gate + g_suh as i64, up + g_suh as i64);
        let mut b = s.launch_builder(self.kernel("exl3_moe_rotate_in"));
        b.arg(arena)
            .arg(&d_ebase)
            .arg(&suh_g)
            .arg(&suh_u)
            .arg(&d_rows)
            .arg(&run.x)
            .arg(&hidden_i)
            .arg(&entries_i)
            .arg(&mut xr);
        // SAFETY: every entry's slot lies inside the arena (checked by `moe_picks`), its row
        // below `tokens` (x holds them), xr holds 2 x entries x hidden values.
        unsafe { b.launch(entry_config(entries, hidden, 2)) }?;

        let part_gu = self.moe_gemv(arena, gate_up, tables, [gate, up], hidden, inter, &xr)?;

        let (svh_g, svh_u, suh_d) = (gate + g_svh as i64, up + g_svh as i64, dn + d_suh as i64);
        let splits_gu = moe_splits(hidden, inter) as i32;
        let mut b = s.launch_builder(self.kernel("exl3_moe_act"));
        b.arg(arena)
            .arg(&d_ebase)
            .arg(&svh_g)
            .arg(&svh_u)
            .arg(&suh_d)
            .arg(&part_gu)
            .arg(&splits_gu)
            .arg(&entries_i)
            .arg(&inter_i)
            .arg(&limit)
            .arg(&mut run.act);
        // SAFETY: part_gu holds 2 x splits x entries x inter values; act holds tokens x k
        // rows of inter, at least one per entry.
        unsafe { b.launch(entry_config(entries, inter, 1)) }?;

        let part_d = self.moe_gemv(arena, down, tables, [dn, dn], inter, hidden, &run.act)?;

        let (svh_d, splits_d) = (dn + d_svh as i64, moe_splits(inter, hidden) as i32);
        let mut b = s.launch_builder(self.kernel("exl3_moe_rotate_out"));
        b.arg(arena)
            .arg(&d_ebase)
            .arg(&svh_d)
            .arg(&part_d)
            .arg(&splits_d)
            .arg(&entries_i)
            .arg(&hidden_i)
            .arg(&d_list)
            .arg(&mut run.yp);
        // SAFETY: part_d holds splits x entries x hidden values; every pick index is below
        // tokens x k, the rows of yp.
        unsafe { b.launch(entry_config(entries, hidden, 1)) }?;
        Ok(())
    }

    /// EXL3 slots with many picks each ([`Cuda::moe_slots_gemm`]): gate, up and down as
    /// [`Cuda::exl3_gemm_product`]s (the slot's trellis decoded to f16 for cuBLAS, as a dense
    /// EXL3 layer's prompt products). Another order of sums than the grouped GEMV's.
    pub(super) fn moe_exl3_gemm(
        &self,
        run: &mut MoeRun,
        arena: &CudaSlice<u8>,
        limit: f32,
        groups: &[(u32, &[i32])],
        gate_up: Exl3Form,
        down: Exl3Form,
    ) -> Result<(), CudaError> {
        let l = run.layout;
        // Matrix `part` at `off` in `slot`: its trellis, suh and svh (f32, 256-byte aligned
        // inside the slot: `MoeLayout::exl3_scales`).
        let matrix = |slot: u32, off: usize, part: Part, form: Exl3Form| {
            let (n, k) = part.shape(&l);
            let [(suh, _), (svh, _)] = l.exl3_scales(part, form);
            let at = slot as usize * l.slot_bytes + off;
            let f32s = |from: usize, len: usize| {
                let bytes = arena.slice(at + from..at + from + 4 * len);
                // SAFETY: the slot's scales are `len` f32 values at a 256-byte-aligned
                // offset (the layout's), inside the arena (checked by `moe_picks`).
                unsafe { bytes.transmute::<f32>(len) }.ok_or_else(|| {
                    CudaError::Invalid("exl3 slot scales short of their size".into())
                })
            };
            let trellis = arena.slice(at..at + form.rate.trellis_bytes(k, n));
            Ok::<_, CudaError>(Exl3Matrix {
                trellis,
                suh: f32s(suh, k)?,
                svh: f32s(svh, n)?,
                bias: None,
                k,
                n,
                halves: i32::from(form.rate.halves()),
                codebook: form.codebook as i32,
            })
        };
        self.moe_slots_gemm(run, limit, groups, |slot, m, product| match product {
            SlotProduct::GateUp { x, mut g, mut u } => {
                let gate = matrix(slot, 0, Part::GateUp, gate_up)?;
                self.exl3_gemm_product(&gate, &x, m, &mut g)?;
                let up = matrix(slot, l.up_offset, Part::GateUp, gate_up)?;
                self.exl3_gemm_product(&up, &x, m, &mut u)
            }
            SlotProduct::Down { act, mut y } => {
                let dn = matrix(slot, l.down_offset, Part::Down, down)?;
                self.exl3_gemm_product(&dn, &act, m, &mut y)
            }
        })
    }

    /// The grouped GEMV of `exl3_moe_gemv` over the slots of `groups` (their tables on the
    /// device), for the matrices at byte offsets `offsets` of each slot (gate and up, or down
    /// twice for one part): partial products `[parts, splits, entries, n]` of the rotated
    /// inputs `xr` (`[parts, entries, k]`).
    #[allow(clippy::too_many_arguments)]
    fn moe_gemv(
        &self,
        arena: &CudaSlice<u8>,
        form: Exl3Form,
        tables: &GroupTables,
        offsets: [i64; 2],
        k: usize,
        n: usize,
        xr: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let parts: u32 = if offsets[0] == offsets[1] { 1 } else { 2 };
        let entries = tables.entries;
        let splits = moe_splits(k, n);
        let per = (k / 16).div_ceil(splits);
        let mut part = self.alloc_f32(parts as usize * splits * entries * n)?;
        let (halves, codebook) = (i32::from(form.rate.halves()), form.codebook as i32);
        let (k_i, n_i, per_i, entries_i) = (k as i32, n as i32, per as i32, entries as i32);
        let cap = tables.groups();
        if cap == 0 {
            return Ok(part);
        }
        let (cap_i, d_count) = (cap as i32, tables.ints(Table::Count));
        let (d_base, d_start, d_len) = (
            tables.base(),
            tables.ints(Table::Start),
            tables.ints(Table::Len),
        );
        // Groups of many picks (prompt chunks) take the kernel that decodes each tile once for
        // several token passes: the same sums in the same order, so which one runs never
        // changes a bit.
        let kernel = if tables.longest > MOE_WIDE_MIN_PICKS {
            "exl3_moe_gemv_wide"
        } else {
            "exl3_moe_gemv"
        };
        let mut b = self.stream.launch_builder(self.kernel(kernel));
        b.arg(arena)
            .arg(&halves)
            .arg(&codebook)
            .arg(&d_base)
            .arg(&d_start)
            .arg(&d_len)
            .arg(&d_count)
            .arg(&cap_i)
            .arg(&offsets[0])
            .arg(&offsets[1])
            .arg(&k_i)
            .arg(&n_i)
            .arg(&per_i)
            .arg(xr)
            .arg(&entries_i)
            .arg(&mut part);
        let cfg = LaunchConfig {
            grid_dim: ((n / STRIP) as u32, splits as u32, parts * cap as u32),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every group below the count has its slot inside the arena, holding each
        // matrix's trellis of K/16 x N/16 tiles at its offset (the layout's); xr holds parts x
        // entries rows of K, part parts x splits x entries x N values; the grid is (strip,
        // slice, room for every group x part), blocks past the count return at once.
        unsafe { b.launch(cfg) }?;
        Ok(part)
    }
}

/// Picks of a group above which the grouped GEMV decodes a tile once for several passes of
/// `TOK_TILE` tokens (`exl3_moe_gemv_wide`, which holds fewer blocks an SM).
const MOE_WIDE_MIN_PICKS: usize = 2 * TOK_TILE;

/// K slices of an expert matrix's grouped GEMV (`k` inputs, `n` outputs).
fn moe_splits(k: usize, n: usize) -> usize {
    let max_splits = (k / 16 / (GEMV_THREADS as usize / 32)).max(1);
    MOE_GEMV_BLOCKS.div_ceil(n / 16).clamp(1, max_splits)
}

/// A per-entry rotation launch: a block of 128 threads per entry and Hadamard block of its
/// `width` values, `parts` times.
fn entry_config(entries: usize, width: usize, parts: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (entries as u32, (width / HADAMARD) as u32, parts),
        block_dim: (HADAMARD as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A rotation launch over `n` rows of `width` values: a block of 128 threads per Hadamard
/// block of a row.
fn rotation_config(width: usize, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((width / HADAMARD) as u32, n as u32, 1),
        block_dim: (HADAMARD as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The activations' scale in the split forms (`EXL3_XUNSCALE` in exl3.cu) and the lo half's
/// weight (`EXL3_LO_UNSCALE`).
const EXL3_XUNSCALE: f32 = 16.0;
const EXL3_LO_UNSCALE: f32 = 1.0 / 2048.0;

/// A dense GEMV's input: rotated already (the split form), or raw rows of K.
enum Input<'a> {
    Rotated(&'a CudaSlice<f32>),
    Raw(&'a CudaSlice<f32>),
}

/// How a dense EXL3 GEMV splits K: `splits` slices of `per` k-tiles (a multiple of 8, a whole
/// number of Hadamard blocks, so a block can rotate its slice itself). A function of the
/// shape alone: the sums' order never depends on the token count or on where the rotation runs.
struct GemvPlan {
    splits: usize,
    per: usize,
    /// Dynamic shared memory of a block that rotates its slice: a pass's tokens' split words.
    shared_bytes: usize,
    /// Whether K is whole Hadamard blocks (EXL3 layers are; a slice then is too).
    whole_blocks: bool,
}

/// Token rows one GEMV pass carries (`TOK_TILE` in common.cuh).
const TOK_TILE: usize = 8;

/// Hadamard blocks (of a pass's tokens) a GEMV block rotates itself at most: one a warp. Each
/// further one is another load latency before the block's first product, which every block of
/// a wave waits out together (measured on the H200: a 4096 x 24576 product at one token took
/// 68 us rotating 32 blocks inside, 56 us after a rotation launch; 4096 x 2048 at one token,
/// 8 blocks, 12.3 us inside against 13.1 us).
const GEMV_ROTATE_BLOCKS: usize = 8;
/// Most k-tiles of a GEMV slice (a block's share of K): more slices for the widest K (the
/// dense MLP's down product, 3 instead of 2), the split every session-15 timing ran with.
const GEMV_MAX_PER: usize = 256;

impl GemvPlan {
    /// The plan of a `k` x `outputs` product of `n` token rows aiming for `blocks` blocks.
    fn of(k: usize, outputs: usize, n: usize, blocks: usize) -> GemvPlan {
        let (k_tiles, n_tiles) = (k / 16, outputs / 16);
        // Every warp of a block gets at least one tile of its slice.
        let max_splits = (k_tiles / (GEMV_THREADS as usize / 32)).max(1);
        // Slices of at most GEMV_MAX_PER k-tiles.
        let splits = blocks
            .div_ceil(n_tiles)
            .max(k_tiles.div_ceil(GEMV_MAX_PER))
            .clamp(1, max_splits);
        let per = k_tiles.div_ceil(splits).next_multiple_of(8);
        GemvPlan {
            splits: k_tiles.div_ceil(per).max(1),
            per,
            shared_bytes: n.min(TOK_TILE) * per * 16 * 4,
            whole_blocks: k_tiles % 8 == 0,
        }
    }

    fn rotates_inside(&self) -> bool {
        self.whole_blocks && self.shared_bytes <= GEMV_ROTATE_BLOCKS * HADAMARD * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::exl3::Codebook;

    fn source() -> &'static str {
        glmflash_kernels::SOURCES
            .iter()
            .find(|(name, _, _)| *name == "exl3.cu")
            .map(|(_, src, _)| *src)
            .expect("exl3.cu is listed")
    }

    /// Slices are whole Hadamard blocks that cover K once; the split depends on the shape
    /// alone, never on the token count; a block rotates its input itself only when that is at
    /// most one Hadamard block a warp (the model's dense shapes as measured).
    #[test]
    fn gemv_plans_split_k_by_shape_and_rotate_inside_only_short_slices() {
        let shapes = [
            (4096usize, 24576usize),
            (8192, 4096),
            (4096, 12288),
            (12288, 4096),
            (4096, 2048),
            (2048, 4096),
            (4096, 154_880),
            (256, 384),
            (1024, 256),
        ];
        for (k, outputs) in shapes {
            let one = GemvPlan::of(k, outputs, 1, GEMV_BLOCKS);
            for n in [1usize, 4, 8, 20, 63] {
                let p = GemvPlan::of(k, outputs, n, GEMV_BLOCKS);
                assert_eq!(
                    (p.splits, p.per),
                    (one.splits, one.per),
                    "{k}x{outputs} n={n}"
                );
                assert!(p.per.is_multiple_of(8) && p.per <= GEMV_MAX_PER.max(8));
                assert!(p.splits * p.per >= k / 16 && (p.splits - 1) * p.per < k / 16);
                assert_eq!(
                    p.rotates_inside(),
                    n.min(TOK_TILE) * p.per <= 64,
                    "{k}x{outputs} n={n}"
                );
            }
        }
        // The expert-sized shapes rotate inside at one token, the wide ones never.
        assert!(GemvPlan::of(4096, 2048, 1, GEMV_BLOCKS).rotates_inside());
        assert!(!GemvPlan::of(4096, 24576, 1, GEMV_BLOCKS).rotates_inside());
        assert!(!GemvPlan::of(4096, 154_880, 1, GEMV_BLOCKS).rotates_inside());
    }

    /// The numbers the kernels dispatch on are the ones the wrapper passes.
    #[test]
    fn codebook_numbers_and_block_size_match_the_kernels() {
        let src = source();
        for (cb, name) in [
            (Codebook::Inst3, "EXL3_INST3"),
            (Codebook::Mcg, "EXL3_MCG"),
            (Codebook::Mul1, "EXL3_MUL1"),
        ] {
            let define = format!("#define {name} {}\n", cb as i32);
            assert!(src.contains(&define), "exl3.cu lacks `{}`", define.trim());
        }
        let warps = format!("#define EXL3_GEMV_WARPS {}\n", GEMV_THREADS / 32);
        assert!(src.contains(&warps), "exl3.cu lacks `{}`", warps.trim());
    }
}
