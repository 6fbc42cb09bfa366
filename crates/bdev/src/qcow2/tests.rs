//! The qcow2 backend without QEMU: hostile headers and chains end in typed
//! errors at open, corrupt tables in I/O error statuses; images made by
//! `create_qcow2` keep what is written through a channel across a reopen.
//! (Interop with qemu-img is `tests/qcow2.rs`.)

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use guest_mem::MappedRegion;
use test_support::wait::{wait_until, T};

use super::meta::{get_refcount, put_refcount};
use super::*;
use crate::{IoOp, IoRequest, IoStatus};

/// One request to completion (`test_support::channel::one` is for the crate
/// seen from outside: inside it, its types are another crate's).
fn io(ch: &mut dyn IoChannel, op: IoOp, offset: u64, buf: &MappedRegion, len: usize) -> IoStatus {
    let iov = [buf.slice(0, len).unwrap()];
    let n = usize::from(matches!(op, IoOp::Read | IoOp::Write));
    let req = IoRequest {
        op,
        offset,
        len: len as u64,
        iov: &iov[..n],
        fua: false,
    };
    if let Some(st) = ch.submit(1, &req) {
        return st;
    }
    let mut out = None;
    wait_until("completion", T, || {
        ch.flush();
        ch.poll(&mut |_, st| out = Some(st));
        out.is_some()
    });
    out.unwrap()
}

const MIB: u64 = 1 << 20;

/// What a hostile case must be refused with.
type IsHeader = fn(&HeaderError) -> bool;
type IsOpen = fn(&Qcow2Error) -> bool;

fn new_image(dir: &Path, name: &str, size: u64, backing: Option<&str>) -> PathBuf {
    let p = dir.join(name);
    let o = CreateOptions {
        size,
        cluster_size: 64 << 10,
        backing: backing.map(str::to_string),
    };
    assert!(create_qcow2(&p, &o).unwrap());
    p
}

fn head(p: &Path) -> (Vec<u8>, u64) {
    let f = std::fs::File::open(p).unwrap();
    let len = f.metadata().unwrap().len();
    let mut b = vec![0; 65536];
    f.read_exact_at(&mut b, 0).unwrap();
    (b, len)
}

fn put(p: &Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

#[test]
fn hostile_header_fields_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let p = new_image(dir.path(), "a.qcow2", 64 * MIB, None);
    let (good, len) = head(&p);
    let h = Header::parse(&good, len).unwrap();
    assert_eq!(
        (h.size, h.cluster_bits, h.refcount_order),
        (64 * MIB, 16, 4)
    );
    let cases: Vec<(usize, Vec<u8>, IsHeader)> = vec![
        (0, b"QFI\xfc".to_vec(), |e| *e == HeaderError::Magic),
        (4, 2u32.to_be_bytes().to_vec(), |e| {
            *e == HeaderError::Version(2)
        }),
        (20, 8u32.to_be_bytes().to_vec(), |e| {
            *e == HeaderError::ClusterBits(8)
        }),
        (20, 22u32.to_be_bytes().to_vec(), |e| {
            *e == HeaderError::ClusterBits(22)
        }),
        (100, 100u32.to_be_bytes().to_vec(), |e| {
            *e == HeaderError::HeaderLength(100)
        }),
        (24, (1u64 << 62).to_be_bytes().to_vec(), |e| {
            matches!(e, HeaderError::Size(_))
        }),
        (96, 7u32.to_be_bytes().to_vec(), |e| {
            *e == HeaderError::RefcountOrder(7)
        }),
        (36, 0u32.to_be_bytes().to_vec(), |e| {
            matches!(e, HeaderError::L1Size { .. })
        }),
        (36, u32::MAX.to_be_bytes().to_vec(), |e| {
            matches!(e, HeaderError::L1Size { .. })
        }),
        (40, 0x10200u64.to_be_bytes().to_vec(), |e| {
            matches!(
                e,
                HeaderError::Table {
                    what: "L1 table",
                    ..
                }
            )
        }),
        (40, 0u64.to_be_bytes().to_vec(), |e| {
            matches!(
                e,
                HeaderError::Table {
                    what: "L1 table",
                    ..
                }
            )
        }),
        (40, (1u64 << 40).to_be_bytes().to_vec(), |e| {
            matches!(
                e,
                HeaderError::Table {
                    what: "L1 table",
                    ..
                }
            )
        }),
        (48, 0u64.to_be_bytes().to_vec(), |e| {
            matches!(
                e,
                HeaderError::Table {
                    what: "refcount table",
                    ..
                }
            )
        }),
        (56, 0u32.to_be_bytes().to_vec(), |e| {
            *e == HeaderError::RefcountTableSize(0)
        }),
        (56, u32::MAX.to_be_bytes().to_vec(), |e| {
            matches!(e, HeaderError::RefcountTableSize(_))
        }),
        (48, h.l1_offset.to_be_bytes().to_vec(), |e| {
            *e == HeaderError::Overlap
        }),
        (8, 65530u64.to_be_bytes().to_vec(), |e| {
            matches!(e, HeaderError::BackingName { .. })
        }),
        (104, [0, 0, 0, 9, 0x7f, 0xff, 0xff, 0xf0].to_vec(), |e| {
            matches!(e, HeaderError::Extension(_))
        }),
    ];
    for (at, bytes, want) in cases {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(&bytes);
        if at == 8 {
            b[16..20].copy_from_slice(&100u32.to_be_bytes());
        }
        let e = Header::parse(&b, len).unwrap_err();
        assert!(want(&e), "field at {at}: {e:?}");
        // Every prefix of a hostile header is refused or parsed, never a panic.
        for n in [0, 7, 50, 103, 104, 200] {
            let _ = Header::parse(&b[..n], len);
        }
    }
}

#[test]
fn refused_features_name_themselves() {
    let dir = tempfile::tempdir().unwrap();
    // Dirty (lazy refcounts, not written back): rebuilt at a writable open.
    let p = new_image(dir.path(), "dirty.qcow2", MIB, None);
    put(&p, 72, &1u64.to_be_bytes());
    drop(Qcow2Disk::open(&p, Qcow2Options::default()).unwrap());
    assert_eq!(head(&p).0[79] & 1, 0, "the dirty bit stayed");
    let cases: [(u64, u64, IsOpen); 3] = [
        (72, 2, |e| matches!(e, Qcow2Error::Corrupt { .. })),
        (
            72,
            4,
            |e| matches!(e, Qcow2Error::Unsupported { feature, .. } if feature.contains("data file")),
        ),
        (
            72,
            1 << 40,
            |e| matches!(e, Qcow2Error::Unsupported { feature, .. } if feature.contains("unknown")),
        ),
    ];
    for (i, (at, v, want)) in cases.into_iter().enumerate() {
        let p = new_image(dir.path(), &format!("f{i}.qcow2"), MIB, None);
        put(&p, at, &v.to_be_bytes());
        let e = Qcow2Disk::open(&p, Qcow2Options::default()).err().unwrap();
        assert!(want(&e), "{e}");
        let _ = std::io::Error::from(e);
    }
    // Subclusters of less than 512 bytes.
    let p = new_image(dir.path(), "x.qcow2", MIB, None);
    put(&p, 72, &16u64.to_be_bytes());
    put(&p, 20, &13u32.to_be_bytes());
    let e = Qcow2Disk::open(&p, Qcow2Options::default()).err().unwrap();
    assert!(
        matches!(
            &e,
            Qcow2Error::Header {
                source: HeaderError::Subclusters(13),
                ..
            }
        ),
        "{e}"
    );
    let p = new_image(dir.path(), "enc.qcow2", MIB, None);
    put(&p, 32, &1u32.to_be_bytes());
    let e = Qcow2Disk::open(&p, Qcow2Options::default()).err().unwrap();
    assert!(matches!(e, Qcow2Error::Unsupported { .. }), "{e}");
}

#[test]
fn backing_loops_and_deep_chains_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // An image that is its own backing file (the name written after creation).
    let p = new_image(dir.path(), "self.qcow2", MIB, None);
    let name = b"self.qcow2";
    put(&p, 512, name);
    put(&p, 8, &512u64.to_be_bytes());
    put(&p, 16, &(name.len() as u32).to_be_bytes());
    let e = Qcow2Disk::open(&p, Qcow2Options::default()).err().unwrap();
    assert!(matches!(e, Qcow2Error::BackingLoop { .. }), "{e}");
    // a -> b -> a
    let a = new_image(dir.path(), "a.qcow2", MIB, None);
    new_image(dir.path(), "b.qcow2", MIB, Some("a.qcow2"));
    put(&a, 512, b"b.qcow2");
    put(&a, 8, &512u64.to_be_bytes());
    put(&a, 16, &7u32.to_be_bytes());
    let e = Qcow2Disk::open(&a, Qcow2Options::default()).err().unwrap();
    assert!(matches!(e, Qcow2Error::BackingLoop { .. }), "{e}");
    // A chain one deeper than allowed.
    let mut prev = "c0.qcow2".to_string();
    new_image(dir.path(), &prev, MIB, None);
    for i in 1..=MAX_BACKING_CHAIN + 1 {
        let name = format!("c{i}.qcow2");
        new_image(dir.path(), &name, MIB, Some(&prev));
        prev = name;
    }
    let e = Qcow2Disk::open(dir.path().join(&prev), Qcow2Options::default())
        .err()
        .unwrap();
    assert!(matches!(e, Qcow2Error::ChainTooDeep { .. }), "{e}");
    let ok = format!("c{}.qcow2", MAX_BACKING_CHAIN - 1);
    let d = Qcow2Disk::open(dir.path().join(ok), Qcow2Options::default()).unwrap();
    assert_eq!(d.status().backing_chain.len(), MAX_BACKING_CHAIN - 1);
}

#[test]
fn corrupt_tables_end_in_io_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let p = new_image(dir.path(), "c.qcow2", 4 * MIB, None);
    let (b, len) = head(&p);
    let h = Header::parse(&b, len).unwrap();
    let buf = MappedRegion::anonymous(0, 65536).unwrap();
    for l1 in [
        1u64 << 50,
        0x10200 | tables::COPIED,
        tables::OFFSET_MASK,
        0x200,
    ] {
        put(&p, h.l1_offset, &l1.to_be_bytes());
        let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
        let mut ch = d.channel().unwrap();
        assert_eq!(
            io(&mut *ch, IoOp::Read, 0, &buf, 4096),
            IoStatus::ReadError,
            "L1 {l1:#x}"
        );
        assert_eq!(
            io(&mut *ch, IoOp::Write, 0, &buf, 4096),
            IoStatus::IoError,
            "L1 {l1:#x}"
        );
        assert_eq!(
            io(&mut *ch, IoOp::WriteZeroes, 0, &buf, 65536),
            IoStatus::IoError
        );
    }
}

#[test]
fn created_images_keep_what_was_written() {
    let dir = tempfile::tempdir().unwrap();
    let p = new_image(dir.path(), "w.qcow2", 8 * MIB, None);
    // Creating again over an image leaves it; over other data refuses.
    let o = CreateOptions {
        size: 8 * MIB,
        cluster_size: 65536,
        backing: None,
    };
    assert!(!create_qcow2(&p, &o).unwrap());
    let other = dir.path().join("other");
    std::fs::write(&other, b"data").unwrap();
    assert!(matches!(
        create_qcow2(&other, &o),
        Err(Qcow2Error::NotBlank { .. })
    ));
    let buf = MappedRegion::anonymous(0, 3 * 65536).unwrap();
    let data: Vec<u8> = (0..3 * 65536u32).map(|i| ((i * 7) >> 3) as u8).collect();
    buf.slice(0, data.len())
        .unwrap()
        .write_from(0, &data)
        .unwrap();
    {
        let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
        let mut ch = d.channel().unwrap();
        // Partial, whole and spanning writes; a read of an unallocated cluster.
        assert_eq!(io(&mut *ch, IoOp::Write, 512, &buf, 4096), IoStatus::Ok);
        assert_eq!(
            io(&mut *ch, IoOp::Write, 65536 * 3 - 4096, &buf, 3 * 65536),
            IoStatus::Ok
        );
        assert_eq!(
            io(&mut *ch, IoOp::WriteZeroes, 65536 * 4, &buf, 65536),
            IoStatus::Ok
        );
        assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
        // Over allocated clusters: the fast path.
        assert_eq!(
            io(&mut *ch, IoOp::Write, 65536 * 3, &buf, 8192),
            IoStatus::Ok
        );
    }
    let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
    let mut ch = d.channel().unwrap();
    let out = MappedRegion::anonymous(0, 8 * MIB).unwrap();
    assert_eq!(
        io(&mut *ch, IoOp::Read, 0, &out, 8 * MIB as usize),
        IoStatus::Ok
    );
    let mut got = vec![0u8; 8 * MIB as usize];
    out.slice(0, got.len())
        .unwrap()
        .read_into(0, &mut got)
        .unwrap();
    let mut want = vec![0u8; 8 * MIB as usize];
    want[512..512 + 4096].copy_from_slice(&data[..4096]);
    let at = 65536 * 3 - 4096;
    want[at..at + 3 * 65536].copy_from_slice(&data);
    want[65536 * 4..65536 * 5].fill(0);
    want[65536 * 3..65536 * 3 + 8192].copy_from_slice(&data[..8192]);
    assert!(got == want, "content differs after reopen");
    assert!(d.status().allocated > 3 * 65536);
}

#[test]
fn refcounts_of_every_width_round_trip() {
    for order in 0..=6u32 {
        let mut b = vec![0u8; 512];
        let max = if order == 6 {
            u64::MAX
        } else {
            (1u64 << (1 << order)) - 1
        };
        for i in [0usize, 1, 5, 17] {
            put_refcount(&mut b, order, i, max);
            assert_eq!(get_refcount(&b, order, i), max, "order {order} index {i}");
            assert_eq!(get_refcount(&b, order, i + 1), 0);
            put_refcount(&mut b, order, i, 1);
            assert_eq!(get_refcount(&b, order, i), 1);
        }
    }
}

#[test]
fn pause_puts_the_metadata_on_disk_for_a_successor() {
    let dir = tempfile::tempdir().unwrap();
    let p = new_image(dir.path(), "h.qcow2", 4 * MIB, None);
    let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
    let mut ch = d.channel().unwrap();
    let buf = MappedRegion::anonymous(0, 4096).unwrap();
    buf.slice(0, 4096)
        .unwrap()
        .write_from(0, &[0x3c; 4096])
        .unwrap();
    assert_eq!(io(&mut *ch, IoOp::Write, MIB, &buf, 4096), IoStatus::Ok);
    d.pause().unwrap();
    // The successor, while this process still has the image open.
    let next = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
    let mut ch2 = next.channel().unwrap();
    let out = MappedRegion::anonymous(0, 4096).unwrap();
    assert_eq!(io(&mut *ch2, IoOp::Read, MIB, &out, 4096), IoStatus::Ok);
    let mut got = [0u8; 4096];
    out.slice(0, 4096).unwrap().read_into(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0x3c));
}

#[test]
fn hostile_refcount_and_l2_entries_are_io_errors() {
    let dir = tempfile::tempdir().unwrap();
    let buf = MappedRegion::anonymous(0, 65536).unwrap();
    // A refcount table entry pointing outside the file, unaligned, at the header.
    for bad in [1u64 << 45, 0x30200, 0] {
        let p = new_image(dir.path(), &format!("r{bad:x}.qcow2"), 4 * MIB, None);
        let (b, len) = head(&p);
        let h = Header::parse(&b, len).unwrap();
        put(&p, h.refcount_table_offset, &bad.to_be_bytes());
        let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
        let mut ch = d.channel().unwrap();
        let st = io(&mut *ch, IoOp::Write, 0, &buf, 4096);
        // Entry 0 covers the image's own first clusters: a missing block is
        // made anew (the image then has leaks), a bad one is an error.
        assert!(
            st == IoStatus::IoError || (bad == 0 && st == IoStatus::Ok),
            "{bad:#x}: {st:?}"
        );
        assert_eq!(io(&mut *ch, IoOp::Read, 0, &buf, 4096), IoStatus::Ok);
    }
    // L2 entries pointing into the header cluster, past the file, unaligned.
    let p = new_image(dir.path(), "l2.qcow2", 4 * MIB, None);
    {
        let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
        let mut ch = d.channel().unwrap();
        assert_eq!(io(&mut *ch, IoOp::Write, 0, &buf, 65536), IoStatus::Ok);
    }
    let (b, len) = head(&p);
    let h = Header::parse(&b, len).unwrap();
    let f = std::fs::File::open(&p).unwrap();
    let mut l1 = [0u8; 8];
    f.read_exact_at(&mut l1, h.l1_offset).unwrap();
    let l2 = u64::from_be_bytes(l1) & tables::OFFSET_MASK;
    for bad in [
        tables::COPIED | 0x200,
        tables::COPIED | (1 << 50),
        tables::COPIED | 0x20200,
    ] {
        put(&p, l2, &bad.to_be_bytes());
        let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
        let mut ch = d.channel().unwrap();
        assert_eq!(
            io(&mut *ch, IoOp::Read, 0, &buf, 4096),
            IoStatus::ReadError,
            "{bad:#x}"
        );
        assert_eq!(
            io(&mut *ch, IoOp::Write, 0, &buf, 4096),
            IoStatus::IoError,
            "{bad:#x}"
        );
    }
}

/// A crash after a flush: what was flushed reads back, what was written after
/// it (its clusters allocated, its metadata only in memory) reads as before,
/// never as another cluster's data.
#[test]
fn a_crash_loses_only_what_was_not_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let p = new_image(dir.path(), "crash.qcow2", 4 * MIB, None);
    let buf = MappedRegion::anonymous(0, 65536).unwrap();
    let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
    let mut ch = d.channel().unwrap();
    buf.slice(0, 65536)
        .unwrap()
        .write_from(0, &[0xa1; 65536])
        .unwrap();
    assert_eq!(io(&mut *ch, IoOp::Write, 0, &buf, 65536), IoStatus::Ok);
    assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
    buf.slice(0, 65536)
        .unwrap()
        .write_from(0, &[0xb2; 65536])
        .unwrap();
    assert_eq!(io(&mut *ch, IoOp::Write, MIB, &buf, 65536), IoStatus::Ok);
    drop(ch);
    // The process dies: nothing in memory reaches the file.
    std::mem::forget(d);
    let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
    let mut ch = d.channel().unwrap();
    let mut got = vec![0u8; 65536];
    assert_eq!(io(&mut *ch, IoOp::Read, 0, &buf, 65536), IoStatus::Ok);
    buf.slice(0, 65536).unwrap().read_into(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0xa1), "flushed data survives");
    assert_eq!(io(&mut *ch, IoOp::Read, MIB, &buf, 65536), IoStatus::Ok);
    buf.slice(0, 65536).unwrap().read_into(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&b| b == 0),
        "unflushed data reads as before"
    );
    // The clusters allocated since the crash are past the lost ones.
    assert_eq!(
        io(&mut *ch, IoOp::Write, 2 * MIB, &buf, 65536),
        IoStatus::Ok
    );
}

/// A cluster a discard freed is not handed out while some channel may still
/// have a request in flight that was translated to it before the discard
/// (one that publishes an older generation), only once that channel has run
/// empty; and only after a flush made the discard durable.
#[test]
fn freed_clusters_wait_for_requests_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let p = new_image(dir.path(), "reuse.qcow2", 8 * MIB, None);
    let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
    let mut ch = d.channel().unwrap();
    let buf = MappedRegion::anonymous(0, 65536).unwrap();
    let data = buf.slice(0, 65536).unwrap();
    data.write_from(0, &[0xc3; 65536]).unwrap();
    let write = |ch: &mut dyn IoChannel, at| {
        assert_eq!(io(ch, IoOp::Write, at, &buf, 65536), IoStatus::Ok);
    };
    for at in [0, MIB, 2 * MIB] {
        write(&mut *ch, at);
    }
    assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
    // Another channel with a request in flight since before the discard.
    let busy = Arc::new(meta::Quiet::new(1));
    d.active.get().meta().register(&busy);
    let size = || d.status().allocated;
    let before = size();
    assert_eq!(io(&mut *ch, IoOp::Discard, 0, &buf, 65536), IoStatus::Ok);
    write(&mut *ch, 3 * MIB);
    assert_eq!(size(), before + 65536, "no reuse before a flush");
    assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
    write(&mut *ch, 4 * MIB);
    assert_eq!(size(), before + 2 * 65536, "no reuse under a busy channel");
    busy.store(meta::IDLE, std::sync::atomic::Ordering::SeqCst);
    write(&mut *ch, 5 * MIB);
    assert_eq!(size(), before + 2 * 65536, "reused once it ran empty");
    drop(ch);
    drop(d);
    // Reopened: the freed cluster holds guest cluster 5 MiB's data, 0 reads
    // as zeroes.
    let d = Qcow2Disk::open(&p, Qcow2Options::default()).unwrap();
    let mut ch = d.channel().unwrap();
    let mut got = vec![1u8; 65536];
    for (at, want) in [(0, 0), (5 * MIB, 0xc3), (MIB, 0xc3)] {
        assert_eq!(io(&mut *ch, IoOp::Read, at, &buf, 65536), IoStatus::Ok);
        data.read_into(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == want), "at {at}");
    }
}
