//! EXL3 (exllamav3) linear layers, decoded and multiplied on the CPU straight from the
//! trellis.
//!
//! One layer of `K` inputs and `N` outputs computes `y = x W` with
//! `W = diag(suh) H What H diag(svh)`: `H` is block-diagonal with 128x128 orthonormal
//! Hadamard blocks, `suh` / `svh` are per-channel signs times scales, and `What` (`[K, N]`) is
//! stored as 16x16 tiles of a tail-biting trellis, `bits` bits per weight, each 16-bit state
//! mapped to a weight by one of three codebooks (see `trellis.rs`). So a product is: scale
//! `x` by `suh` and rotate it, multiply by `What` decoding each tile as it is used, rotate the
//! result and scale it by `svh`.
//!
//! Activations stay f32 throughout (exllamav3 rounds them to f16 between steps); decoded
//! weights are exactly exllamav3's f16 values. The one exception is the CPU lane of the
//! near-exact modes ([`Exl3Linear::forward_lane`], `lane.rs`): 16-bit integer inputs against
//! mul1's weights before their f16 rounding. The tile decode is bit-exact on both kernels;
//! products differ between the AVX2+FMA+F16C kernel and the portable one only in summation
//! order. [`Kernel::active`] follows the same CPU detection and `GLMFLASH_FORCE_PORTABLE`
//! switch as the row formats' dot products.

mod hadamard;
mod lane;
mod parts;
mod portable;
#[cfg(target_arch = "x86_64")]
mod simd_x86;
mod trellis;

use rayon::prelude::*;

pub use parts::Exl3Parts;
use trellis::TILE_VALUES;

/// The codebook mapping a 16-bit trellis state to a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codebook {
    /// exllamav3's default before 1.6 ("3inst"): an LCG step, two f16 halves summed.
    Inst3 = 0,
    /// A multiplicative congruential step, two f16 halves summed ("mcg").
    Mcg = 1,
    /// One multiply, the sum of the product's four bytes ("mul1").
    Mul1 = 2,
}

impl Codebook {
    /// The name exllamav3 gives it in `quantization_config.codebook`.
    pub fn name(self) -> &'static str {
        match self {
            Codebook::Inst3 => "3inst",
            Codebook::Mcg => "mcg",
            Codebook::Mul1 => "mul1",
        }
    }

    pub fn from_name(name: &str) -> Result<Codebook, Exl3Error> {
        [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1]
            .into_iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| Exl3Error::UnknownCodebook {
                name: name.to_string(),
            })
    }
}

impl std::fmt::Display for Codebook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Bits per weight of a trellis: 1 to 8, or 1.5, 2.5 or 3.5 (mul1 only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    halves: u8,
}

impl Rate {
    /// The rate of tiles of `words` int16 words (16 per bit per weight).
    pub fn from_tile_len(words: usize) -> Result<Rate, Exl3Error> {
        let defined = words.is_multiple_of(8) && matches!(words / 8, 2..=8 | 10 | 12 | 14 | 16);
        if !defined {
            return Err(Exl3Error::Rate { words });
        }
        Ok(Rate {
            halves: (words / 8) as u8,
        })
    }

    /// The rate of `bits` bits per weight (1 to 8, or 1.5, 2.5, 3.5).
    pub fn from_bits(bits: f32) -> Result<Rate, Exl3Error> {
        let words = bits * 16.0;
        if words.fract() != 0.0 || !(0.0..=256.0).contains(&words) {
            return Err(Exl3Error::Bits { bits });
        }
        Rate::from_tile_len(words as usize)
    }

    pub fn bits(self) -> f32 {
        f32::from(self.halves) / 2.0
    }

    /// Int16 words of one tile (the trellis's last dimension).
    pub fn tile_words(self) -> usize {
        8 * usize::from(self.halves)
    }

    /// Bytes of the trellis of a layer of `k` inputs and `n` outputs as a checkpoint stores it.
    pub fn trellis_bytes(self, k: usize, n: usize) -> usize {
        k / 16 * (n / 16) * self.stream_bytes()
    }

    pub fn is_half(self) -> bool {
        self.halves % 2 == 1
    }

    /// Twice the bits per weight (2 to 16).
    pub fn halves(self) -> u8 {
        self.halves
    }

    /// Bits of the even positions (the odd ones get one more at half-integer rates).
    fn low_bits(self) -> usize {
        usize::from(self.halves / 2)
    }

    /// Bytes of a tile's bit stream (`16 * bits` int16 words).
    fn stream_bytes(self) -> usize {
        16 * usize::from(self.halves)
    }

    /// Bytes a tile occupies as stored here: its stream and the copy of the stream's last
    /// [`trellis::WRAP`] bytes in front of it.
    fn tile_bytes(self) -> usize {
        trellis::WRAP + self.stream_bytes()
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.bits())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Exl3Error {
    #[error("unknown EXL3 codebook `{name}` (expected 3inst, mcg or mul1)")]
    UnknownCodebook { name: String },
    #[error(
        "EXL3 trellis tiles of {words} int16 words are {} bits per weight, which EXL3 does not define (1 to 8, or 1.5, 2.5, 3.5)",
        *words as f32 / 16.0
    )]
    Rate { words: usize },
    #[error("{bits} bits per weight is not an EXL3 rate (1 to 8, or 1.5, 2.5, 3.5)")]
    Bits { bits: f32 },
    #[error("EXL3 half-integer rate {rate} needs the mul1 codebook, not {codebook}")]
    HalfRateCodebook { rate: Rate, codebook: Codebook },
    #[error("EXL3 trellis shape {shape:?}: {reason}")]
    Shape { shape: Vec<usize>, reason: String },
    #[error("EXL3 {what} has {got} {unit}, expected {expected}")]
    Length {
        what: &'static str,
        unit: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("the AVX2+FMA+F16C EXL3 kernel needs a CPU with those features")]
    SimdUnsupported,
}

/// Which code computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Portable,
    /// AVX2 + FMA + F16C, with AVX-512 VL + VNNI too where the CPU has them.
    Simd,
    /// The SIMD kernel as compiled for AVX2 + FMA + F16C alone (for comparing the two).
    Avx2,
}

impl Kernel {
    /// The kernel products use: SIMD when the CPU has it and it is not switched off (see
    /// [`super::CpuFeatures::simd_active`]).
    pub fn active() -> Kernel {
        if super::cpu_features().simd_active() {
            Kernel::Simd
        } else {
            Kernel::Portable
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel {
    /// The instruction set a SIMD kernel runs on.
    fn isa(self) -> simd_x86::Isa {
        if self == Kernel::Avx2 {
            simd_x86::Isa::Avx2
        } else {
            simd_x86::Isa::best()
        }
    }
}

/// The build of the SIMD kernel [`Kernel::Simd`] runs on this CPU, for the start-up log:
/// `avx512-vnni` (AVX2 with AVX-512 VL and VNNI) or `avx2`; `none` without AVX2+FMA+F16C.
pub fn simd_build() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if super::cpu_features().simd_supported() {
        return match simd_x86::Isa::best() {
            simd_x86::Isa::Avx512Vnni => "avx512-vnni",
            simd_x86::Isa::Avx2 => "avx2",
        };
    }
    "none"
}

/// One EXL3 linear layer: its trellis, `suh`, `svh` and optional bias.
#[derive(Clone)]
pub struct Exl3Linear {
    k: usize,
    n: usize,
    rate: Rate,
    codebook: Codebook,
    /// Tile `(kt, nt)` at `stream[(nt * k / 16 + kt) * tile_bytes..]`, laid out by
    /// `trellis::store_tile`; [`trellis::TAIL`] bytes of padding after the last tile. Strip
    /// by strip (the checkpoint goes row of tiles by row): a strip's product reads its tiles
    /// as one sequential run, which the hardware prefetches from DRAM, where the checkpoint's
    /// order puts each tile on another page.
    stream: super::Bytes,
    suh: Vec<f32>,
    svh: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl std::fmt::Debug for Exl3Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Exl3Linear({}x{} {} bpw {})",
            self.k, self.n, self.rate, self.codebook
        )
    }
}

impl Exl3Linear {
    /// A layer from its tensors: the trellis (`shape` `[K/16, N/16, 16 * bits]`, `trellis`
    /// its int16 values as little-endian bytes), `suh` (`K` values) and `svh` (`N`). The rate
    /// comes from the shape; `K` and `N` must be multiples of 128 (exllamav3 pads them so).
    pub fn new(
        shape: &[usize],
        trellis: &[u8],
        suh: Vec<f32>,
        svh: Vec<f32>,
        codebook: Codebook,
    ) -> Result<Exl3Linear, Exl3Error> {
        let parts = Exl3Parts::checked(shape, trellis.len(), suh, svh, codebook)?;
        let mut stream = vec![0u8; parts.stream_len()];
        parts.lay_out(trellis, &mut stream);
        Ok(parts.with_stream(stream.into()))
    }

    /// A layer of `k` inputs and `n` outputs from its bytes as a checkpoint stores them, one
    /// after the other: the trellis (int16, `[k/16, n/16, 16 * bits]`), then `suh` (`k` f16
    /// values) and `svh` (`n` f16 values), all little-endian.
    pub fn from_stored(
        k: usize,
        n: usize,
        rate: Rate,
        codebook: Codebook,
        bytes: &[u8],
    ) -> Result<Exl3Linear, Exl3Error> {
        let (parts, trellis) = Exl3Parts::stored(k, n, rate, codebook, bytes)?;
        let mut stream = vec![0u8; parts.stream_len()];
        parts.lay_out(trellis, &mut stream);
        Ok(parts.with_stream(stream.into()))
    }

    /// Bytes of the trellis of a layer of `k` inputs and `n` outputs as laid out here (what
    /// [`Exl3Linear::stream`] holds).
    pub fn stream_len(k: usize, n: usize, rate: Rate) -> usize {
        k / 16 * (n / 16) * rate.tile_bytes() + trellis::TAIL
    }

    /// Bytes of a layer without bias as [`Exl3Linear::from_stored`] reads it.
    pub fn stored_len(k: usize, n: usize, rate: Rate) -> usize {
        rate.trellis_bytes(k, n) + 2 * (k + n)
    }

    /// Whether the layer adds an output bias.
    pub fn has_bias(&self) -> bool {
        self.bias.is_some()
    }

    /// The layer with an output bias of `N` values.
    pub fn with_bias(mut self, bias: Vec<f32>) -> Result<Exl3Linear, Exl3Error> {
        if bias.len() != self.n {
            return Err(Exl3Error::Length {
                what: "bias",
                unit: "values",
                expected: self.n,
                got: bias.len(),
            });
        }
        self.bias = Some(bias);
        Ok(self)
    }

    /// Inputs `K`.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Outputs `N`.
    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn rate(&self) -> Rate {
        self.rate
    }

    pub fn codebook(&self) -> Codebook {
        self.codebook
    }

    /// The input scales `suh` (`K` values).
    pub fn suh(&self) -> &[f32] {
        &self.suh
    }

    /// The output scales `svh` (`N` values).
    pub fn svh(&self) -> &[f32] {
        &self.svh
    }

    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// The trellis as the checkpoint stores it (what a GPU decodes): int16
    /// `[K/16, N/16, 16 * bits]` as little-endian bytes.
    pub fn checkpoint_trellis(&self) -> Vec<u8> {
        let (tile_bytes, stream) = (self.rate.tile_bytes(), self.rate.stream_bytes());
        let (kt, nt) = (self.k / 16, self.n / 16);
        let mut out = vec![0u8; kt * nt * stream];
        // Read in order, each tile written to its place in its row of tiles.
        for (i, tile) in self
            .stream
            .chunks_exact(tile_bytes)
            .take(kt * nt)
            .enumerate()
        {
            let at = ((i % kt) * nt + i / kt) * stream;
            let words = tile[trellis::WRAP..].chunks_exact(4);
            for (w, o) in words.zip(out[at..at + stream].chunks_exact_mut(4)) {
                o.copy_from_slice(&u32::from_be_bytes([w[0], w[1], w[2], w[3]]).to_le_bytes());
            }
        }
        out
    }

    /// The trellis as stored here (start and length in bytes, for pinning them in RAM).
    pub fn trellis_span(&self) -> (*const u8, usize) {
        (self.stream.as_ptr(), self.stream.len())
    }

    /// The trellis as stored here (the bytes [`Exl3Linear::trellis_span`] points at).
    pub fn stream(&self) -> &super::Bytes {
        &self.stream
    }

    /// This layer with its trellis kept in `stream` (the same bytes [`Exl3Linear::stream`]
    /// gives, in other memory) instead of its own buffer.
    pub fn with_stream(&self, stream: super::Bytes) -> Exl3Linear {
        debug_assert!(stream[..] == self.stream[..], "with_stream: other bytes");
        let parts = Exl3Parts {
            k: self.k,
            n: self.n,
            rate: self.rate,
            codebook: self.codebook,
            suh: self.suh.clone(),
            svh: self.svh.clone(),
        };
        Exl3Linear {
            bias: self.bias.clone(),
            ..parts.with_stream(stream)
        }
    }

    /// Bytes as stored in an EXL3 checkpoint: trellis, f16 `suh` and `svh`, f16 bias.
    pub fn stored_bytes(&self) -> usize {
        let trellis = self.k / 16 * self.n / 16 * self.rate.stream_bytes();
        trellis + 2 * (self.k + self.n + self.bias.as_ref().map_or(0, Vec::len))
    }

    fn tile(&self, kt: usize, nt: usize) -> &[u8] {
        self.column(nt).tile(kt)
    }

    /// The tiles of output columns `16 nt..16 nt + 16`.
    fn column(&self, nt: usize) -> TileColumn<'_> {
        let tile_bytes = self.rate.tile_bytes();
        TileColumn {
            stream: &self.stream,
            start: nt * (self.k / 16) * tile_bytes,
            stride: tile_bytes,
            tiles: self.k / 16,
            tile_bytes,
        }
    }

    /// `What` (`[K, N]`, row-major): the decoded weights before rotation and scaling, as
    /// exllamav3's `reconstruct` writes them (every value an f16).
    pub fn reconstruct(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.k * self.n];
        let mut tile = [0f32; TILE_VALUES];
        for kt in 0..self.k / 16 {
            for nt in 0..self.n / 16 {
                trellis::decode_tile(self.rate, self.codebook, self.tile(kt, nt), &mut tile);
                for r in 0..16 {
                    let at = (16 * kt + r) * self.n + 16 * nt;
                    out[at..at + 16].copy_from_slice(&tile[16 * r..16 * r + 16]);
                }
            }
        }
        out
    }

    /// Columns `n0..n1` of `What`, transposed: `out[(c - n0) * K + r] = What[r, c]`. `n0` and
    /// `n1` are multiples of 16.
    pub fn reconstruct_columns_t(&self, n0: usize, n1: usize, out: &mut [f32]) {
        assert!(n0.is_multiple_of(16) && n1.is_multiple_of(16) && n0 <= n1 && n1 <= self.n);
        assert_eq!(
            out.len(),
            (n1 - n0) * self.k,
            "output of columns {n0}..{n1}"
        );
        let mut tile = [0f32; TILE_VALUES];
        for nt in n0 / 16..n1 / 16 {
            for kt in 0..self.k / 16 {
                trellis::decode_tile(self.rate, self.codebook, self.tile(kt, nt), &mut tile);
                for c in 0..16 {
                    let row = &mut out[(16 * nt + c - n0) * self.k + 16 * kt..][..16];
                    for (r, v) in row.iter_mut().enumerate() {
                        *v = tile[16 * r + c];
                    }
                }
            }
        }
    }

    /// Rows `r0..r1` of the full weight in the usual `[out, in]` orientation, `W^T`, in f32:
    /// `out[(r - r0) * K + i] = W[i, r]`.
    pub fn dequantize_rows(&self, r0: usize, r1: usize, out: &mut [f32]) {
        assert!(r0 <= r1 && r1 <= self.n, "rows {r0}..{r1} of {}", self.n);
        assert_eq!(out.len(), (r1 - r0) * self.k, "output of rows {r0}..{r1}");
        let (k, b) = (self.k, hadamard::BLOCK);
        let mut block_t = vec![0f32; b * k];
        let mut rotated = vec![0f32; k * b];
        let mut block = usize::MAX;
        for r in r0..r1 {
            if r / b != block {
                block = r / b;
                // What's 128 columns of this block, rotated along N: (What H)[:, block].
                self.reconstruct_columns_t(block * b, block * b + b, &mut block_t);
                for i in 0..k {
                    for c in 0..b {
                        rotated[i * b + c] = block_t[c * k + i];
                    }
                }
                hadamard::rotate(&mut rotated);
                for c in 0..b {
                    for i in 0..k {
                        block_t[c * k + i] = rotated[i * b + c];
                    }
                }
            }
            // Then rotated along K, scaled by suh and svh.
            let row = &mut out[(r - r0) * k..(r - r0 + 1) * k];
            row.copy_from_slice(&block_t[(r % b) * k..(r % b + 1) * k]);
            hadamard::rotate(row);
            for (v, s) in row.iter_mut().zip(&self.suh) {
                *v *= s * self.svh[r];
            }
        }
    }

    /// `x diag(suh) H` for `rows` rows of `x` (`[rows, K]`): the input in `What`'s basis.
    pub fn rotate_input(&self, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k, "{rows} input rows of {}", self.k);
        let mut xr: Vec<f32> = x
            .chunks_exact(self.k)
            .flat_map(|row| row.iter().zip(&self.suh).map(|(v, s)| v * s))
            .collect();
        hadamard::rotate(&mut xr);
        xr
    }

    /// `z H diag(svh) + bias` in place, for `rows` rows of `z` (`[rows, N]`): the output back
    /// from `What`'s basis.
    pub fn rotate_output(&self, z: &mut [f32], rows: usize) {
        assert_eq!(z.len(), rows * self.n, "{rows} output rows of {}", self.n);
        hadamard::rotate(z);
        for row in z.chunks_exact_mut(self.n) {
            for (v, s) in row.iter_mut().zip(&self.svh) {
                *v *= s;
            }
            if let Some(bias) = &self.bias {
                for (v, b) in row.iter_mut().zip(bias) {
                    *v += b;
                }
            }
        }
    }

    /// `y = x W` for `rows` rows (`x` `[rows, K]`, `y` `[rows, N]`) on [`Kernel::active`],
    /// spread over the rayon pool by 16-column strips.
    pub fn forward(&self, x: &[f32], rows: usize, y: &mut [f32]) {
        self.forward_with(Kernel::active(), x, rows, y)
            .expect("the active kernel is supported");
    }

    /// As [`Exl3Linear::forward`] on the given kernel.
    ///
    /// # Panics
    /// When `x` or `y` do not hold `rows` rows.
    pub fn forward_with(
        &self,
        kernel: Kernel,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
    ) -> Result<(), Exl3Error> {
        assert_eq!(y.len(), rows * self.n, "{rows} output rows of {}", self.n);
        if kernel != Kernel::Portable && !super::cpu_features().simd_supported() {
            return Err(Exl3Error::SimdUnsupported);
        }
        if rows == 0 {
            return Ok(());
        }
        let xr = self.rotate_input(x, rows);
        let input = match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Simd | Kernel::Avx2 => simd_x86::arrange(&xr, rows, self.codebook),
            _ => xr,
        };
        // Strip-major partial products: [N/16][rows][16].
        let mut strips = vec![0f32; rows * self.n];
        strips
            .par_chunks_mut(rows * 16)
            .enumerate()
            .for_each(|(nt, out)| self.strip(kernel, nt, &input, rows, out));
        for (nt, strip) in strips.chunks_exact(rows * 16).enumerate() {
            for (row, part) in strip.chunks_exact(16).enumerate() {
                y[row * self.n + 16 * nt..][..16].copy_from_slice(part);
            }
        }
        self.rotate_output(y, rows);
        Ok(())
    }

    /// `y = x W` for one row `x` as the CPU lane of the near-exact modes computes it (see
    /// `lane.rs`: 16-bit integer inputs against mul1's byte sums), on [`Kernel::active`].
    /// Other codebooks, and an input with a value that is not finite, as
    /// [`Exl3Linear::forward`].
    pub fn forward_lane(&self, x: &[f32], y: &mut [f32]) {
        self.forward_lane_with(Kernel::active(), x, y)
            .expect("the active kernel is supported");
    }

    /// Whether [`Exl3Linear::forward_lane`] takes the integer path (a mul1 trellis).
    pub fn lane_integer(&self) -> bool {
        self.codebook == Codebook::Mul1
    }

    /// As [`Exl3Linear::forward_lane`] on the given kernel (every kernel gives the same bits).
    ///
    /// # Panics
    /// When `x` or `y` do not hold one row.
    pub fn forward_lane_with(
        &self,
        kernel: Kernel,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), Exl3Error> {
        assert_eq!(y.len(), self.n, "one output row of {}", self.n);
        if kernel != Kernel::Portable && !super::cpu_features().simd_supported() {
            return Err(Exl3Error::SimdUnsupported);
        }
        if !self.lane_integer() {
            return self.forward_with(kernel, x, 1, y);
        }
        let Some(input) = lane::LaneInput::new(&self.rotate_input(x, 1)) else {
            return self.forward_with(kernel, x, 1, y);
        };
        let arranged = match kernel {
            Kernel::Portable => Vec::new(),
            _ => input.arranged(),
        };
        y.par_chunks_mut(16)
            .enumerate()
            .for_each(|(nt, out)| match kernel {
                #[cfg(target_arch = "x86_64")]
                Kernel::Simd | Kernel::Avx2 => simd_x86::lane_strip(
                    kernel.isa(),
                    self.rate,
                    self.column(nt),
                    &input,
                    &arranged,
                    out,
                ),
                #[cfg(not(target_arch = "x86_64"))]
                Kernel::Simd | Kernel::Avx2 => unreachable!("refused above"),
                Kernel::Portable => lane::strip(self.rate, self.column(nt), &input, out),
            });
        self.rotate_output(y, 1);
        Ok(())
    }

    /// Output columns `16 nt..16 nt + 16` of `xr What` (`out`: `[rows, 16]`), from the
    /// rotated input as the kernel arranges it.
    fn strip(&self, kernel: Kernel, nt: usize, input: &[f32], rows: usize, out: &mut [f32]) {
        let tiles = self.column(nt);
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Simd | Kernel::Avx2 => simd_x86::strip(
                kernel.isa(),
                self.rate,
                self.codebook,
                tiles,
                input,
                rows,
                out,
            ),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Simd | Kernel::Avx2 => unreachable!("forward_with refuses SIMD kernels here"),
            Kernel::Portable => portable::strip(self.rate, self.codebook, tiles, input, rows, out),
        }
    }
}

/// The tiles of one 16-column strip of a trellis, top to bottom.
#[derive(Clone, Copy)]
struct TileColumn<'a> {
    stream: &'a [u8],
    start: usize,
    stride: usize,
    tiles: usize,
    tile_bytes: usize,
}

impl<'a> TileColumn<'a> {
    /// Tile `kt` with the [`trellis::TAIL`] bytes after it, which wide reads may touch.
    fn tile(&self, kt: usize) -> &'a [u8] {
        &self.stream[self.start + kt * self.stride..][..self.tile_bytes + trellis::TAIL]
    }
}

#[cfg(test)]
mod tests;
