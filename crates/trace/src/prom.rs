//! Prometheus text exposition format (version 0.0.4) of a [`StatsSnapshot`].

use std::fmt::Write;

use crate::hist::HistSnapshot;
use crate::snapshot::StatsSnapshot;

const LATENCY_BUCKETS_NS: [u64; 16] = [
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    50_000_000,
    100_000_000,
    1_000_000_000,
];
const DEPTH_BUCKETS: [u64; 12] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096];

fn esc(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// `{k="v",...}` with the values escaped, for other families rendered beside
/// these.
pub fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", esc(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    lines: String,
}

impl Family {
    fn new(name: &'static str, kind: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind,
            help,
            lines: String::new(),
        }
    }

    fn sample(&mut self, suffix: &str, labels: &str, v: impl std::fmt::Display) {
        let _ = writeln!(self.lines, "{}{suffix}{labels} {v}", self.name);
    }

    /// A histogram from an HDR snapshot; `scale` turns recorded values into the
    /// metric's unit.
    fn hist(&mut self, base: &[(&str, &str)], h: &HistSnapshot, les: &[u64], scale: f64) {
        for &le in les {
            let le_s = format!("{}", le as f64 * scale);
            let mut l = base.to_vec();
            l.push(("le", &le_s));
            self.sample("_bucket", &labels(&l), h.count_le(le));
        }
        let mut l = base.to_vec();
        l.push(("le", "+Inf"));
        self.sample("_bucket", &labels(&l), h.count);
        let sum = h.mean * h.count as f64 * scale;
        self.sample("_sum", &labels(base), sum);
        self.sample("_count", &labels(base), h.count);
    }

    fn write(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        out.push_str(&self.lines);
    }
}

/// Renders `s` for a Prometheus scrape. Every metric is named `udrive_*` and carries
/// `device`, `namespace`, `queue` or `reactor` labels.
pub fn render_prometheus(s: &StatsSnapshot) -> String {
    let mut ops = Family::new(
        "udrive_io_ops_total",
        "counter",
        "Requests completed, by operation type.",
    );
    let mut bytes = Family::new(
        "udrive_io_bytes_total",
        "counter",
        "Bytes moved by successful requests, by operation type.",
    );
    let mut errors = Family::new(
        "udrive_io_errors_total",
        "counter",
        "Requests completed with an error, by device status code (hex).",
    );
    let mut inflight = Family::new(
        "udrive_io_inflight",
        "gauge",
        "Requests submitted to the backend and not yet completed.",
    );
    let mut depth = Family::new(
        "udrive_queue_depth",
        "histogram",
        "Requests outstanding on the queue when a batch was fetched.",
    );
    let mut latency = Family::new(
        "udrive_io_latency_seconds",
        "histogram",
        "Doorbell seen to interrupt signalled, of traced reads and writes.",
    );
    let mut polls = Family::new(
        "udrive_reactor_polls_total",
        "counter",
        "Reactor poll iterations that found work (busy) or none (idle).",
    );
    let mut work = Family::new(
        "udrive_reactor_work_items_total",
        "counter",
        "Work items (requests fetched, completions posted) handled by the reactor.",
    );
    let mut cpu = Family::new(
        "udrive_reactor_cpu_seconds_total",
        "counter",
        "CPU time of the reactor thread.",
    );
    let mut sleeps = Family::new(
        "udrive_reactor_sleeps_total",
        "counter",
        "Sleeps the reactor began because all its pollers were idle (adaptive, event).",
    );
    for d in &s.devices {
        for q in &d.queues {
            let qs = q.queue.to_string();
            let ql = [("device", d.name.as_str()), ("queue", qs.as_str())];
            inflight.sample("", &labels(&ql), q.inflight);
            depth.hist(&ql, &q.depth, &DEPTH_BUCKETS, 1.0);
            for ns in &q.namespaces {
                let nss = ns.nsid.to_string();
                let nl = [
                    ("device", d.name.as_str()),
                    ("namespace", nss.as_str()),
                    ("queue", qs.as_str()),
                ];
                for (op, n) in ns.ops.pairs() {
                    let mut l = nl.to_vec();
                    l.push(("op", op));
                    ops.sample("", &labels(&l), n);
                }
                for (op, n) in ns.bytes.pairs() {
                    let mut l = nl.to_vec();
                    l.push(("op", op));
                    bytes.sample("", &labels(&l), n);
                }
                for e in &ns.errors {
                    let st = format!("0x{:04x}", e.status);
                    let mut l = nl.to_vec();
                    l.push(("status", &st));
                    errors.sample("", &labels(&l), e.count);
                }
                latency.hist(&nl, &ns.latency, &LATENCY_BUCKETS_NS, 1e-9);
            }
        }
    }
    for r in &s.reactors {
        let rs = r.reactor.to_string();
        let busy = [("reactor", rs.as_str()), ("state", "busy")];
        let idle = [("reactor", rs.as_str()), ("state", "idle")];
        polls.sample("", &labels(&busy), r.busy_polls);
        polls.sample("", &labels(&idle), r.polls.saturating_sub(r.busy_polls));
        work.sample("", &labels(&[("reactor", &rs)]), r.work_items);
        cpu.sample("", &labels(&[("reactor", &rs)]), r.cpu_ns as f64 / 1e9);
        sleeps.sample("", &labels(&[("reactor", &rs)]), r.sleeps);
    }
    let mut out = String::new();
    for f in [
        &ops, &bytes, &errors, &inflight, &depth, &latency, &polls, &work, &cpu, &sleeps,
    ] {
        f.write(&mut out);
    }
    out
}
