//! Checks on a server's layer breakdown, shared by the NVMe and virtio-blk trace tests.

use trace::{Breakdown, LAYERS, TOTAL};

pub fn layer_mean(b: &Breakdown, op: &str, layer: &str) -> f64 {
    b.op(op)
        .and_then(|o| o.row(layer))
        .map(|r| r.mean_ns)
        .unwrap_or_else(|| panic!("no {op}/{layer} in\n{b}"))
}

/// With 100 µs of injected backend latency, reads and writes spend it in `backend`
/// and every other layer stays far below it.
pub fn assert_latency_in_backend_only(server: &Breakdown) {
    for op in ["read", "write"] {
        let backend = layer_mean(server, op, "backend");
        assert!(
            backend >= 100_000.0,
            "{op}: backend mean {backend} ns\n{server}"
        );
        for l in LAYERS.iter().filter(|l| **l != "backend") {
            let m = layer_mean(server, op, l);
            assert!(
                m < backend / 4.0,
                "{op}: {l} mean {m} ns vs backend {backend}\n{server}"
            );
        }
    }
}

/// The server's layer means add up to its total (HDR buckets at 2 significant
/// digits: each mean is within 1 %).
pub fn assert_layers_add_up(server: &Breakdown) {
    for op in ["read", "write"] {
        let sum: f64 = LAYERS.iter().map(|l| layer_mean(server, op, l)).sum();
        let total = layer_mean(server, op, TOTAL);
        assert!(
            (sum - total).abs() <= 0.02 * total.max(1.0) + 10.0,
            "{op}: layers {sum} vs total {total}\n{server}"
        );
    }
}
