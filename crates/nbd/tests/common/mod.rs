//! Shared by the integration tests: an in-memory export, a server thread on a
//! Unix socket, and qemu tools.
#![allow(dead_code)] // Each test binary uses a different part.

use std::io;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::{serve, Export};

/// An export over a shared Vec, so the test can look at the bytes.
pub struct MemExport {
    pub data: Arc<Mutex<Vec<u8>>>,
    pub read_only: bool,
    /// Flushes seen, to check that FLUSH and FUA reach the export.
    pub flushes: Arc<Mutex<u64>>,
}

impl MemExport {
    fn range(&self, offset: u64, len: u64) -> io::Result<std::ops::Range<usize>> {
        let start =
            usize::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let end = usize::try_from(offset + len)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        Ok(start..end)
    }
}

impl Export for MemExport {
    fn size(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let r = self.range(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.data.lock().unwrap()[r]);
        Ok(())
    }
    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let r = self.range(offset, data.len() as u64)?;
        self.data.lock().unwrap()[r].copy_from_slice(data);
        if fua {
            *self.flushes.lock().unwrap() += 1;
        }
        Ok(())
    }
    fn write_zeroes(&mut self, offset: u64, len: u64, _may_trim: bool) -> io::Result<()> {
        let r = self.range(offset, len)?;
        self.data.lock().unwrap()[r].fill(0);
        Ok(())
    }
    fn trim(&mut self, offset: u64, len: u64) -> io::Result<()> {
        // Trimmed bytes read back as 0xdd, so a test can tell a trim happened.
        let r = self.range(offset, len)?;
        self.data.lock().unwrap()[r].fill(0xdd);
        Ok(())
    }
    fn flush(&mut self) -> io::Result<()> {
        *self.flushes.lock().unwrap() += 1;
        Ok(())
    }
}

/// A server on a Unix socket with one export, `name`, over `data`; each
/// connection is served on its own thread. Results of `serve` are collected.
pub struct TestServer {
    pub socket: PathBuf,
    pub data: Arc<Mutex<Vec<u8>>>,
    pub flushes: Arc<Mutex<u64>>,
    pub results: Arc<Mutex<Vec<Result<(), String>>>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub fn start(name: &str, size: usize, read_only: bool) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbd.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let data = Arc::new(Mutex::new(vec![0u8; size]));
        let flushes = Arc::new(Mutex::new(0));
        let results = Arc::new(Mutex::new(Vec::new()));
        let (d, f, res, name) = (
            data.clone(),
            flushes.clone(),
            results.clone(),
            name.to_string(),
        );
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let (d, f, res, name) = (d.clone(), f.clone(), res.clone(), name.clone());
                std::thread::spawn(move || {
                    let names = || vec![name.clone()];
                    let mut open = |n: &str| -> Result<Box<dyn Export>, String> {
                        if n != name {
                            return Err(format!("no export {n:?}; try {name:?}"));
                        }
                        Ok(Box::new(MemExport {
                            data: d.clone(),
                            read_only,
                            flushes: f.clone(),
                        }))
                    };
                    let r = serve(conn, &names, &mut open);
                    res.lock().unwrap().push(r.map_err(|e| e.to_string()));
                });
            }
        });
        TestServer {
            socket,
            data,
            flushes,
            results,
            _dir: dir,
        }
    }

    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }
}

/// Fails with the install hint when a qemu tool is missing.
pub fn require(tool: &str) {
    let ok = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{tool} not found: these tests need QEMU's tools; run `apt-get install qemu-utils`"
    );
}

/// Runs a command, panicking with its output when it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `qemu-nbd` serving a raw file on a Unix socket; killed and reaped on drop.
pub struct QemuNbd {
    child: Child,
    pub socket: PathBuf,
}

impl QemuNbd {
    pub fn start(file: &Path, socket: &Path, name: &str, extra: &[&str]) -> QemuNbd {
        require("qemu-nbd");
        let child = Command::new("qemu-nbd")
            .args(["-f", "raw", "-k"])
            .arg(socket)
            .args(["-x", name, "--persistent"])
            .args(extra)
            .arg(file)
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn qemu-nbd");
        let mut q = QemuNbd {
            child,
            socket: socket.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if let Some(status) = q.child.try_wait().unwrap() {
                panic!("qemu-nbd exited early: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "qemu-nbd did not create {socket:?} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        q
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A recognisable pattern: byte i of the pattern seeded `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}
