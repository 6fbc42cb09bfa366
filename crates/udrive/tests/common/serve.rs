//! A `udrive serve` child process serving two NVMe controllers and two
//! vhost-user-blk devices (`nvme-a`/`vhost-a` for attackers, `nvme-b`/`vhost-b` for
//! bystanders) and a control socket, and the bystanders' well-behaved clients doing
//! verified I/O. The message deadline is shortened to 300 ms and the log goes to a
//! file the tests read.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_mem::Prot;
use initiator::regs::{AQA, CC, CC_EN, CSTS, CSTS_RDY};
use initiator::{NvmeDriver, VfioUserClient};
use test_support::blkio::BlkioSession;
use vfio_user::proto::PCI_BAR0_REGION;

use super::{opts, verified_io, Rng, Verifier, T};
use test_support::poll_until;

pub const SOCKETS: [&str; 5] = [
    "rpc.sock",
    "nvme-a.sock",
    "nvme-b.sock",
    "vhost-a.sock",
    "vhost-b.sock",
];

pub struct Server {
    child: Child,
    dir: tempfile::TempDir,
}

impl Server {
    pub fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).display().to_string();
        let mut cfg = format!("cpus = \"0\"\nrpc = \"{}\"\n", p("rpc.sock"));
        // The attacker's controller offers its doorbell page (busy mode) so the
        // mapped memfd can be attacked; the bystander's takes doorbells by message
        // (adaptive, the default) and must keep working through every attack.
        for (n, poll) in [("nvme-a.sock", "busy"), ("nvme-b.sock", "adaptive")] {
            cfg += &format!(
                "\n[[controller]]\nsocket = \"{}\"\nnamespaces = [\"ram:16M\"]\npoll = \"{poll}\"\n",
                p(n)
            );
        }
        for n in ["vhost-a.sock", "vhost-b.sock"] {
            cfg += &format!(
                "\n[[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"ram:16M\"\n",
                p(n)
            );
        }
        std::fs::write(p("u.toml"), cfg).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--config", &p("u.toml")])
            .env("UDRIVE_MSG_DEADLINE_MS", "300")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(p("stderr.log")).unwrap())
            .spawn()
            .unwrap();
        let s = Server { child, dir };
        let until = Instant::now() + Duration::from_secs(30);
        for n in SOCKETS {
            while !s.path(n).exists() {
                assert!(Instant::now() < until, "udrive serve did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        s
    }

    pub fn path(&self, n: &str) -> PathBuf {
        self.dir.path().join(n)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// What each open descriptor is (for messages when a count is off).
    pub fn fd_targets(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|t| t.display().to_string())
            .collect();
        v.sort();
        v
    }

    /// Waits (up to 60 s: a loaded machine works through thousands of queued
    /// connections slowly) until the fd count has stayed at most `base` for half a
    /// second (an accept still in progress opens one briefly); the count it settled
    /// at, or the last one seen if it never did.
    pub fn settle_fds(&self, base: usize) -> usize {
        let until = Instant::now() + Duration::from_secs(60);
        let mut quiet_since = None;
        let mut last = self.fds();
        while Instant::now() < until {
            last = self.fds();
            if last > base {
                quiet_since = None;
            } else if quiet_since.get_or_insert_with(Instant::now).elapsed()
                > Duration::from_millis(500)
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        last
    }

    /// What each of `targets` is, for a leak report: a socket's line of `ss -xp`
    /// (path, peer), and the server's threads (whoever still holds it).
    pub fn describe_fds(&self, targets: &[&String]) -> String {
        let ss = Command::new("ss")
            .args(["-xpan"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let mut out = String::new();
        for t in targets {
            out += &format!("{t}\n");
            if let Some(ino) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                for l in ss
                    .lines()
                    .filter(|l| l.split_whitespace().any(|w| w == ino))
                {
                    out += &format!("  ss: {l}\n");
                }
            }
        }
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect::<Vec<_>>();
        out += &format!("threads: {}", tasks.join(" "));
        out
    }

    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.path("stderr.log")).unwrap_or_default()
    }

    /// `udrive rpc METHOD PARAMS` against this server; its stdout, or stderr on failure.
    pub fn rpc(&self, method: &str, params: &str) -> Result<String, String> {
        let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["rpc", "--rpc"])
            .arg(self.path("rpc.sock"))
            .args([method, params])
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Verified I/O by well-behaved clients until `finish`; errors are collected. Each
/// client stays within the first 1 MiB of its disk, so the server's RSS settles.
pub struct Bystanders {
    /// Round trips of the NVMe and the vhost-user-blk client.
    ops: [Arc<AtomicU64>; 2],
    errors: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Bystanders {
    pub fn start(nvme: PathBuf, vhost: PathBuf) -> Bystanders {
        let ops = [Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0))];
        let errors = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let spawn = |f: fn(&Path, &AtomicU64, &AtomicBool) -> Result<(), String>,
                     sock: PathBuf,
                     ops: &Arc<AtomicU64>| {
            let (o, e, s) = (ops.clone(), errors.clone(), stop.clone());
            std::thread::spawn(move || {
                if let Err(m) = f(&sock, &o, &s) {
                    e.lock().unwrap().push(m);
                }
            })
        };
        let threads = vec![
            spawn(nvme_loop, nvme, &ops[0]),
            spawn(vhost_loop, vhost, &ops[1]),
        ];
        Bystanders {
            ops,
            errors,
            stop,
            threads,
        }
    }

    /// Round trips so far of the slower of the two clients (so a count that grows
    /// means both are connected and making progress).
    pub fn ops(&self) -> u64 {
        self.ops
            .iter()
            .map(|o| o.load(Ordering::Relaxed))
            .min()
            .unwrap_or(0)
    }

    /// Stops the clients: the round trips they made (the slower one's) and the
    /// errors they saw.
    pub fn finish(mut self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in std::mem::take(&mut self.threads) {
            let _ = t.join();
        }
        let errors = self.errors.lock().unwrap().clone();
        (self.ops(), errors)
    }
}

/// Verified I/O of up to 4 KiB within the disk's first 1 MiB until `stop`.
pub fn nvme_loop(sock: &Path, ops: &AtomicU64, stop: &AtomicBool) -> Result<(), String> {
    let d = NvmeDriver::connect(sock, opts()).map_err(|e| format!("nvme connect: {e}"))?;
    let v = Verifier {
        seed: 7,
        max_nlb: 8,
        lbas: 2048,
        pause: Duration::ZERO,
    };
    verified_io(&d, v, stop, ops).map_err(|e| format!("nvme bystander: {e}"))
}

/// As `nvme_loop`, through libblkio.
pub fn vhost_loop(sock: &Path, ops: &AtomicU64, stop: &AtomicBool) -> Result<(), String> {
    let mut c = BlkioSession::open(sock)?;
    let mut rng = Rng::new(11);
    while !stop.load(Ordering::Relaxed) {
        let off = rng.below(256) * 4096;
        let byte = (rng.below(255) + 1) as u8;
        c.round(off, byte)
            .map_err(|e| format!("vhost bystander: {e}"))?;
        ops.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Maps a plain file, puts the admin queues in it, enables the controller, then
/// shrinks the file and rings the admin doorbell: the device must fault into zero
/// pages and drop this client, never the process. Returns the client (to check it
/// was dropped).
pub fn vfio_shrink(sock: &Path) -> Option<VfioUserClient> {
    let Ok(mut c) = VfioUserClient::connect(sock) else {
        return None;
    };
    let file = tempfile::tempfile().ok()?;
    file.set_len(0x10000).ok()?;
    let base = 0x20_0000u64;
    if c.dma_map(file.as_fd(), 0, base, 0x10000, Prot::RW).is_err() {
        return None;
    }
    let _ = c.region_write_u32(PCI_BAR0_REGION, AQA, (15 << 16) | 15);
    let asq = base.to_le_bytes();
    let acq = (base + 0x1000).to_le_bytes();
    let _ = c.region_write(PCI_BAR0_REGION, 0x28, &asq, false);
    let _ = c.region_write(PCI_BAR0_REGION, 0x30, &acq, false);
    let _ = c.region_write_u32(PCI_BAR0_REGION, CC, CC_EN | (6 << 16) | (4 << 20));
    // Ready, so the doorbell below makes it read the admin queue.
    let ready = poll_until(T, || {
        let mut csts = [0u8; 4];
        c.region_read(PCI_BAR0_REGION, CSTS, &mut csts)
            .is_ok_and(|()| u32::from_le_bytes(csts) & CSTS_RDY != 0)
    });
    if !ready {
        return None;
    }
    let _ = file.set_len(0);
    // Admin SQ tail doorbell.
    let _ = c.region_write_u32(PCI_BAR0_REGION, 0x1000, 1);
    // Time for the fault before a caller that drops the client at once (the
    // protocol fuzzer); callers that check the outcome wait for it.
    std::thread::sleep(Duration::from_millis(50));
    Some(c)
}

/// Sends `first`, then one byte of `rest` every 100 ms; returns when the peer
/// closed the connection (true) or after 5 s (false).
pub fn trickle(s: &mut UnixStream, first: &[u8], rest: &[u8]) -> bool {
    s.write_all(first).unwrap();
    let start = Instant::now();
    for b in rest {
        std::thread::sleep(Duration::from_millis(100));
        if s.write_all(&[*b]).is_err() {
            return true;
        }
        let _ = s.set_read_timeout(Some(Duration::from_millis(1)));
        let mut x = [0u8; 64];
        match s.read(&mut x) {
            Ok(0) => return true,
            Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => return true,
            _ => {}
        }
        if start.elapsed() > Duration::from_secs(5) {
            return false;
        }
    }
    false
}
