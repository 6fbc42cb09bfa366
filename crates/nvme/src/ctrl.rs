//! The control path of a controller: registers, the admin queue (its pass is
//! `admin/pass.rs`), the registry of queue groups and where they run. What reactors
//! read is in `shared.rs`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use engine::{Engine, Placer, PollerId, Waker};
use guest_mem::DmaSpace;

use crate::admin::features::Features;
use crate::admin::format_job::FormatRun;
use crate::io::{GroupPoller, QueueGroup, Shadow};
use crate::log::{GroupCounters, Totals};
use crate::ns::Ns;
use crate::queue::{CqRing, SqRing};
use crate::regs::{self, Regs};
pub(crate) use crate::shared::Shared;
use crate::status::Status;
use crate::{ControllerConfig, DOORBELL_OFFSET};

/// Registers (or with `gone`, forgets) the doorbells of group `g`'s queues.
fn db_targets(shared: &Shared, g: &QueueGroup, waker: Option<Waker>, gone: bool) {
    let cq = (g.out.cq.qid, g.out.cq.size);
    let sqs = g.sqs.iter().map(|sq| (sq.ring.qid, sq.ring.size));
    shared.set_db_targets(cq, sqs, waker, gone);
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct AdminQueues {
    pub sq: SqRing,
    pub cq: CqRing,
}

pub(crate) enum Place {
    Parked(Box<QueueGroup>),
    Running {
        id: PollerId,
        back: Receiver<Box<QueueGroup>>,
    },
    /// Taken by the control path (or lost with a stopped reactor).
    Out,
}

pub(crate) struct GroupEntry {
    pub counters: GroupCounters,
    pub mailbox: Arc<trace::Mailbox>,
    pub place: Place,
}

pub(crate) struct State {
    pub regs: Regs,
    pub admin: Option<AdminQueues>,
    /// Queue groups by CQ id.
    pub groups: BTreeMap<u16, GroupEntry>,
    /// SQ id -> CQ id.
    pub sq_owner: BTreeMap<u16, u16>,
    pub features: Features,
    pub aer: Vec<u16>,
    pub events: VecDeque<u32>,
    pub shadow: Option<Shadow>,
    pub retired: Totals,
    /// Metrics and traces of deleted queue groups, merged per CQ id (bounded by the
    /// number of queue ids).
    pub retired_queues: BTreeMap<u16, trace::QueueSnapshot>,
    pub admin_commands: u64,
    /// Successful Doorbell Buffer Config commands: unlike `shadow`, which a reset
    /// clears, this still says at exit that the host used shadow doorbells.
    pub doorbell_buffer_configs: u64,
    /// Active namespaces by `nsid - 1` (the reactors hold their own copy per group).
    pub ns: Vec<Option<Ns>>,
    /// The Format NVM in progress (one at a time).
    pub format: Option<FormatRun>,
    /// Admin commands that finished after they left `exec_admin` (Format NVM), as
    /// (CID, status): posted by the next `admin_poll`.
    pub done: VecDeque<(u16, Status)>,
    /// Changed Namespace List (log page 04h) since the host last read it.
    pub changed_ns: std::collections::BTreeSet<u32>,
    /// A Namespace Attribute Changed event was queued and the host has not read the
    /// log yet: further changes only extend the list (the event type is masked).
    pub ns_event_masked: bool,
    pub placer: Placer,
    /// When the Keep Alive Timer expires (KATO set and not 0); restarted by each
    /// Keep Alive command.
    pub keep_alive: Option<Instant>,
    /// Paused for a handover (`handover/`): no admin or I/O command is
    /// fetched, queue groups are parked off their reactors, the Keep Alive Timer
    /// is stopped.
    pub paused: bool,
}

impl State {
    /// Active namespace `nsid` (None: out of range or inactive).
    pub fn ns(&self, nsid: u32) -> Option<&Ns> {
        self.ns.get((nsid as usize).checked_sub(1)?)?.as_ref()
    }

    pub fn ns_mut(&mut self, nsid: u32) -> Option<&mut Ns> {
        self.ns.get_mut((nsid as usize).checked_sub(1)?)?.as_mut()
    }

    /// Starts or restarts the Keep Alive Timer from the current KATO (milliseconds,
    /// rounded up to the 100 ms granularity Identify reports in KAS).
    pub fn restart_keep_alive(&mut self) {
        let kato = u64::from(self.features.kato);
        self.keep_alive =
            (kato != 0).then(|| Instant::now() + Duration::from_millis(kato.div_ceil(100) * 100));
    }
}

pub(crate) struct Inner {
    /// Itself, for work that outlives a call (a Format NVM's erase thread).
    pub me: Weak<Inner>,
    pub cfg: ControllerConfig,
    pub shared: Arc<Shared>,
    pub engine: Arc<Engine>,
    pub mem: Arc<DmaSpace>,
    pub state: Mutex<State>,
    pub stop: AtomicBool,
    /// The client's memory (some of it) moves by messages: queue groups wait for
    /// the client, so they run on `own_reactor`, not on reactors other
    /// controllers share (docs/decisions/0020-dma-messages.md). Until it goes.
    pub messages: AtomicBool,
    /// This controller's own reactor, started the first time a client needed one
    /// and stopped when that client goes (or with the controller).
    pub own_reactor: Mutex<Option<usize>>,
    /// An admin pass runs on a thread of its own (mapped admin doorbells with
    /// memory that moves by messages, see `service.rs`).
    pub admin_running: AtomicBool,
    /// Requests for such a pass (see [`Inner::admin_elsewhere`]).
    pub admin_kicks: AtomicU64,
    /// Its state was saved for another controller that takes the client over
    /// (`handover/`): it must not touch the doorbell page again (a reset or
    /// shutdown clears it otherwise). Cleared by `resume`.
    pub handed_over: AtomicBool,
}

impl Inner {
    pub fn new(
        me: Weak<Inner>,
        cfg: ControllerConfig,
        shared: Arc<Shared>,
        engine: Arc<Engine>,
        placer: Placer,
        mem: Arc<DmaSpace>,
        ns: Vec<Option<Ns>>,
    ) -> Inner {
        let cap = regs::capabilities(cfg.max_queue_entries.saturating_sub(1));
        let features = Features::new(&cfg, shared.wce.load(Ordering::Relaxed));
        Inner {
            me,
            cfg,
            shared,
            engine,
            mem,
            state: Mutex::new(State {
                regs: Regs::new(cap),
                admin: None,
                groups: BTreeMap::new(),
                sq_owner: BTreeMap::new(),
                features,
                aer: Vec::new(),
                events: VecDeque::new(),
                shadow: None,
                retired: Totals::default(),
                retired_queues: BTreeMap::new(),
                admin_commands: 0,
                doorbell_buffer_configs: 0,
                ns,
                format: None,
                done: VecDeque::new(),
                changed_ns: Default::default(),
                ns_event_masked: false,
                placer,
                keep_alive: None,
                paused: false,
            }),
            stop: AtomicBool::new(false),
            messages: AtomicBool::new(false),
            own_reactor: Mutex::new(None),
            admin_running: AtomicBool::new(false),
            admin_kicks: AtomicU64::new(0),
            handed_over: AtomicBool::new(false),
        }
    }

    /// Runs admin passes on a short-lived thread of this controller until no
    /// request for one is left (one such thread at a time): for a client whose
    /// memory moves by messages, whose admin commands wait for its replies. The
    /// thread that received the doorbell (the client's connection) stays free to
    /// serve the client meanwhile, which QEMU needs: it answers our DMA requests
    /// only while none of its own waits for us.
    pub fn admin_elsewhere(&self) {
        self.admin_kicks.fetch_add(1, Ordering::SeqCst);
        if self.admin_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(me) = self.me.upgrade() else {
            self.admin_running.store(false, Ordering::Release);
            return;
        };
        let pass = move || loop {
            let k = me.admin_kicks.load(Ordering::SeqCst);
            {
                let mut st = me.lock();
                me.admin_poll(&mut st);
            }
            if me.admin_kicks.load(Ordering::SeqCst) != k {
                continue;
            }
            me.admin_running.store(false, Ordering::SeqCst);
            // A request that came between the check and the store is ours again.
            if me.admin_kicks.load(Ordering::SeqCst) == k
                || me.admin_running.swap(true, Ordering::AcqRel)
            {
                break;
            }
        };
        if let Err(e) = sandbox::spawn(sandbox::Role::NvmeAdmin, "nvme-admin-dma".into(), pass) {
            tracing::warn!("nvme: cannot start an admin thread ({e})");
            self.admin_running.store(false, Ordering::Release);
        }
    }

    /// The reactor this controller's queue groups run on while its client's
    /// memory moves by messages (started on first use).
    fn own_reactor(&self) -> Result<usize, engine::EngineError> {
        let mut r = self.own_reactor.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = *r {
            return Ok(i);
        }
        let i = self.engine.add_reactor(None)?;
        *r = Some(i);
        Ok(i)
    }

    /// The client maps writable memory without a file descriptor: from now on
    /// queue groups run on this controller's own reactor (those running move there
    /// now, before that memory can be used), since they wait for the client; admin
    /// passes that may wait leave the shared admin thread (`service.rs`).
    pub fn use_messages(&self) -> Result<(), i32> {
        let mut st = self.lock();
        self.own_reactor().map_err(|e| {
            tracing::error!("nvme: cannot start a reactor for DMA by messages: {e}");
            libc::EAGAIN
        })?;
        if self.messages.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        for cqid in ids {
            if let Some(g) = self.take_group(&mut st, cqid) {
                self.place_group(&mut st, g).map_err(|_| libc::EAGAIN)?;
            }
        }
        Ok(())
    }

    /// Stops this controller's own reactor (its client went, or the controller).
    /// Its groups must be gone.
    pub fn stop_own_reactor(&self) {
        let r = self
            .own_reactor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(i) = r {
            self.engine.stop_reactor(i);
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn read32(&self, off: u64) -> u32 {
        if (DOORBELL_OFFSET..DOORBELL_OFFSET + 0x1000).contains(&off) {
            return self
                .shared
                .doorbells
                .all()
                .load_u32(off as usize)
                .map(u32::from_le)
                .unwrap_or(0);
        }
        let fatal = self.shared.fatal.load(Ordering::Acquire);
        self.lock().regs.read32(off, fatal)
    }

    pub fn write32(&self, off: u64, v: u32) {
        if (DOORBELL_OFFSET..DOORBELL_OFFSET + 0x1000).contains(&off) {
            // Same page the client may map: a doorbell by message lands where the
            // pollers look.
            self.shared
                .doorbells
                .all()
                .store_u32(off as usize, v.to_le());
            if off < DOORBELL_OFFSET + 8 {
                if self.messages.load(Ordering::Acquire) {
                    // Its pass may wait for the client's replies: not on the thread
                    // that must answer the client meanwhile.
                    self.admin_elsewhere();
                } else {
                    // The admin queue, by message: handled here, on the client's thread.
                    let mut st = self.lock();
                    self.admin_poll(&mut st);
                }
            } else {
                self.shared.rang(off, v);
            }
            return;
        }
        let mut st = self.lock();
        if off == regs::CC {
            self.write_cc(&mut st, v);
        } else {
            st.regs.write_plain(off, v);
        }
    }

    fn write_cc(&self, st: &mut State, v: u32) {
        let old = st.regs.cc;
        st.regs.cc = v;
        let was = old & regs::CC_EN != 0;
        let now = v & regs::CC_EN != 0;
        if was && !now {
            self.disable(st);
            st.regs.cc = v;
        } else if !was && now {
            self.enable(st);
        }
        if regs::cc_shn(v) != 0 && regs::cc_shn(old) == 0 {
            // Nothing is buffered in the controller: backends own durability, and the
            // host flushes volatile caches before shutting down.
            st.regs.shst = regs::SHST_COMPLETE;
        }
    }

    fn enable(&self, st: &mut State) {
        let r = &st.regs;
        let asqs = (r.aqa & 0xfff) + 1;
        let acqs = ((r.aqa >> 16) & 0xfff) + 1;
        let bad = regs::cc_css(r.cc) != 0
            || regs::cc_mps(r.cc) != 0
            || regs::cc_ams(r.cc) != 0
            || asqs < 2
            || acqs < 2
            || !r.asq.is_multiple_of(4096)
            || !r.acq.is_multiple_of(4096)
            || r.asq == 0
            || r.acq == 0;
        if bad {
            trace::limited!(
                self.shared.log,
                warn,
                cc = r.cc,
                aqa = r.aqa,
                "nvme: invalid controller enable"
            );
            st.regs.cfs = true;
            return;
        }
        st.admin = Some(AdminQueues {
            sq: SqRing {
                qid: 0,
                base: r.asq,
                size: asqs as u16,
                head: 0,
            },
            cq: CqRing::new(0, r.acq, acqs as u16, true, 0),
        });
        st.regs.shst = 0;
        st.regs.rdy = true;
        trace::limited!(
            self.shared.log,
            info,
            cntlid = self.cfg.cntlid,
            admin_sq = asqs,
            admin_cq = acqs,
            "nvme: controller enabled"
        );
    }

    /// CC.EN 1->0: every queue goes, state back to power-on except registers the
    /// host programs before enabling again.
    pub fn disable(&self, st: &mut State) {
        if st.regs.rdy {
            trace::limited!(
                self.shared.log,
                info,
                cntlid = self.cfg.cntlid,
                "nvme: controller disabled"
            );
        }
        self.teardown_queues(st);
        st.admin = None;
        st.aer.clear();
        st.events.clear();
        // A format in progress carries on, but its command went with the queues.
        st.done.clear();
        if let Some(f) = &mut st.format {
            f.cid = None;
        }
        st.changed_ns.clear();
        st.ns_event_masked = false;
        st.shadow = None;
        st.keep_alive = None;
        st.features = Features::new(&self.cfg, Self::any_write_cache(&st.ns));
        self.shared.wce.store(st.features.wce, Ordering::Relaxed);
        self.shared
            .publish_interrupt_features(st.features.coalescing, &st.features.no_coalesce);
        st.regs.rdy = false;
        st.regs.cfs = false;
        st.regs.shst = 0;
        // After a handover the page is the new controller's.
        if !self.handed_over.load(Ordering::Acquire) {
            self.shared.clear_doorbells();
        }
        self.shared.fatal.store(false, Ordering::Release);
    }

    pub fn any_write_cache(ns: &[Option<Ns>]) -> bool {
        ns.iter().flatten().any(|n| n.info.write_cache)
    }

    /// See `Controller::restore_lost`. CC reads back enabled with the entry sizes
    /// every driver programs (a driver keeps its own copy to write back).
    pub fn restore_lost(&self) {
        let mut st = self.lock();
        self.disable(&mut st);
        st.regs.cc = regs::CC_EN | (6 << 16) | (4 << 20);
        st.regs.rdy = true;
        st.regs.cfs = true;
        trace::limited!(
            self.shared.log,
            warn,
            cntlid = self.cfg.cntlid,
            "nvme: resumed a client after the server process died: controller fatal \
             status until the host resets the controller"
        );
    }

    /// Full reset: like CC.EN 1->0 plus every register back to its reset value.
    pub fn reset(&self) {
        let mut st = self.lock();
        self.disable(&mut st);
        st.regs.reset();
    }

    pub fn teardown_queues(&self, st: &mut State) {
        // Groups waiting for the client's replies give up: we wait for them here,
        // and the client may be waiting for us.
        let _paused = self.mem.pause_remote();
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        for cqid in ids {
            if let Some(mut g) = self.take_group(st, cqid) {
                g.drain();
                st.retire(&g);
            }
            st.groups.remove(&cqid);
        }
        st.sq_owner.clear();
    }

    /// Gets a group's state back from wherever it is (parked or on a reactor).
    /// The registry entry stays; the caller puts the group back with `place_group`.
    pub fn take_group(&self, st: &mut State, cqid: u16) -> Option<Box<QueueGroup>> {
        let entry = st.groups.get_mut(&cqid)?;
        match std::mem::replace(&mut entry.place, Place::Out) {
            Place::Out => None,
            Place::Parked(g) => {
                db_targets(&self.shared, &g, None, true);
                Some(g)
            }
            Place::Running { id, back } => {
                let p = self.engine.remove_poller(id).ok().flatten();
                drop(p);
                let g = back.try_recv().ok()?;
                db_targets(&self.shared, &g, None, true);
                Some(g)
            }
        }
    }

    /// Parks a group without SQs (nothing to poll) or while the controller is
    /// paused, or hands it to its reactor.
    pub fn place_group(&self, st: &mut State, g: Box<QueueGroup>) -> Result<(), Status> {
        let cqid = g.out.cq.qid;
        let counters = g.out.counters();
        let mailbox = g.out.rec.mailbox();
        let place = if g.sqs.is_empty() || st.paused {
            let mut g = g;
            g.park();
            db_targets(&self.shared, &g, None, false);
            Place::Parked(g)
        } else {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let mut g = g;
            g.resync();
            // Guest RAM that moves by messages: the group waits for the client, on
            // a reactor of this controller's own.
            let own = if self.messages.load(Ordering::Acquire) {
                self.own_reactor().ok()
            } else {
                None
            };
            g.own = own.is_some();
            let poller = GroupPoller {
                group: Some(g),
                back: tx,
            };
            let reactor = own.unwrap_or_else(|| st.placer.reactor_for(usize::from(cqid)));
            if let Some(g) = &poller.group {
                // Before the reactor has it: a doorbell by message from now on wakes
                // the reactor, which polls the group first thing anyway.
                db_targets(&self.shared, g, self.engine.waker(reactor), false);
            }
            match self.engine.add_poller(reactor, Box::new(poller)) {
                Ok(id) => Place::Running { id, back: rx },
                Err(e) => {
                    tracing::error!("nvme: cannot start queue group {cqid}: {e}");
                    // The poller was dropped and sent the group back.
                    if let Ok(mut g) = rx.try_recv() {
                        db_targets(&self.shared, &g, None, true);
                        g.drain();
                        st.retire(&g);
                    }
                    st.groups.remove(&cqid);
                    st.sq_owner.retain(|_, c| *c != cqid);
                    return Err(Status::INTERNAL_ERROR);
                }
            }
        };
        st.groups.insert(
            cqid,
            GroupEntry {
                counters,
                mailbox,
                place,
            },
        );
        Ok(())
    }

    /// Takes the controller out of the admin service (see `service`).
    pub fn stop_admin(&self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.cancel_format(&st);
        self.teardown_queues(&mut st);
        drop(st);
        self.stop_own_reactor();
    }
}
