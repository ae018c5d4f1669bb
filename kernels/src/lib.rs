//! CUDA C sources of glmflash, embedded so the node server can compile them with NVRTC
//! at start for the device it finds.
//!
//! No kernel exists yet: the CUDA backend (a later issue) adds each `.cu` file here with an
//! entry in [`SOURCES`]. The node server runs on the CPU until then.

/// `(file name, CUDA C source)` for every kernel file this crate carries.
pub const SOURCES: &[(&str, &str)] = &[];

#[cfg(test)]
mod tests {
    #[test]
    fn every_source_is_a_cu_file() {
        for (name, _) in super::SOURCES {
            assert!(name.ends_with(".cu"), "{name}");
        }
    }
}
