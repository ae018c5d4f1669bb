//! Compute backends. `cpu` is the reference path every other backend is proved against;
//! `cuda` runs the same products on an NVIDIA GPU when one (and its driver) is present.

pub mod cpu;
pub mod cuda;

use std::path::PathBuf;
use std::sync::Arc;

/// What `--device` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceChoice {
    /// CUDA when a device and its driver are found, else the CPU (and a log line saying why).
    Auto,
    Cpu,
    /// CUDA or a clear error.
    Cuda,
}

/// How a sequence's growing caches (MLA latents; DSA indexer keys, gates and pool keys) hold
/// a value: f32, or rounded to nearest-even bf16 / f16 when a row is pushed (half the bytes)
/// and widened to f32 as attention and the indexer read it, their arithmetic staying f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheDtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl CacheDtype {
    pub const ALL: [CacheDtype; 3] = [CacheDtype::F32, CacheDtype::Bf16, CacheDtype::F16];

    /// Bytes of one cached value.
    pub fn bytes(self) -> usize {
        match self {
            CacheDtype::F32 => 4,
            CacheDtype::Bf16 | CacheDtype::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheDtype::F32 => "f32",
            CacheDtype::Bf16 => "bf16",
            CacheDtype::F16 => "f16",
        }
    }
}

/// Where products run: the CPU, or a CUDA device with its compiled kernels.
#[derive(Clone, Debug)]
pub enum Device {
    Cpu,
    Cuda(Arc<cuda::Cuda>),
}

/// The device flags every model-loading command takes.
#[derive(Clone, Debug, clap::Args)]
pub struct DeviceArgs {
    /// Where products run: auto (CUDA when present), cpu or cuda. On CUDA the dense weights
    /// and the routed experts (or the tiers' device slots) live and multiply on the GPU, and
    /// `serve` keeps its sequences' activations and caches there (`--gpu-forward`).
    #[arg(long, env = "GLMFLASH_DEVICE", value_enum, default_value = "cpu")]
    pub device: DeviceChoice,
    /// CUDA device ordinal.
    #[arg(long, env = "GLMFLASH_CUDA_DEVICE", default_value_t = 0)]
    pub cuda_device: usize,
    /// Where compiled kernels are cached (default: $GLMFLASH_CACHE_DIR/kernels or
    /// ~/.cache/glmflash/kernels).
    #[arg(long, env = "GLMFLASH_KERNEL_CACHE")]
    pub kernel_cache: Option<PathBuf>,
}

impl DeviceArgs {
    /// Opens the device the flags ask for.
    pub fn open(&self) -> anyhow::Result<Device> {
        if self.device == DeviceChoice::Cpu {
            return Ok(Device::Cpu);
        }
        let cache = self.kernel_cache.clone().or_else(default_kernel_cache);
        match cuda::Cuda::open(self.cuda_device, cache.as_deref()) {
            Ok(c) => {
                let (free, total) = c.mem_info()?;
                tracing::info!(
                    device = %c.describe(),
                    free_mib = free >> 20,
                    total_mib = total >> 20,
                    "CUDA device opened"
                );
                Ok(Device::Cuda(c))
            }
            Err(e) if self.device == DeviceChoice::Auto => {
                tracing::warn!(reason = %e, "no usable CUDA device; running on the CPU");
                Ok(Device::Cpu)
            }
            Err(e) => Err(anyhow::anyhow!(e).context("--device cuda")),
        }
    }
}

fn default_kernel_cache() -> Option<PathBuf> {
    let base = std::env::var_os("GLMFLASH_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/glmflash")))?;
    Some(base.join("kernels"))
}

/// Where attention finds each token's key and value inside one `[tokens, stride]` buffer:
/// head `h`'s key of token `j` is `dk` values at `j * stride + h * head_step + k_off`, its
/// value `dv` values at `j * stride + h * head_step + v_off`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnLayout {
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub stride: usize,
    pub head_step: usize,
    pub k_off: usize,
    pub v_off: usize,
    pub scale: f32,
}

impl AttnLayout {
    /// MLA decode with weight absorption: every head attends over the shared `rank`-wide
    /// latent, which is both key and value.
    pub fn absorbed(heads: usize, rank: usize, scale: f32) -> AttnLayout {
        AttnLayout {
            heads,
            dk: rank,
            dv: rank,
            stride: rank,
            head_step: 0,
            k_off: 0,
            v_off: 0,
            scale,
        }
    }

    /// MLA with keys and values expanded per head: `[tokens, heads, nope + v_dim]`.
    pub fn expanded(heads: usize, nope: usize, v_dim: usize, scale: f32) -> AttnLayout {
        AttnLayout {
            heads,
            dk: nope,
            dv: v_dim,
            stride: heads * (nope + v_dim),
            head_step: nope + v_dim,
            k_off: 0,
            v_off: nope,
            scale,
        }
    }
}
