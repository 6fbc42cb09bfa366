//! What keeps a request's guest memory mapped until the request completes.

use std::sync::Arc;

use crate::map::MemoryMap;
use crate::space::MemView;

/// The memory snapshots that a reader's requests in flight were translated against.
///
/// A reader refreshes its [`MemView`] whenever the map changed, even with requests
/// in flight; each request that outlives the poll which translated it takes a
/// [`Pin`] on the view's snapshot and returns it on completion. A snapshot stays
/// referenced while pinned, so `DmaSpace::wait_released` (an unmap) returns exactly
/// when the last request that could touch the old memory has completed.
///
/// Per request this costs a compare and an increment, no reference-count traffic:
/// the snapshot's `Arc` is cloned once per snapshot, not per request. Entries are
/// few (the current snapshot plus the ones older requests still use); the vector
/// grows only when the client changes its map.
#[derive(Debug, Default)]
pub struct MemPins {
    entries: Vec<Entry>,
}

#[derive(Debug)]
struct Entry {
    generation: u64,
    /// Never read: holding it is what keeps the snapshot's regions mapped.
    _map: Arc<MemoryMap>,
    requests: u32,
}

/// A request's hold on the snapshot it was translated against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pin(u64);

impl MemPins {
    pub fn with_capacity(n: usize) -> MemPins {
        MemPins {
            entries: Vec::with_capacity(n),
        }
    }

    /// Pins the snapshot `view` holds now, for one request.
    #[inline]
    pub fn pin(&mut self, view: &MemView) -> Pin {
        let generation = view.generation();
        match self.entries.last_mut() {
            Some(e) if e.generation == generation => e.requests += 1,
            _ => self.entries.push(Entry {
                generation,
                _map: view.map_arc().clone(),
                requests: 1,
            }),
        }
        Pin(generation)
    }

    /// Returns a request's pin; the snapshot is let go with its last request.
    #[inline]
    pub fn unpin(&mut self, pin: Pin) {
        let Some(i) = self.entries.iter().position(|e| e.generation == pin.0) else {
            return;
        };
        let e = &mut self.entries[i];
        e.requests = e.requests.saturating_sub(1);
        if e.requests == 0 {
            self.entries.remove(i);
        }
    }

    /// Requests pinned, over all snapshots.
    pub fn requests(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.requests)).sum()
    }

    /// Forgets every pin (the requests were abandoned: the controller was reset
    /// after they did not complete in time).
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Access, DmaSpace, MappedRegion};
    use std::time::Duration;

    #[test]
    fn an_unmap_waits_for_pinned_requests_only() {
        let space = DmaSpace::new();
        let r = Arc::new(MappedRegion::anonymous(0x1000, 0x1000).unwrap());
        drop(space.update(|m| m.with_region(r)).unwrap());
        let mut view = MemView::new(space.clone());
        let mut pins = MemPins::default();
        assert!(view.refresh().translate(0x1000, 8, Access::Read).is_ok());
        let a = pins.pin(&view);
        let b = pins.pin(&view);
        // The client unmaps; the reader moves on at once, its requests do not.
        let old = space
            .update(|m| Ok::<_, ()>(m.without_range(0, u64::MAX).0))
            .unwrap();
        assert!(view.refresh().translate(0x1000, 8, Access::Read).is_err());
        let c = pins.pin(&view);
        assert_eq!(pins.requests(), 3);
        pins.unpin(a);
        assert!(Arc::strong_count(&old) > 1, "b still uses the old map");
        pins.unpin(b);
        assert!(DmaSpace::wait_released(old, Duration::from_millis(50)));
        pins.unpin(c);
        assert_eq!(pins.requests(), 0);
    }
}
