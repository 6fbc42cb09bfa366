//! LUKS volumes of a running server: the header's description and keyslot
//! changes while the disk serves its guest (bdev::crypt, decision 0037). Keys
//! are files the server reads (`key_file`, `new_key_file`) or secrets given
//! earlier with `secret_add` (`key_secret`, `new_key_secret`), as on the spec: a
//! key is never in a reply, a log or an error.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{parse_params, Registry, Rpc, RpcError, SERVER_ERROR};
use crate::nsspec::{KeySpec, Passphrase};

pub fn register(r: &mut Registry) {
    r.register(
        "luks_status",
        "the LUKS header of an encrypted disk: version, cipher, key size, data offset, active keyslots",
        |rpc, p| {
            let a: Disk = parse_params(p)?;
            with_volume(rpc, &a, |v| Ok(status_json(&bdev::luks_status(v)?, None)))
        },
    );
    r.register(
        "luks_add_key",
        "add the passphrase new_key_file (or new_key_secret) to an encrypted disk; key_file (or key_secret) opens it",
        |rpc, p| change(rpc, p, Op::Add),
    );
    r.register(
        "luks_change_key",
        "replace the passphrase key_file (or key_secret) opens with new_key_file (or new_key_secret)",
        |rpc, p| change(rpc, p, Op::Change),
    );
    r.register(
        "luks_remove_key",
        "remove the keyslot key_file (or key_secret) opens (never the last one)",
        |rpc, p| change(rpc, p, Op::Remove),
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Disk {
    socket: PathBuf,
    #[serde(default)]
    nsid: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyParams {
    socket: PathBuf,
    #[serde(default)]
    nsid: Option<u32>,
    #[serde(default)]
    key_file: Option<PathBuf>,
    #[serde(default)]
    key_secret: Option<String>,
    #[serde(default)]
    new_key_file: Option<PathBuf>,
    #[serde(default)]
    new_key_secret: Option<String>,
    /// Time the new keyslot's key derivation is measured to take (cryptsetup's
    /// --iter-time) [default: libcryptsetup's, 2000].
    #[serde(default)]
    iter_time_ms: Option<u64>,
}

#[derive(Clone, Copy)]
enum Op {
    Add,
    Change,
    Remove,
}

/// The passphrase `file` or `secret` names (`what`: the parameters' names for
/// errors); None if neither is given.
fn passphrase(
    rpc: &Rpc,
    file: Option<PathBuf>,
    secret: Option<String>,
    what: &str,
) -> Result<Option<Passphrase>, RpcError> {
    let spec = match (file, secret) {
        (Some(f), None) => KeySpec::File(f),
        (None, Some(name)) => KeySpec::Secret(name),
        (Some(_), Some(_)) => return Err(RpcError::params(format!("give {what}, not both"))),
        (None, None) => return Ok(None),
    };
    let env: &dyn crate::kinds::OpenEnv = &**rpc.server.process();
    spec.resolve(env)
        .map(Some)
        .map_err(|e| RpcError::new(SERVER_ERROR, e.to_string()))
}

fn change(rpc: &Rpc, p: Value, op: Op) -> Result<Value, RpcError> {
    let a: KeyParams = parse_params(p)?;
    let key = passphrase(rpc, a.key_file, a.key_secret, "key_file or key_secret")?
        .ok_or_else(|| RpcError::params("key_file or key_secret is missing"))?;
    let new = passphrase(
        rpc,
        a.new_key_file,
        a.new_key_secret,
        "new_key_file or new_key_secret",
    )?;
    let change = match (op, &new) {
        (Op::Add, Some(n)) => bdev::KeyChange::Add { new: n.key() },
        (Op::Change, Some(n)) => bdev::KeyChange::Change { new: n.key() },
        (Op::Remove, None) => bdev::KeyChange::Remove,
        (Op::Remove, Some(_)) => return Err(RpcError::params("luks_remove_key takes no new key")),
        (_, None) => {
            return Err(RpcError::params(
                "new_key_file or new_key_secret is missing",
            ))
        }
    };
    let disk = Disk {
        socket: a.socket,
        nsid: a.nsid,
    };
    with_volume(rpc, &disk, |v| {
        let (status, slot) = bdev::change_key(v, key.key(), change, a.iter_time_ms)?;
        tracing::info!(socket = %disk.socket.display(), nsid = ?disk.nsid, keyslot = slot, "LUKS keyslots changed");
        Ok(status_json(&status, Some(slot)))
    })
}

fn with_volume(
    rpc: &Rpc,
    a: &Disk,
    f: impl FnOnce(&dyn bdev::BlockDevice) -> Result<Value, bdev::LuksError>,
) -> Result<Value, RpcError> {
    let disk = rpc.server.disk(&a.socket, a.nsid)?;
    let Some(volume) = bdev::BlockDevice::encrypted_volume(&*disk) else {
        return Err(RpcError::new(
            SERVER_ERROR,
            format!(
                "{} is not encrypted (its spec has no encrypt=luks)",
                bdev::BlockDevice::describe(&*disk)
            ),
        ));
    };
    f(volume).map_err(|e| RpcError::new(SERVER_ERROR, format!("{:#}", anyhow::Error::new(e))))
}

fn status_json(s: &bdev::LuksStatus, keyslot: Option<u32>) -> Value {
    let mut v = json!({
        "version": s.version,
        "uuid": s.uuid,
        "cipher": format!("{}-{}", s.cipher, s.cipher_mode),
        "key_bits": s.key_bits,
        "sector_size": s.sector_size,
        "data_offset": s.data_offset,
        "keyslots": s.keyslots,
    });
    if let Some(k) = keyslot {
        v["keyslot"] = json!(k);
    }
    v
}
