//! Locking as every thread of a device does it.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data over from a holder that panicked: the state it
/// guards stays consistent between statements, and a device must keep serving
/// its other queues.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
