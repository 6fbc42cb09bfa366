//! Secrets given over the control socket (`secret_add`, like QEMU's `secret`
//! objects): passphrases a spec names with `key-secret=NAME` instead of a key
//! file. Held only in memory that is zeroed when dropped, never logged, never in
//! `get_devices`; passed on to a successor in a live handover and kept by the
//! supervisor of a supervised server, because both reopen the volumes that need
//! them.

use std::collections::BTreeMap;
use std::sync::Mutex;

use zeroize::Zeroizing;

/// The prefix of a secret's record (a handover's, a supervisor's).
pub const RECORD_PREFIX: &str = "secret/";
/// Secrets one server holds at most.
pub const MAX_SECRETS: usize = 4096;
/// The longest secret (cryptsetup's key file limit).
pub const MAX_SECRET_BYTES: usize = 8 << 20;
/// The longest name.
const MAX_NAME: usize = 64;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("secret name {0:?}: use 1 to {MAX_NAME} letters, digits, '.', '_' or '-'")]
    BadName(String),
    #[error("a secret named {0} exists already: remove it first")]
    Exists(String),
    #[error("no secret named {0}")]
    Missing(String),
    #[error("a secret must be 1 to {MAX_SECRET_BYTES} bytes")]
    Size,
    #[error("this server holds {MAX_SECRETS} secrets already")]
    TooMany,
}

/// The record key of secret `name` (names never hold '/', so no key is the
/// prefix of another's once the trailing '/' is added).
pub fn record_key(name: &str) -> String {
    format!("{RECORD_PREFIX}{name}/")
}

/// A secret's name from its record key (relative to [`RECORD_PREFIX`]).
pub fn name_of_record(rel_key: &str) -> Option<&str> {
    rel_key.strip_suffix('/').filter(|n| valid_name(n))
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The secrets of one process, by name.
#[derive(Default)]
pub struct Secrets {
    map: Mutex<BTreeMap<String, Zeroizing<Vec<u8>>>>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({:?})", self.names())
    }
}

impl Secrets {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Zeroizing<Vec<u8>>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `name`; an existing name is refused (a volume opened with the old
    /// value would otherwise reopen with another after a handover).
    pub fn add(&self, name: &str, bytes: Zeroizing<Vec<u8>>) -> Result<(), SecretError> {
        if !valid_name(name) {
            return Err(SecretError::BadName(name.into()));
        }
        if bytes.is_empty() || bytes.len() > MAX_SECRET_BYTES {
            return Err(SecretError::Size);
        }
        let mut map = self.lock();
        if map.contains_key(name) {
            return Err(SecretError::Exists(name.into()));
        }
        if map.len() >= MAX_SECRETS {
            return Err(SecretError::TooMany);
        }
        map.insert(name.into(), bytes);
        Ok(())
    }

    pub fn remove(&self, name: &str) -> Result<(), SecretError> {
        self.lock()
            .remove(name)
            .map(drop)
            .ok_or_else(|| SecretError::Missing(name.into()))
    }

    /// A copy of `name`'s bytes.
    pub fn get(&self, name: &str) -> Option<Zeroizing<Vec<u8>>> {
        self.lock().get(name).cloned()
    }

    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Every secret as `(record key, bytes)`, for a successor.
    pub fn records(&self) -> Vec<(String, Zeroizing<Vec<u8>>)> {
        self.lock()
            .iter()
            .map(|(n, b)| (record_key(n), b.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn z(b: &[u8]) -> Zeroizing<Vec<u8>> {
        Zeroizing::new(b.to_vec())
    }

    #[test]
    fn names_sizes_and_duplicates() {
        let s = Secrets::default();
        s.add("vm1-key.0", z(b"pass")).unwrap();
        assert_eq!(s.get("vm1-key.0").unwrap().as_slice(), b"pass");
        assert_eq!(
            s.add("vm1-key.0", z(b"other")),
            Err(SecretError::Exists("vm1-key.0".into()))
        );
        for bad in ["", "a/b", "a b", &"x".repeat(65), "ü"] {
            assert_eq!(s.add(bad, z(b"k")), Err(SecretError::BadName(bad.into())));
        }
        assert_eq!(s.add("empty", z(b"")), Err(SecretError::Size));
        let big = Zeroizing::new(vec![1u8; MAX_SECRET_BYTES + 1]);
        assert_eq!(s.add("big", big), Err(SecretError::Size));
        assert_eq!(s.names(), ["vm1-key.0"]);
        assert!(!format!("{s:?}").contains("pass"));
        s.remove("vm1-key.0").unwrap();
        assert_eq!(
            s.remove("vm1-key.0"),
            Err(SecretError::Missing("vm1-key.0".into()))
        );
    }

    #[test]
    fn record_keys_round_trip_and_never_prefix_each_other() {
        let (a, ab) = (record_key("a"), record_key("ab"));
        assert!(!ab.starts_with(&a));
        let rel = &a[RECORD_PREFIX.len()..];
        assert_eq!(name_of_record(rel), Some("a"));
        assert_eq!(name_of_record("a/b/"), None);
        assert_eq!(name_of_record("nosuffix"), None);
    }

    #[test]
    fn at_most_max_secrets() {
        let s = Secrets::default();
        for i in 0..MAX_SECRETS {
            s.add(&format!("k{i}"), z(b"x")).unwrap();
        }
        assert_eq!(s.add("one-more", z(b"x")), Err(SecretError::TooMany));
    }
}
