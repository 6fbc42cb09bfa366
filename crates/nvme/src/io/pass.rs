//! What one poll of a queue group reads once (the controller, the memory map, the
//! doorbells, the CQ ring), and how a poll stops when the controller goes fatal.
//! A leaf below the stages: each of them takes a [`Pass`].

use guest_mem::{Access, DmaSlice, MemView, MemoryMap};

use super::shadow::{read_db, shadow_page, Shadow};
use crate::queue::CqRing;
use crate::shared::Shared;

/// The controller went fatal (CSTS.CFS, reason logged) during this poll; the poll
/// stops where it is.
pub(crate) struct Fatal;

/// What one poll reads once: the controller, the memory map commands are translated
/// against, the doorbells and the CQ ring.
pub(crate) struct Pass<'m> {
    pub shared: &'m Shared,
    pub view: &'m MemView,
    pub map: &'m MemoryMap,
    page: DmaSlice<'m>,
    shadow: Option<Shadow>,
    shadow_db: Option<DmaSlice<'m>>,
    cq_ring: DmaSlice<'m>,
    /// The CQ lies in unshared client memory: completions go out at the end.
    pub cq_remote: bool,
}

impl<'m> Pass<'m> {
    /// Translates the CQ ring. The CQ head is read only when the CQ looks full
    /// ([`Pass::read_cq_head`]), with or without shadow doorbells.
    pub(super) fn begin(
        shared: &'m Shared,
        view: &'m MemView,
        shadow: Option<Shadow>,
        cq: &CqRing,
    ) -> Result<Pass<'m>, Fatal> {
        let map = view.map();
        let page = shared.doorbells.all();
        let shadow_db = shadow_page(map, shadow);
        let Ok(cq_ring) = map.translate(cq.base, cq.ring_bytes(), Access::Write) else {
            shared.set_fatal("I/O CQ memory unmapped");
            return Err(Fatal);
        };
        let cq_remote = map.touches_remote(cq.base, cq.ring_bytes() as u64);
        Ok(Pass {
            shared,
            view,
            map,
            page,
            shadow,
            shadow_db,
            cq_ring,
            cq_remote,
        })
    }

    /// Reads the CQ head doorbell into `cq`, only when the CQ seems too full to
    /// fetch more (a stale head only under-counts the room):
    /// SPDK's driver rings the CQ head right after the next SQ tail, on the same
    /// cache line, so reading it on every poll takes that line back from the host's
    /// core and the SQ tail read that follows waits for it again
    /// (docs/decisions/0027-prefetch-next-copy.md, "the CQ head when needed").
    #[inline]
    pub(super) fn read_cq_head(&self, cq: &mut CqRing) -> Result<(), Fatal> {
        let head = read_db(&self.page, self.shadow_db.as_ref(), cq.qid, true);
        if head >= u32::from(cq.size) {
            return Err(self.fatal("CQ head doorbell beyond queue size"));
        }
        cq.head = head as u16;
        Ok(())
    }

    pub fn fatal(&self, why: &str) -> Fatal {
        self.shared.set_fatal(why);
        Fatal
    }

    #[inline]
    pub fn cq_ring(&self) -> &DmaSlice<'m> {
        &self.cq_ring
    }

    #[inline]
    pub fn shadow(&self) -> Option<Shadow> {
        self.shadow
    }

    #[inline]
    pub(super) fn sq_tail(&self, qid: u16) -> u32 {
        read_db(&self.page, self.shadow_db.as_ref(), qid, false)
    }
}
