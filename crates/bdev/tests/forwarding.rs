//! What wrappers pass on to the device or channel they wrap: every method they do
//! not change (`bdev::DeviceWrapper`, `bdev::ChannelWrapper`), batches, the
//! lifecycle (pause, resume), resize and format support, and the typed errors they
//! refuse with.

mod common;
use common::{batch, req};

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bdev::{
    typed, Armed, Batch, BlockDevice, BlockInfo, FaultConfig, FaultDisk, FaultError, FixedSize,
    FormatSupport, GeometryError, IoChannel, IoOp, IoRequest, IoStatus, NullDisk, QosDisk,
    QosError, QosLimits, RamDisk, SliceDisk, SliceError,
};
use guest_mem::SharedMem;

const MIB: u64 = 1 << 20;

// ---------------------------------------------------------------- a probe backend

/// What reached a [`Probe`] device or its channels.
#[derive(Debug, Default, PartialEq)]
struct Calls {
    /// Offsets of requests submitted one by one.
    submits: Vec<u64>,
    /// Offsets of the requests of each batch.
    batches: Vec<Vec<u64>>,
    announced: Vec<(IoOp, u64, u64)>,
    polls: usize,
    flushes: usize,
    arms: usize,
    pauses: usize,
    resumes: Vec<Vec<String>>,
}

type Log = Arc<Mutex<Calls>>;

fn log(l: &Log) -> std::sync::MutexGuard<'_, Calls> {
    l.lock().unwrap()
}

/// A 1 MiB backend that records what reaches it and answers every query with a
/// value no default has.
struct Probe {
    info: BlockInfo,
    log: Log,
}

/// When a probe channel must be polled again.
fn probe_deadline() -> Instant {
    static AT: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *AT.get_or_init(|| Instant::now() + Duration::from_secs(3600))
}

impl Probe {
    fn new() -> (Arc<Probe>, Log) {
        let log = Log::default();
        let info = NullDisk::new(MIB, 512).unwrap().info().clone();
        (
            Arc::new(Probe {
                info,
                log: log.clone(),
            }),
            log,
        )
    }
}

impl BlockDevice for Probe {
    fn describe(&self) -> String {
        "probe".into()
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(ProbeChan {
            log: self.log.clone(),
            bell: UnixStream::pair()?.0,
        }))
    }
    fn resize(&self, bytes: u64) -> std::io::Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(Probe {
            info: self.info.resized(bytes)?,
            log: self.log.clone(),
        }))
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
    fn format_support(&self) -> FormatSupport {
        FormatSupport::Exclusive {
            min_block_size: 4096,
        }
    }
    fn pause(&self) -> std::io::Result<()> {
        log(&self.log).pauses += 1;
        Ok(())
    }
    fn resume(&self, dead_owners: &[String]) -> std::io::Result<()> {
        log(&self.log).resumes.push(dead_owners.to_vec());
        Ok(())
    }
}

struct ProbeChan {
    log: Log,
    bell: UnixStream,
}

impl IoChannel for ProbeChan {
    fn submit(&mut self, _tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        log(&self.log).submits.push(req.offset);
        Some(IoStatus::Ok)
    }
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        let mut offsets = Vec::new();
        while let Some((_, r)) = batch.request(offsets.len()) {
            offsets.push(r.offset);
        }
        for i in 0..offsets.len() {
            batch.started(i, Some(IoStatus::Ok));
        }
        log(&self.log).batches.push(offsets);
        0
    }
    fn announce(&mut self, op: IoOp, offset: u64, len: u64) {
        log(&self.log).announced.push((op, offset, len));
    }
    fn poll(&mut self, _done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        log(&self.log).polls += 1;
        0
    }
    fn flush(&mut self) {
        log(&self.log).flushes += 1;
    }
    fn room(&self) -> usize {
        7
    }
    fn arm_notifier(&mut self) -> Armed {
        log(&self.log).arms += 1;
        Armed::Fd
    }
    fn wake_by(&self) -> Option<Instant> {
        Some(probe_deadline())
    }
    fn notifier(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.bell.as_fd())
    }
    fn slow_completions(&self) -> bool {
        true
    }
}

/// The least a wrapper can be: it overrides nothing.
struct Bare {
    inner: Arc<dyn BlockDevice>,
}

// Named by path: with the wrapper traits in scope, a wrapper's methods would be
// ambiguous between them and `BlockDevice`/`IoChannel`.
impl bdev::DeviceWrapper for Bare {
    fn inner(&self) -> &dyn BlockDevice {
        &*self.inner
    }
    fn kind(&self) -> &'static str {
        "bare"
    }
    fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(BareChan {
            inner: self.inner.channel()?,
        }))
    }
    fn rewrap(&self, inner: Arc<dyn BlockDevice>) -> std::io::Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(Bare { inner }))
    }
}

struct BareChan {
    inner: Box<dyn IoChannel>,
}

impl bdev::ChannelWrapper for BareChan {
    fn inner(&self) -> &dyn IoChannel {
        &*self.inner
    }
    fn inner_mut(&mut self) -> &mut dyn IoChannel {
        &mut *self.inner
    }
}

/// Calls every channel method on `ch` once; what each query answered.
fn exercise(ch: &mut dyn IoChannel) -> (usize, Armed, Option<Instant>, bool, bool) {
    assert_eq!(
        ch.submit(1, &req(IoOp::Flush, 0, 0, &[])),
        Some(IoStatus::Ok)
    );
    ch.announce(IoOp::Read, 4096, 512);
    ch.poll(&mut |_, _| {});
    ch.flush();
    let armed = ch.arm_notifier();
    (
        ch.room(),
        armed,
        ch.wake_by(),
        ch.notifier().is_some(),
        ch.slow_completions(),
    )
}

// ---------------------------------------------------------------- forwarding

/// A wrapper that overrides nothing passes every method on: the device's queries,
/// lifecycle and resize (which keeps the wrapper), and every channel method
/// (a batch request by request, through the wrapper's own submit).
#[test]
fn a_wrapper_passes_on_what_it_does_not_override() {
    let (probe, calls) = Probe::new();
    let bare = Bare { inner: probe };
    let d: &dyn BlockDevice = &bare;
    assert_eq!(d.describe(), "bare:probe");
    assert_eq!(d.info().size_bytes(), MIB);
    assert!(d.as_any().and_then(|a| a.downcast_ref::<Probe>()).is_some());
    let any4k = FormatSupport::Exclusive {
        min_block_size: 4096,
    };
    assert_eq!(d.format_support(), any4k);
    d.pause().unwrap();
    d.resume(&["dead".to_string()]).unwrap();
    let bigger = d.resize(2 * MIB).unwrap();
    assert_eq!(
        bigger.describe(),
        "bare:probe",
        "the resized handle is wrapped"
    );
    assert_eq!(bigger.info().size_bytes(), 2 * MIB);

    let mut ch = d.channel().unwrap();
    let answers = exercise(&mut *ch);
    assert_eq!(answers, (7, Armed::Fd, Some(probe_deadline()), true, true));
    let two = [req(IoOp::Flush, 8, 0, &[]), req(IoOp::Flush, 9, 0, &[])];
    assert_eq!(batch(&mut *ch, &two), [Some(IoStatus::Ok); 2]);
    let want = Calls {
        submits: vec![0, 8, 9],
        batches: vec![],
        announced: vec![(IoOp::Read, 4096, 512)],
        polls: 1,
        flushes: 1,
        arms: 1,
        pauses: 1,
        resumes: vec![vec!["dead".to_string()]],
    };
    assert_eq!(*log(&calls), want);
}

/// Slice, QoS and fault injection change how requests go, not the rest: queries,
/// notifier, flush, polls and the lifecycle reach the backend; an announcement
/// reaches it in the backend's offsets (a slice drops one outside itself); a slice
/// hides the backend from control operations of its kind, the others show it.
#[test]
fn slice_qos_and_fault_pass_on_what_they_do_not_change() {
    let (probe, calls) = Probe::new();
    let slice = SliceDisk::new(probe.clone(), 4096, 64 * 1024).unwrap();
    let qos = QosDisk::new(probe.clone(), QosLimits::default()).unwrap();
    let fault = FaultDisk::new(probe.clone(), FaultConfig::default()).unwrap();
    let devs: [&dyn BlockDevice; 3] = [&slice, &qos, &fault];
    for d in devs {
        d.pause().unwrap();
        d.resume(&[]).unwrap();
        let mut ch = d.channel().unwrap();
        let answers = exercise(&mut *ch);
        let want = (7, Armed::Fd, Some(probe_deadline()), true, true);
        assert_eq!(answers, want, "{}", d.describe());
    }
    let mut ch = slice.channel().unwrap();
    ch.announce(IoOp::Read, 64 * 1024, 512);
    ch.announce(IoOp::Read, u64::MAX, 512);
    {
        let c = log(&calls);
        assert_eq!((c.pauses, c.resumes.len()), (3, 3));
        assert_eq!((c.polls, c.flushes, c.arms), (3, 3, 3));
        let read = |offset| (IoOp::Read, offset, 512);
        assert_eq!(c.announced, [read(8192), read(4096), read(4096)]);
    }
    let probe_of =
        |d: &dyn BlockDevice| d.as_any().and_then(|a| a.downcast_ref::<Probe>()).is_some();
    assert!(!probe_of(&slice), "a slice is not the whole backend");
    assert!(probe_of(&qos) && probe_of(&fault));
    assert_eq!(BlockDevice::format_support(&slice), FormatSupport::Shared);
    let any4k = FormatSupport::Exclusive {
        min_block_size: 4096,
    };
    assert_eq!(BlockDevice::format_support(&qos), any4k);
    assert_eq!(BlockDevice::format_support(&fault), any4k);
}

/// A batch reaches the backend whole through an unlimited QoS and through a slice
/// (in the backing device's offsets) so that the backend orders its work; request
/// by request where the wrapper decides per request: a slice with a request
/// outside it (which never reaches the backend), a QoS with limits, fault
/// injection.
#[test]
fn batches_reach_the_backend_whole_where_the_wrapper_allows() {
    let (probe, calls) = Probe::new();
    let buf = SharedMem::new("b", 512).unwrap();
    let iov = [buf.all().sub(0, 512).unwrap()];
    let read = |offset| req(IoOp::Read, offset, 512, &iov);
    let reads = [read(0), read(4096), read(8192)];
    let ok = [Some(IoStatus::Ok); 3];

    let qos = QosDisk::new(probe.clone(), QosLimits::default()).unwrap();
    assert_eq!(batch(&mut *qos.channel().unwrap(), &reads), ok);
    let slice = SliceDisk::new(probe.clone(), 65536, 65536).unwrap();
    let mut ch = slice.channel().unwrap();
    assert_eq!(batch(&mut *ch, &reads), ok);
    let outside = [read(0), read(65536), read(4096)];
    let st = batch(&mut *ch, &outside);
    assert_eq!(st, [ok[0], Some(IoStatus::OutOfRange), ok[0]]);
    {
        let mut c = log(&calls);
        let slice_whole = vec![65536, 69632, 73728];
        assert_eq!(c.batches, [vec![0, 4096, 8192], slice_whole]);
        assert_eq!(c.submits, [65536, 69632], "only the slice's own requests");
        c.submits.clear();
    }

    let limited = QosLimits {
        iops: Some(1_000_000),
        ..QosLimits::default()
    };
    let qos = QosDisk::new(probe.clone(), limited).unwrap();
    assert_eq!(batch(&mut *qos.channel().unwrap(), &reads), ok);
    let fault = FaultDisk::new(probe, FaultConfig::default()).unwrap();
    assert_eq!(batch(&mut *fault.channel().unwrap(), &reads), ok);
    let c = log(&calls);
    assert_eq!(c.submits, [0, 4096, 8192, 0, 4096, 8192]);
    assert_eq!(c.batches.len(), 2, "no new batch");
}

// ---------------------------------------------------------------- typed errors

/// Wrappers and backends refuse with typed errors; where a trait returns
/// `io::Error` the typed error travels inside it.
#[test]
fn refusals_are_typed() {
    let (probe, _) = Probe::new();
    let zero = QosLimits {
        read_bw: Some(0),
        ..QosLimits::default()
    };
    let e = QosDisk::new(probe.clone(), zero).err().unwrap();
    assert_eq!(e, QosError::ZeroLimit(zero));
    let qos = QosDisk::new(probe.clone(), QosLimits::default()).unwrap();
    assert_eq!(qos.set_limits(zero), Err(QosError::ZeroLimit(zero)));
    let bad = FaultConfig {
        error_rate: 1.5,
        ..FaultConfig::default()
    };
    let e = FaultDisk::new(probe.clone(), bad).err().unwrap();
    assert_eq!(e, FaultError::ErrorRate(1.5));

    let slice = SliceDisk::new(probe, 0, MIB).unwrap();
    let e = BlockDevice::resize(&slice, 2 * MIB).err().unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::Unsupported);
    assert_eq!(typed::<SliceError>(&e), Some(&SliceError::FixedExtent));

    let null = NullDisk::new(MIB, 512).unwrap();
    let e = null.resize(1000).err().unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    let size = GeometryError::Size {
        size: 1000,
        block_size: 512,
    };
    assert_eq!(typed::<GeometryError>(&e), Some(&size));
    assert_eq!(
        NullDisk::new(MIB, 1024).err(),
        Some(GeometryError::BlockSize(1024))
    );
    let e = RamDisk::new(0, 512).err().unwrap();
    assert!(matches!(
        e,
        bdev::RamError::Geometry(GeometryError::Size { size: 0, .. })
    ));

    // A backend that cannot change size says so by the default.
    struct Fixed(NullDisk);
    impl BlockDevice for Fixed {
        fn describe(&self) -> String {
            "fixed".into()
        }
        fn info(&self) -> &BlockInfo {
            self.0.info()
        }
        fn channel(&self) -> std::io::Result<Box<dyn IoChannel>> {
            self.0.channel()
        }
    }
    let e = Fixed(NullDisk::new(MIB, 512).unwrap())
        .resize(2 * MIB)
        .err()
        .unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::Unsupported);
    assert_eq!(
        typed::<FixedSize>(&e).map(|f| f.device.as_str()),
        Some("fixed")
    );
}

// ---------------------------------------------------------------- resize

/// Writes `byte` at `offset` through a fresh channel of `d`, then reads it back.
fn write_read(d: &dyn BlockDevice, offset: u64, byte: u8) -> (IoStatus, u8) {
    let mut ch = d.channel().unwrap();
    let buf = SharedMem::new("r", 4096).unwrap();
    let s = buf.all();
    let one = [s.sub(0, 512).unwrap()];
    s.fill(byte);
    let w = ch.submit(1, &req(IoOp::Write, offset, 512, &one)).unwrap();
    s.fill(0);
    ch.submit(2, &req(IoOp::Read, offset, 512, &one)).unwrap();
    let mut b = [0u8; 1];
    s.read_into(0, &mut b).unwrap();
    (w, b[0])
}

#[test]
fn resize_gives_a_new_handle_over_the_same_data() {
    let ram = RamDisk::new(4 * MIB, 512).unwrap();
    assert_eq!(write_read(&ram, 0, 9), (IoStatus::Ok, 9));
    let small = ram.resize(MIB).unwrap();
    assert_eq!(small.info().size_bytes(), MIB);
    assert_eq!(
        ram.info().size_bytes(),
        4 * MIB,
        "the old handle keeps its size"
    );
    // Same data; the new size is enforced by the backend itself.
    let mut ch = small.channel().unwrap();
    let buf = SharedMem::new("r", 4096).unwrap();
    let one = [buf.all().sub(0, 512).unwrap()];
    assert_eq!(
        ch.submit(1, &req(IoOp::Read, 0, 512, &one)),
        Some(IoStatus::Ok)
    );
    let mut b = [0u8; 1];
    one[0].read_into(0, &mut b).unwrap();
    assert_eq!(b[0], 9);
    assert_eq!(
        ch.submit(2, &req(IoOp::Read, MIB, 512, &one)),
        Some(IoStatus::OutOfRange)
    );
    // Back up, and beyond what was mapped at first: the data below stays.
    assert_eq!(small.resize(4 * MIB).unwrap().info().size_bytes(), 4 * MIB);
    let big = small.resize(8 * MIB).unwrap();
    assert_eq!(big.info().size_bytes(), 8 * MIB);
    assert_eq!(write_read(&*big, 0, 9), (IoStatus::Ok, 9));
    assert_eq!(write_read(&*big, 8 * MIB - 512, 4), (IoStatus::Ok, 4));
    assert!(
        ram.resize(1000).is_err(),
        "not a multiple of the block size"
    );
    assert!(ram.resize(0).is_err());

    let null = NullDisk::new(MIB, 4096).unwrap();
    assert_eq!(null.resize(64 * MIB).unwrap().info().num_blocks, 16384);
}

#[test]
fn wrappers_resize_their_backend_and_keep_their_state() {
    let ram: Arc<dyn BlockDevice> = Arc::new(RamDisk::new(4 * MIB, 512).unwrap());
    let limits = QosLimits {
        iops: Some(1000),
        ..QosLimits::default()
    };
    let qos = QosDisk::new(ram.clone(), limits).unwrap();
    let q2 = qos.resized(2 * MIB).unwrap();
    assert_eq!(q2.info().size_bytes(), 2 * MIB);
    assert_eq!(q2.limits(), limits);
    // One set of buckets: a change through either handle reaches both.
    qos.set_limits(QosLimits::default()).unwrap();
    assert_eq!(q2.limits(), QosLimits::default());

    let fault = FaultDisk::new(ram.clone(), FaultConfig::default()).unwrap();
    assert_eq!(fault.resize(MIB).unwrap().info().size_bytes(), MIB);

    let slice = SliceDisk::new(ram, 0, MIB).unwrap();
    let e = BlockDevice::resize(&slice, 2 * MIB).err().unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::Unsupported);
    assert!(e.to_string().contains("offset= and size="), "{e}");
}

// ---------------------------------------------------------------- format support

/// Memory backends can take any block size; a slice is a window others may share;
/// QoS and fault wrappers answer for what they wrap.
#[test]
fn format_support_through_wrappers() {
    use bdev::FormatSupport;
    let any = FormatSupport::Exclusive {
        min_block_size: 512,
    };
    let ram: Arc<dyn BlockDevice> = Arc::new(RamDisk::new(MIB, 4096).unwrap());
    let null: Arc<dyn BlockDevice> = Arc::new(NullDisk::new(MIB, 512).unwrap());
    assert_eq!(ram.format_support(), any);
    assert_eq!(null.format_support(), any);
    let slice: Arc<dyn BlockDevice> = Arc::new(SliceDisk::new(ram.clone(), 0, MIB).unwrap());
    assert_eq!(slice.format_support(), FormatSupport::Shared);
    let qos = QosDisk::new(ram.clone(), QosLimits::default()).unwrap();
    assert_eq!(qos.format_support(), any);
    let fault = FaultDisk::new(slice, FaultConfig::default()).unwrap();
    assert_eq!(fault.format_support(), FormatSupport::Shared);
}
