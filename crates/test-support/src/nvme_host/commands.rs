//! Command sequences the controller's tests share: namespace events and their
//! log, and commands kept in flight at a [`crate::held::HeldDisk`] while the test
//! changes the namespace under them.

use crate::held::HeldGate;
use crate::nvme_cmd::{rw, set_prp, sqe, Outcome};
use crate::wait::{wait_until, T};

use super::{Host, AEC_NS_ATTR};

impl Host {
    /// Set Features, Asynchronous Event Configuration = `aec`.
    #[track_caller]
    pub fn set_async_events(&mut self, aec: u32) {
        let mut s = sqe(0x09, 0);
        s.cdw10 = 0x0b;
        s.cdw11 = aec;
        assert!(self.admin(s).ok());
    }

    /// Submits an Asynchronous Event Request; its CID.
    pub fn aer(&mut self) -> u16 {
        self.submit(0, sqe(0x0c, 0))
    }

    /// Namespace notices on, and an AER waiting for one; the AER's CID.
    #[track_caller]
    pub fn enable_ns_events(&mut self) -> u16 {
        self.set_async_events(AEC_NS_ATTR);
        self.aer()
    }

    /// The Changed Namespace List log page, read into `buf`; `retain` keeps the
    /// list (Retain Asynchronous Event).
    #[track_caller]
    pub fn changed_ns_log(&mut self, buf: u64, retain: bool) -> Vec<u32> {
        let mut s = sqe(0x02, 0);
        set_prp(&mut s, buf, 0);
        s.cdw10 = 0x04 | (1023 << 16) | (u32::from(retain) << 15);
        assert!(self.admin(s).ok());
        self.read_mem(buf, 4096)
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .take_while(|n| *n != 0)
            .collect()
    }

    /// Submits `n` reads of 4 KiB on namespace `nsid` (queue 1) and waits until
    /// `gate`'s disk holds them all; their CIDs.
    #[track_caller]
    pub fn reads_held(&mut self, nsid: u32, n: u64, gate: &HeldGate) -> Vec<u16> {
        let data = self.alloc(n);
        let before = gate.submitted();
        let cids = (0..n)
            .map(|i| self.submit(1, rw(2, nsid, i * 8, 8, data + i * 4096, 0)))
            .collect();
        let want = before + usize::try_from(n).expect("count");
        wait_until("the reads at the backend", T, || gate.submitted() == want);
        assert!(self.try_reap(1).is_none(), "held by the backend");
        cids
    }

    /// Opens `gate` and checks that the commands `cids` held there complete, each
    /// successfully.
    #[track_caller]
    pub fn release_held(&mut self, gate: &HeldGate, cids: &[u16]) {
        gate.open();
        let done = self.reap_n(1, cids.len());
        assert!(done.iter().all(|c| c.ok()), "in flight, finished: {done:?}");
        let mut got: Vec<u16> = done.iter().map(|c| c.cid).collect();
        got.sort_unstable();
        let mut want = cids.to_vec();
        want.sort_unstable();
        assert_eq!(got, want, "every command in flight finishes");
    }
}
