//! Ceph RBD images through librbd (feature `rbd`).
//!
//! * **One image handle per device**, shared by every channel: two handles on one
//!   image would trade its exclusive lock back and forth on every write. A writable
//!   image's exclusive lock is taken at open and kept, so a second writer (another
//!   udrive, a QEMU) is refused with a clear error instead of slowing both down.
//! * **Completions**: librbd calls back on its own threads; the callback queues
//!   (slot, result) on the submitting channel's lock-free [`ffi::Sink`], which the
//!   channel's `poll()` drains without a syscall, and writes the channel's eventfd
//!   only while its reactor sleeps (`arm_notifier`).
//! * **librbd's threads stay off the reactors**: the cluster connection and the
//!   image are opened with the calling thread's affinity set to
//!   [`RbdOptions::thread_cpus`]; the threads librados/librbd start inherit it.
//! * **One cluster connection per (conf, client, keyring, timeout)** in the
//!   process, shared by its images (each connection costs ~17 threads).
//! * **Timeouts**: `timeout` bounds each OSD and monitor operation
//!   (`rados_osd_op_timeout`, `rados_mon_op_timeout`) and the initial connection
//!   (`client_mount_timeout`). A request that outlives it fails (EIO to the front
//!   end); librados keeps reconnecting, so the device works again once the cluster
//!   is back. An OSD restart shorter than the timeout only pauses requests.
//! * FUA: a write with FUA is followed by a flush before it completes (with
//!   librbd's cache off, as `rbd cache = false` sets, the flush costs nothing).

mod aio;
mod channel;
mod error;
mod ffi;

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::{BlockDevice, BlockInfo, GeometryError, IoChannel};

pub use error::RbdError;
pub use ffi::SnapInfo;
use ffi::{Image, IoCtx, Rados};

/// Default bound on one cluster operation and on connecting.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Where an image is and how to reach its cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClusterOptions {
    /// ceph.conf path; None: librados' default search (/etc/ceph/ceph.conf).
    pub conf: Option<String>,
    /// Client name without `client.` (None: `admin`).
    pub id: Option<String>,
    /// Keyring path; None: what the conf says.
    pub keyring: Option<String>,
    /// Bound on each cluster operation and on connecting; zero: wait forever.
    pub timeout: Duration,
    /// CPUs librados/librbd threads may run on (empty: the caller's own set).
    pub thread_cpus: Vec<usize>,
}

/// An image: `pool[/namespace]/name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ImageSpec {
    pub pool: String,
    pub namespace: Option<String>,
    pub name: String,
}

impl std::fmt::Display for ImageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{}/{}/{}", self.pool, ns, self.name),
            None => write!(f, "{}/{}", self.pool, self.name),
        }
    }
}

impl std::str::FromStr for ImageSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<ImageSpec, String> {
        let parts: Vec<&str> = s.split('/').collect();
        let ok = |p: &&str| !p.is_empty() && !p.contains('@');
        if !parts.iter().all(ok) {
            return Err(format!("{s:?} is not POOL/IMAGE or POOL/NAMESPACE/IMAGE"));
        }
        match parts.as_slice() {
            [pool, name] => Ok(ImageSpec {
                pool: pool.to_string(),
                namespace: None,
                name: name.to_string(),
            }),
            [pool, ns, name] => Ok(ImageSpec {
                pool: pool.to_string(),
                namespace: Some(ns.to_string()),
                name: name.to_string(),
            }),
            _ => Err(format!("{s:?} is not POOL/IMAGE or POOL/NAMESPACE/IMAGE")),
        }
    }
}

/// How to open an [`RbdDisk`].
#[derive(Clone, Debug)]
pub struct RbdOptions {
    pub cluster: ClusterOptions,
    pub image: ImageSpec,
    /// Open this snapshot (read-only).
    pub snap: Option<String>,
    /// Create the image with this size if it does not exist.
    pub create: Option<u64>,
    pub read_only: bool,
    /// 512 (default) or 4096.
    pub block_size: Option<u32>,
    /// Addresses of clients known to be dead (a previous process of this
    /// service, reaped by its supervisor): if one of them still holds the image's
    /// exclusive lock, the lock is broken (librbd blocklists that client first)
    /// instead of waiting ~30 s for its watch to expire.
    pub dead_owners: Vec<String>,
    /// The destination of a live migration: open without the exclusive lock (the
    /// source holds it); [`BlockDevice::resume`] takes it once the source paused.
    pub incoming: bool,
}

/// Whether lock owner `owner` is one of `dead` (addresses as `rados_getaddrs` and
/// `rbd_lock_get_owners` print them: `[v2:IP:PORT/NONCE,v1:…]` or `IP:PORT/NONCE`).
pub fn owner_is_one_of(owner: &str, dead: &[String]) -> bool {
    fn addrs(s: &str) -> Vec<&str> {
        s.trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .map(|a| {
                a.trim()
                    .trim_start_matches("v2:")
                    .trim_start_matches("v1:")
                    .trim_start_matches("any:")
            })
            // A client address without a nonce names no one in particular.
            .filter(|a| a.contains('/') && !a.ends_with("/0"))
            .collect()
    }
    let o = addrs(owner);
    dead.iter().any(|d| addrs(d).iter().any(|a| o.contains(a)))
}

/// A connection to a cluster, shared by every image opened through it.
#[derive(Clone)]
pub struct Cluster {
    rados: Arc<Rados>,
    opts: ClusterOptions,
}

fn clusters() -> &'static Mutex<HashMap<ClusterOptions, Weak<Rados>>> {
    static C: std::sync::OnceLock<Mutex<HashMap<ClusterOptions, Weak<Rados>>>> =
        std::sync::OnceLock::new();
    C.get_or_init(Default::default)
}

impl Cluster {
    /// The process's connection for `opts`, connecting if there is none.
    pub fn connect(opts: &ClusterOptions) -> Result<Cluster, RbdError> {
        let mut map = clusters().lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(rados) = map.get(opts).and_then(Weak::upgrade) {
            return Ok(Cluster {
                rados,
                opts: opts.clone(),
            });
        }
        let mut settings = Vec::new();
        if let Some(k) = &opts.keyring {
            settings.push(("keyring", k.clone()));
        }
        let secs = opts
            .timeout
            .as_secs()
            .max(u64::from(!opts.timeout.is_zero()));
        if secs > 0 {
            for k in [
                "rados_osd_op_timeout",
                "rados_mon_op_timeout",
                "client_mount_timeout",
            ] {
                settings.push((k, secs.to_string()));
            }
        }
        let conf = opts.conf.as_deref();
        let who = format!("client.{}", opts.id.as_deref().unwrap_or("admin"));
        let connect = || Rados::connect(opts.id.as_deref(), conf, &settings);
        let rados = affine(&opts.thread_cpus, connect).map_err(|e| {
            e.hinted(|errno| match errno {
                libc::ENOENT => Some(format!(
                    "no such configuration file, or no keyring for {who}: give conf= and keyring="
                )),
                libc::EACCES | libc::EPERM => Some(format!(
                    "authentication refused for {who}: check id= and keyring="
                )),
                libc::ETIMEDOUT => Some(format!(
                    "no monitor answered within {secs} s: is the cluster up and `mon host` in the conf right?"
                )),
                libc::EINVAL => Some("check the conf file's `mon host`".into()),
                _ => None,
            })
        })?;
        let rados = Arc::new(rados);
        map.insert(opts.clone(), Arc::downgrade(&rados));
        Ok(Cluster {
            rados,
            opts: opts.clone(),
        })
    }

    fn ioctx(&self, spec: &ImageSpec) -> Result<Arc<IoCtx>, RbdError> {
        let io = self
            .rados
            .ioctx(&spec.pool, spec.namespace.as_deref())
            .map_err(|e| {
                e.hinted(|errno| {
                    (errno == libc::ENOENT).then(|| {
                        format!(
                            "pool {:?} does not exist: `ceph osd pool create`",
                            spec.pool
                        )
                    })
                })
            })?;
        Ok(Arc::new(io))
    }

    /// This client's addresses (what a lock it holds is owned by).
    pub fn client_addrs(&self) -> Result<String, RbdError> {
        self.rados.addrs()
    }

    /// A configuration value as this connection sees it.
    pub fn conf_get(&self, option: &str) -> Result<String, RbdError> {
        self.rados.conf_get(option)
    }

    pub fn create_image(&self, spec: &ImageSpec, size: u64) -> Result<(), RbdError> {
        self.ioctx(spec)?
            .create_image(&spec.name, size)
            .map_err(|e| {
                e.hinted(|errno| {
                    (errno == libc::EEXIST).then(|| format!("image {spec} exists already"))
                })
            })
    }

    pub fn remove_image(&self, spec: &ImageSpec) -> Result<(), RbdError> {
        self.ioctx(spec)?.remove_image(&spec.name).map_err(|e| {
            e.hinted(|errno| match errno {
                libc::ENOENT => Some(format!("image {spec} does not exist")),
                libc::EBUSY => Some(format!(
                    "image {spec} is open by a client (or has watchers): detach it first"
                )),
                libc::ENOTEMPTY => Some(format!("image {spec} has snapshots: remove them first")),
                _ => None,
            })
        })
    }

    /// Clones protected snapshot `snap` of `parent` into a new image `child`.
    pub fn clone_image(
        &self,
        parent: &ImageSpec,
        snap: &str,
        child: &ImageSpec,
    ) -> Result<(), RbdError> {
        let p = self.ioctx(parent)?;
        let c = self.ioctx(child)?;
        p.clone_image(&parent.name, snap, &c, &child.name)
            .map_err(|e| {
                e.hinted(|errno| match errno {
                    libc::EINVAL => Some(format!(
                        "{parent}@{snap} must exist and be protected (snapshot_protect)"
                    )),
                    libc::EEXIST => Some(format!("image {child} exists already")),
                    libc::ENOENT => Some(format!("{parent}@{snap} does not exist")),
                    _ => None,
                })
            })
    }

    /// The size of `spec` (or of its snapshot `snap`), opened read-only: no lock
    /// is asked for and nothing is written (`udrive check`).
    pub fn image_size(&self, spec: &ImageSpec, snap: Option<&str>) -> Result<u64, RbdError> {
        let io = self.ioctx(spec)?;
        let image = affine(&self.opts.thread_cpus, || {
            Image::open(&io, &spec.name, snap, true)
        })
        .map_err(|e| open_hint(e, spec))?;
        image.size()
    }

    /// Opens `spec` for control operations (snapshots) while no device has it open.
    pub fn open_image(&self, spec: &ImageSpec) -> Result<ImageHandle, RbdError> {
        let io = self.ioctx(spec)?;
        let image = affine(&self.opts.thread_cpus, || {
            Image::open(&io, &spec.name, None, false)
        })
        .map_err(|e| open_hint(e, spec))?;
        Ok(ImageHandle {
            image: Arc::new(image),
            spec: spec.clone(),
        })
    }
}

/// If the exclusive lock is held and every holder is one of `dead`, breaks it
/// (librbd blocklists the holder first, so it can never write again). Done before
/// asking for the lock: `rbd_lock_acquire` with a dead holder whose watch has not
/// expired yet blocks ~30 s (it asks the holder, which never answers). A holder
/// not known dead is left alone (taking the lock then fails as usual).
fn break_dead_owners(image: &Image, spec: &ImageSpec, dead: &[String]) -> Result<(), RbdError> {
    if dead.is_empty() {
        return Ok(());
    }
    let owners = image.lock_owners()?;
    if owners.is_empty() || !owners.iter().all(|o| owner_is_one_of(o, dead)) {
        return Ok(());
    }
    for o in &owners {
        let t = std::time::Instant::now();
        image.break_lock(o)?;
        tracing::warn!(
            owner = %o,
            ms = t.elapsed().as_millis() as u64,
            "image {spec}: broke the exclusive lock of a dead client (blocklisted)"
        );
    }
    Ok(())
}

fn open_hint(e: RbdError, spec: &ImageSpec) -> RbdError {
    e.hinted(|errno| match errno {
        libc::ENOENT => Some(format!(
            "image {spec} (or the snapshot) does not exist: `rbd create`, or add create=SIZE"
        )),
        libc::EACCES | libc::EPERM => Some("the client's caps do not allow it".into()),
        _ => None,
    })
}

/// Runs `f` with librados/librbd's future threads confined to `cpus`.
fn affine<T>(cpus: &[usize], f: impl FnOnce() -> Result<T, RbdError>) -> Result<T, RbdError> {
    if cpus.is_empty() {
        f()
    } else {
        ffi::with_affinity(cpus, f)?
    }
}

/// Control operations on an open image: snapshots, resize. A device's own handle
/// ([`RbdDisk::handle`]), or one opened with [`Cluster::open_image`].
#[derive(Clone)]
pub struct ImageHandle {
    image: Arc<Image>,
    spec: ImageSpec,
}

/// Its operations return [`io::Error`] (carrying an [`RbdError`]), as the control
/// paths that run them on any device's handle expect.
impl ImageHandle {
    pub fn spec(&self) -> &ImageSpec {
        &self.spec
    }
    pub fn size(&self) -> io::Result<u64> {
        Ok(self.image.size()?)
    }
    pub fn snap_create(&self, name: &str) -> io::Result<()> {
        Ok(self.image.snap_create(name)?)
    }
    pub fn snap_list(&self) -> io::Result<Vec<SnapInfo>> {
        Ok(self.image.snap_list()?)
    }
    /// Removes a snapshot (unprotecting it first if it is protected).
    pub fn snap_remove(&self, name: &str) -> io::Result<()> {
        let protected = self
            .image
            .snap_list()?
            .iter()
            .any(|s| s.name == name && s.protected);
        if protected {
            self.image.snap_unprotect(name).map_err(|e| {
                e.hinted(|errno| {
                    (errno == libc::EBUSY).then(|| "clones of it still exist".to_string())
                })
            })?;
        }
        Ok(self.image.snap_remove(name)?)
    }
    pub fn snap_rollback(&self, name: &str) -> io::Result<()> {
        Ok(self.image.snap_rollback(name)?)
    }
    pub fn snap_protect(&self, name: &str) -> io::Result<()> {
        Ok(self.image.snap_protect(name)?)
    }
}

/// An RBD image as a block device.
pub struct RbdDisk {
    info: BlockInfo,
    handle: ImageHandle,
    snap: Option<String>,
    _cluster: Cluster,
}

impl RbdDisk {
    pub fn open(opts: &RbdOptions) -> Result<RbdDisk, RbdError> {
        let cluster = Cluster::connect(&opts.cluster)?;
        let spec = &opts.image;
        let io = cluster.ioctx(spec)?;
        let read_only = opts.read_only || opts.snap.is_some();
        let open = || Image::open(&io, &spec.name, opts.snap.as_deref(), read_only);
        let image = match (affine(&opts.cluster.thread_cpus, open), opts.create) {
            (Err(e), Some(size)) if e.errno() == Some(libc::ENOENT) && opts.snap.is_none() => {
                cluster.create_image(spec, size)?;
                tracing::info!("created RBD image {spec} ({size} bytes)");
                affine(&opts.cluster.thread_cpus, open)
            }
            (r, _) => r,
        }
        .map_err(|e| open_hint(e, spec))?;
        const EXCLUSIVE_LOCK: u64 = 1 << 2;
        let locks = !read_only && image.features()? & EXCLUSIVE_LOCK != 0;
        if locks && opts.incoming {
            // Taken by `resume`, as after a `pause`.
            image.set_released(true);
        } else if locks {
            break_dead_owners(&image, spec, &opts.dead_owners)?;
            image.lock_exclusive().map_err(|e| {
                e.hinted(|errno| match errno {
                    libc::EBUSY | libc::EROFS | libc::EAGAIN => Some(format!(
                        "image {spec} is in use by another client, which holds its exclusive \
                         lock (`rbd status {spec}` names it); detach it there first"
                    )),
                    _ => None,
                })
            })?;
        }
        let size = image.size()?;
        let bs = opts.block_size.unwrap_or(512);
        GeometryError::check_block_size(bs).map_err(|source| RbdError::Geometry {
            image: spec.to_string(),
            source,
        })?;
        if size < u64::from(bs) {
            return Err(RbdError::TooSmall {
                image: spec.to_string(),
                size,
                block_size: bs,
            });
        }
        if size % u64::from(bs) != 0 {
            tracing::warn!(
                "image {spec} is {size} bytes, not a multiple of {bs}: the last {} bytes are not served",
                size % u64::from(bs)
            );
        }
        let write_cache = cluster.conf_get("rbd_cache").is_ok_and(|v| v == "true");
        Ok(RbdDisk {
            info: BlockInfo {
                block_size: bs,
                num_blocks: size / u64::from(bs),
                volatile: false,
                write_cache,
                read_only,
                discard: !read_only,
                write_zeroes: !read_only,
                // Discards smaller than librbd's discard granularity are skipped.
                discard_zeroes: false,
            },
            handle: ImageHandle {
                image: Arc::new(image),
                spec: spec.clone(),
            },
            snap: opts.snap.clone(),
            _cluster: cluster,
        })
    }

    /// The device's image handle, for snapshots and other control operations.
    pub fn handle(&self) -> &ImageHandle {
        &self.handle
    }
}

impl BlockDevice for RbdDisk {
    fn describe(&self) -> String {
        let snap = self
            .snap
            .as_ref()
            .map(|s| format!("@{s}"))
            .unwrap_or_default();
        let ro = if self.info.read_only { ",ro" } else { "" };
        format!("rbd:{}{snap}{ro}", self.handle.spec)
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(channel::RbdChannel::new(
            self.handle.image.clone(),
            &self.info,
        )?))
    }
    /// Resizes the image to `bytes` (`rbd_resize2`; shrinking discards the data
    /// beyond, like a file's truncate: front ends ask for a shrink explicitly).
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(self.resized(bytes)?))
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    /// Releases the exclusive lock (librbd flushes first) so that a successor can
    /// take it; writes fail until [`BlockDevice::resume`].
    fn pause(&self) -> io::Result<()> {
        self.handle
            .image
            .unlock()
            .map_err(|e| self.context(e).into())
    }
    /// Takes the lock back; if a dead successor (one of `dead_owners`) holds it,
    /// breaks it first (librbd blocklists that client).
    fn resume(&self, dead_owners: &[String]) -> io::Result<()> {
        let image = &self.handle.image;
        if !image.was_released() {
            return Ok(());
        }
        break_dead_owners(image, &self.handle.spec, dead_owners)
            .and_then(|()| image.lock_exclusive())
            .map_err(|e| self.context(e))?;
        image.set_released(false);
        Ok(())
    }
}

impl RbdDisk {
    /// [`BlockDevice::resize`], typed: resizes the image to `bytes` (`rbd_resize2`;
    /// shrinking discards the data beyond, like a file's truncate: front ends ask
    /// for a shrink explicitly).
    fn resized(&self, bytes: u64) -> Result<RbdDisk, RbdError> {
        let info = self
            .info
            .resized(bytes)
            .map_err(|source| RbdError::Geometry {
                image: self.handle.spec.to_string(),
                source,
            })?;
        if self.info.read_only {
            return Err(RbdError::ReadOnly {
                device: self.describe(),
            });
        }
        if bytes != self.handle.image.size()? {
            self.handle.image.resize(bytes, true)?;
        }
        Ok(RbdDisk {
            info,
            handle: self.handle.clone(),
            snap: self.snap.clone(),
            _cluster: self._cluster.clone(),
        })
    }

    /// `e`, with this device named.
    fn context(&self, e: RbdError) -> RbdError {
        RbdError::Device {
            device: self.describe(),
            source: Box::new(e),
        }
    }
}

impl Drop for RbdDisk {
    fn drop(&mut self) {
        // Writes librbd may still cache reach the cluster before the lock goes.
        if Arc::strong_count(&self.handle.image) == 1
            && !self.info.read_only
            && !self.handle.image.was_released()
        {
            if let Err(e) = self.handle.image.flush() {
                tracing::warn!("flushing {} on close: {e}", self.handle.spec);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_specs_parse_and_print() {
        let s: ImageSpec = "rbd/vm1".parse().unwrap();
        assert_eq!(
            (s.pool.as_str(), s.namespace.as_deref(), s.name.as_str()),
            ("rbd", None, "vm1")
        );
        assert_eq!(s.to_string(), "rbd/vm1");
        let s: ImageSpec = "rbd/tenant-a/vm1".parse().unwrap();
        assert_eq!(s.namespace.as_deref(), Some("tenant-a"));
        assert_eq!(s.to_string(), "rbd/tenant-a/vm1");
        for bad in [
            "",
            "rbd",
            "rbd/",
            "/img",
            "a/b/c/d",
            "rbd/img@snap",
            "rbd//img",
        ] {
            assert!(bad.parse::<ImageSpec>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lock_owners_match_recorded_addresses() {
        let dead = vec!["[v2:127.0.0.1:0/3417622045,v1:127.0.0.1:0/3417622045]".to_string()];
        assert!(owner_is_one_of("127.0.0.1:0/3417622045", &dead));
        assert!(!owner_is_one_of("127.0.0.1:0/3417622046", &dead));
        assert!(owner_is_one_of("127.0.0.1:0/7", &["127.0.0.1:0/7".into()]));
        assert!(!owner_is_one_of("127.0.0.1:0/0", &["127.0.0.1:0/0".into()]));
        assert!(!owner_is_one_of("", &dead));
        assert!(!owner_is_one_of("127.0.0.1:0/3417622045", &[]));
    }
}
