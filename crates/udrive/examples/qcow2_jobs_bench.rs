//! Block-job throughput: udrive's jobs against qemu-storage-daemon's, on the same
//! images in tmpfs. For every repetition the images are made afresh: a qcow2 base
//! (64 KiB clusters) holding BASE MiB of pseudo-random data, fully allocated, and a
//! qcow2 overlay over it with its first TOP MiB rewritten (a golden image and a
//! VM's overlay). Each server exports the overlay over
//! vhost-user-blk with no client attached, the whole process pinned to CPU 0, and
//! runs one job unthrottled to its end:
//!
//! - `stream`: the base's data into the overlay (`block_stream` / `block-stream`);
//!   BASE − TOP MiB copied.
//! - `commit`: the overlay into the base, the active layer, then the disk goes on on
//!   the base (`block_commit` / `block-commit` and `job-complete` once ready); TOP MiB.
//! - `mirror`: the whole disk to a new qcow2 image, then the disk goes on there
//!   (`blockdev_mirror` with `pivot` / `drive-mirror sync=full` and `job-complete`);
//!   BASE MiB.
//! - `mirror-nbd`: the whole disk into an NBD export, as for a migration without
//!   shared storage: `qemu-nbd` serving a new qcow2 image on a unix socket (on CPU
//!   1), the same for both; until ready, then ended without a pivot
//!   (`blockdev_mirror` with `target` and `job_complete` / `blockdev-mirror` onto
//!   an `nbd` node and `block-job-cancel` once ready); BASE MiB.
//!
//! Which server goes first alternates per repetition. Prints per job the MB/s of
//! each (median, min–max) and udrive ÷ qsd per repetition.
//!
//!   cargo run --release -p udrive --example qcow2_jobs_bench -- UDRIVE_BIN [REPS=5] [BASE=1024] [TOP=512]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use udrive::rpc_client;

const LIMIT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, PartialEq)]
enum Job {
    Stream,
    Commit,
    Mirror,
    MirrorNbd,
}

impl Job {
    const ALL: [Job; 4] = [Job::Stream, Job::Commit, Job::Mirror, Job::MirrorNbd];
    fn name(self) -> &'static str {
        match self {
            Job::Stream => "stream",
            Job::Commit => "commit",
            Job::Mirror => "mirror",
            Job::MirrorNbd => "mirror-nbd",
        }
    }
    /// MiB the job copies.
    fn mib(self, base: u64, top: u64) -> u64 {
        match self {
            Job::Stream => base - top,
            Job::Commit => top,
            Job::Mirror | Job::MirrorNbd => base,
        }
    }
}

struct Images {
    dir: PathBuf,
    pristine: PathBuf,
    base: PathBuf,
    top: PathBuf,
    mirror: PathBuf,
    top_mib: u64,
    base_mib: u64,
}

fn run(c: &mut Command, what: &str) -> Result<()> {
    let out = c
        .stdin(Stdio::null())
        .output()
        .with_context(|| what.to_string())?;
    if !out.status.success() {
        bail!("{what}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

impl Images {
    fn new(dir: &Path, base_mib: u64, top_mib: u64) -> Result<Images> {
        let pristine = dir.join("pristine.raw");
        let mut f = std::fs::File::create(&pristine)?;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut chunk = vec![0u8; 1 << 20];
        for _ in 0..base_mib {
            for w in chunk.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes());
            }
            f.write_all(&chunk)?;
        }
        Ok(Images {
            dir: dir.to_owned(),
            pristine,
            base: dir.join("base.qcow2"),
            top: dir.join("top.qcow2"),
            mirror: dir.join("mirror.qcow2"),
            top_mib,
            base_mib,
        })
    }

    /// The base, the overlay with TOP MiB of its own, no mirror target.
    fn fresh(&self) -> Result<()> {
        let _ = std::fs::remove_file(&self.mirror);
        let _ = std::fs::remove_file(&self.top);
        let _ = std::fs::remove_file(&self.base);
        run(
            Command::new("qemu-img")
                .args(["convert", "-f", "raw", "-O", "qcow2"])
                .args(["-o", "cluster_size=65536"])
                .arg(&self.pristine)
                .arg(&self.base),
            "qemu-img convert",
        )?;
        run(
            Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=65536"])
                .args(["-b", "base.qcow2", "-F", "qcow2"])
                .arg(&self.top),
            "qemu-img create",
        )?;
        run(
            Command::new("qemu-io")
                .args(["-f", "qcow2", "-c"])
                .arg(format!("write -P 0x5a 0 {}M", self.top_mib))
                .arg(&self.top),
            "qemu-io write",
        )
    }
}

fn wait_socket(child: &mut Child, sock: &Path) -> Result<()> {
    let t = Instant::now();
    while !sock.exists() {
        if let Some(st) = child.try_wait()? {
            bail!("the server stopped: {st}");
        }
        if t.elapsed() > Duration::from_secs(20) {
            bail!("{} did not appear", sock.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

struct Stop(Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `qemu-nbd` on CPU 1 serving a new qcow2 image of BASE MiB as export `x`
/// on a unix socket (the mirror-nbd job's destination).
fn nbd_target(im: &Images) -> Result<(Stop, PathBuf)> {
    let sock = im.dir.join("nbd.sock");
    let _ = std::fs::remove_file(&sock);
    run(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o", "cluster_size=65536"])
            .arg(&im.mirror)
            .arg(format!("{}M", im.base_mib)),
        "qemu-img create",
    )?;
    let mut child = Command::new("taskset")
        .args(["-c", "1", "qemu-nbd", "-f", "qcow2", "-x", "x", "-k"])
        .arg(&sock)
        .arg(&im.mirror)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("qemu-nbd (apt-get install qemu-utils)")?;
    wait_socket(&mut child, &sock)?;
    Ok((Stop(child), sock))
}

/// One udrive job, start to end: seconds.
fn udrive_job(bin: &str, im: &Images, job: Job) -> Result<f64> {
    let (sock, rpc) = (im.dir.join("u.sock"), im.dir.join("u.rpc"));
    // A killed server leaves its sockets.
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(&rpc);
    let mut child = Command::new("taskset")
        .args(["-c", "0", bin, "serve", "--cpus", "0", "--vhost-user-blk"])
        .arg(&sock)
        .arg("--disk")
        .arg(format!("qcow2:{}", im.top.display()))
        .arg("--rpc")
        .arg(&rpc)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    wait_socket(&mut child, &rpc)?;
    let _server = Stop(child);
    let call = |method: &str, params: Value| {
        rpc_client::call(&rpc, method, params, Duration::from_secs(30))
            .map_err(|e| anyhow::anyhow!("{method}: {e}"))
    };
    // The mirror-nbd job's destination, served while the job runs.
    let nbd = (job == Job::MirrorNbd)
        .then(|| nbd_target(im))
        .transpose()?;
    let (method, params) = match (job, &nbd) {
        (Job::Stream, _) => ("block_stream", json!({"socket": sock})),
        (Job::Commit, _) => ("block_commit", json!({"socket": sock})),
        (Job::Mirror, _) => (
            "blockdev_mirror",
            json!({"socket": sock, "path": im.mirror, "pivot": true}),
        ),
        (Job::MirrorNbd, Some((_, nbd_sock))) => {
            let uri = format!("nbd+unix:///x?socket={}", nbd_sock.display());
            ("blockdev_mirror", json!({"socket": sock, "target": uri}))
        }
        (Job::MirrorNbd, None) => bail!("mirror-nbd without its destination"),
    };
    let t = Instant::now();
    let id = call(method, params)?["job"].clone();
    loop {
        let jobs = call("get_jobs", json!({}))?;
        let me = jobs
            .as_array()
            .and_then(|a| a.iter().find(|j| j["id"] == id))
            .cloned()
            .unwrap_or(Value::Null);
        match me["state"].as_str() {
            Some("completed") => break,
            Some("ready") => {
                call("job_complete", json!({"id": id}))?;
            }
            Some("running") if t.elapsed() < LIMIT => {}
            _ => bail!("udrive {}: {me}", job.name()),
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(t.elapsed().as_secs_f64())
}

/// A QMP connection that keeps the events it reads.
struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
    events: Vec<Value>,
}

impl Qmp {
    fn connect(path: &Path) -> Result<Qmp> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(LIMIT))?;
        let mut q = Qmp {
            r: BufReader::new(s.try_clone()?),
            w: s,
            events: Vec::new(),
        };
        q.read()?;
        q.cmd("qmp_capabilities", json!({}))?;
        Ok(q)
    }
    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            bail!("qemu-storage-daemon closed its monitor");
        }
        Ok(serde_json::from_str(&line)?)
    }
    fn cmd(&mut self, name: &str, args: Value) -> Result<Value> {
        writeln!(self.w, "{}", json!({"execute": name, "arguments": args}))?;
        loop {
            let m = self.read()?;
            if let Some(r) = m.get("return") {
                return Ok(r.clone());
            }
            if m.get("error").is_some() {
                bail!("{name}: {m}");
            }
            self.events.push(m);
        }
    }
    fn event(&mut self, name: &str) -> Result<Value> {
        if let Some(i) = self.events.iter().position(|e| e["event"] == name) {
            return Ok(self.events.remove(i));
        }
        loop {
            let m = self.read()?;
            if m["event"] == name {
                return Ok(m);
            }
            if m["event"] == "BLOCK_JOB_ERROR" {
                bail!("{m}");
            }
        }
    }
}

/// One qemu-storage-daemon job, start to end: seconds.
fn qsd_job(im: &Images, job: Job) -> Result<f64> {
    let (sock, mon) = (im.dir.join("q.sock"), im.dir.join("q.qmp"));
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(&mon);
    let mut child = Command::new("taskset")
        .args(["-c", "0", "qemu-storage-daemon", "--blockdev"])
        .arg(format!(
            "driver=qcow2,node-name=d0,file.driver=file,file.filename={},file.aio=io_uring",
            im.top.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e0,node-name=d0,addr.type=unix,addr.path={},writable=on",
            sock.display()
        ))
        .arg("--chardev")
        .arg(format!(
            "socket,id=m0,path={},server=on,wait=off",
            mon.display()
        ))
        .args(["--monitor", "chardev=m0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    wait_socket(&mut child, &mon)?;
    let _server = Stop(child);
    let mut q = Qmp::connect(&mon)?;
    let nbd = (job == Job::MirrorNbd)
        .then(|| nbd_target(im))
        .transpose()?;
    if let Some((_, nbd_sock)) = &nbd {
        q.cmd(
            "blockdev-add",
            json!({"driver": "nbd", "node-name": "t0", "export": "x",
                   "server": {"type": "unix", "path": nbd_sock}}),
        )?;
    }
    let t = Instant::now();
    let ready_then_complete = match job {
        Job::Stream => {
            q.cmd("block-stream", json!({"job-id": "j", "device": "d0"}))?;
            false
        }
        Job::Commit => {
            q.cmd("block-commit", json!({"job-id": "j", "device": "d0"}))?;
            true
        }
        Job::Mirror => {
            let target = im.mirror.display().to_string();
            q.cmd(
                "drive-mirror",
                json!({"job-id": "j", "device": "d0", "target": target, "format": "qcow2",
                       "sync": "full", "mode": "absolute-paths"}),
            )?;
            true
        }
        Job::MirrorNbd => {
            q.cmd(
                "blockdev-mirror",
                json!({"job-id": "j", "device": "d0", "target": "t0", "sync": "full"}),
            )?;
            q.event("BLOCK_JOB_READY")?;
            // Ends a ready mirror without a pivot, as after a migration.
            q.cmd("block-job-cancel", json!({"device": "j"}))?;
            false
        }
    };
    if ready_then_complete {
        q.event("BLOCK_JOB_READY")?;
        q.cmd("job-complete", json!({"id": "j"}))?;
    }
    let done = q.event("BLOCK_JOB_COMPLETED")?;
    let secs = t.elapsed().as_secs_f64();
    if done["data"]["error"].is_string() || done["data"]["offset"] != done["data"]["len"] {
        bail!("qemu-storage-daemon {}: {done}", job.name());
    }
    Ok(secs)
}

/// `median (min–max)` with `digits` decimals.
fn median_range(mut v: Vec<f64>, digits: usize) -> String {
    v.sort_by(f64::total_cmp);
    let (mid, lo, hi) = (v[v.len() / 2], v[0], v[v.len() - 1]);
    format!("{mid:.digits$} ({lo:.digits$}–{hi:.digits$})")
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bin = args
        .first()
        .context("usage: UDRIVE_BIN [REPS] [BASE] [TOP]")?;
    let num = |i: usize, d: u64| args.get(i).map_or(Ok(d), |s| s.parse::<u64>());
    let (reps, base, top) = (num(1, 5)?, num(2, 1024)?, num(3, 512)?);
    if top >= base || reps == 0 {
        bail!("TOP must be below BASE, REPS at least 1");
    }
    let dir = tempfile::Builder::new()
        .prefix("udrive-jobs-")
        .tempdir_in("/dev/shm")?;
    let im = Images::new(dir.path(), base, top)?;
    println!("| job | MiB | udrive MB/s | qsd MB/s | udrive ÷ qsd (per rep.) |");
    println!("|---|---|---|---|---|");
    for job in Job::ALL {
        let mb = (job.mib(base, top) << 20) as f64 / 1e6;
        let (mut u, mut q, mut r) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..reps {
            let once = |udrive_side: bool| -> Result<f64> {
                im.fresh()?;
                if udrive_side {
                    udrive_job(bin, &im, job)
                } else {
                    qsd_job(&im, job)
                }
            };
            let (us, qs) = if rep % 2 == 0 {
                let us = once(true)?;
                (us, once(false)?)
            } else {
                let qs = once(false)?;
                (once(true)?, qs)
            };
            eprintln!(
                "{} rep {}: udrive {us:.3} s, qsd {qs:.3} s",
                job.name(),
                rep + 1
            );
            u.push(mb / us);
            q.push(mb / qs);
            r.push(qs / us);
        }
        println!(
            "| {} | {} | {} | {} | {} |",
            job.name(),
            job.mib(base, top),
            median_range(u, 0),
            median_range(q, 0),
            median_range(r, 2)
        );
    }
    Ok(())
}
