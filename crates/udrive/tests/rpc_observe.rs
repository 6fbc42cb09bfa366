//! What the control socket reports of a real `udrive serve --rpc` process: traces
//! (`trace_*` methods, `udrive trace`, `udrive perf --trace`), statistics and
//! Prometheus metrics, for NVMe controllers and vhost-user-blk devices.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::control::{blkio_io, ns_sum, serve_opts, sync_io, udrive, udrive_ok, Serve};
use initiator::NvmeDriver;
use serde_json::json;

#[test]
fn trace_methods_and_metrics_count_what_the_initiator_issued() {
    let s = Serve::start(&[]);
    let a = s.nvme.to_str().unwrap().to_string();
    for bad in [
        json!(0),
        json!(-1),
        json!(1u64 << 31),
        json!("x"),
        json!(1.5),
    ] {
        s.err("trace_start", json!({"sample": bad}), -32602, "sample");
    }
    s.err(
        "trace_start",
        json!({"socket": "nope.sock"}),
        -32000,
        "no device",
    );
    let r = s.ok("trace_start", json!({"sample": (1u64 << 31) - 1}));
    assert_eq!(r["devices"][0], a);
    let r = s.ok("trace_start", json!({"socket": a}));
    assert_eq!(r["sample"], 1);

    let d = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    sync_io(&d, 50);
    s.ok("trace_stop", json!({}));
    // Not traced: the counters still see it, the breakdown does not.
    sync_io(&d, 10);

    let b: trace::Breakdown =
        serde_json::from_value(s.ok("trace_read", json!({"socket": a}))).unwrap();
    for op in ["read", "write"] {
        let o = b.op(op).unwrap_or_else(|| panic!("no {op} in {b:?}"));
        for l in trace::LAYERS.iter().chain([&trace::TOTAL]) {
            let row = o.row(l).unwrap_or_else(|| panic!("no {op} {l} row"));
            assert_eq!(row.count, 50, "{op} {l}");
        }
        assert!(o.row("backend").unwrap().max_ns > 0);
    }

    let st = s.ok("get_stats", json!({}));
    assert_eq!(ns_sum(&st, 0, "ops", "read"), 60);
    assert_eq!(ns_sum(&st, 0, "ops", "write"), 60);
    assert_eq!(ns_sum(&st, 0, "bytes", "write"), 60 * 4096);

    let text = s.ok("get_metrics", json!({}));
    let scrape =
        prometheus_parse::Scrape::parse(text.as_str().unwrap().lines().map(|l| Ok(l.to_string())))
            .expect("get_metrics is Prometheus text");
    let sum = |name: &str, op: &str| -> f64 {
        scrape
            .samples
            .iter()
            .filter(|x| x.metric == name && x.labels.get("op") == Some(op))
            .map(|x| match x.value {
                prometheus_parse::Value::Counter(v) => v,
                ref v => panic!("{name} is {v:?}, not a counter"),
            })
            .sum()
    };
    assert_eq!(sum("udrive_io_ops_total", "read"), 60.0);
    assert_eq!(sum("udrive_io_ops_total", "write"), 60.0);
    assert_eq!(sum("udrive_io_bytes_total", "read"), 60.0 * 4096.0);
    assert_eq!(sum("udrive_io_ops_total", "flush"), 0.0);
}

#[test]
fn udrive_trace_and_perf_trace_over_the_socket() {
    let s = Serve::start(&[]);
    let stop = Arc::new(AtomicBool::new(false));
    let bg = {
        let (stop, sock) = (stop.clone(), s.nvme.clone());
        std::thread::spawn(move || {
            let d = NvmeDriver::connect(&sock, serve_opts()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                sync_io(&d, 20);
            }
        })
    };
    let out = udrive_ok(&["trace", "--time", "1", "--rpc", s.rpc.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    for w in ["read", "write", "backend", "notify", "total", "p99.9"] {
        assert!(text.contains(w), "{w} missing in\n{text}");
    }
    let out = udrive_ok(&[
        "trace",
        "--time",
        "0.5",
        "--sample",
        "2",
        "--json",
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    let b: trace::Breakdown = serde_json::from_slice(&out.stdout).unwrap();
    assert!(b
        .op("read")
        .is_some_and(|o| o.row("total").unwrap().count > 0));
    let out = udrive(&[
        "trace",
        "--time",
        "0",
        "--sample",
        "0",
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    assert!(!out.status.success(), "--sample 0 refused");
    stop.store(true, Ordering::Relaxed);
    bg.join().unwrap();

    // perf --trace --rpc: initiator layers and the server's in one table.
    let out = udrive_ok(&[
        "perf",
        "--time",
        "0.5",
        "--rw",
        "randrw",
        "--trace",
        "--vfio-user",
        s.nvme.to_str().unwrap(),
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    for w in ["submit", "reap", "queue", "backend", "notify", "transport"] {
        assert!(text.contains(w), "{w} missing in\n{text}");
    }
    // --trace-server: the server's layers alone, the initiator untraced.
    let out = udrive_ok(&[
        "perf",
        "--time",
        "0.3",
        "--json",
        "--trace-server",
        "--vfio-user",
        s.nvme.to_str().unwrap(),
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let b: trace::Breakdown = serde_json::from_value(r["trace"].clone()).unwrap();
    let read = b.op("read").expect("the server's reads");
    let layers: Vec<&str> = read.rows.iter().map(|r| r.layer.as_str()).collect();
    assert_eq!(layers, ["queue", "backend", "complete", "notify", "total"]);
    assert!(read.row("total").unwrap().count > 0);
    // --rpc alone traces nothing: refused with what to add.
    let out = udrive(&[
        "perf",
        "--time",
        "0.1",
        "--vfio-user",
        s.nvme.to_str().unwrap(),
        "--rpc",
        s.rpc.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("add --trace or --trace-server"));
}

#[test]
fn vhost_user_blk_devices_have_stats_and_traces() {
    let vdir = tempfile::tempdir().unwrap();
    let v = vdir.path().join("v.sock");
    let vs = v.to_str().unwrap().to_string();
    let s = Serve::start(&[
        "--vhost-user-blk",
        &vs,
        "--disk",
        "ram:16M",
        "--queues",
        "2",
    ]);
    let a = s.nvme.to_str().unwrap().to_string();
    let st = s.ok("get_stats", json!({}));
    let kinds: Vec<&str> = st["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["nvme", "vhost-user-blk"]);
    let st = s.ok("get_stats", json!({"socket": vs}));
    assert_eq!(st["devices"][0]["name"], "v");
    let queues: Vec<u64> = st["devices"][0]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["queue"].as_u64().unwrap())
        .collect();
    assert_eq!(queues, [0, 1]);

    let r = s.ok("trace_start", json!({}));
    assert_eq!(r["devices"], json!([a, vs]));
    let r = s.ok("trace_start", json!({"socket": vs, "sample": 1}));
    assert_eq!(r["devices"], json!([vs]));
    // I/O through libblkio while the trace runs.
    let t = udrive::blkio_target::BlkioTarget::connect(&v, 1, 4, 4096).expect("libblkio");
    let cfg = initiator::workload::WorkloadConfig {
        rw: initiator::workload::Rw::RandRw { read_pct: 50 },
        qd: 4,
        time: Duration::from_millis(200),
        ..Default::default()
    };
    let rep = initiator::workload::run(&t, &cfg).expect("workload");
    drop(t);
    s.ok("trace_stop", json!({"socket": vs}));
    let b = s.ok("trace_read", json!({"socket": vs}));
    let b: trace::Breakdown = serde_json::from_value(b).unwrap();
    let reads = b
        .op("read")
        .and_then(|o| o.row("total"))
        .expect("read total");
    assert!(reads.count >= rep.reads, "{b}");
    assert!(
        b.op("write").and_then(|o| o.row("backend")).is_some(),
        "{b}"
    );

    // `udrive trace` on the vhost-user-blk device while libblkio runs I/O.
    let (out, rep) = std::thread::scope(|sc| {
        let io = sc.spawn(|| blkio_io(&v, 2));
        let out = udrive_ok(&[
            "trace",
            "--time",
            "0.3",
            "--json",
            "--device",
            v.to_str().unwrap(),
            "--rpc",
            s.rpc.to_str().unwrap(),
        ]);
        (out, io.join().unwrap())
    });
    let b: trace::Breakdown = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        b.op("write")
            .is_some_and(|o| o.row("queue").unwrap().count > 0),
        "{b} ({} I/Os)",
        rep.ios
    );

    let text = s.ok("get_metrics", json!({}));
    let text = text.as_str().unwrap();
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .expect("get_metrics is Prometheus text");
    assert!(
        text.contains("udrive_io_ops_total{device=\"v\",namespace=\"1\",queue=\"0\",op=\"read\"}"),
        "{text}"
    );
}
