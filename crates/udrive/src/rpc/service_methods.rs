//! What a service manager's unit drives: `reload_config` (the configuration file
//! applied to the running server, crate::reload, as SIGHUP and `systemctl reload`
//! do) and `start_successor` (a live upgrade that stays inside the unit,
//! crate::handover::successor).

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;

use super::api::{parse_params, Registry, Rpc, RpcError, SERVER_ERROR};

pub fn register(r: &mut Registry) {
    r.register(
        "reload_config",
        "re-read the configuration file (or `config`) and apply what changed (as SIGHUP does)",
        reload_config,
    );
    r.register(
        "start_successor",
        "start this server's own binary to take every device over (`udrive upgrade` for a systemd service)",
        |rpc, p| {
            parse_params::<super::params::Empty>(p)?;
            let Some(socket) = rpc.server.rpc.clone() else {
                return Err(RpcError::new(SERVER_ERROR, "this server has no control socket"));
            };
            let pid = match crate::handover::launcher::start_successor(&socket) {
                Some(launched) => launched?,
                None => crate::handover::successor::start(&socket)?,
            };
            Ok(serde_json::json!({"pid": pid}))
        },
    );
}

/// Applies the configuration file; anything it could not apply makes this an error
/// (listing what was applied too), so `systemctl reload` fails visibly.
fn reload_config(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Params {
        #[serde(default)]
        config: Option<PathBuf>,
    }
    let p: Params = parse_params(p)?;
    let Some(path) = p.config.or_else(|| rpc.server.config_file.clone()) else {
        return Err(RpcError::new(
            SERVER_ERROR,
            "this server was not started from a configuration file (--config); pass \"config\"",
        ));
    };
    let report = crate::reload::reload(&rpc.server, &path)?;
    if report.failed.is_empty() {
        return Ok(serde_json::to_value(&report).unwrap_or(Value::Null));
    }
    Err(RpcError::new(
        SERVER_ERROR,
        format!(
            "reload of {} left {} change(s) undone: {}; applied: {}",
            path.display(),
            report.failed.len(),
            report.failed.join("; "),
            if report.applied.is_empty() {
                "nothing".to_string()
            } else {
                report.applied.join("; ")
            }
        ),
    ))
}
