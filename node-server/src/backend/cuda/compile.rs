//! The kernels' PTX: NVRTC compiles each embedded source for the device's architecture, with
//! the knobs `GLMFLASH_KERNEL_DEFINES` sets, and a directory caches the result by a key of
//! source, architecture, NVRTC version and knobs.

use super::{CudaError, nvrtc_present};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::path::{Path, PathBuf};

/// PTX for `file` on `arch`, from `cache_dir` when a matching entry exists, else compiled
/// with NVRTC (and written there).
pub(super) fn compile_cached(
    file: &str,
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<Ptx, CudaError> {
    use sha2::{Digest, Sha256};
    let src = glmflash_kernels::module_source(file).expect("file comes from SOURCES");
    let nvrtc = nvrtc_version();
    let defines = kernel_defines()?;
    let key = {
        let mut h = Sha256::new();
        h.update(src.as_bytes());
        h.update(arch.as_bytes());
        h.update(nvrtc.as_bytes());
        for d in defines {
            h.update(b"\0");
            h.update(d.as_bytes());
        }
        let d = h.finalize();
        d.iter()
            .take(12)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let path: Option<PathBuf> =
        cache_dir.map(|d| d.join(format!("{}-{arch}-{key}.ptx", file.trim_end_matches(".cu"))));
    if let Some(p) = &path
        && let Ok(text) = std::fs::read_to_string(p)
    {
        tracing::debug!(file, arch, path = %p.display(), "kernel PTX from the cache");
        return Ok(Ptx::from_src(text));
    }
    if !nvrtc_present() {
        return Err(CudaError::Unavailable(
            "the CUDA runtime compiler (libnvrtc) was not found: install the CUDA toolkit (or the \
             nvidia-cuda-nvrtc package) and put its lib directory on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let started = std::time::Instant::now();
    let opts = CompileOptions {
        arch: Some(static_arch(arch)),
        options: ["--std=c++17", "--generate-line-info"]
            .into_iter()
            .map(String::from)
            .chain(defines.iter().cloned())
            .collect(),
        name: Some(file.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => CudaError::Compile {
            file: file.into(),
            arch: arch.into(),
            log: log.to_string_lossy().into_owned(),
        },
        other => CudaError::Compile {
            file: file.into(),
            arch: arch.into(),
            log: format!("{other:?}"),
        },
    })?;
    tracing::info!(file, arch, nvrtc = %nvrtc, ms = started.elapsed().as_millis() as u64, "compiled kernels with NVRTC");
    if let Some(p) = &path {
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(p.parent().unwrap_or(Path::new(".")))?;
            let tmp = p.with_extension("tmp");
            std::fs::write(&tmp, ptx.to_src())?;
            std::fs::rename(&tmp, p)
        };
        if let Err(e) = write() {
            tracing::warn!(path = %p.display(), error = %e, "could not cache compiled kernels");
        }
    }
    Ok(ptx)
}

/// The kernels' compile-time knobs set from `GLMFLASH_KERNEL_DEFINES` (`NAME=VALUE` or `NAME`,
/// separated by spaces or commas; e.g. `EXL3_GEMV_MIN_BLOCKS=2`), as NVRTC `-D` options: for
/// trying a kernel variant on a machine without rebuilding (A/B timings and checks). Unset:
/// none, the sources' defaults. Part of the kernel cache's key.
fn kernel_defines() -> Result<&'static [String], CudaError> {
    static DEFINES: std::sync::OnceLock<Result<Vec<String>, String>> = std::sync::OnceLock::new();
    let parsed = DEFINES.get_or_init(|| {
        let spec = std::env::var("GLMFLASH_KERNEL_DEFINES").unwrap_or_default();
        let defines = parse_kernel_defines(&spec)?;
        if !defines.is_empty() {
            tracing::warn!(defines = %defines.join(" "), "kernels compiled with GLMFLASH_KERNEL_DEFINES (a tuning knob, not a product setting)");
        }
        Ok(defines)
    });
    parsed
        .as_deref()
        .map_err(|e| CudaError::Invalid(format!("GLMFLASH_KERNEL_DEFINES: {e}")))
}

/// The integer value knob `name` has in `GLMFLASH_KERNEL_DEFINES`, for a knob the host's launch
/// must follow (the rows a warp of a product: its grid). None when unset or unparsable.
pub(super) fn kernel_knob(name: &str) -> Option<i64> {
    let prefix = format!("-D{name}=");
    kernel_defines()
        .ok()?
        .iter()
        .find_map(|d| d.strip_prefix(&prefix)?.parse().ok())
}

/// `NAME=VALUE` / `NAME` items (spaces or commas between them) as `-DNAME=VALUE` options.
/// Names are C identifiers in capitals; values letters, digits, `.`, `_`, `+`, `-`.
fn parse_kernel_defines(spec: &str) -> Result<Vec<String>, String> {
    spec.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|item| !item.is_empty())
        .map(|item| {
            let (name, value) = item.split_once('=').unwrap_or((item, ""));
            let name_ok = name.starts_with(|c: char| c.is_ascii_uppercase() || c == '_')
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            let value_ok = value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '+' | '-'));
            if !name_ok || !value_ok {
                return Err(format!(
                    "`{item}` is not NAME=VALUE with NAME in capitals (A-Z, 0-9, _) and VALUE of \
                     letters, digits, '.', '_', '+' or '-'"
                ));
            }
            Ok(if item.contains('=') {
                format!("-D{name}={value}")
            } else {
                format!("-D{name}")
            })
        })
        .collect()
}

fn nvrtc_version() -> String {
    if !nvrtc_present() {
        return "absent".into();
    }
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: nvrtcVersion writes two ints through valid pointers; the library is present.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        format!("unknown ({status:?})")
    }
}

/// cudarc wants the arch as a `&'static str`; the common ones are literals, others leak once.
fn static_arch(arch: &str) -> &'static str {
    const KNOWN: [&str; 9] = [
        "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120", "sm_121",
    ];
    KNOWN
        .iter()
        .find(|a| **a == arch)
        .copied()
        .unwrap_or_else(|| Box::leak(arch.to_string().into_boxed_str()))
}

#[cfg(test)]
mod tests {
    use super::parse_kernel_defines;

    #[test]
    fn kernel_defines_parse_to_options_and_bad_items_are_refused() {
        assert_eq!(parse_kernel_defines("").unwrap(), Vec::<String>::new());
        assert_eq!(
            parse_kernel_defines(" MATVEC_Q4K_BLOCKS=8,Q4K_FLAG  EXL3_ROUND=2 ").unwrap(),
            ["-DMATVEC_Q4K_BLOCKS=8", "-DQ4K_FLAG", "-DEXL3_ROUND=2"]
        );
        for bad in ["lower=1", "9LIVES=1", "A=1;rm", "A=$(x)", "=3", "A B=\"1\""] {
            let err = parse_kernel_defines(bad).unwrap_err();
            assert!(err.contains("NAME=VALUE"), "{bad}: {err}");
        }
    }
}
