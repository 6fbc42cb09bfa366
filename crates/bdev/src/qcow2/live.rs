//! Live changes to a running disk's chain (docs/decisions/0041-qcow2-snapshots-and-jobs.md):
//! an external snapshot (a new overlay over the image), and the block jobs
//! that stream a backing file into the image, commit the image into its base
//! or mirror the guest's view into a new image, a cluster per step, while the
//! guest reads and writes.
//!
//! Who owns what: the disk's [`Active`] holds the image the channels serve;
//! replacing it makes rings on the new image for every channel (on the
//! replacing thread, not the reactors) and bumps an epoch each channel checks
//! before a request; a channel then takes its rings and moves to the new
//! image (its rings on the old files retire once empty).
//! The caller replaces it only while the device is paused (nothing in
//! flight), so no write reaches an image after it became a backing file.
//! A job step holds the image's metadata lock for one cluster, the same lock
//! every slow-path write takes, so a step and a guest write of the same
//! cluster never interleave.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::create::{create_qcow2, CreateOptions};
use super::error::Qcow2Error;
use super::header::Header;
use super::image::{Image, OpenOpts};
use super::tables::{Cluster, COPIED, ZERO};
use super::target::{Remote, RemoteTarget, Target, Through};
use super::Qcow2Disk;
use crate::image_lock::Perms;
use crate::{FileEngine, IoChannel};

/// The image a disk's channels serve, replaceable while the device is paused.
pub(super) struct Active {
    /// The image, and rings on its files made for the channels that still
    /// serve an older one: a reactor takes them and makes no ring itself
    /// (its thread may not be allowed to set one up).
    inner: Mutex<(Arc<Image>, Vec<Rings>, Engines)>,
    /// Bumped on every replacement: one load per request tells a channel.
    pub epoch: AtomicU64,
    /// Channels alive (counted under `inner`).
    channels: AtomicUsize,
    engine: FileEngine,
}

/// Rings on an image's file and on its raw backing file, if it has one.
pub(super) type Rings = (Box<dyn IoChannel>, Option<Box<dyn IoChannel>>);

/// The engines of an image's file and of its raw backing file, `Auto` decided
/// (on the control path: see [`crate::uring::resolve_engine`]).
pub(super) type Engines = (FileEngine, FileEngine);

pub(super) fn engines(image: &Image, engine: FileEngine) -> Engines {
    let backing = image
        .raw_backing_file()
        .map_or(engine, |f| crate::uring::resolve_engine(&f, engine));
    (crate::uring::resolve_engine(&image.file, engine), backing)
}

pub(super) fn rings(image: &Image, (data, backing): Engines) -> io::Result<Rings> {
    let data = crate::uring::data_channel(image.file.clone(), data, image.read_only)?;
    let backing = match image.raw_backing_file() {
        Some(file) => Some(crate::uring::data_channel(file, backing, true)?),
        None => None,
    };
    Ok((data, backing))
}

impl Active {
    /// Decides the engines (probing the files): call on the control path.
    pub(super) fn new(image: Image, engine: FileEngine) -> Active {
        let e = engines(&image, engine);
        Active {
            inner: Mutex::new((Arc::new(image), Vec::new(), e)),
            epoch: AtomicU64::new(0),
            channels: AtomicUsize::new(0),
            engine,
        }
    }
    fn lock(&self) -> MutexGuard<'_, (Arc<Image>, Vec<Rings>, Engines)> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub(super) fn get(&self) -> Arc<Image> {
        self.lock().0.clone()
    }
    /// A new channel: the image, its epoch and rings on its files (no probe:
    /// a device's own thread attaches).
    pub(super) fn attach(&self) -> io::Result<(Arc<Image>, u64, Rings)> {
        let g = self.lock();
        let r = rings(&g.0, g.2)?;
        self.channels.fetch_add(1, Ordering::AcqRel);
        Ok((g.0.clone(), self.epoch.load(Ordering::Acquire), r))
    }
    pub(super) fn detach(&self) {
        let _g = self.lock();
        self.channels.fetch_sub(1, Ordering::AcqRel);
    }
    /// For a channel moving to the current image: the image, its epoch and
    /// rings made for it by [`Active::set`].
    pub(super) fn take(&self) -> Option<(Arc<Image>, u64, Rings)> {
        let mut g = self.lock();
        let r = g.1.pop()?;
        Some((g.0.clone(), self.epoch.load(Ordering::Acquire), r))
    }
    /// Replaces the image, with rings for every channel made here (on the
    /// control thread, not on the reactors).
    fn set(&self, image: Arc<Image>) -> io::Result<()> {
        let mut g = self.lock();
        let n = self.channels.load(Ordering::Acquire);
        let e = engines(&image, self.engine);
        let spare = (0..n)
            .map(|_| rings(&image, e))
            .collect::<io::Result<Vec<_>>>()?;
        *g = (image, spare, e);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// What a [`BlockJob`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// Copies the backing chain's data into the image, then drops the link.
    Stream,
    /// Copies the image's clusters into its base, then serves the base.
    Commit,
    /// Copies what the guest sees into a new image, then serves it (pivot)
    /// or leaves it as a copy of the disk at the job's end.
    Mirror,
}

/// A stream or commit over one disk, a cluster per [`BlockJob::step`]. The
/// caller runs it off the reactors and pauses the device around
/// [`Qcow2Disk::start_job`] (commit) and [`BlockJob::finish`].
pub struct BlockJob {
    kind: JobKind,
    image: Arc<Image>,
    next: u64,
    clusters: u64,
    buf: Vec<u8>,
    /// Mirror: serve the copy at the end.
    pivot: bool,
    /// The image's `takeovers` when the job last stepped.
    takeovers: u64,
}

impl BlockJob {
    fn new(kind: JobKind, image: Arc<Image>, pivot: bool) -> BlockJob {
        let cs = image.cs();
        BlockJob {
            kind,
            clusters: image.header.size.div_ceil(cs),
            next: 0,
            buf: vec![0; cs as usize],
            pivot,
            takeovers: image.takeovers.load(Ordering::Acquire),
            image,
        }
    }
    pub fn kind(&self) -> JobKind {
        self.kind
    }
    /// Bytes the job goes over (the virtual size, in whole clusters).
    pub fn total_bytes(&self) -> u64 {
        self.clusters * self.image.cs()
    }
    pub fn done_bytes(&self) -> u64 {
        self.next * self.image.cs()
    }
    /// The image a commit or mirror writes into on this host (None: a
    /// stream, a mirror to another host, or a target let go).
    pub fn target_path(&self) -> Option<PathBuf> {
        let t = self.image.through.lock().unwrap_or_else(|p| p.into_inner());
        match t.as_ref().map(|t| &t.target) {
            Some(Target::Image(b)) => Some(b.path.clone()),
            _ => None,
        }
    }
    /// The export on another host a mirror writes into, as its URI.
    pub fn remote(&self) -> Option<String> {
        let t = self.image.through.lock().unwrap_or_else(|p| p.into_inner());
        match t.as_ref().map(|t| &t.target) {
            Some(Target::Remote(r)) => Some(r.name()),
            _ => None,
        }
    }
    /// Whether the job, its copy done, keeps writing through until it is
    /// told to complete (a mirror to another host: the VM moves there).
    pub fn waits_for_complete(&self) -> bool {
        self.kind == JobKind::Mirror && self.remote().is_some()
    }
    /// Fails once writing a guest write through into a remote target failed:
    /// the target misses that write, the job must end.
    pub fn check_target(&self) -> io::Result<()> {
        let t = self.image.through.lock().unwrap_or_else(|p| p.into_inner());
        t.as_ref().map_or(Ok(()), |t| t.failed())
    }
    /// Mirror: whether the disk goes on in the copy at the end.
    pub fn pivot(&self) -> bool {
        self.pivot
    }
    /// Goes on from `done` bytes (a whole number of clusters, as
    /// [`BlockJob::done_bytes`] said in another process).
    fn resume_from(mut self, done: u64) -> Result<BlockJob, Qcow2Error> {
        let cs = self.image.cs();
        if !done.is_multiple_of(cs) || done / cs > self.clusters {
            return Err(refused(
                &self.image,
                &format!(
                    "a job cannot go on from byte {done}: not a cluster boundary inside the image"
                ),
            ));
        }
        self.next = done / cs;
        Ok(self)
    }
    /// Does one cluster; `Ok(None)` once all are done, else the bytes copied
    /// (0 for a cluster that needed nothing).
    ///
    /// While another process writes the image (the VM migrated away) it
    /// fails with [`io::ErrorKind::WouldBlock`] and copies nothing: try again
    /// later. Once the image came back, a commit or mirror starts over.
    pub fn step(&mut self) -> io::Result<Option<u64>> {
        let takeovers = self.image.takeovers.load(Ordering::Acquire);
        if takeovers != self.takeovers {
            self.takeovers = takeovers;
            if self.kind != JobKind::Stream && self.next > 0 {
                tracing::info!(path = %self.image.path.display(), "qcow2 {:?}: the image was written by another process meanwhile; copying again from the start", self.kind);
                self.next = 0;
            }
        }
        if self.next >= self.clusters {
            return Ok(None);
        }
        let c = self.next;
        let copied = match self.kind {
            JobKind::Stream => self.populate(c)?,
            JobKind::Commit | JobKind::Mirror => self.copy(c)?,
        };
        self.next += 1;
        Ok(Some(if copied { self.image.cs() } else { 0 }))
    }

    /// Stream: an unallocated cluster gets the chain's data (or a zero flag).
    fn populate(&mut self, c: u64) -> io::Result<bool> {
        let img = &self.image;
        let mut meta = img.meta();
        check_not_handed_off(img)?;
        // A cluster with subclusters left to the backing file is made whole,
        // in its own space when it has some.
        let own = match img.cluster(&mut meta, c)? {
            Cluster::Unallocated | Cluster::Mixed { host: 0, .. } => None,
            Cluster::Mixed {
                host, copied: true, ..
            } => Some(host),
            _ => return Ok(false),
        };
        let cs = img.cs();
        img.read_locked(&mut meta, c * cs, &mut self.buf)?;
        if self.buf.iter().all(|&b| b == 0) {
            img.set_entry(&mut meta, c, own.map_or(0, |h| h | COPIED) | ZERO)?;
            return Ok(false);
        }
        let host = match own {
            Some(h) => h,
            None => meta.alloc()?,
        };
        img.file.write_all_at(&self.buf, host)?;
        img.set_entry(&mut meta, c, host | COPIED)?;
        Ok(true)
    }

    /// Commit: a cluster the image has goes to the base. Mirror: what the
    /// guest reads of the cluster goes to the copy (zeroes as a zero flag).
    fn copy(&mut self, c: u64) -> io::Result<bool> {
        let img = &self.image;
        let mut meta = img.meta();
        check_not_handed_off(img)?;
        let cluster = img.cluster(&mut meta, c)?;
        let mirror = self.kind == JobKind::Mirror;
        if cluster == Cluster::Unallocated && !mirror {
            return Ok(false);
        }
        let cs = img.cs();
        let zero = match cluster {
            Cluster::Zero { .. } => true,
            _ => {
                img.read_locked(&mut meta, c * cs, &mut self.buf)?;
                mirror && self.buf.iter().all(|&b| b == 0)
            }
        };
        let mut t = img.through.lock().unwrap_or_else(|p| p.into_inner());
        let Some(through) = t.as_mut() else {
            return Err(io::Error::other("the job's target was let go"));
        };
        through.copy(cs, c, (!zero).then_some(&self.buf[..]))?;
        Ok(!zero)
    }

    /// After the last step, with the device paused: stream drops the backing
    /// link and reopens the image; commit makes the base the disk's image.
    pub fn finish(self, disk: &Qcow2Disk) -> Result<(), Qcow2Error> {
        let img = &self.image;
        let io = |op| {
            let path = img.path.clone();
            move |source| Qcow2Error::Io { path, op, source }
        };
        match self.kind {
            JobKind::Stream => {
                img.flush().map_err(io("write its metadata back"))?;
                drop_backing(img)?;
                let opened = Image::open(&img.path, disk.open_opts(), &mut Vec::new())?;
                disk.active
                    .set(Arc::new(opened))
                    .map_err(io("set up rings on it"))?;
            }
            JobKind::Commit | JobKind::Mirror => {
                match take_through(img).ok_or_else(|| refused(img, "the job lost its target"))? {
                    Target::Image(to) => {
                        to.flush().map_err(io("write the target's metadata back"))?;
                        if self.kind == JobKind::Commit || self.pivot {
                            disk.active.set(to).map_err(io("set up rings on it"))?;
                        }
                    }
                    Target::Remote(mut r) => r.flush().map_err(|source| Qcow2Error::Io {
                        path: PathBuf::from(r.name()),
                        op: "flush the mirror's target",
                        source,
                    })?,
                }
            }
        }
        Ok(())
    }

    /// Stops: a commit or mirror stops writing through (the target keeps
    /// what it got, the image is whole as it was); a stream leaves what it
    /// copied.
    pub fn abandon(self) {
        let flushed = match take_through(&self.image) {
            Some(Target::Image(base)) => base
                .flush()
                .map_err(|e| (base.path.display().to_string(), e)),
            Some(Target::Remote(mut r)) => r.flush().map_err(|e| (r.name(), e)),
            None => Ok(()),
        };
        if let Err((target, e)) = flushed {
            tracing::error!(target, "block job ended: flushing its target: {e}");
        }
    }
}

/// Writes back the metadata of the image a commit or mirror of `img` writes
/// into (a successor opens it again).
pub(super) fn flush_target(img: &Image) -> io::Result<()> {
    let mut t = img.through.lock().unwrap_or_else(|p| p.into_inner());
    match t.as_mut().map(|t| &mut t.target) {
        Some(Target::Remote(r)) => r.flush(),
        Some(Target::Image(b)) => {
            // Flushed outside the lock guest writes take to write through.
            let b = b.clone();
            drop(t);
            b.flush()
        }
        None => Ok(()),
    }
}

/// The image on this host a commit or mirror of `img` writes into, if a
/// job runs.
fn target(img: &Image) -> Option<Arc<Image>> {
    let t = img.through.lock().unwrap_or_else(|p| p.into_inner());
    match t.as_ref().map(|t| &t.target) {
        Some(Target::Image(b)) => Some(b.clone()),
        _ => None,
    }
}

/// With `img` handed to another process: its job's target is written back
/// and unlocked too (the other process opens it as part of the chain, or
/// connects to the remote one again).
pub(super) fn release_target(img: &Image) -> io::Result<()> {
    match target(img) {
        Some(b) => b.flush().and_then(|()| b.set_lock(Perms::NONE)),
        None => flush_target(img),
    }
}

/// With `img` taken back: its job's target is locked and read again.
pub(super) fn take_target(img: &Image) -> io::Result<()> {
    match target(img) {
        Some(b) => {
            b.set_lock(Perms::QCOW2_WRITER)?;
            Ok(b.reload()?)
        }
        None => Ok(()),
    }
}

/// Refuses a job's step while the image is handed off (the VM migrated away,
/// or its device is paused for a handover).
pub(super) fn check_not_handed_off(img: &Image) -> io::Result<()> {
    if img.handed_off.load(Ordering::Acquire) {
        return Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{}: another process writes the image now (its VM migrated there)",
                img.path.display()
            ),
        ));
    }
    Ok(())
}

fn take_through(img: &Image) -> Option<Target<Image>> {
    let _meta = img.meta();
    img.writes_slow.store(false, Ordering::Release);
    let t = img.through.lock().unwrap_or_else(|p| p.into_inner()).take();
    t.map(|t| t.target)
}

fn refused(img: &Image, why: &str) -> Qcow2Error {
    Qcow2Error::Refused {
        path: img.path.clone(),
        why: why.to_string(),
    }
}

/// Rewrites the header without a backing file (the header cluster holds
/// nothing else: its tables start past it). The header is read back from
/// the file, not taken from the one parsed at open: the refcount table may
/// have moved since, and autoclear bits were cleared.
fn drop_backing(img: &Image) -> Result<(), Qcow2Error> {
    let io = |op| {
        let path = img.path.clone();
        move |source| Qcow2Error::Io { path, op, source }
    };
    let cs = img.cs() as usize;
    let file_len = img.file.metadata().map_err(io("read its metadata"))?.len();
    let mut b = vec![0u8; cs];
    img.file
        .read_exact_at(&mut b, 0)
        .map_err(io("read its header"))?;
    let mut h = Header::parse(&b, file_len).map_err(|source| Qcow2Error::Header {
        path: img.path.clone(),
        source,
    })?;
    if h.compression_type != 0 {
        return Err(refused(
            img,
            "dropping the backing link of an image with a compression type other than deflate",
        ));
    }
    h.backing_file = None;
    h.backing_format = None;
    let mut b = h.encode();
    b.resize(cs, 0);
    img.file
        .write_all_at(&b, 0)
        .map_err(io("rewrite its header"))?;
    img.file.sync_data().map_err(io("sync its header"))
}

/// How the overlay names `base`: by file name beside it, else by absolute path.
fn backing_name(overlay: &Path, base: &Path) -> String {
    let dir = |p: &Path| {
        let d = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::canonicalize(d).ok()
    };
    let canon = std::fs::canonicalize(base).unwrap_or_else(|_| base.to_path_buf());
    match (dir(overlay), canon.parent(), canon.file_name()) {
        (Some(a), Some(b), Some(name)) if a == b => name.to_string_lossy().into_owned(),
        _ => canon.display().to_string(),
    }
}

impl Qcow2Disk {
    /// The image the disk serves now (its overlay after a snapshot, its base
    /// after a commit).
    pub fn active_path(&self) -> PathBuf {
        self.active.get().path.clone()
    }

    /// Writes back the metadata of the image a commit or mirror writes into
    /// (none: nothing to do); safe while the guest runs.
    pub fn flush_target(&self) -> io::Result<()> {
        flush_target(&self.active.get())
    }

    /// The image the disk's spec names (the one it opened first).
    pub fn spec_path(&self) -> &Path {
        &self.opened
    }

    /// Whether the disk serves another image than the one it opened: a
    /// successor opening the spec's path would not see the guest's data.
    pub fn chain_changed(&self) -> bool {
        self.active.get().path != self.opened
    }

    pub(super) fn open_opts(&self) -> OpenOpts {
        OpenOpts {
            read_only: self.info.read_only,
            l2_cache: self.l2_cache,
            inactive: false,
            locking: self.locking,
        }
    }

    /// An external snapshot: a new image at `overlay` (which must not exist)
    /// over the current one, which the disk serves from then on read-only as
    /// its backing file. Call with the device paused.
    pub fn snapshot(&self, overlay: &Path) -> Result<(), Qcow2Error> {
        let old = self.active.get();
        if self.info.read_only {
            return Err(refused(&old, "a read-only disk takes no snapshot"));
        }
        old.flush().map_err(|source| Qcow2Error::Io {
            path: old.path.clone(),
            op: "write its metadata back",
            source,
        })?;
        let img = self.new_image(overlay, &old, Some(backing_name(overlay, &old.path)))?;
        if let Err(source) = self.active.set(Arc::new(img)) {
            let _ = std::fs::remove_file(overlay);
            return Err(Qcow2Error::Io {
                path: overlay.to_path_buf(),
                op: "set up rings on it",
                source,
            });
        }
        Ok(())
    }

    /// Makes and opens an image at `path`, which must not exist, with the
    /// size and cluster size of `like` (removed again if that fails).
    fn new_image(
        &self,
        path: &Path,
        like: &Image,
        backing: Option<String>,
    ) -> Result<Image, Qcow2Error> {
        // Reserves the name: an existing file is never taken over.
        match OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(Qcow2Error::Exists {
                    path: path.to_path_buf(),
                })
            }
            Err(source) => {
                return Err(Qcow2Error::Io {
                    path: path.to_path_buf(),
                    op: "create it",
                    source,
                })
            }
        }
        let o = CreateOptions {
            size: like.header.size,
            cluster_size: like.cs(),
            backing,
        };
        let made = create_qcow2(path, &o)
            .and_then(|_| Image::open(path, self.open_opts(), &mut Vec::new()));
        if made.is_err() {
            let _ = std::fs::remove_file(path);
        }
        made
    }

    /// Starts a mirror of the disk into a new image at `target` (which must
    /// not exist; `pivot`: serve it at the end). From here every guest write
    /// goes through to it: call with the device paused.
    pub fn start_mirror(&self, target: &Path, pivot: bool) -> Result<BlockJob, Qcow2Error> {
        let img = self.active.get();
        if self.info.read_only {
            return Err(refused(&img, "a read-only disk runs no block job"));
        }
        let to = self.new_image(target, &img, None)?;
        write_through_to(&img, Target::Image(Arc::new(to)));
        Ok(BlockJob::new(JobKind::Mirror, img, pivot))
    }

    /// Starts a mirror of the disk into an export on another host, going on
    /// from `done` bytes (0: from the start; else what a predecessor
    /// process said it copied). The job keeps writing guest writes through
    /// after its copy until it is told to complete: call with the device
    /// paused, so that no write in flight escapes it.
    pub fn start_remote_mirror(
        &self,
        to: Box<dyn RemoteTarget>,
        done: u64,
    ) -> Result<BlockJob, Qcow2Error> {
        let img = self.active.get();
        if self.info.read_only {
            return Err(refused(&img, "a read-only disk runs no block job"));
        }
        if to.size() < img.header.size {
            return Err(refused(
                &img,
                &format!(
                    "the mirror's target {} has {} bytes, fewer than the disk's {}",
                    to.name(),
                    to.size(),
                    img.header.size
                ),
            ));
        }
        write_through_to(&img, Target::Remote(Remote::new(to, img.header.size)));
        let job = BlockJob::new(JobKind::Mirror, img.clone(), false);
        job.resume_from(done).inspect_err(|_| {
            take_through(&img);
        })
    }

    /// Takes over a job another process ran on this disk up to `done` bytes:
    /// a commit writes through into its base again, a mirror into its
    /// `target` (which exists now, with what that process copied and wrote
    /// through). Call with the device paused, as to start one: from here
    /// guest writes go through, and what the job copies from `done` on
    /// repairs whatever reached the target before.
    pub fn resume_job(
        &self,
        kind: JobKind,
        target: Option<&Path>,
        pivot: bool,
        done: u64,
    ) -> Result<BlockJob, Qcow2Error> {
        let job = match kind {
            JobKind::Stream | JobKind::Commit => {
                let job = self.start_job(kind)?;
                let named = job.target_path();
                if kind == JobKind::Commit && !same_file(named.as_deref(), target) {
                    take_through(&job.image);
                    return Err(refused(
                        &job.image,
                        "the commit's base is not the image the job wrote into",
                    ));
                }
                job
            }
            JobKind::Mirror => {
                let img = self.active.get();
                let Some(target) = target else {
                    return Err(refused(&img, "a mirror goes on only into its target"));
                };
                let to = Image::open(target, self.open_opts(), &mut Vec::new())?;
                if to.cs() != img.cs() || to.header.size != img.header.size || to.backing.is_some()
                {
                    return Err(refused(
                        &to,
                        "a mirror's target with another size, cluster size or a backing file",
                    ));
                }
                write_through_to(&img, Target::Image(Arc::new(to)));
                BlockJob::new(JobKind::Mirror, img, pivot)
            }
        };
        let image = job.image.clone();
        job.resume_from(done).inspect_err(|_| {
            take_through(&image);
        })
    }

    /// Starts a stream or commit of the disk's image (a mirror is
    /// [`Qcow2Disk::start_mirror`]). A commit opens the base
    /// writable and from here sends every guest write through it: call with
    /// the device paused, so that no write in flight escapes it.
    pub fn start_job(&self, kind: JobKind) -> Result<BlockJob, Qcow2Error> {
        let img = self.active.get();
        if self.info.read_only {
            return Err(refused(&img, "a read-only disk runs no block job"));
        }
        if kind == JobKind::Mirror {
            return Err(refused(&img, "a mirror starts with its target image"));
        }
        let Some(base_path) = img.backing_image() else {
            return Err(refused(&img, "the image has no backing file"));
        };
        let cs = img.cs();
        if kind == JobKind::Commit {
            let Some(base_path) = base_path else {
                return Err(refused(&img, "committing into a raw backing file"));
            };
            let base = Image::open(&base_path, self.open_opts(), &mut Vec::new())?;
            if base.cs() != cs || base.header.size < img.header.size {
                return Err(refused(
                    &img,
                    "committing into a base with another cluster size or a smaller size",
                ));
            }
            write_through_to(&img, Target::Image(Arc::new(base)));
        }
        Ok(BlockJob::new(kind, img, false))
    }
}

/// Whether two paths name one file (both must exist).
fn same_file(a: Option<&Path>, b: Option<&Path>) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |p: Option<&Path>| {
        p.and_then(|p| std::fs::metadata(p).ok())
            .map(|m| (m.dev(), m.ino()))
    };
    id(a).is_some() && id(a) == id(b)
}

/// From here every guest write into `img` goes to the slow path and through
/// into `to` (an image of the same cluster size, or a remote export).
fn write_through_to(img: &Image, to: Target<Image>) {
    let _meta = img.meta();
    *img.through.lock().unwrap_or_else(|p| p.into_inner()) = Some(Through::new(to, img.cs()));
    img.writes_slow.store(true, Ordering::Release);
}
