//! Finding policy components: `--policy binpack` names a bundled component,
//! `--policy path/to/x.wasm` a file.

use std::path::{Path, PathBuf};

/// Where bundled components live: `$BERTH_POLICY_DIR`, else `target/policies`
/// beside the binary's profile folder, else `./target/policies`.
pub fn policy_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("BERTH_POLICY_DIR") {
        return PathBuf::from(dir);
    }
    if let Ok(exe) = std::env::current_exe() {
        // target/<profile>/berth or target/<profile>/deps/<test>
        for up in exe.ancestors().skip(1).take(3) {
            let dir = up.join("policies");
            if dir.join("binpack.wasm").exists() {
                return dir;
            }
        }
    }
    PathBuf::from("target/policies")
}

/// Resolves a policy argument to a component file, with a clear error
/// listing what is available when it does not exist.
pub fn resolve(spec: &str) -> anyhow::Result<PathBuf> {
    let as_path = Path::new(spec);
    if spec.ends_with(".wasm") || spec.contains(std::path::MAIN_SEPARATOR) {
        anyhow::ensure!(as_path.is_file(), "policy component {spec:?} does not exist");
        return Ok(as_path.to_path_buf());
    }
    let dir = policy_dir();
    let path = dir.join(format!("{spec}.wasm"));
    if path.is_file() {
        return Ok(path);
    }
    let available = available(&dir);
    anyhow::bail!(
        "no policy named {spec:?} in {} (available: {}); build them with scripts/build-policies.sh or pass a .wasm path",
        dir.display(),
        if available.is_empty() { "none".to_string() } else { available.join(", ") }
    )
}

/// Names of the components in `dir`, sorted.
pub fn available(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".wasm").map(str::to_string))
        .collect();
    names.sort();
    names
}
