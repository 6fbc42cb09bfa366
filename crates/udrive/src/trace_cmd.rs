//! `udrive trace`: trace a running server over its control socket for a while and
//! print the layer breakdown; and [`RpcServerTrace`], the server side of
//! `udrive perf --trace --rpc`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::rpc_client::{call, DEFAULT_SOCKET};

/// Replies to trace calls come after every reactor answered (stats::READ_TIMEOUT
/// each); this is generous on top.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    /// Control socket of `udrive serve --rpc`
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    pub rpc: PathBuf,
    /// Only the device on this socket (default: every device)
    #[arg(long, value_name = "SOCKET")]
    pub device: Option<PathBuf>,
    /// Seconds to trace
    #[arg(long, default_value_t = 10.0)]
    pub time: f64,
    /// Trace one request in N (1: every request)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i32::MAX as i64))]
    pub sample: u32,
    /// Print the breakdown as JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// Also write a stacked-bar chart of mean time per layer to this PNG
    #[arg(long, value_name = "PNG")]
    pub plot: Option<PathBuf>,
}

fn rpc(socket: &Path, method: &str, params: Value) -> Result<Value> {
    call(socket, method, params, CALL_TIMEOUT).map_err(|e| anyhow!("{method} failed: {e}"))
}

fn device_params(device: Option<&Path>) -> Value {
    match device {
        Some(d) => json!({"socket": d}),
        None => json!({}),
    }
}

fn breakdown(v: Value) -> Result<trace::Breakdown> {
    serde_json::from_value(v).context("trace_read returned something that is not a breakdown")
}

pub fn run(a: TraceArgs) -> Result<()> {
    if !a.time.is_finite() || !(0.0..=86_400.0).contains(&a.time) {
        bail!("--time must be between 0 and 86400 seconds");
    }
    let mut start = device_params(a.device.as_deref());
    start["sample"] = json!(a.sample);
    let started = rpc(&a.rpc, "trace_start", start)?;
    let traced = started["devices"].as_array().map_or(0, Vec::len);
    if traced == 0 {
        let _ = rpc(&a.rpc, "trace_stop", device_params(a.device.as_deref()));
        bail!("the server has no device to trace (add one with nvme_add_controller or vhost_user_blk_add)");
    }
    let total = Duration::from_secs_f64(a.time);
    let began = Instant::now();
    let mut err = std::io::stderr();
    loop {
        let done = began.elapsed();
        if done >= total {
            break;
        }
        let _ = write!(
            err,
            "\rudrive trace: {traced} device(s), one request in {}, {:.0}/{:.0} s ",
            a.sample,
            done.as_secs_f64(),
            total.as_secs_f64()
        );
        let _ = err.flush();
        std::thread::sleep((total - done).min(Duration::from_millis(500)));
    }
    let _ = writeln!(err);
    let params = device_params(a.device.as_deref());
    rpc(&a.rpc, "trace_stop", params.clone())?;
    let b = breakdown(rpc(&a.rpc, "trace_read", params)?)?;
    if a.json {
        crate::outln!("{}", crate::trace_view::json(&b)?)?;
    } else if b.ops.is_empty() {
        crate::outln!("no reads or writes were traced in {:.1} s", a.time)?;
    } else {
        crate::outln!("layers (µs):\n{}", crate::trace_view::table(&b))?;
    }
    if let Some(p) = &a.plot {
        let title = format!("udrive trace, {:.0} s", a.time);
        crate::trace_view::plot(&b, &title, p)?;
    }
    Ok(())
}

/// The server's layers for `udrive perf --trace --rpc SOCKET`: traces every request
/// of the device perf drives (`device`), or of all devices.
pub struct RpcServerTrace {
    pub rpc: PathBuf,
    pub device: Option<PathBuf>,
}

impl RpcServerTrace {
    fn params(&self) -> Value {
        // The server resolves sockets relative to its own directory; an absolute
        // path names the same file from both processes.
        let d = self
            .device
            .as_ref()
            .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.clone()));
        device_params(d.as_deref())
    }
}

impl crate::perf::ServerTrace for RpcServerTrace {
    fn start(&self) -> Result<()> {
        let mut p = self.params();
        p["sample"] = json!(1);
        rpc(&self.rpc, "trace_start", p).map(drop)
    }

    fn stop_and_read(&self) -> Result<trace::Breakdown> {
        rpc(&self.rpc, "trace_stop", self.params())?;
        breakdown(rpc(&self.rpc, "trace_read", self.params())?)
    }
}
