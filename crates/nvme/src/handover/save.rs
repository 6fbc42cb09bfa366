//! Reading a paused controller into a [`ControllerState`].

use std::sync::atomic::Ordering;

use super::state::{
    AdminQueueState, ControllerState, CountersState, CqState, ErrorEntryState, ErrorLogState,
    FeaturesState, NamespaceState, RegsState, SaveError, ShadowState, SqState, STATE_VERSION,
};
use crate::admin::features::Features;
use crate::ctrl::{AdminQueues, Inner, Place, State};
use crate::io::Shadow;
use crate::log::{ErrorLog, Totals};
use crate::ns::Ns;
use crate::regs::Regs;

impl Inner {
    /// See [`crate::Controller::save`].
    pub(crate) fn save(&self) -> Result<ControllerState, SaveError> {
        let st = self.lock();
        if !st.paused {
            return Err(SaveError::NotPaused);
        }
        if self.messages.load(Ordering::Acquire) {
            return Err(SaveError::DmaMessages);
        }
        let (cqs, sqs) = io_queues(&st)?;
        let error_log = {
            let log = self.shared.errors.lock().unwrap_or_else(|e| e.into_inner());
            ErrorLogState::from(&*log)
        };
        let state = ControllerState {
            version: STATE_VERSION,
            limits: self.limits(),
            regs: RegsState::from(&st.regs),
            fatal: self.shared.fatal.load(Ordering::Acquire),
            doorbells_mapped: self.shared.mapped.load(Ordering::Acquire),
            admin: st.admin.as_ref().map(AdminQueueState::from),
            cqs,
            sqs,
            shadow: st.shadow.as_ref().map(ShadowState::from),
            features: FeaturesState::from(&st.features),
            aer_cids: st.aer.clone(),
            events: st.events.iter().copied().collect(),
            changed_ns: st.changed_ns.iter().copied().collect(),
            ns_event_masked: st.ns_event_masked,
            admin_done: st.done.iter().map(|(c, s)| (*c, s.0)).collect(),
            namespaces: namespaces(&st.ns),
            error_log,
            counters: CountersState::from(self.totals(&st)),
            admin_commands: st.admin_commands,
        };
        // From now on the doorbell page belongs to whoever restores this state.
        self.handed_over.store(true, Ordering::Release);
        Ok(state)
    }
}

/// The I/O queues of the parked groups: CQs by id, each group's SQs in the order
/// it polls them. A group not parked was lost with its reactor.
fn io_queues(st: &State) -> Result<(Vec<CqState>, Vec<SqState>), SaveError> {
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
    Ok((cqs, sqs))
}

/// The active namespaces (`ns` by `nsid - 1`) and the LBA size each has now.
fn namespaces(ns: &[Option<Ns>]) -> Vec<NamespaceState> {
    ns.iter()
        .enumerate()
        .filter_map(|(i, n)| {
            let ns = n.as_ref()?;
            Some(NamespaceState {
                nsid: u32::try_from(i + 1).ok()?,
                block_size: ns.info.block_size,
            })
        })
        .collect()
}

impl From<&Regs> for RegsState {
    fn from(r: &Regs) -> Self {
        RegsState {
            cc: r.cc,
            aqa: r.aqa,
            asq: r.asq,
            acq: r.acq,
            intms: r.intms,
            rdy: r.rdy,
            cfs: r.cfs,
            shst: r.shst,
        }
    }
}

impl From<&AdminQueues> for AdminQueueState {
    fn from(a: &AdminQueues) -> Self {
        AdminQueueState {
            sq_head: a.sq.head,
            cq_head: a.cq.head,
            cq_tail: a.cq.tail,
            cq_phase: a.cq.phase,
        }
    }
}

impl From<&Shadow> for ShadowState {
    fn from(s: &Shadow) -> Self {
        ShadowState {
            doorbells: s.db,
            event_idx: s.ei,
        }
    }
}

impl From<&Features> for FeaturesState {
    fn from(f: &Features) -> Self {
        FeaturesState {
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
        }
    }
}

impl From<&ErrorLog> for ErrorLogState {
    fn from(log: &ErrorLog) -> Self {
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
    }
}

impl From<Totals> for CountersState {
    fn from(t: Totals) -> Self {
        CountersState {
            ops: t.io.ops,
            bytes: t.io.bytes,
            errors: t.io.errors,
            shadow_doorbell_reads: t.shadow_reads,
        }
    }
}
