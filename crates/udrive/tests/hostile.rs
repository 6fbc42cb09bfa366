//! Hostile clients against in-process udrive controllers. Every case checks the
//! status the spec (or our documented choice) gives, that the attacked controller
//! serves a new well-behaved client afterwards, and that a bystander controller in
//! the same process keeps doing verified I/O throughout.

mod common;

use std::time::{Duration, Instant};

use common::*;
use guest_mem::{Prot, SharedMem};
use initiator::regs::{AQA, CAP, CSTS, CSTS_CFS};
use initiator::{Completion, Cqe, DataMode, DriverOpts, Error, IoOp, NvmeDriver, Sqe};
use vfio_user::proto::Command;

/// Runs `attack` against a fresh controller with a fresh client, then checks the
/// controller serves a new client and the bystander is unharmed.
fn hostile(name: &str, seed: u64, attack: impl FnOnce(&TestDev, NvmeDriver)) {
    let by = bystander();
    by.check();
    let dev = TestDev::start(name, &["ram:16M"]);
    // Plain doorbells: the attacks ring raw queues of their own through the
    // doorbell registers, which a controller using shadow doorbells reads from the
    // shadow buffer instead.
    let d = dev.connect_with(DriverOpts {
        shadow_doorbells: Some(false),
        ..opts()
    });
    attack(&dev, d);
    dev.check_fresh_client(seed);
    by.check();
}

fn generic(c: &Completion, sc: u8, what: &str) {
    assert_status(c, 0, sc, what);
    assert!(
        c.status.dnr,
        "{what}: DNR set on a command that cannot succeed"
    );
}

const DTE: u8 = 0x04; // Data Transfer Error
const POOL_END: u64 = 0x1_0000_0000 + (16 << 20); // see common::opts()

#[test]
fn prp_entries_outside_the_dma_map() {
    hostile("prp-oob", 1, |dev, d| {
        let mut qp = d.create_qpair(16, false).unwrap();
        let data = qp.alloc_buf(8192).unwrap();
        let list = qp.alloc_buf(4096).unwrap();
        let pg = data.iova();
        for opc in [READ, WRITE] {
            let c = raw(&mut qp, rw(opc, 1, 0, 1, UNMAPPED, 0));
            generic(&c, DTE, "PRP1 unmapped");
            let c = raw(&mut qp, rw(opc, 1, 0, 8, 0xffff_ffff_ffff_f000, 0));
            generic(&c, DTE, "PRP1 at the top of the address space");
            let c = raw(&mut qp, rw(opc, 1, 0, 8, POOL_END - 2048, 0));
            generic(&c, DTE, "PRP1 runs off the end of the mapping");
            let c = raw(&mut qp, rw(opc, 1, 0, 16, pg, UNMAPPED));
            generic(&c, DTE, "PRP2 data page unmapped");
            let c = raw(&mut qp, rw(opc, 1, 0, 24, pg, UNMAPPED));
            generic(&c, DTE, "PRP2 list pointer unmapped");
            put_u64s(&list, 0, &[pg + 4096, UNMAPPED]);
            let c = raw(&mut qp, rw(opc, 1, 0, 24, pg, list.iova()));
            generic(&c, DTE, "PRP list entry unmapped");
            put_u64s(&list, 0, &[POOL_END - 4096, POOL_END]);
            let c = raw(&mut qp, rw(opc, 1, 0, 24, pg, list.iova()));
            generic(&c, DTE, "PRP list entry just past the mapping");
        }
        qp_still_works(&mut qp, 100, 2);
        let st = dev.ctrl().stats();
        assert!(!st.fatal && st.io_errors >= 14, "{st:?}");
    });
}

#[test]
fn misaligned_prp_entries() {
    hostile("prp-align", 3, |_, d| {
        let mut qp = d.create_qpair(16, false).unwrap();
        let data = qp.alloc_buf(16384).unwrap();
        let list = qp.alloc_buf(4096).unwrap();
        let pg = data.iova();
        let c = raw(&mut qp, rw(READ, 1, 0, 1, pg + 2, 0));
        generic(&c, 0x13, "PRP1 not dword aligned");
        let c = raw(&mut qp, rw(READ, 1, 0, 16, pg, pg + 4096 + 512));
        generic(&c, 0x13, "PRP2 data pointer with an offset");
        put_u64s(&list, 0, &[pg + 4096 + 8, pg + 8192]);
        let c = raw(&mut qp, rw(WRITE, 1, 0, 24, pg, list.iova()));
        generic(&c, 0x13, "PRP list entry with an offset");
        put_u64s(&list, 0, &[pg + 4096, pg + 8192 + 4]);
        let c = raw(&mut qp, rw(READ, 1, 0, 24, pg, list.iova()));
        generic(&c, 0x13, "second PRP list entry with an offset");
        let c = raw(&mut qp, rw(READ, 1, 0, 24, pg, list.iova() + 4));
        generic(&c, 0x13, "PRP list pointer not qword aligned");
        // A list that starts inside its page (qword aligned) is legal.
        put_u64s(&list, 8, &[pg + 4096, pg + 8192]);
        assert_ok(
            &raw(&mut qp, rw(READ, 1, 0, 24, pg, list.iova() + 8)),
            "PRP list at a page offset",
        );
        qp_still_works(&mut qp, 200, 4);
    });
}

#[test]
fn prp_list_that_loops_on_itself() {
    hostile("prp-loop", 5, |_, d| {
        let mut qp = d.create_qpair(16, false).unwrap();
        let data = qp.alloc_buf(64 << 10).unwrap();
        let list = qp.alloc_buf(4096).unwrap();
        let (pg, l) = (data.iova(), list.iova());
        // PRP2 points at the last two slots of the list page, so its last entry
        // chains; the chain pointer names the same list page.
        put_u64s(&list, 4080, &[pg + 4096, l]);
        for opc in [READ, WRITE] {
            let c = raw(&mut qp, rw(opc, 1, 0, 128, pg, l + 4080));
            assert!(
                c.status.sct == 0 && [0x02, DTE, 0x13].contains(&c.status.sc),
                "looping PRP list: {}",
                c.status
            );
        }
        // The same list chaining to a different page is legal and works.
        let list2 = qp.alloc_buf(4096).unwrap();
        let rest: Vec<u64> = (2..16).map(|i| pg + i * 4096).collect();
        put_u64s(&list2, 0, &rest);
        put_u64s(&list, 4080, &[pg + 4096, list2.iova()]);
        assert_ok(
            &raw(&mut qp, rw(WRITE, 1, 0, 128, pg, l + 4080)),
            "list chained from a page offset",
        );
        qp_still_works(&mut qp, 300, 6);
    });
}

#[test]
fn sgl_descriptor_chain_that_loops() {
    hostile("sgl-loop", 7, |dev, d| {
        let mut qp = d.create_qpair(16, false).unwrap();
        let data = qp.alloc_buf(4096).unwrap();
        let seg = qp.alloc_buf(4096).unwrap();
        let s = seg.iova();
        // A segment whose only descriptor is a Segment pointing at itself.
        put_descs(&seg, 0, &[sgl_segment(s, 1)]);
        let c = raw(&mut qp, rw_sgl(READ, 1, 0, 8, sgl_segment(s, 1)));
        generic(&c, 0x0e, "pure segment loop");
        // Data and a pointer back to the same segment: data keeps coming, but the
        // descriptor cap ends the walk before the 128 KiB transfer is covered.
        put_descs(&seg, 0, &[sgl_data(data.iova(), 512), sgl_segment(s, 2)]);
        for opc in [READ, WRITE] {
            let c = raw(&mut qp, rw_sgl(opc, 1, 0, 256, sgl_segment(s, 2)));
            generic(&c, 0x0e, "looping segment with data");
        }
        // A Last Segment may not point onwards.
        let c = raw(&mut qp, rw_sgl(READ, 1, 0, 256, sgl_last(s, 2)));
        generic(&c, 0x0d, "Last Segment that chains");
        qp_still_works(&mut qp, 400, 8);
        assert!(!dev.ctrl().stats().fatal);
    });
}

#[test]
fn sgl_descriptor_overflow_and_length_mismatch() {
    hostile("sgl-bad", 9, |_, d| {
        let mut qp = d.create_qpair(16, false).unwrap();
        let data = qp.alloc_buf(64 << 10).unwrap();
        let seg = qp.alloc_buf(16 << 10).unwrap();
        let (p, s) = (data.iova(), seg.iova());
        // 320 non-contiguous 16-byte data blocks for a 5 KiB transfer.
        let many: Vec<[u8; 16]> = (0..320).map(|i| sgl_data(p + i * 32, 16)).collect();
        put_descs(&seg, 0, &many);
        let c = raw(&mut qp, rw_sgl(WRITE, 1, 0, 10, sgl_last(s, 320)));
        generic(&c, 0x0e, "too many descriptors");
        // A segment claiming 2^28 descriptors (all zero-length data blocks here).
        seg.fill(0);
        let huge = initiator::dptr::sgl_desc(s, 0xffff_fff0, initiator::dptr::SGL_LAST_SEGMENT);
        let c = raw(&mut qp, rw_sgl(READ, 1, 0, 1, huge));
        generic(&c, 0x0e, "segment length of 4 GiB");
        // Descriptors that describe more, or less, than the transfer.
        let c = raw(&mut qp, rw_sgl(READ, 1, 0, 1, sgl_data(p, 4096)));
        generic(&c, 0x0f, "data block longer than the transfer");
        let c = raw(&mut qp, rw_sgl(READ, 1, 0, 2, sgl_data(p, 512)));
        generic(&c, 0x0f, "data block shorter than the transfer");
        put_descs(&seg, 0, &[sgl_data(p, 512), sgl_data(p + 4096, 256)]);
        let c = raw(&mut qp, rw_sgl(WRITE, 1, 0, 2, sgl_last(s, 2)));
        generic(&c, 0x0f, "segment short of the transfer");
        // Malformed descriptors.
        let c = raw(
            &mut qp,
            rw_sgl(
                READ,
                1,
                0,
                1,
                initiator::dptr::sgl_desc(s, 24, initiator::dptr::SGL_SEGMENT),
            ),
        );
        generic(&c, 0x0d, "segment length not a multiple of 16");
        for ty in [0x10u8, 0xf0, 0x01] {
            let c = raw(
                &mut qp,
                rw_sgl(READ, 1, 0, 1, initiator::dptr::sgl_desc(p, 512, ty)),
            );
            generic(&c, 0x11, &format!("SGL descriptor type byte {ty:#x}"));
        }
        let c = raw(&mut qp, rw_sgl(READ, 1, 0, 1, sgl_last(UNMAPPED, 1)));
        generic(&c, DTE, "segment in unmapped memory");
        let c = raw(&mut qp, rw_sgl(READ, 1, 0, 1, sgl_data(UNMAPPED, 512)));
        generic(&c, DTE, "data block in unmapped memory");
        // Admin commands take PRPs only.
        let mut id = Sqe::identify(1, 0);
        id.flags |= initiator::cmd::PSDT_SGL;
        id.dptr = [p, 0];
        let c = d.admin(id).unwrap();
        generic(&c, 0x02, "Identify with PSDT=SGL");
        qp_still_works(&mut qp, 500, 10);
    });
}

#[test]
fn unknown_opcodes() {
    hostile("opcodes", 11, |_, d| {
        for opc in [0x7fu8, 0xc7, 0xff, 0x03] {
            let c = d.admin(Sqe::new(opc)).unwrap();
            generic(&c, 0x01, &format!("admin opcode {opc:#x}"));
        }
        let mut qp = d.create_qpair(16, false).unwrap();
        for opc in [0x7fu8, 0x05, 0x0c, 0xff, 0x80] {
            let c = raw(
                &mut qp,
                Sqe {
                    nsid: 1,
                    ..Sqe::new(opc)
                },
            );
            generic(&c, 0x01, &format!("I/O opcode {opc:#x}"));
        }
        // Fused operations are not supported: Invalid Field.
        let buf = qp.alloc_buf(512).unwrap();
        let mut s = rw(READ, 1, 0, 1, buf.iova(), 0);
        s.flags |= 1;
        generic(&raw(&mut qp, s), 0x02, "fused first command");
        qp_still_works(&mut qp, 600, 12);
    });
}

#[test]
fn invalid_namespace_ids() {
    hostile("nsid", 13, |_, d| {
        let mut qp = d.create_qpair(16, false).unwrap();
        let buf = qp.alloc_buf(4096).unwrap();
        for nsid in [0u32, 0xffff_ffff, 2, 0x8000_0000] {
            for opc in [READ, WRITE] {
                let c = raw(&mut qp, rw(opc, nsid, 0, 1, buf.iova(), 0));
                generic(&c, 0x0b, &format!("opcode {opc} nsid {nsid:#x}"));
            }
            let c = raw(&mut qp, Sqe::rw(op::WRITE_ZEROES, nsid, 0, 1));
            generic(&c, 0x0b, &format!("write zeroes nsid {nsid:#x}"));
        }
        for nsid in [0u32, 33, 0xffff_fffe] {
            match d.identify_namespace(nsid) {
                Err(Error::Nvme(s)) => assert_eq!((s.sct, s.sc), (0, 0x0b), "identify {nsid}"),
                other => panic!("Identify Namespace {nsid:#x}: {other:?}"),
            }
        }
        // Inactive but within NN (namespaces can be added later): zeroes.
        assert!(matches!(d.identify_namespace(2), Ok(None)));
        qp_still_works(&mut qp, 700, 14);
    });
}

#[test]
fn lba_range_overflow_and_out_of_range() {
    const NS: u64 = 32768; // ram:16M, 512-byte blocks
    hostile("lba", 15, |_, d| {
        let mut qp = d.create_qpair(16, false).unwrap();
        let buf = qp.alloc_buf(8192).unwrap();
        for opc in [READ, WRITE] {
            for (slba, nlb) in [
                (u64::MAX, 1),
                (u64::MAX - 2, 8),
                (1 << 55, 1),
                (NS - 1, 2),
                (NS, 1),
                (NS + 1000, 16),
            ] {
                let c = raw(
                    &mut qp,
                    rw(opc, 1, slba, nlb, buf.iova(), buf.iova() + 4096),
                );
                generic(&c, 0x80, &format!("opcode {opc} LBA {slba:#x} x{nlb}"));
            }
        }
        for (slba, nlb) in [(u64::MAX, 1u32), (NS - 10, 11), (NS, 65536)] {
            let c = raw(&mut qp, Sqe::rw(op::WRITE_ZEROES, 1, slba, nlb));
            generic(&c, 0x80, &format!("write zeroes LBA {slba:#x} x{nlb}"));
        }
        // The last block itself is fine.
        assert_ok(
            &io(
                &mut qp,
                IoOp::Write,
                1,
                NS - 1,
                1,
                Some(&buf.sub(0, 512).unwrap()),
                DataMode::Prp,
            ),
            "write of the last block",
        );
        qp_still_works(&mut qp, 800, 16);
    });
}

#[test]
fn transfer_beyond_mdts() {
    hostile("mdts", 17, |_, d| {
        let mdts = d.max_xfer().unwrap();
        assert_eq!(mdts, 128 << 10);
        let mut qp = d.create_qpair(16, false).unwrap();
        let buf = qp.alloc_buf(mdts as usize).unwrap();
        for opc in [READ, WRITE] {
            for nlb in [257u32, 1024, 32768] {
                let c = raw(&mut qp, rw(opc, 1, 0, nlb, buf.iova(), 0));
                generic(&c, 0x02, &format!("opcode {opc}: {nlb} blocks"));
            }
        }
        // Exactly MDTS works, with a real PRP list.
        let c = io(&mut qp, IoOp::Write, 1, 0, 256, Some(&buf), DataMode::Prp);
        assert_ok(&c, "transfer of exactly MDTS");
        qp_still_works(&mut qp, 900, 18);
    });
}

fn create_cq_raw(qid: u32, qsize0: u32, iova: u64, vector: u32, flags: u32) -> Sqe {
    let mut s = Sqe::new(op::CREATE_IO_CQ);
    s.dptr[0] = iova;
    s.cdw10 = qsize0 << 16 | qid;
    s.cdw11 = vector << 16 | flags;
    s
}

fn create_sq_raw(qid: u32, qsize0: u32, iova: u64, cqid: u32) -> Sqe {
    let mut s = Sqe::new(op::CREATE_IO_SQ);
    s.dptr[0] = iova;
    s.cdw10 = qsize0 << 16 | qid;
    s.cdw11 = cqid << 16 | 1;
    s
}

#[test]
fn queue_creation_and_deletion_errors() {
    hostile("queues", 19, |dev, d| {
        let mem = d.alloc_buf(64 << 10).unwrap();
        let m = mem.iova();
        let specific = |s: Sqe, sc: u8, what: &str| {
            let c = d.admin(s).unwrap();
            assert_status(&c, 1, sc, what);
        };
        // Bad queue ids: 0 is the admin queue, the controller offers 32 I/O queues.
        for qid in [0u32, 33, 0xffff] {
            specific(
                create_cq_raw(qid, 15, m, 0, 1),
                0x01,
                &format!("create CQ {qid}"),
            );
            specific(
                create_sq_raw(qid, 15, m, 1),
                0x01,
                &format!("create SQ {qid}"),
            );
        }
        // Bad sizes: 1 entry (QSIZE 0) and more than CAP.MQES + 1 = 1024.
        for qsize0 in [0u32, 1024, 0xffff] {
            specific(
                create_cq_raw(30, qsize0, m, 0, 1),
                0x02,
                &format!("CQ QSIZE {qsize0}"),
            );
        }
        // Bad interrupt vectors (33 MSI-X vectors: 0..=32).
        for v in [33u32, 0x7ff, 0xffff] {
            specific(
                create_cq_raw(30, 15, m, v, 0b11),
                0x08,
                &format!("CQ vector {v}"),
            );
        }
        // Non-contiguous queues are not supported (CAP.CQR = 1).
        let c = d.admin(create_cq_raw(30, 15, m, 0, 0)).unwrap();
        generic(&c, 0x02, "PC = 0");
        let c = d.admin(create_cq_raw(30, 15, UNMAPPED, 0, 1)).unwrap();
        assert!(!c.status.is_ok(), "CQ in unmapped memory accepted");
        // SQ without its CQ: a valid CQID with no queue is Completion Queue Invalid;
        // the admin CQ and CQIDs past the 32 allocated are no valid CQID at all
        // (docs/decisions/0011-nvme-conformance.md).
        specific(create_sq_raw(30, 15, m, 29), 0x00, "SQ on a missing CQ");
        specific(create_sq_raw(30, 15, m, 0), 0x01, "SQ on the admin CQ");
        specific(create_sq_raw(30, 15, m, 33), 0x01, "SQ on CQ 33 of 32");
        specific(create_sq_raw(30, 15, m, 0xffff), 0x01, "SQ on CQ 0xffff");
        // A real pair at qid 30, then deletion order errors.
        assert_ok(&d.admin(create_cq_raw(30, 15, m, 0, 1)).unwrap(), "CQ 30");
        specific(create_cq_raw(30, 15, m + 4096, 0, 1), 0x01, "CQ 30 twice");
        assert_ok(
            &d.admin(create_sq_raw(30, 15, m + 8192, 30)).unwrap(),
            "SQ 30",
        );
        specific(create_sq_raw(30, 15, m + 12288, 30), 0x01, "SQ 30 twice");
        assert_eq!(dev.ctrl().stats().io_queues, 1);
        specific(
            Sqe::delete_io_cq(30),
            0x0c,
            "delete CQ that still has an SQ",
        );
        specific(Sqe::delete_io_sq(0), 0x01, "delete the admin SQ");
        specific(Sqe::delete_io_sq(31), 0x01, "delete a missing SQ");
        assert_ok(&d.admin(Sqe::delete_io_sq(30)).unwrap(), "delete SQ 30");
        assert_ok(&d.admin(Sqe::delete_io_cq(30)).unwrap(), "delete CQ 30");
        specific(Sqe::delete_io_cq(30), 0x01, "delete CQ 30 twice");
        specific(Sqe::delete_io_cq(0), 0x01, "delete the admin CQ");
        let st = dev.ctrl().stats();
        assert_eq!((st.io_queues, st.io_completion_queues), (0, 0));
        let mut qp = d.create_qpair(16, false).unwrap();
        qp_still_works(&mut qp, 1000, 20);
    });
}

/// Writes a doorbell by REGION_WRITE (lands in the same page the mmap shows).
fn ring_raw(d: &NvmeDriver, qid: u16, cq: bool, v: u32) {
    d.write_reg32(d.cap().doorbell(qid, cq), v).unwrap();
}

#[test]
fn doorbell_beyond_queue_size_is_fatal_until_reset() {
    hostile("doorbell", 21, |dev, d| {
        for (what, qid, cq, v) in [
            ("I/O SQ tail", 1u16, false, 16u32),
            ("I/O CQ head", 1, true, 1000),
            ("admin SQ tail", 0, false, 32),
            ("admin CQ head", 0, true, 0xffff_ffff),
        ] {
            let mut qp = d.create_qpair(16, false).unwrap();
            assert_eq!(qp.qid(), 1);
            qp_still_works(&mut qp, 1100, 22);
            assert_eq!(d.read_reg32(CSTS).unwrap() & CSTS_CFS, 0);
            ring_raw(&d, qid, cq, v);
            wait_fatal(&d);
            assert!(dev.ctrl().stats().fatal, "{what}");
            // CC.EN 1 -> 0 -> 1 recovers; old queue pairs are gone with the reset.
            d.reset_controller().expect("reset after CFS");
            assert_eq!(d.read_reg32(CSTS).unwrap() & CSTS_CFS, 0, "{what}");
            assert!(!dev.ctrl().stats().fatal);
            drop(qp);
            let mut qp = d.create_qpair(16, false).unwrap();
            qp_still_works(&mut qp, 1200, 23);
        }
        // An enable with an invalid admin queue size is refused with CFS as well.
        d.write_reg32(initiator::regs::CC, 0).unwrap();
        wait_until("RDY=0", T, || d.read_reg32(CSTS).unwrap() & 1 == 0);
        d.write_reg32(AQA, 0).unwrap();
        d.write_reg32(initiator::regs::CC, initiator::regs::CC_EN)
            .unwrap();
        assert_ne!(d.read_reg32(CSTS).unwrap() & CSTS_CFS, 0, "AQA of 1 entry");
        assert_ne!(d.read_reg64(CAP).unwrap(), 0);
        d.reset_controller().expect("reset after a bad enable");
    });
}

/// An I/O queue pair in memory the test owns (not the driver's pool), so the test
/// can unmap it under the controller.
struct RawQueues {
    mem: SharedMem,
    iova: u64,
    qid: u16,
    tail: u16,
    head: u16,
    phase: bool,
}

const RQ_DEPTH: u16 = 32;
const RQ_BYTES: u64 = 64 << 10;

impl RawQueues {
    fn new(d: &NvmeDriver, iova: u64, qid: u16) -> RawQueues {
        let mut q = RawQueues {
            mem: SharedMem::new("raw-queues", RQ_BYTES).unwrap(),
            iova,
            qid,
            tail: 0,
            head: 0,
            phase: true,
        };
        q.map(d);
        q.create(d);
        q
    }
    fn map(&self, d: &NvmeDriver) {
        d.client()
            .dma_map(self.mem.fd(), 0, self.iova, RQ_BYTES, Prot::RW)
            .expect("map raw queue memory");
    }
    /// SQ at +0, CQ at +4 KiB, data from +8 KiB.
    fn create(&mut self, d: &NvmeDriver) {
        self.mem.all().fill(0);
        (self.tail, self.head, self.phase) = (0, 0, true);
        let q = u32::from(self.qid);
        let c = d
            .admin(create_cq_raw(
                q,
                u32::from(RQ_DEPTH) - 1,
                self.iova + 4096,
                0,
                1,
            ))
            .unwrap();
        assert_ok(&c, "create raw CQ");
        let c = d
            .admin(create_sq_raw(q, u32::from(RQ_DEPTH) - 1, self.iova, q))
            .unwrap();
        assert_ok(&c, "create raw SQ");
    }
    fn data(&self) -> u64 {
        self.iova + 8192
    }
    fn submit(&mut self, d: &NvmeDriver, mut sqe: Sqe) -> u16 {
        sqe.cid = self.tail;
        self.mem
            .all()
            .write_obj(usize::from(self.tail) * 64, &sqe)
            .unwrap();
        self.tail = (self.tail + 1) % RQ_DEPTH;
        ring_raw(d, self.qid, false, u32::from(self.tail));
        sqe.cid
    }
    fn wait(&mut self, d: &NvmeDriver) -> Completion {
        let start = Instant::now();
        loop {
            let off = 4096 + usize::from(self.head) * 16;
            let cqe: Cqe = self.mem.all().read_obj(off).unwrap();
            if (cqe.status & 1 == 1) == self.phase {
                self.head = (self.head + 1) % RQ_DEPTH;
                if self.head == 0 {
                    self.phase = !self.phase;
                }
                ring_raw(d, self.qid, true, u32::from(self.head));
                return Completion::from(cqe);
            }
            assert!(start.elapsed() < T, "no completion on the raw queue");
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    fn rw(&mut self, d: &NvmeDriver, opc: u8, slba: u64) -> Completion {
        let cid = self.submit(d, rw(opc, 1, slba, 8, self.data(), 0));
        let c = self.wait(d);
        assert_eq!(c.cid, cid);
        c
    }
}

#[test]
fn dma_unmap_of_memory_in_use() {
    hostile("unmap", 23, |dev, d| {
        // 1. A data buffer in its own mapping goes away: commands on it fail with
        //    Data Transfer Error; mapped again, it works again.
        let extra = SharedMem::new("extra", 64 << 10).unwrap();
        let xi = 0x2_0000_0000;
        d.client()
            .dma_map(extra.fd(), 0, xi, 64 << 10, Prot::RW)
            .unwrap();
        let mut qp = d.create_qpair(16, false).unwrap();
        let data = Rng::new(24).bytes(4096);
        extra.all().write_from(0, &data).unwrap();
        assert_ok(&raw(&mut qp, rw(WRITE, 1, 10, 8, xi, 0)), "write");
        d.client()
            .dma_unmap(xi, 64 << 10)
            .expect("server answers the unmap");
        for opc in [READ, WRITE] {
            generic(
                &raw(&mut qp, rw(opc, 1, 10, 8, xi, 0)),
                DTE,
                "unmapped data",
            );
        }
        assert!(!dev.ctrl().stats().fatal);
        d.client()
            .dma_map(extra.fd(), 0, xi, 64 << 10, Prot::RW)
            .unwrap();
        extra.all().fill(0);
        assert_ok(&raw(&mut qp, rw(READ, 1, 10, 8, xi, 0)), "read after remap");
        let mut back = vec![0u8; 4096];
        extra.all().read_into(0, &mut back).unwrap();
        assert!(back == data);

        // 2. The memory holding an I/O SQ and CQ goes away while they exist.
        let ri = 0x3_0000_0000;
        let mut rq = RawQueues::new(&d, ri, 7);
        let rdata = Rng::new(25).bytes(4096);
        rq.mem.all().write_from(8192, &rdata).unwrap();
        assert_ok(&rq.rw(&d, WRITE, 2000), "raw queue write");
        d.client()
            .dma_unmap(ri, RQ_BYTES)
            .expect("server answers the unmap of queue memory");
        rq.submit(&d, rw(READ, 1, 2000, 8, rq.data(), 0));
        // The controller cannot post to a CQ it cannot reach: fatal, never a crash.
        wait_fatal(&d);
        assert!(dev.ctrl().stats().fatal);
        d.reset_controller().expect("reset after the fatal unmap");
        drop(qp);
        rq.map(&d);
        rq.create(&d);
        assert_ok(&rq.rw(&d, READ, 2000), "raw queue read after reset + remap");
        let mut back = vec![0u8; 4096];
        rq.mem.all().read_into(8192, &mut back).unwrap();
        assert!(back == rdata, "data written before the unmap is intact");

        // 3. Everything (admin queue and I/O queues) unmapped at once.
        let _qp = d.create_qpair(16, false).unwrap();
        d.client().unmap_all().expect("server answers UNMAP_ALL");
        wait_fatal(&d);
        d.reset_controller()
            .expect("CC.EN toggles even without memory");
    });
}

/// SPDK's client attaches the region's fd to DMA_UNMAP: the unmap takes effect (the
/// fd is closed, not kept), and the IOVA can be mapped again to other memory, which
/// the next command then uses.
#[test]
fn dma_unmap_with_an_fd_attached_takes_effect() {
    hostile("unmapfd", 37, |_dev, d| {
        let (a, b) = (
            SharedMem::new("a", 64 << 10).unwrap(),
            SharedMem::new("b", 64 << 10).unwrap(),
        );
        let x = 0x2_0000_0000u64;
        d.client()
            .dma_map(a.fd(), 0, x, 64 << 10, Prot::RW)
            .unwrap();
        let mut qp = d.create_qpair(16, false).unwrap();
        a.all().write_from(0, &[0xa5; 4096]).unwrap();
        assert_ok(&raw(&mut qp, rw(WRITE, 1, 10, 8, x, 0)), "write from a");
        a.all().write_from(0, &[0; 4096]).unwrap();
        let mut unmap: Vec<u8> = [24u32, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
        unmap.extend_from_slice(&x.to_le_bytes());
        unmap.extend_from_slice(&(64u64 << 10).to_le_bytes());
        d.client()
            .request_raw(Command::DmaUnmap, &unmap, &[a.fd()])
            .expect("DMA_UNMAP with the region's fd attached");
        d.client()
            .dma_map(b.fd(), 0, x, 64 << 10, Prot::RW)
            .expect("the IOVA is free again");
        assert_ok(&raw(&mut qp, rw(READ, 1, 10, 8, x, 0)), "read into b");
        let (mut in_a, mut in_b) = (vec![0u8; 4096], vec![0u8; 4096]);
        a.all().read_into(0, &mut in_a).unwrap();
        b.all().read_into(0, &mut in_b).unwrap();
        assert!(in_b.iter().all(|x| *x == 0xa5), "the read landed in b");
        assert!(in_a.iter().all(|x| *x == 0), "and not in the unmapped a");
    });
}
