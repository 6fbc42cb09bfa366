//! The server's side: what the supervisor kept for it at start, and a [`Keeper`]
//! that sends it new records. Its channel to the supervisor is its standard input.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Context, Result};
use vfio_user::{Keeper, Kept, KeptRecords};

use super::store::RecordStore;
use super::wire::{self, Op};

struct Channel {
    sock: OwnedFd,
    /// One warning when the supervisor is gone, not one per record.
    warned: AtomicBool,
}

impl Channel {
    fn send(&self, op: Op, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        if let Err(e) = wire::send(self.sock.as_fd(), op, key, bytes, fds) {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "supervise: cannot reach the supervisor ({e}); clients will not \
                     survive a crash of this process"
                );
            }
        }
    }
}

impl Keeper for Channel {
    fn put(&self, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        self.send(Op::Put, key, bytes, fds);
    }
    fn remove(&self, prefix: &str) {
        self.send(Op::Remove, prefix, &[], &[]);
    }
}

static CHANNEL: OnceLock<Arc<Channel>> = OnceLock::new();
/// Notes earlier children left (records under [`NOTE_PREFIX`]): facts about them
/// rather than fds a device takes. Kept for this process's life, forgotten by the
/// supervisor once this child is ready (it has them).
static NOTES: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();

/// Records under this prefix are notes (see [`notes`]).
pub const NOTE_PREFIX: &str = "note/";
static INHERITED: Mutex<BTreeMap<String, Kept>> = Mutex::new(BTreeMap::new());

fn inherited() -> std::sync::MutexGuard<'static, BTreeMap<String, Kept>> {
    INHERITED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Connects to the supervisor (our stdin) and takes the records it kept from the
/// previous child. Call before any device starts.
pub fn attach() -> Result<()> {
    let sock = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .context("supervise: cannot take the supervisor's channel")?;
    wire::send(sock.as_fd(), Op::Hello, "", &[], &[]).context(
        "--supervised: standard input is not a supervisor's channel (run `udrive serve --supervise`)",
    )?;
    let mut buf = vec![0u8; wire::MAX_MSG];
    let mut got = inherited();
    loop {
        let Some(m) =
            wire::recv(sock.as_fd(), &mut buf).context("supervise: reading kept records")?
        else {
            bail!("supervise: the supervisor closed the channel");
        };
        match m.op {
            Op::Record => {
                got.insert(
                    m.key,
                    Kept {
                        bytes: m.bytes,
                        fds: m.fds,
                    },
                );
            }
            Op::End => break,
            op => bail!("supervise: unexpected {op:?} from the supervisor"),
        }
    }
    if !got.is_empty() {
        tracing::info!(
            records = got.len(),
            "supervise: took over what the previous process kept"
        );
    }
    let notes: Vec<(String, Vec<u8>)> = take_prefix(&mut got, NOTE_PREFIX)
        .into_iter()
        .map(|(k, v)| (k, v.bytes))
        .collect();
    let _ = NOTES.set(notes);
    drop(got);
    let _ = CHANNEL.set(Arc::new(Channel {
        sock,
        warned: AtomicBool::new(false),
    }));
    Ok(())
}

/// Whether this process runs under a supervisor.
pub fn supervised() -> bool {
    CHANNEL.get().is_some()
}

/// Where devices keep state for a successor: the supervisor, or (unsupervised)
/// this process's own store, which a handover passes on.
pub fn keeper() -> Arc<dyn Keeper> {
    match CHANNEL.get() {
        Some(c) => c.clone(),
        None => local_records(),
    }
}

/// This process's own records (unsupervised).
pub fn local_records() -> Arc<RecordStore> {
    static LOCAL: OnceLock<Arc<RecordStore>> = OnceLock::new();
    LOCAL.get_or_init(Arc::default).clone()
}

/// Records an earlier process handed over, for devices to take as they start.
pub fn inherit(records: BTreeMap<String, Kept>) {
    inherited().extend(records);
}

/// The notes earlier children left under `NOTE_PREFIX` + `prefix` (keys
/// relative to it): empty unless supervised.
pub fn notes(prefix: &str) -> Vec<(String, Vec<u8>)> {
    NOTES
        .get()
        .map(|n| {
            n.iter()
                .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_string(), v.clone())))
                .collect()
        })
        .unwrap_or_default()
}

/// The inherited records under `prefix`, keys relative to it.
pub fn take(prefix: &str) -> KeptRecords {
    take_prefix(&mut inherited(), prefix)
}

fn take_prefix(got: &mut BTreeMap<String, Kept>, prefix: &str) -> KeptRecords {
    let keys: Vec<String> = got
        .range(prefix.to_string()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .map(|(k, _)| k.clone())
        .collect();
    keys.into_iter()
        .filter_map(|k| {
            let v = got.remove(&k)?;
            Some((k[prefix.len()..].to_string(), v))
        })
        .collect()
}

/// The inherited record `key`.
pub fn take_one(key: &str) -> Option<Kept> {
    inherited().remove(key)
}

/// Devices are up: tell the supervisor, and let it drop what no device took (a
/// device that is not configured any more, e.g. one added over RPC: its client is
/// disconnected).
pub fn ready() {
    let left = std::mem::take(&mut *inherited());
    for key in left.keys() {
        tracing::warn!("no device took kept record {key}; dropping it");
    }
    let Some(c) = CHANNEL.get() else { return };
    for key in left.keys() {
        c.remove(key);
    }
    for (key, _) in NOTES.get().map(Vec::as_slice).unwrap_or_default() {
        c.remove(&format!("{NOTE_PREFIX}{key}"));
    }
    c.send(Op::Ready, "", &[], &[]);
}
