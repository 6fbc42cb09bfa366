//! NVMe conformance corners that independent clients and compliance suites probe,
//! through udrive's initiator with raw admin commands
//! (docs/decisions/0011-nvme-conformance.md).

mod common;

use common::*;
use initiator::cmd::opc;
use initiator::{Completion, NvmeDriver, Sqe};

const ERROR_RECOVERY: u32 = 0x05;
const QUEUES: u32 = 0x07;
const WRITE_ATOMICITY: u32 = 0x0a;
const HOST_BEHAVIOR: u32 = 0x16;

fn get_features(d: &NvmeDriver, fid: u32, sel: u32) -> Completion {
    let s = Sqe {
        cdw10: fid | (sel << 8),
        ..Sqe::new(opc::GET_FEATURES)
    };
    d.admin(s).unwrap()
}

fn set_features(d: &NvmeDriver, fid: u32, cdw11: u32) -> Completion {
    d.admin(Sqe::set_features(fid, cdw11)).unwrap()
}

/// Error Recovery and Write Atomicity Normal are mandatory for NVM controllers (NVMe
/// 1.4 §5.21.1, the Feature Identifiers table);
/// Host Behavior Support is what drivers with ACRE query. Each reads back what was
/// set, and SEL = 3 reports it changeable.
#[test]
fn mandatory_and_queried_features() {
    let dev = TestDev::start("features", &["ram:4M"]);
    let d = dev.connect();
    for fid in [ERROR_RECOVERY, WRITE_ATOMICITY, HOST_BEHAVIOR] {
        let c = get_features(&d, fid, 3);
        assert_ok(&c, &format!("capabilities of feature {fid:#x}"));
        assert_eq!(c.dw0, 0b100, "feature {fid:#x}: changeable, not saveable");
    }
    // Error Recovery: TLER round trip; DULBE refused (no namespace has DAE).
    assert_eq!(get_features(&d, ERROR_RECOVERY, 0).dw0, 0);
    assert_ok(&set_features(&d, ERROR_RECOVERY, 50), "set TLER");
    assert_eq!(get_features(&d, ERROR_RECOVERY, 0).dw0, 50);
    assert_status(
        &set_features(&d, ERROR_RECOVERY, 1 << 16),
        0,
        0x02,
        "DULBE without deallocated-block errors",
    );
    // Write Atomicity Normal: DN round trip.
    assert_eq!(get_features(&d, WRITE_ATOMICITY, 0).dw0, 0);
    assert_ok(&set_features(&d, WRITE_ATOMICITY, 1), "set DN");
    assert_eq!(get_features(&d, WRITE_ATOMICITY, 0).dw0, 1);
    // Host Behavior Support: a 512-byte structure in the data buffer.
    let buf = d.alloc_buf(4096).unwrap();
    let with_buf = |opcode: u8, cdw10: u32| Sqe {
        cdw10,
        dptr: [buf.iova(), 0],
        ..Sqe::new(opcode)
    };
    let acre = |d: &NvmeDriver| {
        buf.write(0, &[0xff; 512]).unwrap();
        assert_ok(
            &d.admin(with_buf(opc::GET_FEATURES, HOST_BEHAVIOR)).unwrap(),
            "get host behavior",
        );
        let mut b = [0u8; 512];
        buf.read(0, &mut b).unwrap();
        assert!(b[1..].iter().all(|x| *x == 0), "fields beyond ACRE read 0");
        b[0]
    };
    assert_eq!(acre(&d), 0);
    let mut page = [0u8; 512];
    page[0] = 1;
    buf.write(0, &page).unwrap();
    assert_ok(
        &d.admin(with_buf(opc::SET_FEATURES, HOST_BEHAVIOR)).unwrap(),
        "enable ACRE",
    );
    assert_eq!(acre(&d), 1);
    page[0] = 2;
    buf.write(0, &page).unwrap();
    let c = d.admin(with_buf(opc::SET_FEATURES, HOST_BEHAVIOR)).unwrap();
    assert_status(&c, 0, 0x02, "ACRE 2 is reserved");
    let c = d
        .admin(Sqe {
            dptr: [UNMAPPED, 0],
            ..with_buf(opc::SET_FEATURES, HOST_BEHAVIOR)
        })
        .unwrap();
    assert!(!c.status.is_ok(), "a data buffer outside the DMA map");
    assert_eq!(acre(&d), 1, "failed Sets change nothing");
    drop(d);
    dev.check_fresh_client(3);
}

/// Number of Queues may only be set before any I/O queue exists (NVMe 1.4
/// §5.21.1.7): afterwards Command Sequence Error, and again allowed once all are
/// deleted.
#[test]
fn number_of_queues_after_io_queues_exist() {
    let dev = TestDev::start("nqueues", &["ram:4M"]);
    let d = dev.connect();
    let want = (3 << 16) | 3;
    assert_ok(&set_features(&d, QUEUES, want), "before any I/O queue");
    let mem = d.alloc_buf(8192).unwrap();
    assert_ok(
        &d.admin(Sqe::create_io_cq(1, 16, mem.iova(), 0, true))
            .unwrap(),
        "CQ 1",
    );
    assert_status(
        &set_features(&d, QUEUES, want),
        0,
        0x0c,
        "with a completion queue",
    );
    assert_ok(
        &d.admin(Sqe::create_io_sq(1, 16, mem.iova() + 4096, 1))
            .unwrap(),
        "SQ 1",
    );
    assert_status(&set_features(&d, QUEUES, want), 0, 0x0c, "with a pair");
    assert_ok(&get_features(&d, QUEUES, 0), "Get stays allowed");
    assert_ok(&d.admin(Sqe::delete_io_sq(1)).unwrap(), "delete SQ 1");
    assert_ok(&d.admin(Sqe::delete_io_cq(1)).unwrap(), "delete CQ 1");
    assert_ok(&set_features(&d, QUEUES, want), "after deleting them");
    drop(d);
    dev.check_fresh_client(4);
}

/// Keep Alive is advertised (KAS = 100 ms), so it is enforced: while the host sends
/// Keep Alive within KATO the controller runs; once it stops, the controller sets
/// CSTS.CFS (NVMe 1.4 §7.12) and a reset clears it. The margins are 10×: this checks
/// behaviour, not timing.
#[test]
fn keep_alive_timeout_is_enforced() {
    let dev = TestDev::start("keepalive", &["ram:4M"]);
    let d = dev.connect();
    let fatal = |d: &NvmeDriver| {
        d.read_reg32(initiator::regs::CSTS).unwrap() & initiator::regs::CSTS_CFS != 0
    };
    assert_ok(&set_features(&d, 0x0f, 1000), "KATO 1 s");
    assert_eq!(get_features(&d, 0x0f, 0).dw0, 1000);
    for _ in 0..25 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_ok(&d.admin(Sqe::new(opc::KEEP_ALIVE)).unwrap(), "keep alive");
        assert!(!fatal(&d), "fatal although the host kept it alive");
    }
    wait_fatal(&d);
    drop(d);
    // A new client's reset clears it, with KATO back at 0 (no timer).
    let d = dev.connect();
    check_io(&d, 5);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(!fatal(&d), "no keep alive timer after the reset");
}

/// Identify CNS 05h/06h (I/O Command Set specific namespace and controller data,
/// NVMe 2.0), which Linux asks for whatever the version: answered for the NVM
/// command set (CSI 0), Invalid Field for others.
#[test]
fn identify_io_command_set_specific_structures() {
    let dev = TestDev::start("iocs", &["ram:4M"]);
    let d = dev.connect();
    let identify = |cns: u32, nsid: u32, csi: u32| Sqe {
        nsid,
        cdw10: cns,
        cdw11: csi << 24,
        ..Sqe::new(opc::IDENTIFY)
    };
    let page = d
        .admin_read_page(identify(0x06, 0, 0))
        .expect("CNS 06h, NVM");
    assert!(page.iter().all(|b| *b == 0), "no NVM limits reported");
    let page = d
        .admin_read_page(identify(0x05, 1, 0))
        .expect("CNS 05h, NVM");
    assert!(page.iter().all(|b| *b == 0), "no PI, no extended formats");
    d.admin_read_page(identify(0x05, 2, 0))
        .expect("CNS 05h, a valid inactive NSID");
    let c = d.admin(identify(0x05, 0x1_0000, 0)).unwrap();
    assert_status(&c, 0, 0x0b, "CNS 05h, NSID out of range");
    for (cns, nsid) in [(0x05, 1), (0x06, 0)] {
        let c = d.admin(identify(cns, nsid, 2)).unwrap();
        assert_status(
            &c,
            0,
            0x02,
            &format!("CNS {cns:#x} for the zoned command set"),
        );
    }
    drop(d);
    dev.check_fresh_client(6);
}
