//! A Format NVM in progress as the controller's state holds it (`State::format`):
//! which namespaces it erases, and the job its erase thread and the control path
//! share (see `super::format` for the command itself).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::status::Status;

/// How long a cancel waits for the erase request at the backend.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// The Format NVM in progress (`State::format`).
pub(crate) struct FormatRun {
    /// The command's CID; `None` once a controller reset took its queue away.
    pub cid: Option<u16>,
    pub nsids: Vec<u32>,
    pub(crate) job: Arc<Job>,
}

/// What the control path and the erase thread share.
#[derive(Default)]
pub(crate) struct Job {
    cancel: AtomicBool,
    /// An erase request is at the backend.
    busy: Mutex<bool>,
    idle: Condvar,
}

/// The status a cancelled format ends with: it is cancelled only when a target
/// namespace is removed (or the controller stops, when nothing is posted).
pub(crate) const CANCELLED: Status = Status::INVALID_NAMESPACE;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Job {
    /// Runs one backend request unless the job was cancelled.
    pub(crate) fn step(&self, f: impl FnOnce() -> Result<(), Status>) -> Result<(), Status> {
        {
            let mut busy = lock(&self.busy);
            if self.cancel.load(Ordering::Acquire) {
                return Err(CANCELLED);
            }
            *busy = true;
        }
        let r = f();
        *lock(&self.busy) = false;
        self.idle.notify_all();
        r
    }

    /// Stops the erase after the request at the backend, which it waits for.
    pub(crate) fn cancel(&self) {
        let mut busy = lock(&self.busy);
        self.cancel.store(true, Ordering::Release);
        let deadline = Instant::now() + CANCEL_WAIT;
        while *busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!("nvme: a format's erase request did not finish within 10 s");
                return;
            }
            busy = self
                .idle
                .wait_timeout(busy, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
