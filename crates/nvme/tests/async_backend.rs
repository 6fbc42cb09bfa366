//! A backend that completes later (from `poll`) exercises the per-command slots.

use std::sync::Arc;

use bdev::{BlockDevice, BlockInfo, IoChannel, IoRequest, IoStatus, RamDisk};
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;

struct Later(RamDisk);
struct LaterChan {
    inner: Box<dyn IoChannel>,
    done: Vec<(u64, IoStatus)>,
}

impl BlockDevice for Later {
    fn describe(&self) -> String {
        "later".into()
    }
    fn info(&self) -> &BlockInfo {
        self.0.info()
    }
    fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(LaterChan {
            inner: self.0.channel()?,
            done: Vec::new(),
        }))
    }
}

impl IoChannel for LaterChan {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        let st = self.inner.submit(tag, req).unwrap_or(IoStatus::IoError);
        self.done.push((tag, st));
        None
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        let n = self.done.len();
        for (t, s) in self.done.drain(..) {
            done(t, s);
        }
        n
    }
}

#[test]
fn asynchronous_completions() {
    let disk: Arc<dyn BlockDevice> = Arc::new(Later(RamDisk::new(16 << 20, 4096).unwrap()));
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![disk]);
    h.ready(true);
    let a = h.alloc(2);
    h.write_mem(a, &[0x5a; 8192]);
    let cids: Vec<u16> = (0..10u64)
        .map(|i| h.submit(1, rw(1, 1, i * 2, 2, a, a + 4096)))
        .collect();
    let got: Vec<u16> = (0..10)
        .map(|_| {
            let c = h.reap(1);
            assert!(c.ok(), "{c:?}");
            c.cid
        })
        .collect();
    assert_eq!(got, cids);
    // DSM with several ranges completes once, after all of them.
    let ranges = h.alloc(1);
    let mut r = [0u8; 48];
    for k in 0..3 {
        r[k * 16 + 4..k * 16 + 8].copy_from_slice(&1u32.to_le_bytes());
        r[k * 16 + 8..k * 16 + 16].copy_from_slice(&(k as u64 * 2).to_le_bytes());
    }
    h.write_mem(ranges, &r);
    let mut s = sqe(0x09, 1);
    set_prp(&mut s, ranges, 0);
    s.cdw10 = 2;
    s.cdw11 = 1 << 2;
    assert!(h.io(s).ok());
    assert!(h.try_reap(1).is_none(), "exactly one completion");
    let out = h.alloc(1);
    assert!(h.io(rw(2, 1, 2, 1, out, 0)).ok());
    assert!(h.read_mem(out, 4096).iter().all(|x| *x == 0));
    assert!(h.io(rw(2, 1, 1, 1, out, 0)).ok());
    assert!(h.read_mem(out, 4096).iter().all(|x| *x == 0x5a));
    let st = h.ctrl.stats();
    assert_eq!(st.writes, 10);
}

/// A backend that takes at most `ROOM` requests at a time and completes them on the
/// next poll, counting the most it ever held.
struct Narrow(RamDisk, Arc<std::sync::atomic::AtomicUsize>);
struct NarrowChan {
    inner: LaterChan,
    most: Arc<std::sync::atomic::AtomicUsize>,
}
const ROOM: usize = 4;

impl BlockDevice for Narrow {
    fn describe(&self) -> String {
        "narrow".into()
    }
    fn info(&self) -> &BlockInfo {
        self.0.info()
    }
    fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(NarrowChan {
            inner: LaterChan {
                inner: self.0.channel()?,
                done: Vec::new(),
            },
            most: self.1.clone(),
        }))
    }
}

impl IoChannel for NarrowChan {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        let r = self.inner.submit(tag, req);
        self.most
            .fetch_max(self.inner.done.len(), std::sync::atomic::Ordering::Relaxed);
        r
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        self.inner.poll(done)
    }
    fn room(&self) -> usize {
        ROOM.saturating_sub(self.inner.done.len())
    }
}

#[test]
fn commands_wait_in_the_sq_while_the_backend_has_no_room() {
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let disk: Arc<dyn BlockDevice> =
        Arc::new(Narrow(RamDisk::new(16 << 20, 4096).unwrap(), most.clone()));
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![disk]);
    h.ready(true);
    let a = h.alloc(1);
    h.write_mem(a, &[0x3c; 4096]);
    let cmds: Vec<Sqe> = (0..32u64).map(|i| rw(1, 1, i, 1, a, 0)).collect();
    let cids = h.submit_batch(1, &cmds);
    let mut got: Vec<u16> = (0..32)
        .map(|_| {
            let c = h.reap(1);
            assert!(c.ok(), "{c:?}");
            c.cid
        })
        .collect();
    got.sort_unstable();
    let mut want = cids.clone();
    want.sort_unstable();
    assert_eq!(got, want, "every command completes once");
    let held = most.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        held <= ROOM,
        "backend held {held} requests, room was {ROOM}"
    );
    assert!(held > 0);
    let out = h.alloc(1);
    assert!(h.io(rw(2, 1, 31, 1, out, 0)).ok());
    assert!(h.read_mem(out, 4096).iter().all(|x| *x == 0x3c));
}
