//! Block jobs on qcow2 disks (docs/decisions/0041-qcow2-snapshots-and-jobs.md):
//! a thread per job runs a `bdev::Qcow2Job` a cluster at a time, off the
//! reactors, at most at its rate, pausable and cancellable; the device is
//! paused only around the moments the disk's image changes (the start of a
//! commit or mirror, which write guest writes through from then on; the final
//! pivot) and for a live snapshot.
//!
//! Who owns what: the server's state keeps every job's shared record
//! ([`Job`]); its thread owns the `Qcow2Job` and reports progress through
//! atomics and the record's lock, which RPC handlers take to read it or to ask
//! for a pause, a resume, a new rate or a cancel. A live handover holds every
//! job between two steps and passes it on ([`handover`]).

pub mod handover;
mod remote;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bdev::{BlockDevice, Qcow2Disk, Qcow2Job, Qcow2JobKind, QosDisk};
use serde_json::{json, Value};

use crate::server::{same_socket, Server, State};

/// How long a device may take to let its requests finish before the chain
/// of its disk changes.
pub const QUIESCE_LIMIT: Duration = Duration::from_secs(5);

/// Finished jobs kept for `get_jobs`, the oldest dropped first.
const KEEP_FINISHED: usize = 32;
/// How often a job whose image another process writes looks again.
const HANDED_OFF_RETRY: Duration = Duration::from_millis(200);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JobState {
    #[default]
    Running,
    Paused,
    /// A mirror to another host copied everything and keeps writing guest
    /// writes through until `job_complete`.
    Ready,
    Completed,
    Failed,
    Cancelled,
}

const KINDS: [Qcow2JobKind; 3] = [
    Qcow2JobKind::Stream,
    Qcow2JobKind::Commit,
    Qcow2JobKind::Mirror,
];

fn kind_name(kind: Qcow2JobKind) -> &'static str {
    match kind {
        Qcow2JobKind::Stream => "stream",
        Qcow2JobKind::Commit => "commit",
        Qcow2JobKind::Mirror => "mirror",
    }
}

impl JobState {
    const ALL: [JobState; 6] = [
        JobState::Running,
        JobState::Paused,
        JobState::Ready,
        JobState::Completed,
        JobState::Failed,
        JobState::Cancelled,
    ];
    fn name(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Paused => "paused",
            JobState::Ready => "ready",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
    pub fn finished(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Failed | JobState::Cancelled
        )
    }
}

#[derive(Default)]
struct Control {
    state: JobState,
    error: Option<String>,
    pause: bool,
    cancel: bool,
    /// `job_complete`: a ready mirror to another host ends.
    complete: bool,
    /// A live handover asks the thread to stop between two steps ...
    hold: bool,
    /// ... and the thread says it did, or that it has no step left (it waits
    /// for the server's lock to pivot, which the handover holds).
    held: bool,
    /// Why a running job copies nothing for now (its VM runs in another
    /// process); `get_jobs` shows it.
    waiting: Option<String>,
}

/// A job as the control plane sees it.
pub struct Job {
    pub id: u64,
    kind: Qcow2JobKind,
    socket: PathBuf,
    nsid: Option<u32>,
    /// A commit's base or a mirror's copy.
    target: Option<PathBuf>,
    /// A mirror's export on another host (its URI).
    remote: Option<String>,
    /// Mirror: the disk goes on in the copy.
    pivot: bool,
    done: AtomicU64,
    total: AtomicU64,
    /// Bytes per second; 0: unlimited.
    rate: AtomicU64,
    control: Mutex<Control>,
    wake: Condvar,
}

impl Job {
    /// A job record as `get_jobs` shows it from the start.
    fn new(id: u64, job: &Qcow2Job, socket: &Path, nsid: Option<u32>, rate: u64) -> Job {
        Job {
            id,
            kind: job.kind(),
            socket: socket.to_path_buf(),
            nsid,
            target: job.target_path(),
            remote: job.remote(),
            pivot: job.pivot(),
            done: AtomicU64::new(job.done_bytes()),
            total: AtomicU64::new(job.total_bytes()),
            rate: AtomicU64::new(rate),
            control: Mutex::default(),
            wake: Condvar::new(),
        }
    }
    fn control(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn state(&self) -> JobState {
        self.control().state
    }
    fn kind_name(&self) -> &'static str {
        kind_name(self.kind)
    }
    pub fn json(&self) -> Value {
        let c = self.control();
        json!({
            "id": self.id,
            "type": self.kind_name(),
            "socket": self.socket,
            "nsid": self.nsid,
            "target": self.remote.clone().or_else(|| self.target.as_ref().map(|t| t.display().to_string())),
            "done": self.done.load(Ordering::Relaxed),
            "total": self.total.load(Ordering::Relaxed),
            "rate": self.rate.load(Ordering::Relaxed),
            "state": c.state.name(),
            "error": c.error,
            "waiting": c.waiting,
        })
    }
    fn on(&self, socket: &Path, nsid: Option<u32>) -> bool {
        same_socket(&self.socket, socket) && self.nsid.unwrap_or(1) == nsid.unwrap_or(1)
    }
    /// Asks for a pause (`Some(true)`), a resume (`Some(false)`) or a cancel.
    pub fn request(&self, pause: Option<bool>, cancel: bool) -> Result<()> {
        let mut c = self.control();
        if c.state.finished() {
            bail!("job {} has {} already", self.id, c.state.name());
        }
        if let Some(p) = pause {
            c.pause = p;
        }
        c.cancel |= cancel;
        self.wake.notify_all();
        Ok(())
    }
    /// `job_complete`: a ready mirror to another host flushes its target
    /// and stops writing through (the VM moved there).
    pub fn complete(&self) -> Result<()> {
        let mut c = self.control();
        if self.remote.is_none() {
            bail!(
                "job {} ends by itself: only a mirror to another host waits for job_complete",
                self.id
            );
        }
        if c.state != JobState::Ready {
            bail!(
                "job {} is {}, not ready: it has copied {} of {} bytes (get_jobs)",
                self.id,
                c.state.name(),
                self.done.load(Ordering::Relaxed),
                self.total.load(Ordering::Relaxed)
            );
        }
        c.complete = true;
        self.wake.notify_all();
        Ok(())
    }
    pub fn set_rate(&self, bytes_per_sec: u64) {
        self.rate.store(bytes_per_sec, Ordering::Relaxed);
        self.wake.notify_all();
    }
    fn end(&self, state: JobState, error: Option<String>) {
        let mut c = self.control();
        c.state = state;
        c.error = error;
        self.wake.notify_all();
    }
}

/// The server's jobs.
#[derive(Default)]
pub struct Jobs {
    list: Vec<Arc<Job>>,
    next_id: u64,
}

impl Jobs {
    pub fn json(&self) -> Value {
        Value::Array(self.list.iter().map(|j| j.json()).collect())
    }
    pub fn get(&self, id: u64) -> Result<Arc<Job>> {
        self.list
            .iter()
            .find(|j| j.id == id)
            .cloned()
            .ok_or_else(|| anyhow!("no job {id} (get_jobs lists them)"))
    }
    /// The job still running or paused on a disk, if any.
    pub fn active_on(&self, socket: &Path, nsid: Option<u32>) -> Option<Arc<Job>> {
        self.list
            .iter()
            .find(|j| j.on(socket, nsid) && !j.state().finished())
            .cloned()
    }
    /// Progress gauges of every job listed, in Prometheus text format.
    pub fn prometheus(&self) -> String {
        use std::fmt::Write;
        type Gauge = (&'static str, &'static str, fn(&Job) -> u64);
        let gauges: [Gauge; 2] = [
            (
                "udrive_block_job_done_bytes",
                "Bytes a block job went over",
                |j| j.done.load(Ordering::Relaxed),
            ),
            (
                "udrive_block_job_total_bytes",
                "Bytes a block job goes over",
                |j| j.total.load(Ordering::Relaxed),
            ),
        ];
        let mut out = String::new();
        if self.list.is_empty() {
            return out;
        }
        for (name, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for j in &self.list {
                let (id, socket) = (j.id.to_string(), j.socket.display().to_string());
                let labels = trace::prometheus_labels(&[
                    ("id", id.as_str()),
                    ("type", j.kind_name()),
                    ("socket", socket.as_str()),
                    ("state", j.state().name()),
                ]);
                let _ = writeln!(out, "{name}{labels} {}", value(j));
            }
        }
        out
    }
    fn add(&mut self, job: Arc<Job>) {
        self.list.push(job);
        let finished = self.list.iter().filter(|j| j.state().finished()).count();
        if finished > KEEP_FINISHED {
            if let Some(i) = self.list.iter().position(|j| j.state().finished()) {
                self.list.remove(i);
            }
        }
    }
}

/// The qcow2 disk `nsid` of the device on `socket`.
pub fn qcow2_disk(server: &Server, socket: &Path, nsid: Option<u32>) -> Result<Arc<QosDisk>> {
    let disk = server.disk(socket, nsid)?;
    if as_qcow2(&disk).is_none() {
        bail!(
            "{} is not a whole qcow2 image (a slice or another kind)",
            disk.describe()
        );
    }
    Ok(disk)
}

fn as_qcow2(disk: &QosDisk) -> Option<&Qcow2Disk> {
    BlockDevice::as_any(disk).and_then(|a| a.downcast_ref::<Qcow2Disk>())
}

/// Runs `f` while the device on `socket` has nothing in flight and takes no
/// new request (its lifecycle pause, as a live handover does).
pub fn quiesced<R>(st: &mut State, socket: &Path, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let Some(d) = st
        .devices
        .iter_mut()
        .find(|d| same_socket(d.socket(), socket))
    else {
        bail!("no device on {} any more", socket.display());
    };
    d.pause(QUIESCE_LIMIT)?;
    let r = f();
    d.resume();
    r
}

/// Refuses a change to a disk a job works on, or whose VM runs in another
/// process (a live migration's source after the VM left, or destination
/// before it arrived: the image is that process's to change).
pub fn refuse_if_busy(st: &State, socket: &Path, nsid: Option<u32>) -> Result<()> {
    if st.find(socket).is_some_and(|d| !d.writes_disk()) {
        bail!(
            "the VM of {} runs in another process (live migration): snapshots and block \
             jobs go where it runs",
            socket.display()
        );
    }
    match st.jobs.active_on(socket, nsid) {
        Some(j) => bail!(
            "block job {} ({}) runs on this disk: let it finish or cancel it first",
            j.id,
            j.kind_name()
        ),
        None => Ok(()),
    }
}

/// A live external snapshot of a qcow2 disk into a new image at `path`.
pub fn snapshot(server: &Server, socket: &Path, nsid: Option<u32>, path: &Path) -> Result<Value> {
    let disk = qcow2_disk(server, socket, nsid)?;
    let q = as_qcow2(&disk).context("not a qcow2 disk")?;
    let mut st = server.lock();
    refuse_if_busy(&st, socket, nsid)?;
    let t0 = Instant::now();
    quiesced(&mut st, socket, || Ok(q.snapshot(path)?))?;
    let pause_us = t0.elapsed().as_micros() as u64;
    drop(st);
    let st = q.status();
    tracing::info!(socket = %socket.display(), overlay = %path.display(), "live snapshot");
    Ok(json!({"image": st.path, "backing_chain": st.backing_chain, "pause_us": pause_us}))
}

/// What job to start.
pub enum JobRequest<'a> {
    Stream,
    Commit,
    /// Into a new image at `target`; `pivot`: the disk goes on in it.
    Mirror {
        target: &'a Path,
        pivot: bool,
    },
    /// Into an NBD export on another host, until `job_complete`.
    MirrorTo {
        uri: &'a str,
    },
}

/// Starts a job on a qcow2 disk; its id.
pub fn start(
    server: &Arc<Server>,
    socket: &Path,
    nsid: Option<u32>,
    what: JobRequest<'_>,
    rate: u64,
) -> Result<u64> {
    let disk = qcow2_disk(server, socket, nsid)?;
    let q = as_qcow2(&disk).context("not a qcow2 disk")?;
    // Connected before the server's lock: a remote host may take its time.
    let mut remote = match what {
        JobRequest::MirrorTo { uri } => Some(remote::connect(uri)?),
        _ => None,
    };
    // One lock from the check to the record: no handover or other job slips in.
    let mut st = server.lock();
    refuse_if_busy(&st, socket, nsid)?;
    let job = match what {
        JobRequest::Stream => q.start_job(Qcow2JobKind::Stream)?,
        // Writes in flight must not escape the write-through that starts here.
        JobRequest::Commit => quiesced(&mut st, socket, || Ok(q.start_job(Qcow2JobKind::Commit)?))?,
        JobRequest::Mirror { target, pivot } => {
            quiesced(&mut st, socket, || Ok(q.start_mirror(target, pivot)?))?
        }
        JobRequest::MirrorTo { .. } => quiesced(&mut st, socket, || {
            let to = remote.take().context("the mirror's connection is gone")?;
            Ok(q.start_remote_mirror(Box::new(to), 0)?)
        })?,
    };
    st.jobs.next_id += 1;
    let record = Arc::new(Job::new(st.jobs.next_id, &job, socket, nsid, rate));
    st.jobs.add(record.clone());
    drop(st);
    let id = record.id;
    spawn(server, record, job, disk)?;
    Ok(id)
}

/// Starts the thread that runs `job`; if it cannot start, the job ends failed
/// (a commit or mirror stops writing through).
fn spawn(server: &Arc<Server>, record: Arc<Job>, job: Qcow2Job, disk: Arc<QosDisk>) -> Result<()> {
    let (id, server) = (record.id, server.clone());
    // The job comes back if the thread does not start.
    let slot = Arc::new(Mutex::new(Some((job, record.clone()))));
    let theirs = slot.clone();
    // Started by the spawner, as every server thread (decision 0042): the
    // control role's calls (files opened for a stream's reopen).
    let spawned = sandbox::spawn(sandbox::Role::Control, format!("job-{id}"), move || {
        let taken = theirs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((job, record)) = taken {
            run(&server, &record, job, &disk)
        }
    });
    if let Err(e) = spawned {
        let e = anyhow!(e).context("cannot start the job's thread");
        if let Some((job, record)) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
            job.abandon();
            record.end(JobState::Failed, Some(format!("{e:#}")));
        }
        return Err(e);
    }
    Ok(())
}

/// What the job's loop ended with.
enum Outcome {
    Done(Qcow2Job),
    Cancelled(Qcow2Job),
    Failed(Qcow2Job, String),
}

fn run(server: &Server, rec: &Job, job: Qcow2Job, disk: &QosDisk) {
    let (state, error) = match steps(rec, job) {
        Outcome::Done(job) if job.waits_for_complete() => match until_complete(rec, &job) {
            Ok(true) => match as_qcow2(disk).map(|q| job.finish(q)) {
                Some(Ok(())) => (JobState::Completed, None),
                Some(Err(e)) => (JobState::Failed, Some(format!("{e:#}"))),
                None => (
                    JobState::Failed,
                    Some("the disk is not a qcow2 image any more".into()),
                ),
            },
            Ok(false) => {
                job.abandon();
                (JobState::Cancelled, None)
            }
            Err(e) => {
                job.abandon();
                (JobState::Failed, Some(e))
            }
        },
        Outcome::Done(job) => {
            // A handover may go on without waiting for us: a successor
            // resumes from the end and pivots itself.
            rec.control().held = true;
            rec.wake.notify_all();
            let mut job = Some(job);
            let pivot = quiesced(&mut server.lock(), &rec.socket, || {
                match (as_qcow2(disk), job.take()) {
                    (Some(q), Some(job)) => Ok(job.finish(q)?),
                    _ => bail!("the disk is not a qcow2 image any more"),
                }
            });
            // A device that could not be paused: the image goes on as it was.
            if let Some(job) = job {
                job.abandon();
            }
            match pivot {
                Ok(()) => (JobState::Completed, None),
                Err(e) => (JobState::Failed, Some(format!("{e:#}"))),
            }
        }
        Outcome::Cancelled(job) => {
            job.abandon();
            (JobState::Cancelled, None)
        }
        Outcome::Failed(job, e) => {
            job.abandon();
            (JobState::Failed, Some(e))
        }
    };
    tracing::info!(job = rec.id, state = state.name(), error = ?error, "block job ended");
    rec.end(state, error);
}

/// A mirror to another host, its copy done: guest writes keep going through
/// until `job_complete` (true) or `job_cancel` (false); Err: writing through
/// failed. A handover may take it over meanwhile.
fn until_complete(rec: &Job, job: &Qcow2Job) -> Result<bool, String> {
    let mut c = rec.control();
    c.state = JobState::Ready;
    c.held = true;
    rec.wake.notify_all();
    tracing::info!(
        job = rec.id,
        "block job ready: its target follows the guest until job_complete"
    );
    loop {
        if c.cancel {
            return Ok(false);
        }
        if c.complete && !c.hold {
            return Ok(true);
        }
        if let Err(e) = job.check_target() {
            return Err(e.to_string());
        }
        c = rec
            .wake
            .wait_timeout(c, HANDED_OFF_RETRY)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Steps the job to its end, honouring pause, cancel and the rate.
fn steps(rec: &Job, mut job: Qcow2Job) -> Outcome {
    let mut next = Instant::now();
    let mut waiting = false;
    loop {
        {
            let mut c = rec.control();
            loop {
                if c.hold {
                    c.held = true;
                    rec.wake.notify_all();
                    c = rec.wake.wait(c).unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                c.held = false;
                if c.cancel {
                    return Outcome::Cancelled(job);
                }
                let now = Instant::now();
                if c.pause {
                    c.state = JobState::Paused;
                    c = rec.wake.wait(c).unwrap_or_else(|p| p.into_inner());
                } else if next > now {
                    let wait = next - now;
                    c = rec
                        .wake
                        .wait_timeout(c, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                } else {
                    c.state = JobState::Running;
                    break;
                }
            }
        }
        match job.step() {
            Ok(Some(n)) => {
                rec.done.store(job.done_bytes(), Ordering::Relaxed);
                let rate = rec.rate.load(Ordering::Relaxed);
                if rate > 0 && n > 0 {
                    let now = Instant::now();
                    next = next.max(now) + Duration::from_secs_f64(n as f64 / rate as f64);
                    // A rate lowered while waiting must not leave a long debt.
                    next = next.min(now + Duration::from_secs(1));
                }
            }
            Ok(None) => return Outcome::Done(job),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // The VM migrated away: wait for it to come back (or a cancel).
                if !waiting {
                    tracing::info!(job = rec.id, "block job waits: {e}");
                    rec.control().waiting = Some(e.to_string());
                }
                waiting = true;
                next = Instant::now() + HANDED_OFF_RETRY;
                continue;
            }
            Err(e) => return Outcome::Failed(job, e.to_string()),
        }
        if waiting {
            rec.control().waiting = None;
        }
        waiting = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bdev::{create_qcow2, Qcow2Create, Qcow2Disk, Qcow2Options, WriterClaim};

    #[test]
    fn a_job_waits_while_another_process_writes_its_image() {
        let dir = tempfile::tempdir().unwrap();
        let (base, top) = (dir.path().join("base.qcow2"), dir.path().join("top.qcow2"));
        let create = |p: &Path, backing: Option<&str>| {
            let o = Qcow2Create {
                size: 4 << 20,
                cluster_size: 64 << 10,
                backing: backing.map(str::to_string),
            };
            create_qcow2(p, &o).unwrap();
        };
        create(&base, None);
        create(&top, Some("base.qcow2"));
        let disk = Qcow2Disk::open(&top, Qcow2Options::default()).unwrap();
        let job = disk.start_job(Qcow2JobKind::Stream).unwrap();
        let claim = disk.claim();
        claim.release().unwrap();
        let rec = Arc::new(Job::new(1, &job, Path::new("/run/vm.sock"), None, 0));
        let theirs = rec.clone();
        let t = std::thread::spawn(move || matches!(steps(&theirs, job), Outcome::Done(_)));
        std::thread::sleep(HANDED_OFF_RETRY * 3);
        // Neither failed nor done while the image is away, however long that is,
        // and get_jobs says why it copies nothing.
        assert!(!t.is_finished());
        assert_eq!(rec.done.load(Ordering::Relaxed), 0);
        let says_why = || rec.json()["waiting"].is_string();
        assert!(test_support::wait::poll_until(
            Duration::from_secs(10),
            says_why
        ));
        assert_eq!(rec.json()["state"], "running");
        claim.take().unwrap();
        assert!(
            t.join().unwrap(),
            "the job did not finish once its image came back"
        );
        assert_eq!(rec.done.load(Ordering::Relaxed), 4 << 20);
        assert!(rec.json()["waiting"].is_null());
    }
}
