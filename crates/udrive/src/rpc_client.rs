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
    /// Method name (rpc_get_methods lists them)
    pub method: String,
    /// Parameters as a JSON object, e.g. '{"socket":"vm1.sock","nsid":2}'
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
    let params = match &a.params {
        None => Value::Null,
        Some(p) => {
            let v: Value = serde_json::from_str(p).with_context(|| {
                format!(
                    "PARAMS must be a JSON object, e.g. '{{\"socket\":\"vm.sock\"}}', not `{p}`"
                )
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
            Ok(())
        }
        Err(e) => bail!("{} failed: {e}", a.method),
    }
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
