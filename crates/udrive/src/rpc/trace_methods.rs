//! Tracing and metrics methods (docs/rpc.md): `get_stats`, `get_metrics`,
//! `trace_start`, `trace_stop`, `trace_read`. They select devices here and leave the
//! data to `crate::stats`. NVMe controllers and vhost-user-blk devices both keep
//! per-queue recorders (`crate::stats::Traced`).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};
use trace::StatsSnapshot;

use super::api::{parse_params, Registry, RpcError, INTERNAL_ERROR};
use super::params::{DeviceFilter, Empty};
use crate::frontend::FrontEnd;
use crate::server::{Server, State};
use crate::stats;

/// Largest `sample` (one request in N is traced); the recorders count in u32 and
/// keep the top bit free.
pub const MAX_SAMPLE: u32 = (1 << 31) - 1;

pub fn register(r: &mut Registry) {
    r.register(
        "get_stats",
        "per device/namespace/queue counters, histograms and reactor counters (trace::StatsSnapshot)",
        |rpc, p| {
            let a: DeviceFilter = parse_params(p)?;
            let s = snapshot(&rpc.server, a.socket.as_deref())?;
            serde_json::to_value(s).map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))
        },
    );
    r.register(
        "get_metrics",
        "all counters in Prometheus text format (a string)",
        |rpc, p| {
            parse_params::<Empty>(p)?;
            Ok(Value::String(crate::metrics::render(&rpc.server)))
        },
    );
    r.register(
        "trace_start",
        "trace one request in `sample` (default 1: all) on every device or on `socket`; drops earlier trace data",
        |rpc, p| {
            let a: TraceStart = parse_params(p)?;
            let sample = match &a.sample {
                None => 1,
                Some(v) => v
                    .as_u64()
                    .filter(|n| (1..=u64::from(MAX_SAMPLE)).contains(n))
                    .ok_or_else(|| {
                        RpcError::params(format!(
                            "sample must be an integer 1..={MAX_SAMPLE} (trace one request in N), not {v}"
                        ))
                    })?,
            };
            let st = rpc.server.lock();
            let devs = select(&st, a.socket.as_deref())?;
            stats::trace_start(&devs, sample as u32);
            Ok(targets(&devs, Some(sample)))
        },
    );
    r.register(
        "trace_stop",
        "stop tracing on every device or on `socket`; the data stays readable",
        |rpc, p| {
            let a: DeviceFilter = parse_params(p)?;
            let st = rpc.server.lock();
            let devs = select(&st, a.socket.as_deref())?;
            stats::trace_stop(&devs);
            Ok(targets(&devs, None))
        },
    );
    r.register(
        "trace_read",
        "the layer breakdown (count, mean, p50, p99, p99.9, max per layer, per op) of the current trace",
        |rpc, p| {
            let a: DeviceFilter = parse_params(p)?;
            let st = rpc.server.lock();
            let devs = select(&st, a.socket.as_deref())?;
            let b = stats::trace_read(&devs);
            serde_json::to_value(b).map_err(|e| RpcError::new(INTERNAL_ERROR, e.to_string()))
        },
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceStart {
    #[serde(default)]
    socket: Option<PathBuf>,
    /// Checked by hand so that every wrong value gets a message naming `sample`.
    #[serde(default)]
    sample: Option<Value>,
}

/// The devices `socket` selects (all when `None`). A socket with no device is an
/// error.
fn select<'a>(st: &'a State, socket: Option<&Path>) -> Result<Vec<&'a dyn FrontEnd>, RpcError> {
    if let Some(s) = socket {
        if st.find(s).is_none() {
            return Err(st.not_found(s).into());
        }
    }
    Ok(st
        .devices
        .iter()
        .filter(|d| socket.is_none_or(|s| crate::server::same_socket(d.socket(), s)))
        .map(|d| d.as_ref())
        .collect())
}

fn targets(devs: &[&dyn FrontEnd], sample: Option<u64>) -> Value {
    let mut v = json!({
        "devices": devs.iter().map(|d| d.socket().display().to_string()).collect::<Vec<_>>(),
    });
    if let Some(s) = sample {
        v["sample"] = json!(s);
    }
    v
}

/// The stats of the devices `socket` selects (all when `None`) and of every reactor.
pub fn snapshot(server: &Server, socket: Option<&Path>) -> Result<StatsSnapshot, RpcError> {
    let st = server.lock();
    let devs = select(&st, socket)?;
    Ok(stats::get_stats(&devs, &server.engine))
}
