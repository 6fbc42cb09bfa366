//! NVMe 1.4 controller over a memory-based (PCIe) transport.
//!
//! Command semantics are apart from the PCIe queue transport as far as
//! docs/decisions/0013-nvme-command-decoding.md takes them: I/O commands decode to
//! an `IoCmd` or a status without touching memory (`decode.rs`), admin commands move
//! their data through a transport-supplied buffer (`admin/data.rs`); rings,
//! doorbells and PRP/SGL walks are the PCIe side (`io/`, `queue.rs`, `prp.rs`,
//! `sgl.rs`).
//!
//! The transport (vfio-user) forwards BAR0 accesses to [`Controller::bar0_read`] /
//! [`Controller::bar0_write`], shares the doorbell page ([`Controller::doorbells`])
//! with the client, keeps the client's DMA map in a [`guest_mem::DmaSpace`] and
//! delivers interrupts through an [`InterruptSink`].
//!
//! Threads: register accesses and the admin queue run on the control path (admin
//! doorbells by message on the transport's thread; one `nvme-admin` thread per
//! process polls the admin doorbells of clients that mapped them and runs Keep
//! Alive timers); each I/O completion queue and its
//! submission queues form one poller owned by one engine reactor, which may sleep
//! in `adaptive` and `event` modes (docs/decisions/0014-nvme-poll-modes.md).
//!
//! Client memory the transport mirrors instead of mapping (DMA_MAP without a file
//! descriptor) is fetched before the controller reads it and pushed after it wrote
//! it, at the points `io/poll.rs`, `io/completions.rs` and `admin_poll` name; such a
//! client's queue groups run on a reactor of this controller's own and its admin
//! passes on a thread of their own, since they wait for its replies
//! (docs/decisions/0020-dma-messages.md).
//!
//! Format NVM (`admin/format.rs`) changes a namespace between 512- and 4096-byte
//! blocks and erases it on a thread of its own; the admin command completes when
//! the erase is done.
//!
//! A running controller can be handed to another process (`handover/`,
//! docs/decisions/0023-nvme-controller-state.md): [`Controller::pause`],
//! [`Controller::save`], and [`Controller::restore`] on a fresh
//! controller over the same memory, doorbell page and namespaces
//! ([`Controller::resume`] if the handover fails).
//!
//! Not implemented: namespace management/attach, firmware commands, SGL Bit
//! Bucket descriptors, metadata and protection information, cryptographic erase.

#![forbid(unsafe_code)]

mod admin;
mod bits;
mod ctrl;
mod decode;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod handover;
mod identify;
mod io;
mod iov;
mod log;
mod namespaces;
mod ns;
mod prp;
mod queue;
mod regs;
mod service;
mod sgl;
mod shared;
mod stats;
mod status;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{Engine, Placer, PollMode};
use guest_mem::{DmaSpace, SharedMem};

pub use handover::{
    AdminQueueState, ControllerState, CountersState, CqState, ErrorEntryState, ErrorLogState,
    FeaturesState, NamespaceState, PauseError, RegsState, RestoreError, SaveError, ShadowState,
    SqState, StateLimits, STATE_VERSION,
};
pub use identify::VENDOR_ID;
pub use ns::{Namespace, NsError, NsLabel, NsNotice, NsView};
pub use status::{Nvme, Status};

/// Smallest BAR0: registers, doorbells, MSI-X table, MSI-X PBA, a page each. 16 KiB
/// is also what Windows guests are reported to need (docs/decisions/0011).
pub const BAR0_SIZE: u64 = 0x4000;
/// Bytes of the doorbell memfd ([`Controller::doorbells`]).
pub const DOORBELL_PAGE_LEN: u64 = 0x2000;

/// Doorbells live at BAR0 0x1000..0x2000, i.e. the same offsets of the doorbell memfd.
pub const DOORBELL_OFFSET: u64 = 0x1000;
/// [`DOORBELL_OFFSET`] as an index into the doorbell page.
pub(crate) const DOORBELL_PAGE_OFFSET: usize = 0x1000;
const _: () = assert!(DOORBELL_PAGE_OFFSET as u64 == DOORBELL_OFFSET);
pub const MSIX_TABLE_OFFSET: u64 = 0x2000;

/// Where the parts of BAR0 lie for a controller with a given number of MSI-X
/// vectors ([`bar0_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bar0Layout {
    /// A power of two, at least [`BAR0_SIZE`].
    pub size: u64,
    /// [`MSIX_TABLE_OFFSET`]: 16 bytes per vector.
    pub msix_table: u64,
    /// The page after the table: one bit per vector.
    pub msix_pba: u64,
}

/// BAR0 for `msix_vectors` vectors: registers at 0, doorbells at 0x1000, the MSI-X
/// table at 0x2000 and the PBA on the first page after it, each part page-aligned
/// (the doorbell page is mapped by the client; the table and PBA are trapped). Up
/// to 256 vectors the table fits one page and BAR0 is 16 KiB; 512 vectors (511 I/O
/// queues) take 32 KiB.
pub fn bar0_layout(msix_vectors: u16) -> Bar0Layout {
    const PAGE: u64 = 0x1000;
    let table_len = u64::from(msix_vectors.max(1)) * 16;
    let msix_pba = MSIX_TABLE_OFFSET + table_len.next_multiple_of(PAGE);
    Bar0Layout {
        size: (msix_pba + PAGE).next_power_of_two().max(BAR0_SIZE),
        msix_table: MSIX_TABLE_OFFSET,
        msix_pba,
    }
}

/// Idle time after which an `adaptive` queue group sleeps. Long enough that a
/// guest at QD1 on a fast backend (next command ~10-30 µs after the last
/// completion) never pays a wake-up; short enough that an idle VM costs nothing
/// measurable (README: idle cost, wake-up latency).
pub const DEFAULT_ADAPTIVE_IDLE: Duration = Duration::from_micros(500);

/// Delivers MSI-X interrupts (the transport's irqfds).
pub trait InterruptSink: Send + Sync {
    fn signal(&self, vector: u16);
}

#[derive(Debug, Clone)]
pub struct ControllerConfig {
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// I/O queue pairs offered (Number of Queues feature).
    pub max_io_queues: u16,
    /// Entries per queue (CAP.MQES + 1).
    pub max_queue_entries: u16,
    /// Maximum data transfer size as a power of two of 4 KiB pages (capped at 7).
    pub mdts: u8,
    pub msix_vectors: u16,
    pub cntlid: u16,
    /// Highest namespace ID (Identify NN): namespaces added at run time get IDs up
    /// to this.
    pub max_namespaces: u32,
    /// How queue groups wait for work; [`Controller::set_poll_mode`] changes it.
    pub poll: PollMode,
    /// How long an idle group keeps polling in `adaptive` mode before it sleeps.
    pub adaptive_idle: Duration,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            serial: "udrive0001".into(),
            model: "udrive NVMe".into(),
            firmware: "0.1".into(),
            max_io_queues: 32,
            max_queue_entries: 1024,
            mdts: 5,
            msix_vectors: 33,
            cntlid: 1,
            max_namespaces: 32,
            poll: PollMode::default(),
            adaptive_idle: DEFAULT_ADAPTIVE_IDLE,
        }
    }
}

/// Counters for tests, the control socket and benchmarks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControllerStats {
    pub ready: bool,
    /// CSTS.CFS as the host sees it.
    pub fatal: bool,
    /// Whether shadow doorbells are in use now (a controller reset ends them).
    pub doorbell_buffer_configured: bool,
    /// Doorbell Buffer Config commands that succeeded since the controller started.
    pub doorbell_buffer_configs: u64,
    /// I/O doorbell values (new SQ tails) taken from the shadow doorbell buffer.
    pub shadow_doorbell_reads: u64,
    /// I/O submission queues.
    pub io_queues: usize,
    pub io_completion_queues: usize,
    pub admin_commands: u64,
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    /// Write Zeroes, Dataset Management and rejected I/O opcodes.
    pub other_io: u64,
    pub io_errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Entries ever added to the Error Information log.
    pub error_log_count: u64,
}

/// An NVMe controller. Cheap to clone (shared state).
#[derive(Clone)]
pub struct Controller {
    inner: Arc<ctrl::Inner>,
}

/// Why [`Controller::new`] refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("max_io_queues must be 1..=511 (one doorbell page), not {0}")]
    IoQueues(u16),
    #[error("max_queue_entries must be at least 2, not {0}")]
    QueueEntries(u16),
    #[error("at least one MSI-X vector is needed")]
    NoVectors,
    #[error("{given} namespaces, more than max_namespaces ({max})")]
    TooManyNamespaces { given: usize, max: u32 },
    #[error("namespace {nsid}")]
    Namespace {
        nsid: u32,
        #[source]
        source: NsError,
    },
    #[error("cannot create the shared doorbell page")]
    Doorbells(#[source] std::io::Error),
    #[error("cannot start the admin service thread")]
    AdminThread(#[source] std::io::Error),
}

impl Controller {
    /// Creates the controller with namespaces `nsid = index + 1` (`None`: that NSID
    /// is inactive) and starts its admin thread.
    pub fn new<N: Into<Namespace>>(
        cfg: ControllerConfig,
        namespaces: Vec<Option<N>>,
        engine: Arc<Engine>,
        placer: Placer,
        mem: Arc<DmaSpace>,
        irqs: Arc<dyn InterruptSink>,
    ) -> Result<Controller, ControllerError> {
        Self::with_doorbells(cfg, namespaces, engine, placer, mem, irqs, None)
    }

    /// [`Controller::new`] on a doorbell page of an earlier process
    /// ([`DOORBELL_PAGE_LEN`] bytes, `SharedMem::adopt`): a client that mapped it
    /// keeps writing where this controller looks. `None`: a new page.
    pub fn with_doorbells<N: Into<Namespace>>(
        cfg: ControllerConfig,
        namespaces: Vec<Option<N>>,
        engine: Arc<Engine>,
        placer: Placer,
        mem: Arc<DmaSpace>,
        irqs: Arc<dyn InterruptSink>,
        doorbells: Option<SharedMem>,
    ) -> Result<Controller, ControllerError> {
        if cfg.max_io_queues == 0 || cfg.max_io_queues > 0x1ff {
            return Err(ControllerError::IoQueues(cfg.max_io_queues));
        }
        if cfg.max_queue_entries < 2 {
            return Err(ControllerError::QueueEntries(cfg.max_queue_entries));
        }
        if cfg.msix_vectors == 0 {
            return Err(ControllerError::NoVectors);
        }
        if namespaces.len() > cfg.max_namespaces as usize {
            return Err(ControllerError::TooManyNamespaces {
                given: namespaces.len(),
                max: cfg.max_namespaces,
            });
        }
        let namespaces: Vec<Option<Namespace>> =
            namespaces.into_iter().map(|n| n.map(Into::into)).collect();
        for (i, d) in namespaces.iter().enumerate() {
            if let Some(d) = d {
                ns::check_block_size(d.dev.as_ref()).map_err(|source| {
                    ControllerError::Namespace {
                        nsid: i as u32 + 1,
                        source,
                    }
                })?;
            }
        }
        let doorbells = match doorbells {
            Some(d) => d,
            None => SharedMem::new("nvme-doorbells", DOORBELL_PAGE_LEN)
                .map_err(ControllerError::Doorbells)?,
        };
        let namespaces: Vec<Option<ns::Ns>> =
            namespaces.into_iter().map(|d| d.map(ns::Ns::new)).collect();
        let vwc = ctrl::Inner::any_write_cache(&namespaces);
        let mdts = iov::effective_mdts(cfg.mdts);
        let shared = Arc::new(shared::Shared {
            doorbells,
            fatal: AtomicBool::new(false),
            irqs,
            errors: Mutex::new(log::ErrorLog::default()),
            wce: AtomicBool::new(vwc),
            mdts_bytes: iov::PAGE << mdts,
            trace: Arc::new(trace::TraceControl::default()),
            log: trace::LogLimiter::new(),
            poll: engine::AtomicPollMode::new(cfg.poll),
            idle: cfg.adaptive_idle,
            mapped: AtomicBool::new(false),
            db_targets: Mutex::new(vec![None; 2 * (usize::from(cfg.max_io_queues) + 1)]),
            coalescing: AtomicU32::new(0),
            no_coalesce: (0..cfg.msix_vectors)
                .map(|_| AtomicBool::new(false))
                .collect(),
        });
        let inner = Arc::new_cyclic(|me| {
            ctrl::Inner::new(me.clone(), cfg, shared, engine, placer, mem, namespaces)
        });
        service::register(&inner).map_err(ControllerError::AdminThread)?;
        Ok(Controller { inner })
    }

    /// The 8 KiB doorbell memfd; offsets 0x1000..0x2000 are BAR0's doorbells.
    pub fn doorbells(&self) -> &SharedMem {
        &self.inner.shared.doorbells
    }

    /// Register or doorbell read. Unknown offsets read as zero.
    pub fn bar0_read(&self, offset: u64, data: &mut [u8]) {
        let mut i = 0usize;
        while i < data.len() {
            let Some(addr) = offset.checked_add(i as u64) else {
                data[i..].fill(0);
                return;
            };
            let base = addr & !3;
            let v = self.inner.read32(base).to_le_bytes();
            let mut k = (addr - base) as usize;
            while k < 4 && i < data.len() {
                data[i] = v[k];
                k += 1;
                i += 1;
            }
        }
    }

    /// Register or doorbell write. Dword-aligned dword and qword writes are the
    /// norm; narrower writes are merged into the current dword value.
    pub fn bar0_write(&self, offset: u64, data: &[u8]) {
        let mut i = 0usize;
        while i < data.len() {
            let Some(addr) = offset.checked_add(i as u64) else {
                return;
            };
            let base = addr & !3;
            let k = (addr - base) as usize;
            let n = (4 - k).min(data.len() - i);
            let mut v = if k == 0 && n == 4 {
                [0u8; 4]
            } else {
                self.inner.read32(base).to_le_bytes()
            };
            v[k..k + n].copy_from_slice(&data[i..i + n]);
            self.inner.write32(base, u32::from_le_bytes(v));
            i += n;
        }
    }

    /// Function level reset: like CC.EN 1->0, and registers back to reset values.
    pub fn reset(&self) {
        self.inner.reset();
    }

    /// The process that served this controller's client died and this one took the
    /// client over (`udrive serve --supervise`): the queues' state died with it. The
    /// controller looks enabled and failed (CSTS.RDY and CSTS.CFS), which a host
    /// driver answers by resetting it (CC.EN 1->0), re-creating its queues and
    /// retrying what was in flight (NVMe 2.0 base §3.5.3, "Controller Fatal
    /// Status"). `doorbells_mapped`: the client has the doorbell page mapped.
    pub fn restore_lost(&self, doorbells_mapped: bool) {
        self.inner.restore_lost();
        self.inner
            .shared
            .mapped
            .store(doorbells_mapped, Ordering::Release);
        if doorbells_mapped {
            service::kick();
        }
    }

    /// The client went away: stop touching its memory. Namespaces stay.
    pub fn client_gone(&self) {
        self.inner.reset();
        self.inner.shared.mapped.store(false, Ordering::Release);
        self.inner.messages.store(false, Ordering::Release);
        // Its queues are gone: so goes the reactor (and its thread and eventfd)
        // they had for memory that moved by messages.
        self.inner.stop_own_reactor();
    }

    /// The transport mirrors client memory that was mapped without a file
    /// descriptor and moves it by messages when the controller fetches and pushes
    /// (docs/decisions/0020-dma-messages.md). For `writable` memory (guest RAM),
    /// from now until the client goes, queue groups run on a reactor of this
    /// controller's own, since they wait for the client's replies; read-only
    /// memory alone (QEMU's ROMs) changes nothing: nobody does I/O from it, and a
    /// transfer from it on a shared reactor fails at once instead of waiting.
    /// Errors are errnos for the transport's reply.
    pub fn use_dma_messages(&self, writable: bool) -> Result<(), i32> {
        if writable {
            self.inner.use_messages()
        } else {
            Ok(())
        }
    }

    /// Whether the current client's memory (some of it) moves by messages.
    pub fn dma_messages(&self) -> bool {
        self.inner.messages.load(Ordering::Acquire)
    }

    /// Asked by the transport when a client queries BAR0: whether to offer it the
    /// doorbell page as an mmap area. Only in `busy` mode; in `adaptive` and
    /// `event` the doorbells must come by message, which wakes sleeping queues.
    /// The answer holds for that client's whole connection.
    pub fn offer_doorbell_mmap(&self) -> bool {
        let offer = self.inner.shared.mapped.load(Ordering::Acquire)
            || self.inner.shared.poll_mode() == PollMode::Busy;
        if offer {
            self.inner.shared.mapped.store(true, Ordering::Release);
            service::kick();
        }
        offer
    }

    /// Whether the connected client writes its doorbells into the mapped page.
    pub fn doorbells_mapped(&self) -> bool {
        self.inner.shared.mapped.load(Ordering::Acquire)
    }

    pub fn poll_mode(&self) -> PollMode {
        self.inner.shared.poll_mode()
    }

    /// Switches how the queue groups wait for work, at once (sleeping groups are
    /// woken to re-read it). With the doorbell page mapped by the current client,
    /// `adaptive` and `event` poll busily until the client reconnects.
    pub fn set_poll_mode(&self, mode: PollMode) {
        self.inner.shared.set_poll_mode(mode);
        self.inner.shared.wake_all();
        service::kick();
    }

    /// Handover, step 1 (docs/decisions/0023-nvme-controller-state.md): stops fetching new
    /// commands on every queue, admin and I/O, and waits, at most `timeout`, until
    /// every command fetched already has completed, its completion entry is posted
    /// and its interrupt signalled (interrupts held for coalescing fire). Waits for
    /// a Format NVM in progress as well. Outstanding Asynchronous Event Requests
    /// stay outstanding; the Keep Alive Timer stops. Doorbells the host writes
    /// meanwhile stay where it wrote them, for whoever serves it next.
    ///
    /// On error the controller runs on as before. A paused controller is
    /// resumed with [`Controller::resume`] or its state handed to another one
    /// with [`Controller::save`]. Refused for a client whose memory moves by
    /// DMA messages. The I/O path is untouched: queue groups are taken off their
    /// reactors as queue deletion does. Call it from the control path (not from
    /// a reactor thread); pausing a paused controller does nothing.
    pub fn pause(&self, timeout: Duration) -> Result<(), PauseError> {
        self.inner.pause(timeout)
    }

    /// Undoes [`Controller::pause`] (also after a [`Controller::save`]
    /// whose handover failed): queues go back to their reactors, admin commands
    /// written meanwhile are fetched, the Keep Alive Timer restarts in full. Does
    /// nothing if the controller is not paused.
    pub fn resume(&self) {
        self.inner.resume()
    }

    /// Everything a controller in another process needs to take this one's client
    /// over (registers, queues and their positions, features, outstanding AERs and
    /// queued events, shadow doorbells, logs, counters): only while paused.
    /// From then on this controller leaves the doorbell page alone (a reset or
    /// [`Controller::shutdown`] would clear it) until [`Controller::resume`].
    pub fn save(&self) -> Result<ControllerState, SaveError> {
        self.inner.save()
    }

    /// Takes over the client of a saved controller: on a fresh controller (not
    /// enabled, no queues) with the same [`ControllerConfig`] limits and
    /// namespaces, over the same guest memory (its DMA map already in place) and
    /// doorbell page ([`Controller::with_doorbells`]). The state is checked like
    /// guest input first (version, queue ids, sizes, alignment, vectors, indices,
    /// that every ring is mapped); a refused state changes nothing. Then the
    /// queues start on their reactors at their saved positions and pick up
    /// doorbells written during the pause; AERs complete from here.
    pub fn restore(&self, state: ControllerState) -> Result<(), RestoreError> {
        self.inner.restore(state)
    }

    /// Leaves the admin service and takes every queue off the reactors. A Format
    /// NVM in progress stops erasing before this returns.
    pub fn shutdown(&self) {
        self.inner.stop_admin();
        let mut st = self.inner.lock();
        self.inner.cancel_format(&st);
        self.inner.disable(&mut st);
        drop(st);
        self.inner.stop_own_reactor();
    }

    /// Activates namespace `nsid` (`None`: the lowest inactive one) at run time;
    /// returns its NSID. Queue groups get a channel on their reactor's next
    /// iteration; the host gets a Namespace Attribute Changed event.
    pub fn add_namespace(
        &self,
        nsid: impl Into<Option<u32>>,
        ns: impl Into<Namespace>,
    ) -> Result<u32, NsError> {
        self.inner.add_namespace(nsid.into(), ns.into())
    }

    /// The lowest inactive NSID (what [`Controller::add_namespace`] takes when
    /// given none).
    pub fn free_nsid(&self) -> Result<u32, NsError> {
        let st = self.inner.lock();
        self.inner.free_nsid(&st)
    }

    /// Deactivates namespace `nsid`: commands in flight finish, new ones get Invalid
    /// Namespace. Returns it.
    pub fn remove_namespace(&self, nsid: u32) -> Result<Namespace, NsError> {
        self.inner.remove_namespace(nsid)
    }

    /// Gives namespace `nsid` a size of `bytes` (a non-zero multiple of its current
    /// LBA size) while I/O runs: `resize` makes the backend's new handle (for
    /// example `|b| disk.resize(b)`) and, if it changes, the label; it is called
    /// with the controller's lock held, after the checks, so no Format NVM starts
    /// in between. Queue groups switch to the new handle (commands in flight finish
    /// on the old one), Identify reports the new NSZE/NCAP/NUSE and the host is
    /// told with a Namespace Attribute Changed event; the answer says how. Refused
    /// while a Format NVM erases it.
    pub fn resize_namespace<N: Into<Namespace>>(
        &self,
        nsid: u32,
        bytes: u64,
        resize: impl FnOnce(u64) -> std::io::Result<N>,
    ) -> Result<NsNotice, NsError> {
        self.inner
            .resize_namespace(nsid, bytes, |b| resize(b).map(Into::into))
    }

    /// The active namespaces, by NSID.
    pub fn namespaces(&self) -> Vec<NsView> {
        let st = self.inner.lock();
        st.ns
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some(n.as_ref()?.view(u32::try_from(i + 1).ok()?)))
            .collect()
    }

    /// Namespace `nsid`, if it is active.
    pub fn namespace(&self, nsid: u32) -> Option<NsView> {
        self.inner.lock().ns(nsid).map(|n| n.view(nsid))
    }

    /// Namespace `nsid` as the host sees it: the backend's facts in the current LBA
    /// format (a Format NVM changes the block size and count, not the backend).
    pub fn namespace_info(&self, nsid: u32) -> Option<bdev::BlockInfo> {
        self.namespace(nsid).map(|n| n.info)
    }

    pub fn max_namespaces(&self) -> u32 {
        self.inner.cfg.max_namespaces
    }

    /// Placement for queue groups created (or re-placed) from now on.
    pub fn set_placer(&self, placer: Placer) {
        self.inner.lock().placer = placer;
    }

    /// Reactor of each running queue group, by CQ id.
    pub fn queue_reactors(&self) -> Vec<(u16, Option<usize>)> {
        let st = self.inner.lock();
        st.groups
            .iter()
            .map(|(cqid, g)| {
                let r = match &g.place {
                    ctrl::Place::Running { id, .. } => Some(id.reactor),
                    _ => None,
                };
                (*cqid, r)
            })
            .collect()
    }

    pub fn stats(&self) -> ControllerStats {
        let st = self.inner.lock();
        let t = self.inner.totals(&st);
        let fatal = self.inner.shared.fatal.load(Ordering::Acquire);
        let error_log_count = self
            .inner
            .shared
            .errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .count;
        ControllerStats {
            ready: st.regs.rdy,
            fatal: fatal || st.regs.cfs,
            doorbell_buffer_configured: st.shadow.is_some(),
            doorbell_buffer_configs: st.doorbell_buffer_configs,
            shadow_doorbell_reads: t.shadow_reads,
            io_queues: st.sq_owner.len(),
            io_completion_queues: st.groups.len(),
            admin_commands: st.admin_commands,
            reads: t.io.ops.read,
            writes: t.io.ops.write,
            flushes: t.io.ops.flush,
            other_io: t.io.ops.other,
            io_errors: t.io.errors,
            bytes_read: t.io.bytes.read,
            bytes_written: t.io.bytes.write,
            error_log_count,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bar0_grows_with_the_msix_table() {
        let l = |v| {
            let b = bar0_layout(v);
            (b.size, b.msix_table, b.msix_pba)
        };
        assert_eq!(l(1), (0x4000, 0x2000, 0x3000));
        assert_eq!(l(33), (0x4000, 0x2000, 0x3000));
        assert_eq!(l(256), (0x4000, 0x2000, 0x3000));
        assert_eq!(l(257), (0x8000, 0x2000, 0x4000));
        assert_eq!(l(512), (0x8000, 0x2000, 0x4000));
        assert_eq!(l(2048), (0x10000, 0x2000, 0xa000));
    }
}
