//! The tracing clock: the calibrated TSC through `quanta` (about half the cost of a
//! `CLOCK_MONOTONIC` vDSO call on this machine, see the decision record), falling
//! back to the OS monotonic clock where the TSC is not usable. Values are raw ticks;
//! only differences mean something, converted with [`delta_ns`].

use std::sync::OnceLock;

fn clock() -> &'static quanta::Clock {
    static CLOCK: OnceLock<quanta::Clock> = OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}

/// Raw clock value. Never 0 in practice; devices use 0 for "not stamped".
#[inline]
pub fn now() -> u64 {
    clock().raw()
}

/// Nanoseconds from `start` to `end` (0 if `end` is earlier).
#[inline]
pub fn delta_ns(start: u64, end: u64) -> u64 {
    if end <= start {
        return 0;
    }
    clock().delta_as_nanos(start, end)
}

/// Calibrates the clock now, so the first traced request does not pay for it.
pub fn init() {
    let _ = clock();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_and_scaled() {
        let a = now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let b = now();
        let ns = delta_ns(a, b);
        assert!(ns >= 20_000_000, "slept 20 ms, clock says {ns} ns");
        assert_eq!(delta_ns(b, a), 0);
    }
}
