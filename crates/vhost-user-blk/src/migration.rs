//! Live migration of the VM a device serves (vhost-user "Migration";
//! docs/decisions/0035-vhost-user-migration.md).
//!
//! Two parts. **Dirty-page logging**: the device offers VHOST_F_LOG_ALL and
//! LOG_SHMFD; SET_LOG_BASE hands it a shared log that is size-checked against the
//! memory table and mapped under the SIGBUS guard ([`map_log`]); while LOG_ALL is
//! acknowledged the pollers mark what they write into guest memory — read data and
//! status bytes (the worker, at completion) and the used ring (the poller, at the
//! ring's `log_guest_addr`). GET_VRING_BASE answers once the ring's requests have
//! completed, so every mark precedes the front end's last harvest.
//!
//! **One writer**: the disk may be open on the source and the destination at
//! once, but only one of them writes. A device holds its disk's [`WriterClaim`]
//! (an RBD image's exclusive lock, a lock on a file's range) while it is the
//! writer: it gives it up when its front end stops the rings with logging on (the
//! source at the switch-over) and takes it when a front end starts a ring while
//! it does not hold it (the destination, or the source again if the migration
//! failed). A destination built `incoming` starts without it.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};

pub use bdev::WriterClaim;
use guest_mem::{DirtyLog, FaultSignal};
use vhost::vhost_user::message::VhostUserLog;

use crate::memory::Mapping;
use crate::sync::lock;

/// Largest log a front end may hand over: a bit per 4 KiB page, so 4 GiB of log
/// covers 128 TiB of guest-physical address space.
const MAX_LOG_BYTES: u64 = 1 << 32;

/// How a device takes part in live migration.
#[derive(Clone, Debug, Default)]
pub struct MigrationOptions {
    /// Why the disk cannot follow its VM (a RAM disk lives in this process only):
    /// the device then offers no dirty-page logging, so the VMM refuses to
    /// migrate the VM. `None`: it can.
    pub refusal: Option<String>,
    /// The disk's writer claim, if it has one (a `shared` disk has none).
    pub claim: Option<Arc<dyn WriterClaim>>,
    /// The device receives a migrating VM: it takes its claim when the front end
    /// starts the disk, not when it is built.
    pub incoming: bool,
}

/// Whether the pollers mark read data in the front end's log. Off only for the
/// test that proves the VM migration test can fail (`UDRIVE_TEST_SKIP_DIRTY_DATA=1`:
/// used rings are still logged, read data is not), and only in a build with the
/// `test-knobs` feature: a product build always marks.
pub(crate) fn logs_data() -> bool {
    #[cfg(feature = "test-knobs")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            let skip = std::env::var("UDRIVE_TEST_SKIP_DIRTY_DATA").is_ok_and(|v| v == "1");
            if skip {
                tracing::warn!(
                    "UDRIVE_TEST_SKIP_DIRTY_DATA=1: read data is not marked in dirty-page logs \
                     (a test knob: migrated guests will see stale data)"
                );
            }
            !skip
        })
    }
    #[cfg(not(feature = "test-knobs"))]
    true
}

/// Whether the device keeps a dirty-page log of its own, always on, whatever its
/// front end negotiates: a test knob (`UDRIVE_TEST_FORCE_DIRTY_LOG=1`, builds with
/// the `test-knobs` feature only) to measure what logging costs the I/O path with
/// a benchmark client that never migrates.
fn forces_log() -> bool {
    #[cfg(feature = "test-knobs")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            let on = std::env::var("UDRIVE_TEST_FORCE_DIRTY_LOG").is_ok_and(|v| v == "1");
            if on {
                tracing::warn!(
                    "UDRIVE_TEST_FORCE_DIRTY_LOG=1: every device logs dirty pages into a log of \
                     its own (a test knob for measuring the cost of logging)"
                );
            }
            on
        })
    }
    #[cfg(not(feature = "test-knobs"))]
    false
}

/// The device's part in migration, as its threads share it.
pub(crate) struct Migration {
    pub refusal: Option<String>,
    pub log_data: bool,
    /// [`forces_log`]: the handler installs a log of its own for each memory table.
    pub force_log: bool,
    claim: Option<Arc<dyn WriterClaim>>,
    st: Mutex<ClaimSt>,
}

#[derive(Clone, Copy)]
struct ClaimSt {
    /// The device is its disk's writer (not migrated away, not an incoming
    /// device whose front end has not started the disk yet).
    wanted: bool,
    held: bool,
}

/// Why a claim could not be taken.
#[derive(Debug, thiserror::Error)]
#[error("the disk has another writer: {source}")]
pub struct ClaimError {
    #[source]
    pub source: io::Error,
}

impl Migration {
    pub fn new(opts: &MigrationOptions) -> Migration {
        Migration {
            refusal: opts.refusal.clone(),
            log_data: logs_data(),
            force_log: forces_log() && opts.refusal.is_none(),
            claim: opts.claim.clone(),
            st: Mutex::new(ClaimSt {
                wanted: !opts.incoming,
                held: false,
            }),
        }
    }

    pub fn offers_logging(&self) -> bool {
        self.refusal.is_none()
    }

    fn sync(&self, st: &mut ClaimSt, want_held: bool) -> io::Result<()> {
        let Some(c) = &self.claim else {
            return Ok(());
        };
        if want_held && !st.held {
            c.take()?;
            st.held = true;
        } else if !want_held && st.held {
            st.held = false;
            c.release()?;
        }
        Ok(())
    }

    /// A device starting to serve (built, or resumed after a pause): holds the
    /// claim if it is the writer.
    pub fn serve(&self) -> Result<(), ClaimError> {
        let mut st = lock(&self.st);
        let want = st.wanted;
        self.sync(&mut st, want)
            .map_err(|source| ClaimError { source })
    }

    /// A front end starts a ring: the device is the writer from now on.
    pub fn front_end_starts(&self) -> Result<(), ClaimError> {
        let mut st = lock(&self.st);
        if st.wanted && st.held {
            return Ok(());
        }
        self.sync(&mut st, true)
            .map_err(|source| ClaimError { source })?;
        if !st.wanted {
            tracing::info!("the front end started the disk: this device writes it now");
        }
        st.wanted = true;
        Ok(())
    }

    /// The front end stopped every ring while logging: the VM moves to another
    /// device, which may write from now on.
    pub fn migrated_away(&self) {
        let mut st = lock(&self.st);
        if !st.wanted {
            return;
        }
        st.wanted = false;
        match self.sync(&mut st, false) {
            Ok(()) => tracing::info!(
                "the front end stopped the disk while migrating: this device no longer writes it"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot give up the disk's writer claim"),
        }
    }

    /// A pause (handover): the successor takes the claim.
    pub fn pause(&self) {
        let mut st = lock(&self.st);
        if let Err(e) = self.sync(&mut st, false) {
            tracing::warn!(error = %e, "cannot give up the disk's writer claim for a handover");
        }
    }

    pub fn wanted(&self) -> bool {
        lock(&self.st).wanted
    }

    /// A restored device continues its predecessor's part.
    pub fn set_wanted(&self, wanted: bool) {
        lock(&self.st).wanted = wanted;
    }
}

/// The log a front end set with SET_LOG_BASE, as a handover carries it.
pub(crate) struct LogRec {
    pub size: u64,
    pub offset: u64,
    pub file: File,
    pub map: Arc<DirtyLog>,
}

/// Why a dirty-page log was refused.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("this device does not migrate: {0}")]
    NotOffered(String),
    #[error("a dirty log of {0} bytes is empty or larger than any guest needs")]
    Size(u64),
    #[error("the dirty log of {bytes} bytes covers guest memory up to {covers:#x}; the memory table reaches {end:#x}")]
    TooSmall { bytes: u64, covers: u64, end: u64 },
    #[error("cannot map the dirty log at offset {offset:#x}")]
    Map {
        offset: u64,
        #[source]
        source: io::Error,
    },
}

/// One past the highest guest-physical address of `table`.
pub(crate) fn table_end(table: &[Mapping]) -> u64 {
    table
        .iter()
        .map(|m| m.gpa.saturating_add(m.size))
        .max()
        .unwrap_or(0)
}

/// Checks that `log` has a bit for every page of `table`.
pub(crate) fn check_covers(log: &DirtyLog, table: &[Mapping]) -> Result<(), LogError> {
    let end = table_end(table);
    if end > log.covers() {
        return Err(LogError::TooSmall {
            bytes: log.bytes(),
            covers: log.covers(),
            end,
        });
    }
    Ok(())
}

/// Maps the log of SET_LOG_BASE (or of a handover) under the connection's fault
/// guard `signal`: refused when it is empty, absurdly large, shorter than its file
/// claims or too short for the memory table `table`.
pub(crate) fn map_log(
    signal: &Arc<FaultSignal>,
    table: &[Mapping],
    req: &VhostUserLog,
    file: File,
) -> Result<LogRec, LogError> {
    let (size, offset) = (req.mmap_size, req.mmap_offset);
    if size == 0 || size > MAX_LOG_BYTES {
        return Err(LogError::Size(size));
    }
    let map = DirtyLog::map(file.as_fd(), offset, size, signal)
        .map_err(|source| LogError::Map { offset, source })?;
    check_covers(&map, table)?;
    Ok(LogRec {
        size,
        offset,
        file,
        map: Arc::new(map),
    })
}

/// A log of the device's own covering `table` (for [`Migration::force_log`]).
pub(crate) fn own_log(signal: &Arc<FaultSignal>, table: &[Mapping]) -> Result<LogRec, LogError> {
    let bytes = table_end(table).div_ceil(8 * guest_mem::LOG_PAGE).max(1);
    let mem = guest_mem::SharedMem::new("udrive-dirty-log", bytes)
        .map_err(|source| LogError::Map { offset: 0, source })?;
    let file = File::from(
        mem.fd()
            .try_clone_to_owned()
            .map_err(|source| LogError::Map { offset: 0, source })?,
    );
    let req = VhostUserLog {
        mmap_size: bytes,
        mmap_offset: 0,
    };
    map_log(signal, table, &req, file)
}
