//! Opens every namespace's backend before any socket exists, so configuration
//! mistakes (missing file, slice past the end, overlapping slices) stop start-up
//! cleanly. Namespaces on the same backing (a file) share one opened device; the
//! kind itself (`crate::kinds`) says what its backing is and how it opens.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bdev::{BlockDevice, FaultDisk, QosDisk, SliceDisk};

use crate::config::ControllerConfig;
use crate::kinds::{NoEnv, OpenEnv};
use crate::nsspec::NsSpec;

/// Backends per controller, in namespace order. Every namespace is wrapped in a
/// [`QosDisk`] (pass-through while it has no limits) so `set_qos` can limit it later.
pub type Backends = Vec<Vec<Arc<QosDisk>>>;

/// One namespace's use of a shared backing.
struct BackingUse {
    /// What the data is kept in (`kinds::Backing::resource`).
    resource: String,
    /// Which opened device it uses.
    open_key: String,
    range: (u64, u64),
    writable: bool,
    shared: bool,
    /// A vhost-user-blk disk: its device writes only while it holds the range's
    /// writer claim.
    claims: bool,
    /// ... and receives a migrating VM (opened without the writer's claim).
    incoming: bool,
    /// Sees the backing's LUKS payload (its range is in payload bytes).
    encrypted: bool,
    who: String,
    /// (controller socket, nsid): what `release` matches.
    owner: (PathBuf, u32),
}

/// The backends a running server has open: files shared between namespaces are
/// opened once, and a new namespace is checked against the ranges already in use.
pub struct BackendSet {
    opened: HashMap<String, Arc<dyn BlockDevice>>,
    uses: Vec<BackingUse>,
    /// What backends open with besides their spec (the process's).
    env: Arc<dyn OpenEnv>,
}

/// A set for a one-off open (tests, tools): no supervisor, no predecessor.
impl Default for BackendSet {
    fn default() -> BackendSet {
        BackendSet::new(Arc::new(NoEnv))
    }
}

impl BackendSet {
    pub fn new(env: Arc<dyn OpenEnv>) -> BackendSet {
        BackendSet {
            opened: HashMap::new(),
            uses: Vec::new(),
            env,
        }
    }

    /// Opens namespace `nsid` of the controller on `socket`. Nothing is kept on error.
    pub fn open(&mut self, ns: &NsSpec, socket: &Path, nsid: u32) -> Result<Arc<QosDisk>> {
        let who = namespace_who(ns, socket, nsid)?;
        let owner = (socket.to_path_buf(), nsid);
        self.open_one(ns, &who, owner, false)
            .with_context(|| who.clone())
    }

    /// What [`BackendSet::open`] would refuse in namespace `nsid` of `socket` on a
    /// backend of `total` bytes, found without opening it (`udrive check`); the
    /// namespace's range counts against the next ones.
    pub fn check_namespace(
        &mut self,
        ns: &NsSpec,
        socket: &Path,
        nsid: u32,
        total: u64,
    ) -> Result<()> {
        let who = namespace_who(ns, socket, nsid)?;
        self.check_one(ns, &who, (socket.to_path_buf(), nsid), false, total)
            .with_context(|| who.clone())
    }

    /// [`BackendSet::check_namespace`] for the disk of a vhost-user-blk device.
    pub fn check_disk(&mut self, ns: &NsSpec, socket: &Path, total: u64) -> Result<()> {
        let who = disk_who(ns, socket);
        self.check_one(ns, &who, (socket.to_path_buf(), 1), true, total)
            .with_context(|| who.clone())
    }

    fn check_one(
        &mut self,
        ns: &NsSpec,
        who: &str,
        owner: (PathBuf, u32),
        claims: bool,
        total: u64,
    ) -> Result<()> {
        match ns.kind.0.backing()? {
            None => slice_range(ns, total).map(drop),
            Some(b) => {
                let key = open_key(&b, ns);
                let u = new_use(&self.uses, ns, (b, key), total, who, owner, claims)?;
                self.uses.push(u);
                Ok(())
            }
        }
    }

    /// Opens the disk of the vhost-user-blk device on `socket` (its "namespace
    /// 1"). Its device writes only while it holds the writer claim of its range
    /// (`KindSpec::writer_claim`), so an `incoming` disk may share the range of
    /// another device's.
    pub fn open_disk(&mut self, ns: &NsSpec, socket: &Path) -> Result<Arc<QosDisk>> {
        let who = disk_who(ns, socket);
        self.open_one(ns, &who, (socket.to_path_buf(), 1), true)
            .with_context(|| who.clone())
    }

    /// Forgets namespace `nsid` of `socket` (its file range is free again).
    pub fn release(&mut self, socket: &Path, nsid: u32) {
        self.uses
            .retain(|u| !(u.owner.0 == socket && u.owner.1 == nsid));
        let uses = &self.uses;
        self.opened
            .retain(|key, _| uses.iter().any(|u| &u.open_key == key));
    }

    /// Who uses backing `resource` (`kinds::Backing::resource`), for refusals.
    pub fn users_of(&self, resource: &str) -> Vec<String> {
        self.uses
            .iter()
            .filter(|u| u.resource == resource)
            .map(|u| u.who.clone())
            .collect()
    }

    /// Namespace `nsid` of `socket` (a whole backend: slices keep their size) now
    /// has `bytes` bytes: its range for overlap checks follows, and its opened
    /// device is no longer handed to new namespaces (they open the backend anew,
    /// at its new size).
    pub fn resized(&mut self, socket: &Path, nsid: u32, bytes: u64) {
        let mut keys = Vec::new();
        for u in self
            .uses
            .iter_mut()
            .filter(|u| u.owner.0 == socket && u.owner.1 == nsid)
        {
            u.range = (u.range.0, bytes);
            keys.push(u.open_key.clone());
        }
        for k in keys {
            self.opened.remove(&k);
        }
    }

    /// Forgets every namespace of `socket`.
    pub fn release_all(&mut self, socket: &Path) {
        let ids: Vec<u32> = self
            .uses
            .iter()
            .filter(|u| u.owner.0 == socket)
            .map(|u| u.owner.1)
            .collect();
        for id in ids {
            self.release(socket, id);
        }
    }

    fn open_one(
        &mut self,
        ns: &NsSpec,
        who: &str,
        owner: (PathBuf, u32),
        claims: bool,
    ) -> Result<Arc<QosDisk>> {
        let kind = &ns.kind.0;
        let mut new_use_of = None;
        // An encrypted backend is its LUKS payload from here on: slices, overlap
        // checks and sharing are in payload bytes.
        let open = |env: &dyn OpenEnv| -> Result<Arc<dyn BlockDevice>> {
            let dev = match ns.incoming && !ns.read_only {
                true => kind.open_incoming(env, ns.block_size)?,
                false => kind.open(env, ns.block_size, ns.read_only)?,
            };
            Ok(match &ns.encrypt {
                Some(e) => Arc::new(e.open(dev, env)?),
                None => dev,
            })
        };
        let base = match kind.backing()? {
            None => open(&*self.env)?,
            Some(b) => {
                let open_key = open_key(&b, ns);
                let disk = match self.opened.get(&open_key) {
                    Some(d) => d.clone(),
                    None => open(&*self.env)?,
                };
                let total = disk.info().size_bytes();
                let u = new_use(&self.uses, ns, (b, open_key), total, who, owner, claims)?;
                new_use_of = Some((disk.clone(), u));
                disk
            }
        };
        let mut dev = base;
        // A `shared` namespace is a window on a file others may use, whatever its
        // bounds: as a slice it refuses Format NVM (bdev::FormatSupport::Shared).
        if ns.slice.is_some() || ns.shared {
            let (off, len) = slice_range(ns, dev.info().size_bytes())?;
            dev = Arc::new(SliceDisk::new(dev, off, len)?);
        }
        if let Some(f) = &ns.fault {
            let cfg = f.config(dev.info().block_size);
            dev = Arc::new(FaultDisk::new(dev, cfg)?);
        }
        let dev = Arc::new(QosDisk::new(dev, ns.qos)?);
        if let Some((disk, u)) = new_use_of {
            self.opened.entry(u.open_key.clone()).or_insert(disk);
            self.uses.push(u);
        }
        Ok(dev)
    }
}

/// Opens every namespace of `controllers` on their own (tests, tools).
pub fn open_all(controllers: &[ControllerConfig]) -> Result<Backends> {
    Ok(open_all_set(Arc::new(NoEnv), controllers, &[])?.1)
}

/// NVMe namespaces plus vhost-user-blk disks (`(socket, spec)`), opened together so
/// that a file is opened once and overlapping slices are caught across both kinds.
/// Also returns the set to open more namespaces against at run time.
pub fn open_all_set(
    env: Arc<dyn OpenEnv>,
    controllers: &[ControllerConfig],
    disks: &[(PathBuf, &NsSpec)],
) -> Result<(BackendSet, Backends, Vec<Arc<QosDisk>>)> {
    let mut set = BackendSet::new(env);
    let mut out = Vec::new();
    for c in controllers {
        let mut devs = Vec::new();
        for (i, ns) in c.namespaces.iter().enumerate() {
            devs.push(set.open(ns, &c.socket, c.nsid(i))?);
        }
        out.push(devs);
    }
    let mut disk_devs = Vec::new();
    for (socket, spec) in disks {
        disk_devs.push(set.open_disk(spec, socket)?);
    }
    Ok((set, out, disk_devs))
}

fn namespace_who(ns: &NsSpec, socket: &Path, nsid: u32) -> Result<String> {
    let who = format!("namespace {nsid} ({ns}) of {}", socket.display());
    if ns.incoming {
        bail!("{who}: `incoming` is for vhost-user-blk disks (NVMe over vfio-user has no live migration)");
    }
    Ok(who)
}

fn disk_who(ns: &NsSpec, socket: &Path) -> String {
    format!("disk {ns} of {}", socket.display())
}

/// Which opened device `ns` on backing `b` uses: the block size, read-only and
/// incoming flags are part of how a device opens.
fn open_key(b: &crate::kinds::Backing, ns: &NsSpec) -> String {
    format!(
        "{}\0{:?}\0{}\0{}\0{:?}",
        b.open_key, ns.block_size, ns.read_only, ns.incoming, ns.encrypt
    )
}

/// `ns`'s use of backing `b` (with its open key) of `total` bytes, checked
/// against `uses`: its slice within the backend, no overlap with another writer.
fn new_use(
    uses: &[BackingUse],
    ns: &NsSpec,
    (b, open_key): (crate::kinds::Backing, String),
    total: u64,
    who: &str,
    owner: (PathBuf, u32),
    claims: bool,
) -> Result<BackingUse> {
    let u = BackingUse {
        resource: b.resource,
        open_key,
        range: slice_range(ns, total)?,
        writable: !ns.read_only,
        shared: ns.shared,
        claims,
        incoming: ns.incoming,
        encrypted: ns.encrypt.is_some(),
        who: who.to_string(),
        owner,
    };
    check_overlap(uses, &u)?;
    Ok(u)
}

fn slice_range(ns: &NsSpec, total: u64) -> Result<(u64, u64)> {
    let Some((off, size)) = ns.slice else {
        return Ok((0, total));
    };
    if off >= total {
        bail!("offset {off} is at or beyond the end of the backend ({total} bytes)");
    }
    let len = size.unwrap_or(total - off);
    if off.checked_add(len).is_none_or(|end| end > total) {
        bail!("slice {off}+{len} reaches beyond the end of the backend ({total} bytes)");
    }
    Ok((off, len))
}

fn check_overlap(uses: &[BackingUse], b: &BackingUse) -> Result<()> {
    for a in uses {
        // Payload and raw bytes of one backing do not compare: one writer of
        // either kind rules the other out.
        if a.resource == b.resource && a.encrypted != b.encrypted && (a.writable || b.writable) {
            bail!(
                "{} and {} use {} with and without encrypt=luks: a backing is either encrypted for all its users or for none",
                a.who,
                b.who,
                a.resource
            );
        }
        let both_shared = a.shared && b.shared;
        // A migration's source and destination: one writer at a time, by claim.
        let migration = (a.incoming || b.incoming) && a.claims && b.claims;
        if a.resource == b.resource
            && (a.writable || b.writable)
            && !both_shared
            && !migration
            && bdev::overlaps(a.range, b.range)
        {
            bail!(
                "{} and {} overlap on {} (bytes {}+{} and {}+{}): give them disjoint offset=/size= or mark both `shared`",
                a.who,
                b.who,
                a.resource,
                a.range.0,
                a.range.1,
                b.range.0,
                b.range.1
            );
        }
    }
    Ok(())
}
