//! Two controllers in one process on disjoint slices of one file: concurrent verified
//! I/O without corruption, and a hostile initiator on one of them that never reaches
//! the other's slice.

mod common;

use std::time::Duration;

use common::*;
use initiator::workload::{self, NvmeTarget, Rw, WorkloadConfig};
use initiator::{DataMode, IoOp, Sqe};

const SLICE: u64 = 16 << 20;

/// A 48 MiB file: controller A gets bytes 8M..24M, B gets 24M..40M; the 8 MiB on
/// each side belong to nobody, so a stray write either way would show.
fn two_controllers(img: &std::path::Path) -> Vec<TestDev> {
    let a = format!("file:{},offset=8M,size=16M", img.display());
    let b = format!("file:{},offset=24M,size=16M", img.display());
    TestDev::start_all(&[("share-a", &[a.as_str()]), ("share-b", &[b.as_str()])])
}

fn verify_workload(dev: &TestDev, seed: u64) -> workload::Report {
    let d = dev.connect_with(initiator::DriverOpts {
        pool_bytes: 64 << 20,
        ..opts()
    });
    let target = NvmeTarget::new(&d, 1, DataMode::Prp).expect("namespace 1");
    let cfg = WorkloadConfig {
        rw: Rw::RandRw { read_pct: 50 },
        bs: 4096,
        qd: 16,
        jobs: 2,
        time: Duration::from_secs(2),
        verify: true,
        seed,
        ..Default::default()
    };
    workload::run(&target, &cfg).expect("workload")
}

#[test]
fn disjoint_slices_verify_concurrently() {
    let (_dir, img) = disk_file("shared.img", 48 << 20);
    let devs = two_controllers(&img);
    let outside_before = (
        file_bytes(&img, 0, 8 << 20),
        file_bytes(&img, 40 << 20, 8 << 20),
    );
    let (ra, rb) = std::thread::scope(|s| {
        let a = s.spawn(|| verify_workload(&devs[0], 1));
        let b = s.spawn(|| verify_workload(&devs[1], 2));
        (a.join().expect("A"), b.join().expect("B"))
    });
    for (name, r) in [("A", &ra), ("B", &rb)] {
        // Every slot of both jobs went round (how many more depends on the machine).
        assert!(r.ios >= 32, "{name} did too little I/O: {}", r.ios);
        assert!(r.reads > 0 && r.writes > 0, "{name}: {r:?}");
        assert_eq!(r.errors, 0, "{name} had I/O errors");
        assert_eq!(r.verify_errors, 0, "{name} read back wrong data");
    }
    assert!(
        (
            file_bytes(&img, 0, 8 << 20),
            file_bytes(&img, 40 << 20, 8 << 20)
        ) == outside_before,
        "bytes outside both slices changed"
    );
}

#[test]
fn hostile_lbas_stay_inside_their_slice() {
    let (_dir, img) = disk_file("hostile.img", 48 << 20);
    // Known content everywhere, so "unchanged" means something.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&Rng::new(5).bytes(48 << 20), 0).unwrap();
    }
    let before = file_bytes(&img, 0, 48 << 20);
    let devs = two_controllers(&img);
    let nsze = SLICE / 512;
    let d = devs[0].connect();
    let mut qp = d.create_qpair(32, false).unwrap();
    let buf = qp.alloc_buf(256 << 10).unwrap();
    buf.write(0, &Rng::new(6).bytes(256 << 10)).unwrap();
    let prp2 = buf.iova() + 4096;
    let sqe = |op: u8, slba: u64, nlb0: u32| {
        // nlb0 is the 0-based NLB field; PRP2 points at a page (lists are not needed
        // for the range check to fire first, and the data path must never run).
        let mut s = Sqe::rw(op, 1, slba, 1);
        s.cdw12 = nlb0 & 0xffff;
        s.dptr = [buf.iova(), prp2];
        s
    };
    let mut rng = Rng::new(0x5eed);
    let mut cases: Vec<(u64, u32)> = vec![
        (u64::MAX, 0),
        (u64::MAX, 0xffff),
        (u64::MAX - 1, 1),
        (u64::MAX - 0xfffe, 0xffff),
        (nsze, 0),
        (nsze - 1, 1),
        (0, 0xffff), // 65536 blocks: more than the whole slice
        (nsze - 1, 0xffff),
        (1 << 63, 7),
        ((u64::MAX / 512) + 1, 7),
        (nsze + (24 << 20) / 512, 7), // where B's slice would be, in A's LBAs
    ];
    for _ in 0..200 {
        let slba = match rng.below(3) {
            0 => nsze + rng.below(1 << 40),
            1 => u64::MAX - rng.below(1 << 16),
            _ => rng.next_u64(),
        };
        cases.push((slba, rng.below(1 << 16) as u32));
    }
    for &(slba, nlb0) in &cases {
        for op in [WRITE, READ, op::WRITE_ZEROES] {
            // Ranges that fit are legitimate for A; only out-of-range ones here.
            let end = slba.checked_add(u64::from(nlb0) + 1);
            if end.is_some_and(|e| e <= nsze) {
                continue;
            }
            let c = raw(&mut qp, sqe(op, slba, nlb0));
            assert_status(
                &c,
                0,
                0x80,
                &format!("opcode {op:#x} slba {slba:#x} nlb0 {nlb0:#x}"),
            );
        }
    }
    // A's own last blocks still work, and a flush too.
    qp_still_works(&mut qp, nsze - 8, 1);
    assert_ok(
        &io(&mut qp, IoOp::Flush, 1, 0, 0, None, DataMode::Prp),
        "flush",
    );
    let after = file_bytes(&img, 0, 48 << 20);
    let a = (8 << 20)..(24 << 20);
    for (name, r) in [
        ("before A's slice", 0..a.start),
        ("B's slice", a.end..(40 << 20)),
        ("after B's slice", (40 << 20)..(48 << 20)),
    ] {
        assert!(after[r.clone()] == before[r], "{name} changed");
    }
    // B's controller is untouched and works.
    devs[1].check_fresh_client(3);
}
