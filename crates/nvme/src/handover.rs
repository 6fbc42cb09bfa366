//! Handing a running controller over to another process (issue 15): quiesce, save
//! the runtime state as a serializable value, restore it into a fresh controller
//! that sees the same guest memory, doorbell page and namespaces. The guest sees a
//! pause: no reset, no error, no lost or repeated completion.
//!
//! **Quiesce** runs on the control path only; the I/O hot path is unchanged (not
//! even a flag load). Every queue group is taken off its reactor the way queue
//! creation and namespace changes do it (`Engine::remove_poller` returns once the
//! reactor let go between two polls), so nothing more is fetched from that moment.
//! The control path then finishes what the groups hold: it polls their backend
//! channels, posts the completions and signals the interrupts
//! (`QueueGroup::settle`), bounded by the caller's timeout; a group's CQ always
//! has room for what it has in flight (a group fetches only what its CQ can take).
//! The settled groups stay parked off their reactors (`Inner::place_group` parks
//! every group while `State::quiesced`). The admin queue stops fetching
//! (`Inner::admin_poll`); outstanding Asynchronous Event Requests stay outstanding
//! and their CIDs move to the new controller, which completes them. A Format NVM in
//! progress is waited for (within the timeout). The Keep Alive Timer stops and
//! restarts in full on `resume` or `restore`: the pause is not the host's.
//!
//! **Doorbells** written meanwhile land in the shared doorbell page (mapped by the
//! client or stored there by the transport) or the shadow doorbell buffer in guest
//! memory; the new controller's groups poll both first thing when placed, and its
//! admin queue is polled once at the end of `restore`. The transport must
//! not hand the old controller any message after `save`: a register write
//! there would be lost (the orchestrator stops reading the client's socket before
//! quiescing and the new process reads it after restoring).
//!
//! **After a successful save** the old controller must not clear the doorbell page
//! (now the new controller's) when it is reset or shut down: `handed_over` keeps it
//! from doing so until `resume` (rollback).
//!
//! **Refused:** clients whose memory moves by DMA messages
//! (docs/decisions/0020-dma-messages.md): their queue groups and admin passes wait
//! for the client's replies, and mirrored SQ entries fetched ahead (`IoSq::synced`)
//! would have to move too. `quiesce` and `save` say so.
//!
//! The state is validated on restore like guest input: every queue id, size, base,
//! vector and index is checked against this controller's configuration and the
//! current memory map before anything changes, so a corrupt or hostile state is an
//! error, never a panic, and leaves the controller fresh.

// Client-supplied numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bdev::BlockInfo;
use guest_mem::{Access, MemoryMap};
use serde::{Deserialize, Serialize};

use crate::admin::features::Features;
use crate::ctrl::{AdminQueues, Inner, Place, State};
use crate::identify::AERL;
use crate::io::{QueueGroup, Shadow};
use crate::log::{ErrorEntry, ErrorLog, Totals, ERROR_LOG_ENTRIES};
use crate::queue::{CqRing, SqRing, CQE_SIZE, SQE_SIZE};
use crate::regs;
use crate::status::Status;

/// The [`ControllerState::version`] this build writes and reads.
pub const STATE_VERSION: u32 = 1;

/// Events queued for Asynchronous Event Requests a state may carry (udrive queues
/// at most a few: namespace notices are masked until the host reads the log).
const MAX_EVENTS: usize = 64;
/// Entries of the Changed Namespace List (beyond: "more than 1024 changed").
const MAX_CHANGED_NS: usize = 1024;

/// Everything a controller in another process needs to take a running client
/// over ([`crate::Controller::save`], [`crate::Controller::restore`]).
/// Plain data (serde, e.g. JSON); validated on restore like guest input.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerState {
    /// [`STATE_VERSION`]; a restore refuses any other.
    pub version: u32,
    /// The configuration it was saved from; must equal the restoring one's.
    pub limits: StateLimits,
    pub regs: RegsState,
    /// CSTS.CFS set by the I/O path (a hostile doorbell, a lost ring).
    pub fatal: bool,
    /// The client has the doorbell page mapped (its doorbell writes land silently:
    /// queues poll busily in every mode).
    pub doorbells_mapped: bool,
    /// The admin queue (`None`: controller not enabled).
    pub admin: Option<AdminQueueState>,
    /// I/O completion queues.
    pub cqs: Vec<CqState>,
    /// I/O submission queues, in the order their groups poll them.
    pub sqs: Vec<SqState>,
    /// Doorbell Buffer Config: shadow doorbell and EventIdx buffers.
    pub shadow: Option<ShadowState>,
    pub features: FeaturesState,
    /// CIDs of outstanding Asynchronous Event Requests, oldest first.
    pub aer_cids: Vec<u16>,
    /// Events (completion dword 0) waiting for an Asynchronous Event Request.
    pub events: Vec<u32>,
    /// Changed Namespace List (log page 04h) not read by the host yet.
    pub changed_ns: Vec<u32>,
    /// A Namespace Attribute Changed event is out and the host has not read the
    /// log yet (further changes only extend the list).
    pub ns_event_masked: bool,
    /// Admin commands that finished but whose entries found no room in the admin
    /// CQ yet, as (CID, status): posted by the new controller.
    pub admin_done: Vec<(u16, u16)>,
    /// Active namespaces and their LBA size as the host formatted it.
    pub namespaces: Vec<NamespaceState>,
    pub error_log: ErrorLogState,
    /// Request counters (SMART log, statistics), carried on as a base.
    pub counters: CountersState,
    /// Admin commands executed.
    pub admin_commands: u64,
}

/// The controller configuration a state belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateLimits {
    pub max_io_queues: u16,
    pub max_queue_entries: u16,
    pub msix_vectors: u16,
    pub max_namespaces: u32,
}

/// BAR0 registers the host programs or reads (CAP and VS follow the config).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegsState {
    pub cc: u32,
    pub aqa: u32,
    pub asq: u64,
    pub acq: u64,
    /// Interrupt Mask Set/Clear (INTMS).
    pub intms: u32,
    /// CSTS.RDY.
    pub rdy: bool,
    /// CSTS.CFS from the control path (an invalid enable).
    pub cfs: bool,
    /// CSTS.SHST.
    pub shst: u32,
}

/// The admin queue pair's positions (base and size are ASQ/ACQ/AQA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminQueueState {
    pub sq_head: u16,
    /// The host's CQ head as last read from its doorbell.
    pub cq_head: u16,
    pub cq_tail: u16,
    pub cq_phase: bool,
}

/// One I/O completion queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CqState {
    pub qid: u16,
    pub base: u64,
    pub size: u16,
    pub vector: u16,
    /// Interrupts enabled.
    pub ien: bool,
    /// The host's head as last read from its doorbell.
    pub head: u16,
    pub tail: u16,
    pub phase: bool,
}

/// One I/O submission queue. Its priority is not kept: udrive arbitrates round
/// robin only (CAP.AMS = 0), so QPRIO never mattered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqState {
    pub qid: u16,
    pub base: u64,
    pub size: u16,
    pub cqid: u16,
    pub head: u16,
}

/// Doorbell Buffer Config addresses (guest IOVAs, page aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowState {
    pub doorbells: u64,
    pub event_idx: u64,
}

/// Set Features values (NVMe 1.4 §5.21.1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeaturesState {
    pub arbitration: u32,
    pub power_state: u32,
    pub temp_over: u16,
    pub temp_under: u16,
    pub vwc_present: bool,
    pub volatile_write_cache: bool,
    /// Number of Queues granted (NSQA | NCQA << 16, 0's based).
    pub queues: u32,
    pub coalescing: u32,
    /// Interrupt Vector Configuration: Coalescing Disable per vector.
    pub no_coalesce: Vec<bool>,
    pub async_event_config: u32,
    /// Keep Alive Timeout in ms (the timer restarts in full after the handover).
    pub keep_alive_ms: u32,
    pub error_recovery: u32,
    pub write_atomicity: u32,
    /// Host Behavior Support: ACRE.
    pub host_behavior_acre: bool,
}

/// An active namespace as the host formatted it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceState {
    pub nsid: u32,
    pub block_size: u32,
}

/// The Error Information log.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorLogState {
    /// Entries ever logged.
    pub count: u64,
    /// The most recent ones, oldest first.
    pub entries: Vec<ErrorEntryState>,
}

/// One Error Information log entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorEntryState {
    pub count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: u16,
    pub lba: u64,
    pub nsid: u32,
}

/// Request counters summed over all queues (the SMART log reports them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountersState {
    pub ops: trace::OpCounts,
    pub bytes: trace::OpCounts,
    pub errors: u64,
    pub shadow_doorbell_reads: u64,
}

/// Why [`crate::Controller::quiesce`] failed; the controller runs on as before.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error(
        "the client's memory moves by DMA messages (not shared): its controller cannot be \
         handed over"
    )]
    DmaMessages,
    #[error("a Format NVM is still erasing after {0:?}; try again when it has finished")]
    FormatInProgress(Duration),
    #[error("{requests} requests still at the backend after {timeout:?}")]
    Timeout { requests: u64, timeout: Duration },
}

/// Why [`crate::Controller::save`] refused.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error("the controller is not quiesced")]
    NotQuiesced,
    #[error(
        "the client's memory moves by DMA messages (not shared): its controller cannot be \
         handed over"
    )]
    DmaMessages,
    #[error("queue group {0} was lost (its reactor stopped)")]
    LostGroup(u16),
}

/// Why [`crate::Controller::restore`] refused; the controller stays fresh.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("state version {0} is not {STATE_VERSION}")]
    Version(u32),
    #[error("the controller is not fresh (enabled, or it has queues)")]
    NotFresh,
    #[error("the state is for another configuration: {0}")]
    Config(&'static str),
    #[error("invalid state: {0}")]
    Invalid(String),
    #[error("{what} at {base:#x} ({len} bytes) is not mapped for the controller")]
    Unmapped {
        what: &'static str,
        base: u64,
        len: u64,
    },
    #[error("namespace {nsid} cannot take LBA size {block_size}")]
    Namespace { nsid: u32, block_size: u32 },
    #[error("cannot open backend channels")]
    Backend(#[source] std::io::Error),
    #[error("cannot start queue group {0} on a reactor")]
    Reactor(u16),
}

fn invalid(msg: impl Into<String>) -> RestoreError {
    RestoreError::Invalid(msg.into())
}

impl Inner {
    fn limits(&self) -> StateLimits {
        StateLimits {
            max_io_queues: self.cfg.max_io_queues,
            max_queue_entries: self.cfg.max_queue_entries,
            msix_vectors: self.cfg.msix_vectors,
            max_namespaces: self.cfg.max_namespaces,
        }
    }

    /// An admin pass where this controller's admin passes run (see `write32`).
    fn admin_kick(&self, st: &mut State) {
        if self.messages.load(Ordering::Acquire) {
            self.admin_elsewhere();
        } else {
            self.admin_poll(st);
        }
        crate::service::kick();
    }

    /// See [`crate::Controller::quiesce`].
    pub(crate) fn pause(&self, timeout: Duration) -> Result<(), PauseError> {
        let start = Instant::now();
        let mut st = self.lock();
        if self.messages.load(Ordering::Acquire) {
            return Err(PauseError::DmaMessages);
        }
        if st.quiesced {
            return Ok(());
        }
        st.quiesced = true;
        st.keep_alive = None;
        // A Format NVM completes when its erase ends (on its own thread, which
        // needs the lock to finish).
        while st.format.is_some() {
            if start.elapsed() >= timeout {
                self.resume_locked(&mut st);
                return Err(PauseError::FormatInProgress(timeout));
            }
            drop(st);
            std::thread::sleep(Duration::from_millis(1));
            st = self.lock();
        }
        // Admin commands that finished meanwhile are posted (nothing is fetched).
        if st.admin.is_some() {
            self.admin_poll(&mut st);
        }
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        let mut taken = Vec::with_capacity(ids.len());
        for cqid in ids {
            if let Some(g) = self.take_group(&mut st, cqid) {
                taken.push(g);
            }
        }
        // From here on nothing is fetched: finish what the groups hold.
        let left = timeout.saturating_sub(start.elapsed());
        let mut idle = vec![false; taken.len()];
        let done = engine::wait_until(left, Duration::from_micros(20), || {
            for (g, idle) in taken.iter_mut().zip(idle.iter_mut()) {
                if !*idle {
                    *idle = g.settle();
                }
            }
            idle.iter().all(|i| *i)
        });
        let requests: u64 = taken.iter().map(|g| u64::from(g.out.inflight)).sum();
        // Parked while quiesced, back on their reactors otherwise.
        for g in taken {
            let cqid = g.out.cq.qid;
            if let Err(s) = self.place_group(&mut st, g) {
                tracing::error!(cqid, status = ?s, "nvme: queue group lost in a quiesce");
            }
        }
        if !done {
            self.resume_locked(&mut st);
            return Err(PauseError::Timeout { requests, timeout });
        }
        trace::limited!(
            self.shared.log,
            info,
            cntlid = self.cfg.cntlid,
            took_us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
            "nvme: controller quiesced"
        );
        Ok(())
    }

    /// Back to running after a quiesce: groups on their reactors, the Keep Alive
    /// Timer restarted, admin commands rung meanwhile fetched.
    fn resume_locked(&self, st: &mut State) {
        st.quiesced = false;
        self.handed_over.store(false, Ordering::Release);
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        for cqid in ids {
            if let Some(g) = self.take_group(st, cqid) {
                if let Err(s) = self.place_group(st, g) {
                    tracing::error!(cqid, status = ?s, "nvme: queue group lost resuming");
                }
            }
        }
        if st.admin.is_some() {
            st.restart_keep_alive();
            self.admin_kick(st);
        }
    }

    /// See [`crate::Controller::resume`].
    pub(crate) fn resume(&self) {
        let mut st = self.lock();
        if st.quiesced {
            self.resume_locked(&mut st);
        }
    }

    /// See [`crate::Controller::save`].
    pub(crate) fn save(&self) -> Result<ControllerState, SaveError> {
        let st = self.lock();
        if !st.quiesced {
            return Err(SaveError::NotQuiesced);
        }
        if self.messages.load(Ordering::Acquire) {
            return Err(SaveError::DmaMessages);
        }
        let mut cqs = Vec::with_capacity(st.groups.len());
        let mut sqs = Vec::with_capacity(st.sq_owner.len());
        for (cqid, entry) in &st.groups {
            let Place::Parked(g) = &entry.place else {
                return Err(SaveError::LostGroup(*cqid));
            };
            let cq = &g.out.cq;
            cqs.push(CqState {
                qid: cq.qid,
                base: cq.base,
                size: cq.size,
                vector: cq.vector,
                ien: cq.ien,
                head: cq.head,
                tail: cq.tail,
                phase: cq.phase,
            });
            sqs.extend(g.sqs.iter().map(|sq| SqState {
                qid: sq.ring.qid,
                base: sq.ring.base,
                size: sq.ring.size,
                cqid: *cqid,
                head: sq.ring.head,
            }));
        }
        let f = &st.features;
        let features = FeaturesState {
            arbitration: f.arbitration,
            power_state: f.power_state,
            temp_over: f.temp_over,
            temp_under: f.temp_under,
            vwc_present: f.vwc_present,
            volatile_write_cache: f.wce,
            queues: f.queues,
            coalescing: f.coalescing,
            no_coalesce: f.no_coalesce.clone(),
            async_event_config: f.async_events,
            keep_alive_ms: f.kato,
            error_recovery: f.error_recovery,
            write_atomicity: f.write_atomicity,
            host_behavior_acre: f.acre,
        };
        let error_log = {
            let log = self.shared.errors.lock().unwrap_or_else(|e| e.into_inner());
            ErrorLogState {
                count: log.count,
                entries: log
                    .ring
                    .iter()
                    .map(|e| ErrorEntryState {
                        count: e.count,
                        sqid: e.sqid,
                        cid: e.cid,
                        status: e.status.0,
                        lba: e.lba,
                        nsid: e.nsid,
                    })
                    .collect(),
            }
        };
        let t = self.totals(&st);
        let r = &st.regs;
        let state = ControllerState {
            version: STATE_VERSION,
            limits: self.limits(),
            regs: RegsState {
                cc: r.cc,
                aqa: r.aqa,
                asq: r.asq,
                acq: r.acq,
                intms: r.intms,
                rdy: r.rdy,
                cfs: r.cfs,
                shst: r.shst,
            },
            fatal: self.shared.fatal.load(Ordering::Acquire),
            doorbells_mapped: self.shared.mapped.load(Ordering::Acquire),
            admin: st.admin.map(|a| AdminQueueState {
                sq_head: a.sq.head,
                cq_head: a.cq.head,
                cq_tail: a.cq.tail,
                cq_phase: a.cq.phase,
            }),
            cqs,
            sqs,
            shadow: st.shadow.map(|s| ShadowState {
                doorbells: s.db,
                event_idx: s.ei,
            }),
            features,
            aer_cids: st.aer.clone(),
            events: st.events.iter().copied().collect(),
            changed_ns: st.changed_ns.iter().copied().collect(),
            ns_event_masked: st.ns_event_masked,
            admin_done: st.done.iter().map(|(c, s)| (*c, s.0)).collect(),
            namespaces: st
                .ns
                .iter()
                .enumerate()
                .filter_map(|(i, n)| {
                    let ns = n.as_ref()?;
                    Some(NamespaceState {
                        nsid: u32::try_from(i + 1).ok()?,
                        block_size: ns.info.block_size,
                    })
                })
                .collect(),
            error_log,
            counters: CountersState {
                ops: t.io.ops,
                bytes: t.io.bytes,
                errors: t.io.errors,
                shadow_doorbell_reads: t.shadow_reads,
            },
            admin_commands: st.admin_commands,
        };
        // From now on the doorbell page belongs to whoever restores this state.
        self.handed_over.store(true, Ordering::Release);
        Ok(state)
    }

    /// See [`crate::Controller::restore`].
    pub(crate) fn restore(&self, s: ControllerState) -> Result<(), RestoreError> {
        if s.version != STATE_VERSION {
            return Err(RestoreError::Version(s.version));
        }
        let mut st = self.lock();
        let fresh = st.regs.cc == 0
            && st.admin.is_none()
            && st.groups.is_empty()
            && st.sq_owner.is_empty()
            && !st.quiesced
            && st.format.is_none();
        if !fresh {
            return Err(RestoreError::NotFresh);
        }
        let (_, map) = self.mem.snapshot();
        let plan = self.check(&st, &s, &map)?;
        let mapped = self.shared.mapped.load(Ordering::Acquire);
        self.apply(&mut st, s, plan).inspect_err(|_| {
            // Back to fresh; the doorbell page is the client's, not ours to clear.
            let was = self.handed_over.swap(true, Ordering::AcqRel);
            self.disable(&mut st);
            st.regs.reset();
            st.retired = Totals::default();
            st.admin_commands = 0;
            *self.shared.errors.lock().unwrap_or_else(|e| e.into_inner()) = ErrorLog::default();
            self.shared.mapped.store(mapped, Ordering::Release);
            self.handed_over.store(was, Ordering::Release);
        })
    }

    /// Checks a state against this controller and the memory map, changing nothing.
    /// Returns each namespace's facts in the state's LBA size.
    fn check(
        &self,
        st: &State,
        s: &ControllerState,
        map: &MemoryMap,
    ) -> Result<Vec<(u32, BlockInfo)>, RestoreError> {
        let limits = self.limits();
        if s.limits != limits {
            return Err(RestoreError::Config(
                "limits (I/O queues, queue entries, vectors, namespaces) differ",
            ));
        }
        let cfg = &self.cfg;
        let mapped = |what, base: u64, len: usize, access| {
            map.translate(base, len, access)
                .map(|_| ())
                .map_err(|_| RestoreError::Unmapped {
                    what,
                    base,
                    len: len as u64,
                })
        };
        let aligned = |what: &str, base: u64| {
            if base == 0 || !base.is_multiple_of(4096) {
                return Err(invalid(format!(
                    "{what} base {base:#x} is not page aligned"
                )));
            }
            Ok(())
        };
        let r = &s.regs;
        if r.shst > regs::SHST_COMPLETE {
            return Err(invalid(format!("CSTS.SHST {}", r.shst)));
        }
        if r.aqa & !0x0fff_0fff != 0 {
            return Err(invalid(format!("AQA {:#x}", r.aqa)));
        }
        let io_queues = !s.cqs.is_empty() || !s.sqs.is_empty();
        match &s.admin {
            Some(a) => {
                let asqs = (r.aqa & 0xfff) + 1;
                let acqs = ((r.aqa >> 16) & 0xfff) + 1;
                if r.cc & regs::CC_EN == 0 || !r.rdy {
                    return Err(invalid("admin queues without CC.EN and CSTS.RDY"));
                }
                if regs::cc_css(r.cc) != 0 || regs::cc_mps(r.cc) != 0 || regs::cc_ams(r.cc) != 0 {
                    return Err(invalid(format!("CC {:#x}", r.cc)));
                }
                if asqs < 2 || acqs < 2 {
                    return Err(invalid("admin queue of fewer than 2 entries"));
                }
                aligned("admin SQ", r.asq)?;
                aligned("admin CQ", r.acq)?;
                mapped("admin SQ", r.asq, asqs as usize * SQE_SIZE, Access::Read)?;
                mapped("admin CQ", r.acq, acqs as usize * CQE_SIZE, Access::Write)?;
                if u32::from(a.sq_head) >= asqs
                    || u32::from(a.cq_head) >= acqs
                    || u32::from(a.cq_tail) >= acqs
                {
                    return Err(invalid("admin queue index beyond its size"));
                }
                if s.admin_done.len() >= acqs as usize {
                    return Err(invalid("more finished admin commands than the admin CQ"));
                }
                if io_queues && (regs::cc_iosqes(r.cc) != 6 || regs::cc_iocqes(r.cc) != 4) {
                    return Err(invalid("I/O queues with CC.IOSQES/IOCQES other than 6/4"));
                }
            }
            None => {
                if io_queues
                    || s.shadow.is_some()
                    || !s.aer_cids.is_empty()
                    || !s.events.is_empty()
                    || !s.admin_done.is_empty()
                {
                    return Err(invalid("queues or commands without an admin queue"));
                }
                if r.rdy && !r.cfs && !s.fatal {
                    return Err(invalid("CSTS.RDY without an admin queue"));
                }
            }
        }
        // Features.
        let f = &s.features;
        let ours = Features::new(cfg, Self::any_write_cache(&st.ns));
        if f.queues != ours.queues {
            return Err(RestoreError::Config("Number of Queues granted differs"));
        }
        if f.vwc_present != ours.vwc_present {
            return Err(RestoreError::Config(
                "volatile write cache presence differs",
            ));
        }
        if f.volatile_write_cache && !f.vwc_present {
            return Err(invalid("write cache enabled without one"));
        }
        if f.no_coalesce.len() != ours.no_coalesce.len() {
            return Err(invalid(
                "Interrupt Vector Configuration for another vector count",
            ));
        }
        if f.power_state != 0
            || f.coalescing > 0xffff
            || f.error_recovery > 0xffff
            || f.write_atomicity > 1
        {
            return Err(invalid("a feature value Set Features never accepts"));
        }
        // I/O queues.
        let in_range = |qid: u16| qid != 0 && qid <= cfg.max_io_queues;
        let size_ok = |n: u16| n >= 2 && n <= cfg.max_queue_entries;
        let mut cqids = BTreeSet::new();
        for cq in &s.cqs {
            if !in_range(cq.qid) || !cqids.insert(cq.qid) {
                return Err(invalid(format!(
                    "CQ id {} out of range or repeated",
                    cq.qid
                )));
            }
            if !size_ok(cq.size) {
                return Err(invalid(format!("CQ {} size {}", cq.qid, cq.size)));
            }
            if cq.vector >= cfg.msix_vectors {
                return Err(invalid(format!("CQ {} vector {}", cq.qid, cq.vector)));
            }
            if cq.head >= cq.size || cq.tail >= cq.size {
                return Err(invalid(format!("CQ {} index beyond its size", cq.qid)));
            }
            aligned("I/O CQ", cq.base)?;
            mapped(
                "I/O CQ",
                cq.base,
                usize::from(cq.size) * CQE_SIZE,
                Access::Write,
            )?;
        }
        let allocated_cqs = (f.queues >> 16) + 1;
        let mut sqids = BTreeSet::new();
        for sq in &s.sqs {
            if !in_range(sq.qid) || !sqids.insert(sq.qid) {
                return Err(invalid(format!(
                    "SQ id {} out of range or repeated",
                    sq.qid
                )));
            }
            if !cqids.contains(&sq.cqid) || u32::from(sq.cqid) > allocated_cqs {
                return Err(invalid(format!("SQ {} on CQ {}", sq.qid, sq.cqid)));
            }
            if !size_ok(sq.size) || sq.head >= sq.size {
                return Err(invalid(format!(
                    "SQ {} size {} head {}",
                    sq.qid, sq.size, sq.head
                )));
            }
            aligned("I/O SQ", sq.base)?;
            mapped(
                "I/O SQ",
                sq.base,
                usize::from(sq.size) * SQE_SIZE,
                Access::Read,
            )?;
        }
        if let Some(sh) = &s.shadow {
            for (what, a) in [
                ("shadow doorbells", sh.doorbells),
                ("EventIdx", sh.event_idx),
            ] {
                aligned(what, a)?;
                mapped(what, a, 4096, Access::Write)?;
                if map.is_remote(a) {
                    return Err(invalid(format!("{what} in unshared client memory")));
                }
            }
        }
        // Admin command and event bookkeeping.
        if s.aer_cids.len() > usize::from(AERL) + 1 {
            return Err(invalid("more Asynchronous Event Requests than AERL allows"));
        }
        if s.events.len() > MAX_EVENTS {
            return Err(invalid("too many queued events"));
        }
        if s.changed_ns.len() > MAX_CHANGED_NS
            || s.changed_ns
                .iter()
                .any(|&n| n == 0 || n > cfg.max_namespaces)
        {
            return Err(invalid("Changed Namespace List out of range"));
        }
        if s.error_log.entries.len() > ERROR_LOG_ENTRIES {
            return Err(invalid("error log longer than its ring"));
        }
        // Namespaces: the same ones, each in an LBA size its backend can take.
        let ours: BTreeMap<u32, &crate::ns::Ns> = st
            .ns
            .iter()
            .enumerate()
            .filter_map(|(i, n)| Some((u32::try_from(i + 1).ok()?, n.as_ref()?)))
            .collect();
        let theirs: BTreeSet<u32> = s.namespaces.iter().map(|n| n.nsid).collect();
        if theirs.len() != s.namespaces.len() || !theirs.iter().eq(ours.keys()) {
            return Err(RestoreError::Config("active namespaces differ"));
        }
        let mut infos = Vec::with_capacity(s.namespaces.len());
        for n in &s.namespaces {
            let Some(ns) = ours.get(&n.nsid) else {
                return Err(RestoreError::Config("active namespaces differ"));
            };
            let info = if n.block_size == ns.info.block_size {
                ns.info.clone()
            } else {
                crate::admin::format::info_in_block_size(ns, n.block_size).map_err(|_| {
                    RestoreError::Namespace {
                        nsid: n.nsid,
                        block_size: n.block_size,
                    }
                })?
            };
            infos.push((n.nsid, info));
        }
        Ok(infos)
    }

    /// Puts a checked state in place and starts the queues.
    fn apply(
        &self,
        st: &mut State,
        s: ControllerState,
        infos: Vec<(u32, BlockInfo)>,
    ) -> Result<(), RestoreError> {
        for (nsid, info) in infos {
            if let Some(ns) = st.ns_mut(nsid) {
                ns.info = info;
            }
        }
        let r = s.regs;
        st.regs.cc = r.cc;
        st.regs.aqa = r.aqa;
        st.regs.asq = r.asq;
        st.regs.acq = r.acq;
        st.regs.intms = r.intms;
        st.regs.rdy = r.rdy;
        st.regs.cfs = r.cfs;
        st.regs.shst = r.shst;
        let f = s.features;
        let features = &mut st.features;
        features.arbitration = f.arbitration;
        features.power_state = f.power_state;
        features.temp_over = f.temp_over;
        features.temp_under = f.temp_under;
        features.wce = f.volatile_write_cache;
        features.coalescing = f.coalescing;
        features.no_coalesce = f.no_coalesce;
        features.async_events = f.async_event_config;
        features.kato = f.keep_alive_ms;
        features.error_recovery = f.error_recovery;
        features.write_atomicity = f.write_atomicity;
        features.acre = f.host_behavior_acre;
        self.shared.wce.store(st.features.wce, Ordering::Relaxed);
        self.shared
            .publish_interrupt_features(st.features.coalescing, &st.features.no_coalesce);
        st.admin = s.admin.map(|a| {
            let asqs = crate::bits::lo16((r.aqa & 0xfff) + 1);
            let acqs = crate::bits::lo16(((r.aqa >> 16) & 0xfff) + 1);
            let mut cq = CqRing::new(0, r.acq, acqs, true, 0);
            cq.head = a.cq_head;
            cq.tail = a.cq_tail;
            cq.phase = a.cq_phase;
            AdminQueues {
                sq: SqRing {
                    qid: 0,
                    base: r.asq,
                    size: asqs,
                    head: a.sq_head,
                },
                cq,
            }
        });
        st.shadow = s.shadow.map(|sh| Shadow {
            db: sh.doorbells,
            ei: sh.event_idx,
        });
        st.aer = s.aer_cids;
        st.events = s.events.into();
        st.changed_ns = s.changed_ns.into_iter().collect();
        st.ns_event_masked = s.ns_event_masked;
        st.done = s
            .admin_done
            .into_iter()
            .map(|(c, v)| (c, Status(v)))
            .collect();
        st.admin_commands = s.admin_commands;
        st.retired = Totals {
            io: trace::IoTotals {
                ops: s.counters.ops,
                bytes: s.counters.bytes,
                errors: s.counters.errors,
            },
            shadow_reads: s.counters.shadow_doorbell_reads,
        };
        *self.shared.errors.lock().unwrap_or_else(|e| e.into_inner()) = ErrorLog {
            count: s.error_log.count,
            ring: s
                .error_log
                .entries
                .iter()
                .map(|e| ErrorEntry {
                    count: e.count,
                    sqid: e.sqid,
                    cid: e.cid,
                    status: Status(e.status),
                    lba: e.lba,
                    nsid: e.nsid,
                })
                .collect(),
        };
        self.shared
            .mapped
            .store(s.doorbells_mapped, Ordering::Release);
        self.shared.fatal.store(s.fatal, Ordering::Release);
        // The queues, with their positions; the doorbell page and the shadow
        // buffers are left as the host wrote them.
        for c in &s.cqs {
            let mut cq = CqRing::new(c.qid, c.base, c.size, c.ien, c.vector);
            cq.head = c.head;
            cq.tail = c.tail;
            cq.phase = c.phase;
            let mut g =
                QueueGroup::new(self.shared.clone(), self.mem.clone(), cq, st.shadow, &st.ns)
                    .map_err(RestoreError::Backend)?;
            for sq in s.sqs.iter().filter(|sq| sq.cqid == c.qid) {
                g.add_sq(SqRing {
                    qid: sq.qid,
                    base: sq.base,
                    size: sq.size,
                    head: sq.head,
                });
                st.sq_owner.insert(sq.qid, c.qid);
            }
            self.place_group(st, g)
                .map_err(|_| RestoreError::Reactor(c.qid))?;
        }
        if st.admin.is_some() {
            st.restart_keep_alive();
            // Admin commands rung during the pause.
            self.admin_kick(st);
        }
        trace::limited!(
            self.shared.log,
            info,
            cntlid = self.cfg.cntlid,
            io_cqs = s.cqs.len(),
            io_sqs = s.sqs.len(),
            "nvme: controller state restored"
        );
        Ok(())
    }
}
