//! The fake datapath (`fake-NAME`): numbers that depend only on its name, the
//! backend, the workload, the repetition and the client, in the shape of `perf
//! --json`, so that the harness's tests know what to expect without a server.

use serde_json::{json, Value};

use super::cpu::{CpuDetail, CpuShare, ServerCpu};
use super::matrix::{Backend, Point, Rw};
use super::process::DatapathError;
use super::target::{Measured, Target};

/// Numbers that depend only on the datapath's name, the backend, the workload, the
/// repetition and the client, in the shape of `perf --json`: the harness's tests know
/// what to expect.
pub(super) struct Fake {
    pub(super) name: String,
    pub(super) backend: Backend,
    pub(super) clients: u32,
    /// Add a full-path layer table, as `perf --trace --rpc` gives one.
    pub(super) trace: bool,
    /// Whose CPU to report besides the server's (the matrix's `cpu`).
    pub(super) cpu: CpuDetail,
}

/// The fake's layer table for I/Os of `mean` ns: the full path's layers in request
/// order, each a fixed share of the total, per op the workload does (a mix split
/// by its share of reads).
fn fake_trace(p: &Point, mean: f64, ios: f64) -> Value {
    const SHARES: [(&str, &str, f64); 8] = [
        ("submit", "initiator", 0.05),
        ("queue", "server", 0.10),
        ("backend", "server", 0.50),
        ("complete", "server", 0.10),
        ("notify", "server", 0.05),
        ("transport", "transport", 0.15),
        ("reap", "initiator", 0.05),
        ("total", "initiator", 1.0),
    ];
    let reads = match p.rw {
        Rw::Randread => 1.0,
        Rw::Randwrite => 0.0,
        Rw::Randrw => f64::from(p.rwmixread) / 100.0,
    };
    let ops: Vec<Value> = [("read", reads), ("write", 1.0 - reads)]
        .iter()
        .filter(|(_, part)| *part > 0.0)
        .map(|(op, part)| {
            // Counts and percentiles are whole numbers in trace's table.
            let count = (ios * part).round() as u64;
            let rows: Vec<Value> = SHARES
                .iter()
                .map(|(layer, side, share)| {
                    let ns = mean * share;
                    let at = |k: f64| (k * ns).round() as u64;
                    json!({"layer": layer, "side": side, "count": count, "mean_ns": ns,
                        "p50_ns": at(1.0), "p99_ns": at(2.0), "p99_9_ns": at(3.0),
                        "max_ns": at(10.0)})
                })
                .collect();
            json!({"op": op, "rows": rows})
        })
        .collect();
    json!({ "ops": ops })
}

impl Target for Fake {
    fn run(&mut self, p: &Point, rep: u32) -> Result<Measured, DatapathError> {
        let seed = self
            .name
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        let base = 100_000.0 * (1 + seed % 5) as f64 / (1 + self.backend as u64) as f64;
        let rw = if p.rw == Rw::Randread { 1.0 } else { 0.8 };
        let spread = 1.0 + 0.05 * f64::from((rep * 7) % 3);
        let inflight = f64::from(p.qd * p.jobs);
        let n = f64::from(self.clients);
        let clients = (0..self.clients)
            .map(|i| {
                // Clients share the server: each gets less, the later ones a little less.
                let share = n.sqrt() / n * (1.0 - 0.05 * f64::from(i));
                let iops = base * rw * inflight.sqrt() * spread * share * 4096.0
                    / f64::from(p.bs.max(4096));
                let mean = inflight / iops * 1e9;
                let lat = json!({"mean": mean, "min": mean / 4.0, "p50": mean, "p99": mean * 2.0,
                    "p99_9": mean * 3.0, "p99_99": mean * 4.0, "max": mean * 10.0});
                let ios = (iops * 2.0).round();
                let mut run = json!({"rw": p.rw.to_string(), "bs": p.bs, "qd": p.qd,
                    "jobs_count": p.jobs, "iops": iops, "ios": ios, "errors": 0, "lat_ns": lat});
                if self.trace {
                    run["trace"] = fake_trace(p, mean, ios);
                }
                run
            })
            .collect();
        // One reactor's worth of CPU, plus a little per client.
        let server_cpu = ServerCpu {
            cpu_s: 2.0 * (1.0 + 0.1 * n) * spread,
            wall_s: 2.0,
            threads: Some(3 + self.clients),
        };
        Ok(Measured {
            clients,
            server_cpu: Some(server_cpu),
            cpu: self.cpu_share(&server_cpu),
            upgrades_ms: Vec::new(),
        })
    }
}

impl Fake {
    /// The server's CPU as its reactors' and a control thread's, and each client
    /// half a core, a quarter of it in a completion thread.
    fn cpu_share(&self, server: &ServerCpu) -> Option<CpuShare> {
        let client_s = 0.5 * server.wall_s * f64::from(self.clients);
        let mut s = CpuShare {
            wall_s: server.wall_s,
            roles: [("server", server.cpu_s), ("client", client_s)]
                .into_iter()
                .map(|(r, t)| (r.to_string(), t))
                .collect(),
            threads: Default::default(),
        };
        match self.cpu {
            CpuDetail::Server => return None,
            CpuDetail::Roles => {}
            CpuDetail::Threads => {
                s.threads = [
                    ("server:reactor-#", server.cpu_s * 0.9),
                    ("server:udrive", server.cpu_s * 0.1),
                    ("client:perf", client_s * 0.75),
                    ("client:completions", client_s * 0.25),
                ]
                .into_iter()
                .map(|(k, t)| (k.to_string(), t))
                .collect();
            }
        }
        Some(s)
    }
}
