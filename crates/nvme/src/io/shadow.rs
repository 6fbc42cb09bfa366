//! Doorbell values as a queue group reads them (the shadow buffer of Doorbell Buffer
//! Config, else the doorbell page) and the EventIdx values it writes back.

use guest_mem::{Access, DmaSlice, MemoryMap};

use crate::queue::db_index;

/// Shadow doorbell buffer and EventIdx buffer (Doorbell Buffer Config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shadow {
    pub db: u64,
    pub ei: u64,
}

/// No EventIdx written yet (queue indices stay below 4096).
pub(super) const NO_EI: u16 = u16::MAX;

/// The shadow doorbell page (Doorbell Buffer Config makes both buffers one
/// page-aligned page), translated once per poll.
pub(super) fn shadow_page(map: &MemoryMap, shadow: Option<Shadow>) -> Option<DmaSlice<'_>> {
    let s = shadow?;
    // A buffer in unshared client memory would have to be fetched on every poll:
    // Doorbell Buffer Config refuses one, and a buffer remapped that way later is
    // ignored (doorbells then come from the doorbell page).
    if map.has_remote() && map.is_remote(s.db) {
        return None;
    }
    map.translate(s.db, 4096, Access::Read).ok()
}

/// Current doorbell value: from the shadow buffer when configured (falling back to
/// the doorbell page if the host unmapped it), else from the doorbell page.
pub(super) fn read_db(
    page: &DmaSlice<'_>,
    shadow: Option<&DmaSlice<'_>>,
    qid: u16,
    cq: bool,
) -> u32 {
    let idx = db_index(qid, cq);
    if let Some(v) = shadow.and_then(|s| s.load_u32(idx)) {
        return u32::from_le(v);
    }
    page.load_u32(crate::DOORBELL_PAGE_OFFSET + idx)
        .map(u32::from_le)
        .unwrap_or(0)
}

pub(crate) fn write_event_idx(map: &MemoryMap, shadow: Shadow, qid: u16, cq: bool, v: u16) {
    store(map, shadow.ei, qid, cq, v);
}

pub(crate) fn write_shadow_db(map: &MemoryMap, shadow: Shadow, qid: u16, cq: bool, v: u16) {
    store(map, shadow.db, qid, cq, v);
}

fn store(map: &MemoryMap, base: u64, qid: u16, cq: bool, v: u16) {
    if let Some(w) = base
        .checked_add(db_index(qid, cq) as u64)
        .and_then(|a| map.translate(a, 4, Access::Write).ok())
    {
        w.store_u32(0, u32::from(v).to_le());
    }
}

/// The EventIdx that asks a driver not to ring while we poll: the entry just behind
/// the one we expect next. Drivers ring when an update moves their index past
/// EventIdx (`event_idx` in `[old, new)`), which one behind never is.
pub(super) fn behind(idx: u16, size: u16) -> u16 {
    idx.checked_sub(1).unwrap_or(size.saturating_sub(1))
}

/// Whether an awake group should move EventIdx (last written `ei`) up to `idx`.
/// Not on every command: the driver reads EventIdx after each of its updates, so
/// a store per command moves that cache line between its CPU and ours each time
/// (measured: ~0.05-0.15 µs per QD1 I/O). A driver rings only when its index laps
/// a lagging EventIdx, which needs more than `size - 1 - lag` entries in use; so
/// the lag allowed is half the entries `in_use` leaves free (at most a quarter of
/// the queue). `in_use` is the most the queue ever had in use, not the current
/// count: a driver whose commands all just completed refills as many at once. Before
/// sleeping the group sets EventIdx exactly (`prepare_sleep`).
pub(super) fn ei_stale(ei: u16, idx: u16, size: u16, in_use: u32) -> bool {
    if ei == NO_EI || ei >= size {
        return true;
    }
    let size = u32::from(size);
    let lag = (u32::from(idx) + size - u32::from(ei) - 1) % size;
    let slack = (size.saturating_sub(1).saturating_sub(in_use) / 2).min(size / 4);
    lag > slack
}

/// While an SQ is polled: moves its EventIdx (last written `ei`) up to just behind
/// `idx`, the tail just read, once it lags more than `ei_stale` allows, so the
/// driver keeps not ringing. Stored before that batch's commands can complete: the
/// furthest the driver can go from the head they report stays short of a lap, which
/// a later store would let it complete first. (The CQ's EventIdx moves just
/// behind the known head when an entry is about to go into the slot it names:
/// `Completions::event_idx_before_post`.)
#[inline]
pub(super) fn keep_behind(
    map: &MemoryMap,
    shadow: Shadow,
    qid: u16,
    (idx, size): (u16, u16),
    in_use: u32,
    ei: &mut u16,
) {
    if ei_stale(*ei, idx, size, in_use) {
        let v = behind(idx, size);
        write_event_idx(map, shadow, qid, false, v);
        *ei = v;
    }
}
