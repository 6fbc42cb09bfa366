//! Format NVM at controller level: new LBA format and erase, the event, I/O while
//! the erase runs, refusals, and a namespace removed under a running format.

use std::sync::Arc;
use std::time::Duration;

use bdev::{BlockDevice, RamDisk};
use test_support::held::{HeldDisk, HeldGate};
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;
use test_support::{wait_until, T};

const EVENT_NS_CHANGED: u32 = 0x0004_0002;
const FORMAT_NVM: u8 = 0x80;

fn ram(mib: u64, bs: u32) -> Arc<dyn BlockDevice> {
    Arc::new(RamDisk::new(mib << 20, bs).unwrap())
}

/// Format NVM of `nsid` to LBA format `lbaf` with Secure Erase Settings `ses`.
fn format(lbaf: u32, ses: u32, nsid: u32) -> Sqe {
    let mut s = sqe(FORMAT_NVM, nsid);
    s.cdw10 = lbaf | (ses << 9);
    s
}

/// Identify Namespace: (NSZE, NLBAF, FLBAS, [LBADS of LBAF0, LBAF1]).
fn identify_ns(h: &mut Host, buf: u64, nsid: u32) -> (u64, u8, u8, [u8; 2]) {
    let mut s = sqe(0x06, nsid);
    set_prp(&mut s, buf, 0);
    assert!(h.admin(s).ok());
    let b = h.read_mem(buf, 4096);
    let nsze = u64::from_le_bytes(b[..8].try_into().unwrap());
    (nsze, b[25], b[26], [b[128 + 2], b[132 + 2]])
}

/// Reaps admin completions until the one with `cid`; returns it and the others.
fn reap_cid(h: &mut Host, cid: u16) -> (Completion, Vec<Completion>) {
    let mut others = Vec::new();
    loop {
        let c = h.reap(0);
        if c.cid == cid {
            return (c, others);
        }
        others.push(c);
    }
}

#[test]
fn format_changes_the_lba_size_erases_and_tells_the_host() {
    let mut h = Host::with(
        nvme::ControllerConfig::default(),
        vec![ram(16, 512), ram(8, 512)],
    );
    h.ready(false);
    let buf = h.alloc(1);
    let data = h.alloc(2);
    // Identify Controller: OACS announces Format NVM; FNA: per namespace, no crypto.
    let mut s = sqe(0x06, 0);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 1;
    assert!(h.admin(s).ok());
    let id = h.read_mem(buf, 4096);
    assert_eq!(u16::from_le_bytes([id[256], id[257]]) & 0b10, 0b10, "OACS");
    assert_eq!(id[524], 0, "FNA");
    assert_eq!(identify_ns(&mut h, buf, 1), (32768, 1, 0, [9, 12]));

    h.write_mem(data, &[0x5a; 8192]);
    assert!(h.io(rw(1, 1, 0, 16, data, data + 4096)).ok());
    assert!(h.io(rw(1, 2, 0, 16, data, data + 4096)).ok());
    let aer = h.enable_ns_events();
    let cid = h.submit(0, format(1, 1, 1));
    let (c, others) = reap_cid(&mut h, cid);
    assert!(c.ok(), "format to 4096: {c:?}");
    let ev = match others.first() {
        Some(e) => *e,
        None => h.reap(0),
    };
    assert_eq!((ev.cid, ev.dw0), (aer, EVENT_NS_CHANGED));
    assert_eq!(h.changed_ns_log(buf, false), vec![1]);
    assert_eq!(identify_ns(&mut h, buf, 1), (4096, 1, 1, [9, 12]));
    assert_eq!(h.ctrl.namespace_info(1).unwrap().block_size, 4096);

    // Erased; I/O in 4096-byte blocks up to the new end.
    h.write_mem(data, &[0xff; 8192]);
    assert!(h.io(rw(2, 1, 0, 2, data, data + 4096)).ok());
    assert_eq!(h.read_mem(data, 8192), vec![0; 8192]);
    h.write_mem(data, &[0x77; 4096]);
    assert!(h.io(rw(1, 1, 4095, 1, data, 0)).ok());
    assert_eq!(h.io(rw(2, 1, 4096, 1, data, 0)).code(), (0, 0x80));
    h.write_mem(data, &[0; 4096]);
    assert!(h.io(rw(2, 1, 4095, 1, data, 0)).ok());
    assert_eq!(h.read_mem(data, 4096), vec![0x77; 4096]);
    // The other namespace kept its format and data.
    assert_eq!(identify_ns(&mut h, buf, 2), (16384, 1, 0, [9, 12]));
    assert!(h.io(rw(2, 2, 0, 16, data, data + 4096)).ok());
    assert_eq!(h.read_mem(data, 8192), vec![0x5a; 8192]);

    // Back to 512 without Secure Erase: udrive erases anyway (§5.23: no user data
    // of before a format may be returned).
    h.write_mem(data, &[0x33; 4096]);
    assert!(h.io(rw(1, 1, 0, 1, data, 0)).ok());
    assert!(h.admin(format(0, 0, 1)).ok());
    assert_eq!(identify_ns(&mut h, buf, 1), (32768, 1, 0, [9, 12]));
    h.write_mem(data, &[0xff; 4096]);
    assert!(h.io(rw(2, 1, 0, 8, data, 0)).ok());
    assert_eq!(h.read_mem(data, 4096), vec![0; 4096]);
    assert!(h.io(rw(2, 1, 32767, 1, data, 0)).ok());
}

#[test]
fn refusals_change_nothing() {
    let ram1 = ram(4, 512);
    let slice: Arc<dyn BlockDevice> =
        Arc::new(bdev::SliceDisk::new(ram(8, 512), 1 << 20, 4 << 20).unwrap());
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram1, slice]);
    h.ready(false);
    let buf = h.alloc(1);
    let data = h.alloc(1);
    h.write_mem(data, &[0x11; 4096]);
    assert!(h.io(rw(1, 1, 0, 8, data, 0)).ok());
    let cases: &[(&str, Sqe, (u8, u8))] = &[
        ("LBAF 2", format(2, 0, 1), (1, 0x0a)),
        ("LBAFU", format(1 << 12, 0, 1), (1, 0x0a)),
        ("PI type 1", format(1 | 1 << 5, 0, 1), (1, 0x0a)),
        ("PI reserved", format(1 | 4 << 5, 0, 1), (0, 0x02)),
        ("crypto erase", format(1, 2, 1), (0, 0x02)),
        ("SES reserved", format(1, 5, 1), (0, 0x02)),
        ("slice", format(1, 1, 2), (0, 0x0b)),
        ("all, with a slice", format(1, 0, 0xffff_ffff), (0, 0x0b)),
        ("inactive NSID", format(1, 0, 3), (0, 0x0b)),
        ("NSID 0", format(1, 0, 0), (0, 0x0b)),
    ];
    for (what, s, code) in cases {
        assert_eq!(h.admin(*s).code(), *code, "{what}");
    }
    assert_eq!(identify_ns(&mut h, buf, 1), (8192, 1, 0, [9, 12]));
    h.write_mem(data, &[0; 4096]);
    assert!(h.io(rw(2, 1, 0, 8, data, 0)).ok());
    assert_eq!(h.read_mem(data, 4096), vec![0x11; 4096], "data kept");
    // MSET and PIL mean nothing without metadata and are accepted.
    assert!(h.admin(format(1 | 1 << 4 | 1 << 8, 1, 1)).ok());
    assert_eq!(identify_ns(&mut h, buf, 1).2, 1);
}

#[test]
fn all_namespaces_at_once() {
    let mut h = Host::with(
        nvme::ControllerConfig::default(),
        vec![ram(4, 512), ram(4, 4096)],
    );
    h.ready(false);
    let buf = h.alloc(1);
    assert_eq!(identify_ns(&mut h, buf, 2), (1024, 1, 1, [9, 12]));
    assert!(h.admin(format(1, 1, 0xffff_ffff)).ok());
    assert_eq!(identify_ns(&mut h, buf, 1), (1024, 1, 1, [9, 12]));
    assert_eq!(identify_ns(&mut h, buf, 2), (1024, 1, 1, [9, 12]));
    assert!(h.admin(format(0, 0, 0xffff_ffff)).ok());
    assert_eq!(identify_ns(&mut h, buf, 2), (8192, 1, 0, [9, 12]));
}

/// A RAM namespace whose completions wait for the gate.
fn held() -> (Arc<dyn BlockDevice>, Arc<HeldGate>) {
    let (disk, gate) = HeldDisk::new(8 << 20, 512).unwrap();
    (Arc::new(disk), gate)
}

#[test]
fn io_in_flight_refuses_and_io_during_the_erase_waits() {
    let (disk, gate) = held();
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram(4, 512), disk]);
    h.ready(false);
    let buf = h.alloc(1);
    let data = h.alloc(1);
    // A read held by the backend: the format is refused (§5.23).
    let read = h.submit(1, rw(2, 2, 0, 8, data, 0));
    wait_until("the read at the backend", T, || gate.submitted() == 1);
    assert_eq!(h.admin(format(1, 1, 2)).code(), (0, 0x0c));
    gate.open();
    assert_eq!(h.reap(1).cid, read);
    gate.close();

    // The erase is held: the namespace's I/O gets Format In Progress (no DNR: the
    // host may retry), a second format too; the other namespace works.
    let cid = h.submit(0, format(1, 1, 2));
    wait_until("the erase at the backend", T, || gate.submitted() > 1);
    assert!(h.try_reap(0).is_none(), "the format waits for its erase");
    let c = h.io(rw(2, 2, 0, 8, data, 0));
    assert_eq!(c.code(), (0, 0x84));
    assert!(!c.status.dnr, "no DNR");
    assert_eq!(h.io(sqe(0x00, 2)).code(), (0, 0x84), "flush");
    assert_eq!(h.admin(format(1, 1, 1)).code(), (0, 0x84));
    assert!(h.io(rw(2, 1, 0, 8, data, 0)).ok());
    // Identify still shows the old format until the erase ends.
    assert_eq!(identify_ns(&mut h, buf, 2), (16384, 1, 0, [9, 12]));
    gate.open();
    let (c, _) = reap_cid(&mut h, cid);
    assert!(c.ok(), "{c:?}");
    assert_eq!(identify_ns(&mut h, buf, 2), (2048, 1, 1, [9, 12]));
    assert!(h.io(rw(2, 2, 2047, 1, data, 0)).ok());
}

#[test]
fn removal_and_reset_under_a_running_format() {
    let (disk, gate) = held();
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram(4, 512), disk]);
    h.ready(false);
    let buf = h.alloc(1);
    // Removal cancels the erase and waits for the request at the backend (the gate
    // opens meanwhile); the format ends with Invalid Namespace. Nothing outside the
    // controller's lock shows that the removal is waiting, so the gate opens 50 ms
    // after the call begins: the removal must take the lock within those 50 ms,
    // which only a thread stalled between two instructions for that long misses.
    let cid = h.submit(0, format(1, 1, 2));
    wait_until("the erase at the backend", T, || gate.submitted() > 0);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            gate.open();
        });
        h.ctrl.remove_namespace(2).unwrap();
    });
    let (c, _) = reap_cid(&mut h, cid);
    assert_eq!(c.code(), (0, 0x0b));
    assert!(h.admin(format(1, 1, 1)).ok(), "the next format runs");

    // A reset drops the command of a running format; the format still ends and
    // the namespace has its new format.
    let (disk, gate) = held();
    h.ctrl.add_namespace(2, disk).unwrap();
    h.submit(0, format(1, 1, 2));
    wait_until("the erase at the backend", T, || gate.submitted() > 0);
    h.disable();
    h.ready(false);
    gate.open();
    wait_until("the format to end", T, || {
        h.ctrl.namespace_info(2).unwrap().block_size == 4096
    });
    // Nothing can be waited for here: give a wrongly posted completion time to show.
    std::thread::sleep(Duration::from_millis(10));
    assert!(h.try_reap(0).is_none(), "nothing posted for the old queue");
    assert_eq!(identify_ns(&mut h, buf, 2), (2048, 1, 1, [9, 12]));
}
