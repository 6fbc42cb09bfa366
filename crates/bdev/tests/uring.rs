//! File backend: data round trips, bounce path, zeroing, errors, through io_uring
//! and through the inline engine.

use std::time::Duration;

use bdev::{
    BlockDevice, FileDisk, FileEngine, FileError, FileOp, FileOptions, GeometryError, IoChannel,
    IoOp, IoRequest, IoStatus,
};
use guest_mem::{DmaSlice, SharedMem};
use test_support::files::{sized_file, LoopDev};

const SIZE: u64 = 1 << 20;

/// A temp dir on a real disk (the target dir), where O_DIRECT usually works.
fn disk_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn open(p: &std::path::Path, direct: bool, read_only: bool) -> FileDisk {
    open_with(p, direct, read_only, FileEngine::Uring)
}

fn open_with(p: &std::path::Path, direct: bool, read_only: bool, engine: FileEngine) -> FileDisk {
    let d = FileDisk::open(
        p,
        FileOptions {
            direct,
            read_only,
            block_size: None,
            engine,
        },
    )
    .unwrap();
    assert_eq!(d.inline(), engine == FileEngine::Inline);
    d
}

const ENGINES: [FileEngine; 2] = [FileEngine::Uring, FileEngine::Inline];

/// Submits one request and drives the channel until it completes.
fn run(ch: &mut dyn IoChannel, op: IoOp, offset: u64, iov: &[DmaSlice<'_>], fua: bool) -> IoStatus {
    let len = iov.iter().map(|b| b.len() as u64).sum();
    run_len(ch, op, offset, len, iov, fua)
}

fn run_len(
    ch: &mut dyn IoChannel,
    op: IoOp,
    offset: u64,
    len: u64,
    iov: &[DmaSlice<'_>],
    fua: bool,
) -> IoStatus {
    let req = IoRequest {
        op,
        offset,
        len,
        iov,
        fua,
    };
    if let Some(st) = ch.submit(42, &req) {
        return st;
    }
    let mut out = None;
    let done = engine::wait_until(Duration::from_secs(10), Duration::ZERO, || {
        ch.flush();
        ch.poll(&mut |tag, st| {
            assert_eq!(tag, 42);
            out = Some(st);
        });
        out.is_some()
    });
    assert!(done, "request timed out");
    out.unwrap()
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn round_trip(direct: bool) {
    for e in ENGINES {
        round_trip_with(direct, e);
    }
}

fn round_trip_with(direct: bool, engine: FileEngine) {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", SIZE);
    let d = open_with(&p, direct, false, engine);
    assert_eq!(d.info().num_blocks, SIZE / 512);
    assert!(!d.info().volatile && d.info().write_cache && d.info().discard_zeroes);
    assert_eq!(d.describe().contains(":direct"), d.direct());
    let mut ch = d.channel().unwrap();
    let mem = SharedMem::new("g", 65536).unwrap();
    let s = mem.all();
    let data = pattern(16384, 1);
    s.write_from(0, &data).unwrap();
    let w = [s.sub(0, 16384).unwrap()];
    assert_eq!(run(&mut *ch, IoOp::Write, 8192, &w, false), IoStatus::Ok);
    assert_eq!(run(&mut *ch, IoOp::Flush, 0, &[], false), IoStatus::Ok);
    let r = [s.sub(32768, 16384).unwrap()];
    assert_eq!(run(&mut *ch, IoOp::Read, 8192, &r, false), IoStatus::Ok);
    let mut back = vec![0u8; 16384];
    s.read_into(32768, &mut back).unwrap();
    assert_eq!(back, data);
    // Also visible through the file itself.
    let f = std::fs::read(&p).unwrap();
    assert_eq!(&f[8192..8192 + 16384], &data[..]);
}

#[test]
fn round_trip_buffered() {
    round_trip(false);
}

#[test]
fn round_trip_direct() {
    round_trip(true);
}

#[test]
fn direct_is_used_on_disk_and_tmpfs_falls_back() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", SIZE);
    let d = open(&p, true, false);
    eprintln!("{}", d.describe());
    // O_DIRECT works on ext4/xfs; just make sure describe reports the mode in effect.
    assert!(d
        .describe()
        .contains(if d.direct() { ":direct" } else { ":buffered" }));
    if std::path::Path::new("/dev/shm").is_dir() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let p = sized_file(shm.path(), "s.img", SIZE);
        let d = open(&p, true, false);
        eprintln!("{}", d.describe());
        let mut ch = d.channel().unwrap();
        let mem = SharedMem::new("g", 8192).unwrap();
        let s = mem.all();
        s.write_from(0, &pattern(4096, 9)).unwrap();
        let w = [s.sub(0, 4096).unwrap()];
        assert_eq!(run(&mut *ch, IoOp::Write, 0, &w, false), IoStatus::Ok);
        let r = [s.sub(4096, 4096).unwrap()];
        assert_eq!(run(&mut *ch, IoOp::Read, 0, &r, false), IoStatus::Ok);
        let mut b = vec![0u8; 4096];
        s.read_into(4096, &mut b).unwrap();
        assert_eq!(b, pattern(4096, 9));
    }
}

#[test]
fn unaligned_and_multi_segment_direct() {
    for e in ENGINES {
        unaligned_and_multi_segment(e);
    }
}

fn unaligned_and_multi_segment(engine: FileEngine) {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", SIZE);
    let d = open_with(&p, true, false, engine);
    let mut ch = d.channel().unwrap();
    let mem = SharedMem::new("g", 1 << 20).unwrap();
    let s = mem.all();
    // 3 segments: odd base, odd lengths, adding up to 8 blocks.
    let data = pattern(4096, 7);
    let segs = [(3usize, 1000usize), (20000, 2000), (50001, 1096)];
    let mut pos = 0;
    for &(off, len) in &segs {
        s.write_from(off, &data[pos..pos + len]).unwrap();
        pos += len;
    }
    let iov: Vec<_> = segs.iter().map(|&(o, l)| s.sub(o, l).unwrap()).collect();
    assert_eq!(run(&mut *ch, IoOp::Write, 4096, &iov, true), IoStatus::Ok);
    assert_eq!(&std::fs::read(&p).unwrap()[4096..8192], &data[..]);
    // Read back into different unaligned segments.
    let rsegs = [(100_001usize, 513usize), (200_003, 3583)];
    let riov: Vec<_> = rsegs.iter().map(|&(o, l)| s.sub(o, l).unwrap()).collect();
    assert_eq!(run(&mut *ch, IoOp::Read, 4096, &riov, false), IoStatus::Ok);
    let mut back = vec![0u8; 4096];
    s.read_into(100_001, &mut back[..513]).unwrap();
    s.read_into(200_003, &mut back[513..]).unwrap();
    assert_eq!(back, data);
    // Aligned multi-segment (no bounce), big enough to exceed the kept bounce size too.
    let big = pattern(512 * 1024, 3);
    s.write_from(0, &big).unwrap();
    let iov = [
        s.sub(0, 4096).unwrap(),
        s.sub(4096, 512 * 1024 - 4096).unwrap(),
    ];
    assert_eq!(run(&mut *ch, IoOp::Write, 0, &iov, false), IoStatus::Ok);
    s.fill(0);
    let iov = [s.sub(1, 512 * 1024).unwrap()]; // unaligned, bounced
    assert_eq!(run(&mut *ch, IoOp::Read, 0, &iov, false), IoStatus::Ok);
    let mut back = vec![0u8; 512 * 1024];
    s.read_into(1, &mut back).unwrap();
    assert_eq!(back, big);
}

fn zeroing(direct: bool, engine: FileEngine) {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", SIZE);
    let d = open_with(&p, direct, false, engine);
    let mut ch = d.channel().unwrap();
    let mem = SharedMem::new("g", 65536).unwrap();
    let s = mem.all();
    s.write_from(0, &[0xabu8; 65536]).unwrap();
    let w = [s.sub(0, 65536).unwrap()];
    assert_eq!(run(&mut *ch, IoOp::Write, 0, &w, false), IoStatus::Ok);
    assert_eq!(
        run_len(&mut *ch, IoOp::WriteZeroes, 4096, 4096, &[], false),
        IoStatus::Ok
    );
    assert_eq!(
        run_len(&mut *ch, IoOp::Discard, 16384, 8192, &[], false),
        IoStatus::Ok
    );
    s.fill(1);
    assert_eq!(run(&mut *ch, IoOp::Read, 0, &w, false), IoStatus::Ok);
    let mut b = vec![0u8; 65536];
    s.read_into(0, &mut b).unwrap();
    assert!(b[..4096].iter().all(|x| *x == 0xab));
    assert!(b[4096..8192].iter().all(|x| *x == 0));
    assert!(b[8192..16384].iter().all(|x| *x == 0xab));
    assert!(b[16384..24576].iter().all(|x| *x == 0));
    assert!(b[24576..].iter().all(|x| *x == 0xab));
}

#[test]
fn write_zeroes_and_discard_read_back_zeroes() {
    for e in ENGINES {
        zeroing(true, e);
        zeroing(false, e);
    }
}

#[test]
fn many_in_flight() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", 4 << 20);
    let d = open(&p, true, false);
    let mut ch = d.channel().unwrap();
    let mem = SharedMem::new("g", 4 << 20).unwrap();
    let s = mem.all();
    let data = pattern(4 << 20, 5);
    s.write_from(0, &data).unwrap();
    // 1024 writes of 4 KiB: more than the ring holds, so the backlog is used (a front
    // end would stop at `room`, which counts down to 0 and stays there).
    let room = ch.room();
    assert!(room > 0 && room < 1024, "room {room}");
    let bufs: Vec<_> = (0..1024)
        .map(|i| [s.sub(i * 4096, 4096).unwrap()])
        .collect();
    let mut pending = 0;
    for (i, b) in bufs.iter().enumerate() {
        let req = IoRequest {
            op: IoOp::Write,
            offset: i as u64 * 4096,
            len: 4096,
            iov: b,
            fua: false,
        };
        assert_eq!(ch.submit(i as u64, &req), None);
        pending += 1;
        assert_eq!(ch.room(), room.saturating_sub(pending));
    }
    let mut seen = vec![false; 1024];
    let done = engine::wait_until(Duration::from_secs(20), Duration::ZERO, || {
        ch.flush();
        ch.poll(&mut |tag, st| {
            assert_eq!(st, IoStatus::Ok);
            assert!(!seen[tag as usize]);
            seen[tag as usize] = true;
            pending -= 1;
        });
        pending == 0
    });
    assert!(done, "requests timed out");
    assert_eq!(ch.room(), room, "every slot is free again");
    assert_eq!(std::fs::read(&p).unwrap(), data);
}

#[test]
fn range_and_read_only_errors() {
    for e in ENGINES {
        range_and_read_only(e);
    }
}

fn range_and_read_only(engine: FileEngine) {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", SIZE);
    let d = open_with(&p, true, false, engine);
    let mut ch = d.channel().unwrap();
    let mem = SharedMem::new("g", 8192).unwrap();
    let s = mem.all();
    let b = [s.sub(0, 8192).unwrap()];
    assert_eq!(
        run(&mut *ch, IoOp::Read, SIZE - 4096, &b, false),
        IoStatus::OutOfRange
    );
    assert_eq!(
        run(&mut *ch, IoOp::Write, u64::MAX - 511, &b, false),
        IoStatus::OutOfRange
    );
    assert_eq!(
        run_len(&mut *ch, IoOp::Discard, SIZE, 512, &[], false),
        IoStatus::OutOfRange
    );
    assert_eq!(
        run_len(&mut *ch, IoOp::Read, 0, 4096, &b, false),
        IoStatus::Invalid
    );
    drop(ch);

    let ro = open_with(&p, true, true, engine);
    assert!(ro.info().read_only);
    let mut ch = ro.channel().unwrap();
    assert_eq!(run(&mut *ch, IoOp::Write, 0, &b, false), IoStatus::ReadOnly);
    assert_eq!(
        run_len(&mut *ch, IoOp::WriteZeroes, 0, 512, &[], false),
        IoStatus::ReadOnly
    );
    assert_eq!(
        run_len(&mut *ch, IoOp::Discard, 0, 512, &[], false),
        IoStatus::ReadOnly
    );
    assert_eq!(run(&mut *ch, IoOp::Read, 0, &b, false), IoStatus::Ok);
}

#[test]
fn open_errors_name_the_path() {
    let dir = disk_dir();
    let missing = dir.path().join("nope.img");
    let e = FileDisk::open(&missing, FileOptions::default())
        .err()
        .unwrap();
    assert!(
        matches!(&e, FileError::Io { path, op: FileOp::Stat, source }
            if *path == missing && source.kind() == std::io::ErrorKind::NotFound),
        "{e:?}"
    );
    assert!(e.to_string().contains("nope.img"), "{e}");
    let odd = sized_file(dir.path(), "odd.img", 1000);
    let e = FileDisk::open(&odd, FileOptions::default()).err().unwrap();
    let size = GeometryError::Size {
        size: 1000,
        block_size: 512,
    };
    assert!(
        matches!(&e, FileError::Geometry { path, source } if *path == odd && *source == size),
        "{e:?}"
    );
    let empty = sized_file(dir.path(), "empty.img", 0);
    let e = FileDisk::open(&empty, FileOptions::default())
        .err()
        .unwrap();
    assert!(matches!(e, FileError::Geometry { .. }), "{e:?}");
    let e = FileDisk::open(dir.path(), FileOptions::default())
        .err()
        .unwrap();
    assert!(matches!(e, FileError::NotFileOrDevice { .. }), "{e:?}");
    // Through the io::Error a trait returns, the typed error is still there.
    let io: std::io::Error = e.into();
    assert_eq!(io.kind(), std::io::ErrorKind::InvalidInput);
    assert!(matches!(
        bdev::typed::<FileError>(&io),
        Some(FileError::NotFileOrDevice { .. })
    ));
    let k512 = sized_file(dir.path(), "k.img", 512 * 3);
    let opts = FileOptions {
        block_size: Some(4096),
        ..FileOptions::default()
    };
    assert!(FileDisk::open(&k512, opts.clone()).is_err());
    let k4 = sized_file(dir.path(), "k4.img", 4096 * 3);
    let d = FileDisk::open(&k4, opts).unwrap();
    assert_eq!(d.info().block_size, 4096);
    assert_eq!(d.info().num_blocks, 3);
    let bad = FileOptions {
        block_size: Some(1024),
        ..FileOptions::default()
    };
    let e = FileDisk::open(&k4, bad).err().unwrap();
    assert!(
        matches!(&e, FileError::Geometry { source, .. } if *source == GeometryError::BlockSize(1024)),
        "{e:?}"
    );
}

#[test]
fn inline_completes_in_submit_and_reports_a_shrunk_file() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", SIZE);
    let d = open_with(&p, false, false, FileEngine::Inline);
    assert!(d.describe().starts_with("inline:"), "{}", d.describe());
    let mut ch = d.channel().unwrap();
    let mem = SharedMem::new("g", 8192).unwrap();
    let s = mem.all();
    let b = [s.sub(0, 8192).unwrap()];
    let req = IoRequest {
        op: IoOp::Read,
        offset: 0,
        len: 8192,
        iov: &b,
        fua: false,
    };
    assert_eq!(ch.submit(1, &req), Some(IoStatus::Ok));
    // Nothing is left for poll: the request finished inside submit.
    ch.flush();
    assert_eq!(
        ch.poll(&mut |_, _| panic!("inline request completed twice")),
        0
    );
    // Someone truncates the backing file under the running disk: a read beyond the
    // new end ends in a read error, a write in an I/O error (no hang, no loop).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let req = IoRequest {
        offset: 8192,
        ..req
    };
    assert_eq!(ch.submit(2, &req), Some(IoStatus::ReadError));
    // Half inside the file: the first part is read, then EOF.
    let req = IoRequest { offset: 0, ..req };
    assert_eq!(ch.submit(3, &req), Some(IoStatus::ReadError));
}

#[test]
fn auto_engine_is_io_uring_on_a_disk_filesystem() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "d.img", SIZE);
    let d = FileDisk::open(&p, FileOptions::default()).unwrap();
    assert!(!d.inline(), "{}", d.describe());
    if !std::path::Path::new("/dev/shm").is_dir() {
        return;
    }
    // On tmpfs, auto is inline exactly when io_uring would punt reads to workers
    // (tmpfs without FMODE_NOWAIT); either way the data round-trips.
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let p = sized_file(shm.path(), "s.img", SIZE);
    let d = FileDisk::open(&p, FileOptions::default()).unwrap();
    eprintln!("{}", d.describe());
    let mut ch = d.channel().unwrap();
    let mem = SharedMem::new("g", 8192).unwrap();
    let s = mem.all();
    s.write_from(0, &pattern(4096, 4)).unwrap();
    let w = [s.sub(0, 4096).unwrap()];
    assert_eq!(run(&mut *ch, IoOp::Write, 4096, &w, false), IoStatus::Ok);
    let r = [s.sub(4096, 4096).unwrap()];
    assert_eq!(run(&mut *ch, IoOp::Read, 4096, &r, false), IoStatus::Ok);
    let mut b = vec![0u8; 4096];
    s.read_into(4096, &mut b).unwrap();
    assert_eq!(b, pattern(4096, 4));
}

#[test]
fn resize_sets_the_file_length() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "r.img", SIZE);
    let d = open(&p, false, false);
    let big = d.resize(4 * SIZE).unwrap();
    assert_eq!(big.info().size_bytes(), 4 * SIZE);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 * SIZE);
    let mut ch = big.channel().unwrap();
    let mem = SharedMem::new("g", 4096).unwrap();
    let s = mem.all();
    s.write_from(0, &pattern(4096, 3)).unwrap();
    let iov = [s];
    assert_eq!(
        run(ch.as_mut(), IoOp::Write, 4 * SIZE - 4096, &iov, false),
        IoStatus::Ok
    );
    assert_eq!(
        run(ch.as_mut(), IoOp::Write, SIZE - 4096, &iov, false),
        IoStatus::Ok
    );
    // A shrink truncates the file: what lay past the new end is gone.
    let small = big.resize(SIZE).unwrap();
    assert_eq!(small.info().size_bytes(), SIZE);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), SIZE);
    let mut ch = small.channel().unwrap();
    assert_eq!(
        run(ch.as_mut(), IoOp::Read, 4 * SIZE - 4096, &iov, false),
        IoStatus::OutOfRange
    );
    s.fill(0);
    assert_eq!(
        run(ch.as_mut(), IoOp::Read, SIZE - 4096, &iov, false),
        IoStatus::Ok
    );
    let mut b = vec![0u8; 4096];
    s.read_into(0, &mut b).unwrap();
    assert_eq!(b, pattern(4096, 3), "data below the new end is kept");
    let again = small.resize(2 * SIZE).unwrap();
    let mut ch = again.channel().unwrap();
    assert_eq!(
        run(ch.as_mut(), IoOp::Read, 2 * SIZE - 4096, &iov, false),
        IoStatus::Ok
    );
    s.read_into(0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 0), "grown again: zeroes");
    // Read-only files keep their length: only the size they have is taken.
    let ro = open(&p, false, true);
    let e = ro.resize(8 * SIZE).err().unwrap();
    assert!(matches!(
        bdev::typed::<FileError>(&e),
        Some(FileError::KeepsSize {
            asked,
            block_device: false,
            ..
        }) if *asked == 8 * SIZE
    ));
    assert!(ro.resize(SIZE).is_err());
    assert_eq!(ro.resize(2 * SIZE).unwrap().info().size_bytes(), 2 * SIZE);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 * SIZE);
}

/// A disk opened with 4096-byte blocks on storage that takes 512-byte I/O can
/// present 512-byte blocks later (Format NVM): requests need only its alignment.
#[test]
fn alignment_below_the_block_size() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "a.img", SIZE);
    for direct in [false, true] {
        let d = FileDisk::open(
            &p,
            FileOptions {
                direct,
                block_size: Some(4096),
                ..FileOptions::default()
            },
        )
        .unwrap();
        assert_eq!(d.info().block_size, 4096);
        if d.direct() {
            // Most filesystems take 512-byte direct I/O; the probe decides.
            assert!([512, 4096].contains(&d.alignment()));
        } else {
            assert_eq!(d.alignment(), 512);
        }
        let a = d.alignment();
        assert_eq!(
            d.format_support(),
            bdev::FormatSupport::Exclusive { min_block_size: a }
        );
        let mut ch = d.channel().unwrap();
        let mem = SharedMem::new("g", 4096).unwrap();
        let s = mem.all();
        s.write_from(0, &pattern(512, 3)).unwrap();
        let one = [s.sub(0, 512).unwrap()];
        let want = if a == 512 {
            IoStatus::Ok
        } else {
            IoStatus::Invalid
        };
        assert_eq!(run(&mut *ch, IoOp::Write, 512, &one, false), want);
    }
}

/// A loop device with 4096-byte logical sectors (root only; skipped otherwise):
/// the disk's alignment is the sector size, so 512-byte blocks are refused.
#[test]
fn block_device_alignment_is_its_sector_size() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "loop.img", SIZE);
    let Some(dev) = LoopDev::attach(&p, 4096).ok() else {
        eprintln!("skipped: cannot attach a loop device (not root?)");
        return;
    };
    let d = FileDisk::open(&dev.path, FileOptions::default()).unwrap();
    assert_eq!(d.info().block_size, 4096);
    assert_eq!(d.alignment(), 4096);
    assert_eq!(
        d.format_support(),
        bdev::FormatSupport::Exclusive {
            min_block_size: 4096
        }
    );
}

/// A block device takes only the size it has: after the volume grows (here the
/// loop device's file, then `losetup --set-capacity`), the disk can follow it.
#[test]
fn block_device_resizes_only_to_its_own_size() {
    let dir = disk_dir();
    let p = sized_file(dir.path(), "grow.img", SIZE);
    let Some(dev) = LoopDev::attach(&p, 512).ok() else {
        eprintln!("skipped: cannot attach a loop device (not root?)");
        return;
    };
    let d = FileDisk::open(&dev.path, FileOptions::default()).unwrap();
    assert_eq!(d.info().size_bytes(), SIZE);
    let e = d
        .resize(2 * SIZE)
        .err()
        .expect("a device does not grow from here");
    assert!(
        matches!(
            bdev::typed::<FileError>(&e),
            Some(FileError::KeepsSize {
                block_device: true,
                has,
                ..
            }) if *has == SIZE
        ),
        "{e:?}"
    );
    assert!(d.resize(SIZE / 2).is_err(), "nor shrink");
    assert_eq!(d.resize(SIZE).unwrap().info().size_bytes(), SIZE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(2 * SIZE)
        .unwrap();
    assert!(dev.set_capacity(), "losetup --set-capacity");
    let big = d.resize(2 * SIZE).unwrap();
    assert_eq!(big.info().size_bytes(), 2 * SIZE);
    let mut ch = big.channel().unwrap();
    let mem = SharedMem::new("g", 4096).unwrap();
    let iov = [mem.all()];
    assert_eq!(
        run(ch.as_mut(), IoOp::Write, 2 * SIZE - 4096, &iov, false),
        IoStatus::Ok
    );
}
