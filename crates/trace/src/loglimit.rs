//! A budget for log lines that a guest or a client can trigger: without one, a
//! hostile ring or a connect/close loop writes thousands of lines a second and
//! floods the host's logs (and disk) for every tenant.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Lines allowed per window, per limiter (one limiter per device).
pub const LINES_PER_WINDOW: u32 = 10;
/// Window length.
pub const WINDOW_MS: u64 = 1000;

/// Allows `LINES_PER_WINDOW` lines per second; counts the rest, and reports the
/// count with the next line it allows. Lock-free: a few atomics, no allocation.
#[derive(Debug, Default)]
pub struct LogLimiter {
    window: AtomicU64,
    lines: AtomicU32,
    suppressed: AtomicU64,
}

fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    // Offset by a window, so that a fresh limiter (window 0) starts a new one.
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + WINDOW_MS
}

impl LogLimiter {
    pub const fn new() -> LogLimiter {
        LogLimiter {
            window: AtomicU64::new(0),
            lines: AtomicU32::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)`: log this line, and say that `n` lines were suppressed since the
    /// last one logged. `None`: over budget; the line is counted, not logged.
    pub fn allow(&self) -> Option<u64> {
        let now = now_ms();
        let w = self.window.load(Ordering::Relaxed);
        if now.saturating_sub(w) >= WINDOW_MS
            && self
                .window
                .compare_exchange(w, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.lines.store(0, Ordering::Relaxed);
        }
        if self.lines.fetch_add(1, Ordering::Relaxed) < LINES_PER_WINDOW {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Logs through a [`LogLimiter`]: `limited!(limiter, warn, "text {x}", ...)`; the
/// line gets a `suppressed` field when lines were dropped before it.
#[macro_export]
macro_rules! limited {
    ($lim:expr, $level:ident, $($arg:tt)+) => {
        if let Some(suppressed) = ($lim).allow() {
            if suppressed > 0 {
                ::tracing::$level!(suppressed, $($arg)+);
            } else {
                ::tracing::$level!($($arg)+);
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_cut_and_counted() {
        let l = LogLimiter::new();
        let allowed = (0..1000).filter(|_| l.allow().is_some()).count();
        assert_eq!(allowed, LINES_PER_WINDOW as usize);
        assert_eq!(l.suppressed.load(Ordering::Relaxed), 990);
        // The next window's first line carries the count.
        l.window.store(0, Ordering::Relaxed);
        assert_eq!(l.allow(), Some(990));
        assert_eq!(l.allow(), Some(0));
    }
}
