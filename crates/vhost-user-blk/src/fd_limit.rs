//! Running out of file descriptors is the one resource error a front end can drive
//! (each connection needs a few): say so once per burst, with what to do.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the epoch of the last report; at most one report per 10 s.
static LAST: AtomicU64 = AtomicU64::new(0);

/// Logs `err` if it is EMFILE/ENFILE (rate-limited) or, for other errors, as-is.
pub(crate) fn report(what: &str, err: &std::io::Error) {
    let limit = matches!(err.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE));
    if !limit {
        tracing::warn!(error = %err, "cannot create {what}");
        return;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let last = LAST.load(Ordering::Relaxed);
    if now >= last + 10
        && LAST
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::error!(
            error = %err,
            "cannot create {what}: the process is out of file descriptors; \
             vhost-user connections fail until some close. Raise the limit \
             (`ulimit -n`, LimitNOFILE= in a systemd unit) or serve fewer devices"
        );
    }
}
