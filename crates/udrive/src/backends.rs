//! Opens every namespace's backend before any socket exists, so configuration
//! mistakes (missing file, slice past the end, overlapping slices) stop start-up
//! cleanly. Namespaces on the same file share one opened `FileDisk`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bdev::{BlockDevice, FileDisk, FileOptions, NullDisk, QosDisk, RamDisk, SliceDisk};

use crate::config::ControllerConfig;
use crate::nsspec::{NsKind, NsSpec};

/// Backends per controller, in namespace order.
pub type Backends = Vec<Vec<Arc<dyn BlockDevice>>>;

struct FileUse {
    path: PathBuf,
    range: (u64, u64),
    writable: bool,
    shared: bool,
    who: String,
}

pub fn open_all(controllers: &[ControllerConfig]) -> Result<Backends> {
    Ok(open_with_disks(controllers, &[])?.0)
}

/// NVMe namespaces plus vhost-user-blk disks (`(who, spec)`), opened together so
/// that a file is opened once and overlapping slices are caught across both kinds.
pub fn open_with_disks(
    controllers: &[ControllerConfig],
    disks: &[(String, &NsSpec)],
) -> Result<(Backends, Vec<Arc<dyn BlockDevice>>)> {
    let mut files: HashMap<(PathBuf, bool, bool), Arc<FileDisk>> = HashMap::new();
    let mut uses: Vec<FileUse> = Vec::new();
    let mut out = Vec::new();
    for c in controllers {
        let mut devs = Vec::new();
        for (i, ns) in c.namespaces.iter().enumerate() {
            let who = format!("namespace {} ({ns}) of {}", i + 1, c.socket.display());
            let dev = open_one(ns, &mut files, &mut uses, &who).with_context(|| who.clone())?;
            devs.push(dev);
        }
        out.push(devs);
    }
    let mut disk_devs = Vec::new();
    for (who, spec) in disks {
        let dev = open_one(spec, &mut files, &mut uses, who).with_context(|| who.clone())?;
        disk_devs.push(dev);
    }
    check_overlaps(&uses)?;
    Ok((out, disk_devs))
}

fn open_one(
    ns: &NsSpec,
    files: &mut HashMap<(PathBuf, bool, bool), Arc<FileDisk>>,
    uses: &mut Vec<FileUse>,
    who: &str,
) -> Result<Arc<dyn BlockDevice>> {
    let bs = ns.block_size.unwrap_or(512);
    let base: Arc<dyn BlockDevice> = match &ns.kind {
        NsKind::Null { size } => Arc::new(NullDisk::new(*size, bs)?),
        NsKind::Ram { size } => Arc::new(
            RamDisk::new(*size, bs).with_context(|| format!("cannot reserve {size} bytes"))?,
        ),
        NsKind::File { path, direct } => {
            let canon = std::fs::canonicalize(path)
                .with_context(|| format!("file {} does not exist", path.display()))?;
            let key = (canon.clone(), *direct, ns.read_only);
            let disk = match files.get(&key) {
                Some(d) => d.clone(),
                None => {
                    let opts = FileOptions {
                        direct: *direct,
                        read_only: ns.read_only,
                        block_size: ns.block_size,
                    };
                    let d = Arc::new(FileDisk::open(&canon, opts)?);
                    files.insert(key, d.clone());
                    d
                }
            };
            let total = disk.info().size_bytes();
            let (off, len) = slice_range(ns, total)?;
            uses.push(FileUse {
                path: canon,
                range: (off, len),
                writable: !ns.read_only,
                shared: ns.shared,
                who: who.to_string(),
            });
            disk
        }
    };
    let mut dev = base;
    if ns.slice.is_some() {
        let (off, len) = slice_range(ns, dev.info().size_bytes())?;
        dev = Arc::new(SliceDisk::new(dev, off, len)?);
    }
    let q = ns.qos;
    if [
        q.iops,
        q.read_iops,
        q.write_iops,
        q.bw_bytes,
        q.read_bw,
        q.write_bw,
    ]
    .iter()
    .any(Option::is_some)
    {
        dev = Arc::new(QosDisk::new(dev, q)?);
    }
    Ok(dev)
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

fn check_overlaps(uses: &[FileUse]) -> Result<()> {
    for (i, a) in uses.iter().enumerate() {
        for b in &uses[i + 1..] {
            let both_shared = a.shared && b.shared;
            if a.path == b.path
                && (a.writable || b.writable)
                && !both_shared
                && bdev::overlaps(a.range, b.range)
            {
                bail!(
                    "{} and {} overlap on {} (bytes {}+{} and {}+{}): give them disjoint offset=/size= or mark both `shared`",
                    a.who,
                    b.who,
                    a.path.display(),
                    a.range.0,
                    a.range.1,
                    b.range.0,
                    b.range.1
                );
            }
        }
    }
    Ok(())
}
