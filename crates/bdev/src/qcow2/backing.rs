//! The backing chain: a raw file or another qcow2 image (read only), whose data
//! shows through where an image has no cluster of its own. A relative name is
//! resolved against the directory of the image that names it, as QEMU does;
//! loops and chains deeper than [`MAX_CHAIN`] are refused at open. Reads past a
//! shorter backing file's end are zeroes.

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::error::Qcow2Error;
use super::header::{Header, MAGIC};
use super::image::{Image, OpenOpts};
use crate::image_lock::{ImageLock, Perms};

/// The deepest backing chain opened.
pub const MAX_CHAIN: usize = 32;

pub(super) enum Backing {
    Raw {
        path: PathBuf,
        file: Arc<File>,
        len: u64,
        /// QEMU's locks of a backing file (none with `locking=off`).
        _lock: Option<ImageLock>,
    },
    Qcow2(Box<Image>),
}

impl Backing {
    /// The backing file `h` names for the image at `path`, opened read-only.
    pub(super) fn open(
        path: &Path,
        h: &Header,
        o: OpenOpts,
        seen: &mut Vec<PathBuf>,
    ) -> Result<Option<Backing>, Qcow2Error> {
        let Some(name) = &h.backing_file else {
            return Ok(None);
        };
        let me = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        seen.push(me);
        if seen.len() > MAX_CHAIN {
            return Err(Qcow2Error::ChainTooDeep {
                path: path.to_path_buf(),
                max: MAX_CHAIN,
            });
        }
        let name = Path::new(name);
        let target = if name.is_absolute() {
            name.to_path_buf()
        } else {
            path.parent().unwrap_or(Path::new(".")).join(name)
        };
        let io = |op: &'static str| {
            let target = target.clone();
            move |source| Qcow2Error::Io {
                path: target,
                op,
                source,
            }
        };
        let canon = std::fs::canonicalize(&target).map_err(io("find the backing file"))?;
        if seen.contains(&canon) {
            return Err(Qcow2Error::BackingLoop {
                path: path.to_path_buf(),
            });
        }
        // A FIFO or a character device would block or never end.
        let meta = std::fs::metadata(&canon).map_err(io("read the backing file's metadata"))?;
        if !meta.is_file() && !meta.file_type().is_block_device() {
            return Err(Qcow2Error::Unsupported {
                path: target,
                feature: "a backing file that is not a regular file or block device",
            });
        }
        let file = File::open(&target).map_err(io("open the backing file"))?;
        let mut magic = [0u8; 4];
        let is_qcow2 = match h.backing_format.as_deref() {
            Some("qcow2") => true,
            Some("raw") => false,
            Some(_) => {
                return Err(Qcow2Error::Unsupported {
                    path: target,
                    feature: "a backing format other than raw or qcow2",
                })
            }
            None => file.read_exact_at(&mut magic, 0).is_ok() && u32::from_be_bytes(magic) == MAGIC,
        };
        if is_qcow2 {
            // Whether or not the top image is active, its base is read by both
            // processes of a migration alike.
            let ro = OpenOpts {
                read_only: true,
                inactive: false,
                ..o
            };
            return Ok(Some(Backing::Qcow2(Box::new(Image::open(
                &target, ro, seen,
            )?))));
        }
        // A block device's length is its end, not its metadata's.
        let len = (&file)
            .seek(SeekFrom::End(0))
            .map_err(io("find the backing file's end"))?;
        let lock = match o.locking {
            true => Some(
                ImageLock::acquire(&file, &target, Perms::READER)
                    .map_err(io("lock the backing file"))?,
            ),
            false => None,
        };
        Ok(Some(Backing::Raw {
            path: target,
            file: Arc::new(file),
            len,
            _lock: lock,
        }))
    }

    /// Reads `buf.len()` bytes at `offset` (zeroes past the backing's end).
    pub(super) fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let size = self.size();
        let have = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[have..].fill(0);
        if have == 0 {
            return Ok(());
        }
        match self {
            Backing::Raw { file, .. } => file.read_exact_at(&mut buf[..have], offset),
            Backing::Qcow2(img) => img.read_sync(offset, &mut buf[..have]),
        }
    }

    pub(super) fn size(&self) -> u64 {
        match self {
            Backing::Raw { len, .. } => *len,
            Backing::Qcow2(img) => img.header.size,
        }
    }

    /// The chain below this image, top first (`format:path`).
    pub(super) fn chain(&self, out: &mut Vec<String>) {
        match self {
            Backing::Raw { path, .. } => out.push(format!("raw:{}", path.display())),
            Backing::Qcow2(img) => {
                out.push(format!("qcow2:{}", img.path.display()));
                if let Some(b) = &img.backing {
                    b.chain(out);
                }
            }
        }
    }
}
