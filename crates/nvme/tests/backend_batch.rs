//! What a backend sees of one poll's reads and writes (docs/decisions/
//! 0033-backend-batches.md): each run of commands to one namespace arrives as one
//! `bdev::Batch` (a run of one as a plain submit), in submission order; the
//! batch's first request is announced before it arrives; a command that is not a
//! read or write keeps its place and starts a new batch after it.
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;

use std::sync::{Arc, Mutex};

use bdev::{Batch, BlockDevice, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus, RamDisk};

/// What reached a [`Recording`] disk's channel, by namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    Announced(u32, IoOp, u64),
    Batch(u32, Vec<u64>),
    Submit(u32, IoOp),
}

/// A RAM disk whose channel records what reaches it.
struct Recording {
    ram: RamDisk,
    nsid: u32,
    seen: Arc<Mutex<Vec<Seen>>>,
}

struct RecordingChan {
    inner: Box<dyn IoChannel>,
    nsid: u32,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl BlockDevice for Recording {
    fn describe(&self) -> String {
        "recording".into()
    }
    fn info(&self) -> &BlockInfo {
        self.ram.info()
    }
    fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(RecordingChan {
            inner: self.ram.channel()?,
            nsid: self.nsid,
            seen: self.seen.clone(),
        }))
    }
}

impl RecordingChan {
    fn note(&self, s: Seen) {
        self.seen.lock().unwrap().push(s);
    }
}

impl IoChannel for RecordingChan {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        self.note(Seen::Submit(self.nsid, req.op));
        self.inner.submit(tag, req)
    }
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        let mut offsets = Vec::new();
        while let Some((_, r)) = batch.request(offsets.len()) {
            offsets.push(r.offset);
        }
        self.note(Seen::Batch(self.nsid, offsets));
        self.inner.submit_batch(batch)
    }
    fn announce(&mut self, op: IoOp, offset: u64, len: u64) {
        assert_eq!(len, 4096);
        self.note(Seen::Announced(self.nsid, op, offset));
        self.inner.announce(op, offset, len)
    }
}

#[test]
fn a_polls_reads_reach_each_backend_as_batches_the_first_announced() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let disk = |nsid| -> Arc<dyn BlockDevice> {
        Arc::new(Recording {
            ram: RamDisk::new(1 << 20, 4096).unwrap(),
            nsid,
            seen: seen.clone(),
        })
    };
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![disk(1), disk(2)]);
    h.ready(true);
    let buf = h.alloc(8);
    // Each block holds its namespace and LBA, written one command at a time.
    let blocks = [(1, 0), (1, 1), (2, 2), (2, 6), (1, 3), (1, 5), (1, 4)];
    for (nsid, lba) in blocks {
        h.write_mem(buf, &[nsid as u8, lba as u8]);
        assert!(h.cmd(1, rw(1, nsid, lba, 1, buf, 0)).ok());
    }
    seen.lock().unwrap().clear();
    let read = |i: u64, nsid, lba| rw(2, nsid, lba, 1, buf + i * 4096, 0);
    let flush = sqe(0, 1);
    let cmds = [
        read(0, 1, 0),
        read(1, 1, 1),
        read(2, 2, 2),
        read(3, 2, 6),
        read(4, 1, 3),
        flush,
        read(5, 1, 5),
        read(6, 1, 4),
    ];
    let n = cmds.len();
    h.submit_batch(1, &cmds);
    for _ in 0..n {
        let c = h.reap(1);
        assert!(c.ok(), "{c:?}");
    }
    for (i, (nsid, lba)) in blocks.into_iter().enumerate() {
        let got = h.read_mem(buf + i as u64 * 4096, 2);
        assert_eq!(got, [nsid as u8, lba as u8], "read {i}");
    }
    let at = |lba: u64| lba * 4096;
    let want = [
        Seen::Announced(1, IoOp::Read, at(0)),
        Seen::Batch(1, vec![at(0), at(1)]),
        Seen::Batch(2, vec![at(2), at(6)]),
        Seen::Submit(1, IoOp::Read),
        Seen::Submit(1, IoOp::Flush),
        Seen::Announced(1, IoOp::Read, at(5)),
        Seen::Batch(1, vec![at(5), at(4)]),
    ];
    assert_eq!(*seen.lock().unwrap(), want);
}
