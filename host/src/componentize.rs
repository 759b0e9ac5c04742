//! Turns a core wasm module built with the SDK (it carries its WIT in a
//! custom section) into a component.

use anyhow::Context;

/// Wraps `module` as a component and validates the result.
pub fn componentize(module: &[u8]) -> anyhow::Result<Vec<u8>> {
    wit_component::ComponentEncoder::default()
        .module(module)
        .context("reading the module's component-type section (was it built with berth-sdk?)")?
        .validate(true)
        .encode()
        .context("encoding the component")
}
