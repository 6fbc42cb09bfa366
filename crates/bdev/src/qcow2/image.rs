//! An opened qcow2 image: its checked header, its metadata behind a lock, its
//! backing chain, and the synchronous reads and writes of the slow path
//! (allocation, backing data, zeroes, partial clusters), which run under the
//! image's lock on the calling reactor.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::backing::Backing;
use super::compress;
use super::error::Qcow2Error;
use super::header::{
    Header, INCOMPAT_COMPRESSION, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE, INCOMPAT_DIRTY,
    INCOMPAT_EXTL2,
};
use super::meta::Meta;
use super::tables::{classify_at, compressed_extent, Cluster, COPIED, OFFSET_MASK, ZERO};
use super::target::{LocalTarget, Through};
use crate::image_lock::{ImageLock, Perms};

/// How an image is opened.
#[derive(Clone, Copy, Debug)]
pub(super) struct OpenOpts {
    pub read_only: bool,
    /// Bytes of L2 tables the cache holds (at least one table).
    pub l2_cache: u64,
    /// Another process writes the image now (the destination of a live
    /// migration): nothing is written, and no lock taken, until
    /// [`Image::reload`].
    pub inactive: bool,
    /// QEMU's image locks on the chain (`locking=off`: none).
    pub locking: bool,
}

pub(super) struct Image {
    pub path: PathBuf,
    pub file: Arc<File>,
    pub header: Header,
    pub read_only: bool,
    meta: Mutex<Meta>,
    /// Bumped when an L2 table leaves the cache.
    pub generation: Arc<AtomicU64>,
    /// Where allocated clusters end.
    pub limit: Arc<AtomicU64>,
    pub backing: Option<Backing>,
    /// While a commit or mirror runs: the target every write also goes to,
    /// and the flag that sends every write to the slow path (under `meta`)
    /// so that it does (docs/decisions/0041-qcow2-snapshots-and-jobs.md).
    pub(super) through: Mutex<Option<Through<Image>>>,
    pub writes_slow: std::sync::atomic::AtomicBool,
    /// QEMU's locks on the image file (none with `locking=off`).
    lock: Option<ImageLock>,
    /// Another process may write the image now (set under `meta`): a block
    /// job's step waits.
    pub(super) handed_off: std::sync::atomic::AtomicBool,
    /// Times the image was taken back from another process: a commit or
    /// mirror copies again from the start, as the other process's writes did
    /// not go through to its target.
    pub(super) takeovers: AtomicU64,
}

/// After a guest write of `data` at `off` into `img` (its metadata lock
/// held): the same write into the target a commit or mirror copies into.
fn write_through(img: &Image, off: u64, data: &[u8]) -> io::Result<()> {
    if !img.writes_slow.load(Ordering::Acquire) {
        return Ok(());
    }
    let mut t = img.through.lock().unwrap_or_else(|p| p.into_inner());
    t.as_mut().map_or(Ok(()), |t| t.write(off, data))
}

/// After guest clusters `first..first+count` of `img` were made zeroes.
fn zero_through(img: &Image, first: u64, count: u64) -> io::Result<()> {
    if !img.writes_slow.load(Ordering::Acquire) {
        return Ok(());
    }
    let mut t = img.through.lock().unwrap_or_else(|p| p.into_inner());
    t.as_mut()
        .map_or(Ok(()), |t| t.zero(img.cs(), first, count))
}

/// Where a guest cluster's data is, for the slow path.
enum Source {
    Host(u64),
    /// A compressed cluster's L2 entry.
    Compressed(u64),
    /// Subclusters of different kinds (extended L2 entries).
    Mixed {
        host: u64,
        alloc: u32,
        zero: u32,
    },
    Zeroes,
    Backing,
}

fn bad_data() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "qcow2: corrupt or compressed cluster",
    )
}

impl Image {
    /// Opens the image at `path` and its backing chain (`seen`: the canonical
    /// paths of the images above it, to refuse loops).
    pub(super) fn open(
        path: &Path,
        o: OpenOpts,
        seen: &mut Vec<PathBuf>,
    ) -> Result<Image, Qcow2Error> {
        let io = |op: &'static str| {
            move |source| Qcow2Error::Io {
                path: path.to_path_buf(),
                op,
                source,
            }
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!o.read_only)
            .open(path)
            .map_err(io("open it"))?;
        let perms = match (o.inactive, o.read_only) {
            (true, _) => Perms::NONE,
            (false, true) => Perms::READER,
            (false, false) => Perms::QCOW2_WRITER,
        };
        let lock = match o.locking {
            true => Some(ImageLock::acquire(&file, path, perms).map_err(io("lock it"))?),
            false => None,
        };
        let (mut header, mut file_len) = read_header(path, &file)?;
        check_features(path, &header, o.read_only)?;
        if !o.read_only && !o.inactive {
            (header, file_len) = prepare_for_writing(path, &file, header, file_len)?;
        }
        let file = Arc::new(file);
        let generation = Arc::new(AtomicU64::new(0));
        let meta = Meta::load(
            file.clone(),
            &header,
            file_len,
            (o.l2_cache >> header.cluster_bits).max(1) as usize,
            generation.clone(),
        )
        .map_err(io("read its L1 and refcount tables"))?;
        let backing = Backing::open(path, &header, o, seen)?;
        Ok(Image {
            path: path.to_path_buf(),
            limit: meta.limit(),
            file,
            header,
            read_only: o.read_only,
            meta: Mutex::new(meta),
            generation,
            backing,
            through: Mutex::new(None),
            writes_slow: std::sync::atomic::AtomicBool::new(false),
            lock,
            handed_off: std::sync::atomic::AtomicBool::new(o.inactive),
            takeovers: AtomicU64::new(0),
        })
    }

    /// Takes the image back after another process wrote it (a migration's
    /// destination starting to serve, or its source the VM came back to): the
    /// header must describe the same disk, the tables are read again, and a
    /// writer's preparation (dirty refcounts, autoclear bits) is done now.
    /// Call with nothing in flight.
    pub(super) fn reload(&self) -> Result<(), Qcow2Error> {
        let (mut h, mut len) = read_header(&self.path, &self.file)?;
        check_features(&self.path, &h, self.read_only)?;
        let was = &self.header;
        let disk = |h: &Header| {
            (
                h.cluster_bits,
                h.size,
                h.refcount_order,
                h.compression_type,
                h.incompatible & !INCOMPAT_DIRTY,
                h.backing_file.clone(),
                h.backing_format.clone(),
            )
        };
        if disk(&h) != disk(was) {
            return Err(Qcow2Error::Refused {
                path: self.path.clone(),
                why: "its size, cluster size, features or backing file changed while another \
                      process served it; serve the disk again from its spec"
                    .to_string(),
            });
        }
        if !self.read_only {
            (h, len) = prepare_for_writing(&self.path, &self.file, h, len)?;
        }
        self.meta()
            .reload(&h, len)
            .map_err(|source| Qcow2Error::Io {
                path: self.path.clone(),
                op: "read its tables again",
                source,
            })
    }

    /// Holds the image as a writer again, or lets it go for another process
    /// (QEMU's locks; nothing with `locking=off`).
    pub(super) fn set_lock(&self, perms: Perms) -> io::Result<()> {
        match &self.lock {
            Some(l) => l.set(perms),
            None => Ok(()),
        }
    }

    pub(super) fn meta(&self) -> MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn cs(&self) -> u64 {
        self.header.cluster_size()
    }

    /// (L1 index, L2 index) of guest cluster `c`.
    pub(super) fn split(&self, c: u64) -> (usize, usize) {
        let l2_bits = self.header.l2_bits();
        ((c >> l2_bits) as usize, (c & ((1 << l2_bits) - 1)) as usize)
    }

    pub(super) fn cluster(&self, meta: &mut Meta, c: u64) -> io::Result<Cluster> {
        Ok(self.entry(meta, c)?.0)
    }

    /// Guest cluster `c`'s L2 entry, classified and raw.
    fn entry(&self, meta: &mut Meta, c: u64) -> io::Result<(Cluster, u64)> {
        let (l1i, l2i) = self.split(c);
        let limit = self.limit.load(Ordering::Acquire);
        let ext = self.header.extended_l2();
        let Some(t) = meta.l2(l1i)? else {
            return Ok((Cluster::Unallocated, 0));
        };
        let entry = t.get(l2i << u32::from(ext));
        Ok((classify_at(&t, l2i, ext, self.cs(), limit), entry))
    }

    fn source(&self, meta: &mut Meta, c: u64) -> io::Result<Source> {
        Ok(match self.entry(meta, c)? {
            (Cluster::Compressed, e) => Source::Compressed(e),
            (
                Cluster::Mixed {
                    host, alloc, zero, ..
                },
                _,
            ) => Source::Mixed { host, alloc, zero },
            (Cluster::Data { host, .. }, _) => Source::Host(host),
            (Cluster::Zero { .. }, _) => Source::Zeroes,
            (Cluster::Unallocated, _) if self.backing.is_some() => Source::Backing,
            (Cluster::Unallocated, _) => Source::Zeroes,
            (Cluster::Bad, _) => return Err(bad_data()),
        })
    }

    /// Reads `buf.len()` bytes at guest offset `offset` (inside the image).
    pub(super) fn read_sync(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut meta = self.meta();
        self.read_locked(&mut meta, offset, buf)
    }

    pub(super) fn read_locked(
        &self,
        meta: &mut Meta,
        offset: u64,
        buf: &mut [u8],
    ) -> io::Result<()> {
        let cs = self.cs();
        let mut pos = 0usize;
        while pos < buf.len() {
            let off = offset + pos as u64;
            let within = off & (cs - 1);
            let n = ((cs - within) as usize).min(buf.len() - pos);
            let part = &mut buf[pos..pos + n];
            match self.source(meta, off / cs)? {
                Source::Host(h) => self.file.read_exact_at(part, h + within)?,
                Source::Zeroes => part.fill(0),
                Source::Compressed(e) => {
                    let mut whole = vec![0u8; cs as usize];
                    self.inflate(e, &mut whole)?;
                    part.copy_from_slice(&whole[within as usize..within as usize + n]);
                }
                Source::Backing => self.read_backing(off, part)?,
                Source::Mixed { host, alloc, zero } => {
                    self.read_subclusters(off, part, host, alloc, zero)?
                }
            }
            pos += n;
        }
        Ok(())
    }

    fn read_backing(&self, off: u64, part: &mut [u8]) -> io::Result<()> {
        match &self.backing {
            Some(b) => b.read(off, part),
            None => {
                part.fill(0);
                Ok(())
            }
        }
    }

    /// Reads `part` at guest offset `off` (inside one cluster) subcluster by
    /// subcluster: from `host`, zeroes or the backing file, as the bitmaps say.
    fn read_subclusters(
        &self,
        off: u64,
        part: &mut [u8],
        host: u64,
        alloc: u32,
        zero: u32,
    ) -> io::Result<()> {
        let cs = self.cs();
        let sc = cs / 32;
        let mut pos = 0usize;
        while pos < part.len() {
            let within = (off + pos as u64) & (cs - 1);
            let i = within / sc;
            let n = ((sc - within % sc) as usize).min(part.len() - pos);
            let piece = &mut part[pos..pos + n];
            if alloc & (1 << i) != 0 {
                self.file.read_exact_at(piece, host + within)?;
            } else if zero & (1 << i) != 0 {
                piece.fill(0);
            } else {
                self.read_backing(off + pos as u64, piece)?;
            }
            pos += n;
        }
        Ok(())
    }

    /// Writes `data` at guest offset `offset`, allocating clusters as needed
    /// (`scratch`: one cluster, for the old content around a partial write).
    pub(super) fn write_sync(
        &self,
        offset: u64,
        data: &[u8],
        scratch: &mut [u8],
    ) -> io::Result<()> {
        let mut meta = self.meta();
        let cs = self.cs();
        let mut pos = 0usize;
        while pos < data.len() {
            let off = offset + pos as u64;
            let within = off & (cs - 1);
            let n = ((cs - within) as usize).min(data.len() - pos);
            self.write_cluster(
                &mut meta,
                off / cs,
                within as usize,
                &data[pos..pos + n],
                scratch,
            )?;
            write_through(self, off, &data[pos..pos + n])?;
            pos += n;
        }
        Ok(())
    }

    /// Writes `part` at `within` of guest cluster `c`.
    fn write_cluster(
        &self,
        meta: &mut Meta,
        c: u64,
        within: usize,
        part: &[u8],
        scratch: &mut [u8],
    ) -> io::Result<()> {
        let cs = self.cs();
        let host = match self.cluster(meta, c)? {
            Cluster::Data { host, copied: true } => {
                return self.file.write_all_at(part, host + within as u64);
            }
            // A cluster of the image's own, partly allocated or all zeroes, is
            // written whole in place.
            Cluster::Zero { host: Some(h) } => Some(h),
            Cluster::Mixed {
                host, copied: true, ..
            } if host != 0 => Some(host),
            // A compressed cluster is rewritten whole into a new one; its old
            // space leaks (it may share a cluster with others).
            Cluster::Unallocated | Cluster::Zero { host: None } | Cluster::Compressed => None,
            Cluster::Mixed { host: 0, .. } => None,
            Cluster::Data { copied: false, .. } | Cluster::Mixed { .. } | Cluster::Bad => {
                return Err(bad_data())
            }
        };
        let whole = &mut scratch[..cs as usize];
        if part.len() < whole.len() {
            // The rest of the cluster keeps what it read as before the write.
            self.read_locked(meta, c * cs, whole)?;
        }
        whole[within..within + part.len()].copy_from_slice(part);
        let host = match host {
            Some(h) => h,
            None => meta.alloc()?,
        };
        self.file.write_all_at(whole, host)?;
        self.set_entry(meta, c, host | COPIED)
    }

    /// Stores guest cluster `c`'s L2 entry, `value` as a standard entry
    /// says it (`host | COPIED`, `ZERO`, 0). With extended entries every
    /// subcluster follows it: the entry is stored first, then the bitmap; a
    /// lock-free reader between the two sees a mix that sends it to the slow
    /// path (this lock) or to the cluster's old content, never to stale data.
    pub(super) fn set_entry(&self, meta: &mut Meta, c: u64, value: u64) -> io::Result<()> {
        let (l1i, l2i) = self.split(c);
        if !self.header.extended_l2() {
            return meta.set_entry(l1i, l2i, value);
        }
        let all = u64::from(u32::MAX);
        let bitmap = match (value & ZERO != 0, value & OFFSET_MASK != 0) {
            (true, _) => all << 32,
            (false, true) => all,
            (false, false) => 0,
        };
        meta.set_entry(l1i, 2 * l2i, value & !ZERO)?;
        meta.set_entry(l1i, 2 * l2i + 1, bitmap)
    }

    /// Makes whole guest clusters `first..first+count` read as zeroes. For a
    /// discard their space is punched out and their clusters are freed (the
    /// entry says zeroes over a backing file, unallocated without one); Write
    /// Zeroes keeps them allocated.
    pub(super) fn zero_clusters(&self, first: u64, count: u64, discard: bool) -> io::Result<()> {
        let mut meta = self.meta();
        let freed_entry = if self.backing.is_some() { ZERO } else { 0 };
        let mut freed = Vec::new();
        for c in first..first + count {
            let host = match self.cluster(&mut meta, c)? {
                Cluster::Data { host, copied: true } | Cluster::Zero { host: Some(host) } => host,
                Cluster::Mixed {
                    host, copied: true, ..
                } if host != 0 => host,
                Cluster::Zero { host: None } => continue,
                // Shared or compressed clusters are left to their owners: the
                // entry alone says zeroes.
                _ => 0,
            };
            if discard && host != 0 {
                super::punch(&self.file, host, self.cs());
                if meta.can_free() {
                    self.set_entry(&mut meta, c, freed_entry)?;
                    freed.push(host);
                    continue;
                }
            }
            let keep = if host != 0 { host | COPIED } else { 0 };
            self.set_entry(&mut meta, c, keep | ZERO)?;
        }
        meta.discard(&freed);
        zero_through(self, first, count)
    }

    /// Decompresses the cluster L2 entry `entry` describes into `out` (one
    /// cluster), deflate or zstd as the header says.
    fn inflate(&self, entry: u64, out: &mut [u8]) -> io::Result<()> {
        let (offset, len) = compressed_extent(entry, self.header.cluster_bits);
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.limit.load(Ordering::Acquire));
        if offset < self.cs() || end.is_none() {
            return Err(bad_data());
        }
        let mut input = vec![0u8; len as usize];
        let n = read_some(&self.file, &mut input, offset)?;
        compress::decompress(self.header.compression_type, &input[..n], out)
    }

    pub(super) fn flush(&self) -> io::Result<()> {
        self.meta().flush()
    }

    /// The backing file: `Some(Some(path))` a qcow2 image, `Some(None)` a
    /// raw file.
    pub(super) fn backing_image(&self) -> Option<Option<PathBuf>> {
        match &self.backing {
            None => None,
            Some(Backing::Qcow2(b)) => Some(Some(b.path.clone())),
            Some(Backing::Raw { .. }) => Some(None),
        }
    }

    /// A raw backing file (read on its own ring by the channels).
    pub(super) fn raw_backing_file(&self) -> Option<Arc<File>> {
        match &self.backing {
            Some(Backing::Raw { file, .. }) => Some(file.clone()),
            _ => None,
        }
    }

    /// Bytes allocated in the image file.
    pub(super) fn allocated_bytes(&self) -> u64 {
        self.meta().allocated_bytes()
    }
}

impl LocalTarget for Image {
    fn write_sync(&self, offset: u64, data: &[u8], scratch: &mut [u8]) -> io::Result<()> {
        Image::write_sync(self, offset, data, scratch)
    }
    fn zero_clusters(&self, first: u64, count: u64, discard: bool) -> io::Result<()> {
        Image::zero_clusters(self, first, count, discard)
    }
}

impl Drop for Image {
    /// Metadata still in memory goes to disk when the last user lets go.
    fn drop(&mut self) {
        if !self.read_only {
            let m = self.meta.get_mut().unwrap_or_else(|p| p.into_inner());
            if m.dirty() {
                if let Err(e) = m.flush() {
                    tracing::error!(path = %self.path.display(), "qcow2 metadata flush on close: {e}");
                }
            }
        }
    }
}

/// Reads what there is of `buf.len()` bytes at `offset` (a compressed
/// cluster's last sector may lie past the end of the file).
fn read_some(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The header of the image in `file`, and the file's length.
/// What opening an image for writing does to it first, as QEMU does: a dirty
/// image (lazy refcounts) gets its refcounts rebuilt, and the autoclear bits
/// of extensions udrive does not keep up to date (bitmaps) are cleared. The
/// header and length after it.
fn prepare_for_writing(
    path: &Path,
    file: &File,
    header: Header,
    file_len: u64,
) -> Result<(Header, u64), Qcow2Error> {
    let (mut header, mut file_len) = (header, file_len);
    if header.incompatible & INCOMPAT_DIRTY != 0 {
        super::repair::rebuild_refcounts(file, &header).map_err(|source| Qcow2Error::Dirty {
            path: path.to_path_buf(),
            source,
        })?;
        tracing::warn!(path = %path.display(), "qcow2: the image was dirty (lazy refcounts); its refcounts were rebuilt");
        (header, file_len) = read_header(path, file)?;
    }
    if header.autoclear != 0 {
        file.write_all_at(&0u64.to_be_bytes(), 88)
            .map_err(|source| Qcow2Error::Io {
                path: path.to_path_buf(),
                op: "clear its autoclear features",
                source,
            })?;
        header.autoclear = 0;
    }
    Ok((header, file_len))
}

fn read_header(path: &Path, file: &File) -> Result<(Header, u64), Qcow2Error> {
    let io = |op: &'static str| {
        move |source| Qcow2Error::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    let file_len = file.metadata().map_err(io("read its metadata"))?.len();
    let mut buf = vec![0u8; file_len.min(2 << 20) as usize];
    file.read_exact_at(&mut buf, 0)
        .map_err(io("read its header"))?;
    let header = Header::parse(&buf, file_len).map_err(|source| Qcow2Error::Header {
        path: path.to_path_buf(),
        source,
    })?;
    Ok((header, file_len))
}

/// Refuses what this implementation does not handle, naming it.
fn check_features(path: &Path, h: &Header, read_only: bool) -> Result<(), Qcow2Error> {
    let unsupported = |feature| Qcow2Error::Unsupported {
        path: path.to_path_buf(),
        feature,
    };
    let inc = h.incompatible;
    if inc & INCOMPAT_CORRUPT != 0 {
        return Err(Qcow2Error::Corrupt {
            path: path.to_path_buf(),
        });
    }
    if inc & INCOMPAT_DATA_FILE != 0 {
        return Err(unsupported("an external data file"));
    }
    let known = INCOMPAT_DIRTY
        | INCOMPAT_CORRUPT
        | INCOMPAT_DATA_FILE
        | INCOMPAT_COMPRESSION
        | INCOMPAT_EXTL2;
    if inc & !known != 0 {
        return Err(unsupported("an unknown incompatible feature"));
    }
    if h.crypt_method != 0 {
        return Err(unsupported(
            "qcow2's own encryption (use encrypt=luks on a plain image)",
        ));
    }
    if h.nb_snapshots != 0 && !read_only {
        return Err(unsupported("writing an image with internal snapshots"));
    }
    Ok(())
}
