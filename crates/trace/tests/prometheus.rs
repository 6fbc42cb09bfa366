//! The exposition output parses with an independent parser and says what we counted.

use std::sync::Arc;

use trace::{
    render_prometheus, DeviceStats, OpClass, QueueRecorder, ReactorSnapshot, Stamps, StatsSnapshot,
    TraceControl,
};

fn snapshot(device: &str) -> StatsSnapshot {
    let ctl = Arc::new(TraceControl::default());
    ctl.start(1);
    let mut rec = QueueRecorder::new(3, 2, 64, ctl);
    rec.begin_poll();
    let kick = rec.kick();
    for i in 0..10u64 {
        let k = rec.sample(kick);
        let s = Stamps {
            kick: k,
            submitted: QueueRecorder::stamp(k),
            completed: QueueRecorder::stamp(k),
        };
        let (op, st) = if i % 2 == 0 {
            (OpClass::Read, 0)
        } else {
            (OpClass::Write, if i == 9 { 0x0281 } else { 0 })
        };
        rec.complete(2, op, 4096, st, s);
    }
    rec.depth(10);
    let p = trace::clock::now();
    rec.end_poll(p, p);
    StatsSnapshot {
        devices: vec![DeviceStats {
            name: device.into(),
            kind: "nvme".into(),
            queues: vec![rec.snapshot()],
        }],
        reactors: vec![ReactorSnapshot {
            reactor: 0,
            polls: 100,
            busy_polls: 10,
            work_items: 20,
            cpu_ns: 1_500_000_000,
            sleeps: 7,
        }],
    }
}

#[test]
fn parses_and_matches_counts() {
    let text = render_prometheus(&snapshot("vm-1"));
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("exposition parses");
    let find = |name: &str, labels: &[(&str, &str)]| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .map(|s| s.value.clone())
    };
    use prometheus_parse::Value;
    let ops = |op| {
        find(
            "udrive_io_ops_total",
            &[("namespace", "2"), ("queue", "3"), ("op", op)],
        )
    };
    assert_eq!(ops("read"), Some(Value::Counter(5.0)));
    assert_eq!(ops("write"), Some(Value::Counter(5.0)));
    assert_eq!(
        find(
            "udrive_io_bytes_total",
            &[("namespace", "2"), ("op", "write")]
        ),
        Some(Value::Counter(4.0 * 4096.0))
    );
    assert_eq!(
        find("udrive_io_errors_total", &[("status", "0x0281")]),
        Some(Value::Counter(1.0))
    );
    assert_eq!(
        find("udrive_reactor_polls_total", &[("state", "idle")]),
        Some(Value::Counter(90.0))
    );
    assert_eq!(
        find("udrive_reactor_cpu_seconds_total", &[("reactor", "0")]),
        Some(Value::Counter(1.5))
    );
    assert_eq!(
        find("udrive_reactor_sleeps_total", &[("reactor", "0")]),
        Some(Value::Counter(7.0))
    );
    assert!(scrape
        .samples
        .iter()
        .all(|s| s.labels.get("device").is_none_or(|d| d == "vm-1")));
    // Histograms: buckets are cumulative and +Inf equals the count.
    let lat = scrape
        .samples
        .iter()
        .find(|s| s.metric == "udrive_io_latency_seconds" && s.labels.get("namespace") == Some("2"))
        .expect("latency histogram");
    match &lat.value {
        Value::Histogram(b) => {
            assert!(b.windows(2).all(|w| w[0].count <= w[1].count));
            assert_eq!(b.last().map(|x| x.count), Some(10.0));
        }
        v => panic!("latency is not a histogram: {v:?}"),
    }
    // Every family has HELP and TYPE.
    for name in [
        "udrive_io_ops_total",
        "udrive_io_bytes_total",
        "udrive_io_errors_total",
        "udrive_io_inflight",
        "udrive_queue_depth",
        "udrive_io_latency_seconds",
        "udrive_reactor_polls_total",
        "udrive_reactor_work_items_total",
        "udrive_reactor_cpu_seconds_total",
        "udrive_reactor_sleeps_total",
    ] {
        assert!(text.contains(&format!("# HELP {name} ")), "{name} HELP");
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} TYPE");
    }
}

#[test]
fn serde_round_trip() {
    let s = snapshot("vm-1");
    let json = serde_json::to_string(&s).unwrap();
    let back: StatsSnapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
    let b = trace::Breakdown::from_queues(&s.devices[0].queues);
    let read = b.op("read").expect("reads traced");
    assert_eq!(read.rows.last().unwrap().count, 5);
}

#[test]
fn label_values_are_escaped() {
    // The parser above does not unescape, so check the text itself.
    let text = render_prometheus(&snapshot("a\\b \"c\"\nd"));
    assert!(text.contains(r#"device="a\\b \"c\"\nd""#), "{text}");
    assert!(text.lines().all(|l| !l.is_empty()));
}
