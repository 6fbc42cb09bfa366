//! Why a qcow2 image cannot be opened or created. The I/O path never builds
//! these: it reports `IoStatus`.

use std::io;
use std::path::PathBuf;

/// What is wrong with a qcow2 image (or its backing chain), with its path.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    #[error("{}: cannot {op}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{}: not a qcow2 header udrive can serve", path.display())]
    Header {
        path: PathBuf,
        #[source]
        source: HeaderError,
    },
    #[error("{}: the image is marked dirty (lazy refcounts were not written back) and its refcounts could not be rebuilt: {source}; repair it with `qemu-img check -r all`", path.display())]
    Dirty {
        path: PathBuf,
        #[source]
        source: RepairError,
    },
    #[error("{}: the image is marked corrupt; repair it with `qemu-img check -r all`", path.display())]
    Corrupt { path: PathBuf },
    #[error("{}: {feature} is not supported", path.display())]
    Unsupported {
        path: PathBuf,
        feature: &'static str,
    },
    #[error("{}: backing chain deeper than {max} images", path.display())]
    ChainTooDeep { path: PathBuf, max: usize },
    #[error("{}: the backing chain comes back to this image (a loop)", path.display())]
    BackingLoop { path: PathBuf },
    #[error("{}: exists and is neither a qcow2 image nor empty; refusing to create an image over it", path.display())]
    NotBlank { path: PathBuf },
    #[error("{}: cannot create: {why}", path.display())]
    Create { path: PathBuf, why: String },
    #[error("{}: already exists; a snapshot is made into a new file", path.display())]
    Exists { path: PathBuf },
    #[error("{}: {why}", path.display())]
    Refused { path: PathBuf, why: String },
}

impl From<Qcow2Error> for io::Error {
    fn from(e: Qcow2Error) -> io::Error {
        let kind = match &e {
            Qcow2Error::Io { source, .. } => source.kind(),
            Qcow2Error::Unsupported { .. } => io::ErrorKind::Unsupported,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// What is wrong with a header's fields (the parser is pure: no path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("not a qcow2 image (bad magic)")]
    Magic,
    #[error("qcow2 version {0} (only version 3 is supported)")]
    Version(u32),
    #[error("header shorter than its fields ({0} bytes)")]
    Short(usize),
    #[error("cluster_bits {0} outside 9..=21")]
    ClusterBits(u32),
    #[error(
        "extended L2 entries with cluster_bits {0} (subclusters need clusters of 16 KiB or more)"
    )]
    Subclusters(u32),
    #[error("header length {0} is not a multiple of 8 between 104 and the cluster size")]
    HeaderLength(u32),
    #[error("virtual size {0} above the supported maximum")]
    Size(u64),
    #[error("refcount_order {0} above 6")]
    RefcountOrder(u32),
    #[error("{what} at {offset:#x} (+{len} bytes) is unaligned, overlaps the header or lies outside the {file_len}-byte file")]
    Table {
        what: &'static str,
        offset: u64,
        len: u64,
        file_len: u64,
    },
    #[error("L1 table of {l1_size} entries: {needed} needed for the virtual size, at most {max}")]
    L1Size { l1_size: u32, needed: u64, max: u64 },
    #[error("refcount table of {0} clusters is empty or above 8 MiB")]
    RefcountTableSize(u32),
    #[error("the L1 table and the refcount table overlap")]
    Overlap,
    #[error(
        "backing file name at {offset:#x} ({len} bytes) outside the header cluster or not UTF-8"
    )]
    BackingName { offset: u64, len: u32 },
    #[error("header extension at {0:#x} runs past the header cluster")]
    Extension(u64),
}

/// Why a dirty image could not be repaired.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{what} at {offset:#x} lies outside the file or is not cluster aligned")]
    Outside { what: &'static str, offset: u64 },
    #[error("the file has {0} clusters, more than a repair here counts")]
    TooLarge(u64),
    #[error("the image has {0}, which this repair does not count")]
    Unsupported(&'static str),
}
