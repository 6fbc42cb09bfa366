use test_support::nvme_cmd::*;
use test_support::nvme_host::*;
use test_support::{wait_until, T};

fn create_cq_raw(h: &mut Host, qid: u16, qsize0: u16, cdw11: u32) -> Completion {
    let cq = h.alloc(16);
    let mut s = sqe(0x05, 0);
    set_prp(&mut s, cq, 0);
    s.cdw10 = u32::from(qid) | (u32::from(qsize0) << 16);
    s.cdw11 = cdw11;
    h.admin(s)
}

#[test]
fn queue_create_delete_errors() {
    let mut h = Host::new();
    h.enable();
    assert_eq!(create_cq_raw(&mut h, 0, 15, 3).code(), (1, 0x01), "qid 0");
    assert_eq!(
        create_cq_raw(&mut h, 33, 15, 3).code(),
        (1, 0x01),
        "qid > max"
    );
    assert_eq!(create_cq_raw(&mut h, 1, 0, 3).code(), (1, 0x02), "size 1");
    assert_eq!(
        create_cq_raw(&mut h, 1, 1024, 3).code(),
        (1, 0x02),
        "size > MQES+1"
    );
    assert_eq!(create_cq_raw(&mut h, 1, 15, 2).code(), (0, 0x02), "PC=0");
    assert_eq!(
        create_cq_raw(&mut h, 1, 15, 3 | (33 << 16)).code(),
        (1, 0x08),
        "vector"
    );
    let mut s = sqe(0x05, 0);
    set_prp(&mut s, 0x1000, 0);
    s.cdw10 = 1 | (15 << 16);
    s.cdw11 = 1;
    assert_eq!(h.admin(s).code(), (0, 0x02), "CQ memory unmapped");
    assert_eq!(h.create_sq(1, 16, 1).code(), (1, 0x00), "missing CQ");
    assert!(h.create_cq(1, 16, true, 1).ok());
    assert_eq!(
        h.create_cq(1, 16, true, 1).code(),
        (1, 0x01),
        "duplicate CQ"
    );
    assert_eq!(h.create_sq(0, 16, 1).code(), (1, 0x01), "SQ id 0");
    // The admin CQ is no valid CQID (docs/decisions/0011-nvme-conformance.md).
    assert_eq!(h.create_sq(1, 16, 0).code(), (1, 0x01), "SQ on admin CQ");
    assert!(h.create_sq(1, 16, 1).ok());
    assert!(h.create_sq(2, 16, 1).ok(), "second SQ on the same CQ");
    assert_eq!(h.create_sq(2, 16, 1).code(), (1, 0x01), "duplicate SQ");
    assert_eq!(h.ctrl.stats().io_queues, 2);
    // Both SQs work.
    let a = h.alloc(1);
    assert!(h.cmd(2, rw(2, 1, 0, 1, a, 0)).ok());
    let cid = h.submit(1, rw(2, 1, 0, 1, a, 0));
    assert_eq!(h.reap(1).cid, cid);
    let mut del = sqe(0x04, 0);
    del.cdw10 = 1;
    assert_eq!(h.admin(del).code(), (1, 0x0c), "CQ with SQs");
    let mut dsq = sqe(0x00, 0);
    dsq.cdw10 = 1;
    assert!(h.admin(dsq).ok());
    assert_eq!(h.admin(dsq).code(), (1, 0x01), "SQ already gone");
    assert_eq!(h.admin(del).code(), (1, 0x0c), "SQ 2 still attached");
    dsq.cdw10 = 2;
    assert!(h.admin(dsq).ok());
    assert!(h.admin(del).ok());
    assert_eq!(h.admin(del).code(), (1, 0x01), "CQ already gone");
    let st = h.ctrl.stats();
    assert_eq!((st.io_queues, st.io_completion_queues), (0, 0));
    assert_eq!(st.reads, 2, "counters survive deletion");
}

#[test]
fn doorbell_beyond_size_is_fatal_and_recoverable() {
    let mut h = Host::new();
    h.ready(true);
    h.ring_sq_raw(1, 64);
    h.wait_csts(2, 2);
    assert!(h.ctrl.stats().fatal);
    h.disable();
    assert_eq!(h.csts() & 3, 0, "CFS cleared by reset");
    h.ready(true);
    let a = h.alloc(1);
    assert!(h.io(rw(2, 1, 0, 1, a, 0)).ok());
    // Admin doorbell too.
    h.ring_sq_raw(0, 1000);
    h.wait_csts(2, 2);
    h.disable();
    h.enable();
    assert!(h.admin(sqe(0x18, 0)).ok());
}

#[test]
fn bad_enable_sets_cfs() {
    let h = Host::new();
    h.w32(0x24, 0); // admin queues of size 1
    h.w64(0x28, BASE);
    h.w64(0x30, BASE + 4096);
    h.w32(0x14, 1 | (6 << 16) | (4 << 20));
    h.wait_csts(3, 2);
    h.w32(0x14, 0);
    h.wait_csts(3, 0);
}

#[test]
fn shadow_doorbells() {
    let mut h = Host::new();
    h.enable();
    let db = h.alloc(1);
    let ei = h.alloc(1);
    let mut s = sqe(0x7c, 0);
    set_prp(&mut s, db, ei);
    assert!(h.admin(s).ok());
    let mut bad = sqe(0x7c, 0);
    set_prp(&mut bad, db + 8, ei);
    assert_eq!(h.admin(bad).code(), (0, 0x02));
    h.shadow = Some(db);
    h.ctrl.set_poll_mode(engine::PollMode::Busy);
    assert!(h.create_cq(1, 64, true, 1).ok());
    assert!(h.create_sq(1, 64, 1).ok());
    let a = h.alloc(1);
    for i in 0..5 {
        assert!(h.io(rw(1, 1, i, 1, a, 0)).ok());
    }
    let st = h.ctrl.stats();
    assert!(st.doorbell_buffer_configured);
    assert_eq!(st.doorbell_buffer_configs, 1);
    assert!(st.shadow_doorbell_reads >= 5, "{st:?}");
    // The MMIO doorbell page was never written for queue 1.
    assert_eq!(h.ctrl.doorbells().all().load_u32(0x1008), Some(0));
    // Polling: EventIdx behind the last tail processed, so a driver that honours
    // it does not ring (tests/poll_modes.rs has the details). Busy, so the group is
    // still polling however late this test looks (asleep it asks to be rung).
    let e = u32::from_le_bytes(h.read_mem(ei + 8, 4).try_into().unwrap());
    assert!(e < 5 || e == 63, "EventIdx {e} not behind tail 5");
    h.disable();
    let st = h.ctrl.stats();
    assert!(!st.doorbell_buffer_configured, "reset clears it");
    // What the exit statistics report: the count outlives the reset.
    assert_eq!(st.doorbell_buffer_configs, 1);
}

#[test]
fn interrupts_only_with_ien() {
    let mut h = Host::new();
    h.enable();
    assert!(h.create_cq(1, 16, false, 1).ok());
    assert!(h.create_sq(1, 16, 1).ok());
    assert!(h.create_cq(2, 16, true, 2).ok());
    assert!(h.create_sq(2, 16, 2).ok());
    let a = h.alloc(1);
    for _ in 0..20 {
        assert!(h.cmd(1, rw(2, 1, 0, 1, a, 0)).ok(), "wraps the 16-entry CQ");
    }
    assert_eq!(h.irq_count(1), 0, "polled queue never signals");
    assert!(h.cmd(2, rw(2, 1, 0, 1, a, 0)).ok());
    // The interrupt follows the entry (the end of the poll that posted it).
    wait_until("vector 2 signalled", T, || h.irq_count(2) >= 1);
}

/// A controller with I/O SQ 1 (16 entries) on a 4-entry CQ, and a one-page buffer.
fn four_entry_cq() -> (Host, u64) {
    let mut h = Host::new();
    h.enable();
    assert!(h.create_cq(1, 4, true, 1).ok());
    assert!(h.create_sq(1, 16, 1).ok());
    let a = h.alloc(1);
    (h, a)
}

#[test]
fn cq_full_is_respected() {
    let (mut h, a) = four_entry_cq();
    let cids: Vec<u16> = (0..6).map(|_| h.submit(1, rw(2, 1, 0, 1, a, 0))).collect();
    // Only 3 fit (size - 1): the controller reads the CQ head doorbell only when
    // the CQ seems full, and must never post over an entry the host still owns.
    wait_until("three completions posted", T, || {
        h.cq_phases(1)[..3] == [true; 3]
    });
    // Nothing to wait for: give a wrongly posted fourth entry time to show.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(h.cq_phases(1), [true, true, true, false]);
    // Reaping frees room for the rest.
    let mut got = Vec::new();
    while got.len() < 6 {
        got.push(h.reap(1).cid);
    }
    assert_eq!(got, cids);
    assert_eq!(h.ctrl.stats().reads, 6);
}

#[test]
fn cq_head_beyond_size_is_fatal_once_read() {
    let (mut h, a) = four_entry_cq();
    // A head past the end, stored into the mapped page (a message is checked at
    // once): harmless while the CQ has room (the controller need not read it),
    // fatal when it needs the head to post more.
    h.store_cq_head_raw(1, 9);
    for _ in 0..2 {
        h.submit(1, rw(2, 1, 0, 1, a, 0));
    }
    wait_until("two completions posted", T, || {
        h.cq_phases(1)[..2] == [true; 2]
    });
    assert!(!h.ctrl.stats().fatal);
    for _ in 0..2 {
        h.submit(1, rw(2, 1, 0, 1, a, 0));
    }
    h.wait_csts(2, 2);
    assert!(h.ctrl.stats().fatal);
    let phases = h.cq_phases(1);
    assert!(phases[0] && phases[1], "the first two were posted");
    assert!(!phases[3], "nothing past the room a valid head would leave");
    h.disable();
    assert_eq!(h.csts() & 3, 0, "CFS cleared by reset");
}

#[test]
fn reset_and_client_gone() {
    let mut h = Host::new();
    h.ready(true);
    h.ctrl.reset();
    let st = h.ctrl.stats();
    assert!(!st.ready);
    assert_eq!(st.io_queues, 0);
    assert_eq!(h.r64(0x28), 0, "registers reset");
    h.ready(true);
    h.ctrl.client_gone();
    assert_eq!(h.csts() & 1, 0);
    h.ready(true);
    let a = h.alloc(1);
    assert!(h.io(rw(2, 1, 0, 1, a, 0)).ok());
}
