//! Metrics and traces against what an in-process initiator issued and measured.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bdev::{FaultConfig, FaultDisk, QosDisk, QosLimits};
use common::*;
use frontend_core::Observed;
use initiator::workload::{self, NvmeTarget, Rw, WorkloadConfig};
use initiator::{DataMode, IoOp, NvmeDriver};
use test_support::layers::{
    assert_add_up, assert_latency_in, assert_latency_in_backend_only, close, layer_mean, layer_p50,
};
use trace::{Breakdown, QueueSnapshot, Side, LAYERS, TOTAL};
use udrive::config::ControllerConfig;
use udrive::device::NvmeDevice;
use udrive::nsspec::NsSpec;

struct Dev {
    dev: Option<NvmeDevice>,
    _dir: tempfile::TempDir,
}

impl Dev {
    /// Namespaces from `specs`; namespace `fault.0` (1-based) wrapped in a FaultDisk.
    fn start(specs: &[&str], fault: Option<(u32, FaultConfig)>) -> Dev {
        static CNTLID: AtomicU16 = AtomicU16::new(200);
        let dir = tempfile::tempdir().expect("temp dir");
        let sock = dir.path().join("trace.sock");
        let specs: Vec<NsSpec> = specs.iter().map(|s| s.parse().expect("ns spec")).collect();
        let cfg = ControllerConfig::new(sock, specs);
        let mut devs = udrive::backends::open_all(std::slice::from_ref(&cfg))
            .expect("open backends")
            .remove(0);
        if let Some((nsid, fc)) = fault {
            let i = nsid as usize - 1;
            let faulty = Arc::new(FaultDisk::new(devs[i].clone(), fc).expect("fault disk"));
            devs[i] = Arc::new(QosDisk::new(faulty, QosLimits::default()).expect("qos disk"));
        }
        let cntlid = CNTLID.fetch_add(1, Ordering::Relaxed);
        let dev = NvmeDevice::start(&cfg, devs, cntlid, &engine(), 1, standalone(&cfg))
            .expect("start device");
        Dev {
            dev: Some(dev),
            _dir: dir,
        }
    }

    fn nvme(&self) -> &NvmeDevice {
        self.dev.as_ref().expect("running")
    }

    fn queues(&self) -> Vec<QueueSnapshot> {
        self.nvme().ctrl.queue_stats(T)
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        if let Some(d) = self.dev.take() {
            d.stop();
        }
    }
}

#[derive(Default, Debug, PartialEq, Eq)]
struct Seen {
    ops: [u64; 4],
    bytes: [u64; 4],
    errors: BTreeMap<u16, u64>,
}

#[test]
fn counters_match_what_the_initiator_issued() {
    let fc = FaultConfig {
        error_rate: 0.25,
        seed: 7,
        ..Default::default()
    };
    let dev = Dev::start(&["ram:4M", "ram:4M"], Some((1, fc)));
    let d = NvmeDriver::connect(&dev.nvme().socket, opts()).expect("connect");
    let mut qp = d.create_qpair(16, false).expect("qpair");
    let buf = qp.alloc_buf(8 * 512).expect("buf");
    let blocks = 4 * 1024 * 1024 / 512;
    let mut rng = Rng::new(11);
    let mut want: BTreeMap<u32, Seen> = BTreeMap::new();
    for i in 0..600u64 {
        let nsid = 1 + (rng.below(2) as u32);
        let nlb = 1 + rng.below(8) as u32;
        let (op, class) = match rng.below(10) {
            0 => (IoOp::Flush, 2),
            1..=4 => (IoOp::Read, 0),
            _ => (IoOp::Write, 1),
        };
        // Every 50th I/O runs past the end: the controller rejects it itself.
        let slba = if i % 50 == 49 {
            blocks - 1
        } else {
            rng.below(blocks - 8)
        };
        let data = (op != IoOp::Flush).then_some(&buf);
        let c = io(&mut qp, op, nsid, slba, nlb, data, DataMode::Prp);
        let w = want.entry(nsid).or_default();
        w.ops[class] += 1;
        if c.status.is_ok() {
            if op != IoOp::Flush {
                w.bytes[class] += u64::from(nlb) * 512;
            }
        } else {
            *w.errors.entry(c.status.code()).or_default() += 1;
        }
    }
    // A namespace that does not exist counts under namespace 0.
    let c = io(&mut qp, IoOp::Read, 9, 0, 1, Some(&buf), DataMode::Prp);
    assert!(!c.status.is_ok());
    let mut bad = Seen::default();
    bad.ops[0] = 1;
    bad.errors.insert(c.status.code(), 1);
    want.insert(0, bad);

    let faults: u64 = want[&1].errors.values().sum();
    assert!(faults > 20, "the fault disk injected errors ({faults})");
    let mut got: BTreeMap<u32, Seen> = BTreeMap::new();
    for q in dev.queues() {
        for ns in &q.namespaces {
            let g = got.entry(ns.nsid).or_default();
            for (i, (_, n)) in ns.ops.pairs().iter().enumerate() {
                g.ops[i] += n;
            }
            for (i, (_, n)) in ns.bytes.pairs().iter().enumerate() {
                g.bytes[i] += n;
            }
            for e in &ns.errors {
                *g.errors.entry(e.status).or_default() += e.count;
            }
        }
    }
    got.retain(|_, s| *s != Seen::default());
    assert_eq!(got, want);
    // The same numbers reach the Prometheus text.
    let stats = udrive::stats::get_stats(&[dev.nvme()], &engine());
    let text = trace::render_prometheus(&stats);
    let reads1: u64 = want[&1].ops[0];
    assert!(
        text.contains(&format!(
            "namespace=\"1\",queue=\"{}\",op=\"read\"}} {reads1}",
            qp.qid()
        )),
        "{text}"
    );
    assert_eq!(stats.reactors.len(), engine().num_reactors());
}

/// 400 ms of traced 50 % random reads/writes at `qd` on namespace 1: the server's
/// breakdown and the initiator's report (with its own trace).
fn traced_randrw(dev: &Dev, qd: u32) -> (Breakdown, workload::Report) {
    dev.nvme().ctrl.trace_start(1, T);
    let d = NvmeDriver::connect(&dev.nvme().socket, opts()).expect("connect");
    let target = NvmeTarget::new(&d, 1, DataMode::Prp).expect("target");
    let cfg = WorkloadConfig {
        rw: Rw::RandRw { read_pct: 50 },
        qd,
        time: Duration::from_millis(400),
        trace: true,
        ..Default::default()
    };
    let rep = workload::run(&target, &cfg).expect("workload");
    dev.nvme().ctrl.trace_stop(T);
    (Breakdown::from_queues(&dev.queues()), rep)
}

/// Far above anything else a request spends on an idle or a busy machine, so the
/// backend layer's median shows it and every other layer's median stays far below
/// (load adds time to a preempted sample; it cannot move a median of samples that
/// mostly were not).
const INJECTED: Duration = Duration::from_millis(20);

#[test]
fn injected_backend_latency_shows_in_the_backend_layer_only() {
    let fc = FaultConfig {
        latency: INJECTED,
        ..Default::default()
    };
    let dev = Dev::start(&["ram:8M"], Some((1, fc)));
    let (server, rep) = traced_randrw(&dev, 8);
    assert_latency_in_backend_only(&server, INJECTED);
    // The initiator sees it too, in its device layer, not in its own.
    let init = rep.trace.expect("initiator trace");
    assert_latency_in(&init, trace::DEVICE, &["submit", "reap"], INJECTED);
}

#[test]
fn layers_add_up_to_what_the_initiator_measured() {
    let dev = Dev::start(&["null:1G"], None);
    let (server, rep) = traced_randrw(&dev, 1);
    let init = rep.trace.clone().expect("initiator trace");
    for op in ["read", "write"] {
        // Every request's layers add up to its total, so the means do too.
        assert_add_up(&server, op, &LAYERS);
        assert_add_up(&init, op, &["submit", trace::DEVICE, "reap"]);
        // The server's part of each request lies inside the time the initiator
        // waited for the device (stamps on both sides come from the same clock), so
        // its median does. Slack: one stamp's placement on each side (the server may
        // read the doorbell before the initiator stamps "rung", and stamps "posted"
        // after the guest may see it).
        let server_total = layer_p50(&server, op, TOTAL);
        let device = layer_p50(&init, op, trace::DEVICE);
        assert!(
            server_total <= device + 1_000,
            "{op}: server p50 {server_total} vs device p50 {device}\n{server}\n{init}"
        );
    }
    // The initiator's end-to-end latency (its own Instant, over reads and writes) is
    // the traced total: its median lies between the two ops' traced medians.
    let traced = ["read", "write"].map(|op| layer_p50(&init, op, TOTAL) as f64);
    let (lo, hi) = (traced[0].min(traced[1]), traced[0].max(traced[1]));
    let e2e = rep.lat_ns.p50 as f64;
    assert!(
        0.95 * lo - 500.0 <= e2e && e2e <= 1.05 * hi + 500.0,
        "measured e2e p50 {e2e} vs traced p50s {traced:?}\n{init}"
    );
    // The merged table: initiator rows around the server's, transport in between,
    // and the row means still add up to the initiator's total.
    let full = Breakdown::full_path(&init, &server);
    for op in ["read", "write"] {
        let o = full.op(op).expect("op in full path");
        let names: Vec<&str> = o.rows.iter().map(|r| r.layer.as_str()).collect();
        assert_eq!(
            names,
            [
                "submit",
                "queue",
                "backend",
                "complete",
                "notify",
                "transport",
                "reap",
                "total"
            ]
        );
        assert_eq!(o.rows[1].side, Side::Server);
        assert_eq!(o.rows[5].side, Side::Transport);
        let sum: f64 = o
            .rows
            .iter()
            .filter(|r| r.layer != TOTAL)
            .map(|r| r.mean_ns)
            .sum();
        let total = layer_mean(&full, op, TOTAL);
        assert!(
            close(sum, total),
            "full path {sum} vs total {total}\n{full}"
        );
    }
}

#[test]
fn sampling_one_in_n_records_about_one_in_n() {
    let dev = Dev::start(&["null:1G"], None);
    let d = NvmeDriver::connect(&dev.nvme().socket, opts()).expect("connect");
    let mut qp = d.create_qpair(8, false).expect("qpair");
    let buf = qp.alloc_buf(4096).expect("buf");
    let reads = |qp: &mut initiator::QueuePair, n: u64| {
        for i in 0..n {
            let c = io(qp, IoOp::Read, 1, i * 8, 8, Some(&buf), DataMode::Prp);
            assert_ok(&c, "read");
        }
    };
    // Off: counted, not traced.
    reads(&mut qp, 100);
    let traced = |dev: &Dev| {
        Breakdown::from_queues(&dev.queues())
            .op("read")
            .and_then(|o| o.row(TOTAL))
            .map_or(0, |r| r.count)
    };
    assert_eq!(traced(&dev), 0);
    dev.nvme().ctrl.trace_start(10, T);
    reads(&mut qp, 1000);
    assert_eq!(traced(&dev), 100);
    dev.nvme().ctrl.trace_start(1, T);
    reads(&mut qp, 50);
    dev.nvme().ctrl.trace_stop(T);
    reads(&mut qp, 50);
    assert_eq!(traced(&dev), 50, "a new start clears, a stop stops");
    let ops: u64 = dev
        .queues()
        .iter()
        .flat_map(|q| q.namespaces.iter())
        .map(|n| n.ops.read)
        .sum();
    assert_eq!(ops, 1200);
}
