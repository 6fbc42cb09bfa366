//! Control-socket changes while I/O runs, over a real `udrive serve --rpc`
//! process: namespace hot add and remove seen by the userspace initiator, and poll
//! modes and placement switched under libblkio.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use common::control::{blkio_io, round_trip, serve_opts, Serve};
use initiator::{DataMode, DmaBuf, IoOp, NvmeDriver, QueuePair};
use serde_json::{json, Value};
use test_support::T;

#[test]
fn hot_add_and_remove_namespace_while_io_runs_on_another() {
    let s = Serve::start(&[]);
    let mut d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    assert_eq!(d.namespaces().len(), 1);
    d.enable_ns_events().unwrap();

    // Background I/O on namespace 1 for the whole test; every error is counted.
    let stop = Arc::new(AtomicBool::new(false));
    let (ops, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let qp = d.create_qpair(32, false).unwrap();
    let bg = background_io(qp, stop.clone(), ops.clone(), errors.clone());
    wait_ops(&ops, 100);

    let a = s.nvme.to_str().unwrap();
    let (q2, buf) = hot_add(&s, &mut d, a);
    hot_remove_under_io(&s, &mut d, a, q2, buf);

    let before = ops.load(Ordering::Relaxed);
    wait_ops(&ops, before + 100);
    stop.store(true, Ordering::Relaxed);
    let qp = bg.join().unwrap();
    d.delete_qpair(qp).unwrap();
    assert_eq!(
        errors.load(Ordering::Relaxed),
        0,
        "I/O on namespace 1 unaffected"
    );
    // The counters saw the Invalid Namespace error and nothing else failed.
    let st = s.ok("get_stats", json!({"socket": a}));
    let errors: u64 = st["devices"][0]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|q| q["namespaces"].as_array().unwrap())
        .flat_map(|n| n["errors"].as_array().unwrap())
        .map(|e| e["count"].as_u64().unwrap())
        .sum();
    assert_eq!(errors, 1);
}

/// Waits until `ops` reaches `n`.
fn wait_ops(ops: &AtomicU64, n: u64) {
    while ops.load(Ordering::Relaxed) < n {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Alternating 4 KiB writes and reads on namespace 1 through `qp` until `stop`,
/// counting completions in `ops` and failed ones in `errors`; gives `qp` back.
fn background_io(
    mut qp: QueuePair,
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
) -> JoinHandle<QueuePair> {
    std::thread::spawn(move || {
        let buf = qp.alloc_buf(4096).unwrap();
        let mut lba = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let op = if lba.is_multiple_of(2) {
                IoOp::Write
            } else {
                IoOp::Read
            };
            let cid = qp
                .submit_io(op, 1, lba % 1000 * 8, 8, Some(&buf), DataMode::Prp)
                .unwrap();
            qp.ring().unwrap();
            let c = qp.wait(cid, T).unwrap();
            if !c.status.is_ok() {
                errors.fetch_add(1, Ordering::Relaxed);
            }
            ops.fetch_add(1, Ordering::Relaxed);
            lba += 1;
        }
        qp
    })
}

/// Adds namespace 2 (4 KiB blocks) to controller `a`: the client hears of it,
/// identifies it and does verified I/O on it through the returned queue pair and
/// buffer.
fn hot_add(s: &Serve, d: &mut NvmeDriver, a: &str) -> (QueuePair, DmaBuf) {
    let r = s.ok(
        "nvme_add_namespace",
        json!({"socket": a, "spec": "ram:16M,bs=4096"}),
    );
    assert_eq!(r["nsid"], 2);
    let ev = d.wait_event(T).unwrap();
    assert!(ev.is_namespace_change(), "{ev:?}");
    assert_eq!(ev.log_page, 4);
    assert_eq!(d.rescan_namespaces().unwrap(), vec![2]);
    let ns2 = d.namespace(2).expect("new namespace identified").clone();
    assert_eq!((ns2.lba_size, ns2.size_bytes()), (4096, 16 << 20));
    // I/O on the new namespace (4 KiB blocks).
    let mut q2 = d.create_qpair(8, false).unwrap();
    let buf = q2.alloc_buf(4096).unwrap();
    buf.write(0, &[0xab; 4096]).unwrap();
    let c = q2
        .submit_io(IoOp::Write, 2, 5, 1, Some(&buf), DataMode::Prp)
        .unwrap();
    q2.ring().unwrap();
    assert!(q2.wait(c, T).unwrap().status.is_ok());
    buf.fill(0);
    let c = q2
        .submit_io(IoOp::Read, 2, 5, 1, Some(&buf), DataMode::Prp)
        .unwrap();
    q2.ring().unwrap();
    assert!(q2.wait(c, T).unwrap().status.is_ok());
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert_eq!(back, vec![0xab; 4096]);
    (q2, buf)
}

/// Hot remove of namespace 2 while a thread keeps I/O going on it: every command
/// either completes normally or gets Invalid Namespace; nothing hangs.
fn hot_remove_under_io(s: &Serve, d: &mut NvmeDriver, a: &str, mut q2: QueuePair, buf: DmaBuf) {
    let ops2 = Arc::new(AtomicU64::new(0));
    let io2 = {
        let ops2 = ops2.clone();
        std::thread::spawn(move || {
            let mut lba = 0u64;
            loop {
                let op = if lba.is_multiple_of(2) {
                    IoOp::Write
                } else {
                    IoOp::Read
                };
                let c = q2
                    .submit_io(op, 2, lba % 4000, 1, Some(&buf), DataMode::Prp)
                    .unwrap();
                q2.ring().unwrap();
                let st = q2.wait(c, T).unwrap().status;
                ops2.fetch_add(1, Ordering::Relaxed);
                lba += 1;
                if !st.is_ok() {
                    return (q2, st);
                }
            }
        })
    };
    wait_ops(&ops2, 100);
    s.ok("nvme_remove_namespace", json!({"socket": a, "nsid": 2}));
    let (q2, st) = io2.join().unwrap();
    assert_eq!((st.sct, st.sc), (0, 0x0b), "Invalid Namespace, got {st}");
    let ev = d.wait_event(T).unwrap();
    assert!(ev.is_namespace_change());
    assert_eq!(d.rescan_namespaces().unwrap(), vec![2]);
    assert!(d.namespace(2).is_none());
    d.delete_qpair(q2).unwrap();
}

#[test]
fn set_poll_mode_and_placement_while_libblkio_runs() {
    let s = Serve::start(&[]);
    let v = s.path("v.sock");
    let added = s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M", "queues": 2}),
    );
    assert_eq!(added["state"]["poll_mode"], "adaptive", "the default");
    switch_vhost_modes_under_io(&s, &v);
    nvme_queues_stay_on_the_shared_reactor(&s);
    event_mode_sleeps_when_idle(&s);
    bad_modes_and_sockets_are_refused(&s, &v);
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["state"]["poll_mode"],
        "adaptive"
    );
    blkio_io(&v, 2);
}

/// The vhost-user-blk device `v` goes through every poll mode and placement while
/// libblkio runs verified I/O on it, which sees no error.
fn switch_vhost_modes_under_io(s: &Serve, v: &Path) {
    let r = std::thread::scope(|sc| {
        let io = sc.spawn(|| {
            let t = udrive::blkio_target::BlkioTarget::connect(v, 2, 4, 4096).expect("libblkio");
            let cfg = initiator::workload::WorkloadConfig {
                rw: initiator::workload::Rw::RandRw { read_pct: 50 },
                qd: 4,
                jobs: 2,
                verify: true,
                time: Duration::from_millis(1000),
                ..Default::default()
            };
            initiator::workload::run(&t, &cfg).expect("workload")
        });
        let placements = [
            "dedicated",
            "single",
            "round-robin",
            "dedicated",
            "single",
            "single",
        ];
        for (mode, placement) in ["event", "adaptive", "busy", "event", "busy", "adaptive"]
            .into_iter()
            .zip(placements)
        {
            std::thread::sleep(Duration::from_millis(120));
            switch_vhost_mode(s, v, mode, placement);
        }
        io.join().unwrap()
    });
    assert!(r.ios > 0);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
}

/// Sets `mode` and `placement` on `v` and checks what `get_devices` reports.
fn switch_vhost_mode(s: &Serve, v: &Path, mode: &str, placement: &str) {
    assert_eq!(
        s.ok("set_poll_mode", json!({"socket": v, "mode": mode})),
        true
    );
    s.ok(
        "set_placement",
        json!({"socket": v, "placement": placement}),
    );
    let d = s.ok("get_devices", json!({"socket": v}));
    assert_eq!(d[0]["state"]["poll_mode"], mode);
    assert_eq!(d[0]["config"]["poll"], mode);
    assert_eq!(d[0]["config"]["placement"], placement);
    let on: Vec<u64> = d[0]["state"]["queue_reactors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_u64().unwrap())
        .collect();
    // One shared reactor (--cpus 0): everything but dedicated is on reactor 0.
    assert_eq!(
        on.iter().all(|r| *r >= 1),
        placement == "dedicated",
        "{placement}: {on:?}"
    );
}

/// NVMe queues stay on the shared reactor (--cpus 0 = reactor 0) though the
/// engine grew reactors for the dedicated vhost device; their poll mode switches
/// at run time.
fn nvme_queues_stay_on_the_shared_reactor(s: &Serve) {
    s.ok(
        "set_placement",
        json!({"socket": s.nvme, "placement": "round-robin"}),
    );
    assert_eq!(
        s.ok("get_devices", json!({"socket": s.nvme}))[0]["poll"],
        "adaptive",
        "the default"
    );
    s.ok("set_poll_mode", json!({"socket": s.nvme, "mode": "busy"}));
    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    let qps: Vec<_> = (0..3).map(|_| d.create_qpair(16, false).unwrap()).collect();
    let dev = s.ok("get_devices", json!({"socket": s.nvme}));
    let groups = dev[0]["state"]["queue_groups"].as_array().unwrap().clone();
    assert_eq!(groups.len(), 3);
    assert!(
        groups.iter().all(|g| g["reactor"] == 0),
        "NVMe queues on dedicated reactors: {groups:?}"
    );
    // NVMe poll modes switch at run time; this client mapped the doorbell page
    // (busy mode when it connected), so its queues cannot sleep until it reconnects.
    assert_eq!(
        s.ok("set_poll_mode", json!({"socket": s.nvme, "mode": "event"})),
        true
    );
    let dev = s.ok("get_devices", json!({"socket": s.nvme}));
    assert_eq!(dev[0]["poll"], "event");
    assert_eq!(dev[0]["state"]["poll_mode"], "event");
    assert_eq!(dev[0]["state"]["doorbells"], "mapped");
    assert_eq!(dev[0]["state"]["can_sleep"], false);
    for qp in qps {
        d.delete_qpair(qp).unwrap();
    }
    round_trip(&d, 5);
}

/// A client that connects in event mode gets no doorbell page, and the reactor
/// sleeps whenever its queues are idle: between its I/Os too, and get_stats counts
/// it.
fn event_mode_sleeps_when_idle(s: &Serve) {
    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    assert!(!d.doorbells_mapped(), "event mode offers no doorbell mmap");
    assert!(d.shadow_doorbells());
    let sleeps = |s: &Serve| -> u64 {
        s.ok("get_stats", json!({}))["reactors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["sleeps"].as_u64().unwrap())
            .sum()
    };
    let before = sleeps(s);
    round_trip(&d, 6);
    assert!(sleeps(s) > before, "no reactor slept in event mode");
    let dev = s.ok("get_devices", json!({"socket": s.nvme}));
    assert_eq!(dev[0]["state"]["doorbells"], "messages");
    assert_eq!(dev[0]["state"]["can_sleep"], true);
}

/// Bad modes and sockets get clear errors.
fn bad_modes_and_sockets_are_refused(s: &Serve, v: &Path) {
    let cases: [(&str, Value, i64, &str); 6] = [
        (
            "set_placement",
            json!({"socket": s.nvme, "placement": "dedicated"}),
            -32000,
            "vhost-user-blk devices only",
        ),
        (
            "set_placement",
            json!({"socket": v, "placement": "everywhere"}),
            -32602,
            "placement",
        ),
        (
            "set_poll_mode",
            json!({"socket": v, "mode": "lazy"}),
            -32602,
            "unknown poll mode",
        ),
        (
            "set_poll_mode",
            json!({"socket": v, "mode": 1}),
            -32602,
            "invalid type",
        ),
        ("set_poll_mode", json!({"socket": v}), -32602, "mode"),
        (
            "set_poll_mode",
            json!({"socket": s.path("none.sock"), "mode": "busy"}),
            -32000,
            "no device",
        ),
    ];
    for (method, params, code, want) in cases {
        s.err(method, params, code, want);
    }
}
