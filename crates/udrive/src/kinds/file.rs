//! `file:PATH` — a regular file or block device through io_uring. Options:
//! `direct=on|off` (O_DIRECT, default on), `engine=auto|uring|inline` (default
//! auto: inline only for memory-filesystem files that io_uring would hand to kernel
//! workers, see `bdev::FileEngine`), and `ro`.

use std::io::Seek;
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use bdev::{BlockDevice, FileDisk, FileEngine, FileOptions, RangeClaim};

use super::kind::{BackendKind, Backing, KindSpec, OpenEnv};

pub struct File;

#[derive(Debug)]
struct FileSpec {
    path: PathBuf,
    direct: bool,
    engine: FileEngine,
}

impl BackendKind for File {
    fn name(&self) -> &'static str {
        "file"
    }
    fn example(&self) -> &'static str {
        "file:/var/lib/vm1.img"
    }
    fn options(&self) -> &'static [&'static str] {
        &["direct", "engine"]
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
            return Err(format!("file needs a path, e.g. {}", self.example()));
        }
        let mut spec = FileSpec {
            path: PathBuf::from(arg),
            direct: true,
            engine: FileEngine::default(),
        };
        for &(k, v) in opts {
            match k {
                "direct" => {
                    spec.direct = match v {
                        "on" => true,
                        "off" => false,
                        _ => return Err("direct must be on or off".into()),
                    }
                }
                "engine" => spec.engine = v.parse()?,
                _ => {}
            }
        }
        Ok(Arc::new(spec))
    }
}

impl FileSpec {
    fn canonical_path(&self) -> Result<PathBuf> {
        std::fs::canonicalize(&self.path)
            .with_context(|| format!("file {} does not exist", self.path.display()))
    }
}

impl KindSpec for FileSpec {
    fn fs_paths(&self) -> Vec<(PathBuf, bool)> {
        super::kind::file_paths(&self.path)
    }
    fn canonical(&self) -> Option<String> {
        None
    }
    fn backing(&self) -> Result<Option<Backing>> {
        let path = self.canonical_path()?;
        let resource = path.display().to_string();
        Ok(Some(Backing {
            open_key: format!("{resource}\0{}\0{:?}", self.direct, self.engine),
            resource,
        }))
    }
    fn check(&self, read_only: bool, problems: &mut Vec<String>) -> Option<u64> {
        let path = match self.canonical_path() {
            Ok(p) => p,
            Err(e) => {
                problems.push(format!("{e:#}"));
                return None;
            }
        };
        let kind = std::fs::metadata(&path).map(|m| m.file_type());
        if !kind
            .as_ref()
            .is_ok_and(|t| t.is_file() || t.is_block_device())
        {
            problems.push(format!(
                "{} is neither a regular file nor a block device",
                path.display()
            ));
            return None;
        }
        let mut access = nix::unistd::AccessFlags::R_OK;
        if !read_only {
            access |= nix::unistd::AccessFlags::W_OK;
        }
        if let Err(e) = nix::unistd::access(&path, access) {
            let how = if read_only { "read" } else { "read and write" };
            problems.push(format!("cannot {how} {}: {e}", path.display()));
            return None;
        }
        // The end of a block device is its size; its metadata says 0.
        let size = std::fs::File::open(&path).and_then(|mut f| f.seek(std::io::SeekFrom::End(0)));
        match size {
            Ok(s) => Some(s),
            Err(e) => {
                problems.push(format!("cannot open {}: {e}", path.display()));
                None
            }
        }
    }
    fn open(
        &self,
        _env: &dyn OpenEnv,
        block_size: Option<u32>,
        read_only: bool,
    ) -> Result<Arc<dyn BlockDevice>> {
        let opts = FileOptions {
            direct: self.direct,
            read_only,
            block_size,
            engine: self.engine,
        };
        Ok(Arc::new(FileDisk::open(self.canonical_path()?, opts)?))
    }
    /// A lock on the device's byte range of the file (`bdev::RangeClaim`).
    fn writer_claim(
        &self,
        _disk: &Arc<dyn BlockDevice>,
        (offset, len): (u64, u64),
    ) -> Result<Option<Arc<dyn bdev::WriterClaim>>> {
        let path = self.canonical_path()?;
        let claim = RangeClaim::new(path.clone(), offset, len)
            .with_context(|| format!("cannot open {} for its writer lock", path.display()))?;
        Ok(Some(Arc::new(claim)))
    }
}
