//! L1 and L2 tables: what an entry says about a guest cluster, and the bounded
//! L2 cache every channel of an image shares.
//!
//! The cache holds decoded tables as arrays of atomics behind `Arc`s: channels
//! keep a few of them and read entries without the image's lock (the fast path);
//! entries change in place, under the lock (an allocation's data is written
//! before its entry is stored, with release ordering). A discard that frees a
//! cluster clears its entry; a request a channel translated before that may
//! still be in flight, which is why a freed cluster waits before reuse
//! (`meta::Quiet`). Evicting a table bumps the
//! image's generation so channels drop the tables they kept (a reloaded table is
//! a new `Arc`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// L1 and L2 entry bits.
pub(super) const COPIED: u64 = 1 << 63;
pub(super) const COMPRESSED: u64 = 1 << 62;
pub(super) const ZERO: u64 = 1;
pub(super) const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// One L2 table, decoded to host byte order.
pub struct L2Table {
    pub(super) entries: Box<[AtomicU64]>,
}

impl L2Table {
    /// A table decoded from its on-disk bytes (big-endian entries).
    pub(super) fn decode(bytes: &[u8]) -> L2Table {
        let entries = bytes
            .chunks_exact(8)
            .map(|c| AtomicU64::new(u64::from_be_bytes(c.try_into().unwrap_or([0; 8]))))
            .collect();
        L2Table { entries }
    }
    /// An empty table of `n` entries.
    pub(super) fn empty(n: usize) -> L2Table {
        L2Table {
            entries: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }
    pub(super) fn encode(&self) -> Vec<u8> {
        self.entries
            .iter()
            .flat_map(|e| e.load(Ordering::Acquire).to_be_bytes())
            .collect()
    }
    pub(super) fn get(&self, i: usize) -> u64 {
        self.entries.get(i).map_or(0, |e| e.load(Ordering::Acquire))
    }
    pub(super) fn set(&self, i: usize, v: u64) {
        if let Some(e) = self.entries.get(i) {
            e.store(v, Ordering::Release)
        }
    }
}

/// What an L2 entry says about one guest cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cluster {
    /// Not in this image: the backing file's data, or zeroes.
    Unallocated,
    /// Reads as zeroes; `host` is kept allocated when set.
    Zero {
        host: Option<u64>,
    },
    /// Data at `host`; `copied`: its refcount is 1, so it may be written in place.
    Data {
        host: u64,
        copied: bool,
    },
    Compressed,
    /// Extended L2 entries: subclusters not all alike. `host` is 0 when the
    /// cluster has no space; bit `i` of `alloc`: subcluster `i` is at
    /// `host + i * cs / 32`; of `zero`: it reads as zeroes; neither: it is the
    /// backing file's (or zeroes); `copied` as for `Data`.
    Mixed {
        host: u64,
        copied: bool,
        alloc: u32,
        zero: u32,
    },
    /// An offset that is unaligned, in the header cluster or past the file.
    Bad,
}

/// Classifies an L2 entry of an image with clusters of `cs` bytes whose
/// allocated clusters end before `limit`.
pub(super) fn classify(entry: u64, cs: u64, limit: u64) -> Cluster {
    if entry & COMPRESSED != 0 {
        return Cluster::Compressed;
    }
    let host = entry & OFFSET_MASK;
    let valid = host.is_multiple_of(cs) && host >= cs && host.saturating_add(cs) <= limit;
    match (host, entry & ZERO != 0) {
        (0, false) => Cluster::Unallocated,
        (0, true) => Cluster::Zero { host: None },
        (_, _) if !valid => Cluster::Bad,
        (h, true) => Cluster::Zero { host: Some(h) },
        (h, false) => Cluster::Data {
            host: h,
            copied: entry & COPIED != 0,
        },
    }
}

/// Classifies an extended L2 entry (the standard entry, whose zero bit is
/// unused, and its subcluster bitmap: allocated in the low half, zeroes in
/// the high). A cluster whose subclusters all agree is what a standard entry
/// would say; subclusters both allocated and zero, or allocated without
/// space, are `Bad` (QEMU calls them corrupt).
pub(super) fn classify_ext(entry: u64, bitmap: u64, cs: u64, limit: u64) -> Cluster {
    if entry & COMPRESSED != 0 {
        return Cluster::Compressed;
    }
    let (alloc, zero) = (bitmap as u32, (bitmap >> 32) as u32);
    if alloc & zero != 0 {
        return Cluster::Bad;
    }
    match classify(entry & !ZERO, cs, limit) {
        Cluster::Unallocated if alloc != 0 => Cluster::Bad,
        Cluster::Unallocated if zero == u32::MAX => Cluster::Zero { host: None },
        Cluster::Unallocated if zero == 0 => Cluster::Unallocated,
        Cluster::Data { host, copied } if alloc == u32::MAX => Cluster::Data { host, copied },
        Cluster::Data { host, .. } if zero == u32::MAX => Cluster::Zero { host: Some(host) },
        Cluster::Data { host, copied } => Cluster::Mixed {
            host,
            copied,
            alloc,
            zero,
        },
        Cluster::Unallocated => Cluster::Mixed {
            host: 0,
            copied: false,
            alloc,
            zero,
        },
        _ => Cluster::Bad,
    }
}

/// What entry `i` of table `t` says (`ext`: the table holds extended
/// entries, two words each).
#[inline]
pub(super) fn classify_at(t: &L2Table, i: usize, ext: bool, cs: u64, limit: u64) -> Cluster {
    if ext {
        classify_ext(t.get(2 * i), t.get(2 * i + 1), cs, limit)
    } else {
        classify(t.get(i), cs, limit)
    }
}

/// A cached table and what it needs to go back to disk.
struct Cached {
    table: Arc<L2Table>,
    /// Where it lives in the image.
    offset: u64,
    dirty: bool,
    last_use: u64,
}

/// The L2 tables in memory, at most `cap` of them.
pub(super) struct L2Cache {
    tables: HashMap<usize, Cached>,
    cap: usize,
    tick: u64,
}

impl L2Cache {
    pub(super) fn new(cap: usize) -> L2Cache {
        L2Cache {
            tables: HashMap::with_capacity(cap.min(4096)),
            cap: cap.max(1),
            tick: 0,
        }
    }
    pub(super) fn get(&mut self, l1i: usize) -> Option<Arc<L2Table>> {
        self.tick += 1;
        let c = self.tables.get_mut(&l1i)?;
        c.last_use = self.tick;
        Some(c.table.clone())
    }
    pub(super) fn capacity(&self) -> usize {
        self.cap
    }
    pub(super) fn full(&self) -> bool {
        self.tables.len() >= self.cap
    }
    pub(super) fn any_dirty(&self) -> bool {
        self.tables.values().any(|c| c.dirty)
    }
    /// Drops the least recently used clean table; false if every table is dirty.
    pub(super) fn evict_clean(&mut self) -> bool {
        let victim = self
            .tables
            .iter()
            .filter(|(_, c)| !c.dirty)
            .min_by_key(|(_, c)| c.last_use)
            .map(|(&k, _)| k);
        victim.is_some_and(|k| self.tables.remove(&k).is_some())
    }
    pub(super) fn insert(&mut self, l1i: usize, offset: u64, table: Arc<L2Table>, dirty: bool) {
        self.tick += 1;
        let c = Cached {
            table,
            offset,
            dirty,
            last_use: self.tick,
        };
        self.tables.insert(l1i, c);
    }
    pub(super) fn mark_dirty(&mut self, l1i: usize) {
        if let Some(c) = self.tables.get_mut(&l1i) {
            c.dirty = true;
        }
    }
    /// The dirty tables (offset and bytes), marked clean.
    pub(super) fn take_dirty(&mut self) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        for c in self.tables.values_mut().filter(|c| c.dirty) {
            out.push((c.offset, c.table.encode()));
            c.dirty = false;
        }
        out
    }
    /// Marks tables dirty again after a failed write-back.
    pub(super) fn redirty(&mut self, offsets: &[u64]) {
        for c in self.tables.values_mut() {
            if offsets.contains(&c.offset) {
                c.dirty = true;
            }
        }
    }
}

/// Where a compressed cluster's bytes are (offset, length) per its L2 entry:
/// the offset in the low bits, the count of further 512-byte sectors above.
pub(super) fn compressed_extent(entry: u64, cluster_bits: u32) -> (u64, u64) {
    let shift = 62 - (cluster_bits - 8);
    let offset = entry & ((1 << shift) - 1);
    let sectors = ((entry >> shift) & ((1 << (cluster_bits - 8)) - 1)) + 1;
    (offset, sectors * 512 - (offset & 511))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_classified_and_hostile_offsets_are_bad() {
        let cs = 65536;
        let limit = 10 * cs;
        assert_eq!(classify(0, cs, limit), Cluster::Unallocated);
        assert_eq!(classify(ZERO, cs, limit), Cluster::Zero { host: None });
        assert_eq!(
            classify(COPIED | (2 * cs), cs, limit),
            Cluster::Data {
                host: 2 * cs,
                copied: true
            }
        );
        assert_eq!(
            classify(COPIED | (2 * cs) | ZERO, cs, limit),
            Cluster::Zero { host: Some(2 * cs) }
        );
        assert_eq!(classify(COMPRESSED | 5, cs, limit), Cluster::Compressed);
        // In the header cluster, unaligned, past the file.
        assert_eq!(classify(COPIED | 512, cs, limit), Cluster::Bad);
        assert_eq!(classify(COPIED | (2 * cs + 512), cs, limit), Cluster::Bad);
        assert_eq!(classify(COPIED | (10 * cs), cs, limit), Cluster::Bad);
        assert_eq!(classify(COPIED | OFFSET_MASK, cs, limit), Cluster::Bad);
    }

    #[test]
    fn extended_entries_are_classified_by_their_bitmaps() {
        let cs = 65536;
        let limit = 10 * cs;
        let d = COPIED | (2 * cs);
        let all = u64::from(u32::MAX);
        assert_eq!(classify_ext(0, 0, cs, limit), Cluster::Unallocated);
        assert_eq!(
            classify_ext(0, all << 32, cs, limit),
            Cluster::Zero { host: None }
        );
        assert_eq!(
            classify_ext(d, all, cs, limit),
            Cluster::Data {
                host: 2 * cs,
                copied: true
            }
        );
        assert_eq!(
            classify_ext(d, all << 32, cs, limit),
            Cluster::Zero { host: Some(2 * cs) }
        );
        assert_eq!(
            classify_ext(d, 0b101 | (0b10 << 32), cs, limit),
            Cluster::Mixed {
                host: 2 * cs,
                copied: true,
                alloc: 0b101,
                zero: 0b10
            }
        );
        assert_eq!(
            classify_ext(0, 0b10 << 32, cs, limit),
            Cluster::Mixed {
                host: 0,
                copied: false,
                alloc: 0,
                zero: 0b10
            }
        );
        assert_eq!(
            classify_ext(COMPRESSED | 5, all, cs, limit),
            Cluster::Compressed
        );
        // Allocated and zero at once; allocated without space; a bad offset.
        assert_eq!(classify_ext(d, 1 | (1 << 32), cs, limit), Cluster::Bad);
        assert_eq!(classify_ext(0, 1, cs, limit), Cluster::Bad);
        assert_eq!(classify_ext(COPIED | 512, all, cs, limit), Cluster::Bad);
    }
}
