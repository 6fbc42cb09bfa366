//! The NBD server (docs/rpc.md, decision 0045): `nbd_server_start`,
//! `nbd_server_add`, `nbd_server_remove`, `nbd_server_stop`,
//! `get_nbd_exports`. A disk is named as for `set_qos`: `socket`, plus
//! `nsid` for an NVMe namespace.

use std::path::PathBuf;

use anyhow::anyhow;
use serde::Deserialize;
use serde_json::Value;

use super::api::{parse_params, Registry, Rpc, RpcError};
use super::params::Empty;
use crate::nbd_export::NbdServer;

pub fn register(r: &mut Registry) {
    r.register(
        "nbd_server_start",
        "listen for NBD clients on `listen` (`HOST:PORT` or `unix:PATH`)",
        start,
    );
    r.register(
        "nbd_server_add",
        "export a device's disk over NBD as `name` (`writable`: clients may write)",
        add,
    );
    r.register(
        "nbd_server_remove",
        "stop exporting `name`; its connections end",
        remove,
    );
    r.register(
        "nbd_server_stop",
        "stop the NBD server and every connection",
        stop,
    );
    r.register(
        "get_nbd_exports",
        "the NBD server's address, exports and connections",
        get,
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Start {
    listen: String,
}

fn start(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: Start = parse_params(p)?;
    let mut n = rpc.server.nbd_server();
    if let Some(running) = n.as_ref() {
        return Err(anyhow!(
            "the NBD server listens on {} already (nbd_server_stop first)",
            running.listen
        )
        .into());
    }
    let server = NbdServer::start(&a.listen)?;
    let shown = server.json();
    *n = Some(server);
    Ok(shown)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Add {
    socket: PathBuf,
    nsid: Option<u32>,
    /// Default: the socket's file name.
    name: Option<String>,
    #[serde(default)]
    writable: bool,
}

fn add(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: Add = parse_params(p)?;
    let disk = rpc.server.disk(&a.socket, a.nsid)?;
    let name = match a.name {
        Some(n) => n,
        None => a
            .socket
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .ok_or_else(|| anyhow!("name the export: the socket path has no file name"))?,
    };
    let n = rpc.server.nbd_server();
    let server = n
        .as_ref()
        .ok_or_else(|| anyhow!("no NBD server runs: nbd_server_start first"))?;
    server.add(&name, &a.socket, a.nsid, a.writable, disk)?;
    Ok(server.json())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Remove {
    name: String,
}

fn remove(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: Remove = parse_params(p)?;
    let n = rpc.server.nbd_server();
    let server = n.as_ref().ok_or_else(|| anyhow!("no NBD server runs"))?;
    server.remove(&a.name)?;
    Ok(server.json())
}

fn stop(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let Empty {} = parse_params(p)?;
    let server = rpc
        .server
        .nbd_server()
        .take()
        .ok_or_else(|| anyhow!("no NBD server runs"))?;
    drop(server);
    Ok(Value::Bool(true))
}

fn get(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let Empty {} = parse_params(p)?;
    Ok(rpc
        .server
        .nbd_server()
        .as_ref()
        .map_or(Value::Null, NbdServer::json))
}
