use std::time::Duration;

use initiator::workload::{self, NvmeTarget};
use initiator::{
    DataMode, DriverOpts, Error, IoOp, NvmeDriver, QpairOpts, Rw, Sqe, VfioUserClient,
    WorkloadConfig,
};
use test_support::fake_nvme::{self, FakeNvme};
use test_support::{wait_until, T};

fn driver(opts: DriverOpts) -> (FakeNvme, NvmeDriver) {
    let (f, sock) = fake_nvme::start(Default::default());
    let c = VfioUserClient::from_stream(sock).unwrap();
    let d = NvmeDriver::with_client(
        c,
        DriverOpts {
            pool_bytes: 16 << 20,
            ..opts
        },
    )
    .unwrap();
    (f, d)
}

fn roundtrip(
    d: &NvmeDriver,
    qp: &mut initiator::QueuePair,
    mode: DataMode,
    len: usize,
    buf_off: usize,
    slba: u64,
) {
    let big = qp.alloc_buf(len + buf_off).unwrap();
    let buf = big.sub(buf_off, len).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + slba as usize) as u8).collect();
    buf.write(0, &data).unwrap();
    let nlb = (len / 512) as u32;
    let cid = qp
        .submit_io(IoOp::Write, 1, slba, nlb, Some(&buf), mode)
        .unwrap();
    qp.ring().unwrap();
    let c = qp.wait(cid, T).unwrap();
    assert!(c.status.is_ok(), "write {len}@{buf_off}: {}", c.status);
    buf.fill(0);
    let cid = qp
        .submit_io(IoOp::Read, 1, slba, nlb, Some(&buf), mode)
        .unwrap();
    qp.ring().unwrap();
    assert!(qp.wait(cid, T).unwrap().status.is_ok());
    let mut back = vec![0u8; len];
    buf.read(0, &mut back).unwrap();
    assert!(
        back == data,
        "data mismatch len {len} off {buf_off} mode {mode:?}"
    );
    let _ = d;
}

#[test]
fn bring_up_and_identify() {
    let (_f, d) = driver(Default::default());
    assert!(d.doorbells_mapped());
    assert_eq!(d.controller().serial, "FAKE0001");
    assert_eq!(d.controller().model, "fakenvme");
    assert_eq!(d.controller().nn, 1);
    assert!(d.controller().volatile_write_cache());
    assert_eq!(d.max_xfer(), Some(128 << 10));
    let ns = d.namespace(1).unwrap();
    assert_eq!((ns.lba_size, ns.nsze), (512, fake_nvme::ctrl::NS_BLOCKS));
    assert_eq!(d.io_queue_count(), 8);
    assert_eq!(d.read_reg32(initiator::regs::CSTS).unwrap() & 1, 1);
    // A bogus admin command completes with an error status, not a driver error.
    let c = d.admin(Sqe::new(0xc7)).unwrap();
    assert_eq!((c.status.sct, c.status.sc), (0, 1));
    assert!(matches!(d.identify_namespace(5), Err(Error::Nvme(_))));
}

#[test]
fn prp_shapes_roundtrip() {
    let (f, d) = driver(Default::default());
    let mut qp = d.create_qpair(16, false).unwrap();
    for (len, off) in [
        (512, 0),
        (4096, 0),
        (8192, 0),
        (512, 4096 - 512),
        (4096, 512),
        (64 << 10, 0),
        (128 << 10, 1024),
    ] {
        roundtrip(&d, &mut qp, DataMode::Prp, len, off, 8);
    }
    // Force chained lists: 4 entries per list page.
    let mut qp2 = d
        .create_qpair_with(QpairOpts {
            depth: 8,
            prp_list_entries: 4,
            data_bytes: 2 << 20,
            ..Default::default()
        })
        .unwrap();
    roundtrip(&d, &mut qp2, DataMode::Prp, 64 << 10, 0, 100);
    roundtrip(&d, &mut qp2, DataMode::Prp, 36 << 10, 2048, 300);
    let log = f.ctrl.lock().unwrap().io_log.clone();
    assert!(log.iter().all(|(_, flags, _)| flags >> 6 == 0));
}

#[test]
fn sgl_shapes_roundtrip() {
    let (f, d) = driver(Default::default());
    assert!(d.controller().supports_sgl());
    let mut qp = d.create_qpair(16, false).unwrap();
    roundtrip(&d, &mut qp, DataMode::Sgl, 8192, 0, 0);
    qp.set_layout(512, 4, 256).unwrap();
    roundtrip(&d, &mut qp, DataMode::Sgl, 16384, 0, 40);
    qp.set_layout(512, 7, 3).unwrap();
    roundtrip(&d, &mut qp, DataMode::Sgl, 7 * 512, 100, 80);
    let log = f.ctrl.lock().unwrap().io_log.clone();
    assert!(log.iter().all(|(_, flags, _)| flags >> 6 == 1));
    assert!(
        qp.set_layout(512, 100_000, 2).is_err(),
        "does not fit reserved list memory"
    );
}

#[test]
fn message_doorbells_interrupts_and_delete() {
    let (f, d) = driver(DriverOpts {
        doorbells_via_messages: true,
        ..Default::default()
    });
    assert!(!d.doorbells_mapped());
    let mut qp = d.create_qpair(8, true).unwrap();
    roundtrip(&d, &mut qp, DataMode::Prp, 4096, 0, 1);
    assert!(qp.wait_irq(T).unwrap());
    assert!(f.ctrl.lock().unwrap().irq_count >= 2);
    let flush = qp
        .submit_io(IoOp::Flush, 1, 0, 0, None, DataMode::Prp)
        .unwrap();
    qp.ring().unwrap();
    assert!(qp.wait(flush, T).unwrap().status.is_ok());
    // Out of range LBA: error status, decoded.
    let buf = qp.alloc_buf(512).unwrap();
    let cid = qp
        .submit_io(IoOp::Read, 1, 1 << 40, 1, Some(&buf), DataMode::Prp)
        .unwrap();
    qp.ring().unwrap();
    let c = qp.wait(cid, T).unwrap();
    assert_eq!(c.status.sc, 0x80);
    let qid = qp.qid();
    d.delete_qpair(qp).unwrap();
    let again = d.create_qpair(8, false).unwrap();
    assert_eq!(again.qid(), qid, "qid is reused after delete");
}

#[test]
fn batch_poll_and_full_queue() {
    let (_f, d) = driver(Default::default());
    let mut qp = d.create_qpair(4, false).unwrap();
    let buf = qp.alloc_buf(512).unwrap();
    let cids: Vec<u16> = (0..3)
        .map(|i| {
            qp.submit_io(IoOp::Read, 1, i, 1, Some(&buf), DataMode::Prp)
                .unwrap()
        })
        .collect();
    assert!(matches!(
        qp.submit_io(IoOp::Read, 1, 0, 1, Some(&buf), DataMode::Prp),
        Err(Error::NoResources(_))
    ));
    qp.ring().unwrap();
    let mut got = Vec::new();
    wait_until("three completions", T, || {
        qp.poll_into(16, &mut got).unwrap();
        got.len() >= 3
    });
    let mut seen: Vec<u16> = got.iter().map(|c| c.cid).collect();
    seen.sort();
    assert_eq!(seen, cids);
    assert_eq!(qp.in_flight(), 0);
    // The ring wraps several times with the phase flipping.
    for i in 0..20 {
        let cid = qp
            .submit_io(IoOp::Read, 1, i, 1, Some(&buf), DataMode::Prp)
            .unwrap();
        qp.ring().unwrap();
        assert!(qp.wait(cid, T).unwrap().status.is_ok());
    }
}

#[test]
fn reset_makes_qpairs_stale() {
    let (_f, d) = driver(Default::default());
    let mut qp = d.create_qpair(8, false).unwrap();
    roundtrip(&d, &mut qp, DataMode::Prp, 512, 0, 0);
    d.reset_controller().unwrap();
    let buf = qp.alloc_buf(512).unwrap();
    assert!(matches!(
        qp.submit_io(IoOp::Read, 1, 0, 1, Some(&buf), DataMode::Prp),
        Err(Error::Stale)
    ));
    drop(qp);
    let mut qp = d.create_qpair(8, false).unwrap();
    roundtrip(&d, &mut qp, DataMode::Prp, 4096, 0, 10);
    assert!(d.identify_controller().is_ok());
}

#[test]
fn workload_against_fake_verifies() {
    let (_f, d) = driver(Default::default());
    for (rw, mode) in [
        (Rw::RandRw { read_pct: 60 }, DataMode::Prp),
        (Rw::RandRead, DataMode::Sgl),
    ] {
        let t = NvmeTarget::new(&d, 1, mode).unwrap();
        let cfg = WorkloadConfig {
            rw,
            bs: 4096,
            qd: 4,
            jobs: 2,
            time: Duration::from_millis(300),
            verify: true,
            ..Default::default()
        };
        let r = workload::run(&t, &cfg).unwrap();
        // Every slot of both jobs went round (how many more depends on the machine).
        assert!(r.ios >= 8, "{r}");
        assert_eq!((r.errors, r.verify_errors), (0, 0), "{r}");
        if rw == Rw::RandRead {
            assert_eq!(r.unverified_reads, 0, "prefilled");
        }
        let j = serde_json::to_value(&r).unwrap();
        assert!(j["lat_ns"]["p99_99"].as_u64().unwrap() > 0);
    }
}
