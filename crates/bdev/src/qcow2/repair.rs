//! Rebuilding the refcounts of a dirty image, as QEMU does when it opens one for
//! writing. An image with the dirty bit was written with lazy refcounts (QEMU's
//! `lazy_refcounts=on`) and not closed cleanly: its L1 and L2 tables are right,
//! its refcounts may not be. The repair counts every reference the tables make
//! (the header cluster, the L1 table, every L2 table, every data or compressed
//! cluster), writes a new refcount table and blocks after the end of the file, syncs, then points the header at them and clears the
//! dirty bit in one header write, synced again. A crash before that write leaves
//! the old header, dirty still, so the next open repairs again; the old refcount
//! structures become unreferenced space.
//!
//! Everything here reads what a hostile image controls: every table entry is
//! checked against the file before it is followed, and the count it keeps is
//! bounded ([`MAX_CLUSTERS`]).

use std::fs::File;
use std::os::unix::fs::FileExt;

use super::error::RepairError;
use super::header::{Header, INCOMPAT_DIRTY, MAX_REFTABLE_BYTES};
use super::meta::{put_refcount, read_u64s};
use super::tables::{compressed_extent, COMPRESSED, OFFSET_MASK};

/// The most host clusters a repair counts (2 bytes each in memory: 128 MiB;
/// 4 TiB of file with 64 KiB clusters). A larger file: `qemu-img check -r all`.
const MAX_CLUSTERS: u64 = 1 << 26;

/// References counted per host cluster.
struct Counts {
    cs: u64,
    clusters: u64,
    refs: Vec<u16>,
}

impl Counts {
    /// Counts one reference to each cluster of `len` bytes at `offset`.
    fn add(&mut self, what: &'static str, offset: u64, len: u64) -> Result<(), RepairError> {
        let end = offset.checked_add(len.max(1));
        let outside = RepairError::Outside { what, offset };
        let Some(end) = end.filter(|&e| e.div_ceil(self.cs) <= self.clusters) else {
            return Err(outside);
        };
        for c in offset / self.cs..end.div_ceil(self.cs) {
            let r = &mut self.refs[c as usize];
            *r = r.saturating_add(1);
        }
        Ok(())
    }

    /// Counts a table's clusters, which must start on a cluster.
    fn add_table(&mut self, what: &'static str, offset: u64, len: u64) -> Result<(), RepairError> {
        if offset == 0 || !offset.is_multiple_of(self.cs) {
            return Err(RepairError::Outside { what, offset });
        }
        self.add(what, offset, len)
    }
}

/// Counts what the header, the L1 table and the L2 tables reference.
fn count(file: &File, h: &Header, file_len: u64) -> Result<Counts, RepairError> {
    let cs = h.cluster_size();
    let clusters = file_len.div_ceil(cs);
    if clusters > MAX_CLUSTERS {
        return Err(RepairError::TooLarge(clusters));
    }
    let mut n = Counts {
        cs,
        clusters,
        refs: vec![0; clusters as usize],
    };
    n.add("the header", 0, cs)?;
    let l1_len = u64::from(h.l1_size) * 8;
    n.add_table("the L1 table", h.l1_offset, l1_len)?;
    let l1 = read_u64s(file, h.l1_offset, h.l1_size as usize)?;
    let step = if h.extended_l2() { 2 } else { 1 };
    for l2_offset in l1.iter().map(|e| e & OFFSET_MASK).filter(|&o| o != 0) {
        n.add_table("an L2 table", l2_offset, cs)?;
        let l2 = read_u64s(file, l2_offset, (cs / 8) as usize)?;
        for &entry in l2.iter().step_by(step) {
            if entry & COMPRESSED != 0 {
                let (offset, len) = compressed_extent(entry, h.cluster_bits);
                n.add("a compressed cluster", offset, len)?;
            } else if entry & OFFSET_MASK != 0 {
                n.add_table("a data cluster", entry & OFFSET_MASK, cs)?;
            }
        }
    }
    Ok(n)
}

/// Rebuilds the refcounts of the dirty image in `file` (header `h`) and clears
/// its dirty bit.
pub(super) fn rebuild_refcounts(file: &File, h: &Header) -> Result<(), RepairError> {
    if h.nb_snapshots != 0 {
        return Err(RepairError::Unsupported("internal snapshots"));
    }
    if h.autoclear != 0 {
        return Err(RepairError::Unsupported(
            "bitmaps or other autoclear extensions",
        ));
    }
    let file_len = file.metadata()?.len();
    let n = count(file, h, file_len)?;
    let cs = n.cs;
    // The new blocks and table go after the file's last cluster and count
    // themselves: grow them until they cover everything, themselves included.
    let per_block = (cs * 8) >> h.refcount_order;
    let first_new = n.clusters;
    let (mut blocks, mut table) = (0u64, 0u64);
    loop {
        let total = first_new + blocks + table;
        let b = total.div_ceil(per_block);
        let t = (b * 8).div_ceil(cs);
        if (b, t) == (blocks, table) {
            break;
        }
        (blocks, table) = (b, t);
    }
    if table * cs > MAX_REFTABLE_BYTES {
        return Err(RepairError::TooLarge(first_new));
    }
    let table_at = first_new + blocks;
    let total = table_at + table;
    let mut reftable = vec![0u8; (table * cs) as usize];
    // A count the entries cannot hold is stored as their largest value, never
    // wrapped to a smaller one (0 would free a cluster in use).
    let width_max = u64::MAX >> (64 - (1u32 << h.refcount_order));
    let mut block = vec![0u8; cs as usize];
    for b in 0..blocks {
        block.fill(0);
        for i in 0..per_block {
            let c = b * per_block + i;
            let refs = match n.refs.get(c as usize) {
                Some(&r) => u64::from(r),
                None if c < total => 1,
                None => 0,
            };
            put_refcount(
                &mut block,
                h.refcount_order,
                i as usize,
                refs.min(width_max),
            );
        }
        file.write_all_at(&block, (first_new + b) * cs)?;
        let at = (b * 8) as usize;
        reftable[at..at + 8].copy_from_slice(&((first_new + b) * cs).to_be_bytes());
    }
    file.write_all_at(&reftable, table_at * cs)?;
    file.sync_data()?;
    // Bytes 48..80: the refcount table's offset and size, the snapshot fields
    // (kept), the incompatible features; one write, within one sector.
    let mut fields = [0u8; 32];
    file.read_exact_at(&mut fields, 48)?;
    fields[..8].copy_from_slice(&(table_at * cs).to_be_bytes());
    fields[8..12].copy_from_slice(&(table as u32).to_be_bytes());
    fields[24..].copy_from_slice(&(h.incompatible & !INCOMPAT_DIRTY).to_be_bytes());
    file.write_all_at(&fields, 48)?;
    file.sync_data()?;
    Ok(())
}
