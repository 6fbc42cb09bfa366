//! Injected backend faults (the test-only `fault_*` namespace options): NVMe
//! statuses, Error Information log entries, random failures and added latency
//! without hangs.

mod common;

use common::*;
use initiator::{DataMode, IoOp, QueuePair, Sqe};

/// Error Information log entries (newest first) as (status field, LBA, nsid).
fn error_log(d: &initiator::NvmeDriver) -> Vec<(u64, u16, u64, u32)> {
    let page = d
        .admin_read_page(Sqe::get_log_page(0x01, 0xffff_ffff, 1024))
        .expect("Get Log Page: Error Information");
    page.chunks_exact(64)
        .map(|e| {
            let count = u64::from_le_bytes(e[0..8].try_into().unwrap());
            // Bits 15:1 are the status (SCT/SC/DNR), bit 0 the phase.
            let status = u16::from_le_bytes(e[12..14].try_into().unwrap()) >> 1;
            let lba = u64::from_le_bytes(e[16..24].try_into().unwrap());
            let nsid = u32::from_le_bytes(e[24..28].try_into().unwrap());
            (count, status & 0x7ff, lba, nsid)
        })
        .filter(|e| e.0 != 0)
        .collect()
}

fn rw(
    qp: &mut QueuePair,
    op: IoOp,
    nsid: u32,
    slba: u64,
    buf: &initiator::DmaBuf,
) -> initiator::Completion {
    io(qp, op, nsid, slba, 8, Some(buf), DataMode::Prp)
}

#[test]
fn injected_eio_maps_to_media_errors_and_the_error_log() {
    let (_dir, img) = disk_file("fault.img", 8 << 20);
    // nsid 1: a file whose LBAs 1000-1007 fail; nsid 2: a RAM disk whose LBAs 64-71
    // fail for writes only.
    let dev = TestDev::start(
        "faults",
        &[
            &format!("file:{},fault_lbas=1000-1007", img.display()),
            "ram:4M,fault_lbas=64-71,fault_ops=write",
        ],
    );
    let d = dev.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    assert!(
        error_log(&d).is_empty(),
        "fresh controller has logged errors"
    );

    let c = rw(&mut qp, IoOp::Read, 1, 996, &buf);
    assert_status(&c, 2, 0x81, "read overlapping the faulty LBAs");
    let log = error_log(&d);
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].1, 0x281, "logged status");
    assert_eq!((log[0].2, log[0].3), (996, 1), "logged LBA and nsid");

    let c = rw(&mut qp, IoOp::Write, 1, 1004, &buf);
    assert_status(&c, 2, 0x80, "write overlapping the faulty LBAs");
    let c = rw(&mut qp, IoOp::Write, 2, 70, &buf);
    assert_status(&c, 2, 0x80, "write to ram's faulty LBAs");
    let log = error_log(&d);
    assert_eq!(log.len(), 3, "{log:?}");
    assert_eq!(
        (log[0].1, log[0].2, log[0].3),
        (0x280, 70, 2),
        "newest entry: the ram write"
    );
    assert_eq!((log[1].1, log[1].2, log[1].3), (0x280, 1004, 1));
    assert!(
        log[0].0 > log[1].0 && log[1].0 > log[2].0,
        "error counts grow"
    );

    // Around the faulty range everything works; reads of ram's range are not faulted.
    let data = Rng::new(4).bytes(4096);
    let big = qp.alloc_buf(4096).unwrap();
    for (nsid, slba) in [(1, 992), (1, 1008), (2, 64)] {
        let op = if nsid == 2 { IoOp::Read } else { IoOp::Write };
        big.write(0, &data).unwrap();
        assert_ok(&rw(&mut qp, op, nsid, slba, &big), "I/O next to the faults");
    }
    write_read(&mut qp, &big, 992, &data, DataMode::Sgl);
    assert_eq!(error_log(&d).len(), 3, "successful I/O logged an error");
    assert!(!dev.ctrl().stats().fatal);
}

#[test]
fn random_faults_and_latency_complete_without_hanging() {
    let dev = TestDev::start(
        "faultrate",
        &[
            "ram:4M,fault_rate=0.3,fault_ops=read",
            "ram:4M,fault_latency_us=3000",
        ],
    );
    let d = dev.connect();
    let mut qp = d.create_qpair(64, false).unwrap();
    let buf = qp.alloc_buf(32 * 4096).unwrap();
    // Random failures: 200 reads, 16 in flight at a time; every one completes, some
    // fail with Unrecovered Read Error and the rest succeed.
    let (mut ok, mut failed) = (0, 0);
    for round in 0..25u64 {
        let cids: Vec<u16> = (0..8u64)
            .map(|i| {
                let b = buf.sub(i as usize * 4096, 4096).unwrap();
                qp.submit_io(
                    IoOp::Read,
                    1,
                    (round * 8 + i) * 8,
                    8,
                    Some(&b),
                    DataMode::Prp,
                )
                .unwrap()
            })
            .collect();
        qp.ring().unwrap();
        for cid in cids {
            let c = qp.wait(cid, T).expect("completion despite faults");
            match (c.status.sct, c.status.sc) {
                (0, 0) => ok += 1,
                (2, 0x81) => failed += 1,
                other => panic!("unexpected status {other:?}"),
            }
        }
    }
    assert!(ok > 0 && failed > 0, "ok {ok}, failed {failed}");
    // Writes are not selected by fault_ops=read.
    let data = Rng::new(8).bytes(4096);
    write_read(&mut qp, &buf, 0, &data, DataMode::Prp);

    // Latency: 32 verified writes then reads in flight together on the delayed
    // namespace; all complete with the right data.
    let all = Rng::new(9).bytes(32 * 4096);
    buf.write(0, &all).unwrap();
    for op in [IoOp::Write, IoOp::Read] {
        if op == IoOp::Read {
            buf.fill(0);
        }
        let cids: Vec<u16> = (0..32u64)
            .map(|i| {
                let b = buf.sub(i as usize * 4096, 4096).unwrap();
                qp.submit_io(op, 2, i * 8, 8, Some(&b), DataMode::Sgl)
                    .unwrap()
            })
            .collect();
        qp.ring().unwrap();
        for cid in cids {
            assert_ok(&qp.wait(cid, T).expect("delayed completion"), "delayed I/O");
        }
    }
    let mut back = vec![0u8; all.len()];
    buf.read(0, &mut back).unwrap();
    assert!(back == all, "data through the delaying wrapper");
}
