//! Finding policy components: `--policy binpack` names a bundled component,
//! `--policy path/to/x.wasm` a file.

use std::path::{Path, PathBuf};

/// Where bundled components were found, and why there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyDir {
    pub dir: PathBuf,
    pub source: &'static str,
}

/// Where bundled components live, first found of:
/// 1. `$BERTH_POLICY_DIR`;
/// 2. `<prefix>/share/berth/policies` for a binary in `<prefix>/bin`
///    (`scripts/install.sh` puts them there);
/// 3. `target/policies` beside the binary's profile folder (a development
///    build, or a test binary in `target/<profile>/deps`);
/// 4. the `target/policies` of the checkout the binary was built from
///    (`cargo install --path host` after `scripts/build-policies.sh`);
/// 5. `./target/policies`.
pub fn policy_dir() -> PathBuf {
    find_policy_dir().dir
}

/// [`policy_dir`] with the reason it was chosen (`berth policy list`).
pub fn find_policy_dir() -> PolicyDir {
    if let Some(dir) = std::env::var_os("BERTH_POLICY_DIR") {
        return PolicyDir { dir: PathBuf::from(dir), source: "$BERTH_POLICY_DIR" };
    }
    let holds = |dir: &Path| dir.join("binpack.wasm").is_file();
    if let Ok(exe) = std::env::current_exe() {
        let exe = exe.canonicalize().unwrap_or(exe);
        if let Some(prefix) = exe.parent().filter(|bin| bin.file_name().is_some_and(|n| n == "bin")).and_then(Path::parent) {
            let dir = prefix.join("share/berth/policies");
            if holds(&dir) {
                return PolicyDir { dir, source: "installed beside the binary" };
            }
        }
        // target/<profile>/berth or target/<profile>/deps/<test>
        for up in exe.ancestors().skip(1).take(3) {
            let dir = up.join("policies");
            if holds(&dir) {
                return PolicyDir { dir, source: "the development build beside the binary" };
            }
        }
    }
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/policies");
    if holds(&checkout) {
        return PolicyDir { dir: checkout.canonicalize().unwrap_or(checkout), source: "the checkout the binary was built from" };
    }
    PolicyDir { dir: PathBuf::from("target/policies"), source: "the current folder" }
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
        "no policy named {spec:?} in {} (available: {}); build them with scripts/build-policies.sh, install them with scripts/install.sh, or pass a .wasm path",
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
