//! CUDA C sources of glmflash, embedded so the node server compiles them with NVRTC at start
//! for the compute capability of the device it finds (and CI compiles them with nvcc to PTX
//! for sm_86 and sm_90, see `e2e/kernels_ptx.sh`).
//!
//! Every `.cu` file starts with `#include "common.cuh"`; [`module_source`] inlines it, so
//! NVRTC needs no include path and no CUDA headers.

/// The shared header every kernel file includes.
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// `(file name, CUDA C source)` for every kernel file, and the `extern "C"` kernels in it.
pub const SOURCES: &[(&str, &str, &[&str])] = &[
    (
        "gemv.cu",
        include_str!("../cuda/gemv.cu"),
        &[
            "matvec",
            "matvec_split",
            "matvec_t1",
            "matvec_t2",
            "matvec_t4",
            "matvec_split_t1",
            "matvec_split_t2",
            "matvec_split_t4",
            "matvec_q_t1",
            "matvec_q_t2",
            "matvec_q_t4",
            "matvec_q_split_t1",
            "matvec_q_split_t2",
            "matvec_q_split_t4",
            "matvec_q4k_xl_t1",
            "matvec_q4k_xl_t2",
            "matvec_q4k_xl_t4",
            "lane32_x",
            "widen_f32",
            "dequant_rows",
            "split_bf16x3",
        ],
    ),
    (
        "exl3.cu",
        include_str!("../cuda/exl3.cu"),
        &[
            "exl3_rotate_input",
            "exl3_rotate_output",
            "exl3_gemv",
            "exl3_reconstruct",
            "exl3_moe_rotate_in",
            "exl3_moe_gemv",
            "exl3_moe_gemv_wide",
            "exl3_moe_act",
            "exl3_moe_rotate_out",
        ],
    ),
    (
        "moe.cu",
        include_str!("../cuda/moe.cu"),
        &[
            "moe_gate_up",
            "moe_down",
            "moe_gate_up_wide",
            "moe_down_wide",
            "moe_gather",
            "moe_scatter",
            "moe_combine",
            "moe_group",
        ],
    ),
    (
        "norm.cu",
        include_str!("../cuda/norm.cu"),
        &["rms_norm", "gated_rms_norm", "layer_norm"],
    ),
    (
        "act.cu",
        include_str!("../cuda/act.cu"),
        &[
            "swiglu",
            "scale_values",
            "add_values",
            "stream_mean",
            "repeat_rows",
        ],
    ),
    ("router.cu", include_str!("../cuda/router.cu"), &["route"]),
    (
        "mhc.cu",
        include_str!("../cuda/mhc.cu"),
        &[
            "mhc_project",
            "mhc_project_bf16",
            "mhc_collapse",
            "mhc_expand",
        ],
    ),
    (
        "kda.cu",
        include_str!("../cuda/kda.cu"),
        &[
            "kda_conv",
            "kda_conv_seqs",
            "kda_conv_state",
            "kda_recurrent",
            "kda_recurrent_seqs",
            "kda_chunked",
            "kda_gates",
            "interleave3",
        ],
    ),
    (
        "mla.cu",
        include_str!("../cuda/mla.cu"),
        &[
            "mla_sparse_attend",
            "mla_attend_shared",
            "mla_absorb_q",
            "mla_absorb_out",
            "cache_store",
            "sel_offsets_gather",
        ],
    ),
    (
        "dsa.cu",
        include_str!("../cuda/dsa.cu"),
        &[
            "dsa_pool_keys",
            "dsa_pool_step",
            "dsa_plan",
            "dsa_scores",
            "dsa_topk_tokens",
        ],
    ),
];

const INCLUDE: &str = "#include \"common.cuh\"";

/// The self-contained source of one kernel file: its include of `common.cuh` replaced by
/// the header's text. `None` for an unknown file.
pub fn module_source(file: &str) -> Option<String> {
    let (_, src, _) = SOURCES.iter().find(|(name, _, _)| *name == file)?;
    Some(src.replacen(INCLUDE, COMMON.trim_start_matches("#pragma once"), 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_is_a_cu_file_that_includes_the_header_once() {
        for (name, src, kernels) in SOURCES {
            assert!(name.ends_with(".cu"), "{name}");
            assert_eq!(src.matches(INCLUDE).count(), 1, "{name}");
            let inlined = module_source(name).unwrap();
            assert!(!inlined.contains(INCLUDE), "{name}");
            assert!(inlined.contains("#define FMT_Q4_K"), "{name}");
            let defined = defined_kernels(src);
            for k in *kernels {
                assert!(defined.contains(k), "{name} lacks kernel {k}");
            }
        }
    }

    /// The `extern "C"` kernels a source defines, each as `extern "C" __global__ void NAME(`,
    /// optionally with `__launch_bounds__(...)` before the name.
    fn defined_kernels(src: &str) -> Vec<&str> {
        let marker = "extern \"C\" __global__ void ";
        src.match_indices(marker)
            .map(|(at, _)| {
                let mut rest = &src[at + marker.len()..];
                if let Some(after) = rest.strip_prefix("__launch_bounds__(") {
                    rest = after[after.find(')').unwrap() + 1..].trim_start();
                }
                &rest[..rest.find('(').unwrap()]
            })
            .collect()
    }

    #[test]
    fn every_kernel_in_a_source_is_listed() {
        for (name, src, kernels) in SOURCES {
            for kernel in defined_kernels(src) {
                assert!(
                    kernels.contains(&kernel),
                    "{name}: kernel {kernel} is not listed"
                );
            }
        }
    }

    #[test]
    fn every_cu_file_on_disk_is_listed() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".cu") {
                assert!(
                    SOURCES.iter().any(|(n, _, _)| *n == name),
                    "{name} not in SOURCES"
                );
            }
        }
    }

    #[test]
    fn unknown_file_is_none() {
        assert!(module_source("nope.cu").is_none());
    }
}
