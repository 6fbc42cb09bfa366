//! The one bounded wait of the control path: a thread that needs something from a
//! reactor (a snapshot in a mailbox, requests drained, a queue handed back) checks,
//! nudges and sleeps a little, and gives up after a limit, because a reactor can be
//! stuck or gone and the control path must not hang with it.

use std::time::{Duration, Instant};

/// Calls `done` until it returns `true` or `limit` has passed, sleeping `pause`
/// between calls. `done` may do work each round (poll a channel, wake a reactor).
/// Returns whether it finished; `done` is called at least once, and once more after
/// the last pause, so a condition met just before the limit is seen.
pub fn wait_until(limit: Duration, pause: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(pause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finishes_when_the_condition_holds() {
        let mut n = 0;
        assert!(wait_until(Duration::from_secs(5), Duration::ZERO, || {
            n += 1;
            n == 3
        }));
        assert_eq!(n, 3);
    }

    #[test]
    fn gives_up_after_the_limit() {
        let t = Instant::now();
        let mut n = 0;
        assert!(!wait_until(
            Duration::from_millis(20),
            Duration::from_millis(1),
            || {
                n += 1;
                false
            }
        ));
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert!(n >= 2);
    }

    #[test]
    fn zero_limit_still_looks_once() {
        assert!(wait_until(Duration::ZERO, Duration::from_secs(1), || true));
    }
}
