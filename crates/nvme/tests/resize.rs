//! Online resize at controller level (docs/decisions/0018-online-resize.md): the
//! event and the Changed Namespace List, Identify's new size, I/O beyond the old
//! end and beyond a new smaller end, commands in flight on the old handle, and the
//! refusals (unknown namespace, bad size, a running format, a backend that cannot).

use std::sync::Arc;

use bdev::{BlockDevice, RamDisk};
use nvme::{NsError, NsNotice};
use test_support::held::HeldDisk;
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;
use test_support::{wait_until, T};

const EVENT_NS_CHANGED: u32 = 0x0004_0002;
const MIB: u64 = 1 << 20;

fn ram(mib: u64) -> Arc<dyn BlockDevice> {
    Arc::new(RamDisk::new(mib * MIB, 512).unwrap())
}

/// Identify Namespace: (NSZE, NCAP, NUSE, FLBAS).
fn identify_ns(h: &mut Host, buf: u64, nsid: u32) -> (u64, u64, u64, u8) {
    let mut s = sqe(0x06, nsid);
    set_prp(&mut s, buf, 0);
    assert!(h.admin(s).ok());
    let b = h.read_mem(buf, 4096);
    let q = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    (q(0), q(8), q(16), b[26])
}

/// Resizes namespace `nsid` of `h` through the backend's own `resize`.
fn resize(h: &Host, nsid: u32, bytes: u64) -> Result<NsNotice, NsError> {
    let dev = h.ctrl.namespace(nsid).map(|n| n.dev);
    h.ctrl.resize_namespace(nsid, bytes, |b| match dev {
        Some(d) => d.resize(b),
        None => Err(std::io::Error::other("no such namespace")),
    })
}

#[test]
fn grow_and_shrink_tell_the_host_and_move_the_end() {
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram(16), ram(8)]);
    h.ready(false);
    let buf = h.alloc(1);
    let data = h.alloc(1);
    let cid = h.enable_ns_events();
    let last = (16 * MIB / 512) - 8;
    h.write_mem(data, &[0x5a; 4096]);
    assert!(h.io(rw(1, 1, last, 8, data, 0)).ok());
    assert_eq!(h.io(rw(1, 1, last + 8, 8, data, 0)).code(), (0, 0x80));

    // Grow: the event, the log, Identify, and I/O past the old end.
    assert_eq!(resize(&h, 1, 32 * MIB).unwrap(), NsNotice::Event);
    let c = h.reap(0);
    assert_eq!((c.cid, c.dw0), (cid, EVENT_NS_CHANGED));
    assert_eq!(h.changed_ns_log(buf, false), vec![1]);
    let blocks = 32 * MIB / 512;
    assert_eq!(identify_ns(&mut h, buf, 1), (blocks, blocks, blocks, 0));
    h.write_mem(data, &[0xc3; 4096]);
    assert!(h.io(rw(1, 1, blocks - 8, 8, data, 0)).ok());
    h.write_mem(data, &[0; 4096]);
    assert!(h.io(rw(2, 1, last, 8, data, 0)).ok());
    assert_eq!(h.read_mem(data, 4096), vec![0x5a; 4096], "data kept");
    assert!(h.io(rw(2, 1, blocks - 8, 8, data, 0)).ok());
    assert_eq!(h.read_mem(data, 4096), vec![0xc3; 4096]);
    assert_eq!(h.io(rw(2, 1, blocks, 8, data, 0)).code(), (0, 0x80));

    // A change while the host has no AER outstanding and has read the log:
    // queued, posted with the next AER.
    assert_eq!(resize(&h, 1, 8 * MIB).unwrap(), NsNotice::Event);
    let cid = h.submit(0, sqe(0x0c, 0));
    let c = h.reap(0);
    assert_eq!((c.cid, c.dw0), (cid, EVENT_NS_CHANGED));
    // Shrunk: beyond the new end is LBA Out of Range, below it the data is there.
    let small = 8 * MIB / 512;
    assert_eq!(identify_ns(&mut h, buf, 1).0, small);
    assert_eq!(h.io(rw(2, 1, small, 8, data, 0)).code(), (0, 0x80));
    assert_eq!(h.io(rw(1, 1, last, 8, data, 0)).code(), (0, 0x80));
    h.write_mem(data, &[0x77; 4096]);
    assert!(h.io(rw(1, 1, small - 8, 8, data, 0)).ok());
    // A second change before the log is read: listed, no second event.
    assert_eq!(resize(&h, 2, 12 * MIB).unwrap(), NsNotice::Pending);
    assert_eq!(h.changed_ns_log(buf, false), vec![1, 2]);
    assert_eq!(identify_ns(&mut h, buf, 2).0, 12 * MIB / 512);
    assert!(h.io(rw(2, 2, 12 * MIB / 512 - 8, 8, data, 0)).ok());
}

#[test]
fn the_formatted_lba_size_stays_and_decides_what_sizes_fit() {
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram(16)]);
    h.ready(false);
    let buf = h.alloc(1);
    // Format NVM to 4096-byte blocks (LBAF 1).
    let mut s = sqe(0x80, 1);
    s.cdw10 = 1;
    assert!(h.admin(s).ok());
    assert_eq!(identify_ns(&mut h, buf, 1), (4096, 4096, 4096, 1));
    assert!(matches!(
        resize(&h, 1, 16 * MIB + 512),
        Err(NsError::Size {
            block_size: 4096,
            ..
        })
    ));
    assert_eq!(resize(&h, 1, 24 * MIB).unwrap(), NsNotice::Disabled);
    let n = 24 * MIB / 4096;
    assert_eq!(identify_ns(&mut h, buf, 1), (n, n, n, 1));
}

#[test]
fn refusals_change_nothing() {
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram(16)]);
    let slice: Arc<dyn BlockDevice> = Arc::new(bdev::SliceDisk::new(ram(16), MIB, MIB).unwrap());
    h.ctrl.add_namespace(2, slice).unwrap();
    // Not enabled yet: the host learns the size when it identifies.
    assert_eq!(resize(&h, 1, 20 * MIB).unwrap(), NsNotice::NotReady);
    h.ready(false);
    let buf = h.alloc(1);
    assert!(matches!(resize(&h, 3, MIB), Err(NsError::NotFound(3))));
    assert!(matches!(resize(&h, 0, MIB), Err(NsError::OutOfRange(0, _))));
    assert!(matches!(resize(&h, 1, 0), Err(NsError::Size { .. })));
    assert!(matches!(resize(&h, 1, 1000), Err(NsError::Size { .. })));
    match resize(&h, 2, 2 * MIB) {
        Err(NsError::Backend(e)) => assert_eq!(e.kind(), std::io::ErrorKind::Unsupported),
        r => panic!("a slice resized: {r:?}"),
    }
    assert_eq!(identify_ns(&mut h, buf, 1).0, 20 * MIB / 512);
    assert_eq!(identify_ns(&mut h, buf, 2).0, MIB / 512);
}

/// Namespace 2 holds its completions until its gate opens; a resized handle gets
/// a gate of its own, open.
#[test]
fn commands_in_flight_finish_on_the_old_handle() {
    let (held, gate) = HeldDisk::over(ram(16));
    let mut h = Host::with(
        nvme::ControllerConfig::default(),
        vec![ram(16), Arc::new(held)],
    );
    h.ready(false);
    let cids = h.reads_held(2, 4, &gate);
    let data = h.alloc(1);
    resize(&h, 2, 32 * MIB).unwrap();
    // New commands go to the new handle (its gate is open), past the old end too.
    h.write_mem(data, &[0x11; 4096]);
    assert!(h.io(rw(1, 2, 32 * MIB / 512 - 8, 8, data, 0)).ok());
    assert!(h.io(rw(1, 1, 0, 8, data, 0)).ok(), "namespace 1 unaffected");
    // The old handle still holds requests of namespace 2: no format now.
    let mut s = sqe(0x80, 2);
    s.cdw10 = 1;
    assert_eq!(h.admin(s).code(), (0, 0x0c), "Command Sequence Error");
    h.release_held(&gate, &cids);
    let mut s = sqe(0x80, 2);
    s.cdw10 = 1;
    assert!(h.admin(s).ok(), "format once the old requests are done");
}

#[test]
fn no_resize_while_a_format_erases() {
    let (held, gate) = HeldDisk::over(ram(16));
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![Arc::new(held)]);
    h.ready(false);
    let buf = h.alloc(1);
    // The erase is held by the gate: the format command stays outstanding.
    let mut s = sqe(0x80, 1);
    s.cdw10 = 1;
    let cid = h.submit(0, s);
    wait_until("the erase at the backend", T, || gate.submitted() > 0);
    let mut called = false;
    let r = h.ctrl.resize_namespace(1, 32 * MIB, |_| {
        called = true;
        Err::<nvme::Namespace, _>(std::io::Error::other("must not be called"))
    });
    assert!(matches!(r, Err(NsError::Formatting(1))), "{r:?}");
    assert!(!called, "the backend is not touched");
    gate.open();
    let c = h.reap(0);
    assert_eq!(c.cid, cid);
    assert!(c.ok());
    assert_eq!(resize(&h, 1, 32 * MIB).unwrap(), NsNotice::Disabled);
    assert_eq!(identify_ns(&mut h, buf, 1).0, 32 * MIB / 4096);
}
