//! Ceph RBD methods (docs/rpc.md, feature `rbd`): images (create, remove, clone),
//! snapshots (create, list, remove, protect, rollback).
//!
//! A snapshot method names its image either by device (`socket`, plus `nsid` for
//! an NVMe namespace): the operation then goes through the device's own image
//! handle, the one holding the exclusive lock; or by `image` plus the cluster
//! options of an `rbd:` spec (`conf`, `id`, `keyring`, `timeout`) for an image no
//! device of this server has open. Rollback is refused while any device here has
//! the image open: the guest's view would change under it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bdev::rbd::{Cluster, ClusterOptions, ImageHandle, ImageSpec, RbdDisk, DEFAULT_TIMEOUT};
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{parse_params, Registry, Rpc, RpcError};
use crate::kinds::rbd::RbdSpec;
use crate::kinds::KindSpec;
use crate::server::Server;

pub fn register(r: &mut Registry) {
    r.register(
        "rbd_create_image",
        "create an RBD image (format 2, default features)",
        create_image,
    );
    r.register(
        "rbd_remove_image",
        "remove an RBD image no device has open (its snapshots must be gone)",
        remove_image,
    );
    r.register(
        "rbd_clone_image",
        "clone a protected snapshot into a new image (attach it with nvme_add_namespace or vhost_user_blk_add)",
        clone_image,
    );
    r.register(
        "rbd_snapshot_create",
        "snapshot a device's RBD image (or a detached image)",
        snapshot_create,
    );
    r.register(
        "rbd_snapshot_list",
        "snapshots of a device's RBD image (or a detached image)",
        snapshot_list,
    );
    r.register(
        "rbd_snapshot_remove",
        "remove a snapshot (unprotecting it first; refused while clones of it exist)",
        snapshot_remove,
    );
    r.register(
        "rbd_snapshot_protect",
        "protect a snapshot so that it can be cloned",
        snapshot_protect,
    );
    r.register(
        "rbd_snapshot_rollback",
        "roll a detached image back to a snapshot (refused while a device has it open)",
        snapshot_rollback,
    );
}

fn create_image(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    let size = match &a.size {
        Some(s) => s.value("size")?,
        None => None,
    };
    let Some(size) = size.filter(|s| s % 512 == 0) else {
        return Err(RpcError::params("size: a non-zero multiple of 512 bytes"));
    };
    let spec = a.spec()?;
    a.connect(&rpc.server)?
        .create_image(&spec, size)
        .map_err(anyhow::Error::from)?;
    Ok(json!({"image": spec.to_string(), "size": size}))
}

fn remove_image(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    refuse_if_attached(&rpc.server, &a, "remove")?;
    a.connect(&rpc.server)?
        .remove_image(&a.spec()?)
        .map_err(anyhow::Error::from)?;
    Ok(Value::Bool(true))
}

fn clone_image(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    let parent = a.spec()?;
    let snap = a.snap_name()?;
    let Some(clone) = &a.clone else {
        return Err(RpcError::params("clone (the new POOL/IMAGE) is missing"));
    };
    let child: ImageSpec = clone.parse().map_err(RpcError::params)?;
    a.connect(&rpc.server)?
        .clone_image(&parent, &snap, &child)
        .map_err(anyhow::Error::from)?;
    Ok(json!({"image": child.to_string(), "parent": format!("{parent}@{snap}")}))
}

fn snapshot_create(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    let name = a.snap_name()?;
    with_image(&rpc.server, &a, |h| h.snap_create(&name))?;
    Ok(json!({"snapshot": name}))
}

fn snapshot_list(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    let snaps = with_image(&rpc.server, &a, |h| h.snap_list())?;
    Ok(json!(snaps
        .iter()
        .map(|s| json!({"name": s.name, "id": s.id, "size": s.size, "protected": s.protected}))
        .collect::<Vec<_>>()))
}

fn snapshot_remove(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    let name = a.snap_name()?;
    with_image(&rpc.server, &a, |h| h.snap_remove(&name))?;
    Ok(Value::Bool(true))
}

fn snapshot_protect(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    let name = a.snap_name()?;
    with_image(&rpc.server, &a, |h| h.snap_protect(&name))?;
    Ok(Value::Bool(true))
}

fn snapshot_rollback(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: RbdParams = parse_params(p)?;
    let name = a.snap_name()?;
    if a.image.is_none() || a.socket.is_some() {
        return Err(RpcError::new(
            -32000,
            "rollback is refused while a device has the image open: remove the \
             namespace or device, then roll back by `image`",
        ));
    }
    refuse_if_attached(&rpc.server, &a, "roll back")?;
    let h = a
        .connect(&rpc.server)?
        .open_image(&a.spec()?)
        .map_err(anyhow::Error::from)?;
    h.snap_rollback(&name)
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("{}@{name}", h.spec()))?;
    Ok(Value::Bool(true))
}

/// The parameters of every RBD method; each method takes the ones it needs (one
/// struct because serde cannot refuse unknown fields across a flattened one).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RbdParams {
    /// A device: its socket (and `nsid` for an NVMe namespace).
    socket: Option<PathBuf>,
    nsid: Option<u32>,
    /// An image, POOL/IMAGE or POOL/NAMESPACE/IMAGE, with its cluster options.
    image: Option<String>,
    conf: Option<String>,
    id: Option<String>,
    keyring: Option<String>,
    /// Seconds; default 30.
    timeout: Option<u64>,
    /// rbd_create_image: bytes, or a string with a K/M/G/T suffix.
    size: Option<super::params::Rate>,
    snap: Option<String>,
    /// rbd_clone_image: the new image (same cluster).
    clone: Option<String>,
}

impl RbdParams {
    fn spec(&self) -> Result<ImageSpec, RpcError> {
        let Some(image) = &self.image else {
            return Err(RpcError::params("image (POOL/IMAGE) is missing"));
        };
        image.parse().map_err(RpcError::params)
    }
    fn rbd_spec(&self) -> Result<RbdSpec, RpcError> {
        Ok(RbdSpec {
            image: self.spec()?,
            conf: self.conf.clone(),
            id: self.id.clone(),
            keyring: self.keyring.clone(),
            snap: None,
            create: None,
            timeout: self.timeout.map_or(DEFAULT_TIMEOUT, Duration::from_secs),
        })
    }
    fn cluster(&self, server: &Server) -> Result<ClusterOptions, RpcError> {
        let spec = self.rbd_spec()?;
        crate::fs_access::check_paths(crate::kinds::KindSpec::fs_paths(&spec))?;
        Ok(spec.cluster(server.library_cpus()))
    }
    /// A connection for this call, its threads where the server's backends put
    /// librados'.
    fn connect(&self, server: &Server) -> Result<Cluster, RpcError> {
        Ok(Cluster::connect(&self.cluster(server)?).map_err(anyhow::Error::from)?)
    }
    fn snap_name(&self) -> Result<String, RpcError> {
        let Some(snap) = &self.snap else {
            return Err(RpcError::params("snap (a snapshot name) is missing"));
        };
        let ok = !snap.is_empty() && !snap.contains(['/', '@', ',']) && snap.len() <= 255;
        if ok {
            Ok(snap.clone())
        } else {
            Err(RpcError::params(
                "snap must be a non-empty name without '/', '@' or ','",
            ))
        }
    }
}

/// Runs `f` on the image of `t`: the device's own handle, or a handle opened for
/// the call on a detached image.
fn with_image<R>(
    server: &Server,
    t: &RbdParams,
    f: impl FnOnce(&ImageHandle) -> std::io::Result<R>,
) -> Result<R, RpcError> {
    let handle = match (&t.socket, &t.image) {
        (Some(socket), None) => device_image(server, socket, t.nsid)?,
        (None, Some(_)) if t.nsid.is_none() => t
            .connect(server)?
            .open_image(&t.spec()?)
            .map_err(anyhow::Error::from)?,
        _ => {
            return Err(RpcError::params(
                "give either socket (and nsid for an NVMe namespace) or image",
            ))
        }
    };
    let spec = handle.spec().clone();
    Ok(f(&handle).with_context(|| format!("image {spec}"))?)
}

/// The image handle of namespace `nsid` of the controller on `socket` (or of the
/// vhost-user-blk device's disk there).
fn device_image(
    server: &Server,
    socket: &std::path::Path,
    nsid: Option<u32>,
) -> Result<ImageHandle> {
    server.with_qos(socket, nsid, |q| {
        let rbd = bdev::BlockDevice::as_any(q).and_then(|a| a.downcast_ref::<RbdDisk>());
        match rbd {
            Some(d) => Ok(d.handle().clone()),
            None => bail!(
                "{} is not a whole RBD image (a slice or another kind)",
                bdev::BlockDevice::describe(q)
            ),
        }
    })
}

/// Refuses `what` on an image a namespace or device of this server has open.
fn refuse_if_attached(server: &Server, at: &RbdParams, what: &str) -> Result<(), RpcError> {
    let Some(backing) = at.rbd_spec()?.backing()? else {
        return Ok(());
    };
    let users = server.lock().backends.users_of(&backing.resource);
    if users.is_empty() {
        Ok(())
    } else {
        Err(RpcError::new(
            -32000,
            format!(
                "cannot {what} image {}: it is open by {}; remove that first",
                at.image.as_deref().unwrap_or_default(),
                users.join(", ")
            ),
        ))
    }
}
