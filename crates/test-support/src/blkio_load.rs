//! libblkio doing verified I/O at QD32 on a vhost-user-blk socket until told to
//! stop, for tests that change the device under a running client (handover,
//! resize, poll-mode switches).
//!
//! Each of the 32 slots owns every 32nd block: it writes the block's next version,
//! reads it back and checks every byte, then moves to its next block. A completion
//! for a slot with nothing in flight (completed twice), a failed request or 20 s
//! without any completion is an error. On stop it drains and reads every block it
//! wrote back at its last version.

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use blkio::{Completion, ReqFlags};

use crate::blkio::BlkioSession;
use crate::pattern::{fill_block, is_block};
use crate::wait::{wait_until, T};

pub const QD: usize = 32;
pub const BS: usize = 4096;
/// Blocks the client cycles through: the disk must hold at least `BLOCKS * BS`
/// bytes.
pub const BLOCKS: u64 = 1024;

#[derive(Clone, Copy)]
enum Slot {
    Write { block: u64, version: u64 },
    Read { block: u64, version: u64 },
}

/// What the client saw.
#[derive(Default, Debug)]
pub struct Tally {
    pub completed: u64,
    pub verified: u64,
}

struct Qd32 {
    s: BlkioSession,
    versions: Vec<u64>,
    slots: Vec<Option<Slot>>,
    next_block: Vec<u64>,
    tally: Tally,
}

impl Qd32 {
    fn buf(&mut self, slot: usize) -> &mut [u8] {
        // SAFETY: the region is QD * BS bytes, mapped read/write and ours until the
        // session drops; a slot's buffer is touched only while that slot has no
        // request in flight, and `&mut self` keeps two slices from coexisting here.
        unsafe { std::slice::from_raw_parts_mut(self.s.buf().add(slot * BS), BS) }
    }

    fn issue(&mut self, slot: usize, st: Slot) {
        self.slots[slot] = Some(st);
        match st {
            Slot::Write { block, version } => {
                fill_block(self.buf(slot), version, block);
                let p = self.buf(slot).as_ptr();
                self.s
                    .q
                    .write(block * BS as u64, p, BS, slot, ReqFlags::empty());
            }
            Slot::Read { block, .. } => {
                self.buf(slot).fill(0);
                let p = self.buf(slot).as_mut_ptr();
                self.s
                    .q
                    .read(block * BS as u64, p, BS, slot, ReqFlags::empty());
            }
        }
    }

    /// What slot `slot` does after `st` completed; None once stopping.
    fn next(&mut self, slot: usize, st: Slot, stop: bool) -> Result<Option<Slot>, String> {
        Ok(match st {
            Slot::Write { block, version } => {
                self.versions[block as usize] = version;
                Some(Slot::Read { block, version })
            }
            Slot::Read { block, version } => {
                if !is_block(self.buf(slot), version, block) {
                    return Err(format!(
                        "block {block}: read back differs from version {version}"
                    ));
                }
                self.tally.verified += 1;
                if stop {
                    None
                } else {
                    let nb = (self.next_block[slot] + QD as u64) % BLOCKS;
                    self.next_block[slot] = nb;
                    let version = self.versions[nb as usize] + 1;
                    Some(Slot::Write { block: nb, version })
                }
            }
        })
    }

    fn run(&mut self, stop: &AtomicBool, progress: &AtomicU64) -> Result<(), String> {
        for slot in 0..QD {
            let block = slot as u64;
            let version = self.versions[slot] + 1;
            self.issue(slot, Slot::Write { block, version });
        }
        let mut comps: Vec<MaybeUninit<Completion>> =
            (0..QD).map(|_| MaybeUninit::uninit()).collect();
        while self.slots.iter().any(Option::is_some) {
            let mut t = Duration::from_secs(20);
            let n = self
                .s
                .q
                .do_io(&mut comps, 1, Some(&mut t), None)
                .map_err(|e| format!("libblkio: {e}"))?;
            if n == 0 {
                return Err("no completion within 20 s (stalled)".into());
            }
            for c in &comps[..n] {
                // SAFETY: do_io initialised the first `n` completions.
                let c = unsafe { c.assume_init_ref() };
                let slot = c.user_data;
                let Some(st) = self.slots.get_mut(slot).and_then(Option::take) else {
                    return Err(format!(
                        "completion for slot {slot} with nothing in flight (completed twice?)"
                    ));
                };
                if c.ret != 0 {
                    return Err(format!("request of slot {slot} failed: {}", c.ret));
                }
                self.tally.completed += 1;
                progress.fetch_add(1, Ordering::Relaxed);
                if let Some(st) = self.next(slot, st, stop.load(Ordering::Relaxed))? {
                    self.issue(slot, st);
                }
            }
        }
        Ok(())
    }

    /// Every block written is read back at its last version.
    fn verify_all(&mut self) -> Result<(), String> {
        for block in 0..BLOCKS {
            let version = self.versions[block as usize];
            if version == 0 {
                continue;
            }
            self.s
                .q
                .read(block * BS as u64, self.s.buf(), BS, 1, ReqFlags::empty());
            match self.s.try_wait()? {
                0 => {}
                r => return Err(format!("final read of block {block} failed: {r}")),
            }
            if !is_block(self.buf(0), version, block) {
                return Err(format!(
                    "final read of block {block}: not version {version}"
                ));
            }
        }
        Ok(())
    }
}

/// Runs the QD32 client on `sock` until `stop`, counting completions in
/// `progress`.
pub fn qd32_client(sock: &Path, stop: &AtomicBool, progress: &AtomicU64) -> Result<Tally, String> {
    let s = BlkioSession::open_with(sock, false, QD * BS)?;
    let mut c = Qd32 {
        s,
        versions: vec![0; BLOCKS as usize],
        slots: vec![None; QD],
        next_block: (0..QD as u64).collect(),
        tally: Tally::default(),
    };
    c.run(stop, progress)?;
    c.verify_all()?;
    Ok(c.tally)
}

/// The QD32 client on a thread of its own.
pub struct Qd32Client {
    stop: Arc<AtomicBool>,
    pub progress: Arc<AtomicU64>,
    thread: JoinHandle<Result<Tally, String>>,
}

impl Qd32Client {
    /// Starts the client and returns once it has completed 200 requests.
    pub fn start(sock: &Path) -> Qd32Client {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicU64::new(0));
        let (s, p, path): (_, _, PathBuf) = (stop.clone(), progress.clone(), sock.into());
        let thread = std::thread::spawn(move || qd32_client(&path, &s, &p));
        let c = Qd32Client {
            stop,
            progress,
            thread,
        };
        c.wait_progress(200);
        c
    }

    /// Waits until `n` more requests completed.
    #[track_caller]
    pub fn wait_progress(&self, n: u64) {
        let from = self.progress.load(Ordering::Relaxed);
        wait_until("the libblkio client's progress", 2 * T, || {
            assert!(
                !self.thread.is_finished(),
                "the client ended early: {:?}",
                self.progress
            );
            self.progress.load(Ordering::Relaxed) >= from + n
        });
    }

    /// Stops the client; what it saw (fails the test on any error).
    pub fn finish(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .expect("client thread")
            .expect("libblkio client")
    }
}
