//! Block jobs and changed chains across a live handover
//! (docs/decisions/0043-jobs-across-handover.md).
//!
//! The old process holds every job between two steps ([`hold_all`]) before it
//! pauses the devices; a commit or mirror keeps writing guest writes through
//! meanwhile, and pausing the backends writes the targets' metadata back. The
//! configuration it sends names, per disk whose chain changed, the image the
//! disk serves ([`ActiveImage`]), and carries every job ([`JobRecord`]). The
//! successor opens the served images, sets each job up again from its resume
//! point while its devices are still paused ([`restore`]: a commit or mirror
//! writes through again before the guest's first request), and starts the
//! jobs' threads once the old process let go ([`launch`]). A handover that
//! fails releases the held jobs where they are ([`release_all`]).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use bdev::{Qcow2Job, Qcow2JobKind, QosDisk};
use serde::{Deserialize, Serialize};

use super::{as_qcow2, kind_name, qcow2_disk, spawn, Job, JobState, Jobs, KINDS};
use crate::server::{Server, State};

/// How long a job may take to stop between two steps (one cluster each).
const HOLD_LIMIT: Duration = Duration::from_secs(5);

/// A disk that serves another image than its spec names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveImage {
    /// The image the spec names (as the disk opened it).
    pub spec: PathBuf,
    /// The image it serves.
    pub active: PathBuf,
}

/// A job as a handover passes it on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: u64,
    /// `stream`, `commit` or `mirror`.
    pub kind: String,
    pub socket: PathBuf,
    pub nsid: Option<u32>,
    /// A commit's base or a mirror's copy.
    pub target: Option<PathBuf>,
    /// A mirror's export on another host (its URI): the successor connects
    /// to it again.
    #[serde(default)]
    pub remote: Option<String>,
    pub pivot: bool,
    /// Bytes done: the resume point, a cluster boundary.
    pub done: u64,
    pub total: u64,
    pub rate: u64,
    /// `running`, `paused`, or how it ended.
    pub state: String,
    pub error: Option<String>,
}

fn kind_named(name: &str) -> Result<Qcow2JobKind> {
    KINDS
        .into_iter()
        .find(|k| kind_name(*k) == name)
        .ok_or_else(|| anyhow!("unknown block job type {name:?}"))
}

fn state_named(name: &str) -> Result<JobState> {
    JobState::ALL
        .into_iter()
        .find(|s| s.name() == name)
        .ok_or_else(|| anyhow!("unknown block job state {name:?}"))
}

impl Job {
    fn record(&self) -> JobRecord {
        let c = self.control();
        // A paused job's thread may not have seen the request yet: the
        // request is what the successor honours.
        let state = match c.state {
            JobState::Running | JobState::Paused if c.pause => JobState::Paused,
            JobState::Running | JobState::Paused => JobState::Running,
            s => s,
        };
        JobRecord {
            id: self.id,
            kind: self.kind_name().to_string(),
            socket: self.socket.clone(),
            nsid: self.nsid,
            target: self.target.clone(),
            remote: self.remote.clone(),
            pivot: self.pivot,
            done: self.done.load(Ordering::Relaxed),
            total: self.total.load(Ordering::Relaxed),
            rate: self.rate.load(Ordering::Relaxed),
            state: state.name().to_string(),
            error: c.error.clone(),
        }
    }

    fn set_hold(&self, hold: bool) {
        self.control().hold = hold;
        self.wake.notify_all();
    }
}

impl Jobs {
    /// Every job listed, for a successor (call with the jobs held).
    pub fn records(&self) -> Vec<JobRecord> {
        self.list.iter().map(|j| j.record()).collect()
    }

    /// The id the last job got.
    pub fn last_id(&self) -> u64 {
        self.next_id
    }
}

/// Stops every running or paused job between two steps (or past its last
/// one), so that nothing but guest writes changes an image from here; on a
/// failure releases them again.
pub fn hold_all(jobs: &Jobs) -> Result<()> {
    let live: Vec<_> = jobs.list.iter().filter(|j| !j.state().finished()).collect();
    live.iter().for_each(|j| j.set_hold(true));
    for j in &live {
        let mut c = j.control();
        let until = std::time::Instant::now() + HOLD_LIMIT;
        while !(c.held || c.state.finished()) {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                drop(c);
                release_all(jobs);
                bail!(
                    "block job {} did not stop between two steps within {HOLD_LIMIT:?}",
                    j.id
                );
            }
            c = j
                .wake
                .wait_timeout(c, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
    Ok(())
}

/// With the jobs held and the guest still running: the targets of commits
/// and mirrors get what the jobs wrote into them written back (and synced)
/// now, so that the flush while the devices are paused has only what the
/// guest wrote since. A failure here is said again by that flush.
pub fn flush_targets(st: &State) {
    for d in &st.devices {
        for r in d.disks() {
            if let Err(e) = as_qcow2(&r.disk).map_or(Ok(()), |q| q.flush_target()) {
                tracing::warn!("{}: cannot write a job's target back: {e}", r.name);
            }
        }
    }
}

/// After a failed handover: the held jobs go on here.
pub fn release_all(jobs: &Jobs) {
    jobs.list.iter().for_each(|j| j.set_hold(false));
}

/// The disks serving another image than their spec names.
pub fn active_images(st: &State) -> Vec<ActiveImage> {
    let mut out: Vec<ActiveImage> = Vec::new();
    for d in &st.devices {
        for r in d.disks() {
            let Some(q) = as_qcow2(&r.disk).filter(|q| q.chain_changed()) else {
                continue;
            };
            let a = ActiveImage {
                spec: q.spec_path().to_path_buf(),
                active: q.active_path(),
            };
            // Namespaces sharing one image share its disk.
            if !out.contains(&a) {
                out.push(a);
            }
        }
    }
    out
}

/// Jobs set up again in a successor whose threads start once the old process
/// let go ([`launch`]).
#[derive(Default)]
pub struct Pending(Vec<(Arc<Job>, Qcow2Job, Arc<QosDisk>)>);

/// Lists the jobs a predecessor passed on, and sets each unfinished one up
/// again from its resume point on its disk: call with the devices paused
/// (from here a commit or mirror writes guest writes through again). Any job
/// that cannot go on fails the takeover: the old process resumes it.
pub fn restore(server: &Server, records: &[JobRecord], last_id: u64) -> Result<Pending> {
    let mut pending = Pending::default();
    let mut list = Vec::new();
    for r in records {
        match restore_one(server, r) {
            Ok((job, running)) => {
                let job = Arc::new(job);
                list.push(job.clone());
                if let Some((q, disk)) = running {
                    pending.0.push((job, q, disk));
                }
            }
            Err(e) => {
                // What was set up already stops writing through.
                pending.0.into_iter().for_each(|(_, q, _)| q.abandon());
                return Err(e.context(format!("cannot take block job {} over", r.id)));
            }
        }
    }
    let mut st = server.lock();
    st.jobs.next_id = records.iter().map(|r| r.id).fold(last_id, u64::max);
    st.jobs.list = list;
    Ok(pending)
}

type Running = Option<(Qcow2Job, Arc<QosDisk>)>;

fn restore_one(server: &Server, r: &JobRecord) -> Result<(Job, Running)> {
    let kind = kind_named(&r.kind)?;
    let state = state_named(&r.state)?;
    let (job, running) = if state.finished() {
        let job = Job {
            id: r.id,
            kind,
            socket: r.socket.clone(),
            nsid: r.nsid,
            target: r.target.clone(),
            remote: r.remote.clone(),
            pivot: r.pivot,
            done: r.done.into(),
            total: r.total.into(),
            rate: r.rate.into(),
            control: Default::default(),
            wake: Default::default(),
        };
        (job, None)
    } else {
        let disk = qcow2_disk(server, &r.socket, r.nsid)?;
        let q = as_qcow2(&disk).ok_or_else(|| anyhow!("not a qcow2 disk"))?;
        let qjob = match &r.remote {
            Some(uri) if kind == Qcow2JobKind::Mirror => {
                q.start_remote_mirror(Box::new(super::remote::connect(uri)?), r.done)?
            }
            _ => q.resume_job(kind, r.target.as_deref(), r.pivot, r.done)?,
        };
        let job = Job::new(r.id, &qjob, &r.socket, r.nsid, r.rate);
        (job, Some((qjob, disk)))
    };
    {
        let mut c = job.control();
        c.state = state;
        c.pause = state == JobState::Paused;
        c.error = r.error.clone();
    }
    Ok((job, running))
}

/// Starts the threads of the jobs [`restore`] set up: after the old process
/// let go, before the devices resume. A job whose thread cannot start ends
/// failed (and stops writing through); the others go on.
pub fn launch(server: &Arc<Server>, pending: Pending) {
    for (job, q, disk) in pending.0 {
        let id = job.id;
        match spawn(server, job, q, disk) {
            Ok(()) => tracing::info!(job = id, "block job taken over"),
            Err(e) => tracing::error!(job = id, "block job taken over failed: {e:#}"),
        }
    }
}

/// Where a disk's image was replaced before a handover: the successor opens
/// the image served rather than the spec's, and says so.
pub fn log_served(images: &[ActiveImage]) {
    for a in images {
        tracing::warn!(
            spec = %a.spec.display(),
            serves = %a.active.display(),
            "a live snapshot, commit or mirror changed this disk's chain before the handover: \
             it goes on serving the image it served, not the one its spec names (update the \
             configuration to name it before the next restart or reload)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_types_and_states_read_back_and_unknown_ones_are_refused() {
        for k in KINDS {
            assert_eq!(kind_named(kind_name(k)).unwrap(), k);
        }
        for s in JobState::ALL {
            assert_eq!(state_named(s.name()).unwrap(), s);
        }
        assert!(kind_named("backup").is_err());
        assert!(state_named("Running").is_err());
    }
}
