//! `berth policy new --lang rust|python|js|c --hook place|rank|compact|pool
//! <name>`: writes a working policy project for that hook against the newest
//! contract that builds from its own folder with that language's toolchain
//! (its build.sh finds what Berth's installers put under ~/.cache/berth-tools,
//! and names the installer when a tool is missing) and passes `berth policy
//! test`. The templates are compiled into the binary; where Berth bundles a
//! policy for that hook in that language, its source is the template, so
//! what a project starts from is what the tests check against Rust.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The contract every template builds against: the newest. Python, JS and
/// C carry its WIT; Rust gets it from the SDK (whose hooks all default).
const WIT: &str = include_str!("../../wit/v0.4.0/policy.wit");
const WIT_VERSION: &str = "0.4.0";

/// The pinned tool versions scripts/install-lang-toolchains.sh installs
/// (a test checks they agree).
const COMPONENTIZE_PY: &str = "0.25.1";
const COMPONENTIZE_JS: &str = "0.23.0";
const WIT_BINDGEN: &str = "0.53.0";

/// (path in the project, template text, executable)
type File = (&'static str, &'static str, bool);

const RUST: &[File] = &[("Cargo.toml", include_str!("../templates/rust/Cargo.toml"), false), ("build.sh", include_str!("../templates/rust/build.sh"), true)];
const PYTHON: &[File] = &[("build.sh", include_str!("../templates/python/build.sh"), true), ("wit/policy.wit", WIT, false)];
const JS: &[File] = &[("build.sh", include_str!("../templates/js/build.sh"), true), ("wit/policy.wit", WIT, false)];
const C: &[File] = &[
    ("build.sh", include_str!("../templates/c/build.sh"), true),
    ("unclaimed.c", include_str!("../templates/c/unclaimed.c"), false),
    ("wit/policy.wit", WIT, false),
];

const README: &str = include_str!("../templates/README.md");

/// The hooks a project can start from, in the order of [`Lang::sources`].
pub const HOOKS: [&str; 4] = ["place", "rank", "compact", "pool"];

/// One hook's starting point: what it does, the contract hooks it claims,
/// the C stubs its build leaves out, and how to run it.
struct Hook {
    kind: &'static str,
    claims: &'static str,
    c_claims: &'static str,
    usage: &'static str,
}

const HOOK_INFO: [Hook; 4] = [
    Hook { kind: "placement", claims: "`score`", c_claims: "-DBERTH_CLAIMS_SCORE", usage: "berth replay --policy ./{{name}}.wasm --seeds 42" },
    Hook {
        kind: "preemption-ranking",
        claims: "`rank`",
        c_claims: "-DBERTH_CLAIMS_RANK",
        usage: "berth replay --fleet asi --fleet-scale 0.02 --days 2 --policy best-fit --preempt spot-gpu --preempt ./{{name}}.wasm",
    },
    Hook {
        kind: "compaction",
        claims: "`compact`",
        c_claims: "-DBERTH_CLAIMS_COMPACT",
        usage: "berth replay --fleet asi --fleet-scale 0.02 --days 2 --policy best-fit --compact ./{{name}}.wasm",
    },
    Hook {
        kind: "model-pool",
        claims: "`pool-place` and `pool-step`",
        c_claims: "-DBERTH_CLAIMS_POOL_PLACE -DBERTH_CLAIMS_POOL_STEP",
        usage: "berth replay --pool default --policy pool-token --policy ./{{name}}.wasm",
    },
];

/// A hook's source: the template text, and the bundled policy it is (its
/// name is replaced by the project's), if any.
type Source = (&'static str, Option<&'static str>);

/// A language `berth policy new` knows.
struct Lang {
    name: &'static str,
    files: &'static [File],
    /// Where the hook's source goes in the project.
    main: &'static str,
    /// One source per hook of [`HOOKS`].
    sources: [Source; 4],
    /// What builds it.
    toolchain: &'static str,
    /// The Berth script that installs the toolchain (in scripts/).
    installer: &'static str,
    /// How to install it by hand, for the README.
    by_hand: &'static str,
}

const LANG_LIST: &[Lang] = &[
    Lang {
        name: "rust",
        files: RUST,
        main: "src/lib.rs",
        sources: [
            (include_str!("../templates/rust/src/lib.rs"), None),
            (include_str!("../../policies/spot-gpu/src/lib.rs"), Some("spot-gpu")),
            (include_str!("../../policies/drain/src/lib.rs"), Some("drain")),
            (include_str!("../../policies/pool-demand/src/lib.rs"), Some("pool-demand")),
        ],
        toolchain: "cargo for wasm32 (rustup's wasm32-unknown-unknown target, or Debian's rustc-web with build-std) and the berth-sdk crate",
        installer: "install-guest-toolchain.sh",
        by_hand: "`rustup target add wasm32-unknown-unknown`, or `apt-get install rustc-web cargo-web rust-web-src lld`",
    },
    Lang {
        name: "python",
        files: PYTHON,
        main: "app.py",
        sources: [
            (include_str!("../templates/python/app.py"), None),
            (include_str!("../../policies/spot-gpu-py/app.py"), Some("spot-gpu-py")),
            (include_str!("../templates/python/compact.py"), None),
            (include_str!("../templates/python/pool.py"), None),
        ],
        toolchain: "componentize-py {py} (PyPI)",
        installer: "install-lang-toolchains.sh",
        by_hand: "`pip install componentize-py=={py}`",
    },
    Lang {
        name: "js",
        files: JS,
        main: "policy.js",
        sources: [
            (include_str!("../templates/js/policy.js"), None),
            (include_str!("../templates/js/rank.js"), None),
            (include_str!("../../policies/drain-js/drain.js"), Some("drain-js")),
            (include_str!("../templates/js/pool.js"), None),
        ],
        toolchain: "componentize-js {js} (npm) and node",
        installer: "install-lang-toolchains.sh",
        by_hand: "`apt-get install nodejs npm`, then `npm install -g @bytecodealliance/componentize-js@{js}`",
    },
    Lang {
        name: "c",
        files: C,
        main: "policy.c",
        sources: [
            (include_str!("../templates/c/policy.c"), None),
            (include_str!("../templates/c/rank.c"), None),
            (include_str!("../templates/c/compact.c"), None),
            (include_str!("../../policies/pool-demand-c/pool_demand.c"), Some("pool-demand-c")),
        ],
        toolchain: "clang + lld + wasi-libc (apt) and wit-bindgen c {wb} (cargo install)",
        installer: "install-lang-toolchains.sh",
        by_hand: "`apt-get install clang lld wasi-libc libclang-rt-dev-wasm32`, then `cargo install --locked wit-bindgen-cli@{wb}`",
    },
];

/// A bundled policy's source as a template: its name (quoted, and where
/// its header names it) becomes the project's.
fn as_template(text: &str, bundled: Option<&str>) -> String {
    match bundled {
        Some(b) => text.replace(&format!("\"{b}\""), "\"{{name}}\"").replacen(&format!("{b}:"), "{{name}}:", 1),
        None => text.to_string(),
    }
}

/// Fills in the pinned versions.
fn versions(text: &str) -> String {
    text.replace("{py}", COMPONENTIZE_PY).replace("{js}", COMPONENTIZE_JS).replace("{wb}", WIT_BINDGEN)
}

/// The language named `lang` (or an alias).
fn template(lang: &str) -> anyhow::Result<&'static Lang> {
    let canonical = match lang {
        "python" | "py" => "python",
        "js" | "javascript" => "js",
        other => other,
    };
    LANG_LIST.iter().find(|l| l.name == canonical).ok_or_else(|| {
        anyhow::anyhow!("unknown language {lang:?}; one of: {}", LANG_LIST.iter().map(|l| l.name).collect::<Vec<_>>().join(", "))
    })
}

/// Where the Rust SDK is: `$BERTH_SDK_DIR`, else the checkout this binary
/// was built from.
fn sdk_dir() -> PathBuf {
    std::env::var_os("BERTH_SDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk"))
}

/// The command that installs a toolchain: the script in the checkout this
/// binary was built from, by absolute path while it is there.
fn installer_command(script: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts").join(script);
    match path.canonicalize() {
        Ok(path) => format!("bash {}", path.display()),
        Err(_) => format!("bash scripts/{script}  # in a Berth checkout"),
    }
}

/// `text` as one word in a shell script.
fn sh_quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// `text` as a TOML basic string.
fn toml_quoted(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', r"\\").replace('"', r#"\""#))
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

/// The index in [`HOOKS`] of a hook name (or an alias).
fn hook_index(hook: &str) -> anyhow::Result<usize> {
    let canonical = match hook {
        "score" | "placement" => "place",
        "pool-place" | "pool-step" => "pool",
        other => other,
    };
    HOOKS.iter().position(|&h| h == canonical).ok_or_else(|| anyhow::anyhow!("unknown hook {hook:?}; one of: {}", HOOKS.join(", ")))
}

/// Creates `<parent>/<name>/` for `lang`, starting from a working policy of
/// `hook`, and returns its path. Refuses to write into an existing folder.
pub fn create(lang: &str, hook: &str, name: &str, parent: &Path) -> anyhow::Result<PathBuf> {
    check_name(name)?;
    let lang = template(lang)?;
    let hook_at = hook_index(hook)?;
    let hook = &HOOK_INFO[hook_at];
    let (source, bundled) = lang.sources[hook_at];
    let source = as_template(source, bundled);
    let dir = parent.join(name);
    anyhow::ensure!(!dir.exists(), "{} already exists", dir.display());
    let sdk = sdk_dir();
    let sdk = sdk.canonicalize().unwrap_or(sdk);
    let berth = std::env::current_exe().ok().and_then(|p| p.canonicalize().ok()).unwrap_or_else(|| PathBuf::from("berth"));
    let crate_name = format!("{name}-policy");
    let installer = installer_command(lang.installer);
    // apt needs root; the user-level tools go under $BERTH_TOOLS either way.
    let installer_line = format!("{installer}  # as root where it has apt packages to install");
    let note = format!("By hand: {}.", versions(lang.by_hand))
        + if lang.name == "rust" {
            "\n\nThe berth-sdk dependency is the SDK of the Berth checkout that created this \
             project, by absolute path (Cargo.toml): the project builds from any folder while \
             that checkout is there; edit the path if it moves. With Debian's rustc-web the \
             first build also compiles Rust's std for wasm32 (minutes once)."
        } else {
            ""
        };
    let fill = |text: &str| {
        text.replace("{{name}}", name)
            .replace("{{crate}}", &crate_name)
            .replace("{{crate_file}}", &crate_name.replace('-', "_"))
            .replace("{{sdk_toml}}", &toml_quoted(&sdk.to_string_lossy()))
            .replace("{{berth_sh}}", &sh_quoted(&berth.to_string_lossy()))
            .replace("{{installer_sh}}", &sh_quoted(&installer))
            .replace("{{berth}}", &berth.to_string_lossy())
            .replace("{{lang}}", lang.name)
            .replace("{{toolchain}}", &versions(lang.toolchain))
            .replace("{{toolchain_note}}", &note)
            .replace("{{installer}}", &installer_line)
            .replace("{{componentize_py}}", COMPONENTIZE_PY)
            .replace("{{componentize_js}}", COMPONENTIZE_JS)
            .replace("{{wit_bindgen}}", WIT_BINDGEN)
            .replace("{{contract}}", WIT_VERSION)
            .replace("{{claims}}", hook.c_claims)
            .replace("{{kind}}", hook.kind)
            .replace("{{claimed}}", hook.claims)
            .replace("{{usage}}", &hook.usage.replace("{{name}}", name))
            .replace("{{main}}", lang.main)
    };
    let main: (&str, &str, bool) = (lang.main, &source, false);
    for &(path, text, exec) in lang.files.iter().chain([&main, &("README.md", README, false)]) {
        let target = dir.join(path);
        std::fs::create_dir_all(target.parent().expect("inside dir")).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(&target, fill(text)).with_context(|| format!("writing {}", target.display()))?;
        #[cfg(unix)]
        if exec {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_versions_match_the_installer() {
        let script = include_str!("../../scripts/install-lang-toolchains.sh");
        for (var, version) in [("COMPONENTIZE_PY", COMPONENTIZE_PY), ("COMPONENTIZE_JS", COMPONENTIZE_JS), ("WIT_BINDGEN", WIT_BINDGEN)] {
            assert!(script.contains(&format!("\n{var}={version}\n")), "{var}={version} not in install-lang-toolchains.sh");
        }
    }

    #[test]
    fn every_placeholder_is_filled() {
        let scratch = std::env::temp_dir().join(format!("berth-scaffold-unit-{}", std::process::id()));
        for lang in LANG_LIST {
            for hook in HOOKS {
                let name = format!("p-{}-{hook}", lang.name);
                let dir = create(lang.name, hook, &name, &scratch).unwrap();
                for (path, _, _) in lang.files.iter().chain([&(lang.main, "", false), &("README.md", "", false)]) {
                    let text = std::fs::read_to_string(dir.join(path)).unwrap();
                    assert!(!text.contains("{{"), "{} {hook}: {path} has an unfilled placeholder", lang.name);
                }
                let main = std::fs::read_to_string(dir.join(lang.main)).unwrap();
                assert!(main.contains(&format!("\"{name}\"")), "{} {hook}: the source does not carry the name", lang.name);
                if let (_, Some(bundled)) = lang.sources[hook_index(hook).unwrap()] {
                    assert!(!main.contains(&format!("\"{bundled}\"")), "{} {hook}: still named {bundled}", lang.name);
                }
            }
        }
        assert!(create("c", "evict", "x", &scratch).unwrap_err().to_string().contains("unknown hook"));
        std::fs::remove_dir_all(&scratch).unwrap();
    }

    #[test]
    fn quoting() {
        assert_eq!(sh_quoted("/a b/it's"), r"'/a b/it'\''s'");
        assert_eq!(toml_quoted(r#"C:\a"b"#), r#""C:\\a\"b""#);
    }

    #[test]
    fn templates_target_the_newest_contract() {
        let newest = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../wit"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok()?.strip_prefix('v').map(String::from))
            .max_by_key(|v| v.split('.').map(|p| p.parse::<u32>().unwrap()).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(WIT_VERSION, newest);
        assert!(WIT.contains(&format!("package berth:policy@{newest};")));
    }
}
