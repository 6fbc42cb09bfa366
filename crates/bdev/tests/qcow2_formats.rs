//! qcow2 format features against QEMU's tools: extended L2 entries
//! (subclusters) qemu-io wrote read back through udrive over a backing file,
//! and discards that free clusters for later writes, checked by `qemu-img
//! check` and `compare`. Skipped, saying so, where qemu-img is not installed.

use bdev::{BlockDevice, IoOp, IoStatus, Qcow2Disk, Qcow2Options};
use guest_mem::MappedRegion;
use test_support::channel::one as io;
use test_support::qemu::{
    have_qemu_tools, qemu_check, qemu_check_held, qemu_compare, qemu_compare_held, qemu_create,
    qemu_io,
};
use test_support::rng::Rng;

mod qcow2_common;
use qcow2_common::{fill, first_difference, open, random_ops, raw_base, read_all, MIB};

fn read_only() -> Qcow2Options {
    Qcow2Options {
        read_only: true,
        ..Qcow2Options::default()
    }
}

/// Images with extended L2 entries, written by qemu-io a subcluster at a time
/// (whole, partial, zeroed) over a raw backing file, read back exactly: what
/// no subcluster holds is the backing file's. Random writes, zeroes and
/// discards through udrive pass `qemu-img check` and `compare`; QEMU writes
/// subclusters after them; as the backing file of a plain image they serve
/// writes above them.
#[test]
fn subcluster_images_qemu_wrote_read_back_exactly() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = raw_base(d, 8 * MIB, &mut Rng::new(11));
    for (cs, name) in [(16u64 << 10, "16k"), (64 << 10, "64k"), (2 * MIB, "2M")] {
        let img = d.join(format!("x{name}.qcow2"));
        let opts = format!("{name},extended_l2=on");
        qemu_create(&img, "8M", Some(("base.raw", "raw")), Some(&opts));
        let sc = cs / 32;
        let writes = [
            (0x11u8, sc, sc),
            (0x22, 3 * sc + 512, 1024),
            (0x00, 5 * sc, 2 * sc),
            (0x33, cs + 7 * sc, 3 * sc + 512),
            (0x44, 2 * cs, cs),
        ];
        let cmds: Vec<String> = writes
            .iter()
            .map(|&(p, o, l)| match p {
                0 => format!("write -z {o} {l}"),
                _ => format!("write -P {p:#x} {o} {l}"),
            })
            .collect();
        qemu_io(&img, &cmds);
        let mut want = base.clone();
        for (p, o, l) in writes {
            fill(&mut want, p, o, l);
        }
        let disk = Qcow2Disk::open(&img, read_only()).unwrap();
        assert_eq!(first_difference(&read_all(&disk), &want), None, "{name}");
        drop(disk);
        // Written through udrive (a partly allocated cluster is made whole,
        // the rest from the backing file), then checked and compared by QEMU.
        let disk = open(&img);
        let mut ch = disk.channel().unwrap();
        random_ops(&mut *ch, &mut Rng::new(cs + 1), &mut want, 200);
        drop(ch);
        assert_eq!(first_difference(&read_all(&disk), &want), None, "{name}");
        drop(disk);
        check_clean(&img);
        qemu_compare(&img, &want);
        qemu_io(&img, &[format!("write -P 0x55 {} {sc}", 3 * cs + sc)]);
        fill(&mut want, 0x55, 3 * cs + sc, sc);
        // A plain overlay over it takes writes; QEMU agrees with the result.
        let top = d.join(format!("t{name}.qcow2"));
        let backing = img.file_name().unwrap().to_str().unwrap();
        qemu_create(&top, "8M", Some((backing, "qcow2")), None);
        let disk = open(&top);
        let mut ch = disk.channel().unwrap();
        random_ops(&mut *ch, &mut Rng::new(cs), &mut want, 60);
        drop((ch, disk));
        qemu_check(&top);
        qemu_compare(&top, &want);
    }
}

/// `qemu-img check` without corruption and without leaks.
fn check_clean(img: &std::path::Path) {
    let out = std::process::Command::new("qemu-img")
        .args(["check", "-q"])
        .arg(img)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Discarded clusters are freed: after a flush, writes elsewhere take their
/// space and the image does not grow; over a backing file they read as
/// zeroes (not the base's data). QEMU finds no leak and the data written.
#[test]
fn discards_free_clusters_for_later_writes() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut rng = Rng::new(21);
    let base = raw_base(d, 16 * MIB, &mut rng);
    for backing in [false, true] {
        let img = d.join(format!("d{backing}.qcow2"));
        let mut want = vec![0u8; 16 * MIB as usize];
        if backing {
            want.copy_from_slice(&base);
            qemu_create(&img, "16M", Some(("base.raw", "raw")), None);
        } else {
            qemu_create(&img, "16M", None, None);
        }
        let disk = open(&img);
        let mut ch = disk.channel().unwrap();
        // Large enough for the discard's length (it carries no data).
        let buf = MappedRegion::anonymous(0, 4 * MIB).unwrap();
        let mut write = |ch: &mut dyn bdev::IoChannel, at: u64, want: &mut [u8]| {
            let r = at as usize..(at + MIB) as usize;
            rng.fill(&mut want[r.clone()]);
            buf.slice(0, MIB as usize)
                .unwrap()
                .write_from(0, &want[r])
                .unwrap();
            assert_eq!(io(ch, IoOp::Write, at, &buf, MIB as usize), IoStatus::Ok);
        };
        for at in (0..4 * MIB).step_by(MIB as usize) {
            write(&mut *ch, at, &mut want);
        }
        assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
        let size = disk.status().allocated;
        // Partial clusters at the ends are left alone (a discard is a hint).
        let (from, to) = (512, 4 * MIB - 512);
        let len = (to - from) as usize;
        assert_eq!(io(&mut *ch, IoOp::Discard, from, &buf, len), IoStatus::Ok);
        want[65536..(4 * MIB - 65536) as usize].fill(0);
        assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
        for at in (8 * MIB..11 * MIB).step_by(MIB as usize) {
            write(&mut *ch, at, &mut want);
        }
        assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
        assert_eq!(disk.status().allocated, size, "backing {backing}");
        assert_eq!(first_difference(&read_all(&disk), &want), None);
        drop((ch, disk));
        assert_eq!(std::fs::metadata(&img).unwrap().len(), size);
        check_clean(&img);
        qemu_compare(&img, &want);
        // Random writes, zeroes, discards and flushes over freed space.
        let disk = open(&img);
        let mut ch = disk.channel().unwrap();
        random_ops(&mut *ch, &mut rng, &mut want, 300);
        drop((ch, disk));
        check_clean(&img);
        qemu_compare(&img, &want);
    }
}

/// The process dies after a discard (before a flush), and after a freed
/// cluster was reused (before a flush): QEMU finds no corruption (leaks at
/// most), and the image reads what was flushed.
#[test]
fn a_crash_around_discards_leaks_at_most() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("c.qcow2");
    qemu_create(&img, "8M", None, None);
    let buf = MappedRegion::anonymous(0, MIB).unwrap();
    buf.slice(0, MIB as usize)
        .unwrap()
        .write_from(0, &[0x5e; MIB as usize])
        .unwrap();
    let mut want = vec![0u8; 8 * MIB as usize];
    fill(&mut want, 0x5e, 0, MIB);
    let step = |flushed: &[(IoOp, u64)], unflushed: &[(IoOp, u64)], want: Option<&[u8]>| {
        let disk = open(&img);
        let mut ch = disk.channel().unwrap();
        for &(op, at) in flushed.iter().chain(unflushed) {
            assert_eq!(io(&mut *ch, op, at, &buf, MIB as usize), IoStatus::Ok);
            if flushed.contains(&(op, at)) {
                assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
            }
        }
        drop(ch);
        // The process dies: nothing in memory reaches the file (its image
        // locks stay, as this process lives on).
        std::mem::forget(disk);
        qemu_check_held(&img);
        if let Some(want) = want {
            qemu_compare_held(&img, want);
        }
    };
    // Written and flushed, then discarded without a flush: the entry still
    // points at the cluster, whose space the discard punched out (a discard
    // leaves its range undefined: old data or zeroes).
    step(&[(IoOp::Write, 0)], &[(IoOp::Discard, 0)], None);
    // Discarded and flushed, then the space reused without a flush: the
    // discard holds, the write is lost, nothing points at the cluster twice.
    want[..MIB as usize].fill(0);
    step(
        &[(IoOp::Discard, 0)],
        &[(IoOp::Write, 4 * MIB)],
        Some(&want),
    );
}
