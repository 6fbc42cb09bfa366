//! `reload_config`: the configuration file applied to the running server
//! (crate::reload), as SIGHUP and `systemctl reload` do.

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
