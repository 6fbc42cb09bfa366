//! Keeps a connection's guest memory registered with `guest_mem`'s SIGBUS guard.
//!
//! vm-memory maps the front end's regions and builds the new snapshot, which the
//! handler installs (`memory.rs`) and then hands to [`GuardedMem::sync`]. Until
//! then the pollers must not touch the new snapshot (a file shrunk in that window
//! would SIGBUS unguarded), so they use a snapshot only once it is
//! [`GuardedMem::is_guarded`]. A region must stay registered until it is unmapped,
//! which vm-memory does when the last snapshot holding it drops; we hold every
//! snapshot that may still be in use and release one only when we are its last
//! holder, unregistering the regions no other held snapshot has first.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

use guest_mem::{FaultGuard, FaultSignal};
use virtio_blk::Mem;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

type Range = (usize, usize);

pub(crate) struct GuardedMem {
    /// Raised when a region (or the inflight area) faulted.
    pub signal: Arc<FaultSignal>,
    /// The newest snapshot whose regions are all registered.
    guarded: AtomicPtr<Mem>,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    snapshots: Vec<Arc<Mem>>,
    guards: Vec<(Range, FaultGuard)>,
}

fn ranges(m: &Mem) -> impl Iterator<Item = Range> + '_ {
    m.iter().filter_map(|r| {
        let p = r.get_host_address(MemoryRegionAddress(0)).ok()?;
        Some((p as usize, r.len() as usize))
    })
}

impl GuardedMem {
    pub fn new(signal: Arc<FaultSignal>, initial: Arc<Mem>) -> GuardedMem {
        let g = GuardedMem {
            signal,
            guarded: AtomicPtr::new(std::ptr::null_mut()),
            held: Mutex::new(Held::default()),
        };
        // The initial snapshot is empty: nothing to register.
        let _ = g.sync(initial);
        g
    }

    /// Whether the pollers may touch `m`.
    pub fn is_guarded(&self, m: &Mem) -> bool {
        std::ptr::eq(self.guarded.load(Ordering::Acquire), m)
    }

    /// Registers the regions of `current` (the snapshot just installed) and releases
    /// snapshots nobody else holds any more.
    pub fn sync(&self, current: Arc<Mem>) -> std::io::Result<()> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        // Held before any of its regions is registered, so that a registration
        // failing half-way never leaves a range registered that could be unmapped.
        if !held.snapshots.iter().any(|s| Arc::ptr_eq(s, &current)) {
            held.snapshots.push(current.clone());
        }
        for range in ranges(&current) {
            if held.guards.iter().any(|(r, _)| *r == range) {
                continue;
            }
            // SAFETY: `range` is a region of `current`, which we hold until the guard
            // is dropped (see `release`), so it stays mapped while registered.
            let g = unsafe { guest_mem::guard_range(range.0 as *const u8, range.1, &self.signal) }?;
            held.guards.push((range, g));
        }
        self.guarded
            .store(Arc::as_ptr(&current).cast_mut(), Ordering::Release);
        release(&mut held, &current);
        Ok(())
    }
}

/// Drops the snapshots only we hold (except `current`), unregistering the regions
/// that no remaining snapshot has before the drop unmaps them.
fn release(held: &mut Held, current: &Arc<Mem>) {
    let (gone, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut held.snapshots)
        .into_iter()
        .partition(|s| Arc::strong_count(s) == 1 && !Arc::ptr_eq(s, current));
    held.snapshots = keep;
    if gone.is_empty() {
        return;
    }
    let live: Vec<Range> = held.snapshots.iter().flat_map(|s| ranges(s)).collect();
    held.guards.retain(|(r, _)| live.contains(r));
    drop(gone);
}

impl Drop for GuardedMem {
    fn drop(&mut self) {
        let held = self.held.get_mut().unwrap_or_else(|e| e.into_inner());
        // Unregister before the snapshots (and so possibly the mappings) go.
        held.guards.clear();
        held.snapshots.clear();
    }
}
