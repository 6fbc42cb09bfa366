//! Parameter types and helpers several method groups share.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;

use super::api::RpcError;
use crate::server::Server;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Empty {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DeviceFilter {
    #[serde(default)]
    pub socket: Option<PathBuf>,
}

/// A rate or a size: a number, or a string with a K/M/G suffix ("100M").
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Rate {
    N(u64),
    S(String),
}

impl Rate {
    pub(super) fn value(&self, name: &str) -> Result<Option<u64>, RpcError> {
        let v = match self {
            Rate::N(n) => *n,
            Rate::S(s) => {
                crate::size::parse_size(s).map_err(|e| RpcError::params(format!("{name}: {e}")))?
            }
        };
        Ok(Some(v).filter(|v| *v > 0))
    }
}

pub(super) fn device_json_by_socket(
    server: &Server,
    socket: &std::path::Path,
) -> Result<Value, RpcError> {
    let st = server.lock();
    st.find(socket)
        .map(|d| d.json())
        .ok_or_else(|| st.not_found(socket).into())
}
