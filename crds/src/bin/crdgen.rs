//! Prints the GlmFlashDeployment CRD as YAML: `cargo run -p glmflash-crds --bin crdgen`.
//! With `--write`, rewrites the checked-in copies (crds/ and the Helm chart) instead.

use std::path::Path;

fn main() -> std::io::Result<()> {
    let yaml = glmflash_crds::crd_yaml();
    if std::env::args().any(|a| a == "--write") {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for file in [glmflash_crds::CRD_FILE, glmflash_crds::CHART_CRD_FILE] {
            let path = root.join(file);
            std::fs::create_dir_all(path.parent().expect("file has a parent"))?;
            std::fs::write(&path, &yaml)?;
            eprintln!("wrote {}", path.display());
        }
    } else {
        print!("{yaml}");
    }
    Ok(())
}
