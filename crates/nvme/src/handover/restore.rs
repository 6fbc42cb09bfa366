//! Restoring a [`ControllerState`] into a fresh controller. The state comes from
//! another process and is checked like guest input, in stages that change
//! nothing (`check`), before `apply` puts it in place; the stages run in the order
//! their errors were always reported.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;

use bdev::BlockInfo;
use guest_mem::{Access, MemoryMap};

use super::state::{
    invalid, AdminQueueState, ControllerState, ErrorLogState, FeaturesState, NamespaceState,
    RegsState, RestoreError, ShadowState, SqState, STATE_VERSION,
};
use crate::admin::features::Features;
use crate::ctrl::{AdminQueues, Inner, State};
use crate::identify::AERL;
use crate::io::{QueueGroup, Shadow};
use crate::log::{ErrorEntry, ErrorLog, Totals, ERROR_LOG_ENTRIES};
use crate::ns::Ns;
use crate::queue::{CqRing, SqRing, CQE_SIZE, SQE_SIZE};
use crate::regs::{self, Regs};
use crate::status::Status;
use crate::ControllerConfig;

/// Events queued for Asynchronous Event Requests a state may carry (udrive queues
/// at most a few: namespace notices are masked until the host reads the log).
const MAX_EVENTS: usize = 64;
/// Entries of the Changed Namespace List (beyond: "more than 1024 changed").
const MAX_CHANGED_NS: usize = 1024;

/// Each active namespace's facts in the LBA size the state gives it.
type Formats = Vec<(u32, BlockInfo)>;

impl Inner {
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
            && !st.paused
            && st.format.is_none();
        if !fresh {
            return Err(RestoreError::NotFresh);
        }
        let (_, map) = self.mem.snapshot();
        let formats = self.check(&st, &s, &map)?;
        let mapped = self.shared.mapped.load(Ordering::Acquire);
        self.apply(&mut st, s, formats).inspect_err(|_| {
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
    fn check(
        &self,
        st: &State,
        s: &ControllerState,
        map: &MemoryMap,
    ) -> Result<Formats, RestoreError> {
        if s.limits != self.limits() {
            return Err(RestoreError::Config(
                "limits (I/O queues, queue entries, vectors, namespaces) differ",
            ));
        }
        check_registers_and_admin(s, map)?;
        check_features(
            &s.features,
            &Features::new(&self.cfg, Self::any_write_cache(&st.ns)),
        )?;
        check_io_queues(s, &self.cfg, map)?;
        if let Some(sh) = &s.shadow {
            check_shadow(sh, map)?;
        }
        check_bookkeeping(s, self.cfg.max_namespaces)?;
        namespace_formats(&st.ns, &s.namespaces)
    }

    /// Puts a checked state in place and starts the queues.
    fn apply(
        &self,
        st: &mut State,
        s: ControllerState,
        formats: Formats,
    ) -> Result<(), RestoreError> {
        // Taken apart whole, so that a field added to the state cannot be left out
        // here unnoticed.
        let ControllerState {
            version: _,
            limits: _,
            regs,
            fatal,
            doorbells_mapped,
            admin,
            cqs,
            sqs,
            shadow,
            features,
            aer_cids,
            events,
            changed_ns,
            ns_event_masked,
            admin_done,
            namespaces: _,
            error_log,
            counters,
            admin_commands,
        } = s;
        for (nsid, info) in formats {
            if let Some(ns) = st.ns_mut(nsid) {
                ns.info = info;
            }
        }
        set_regs(&mut st.regs, &regs);
        set_features(&mut st.features, features);
        self.shared.wce.store(st.features.wce, Ordering::Relaxed);
        self.shared
            .publish_interrupt_features(st.features.coalescing, &st.features.no_coalesce);
        st.admin = admin.map(|a| admin_queues(&regs, a));
        st.shadow = shadow.map(|sh| Shadow {
            db: sh.doorbells,
            ei: sh.event_idx,
        });
        st.aer = aer_cids;
        st.events = events.into();
        st.changed_ns = changed_ns.into_iter().collect();
        st.ns_event_masked = ns_event_masked;
        st.done = admin_done
            .into_iter()
            .map(|(c, v)| (c, Status(v)))
            .collect();
        st.admin_commands = admin_commands;
        st.retired = Totals {
            io: trace::IoTotals {
                ops: counters.ops,
                bytes: counters.bytes,
                errors: counters.errors,
            },
            shadow_reads: counters.shadow_doorbell_reads,
        };
        *self.shared.errors.lock().unwrap_or_else(|e| e.into_inner()) = error_log_of(&error_log);
        self.shared
            .mapped
            .store(doorbells_mapped, Ordering::Release);
        self.shared.fatal.store(fatal, Ordering::Release);
        self.start_io_queues(st, &cqs, &sqs)?;
        if st.admin.is_some() {
            st.restart_keep_alive();
            // Admin commands rung during the pause.
            self.admin_kick(st);
        }
        trace::limited!(
            self.shared.log,
            info,
            cntlid = self.cfg.cntlid,
            io_cqs = cqs.len(),
            io_sqs = sqs.len(),
            "nvme: controller state restored"
        );
        Ok(())
    }

    /// The I/O queues at their positions, one group per CQ, on their reactors. The
    /// doorbell page and the shadow buffers are left as the host wrote them: the
    /// groups poll them first thing.
    fn start_io_queues(
        &self,
        st: &mut State,
        cqs: &[super::CqState],
        sqs: &[SqState],
    ) -> Result<(), RestoreError> {
        for c in cqs {
            let mut cq = CqRing::new(c.qid, c.base, c.size, c.ien, c.vector);
            cq.head = c.head;
            cq.tail = c.tail;
            cq.phase = c.phase;
            let mut g =
                QueueGroup::new(self.shared.clone(), self.mem.clone(), cq, st.shadow, &st.ns)
                    .map_err(RestoreError::Backend)?;
            for sq in sqs.iter().filter(|sq| sq.cqid == c.qid) {
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
        Ok(())
    }
}

/// A ring base must be a non-zero page address.
fn aligned(what: &str, base: u64) -> Result<(), RestoreError> {
    if base == 0 || !base.is_multiple_of(4096) {
        return Err(invalid(format!(
            "{what} base {base:#x} is not page aligned"
        )));
    }
    Ok(())
}

/// `len` bytes at `base` must be mapped for the controller, for `access`.
fn mapped(
    map: &MemoryMap,
    what: &'static str,
    base: u64,
    len: usize,
    access: Access,
) -> Result<(), RestoreError> {
    map.translate(base, len, access)
        .map(|_| ())
        .map_err(|_| RestoreError::Unmapped {
            what,
            base,
            len: len as u64,
        })
}

/// Registers the host programmed and, with them, the admin queue (or, without one,
/// nothing that needs it).
fn check_registers_and_admin(s: &ControllerState, map: &MemoryMap) -> Result<(), RestoreError> {
    let r = &s.regs;
    if r.shst > regs::SHST_COMPLETE {
        return Err(invalid(format!("CSTS.SHST {}", r.shst)));
    }
    if r.aqa & !0x0fff_0fff != 0 {
        return Err(invalid(format!("AQA {:#x}", r.aqa)));
    }
    match &s.admin {
        Some(a) => check_admin_queue(s, a, map),
        None => check_no_admin_queue(s),
    }
}

fn check_admin_queue(
    s: &ControllerState,
    a: &AdminQueueState,
    map: &MemoryMap,
) -> Result<(), RestoreError> {
    let r = &s.regs;
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
    mapped(
        map,
        "admin SQ",
        r.asq,
        asqs as usize * SQE_SIZE,
        Access::Read,
    )?;
    mapped(
        map,
        "admin CQ",
        r.acq,
        acqs as usize * CQE_SIZE,
        Access::Write,
    )?;
    if u32::from(a.sq_head) >= asqs || u32::from(a.cq_head) >= acqs || u32::from(a.cq_tail) >= acqs
    {
        return Err(invalid("admin queue index beyond its size"));
    }
    if s.admin_done.len() >= acqs as usize {
        return Err(invalid("more finished admin commands than the admin CQ"));
    }
    let io_queues = !s.cqs.is_empty() || !s.sqs.is_empty();
    if io_queues && (regs::cc_iosqes(r.cc) != 6 || regs::cc_iocqes(r.cc) != 4) {
        return Err(invalid("I/O queues with CC.IOSQES/IOCQES other than 6/4"));
    }
    Ok(())
}

fn check_no_admin_queue(s: &ControllerState) -> Result<(), RestoreError> {
    let io_queues = !s.cqs.is_empty() || !s.sqs.is_empty();
    if io_queues
        || s.shadow.is_some()
        || !s.aer_cids.is_empty()
        || !s.events.is_empty()
        || !s.admin_done.is_empty()
    {
        return Err(invalid("queues or commands without an admin queue"));
    }
    let r = &s.regs;
    if r.rdy && !r.cfs && !s.fatal {
        return Err(invalid("CSTS.RDY without an admin queue"));
    }
    Ok(())
}

/// Feature values against what this controller grants (`ours`, fresh) and what
/// Set Features accepts.
fn check_features(f: &FeaturesState, ours: &Features) -> Result<(), RestoreError> {
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
    Ok(())
}

/// I/O queues: ids in range and unique, sizes, vectors and indices within this
/// controller's limits, rings page aligned and mapped, each SQ on a CQ of the
/// state within the Number of Queues granted.
fn check_io_queues(
    s: &ControllerState,
    cfg: &ControllerConfig,
    map: &MemoryMap,
) -> Result<(), RestoreError> {
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
        let len = usize::from(cq.size) * CQE_SIZE;
        mapped(map, "I/O CQ", cq.base, len, Access::Write)?;
    }
    let allocated_cqs = (s.features.queues >> 16) + 1;
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
        let len = usize::from(sq.size) * SQE_SIZE;
        mapped(map, "I/O SQ", sq.base, len, Access::Read)?;
    }
    Ok(())
}

/// Shadow doorbell and EventIdx buffers: what Doorbell Buffer Config accepts, whole
/// pages of shared guest memory (one in unshared client memory would have to be
/// fetched on every poll).
fn check_shadow(sh: &ShadowState, map: &MemoryMap) -> Result<(), RestoreError> {
    for (what, a) in [
        ("shadow doorbells", sh.doorbells),
        ("EventIdx", sh.event_idx),
    ] {
        aligned(what, a)?;
        mapped(map, what, a, 4096, Access::Write)?;
        if map.is_remote(a) {
            return Err(invalid(format!("{what} in unshared client memory")));
        }
    }
    Ok(())
}

/// Admin command and event bookkeeping within the bounds the controller keeps.
fn check_bookkeeping(s: &ControllerState, max_namespaces: u32) -> Result<(), RestoreError> {
    if s.aer_cids.len() > usize::from(AERL) + 1 {
        return Err(invalid("more Asynchronous Event Requests than AERL allows"));
    }
    if s.events.len() > MAX_EVENTS {
        return Err(invalid("too many queued events"));
    }
    if s.changed_ns.len() > MAX_CHANGED_NS
        || s.changed_ns.iter().any(|&n| n == 0 || n > max_namespaces)
    {
        return Err(invalid("Changed Namespace List out of range"));
    }
    if s.error_log.entries.len() > ERROR_LOG_ENTRIES {
        return Err(invalid("error log longer than its ring"));
    }
    Ok(())
}

/// The same active namespaces as ours (`ns` by `nsid - 1`), each in an LBA size
/// its backend can take: their facts in that size.
fn namespace_formats(
    ns: &[Option<Ns>],
    theirs: &[NamespaceState],
) -> Result<Formats, RestoreError> {
    let ours: BTreeMap<u32, &Ns> = ns
        .iter()
        .enumerate()
        .filter_map(|(i, n)| Some((u32::try_from(i + 1).ok()?, n.as_ref()?)))
        .collect();
    let nsids: BTreeSet<u32> = theirs.iter().map(|n| n.nsid).collect();
    if nsids.len() != theirs.len() || !nsids.iter().eq(ours.keys()) {
        return Err(RestoreError::Config("active namespaces differ"));
    }
    let mut formats = Vec::with_capacity(theirs.len());
    for n in theirs {
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
        formats.push((n.nsid, info));
    }
    Ok(formats)
}

fn set_regs(ours: &mut Regs, r: &RegsState) {
    ours.cc = r.cc;
    ours.aqa = r.aqa;
    ours.asq = r.asq;
    ours.acq = r.acq;
    ours.intms = r.intms;
    ours.rdy = r.rdy;
    ours.cfs = r.cfs;
    ours.shst = r.shst;
}

/// Everything but what this controller's configuration fixes (Number of Queues,
/// volatile write cache presence; `check` compared those).
fn set_features(ours: &mut Features, f: FeaturesState) {
    ours.arbitration = f.arbitration;
    ours.power_state = f.power_state;
    ours.temp_over = f.temp_over;
    ours.temp_under = f.temp_under;
    ours.wce = f.volatile_write_cache;
    ours.coalescing = f.coalescing;
    ours.no_coalesce = f.no_coalesce;
    ours.async_events = f.async_event_config;
    ours.kato = f.keep_alive_ms;
    ours.error_recovery = f.error_recovery;
    ours.write_atomicity = f.write_atomicity;
    ours.acre = f.host_behavior_acre;
}

/// The admin queue pair at its positions; base and size come from ASQ/ACQ/AQA.
fn admin_queues(r: &RegsState, a: AdminQueueState) -> AdminQueues {
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
}

fn error_log_of(log: &ErrorLogState) -> ErrorLog {
    ErrorLog {
        count: log.count,
        ring: log
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
    }
}
