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

/// Raw ticks since an arbitrary start as nanoseconds (the same scaling as
/// [`delta_ns`]). Histograms hold ticks and are scaled with this only when read, so
/// the hot path never converts.
#[inline]
pub fn ticks_to_ns(ticks: u64) -> u64 {
    if ticks == 0 {
        return 0;
    }
    clock().delta_as_nanos(0, ticks)
}

/// Nanoseconds per tick, for scaling means.
pub fn ns_per_tick() -> f64 {
    const SPAN: u64 = 1 << 40;
    ticks_to_ns(SPAN) as f64 / SPAN as f64
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
        assert_eq!(ticks_to_ns(b - a), ns);
        let per = ns_per_tick();
        assert!(((b - a) as f64 * per - ns as f64).abs() <= ns as f64 * 1e-6 + 1.0);
    }
}
