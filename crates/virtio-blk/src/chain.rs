//! Walks a descriptor chain from a head index straight out of the descriptor table.
//!
//! virtio-queue builds chains only while popping the avail ring (its
//! `DescriptorChain::new` is crate-private); resubmitting the heads an inflight log
//! recorded needs chains that are no longer in the avail window, so we walk them
//! ourselves. The table is guest memory: every index is range-checked, a chain ends
//! after at most `queue size` (or indirect table length) descriptors, and an
//! indirect table inside an indirect table ends it — the same limits as virtio-queue.

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

use crate::guest::Mem;

const DESC_SIZE: u64 = 16;
const F_NEXT: u16 = 1;
const F_INDIRECT: u16 = 4;

pub(crate) struct ChainWalk<'a> {
    mem: &'a Mem,
    table: u64,
    table_len: u16,
    idx: Option<u16>,
    ttl: u32,
    indirect: bool,
}

impl<'a> ChainWalk<'a> {
    pub fn new(mem: &'a Mem, desc_table: u64, queue_size: u16, head: u16) -> Self {
        ChainWalk {
            mem,
            table: desc_table,
            table_len: queue_size,
            idx: (head < queue_size).then_some(head),
            ttl: u32::from(queue_size),
            indirect: false,
        }
    }

    fn read(&self, idx: u16) -> Option<Descriptor> {
        let addr = self
            .table
            .checked_add(u64::from(idx).checked_mul(DESC_SIZE)?)?;
        self.mem.read_obj::<Descriptor>(GuestAddress(addr)).ok()
    }
}

impl Iterator for ChainWalk<'_> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        loop {
            let idx = self.idx.take()?;
            if idx >= self.table_len || self.ttl == 0 {
                return None;
            }
            self.ttl -= 1;
            let d = self.read(idx)?;
            if d.flags() & F_INDIRECT != 0 {
                if self.indirect || d.len() == 0 || u64::from(d.len()) % DESC_SIZE != 0 {
                    return None;
                }
                let n = u16::try_from(u64::from(d.len()) / DESC_SIZE).ok()?;
                self.indirect = true;
                self.table = d.addr().0;
                self.table_len = n;
                self.ttl = u32::from(n);
                self.idx = Some(0);
                continue;
            }
            if d.flags() & F_NEXT != 0 {
                self.idx = Some(d.next());
            }
            return Some(d);
        }
    }
}
