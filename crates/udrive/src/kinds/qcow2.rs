//! `qcow2:PATH` — a qcow2 image (version 3, as QEMU writes it) served on the
//! io_uring file engine (`bdev::Qcow2Disk`, docs/decisions/0038-qcow2.md).
//! Options: `create=SIZE` (make the image if the file is missing or empty; an
//! existing image is opened as it is), with `backing=PATH` (relative to the
//! image's directory, as QEMU resolves it) and `cluster=SIZE` (default 64K);
//! `l2-cache=SIZE` (bytes of L2 tables in memory, default 2M), `engine=` as for
//! `file:`, `locking=off` (no QEMU image locks, as QEMU's `file.locking=off`:
//! docs/decisions/0044-image-locking.md), and `ro`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use bdev::{create_qcow2, BlockDevice, FileEngine, Qcow2Create, Qcow2Disk, Qcow2Options};

use super::kind::{BackendKind, Backing, KindSpec, OpenEnv};
use crate::size::parse_size;

pub struct Qcow2;

#[derive(Debug)]
struct Qcow2Spec {
    path: PathBuf,
    create: Option<Qcow2Create>,
    engine: FileEngine,
    l2_cache: u64,
    locking: bool,
}

impl BackendKind for Qcow2 {
    fn name(&self) -> &'static str {
        "qcow2"
    }
    fn example(&self) -> &'static str {
        "qcow2:/var/lib/vm1.qcow2"
    }
    fn options(&self) -> &'static [&'static str] {
        &[
            "create", "backing", "cluster", "l2-cache", "engine", "locking",
        ]
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
        if arg.is_empty() {
            return Err(format!("qcow2 needs a path, e.g. {}", self.example()));
        }
        let mut spec = Qcow2Spec {
            path: PathBuf::from(arg),
            create: None,
            engine: FileEngine::default(),
            l2_cache: bdev::QCOW2_DEFAULT_L2_CACHE,
            locking: true,
        };
        let (mut backing, mut cluster) = (None, None);
        for &(k, v) in opts {
            let size = || parse_size(v).map_err(|e| format!("{k}: {e}"));
            match k {
                "create" => {
                    spec.create = Some(Qcow2Create {
                        size: size()?,
                        cluster_size: 64 << 10,
                        backing: None,
                    })
                }
                "backing" if !v.is_empty() => backing = Some(v.to_string()),
                "backing" => return Err("backing needs a path".into()),
                "cluster" => cluster = Some(size()?),
                "l2-cache" => spec.l2_cache = size()?,
                "engine" => spec.engine = v.parse()?,
                "locking" => {
                    spec.locking = match v {
                        "on" => true,
                        "off" => false,
                        _ => return Err(format!("locking={v}: on or off")),
                    }
                }
                _ => {}
            }
        }
        match &mut spec.create {
            Some(c) => {
                c.backing = backing;
                c.cluster_size = cluster.unwrap_or(c.cluster_size);
            }
            None if backing.is_some() || cluster.is_some() => {
                return Err("backing= and cluster= go with create=SIZE".into())
            }
            None => {}
        }
        Ok(Arc::new(spec))
    }
}

impl Qcow2Spec {
    fn canonical_path(&self) -> Result<PathBuf> {
        std::fs::canonicalize(&self.path)
            .with_context(|| format!("qcow2 image {} does not exist", self.path.display()))
    }

    /// The image's path, created first if the spec says so.
    fn made(&self) -> Result<PathBuf> {
        if let Some(c) = &self.create {
            create_qcow2(&self.path, c)?;
        }
        self.canonical_path()
    }
}

fn will_be(path: &Path) -> String {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    dir.join(path.file_name().unwrap_or_default())
        .display()
        .to_string()
}

impl KindSpec for Qcow2Spec {
    fn fs_paths(&self) -> Vec<(PathBuf, bool)> {
        super::kind::file_paths(&self.path)
    }
    fn canonical(&self) -> Option<String> {
        None
    }
    fn backing(&self) -> Result<Option<Backing>> {
        let resource = match self.canonical_path() {
            Ok(p) => p.display().to_string(),
            Err(_) if self.create.is_some() => will_be(&self.path),
            Err(e) => return Err(e),
        };
        Ok(Some(Backing {
            open_key: format!(
                "{resource}\0qcow2\0{:?}\0{}\0{}",
                self.engine, self.l2_cache, self.locking
            ),
            resource,
        }))
    }
    fn check(&self, read_only: bool, problems: &mut Vec<String>) -> Option<u64> {
        if self.create.is_some() && !self.path.exists() {
            return self.create.as_ref().map(|c| c.size);
        }
        // A look at the header and tables, as `qemu-img info -U`: the image may
        // be served right now.
        let opts = Qcow2Options {
            read_only: true,
            locking: false,
            ..Default::default()
        };
        match Qcow2Disk::open(&self.path, opts) {
            Ok(d) => {
                if !read_only {
                    if let Err(e) = nix::unistd::access(&self.path, nix::unistd::AccessFlags::W_OK)
                    {
                        problems.push(format!("cannot write {}: {e}", self.path.display()));
                    }
                }
                Some(d.status().virtual_size)
            }
            Err(e) => {
                problems.push(format!("{:#}", outside_allowed(e)));
                None
            }
        }
    }
    fn open(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
        read_only: bool,
    ) -> Result<Arc<dyn BlockDevice>> {
        self.open_as(env, block_size, read_only, false)
    }
    /// Opens the image without writing or locking it: the source writes it
    /// until the device's claim is taken (`bdev::Qcow2Claim`).
    fn open_incoming(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
    ) -> Result<Arc<dyn BlockDevice>> {
        self.open_as(env, block_size, false, true)
    }
    fn shared_refusal(&self) -> Option<&'static str> {
        Some(
            "a qcow2 image has one writer at a time (its metadata is cached by the process \
             that writes it); for a migration, leave `shared` out: the image moves with the VM",
        )
    }
    fn writer_claim(
        &self,
        disk: &Arc<dyn BlockDevice>,
        _range: (u64, u64),
    ) -> Result<Option<Arc<dyn bdev::WriterClaim>>> {
        let claim = disk
            .as_any()
            .and_then(|d| d.downcast_ref::<Qcow2Disk>())
            .map(|d| Arc::new(d.claim()) as Arc<dyn bdev::WriterClaim>);
        Ok(claim)
    }
}

impl Qcow2Spec {
    fn open_as(
        &self,
        env: &dyn OpenEnv,
        block_size: Option<u32>,
        read_only: bool,
        inactive: bool,
    ) -> Result<Arc<dyn BlockDevice>> {
        let opts = Qcow2Options {
            read_only,
            block_size,
            engine: self.engine,
            l2_cache: self.l2_cache,
            inactive,
            locking: self.locking,
        };
        let spec = self.made()?;
        let disk = match env.served_instead(&spec) {
            Some(active) => Qcow2Disk::open_serving(&active, &spec, opts),
            None => Qcow2Disk::open(&spec, opts),
        };
        Ok(Arc::new(disk.map_err(outside_allowed)?))
    }
}

/// An image's header names its backing file: one the server's Landlock rules
/// keep it from opening is said to be so (the kernel says only "permission
/// denied").
fn outside_allowed(e: bdev::Qcow2Error) -> anyhow::Error {
    if let bdev::Qcow2Error::Io { path, source, .. } = &e {
        if source.kind() == std::io::ErrorKind::PermissionDenied {
            if let Err(why) = crate::fs_allowed::check_paths(vec![(path.clone(), false)]) {
                return why.context("a backing file of the image");
            }
        }
    }
    e.into()
}
