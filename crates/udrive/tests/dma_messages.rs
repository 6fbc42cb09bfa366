//! Clients that do not share their memory (DMA_MAP without a file descriptor, as
//! QEMU sends for guest RAM that is not fd-backed): udrive mirrors it and moves
//! bytes with DMA_READ/DMA_WRITE messages (docs/decisions/0020-dma-messages.md).
//! Everything here runs through udrive's initiator with `DriverOpts::dma_messages`,
//! whose service thread answers those messages from its unshared pool.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use initiator::{DataMode, DmaServeMode, DriverOpts, IoOp, NvmeDriver, QpairOpts, Sqe};
use vfio_user::proto::DmaWire;

const DTE: u8 = 0x04; // Data Transfer Error

fn unshared() -> DriverOpts {
    DriverOpts {
        dma_messages: true,
        ..opts()
    }
}

fn counts(dev: &TestDev, what: &str) -> u64 {
    dev.json()["dma_message_counts"][what]
        .as_u64()
        .unwrap_or_else(|| panic!("no count {what}: {}", dev.json()))
}

#[test]
fn io_over_dma_messages_is_correct_and_counted() {
    let dev = TestDev::start("msgs-io", &["ram:16M"]);
    let d = dev.connect_with(unshared());
    let svc = d.dma_service().expect("DMA service runs");
    check_io(&d, 1);
    let j = dev.json();
    assert_eq!(j["state"]["dma_messages"], true, "{j}");
    assert!(
        counts(&dev, "reads") > 0 && counts(&dev, "writes") > 0,
        "{j}"
    );
    assert!(svc.stats.reads.load(Ordering::Relaxed) > 0);
    assert!(svc.stats.writes.load(Ordering::Relaxed) > 0);
    assert_eq!(svc.stats.out_of_bounds.load(Ordering::Relaxed), 0);
    // Shadow doorbells in unshared memory would cost a fetch per poll: refused,
    // the driver rings plain doorbells.
    assert!(!d.shadow_doorbells());
    // The groups run on the controller's own reactor, not the shared one (0).
    let qp = d.create_qpair(8, false).expect("queue pair");
    let groups = dev.json()["state"]["queue_groups"].clone();
    assert!(
        groups
            .as_array()
            .unwrap()
            .iter()
            .all(|g| g["reactor"].as_u64() != Some(0)),
        "{groups}"
    );
    d.delete_qpair(qp).expect("delete");
}

#[test]
fn qemus_layout_is_detected_and_served() {
    let dev = TestDev::start("msgs-qemu", &["ram:16M"]);
    let d = dev.connect_with(DriverOpts {
        dma_wire: DmaWire::Qemu,
        ..unshared()
    });
    check_io(&d, 2);
    assert_eq!(
        d.dma_service()
            .unwrap()
            .stats
            .out_of_bounds
            .load(Ordering::Relaxed),
        0
    );
}

/// MDTS-sized transfers through chained PRP lists and SGL segment chains, with a
/// client that takes 4 KiB per message: every list page and segment comes over
/// before it is walked, and no message carries more than the client allows.
#[test]
fn big_transfers_walk_lists_and_split_at_the_clients_limit() {
    let dev = TestDev::start("msgs-big", &["ram:16M"]);
    let d = dev.connect_with(DriverOpts {
        max_data_xfer: 4096,
        ..unshared()
    });
    let mut qp = d
        .create_qpair_with(QpairOpts {
            depth: 16,
            prp_list_entries: 4,
            sgl_split: 8,
            sgl_segment_descs: 3,
            ..Default::default()
        })
        .expect("queue pair");
    let buf = qp.alloc_buf(128 << 10).expect("buffer");
    let mut rng = Rng::new(3);
    for mode in [DataMode::Prp, DataMode::Sgl] {
        for slba in [0u64, 1000, 20000] {
            let reads_before = counts(&dev, "reads");
            let data = rng.bytes(128 << 10);
            write_read(&mut qp, &buf, slba, &data, mode);
            assert!(
                counts(&dev, "reads") - reads_before >= 32,
                "128 KiB at 4 KiB per message"
            );
        }
    }
    let max = d
        .dma_service()
        .unwrap()
        .stats
        .max_count
        .load(Ordering::Relaxed);
    assert_eq!(max, 4096, "largest message data");
}

/// Completions with interrupts, in each poll mode (busy maps the doorbell page
/// even so: doorbells are BAR0, not DMA).
#[test]
fn interrupts_in_every_poll_mode() {
    for poll in [
        engine::PollMode::Busy,
        engine::PollMode::Adaptive,
        engine::PollMode::Event,
    ] {
        let dev = TestDev::start_with("msgs-irq", &["ram:16M"], |c| c.poll = poll);
        let d = dev.connect_with(unshared());
        assert_eq!(d.doorbells_mapped(), poll == engine::PollMode::Busy);
        let mut qp = d.create_qpair(16, true).expect("queue pair");
        let buf = qp.alloc_buf(8192).expect("buffer");
        let mut rng = Rng::new(4);
        for i in 0..20u64 {
            let data = rng.bytes(8192);
            buf.write(0, &data).unwrap();
            for op in [IoOp::Write, IoOp::Read] {
                if op == IoOp::Read {
                    buf.fill(0);
                }
                let cid = qp
                    .submit_io(op, 1, i * 16, 16, Some(&buf), DataMode::Prp)
                    .unwrap();
                qp.ring().unwrap();
                assert!(qp.block_on_irq(T).unwrap(), "{poll:?}: interrupt");
                assert_ok(&qp.wait(cid, T).unwrap(), "I/O");
            }
            let mut back = vec![0u8; 8192];
            buf.read(0, &mut back).unwrap();
            assert!(back == data, "{poll:?}: data at {i}");
        }
        d.delete_qpair(qp).expect("delete");
    }
}

/// Admin completions that arrive on their own: a namespace added at run time
/// completes the outstanding Asynchronous Event Request through DMA_WRITE.
#[test]
fn asynchronous_events_arrive() {
    let dev = TestDev::start("msgs-aer", &["ram:16M"]);
    let mut d = dev.connect_with(unshared());
    d.enable_ns_events().expect("AER");
    let disk: Arc<dyn bdev::BlockDevice> = Arc::new(bdev::RamDisk::new(4 << 20, 512).unwrap());
    dev.ctrl().add_namespace(2, disk).expect("add namespace");
    let ev = d.wait_event(T).expect("namespace event");
    assert!(ev.is_namespace_change(), "{ev:?}");
    assert_eq!(d.rescan_namespaces().expect("rescan"), vec![2]);
    assert!(d.namespace(2).is_some());
}

fn io_at(
    qp: &mut initiator::QueuePair,
    op: IoOp,
    buf: &initiator::DmaBuf,
) -> initiator::Completion {
    io(qp, op, 1, 64, 8, Some(buf), DataMode::Prp)
}

/// A client that refuses (or garbles) the transfers of one buffer costs those
/// commands a Data Transfer Error; the controller and other commands carry on.
#[test]
fn refused_or_garbled_transfers_fail_the_command_only() {
    let dev = TestDev::start("msgs-refuse", &["ram:16M"]);
    let d = dev.connect_with(unshared());
    let svc = d.dma_service().unwrap();
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    let bad = qp.alloc_buf(4096).expect("buffer");
    for mode in [DmaServeMode::Refuse(libc::EFAULT), DmaServeMode::Garble] {
        svc.set_target(Some((bad.iova(), 4096)));
        svc.set_mode(mode);
        for op in [IoOp::Write, IoOp::Read] {
            let c = io_at(&mut qp, op, &bad);
            assert_status(&c, 0, DTE, &format!("{mode:?} {op:?}"));
        }
        // Other buffers on the same queue still work, then this one again.
        qp_still_works(&mut qp, 100, 5);
        svc.set_mode(DmaServeMode::Normal);
        svc.set_target(None);
        assert_ok(&io_at(&mut qp, IoOp::Write, &bad), "after");
    }
    assert!(counts(&dev, "bad_replies") > 0);
    assert!(!dev.json()["state"]["fatal"].as_bool().unwrap());
    // An address outside every mapping fails before any message.
    let c = raw(&mut qp, rw(WRITE, 1, 0, 8, UNMAPPED, 0));
    assert_status(&c, 0, DTE, "unmapped PRP");
}

/// A client that never answers: the wait is bounded, the controller goes fatal,
/// other controllers (on the shared reactor) never notice, and a reset recovers.
#[test]
fn a_silent_client_costs_a_bounded_wait_and_its_own_controller() {
    let by = bystander();
    let dev = TestDev::start("msgs-silent", &["ram:16M"]);
    let d = dev.connect_with(unshared());
    let svc = d.dma_service().unwrap();
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    let buf = qp.alloc_buf(4096).expect("buffer");
    svc.set_mode(DmaServeMode::Silent);
    let t0 = Instant::now();
    let cid = qp
        .submit_io(IoOp::Write, 1, 0, 8, Some(&buf), DataMode::Prp)
        .unwrap();
    qp.ring().unwrap();
    by.check();
    wait_fatal(&d);
    // It waited for the reply timeout (5 s; load only lengthens a wait), and the
    // timeout, nothing else, ended the wait: wait_fatal's own bound bounds it.
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_secs(4),
        "fatal after {waited:?} (reply timeout 5 s)"
    );
    assert!(qp.try_take(cid).unwrap().is_none(), "no completion");
    assert!(counts(&dev, "timeouts") > 0);
    by.check();
    // The client comes back to its senses and resets the controller.
    svc.set_mode(DmaServeMode::Normal);
    drop(qp);
    d.reset_controller().expect("reset");
    check_io(&d, 6);
}

/// Replies to requests never made (unknown ids, junk sizes, error flags) before
/// every real answer: dropped and counted, I/O stays correct.
#[test]
fn a_flooding_client_is_survived() {
    let dev = TestDev::start("msgs-flood", &["ram:16M"]);
    let d = dev.connect_with(unshared());
    d.dma_service().unwrap().set_mode(DmaServeMode::Flood(20));
    check_io(&d, 7);
    assert!(counts(&dev, "unexpected_replies") > 0);
    d.dma_service().unwrap().set_mode(DmaServeMode::Normal);
    check_io(&d, 8);
}

/// DMA_UNMAP of unshared memory is answered at once (nothing of the client's is
/// mapped here), even while the client answers nothing; later transfers to it
/// fail.
#[test]
fn unmapping_unshared_memory_answers_at_once() {
    let dev = TestDev::start("msgs-unmap", &["ram:16M"]);
    let d = dev.connect_with(unshared());
    let svc = d.dma_service().unwrap();
    let extra = Arc::new(guest_mem::SharedMem::new("extra", 1 << 20).unwrap());
    let iova = 0x3_0000_0000;
    d.client()
        .dma_map_unshared(extra, iova, guest_mem::Prot::RW)
        .expect("map");
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    assert_ok(
        &raw(&mut qp, rw(WRITE, 1, 0, 8, iova, 0)),
        "write from the extra region",
    );
    svc.set_mode(DmaServeMode::Silent);
    let t0 = Instant::now();
    d.client().dma_unmap(iova, 1 << 20).expect("unmap");
    // Nothing was waited for: a wait for the (silent) client ends only with its
    // reply timeout. (The line between at once and waiting, not a speed.)
    let took = t0.elapsed();
    assert!(took < vfio_user::DEFAULT_DMA_REPLY_TIMEOUT, "{took:?}");
    svc.set_mode(DmaServeMode::Normal);
    let c = raw(&mut qp, rw(WRITE, 1, 0, 8, iova, 0));
    assert_status(&c, 0, DTE, "after unmap");
    qp_still_works(&mut qp, 200, 9);
}

/// After a client whose memory moved by messages, the next one shares its memory
/// and gets the fast path (no messages, the shared reactor).
#[test]
fn the_next_client_starts_clean() {
    let dev = TestDev::start("msgs-next", &["ram:16M"]);
    {
        let d = dev.connect_with(unshared());
        check_io(&d, 10);
    }
    wait_until("client gone", T, || {
        !dev.json()["connected"].as_bool().unwrap()
    });
    let before = counts(&dev, "reads");
    let d = dev.connect();
    check_io(&d, 11);
    assert_eq!(dev.json()["state"]["dma_messages"], false);
    assert_eq!(
        counts(&dev, "reads"),
        before,
        "no messages for shared memory"
    );
}

#[test]
fn a_client_mixing_shared_and_unshared_memory_works() {
    let dev = TestDev::start("msgs-mixed", &["ram:16M"]);
    // The driver's pool is shared; one extra region, mapped while a queue pair is
    // running (memory hot-plugged into a guest), is not: the running queues move
    // to the controller's own reactor before that memory can be used.
    let d: NvmeDriver = dev.connect();
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    let on = |r: u64| {
        dev.json()["state"]["queue_groups"]
            .as_array()
            .unwrap()
            .iter()
            .all(|g| g["reactor"].as_u64() == Some(r))
    };
    assert!(on(0), "shared reactor first");
    let extra = Arc::new(guest_mem::SharedMem::new("extra", 1 << 20).unwrap());
    let iova = 0x3_0000_0000;
    d.client()
        .dma_map_unshared(extra.clone(), iova, guest_mem::Prot::RW)
        .expect("map");
    assert_eq!(dev.json()["state"]["dma_messages"], true);
    assert!(!on(0), "moved to the controller's own reactor");
    let data = Rng::new(12).bytes(4096);
    extra.slice(0, 4096).unwrap().write_from(0, &data).unwrap();
    assert_ok(&raw(&mut qp, rw(WRITE, 1, 40, 8, iova, 0)), "write");
    let buf = qp.alloc_buf(4096).unwrap();
    assert_ok(
        &io(&mut qp, IoOp::Read, 1, 40, 8, Some(&buf), DataMode::Prp),
        "read",
    );
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert!(back == data, "data written from unshared memory");
    // And the other way round.
    extra.slice(0, 4096).unwrap().fill(0);
    assert_ok(&raw(&mut qp, rw(READ, 1, 40, 8, iova + 4096, 0)), "read");
    let mut back2 = vec![0u8; 4096];
    extra
        .slice(4096, 4096)
        .unwrap()
        .read_into(0, &mut back2)
        .unwrap();
    assert!(back2 == data, "data read into unshared memory");
    qp_still_works(&mut qp, 300, 13);
}

/// Read-only memory without an fd next to shared RAM (what QEMU maps for its ROMs
/// when guest RAM is a memfd) keeps the fast path: queues stay on the shared
/// reactor, and I/O from that memory fails at once rather than waiting there.
#[test]
fn read_only_unshared_memory_alone_keeps_the_fast_path() {
    let dev = TestDev::start("msgs-rom", &["ram:16M"]);
    let d: NvmeDriver = dev.connect();
    let rom = Arc::new(guest_mem::SharedMem::new("rom", 1 << 20).unwrap());
    let iova = 0x3_0000_0000;
    d.client()
        .dma_map_unshared(
            rom,
            iova,
            guest_mem::Prot {
                read: true,
                write: false,
            },
        )
        .expect("map");
    assert_eq!(dev.json()["state"]["dma_messages"], false);
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    let groups = dev.json()["state"]["queue_groups"].clone();
    assert!(
        groups
            .as_array()
            .unwrap()
            .iter()
            .all(|g| g["reactor"].as_u64() == Some(0)),
        "{groups}"
    );
    let c = raw(&mut qp, rw(WRITE, 1, 0, 8, iova, 0));
    assert_status(&c, 0, DTE, "I/O from read-only unshared memory");
    qp_still_works(&mut qp, 400, 14);
    assert_eq!(counts(&dev, "reads"), 0, "no message");
}

/// An admin command waiting for the client's reply does not hold up the client's
/// own requests: its pass runs off the connection's thread (QEMU answers our
/// requests only while none of its own waits for us).
#[test]
fn the_client_is_served_while_an_admin_command_waits() {
    let dev = TestDev::start("msgs-admin", &["ram:16M"]);
    let d = dev.connect_with(unshared());
    let svc = d.dma_service().unwrap();
    // One command answered first, layout probe included: the one below then waits
    // for the DMA read of its own entry (the admin queue is in the client's
    // memory), which the server counts as it sends it.
    d.admin(Sqe::identify(1, 0)).expect("identify");
    svc.set_mode(DmaServeMode::Silent);
    std::thread::scope(|s| {
        let before = dev.dma_counts();
        let waiting = s.spawn(|| d.admin(Sqe::identify(1, 0)));
        wait_until("the admin command's DMA read", T, || {
            dev.dma_counts().reads > before.reads
        });
        let mut id = [0u8; 4];
        d.client()
            .region_read(vfio_user::proto::PCI_CONFIG_REGION, 0, &mut id)
            .expect("config read");
        // Answered while the command still waited for its reply.
        let now = dev.dma_counts();
        assert_eq!(now.timeouts, before.timeouts, "the command gave up first");
        assert_eq!(
            u16::from_le_bytes([id[0], id[1]]),
            udrive::device::PCI_VENDOR
        );
        // The command itself gives up with the reply timeout (controller fatal).
        assert!(waiting.join().unwrap().is_err() || dev.json()["state"]["fatal"] == true);
    });
}
