//! Doorbell writes: into the shared sparse-mmap page when the server offers one,
//! otherwise (or for doorbells outside it) as REGION_WRITE messages. With shadow
//! doorbells (Doorbell Buffer Config) an I/O queue's value goes to the shadow page
//! first and the doorbell is rung only when the controller's EventIdx asks for it,
//! as Linux's driver does.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use guest_mem::MappedRegion;
use vfio_user::proto::PCI_BAR0_REGION;

use crate::client::VfioUserClient;
use crate::error::Result;
use crate::pool::DmaBuf;

/// The shadow doorbell and EventIdx pages shared with the controller.
#[derive(Debug)]
pub(crate) struct ShadowPages {
    pub db: DmaBuf,
    pub ei: DmaBuf,
}

#[derive(Debug)]
pub(crate) struct Doorbells {
    /// A mapping of BAR0 offsets `.1 .. .1 + .0.len()`.
    pub map: Option<(MappedRegion, u64)>,
    pub client: Arc<Mutex<VfioUserClient>>,
    /// Allocated once; in use while `shadow_on` (cleared by a controller reset).
    pub shadow: OnceLock<ShadowPages>,
    pub shadow_on: AtomicBool,
    /// I/O doorbell updates the controller's EventIdx let us skip (queue pairs add
    /// theirs in batches: a locked add per doorbell would cost the driver more than
    /// the skip saves).
    pub skipped: AtomicU64,
    /// Doorbells written by message (REGION_WRITE round trips).
    pub messages: AtomicU64,
}

/// Whether moving a doorbell from `old` to `new` passes `event_idx` (NVMe 1.3
/// Doorbell Buffer Config; the virtio EVENT_IDX rule).
fn need_event(event_idx: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event_idx).wrapping_sub(1) < new.wrapping_sub(old)
}

impl Doorbells {
    pub fn new(map: Option<(MappedRegion, u64)>, client: Arc<Mutex<VfioUserClient>>) -> Self {
        Doorbells {
            map,
            client,
            shadow: OnceLock::new(),
            shadow_on: AtomicBool::new(false),
            skipped: AtomicU64::new(0),
            messages: AtomicU64::new(0),
        }
    }

    /// Writes `v` to the doorbell at BAR0 offset `bar_off`; true when the shadow
    /// doorbell was enough (the controller's EventIdx did not ask for a ring).
    pub fn write(&self, bar_off: u64, v: u32) -> Result<bool> {
        // The admin queue (offsets 0x1000, 0x1004) has no shadow doorbells.
        if bar_off >= 0x1008 && self.shadow_on.load(Ordering::Acquire) {
            if let Some(sh) = self.shadow.get() {
                let off = (bar_off - 0x1000) as usize;
                let (db, ei) = (sh.db.slice(), sh.ei.slice());
                if let (Some(old), Some(())) = (db.load_u32(off), db.store_u32(off, v)) {
                    // Our shadow store before the EventIdx load; the controller
                    // orders its EventIdx store before its shadow load the same way.
                    fence(Ordering::SeqCst);
                    let event = ei.load_u32(off).unwrap_or(0);
                    if !need_event(event as u16, v as u16, old as u16) {
                        return Ok(true);
                    }
                }
            }
        }
        if let Some((map, base)) = &self.map {
            if let Some(s) = bar_off.checked_sub(*base).and_then(|o| map.slice(o, 4)) {
                // Release orders our queue-entry writes before the doorbell value.
                if s.store_u32(0, v).is_some() {
                    return Ok(false);
                }
            }
        }
        self.messages.fetch_add(1, Ordering::Relaxed);
        // Posted, like QEMU's trapped BAR writes: the controller applies messages in
        // order, so a later request (a register read) sees this doorbell.
        self.client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .region_write_u32_posted(PCI_BAR0_REGION, bar_off, v)?;
        Ok(false)
    }

    pub fn is_mmap(&self) -> bool {
        self.map.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::need_event;

    #[test]
    fn event_idx_rule() {
        // EventIdx at the old tail: the next update rings.
        assert!(need_event(5, 6, 5));
        assert!(need_event(5, 9, 5));
        // One behind the old tail (a polling controller): no ring.
        assert!(!need_event(4, 6, 5));
        assert!(!need_event(4, 200, 5));
        // Passed in the middle of a batch.
        assert!(need_event(7, 9, 5));
        assert!(!need_event(9, 9, 5));
    }
}
