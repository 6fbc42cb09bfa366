//! SliceDisk, FaultDisk and QosDisk.

mod common;
use common::{batch, req};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bdev::{
    overlaps, Armed, BlockDevice, FaultConfig, FaultDisk, FaultOps, IoChannel, IoOp, IoRequest,
    IoStatus, NullDisk, QosClock, QosDisk, QosLimits, RamDisk, SliceDisk, SliceError, QOS_MAX_NAP,
};
use guest_mem::{DmaSlice, SharedMem};
use test_support::held::HeldDisk;

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------- slice

#[test]
fn slice_construction_checks() {
    let ram: Arc<dyn BlockDevice> = Arc::new(RamDisk::new(MIB, 512).unwrap());
    let err = |o, s| SliceDisk::new(ram.clone(), o, s).err().unwrap();
    let block_size = 512;
    assert_eq!(err(0, 0), SliceError::Empty);
    assert_eq!(
        err(100, 512),
        SliceError::UnalignedOffset {
            offset: 100,
            block_size
        }
    );
    assert_eq!(
        err(0, 1000),
        SliceError::UnalignedSize {
            size: 1000,
            block_size
        }
    );
    let top = u64::MAX / 512 * 512;
    assert_eq!(
        err(top, 512),
        SliceError::Overflow {
            offset: top,
            size: 512
        }
    );
    let past = |offset, end| SliceError::PastEnd {
        offset,
        end,
        device: ram.describe(),
        device_size: MIB,
    };
    assert_eq!(err(MIB - 512, 1024), past(MIB - 512, MIB + 512));
    assert_eq!(err(MIB, 512), past(MIB, MIB + 512));
    assert!(err(MIB, 512).to_string().contains("past the end"));
    let s = SliceDisk::new(ram.clone(), MIB / 2, MIB / 2).unwrap();
    assert_eq!(s.info().size_bytes(), MIB / 2);
    assert_eq!(s.info().block_size, 512);
    assert!(s.describe().starts_with("slice:ram:"));
}

/// Requests a slice of `size` bytes at `off` must refuse, with the status each
/// ends in: ranges outside it (wrapping, past its end, valid only in the backing
/// device), buffers that do not add up to the length.
fn hostile<'a>(
    off: u64,
    size: u64,
    one: &'a [DmaSlice<'a>],
    two: &'a [DmaSlice<'a>],
    whole: &'a [DmaSlice<'a>],
) -> Vec<(IoRequest<'a>, IoStatus)> {
    let mut v = Vec::new();
    for op in [IoOp::Read, IoOp::Write, IoOp::WriteZeroes, IoOp::Discard] {
        let (iov1, iov2): (&[_], &[_]) = if matches!(op, IoOp::Read | IoOp::Write) {
            (one, two)
        } else {
            (&[], &[])
        };
        for (o, l, iov) in [
            (u64::MAX, 512, iov1),
            (u64::MAX - 511, 512, iov1),
            (u64::MAX - 100, 1024, iov2),
            (size, 512, iov1),
            (size - 512, 1024, iov2),
            (0, size + 512, iov2),
            (u64::MAX - off + 1, 512, iov1), // would wrap to 0 after translation
            (MIB - off, 512, iov1),          // inner-valid, slice-invalid
        ] {
            v.push((req(op, o, l, iov), IoStatus::OutOfRange));
        }
    }
    // Buffers longer than `len` must not spill past the slice end.
    v.push((req(IoOp::Write, size - 512, 512, whole), IoStatus::Invalid));
    v.push((
        req(IoOp::Write, size - 512, 8192, one),
        IoStatus::OutOfRange,
    ));
    v.push((req(IoOp::Write, 0, 1024, one), IoStatus::Invalid));
    v
}

/// Every hostile request is refused alone and inside a batch (where the good
/// requests around it still run); good ones, alone or batched, reach only the
/// slice's bytes of the backing device, at slice-relative offsets.
#[test]
fn slice_isolation_against_hostile_requests() {
    let ram = Arc::new(RamDisk::new(MIB, 512).unwrap());
    let mut raw = ram.channel().unwrap();
    let big = SharedMem::new("big", MIB).unwrap();
    let all = big.all();
    all.fill(0xAA);
    let iov = [all];
    let whole_disk = req(IoOp::Write, 0, MIB, &iov);
    assert_eq!(raw.submit(0, &whole_disk), Some(IoStatus::Ok));

    let (off, size) = (256 * 1024, 256 * 1024);
    let slice = SliceDisk::new(ram.clone(), off, size).unwrap();
    let mut ch = slice.channel().unwrap();
    let buf = SharedMem::new("b", 8192).unwrap();
    let b = buf.all();
    b.fill(0x55);
    let one = [b.sub(0, 512).unwrap()];
    let two = [b.sub(0, 1024).unwrap()];
    let whole = [b];
    let bad = hostile(off, size, &one, &two, &whole);
    for (r, want) in &bad {
        assert_eq!(ch.submit(1, r), Some(*want), "{r:?}");
    }
    // In a batch, with good requests around them: the first 8 KiB of the slice.
    let mut list: Vec<_> = bad.iter().map(|(r, _)| *r).collect();
    list.insert(0, req(IoOp::Write, 0, 8192, &whole));
    list.push(req(IoOp::Flush, u64::MAX, 0, &[]));
    let mut want: Vec<_> = bad.iter().map(|(_, st)| Some(*st)).collect();
    want.insert(0, Some(IoStatus::Ok));
    want.push(Some(IoStatus::Ok));
    assert_eq!(batch(&mut *ch, &list), want);

    // The rest of the slice with 0x55 in batches of 8 KiB writes, then zero one
    // block; flushes pass whatever their (meaningless) offset.
    let fill: Vec<_> = (1..size / 8192)
        .map(|i| req(IoOp::Write, i * 8192, 8192, &whole))
        .collect();
    for part in fill.chunks(7) {
        assert!(batch(&mut *ch, part)
            .iter()
            .all(|st| *st == Some(IoStatus::Ok)));
    }
    let zero = req(IoOp::WriteZeroes, size - 512, 512, &[]);
    let flushes = [
        req(IoOp::Flush, 0, 0, &[]),
        req(IoOp::Flush, u64::MAX, 0, &[]),
    ];
    assert_eq!(ch.submit(4, &zero), Some(IoStatus::Ok));
    assert_eq!(batch(&mut *ch, &flushes), [Some(IoStatus::Ok); 2]);

    all.fill(0);
    assert_eq!(
        raw.submit(6, &req(IoOp::Read, 0, MIB, &iov)),
        Some(IoStatus::Ok)
    );
    let mut back = vec![0u8; MIB as usize];
    all.read_into(0, &mut back).unwrap();
    let (o, s) = (off as usize, size as usize);
    assert!(back[..o].iter().all(|x| *x == 0xAA), "before slice touched");
    assert!(back[o..o + s - 512].iter().all(|x| *x == 0x55));
    assert!(back[o + s - 512..o + s].iter().all(|x| *x == 0));
    assert!(
        back[o + s..].iter().all(|x| *x == 0xAA),
        "after slice touched"
    );

    // Reads through the slice see slice-relative offsets.
    b.fill(0);
    assert_eq!(
        ch.submit(7, &req(IoOp::Read, size - 1024, 1024, &two)),
        Some(IoStatus::Ok)
    );
    let mut r = [0u8; 1024];
    b.read_into(0, &mut r).unwrap();
    assert!(r[..512].iter().all(|x| *x == 0x55));
    assert!(r[512..].iter().all(|x| *x == 0));
}

#[test]
fn overlap_for_config_validation() {
    assert!(overlaps((0, MIB), (MIB - 1, 1)));
    assert!(!overlaps((0, MIB), (MIB, MIB)));
    assert!(!overlaps((0, 0), (0, MIB)));
}

// ---------------------------------------------------------------- fault

fn null() -> Arc<dyn BlockDevice> {
    Arc::new(NullDisk::new(MIB, 512).unwrap())
}

#[test]
fn fault_lba_ranges_and_ops() {
    let d = FaultDisk::new(
        null(),
        FaultConfig {
            error_lbas: vec![(4096, 512)],
            ops: FaultOps::All,
            ..FaultConfig::default()
        },
    )
    .unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("b", 4096).unwrap();
    let iov = [buf.all()];
    let r = |o| req(IoOp::Read, o, 4096, &iov);
    assert_eq!(ch.submit(1, &r(0)), Some(IoStatus::Ok));
    assert_eq!(ch.submit(1, &r(512)), Some(IoStatus::ReadError));
    assert_eq!(ch.submit(1, &r(4096 + 512)), Some(IoStatus::Ok));
    let w = req(IoOp::Write, 4096, 4096, &iov);
    assert_eq!(ch.submit(1, &w), Some(IoStatus::IoError));
    assert_eq!(
        ch.submit(1, &req(IoOp::Discard, 4096, 512, &[])),
        Some(IoStatus::IoError)
    );

    let d = FaultDisk::new(
        null(),
        FaultConfig {
            error_lbas: vec![(4096, 512)],
            ops: FaultOps::Read,
            ..FaultConfig::default()
        },
    )
    .unwrap();
    let mut ch = d.channel().unwrap();
    assert_eq!(ch.submit(1, &r(4096)), Some(IoStatus::ReadError));
    assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));

    assert!(FaultDisk::new(
        null(),
        FaultConfig {
            error_rate: 1.5,
            ..FaultConfig::default()
        }
    )
    .is_err());
}

fn count_errors(rate: f64, seed: u64, n: usize) -> usize {
    let d = FaultDisk::new(
        null(),
        FaultConfig {
            error_rate: rate,
            seed,
            ops: FaultOps::Write,
            ..FaultConfig::default()
        },
    )
    .unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("b", 512).unwrap();
    let iov = [buf.all()];
    // Reads are not selected: never fail.
    assert_eq!(
        ch.submit(0, &req(IoOp::Read, 0, 512, &iov)),
        Some(IoStatus::Ok)
    );
    (0..n)
        .filter(|i| {
            ch.submit(*i as u64, &req(IoOp::Write, 0, 512, &iov)) == Some(IoStatus::IoError)
        })
        .count()
}

#[test]
fn fault_error_rate() {
    assert_eq!(count_errors(0.0, 7, 1000), 0);
    assert_eq!(count_errors(1.0, 7, 1000), 1000);
    let half = count_errors(0.5, 7, 10_000);
    assert!((4500..5500).contains(&half), "{half}");
    let tenth = count_errors(0.1, 99, 10_000);
    assert!((700..1300).contains(&tenth), "{tenth}");
    assert_eq!(count_errors(0.3, 42, 1000), count_errors(0.3, 42, 1000));
}

#[test]
fn fault_latency_withholds_completion() {
    let lat = Duration::from_millis(30);
    let d = FaultDisk::new(
        null(),
        FaultConfig {
            latency: lat,
            error_lbas: vec![(0, 512)],
            ops: FaultOps::Read,
            ..FaultConfig::default()
        },
    )
    .unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("b", 512).unwrap();
    let iov = [buf.all()];
    let start = Instant::now();
    assert_eq!(ch.submit(1, &req(IoOp::Write, 0, 512, &iov)), None);
    assert_eq!(ch.submit(2, &req(IoOp::Read, 0, 512, &iov)), None);
    let mut got = Vec::new();
    let done = engine::wait_until(Duration::from_secs(5), Duration::ZERO, || {
        ch.poll(&mut |t, s| got.push((t, s, start.elapsed())));
        got.len() >= 2
    });
    assert!(done, "never completed");
    assert_eq!(got[0].0, 1);
    assert_eq!(got[0].1, IoStatus::Ok);
    assert_eq!(got[1].0, 2);
    assert_eq!(got[1].1, IoStatus::ReadError);
    assert!(got.iter().all(|g| g.2 >= lat));
}

// ---------------------------------------------------------------- qos

struct FakeClock(Arc<AtomicU64>);

impl FakeClock {
    fn new() -> (FakeClock, QosClock) {
        let t = Arc::new(AtomicU64::new(0));
        let t2 = t.clone();
        (FakeClock(t), Arc::new(move || t2.load(Ordering::SeqCst)))
    }
    fn advance(&self, d: Duration) {
        self.0.fetch_add(d.as_nanos() as u64, Ordering::SeqCst);
    }
}

/// Submits `n` requests; returns how many completed at once.
fn submit_n(ch: &mut dyn IoChannel, first_tag: u64, n: u64, r: &IoRequest<'_>) -> usize {
    (first_tag..first_tag + n)
        .filter(|t| ch.submit(*t, r).is_some())
        .count()
}

#[test]
fn qos_iops_per_interval() {
    let (clock, f) = FakeClock::new();
    let limits = QosLimits {
        iops: Some(1000),
        ..QosLimits::default()
    };
    let d = QosDisk::with_clock(null(), limits, f).unwrap();
    let mut ch = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    // Burst: 100 ms worth (+1 for the request that finds the bucket idle).
    assert_eq!(submit_n(&mut *ch, 0, 1000, &flush), 101);
    let mut tags = Vec::new();
    assert_eq!(ch.poll(&mut |t, _| tags.push(t)), 0);
    for _ in 0..8 {
        clock.advance(Duration::from_millis(100));
        let n = ch.poll(&mut |t, s| {
            assert_eq!(s, IoStatus::Ok);
            tags.push(t)
        });
        assert_eq!(n, 100);
    }
    // FIFO order.
    assert!(tags.windows(2).all(|w| w[0] + 1 == w[1]));
    assert_eq!(tags[0], 101);
    // New requests queue behind the waiting ones, never overtake them.
    assert_eq!(ch.submit(5000, &flush), None);
    clock.advance(Duration::from_secs(1));
    tags.clear();
    ch.poll(&mut |t, _| tags.push(t));
    assert_eq!(tags.len(), 100);
    assert_eq!(*tags.last().unwrap(), 5000);
}

#[test]
fn qos_limits_change_at_run_time() {
    let (clock, f) = FakeClock::new();
    let d = QosDisk::with_clock(null(), QosLimits::default(), f).unwrap();
    let mut ch = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    assert_eq!(submit_n(&mut *ch, 0, 5000, &flush), 5000, "no limits");
    let limits = QosLimits {
        iops: Some(100),
        ..QosLimits::default()
    };
    d.set_limits(limits).unwrap();
    assert_eq!(d.limits(), limits);
    // The channel opened before the change is limited now: burst 10 + 1.
    assert_eq!(submit_n(&mut *ch, 0, 100, &flush), 11);
    let mut done = 0;
    for _ in 0..100 {
        clock.advance(Duration::from_millis(10));
        done += ch.poll(&mut |_, _| {});
    }
    assert_eq!(done, 89, "the rest at 100/s");
    assert_eq!(submit_n(&mut *ch, 0, 20, &flush), 11, "burst");
    // Clearing releases what is held back at the next poll and stops limiting.
    d.set_limits(QosLimits::default()).unwrap();
    assert_eq!(d.limits(), QosLimits::default());
    assert_eq!(ch.poll(&mut |_, _| {}), 9);
    assert_eq!(submit_n(&mut *ch, 0, 1000, &flush), 1000);
    assert!(d
        .set_limits(QosLimits {
            bw_bytes: Some(0),
            ..QosLimits::default()
        })
        .is_err());
}

#[test]
fn qos_bandwidth_and_classes() {
    let (clock, f) = FakeClock::new();
    let limits = QosLimits {
        read_bw: Some(MIB),
        write_iops: Some(10),
        ..QosLimits::default()
    };
    let d = QosDisk::with_clock(null(), limits, f).unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("b", 64 * 1024).unwrap();
    let iov = [buf.all()];
    let rd = req(IoOp::Read, 0, 64 * 1024, &iov);
    let wr = req(IoOp::Write, 0, 64 * 1024, &iov);
    // 64 KiB reads at 1 MiB/s: 62.5 ms each; burst 100 ms -> 2 at t=0.
    assert_eq!(submit_n(&mut *ch, 0, 200, &rd), 2);
    // A reactor polls far more often than the burst window; simulate 1 ms ticks.
    let mut per_second = Vec::new();
    for _ in 0..10 {
        let mut done = 0;
        for _ in 0..1000 {
            clock.advance(Duration::from_millis(1));
            done += ch.poll(&mut |_, _| {});
        }
        per_second.push(done);
    }
    assert_eq!(per_second, [16; 10]); // 1 MiB/s of 64 KiB

    // Writes have their own bucket (and a channel with no queued reads).
    let mut ch2 = d.channel().unwrap();
    assert_eq!(submit_n(&mut *ch2, 0, 100, &wr), 2); // 10 iops: burst 1 + 1
    let mut done = 0;
    for _ in 0..5000 {
        clock.advance(Duration::from_millis(1));
        done += ch2.poll(&mut |_, _| {});
    }
    assert_eq!(done, 50);
    // Flush is not a write: unthrottled on a write-only limit.
    assert_eq!(ch2.submit(1, &req(IoOp::Flush, 0, 0, &[])), None); // queued behind writes
    let mut ch3 = d.channel().unwrap();
    assert_eq!(
        ch3.submit(1, &req(IoOp::Flush, 0, 0, &[])),
        Some(IoStatus::Ok)
    );
}

#[test]
fn qos_shared_between_channels_and_big_request() {
    let (clock, f) = FakeClock::new();
    let d = QosDisk::with_clock(
        null(),
        QosLimits {
            iops: Some(100),
            bw_bytes: Some(1000),
            ..QosLimits::default()
        },
        f,
    )
    .unwrap();
    let mut a = d.channel().unwrap();
    let mut b = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    let n = submit_n(&mut *a, 0, 100, &flush) + submit_n(&mut *b, 0, 100, &flush);
    assert_eq!(n, 11); // one namespace-wide burst, not one per channel
    let mut n = 0;
    for _ in 0..100 {
        clock.advance(Duration::from_millis(10));
        n += a.poll(&mut |_, _| {}) + b.poll(&mut |_, _| {});
    }
    assert_eq!(n, 100); // 100 iops shared by both channels

    // A single request larger than the burst is still admitted on an idle bucket.
    clock.advance(Duration::from_secs(10));
    let mut c = d.channel().unwrap();
    let buf = SharedMem::new("b", MIB).unwrap();
    let iov = [buf.all()];
    let big = req(IoOp::Read, 0, MIB, &iov);
    assert_eq!(c.submit(1, &big), Some(IoStatus::Ok));
    assert_eq!(c.submit(2, &big), None);
    clock.advance(Duration::from_secs(1000));
    assert_eq!(c.poll(&mut |_, _| {}), 0);
    clock.advance(Duration::from_secs(100));
    assert_eq!(c.poll(&mut |_, _| {}), 1);

    assert!(QosDisk::new(
        null(),
        QosLimits {
            iops: Some(0),
            ..QosLimits::default()
        }
    )
    .is_err());
}

#[test]
fn qos_delayed_request_keeps_its_buffers() {
    let (clock, f) = FakeClock::new();
    let ram = Arc::new(RamDisk::new(MIB, 512).unwrap());
    let d = QosDisk::with_clock(
        ram.clone(),
        QosLimits {
            write_iops: Some(1),
            ..QosLimits::default()
        },
        f,
    )
    .unwrap();
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("b", 8192).unwrap();
    let s = buf.all();
    s.fill(1);
    {
        let iov = [s.sub(0, 4096).unwrap()];
        assert_eq!(
            ch.submit(1, &req(IoOp::Write, 0, 4096, &iov)),
            Some(IoStatus::Ok)
        );
    }
    {
        // This iovec array dies before the request is forwarded.
        let iov = [s.sub(4096, 512).unwrap(), s.sub(4608, 3584).unwrap()];
        s.sub(4096, 4096).unwrap().fill(2);
        assert_eq!(ch.submit(2, &req(IoOp::Write, 8192, 4096, &iov)), None);
    }
    clock.advance(Duration::from_secs(2));
    let mut got = Vec::new();
    assert_eq!(ch.poll(&mut |t, st| got.push((t, st))), 1);
    assert_eq!(got, [(2, IoStatus::Ok)]);

    let mut raw = ram.channel().unwrap();
    s.fill(0);
    let iov = [s];
    assert_eq!(
        raw.submit(0, &req(IoOp::Read, 4096, 8192, &iov)),
        Some(IoStatus::Ok)
    );
    let mut back = [0u8; 8192];
    s.read_into(0, &mut back).unwrap();
    assert!(back[..4096].iter().all(|x| *x == 0));
    assert!(back[4096..].iter().all(|x| *x == 2));
}

#[test]
fn qos_unlimited_is_pass_through() {
    let d = QosDisk::new(null(), QosLimits::default()).unwrap();
    let mut ch = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    assert_eq!(submit_n(&mut *ch, 0, 10_000, &flush), 10_000);
}

#[test]
fn fault_latency_over_async_inner() {
    // QosDisk completes throttled requests later from poll(): FaultDisk must match
    // those completions to its pending entries and still honour its own delay.
    let (clock, f) = FakeClock::new();
    let qos: Arc<dyn BlockDevice> = Arc::new(
        QosDisk::with_clock(
            null(),
            QosLimits {
                iops: Some(10),
                ..QosLimits::default()
            },
            f,
        )
        .unwrap(),
    );
    let lat = Duration::from_millis(5);
    let d = FaultDisk::new(
        qos,
        FaultConfig {
            latency: lat,
            ..FaultConfig::default()
        },
    )
    .unwrap();
    let mut ch = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    // Before the submits: a stall between them and this clock read would
    // otherwise make the wait look shorter than the latency.
    let start = Instant::now();
    for t in 1..=3 {
        assert_eq!(ch.submit(t, &flush), None);
    }
    let mut got = Vec::new();
    let done = engine::wait_until(Duration::from_secs(5), Duration::ZERO, || {
        ch.poll(&mut |t, s| got.push((t, s)));
        got.len() >= 2
    });
    assert!(done, "never completed");
    assert!(start.elapsed() >= lat);
    assert_eq!(got, [(1, IoStatus::Ok), (2, IoStatus::Ok)]);
    // The third is still throttled by the (fake) QoS clock.
    std::thread::sleep(lat * 2);
    assert_eq!(ch.poll(&mut |t, s| got.push((t, s))), 0);
    clock.advance(Duration::from_millis(100));
    assert_eq!(ch.poll(&mut |t, s| got.push((t, s))), 1);
    assert_eq!(got[2], (3, IoStatus::Ok));
}

// ---------------------------------------------------------------- sleeping on held requests

/// `wake_by` lies `wait` after some instant between `before` and now.
fn due_in(ch: &dyn IoChannel, before: Instant, wait: Duration) {
    let at = ch.wake_by().expect("a deadline for the held request");
    assert!(
        at >= before + wait && at <= Instant::now() + wait,
        "due {at:?}, not in {wait:?}"
    );
}

/// A reactor may sleep while QoS holds requests back: nothing but time releases
/// them, so the channel arms a timer (no descriptor) due when the oldest one's
/// tokens are there — at most QOS_MAX_NAP away, so a limit raised meanwhile is seen.
#[test]
fn qos_holding_requests_asks_for_a_timer() {
    let (clock, f) = FakeClock::new();
    let limits = QosLimits {
        iops: Some(10),
        ..QosLimits::default()
    };
    let d = QosDisk::with_clock(null(), limits, f).unwrap();
    let mut ch = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    // The burst (100 ms worth, and one more) completes at once; the third waits
    // until the bucket's 200 ms of charges are within the burst again: 100 ms.
    assert_eq!(submit_n(&mut *ch, 1, 3, &flush), 2);
    assert_eq!(ch.arm_notifier(), Armed::Timer);
    assert!(ch.notifier().is_none(), "nothing to wait on but time");
    due_in(&*ch, Instant::now(), QOS_MAX_NAP);
    clock.advance(Duration::from_millis(97));
    due_in(&*ch, Instant::now(), Duration::from_millis(3));
    clock.advance(Duration::from_millis(3));
    assert!(ch.wake_by().unwrap() <= Instant::now(), "due now");
    let mut got = Vec::new();
    assert_eq!(ch.poll(&mut |t, s| got.push((t, s))), 1);
    assert_eq!(got, [(3, IoStatus::Ok)]);
    assert_eq!(ch.wake_by(), None, "nothing held");
}

/// With requests also at a backend that completes on its own (librbd, io_uring),
/// its notifier wakes the reactor for those and the timer for the held ones.
#[test]
fn qos_over_a_slow_backend_arms_both() {
    let (clock, f) = FakeClock::new();
    let (held, gate) = HeldDisk::new(1 << 20, 512).unwrap();
    let limits = QosLimits {
        iops: Some(10),
        ..QosLimits::default()
    };
    let d = QosDisk::with_clock(Arc::new(held), limits, f).unwrap();
    let mut ch = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    assert_eq!(submit_n(&mut *ch, 1, 3, &flush), 0);
    assert_eq!(gate.submitted(), 2);
    assert_eq!(
        ch.arm_notifier(),
        Armed::Fd,
        "the backend's completions wake us"
    );
    assert!(ch.notifier().is_some());
    due_in(&*ch, Instant::now(), QOS_MAX_NAP);
    // Once the backend is done with its two, only the timer is left.
    gate.release(2);
    assert_eq!(ch.arm_notifier(), Armed::Ready);
    assert_eq!(ch.poll(&mut |_, _| {}), 2);
    assert_eq!(ch.arm_notifier(), Armed::Timer);
    assert!(ch.notifier().is_none());
    // Admitted, the third is the backend's: its notifier again, no timer.
    clock.advance(Duration::from_millis(100));
    assert_eq!(ch.poll(&mut |_, _| {}), 0);
    assert_eq!(gate.submitted(), 3);
    assert_eq!(ch.arm_notifier(), Armed::Fd);
    assert_eq!(ch.wake_by(), None);
}

/// Injected latency: completions wait for their deadline, which the channel hands
/// out as its timer; a request still at the inner backend keeps its notifier armed.
#[test]
fn fault_latency_asks_for_a_timer() {
    // Far beyond anything a loaded machine stalls this test for.
    let lat = Duration::from_secs(30);
    let config = FaultConfig {
        latency: lat,
        ..FaultConfig::default()
    };
    let d = FaultDisk::new(null(), config.clone()).unwrap();
    let mut ch = d.channel().unwrap();
    let flush = req(IoOp::Flush, 0, 0, &[]);
    let before = Instant::now();
    assert_eq!(ch.submit(1, &flush), None);
    assert_eq!(ch.arm_notifier(), Armed::Timer);
    assert!(ch.notifier().is_none());
    due_in(&*ch, before, lat);
    let (held, gate) = HeldDisk::new(1 << 20, 512).unwrap();
    let d = FaultDisk::new(Arc::new(held), config).unwrap();
    let mut ch = d.channel().unwrap();
    assert_eq!(ch.submit(1, &flush), None);
    assert_eq!(ch.arm_notifier(), Armed::Fd);
    assert!(ch.notifier().is_some());
    assert_eq!(
        ch.wake_by(),
        None,
        "its deadline counts once the backend is done"
    );
    gate.release(1);
    assert_eq!(ch.poll(&mut |_, _| {}), 0, "completed, but delayed");
    assert_eq!(ch.arm_notifier(), Armed::Timer);
    assert!(ch.wake_by().is_some());
}
