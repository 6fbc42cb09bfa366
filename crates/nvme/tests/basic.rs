use test_support::nvme_cmd::*;
use test_support::nvme_host::*;
use test_support::{wait_until, T};

#[test]
fn registers_after_reset() {
    let h = Host::new();
    let cap = h.r64(0);
    assert_eq!(cap & 0xffff, 1023, "MQES");
    assert_eq!((cap >> 16) & 1, 1, "CQR");
    assert_eq!((cap >> 32) & 0xf, 0, "DSTRD");
    assert_eq!((cap >> 37) & 1, 1, "NVM command set");
    assert_eq!(h.r32(0) as u64 | ((h.r32(4) as u64) << 32), cap, "halves");
    assert_eq!(h.r32(8), 0x0001_0400);
    assert_eq!(h.csts(), 0);
    assert_eq!(h.r32(0x800), 0, "unknown offset");
    h.w64(0x28, 0x1234_5678_9000);
    assert_eq!(h.r64(0x28), 0x1234_5678_9000);
}

#[test]
fn enable_identify_and_io_roundtrip() {
    let mut h = Host::new();
    h.ready(true);
    let buf = h.alloc(1);
    // Identify controller.
    let mut s = sqe(0x06, 0);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 1;
    assert!(h.admin(s).ok());
    let id = h.read_mem(buf, 4096);
    assert_eq!(u16::from_le_bytes([id[0], id[1]]), nvme::VENDOR_ID);
    assert_eq!(&id[4..14], b"udrive0001");
    assert_eq!(id[77], 5, "MDTS");
    assert_eq!(id[512], 0x66);
    assert_eq!(id[513], 0x44);
    assert_eq!(
        u32::from_le_bytes([id[516], id[517], id[518], id[519]]),
        32,
        "NN: max_namespaces"
    );
    assert_eq!(
        u16::from_le_bytes([id[256], id[257]]) & 0x100,
        0x100,
        "OACS DBBC"
    );
    // Identify namespace.
    let mut s = sqe(0x06, 1);
    set_prp(&mut s, buf, 0);
    assert!(h.admin(s).ok());
    let ns = h.read_mem(buf, 4096);
    assert_eq!(
        u64::from_le_bytes(ns[0..8].try_into().unwrap()),
        (64 << 20) / 512
    );
    assert_eq!(ns[130], 9, "LBADS = 512");
    // Active namespace list and descriptors.
    let mut s = sqe(0x06, 0);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 2;
    assert!(h.admin(s).ok());
    assert_eq!(h.read_mem(buf, 8), [1, 0, 0, 0, 0, 0, 0, 0]);
    let mut s = sqe(0x06, 1);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 3;
    assert!(h.admin(s).ok());
    let d = h.read_mem(buf, 40);
    assert_eq!((d[0], d[1], d[20], d[21]), (2, 16, 3, 16));
    // Write then read 8 blocks.
    let data = h.alloc(1);
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    h.write_mem(data, &pattern);
    let c = h.io(rw(1, 1, 100, 8, data, 0));
    assert!(c.ok(), "{c:?}");
    assert_eq!(c.sq_id, 1);
    let out = h.alloc(1);
    assert!(h.io(rw(2, 1, 100, 8, out, 0)).ok());
    assert_eq!(h.read_mem(out, 4096), pattern);
    assert!(h.io(sqe(0x00, 1)).ok(), "flush");
    let st = h.ctrl.stats();
    assert_eq!((st.reads, st.writes, st.flushes), (1, 1, 1));
    assert_eq!(st.io_queues, 1);
    // Each interrupt follows its entry (the end of the poll that posted it).
    wait_until("IEN=1 signals vector 1", T, || h.irq_count(1) >= 3);
    wait_until("admin vector", T, || h.irq_count(0) >= 1);
}

#[test]
fn features_logs_and_aer() {
    let mut h = Host::new();
    h.enable();
    // Number of queues.
    let mut s = sqe(0x09, 0);
    s.cdw10 = 0x07;
    s.cdw11 = 0x0003_0003;
    let c = h.admin(s);
    assert!(c.ok());
    assert_eq!(c.dw0, (31 << 16) | 31);
    // VWC absent on a RAM disk: Set fails.
    let mut s = sqe(0x09, 0);
    s.cdw10 = 0x06;
    s.cdw11 = 1;
    assert_eq!(h.admin(s).code(), (0, 0x02));
    // Save not supported.
    let mut s = sqe(0x09, 0);
    s.cdw10 = 0x01 | (1 << 31);
    assert_eq!(h.admin(s).code(), (1, 0x0d));
    // Temperature threshold round trip.
    let mut s = sqe(0x09, 0);
    s.cdw10 = 0x04;
    s.cdw11 = 330;
    assert!(h.admin(s).ok());
    let mut s = sqe(0x0a, 0);
    s.cdw10 = 0x04;
    assert_eq!(h.admin(s).dw0, 330);
    // Unknown feature.
    let mut s = sqe(0x0a, 0);
    s.cdw10 = 0x55;
    assert_eq!(h.admin(s).code(), (0, 0x02));
    // SMART log.
    let buf = h.alloc(1);
    let mut s = sqe(0x02, 0xffff_ffff);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 0x02 | (127 << 16);
    assert!(h.admin(s).ok());
    let smart = h.read_mem(buf, 512);
    assert_eq!(u16::from_le_bytes([smart[1], smart[2]]), 300);
    // Unknown opcode lands in the error log.
    assert_eq!(h.admin(sqe(0xee, 0)).code(), (0, 0x01));
    let mut s = sqe(0x02, 0);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 0x01 | (15 << 16);
    assert!(h.admin(s).ok());
    let e = h.read_mem(buf, 64);
    assert!(u64::from_le_bytes(e[0..8].try_into().unwrap()) >= 1);
    assert_eq!(u16::from_le_bytes([e[12], e[13]]) >> 1 & 0xff, 0x01);
    // Invalid log page.
    let mut s = sqe(0x02, 0);
    set_prp(&mut s, buf, 0);
    s.cdw10 = 0x70 | (15 << 16);
    assert_eq!(h.admin(s).code(), (1, 0x09));
    // AERs are held: AERL+1 = 4 accepted, the fifth fails at once.
    for _ in 0..4 {
        h.submit(0, sqe(0x0c, 0));
    }
    let c = h.admin(sqe(0x0c, 0));
    assert_eq!(c.code(), (1, 0x05));
    // Abort says "not aborted"; keep alive succeeds.
    let c = h.admin(sqe(0x08, 0));
    assert!(c.ok());
    assert_eq!(c.dw0 & 1, 1);
    assert!(h.admin(sqe(0x18, 0)).ok());
}

/// A backend with a block size no namespace can have.
struct OddBlocks(bdev::BlockInfo);

impl bdev::BlockDevice for OddBlocks {
    fn describe(&self) -> String {
        "odd".into()
    }
    fn info(&self) -> &bdev::BlockInfo {
        &self.0
    }
    fn channel(&self) -> std::io::Result<Box<dyn bdev::IoChannel>> {
        Err(std::io::Error::other("never opened"))
    }
}

#[test]
fn controller_new_says_what_is_wrong() {
    use nvme::{Controller, ControllerConfig, ControllerError, NsError};
    use std::sync::Arc;
    let engine = engine::Engine::start(&[None]).unwrap();
    let new = |cfg: ControllerConfig, ns: Vec<Option<Arc<dyn bdev::BlockDevice>>>| {
        Controller::new(
            cfg,
            ns,
            engine.clone(),
            engine::Placer::new(engine::Placement::RoundRobin, 0, 1),
            guest_mem::DmaSpace::new(),
            Arc::new(Irqs(Vec::new())),
        )
    };
    let cfg = |f: &dyn Fn(&mut ControllerConfig)| {
        let mut c = ControllerConfig::default();
        f(&mut c);
        c
    };
    let r = new(cfg(&|c| c.max_io_queues = 0), vec![]);
    assert!(matches!(r, Err(ControllerError::IoQueues(0))));
    let r = new(cfg(&|c| c.max_io_queues = 512), vec![]);
    assert!(matches!(r, Err(ControllerError::IoQueues(512))));
    let r = new(cfg(&|c| c.max_queue_entries = 1), vec![]);
    assert!(matches!(r, Err(ControllerError::QueueEntries(1))));
    let r = new(cfg(&|c| c.msix_vectors = 0), vec![]);
    assert!(matches!(r, Err(ControllerError::NoVectors)));
    let r = new(cfg(&|c| c.max_namespaces = 2), vec![None, None, None]);
    assert!(matches!(
        r,
        Err(ControllerError::TooManyNamespaces { given: 3, max: 2 })
    ));
    let odd: Arc<dyn bdev::BlockDevice> = Arc::new(OddBlocks(bdev::BlockInfo {
        block_size: 1000,
        num_blocks: 8,
        volatile: true,
        write_cache: false,
        read_only: false,
        discard: false,
        write_zeroes: false,
        discard_zeroes: false,
    }));
    let r = new(ControllerConfig::default(), vec![None, Some(odd)]);
    let Err(e) = r else {
        panic!("a 1000-byte block size was accepted")
    };
    assert!(matches!(
        e,
        ControllerError::Namespace {
            nsid: 2,
            source: NsError::BlockSize(1000)
        }
    ));
    // The cause stays reachable for callers that print the chain.
    assert!(std::error::Error::source(&e).is_some());
    assert!(new(ControllerConfig::default(), vec![]).is_ok());
    engine.shutdown();
}
