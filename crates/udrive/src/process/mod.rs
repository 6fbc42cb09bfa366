//! The process lifecycle as a value: what a device or a backend needs from the
//! process it runs in — where it keeps records for a successor, what a
//! predecessor left for it, whether it starts paused, who held its backends'
//! claims before — reaches it through a [`Process`] that `serve` builds once and
//! the server hands on when it builds devices ([`DeviceLife`]) and opens backends
//! ([`crate::kinds::OpenEnv`]). Nothing of it is process-global, so a spec parser
//! or a device never depends on the running server
//! (docs/decisions/0031-lifecycle-layer.md).
//!
//! A process is one of three kinds, fixed when it starts:
//! - **standalone**: devices keep their records in this process's own
//!   [`RecordStore`], which a live handover passes on;
//! - **supervised** (`serve --supervised`, started by `serve --supervise`): records
//!   go to the supervisor, which hands them to the next child if this one dies;
//! - **taking over** (`serve --takeover`): the records came from the running
//!   process; devices start paused until it confirmed that it let go
//!   ([`Process::commit`]).

pub mod secrets;
mod supervisor_link;

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Result;
use lifecycle::channel::{self, Op};
use lifecycle::{Inherited, KeepHandle, Keeper, Kept, KeptRecords, RecordStore};

use supervisor_link::SupervisorLink;

/// Records under this prefix are notes a supervised child leaves for the next one
/// (facts, not fds a device takes).
pub const NOTE_PREFIX: &str = "note/";

/// Record keys of the control plane's listening sockets (bytes: where they listen).
pub const RPC_LISTENER_KEY: &str = "rpc#listen";
pub const METRICS_LISTENER_KEY: &str = "metrics#listen";

/// Record key of the new process's announcements to the old one during a
/// takeover: the address of a cluster client it is about to take claims with
/// (decision 0025).
pub const CLIENT_KEY: &str = "rbd-client";

/// Supervisor notes naming the cluster clients of this service's processes.
const CLIENT_NOTE: &str = "rbd-client/";

/// The lifecycle of this process (see the module documentation).
pub struct Process {
    /// This process's own records: the devices' when unsupervised, and the
    /// control plane's listeners. A handover sends them all.
    own: Arc<RecordStore>,
    supervisor: Option<Arc<SupervisorLink>>,
    /// Records handed to this process at start, for devices to take.
    inherited: Inherited,
    /// Notes earlier children of our supervisor left.
    notes: Vec<(String, Vec<u8>)>,
    /// While taking over: the channel to the old process, and devices start paused.
    predecessor: Mutex<Option<OwnedFd>>,
    start_paused: AtomicBool,
    /// A handover to a successor was confirmed by the control request running on
    /// this thread: it exits once its reply is out.
    handed_over: Mutex<Option<std::thread::ThreadId>>,
    /// Cluster client addresses already noted with the supervisor.
    noted_owners: Mutex<Vec<String>>,
    /// CPUs for the threads of backend libraries (librbd); empty: no restriction.
    library_cpus: Mutex<Vec<usize>>,
    /// Passphrases given over the control socket.
    secrets: secrets::Secrets,
    /// While taking over: images disks served instead of their spec's
    /// (spec's image, image served).
    served: Mutex<Vec<(PathBuf, PathBuf)>>,
}

/// What a device gets from the process when the server builds it.
pub struct DeviceLife {
    /// Where the device keeps records for a successor, under its own prefix.
    pub keep: KeepHandle,
    /// What a predecessor left for it (keys relative to its prefix); empty for a
    /// new device.
    pub restore: KeptRecords,
    /// Start paused: the predecessor has not let go yet.
    pub paused: bool,
}

impl DeviceLife {
    /// A device on its own (tests, tools): its records go to a store of its own,
    /// nothing to restore.
    pub fn standalone(prefix: &str) -> DeviceLife {
        DeviceLife {
            keep: KeepHandle::new(Arc::new(RecordStore::default()), prefix.to_string()),
            restore: KeptRecords::new(),
            paused: false,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Process {
    fn new(
        supervisor: Option<Arc<SupervisorLink>>,
        inherited: KeptRecords,
        predecessor: Option<OwnedFd>,
    ) -> Process {
        let mut inherited = inherited;
        let notes = lifecycle::keep::take_prefix(&mut inherited, NOTE_PREFIX)
            .into_iter()
            .map(|(k, v)| (k, v.bytes))
            .collect();
        let secrets = secrets::Secrets::default();
        for (k, v) in lifecycle::keep::take_prefix(&mut inherited, secrets::RECORD_PREFIX) {
            let bytes = zeroize::Zeroizing::new(v.bytes);
            match secrets::name_of_record(&k) {
                Some(name) => {
                    if let Err(e) = secrets.add(name, bytes) {
                        tracing::warn!("a kept secret is dropped: {e}");
                    }
                }
                None => tracing::warn!("a kept secret record has a bad name; dropping it"),
            }
        }
        Process {
            own: Arc::default(),
            supervisor,
            inherited: Inherited::new(inherited),
            notes,
            start_paused: AtomicBool::new(predecessor.is_some()),
            predecessor: Mutex::new(predecessor),
            handed_over: Mutex::new(None),
            noted_owners: Mutex::new(Vec::new()),
            library_cpus: Mutex::new(Vec::new()),
            secrets,
            served: Mutex::new(Vec::new()),
        }
    }

    /// Adds a secret; a supervisor keeps a copy for the next child.
    pub fn add_secret(
        &self,
        name: &str,
        bytes: zeroize::Zeroizing<Vec<u8>>,
    ) -> Result<(), secrets::SecretError> {
        let copy = self.supervisor.as_ref().map(|_| bytes.clone());
        self.secrets.add(name, bytes)?;
        if let (Some(s), Some(b)) = (&self.supervisor, copy) {
            s.put(&secrets::record_key(name), &b, &[]);
        }
        Ok(())
    }

    pub fn remove_secret(&self, name: &str) -> Result<(), secrets::SecretError> {
        self.secrets.remove(name)?;
        if let Some(s) = &self.supervisor {
            s.remove(&secrets::record_key(name));
        }
        Ok(())
    }

    pub fn secrets(&self) -> &secrets::Secrets {
        &self.secrets
    }

    /// A process on its own: no supervisor, nothing inherited (also tests and tools).
    pub fn standalone() -> Arc<Process> {
        Arc::new(Process::new(None, KeptRecords::new(), None))
    }

    /// A supervised child: connects to the supervisor (standard input) and takes
    /// what it kept from the previous child. Call before any device starts.
    pub fn supervised() -> Result<Arc<Process>> {
        let (link, kept) = SupervisorLink::attach()?;
        Ok(Arc::new(Process::new(Some(Arc::new(link)), kept, None)))
    }

    /// A process taking over from the one at the other end of `predecessor`, with
    /// the records it sent: devices start paused until [`Process::commit`].
    pub fn taking_over(records: KeptRecords, predecessor: OwnedFd) -> Arc<Process> {
        Arc::new(Process::new(None, records, Some(predecessor)))
    }

    pub fn is_supervised(&self) -> bool {
        self.supervisor.is_some()
    }

    /// Where devices keep records as they run: the supervisor, or this process's
    /// own store.
    pub fn keeper(&self) -> Arc<dyn Keeper> {
        match &self.supervisor {
            Some(s) => s.clone(),
            None => self.own.clone(),
        }
    }

    /// This process's own records (what a handover sends besides the devices'
    /// saved state).
    pub fn own_records(&self) -> &RecordStore {
        &self.own
    }

    /// A device's part: its keeper handle under `prefix`, what a predecessor left
    /// under it, and whether it starts paused.
    pub fn device_life(&self, prefix: &str) -> DeviceLife {
        DeviceLife {
            keep: KeepHandle::new(self.keeper(), prefix.to_string()),
            restore: self.inherited.take(prefix),
            paused: self.start_paused.load(Ordering::Acquire),
        }
    }

    /// A device added at run time: nothing to restore, never paused.
    pub fn new_device_life(&self, prefix: &str) -> DeviceLife {
        DeviceLife {
            keep: KeepHandle::new(self.keeper(), prefix.to_string()),
            restore: KeptRecords::new(),
            paused: false,
        }
    }

    /// A listening socket of the control plane, kept so that a handover passes it
    /// on (`bytes`: where it listens, for messages).
    pub fn keep_listener(&self, key: &str, bytes: &[u8], fd: &impl AsFd) {
        self.own.put(key, bytes, &[fd.as_fd()]);
    }

    /// The inherited listening socket `key`, if a predecessor passed one on.
    pub fn take_listener(&self, key: &str) -> Option<OwnedFd> {
        self.inherited.take_one(key).and_then(Kept::into_fd)
    }

    /// Devices are up: drop what no device took (a device that is not configured
    /// any more: its client is disconnected) and tell the supervisor.
    pub fn ready(&self) {
        let left = self.inherited.take_rest();
        for key in left.keys() {
            tracing::warn!("no device took kept record {key}; dropping it");
        }
        if let Some(s) = &self.supervisor {
            s.ready(left.keys(), self.notes.iter().map(|(k, _)| k));
        }
    }

    /// The predecessor confirmed that it let go: devices created from now on start
    /// serving, and the channel to it is closed.
    pub fn commit(&self) {
        self.start_paused.store(false, Ordering::Release);
        *lock(&self.predecessor) = None;
    }

    /// While taking over: the images the predecessor's disks served instead of
    /// their spec's, for the backends opening now (empty again once they are
    /// open: a disk added later opens what its spec names).
    pub fn set_served(&self, images: Vec<(PathBuf, PathBuf)>) {
        *lock(&self.served) = images;
    }

    /// A handover to a successor was confirmed by the control request running on
    /// the calling thread.
    pub fn set_handed_over(&self) {
        *lock(&self.handed_over) = Some(std::thread::current().id());
    }

    /// Called by the control socket after each reply: once the `handover` reply is
    /// out — on the thread that ran the request, so that no other request's reply
    /// ends the process before that one reached the new process — this process has
    /// nothing left to do. It exits at once, without the teardown that would
    /// disconnect clients or remove socket files the new process now serves.
    pub fn exit_if_handed_over(&self) {
        if *lock(&self.handed_over) == Some(std::thread::current().id()) {
            tracing::info!("handover complete: this process exits; the new one serves");
            std::process::exit(0);
        }
    }

    /// CPUs for backend libraries' own threads (set by `serve` before backends open).
    pub fn set_library_cpus(&self, cpus: Vec<usize>) {
        *lock(&self.library_cpus) = cpus;
    }
}

/// Backends open with what the process knows about CPUs and about who held their
/// claims before (decision 0025).
impl crate::kinds::OpenEnv for Process {
    fn secret(&self, name: &str) -> Option<zeroize::Zeroizing<Vec<u8>>> {
        self.secrets.get(name)
    }

    fn served_instead(&self, spec: &std::path::Path) -> Option<std::path::PathBuf> {
        lock(&self.served)
            .iter()
            .find(|(s, _)| s == spec)
            .map(|(_, active)| active.clone())
    }

    fn library_cpus(&self) -> Vec<usize> {
        lock(&self.library_cpus).clone()
    }

    fn records_owners(&self) -> bool {
        self.supervisor.is_some() || lock(&self.predecessor).is_some()
    }

    /// Tells the supervisor (once per address) or, while taking over, the old
    /// process which client address this process uses, before it takes a claim
    /// with it: whoever outlives us then knows whose claims it may break.
    fn record_owner(&self, addr: &str) {
        if let Some(p) = lock(&self.predecessor).as_ref() {
            if let Err(e) = channel::send(p.as_fd(), Op::Record, CLIENT_KEY, addr.as_bytes(), &[]) {
                tracing::warn!("takeover: cannot tell the old process our client address: {e}");
            }
        }
        let Some(s) = &self.supervisor else { return };
        let mut noted = lock(&self.noted_owners);
        if noted.iter().any(|a| a == addr) {
            return;
        }
        let key = format!("{NOTE_PREFIX}{CLIENT_NOTE}{addr}");
        s.put(&key, addr.as_bytes(), &[]);
        noted.push(addr.to_string());
    }

    /// The client addresses earlier children of our supervisor noted. The
    /// supervisor starts a child only once the previous one was reaped, so every
    /// one of them is dead. Empty unless supervised (a handover's predecessor is
    /// alive; it releases its claims itself).
    fn dead_owners(&self) -> Vec<String> {
        self.notes
            .iter()
            .filter_map(|(k, _)| k.strip_prefix(CLIENT_NOTE).map(str::to_string))
            .collect()
    }
}
