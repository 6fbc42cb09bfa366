//! `udrive rpc` and `udrive metrics`: one request over the control socket.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::framing::{Framer, Push};

pub const DEFAULT_SOCKET: &str = "./udrive-rpc.sock";

#[derive(clap::Args, Debug)]
pub struct RpcArgs {
    /// Control socket of `udrive serve --rpc` (`--rpc`, like every other command;
    /// `--socket` is kept as an alias)
    #[arg(long = "rpc", short = 's', alias = "socket", value_name = "PATH", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Seconds to wait for the reply
    #[arg(long, short = 't', default_value_t = 60)]
    pub timeout: u64,
    /// When the method starts a block job (`block_stream`, `block_commit`,
    /// `blockdev_mirror`): follow it with a progress bar on stderr until it
    /// ends, or until a mirror to another host is ready (exit 1 unless it
    /// completed or is ready)
    #[arg(long)]
    pub wait: bool,
    /// Method name (rpc_get_methods lists them)
    pub method: String,
    /// Parameters as a JSON object, e.g. '{"socket":"vm1.sock","nsid":2}'; `-`
    /// reads them from standard input (for `secret_add`: a passphrase stays out of
    /// the command line other users can see)
    pub params: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct MetricsArgs {
    /// Control socket of `udrive serve --rpc`
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SOCKET)]
    pub rpc: PathBuf,
}

/// Why a call failed: the server's JSON-RPC error, or transport trouble.
#[derive(Debug)]
pub enum CallError {
    Rpc { code: i64, message: String },
    Io(anyhow::Error),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Rpc { code, message } => write!(f, "{message} (code {code})"),
            CallError::Io(e) => write!(f, "{e:#}"),
        }
    }
}

/// Sends one request and returns its result.
pub fn call(
    socket: &Path,
    method: &str,
    params: Value,
    timeout: Duration,
) -> Result<Value, CallError> {
    let io = |e: anyhow::Error| CallError::Io(e);
    let mut s = UnixStream::connect(socket)
        .with_context(|| {
            format!(
                "cannot connect to {} (is `udrive serve --rpc {}` running?)",
                socket.display(),
                socket.display()
            )
        })
        .map_err(io)?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| io(e.into()))?;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| io(e.into()))?;
    let req = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": 1});
    let mut out = serde_json::to_vec(&req).map_err(|e| io(e.into()))?;
    out.push(b'\n');
    s.write_all(&out)
        .context("cannot send the request")
        .map_err(io)?;
    let mut framer = Framer::new(64 << 20);
    let mut buf = vec![0u8; 64 << 10];
    let msg = 'read: loop {
        let n = s
            .read(&mut buf)
            .context("no reply from the server")
            .map_err(io)?;
        if n == 0 {
            return Err(io(anyhow!(
                "the server closed the connection without a reply"
            )));
        }
        let mut at = 0;
        while at < n {
            let (used, p) = framer.push(&buf[at..n]);
            at += used;
            match p {
                Push::More => {}
                Push::Message(m) => break 'read m,
                Push::TooLarge | Push::Junk(_) => {
                    return Err(io(anyhow!("the server sent something that is not JSON")))
                }
            }
        }
    };
    let v: Value = serde_json::from_slice(&msg)
        .context("the server's reply is not valid JSON")
        .map_err(io)?;
    if let Some(e) = v.get("error") {
        return Err(CallError::Rpc {
            code: e.get("code").and_then(Value::as_i64).unwrap_or(0),
            message: e
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("(no message)")
                .to_string(),
        });
    }
    v.get("result")
        .cloned()
        .ok_or_else(|| io(anyhow!("the reply has neither result nor error: {v}")))
}

/// `udrive rpc`: prints the result pretty-printed; errors exit non-zero.
pub fn run(a: RpcArgs) -> Result<()> {
    let stdin;
    let params = match a.params.as_deref() {
        None => Value::Null,
        Some(p) => {
            let p = if p == "-" {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin().take(1 << 24), &mut s)
                    .context("cannot read PARAMS from standard input")?;
                stdin = zeroize::Zeroizing::new(s);
                stdin.as_str()
            } else {
                p
            };
            // The text is not quoted back: it may hold a secret.
            let v: Value = serde_json::from_str(p).with_context(|| {
                "PARAMS must be a JSON object, e.g. '{\"socket\":\"vm.sock\"}'".to_string()
            })?;
            if !v.is_object() {
                bail!("PARAMS must be a JSON object, e.g. '{{\"socket\":\"vm.sock\"}}'");
            }
            v
        }
    };
    match call(&a.socket, &a.method, params, Duration::from_secs(a.timeout)) {
        Ok(v) => {
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
            match v.get("job").and_then(Value::as_u64) {
                Some(id) if a.wait => follow_job(&a, id),
                _ => Ok(()),
            }
        }
        Err(e) => bail!("{} failed: {e}", a.method),
    }
}

/// Polls `get_jobs` until job `id` ends or is ready, drawing its progress
/// on stderr.
fn follow_job(a: &RpcArgs, id: u64) -> Result<()> {
    use std::io::IsTerminal;
    let tty = std::io::stderr().is_terminal();
    let timeout = Duration::from_secs(a.timeout);
    // Since the last answer: a live handover closes the old server's
    // connections, and the new server answers on the same socket.
    let mut answered = std::time::Instant::now();
    loop {
        let jobs = match call(&a.socket, "get_jobs", Value::Null, timeout) {
            Ok(j) => j,
            Err(CallError::Io(_)) if answered.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(250));
                continue;
            }
            Err(e) => bail!("get_jobs failed: {e}"),
        };
        answered = std::time::Instant::now();
        let job = jobs
            .as_array()
            .and_then(|l| l.iter().find(|j| j["id"].as_u64() == Some(id)))
            .cloned()
            .ok_or_else(|| anyhow!("job {id} is gone from get_jobs"))?;
        let state = job["state"].as_str().unwrap_or("?").to_string();
        let line = progress_line(&job);
        if tty {
            eprint!("\r{line}");
        }
        match state.as_str() {
            "running" | "paused" => std::thread::sleep(Duration::from_millis(250)),
            _ => {
                eprintln!("{}{line}", if tty { "\r" } else { "" });
                crate::outln!("{}", serde_json::to_string_pretty(&job)?)?;
                // A mirror to another host waits, ready, for job_complete.
                if state != "completed" && state != "ready" {
                    bail!("job {id} {state}");
                }
                return Ok(());
            }
        }
    }
}

/// `[#####---------------]  25%  4.0/16.0 MiB  running`; a running job that
/// copies nothing for now says `waiting` and why.
pub fn progress_line(job: &Value) -> String {
    const WIDTH: u64 = 30;
    let done = job["done"].as_u64().unwrap_or(0);
    let total = job["total"].as_u64().unwrap_or(0).max(1);
    let filled = (done.min(total) * WIDTH / total) as usize;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let state = match job["waiting"].as_str() {
        Some(why) => format!("waiting: {why}"),
        None => job["state"].as_str().unwrap_or("?").to_string(),
    };
    format!(
        "[{}{}] {:3}%  {:.1}/{:.1} MiB  {state:<9}",
        "#".repeat(filled),
        "-".repeat(WIDTH as usize - filled),
        done.min(total) * 100 / total,
        mib(done),
        mib(total),
    )
}

/// `udrive metrics`: the Prometheus text.
pub fn run_metrics(a: MetricsArgs) -> Result<()> {
    match call(&a.rpc, "get_metrics", Value::Null, Duration::from_secs(30)) {
        Ok(Value::String(s)) => {
            crate::stdout::write(format_args!("{s}"))?;
            Ok(())
        }
        Ok(v) => bail!("get_metrics returned {v}, not text"),
        Err(e) => bail!("get_metrics failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::progress_line;
    use serde_json::json;

    #[test]
    fn a_waiting_job_says_why() {
        let mut j = json!({"done": 1 << 20, "total": 4 << 20, "state": "running",
            "waiting": "the image is written by another process"});
        let line = progress_line(&j);
        assert!(line.starts_with("[#######-"), "{line}");
        assert!(
            line.contains(" 25%  1.0/4.0 MiB  waiting: the image is written by another process")
        );
        j["waiting"] = serde_json::Value::Null;
        assert!(progress_line(&j).trim_end().ends_with("MiB  running"));
    }
}
