//! Namespaces added and removed at run time: the Namespace Attribute Changed event,
//! the Changed Namespace List log, Identify updates, and commands in flight on a
//! namespace that goes away.

use std::sync::Arc;
use std::time::Duration;

use bdev::{BlockDevice, RamDisk};
use test_support::held::HeldDisk;
use test_support::nvme_cmd::*;
use test_support::nvme_host::*;

const EVENT_NS_CHANGED: u32 = 0x0004_0002;

fn ram(mib: u64) -> Arc<dyn BlockDevice> {
    Arc::new(RamDisk::new(mib << 20, 512).unwrap())
}

fn active_list(h: &mut Host, buf: u64) -> Vec<u32> {
    let mut s = sqe(0x06, 0);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 2;
    assert!(h.admin(s).ok());
    ids(&h.read_mem(buf, 4096))
}

fn ids(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .take_while(|n| *n != 0)
        .collect()
}

fn identify_ns_size(h: &mut Host, buf: u64, nsid: u32) -> Completion {
    let mut s = sqe(0x06, nsid);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 0;
    h.admin(s)
}

#[test]
fn hot_add_and_remove_with_event_and_log() {
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram(16)]);
    h.ready(false);
    let buf = h.alloc(1);
    h.set_async_events(1 << 8);
    let cid = h.aer();
    std::thread::sleep(Duration::from_millis(5));
    assert!(h.try_reap(0).is_none(), "no event before a change");

    h.ctrl.add_namespace(3, ram(8)).unwrap();
    let c = h.reap(0);
    assert_eq!((c.cid, c.dw0), (cid, EVENT_NS_CHANGED));
    assert!(c.ok());
    // A second change before the log is read extends the list without an event.
    h.ctrl.add_namespace(2, ram(8)).unwrap();
    let cid2 = h.aer();
    std::thread::sleep(Duration::from_millis(5));
    assert!(
        h.try_reap(0).is_none(),
        "event masked until the log is read"
    );
    assert_eq!(h.changed_ns_log(buf, true), vec![2, 3], "retained");
    assert_eq!(h.changed_ns_log(buf, false), vec![2, 3]);
    assert_eq!(h.changed_ns_log(buf, false), Vec::<u32>::new(), "cleared");
    assert_eq!(active_list(&mut h, buf), vec![1, 2, 3]);
    assert!(identify_ns_size(&mut h, buf, 3).ok());
    let nsze = u64::from_le_bytes(h.read_mem(buf, 8).try_into().unwrap());
    assert_eq!(nsze, (8 << 20) / 512);

    // I/O on the new namespace, on the existing queue.
    let data = h.alloc(1);
    h.write_mem(data, &[0x3c; 4096]);
    assert!(h.io(rw(1, 3, 0, 8, data, 0)).ok());
    h.write_mem(data, &[0; 4096]);
    assert!(h.io(rw(2, 3, 0, 8, data, 0)).ok());
    assert_eq!(h.read_mem(data, 4096), vec![0x3c; 4096]);

    // Removal: the event is unmasked (log read), so it fires on the waiting AER.
    h.ctrl.remove_namespace(3).unwrap();
    let c = h.reap(0);
    assert_eq!((c.cid, c.dw0), (cid2, EVENT_NS_CHANGED));
    assert_eq!(h.changed_ns_log(buf, false), vec![3]);
    assert_eq!(h.io(rw(2, 3, 0, 8, data, 0)).code(), (0, 0x0b));
    assert!(
        h.io(rw(2, 1, 0, 8, data, 0)).ok(),
        "other namespace unaffected"
    );
    assert_eq!(active_list(&mut h, buf), vec![1, 2]);
    let c = identify_ns_size(&mut h, buf, 3);
    assert!(c.ok(), "inactive NSID in range reads as zeroes");
    assert_eq!(h.read_mem(buf, 4096), vec![0; 4096]);
    assert_eq!(identify_ns_size(&mut h, buf, 33).code(), (0, 0x0b));

    // Errors for the control path.
    assert!(matches!(
        h.ctrl.add_namespace(2, ram(1)),
        Err(nvme::NsError::Exists(2))
    ));
    assert!(matches!(
        h.ctrl.add_namespace(0, ram(1)),
        Err(nvme::NsError::OutOfRange(0, 32))
    ));
    assert!(matches!(
        h.ctrl.remove_namespace(9),
        Err(nvme::NsError::NotFound(9))
    ));
    let ns: Vec<u32> = h.ctrl.namespaces().iter().map(|n| n.nsid).collect();
    assert_eq!(ns, vec![1, 2]);
}

#[test]
fn no_event_when_host_did_not_enable_notices() {
    let mut h = Host::with(nvme::ControllerConfig::default(), vec![ram(16)]);
    h.ready(false);
    let buf = h.alloc(1);
    h.aer();
    h.ctrl.add_namespace(2, ram(8)).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    assert!(h.try_reap(0).is_none());
    assert_eq!(h.changed_ns_log(buf, false), vec![2], "the log is kept");
}

#[test]
fn removal_lets_commands_in_flight_finish() {
    let (held, gate) = HeldDisk::new(16 << 20, 512).unwrap();
    let mut h = Host::with(
        nvme::ControllerConfig::default(),
        vec![ram(16), Arc::new(held)],
    );
    h.ready(false);
    let cids = h.reads_held(2, 4, &gate);
    let data = h.alloc(1);
    h.ctrl.remove_namespace(2).unwrap();
    // New commands to the removed namespace fail at once; the others still run.
    let c = h.io(rw(2, 2, 0, 8, data, 0));
    assert_eq!(c.code(), (0, 0x0b));
    assert!(h.io(rw(2, 1, 0, 8, data, 0)).ok());
    h.release_held(&gate, &cids);
}
