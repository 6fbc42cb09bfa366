use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fault::FaultSignal;
use crate::map::MemoryMap;
use crate::remote::{RemoteDma, RemotePause};

/// A client's current DMA memory map, changed by the control path and read by
/// reactors without locks: readers keep a [`MemView`] that checks one shared
/// generation counter per poll and reloads only when it moved.
///
/// Removing memory is safe against in-flight I/O: [`DmaSpace::update`] returns the
/// old snapshot, and [`DmaSpace::wait_released`] waits until every view has moved to
/// the new one (dropping the last reference unmaps regions that are gone).
#[derive(Debug)]
pub struct DmaSpace {
    generation: AtomicU64,
    current: Mutex<Arc<MemoryMap>>,
    /// Raised when a file behind one of the client's regions shrank under us.
    fault: Arc<FaultSignal>,
    /// The port of the client's mirror regions, once it mapped memory without a
    /// file descriptor (until it goes: [`DmaSpace::set_remote`]).
    remote: Mutex<Option<Arc<dyn RemoteDma>>>,
    /// `remote` is set: cheap to ask on placement decisions.
    messages: AtomicBool,
}

impl DmaSpace {
    /// # Panics
    /// When no eventfd can be created (descriptor limit reached at device setup);
    /// use [`DmaSpace::try_new`] to handle that.
    pub fn new() -> Arc<DmaSpace> {
        Self::try_new().expect("cannot create an eventfd for a DMA space")
    }

    pub fn try_new() -> std::io::Result<Arc<DmaSpace>> {
        Ok(Arc::new(DmaSpace {
            generation: AtomicU64::new(0),
            current: Mutex::default(),
            fault: FaultSignal::new()?,
            remote: Mutex::new(None),
            messages: AtomicBool::new(false),
        }))
    }

    /// Records (or with `None`, forgets) the port through which the current
    /// client's unshared memory moves. Set before the first mirror region is
    /// added; forgotten when the client goes.
    pub fn set_remote(&self, port: Option<Arc<dyn RemoteDma>>) {
        let mut r = self.remote.lock().unwrap_or_else(|e| e.into_inner());
        self.messages.store(port.is_some(), Ordering::Release);
        *r = port;
    }

    /// Whether the current client has memory that moves by messages (readers of
    /// this space then wait for the client: keep them off shared threads).
    pub fn uses_messages(&self) -> bool {
        self.messages.load(Ordering::Acquire)
    }

    /// Suspends the client's transfers until the guard drops: readers waiting
    /// for the client give up, new transfers fail at once. For the control path
    /// before it waits on readers it resets anyway (no-op without a port).
    pub fn pause_remote(&self) -> RemotePause {
        let port = self
            .remote
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        RemotePause::new(port)
    }

    /// What client regions should be mapped with ([`crate::MappedRegion::map_fd_watched`]),
    /// and what the client's control thread polls to learn of a fault.
    pub fn fault_signal(&self) -> &Arc<FaultSignal> {
        &self.fault
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The current map and its generation.
    pub fn snapshot(&self) -> (u64, Arc<MemoryMap>) {
        let cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        (self.generation.load(Ordering::Acquire), cur.clone())
    }

    /// Replaces the map with `f(current)`; returns the previous snapshot.
    pub fn update<E>(
        &self,
        f: impl FnOnce(&MemoryMap) -> Result<MemoryMap, E>,
    ) -> Result<Arc<MemoryMap>, E> {
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let next = Arc::new(f(&cur)?);
        let old = std::mem::replace(&mut *cur, next);
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(old)
    }

    /// Waits until `old` is referenced only by the caller, i.e. every view has moved on.
    /// Returns false on timeout (a stuck reader); memory then stays mapped until it
    /// lets go, so there is no use-after-unmap either way.
    pub fn wait_released(old: Arc<MemoryMap>, timeout: Duration) -> bool {
        let start = Instant::now();
        while Arc::strong_count(&old) > 1 {
            if start.elapsed() > timeout {
                return false;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        true
    }
}

/// A reader's cached view of a [`DmaSpace`].
#[derive(Debug)]
pub struct MemView {
    space: Arc<DmaSpace>,
    generation: u64,
    map: Arc<MemoryMap>,
}

impl MemView {
    pub fn new(space: Arc<DmaSpace>) -> MemView {
        let (generation, map) = space.snapshot();
        MemView {
            space,
            generation,
            map,
        }
    }

    /// Moves to the newest map if it changed (one atomic load when it did not), and
    /// returns it.
    #[inline]
    pub fn refresh(&mut self) -> &MemoryMap {
        if self.space.generation() != self.generation {
            let (generation, map) = self.space.snapshot();
            self.generation = generation;
            self.map = map;
        }
        &self.map
    }

    /// Lets go of the snapshot while the reader is not polled (an unmap must not
    /// wait for it); the next [`MemView::refresh`] loads the current map.
    pub fn park(&mut self) {
        self.map = Arc::new(MemoryMap::new());
        self.generation = u64::MAX;
    }

    /// Whether the map is still the newest (one atomic load).
    #[inline]
    pub fn is_current(&self) -> bool {
        self.space.generation() == self.generation
    }

    /// The map as of the last refresh.
    #[inline]
    pub fn map(&self) -> &MemoryMap {
        &self.map
    }

    /// The map as of the last refresh, to keep it alive (see [`crate::MemPins`]).
    #[inline]
    pub fn map_arc(&self) -> &Arc<MemoryMap> {
        &self.map
    }

    /// Generation of the map as of the last refresh.
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn space(&self) -> &Arc<DmaSpace> {
        &self.space
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Access, MappedRegion};

    #[test]
    fn views_move_on_and_release() {
        let space = DmaSpace::new();
        let mut view = MemView::new(space.clone());
        let r = Arc::new(MappedRegion::anonymous(0x1000, 0x1000).unwrap());
        let old = space.update(|m| m.with_region(r.clone())).unwrap();
        assert!(
            !DmaSpace::wait_released(old, Duration::from_millis(5)),
            "view still holds it"
        );
        assert!(view.refresh().translate(0x1000, 8, Access::Read).is_ok());
        let old = space
            .update(|m| Ok::<_, ()>(m.without_range(0, u64::MAX).0))
            .unwrap();
        drop(r);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            assert!(view.refresh().translate(0x1000, 8, Access::Read).is_err());
            view
        });
        assert!(DmaSpace::wait_released(old, Duration::from_secs(5)));
        drop(t.join().unwrap());
    }

    #[test]
    fn parked_view_releases_and_reloads() {
        let space = DmaSpace::new();
        let r = Arc::new(MappedRegion::anonymous(0x1000, 0x1000).unwrap());
        space.update(|m| m.with_region(r.clone())).unwrap();
        let mut view = MemView::new(space.clone());
        let old = space.update(|m| Ok::<_, ()>(m.clone())).unwrap();
        view.park();
        assert!(DmaSpace::wait_released(old, Duration::from_millis(100)));
        assert!(!view.is_current());
        assert!(view.refresh().translate(0x1000, 8, Access::Read).is_ok());
    }
}
