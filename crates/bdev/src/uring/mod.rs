//! Files and block devices through io_uring: one ring per channel (= per reactor),
//! the file registered as a fixed descriptor, preallocated per-request slots.
//!
//! * O_DIRECT by default; if the filesystem refuses it (open or a probe read fails
//!   with EINVAL), the disk falls back to buffered I/O with a warning, and
//!   `describe()` shows which mode is in effect.
//! * With O_DIRECT, a request whose guest buffers (base or length) are not
//!   512-aligned goes through a per-slot aligned bounce buffer (copied in before a
//!   write, out after a read). The buffer grows to the request size; buffers above
//!   [`channel::KEEP_BOUNCE`] are freed after the request, smaller ones are kept.
//! * Short reads/writes are resubmitted for the rest; a zero-byte result (EOF,
//!   e.g. the file shrank) ends the request with ReadError/IoError.
//! * WriteZeroes uses FALLOC_FL_ZERO_RANGE; on EOPNOTSUPP/EINVAL it writes zeroes
//!   synchronously. Discard punches a hole (KEEP_SIZE); EOPNOTSUPP is treated as
//!   a successful no-op hint (block devices report `discard_zeroes = false`).
//! * Engine: io_uring, or *inline* (each request one synchronous `preadv2`/
//!   `pwritev2`/`fdatasync`/`fallocate` inside `submit`). `Auto` picks inline only
//!   for files on a memory filesystem whose reads io_uring would hand to a kernel
//!   worker thread (no FMODE_NOWAIT, e.g. tmpfs before Linux 6.x gained it): there
//!   the I/O is a page-cache copy that cannot wait for a device, and the worker
//!   handoff costs more than the copy (docs/decisions/0009-inline-memory-files.md).

mod channel;
mod sys;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{BlockDevice, BlockInfo, GeometryError, IoChannel};

/// How a [`FileDisk`] issues I/O.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FileEngine {
    /// Inline for memory-backed files io_uring would punt to workers, else io_uring.
    #[default]
    Auto,
    Uring,
    /// Synchronous system calls on the calling (reactor) thread. Only sensible when
    /// the I/O cannot block for long: a tmpfs page swapped out stalls the reactor.
    Inline,
}

impl std::str::FromStr for FileEngine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(FileEngine::Auto),
            "uring" | "io_uring" => Ok(FileEngine::Uring),
            "inline" => Ok(FileEngine::Inline),
            _ => Err(format!("unknown I/O engine {s:?} (auto, uring or inline)")),
        }
    }
}

/// How to open a [`FileDisk`].
#[derive(Clone, Debug)]
pub struct FileOptions {
    /// Bypass the page cache (O_DIRECT); falls back to buffered if refused.
    pub direct: bool,
    pub read_only: bool,
    /// 512 or 4096; default 512 for files, the logical block size for devices.
    pub block_size: Option<u32>,
    pub engine: FileEngine,
}

impl Default for FileOptions {
    fn default() -> Self {
        FileOptions {
            direct: true,
            read_only: false,
            block_size: None,
            engine: FileEngine::Auto,
        }
    }
}

/// A regular file or a block device served through io_uring.
pub struct FileDisk {
    path: PathBuf,
    file: Arc<File>,
    info: BlockInfo,
    /// The smallest block size I/O works with: the device's logical sector size
    /// for a block device, the O_DIRECT alignment for a direct file, else 512.
    /// Requests need only be aligned to this, so the disk can present any
    /// multiple of it (Format NVM).
    align: u32,
    direct: bool,
    blkdev: bool,
    inline: bool,
}

/// Why a file or block device cannot be opened or resized.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{}: cannot {op}", path.display())]
    Io {
        path: PathBuf,
        op: FileOp,
        #[source]
        source: io::Error,
    },
    #[error("{}: not a regular file or block device", path.display())]
    NotFileOrDevice { path: PathBuf },
    #[error("{}: cannot be served with this size or block size", path.display())]
    Geometry {
        path: PathBuf,
        #[source]
        source: GeometryError,
    },
    #[error("{}: block size {block_size} is below the device's {device_block_size}", path.display())]
    BelowDevice {
        path: PathBuf,
        block_size: u32,
        device_block_size: u32,
    },
    #[error(
        "{}: {asked} bytes asked, the {} has {has} and keeps that size",
        path.display(),
        if *block_device { "block device" } else { "read-only file" }
    )]
    KeepsSize {
        path: PathBuf,
        asked: u64,
        has: u64,
        block_device: bool,
    },
}

/// What a [`FileError::Io`] was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOp {
    Stat,
    Open,
    ReadGeometry,
    SetLen,
}

impl std::fmt::Display for FileOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileOp::Stat => "read its metadata",
            FileOp::Open => "open it",
            FileOp::ReadGeometry => "read the block device's size and sector size",
            FileOp::SetLen => "change its size",
        })
    }
}

impl From<FileError> for io::Error {
    fn from(e: FileError) -> io::Error {
        let kind = match &e {
            FileError::Io { source, .. } => source.kind(),
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

/// `f` for `op` on `path`, typed.
fn file_op(path: &Path, op: FileOp) -> impl FnOnce(io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

fn open_file(path: &Path, read_only: bool, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(!read_only);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Does an aligned O_DIRECT read of one block work? (tmpfs and some FUSE
/// filesystems refuse O_DIRECT, at open or at the first I/O.)
fn direct_works(f: &File, block_size: u32) -> bool {
    let mut buf = sys::AlignedBuf::new(block_size as usize);
    let b = &mut buf.as_mut_slice()[..block_size as usize];
    f.read_at(b, 0).is_ok()
}

impl FileDisk {
    pub fn open(path: impl AsRef<Path>, opts: FileOptions) -> Result<FileDisk, FileError> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(file_op(path, FileOp::Stat))?;
        let ft = meta.file_type();
        let blkdev = ft.is_block_device();
        if !blkdev && !ft.is_file() {
            return Err(FileError::NotFileOrDevice {
                path: path.to_path_buf(),
            });
        }
        let mut direct = opts.direct;
        let mut file = match open_file(path, opts.read_only, direct) {
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path = %path.display(), "O_DIRECT refused; using buffered I/O");
                direct = false;
                open_file(path, opts.read_only, false)
            }
            r => r,
        }
        .map_err(file_op(path, FileOp::Open))?;
        let (size, dev_bs) = if blkdev {
            sys::blkdev_geometry(&file).map_err(file_op(path, FileOp::ReadGeometry))?
        } else {
            (meta.len(), 512)
        };
        let block_size = opts.block_size.unwrap_or(dev_bs);
        let geometry = |source| FileError::Geometry {
            path: path.to_path_buf(),
            source,
        };
        GeometryError::check_block_size(block_size).map_err(geometry)?;
        if blkdev && block_size < dev_bs {
            return Err(FileError::BelowDevice {
                path: path.to_path_buf(),
                block_size,
                device_block_size: dev_bs,
            });
        }
        GeometryError::check_size(size, u64::from(block_size)).map_err(geometry)?;
        if direct && !direct_works(&file, block_size) {
            tracing::warn!(path = %path.display(), "O_DIRECT I/O fails; using buffered I/O");
            direct = false;
            file = open_file(path, opts.read_only, false).map_err(file_op(path, FileOp::Open))?;
        }
        // A block size above what I/O needs (bs=4096 on a 512-byte device or
        // filesystem) leaves room to present smaller blocks later.
        let align = if blkdev {
            dev_bs
        } else if direct && block_size > 512 && !direct_works(&file, 512) {
            block_size
        } else {
            512
        };
        // A block device node sits on devtmpfs, which looks memory backed.
        let inline = match opts.engine {
            FileEngine::Auto if blkdev => false,
            e => resolve_engine(&file, e) == FileEngine::Inline,
        };
        let info = BlockInfo {
            block_size,
            num_blocks: size / u64::from(block_size),
            volatile: false,
            write_cache: true,
            read_only: opts.read_only,
            discard: true,
            write_zeroes: true,
            discard_zeroes: !blkdev,
        };
        Ok(FileDisk {
            path: path.to_path_buf(),
            file: Arc::new(file),
            info,
            align,
            direct,
            blkdev,
            inline,
        })
    }

    /// Whether O_DIRECT is actually in effect.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Whether the inline engine is in effect (see [`FileEngine`]).
    pub fn inline(&self) -> bool {
        self.inline
    }

    /// The smallest block size its I/O works with (512 or 4096).
    pub fn alignment(&self) -> u32 {
        self.align
    }
}

impl BlockDevice for FileDisk {
    fn describe(&self) -> String {
        format!(
            "{}:{}:{}:bs={}{}{}",
            if self.inline { "inline" } else { "uring" },
            if self.blkdev { "bdev" } else { "file" },
            self.path.display(),
            self.info.block_size,
            if self.direct { ":direct" } else { ":buffered" },
            if self.info.read_only { ":ro" } else { "" },
        )
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(channel::UringChannel::new(
            self.file.clone(),
            &self.info,
            self.align,
            self.direct,
            self.inline,
        )?))
    }
    /// A regular file is set to `bytes` (`set_len`: it grows, or is truncated,
    /// which drops the data past the new end; a read-only one only takes the size
    /// it has). A block device cannot change its size from here: it takes only the
    /// size the device has now (grow the volume first, e.g. `lvextend`, then the
    /// disk).
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(self.resized(bytes)?))
    }
    fn format_support(&self) -> crate::FormatSupport {
        crate::FormatSupport::Exclusive {
            min_block_size: self.align,
        }
    }
}

impl FileDisk {
    /// [`BlockDevice::resize`], typed.
    fn resized(&self, bytes: u64) -> Result<FileDisk, FileError> {
        let path = &self.path;
        let info = self
            .info
            .resized(bytes)
            .map_err(|source| FileError::Geometry {
                path: path.clone(),
                source,
            })?;
        let have = if self.blkdev {
            sys::blkdev_geometry(&self.file)
                .map_err(file_op(path, FileOp::ReadGeometry))?
                .0
        } else {
            self.file
                .metadata()
                .map_err(file_op(path, FileOp::Stat))?
                .len()
        };
        if bytes != have {
            if self.blkdev || self.info.read_only {
                return Err(FileError::KeepsSize {
                    path: path.clone(),
                    asked: bytes,
                    has: have,
                    block_device: self.blkdev,
                });
            }
            self.file
                .set_len(bytes)
                .map_err(file_op(path, FileOp::SetLen))?;
        }
        Ok(FileDisk {
            path: path.clone(),
            file: self.file.clone(),
            info,
            direct: self.direct,
            blkdev: self.blkdev,
            inline: self.inline,
            align: self.align,
        })
    }
}

/// `engine` with `Auto` decided for `file` (inline where io_uring would hand its
/// reads to kernel workers). The decision probes the file with a read, which a
/// data-plane thread's system-call filter may not allow: decide on the control
/// path and give the channels the answer.
pub(crate) fn resolve_engine(file: &File, engine: FileEngine) -> FileEngine {
    match engine {
        FileEngine::Auto if sys::memory_backed(file) && sys::reads_punted(file) => {
            FileEngine::Inline
        }
        FileEngine::Auto => FileEngine::Uring,
        e => e,
    }
}

/// A channel that reads and writes `file` at any offset the caller computed
/// (a qcow2 image's data clusters: the caller checks ranges against its own
/// metadata), buffered, with `engine` chosen as for a [`FileDisk`].
pub(crate) fn data_channel(
    file: Arc<File>,
    engine: FileEngine,
    read_only: bool,
) -> io::Result<Box<dyn IoChannel>> {
    let inline = resolve_engine(&file, engine) == FileEngine::Inline;
    let info = BlockInfo {
        block_size: 512,
        // The channel's range check passes everything below 2^62 bytes.
        num_blocks: 1 << 53,
        volatile: false,
        write_cache: true,
        read_only,
        discard: false,
        write_zeroes: false,
        discard_zeroes: false,
    };
    Ok(Box::new(channel::UringChannel::new(
        file, &info, 512, false, inline,
    )?))
}

/// Gives `len` bytes at `offset` of `file` back to the filesystem (a hint: errors
/// are ignored, the data reads as before or as zeroes).
pub(crate) fn punch(file: &File, offset: u64, len: u64) {
    let _ = sys::fallocate(
        file,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        offset,
        len,
    );
}
