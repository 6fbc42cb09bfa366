//! Creating an empty version 3 image (16-bit refcounts, QEMU's default layout:
//! header, refcount table, refcount blocks, L1 table), optionally over a
//! backing file whose format is recorded in the header.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::error::Qcow2Error;
use super::header::{Header, MAGIC, MAX_REFTABLE_BYTES, MAX_SIZE};
use super::meta::put_refcount;

/// What to create.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CreateOptions {
    /// Virtual size in bytes.
    pub size: u64,
    /// Cluster size: a power of two from 512 B to 2 MiB (QEMU's default 64 KiB).
    pub cluster_size: u64,
    /// The backing file, as written into the image (relative to its directory
    /// unless absolute).
    pub backing: Option<String>,
}

/// Creates an image at `path` if there is none: a missing or empty file
/// becomes one; a qcow2 image is left as it is (so the same spec opens the same
/// image at every start); anything else is refused ([`Qcow2Error::NotBlank`]).
/// Returns whether it created one.
pub fn create_qcow2(path: &Path, o: &CreateOptions) -> Result<bool, Qcow2Error> {
    let bad = |why: String| Qcow2Error::Create {
        path: path.to_path_buf(),
        why,
    };
    let io = |op: &'static str| {
        move |source| Qcow2Error::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    let cs = o.cluster_size;
    if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
        return Err(bad(format!(
            "cluster size {cs} is not a power of two from 512 to 2 MiB"
        )));
    }
    if o.size == 0 || o.size > MAX_SIZE {
        return Err(bad(format!("size {} is zero or above {MAX_SIZE}", o.size)));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io("open or create it"))?;
    let len = file.metadata().map_err(io("read its metadata"))?.len();
    if len > 0 {
        let mut magic = [0u8; 4];
        let ours = file.read_exact_at(&mut magic, 0).is_ok() && u32::from_be_bytes(magic) == MAGIC;
        return if ours {
            Ok(false)
        } else {
            Err(Qcow2Error::NotBlank {
                path: path.to_path_buf(),
            })
        };
    }
    let backing_format = match &o.backing {
        Some(b) => Some(probe_format(path, b)?),
        None => None,
    };
    let (header, clusters, refblocks) = layout(o, backing_format)?;
    let mut head = header.encode();
    if head.len() as u64 > cs {
        return Err(bad(
            "the backing file name does not fit in the header cluster".into(),
        ));
    }
    head.resize(cs as usize, 0);
    let rt = header.refcount_table_offset;
    let mut table = Vec::new();
    let mut blocks = vec![0u8; (refblocks * cs) as usize];
    let rb_bits = header.refblock_bits();
    for j in 0..refblocks {
        table.extend_from_slice(
            &(rt + (u64::from(header.refcount_table_clusters) + j) * cs).to_be_bytes(),
        );
    }
    for c in 0..clusters {
        let b = (c >> rb_bits) as usize;
        let i = (c & ((1 << rb_bits) - 1)) as usize;
        put_refcount(&mut blocks[b * cs as usize..(b + 1) * cs as usize], 4, i, 1);
    }
    file.set_len(clusters * cs).map_err(io("set its size"))?;
    file.write_all_at(&head, 0)
        .map_err(io("write its header"))?;
    file.write_all_at(&table, rt)
        .map_err(io("write its refcount table"))?;
    let rb_at = rt + u64::from(header.refcount_table_clusters) * cs;
    file.write_all_at(&blocks, rb_at)
        .map_err(io("write its refcount blocks"))?;
    file.sync_all().map_err(io("sync it"))?;
    Ok(true)
}

/// The header of a new image and how many clusters its metadata takes (header,
/// refcount table, refcount blocks, L1 table), of which refcount blocks.
fn layout(
    o: &CreateOptions,
    backing_format: Option<String>,
) -> Result<(Header, u64, u64), Qcow2Error> {
    let cs = o.cluster_size;
    let cluster_bits = cs.trailing_zeros();
    let l1_size = o.size.div_ceil(cs * (cs / 8));
    let l1_clusters = (l1_size * 8).div_ceil(cs);
    let per_block = cs * 8 / 16;
    // Enough refcount blocks (once allocated) for a fully allocated image: its
    // data, an L2 table per L1 entry, and room to spare.
    let most = o.size + l1_size * cs + (l1_clusters + 64) * cs;
    let table_entries = most.div_ceil(per_block * cs) * 2 + 1;
    let rt_clusters = (table_entries * 8)
        .div_ceil(cs)
        .min(MAX_REFTABLE_BYTES / cs);
    let mut refblocks = 1;
    loop {
        let n = 1 + rt_clusters + refblocks + l1_clusters;
        let need = n.div_ceil(per_block);
        if need <= refblocks {
            break;
        }
        refblocks = need;
    }
    let clusters = 1 + rt_clusters + refblocks + l1_clusters;
    let header = Header {
        cluster_bits,
        size: o.size,
        crypt_method: 0,
        l1_size: l1_size as u32,
        l1_offset: (1 + rt_clusters + refblocks) * cs,
        refcount_table_offset: cs,
        refcount_table_clusters: rt_clusters as u32,
        nb_snapshots: 0,
        incompatible: 0,
        compatible: 0,
        autoclear: 0,
        refcount_order: 4,
        header_length: 104,
        compression_type: 0,
        backing_file: o.backing.clone(),
        backing_format,
    };
    Ok((header, clusters, refblocks))
}

/// `raw` or `qcow2`: what the backing file (relative to the image's
/// directory) starts with.
fn probe_format(path: &Path, backing: &str) -> Result<String, Qcow2Error> {
    let b = Path::new(backing);
    let target = if b.is_absolute() {
        b.to_path_buf()
    } else {
        path.parent().unwrap_or(Path::new(".")).join(b)
    };
    let mut f = std::fs::File::open(&target).map_err(|source| Qcow2Error::Io {
        path: target.clone(),
        op: "open the backing file",
        source,
    })?;
    let mut magic = [0u8; 4];
    let qcow2 = f.read_exact(&mut magic).is_ok() && u32::from_be_bytes(magic) == MAGIC;
    Ok(if qcow2 { "qcow2" } else { "raw" }.to_string())
}
