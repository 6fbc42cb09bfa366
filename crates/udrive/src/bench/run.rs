//! The schedule of a bench run and its execution. Repetitions are the outer loop:
//! repetition 1 of every datapath, then repetition 2, ... so that a machine that
//! changes speed over the minutes (this one does, between two states about 2× apart)
//! moves every datapath alike; within a repetition the backends, then the client
//! counts, then the datapaths (in the matrix's order, reversed on every second
//! repetition with `order = "flip"`), each with a fresh server for all its workloads.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::clients;
use super::cpu::{CpuShare, ServerCpu};
use super::datapath::{self, Env};
use super::matrix::{Backend, DatapathKind, Point};
use super::target::Measured;

/// One measured run, as written to `raw/` and read back by the summary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    /// Position in the execution order, from 0.
    pub seq: usize,
    pub rep: u32,
    pub datapath: DatapathKind,
    pub backend: Backend,
    /// Concurrent clients, each with its own device.
    #[serde(default = "one")]
    pub clients: u32,
    pub point: Point,
    /// `perf --json`'s output (the clients' together: `clients::aggregate`), or null
    /// when the run failed.
    pub perf: Value,
    /// Each client's `perf --json`, in client order.
    #[serde(default)]
    pub per_client: Vec<Value>,
    /// The server processes' CPU time over the run (none: no server).
    #[serde(default)]
    pub server_cpu: Option<ServerCpu>,
    /// Every role's CPU time over the run (the matrix's `cpu = "roles"`/`"threads"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuShare>,
    /// How long each live handover's `udrive upgrade` took, in ms (a variant's
    /// `handovers`); the pauses the clients saw are `perf`'s `gaps`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upgrades_ms: Vec<f64>,
    pub error: Option<String>,
}

fn one() -> u32 {
    1
}

impl RunRecord {
    pub fn iops(&self) -> Option<f64> {
        self.perf.get("iops")?.as_f64()
    }
    /// A latency field of `perf --json` in µs (`mean`, `p99`, ...); none when the
    /// run measured no I/O (idle clients).
    pub fn lat_us(&self, k: &str) -> Option<f64> {
        if self.perf.get("ios").and_then(Value::as_f64) == Some(0.0) {
            return None;
        }
        Some(self.perf.get("lat_ns")?.get(k)?.as_f64()? / 1e3)
    }
    /// The lowest and the highest IOPS of one client.
    pub fn client_iops_range(&self) -> Option<(f64, f64)> {
        let v: Vec<f64> = self
            .per_client
            .iter()
            .filter_map(|c| c.get("iops")?.as_f64())
            .collect();
        if v.is_empty() || v.len() != self.per_client.len() {
            return None;
        }
        Some((
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ))
    }
    /// The layer table (`perf --trace`) of the traced op with the most I/Os; the
    /// first client's when there are several (their tables are not merged).
    pub fn layers(&self) -> Option<trace::OpBreakdown> {
        let t = match self.perf.get("trace") {
            Some(t) => t,
            None => self.per_client.first()?.get("trace")?,
        };
        let b: trace::Breakdown = serde_json::from_value(t.clone()).ok()?;
        let ios = |o: &trace::OpBreakdown| o.row(trace::TOTAL).map_or(0, |r| r.count);
        b.ops.into_iter().max_by_key(ios)
    }
    /// The pauses between completions each client saw (`perf --gaps`), in ms, all
    /// clients' together.
    pub fn pauses_ms(&self) -> Vec<f64> {
        let clients = match self.per_client.is_empty() {
            true => std::slice::from_ref(&self.perf),
            false => &self.per_client[..],
        };
        clients
            .iter()
            .filter_map(|c| c.get("gaps")?.as_array())
            .flatten()
            .filter_map(|g| Some(g.get("ns")?.as_f64()? / 1e6))
            .collect()
    }

    /// I/O and verify errors the clients counted.
    pub fn errors(&self) -> f64 {
        ["errors", "verify_errors"]
            .iter()
            .filter_map(|k| self.perf.get(k)?.as_f64())
            .sum()
    }

    /// Server CPU µs per I/O at the run's rate.
    pub fn server_us_per_io(&self) -> Option<f64> {
        let iops = self.iops().filter(|i| *i > 0.0)?;
        Some(self.server_cpu?.cores()? / iops * 1e6)
    }
    /// `raw/`'s name of this run.
    pub fn file_name(&self) -> String {
        let c = match self.clients {
            1 => String::new(),
            n => format!("-c{n}"),
        };
        format!(
            "{:04}-r{}-{}-{}{c}-{}.json",
            self.seq,
            self.rep,
            self.datapath,
            self.backend,
            self.point.slug()
        )
    }
}

/// A (datapath, backend) pair left out, with the reason.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Skipped {
    pub datapath: DatapathKind,
    pub backend: Option<Backend>,
    pub reason: String,
}

/// One server's stint: every workload of one datapath, backend and client count in
/// one repetition.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub rep: u32,
    pub datapath: DatapathKind,
    pub backend: Backend,
    pub clients: u32,
}

/// The groups in execution order, and what is skipped (no tool, no such backend).
pub fn plan(env: &Env) -> (Vec<Group>, Vec<Skipped>) {
    let m = &env.matrix;
    let mut skipped = Vec::new();
    let mut runnable = Vec::new();
    for d in &m.datapaths {
        match datapath::probe(d, env) {
            Err(reason) => skipped.push(Skipped {
                datapath: d.clone(),
                backend: None,
                reason,
            }),
            Ok(()) => runnable.push(d.clone()),
        }
    }
    let mut served = Vec::new();
    for &b in &m.backends {
        let real = runnable
            .iter()
            .filter(|d| !matches!(d, DatapathKind::Fake(_)));
        match datapath::backend_probe(b, env) {
            Err(reason) => {
                for d in real {
                    skipped.push(Skipped {
                        datapath: d.clone(),
                        backend: Some(b),
                        reason: reason.clone(),
                    });
                }
            }
            Ok(()) => served.push(b),
        }
    }
    let ready = |d: &DatapathKind, b: Backend| {
        (matches!(d, DatapathKind::Fake(_)) || served.contains(&b))
            && datapath::applies(d, b).is_ok()
            && datapath::pair_probe(d, b).is_ok()
    };
    for d in &runnable {
        for &b in &m.backends {
            let unserved = !served.contains(&b) && !matches!(d, DatapathKind::Fake(_));
            if unserved {
                continue;
            }
            let why = datapath::applies(d, b).and_then(|()| datapath::pair_probe(d, b));
            let why = why.and_then(|()| match d {
                DatapathKind::Fake(_) => Ok(()),
                _ => m
                    .clients
                    .iter()
                    .try_for_each(|&n| datapath::applies_clients(d, b, n)),
            });
            if let Err(reason) = why {
                skipped.push(Skipped {
                    datapath: d.clone(),
                    backend: Some(b),
                    reason,
                });
            }
        }
    }
    let mut groups = Vec::new();
    for rep in 1..=m.reps {
        for &b in &m.backends {
            for &n in &m.clients {
                for d in m.order_of(rep) {
                    let split = matches!(d, DatapathKind::Fake(_))
                        || datapath::applies_clients(&d, b, n).is_ok();
                    if runnable.contains(&d) && ready(&d, b) && split {
                        groups.push(Group {
                            rep,
                            datapath: d,
                            backend: b,
                            clients: n,
                        });
                    }
                }
            }
        }
    }
    (groups, skipped)
}

/// Run every group, writing each run to `raw_dir` as it completes. A server that does
/// not start fails its group's runs (recorded, not fatal): the others still run.
/// When `stop` is set (SIGINT/SIGTERM) no new run starts: what ran is returned, so
/// the caller still writes its summary and removes the data file.
pub fn execute(
    env: &Env,
    groups: &[Group],
    raw_dir: &Path,
    stop: &AtomicBool,
) -> std::io::Result<Vec<RunRecord>> {
    let points = env.matrix.points();
    let mut progress = Progress::new(groups.len() * points.len(), env);
    let mut out = Vec::new();
    for g in groups {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let mut target = match &g.datapath {
            DatapathKind::Vm(v) => super::vm_target::start(*v, g.backend, env),
            d => datapath::start(d, g.backend, g.clients, env),
        };
        for p in &points {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            progress.show(g, p);
            let result = match &mut target {
                Ok(t) => t.run(p, g.rep).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let (m, error) = match result {
                Ok(v) => (v, None),
                Err(e) => (Measured::default(), Some(e)),
            };
            let perf = match m.clients.is_empty() {
                true => Value::Null,
                false => clients::aggregate(&m.clients),
            };
            if let Some(e) = &error {
                progress.note(&format!("failed: {e}"));
            }
            let r = RunRecord {
                seq: out.len(),
                rep: g.rep,
                datapath: g.datapath.clone(),
                backend: g.backend,
                clients: g.clients,
                point: *p,
                perf,
                per_client: m.clients,
                server_cpu: m.server_cpu,
                cpu: m.cpu,
                upgrades_ms: m.upgrades_ms,
                error,
            };
            std::fs::write(raw_dir.join(r.file_name()), serde_json::to_vec_pretty(&r)?)?;
            out.push(r);
        }
    }
    progress.done();
    Ok(out)
}

/// A one-line progress report on stderr with the time left, when stderr is a terminal.
struct Progress {
    total: usize,
    done: usize,
    started: Instant,
    /// Seconds a run is expected to take before any has finished.
    guess: f64,
    tty: bool,
}

impl Progress {
    fn new(total: usize, env: &Env) -> Progress {
        let m = &env.matrix;
        Progress {
            total,
            done: 0,
            started: Instant::now(),
            guess: m.time + m.ramp + 0.2,
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn show(&mut self, g: &Group, p: &Point) {
        let elapsed = self.started.elapsed().as_secs_f64();
        let per_run = if self.done > 0 {
            elapsed / self.done as f64
        } else {
            self.guess
        };
        let left = Duration::from_secs_f64(per_run * (self.total - self.done) as f64);
        self.done += 1;
        if self.tty {
            eprint!(
                "\r\x1b[K{}/{} rep {} {} {} ×{} {} ~{}m{:02}s left",
                self.done,
                self.total,
                g.rep,
                g.datapath,
                g.backend,
                g.clients,
                p.slug(),
                left.as_secs() / 60,
                left.as_secs() % 60
            );
            let _ = std::io::stderr().flush();
        }
    }

    fn note(&self, s: &str) {
        if self.tty {
            eprintln!();
        }
        eprintln!("udrive bench: {s}");
    }

    fn done(&self) {
        if self.tty {
            eprintln!(
                "\r\x1b[K{} runs in {:.0} s",
                self.total,
                self.started.elapsed().as_secs_f64()
            );
        }
    }
}
