//! `udrive serve --supervise`: the server is killed with SIGKILL under a client's
//! verified writes; the client stays connected, finds the controller in fatal
//! status, resets it, retries what did not complete, and every byte is there.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{opts, wait_until, T};
use initiator::regs::{CSTS, CSTS_CFS, CSTS_RDY};
use initiator::NvmeDriver;
use test_support::gens::{bufs, submit_gen, verify, write_gen, BLOCK, QD};

const BLOCKS: u64 = 256;

struct Supervised {
    child: Child,
    dir: tempfile::TempDir,
}

impl Supervised {
    /// `args(dir)`: the serve arguments, sockets in the test's temp dir.
    fn start(args: impl FnOnce(&Path) -> Vec<String>) -> Supervised {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let log = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_udrive"))
            .arg("serve")
            .arg("--supervise")
            .args(args(dir.path()))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Supervised { child, dir }
    }

    fn path(&self, n: &str) -> PathBuf {
        self.dir.path().join(n)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("stderr.log")).unwrap_or_default()
    }

    /// The server process the supervisor runs now.
    fn server_pid(&self) -> Option<u32> {
        let me = self.child.id();
        let kids = std::fs::read_to_string(format!("/proc/{me}/task/{me}/children")).ok()?;
        kids.split_whitespace().next()?.parse().ok()
    }

    fn kill_server(&self) -> u32 {
        let pid = self.server_pid().expect("the supervisor runs a server");
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        pid
    }

    fn stop(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let mut status = None;
        wait_until("the supervisor to stop on SIGTERM", 2 * T, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status.expect("exited")
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        if let Some(pid) = self.server_pid() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn an_nvme_client_survives_sigkill_of_the_server() {
    let (_disk_dir, disk) = common::disk_file("disk.img", BLOCKS * BLOCK as u64);
    let s = Supervised::start(|dir| {
        vec![
            "--vfio-user".into(),
            dir.join("nvme.sock").display().to_string(),
            "--ns".into(),
            format!("file:{}", disk.display()),
            "--cpus".into(),
            "0".into(),
        ]
    });
    let sock = s.path("nvme.sock");
    wait_until("the device socket", Duration::from_secs(30), || {
        sock.exists()
    });
    let d = NvmeDriver::connect(&sock, opts()).expect("attach");
    let b = bufs(&d);
    let mut qp = d.create_qpair(64, false).unwrap();
    let all: Vec<u64> = (0..BLOCKS).collect();
    assert_eq!(write_gen(&mut qp, &b, 1, &all).len(), all.len());
    // Generation of each block as the client knows it.
    let mut want = vec![1u64; BLOCKS as usize];
    for round in 0..2u64 {
        let gen = round + 2;
        let first = s.server_pid().unwrap();
        // A burst in flight, then the server dies under it.
        let lbas: Vec<u64> = (0..QD as u64).map(|i| i * 7 % BLOCKS).collect();
        submit_gen(&mut qp, &b, gen, &lbas);
        s.kill_server();
        // The new server answers for the controller: enabled, fatal status.
        let csts = d.read_reg32(CSTS).expect("CSTS after the crash");
        assert_eq!(
            csts & (CSTS_CFS | CSTS_RDY),
            CSTS_CFS | CSTS_RDY,
            "round {round}: CSTS {csts:#x}"
        );
        assert_ne!(s.server_pid(), Some(first), "a new server process");
        // What a driver does: reset, new queues, retry what was in flight.
        d.reset_controller().expect("reset after the crash");
        qp = d.create_qpair(64, false).unwrap();
        assert_eq!(write_gen(&mut qp, &b, gen, &lbas).len(), lbas.len());
        for lba in &lbas {
            want[*lba as usize] = gen;
        }
        verify(&mut qp, &b, &all, &want).unwrap();
    }
    let log = s.log();
    assert_eq!(
        log.matches("restarting it").count(),
        2,
        "two restarts in the log:\n{log}"
    );
    let st = s.stop();
    assert!(st.success(), "supervisor exit on SIGTERM: {st}");
    assert!(!sock.exists(), "socket removed at shutdown");
}

#[test]
fn a_server_that_cannot_start_is_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nvme.sock");
    let missing = dir.path().join("no-such-disk.img");
    let mut c = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(["serve", "--supervise", "--vfio-user"])
        .arg(&sock)
        .arg("--ns")
        .arg(format!("file:{}", missing.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut status = None;
    wait_until("the supervisor to give up", Duration::from_secs(30), || {
        status = c.try_wait().unwrap();
        status.is_some()
    });
    let status = status.expect("exited");
    let mut err = String::new();
    use std::io::Read;
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!status.success());
    assert!(
        err.contains("exited before it was ready") && err.contains("no-such-disk.img"),
        "says why: {err}"
    );
}

#[test]
fn the_server_child_refuses_a_terminal_as_its_channel() {
    let out = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(["serve", "--supervised", "--ns", "null:1M", "--vfio-user"])
        .arg(std::env::temp_dir().join(format!("udrive-sv-{}.sock", std::process::id())))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--supervise"), "{err}");
}
