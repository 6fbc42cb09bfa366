//! `rbd:POOL/IMAGE` or `rbd:POOL/NAMESPACE/IMAGE` — a Ceph RBD image through
//! librbd (feature `rbd`). Options: `conf=PATH` (ceph.conf; default
//! /etc/ceph/ceph.conf), `id=NAME` (client name without `client.`, default
//! admin), `keyring=PATH`, `snap=NAME` (a snapshot, read-only), `create=SIZE`
//! (create the image if it is missing), `timeout=SECS` (bound on each cluster
//! operation and on connecting, default 30, 0 = wait forever), and `ro`.
//!
//! Namespaces on the same image share one opened image (one exclusive lock), so
//! slices of an image work as they do for files.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bdev::rbd::{ClusterOptions, ImageSpec, RbdDisk, RbdOptions, DEFAULT_TIMEOUT};
use bdev::BlockDevice;

use super::kind::{BackendKind, Backing, KindSpec, OpenEnv};

pub struct Rbd;

/// Where librados looks for its configuration when `conf=` is not given: $CEPH_CONF,
/// /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf.
fn default_conf_search() -> Vec<String> {
    let mut v: Vec<String> = std::env::var("CEPH_CONF").into_iter().collect();
    v.push("/etc/ceph/ceph.conf".into());
    if let Ok(home) = std::env::var("HOME") {
        v.push(format!("{home}/.ceph/config"));
    }
    v.push("ceph.conf".into());
    v
}

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

/// The longest `udrive check` waits for a cluster.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Where librados' and librbd's threads run: `explicit` (`--rbd-cpus`), or else the
/// process's allowed CPUs minus the reactors' (`reactors`), so that a polling
/// reactor and librbd do not share a CPU; no restriction when that leaves none (a
/// one-CPU process). `serve` hands the result to the process's open environment.
pub fn thread_cpus(reactors: &[usize], explicit: Option<&[usize]>) -> Vec<usize> {
    match explicit {
        Some(cpus) => cpus.to_vec(),
        None => engine::allowed_cpus()
            .into_iter()
            .filter(|c| !reactors.contains(c))
            .collect(),
    }
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
                    spec.create = Some(
                        super::kind::parse_sized(v, None)
                            .map_err(|e| format!("create={v}: {e}"))?,
                    );
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

/// Records the client address of `c` with whoever outlives this process (a
/// supervisor, or the process it takes over from), before a claim is taken with it.
fn record_client(env: &dyn OpenEnv, c: &bdev::rbd::Cluster) {
    match c.client_addrs() {
        Ok(a) if !a.is_empty() => env.record_owner(&a),
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot read our Ceph client address: {e}"),
    }
}

impl RbdSpec {
    /// How to reach the cluster; librados' threads run on `thread_cpus`.
    pub fn cluster(&self, thread_cpus: Vec<usize>) -> ClusterOptions {
        ClusterOptions {
            conf: self.conf.clone(),
            id: self.id.clone(),
            keyring: self.keyring.clone(),
            timeout: self.timeout,
            thread_cpus,
        }
    }
}

impl KindSpec for RbdSpec {
    /// Read-only: the configuration's directory (the keyring usually lies next
    /// to it, as in /etc/ceph), and the configuration and keyring named.
    fn fs_paths(&self) -> Vec<(std::path::PathBuf, bool)> {
        let confs = match &self.conf {
            Some(c) => vec![c.clone()],
            None => default_conf_search(),
        };
        let dirs = confs
            .into_iter()
            .map(|c| super::kind::dir_of(std::path::Path::new(&c)));
        let named = [&self.conf, &self.keyring].into_iter().flatten();
        dirs.chain(named.map(std::path::PathBuf::from))
            .map(|p| (p, false))
            .collect()
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
    /// The files librados reads; the cluster itself is not contacted (a check
    /// must not wait on a monitor, nor take an image's lock).
    fn check(&self, _read_only: bool, problems: &mut Vec<String>) -> Option<u64> {
        let readable = |p: &str| std::fs::File::open(p).map(drop);
        match &self.conf {
            Some(c) => {
                if let Err(e) = readable(c) {
                    problems.push(format!("cannot read the Ceph configuration {c}: {e}"));
                }
            }
            None => {
                let search = default_conf_search();
                if !search.iter().any(|p| readable(p).is_ok()) {
                    problems.push(format!(
                        "{}: no readable Ceph configuration (librados looks at {}); give conf=PATH",
                        self.image,
                        search.join(", ")
                    ));
                }
            }
        }
        if let Some(Err(e)) = self.keyring.as_deref().map(readable) {
            let k = self.keyring.as_deref().unwrap_or_default();
            problems.push(format!("cannot read the keyring {k}: {e}"));
        }
        None
    }
    /// Connects as the device would (bounded by `timeout=`, at most
    /// [`CHECK_TIMEOUT`]) and opens the image read-only: no lock is asked for.
    /// An image `create=` would make is fine when it is missing.
    fn reach(&self) -> Result<Option<u64>> {
        let mut opts = self.cluster(Vec::new());
        if opts.timeout.is_zero() || opts.timeout > CHECK_TIMEOUT {
            opts.timeout = CHECK_TIMEOUT;
        }
        let cluster = bdev::rbd::Cluster::connect(&opts)
            .with_context(|| format!("Ceph cluster of {}", self.image))?;
        match cluster.image_size(&self.image, self.snap.as_deref()) {
            Ok(size) => Ok(Some(size)),
            Err(e) if self.create.is_some() && e.errno() == Some(libc::ENOENT) => Ok(self.create),
            Err(e) => Err(anyhow::Error::new(e).context(format!("image {}", self.image))),
        }
    }
    fn open(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
        read_only: bool,
    ) -> Result<Arc<dyn BlockDevice>> {
        self.open_with(env, block_size, read_only, false)
    }
    /// Opens the image without its exclusive lock, which the source holds: the
    /// device takes it ([`KindSpec::writer_claim`]) when the VM starts here.
    fn open_incoming(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
    ) -> Result<Arc<dyn BlockDevice>> {
        self.open_with(env, block_size, false, true)
    }
    /// The image's exclusive lock, which the device keeps while it writes.
    fn writer_claim(
        &self,
        disk: &Arc<dyn BlockDevice>,
        _range: (u64, u64),
    ) -> Result<Option<Arc<dyn bdev::WriterClaim>>> {
        Ok(Some(Arc::new(bdev::DiskClaim(disk.clone()))))
    }
}

impl RbdSpec {
    fn open_with(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
        read_only: bool,
        incoming: bool,
    ) -> Result<Arc<dyn BlockDevice>> {
        let cluster = self.cluster(env.library_cpus());
        // Under a supervisor, or taking over from a running process: our client's
        // address is recorded with the supervisor (our successor's) or sent to
        // the old process before we may take any lock with it, so that whoever
        // outlives us knows whose locks it may break once we are dead.
        let _connection = if env.records_owners() && !read_only {
            let c = bdev::rbd::Cluster::connect(&cluster)
                .with_context(|| format!("rbd:{}", self.image))?;
            record_client(env, &c);
            Some(c)
        } else {
            None
        };
        let opts = RbdOptions {
            cluster,
            image: self.image.clone(),
            snap: self.snap.clone(),
            create: self.create,
            read_only,
            block_size,
            dead_owners: env.dead_owners(),
            incoming,
        };
        let disk = RbdDisk::open(&opts).with_context(|| format!("rbd:{}", self.image))?;
        Ok(Arc::new(disk))
    }
}
