//! Records that outlive a process: a key, a few opaque bytes and file descriptors.
//!
//! A device puts records with a [`Keeper`] as its clients change their state
//! (control path only), under a prefix of its own; whoever keeps them (a
//! supervisor process, or this process's own [`RecordStore`](crate::RecordStore)
//! that a handover passes on) does not interpret them. The next process gets them
//! back as [`Inherited`] records and each device takes those under its prefix as
//! it is restored; what no device takes is dropped once the process is ready.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

/// Stores records for the next process. Calls come from protocol threads with the
/// device locked: they must not block for long (a keeper answers nothing).
pub trait Keeper: Send + Sync {
    /// Replaces the record `key` (closing the fds it held before).
    fn put(&self, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]);
    /// Drops every record whose key starts with `prefix` (keys that could be a
    /// prefix of another are fixed-width).
    fn remove(&self, prefix: &str);
}

/// A record handed back to a new process.
#[derive(Debug)]
pub struct Kept {
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

impl Kept {
    /// The record's last fd (records that carry one fd).
    pub fn into_fd(mut self) -> Option<OwnedFd> {
        self.fds.pop()
    }
}

/// Records by key (of one device: keys relative to its prefix).
pub type KeptRecords = BTreeMap<String, Kept>;

/// A record as a device saves it for a successor: key, bytes, fds.
#[derive(Debug)]
pub struct Record {
    pub key: String,
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

impl Record {
    pub fn new(key: impl Into<String>, bytes: Vec<u8>, fds: Vec<OwnedFd>) -> Record {
        Record {
            key: key.into(),
            bytes,
            fds,
        }
    }
}

/// The records a process was handed at start (by its supervisor or by the process
/// it took over from), for its devices to take as they are restored.
#[derive(Debug, Default)]
pub struct Inherited {
    map: Mutex<KeptRecords>,
}

impl Inherited {
    pub fn new(records: KeptRecords) -> Inherited {
        Inherited {
            map: Mutex::new(records),
        }
    }

    fn lock(&self) -> MutexGuard<'_, KeptRecords> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The record `key`, taken.
    pub fn take_one(&self, key: &str) -> Option<Kept> {
        self.lock().remove(key)
    }

    /// The records under `prefix`, taken, keys relative to it.
    pub fn take(&self, prefix: &str) -> KeptRecords {
        take_prefix(&mut self.lock(), prefix)
    }

    /// Everything not taken yet.
    pub fn take_rest(&self) -> KeptRecords {
        std::mem::take(&mut *self.lock())
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// Removes the records under `prefix` from `map`; keys relative to it.
pub fn take_prefix(map: &mut KeptRecords, prefix: &str) -> KeptRecords {
    let keys: Vec<String> = map
        .range(prefix.to_string()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .map(|(k, _)| k.clone())
        .collect();
    keys.into_iter()
        .filter_map(|k| {
            let v = map.remove(&k)?;
            Some((k[prefix.len()..].to_string(), v))
        })
        .collect()
}

/// A device's handle on a keeper: the keeper and the device's prefix.
#[derive(Clone)]
pub struct KeepHandle {
    keeper: Arc<dyn Keeper>,
    prefix: String,
}

impl std::fmt::Debug for KeepHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeepHandle")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl KeepHandle {
    pub fn new(keeper: Arc<dyn Keeper>, prefix: String) -> KeepHandle {
        KeepHandle { keeper, prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A handle for the records under `sub` of this one's prefix.
    pub fn child(&self, sub: &str) -> KeepHandle {
        KeepHandle::new(self.keeper.clone(), format!("{}{sub}", self.prefix))
    }

    pub fn put(&self, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        self.keeper
            .put(&format!("{}{key}", self.prefix), bytes, fds);
    }

    pub fn put_json<T: Serialize>(&self, key: &str, v: &T, fds: &[BorrowedFd<'_>]) {
        match serde_json::to_vec(v) {
            Ok(b) => self.put(key, &b, fds),
            Err(e) => tracing::error!("cannot encode kept record {}{key}: {e}", self.prefix),
        }
    }

    pub fn remove(&self, prefix: &str) {
        self.keeper.remove(&format!("{}{prefix}", self.prefix));
    }

    /// Everything under the handle's prefix.
    pub fn remove_all(&self) {
        self.keeper.remove(&self.prefix);
    }

    pub fn put_fd(&self, key: &str, fd: &impl AsFd) {
        self.put(key, &[], &[fd.as_fd()]);
    }
}

/// Decodes a JSON record; `None` (and a log line) when it does not parse.
pub fn parse_json<'a, T: Deserialize<'a>>(key: &str, bytes: &'a [u8]) -> Option<T> {
    match serde_json::from_slice(bytes) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!("ignoring kept record {key}: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept() -> Kept {
        Kept {
            bytes: vec![1],
            fds: Vec::new(),
        }
    }

    #[test]
    fn take_by_prefix_leaves_other_keys_and_strips_the_prefix() {
        let mut m = KeptRecords::new();
        for k in ["a#x", "a#y/1", "ab#x", "b#x"] {
            m.insert(k.into(), kept());
        }
        let inh = Inherited::new(m);
        let a: Vec<String> = inh.take("a#").into_keys().collect();
        assert_eq!(a, ["x", "y/1"]);
        assert!(inh.take_one("ab#x").is_some());
        assert!(inh.take_one("ab#x").is_none());
        let rest: Vec<String> = inh.take_rest().into_keys().collect();
        assert_eq!(rest, ["b#x"]);
        assert!(inh.is_empty());
    }
}
