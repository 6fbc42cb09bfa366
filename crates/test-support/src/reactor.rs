//! What tests read of a reactor to tell whether it sleeps or spins: counters only
//! (a sleeping reactor's iteration count stops moving), never timings.

use std::sync::atomic::Ordering;

use engine::Engine;

/// How often reactor `r` of `e` went to sleep.
pub fn sleeps_on(e: &Engine, r: usize) -> u64 {
    e.stats(r).expect("reactor").sleeps.load(Ordering::Relaxed)
}

/// Reactor `r` of `e`'s poll iterations (published every 4096).
pub fn polls_on(e: &Engine, r: usize) -> u64 {
    e.stats(r)
        .expect("reactor")
        .iterations
        .load(Ordering::Relaxed)
}

/// Reactor `r` of `e`'s sleeps that ran to their time limit (500 ms) without a
/// wake-up: after one, the reactor polls whatever nothing woke it for.
pub fn sleep_timeouts_on(e: &Engine, r: usize) -> u64 {
    e.stats(r)
        .expect("reactor")
        .sleep_timeouts
        .load(Ordering::Relaxed)
}
