//! Where a cell's CPU went, per I/O: by role (server, client, cluster) and by
//! thread (the matrix's `cpu = "roles"` or `"threads"`), and their tables in
//! summary.md.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::matrix::Backend;
use super::run::RunRecord;
use super::stat::Stat;

/// The roles in the order the tables show them.
const ROLES: [&str; 3] = ["server", "client", "cluster"];

/// Threads under this many µs per I/O stay out of the table (not out of
/// summary.json): a cluster has dozens of threads that barely run.
const THREAD_FLOOR_US: f64 = 0.3;

/// A cell's CPU per I/O in µs, median (min–max) over its runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CpuCell {
    /// `server`, `client`, `cluster`: the roles the runs measured.
    pub roles: BTreeMap<String, Stat>,
    /// The roles' sum, per run.
    pub total_us: Option<Stat>,
    /// The cores the roles kept busy together: where every datapath shows about the
    /// same, they all ran out of CPU and their IOPS follow their CPU per I/O.
    pub cores: Option<Stat>,
    /// `role:thread-name` → µs per I/O (`cpu = "threads"`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub threads: BTreeMap<String, Stat>,
}

/// µs of CPU per I/O of `secs` over a run.
fn per_io(r: &RunRecord, secs: f64) -> Option<f64> {
    let share = r.cpu.as_ref()?;
    let iops = r.iops().filter(|&i| i > 0.0)?;
    (share.wall_s > 0.0).then(|| secs / share.wall_s / iops * 1e6)
}

/// The CPU of a cell's runs, if they measured more than the server's.
pub fn stats(runs: &[&RunRecord]) -> Option<CpuCell> {
    let shares: Vec<(&RunRecord, &super::cpu::CpuShare)> = runs
        .iter()
        .filter_map(|r| Some((*r, r.cpu.as_ref()?)))
        .collect();
    if shares.is_empty() {
        return None;
    }
    let of = |key: &dyn Fn(&super::cpu::CpuShare) -> Option<f64>| -> Option<Stat> {
        let v: Vec<f64> = shares
            .iter()
            .filter_map(|(r, s)| per_io(r, key(s)?))
            .collect();
        Stat::of(&v)
    };
    let mut roles = BTreeMap::new();
    for role in ROLES {
        if let Some(s) = of(&|s| s.roles.get(role).copied()) {
            roles.insert(role.to_string(), s);
        }
    }
    let mut threads = BTreeMap::new();
    let names: std::collections::BTreeSet<&String> =
        shares.iter().flat_map(|(_, s)| s.threads.keys()).collect();
    for name in names {
        // A run without the thread had it idle.
        if let Some(s) = of(&|s| Some(s.threads.get(name).copied().unwrap_or(0.0))) {
            threads.insert(name.clone(), s);
        }
    }
    let total = |s: &super::cpu::CpuShare| Some(s.roles.values().sum::<f64>());
    let cores: Vec<f64> = shares
        .iter()
        .filter(|(_, s)| s.wall_s > 0.0)
        .map(|(_, s)| s.roles.values().sum::<f64>() / s.wall_s)
        .collect();
    Some(CpuCell {
        roles,
        total_us: of(&total),
        cores: Stat::of(&cores),
        threads,
    })
}

fn opt(s: Option<&Stat>, nd: usize) -> String {
    s.map_or("—".into(), |s| s.fmt(1.0, nd))
}

/// A cell's row: its workload, its datapath and its CPU.
pub struct Row<'a> {
    pub workload: String,
    pub datapath: String,
    pub cpu: &'a CpuCell,
}

/// The CPU tables of one backend's cells, if any measured more than the server.
pub fn tables(o: &mut String, b: Backend, rows: &[Row]) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(o, "### {b}: CPU per I/O (µs)\n");
    let _ = writeln!(
        o,
        "| workload | datapath | server | client | cluster | total | cores busy |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|");
    for r in rows {
        let u = r.cpu;
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.workload,
            r.datapath,
            opt(u.roles.get("server"), 1),
            opt(u.roles.get("client"), 1),
            opt(u.roles.get("cluster"), 1),
            opt(u.total_us.as_ref(), 1),
            opt(u.cores.as_ref(), 2),
        );
    }
    o.push('\n');
    if rows.iter().all(|r| r.cpu.threads.is_empty()) {
        return;
    }
    let _ = writeln!(
        o,
        "### {b}: CPU per I/O by thread (µs, median; threads of one name added, those under {THREAD_FLOOR_US} left out)\n"
    );
    let _ = writeln!(o, "| workload | datapath | threads |");
    let _ = writeln!(o, "|---|---|---|");
    for r in rows {
        let mut t: Vec<(&String, f64)> = r
            .cpu
            .threads
            .iter()
            .map(|(k, s)| (k, s.median))
            .filter(|(_, m)| *m >= THREAD_FLOOR_US)
            .collect();
        t.sort_by(|a, b| b.1.total_cmp(&a.1));
        let list: Vec<String> = t.iter().map(|(k, m)| format!("{k} {m:.1}")).collect();
        let _ = writeln!(
            o,
            "| {} | {} | {} |",
            r.workload,
            r.datapath,
            list.join(" · ")
        );
    }
    o.push('\n');
}
