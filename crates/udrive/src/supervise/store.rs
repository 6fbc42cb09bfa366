//! Records by key: opaque bytes and file descriptors ([`vfio_user::keep`]). The
//! supervisor holds one for its child; an unsupervised server holds its own, so
//! that a handover can pass them on (`crate::handover`).

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

use vfio_user::Keeper;

/// One record: its bytes and fds.
pub type Entry = (Vec<u8>, Vec<OwnedFd>);

#[derive(Default)]
pub struct RecordStore {
    map: Mutex<BTreeMap<String, Entry>>,
}

impl RecordStore {
    pub fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, key: String, bytes: Vec<u8>, fds: Vec<OwnedFd>) {
        self.lock().insert(key, (bytes, fds));
    }

    pub fn remove_prefix(&self, prefix: &str) {
        self.lock().retain(|k, _| !k.starts_with(prefix));
    }

    pub fn len(&self) -> usize {
        self.lock().len()
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
