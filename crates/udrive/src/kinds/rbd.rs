//! `rbd:POOL/IMAGE` or `rbd:POOL/NAMESPACE/IMAGE` — a Ceph RBD image through
//! librbd (feature `rbd`). Options: `conf=PATH` (ceph.conf; default
//! /etc/ceph/ceph.conf), `id=NAME` (client name without `client.`, default
//! admin), `keyring=PATH`, `snap=NAME` (a snapshot, read-only), `create=SIZE`
//! (create the image if it is missing), `timeout=SECS` (bound on each cluster
//! operation and on connecting, default 30, 0 = wait forever), and `ro`.
//!
//! Namespaces on the same image share one opened image (one exclusive lock), so
//! slices of an image work as they do for files.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use bdev::rbd::{ClusterOptions, ImageSpec, RbdDisk, RbdOptions, DEFAULT_TIMEOUT};
use bdev::BlockDevice;

use super::{BackendKind, Backing, KindSpec};

pub struct Rbd;

#[derive(Clone, Debug)]
pub struct RbdSpec {
    pub image: ImageSpec,
    pub conf: Option<String>,
    pub id: Option<String>,
    pub keyring: Option<String>,
    pub snap: Option<String>,
    pub create: Option<u64>,
    pub timeout: Duration,
}

/// CPUs the reactors run on: librbd's threads are kept off them (set by `serve`
/// before it opens backends).
static REACTOR_CPUS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Records the reactors' CPUs so that RBD images opened later keep librados'
/// and librbd's threads on the others.
pub fn set_reactor_cpus(cpus: &[usize]) {
    *REACTOR_CPUS.lock().unwrap_or_else(|p| p.into_inner()) = cpus.to_vec();
}

/// The process's allowed CPUs minus the reactors'; empty (no restriction) when
/// that leaves none, e.g. a one-CPU process.
fn thread_cpus() -> Vec<usize> {
    let reactors = REACTOR_CPUS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    engine::allowed_cpus()
        .into_iter()
        .filter(|c| !reactors.contains(c))
        .collect()
}

impl BackendKind for Rbd {
    fn name(&self) -> &'static str {
        "rbd"
    }
    fn example(&self) -> &'static str {
        "rbd:rbd/vm1,conf=/etc/ceph/ceph.conf"
    }
    fn options(&self) -> &'static [&'static str] {
        &["conf", "id", "keyring", "snap", "create", "timeout"]
    }
    fn read_only_ok(&self) -> bool {
        true
    }
    fn parse(
        &self,
        arg: &str,
        opts: &[(&str, &str)],
        _block_size: Option<u32>,
    ) -> Result<Arc<dyn KindSpec>, String> {
        let mut spec = RbdSpec {
            image: arg.parse()?,
            conf: None,
            id: None,
            keyring: None,
            snap: None,
            create: None,
            timeout: DEFAULT_TIMEOUT,
        };
        let nonempty = |k: &str, v: &str| {
            if v.is_empty() {
                Err(format!("{k}= needs a value"))
            } else {
                Ok(Some(v.to_string()))
            }
        };
        for &(k, v) in opts {
            match k {
                "conf" => spec.conf = nonempty(k, v)?,
                "id" => spec.id = nonempty(k, v)?.map(|s| s.trim_start_matches("client.").into()),
                "keyring" => spec.keyring = nonempty(k, v)?,
                "snap" => spec.snap = nonempty(k, v)?,
                "create" => {
                    spec.create =
                        Some(super::parse_sized(v, None).map_err(|e| format!("create={v}: {e}"))?);
                }
                "timeout" => {
                    let secs: u64 = v
                        .parse()
                        .map_err(|_| format!("timeout={v}: a number of seconds"))?;
                    spec.timeout = Duration::from_secs(secs);
                }
                _ => {}
            }
        }
        if spec.snap.is_some() && spec.create.is_some() {
            return Err("snap= and create= exclude each other".into());
        }
        Ok(Arc::new(spec))
    }
}

impl RbdSpec {
    pub fn cluster(&self) -> ClusterOptions {
        ClusterOptions {
            conf: self.conf.clone(),
            id: self.id.clone(),
            keyring: self.keyring.clone(),
            timeout: self.timeout,
            thread_cpus: thread_cpus(),
        }
    }
}

impl KindSpec for RbdSpec {
    fn handover_refusal(&self) -> Option<&'static str> {
        Some("an RBD image's exclusive lock is not handed over yet")
    }
    fn canonical(&self) -> Option<String> {
        None
    }
    fn backing(&self) -> Result<Option<Backing>> {
        let conf = match &self.conf {
            Some(c) => std::fs::canonicalize(c)
                .with_context(|| format!("Ceph configuration {c} does not exist"))?
                .display()
                .to_string(),
            None => String::new(),
        };
        let resource = format!("rbd:{conf}\0{}", self.image);
        Ok(Some(Backing {
            open_key: format!("{resource}\0{:?}", (&self.snap, &self.id, &self.keyring)),
            resource,
        }))
    }
    fn open(&self, block_size: Option<u32>, read_only: bool) -> Result<Arc<dyn BlockDevice>> {
        let opts = RbdOptions {
            cluster: self.cluster(),
            image: self.image.clone(),
            snap: self.snap.clone(),
            create: self.create,
            read_only,
            block_size,
        };
        let disk = RbdDisk::open(&opts).with_context(|| format!("rbd:{}", self.image))?;
        Ok(Arc::new(disk))
    }
}
