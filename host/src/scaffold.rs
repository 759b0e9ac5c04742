//! `berth policy new --lang rust|python|js|c <name>`: writes a policy
//! project that builds to a component with that language's toolchain
//! (scripts/install-lang-toolchains.sh installs them) and passes
//! `berth policy test`. The templates are compiled into the binary.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The contract the Python, JavaScript and C templates build against: 0.2.0,
/// whose world has no pool hooks those templates would have to stub.
const WIT: &str = include_str!("../../wit/v0.2.0/policy.wit");
const WIT_VERSION: &str = "0.2.0";
/// Rust builds against the SDK's contract, which gives every hook a default.
const SDK_WIT_VERSION: &str = "0.3.0";

/// (path in the project, template text, executable)
type File = (&'static str, &'static str, bool);

const RUST: &[File] = &[
    ("Cargo.toml", include_str!("../templates/rust/Cargo.toml"), false),
    ("src/lib.rs", include_str!("../templates/rust/src/lib.rs"), false),
    ("build.sh", include_str!("../templates/rust/build.sh"), true),
];
const PYTHON: &[File] = &[
    ("app.py", include_str!("../templates/python/app.py"), false),
    ("build.sh", include_str!("../templates/python/build.sh"), true),
    ("wit/policy.wit", WIT, false),
];
const JS: &[File] = &[
    ("policy.js", include_str!("../templates/js/policy.js"), false),
    ("build.sh", include_str!("../templates/js/build.sh"), true),
    ("wit/policy.wit", WIT, false),
];
const C: &[File] = &[
    ("policy.c", include_str!("../templates/c/policy.c"), false),
    ("build.sh", include_str!("../templates/c/build.sh"), true),
    ("wit/policy.wit", WIT, false),
];

const README: &str = include_str!("../templates/README.md");

/// Languages `berth policy new` knows, with what builds them.
pub const LANGS: &[(&str, &str)] = &[
    ("rust", "cargo + the berth-sdk crate"),
    ("python", "componentize-py 0.25.1 (pip)"),
    ("js", "componentize-js 0.23.0 (npm)"),
    ("c", "clang + wasi-libc (apt) + wit-bindgen c 0.53.0 (cargo install)"),
];

/// The language's canonical name, toolchain and files.
fn template(lang: &str) -> anyhow::Result<(&'static str, &'static str, &'static [File])> {
    let (canonical, files) = match lang {
        "rust" => ("rust", RUST),
        "python" | "py" => ("python", PYTHON),
        "js" | "javascript" => ("js", JS),
        "c" => ("c", C),
        other => anyhow::bail!(
            "unknown language {other:?}; one of: {}",
            LANGS.iter().map(|(l, _)| *l).collect::<Vec<_>>().join(", ")
        ),
    };
    let toolchain = LANGS.iter().find(|(l, _)| *l == canonical).expect("listed").1;
    Ok((canonical, toolchain, files))
}

/// Where the Rust SDK is: `$BERTH_SDK_DIR`, else the checkout this binary
/// was built from.
fn sdk_dir() -> PathBuf {
    std::env::var_os("BERTH_SDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk"))
}

/// Checks a policy name: lowercase letters, digits and dashes, starting
/// with a letter (what the host accepts from `info`).
pub fn check_name(name: &str) -> anyhow::Result<()> {
    let ok = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    anyhow::ensure!(ok, "policy name {name:?} must be lowercase letters, digits and dashes, starting with a letter");
    Ok(())
}

/// Creates `<parent>/<name>/` for `lang` and returns its path. Refuses to
/// write into an existing folder.
pub fn create(lang: &str, name: &str, parent: &Path) -> anyhow::Result<PathBuf> {
    check_name(name)?;
    let (lang, toolchain, files) = template(lang)?;
    let dir = parent.join(name);
    anyhow::ensure!(!dir.exists(), "{} already exists", dir.display());
    let sdk = sdk_dir();
    let sdk = sdk.canonicalize().unwrap_or(sdk);
    let berth = std::env::current_exe().ok().and_then(|p| p.canonicalize().ok()).unwrap_or_else(|| PathBuf::from("berth"));
    let crate_name = format!("{name}-policy");
    let fill = |text: &str| {
        text.replace("{{name}}", name)
            .replace("{{crate}}", &crate_name)
            .replace("{{crate_file}}", &crate_name.replace('-', "_"))
            .replace("{{sdk}}", &sdk.to_string_lossy())
            .replace("{{berth}}", &berth.to_string_lossy())
            .replace("{{lang}}", lang)
            .replace("{{toolchain}}", toolchain)
            .replace("{{contract}}", if lang == "rust" { SDK_WIT_VERSION } else { WIT_VERSION })
    };
    for (path, text, exec) in files.iter().chain(std::iter::once(&("README.md", README, false))) {
        let target = dir.join(path);
        std::fs::create_dir_all(target.parent().expect("inside dir")).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(&target, fill(text)).with_context(|| format!("writing {}", target.display()))?;
        #[cfg(unix)]
        if *exec {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    Ok(dir)
}
