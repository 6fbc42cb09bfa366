//! The qcow2 header (version 3, as QEMU writes it): a pure parser that checks
//! every field a hostile image controls against the file's length before
//! anything is read or allocated from it, and the encoder `create` uses.

use super::error::HeaderError;

pub(super) const MAGIC: u32 = 0x5146_49fb;
/// The fixed fields of a version 3 header.
pub(super) const V3_LEN: usize = 104;
/// QEMU's limits (`QCOW_MAX_L1_SIZE`, `QCOW_MAX_REFTABLE_SIZE`): they bound what
/// opening an image allocates.
pub(super) const MAX_L1_BYTES: u64 = 32 << 20;
pub(super) const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// The largest virtual size served (QEMU's own limit is 2^61; beyond 1 PiB the
/// L1 table alone leaves QEMU's bound for small clusters).
pub(super) const MAX_SIZE: u64 = 1 << 50;

/// Incompatible feature bits.
pub(super) const INCOMPAT_DIRTY: u64 = 1;
pub(super) const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub(super) const INCOMPAT_DATA_FILE: u64 = 1 << 2;
pub(super) const INCOMPAT_COMPRESSION: u64 = 1 << 3;
pub(super) const INCOMPAT_EXTL2: u64 = 1 << 4;

/// Header extension types.
const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;

/// A parsed, checked header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub cluster_bits: u32,
    pub size: u64,
    pub crypt_method: u32,
    pub l1_size: u32,
    pub l1_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub incompatible: u64,
    pub compatible: u64,
    pub autoclear: u64,
    pub refcount_order: u32,
    pub header_length: u32,
    /// How compressed clusters are compressed: 0 deflate, 1 zstd.
    pub compression_type: u8,
    /// The backing file's name as written (relative to the image's directory
    /// unless absolute).
    pub backing_file: Option<String>,
    /// The backing format extension (`raw`, `qcow2`), if present.
    pub backing_format: Option<String>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}

impl Header {
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }
    /// L2 entries per table (one cluster per table; 8 bytes each, 16 with
    /// extended L2 entries).
    pub fn l2_bits(&self) -> u32 {
        self.cluster_bits - 3 - u32::from(self.extended_l2())
    }
    /// Whether L2 entries carry subcluster bitmaps (`extended_l2=on`).
    pub fn extended_l2(&self) -> bool {
        self.incompatible & INCOMPAT_EXTL2 != 0
    }
    /// Refcount entries per refcount block.
    pub fn refblock_bits(&self) -> u32 {
        self.cluster_bits + 3 - self.refcount_order
    }

    /// Parses the start of an image (`buf`: its first cluster, or the whole file
    /// if shorter) of `file_len` bytes.
    pub fn parse(buf: &[u8], file_len: u64) -> Result<Header, HeaderError> {
        if buf.len() < 8 || be32(buf, 0) != MAGIC {
            return Err(HeaderError::Magic);
        }
        let version = be32(buf, 4);
        if version != 3 {
            return Err(HeaderError::Version(version));
        }
        if buf.len() < V3_LEN {
            return Err(HeaderError::Short(buf.len()));
        }
        let cluster_bits = be32(buf, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(HeaderError::ClusterBits(cluster_bits));
        }
        let header_length = be32(buf, 100);
        let cs = 1u64 << cluster_bits;
        // Extensions and the backing name live in the first cluster.
        let buf = &buf[..buf.len().min(cs as usize)];
        if (header_length as usize) < V3_LEN
            || !header_length.is_multiple_of(8)
            || u64::from(header_length) > cs
            || header_length as usize > buf.len()
        {
            return Err(HeaderError::HeaderLength(header_length));
        }
        let mut h = Header {
            cluster_bits,
            size: be64(buf, 24),
            crypt_method: be32(buf, 32),
            l1_size: be32(buf, 36),
            l1_offset: be64(buf, 40),
            refcount_table_offset: be64(buf, 48),
            refcount_table_clusters: be32(buf, 56),
            nb_snapshots: be32(buf, 60),
            incompatible: be64(buf, 72),
            compatible: be64(buf, 80),
            autoclear: be64(buf, 88),
            refcount_order: be32(buf, 96),
            header_length,
            compression_type: if header_length > 104 { buf[104] } else { 0 },
            backing_file: None,
            backing_format: None,
        };
        // 32 subclusters of at least 512 bytes (QEMU's minimum of 16 KiB).
        if h.extended_l2() && cluster_bits < 14 {
            return Err(HeaderError::Subclusters(cluster_bits));
        }
        h.check_tables(file_len)?;
        h.backing_file = backing_name(buf, cs)?;
        h.backing_format = backing_format(buf, header_length as usize)?;
        Ok(h)
    }

    /// The sizes and places of the L1 and refcount tables.
    fn check_tables(&self, file_len: u64) -> Result<(), HeaderError> {
        if self.size > MAX_SIZE {
            return Err(HeaderError::Size(self.size));
        }
        if self.refcount_order > 6 {
            return Err(HeaderError::RefcountOrder(self.refcount_order));
        }
        let cs = self.cluster_size();
        let per_l1 = cs << self.l2_bits();
        let needed = self.size.div_ceil(per_l1);
        let max = MAX_L1_BYTES / 8;
        if u64::from(self.l1_size) < needed || u64::from(self.l1_size) > max {
            return Err(HeaderError::L1Size {
                l1_size: self.l1_size,
                needed,
                max,
            });
        }
        let rt_bytes = u64::from(self.refcount_table_clusters) * cs;
        if rt_bytes == 0 || rt_bytes > MAX_REFTABLE_BYTES {
            return Err(HeaderError::RefcountTableSize(self.refcount_table_clusters));
        }
        let l1 = (self.l1_offset, u64::from(self.l1_size) * 8);
        let rt = (self.refcount_table_offset, rt_bytes);
        check_table("L1 table", l1, cs, file_len)?;
        check_table("refcount table", rt, cs, file_len)?;
        if l1.1 > 0 && l1.0 < rt.0 + rt.1 && rt.0 < l1.0 + l1.1 {
            return Err(HeaderError::Overlap);
        }
        Ok(())
    }

    /// The header as it starts an image of `cluster_size` bytes (with the backing
    /// name and format after it, as QEMU lays them out).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; V3_LEN];
        let put32 =
            |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_be_bytes());
        let put64 =
            |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_be_bytes());
        put32(&mut b, 0, MAGIC);
        put32(&mut b, 4, 3);
        put32(&mut b, 20, self.cluster_bits);
        put64(&mut b, 24, self.size);
        put32(&mut b, 32, self.crypt_method);
        put32(&mut b, 36, self.l1_size);
        put64(&mut b, 40, self.l1_offset);
        put64(&mut b, 48, self.refcount_table_offset);
        put32(&mut b, 56, self.refcount_table_clusters);
        put64(&mut b, 72, self.incompatible);
        put64(&mut b, 80, self.compatible);
        put64(&mut b, 88, self.autoclear);
        put32(&mut b, 96, self.refcount_order);
        put32(&mut b, 100, V3_LEN as u32);
        if let Some(f) = &self.backing_format {
            b.extend_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
            b.extend_from_slice(&(f.len() as u32).to_be_bytes());
            b.extend_from_slice(f.as_bytes());
            b.resize(b.len().next_multiple_of(8), 0);
        }
        b.extend_from_slice(&[0; 8]); // end of extensions
        if let Some(name) = &self.backing_file {
            let at = b.len() as u64;
            put64(&mut b, 8, at);
            put32(&mut b, 16, name.len() as u32);
            b.extend_from_slice(name.as_bytes());
        }
        b
    }
}

/// A table of `len` bytes at `offset`: cluster aligned, after the header
/// cluster, inside the file.
fn check_table(
    what: &'static str,
    (offset, len): (u64, u64),
    cs: u64,
    file_len: u64,
) -> Result<(), HeaderError> {
    if len == 0 {
        return Ok(());
    }
    let inside = offset.checked_add(len).is_some_and(|end| end <= file_len);
    if !offset.is_multiple_of(cs) || offset < cs || !inside {
        return Err(HeaderError::Table {
            what,
            offset,
            len,
            file_len,
        });
    }
    Ok(())
}

/// The backing file name (offset and length at bytes 8 and 16): inside the
/// header cluster, at most 1023 bytes (QEMU's limit), UTF-8.
fn backing_name(buf: &[u8], cs: u64) -> Result<Option<String>, HeaderError> {
    let (offset, len) = (be64(buf, 8), be32(buf, 16));
    if offset == 0 {
        return Ok(None);
    }
    let bad = HeaderError::BackingName { offset, len };
    let end = offset.checked_add(u64::from(len)).ok_or(bad.clone())?;
    if len == 0 || len > 1023 || end > cs || end > buf.len() as u64 {
        return Err(bad);
    }
    let name = std::str::from_utf8(&buf[offset as usize..end as usize]).map_err(|_| bad)?;
    Ok(Some(name.to_string()))
}

/// The backing format from the header extensions (which end at the first
/// end-marker; each is padded to 8 bytes and must stay inside `buf`).
fn backing_format(buf: &[u8], mut at: usize) -> Result<Option<String>, HeaderError> {
    let mut format = None;
    loop {
        if at + 8 > buf.len() {
            return Err(HeaderError::Extension(at as u64));
        }
        let (kind, len) = (be32(buf, at), be32(buf, at + 4) as usize);
        if kind == EXT_END {
            return Ok(format);
        }
        let data = at + 8;
        let end = data
            .checked_add(len)
            .filter(|&e| e <= buf.len())
            .ok_or(HeaderError::Extension(at as u64))?;
        if kind == EXT_BACKING_FORMAT {
            let f = std::str::from_utf8(&buf[data..end])
                .map_err(|_| HeaderError::Extension(at as u64))?;
            format = Some(f.to_string());
        }
        at = end.next_multiple_of(8);
    }
}
