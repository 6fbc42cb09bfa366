//! Live snapshots and block jobs of qcow2 disks (docs/rpc.md, decision 0041):
//! `qcow2_snapshot_create`, `block_stream`, `block_commit`, `blockdev_mirror`,
//! and the job
//! controls `get_jobs`, `job_pause`, `job_resume`, `job_cancel`, `job_set_rate`.
//! A disk is named as for `set_qos`: `socket`, plus `nsid` for an NVMe
//! namespace.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{parse_params, Registry, Rpc, RpcError};
use super::params::{Empty, Rate};
use crate::jobs::{self, JobRequest};

pub fn register(r: &mut Registry) {
    r.register(
        "qcow2_snapshot_create",
        "live external snapshot: the disk goes on in a new qcow2 image at `path` over its current one",
        snapshot_create,
    );
    r.register(
        "block_stream",
        "background job: copy the backing chain's data into the disk's qcow2 image, then drop the link",
        |rpc, p| start(rpc, p, JobRequest::Stream),
    );
    r.register(
        "block_commit",
        "background job: copy the disk's qcow2 image into its base, then serve the base",
        |rpc, p| start(rpc, p, JobRequest::Commit),
    );
    r.register(
        "blockdev_mirror",
        "background job: copy the disk as the guest sees it into a new qcow2 image at `path` (then serve it if `pivot`), or into the NBD export `target` on another host (then follow the guest until job_complete)",
        mirror,
    );
    r.register(
        "get_jobs",
        "block jobs, running and recently ended",
        get_jobs,
    );
    r.register("job_pause", "pause a block job", |rpc, p| {
        control(rpc, p, Some(true), false)
    });
    r.register("job_resume", "resume a paused block job", |rpc, p| {
        control(rpc, p, Some(false), false)
    });
    r.register("job_cancel", "cancel a block job", |rpc, p| {
        control(rpc, p, None, true)
    });
    r.register(
        "job_complete",
        "end a ready mirror to another host: flush its target and stop writing through",
        complete,
    );
    r.register(
        "job_set_rate",
        "change a block job's rate limit (bytes/s; 0 lifts it)",
        set_rate,
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Snapshot {
    socket: PathBuf,
    nsid: Option<u32>,
    /// The new image (must not exist).
    path: PathBuf,
}

fn snapshot_create(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: Snapshot = parse_params(p)?;
    Ok(jobs::snapshot(&rpc.server, &a.socket, a.nsid, &a.path)?)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Start {
    socket: PathBuf,
    nsid: Option<u32>,
    /// Bytes/s (or "100M"); absent or 0: unlimited.
    rate: Option<Rate>,
}

fn rate(r: &Option<Rate>) -> Result<u64, RpcError> {
    match r {
        Some(r) => Ok(r.value("rate")?.unwrap_or(0)),
        None => Ok(0),
    }
}

fn start(rpc: &Rpc, p: Value, what: JobRequest<'_>) -> Result<Value, RpcError> {
    let a: Start = parse_params(p)?;
    let id = jobs::start(&rpc.server, &a.socket, a.nsid, what, rate(&a.rate)?)?;
    Ok(json!({"job": id}))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Mirror {
    socket: PathBuf,
    nsid: Option<u32>,
    /// The new image (must not exist) ...
    path: Option<PathBuf>,
    /// ... or an NBD export on another host (`nbd://HOST[:PORT]/NAME`,
    /// `nbd+unix:///NAME?socket=PATH`).
    target: Option<String>,
    #[serde(default)]
    pivot: bool,
    rate: Option<Rate>,
}

fn mirror(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: Mirror = parse_params(p)?;
    let what = match (&a.path, &a.target) {
        (Some(path), None) => JobRequest::Mirror {
            target: path,
            pivot: a.pivot,
        },
        (None, Some(uri)) if !a.pivot => JobRequest::MirrorTo { uri },
        (None, Some(_)) => {
            return Err(anyhow::anyhow!(
                "`pivot` is for a mirror into a local image: a disk does not go on in \
                 another host's export (the VM moves there, and its udrive serves it)"
            )
            .into())
        }
        _ => {
            return Err(anyhow::anyhow!(
                "name either `path` (a new local image) or `target` (an NBD export), not both"
            )
            .into())
        }
    };
    let id = jobs::start(&rpc.server, &a.socket, a.nsid, what, rate(&a.rate)?)?;
    Ok(json!({"job": id}))
}

fn get_jobs(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let Empty {} = parse_params(p)?;
    Ok(rpc.server.lock().jobs.json())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JobId {
    id: u64,
}

fn control(rpc: &Rpc, p: Value, pause: Option<bool>, cancel: bool) -> Result<Value, RpcError> {
    let a: JobId = parse_params(p)?;
    let job = rpc.server.lock().jobs.get(a.id)?;
    job.request(pause, cancel)?;
    Ok(job.json())
}

fn complete(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: JobId = parse_params(p)?;
    let job = rpc.server.lock().jobs.get(a.id)?;
    job.complete()?;
    Ok(job.json())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetRate {
    id: u64,
    rate: Rate,
}

fn set_rate(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: SetRate = parse_params(p)?;
    let rate = a.rate.value("rate")?.unwrap_or(0);
    let job = rpc.server.lock().jobs.get(a.id)?;
    job.set_rate(rate);
    Ok(job.json())
}
