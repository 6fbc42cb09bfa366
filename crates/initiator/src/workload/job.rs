//! One job's loop: keep `qd` I/Os in flight, time each, verify if asked.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::config::{IoDone, IoTarget, JobQueue, Op, WorkloadConfig};
use super::pattern;
use super::report::{rate, JobReport, LatStats, Report};
use crate::error::{Error, Result};

/// Generation of a block whose content we do not know (never written, failed write).
const UNKNOWN: u32 = 0;
const MAX_LOGGED: u64 = 5;
const STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub(crate) struct JobResult {
    job: u32,
    hist: Histogram<u64>,
    ios: u64,
    reads: u64,
    writes: u64,
    errors: u64,
    verify_errors: u64,
    unverified: u64,
    secs: f64,
    trace: Option<trace::LayerSet>,
    gaps: super::gaps::TopGaps,
}

/// The initiator's per-I/O stamps (raw trace clock), with `WorkloadConfig::trace`.
struct Tracer {
    /// Application submitted, per slot.
    submitted: Vec<u64>,
    /// Doorbell written, per slot.
    rung: Vec<u64>,
    /// Slots issued since the last doorbell.
    unrung: Vec<u32>,
}

#[derive(Clone, Copy)]
struct Slot {
    start: Instant,
    op: Op,
    block: u64,
    gen: u32,
}

struct Job<'a> {
    q: Box<dyn JobQueue + 'a>,
    cfg: &'a WorkloadConfig,
    job: u32,
    base: u64,
    nblocks: u64,
    rng: SmallRng,
    seq: u64,
    slots: Vec<Slot>,
    /// Verify state, per block of this job's region.
    gens: Vec<u32>,
    busy: Vec<bool>,
    scratch: Vec<u8>,
    tracer: Option<Tracer>,
    r: JobResult,
}

fn new_hist() -> Histogram<u64> {
    // 1 ns .. 100 s at 3 significant digits; fixed bounds so merging never resizes.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("static histogram bounds are valid")
}

pub(crate) fn run_job(
    target: &dyn IoTarget,
    cfg: &WorkloadConfig,
    job: u32,
    (base, nblocks): (u64, u64),
) -> Result<JobResult> {
    // In verify mode a block is never in flight twice, so more slots than blocks is useless.
    let qd = if cfg.verify {
        (cfg.qd as u64).min(nblocks) as u32
    } else {
        cfg.qd
    };
    let q = target.open_job(job, qd, cfg.bs)?;
    let now = Instant::now();
    let mut j = Job {
        q,
        cfg,
        job,
        base,
        nblocks,
        rng: SmallRng::seed_from_u64(cfg.seed.wrapping_add(job as u64)),
        seq: 0,
        slots: vec![
            Slot {
                start: now,
                op: Op::Read,
                block: 0,
                gen: 0,
            };
            qd as usize
        ],
        gens: if cfg.verify {
            vec![UNKNOWN; nblocks as usize]
        } else {
            Vec::new()
        },
        busy: if cfg.verify {
            vec![false; nblocks as usize]
        } else {
            Vec::new()
        },
        scratch: vec![0u8; if cfg.verify { cfg.bs as usize } else { 0 }],
        tracer: cfg.trace.then(|| Tracer {
            submitted: vec![0; qd as usize],
            rung: vec![0; qd as usize],
            unrung: Vec::with_capacity(qd as usize),
        }),
        r: JobResult {
            job,
            hist: new_hist(),
            ios: 0,
            reads: 0,
            writes: 0,
            errors: 0,
            verify_errors: 0,
            unverified: 0,
            secs: 0.0,
            trace: cfg
                .trace
                .then(|| trace::LayerSet::new(&trace::INITIATOR_LAYERS)),
            gaps: super::gaps::TopGaps::new(cfg.gaps),
        },
    };
    if cfg.verify && cfg.rw.read_pct() == 100 {
        j.prefill(qd)?;
    }
    j.main_loop(qd)?;
    Ok(j.r)
}

impl Job<'_> {
    fn pick_block(&mut self) -> u64 {
        let mut b = if self.cfg.rw.random() {
            self.rng.gen_range(0..self.nblocks)
        } else {
            let b = self.seq;
            self.seq = (self.seq + 1) % self.nblocks;
            b
        };
        if self.cfg.verify {
            // Free blocks exist: at most qd-1 others are busy and qd <= nblocks.
            while self.busy[b as usize] {
                b = (b + 1) % self.nblocks;
            }
        }
        b
    }

    fn pick_op(&mut self) -> Op {
        match self.cfg.rw.read_pct() {
            100 => Op::Read,
            0 => Op::Write,
            p => {
                if self.rng.gen_range(0..100u8) < p {
                    Op::Read
                } else {
                    Op::Write
                }
            }
        }
    }

    fn offset(&self, block: u64) -> u64 {
        (self.base + block) * self.cfg.bs as u64
    }

    fn issue(&mut self, slot: u32, op: Op, block: u64) -> Result<()> {
        let mut gen = 0;
        if self.cfg.verify {
            self.busy[block as usize] = true;
            if op == Op::Write {
                // 0 means unknown, so generations skip it when they wrap.
                gen = self.gens[block as usize].wrapping_add(1).max(1);
                let off = self.offset(block);
                pattern::fill(&mut self.scratch, off, gen, self.job);
                self.q.write_buf(slot, 0, &self.scratch)?;
            }
        }
        if let Some(t) = self.tracer.as_mut() {
            if let Some(s) = t.submitted.get_mut(slot as usize) {
                *s = trace::clock::now();
                t.unrung.push(slot);
            }
        }
        self.slots[slot as usize] = Slot {
            start: Instant::now(),
            op,
            block,
            gen,
        };
        self.q.submit(op, self.offset(block), self.cfg.bs, slot)
    }

    /// Rings the doorbell; one stamp serves every I/O queued since the last ring.
    fn commit(&mut self) -> Result<()> {
        self.q.commit()?;
        if let Some(t) = self.tracer.as_mut() {
            let now = trace::clock::now();
            for s in t.unrung.drain(..) {
                if let Some(r) = t.rung.get_mut(s as usize) {
                    *r = now;
                }
            }
        }
        Ok(())
    }

    /// Records the initiator's layers of a finished I/O seen by the poll at `seen`.
    fn trace_done(&mut self, slot: u32, write: bool, seen: u64) {
        let (Some(t), Some(set)) = (self.tracer.as_ref(), self.r.trace.as_mut()) else {
            return;
        };
        let (Some(&sub), Some(&rung)) = (t.submitted.get(slot as usize), t.rung.get(slot as usize))
        else {
            return;
        };
        let app = trace::clock::now();
        let d = trace::clock::delta_ns;
        set.record(
            write,
            &[d(sub, rung), d(rung, seen), d(seen, app), d(sub, app)],
        );
    }

    /// Accounts one completion; returns its latency in ns.
    fn complete(&mut self, d: IoDone) -> Result<u64> {
        let Some(s) = self.slots.get(d.slot as usize).copied() else {
            return Err(Error::Invalid(format!(
                "target completed unknown slot {}",
                d.slot
            )));
        };
        let lat = s.start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        if d.status != 0 {
            self.r.errors += 1;
            if self.r.errors <= MAX_LOGGED {
                tracing::warn!(
                    job = self.job,
                    block = s.block,
                    status = d.status,
                    "I/O error"
                );
            }
        }
        if self.cfg.verify {
            let b = s.block as usize;
            self.busy[b] = false;
            match s.op {
                Op::Write => self.gens[b] = if d.status == 0 { s.gen } else { UNKNOWN },
                Op::Read if d.status == 0 => {
                    let want = self.gens[b];
                    if want == UNKNOWN {
                        self.r.unverified += 1;
                    } else {
                        self.q.read_buf(d.slot, 0, &mut self.scratch)?;
                        let off = self.offset(s.block);
                        if let Err(m) = pattern::check(&self.scratch, off, want, self.job) {
                            self.r.verify_errors += 1;
                            if self.r.verify_errors <= MAX_LOGGED {
                                tracing::error!(
                                    job = self.job,
                                    offset = off + m.at as u64,
                                    want_gen = want,
                                    found_lba = m.found_lba,
                                    found_gen = m.found_gen,
                                    found_job = m.found_job,
                                    "verify mismatch"
                                );
                            }
                        }
                    }
                }
                Op::Read => {}
            }
        }
        Ok(lat)
    }

    /// Collects completions, blocking briefly when the workload waits for them.
    fn poll(&mut self, done: &mut Vec<IoDone>) -> Result<usize> {
        if self.cfg.wait {
            self.q.poll_wait(done, Duration::from_millis(100))
        } else {
            self.q.poll(done)
        }
    }

    /// Writes every block of the region once so reads have something to check.
    fn prefill(&mut self, qd: u32) -> Result<()> {
        let mut done = Vec::with_capacity(qd as usize);
        let mut next = 0u64;
        let mut inflight = 0u32;
        let mut free: Vec<u32> = (0..qd).rev().collect();
        let errors_before = self.r.errors;
        while next < self.nblocks || inflight > 0 {
            while next < self.nblocks {
                let Some(slot) = free.pop() else { break };
                self.issue(slot, Op::Write, next)?;
                next += 1;
                inflight += 1;
            }
            self.commit()?;
            done.clear();
            self.poll(&mut done)?;
            for d in done.iter().copied() {
                self.complete(d)?;
                inflight -= 1;
                free.push(d.slot);
            }
        }
        if self.r.errors > errors_before {
            tracing::warn!(
                job = self.job,
                "prefill had {} errors",
                self.r.errors - errors_before
            );
        }
        Ok(())
    }

    fn main_loop(&mut self, qd: u32) -> Result<()> {
        let mut done: Vec<IoDone> = Vec::with_capacity(qd as usize * 2);
        let start = Instant::now();
        let measure_from = start + self.cfg.ramp;
        let end = measure_from + self.cfg.time;
        for slot in 0..qd {
            let op = self.pick_op();
            let b = self.pick_block();
            self.issue(slot, op, b)?;
        }
        self.commit()?;
        let mut inflight = qd;
        let mut stopped = false;
        let mut last_progress = Instant::now();
        while inflight > 0 {
            done.clear();
            self.poll(&mut done)?;
            if done.is_empty() {
                if last_progress.elapsed() > STALL_TIMEOUT {
                    return Err(Error::Timeout("no I/O completed for 30 s"));
                }
                std::hint::spin_loop();
                continue;
            }
            let seen = if self.tracer.is_some() {
                trace::clock::now()
            } else {
                0
            };
            let now = Instant::now();
            if self.cfg.gaps > 0 {
                let gap = now.saturating_duration_since(last_progress).as_nanos() as u64;
                let at = now.saturating_duration_since(start).as_secs_f64();
                self.r.gaps.record(gap, at);
            }
            last_progress = now;
            stopped |= now >= end;
            for d in done.iter().copied() {
                let in_window = {
                    let s = self.slots[d.slot as usize];
                    s.start >= measure_from && now <= end
                };
                if in_window && self.tracer.is_some() {
                    let write = self.slots[d.slot as usize].op == Op::Write;
                    self.trace_done(d.slot, write, seen);
                }
                let lat = self.complete(d)?;
                inflight -= 1;
                if !self.cfg.think.is_zero() && !stopped {
                    // Not past the run's end: a think time as long as the run
                    // makes an idle client that still stops on time.
                    let left = end.saturating_duration_since(Instant::now());
                    std::thread::sleep(self.cfg.think.min(left));
                }
                // Count what was issued and finished inside the measured window.
                let s = self.slots[d.slot as usize];
                if s.start >= measure_from && now <= end {
                    self.r.hist.saturating_record(lat.max(1));
                    self.r.ios += 1;
                    match s.op {
                        Op::Read => self.r.reads += 1,
                        Op::Write => self.r.writes += 1,
                    }
                }
                if !stopped {
                    let op = self.pick_op();
                    let b = self.pick_block();
                    self.issue(d.slot, op, b)?;
                    inflight += 1;
                }
            }
            if !stopped {
                self.commit()?;
            }
        }
        let measured_end = Instant::now().min(end);
        self.r.secs = measured_end
            .saturating_duration_since(measure_from)
            .as_secs_f64();
        Ok(())
    }
}

pub(crate) fn merge(cfg: &WorkloadConfig, jobs: Vec<JobResult>) -> Report {
    let mut all = new_hist();
    let mut rep = Report {
        rw: cfg.rw.name(),
        bs: cfg.bs,
        qd: cfg.qd,
        jobs_count: cfg.jobs,
        ..Default::default()
    };
    let mut secs: f64 = 0.0;
    let mut all_trace: Option<trace::LayerSet> = None;
    rep.gaps = super::gaps::TopGaps::merge(cfg.gaps, jobs.iter().map(|j| j.gaps.clone()));
    for j in &jobs {
        // Same bounds everywhere, so adding cannot fail.
        let _ = all.add(&j.hist);
        rep.ios += j.ios;
        rep.reads += j.reads;
        rep.writes += j.writes;
        rep.errors += j.errors;
        rep.verify_errors += j.verify_errors;
        if let Some(t) = &j.trace {
            match all_trace.as_mut() {
                None => {
                    let mut m = trace::LayerSet::new(&trace::INITIATOR_LAYERS);
                    m.add(t);
                    all_trace = Some(m);
                }
                Some(m) => m.add(t),
            }
        }
        rep.unverified_reads += j.unverified;
        secs = secs.max(j.secs);
        let (iops, bw) = rate(j.ios, cfg.bs, j.secs);
        rep.jobs.push(JobReport {
            job: j.job,
            ios: j.ios,
            iops,
            bw_mib_s: bw,
            errors: j.errors,
            verify_errors: j.verify_errors,
            lat_ns: LatStats::from_hist(&j.hist),
        });
    }
    rep.elapsed_s = secs;
    (rep.iops, rep.bw_mib_s) = rate(rep.ios, cfg.bs, secs);
    rep.lat_ns = LatStats::from_hist(&all);
    rep.trace = all_trace.map(|t| t.breakdown(trace::Side::Initiator));
    rep
}
