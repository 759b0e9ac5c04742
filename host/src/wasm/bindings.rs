//! Generated bindings, one module per contract version. A later contract adds
//! a `v0_2_0` module beside this one; components are matched by what they
//! export.

pub mod v0_1_0 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.1.0",
        world: "placement-policy",
    });
}
