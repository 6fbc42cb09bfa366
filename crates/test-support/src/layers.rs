//! Checks on a layer breakdown (the `trace` crate's per-layer table), shared by the
//! NVMe and virtio-blk trace tests.
//!
//! They hold on a busy machine. Load only ever adds time to a sample: a thread
//! preempted inside a layer makes that sample long. So a lower bound that the code
//! guarantees (an injected latency) holds however busy the machine is, and a layer
//! that is short by construction stays short at its median, which only moves if most
//! of its samples were preempted. Means are compared only where they add up by
//! construction (every request's layers sum to its total).

use std::time::Duration;

use trace::{Breakdown, LayerRow, LAYERS, TOTAL};

/// Row `layer` of `op` in `b`; fails the test when it is missing.
#[track_caller]
pub fn row<'a>(b: &'a Breakdown, op: &str, layer: &str) -> &'a LayerRow {
    b.op(op)
        .and_then(|o| o.row(layer))
        .unwrap_or_else(|| panic!("no {op}/{layer} in\n{b}"))
}

#[track_caller]
pub fn layer_mean(b: &Breakdown, op: &str, layer: &str) -> f64 {
    row(b, op, layer).mean_ns
}

#[track_caller]
pub fn layer_p50(b: &Breakdown, op: &str, layer: &str) -> u64 {
    row(b, op, layer).p50_ns
}

/// For reads and writes: `layer`'s median is at least `injected` (less 5 % for
/// the trace clock's calibration against the one that timed the injection), and
/// the median of each of `others` is below a quarter of it.
#[track_caller]
pub fn assert_latency_in(b: &Breakdown, layer: &str, others: &[&str], injected: Duration) {
    let ns = injected.as_nanos() as f64;
    for op in ["read", "write"] {
        let p50 = layer_p50(b, op, layer) as f64;
        assert!(
            p50 >= 0.95 * ns,
            "{op}: {layer} p50 {p50} ns below the injected {ns} ns\n{b}"
        );
        for l in others {
            let other = layer_p50(b, op, l) as f64;
            assert!(
                other < ns / 4.0,
                "{op}: {l} p50 {other} ns vs {ns} ns injected in {layer}\n{b}"
            );
        }
    }
}

/// A server's breakdown with `injected` backend latency: reads and writes spend it
/// in `backend` and every other layer stays far below it.
#[track_caller]
pub fn assert_latency_in_backend_only(server: &Breakdown, injected: Duration) {
    let others: Vec<&str> = LAYERS.iter().copied().filter(|l| *l != "backend").collect();
    assert_latency_in(server, "backend", &others, injected);
}

/// Whether `a` is `b` within the breakdown's precision (HDR buckets at 2 significant
/// digits: each mean is within 1 %).
pub fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 0.02 * b.max(1.0) + 10.0
}

/// The layer means of `op` in `b` add up to its total.
#[track_caller]
pub fn assert_add_up(b: &Breakdown, op: &str, layers: &[&str]) {
    let sum: f64 = layers.iter().map(|l| layer_mean(b, op, l)).sum();
    let total = layer_mean(b, op, TOTAL);
    assert!(
        close(sum, total),
        "{op}: layers {sum} vs total {total}\n{b}"
    );
}

/// A server's layer means add up to its total, for reads and writes.
#[track_caller]
pub fn assert_layers_add_up(server: &Breakdown) {
    for op in ["read", "write"] {
        assert_add_up(server, op, &LAYERS);
    }
}
