//! A `udrive serve --rpc` child process (one `ram:64M` NVMe controller on reactor
//! 0) and what the control-socket tests do with it: JSON-RPC calls over the
//! socket, the `udrive` CLI, and I/O through the initiator and libblkio.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use initiator::{DataMode, DriverOpts, IoOp, NvmeDriver};
use serde_json::{json, Value};
use test_support::driver::write_read;
use test_support::T;

/// `udrive serve` in a temp dir; SIGTERM and wait on drop.
pub struct Serve {
    child: Child,
    pub dir: tempfile::TempDir,
    pub rpc: PathBuf,
    pub nvme: PathBuf,
    /// What it printed on stdout up to "Stop with".
    pub banner: Vec<String>,
}

impl Serve {
    pub fn start(extra: &[&str]) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let rpc = dir.path().join("rpc.sock");
        let nvme = dir.path().join("a.sock");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_udrive"));
        cmd.args(["serve", "--cpus", "0", "--ns", "ram:64M", "--vfio-user"])
            .arg(&nvme)
            .arg("--rpc")
            .arg(&rpc)
            .args(extra);
        Serve::spawn(cmd, dir, rpc, nvme)
    }

    /// Runs `cmd` (a `udrive serve` whose control socket is `rpc` and first
    /// controller `nvme`, both in `dir`) until it printed how to attach.
    pub fn spawn(mut cmd: Command, dir: tempfile::TempDir, rpc: PathBuf, nvme: PathBuf) -> Serve {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("run udrive serve");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        let mut banner = Vec::new();
        loop {
            let l = rx.recv_timeout(T).expect("udrive serve did not start");
            let done = l.starts_with("Stop with");
            banner.push(l);
            if done {
                break;
            }
        }
        Serve {
            child,
            dir,
            rpc,
            nvme,
            banner,
        }
    }

    /// The server's pid.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn call(&self, method: &str, params: Value) -> Result<Value, (i64, String)> {
        call(&self.rpc, method, params)
    }

    pub fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params)
            .unwrap_or_else(|e| panic!("{method} failed: {e:?}"))
    }

    /// Calls that must fail with `code` and a message containing `want`.
    #[track_caller]
    pub fn err(&self, method: &str, params: Value, code: i64, want: &str) {
        match self.call(method, params) {
            Ok(v) => panic!("{method} succeeded: {v}"),
            Err((c, m)) => {
                assert_eq!(c, code, "{method}: {m}");
                assert!(m.contains(want), "{method}: `{want}` not in `{m}`");
            }
        }
    }
}

impl Serve {
    /// SIGTERM, then wait (bounded); `None` if it had to be killed.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st);
        }
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < T {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.terminate();
    }
}

pub fn connect(sock: &Path) -> UnixStream {
    let s = UnixStream::connect(sock).expect("connect control socket");
    s.set_read_timeout(Some(T)).unwrap();
    s
}

/// Reads one newline-terminated reply.
pub fn read_reply(s: &mut UnixStream) -> Option<Value> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return None,
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) => line.push(b[0]),
        }
    }
    Some(serde_json::from_slice(&line).expect("reply is JSON"))
}

pub fn call(sock: &Path, method: &str, params: Value) -> Result<Value, (i64, String)> {
    call_within(sock, method, params, T)
}

/// [`call`] of a method that may take long on a busy machine (a LUKS keyslot's
/// key derivation), waiting up to `limit` for the reply.
pub fn call_within(
    sock: &Path,
    method: &str,
    params: Value,
    limit: Duration,
) -> Result<Value, (i64, String)> {
    let mut s = connect(sock);
    s.set_read_timeout(Some(limit)).unwrap();
    let req = json!({"jsonrpc": "2.0", "method": method, "params": params, "id": 7});
    s.write_all(format!("{req}\n").as_bytes()).unwrap();
    let r = read_reply(&mut s).expect("a reply");
    // A refusal at accept time (connection limit) cannot know the request's id.
    if r["id"].is_null()
        && r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("too many"))
    {
        return Err((
            r["error"]["code"].as_i64().unwrap_or(0),
            r["error"]["message"].to_string(),
        ));
    }
    assert_eq!(r["id"], 7);
    match r.get("error") {
        Some(e) => Err((
            e["code"].as_i64().unwrap(),
            e["message"].as_str().unwrap().to_string(),
        )),
        None => Ok(r["result"].clone()),
    }
}

/// `get_stats`: the sum of `what` (ops or bytes) of `op` over every queue and
/// namespace of device `dev`.
pub fn ns_sum(st: &Value, dev: usize, what: &str, op: &str) -> u64 {
    st["devices"][dev]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|q| q["namespaces"].as_array().unwrap())
        .map(|n| n[what][op].as_u64().unwrap())
        .sum()
}

pub fn error_code(v: &Value) -> i64 {
    v["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("no error in {v}"))
}

/// Driver options for the served controller: a small pool and 4 I/O queues.
pub fn serve_opts() -> DriverOpts {
    DriverOpts {
        pool_bytes: 16 << 20,
        io_queues: 4,
        admin_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// Writes a pattern of `seed` at LBA `seed * 8` of namespace 1 on a new queue pair
/// and reads it back; panics on any error.
pub fn round_trip(d: &NvmeDriver, seed: u8) {
    let mut qp = d.create_qpair(16, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    write_read(
        &mut qp,
        &buf,
        u64::from(seed) * 8,
        &[seed; 4096],
        DataMode::Prp,
    );
    d.delete_qpair(qp).unwrap();
}

/// `n` writes then `n` reads of 4 KiB on namespace 1, one at a time.
pub fn sync_io(d: &NvmeDriver, n: u64) {
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    for op in [IoOp::Write, IoOp::Read] {
        for i in 0..n {
            let c = qp
                .submit_io(op, 1, i * 8, 8, Some(&buf), DataMode::Prp)
                .unwrap();
            qp.ring().unwrap();
            assert!(qp.wait(c, T).unwrap().status.is_ok());
        }
    }
    d.delete_qpair(qp).unwrap();
}

/// Verified random I/O through libblkio on a vhost-user-blk socket.
pub fn blkio_io(sock: &Path, jobs: u32) -> initiator::workload::Report {
    let t = udrive::blkio_target::BlkioTarget::connect(sock, jobs, 4, 4096).expect("libblkio");
    let cfg = initiator::workload::WorkloadConfig {
        rw: initiator::workload::Rw::RandRw { read_pct: 50 },
        qd: 4,
        jobs,
        verify: true,
        time: Duration::from_millis(600),
        ..Default::default()
    };
    let r = initiator::workload::run(&t, &cfg).expect("workload");
    assert!(r.ios > 0);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
    r
}

/// The server notices a client's disconnect on its own thread.
pub fn wait_disconnected(s: &Serve, v: &Path) {
    let until = Instant::now() + T;
    while s.ok("get_devices", json!({"socket": v}))[0]["connected"] != false {
        assert!(Instant::now() < until, "disconnect not seen");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs the `udrive` binary with `args`.
pub fn udrive(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(args)
        .output()
        .expect("run udrive")
}

/// Runs the `udrive` binary with `args`; it must succeed (else its output is shown).
pub fn udrive_ok(args: &[&str]) -> std::process::Output {
    let out = udrive(args);
    assert!(
        out.status.success(),
        "udrive {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Block jobs as `get_jobs` shows them.
impl Serve {
    /// Job `id` now.
    pub fn job(&self, id: &Value) -> Value {
        let jobs = self.ok("get_jobs", json!({}));
        let job = jobs.as_array().unwrap().iter().find(|j| j["id"] == *id);
        job.cloned()
            .unwrap_or_else(|| panic!("job {id} not in {jobs}"))
    }

    /// Waits until job `id` is in state `want`; the job then.
    pub fn wait_job(&self, id: &Value, want: &str) -> Value {
        let mut last = Value::Null;
        test_support::wait_until(&format!("job {id} {want}"), T, || {
            last = self.job(id);
            last["state"] == want
        });
        last
    }
}
