//! Secrets over the control socket, as QEMU's `secret` objects: a passphrase is
//! added once under a name, and specs (`key-secret=NAME`) and the LUKS keyslot
//! methods (`key_secret`) name it. Replies and logs carry names only.

use std::collections::BTreeMap;

use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use zeroize::Zeroizing;

use super::api::{parse_params, Registry, Rpc, RpcError, SERVER_ERROR};
use crate::nsspec::{KeySpec, NsSpec};

pub fn register(r: &mut Registry) {
    r.register(
        "secret_add",
        "add a secret (a LUKS passphrase) under name: data, as UTF-8 text (format raw, the default) or base64",
        add,
    );
    r.register(
        "secret_remove",
        "remove the secret name (refused while a disk's spec names it)",
        remove,
    );
    r.register(
        "secret_list",
        "the secrets' names and the disks that name them (never their data)",
        |rpc, _| Ok(list(rpc)),
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddParams {
    name: String,
    data: Zeroizing<String>,
    #[serde(default)]
    format: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Name {
    name: String,
}

fn add(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: AddParams = parse_params(p)?;
    let bytes = match a.format.as_deref() {
        None | Some("raw") => Zeroizing::new(a.data.as_bytes().to_vec()),
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(a.data.as_bytes())
            .map(Zeroizing::new)
            // The decoder's message could quote the data: say only where it failed.
            .map_err(|_| RpcError::params("data is not valid base64"))?,
        Some(_) => return Err(RpcError::params("format must be raw or base64")),
    };
    rpc.server
        .process()
        .add_secret(&a.name, bytes)
        .map_err(|e| RpcError::new(SERVER_ERROR, e.to_string()))?;
    tracing::info!(name = %a.name, "secret added");
    Ok(json!({"name": a.name}))
}

fn remove(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: Name = parse_params(p)?;
    if let Some(users) = secret_users(rpc).get(&a.name) {
        return Err(RpcError::new(
            SERVER_ERROR,
            format!(
                "secret {} is named by {}: a handover or a restart reopens them with it; remove those disks first",
                a.name,
                users.join(", ")
            ),
        ));
    }
    rpc.server
        .process()
        .remove_secret(&a.name)
        .map_err(|e| RpcError::new(SERVER_ERROR, e.to_string()))?;
    tracing::info!(name = %a.name, "secret removed");
    Ok(json!({"name": a.name}))
}

fn list(rpc: &Rpc) -> Value {
    let mut users = secret_users(rpc);
    let names = rpc.server.process().secrets().names();
    Value::Array(
        names
            .into_iter()
            .map(|n| {
                let used_by = users.remove(&n).unwrap_or_default();
                json!({"name": n, "used_by": used_by})
            })
            .collect(),
    )
}

/// Secret name -> the disks whose specs name it, as `SOCKET` or `SOCKET nsid N`.
fn secret_users(rpc: &Rpc) -> BTreeMap<String, Vec<String>> {
    let st = rpc.server.lock();
    let snap = crate::handover::snapshot::ServerSnapshot::of(&rpc.server, &st);
    drop(st);
    let secret = |spec: &NsSpec| match spec.encrypt.as_ref().map(|e| &e.key) {
        Some(KeySpec::Secret(name)) => Some(name.clone()),
        _ => None,
    };
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for c in &snap.controllers {
        let ids = c.nsids.clone().unwrap_or_default();
        for (i, ns) in c.namespaces.iter().enumerate() {
            if let Some(name) = secret(ns) {
                let id = ids.get(i).copied().unwrap_or(i as u32 + 1);
                out.entry(name)
                    .or_default()
                    .push(format!("{} nsid {id}", c.socket.display()));
            }
        }
    }
    for v in &snap.vhost_user_blk {
        if let Some(name) = secret(&v.disk) {
            out.entry(name)
                .or_default()
                .push(v.socket.display().to_string());
        }
    }
    out
}
