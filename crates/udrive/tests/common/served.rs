//! A `udrive serve --config` process run detached (its own process group): the
//! processes that take it over with `udrive upgrade` are not our children. For the
//! handover tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const UDRIVE: &str = env!("CARGO_BIN_EXE_udrive");

pub struct Service {
    dir: tempfile::TempDir,
    /// The first server (reaped at the end; later ones are not our children).
    first: Child,
}

impl Service {
    /// `config(dir)`: the TOML, with sockets and files in `dir` (which must have
    /// `rpc = "<dir>/rpc.sock"`). Returns once the control socket answers.
    pub fn start(config: impl FnOnce(&Path) -> String) -> Service {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let toml = dir.path().join("u.toml");
        std::fs::write(&toml, config(dir.path())).unwrap();
        let log = std::fs::File::create(dir.path().join("serve.log")).unwrap();
        let mut cmd = Command::new(UDRIVE);
        cmd.arg("serve")
            .arg("--config")
            .arg(&toml)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let first = cmd.spawn().unwrap();
        let s = Service { dir, first };
        super::wait_until("control socket", Duration::from_secs(60), || {
            s.rpc("get_version", json!({})).is_ok()
        });
        s
    }

    pub fn path(&self, n: &str) -> PathBuf {
        self.dir.path().join(n)
    }

    pub fn rpc(&self, method: &str, params: Value) -> Result<Value, String> {
        let out = Command::new(UDRIVE)
            .args(["rpc", "--rpc"])
            .arg(self.path("rpc.sock"))
            .arg(method)
            .arg(params.to_string())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
    }

    /// The pid that serves the control socket now.
    pub fn pid(&self) -> u64 {
        self.rpc("get_version", json!({})).unwrap()["pid"]
            .as_u64()
            .unwrap()
    }

    /// `udrive upgrade`; the new server's log appends to `upgrade.log`.
    pub fn upgrade(&self) -> std::process::Output {
        Command::new(UDRIVE)
            .args(["upgrade", "--rpc"])
            .arg(self.path("rpc.sock"))
            .arg("--log")
            .arg(self.path("upgrade.log"))
            .env("RUST_LOG", "info")
            .output()
            .unwrap()
    }

    /// `udrive upgrade`, which must succeed (else the test fails with its stderr
    /// and every server's log; `what` says which handover). A handover the running
    /// server refuses because a device could not pause in time (requests still in
    /// flight at its deadline, which a loaded machine can reach) leaves that server
    /// serving, as designed: it is tried again, a few times.
    #[track_caller]
    pub fn upgrade_ok(&self, what: &str) {
        for attempt in 1.. {
            let seen = self.log().len();
            let out = self.upgrade();
            if out.status.success() {
                return;
            }
            let refused = self.log()[seen..].contains("cannot pause");
            assert!(
                refused && attempt < 5,
                "{what} (attempt {attempt}): {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.log()
            );
        }
    }

    /// Every server's log so far.
    pub fn log(&self) -> String {
        let a = std::fs::read_to_string(self.path("serve.log")).unwrap_or_default();
        let b = std::fs::read_to_string(self.path("upgrade.log")).unwrap_or_default();
        format!("{a}{b}")
    }

    /// Stops the server that runs now (SIGTERM) and waits for it to go.
    pub fn stop(&self) {
        if let Ok(v) = self.rpc("get_version", json!({})) {
            if let Some(pid) = v["pid"].as_u64() {
                let _ = Command::new("kill").arg(pid.to_string()).status();
                let until = Instant::now() + Duration::from_secs(20);
                while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
        let _ = self.first.kill();
        let _ = self.first.wait();
    }
}
