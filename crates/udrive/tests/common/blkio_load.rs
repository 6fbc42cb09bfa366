//! libblkio doing verified I/O at QD32 on a vhost-user-blk socket (handover tests).

#![allow(dead_code)]

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blkio::{Blkio, Completion, ReqFlags};

pub const QD: usize = 32;
pub const BS: usize = 4096;
/// Blocks the QD32 client cycles through (each slot owns every QD-th one): the
/// disk must hold at least `BLOCKS * BS` bytes.
pub const BLOCKS: u64 = 1024;

/// The pattern of `block` at `version`: every 8 bytes hold block and version.
pub fn fill(buf: &mut [u8], block: u64, version: u64) {
    for (i, c) in buf.chunks_exact_mut(8).enumerate() {
        let v = if i % 2 == 0 { block } else { version };
        c.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn check(buf: &[u8], block: u64, version: u64) -> bool {
    buf.chunks_exact(8).enumerate().all(|(i, c)| {
        let v = if i % 2 == 0 { block } else { version };
        c == v.to_le_bytes()
    })
}

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

/// libblkio at QD32: each slot writes a block with its next version and reads it
/// back, verifying every byte; a completion for a slot with nothing outstanding
/// (completed twice) or a failed or stalled request is an error. Runs until `stop`,
/// then drains and verifies every block it wrote.
pub fn qd32_client(
    sock: PathBuf,
    stop: Arc<AtomicBool>,
    progress: Arc<AtomicU64>,
) -> Result<Tally, String> {
    let e = |e: blkio::Error| format!("libblkio: {e}");
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(e)?;
    b.set_str("path", sock.to_str().unwrap()).map_err(e)?;
    b.connect().map_err(e)?;
    let mut s = b.start().map_err(e)?;
    let region = b.alloc_mem_region(QD * BS).map_err(e)?;
    b.map_mem_region(&region).map_err(e)?;
    let base = region.addr as *mut u8;
    // SAFETY: the region is QD * BS bytes, mapped read/write, ours until freed below;
    // a slot's buffer is touched only while that slot has no request in flight.
    let buf = |slot: usize| unsafe { std::slice::from_raw_parts_mut(base.add(slot * BS), BS) };
    let q = &mut s.queues[0];
    let mut versions = vec![0u64; BLOCKS as usize];
    let mut slots: Vec<Option<Slot>> = vec![None; QD];
    let mut next_block: Vec<u64> = (0..QD as u64).collect();
    let mut tally = Tally::default();
    let issue = |q: &mut blkio::Blkioq, slot: usize, st: Slot, buf: &mut [u8]| match st {
        Slot::Write { block, version } => {
            fill(buf, block, version);
            q.write(block * BS as u64, buf.as_ptr(), BS, slot, ReqFlags::empty());
        }
        Slot::Read { block, .. } => {
            buf.fill(0);
            q.read(
                block * BS as u64,
                buf.as_mut_ptr(),
                BS,
                slot,
                ReqFlags::empty(),
            );
        }
    };
    for slot in 0..QD {
        let block = next_block[slot];
        let st = Slot::Write {
            block,
            version: versions[block as usize] + 1,
        };
        slots[slot] = Some(st);
        issue(q, slot, st, buf(slot));
    }
    let mut comps: Vec<MaybeUninit<Completion>> = (0..QD).map(|_| MaybeUninit::uninit()).collect();
    let mut err = None;
    while slots.iter().any(Option::is_some) {
        let mut t = Duration::from_secs(20);
        let n = q.do_io(&mut comps, 1, Some(&mut t), None).map_err(e)?;
        if n == 0 {
            err = Some("no completion within 20 s (stalled)".to_string());
            break;
        }
        for c in &comps[..n] {
            // SAFETY: do_io initialised the first `n` completions.
            let c = unsafe { c.assume_init_ref() };
            let slot = c.user_data;
            let Some(st) = slots.get_mut(slot).and_then(Option::take) else {
                return Err(format!(
                    "completion for slot {slot} with nothing in flight (completed twice?)"
                ));
            };
            if c.ret != 0 {
                return Err(format!("request of slot {slot} failed: {}", c.ret));
            }
            tally.completed += 1;
            progress.fetch_add(1, Ordering::Relaxed);
            let next = match st {
                Slot::Write { block, version } => {
                    versions[block as usize] = version;
                    Some(Slot::Read { block, version })
                }
                Slot::Read { block, version } => {
                    if !check(buf(slot), block, version) {
                        return Err(format!(
                            "block {block}: read back differs from version {version}"
                        ));
                    }
                    tally.verified += 1;
                    if stop.load(Ordering::Relaxed) {
                        None
                    } else {
                        let nb = (next_block[slot] + QD as u64) % BLOCKS;
                        next_block[slot] = nb;
                        Some(Slot::Write {
                            block: nb,
                            version: versions[nb as usize] + 1,
                        })
                    }
                }
            };
            if let Some(st) = next {
                slots[slot] = Some(st);
                issue(q, slot, st, buf(slot));
            }
        }
    }
    if let Some(e) = err {
        return Err(e);
    }
    // Every block written is read back at its last version.
    for block in 0..BLOCKS {
        let version = versions[block as usize];
        if version == 0 {
            continue;
        }
        q.read(
            block * BS as u64,
            buf(0).as_mut_ptr(),
            BS,
            0,
            ReqFlags::empty(),
        );
        let mut t = Duration::from_secs(20);
        let n = q.do_io(&mut comps[..1], 1, Some(&mut t), None).map_err(e)?;
        // SAFETY: do_io initialised `n` completions.
        if n != 1 || unsafe { comps[0].assume_init_ref() }.ret != 0 {
            return Err(format!("final read of block {block} failed"));
        }
        if !check(buf(0), block, version) {
            return Err(format!(
                "final read of block {block}: not version {version}"
            ));
        }
    }
    drop(s);
    b.unmap_mem_region(&region);
    b.free_mem_region(&region);
    Ok(tally)
}

pub struct Client {
    stop: Arc<AtomicBool>,
    pub progress: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<Result<Tally, String>>,
}

impl Client {
    pub fn start(sock: &Path) -> Client {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicU64::new(0));
        let (s, p, path) = (stop.clone(), progress.clone(), sock.to_path_buf());
        let thread = std::thread::spawn(move || qd32_client(path, s, p));
        let c = Client {
            stop,
            progress,
            thread,
        };
        c.wait_progress(200);
        c
    }

    /// Waits until `n` more requests completed.
    pub fn wait_progress(&self, n: u64) {
        let from = self.progress.load(Ordering::Relaxed);
        let until = Instant::now() + Duration::from_secs(20);
        while self.progress.load(Ordering::Relaxed) < from + n {
            assert!(
                !self.thread.is_finished(),
                "the client ended early: {:?}",
                self.progress
            );
            assert!(Instant::now() < until, "the client makes no progress");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn finish(self) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap().unwrap()
    }
}
