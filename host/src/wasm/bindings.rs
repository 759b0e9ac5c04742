//! Generated bindings, one module per contract version, bound side by side:
//! a component is matched by the version of `berth:policy/policy` it exports.

pub mod v0_1_0 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.1.0",
        world: "placement-policy",
    });
}

pub mod v0_2_0 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.2.0",
        world: "placement-policy",
    });
}

pub mod v0_3_0 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.3.0",
        world: "placement-policy",
    });
}

pub mod v0_4_0 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.4.0",
        world: "placement-policy",
    });
}
