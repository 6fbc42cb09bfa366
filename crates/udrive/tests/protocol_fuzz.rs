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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blkio::{Blkio, ReqFlags};
use common::{opts, Rng};
use guest_mem::Prot;
use initiator::regs::{AQA, CC, CC_EN};
use initiator::{DataMode, IoOp, NvmeDriver, VfioUserClient};
use vfio_user::proto::PCI_BAR0_REGION;

struct Server {
    child: Child,
    dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        let cfg = format!(
            "cpus = \"0\"\nrpc = \"{}\"\n\n[[controller]]\nsocket = \"{}\"\nnamespaces = [\"ram:16M\"]\n\n[[controller]]\nsocket = \"{}\"\nnamespaces = [\"ram:16M\"]\n\n[[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"ram:16M\"\n\n[[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"ram:16M\"\n",
            p("rpc.sock").display(),
            p("nvme-a.sock").display(),
            p("nvme-b.sock").display(),
            p("vhost-a.sock").display(),
            p("vhost-b.sock").display(),
        );
        std::fs::write(p("u.toml"), cfg).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--config"])
            .arg(p("u.toml"))
            .env("UDRIVE_MSG_DEADLINE_MS", "300")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
            .spawn()
            .unwrap();
        let s = Server { child, dir };
        let until = Instant::now() + Duration::from_secs(30);
        for n in [
            "rpc.sock",
            "nvme-a.sock",
            "nvme-b.sock",
            "vhost-a.sock",
            "vhost-b.sock",
        ] {
            while !s.path(n).exists() {
                assert!(Instant::now() < until, "udrive serve did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        s
    }

    fn path(&self, n: &str) -> PathBuf {
        self.dir.path().join(n)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Verified I/O by well-behaved clients until `stop`; errors are collected.
struct Bystanders {
    ops: Arc<AtomicU64>,
    errors: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Bystanders {
    fn start(nvme: PathBuf, vhost: PathBuf) -> Bystanders {
        let ops = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (o, e, s) = (ops.clone(), errors.clone(), stop.clone());
        let t1 = std::thread::spawn(move || {
            if let Err(m) = nvme_loop(&nvme, &o, &s) {
                e.lock().unwrap().push(m);
            }
        });
        let (o, e, s) = (ops.clone(), errors.clone(), stop.clone());
        let t2 = std::thread::spawn(move || {
            if let Err(m) = vhost_loop(&vhost, &o, &s) {
                e.lock().unwrap().push(m);
            }
        });
        Bystanders {
            ops,
            errors,
            stop,
            threads: vec![t1, t2],
        }
    }

    fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        let errors = self.errors.lock().unwrap().clone();
        (self.ops.load(Ordering::Relaxed), errors)
    }
}

fn nvme_loop(sock: &Path, ops: &AtomicU64, stop: &AtomicBool) -> Result<(), String> {
    let d = NvmeDriver::connect(sock, opts()).map_err(|e| format!("nvme connect: {e}"))?;
    let mut qp = d.create_qpair(16, false).map_err(|e| e.to_string())?;
    let buf = qp.alloc_buf(4096).map_err(|e| e.to_string())?;
    let mut rng = Rng::new(7);
    while !stop.load(Ordering::Relaxed) {
        let slba = rng.below(4000) * 8;
        let data = rng.bytes(4096);
        buf.write(0, &data).map_err(|e| e.to_string())?;
        for op in [IoOp::Write, IoOp::Read] {
            if op == IoOp::Read {
                buf.fill(0);
            }
            let c = qp
                .submit_io(op, 1, slba, 8, Some(&buf), DataMode::Prp)
                .and_then(|cid| qp.ring().map(|_| cid))
                .and_then(|cid| qp.wait(cid, Duration::from_secs(10)))
                .map_err(|e| format!("nvme bystander {op:?}: {e}"))?;
            if !c.status.is_ok() {
                return Err(format!("nvme bystander {op:?}: {}", c.status));
            }
        }
        let mut back = vec![0u8; 4096];
        buf.read(0, &mut back).map_err(|e| e.to_string())?;
        if back != data {
            return Err(format!("nvme bystander: data mismatch at LBA {slba}"));
        }
        ops.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

fn vhost_loop(sock: &Path, ops: &AtomicU64, stop: &AtomicBool) -> Result<(), String> {
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(|e| e.to_string())?;
    b.set_str("path", sock.to_str().unwrap_or_default())
        .map_err(|e| e.to_string())?;
    b.connect().map_err(|e| e.to_string())?;
    let mut s = b.start().map_err(|e| e.to_string())?;
    let region = b.alloc_mem_region(4096).map_err(|e| e.to_string())?;
    b.map_mem_region(&region).map_err(|e| e.to_string())?;
    let buf = region.addr as *mut u8;
    let q = &mut s.queues[0];
    let mut comps: Vec<_> = (0..1).map(|_| std::mem::MaybeUninit::uninit()).collect();
    let mut rng = Rng::new(11);
    let mut result = Ok(());
    while !stop.load(Ordering::Relaxed) && result.is_ok() {
        let off = rng.below(4000) * 4096;
        let byte = (rng.below(255) + 1) as u8;
        let mut io = |write: bool| -> Result<(), String> {
            if write {
                q.write(off, buf, 4096, 0, ReqFlags::empty());
            } else {
                q.read(off, buf, 4096, 0, ReqFlags::empty());
            }
            let mut t = Duration::from_secs(10);
            let n = q
                .do_io(&mut comps, 1, Some(&mut t), None)
                .map_err(|e| format!("vhost bystander: {e}"))?;
            // SAFETY: do_io initialised `n` completions.
            if n != 1 || unsafe { comps[0].assume_init_ref() }.ret != 0 {
                return Err("vhost bystander: request failed".into());
            }
            Ok(())
        };
        // SAFETY: the region is mapped read/write and no request is in flight.
        unsafe { std::ptr::write_bytes(buf, byte, 4096) };
        result = io(true).and_then(|_| {
            // SAFETY: as above.
            unsafe { std::ptr::write_bytes(buf, 0, 4096) };
            io(false)
        });
        // SAFETY: as above.
        let back = unsafe { std::slice::from_raw_parts(buf, 4096) };
        if result.is_ok() && !back.iter().all(|x| *x == byte) {
            result = Err(format!("vhost bystander: data mismatch at {off}"));
        }
        ops.fetch_add(1, Ordering::Relaxed);
    }
    drop(s);
    b.unmap_mem_region(&region);
    b.free_mem_region(&region);
    result
}

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
        if vfio_user::sock::send(s.as_fd(), &[&m], &fds).is_err() {
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

/// Maps a plain file, puts the admin queues in it, enables the controller, then
/// shrinks the file and rings the admin doorbell: the device must fault into zero
/// pages and drop this client, never the process.
fn vfio_shrink(sock: &Path) {
    let Ok(mut c) = VfioUserClient::connect(sock) else {
        return;
    };
    let file = memfd_like(0x10000);
    let base = 0x20_0000u64;
    if c.dma_map(file.as_fd(), 0, base, 0x10000, Prot::RW).is_err() {
        return;
    }
    let _ = c.region_write_u32(PCI_BAR0_REGION, AQA, (15 << 16) | 15);
    let asq = base.to_le_bytes();
    let acq = (base + 0x1000).to_le_bytes();
    let _ = c.region_write(PCI_BAR0_REGION, 0x28, &asq, false);
    let _ = c.region_write(PCI_BAR0_REGION, 0x30, &acq, false);
    let _ = c.region_write_u32(PCI_BAR0_REGION, CC, CC_EN | (6 << 16) | (4 << 20));
    std::thread::sleep(Duration::from_millis(20));
    let _ = file.set_len(0);
    // Admin SQ tail doorbell.
    let _ = c.region_write_u32(PCI_BAR0_REGION, 0x1000, 1);
    std::thread::sleep(Duration::from_millis(50));
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
        if vfio_user::sock::send(s.as_fd(), &[&m], &fds).is_err() {
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
    // Baseline once the bystanders are connected and running.
    std::thread::sleep(Duration::from_millis(500));
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
            4 => vfio_shrink(&na),
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
    let until = Instant::now() + Duration::from_secs(20);
    while server.fds() > fds0 + 2 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (fds1, rss1) = (server.fds(), server.rss_kib());
    let (ops, errors) = by.finish();
    assert!(server.alive(), "udrive died (seed {seed})");
    assert!(
        errors.is_empty(),
        "bystanders saw errors (seed {seed}): {errors:?}"
    );
    assert!(ops > 10, "bystanders made progress ({ops} round trips)");
    assert!(
        fds1 <= fds0 + 2,
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
