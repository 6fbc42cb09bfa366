//! One test per attack of docs/decisions/0010-hostile-clients.md, each against a
//! `udrive serve` process that also serves a bystander NVMe controller and a
//! bystander vhost-user-blk device doing verified I/O. An attack may cost the
//! attacker its own connection or get it an error, nothing more: the process stays
//! up, the bystanders see no error and keep going, the fd count and RSS return to
//! their baseline, and the attacked devices serve a well-behaved client afterwards.

mod common;

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::serve::{trickle, vfio_shrink, Bystanders, Server, SOCKETS};
use common::{check_io, opts, wait_until};
use guest_mem::{Prot, SharedMem};
use initiator::regs::{CC, CC_EN};
use initiator::{NvmeDriver, VfioUserClient};
use test_support::blkio::{blkio_round, BlkioSession};
use test_support::poll_until;
use test_support::vhost_fe::*;
use vfio_user::proto::PCI_BAR0_REGION;
use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::Frontend;
use vhost::{VhostBackend, VhostUserMemoryRegionInfo};

/// One server at a time: each one's reactor and its bystanders busy-poll, and the
/// machine may have 2 cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// What an attack may leave in the server's RSS (allocator caches, a thread stack);
/// client memory mapped during the attack must be gone.
const RSS_SLACK_KIB: u64 = 8 * 1024;

/// Runs `attack` against a fresh server with running bystanders, then checks what
/// every attack must leave intact.
fn under_attack(attack: impl FnOnce(&Server)) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = Server::start();
    let by = Bystanders::start(s.path("nvme-b.sock"), s.path("vhost-b.sock"));
    wait_until("bystanders running", Duration::from_secs(30), || {
        by.ops() > 50
    });
    let (fds0, rss0, open0) = (s.fds(), s.rss_kib(), s.fd_targets());

    attack(&s);

    assert!(s.alive(), "udrive died; its log:\n{}", s.log());
    let fds1 = s.settle_fds(fds0);
    let open1 = s.fd_targets();
    let rss1 = s.rss_kib();
    let ops = by.ops();
    poll_until(Duration::from_secs(30), || by.ops() >= ops + 50);
    let (total, errors) = by.finish();
    assert!(errors.is_empty(), "bystanders saw errors: {errors:?}");
    assert!(total >= ops + 50, "bystanders stalled after the attack");
    assert!(
        fds1 <= fds0,
        "fds {fds0} -> {fds1}; new:\n{}\nthe server log's end:\n{}",
        s.describe_fds(&added(&open0, &open1)),
        tail(&s.log(), 60)
    );
    assert!(rss1 <= rss0 + RSS_SLACK_KIB, "RSS {rss0} KiB -> {rss1} KiB");
    let d = NvmeDriver::connect(s.path("nvme-a.sock"), opts())
        .expect("the attacked controller serves a new client");
    check_io(&d, 5);
    drop(d);
    BlkioSession::open(&s.path("vhost-a.sock"))
        .and_then(|mut c| c.round(0, 0x5a))
        .expect("the attacked vhost-user-blk device serves a new front end");
    assert!(s.alive(), "udrive died; its log:\n{}", s.log());
}

/// What `after` holds that `before` did not (both sorted, as multisets).
fn added<'a>(before: &[String], after: &'a [String]) -> Vec<&'a String> {
    let mut rest = before.to_vec();
    after
        .iter()
        .filter(|t| match rest.iter().position(|b| b == *t) {
            Some(i) => {
                rest.swap_remove(i);
                false
            }
            None => true,
        })
        .collect()
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Whether the server logged a `what` line that reports suppressed lines.
fn suppressed(s: &Server, what: &str) -> bool {
    s.log()
        .lines()
        .any(|l| l.contains(what) && l.contains("suppressed="))
}

fn repaired_faults(s: &Server) -> usize {
    s.log().matches("truncated memory").count()
}

/// Waits until the server logged one more repaired fault than `before`.
fn wait_repaired(s: &Server, before: usize) {
    wait_until("the fault is repaired", Duration::from_secs(10), || {
        repaired_faults(s) > before
    });
}

fn small_file(len: u64) -> File {
    let f = tempfile::tempfile().unwrap();
    f.set_len(len).unwrap();
    f
}

// ---- 1. shared files the other side can shrink ---------------------------------------

#[test]
fn bar0_doorbell_memfd_cannot_be_resized_or_unsealed() {
    under_attack(|s| {
        let mut c = VfioUserClient::connect(s.path("nvme-a.sock")).unwrap();
        let info = c.region_info(PCI_BAR0_REGION).unwrap();
        let f = File::from(info.fd.expect("BAR0 comes with its doorbell fd"));
        assert!(f.set_len(0).is_err(), "shrinking the doorbell page");
        assert!(f.set_len(1 << 20).is_err(), "growing it");
        // SAFETY: fcntl on a descriptor we own, no pointers.
        let seals = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) };
        let want = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        assert_eq!(seals & want, want, "seals {seals:#x}");
        // The client keeps its connection: the controller still answers it.
        assert!(c.device_info().is_ok());
    });
}

#[test]
fn dma_mapped_file_truncated_while_the_controller_reads_it() {
    under_attack(|s| {
        let before = repaired_faults(s);
        let mut c = vfio_shrink(&s.path("nvme-a.sock")).expect("attack set up");
        wait_repaired(s, before);
        wait_until("the attacker is dropped", Duration::from_secs(10), || {
            c.device_info().is_err()
        });
    });
}

#[test]
fn dma_map_past_the_end_of_its_file_is_refused() {
    under_attack(|s| {
        let mut c = VfioUserClient::connect(s.path("nvme-a.sock")).unwrap();
        let f = small_file(4096);
        for (off, len) in [(0, 64 << 10), (4096, 4096), (u64::MAX - 4095, 4096)] {
            assert!(
                c.dma_map(f.as_fd(), off, 0x40_0000, len, Prot::RW).is_err(),
                "DMA_MAP of {len} bytes at offset {off} of a 4 KiB file"
            );
        }
        assert!(c.dma_map(f.as_fd(), 0, 0x40_0000, 4096, Prot::RW).is_ok());
        assert!(c.device_info().is_ok(), "the client keeps its connection");
    });
}

/// A front end set up by hand with REPLY_ACK, so a refused message is an error.
fn acked_frontend(sock: &Path) -> Frontend {
    let fe = negotiate(sock, VhostUserProtocolFeatures::REPLY_ACK);
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    fe
}

#[test]
fn vhost_memory_region_larger_than_its_file_is_refused() {
    under_attack(|s| {
        let small = small_file(4096);
        let ram = GuestRam::file(MEM);
        let fe = acked_frontend(&s.path("vhost-a.sock"));
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM,
            userspace_addr: ram.all().as_ptr() as u64,
            mmap_offset: 0,
            mmap_handle: small.as_raw_fd(),
        };
        assert!(fe.set_mem_table(&[region]).is_err(), "4 KiB file as 1 MiB");
    });
}

#[test]
fn vhost_memory_file_truncated_under_a_running_queue() {
    under_attack(|s| {
        let mut r =
            FakeFrontend::connect_with(&s.path("vhost-a.sock"), Connect::new(GuestRam::file(MEM)));
        r.put(DATA, &[0x42; 512]);
        r.header(T_OUT, 3);
        assert_eq!(
            r.request(&[(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)]),
            0
        );
        let before = repaired_faults(s);
        if let GuestRam::File(f, _) = &r.mem {
            f.set_len(0).unwrap();
        }
        // From here on this process must not touch the ring either.
        r.kick.write(1).unwrap();
        wait_repaired(s, before);
        wait_until("the front end is dropped", Duration::from_secs(10), || {
            r.fe.get_features().is_err()
        });
    });
}

#[test]
fn vhost_inflight_area_truncated_under_a_running_queue() {
    under_attack(|s| {
        let vs = s.path("vhost-a.sock");
        let sealed = get_inflight_area(&vs);
        assert!(
            sealed.set_len(0).is_err(),
            "udrive's inflight memfd is sealed"
        );
        let log = small_file(sealed.metadata().unwrap().len());
        drop(sealed);
        let mut r = FakeFrontend::connect_with(
            &vs,
            Connect {
                inflight: Some(&log),
                ..Connect::new(SharedMem::new("g", MEM).unwrap())
            },
        );
        let req = [(HDR, 16, false), (DATA, 512, false), (STATUS, 1, true)];
        r.put(DATA, &[0x17; 512]);
        r.header(T_OUT, 1);
        assert_eq!(r.request(&req), 0);
        let before = repaired_faults(s);
        log.set_len(0).unwrap();
        r.push(&req);
        wait_repaired(s, before);
        wait_until("the front end is dropped", Duration::from_secs(10), || {
            r.fe.get_features().is_err()
        });
    });
}

// ---- 2. descriptor leaks -------------------------------------------------------------

#[test]
fn ten_thousand_vhost_user_connections_return_their_fds() {
    under_attack(|s| {
        let vs = s.path("vhost-a.sock");
        for _ in 0..10_000 {
            drop(UnixStream::connect(&vs).unwrap());
        }
        for i in 0..20u8 {
            blkio_round(&vs, i);
        }
    });
}

#[test]
fn vhost_user_devices_added_and_removed_return_their_fds() {
    under_attack(|s| {
        let sock = s.path("cycle.sock");
        for i in 0..50u8 {
            let add = format!(r#"{{"socket":"{}","disk":"ram:1M"}}"#, sock.display());
            s.rpc("vhost_user_blk_add", &add).unwrap();
            // Every tenth device serves a session first (its front end may not be
            // gone yet when the remove comes: force it).
            let session = i % 10 == 0;
            if session {
                blkio_round(&sock, i);
            }
            let rm = format!(r#"{{"socket":"{}","force":{session}}}"#, sock.display());
            s.rpc("vhost_user_blk_remove", &rm).unwrap();
        }
    });
}

// ---- 3. slow senders -----------------------------------------------------------------

#[test]
fn vfio_user_message_trickled_byte_by_byte() {
    under_attack(|s| {
        let mut c = UnixStream::connect(s.path("nvme-a.sock")).unwrap();
        // VERSION declaring a 1 MiB message, then a byte every 100 ms.
        let mut hdr = Vec::new();
        hdr.extend_from_slice(&1u16.to_le_bytes());
        hdr.extend_from_slice(&1u16.to_le_bytes());
        hdr.extend_from_slice(&(1u32 << 20).to_le_bytes());
        hdr.extend_from_slice(&[0; 8]);
        assert!(trickle(&mut c, &hdr, &[b'x'; 100]), "slow sender dropped");
    });
}

#[test]
fn vhost_user_message_trickled_byte_by_byte() {
    under_attack(|s| {
        let mut c = UnixStream::connect(s.path("vhost-a.sock")).unwrap();
        // A GET_FEATURES header saying 8 bytes follow, sent slowly.
        let mut hdr = Vec::new();
        for v in [1u32, 1, 8] {
            hdr.extend_from_slice(&v.to_le_bytes());
        }
        assert!(
            trickle(&mut c, &hdr[..4], &[0u8; 60]),
            "slow sender dropped"
        );
    });
}

#[test]
fn slow_and_idle_control_clients_cannot_lock_out_the_operator() {
    under_attack(|s| {
        let rpc = s.path("rpc.sock");
        // One byte per 100 ms: dropped by the message deadline, not the idle timeout.
        let mut slow = UnixStream::connect(&rpc).unwrap();
        assert!(trickle(&mut slow, b"{", &[b' '; 40]), "slow sender dropped");
        // Every slot taken by idle connections and slow senders...
        let mut hogs: Vec<UnixStream> = (0..udrive::rpc::MAX_CONNECTIONS + 16)
            .map(|i| {
                let mut c = UnixStream::connect(&rpc).unwrap();
                if i % 2 == 0 {
                    let _ = c.write_all(b"{\"jsonrpc\":");
                }
                c
            })
            .collect();
        // ... and still the operator gets answers, again and again.
        for _ in 0..5 {
            s.rpc("get_devices", "{}").expect("a legitimate call");
        }
        hogs.clear();
        s.rpc("get_devices", "{}").expect("a legitimate call");
    });
}

// ---- 4. log flooding -----------------------------------------------------------------

#[test]
fn guest_and_client_triggered_lines_are_rate_limited() {
    under_attack(|s| {
        let (ns, vs) = (s.path("nvme-a.sock"), s.path("vhost-a.sock"));
        let bad_enables = |n: usize| {
            let mut c = VfioUserClient::connect(&ns).unwrap();
            for _ in 0..n {
                // Enable with no admin queue configured (AQA = 0): refused and logged.
                c.region_write_u32(PCI_BAR0_REGION, CC, CC_EN).unwrap();
                c.region_write_u32(PCI_BAR0_REGION, CC, 0).unwrap();
            }
        };
        let t = Instant::now();
        bad_enables(2000);
        for _ in 0..2000 {
            drop(UnixStream::connect(&vs).unwrap());
        }
        // The first line of a later window reports what the flood's windows dropped.
        // The server may still be working through queued connections: keep adding
        // one line per window until both reports are there.
        let until = Instant::now() + Duration::from_secs(30);
        while !(suppressed(s, "invalid controller enable") && suppressed(s, "vhost-user front end"))
            && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(1100));
            bad_enables(1);
            drop(UnixStream::connect(&vs).unwrap());
        }
        std::thread::sleep(Duration::from_millis(300));
        let secs = t.elapsed().as_secs() + 1;

        let log = s.log();
        let count = |what: &str| log.lines().filter(|l| l.contains(what)).count();
        let budget = (secs as usize + 3) * trace::LINES_PER_WINDOW as usize;
        let enables = count("invalid controller enable");
        let vhost = count("vhost-user front end");
        assert!(
            (1..=budget).contains(&enables),
            "{enables} lines for 2000 bad enables (budget {budget})"
        );
        assert!(
            (1..=2 * budget).contains(&vhost),
            "{vhost} lines for 2000 connections (budget {})",
            2 * budget
        );
        assert!(
            suppressed(s, "invalid controller enable"),
            "NVMe count reported"
        );
        assert!(
            suppressed(s, "vhost-user front end"),
            "vhost count reported"
        );
    });
}

// ---- 5. socket permissions -----------------------------------------------------------

#[test]
fn sockets_are_owner_only_by_default() {
    under_attack(|s| {
        for n in SOCKETS {
            let mode = std::fs::metadata(s.path(n)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{n}: mode {:o}", mode & 0o777);
        }
    });
}
