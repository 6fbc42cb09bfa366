//! A mirror into an export on another host (`RemoteTarget`), here one in
//! memory: it copies the chain as the guest sees it while the guest writes,
//! keeps writing through once its copy is done until it completes, and a
//! target that fails ends the job, never the guest's writes.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bdev::{create_qcow2, BlockDevice, Qcow2Create, Qcow2Disk, RemoteTarget};
use test_support::rng::Rng;

mod qcow2_common;
use qcow2_common::{first_difference, open, random_ops, read_all, MIB};

const SIZE: u64 = 8 * MIB;

#[derive(Clone, Default)]
struct MemoryTarget {
    data: Arc<Mutex<Vec<u8>>>,
    fail: Arc<AtomicBool>,
    flushes: Arc<AtomicU64>,
}

impl MemoryTarget {
    fn new(size: u64) -> MemoryTarget {
        MemoryTarget {
            data: Arc::new(Mutex::new(vec![0xee; size as usize])),
            ..Default::default()
        }
    }
    fn put(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        let mut d = self.data.lock().unwrap();
        let at = offset as usize;
        d.get_mut(at..at + data.len())
            .ok_or(io::ErrorKind::InvalidInput)?
            .copy_from_slice(data);
        Ok(())
    }
    fn bytes(&self) -> Vec<u8> {
        self.data.lock().unwrap().clone()
    }
}

impl RemoteTarget for MemoryTarget {
    fn name(&self) -> String {
        "nbd+unix:///memory?socket=/nowhere".into()
    }
    fn size(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.put(offset, data)
    }
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.put(offset, &vec![0; len as usize])
    }
    fn flush(&mut self) -> io::Result<()> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// A disk on an overlay over a base, both holding guest data: the chain a
/// mirror must flatten.
fn chained(seed: u64) -> (tempfile::TempDir, Qcow2Disk, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let o = Qcow2Create {
        size: SIZE,
        cluster_size: 64 << 10,
        backing: None,
    };
    create_qcow2(&base, &o).unwrap();
    let disk = open(&base);
    let mut rng = Rng::new(seed);
    let mut want = vec![0u8; SIZE as usize];
    let mut ch = disk.channel().unwrap();
    random_ops(&mut *ch, &mut rng, &mut want, 100);
    disk.snapshot(&dir.path().join("top.qcow2")).unwrap();
    random_ops(&mut *ch, &mut rng, &mut want, 100);
    drop(ch);
    (dir, disk, want)
}

#[test]
fn a_mirror_to_another_host_copies_the_chain_and_follows_the_guest_until_completed() {
    let (_dir, disk, mut want) = chained(51);
    let target = MemoryTarget::new(SIZE);
    let mut job = disk
        .start_remote_mirror(Box::new(target.clone()), 0)
        .unwrap();
    assert!(job.waits_for_complete());
    assert_eq!(job.remote().unwrap(), target.name());
    assert_eq!(job.target_path(), None);
    let mut ch = disk.channel().unwrap();
    let mut rng = Rng::new(52);
    while job.step().unwrap().is_some() {
        random_ops(&mut *ch, &mut rng, &mut want, 1);
    }
    assert_eq!(job.done_bytes(), SIZE);
    // Copied, not completed: guest writes keep going through.
    random_ops(&mut *ch, &mut rng, &mut want, 40);
    job.check_target().unwrap();
    assert_eq!(first_difference(&target.bytes(), &want), None);
    let flushes = target.flushes.load(Ordering::Relaxed);
    job.finish(&disk).unwrap();
    assert!(target.flushes.load(Ordering::Relaxed) > flushes);
    // Completed: the disk stays where it was, the target no longer follows.
    let at_end = want.clone();
    random_ops(&mut *ch, &mut rng, &mut want, 20);
    assert_eq!(first_difference(&read_all(&disk), &want), None);
    assert_eq!(first_difference(&target.bytes(), &at_end), None);
}

#[test]
fn a_failing_target_fails_the_job_and_never_the_guest() {
    let (_dir, disk, mut want) = chained(53);
    let target = MemoryTarget::new(SIZE);
    let mut job = disk
        .start_remote_mirror(Box::new(target.clone()), 0)
        .unwrap();
    let mut ch = disk.channel().unwrap();
    let mut rng = Rng::new(54);
    for _ in 0..10 {
        job.step().unwrap();
    }
    target.fail.store(true, Ordering::Relaxed);
    // Every guest operation still succeeds on the disk (random_ops asserts
    // each status) ...
    random_ops(&mut *ch, &mut rng, &mut want, 30);
    assert_eq!(first_difference(&read_all(&disk), &want), None);
    // ... and the job says its target missed writes, even once the target
    // is back.
    target.fail.store(false, Ordering::Relaxed);
    let e = job.check_target().unwrap_err().to_string();
    assert!(e.contains("writing through into the target failed"), "{e}");
    assert!(job.step().is_err());
    job.abandon();
    random_ops(&mut *ch, &mut rng, &mut want, 10);
    assert_eq!(first_difference(&read_all(&disk), &want), None);
}

#[test]
fn a_target_too_small_or_a_resume_point_off_a_cluster_is_refused() {
    let (_dir, disk, mut want) = chained(55);
    let small = MemoryTarget::new(SIZE - 4096);
    let e = disk
        .start_remote_mirror(Box::new(small), 0)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("fewer than the disk's"), "{e}");
    let target = MemoryTarget::new(SIZE);
    assert!(disk
        .start_remote_mirror(Box::new(target.clone()), 4096)
        .is_err());
    assert!(disk
        .start_remote_mirror(Box::new(target.clone()), SIZE + (64 << 10))
        .is_err());
    // Refused starts leave no write-through behind: guest writes stay on the
    // disk only.
    let before = target.bytes();
    let mut ch = disk.channel().unwrap();
    random_ops(&mut *ch, &mut Rng::new(56), &mut want, 20);
    assert_eq!(target.bytes(), before);
    // Going on from the middle (a successor process): the rest is copied,
    // what came before is the predecessor's.
    let mut job = disk
        .start_remote_mirror(Box::new(target.clone()), SIZE / 2)
        .unwrap();
    while job.step().unwrap().is_some() {}
    let got = target.bytes();
    let half = (SIZE / 2) as usize;
    assert_eq!(first_difference(&got[half..], &want[half..]), None);
    assert!(got[..half].iter().all(|&b| b == 0xee));
    job.abandon();
}
