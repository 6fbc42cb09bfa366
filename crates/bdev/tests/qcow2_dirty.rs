//! Dirty images (QEMU's lazy refcounts, then a crash), as QEMU treats them: a
//! read-only open serves the data and leaves the file alone; a writable open
//! rebuilds the refcounts first, so `qemu-img check` finds the image clean and
//! what QEMU wrote before the crash reads back. Skipped, saying so, without
//! qemu-img (Debian: qemu-utils).

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use bdev::{BlockDevice, Qcow2Disk, Qcow2Options};
use test_support::qemu::{have_qemu_tools, qemu_img};

mod qcow2_common;
use qcow2_common::{fill, first_difference, read_all, MIB};

fn dirty_bit(img: &Path) -> bool {
    let f = std::fs::File::open(img).unwrap();
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, 72).unwrap();
    u64::from_be_bytes(b) & 1 != 0
}

/// `qemu-img check`'s exit status: 0 clean, 2 errors, 3 leaks only.
/// `qemu-img check`'s exit status (`-U`: the image may be open here, as a
/// writer, under QEMU's image locks).
fn check_status(img: &Path) -> Option<i32> {
    Command::new("qemu-img")
        .args(["check", "-q", "-U"])
        .arg(img)
        .status()
        .unwrap()
        .code()
}

/// A 64 MiB lazy-refcounts image that `qemu-io` wrote and then crashed in
/// (`abort`), and what it holds.
fn crashed_image(img: &Path, cluster: &str) -> Vec<u8> {
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("lazy_refcounts=on,cluster_size={cluster}"),
        img.to_str().unwrap(),
        "64M",
    ]);
    let writes = [
        (0x11u8, 0u64, MIB),
        (0x22, 8 * MIB + 4096, 192 << 10),
        (0x33, 40 * MIB, 64 << 10),
    ];
    let mut c = Command::new("qemu-io");
    c.args(["-f", "qcow2"]);
    for (p, o, l) in writes {
        c.args(["-c", &format!("write -P {p:#x} {o} {l}")]);
    }
    let st = c.args(["-c", "abort"]).arg(img).output().unwrap().status;
    assert!(!st.success(), "qemu-io's abort did not crash it");
    let mut want = vec![0u8; 64 * MIB as usize];
    for (p, o, l) in writes {
        fill(&mut want, p, o, l);
    }
    want
}

#[test]
fn a_dirty_image_is_repaired_when_opened_for_writing() {
    if !have_qemu_tools() {
        eprintln!("skipped: no qemu-img");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for cluster in ["64k", "4k"] {
        let img = dir.path().join(format!("lazy-{cluster}.qcow2"));
        let want = crashed_image(&img, cluster);
        assert!(dirty_bit(&img), "qemu-io left no dirty image");
        assert_ne!(
            check_status(&img),
            Some(0),
            "the crash left nothing to repair"
        );

        // Read-only: served as it is, not touched.
        let before = std::fs::read(&img).unwrap();
        let ro = Qcow2Options {
            read_only: true,
            ..Qcow2Options::default()
        };
        let got = read_all(&Qcow2Disk::open(&img, ro).unwrap());
        assert_eq!(first_difference(&got, &want), None, "{cluster} read-only");
        assert!(
            std::fs::read(&img).unwrap() == before,
            "a read-only open wrote"
        );

        // Writable: repaired, then it takes writes.
        let disk = Qcow2Disk::open(&img, Qcow2Options::default()).unwrap();
        assert!(!dirty_bit(&img));
        assert_eq!(
            check_status(&img),
            Some(0),
            "{cluster}: not clean after the repair"
        );
        let got = read_all(&disk);
        assert_eq!(first_difference(&got, &want), None, "{cluster} repaired");
        let mut ch = disk.channel().unwrap();
        let mut want = want;
        qcow2_common::random_ops(
            &mut *ch,
            &mut test_support::rng::Rng::new(7),
            &mut want,
            200,
        );
        drop(ch);
        drop(disk);
        assert_eq!(
            check_status(&img),
            Some(0),
            "{cluster}: not clean after writes"
        );
        let got = read_all(&Qcow2Disk::open(&img, Qcow2Options::default()).unwrap());
        assert_eq!(
            first_difference(&got, &want),
            None,
            "{cluster} after writes"
        );
    }
}

/// A dirty image whose tables point outside the file is not repaired: the open
/// fails naming the dirty bit and what is wrong, and the file is left as it was.
#[test]
fn a_dirty_image_with_tables_outside_the_file_is_refused() {
    if !have_qemu_tools() {
        eprintln!("skipped: no qemu-img");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("bad.qcow2");
    crashed_image(&img, "64k");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let mut l1 = [0u8; 8];
    f.read_exact_at(&mut l1, 40).unwrap();
    let l1_offset = u64::from_be_bytes(l1);
    f.write_all_at(&((1u64 << 63) | (1 << 40)).to_be_bytes(), l1_offset)
        .unwrap();
    drop(f);
    let before = std::fs::read(&img).unwrap();
    let e = Qcow2Disk::open(&img, Qcow2Options::default())
        .err()
        .unwrap();
    let text = format!("{e}");
    assert!(matches!(e, bdev::Qcow2Error::Dirty { .. }), "{text}");
    assert!(
        text.contains("outside the file") && text.contains("qemu-img check -r all"),
        "{text}"
    );
    assert!(
        std::fs::read(&img).unwrap() == before,
        "a refused repair wrote"
    );
}
