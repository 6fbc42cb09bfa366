//! A matrix's variants of udrive's datapaths: `[variant.NAME]` with client options,
//! server environment and tracing, named in `datapaths` as `udrive-nvme+NAME`, so
//! that one matrix compares udrive with itself under one changed knob (DMA by
//! messages, shadow doorbells, a dirty log, tracing, a reactor placement), alternated like any datapath.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::matrix::{DatapathKind, MatrixError};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    /// More `udrive perf` options for this datapath's clients (e.g.
    /// `["--dma-messages"]`, `["--queue-entries", "1024"]`).
    #[serde(default)]
    pub perf: Vec<String>,
    /// `KEY=VALUE` pairs in the server's environment.
    #[serde(default)]
    pub serve_env: Vec<String>,
    /// The reactor placement of this datapath's queues (`serve --placement`)
    /// instead of the matrix's (vhost-user-blk) or round-robin (NVMe).
    #[serde(default)]
    pub placement: Option<String>,
    /// Options added to each client's disk spec (e.g. `["iops=1000"]`, a QoS limit).
    #[serde(default)]
    pub disk: Vec<String>,
    /// Ceph client settings for the `rbd` backend's image (`["rbd_op_threads = 2"]`):
    /// the server reads a copy of the cluster's conf with these in its `[client]`
    /// section, so one cluster compares librbd settings, alternated.
    #[serde(default)]
    pub ceph: Vec<String>,
    /// A device of another tenant on the same server, loaded while this datapath's
    /// clients are measured.
    #[serde(default)]
    pub neighbour: Option<Neighbour>,
    /// Live handovers (`udrive upgrade`, to the server's own binary) during each
    /// run, evenly spaced over its measured time; the clients report that many
    /// longest pauses between completions (`perf --gaps`): what a guest sees of
    /// each.
    #[serde(default)]
    pub handovers: u32,
    /// Trace every run of this datapath (the matrix's `trace` does it for all);
    /// `"server"`: the server's side only (`perf --trace-server`), what tracing
    /// costs the server without the client's stamps.
    #[serde(default)]
    pub trace: TraceOpt,
    /// Text the server's log must hold once it is up: the proof that a knob only
    /// some builds have (a test knob in `serve_env`) took effect. A server without
    /// it fails the datapath's runs instead of measuring the plain server.
    #[serde(default)]
    pub expect_log: Option<String>,
}

/// A second device on the same server with a client the harness starts before each
/// run and stops after it, unmeasured: what a busy or throttled neighbour costs the
/// measured clients. Its disk is `null:64G`: it loads the server, not the medium.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Neighbour {
    /// Options of its disk spec (e.g. `["iops=1000"]`).
    #[serde(default)]
    pub disk: Vec<String>,
    /// Its client's `udrive perf` options (e.g. `["--qd", "512"]`); its device, time,
    /// CPUs (the matrix's client CPUs) and output are the harness's.
    #[serde(default)]
    pub perf: Vec<String>,
    /// Its client at idle priority (SCHED_IDLE): on the measured clients' CPUs it
    /// then keeps its queue full with the time they leave, so what it costs them is
    /// the server's work for it, not their CPU.
    #[serde(default)]
    pub idle_priority: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TraceOpt {
    Flag(bool),
    Side(ServerOnly),
}

impl Default for TraceOpt {
    fn default() -> Self {
        TraceOpt::Flag(false)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServerOnly {
    Server,
}

/// Which sides a datapath's runs trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceScope {
    /// The client's layers, and udrive's server's through its control socket.
    Both,
    /// udrive's server's only.
    Server,
}

/// Options the harness sets itself: a variant giving one would run another device
/// or workload than its cell says.
const HARNESS_OPTIONS: [&str; 17] = [
    "--trace",
    "--trace-server",
    "--vfio-user",
    "--vhost-user",
    "--file",
    "--rbd",
    "--json",
    "--cpus",
    "--rw",
    "--rwmixread",
    "--bs",
    "--qd",
    "--jobs",
    "--think-us",
    "--time",
    "--ramp",
    "--rpc",
];

/// The most handovers in one run.
const MAX_HANDOVERS: u32 = 1000;

/// Options the harness sets on a neighbour's client.
const NEIGHBOUR_HARNESS_OPTIONS: [&str; 10] = [
    "--trace",
    "--trace-server",
    "--vfio-user",
    "--vhost-user",
    "--file",
    "--rbd",
    "--json",
    "--cpus",
    "--time",
    "--rpc",
];

fn invalid(field: String, reason: String) -> MatrixError {
    MatrixError::Invalid { field, reason }
}

/// `perf` options not among those the harness sets.
fn check_perf(field: &str, args: &[String], harness: &[&str]) -> Result<(), MatrixError> {
    for (j, a) in args.iter().enumerate() {
        let flag = a.split('=').next().unwrap_or(a);
        if harness.contains(&flag) {
            return Err(invalid(
                format!("{field}[{j}]"),
                format!("`{flag}` is set by the harness"),
            ));
        }
    }
    Ok(())
}

/// Disk spec options: `key=value`, no comma (each is one option of the spec).
fn check_disk(field: &str, opts: &[String]) -> Result<(), MatrixError> {
    for (j, o) in opts.iter().enumerate() {
        let ok = o
            .split_once('=')
            .is_some_and(|(k, v)| !k.is_empty() && !v.is_empty() && !o.contains(','));
        if !ok {
            return Err(invalid(
                format!("{field}[{j}]"),
                "one disk option, key=value without a comma (e.g. iops=1000)".into(),
            ));
        }
    }
    Ok(())
}

/// Every `+NAME` of `datapaths` has its `[variant.NAME]`, and every variant is one
/// the harness can run.
pub fn check(
    datapaths: &[DatapathKind],
    variants: &BTreeMap<String, Variant>,
) -> Result<(), MatrixError> {
    for (i, d) in datapaths.iter().enumerate() {
        if let Some(v) = d.variant() {
            if !variants.contains_key(v) {
                return Err(invalid(
                    format!("datapaths[{i}]"),
                    format!("`{d}` names variant `{v}`: add [variant.{v}]"),
                ));
            }
        }
    }
    for (name, v) in variants {
        let field = |f: &str| format!("variant.{name}.{f}");
        check_perf(&field("perf"), &v.perf, &HARNESS_OPTIONS)?;
        if v.handovers > MAX_HANDOVERS {
            return Err(invalid(
                field("handovers"),
                format!("at most {MAX_HANDOVERS} (the pauses `perf --gaps` keeps)"),
            ));
        }
        if v.handovers > 0 {
            check_perf(&field("perf"), &v.perf, &["--gaps"])?;
        }
        check_disk(&field("disk"), &v.disk)?;
        for (j, line) in v.ceph.iter().enumerate() {
            let ok = line
                .split_once('=')
                .is_some_and(|(k, _)| !k.trim().is_empty() && !line.contains(['\n', '[']));
            if !ok {
                return Err(invalid(
                    format!("{}[{j}]", field("ceph")),
                    "one Ceph setting, `key = value` (e.g. rbd_op_threads = 2)".into(),
                ));
            }
        }
        if let Some(n) = &v.neighbour {
            check_perf(
                &field("neighbour.perf"),
                &n.perf,
                &NEIGHBOUR_HARNESS_OPTIONS,
            )?;
            check_disk(&field("neighbour.disk"), &n.disk)?;
        }
        for (j, kv) in v.serve_env.iter().enumerate() {
            let key_ok = kv.split_once('=').is_some_and(|(k, _)| {
                !k.is_empty()
                    && k.bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            });
            if !key_ok {
                return Err(invalid(
                    format!("{}[{j}]", field("serve_env")),
                    "KEY=VALUE with KEY of A-Z, 0-9 and _".into(),
                ));
            }
        }
        if let Some(p) = v.placement.as_deref() {
            if !super::matrix::PLACEMENTS.contains(&p) {
                return Err(invalid(
                    field("placement"),
                    format!("one of {}", super::matrix::PLACEMENTS.join(", ")),
                ));
            }
        }
        if v.expect_log.as_deref() == Some("") {
            return Err(invalid(field("expect_log"), "must not be empty".into()));
        }
    }
    Ok(())
}
