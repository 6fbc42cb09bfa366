//! Records by key: opaque bytes and file descriptors ([`crate::keep`]). A
//! supervisor holds one for its child; an unsupervised server holds its own, so
//! that a handover can pass them on.

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

use crate::Keeper;

/// Bounds on what a store holds: a confused (or compromised) server must not make
/// the supervisor run out of memory or descriptors. Far above what real clients
/// need (a QEMU client has ~10 DMA regions and ≤ 2048 interrupt vectors).
const MAX_RECORDS: usize = 64 * 1024;
const MAX_BYTES: usize = 64 << 20;

#[derive(Default)]
pub struct RecordStore {
    inner: Mutex<Records>,
}

#[derive(Default)]
pub struct Records {
    pub map: BTreeMap<String, (Vec<u8>, Vec<OwnedFd>)>,
    /// Bytes of keys and records held.
    used: usize,
}

fn size(key: &str, bytes: &[u8]) -> usize {
    key.len() + bytes.len()
}

impl RecordStore {
    pub fn lock(&self) -> MutexGuard<'_, Records> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores a record (replacing one with the same key); refused beyond the
    /// bounds, with a warning.
    pub fn insert(&self, key: String, bytes: Vec<u8>, fds: Vec<OwnedFd>) {
        let mut r = self.lock();
        let old = r.map.get(&key).map_or(0, |(b, _)| size(&key, b));
        let used = r.used - old + size(&key, &bytes);
        if (old == 0 && r.map.len() >= MAX_RECORDS) || used > MAX_BYTES {
            tracing::warn!(
                "record store full ({} records, {} bytes): {key} not kept",
                r.map.len(),
                r.used
            );
            return;
        }
        r.used = used;
        r.map.insert(key, (bytes, fds));
    }

    pub fn remove_prefix(&self, prefix: &str) {
        let mut r = self.lock();
        let mut freed = 0;
        r.map.retain(|k, (b, _)| {
            let keep = !k.starts_with(prefix);
            if !keep {
                freed += size(k, b);
            }
            keep
        });
        r.used -= freed;
    }

    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// In-process keeping: the fds are duplicated (the connection keeps its own).
impl Keeper for RecordStore {
    fn put(&self, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        let mut owned = Vec::with_capacity(fds.len());
        for f in fds {
            match f.try_clone_to_owned() {
                Ok(f) => owned.push(f),
                Err(e) => {
                    tracing::warn!("cannot keep record {key} ({e}); a handover would miss it");
                    return;
                }
            }
        }
        self.insert(key.to_string(), bytes.to_vec(), owned);
    }
    fn remove(&self, prefix: &str) {
        self.remove_prefix(prefix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_records_is_bounded_and_removal_frees_room() {
        let s = RecordStore::default();
        let big = vec![0u8; 1 << 20];
        for i in 0..100 {
            s.insert(format!("k/{i:03}"), big.clone(), Vec::new());
        }
        assert!(s.len() < 64, "bytes bounded: {}", s.len());
        let full = s.len();
        // Replacing a record of the same size is always allowed.
        s.insert("k/000".into(), big.clone(), Vec::new());
        assert_eq!(s.len(), full);
        s.remove_prefix("k/");
        assert!(s.is_empty());
        s.insert("k/x".into(), big, Vec::new());
        assert_eq!(s.len(), 1);
        for i in 0..MAX_RECORDS + 10 {
            s.insert(format!("n/{i}"), Vec::new(), Vec::new());
        }
        assert_eq!(s.len(), MAX_RECORDS);
    }
}
