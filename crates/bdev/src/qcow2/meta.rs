//! An image's metadata behind its lock: the L1 table (loaded at open), the L2
//! cache, the refcounts and the cluster allocator, and the flush that writes
//! them back in an order a crash cannot turn into exposed stale data.
//!
//! Clusters are allocated at the end of the file, or reused once a discard
//! freed them ([`Meta::discard`]) and two things hold: the L2 entries that no
//! longer point at them are durable (their refcounts drop to 0 only in a flush,
//! after the tables), and no channel can still have a request in flight that
//! was translated to them before the discard ([`Quiet`]). A crash leaks
//! clusters at worst; a cluster is never referenced twice. Metadata reads on a
//! cache miss are synchronous `pread`s of one cluster on the calling reactor
//! (docs/decisions/0038-qcow2.md).

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::header::{Header, MAX_REFTABLE_BYTES};
use super::tables::{L2Cache, L2Table, COPIED, OFFSET_MASK};

/// Refcount blocks kept in memory before a flush makes room.
const REFBLOCK_CAP: usize = 64;

/// Freed clusters remembered for reuse (16 bytes each); a discard past this
/// keeps its clusters allocated, as zero clusters.
const FREE_CAP: usize = 1 << 16;

/// What a channel publishes about its translated requests: `IDLE` (none in
/// flight, and the next one retracts this before it reads an L2 entry), or
/// `g + 1` where `g` is a generation the channel had seen when nothing was in
/// flight. A cluster freed when the generation became `G` is safe to reuse
/// once every channel's value is above `G`: none of their requests in flight
/// can have read the entry from before the discard.
pub(super) type Quiet = AtomicU64;
pub(super) const IDLE: u64 = u64::MAX;

fn corrupt(what: &str, offset: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("qcow2 metadata corrupt: {what} at {offset:#x}"),
    )
}

/// One refcount block in memory.
struct RefBlock {
    offset: u64,
    bytes: Vec<u8>,
    dirty: bool,
}

pub(super) struct Meta {
    file: Arc<File>,
    cluster_bits: u32,
    refcount_order: u32,
    l1_offset: u64,
    l1: Vec<u64>,
    l1_dirty: bool,
    pub(super) l2: L2Cache,
    reftable_offset: u64,
    reftable_clusters: u32,
    reftable: Vec<u64>,
    reftable_dirty: bool,
    /// The table moved ([`Meta::grow_reftable`]): the header must follow.
    reftable_moved: bool,
    refblocks: HashMap<usize, RefBlock>,
    /// The next cluster index to allocate (the end of the file, rounded up).
    next_free: u64,
    /// Where allocated clusters end (bytes): data offsets past it are corrupt.
    /// Shared with the channels' lock-free lookups.
    limit: Arc<AtomicU64>,
    /// Bumped when a table leaves the cache: channels drop the ones they keep.
    generation: Arc<AtomicU64>,
    /// Clusters whose L2 entries a discard cleared, not yet durable (their
    /// refcounts still 1), and the generation the discards left.
    discarded: Vec<u64>,
    discard_gen: u64,
    /// Clusters with refcount 0, each with the generation to wait out.
    freed: VecDeque<(u64, u64)>,
    /// The channels' published [`Quiet`] values.
    channels: Vec<Weak<Quiet>>,
}

pub(super) fn read_u64s(file: &File, offset: u64, n: usize) -> io::Result<Vec<u64>> {
    let mut b = vec![0u8; n * 8];
    file.read_exact_at(&mut b, offset)?;
    Ok(b.chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8])))
        .collect())
}

fn encode_u64s(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|e| e.to_be_bytes()).collect()
}

impl Meta {
    /// Loads the L1 and refcount tables (their sizes were checked against the
    /// file and QEMU's limits by the header parser).
    pub(super) fn load(
        file: Arc<File>,
        h: &Header,
        file_len: u64,
        l2_cache_tables: usize,
        generation: Arc<AtomicU64>,
    ) -> io::Result<Meta> {
        let cs = h.cluster_size();
        let l1 = read_u64s(&file, h.l1_offset, h.l1_size as usize)?;
        let rt_len = (u64::from(h.refcount_table_clusters) * cs / 8) as usize;
        let reftable = read_u64s(&file, h.refcount_table_offset, rt_len)?;
        let next_free = file_len.div_ceil(cs);
        Ok(Meta {
            file,
            cluster_bits: h.cluster_bits,
            refcount_order: h.refcount_order,
            l1_offset: h.l1_offset,
            l1,
            l1_dirty: false,
            l2: L2Cache::new(l2_cache_tables),
            reftable_offset: h.refcount_table_offset,
            reftable_clusters: h.refcount_table_clusters,
            reftable,
            reftable_dirty: false,
            reftable_moved: false,
            refblocks: HashMap::new(),
            next_free,
            limit: Arc::new(AtomicU64::new(next_free << h.cluster_bits)),
            generation,
            discarded: Vec::new(),
            discard_gen: 0,
            freed: VecDeque::new(),
            channels: Vec::new(),
        })
    }

    fn cs(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Reads the tables again as header `h` places them: another process
    /// wrote the image since they were loaded (the source of a live
    /// migration). What this one cached is dropped; the generation moves on
    /// so that channels drop the tables they keep. Call with nothing in
    /// flight and nothing dirty.
    pub(super) fn reload(&mut self, h: &Header, file_len: u64) -> io::Result<()> {
        let mut fresh = Meta::load(
            self.file.clone(),
            h,
            file_len,
            self.l2.capacity(),
            self.generation.clone(),
        )?;
        self.limit
            .store(fresh.limit.load(Ordering::Acquire), Ordering::Release);
        fresh.limit = self.limit.clone();
        fresh.channels = std::mem::take(&mut self.channels);
        *self = fresh;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    pub(super) fn limit(&self) -> Arc<AtomicU64> {
        self.limit.clone()
    }

    /// A host offset read from a table: cluster aligned, after the header,
    /// before the end of what is allocated.
    fn table_offset(&self, entry: u64, what: &str) -> io::Result<u64> {
        let off = entry & OFFSET_MASK;
        let cs = self.cs();
        let end = self.next_free << self.cluster_bits;
        if !off.is_multiple_of(cs) || off < cs || off.saturating_add(cs) > end {
            return Err(corrupt(what, off));
        }
        Ok(off)
    }

    /// The L2 table of L1 entry `l1i`, loaded if needed; `None` if the image has
    /// none there.
    pub(super) fn l2(&mut self, l1i: usize) -> io::Result<Option<Arc<L2Table>>> {
        if let Some(t) = self.l2.get(l1i) {
            return Ok(Some(t));
        }
        let entry = *self
            .l1
            .get(l1i)
            .ok_or_else(|| corrupt("L1 index", l1i as u64))?;
        if entry & OFFSET_MASK == 0 {
            return Ok(None);
        }
        let off = self.table_offset(entry, "L2 table")?;
        let mut bytes = vec![0u8; self.cs() as usize];
        self.file.read_exact_at(&mut bytes, off)?;
        let t = Arc::new(L2Table::decode(&bytes));
        self.make_room()?;
        self.l2.insert(l1i, off, t.clone(), false);
        Ok(Some(t))
    }

    /// Room for one more table in the L2 cache (a flush first if all are dirty).
    fn make_room(&mut self) -> io::Result<()> {
        if !self.l2.full() {
            return Ok(());
        }
        if !self.l2.evict_clean() {
            self.flush()?;
            self.l2.evict_clean();
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// The L2 table of `l1i`, allocated (empty) if the image has none there.
    pub(super) fn l2_for_write(&mut self, l1i: usize) -> io::Result<Arc<L2Table>> {
        if let Some(t) = self.l2(l1i)? {
            return Ok(t);
        }
        if l1i >= self.l1.len() {
            return Err(corrupt("L1 index", l1i as u64));
        }
        let off = self.alloc()?;
        let t = Arc::new(L2Table::empty((self.cs() / 8) as usize));
        self.make_room()?;
        self.l2.insert(l1i, off, t.clone(), true);
        self.l1[l1i] = off | COPIED;
        self.l1_dirty = true;
        Ok(t)
    }

    /// Stores L2 entry `l2i` of table `l1i` (whose table is cached).
    pub(super) fn set_entry(&mut self, l1i: usize, l2i: usize, value: u64) -> io::Result<()> {
        let t = self.l2_for_write(l1i)?;
        t.set(l2i, value);
        self.l2.mark_dirty(l1i);
        Ok(())
    }

    /// A new cluster, its refcount set to 1: a freed one that is safe to
    /// reuse, else one at the end of the image.
    pub(super) fn alloc(&mut self) -> io::Result<u64> {
        let c = match self.reusable() {
            Some(c) => c,
            None => {
                let c = self.next_free;
                self.advance();
                c
            }
        };
        self.mark_used(c)?;
        Ok(c << self.cluster_bits)
    }

    /// A channel to wait for before freed clusters are reused.
    pub(super) fn register(&mut self, q: &Arc<Quiet>) {
        self.channels.retain(|w| w.strong_count() > 0);
        self.channels.push(Arc::downgrade(q));
    }

    /// The oldest freed cluster, if no channel may still use it.
    fn reusable(&mut self) -> Option<u64> {
        let &(c, g) = self.freed.front()?;
        let quiet = self
            .channels
            .iter()
            .filter_map(Weak::upgrade)
            .all(|q| q.load(Ordering::SeqCst) > g);
        if !quiet {
            return None;
        }
        self.freed.pop_front();
        Some(c)
    }

    /// Whether a discard may free more clusters (the lists are bounded).
    pub(super) fn can_free(&self) -> bool {
        self.discarded.len() + self.freed.len() < FREE_CAP
    }

    /// The clusters at `hosts` are no longer referenced by the (cached) L2
    /// entries just changed: channels drop their tables and publish again,
    /// and the clusters are freed at the next flush, to be reused once the
    /// channels are past the generation this makes.
    pub(super) fn discard(&mut self, hosts: &[u64]) {
        if hosts.is_empty() {
            return;
        }
        self.discard_gen = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let bits = self.cluster_bits;
        self.discarded.extend(hosts.iter().map(|h| h >> bits));
    }

    /// Drops the refcounts of the discarded clusters (their L2 entries are
    /// durable) and makes that durable too; they become reusable.
    fn release_discarded(&mut self) -> io::Result<()> {
        let rb_bits = self.cluster_bits + 3 - self.refcount_order;
        for c in std::mem::take(&mut self.discarded) {
            let t = (c >> rb_bits) as usize;
            if self.reftable.get(t).is_none_or(|e| e & OFFSET_MASK == 0) {
                return Err(corrupt("refcount of a discarded cluster", c));
            }
            self.set_refcount(t, (c & ((1 << rb_bits) - 1)) as usize, 0)?;
            self.freed.push_back((c, self.discard_gen));
        }
        self.flush()
    }

    /// Sets cluster `c`'s refcount to 1. A refcount block that is missing is
    /// made in the next free cluster (whose own refcount is then set the same
    /// way); a refcount table too short is moved to a larger one first.
    fn mark_used(&mut self, c: u64) -> io::Result<()> {
        let rb_bits = self.cluster_bits + 3 - self.refcount_order;
        let mut pending = vec![c];
        while let Some(c) = pending.pop() {
            let t = (c >> rb_bits) as usize;
            if t >= self.reftable.len() {
                pending.extend(self.grow_reftable(t)?);
                pending.push(c);
                continue;
            }
            if self.reftable[t] & OFFSET_MASK == 0 {
                let x = self.next_free;
                self.advance();
                self.room_for_refblock()?;
                let block = RefBlock {
                    offset: x << self.cluster_bits,
                    bytes: vec![0u8; self.cs() as usize],
                    dirty: true,
                };
                self.refblocks.insert(t, block);
                self.reftable[t] = x << self.cluster_bits;
                self.reftable_dirty = true;
                pending.push(x);
            }
            self.set_refcount(t, (c & ((1 << rb_bits) - 1)) as usize, 1)?;
        }
        Ok(())
    }

    /// Moves the refcount table to new clusters at the end of the image, large
    /// enough for entry `t` (at least twice the old size, at most QEMU's 8 MiB;
    /// the old clusters leak); the new clusters, whose refcounts the caller
    /// sets. The header points at the new table once it is on disk
    /// ([`Meta::flush`]).
    fn grow_reftable(&mut self, t: usize) -> io::Result<std::ops::Range<u64>> {
        let cs = self.cs();
        let want = (t as u64 + 1).max(self.reftable.len() as u64 * 2);
        let clusters = (want * 8).div_ceil(cs);
        if clusters * cs > MAX_REFTABLE_BYTES {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let at = self.next_free;
        for _ in 0..clusters {
            self.advance();
        }
        self.reftable.resize((clusters * cs / 8) as usize, 0);
        self.reftable_offset = at << self.cluster_bits;
        self.reftable_clusters = clusters as u32;
        self.reftable_moved = true;
        self.reftable_dirty = true;
        Ok(at..at + clusters)
    }

    fn advance(&mut self) {
        self.next_free += 1;
        self.limit
            .store(self.next_free << self.cluster_bits, Ordering::Release);
    }

    fn room_for_refblock(&mut self) -> io::Result<()> {
        if self.refblocks.len() >= REFBLOCK_CAP {
            self.flush()?;
            self.refblocks.clear();
        }
        Ok(())
    }

    /// Sets entry `i` of refcount block `t` (loaded if needed) to `v`.
    fn set_refcount(&mut self, t: usize, i: usize, v: u64) -> io::Result<()> {
        if !self.refblocks.contains_key(&t) {
            let off = self.table_offset(self.reftable[t], "refcount block")?;
            let mut bytes = vec![0u8; self.cs() as usize];
            self.file.read_exact_at(&mut bytes, off)?;
            self.room_for_refblock()?;
            self.refblocks.insert(
                t,
                RefBlock {
                    offset: off,
                    bytes,
                    dirty: false,
                },
            );
        }
        let order = self.refcount_order;
        let b = self
            .refblocks
            .get_mut(&t)
            .ok_or_else(|| corrupt("refcount block", 0))?;
        put_refcount(&mut b.bytes, order, i, v);
        b.dirty = true;
        Ok(())
    }

    /// Writes the metadata back so that nothing durable points at data that is
    /// not: completed data first, then refcount blocks (then the table that
    /// points at new ones), then L2 tables, then the L1 table, each step made
    /// durable before the next. A crash in between leaks clusters, never exposes
    /// a cluster's old content.
    pub(super) fn flush(&mut self) -> io::Result<()> {
        let f = self.file.clone();
        f.sync_data()?;
        let blocks: Vec<_> = self
            .refblocks
            .values()
            .filter(|b| b.dirty)
            .map(|b| b.offset)
            .collect();
        for b in self.refblocks.values_mut().filter(|b| b.dirty) {
            f.write_all_at(&b.bytes, b.offset)?;
            b.dirty = false;
        }
        if self.reftable_dirty {
            f.sync_data()?;
            f.write_all_at(&encode_u64s(&self.reftable), self.reftable_offset)?;
            self.reftable_dirty = false;
        }
        if self.reftable_moved {
            // The header points at the new table only once it is durable.
            f.sync_data()?;
            let mut h = self.reftable_offset.to_be_bytes().to_vec();
            h.extend_from_slice(&self.reftable_clusters.to_be_bytes());
            f.write_all_at(&h, 48)?;
            self.reftable_moved = false;
        }
        let tables = self.l2.take_dirty();
        if !tables.is_empty() {
            f.sync_data()?;
            let r = tables
                .iter()
                .try_for_each(|(off, b)| f.write_all_at(b, *off));
            if let Err(e) = r {
                let offs: Vec<u64> = tables.iter().map(|t| t.0).collect();
                self.l2.redirty(&offs);
                return Err(e);
            }
        }
        if self.l1_dirty {
            f.sync_data()?;
            f.write_all_at(&encode_u64s(&self.l1), self.l1_offset)?;
            self.l1_dirty = false;
        }
        if !blocks.is_empty() || !tables.is_empty() {
            f.sync_data()?;
        }
        if !self.discarded.is_empty() {
            self.release_discarded()?;
        }
        Ok(())
    }

    /// Whether anything waits to be written back.
    pub(super) fn dirty(&self) -> bool {
        self.l1_dirty
            || self.reftable_dirty
            || self.reftable_moved
            || self.l2.any_dirty()
            || self.refblocks.values().any(|b| b.dirty)
            || !self.discarded.is_empty()
    }

    /// Where the image's allocated clusters end (bytes): what it takes on a
    /// file system that does not leave holes.
    pub(super) fn allocated_bytes(&self) -> u64 {
        self.next_free << self.cluster_bits
    }
}

/// Sets refcount `i` of a block of `2^order`-bit entries (sub-byte widths
/// packed from the low bits, as QEMU does; wider ones big-endian).
pub(super) fn put_refcount(block: &mut [u8], order: u32, i: usize, v: u64) {
    let bits = 1usize << order;
    if bits < 8 {
        let per = 8 / bits;
        let shift = (i % per) * bits;
        let mask = (((1u16 << bits) - 1) as u8) << shift;
        if let Some(b) = block.get_mut(i / per) {
            *b = (*b & !mask) | (((v as u8) << shift) & mask);
        }
        return;
    }
    let n = bits / 8;
    let bytes = v.to_be_bytes();
    if let Some(dst) = block.get_mut(i * n..(i + 1) * n) {
        dst.copy_from_slice(&bytes[8 - n..]);
    }
}

#[cfg(test)]
/// Refcount `i` of a block of `2^order`-bit entries.
pub(super) fn get_refcount(block: &[u8], order: u32, i: usize) -> u64 {
    let bits = 1usize << order;
    if bits < 8 {
        let per = 8 / bits;
        let b = block.get(i / per).copied().unwrap_or(0);
        return u64::from((b >> ((i % per) * bits)) & (((1u16 << bits) - 1) as u8));
    }
    let n = bits / 8;
    block
        .get(i * n..(i + 1) * n)
        .map_or(0, |s| s.iter().fold(0, |acc, &x| (acc << 8) | u64::from(x)))
}
