//! A batch's inline completions go out one by one: the CQE of a command the backend
//! finished inside its submit call is posted before the next command of the same
//! batch is submitted, so a polling client can resubmit while the reactor is still
//! copying the rest (docs/decisions/0028-post-each-completion.md).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bdev::{BlockDevice, BlockInfo, IoChannel, IoRequest, IoStatus, RamDisk};
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;

const N: usize = 4;
/// How long the last submit of the batch waits for the host to see the first CQE
/// (reached only by a broken build).
const WAIT: Duration = test_support::T;

/// A RAM disk whose `N`th submit blocks until the host has reaped a CQE (or `WAIT`
/// passed, which it records).
struct Holding {
    ram: RamDisk,
    state: Arc<State>,
}
#[derive(Default)]
struct State {
    submits: AtomicUsize,
    host_saw_cqe: AtomicBool,
    timed_out: AtomicBool,
}
struct HoldingChan(Box<dyn IoChannel>, Arc<State>);

impl BlockDevice for Holding {
    fn describe(&self) -> String {
        "holding".into()
    }
    fn info(&self) -> &BlockInfo {
        self.ram.info()
    }
    fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(HoldingChan(
            self.ram.channel()?,
            self.state.clone(),
        )))
    }
}

impl IoChannel for HoldingChan {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        if self.1.submits.fetch_add(1, Ordering::SeqCst) + 1 == N {
            let t = Instant::now();
            while !self.1.host_saw_cqe.load(Ordering::SeqCst) {
                if t.elapsed() > WAIT {
                    self.1.timed_out.store(true, Ordering::SeqCst);
                    break;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        self.0.submit(tag, req)
    }
}

#[test]
fn first_cqe_of_a_batch_is_posted_before_its_last_command_is_submitted() {
    let state = Arc::new(State::default());
    let disk: Arc<dyn BlockDevice> = Arc::new(Holding {
        ram: RamDisk::new(1 << 20, 4096).unwrap(),
        state: state.clone(),
    });
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![disk]);
    h.ready(true);
    let buf = h.alloc(N as u64);
    let cmds: Vec<Sqe> = (0..N as u64)
        .map(|i| rw(2, 1, i, 1, buf + i * 4096, 0))
        .collect();
    let mut cids = h.submit_batch(1, &cmds);
    let first = h.reap(1);
    assert!(first.ok(), "{first:?}");
    state.host_saw_cqe.store(true, Ordering::SeqCst);
    let mut got = vec![first.cid];
    got.extend((1..N).map(|_| {
        let c = h.reap(1);
        assert!(c.ok(), "{c:?}");
        c.cid
    }));
    assert_eq!(state.submits.load(Ordering::SeqCst), N, "one batch of {N}");
    assert!(
        !state.timed_out.load(Ordering::SeqCst),
        "no CQE reached the host while the batch's last command was being submitted"
    );
    got.sort_unstable();
    cids.sort_unstable();
    assert_eq!(got, cids);
}
