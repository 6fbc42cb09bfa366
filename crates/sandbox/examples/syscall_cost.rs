//! What a reactor's system call costs under the sandbox: ns per `preadv2` of
//! 4 KiB from /dev/zero in a thread of the reactor role, with the sandbox `off`
//! (plain thread) or `on` (the spawner's control filter plus the reactor's).
//!
//!     cargo run --release -p sandbox --example syscall_cost -- on|off [CALLS]

use std::os::fd::AsRawFd;
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode: sandbox::Mode = args
        .next()
        .unwrap_or_else(|| "on".into())
        .parse()
        .expect("on or off");
    let calls: u32 = args
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000_000);
    sandbox::configure(mode).expect("sandbox");
    let t = sandbox::spawn(sandbox::Role::Reactor, "reactor0".into(), move || {
        let f = std::fs::File::open("/dev/zero").expect("/dev/zero");
        let mut buf = vec![0u8; 4096];
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let t0 = Instant::now();
        for _ in 0..calls {
            // SAFETY: one iovec over a live buffer of its length.
            unsafe { libc::preadv2(f.as_raw_fd(), &iov, 1, 0, 0) };
        }
        t0.elapsed().as_nanos() as f64 / f64::from(calls)
    })
    .expect("thread");
    println!("{mode}: {:.1} ns per preadv2", t.join().expect("join"));
}
