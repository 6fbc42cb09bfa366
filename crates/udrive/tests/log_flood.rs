//! Log flooding: what a guest or client can make udrive log is rate-limited per
//! device, and the next line that gets through says how many were suppressed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use initiator::regs::{CC, CC_EN};
use initiator::VfioUserClient;
use vfio_user::proto::PCI_BAR0_REGION;

struct Serve {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    dir: tempfile::TempDir,
}

impl Serve {
    fn start() -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .args(["serve", "--cpus", "0", "--ns", "ram:16M", "--vfio-user"])
            .arg(dir.path().join("n.sock"))
            .args(["--vhost-user-blk"])
            .arg(dir.path().join("v.sock"))
            .args(["--disk", "ram:16M"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (err, l2) = (child.stderr.take().unwrap(), lines.clone());
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                l2.lock().unwrap().push(l);
            }
        });
        let s = Serve { child, lines, dir };
        let until = Instant::now() + Duration::from_secs(20);
        while !(s.path("n.sock").exists() && s.path("v.sock").exists()) {
            assert!(Instant::now() < until, "udrive serve did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    fn count(&self, what: &str) -> usize {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(what))
            .count()
    }

    fn suppressed(&self, what: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(what) && l.contains("suppressed="))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bad_enables(sock: &Path, n: usize) {
    let mut c = VfioUserClient::connect(sock).unwrap();
    for _ in 0..n {
        // Enable with no admin queue configured (AQA = 0): refused and logged.
        c.region_write_u32(PCI_BAR0_REGION, CC, CC_EN).unwrap();
        c.region_write_u32(PCI_BAR0_REGION, CC, 0).unwrap();
    }
}

#[test]
fn guest_and_client_triggered_lines_are_rate_limited() {
    let s = Serve::start();
    let t = Instant::now();
    bad_enables(&s.path("n.sock"), 2000);
    for _ in 0..2000 {
        drop(std::os::unix::net::UnixStream::connect(s.path("v.sock")).unwrap());
    }
    let secs = t.elapsed().as_secs() + 1;
    // The next window's first line reports what the flood's windows dropped.
    std::thread::sleep(Duration::from_millis(1100));
    bad_enables(&s.path("n.sock"), 1);
    drop(std::os::unix::net::UnixStream::connect(s.path("v.sock")).unwrap());
    std::thread::sleep(Duration::from_millis(1100));
    drop(std::os::unix::net::UnixStream::connect(s.path("v.sock")).unwrap());
    std::thread::sleep(Duration::from_millis(300));

    let budget = (secs as usize + 3) * trace::LINES_PER_WINDOW as usize;
    let enables = s.count("invalid controller enable");
    let vhost = s.count("vhost-user front end");
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
        s.suppressed("invalid controller enable"),
        "NVMe count reported"
    );
    assert!(s.suppressed("vhost-user front end"), "vhost count reported");
}
