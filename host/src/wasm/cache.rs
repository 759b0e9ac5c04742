//! Content-addressed cache of precompiled components: the key hashes the
//! component bytes with the engine's compatibility hash, so a changed policy
//! or a changed engine configuration never loads a stale artifact.

use std::hash::{Hash, Hasher};
use std::path::Path;

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::Engine;

/// Hex SHA-256 of a component's bytes: its identity everywhere in Berth.
pub fn content_hash(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn artifact_key(engine: &Engine, content_hash: &str) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    format!("{content_hash}-{:016x}.cwasm", h.finish())
}

/// Compiles `bytes`, or loads the artifact cached for them. A cache that
/// cannot be read or written only costs a compile.
pub fn load_component(engine: &Engine, cache_dir: Option<&Path>, bytes: &[u8], hash: &str) -> wasmtime::Result<Component> {
    let Some(dir) = cache_dir else {
        return Component::new(engine, bytes);
    };
    let path = dir.join(artifact_key(engine, hash));
    // Read into memory rather than mmap: a cache file truncated or rewritten
    // in place by someone else must cost a recompile, not a SIGBUS.
    if let Ok(artifact) = std::fs::read(&path) {
        // SAFETY: deserialize checks the header against this engine's
        // configuration; the bytes come from `precompile_component` under a
        // name keyed by the engine's compatibility hash.
        match unsafe { Component::deserialize(engine, &artifact) } {
            Ok(c) => return Ok(c),
            Err(e) => tracing::warn!("discarding unreadable artifact {}: {e}", path.display()),
        }
    }
    let artifact = engine.precompile_component(bytes)?;
    let component = unsafe { Component::deserialize(engine, &artifact)? };
    if std::fs::create_dir_all(dir).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &artifact).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(component)
}
