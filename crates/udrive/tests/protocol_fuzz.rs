//! Black-box protocol fuzzer: clients of a running `udrive serve`'s real sockets
//! (vfio-user, vhost-user, JSON-RPC) send valid sessions mutated at random —
//! commands, sizes, argsz, fds attached or missing, truncated or oversized framing,
//! abrupt closes, files shrunk after mapping — while a bystander NVMe controller and
//! a bystander vhost-user-blk device in the same process do verified I/O. Afterwards
//! the process must be alive, its fd count and RSS back near their baseline, and
//! the bystanders must have seen no error.
//!
//! `UDRIVE_PROTO_FUZZ_SECS` (default 15) bounds the run; the seed is printed and
//! `UDRIVE_FUZZ_SEED` replays it.

mod common;

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::serve::{vfio_shrink, vhost_loop, Bystanders, Server};
use common::{opts, Rng};
use initiator::NvmeDriver;

// ---- the attacks -------------------------------------------------------------------

fn vfio_header(id: u16, cmd: u16, size: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&cmd.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// A valid vfio-user session as messages (VERSION, GET_INFO, REGION_INFO, DMA_MAP,
/// register reads and writes, SET_IRQS, DMA_UNMAP, RESET).
fn vfio_session() -> Vec<(Vec<u8>, bool)> {
    let caps = b"{\"capabilities\":{\"max_msg_fds\":8}}\0";
    let mut v = vec![0u8, 0, 1, 0];
    v.extend_from_slice(caps);
    let msg = |id: u16, cmd: u16, body: &[u8]| {
        let mut m = vfio_header(id, cmd, 16 + body.len() as u32);
        m.extend_from_slice(body);
        m
    };
    let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut dma = u32s(&[32, 3]);
    for x in [0u64, 0x10_0000, 0x10000] {
        dma.extend_from_slice(&x.to_le_bytes());
    }
    let mut rw = 0x14u64.to_le_bytes().to_vec();
    rw.extend_from_slice(&u32s(&[0, 4, 1]));
    let mut unmap = u32s(&[24, 0]);
    unmap.extend_from_slice(&0x10_0000u64.to_le_bytes());
    unmap.extend_from_slice(&0x10000u64.to_le_bytes());
    vec![
        (msg(1, 1, &v), false),
        (msg(2, 4, &u32s(&[16, 0, 0, 0])), false),
        (msg(3, 5, &u32s(&[32, 0, 0, 0, 0, 0, 0, 0])), false),
        (msg(4, 2, &dma), true),
        (msg(5, 9, &rw), false),
        (msg(6, 6, &u32s(&[16, 0, 2, 0])), false),
        (msg(7, 7, &u32s(&[20, 0x24, 2, 0, 1])), true),
        (msg(8, 3, &unmap), false),
        (msg(9, 13, &[]), false),
    ]
}

fn mutate(rng: &mut Rng, m: &mut Vec<u8>) {
    match rng.below(6) {
        0 if !m.is_empty() => {
            let i = rng.below(m.len() as u64) as usize;
            m[i] ^= 1 << rng.below(8);
        }
        1 if m.len() > 8 => {
            // msg_size or argsz off by a little or a lot.
            let at = if rng.below(2) == 0 {
                4
            } else {
                16.min(m.len() - 4)
            };
            let v = match rng.below(4) {
                0 => 0u32,
                1 => u32::MAX,
                2 => rng.below(1 << 21) as u32,
                _ => u32::from_le_bytes([m[at], m[at + 1], m[at + 2], m[at + 3]]).wrapping_add(1),
            };
            m[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        2 => {
            let n = rng.below(m.len() as u64 + 1) as usize;
            m.truncate(n);
        }
        3 => {
            let n = rng.below(64) as usize;
            m.extend(rng.bytes(n));
        }
        _ => {}
    }
}

fn memfd_like(len: u64) -> std::fs::File {
    let f = tempfile::tempfile().unwrap();
    f.set_len(len).unwrap();
    f
}

/// One mutated vfio-user session, possibly cut short.
fn vfio_fuzz(rng: &mut Rng, sock: &Path) {
    let Ok(mut s) = UnixStream::connect(sock) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(30)));
    let file = memfd_like(0x10000);
    for (mut m, fd) in vfio_session() {
        if rng.below(3) == 0 {
            mutate(rng, &mut m);
        }
        let attach = if rng.below(5) == 0 { !fd } else { fd };
        let fds = if attach { vec![file.as_fd()] } else { vec![] };
        if lifecycle::fdpass::send(s.as_fd(), &[&m], &fds).is_err() {
            return;
        }
        if rng.below(20) == 0 {
            return; // abrupt close
        }
        let mut reply = [0u8; 4096];
        let _ = s.read(&mut reply);
        if rng.below(10) == 0 {
            // The mapped file shrinks under the device.
            let _ = file.set_len(rng.below(0x10000));
        }
    }
}

fn vhost_msg(req: u32, flags: u32, body: &[u8]) -> Vec<u8> {
    let mut m = req.to_le_bytes().to_vec();
    m.extend_from_slice(&flags.to_le_bytes());
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    m
}

/// A mutated vhost-user session: features, protocol features, a memory table with a
/// plain file (sometimes shorter than it claims, sometimes shrunk afterwards),
/// vring setup and kicks, inflight messages, config reads.
fn vhost_fuzz(rng: &mut Rng, sock: &Path) {
    let Ok(mut s) = UnixStream::connect(sock) else {
        return;
    };
    // Most requests have no reply: do not wait long for one.
    let _ = s.set_read_timeout(Some(Duration::from_millis(3)));
    let mem_len = 0x10_0000u64;
    let file = memfd_like(if rng.below(4) == 0 { 4096 } else { mem_len });
    let mut table = 1u32.to_le_bytes().to_vec();
    table.extend_from_slice(&0u32.to_le_bytes());
    for x in [0u64, mem_len, 0x7f00_0000_0000, 0] {
        table.extend_from_slice(&x.to_le_bytes());
    }
    let u64b = |v: u64| v.to_le_bytes().to_vec();
    let mut addr = vec![0u8; 8];
    for x in [0u64, 0x1000, 0x2000, 0] {
        addr.extend_from_slice(&(x + 0x7f00_0000_0000).to_le_bytes());
    }
    let kick = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
    let kick_fd = {
        use std::os::fd::{AsRawFd, BorrowedFd};
        // SAFETY: `kick` outlives every use of the borrow below.
        unsafe { BorrowedFd::borrow_raw(kick.as_raw_fd()) }
    };
    let msgs: Vec<(Vec<u8>, bool, bool)> = vec![
        (vhost_msg(3, 1, &[]), false, false), // SET_OWNER
        (vhost_msg(1, 1, &[]), false, false), // GET_FEATURES
        (vhost_msg(2, 1, &u64b(1 << 30 | 1 << 32)), false, false), // SET_FEATURES
        (vhost_msg(16, 1, &[]), false, false), // GET_PROTOCOL_FEATURES
        (vhost_msg(15, 1, &u64b(0x8 | 0x200)), false, false), // SET_PROTOCOL_FEATURES
        (vhost_msg(5, 9, &table), true, false), // SET_MEM_TABLE
        (vhost_msg(8, 1, &[0, 0, 0, 0, 16, 0, 0, 0]), false, false), // SET_VRING_NUM
        (vhost_msg(9, 1, &addr), false, false), // SET_VRING_ADDR
        (vhost_msg(10, 1, &[0; 8]), false, false), // SET_VRING_BASE
        (vhost_msg(12, 1, &u64b(0)), false, true), // SET_VRING_KICK
        (vhost_msg(18, 1, &[0, 0, 0, 0, 1, 0, 0, 0]), false, false), // SET_VRING_ENABLE
        (vhost_msg(24, 1, &[0; 12 + 8]), false, false), // GET_CONFIG
    ];
    for (mut m, with_file, with_kick) in msgs {
        if rng.below(4) == 0 {
            mutate(rng, &mut m);
        }
        let fds = match (with_file, with_kick) {
            (true, _) => vec![file.as_fd()],
            (_, true) => vec![kick_fd],
            _ if rng.below(15) == 0 => vec![file.as_fd()],
            _ => vec![],
        };
        if lifecycle::fdpass::send(s.as_fd(), &[&m], &fds).is_err() {
            return;
        }
        if rng.below(25) == 0 {
            return;
        }
        let mut r = [0u8; 512];
        let _ = s.read(&mut r);
    }
    if rng.below(3) == 0 {
        let _ = file.set_len(rng.below(mem_len));
    }
    let _ = kick.write(1);
    std::thread::sleep(Duration::from_millis(5));
    let n = rng.below(64) as usize;
    let _ = s.write_all(&rng.bytes(n));
}

fn rpc_fuzz(rng: &mut Rng, sock: &Path) {
    let Ok(mut s) = UnixStream::connect(sock) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let good = [
        r#"{"jsonrpc":"2.0","id":1,"method":"get_devices"}"#,
        r#"{"jsonrpc":"2.0","id":2,"method":"get_stats","params":{}}"#,
        r#"{"jsonrpc":"2.0","id":3,"method":"set_qos","params":{"socket":"x","nsid":1,"iops":5}}"#,
        r#"[{"jsonrpc":"2.0","id":4,"method":"get_version"},{"jsonrpc":"2.0","method":"nope"}]"#,
    ];
    let mut m = good[rng.below(good.len() as u64) as usize]
        .as_bytes()
        .to_vec();
    if rng.below(2) == 0 {
        mutate(rng, &mut m);
    }
    let _ = s.write_all(&m);
    let mut r = [0u8; 4096];
    let _ = s.read(&mut r);
}

#[test]
fn protocol_fuzzer_against_a_running_server() {
    let secs: u64 = std::env::var("UDRIVE_PROTO_FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let seed: u64 = std::env::var("UDRIVE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("protocol fuzzer: seed {seed} (UDRIVE_FUZZ_SEED={seed} replays), {secs} s");
    let mut server = Server::start();
    let by = Bystanders::start(server.path("nvme-b.sock"), server.path("vhost-b.sock"));
    // Baseline once both bystanders are connected and running.
    common::wait_until("bystanders running", Duration::from_secs(30), || {
        by.ops() > 20
    });
    let (fds0, rss0) = (server.fds(), server.rss_kib());
    let mut rng = Rng::new(seed);
    let (mut sessions, start) = (0u64, Instant::now());
    let (na, va, rpc) = (
        server.path("nvme-a.sock"),
        server.path("vhost-a.sock"),
        server.path("rpc.sock"),
    );
    while start.elapsed() < Duration::from_secs(secs) {
        match rng.below(10) {
            0..=3 => vfio_fuzz(&mut rng, &na),
            4 => drop(vfio_shrink(&na)),
            5..=8 => vhost_fuzz(&mut rng, &va),
            _ => rpc_fuzz(&mut rng, &rpc),
        }
        sessions += 1;
        assert!(
            server.alive(),
            "udrive died after {sessions} sessions (seed {seed})"
        );
    }
    let log = std::fs::read_to_string(server.path("stderr.log")).unwrap_or_default();
    println!(
        "protocol fuzzer: {sessions} sessions in {secs} s ({:.0}/s); the server repaired \
         {} shrunk-file faults and logged {} lines",
        sessions as f64 / secs as f64,
        log.matches("truncated memory").count(),
        log.lines().count()
    );
    // Let connections wind down, then compare with the baseline.
    let fds1 = server.settle_fds(fds0);
    let rss1 = server.rss_kib();
    let (ops, errors) = by.finish();
    assert!(server.alive(), "udrive died (seed {seed})");
    assert!(
        errors.is_empty(),
        "bystanders saw errors (seed {seed}): {errors:?}"
    );
    assert!(ops > 10, "bystanders made progress ({ops} round trips)");
    assert!(
        fds1 <= fds0,
        "fds {fds0} -> {fds1} after {sessions} sessions (seed {seed})"
    );
    assert!(
        rss1 <= rss0 + 64 * 1024,
        "RSS {rss0} KiB -> {rss1} KiB (seed {seed})"
    );
    // The attacked devices still serve well-behaved clients.
    let d = NvmeDriver::connect(&na, opts()).expect("attacked controller serves again");
    common::check_io(&d, seed);
    drop(d);
    let stop = AtomicBool::new(false);
    let ops = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            stop.store(true, Ordering::Relaxed);
        });
        vhost_loop(&va, &ops, &stop).expect("attacked vhost device serves again");
    });
}
