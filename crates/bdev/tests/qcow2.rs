//! qcow2 images against QEMU's own tools, both ways: images `qemu-img create`
//! made and `qemu-io` filled (cluster sizes from 512 B to 2 MiB, raw and qcow2
//! backing files, relative backing names) read back exactly through udrive;
//! images udrive wrote (random verified writes, discards, write zeroes, over a
//! backing file) pass `qemu-img check` and `qemu-img compare` against the data
//! written; images `create_qcow2` made open in `qemu-img`. Skipped, saying so,
//! where qemu-img is not installed (Debian: qemu-utils).

use std::path::{Path, PathBuf};
use std::process::Command;

use bdev::{create_qcow2, BlockDevice, IoOp, IoStatus, Qcow2Create, Qcow2Disk, Qcow2Options};
use guest_mem::MappedRegion;
use test_support::channel::one as io;
use test_support::qemu::{
    have_qemu_tools, qemu_check, qemu_check_held, qemu_compare, qemu_compare_held, qemu_create,
    qemu_img, qemu_io,
};
use test_support::rng::Rng;

mod qcow2_common;
use qcow2_common::{fill, first_difference, open, random_ops, read_all, MIB};

#[test]
fn images_qemu_wrote_read_back_exactly() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for cs in ["512", "4k", "64k", "2M"] {
        let img = dir.path().join(format!("q{cs}.qcow2"));
        qemu_create(&img, "24M", None, Some(cs));
        let writes = [
            (0xabu8, 0u64, MIB),
            (0x11, 5 * MIB + 512, 70 << 10),
            (0x5a, 20 * MIB - 4096, 4096),
        ];
        let mut cmds: Vec<String> = writes
            .iter()
            .map(|(p, o, l)| format!("write -P {p:#x} {o} {l}"))
            .collect();
        cmds.push(format!("write -z {} {}", 512 << 10, 256 << 10));
        qemu_io(&img, &cmds);
        let mut want = vec![0u8; 24 * MIB as usize];
        for (p, o, l) in writes {
            fill(&mut want, p, o, l);
        }
        fill(&mut want, 0, 512 << 10, 256 << 10);
        let got = read_all(&open(&img));
        assert_eq!(first_difference(&got, &want), None, "cluster size {cs}");
    }
}

/// raw <- qcow2 <- qcow2, with relative backing names and both -F formats.
#[test]
fn backing_chains_qemu_made_read_back_exactly() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut want = vec![0u8; 16 * MIB as usize];
    let mut rng = Rng::new(7);
    rng.fill(&mut want[..12 * MIB as usize]);
    // The base is shorter than the images above it: past its end reads zeroes.
    std::fs::write(d.join("base.raw"), &want[..12 * MIB as usize]).unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    let mid = d.join("sub/mid.qcow2");
    let top = d.join("sub/top.qcow2");
    qemu_create(&mid, "16M", Some(("../base.raw", "raw")), Some("4k"));
    qemu_io(
        &mid,
        &["write -P 0x22 4096 8192".into(), "write -z 1M 64k".into()],
    );
    qemu_create(&top, "16M", Some(("mid.qcow2", "qcow2")), None);
    qemu_io(
        &top,
        &[
            "write -P 0x33 6144 1024".into(),
            "write -P 0x44 14M 1M".into(),
        ],
    );
    fill(&mut want, 0x22, 4096, 8192);
    fill(&mut want, 0, MIB, 65536);
    fill(&mut want, 0x33, 6144, 1024);
    fill(&mut want, 0x44, 14 * MIB, MIB);
    let disk = open(&top);
    assert_eq!(first_difference(&read_all(&disk), &want), None);
    let chain = disk.status().backing_chain;
    assert_eq!(chain.len(), 2, "{chain:?}");
    assert!(
        chain[0].starts_with("qcow2:") && chain[1].starts_with("raw:"),
        "{chain:?}"
    );
}

/// 300 random writes, write zeroes, discards and flushes on `disk`, each
/// applied to `want`, then the whole device read back against it.
fn random_io(disk: &Qcow2Disk, rng: &mut Rng, want: &mut [u8]) {
    let mut ch = disk.channel().unwrap();
    random_ops(&mut *ch, rng, want, 300);
    assert_eq!(
        first_difference(&read_all(disk), want),
        None,
        "before close"
    );
}

/// Random verified writes, write zeroes and discards through udrive, over a
/// backing file, then QEMU's verdict.
fn udrive_writes_pass_qemu_check(cluster: &str, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let size = 16 * MIB;
    let mut want = vec![0u8; size as usize];
    let mut rng = Rng::new(seed);
    rng.fill(&mut want[..8 * MIB as usize]);
    std::fs::write(d.join("base.raw"), &want[..8 * MIB as usize]).unwrap();
    let img = d.join("w.qcow2");
    qemu_create(&img, "16M", Some(("base.raw", "raw")), Some(cluster));
    random_io(&open(&img), &mut rng, &mut want);
    // No corruption (leaks allowed), and exactly the data written.
    qemu_check(&img);
    qemu_compare(&img, &want);
    assert_eq!(
        first_difference(&read_all(&open(&img)), &want),
        None,
        "after reopen"
    );
}

#[test]
fn udrive_writes_pass_qemu_check_64k_clusters() {
    if have_qemu_tools() {
        udrive_writes_pass_qemu_check("64k", 1);
    }
}

#[test]
fn udrive_writes_pass_qemu_check_4k_clusters() {
    if have_qemu_tools() {
        udrive_writes_pass_qemu_check("4k", 2);
    }
}

#[test]
fn created_images_open_in_qemu() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("base.raw"), vec![0x77u8; 2 * MIB as usize]).unwrap();
    for (name, cs, backing) in [
        ("a.qcow2", 65536, None),
        ("b.qcow2", 4096, Some("base.raw")),
        ("c.qcow2", 2 << 20, Some("a.qcow2")),
    ] {
        let p: PathBuf = d.join(name);
        let o = Qcow2Create {
            size: 64 * MIB,
            cluster_size: cs,
            backing: backing.map(str::to_string),
        };
        assert!(create_qcow2(&p, &o).unwrap());
        let info = qemu_img(&["info", "--output=json", p.to_str().unwrap()]);
        assert!(info.contains("\"virtual-size\": 67108864"), "{info}");
        assert!(info.contains(&format!("\"cluster-size\": {cs}")), "{info}");
        qemu_check(&p);
        // And what udrive writes into it, QEMU reads.
        {
            let disk = open(&p);
            let mut ch = disk.channel().unwrap();
            let buf = MappedRegion::anonymous(0, 8192).unwrap();
            buf.slice(0, 8192)
                .unwrap()
                .write_from(0, &[0x99; 8192])
                .unwrap();
            assert_eq!(
                io(&mut *ch, IoOp::Write, 3 * MIB - 4096, &buf, 8192),
                IoStatus::Ok
            );
        }
        qemu_check(&p);
        qemu_io(&p, &[format!("read -P 0x99 {} 8192", 3 * MIB - 4096)]);
    }
}

/// Compressed clusters (`qemu-img convert -c`, deflate and zstd) read back
/// exactly, and writes over them (a partial one keeps the rest of the cluster)
/// pass `qemu-img check` and `compare`.
#[test]
fn compressed_images_read_back_and_take_writes() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("r.raw");
    let mut want = vec![0u8; 4 * MIB as usize];
    for (i, c) in want.chunks_mut(4096).enumerate() {
        c.fill(b'a' + (i % 26) as u8);
        c[..8].copy_from_slice(&(i as u64).to_le_bytes());
    }
    // Some clusters that do not compress at all.
    Rng::new(3).fill(&mut want[3 * MIB as usize..3 * MIB as usize + 256 * 1024]);
    std::fs::write(&raw, &want).unwrap();
    for (kind, cs) in [
        ("zlib", "4k"),
        ("zlib", "64k"),
        ("zstd", "4k"),
        ("zstd", "64k"),
        ("zstd", "2M"),
    ] {
        let img = dir.path().join(format!("c{kind}{cs}.qcow2"));
        if !convert_compressed(&raw, &img, kind, cs) {
            eprintln!("skipped {kind}: this qemu-img cannot write it");
            continue;
        }
        let mut want = want.clone();
        {
            let disk = open(&img);
            assert_eq!(
                first_difference(&read_all(&disk), &want),
                None,
                "{kind} {cs}"
            );
            let mut ch = disk.channel().unwrap();
            let buf = MappedRegion::anonymous(0, 4096).unwrap();
            buf.slice(0, 1024)
                .unwrap()
                .write_from(0, &[0xee; 1024])
                .unwrap();
            assert_eq!(
                io(&mut *ch, IoOp::Write, MIB + 512, &buf, 1024),
                IoStatus::Ok
            );
            fill(&mut want, 0xee, MIB + 512, 1024);
            assert_eq!(
                first_difference(&read_all(&disk), &want),
                None,
                "{kind} {cs} after a write"
            );
        }
        qemu_check(&img);
        qemu_compare(&img, &want);
    }
}

/// `qemu-img convert -c -o compression_type=KIND,cluster_size=CS`; false if
/// this qemu-img cannot (built without zstd).
fn convert_compressed(raw: &Path, img: &Path, kind: &str, cs: &str) -> bool {
    let o = format!("compression_type={kind},cluster_size={cs}");
    let (r, i) = (raw.to_str().unwrap(), img.to_str().unwrap());
    Command::new("qemu-img")
        .args(["convert", "-q", "-c", "-O", "qcow2", "-o", &o, r, i])
        .status()
        .unwrap()
        .success()
}

/// A zstd-compressed cluster whose frame is damaged is a read error status
/// for that cluster, not data and not a panic; the image's other clusters
/// (compressed or not) still read.
#[test]
fn corrupt_zstd_clusters_are_a_read_error() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("r.raw");
    std::fs::write(&raw, vec![0x61u8; 4 * MIB as usize]).unwrap();
    let img = dir.path().join("z.qcow2");
    if !convert_compressed(&raw, &img, "zstd", "64k") {
        eprintln!("skipped: this qemu-img has no zstd");
        return;
    }
    qemu_io(&img, &["write -P 0x62 2M 64k".into()]);
    // The first frame (qemu-img writes the clusters in order: guest cluster
    // 0's): its blocks overwritten with garbage.
    let mut bytes = std::fs::read(&img).unwrap();
    let at = bytes
        .windows(4)
        .position(|w| w == [0x28, 0xb5, 0x2f, 0xfd])
        .unwrap();
    bytes[at + 6..at + 70].fill(0xff);
    std::fs::write(&img, &bytes).unwrap();
    let disk = open(&img);
    let mut ch = disk.channel().unwrap();
    let buf = MappedRegion::anonymous(0, 4096).unwrap();
    assert_eq!(io(&mut *ch, IoOp::Read, 0, &buf, 4096), IoStatus::ReadError);
    let mut got = [0u8; 4096];
    for (at, pat) in [(2 * MIB, 0x62), (MIB, 0x61)] {
        assert_eq!(io(&mut *ch, IoOp::Read, at, &buf, 4096), IoStatus::Ok);
        buf.slice(0, 4096).unwrap().read_into(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == pat), "at {at}");
    }
}

/// An image whose refcount table fills up (qemu-img sizes it for what it
/// allocates at creation: with 512-byte clusters, 8 MiB of clusters): udrive
/// moves the table to a larger one and QEMU follows it.
#[test]
fn full_refcount_tables_grow() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("small.qcow2");
    qemu_create(&img, "40M", None, Some("512"));
    let reftable_clusters = |p: &Path| {
        let b = std::fs::read(p).unwrap();
        u32::from_be_bytes(b[56..60].try_into().unwrap())
    };
    let before = reftable_clusters(&img);
    let mut want = vec![0u8; 40 * MIB as usize];
    Rng::new(9).fill(&mut want[..24 * MIB as usize]);
    {
        let disk = open(&img);
        let mut ch = disk.channel().unwrap();
        let buf = MappedRegion::anonymous(0, MIB).unwrap();
        for at in (0..24 * MIB).step_by(MIB as usize) {
            let part = &want[at as usize..(at + MIB) as usize];
            buf.slice(0, MIB as usize)
                .unwrap()
                .write_from(0, part)
                .unwrap();
            assert_eq!(
                io(&mut *ch, IoOp::Write, at, &buf, MIB as usize),
                IoStatus::Ok,
                "at {at}"
            );
        }
        assert_eq!(io(&mut *ch, IoOp::Flush, 0, &buf, 0), IoStatus::Ok);
        assert_eq!(first_difference(&read_all(&disk), &want), None);
    }
    assert!(reftable_clusters(&img) > before, "the refcount table grew");
    qemu_check(&img);
    qemu_compare(&img, &want);
    assert_eq!(
        first_difference(&read_all(&open(&img)), &want),
        None,
        "after reopen"
    );
}

/// A 32 MiB image with random data, a live snapshot over it taken while a
/// channel is open, and what the guest should see: (dir, base, overlay,
/// disk, the base's data, the guest's).
fn snapshotted(
    seed: u64,
) -> (
    tempfile::TempDir,
    PathBuf,
    PathBuf,
    Qcow2Disk,
    Vec<u8>,
    Vec<u8>,
) {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    let o = Qcow2Create {
        size: 32 * MIB,
        cluster_size: 64 << 10,
        backing: None,
    };
    create_qcow2(&base, &o).unwrap();
    let disk = open(&base);
    let mut rng = Rng::new(seed);
    let mut want = vec![0u8; 32 * MIB as usize];
    let mut ch = disk.channel().unwrap();
    random_ops(&mut *ch, &mut rng, &mut want, 200);
    let before = want.clone();
    let overlay = dir.path().join("top.qcow2");
    disk.snapshot(&overlay).unwrap();
    // The channel opened before the snapshot moves to the overlay.
    random_ops(&mut *ch, &mut rng, &mut want, 200);
    assert_eq!(first_difference(&read_all(&disk), &want), None);
    (dir, base, overlay, disk, before, want)
}

#[test]
fn a_live_snapshot_leaves_the_base_as_it_was_and_the_chain_as_the_guest_sees_it() {
    if !have_qemu_tools() {
        return;
    }
    let (dir, base, overlay, disk, before, want) = snapshotted(41);
    let st = disk.status();
    assert_eq!(st.path, overlay);
    assert_eq!(st.backing_chain, [format!("qcow2:{}", base.display())]);
    assert!(disk.chain_changed());
    // Hostile: the target exists, its directory does not, nothing to stream.
    assert!(matches!(
        disk.snapshot(&overlay),
        Err(bdev::Qcow2Error::Exists { .. })
    ));
    assert!(matches!(
        disk.snapshot(&dir.path().join("no/such.qcow2")),
        Err(bdev::Qcow2Error::Io { .. })
    ));
    drop(disk);
    let info = qemu_img(&["info", overlay.to_str().unwrap()]);
    assert!(info.contains("backing file: base.qcow2"), "{info}");
    qemu_check(&base);
    qemu_check(&overlay);
    qemu_compare(&base, &before);
    qemu_compare(&overlay, &want);
    let ro = Qcow2Options {
        read_only: true,
        ..Default::default()
    };
    let ro = Qcow2Disk::open(&base, ro).unwrap();
    assert!(matches!(
        ro.snapshot(&dir.path().join("x.qcow2")),
        Err(bdev::Qcow2Error::Refused { .. })
    ));
    assert!(matches!(
        open(&base).start_job(bdev::Qcow2JobKind::Stream),
        Err(bdev::Qcow2Error::Refused { .. })
    ));
}

/// Runs `job` to its end with `ops` random guest operations through `ch`
/// after every few clusters, then finishes it.
fn run_with_guest(
    disk: &Qcow2Disk,
    mut job: bdev::Qcow2Job,
    rng: &mut Rng,
    want: &mut [u8],
) -> u64 {
    let mut ch = disk.channel().unwrap();
    let (mut copied, mut k) = (0, 0);
    while let Some(n) = job.step().unwrap() {
        copied += n;
        k += 1;
        if k % 16 == 0 {
            random_ops(&mut *ch, rng, want, 8);
        }
    }
    assert_eq!(job.done_bytes(), job.total_bytes());
    job.finish(disk).unwrap();
    random_ops(&mut *ch, rng, want, 50);
    assert_eq!(first_difference(&read_all(disk), want), None);
    copied
}

#[test]
fn stream_under_guest_writes_makes_the_overlay_stand_alone() {
    if !have_qemu_tools() {
        return;
    }
    let (_dir, base, overlay, disk, _, mut want) = snapshotted(42);
    let mut rng = Rng::new(7);
    let job = disk.start_job(bdev::Qcow2JobKind::Stream).unwrap();
    assert!(run_with_guest(&disk, job, &mut rng, &mut want) > 0);
    assert!(disk.status().backing_chain.is_empty());
    drop(disk);
    std::fs::remove_file(&base).unwrap();
    let info = qemu_img(&["info", overlay.to_str().unwrap()]);
    assert!(!info.contains("backing file"), "{info}");
    qemu_check(&overlay);
    qemu_compare(&overlay, &want);
}

#[test]
fn commit_under_guest_writes_pivots_to_a_base_holding_everything() {
    if !have_qemu_tools() {
        return;
    }
    let (_dir, base, overlay, disk, _, mut want) = snapshotted(43);
    let mut rng = Rng::new(8);
    let job = disk.start_job(bdev::Qcow2JobKind::Commit).unwrap();
    assert!(run_with_guest(&disk, job, &mut rng, &mut want) > 0);
    assert_eq!(disk.active_path(), base);
    assert!(!disk.chain_changed());
    drop(disk);
    qemu_check(&base);
    qemu_check(&overlay);
    qemu_compare(&base, &want);
}

#[test]
fn a_cancelled_commit_leaves_the_overlay_whole() {
    if !have_qemu_tools() {
        return;
    }
    let (_dir, base, overlay, disk, _, mut want) = snapshotted(44);
    let mut rng = Rng::new(9);
    let mut job = disk.start_job(bdev::Qcow2JobKind::Commit).unwrap();
    let mut ch = disk.channel().unwrap();
    for _ in 0..100 {
        job.step().unwrap();
    }
    random_ops(&mut *ch, &mut rng, &mut want, 30);
    job.abandon();
    random_ops(&mut *ch, &mut rng, &mut want, 30);
    assert_eq!(disk.active_path(), overlay);
    assert_eq!(first_difference(&read_all(&disk), &want), None);
    drop((ch, disk));
    qemu_check(&base);
    qemu_check(&overlay);
    qemu_compare(&overlay, &want);
}

#[test]
fn mirrors_under_guest_writes_copy_the_chain_and_pivot() {
    if !have_qemu_tools() {
        return;
    }
    let (dir, base, overlay, disk, _, mut want) = snapshotted(45);
    let mut rng = Rng::new(10);
    // Without pivot: a copy of the disk as it was at the job's end.
    let copy = dir.path().join("copy.qcow2");
    assert!(matches!(
        disk.start_mirror(&overlay, false),
        Err(bdev::Qcow2Error::Exists { .. })
    ));
    let mut job = disk.start_mirror(&copy, false).unwrap();
    let mut ch = disk.channel().unwrap();
    while job.step().unwrap().is_some() {
        random_ops(&mut *ch, &mut rng, &mut want, 1);
    }
    job.finish(&disk).unwrap();
    let at_end = want.clone();
    random_ops(&mut *ch, &mut rng, &mut want, 20);
    assert_eq!(disk.active_path(), overlay);
    // With pivot: the disk goes on in a stand-alone copy.
    let moved = dir.path().join("moved.qcow2");
    let job = disk.start_mirror(&moved, true).unwrap();
    drop(ch);
    run_with_guest(&disk, job, &mut rng, &mut want);
    assert_eq!(disk.active_path(), moved);
    assert!(disk.status().backing_chain.is_empty());
    drop(disk);
    for p in [&base, &overlay] {
        qemu_check(p);
    }
    std::fs::remove_file(&base).unwrap();
    std::fs::remove_file(&overlay).unwrap();
    qemu_check(&copy);
    qemu_compare(&copy, &at_end);
    qemu_check(&moved);
    qemu_compare(&moved, &want);
}

/// A stream into an image qemu-img made with 512-byte clusters over a raw
/// base: its refcount table moves while the job allocates, and the header
/// rewritten at the end keeps the moved table.
#[test]
fn stream_into_small_clusters_keeps_a_moved_refcount_table() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut want = vec![0u8; 12 * MIB as usize];
    Rng::new(11).fill(&mut want);
    std::fs::write(dir.path().join("base.raw"), &want).unwrap();
    let img = dir.path().join("small.qcow2");
    qemu_create(&img, "12M", Some(("base.raw", "raw")), Some("512"));
    let before = std::fs::read(&img).unwrap()[48..60].to_vec();
    let disk = open(&img);
    let job = disk.start_job(bdev::Qcow2JobKind::Stream).unwrap();
    run_with_guest(&disk, job, &mut Rng::new(12), &mut want);
    drop(disk);
    assert_ne!(
        std::fs::read(&img).unwrap()[48..60],
        before[..],
        "the table moved"
    );
    std::fs::remove_file(dir.path().join("base.raw")).unwrap();
    qemu_check(&img);
    qemu_compare(&img, &want);
}

/// A job half-way through a snapshotted disk, run under guest writes.
struct Half {
    _dir: tempfile::TempDir,
    base: PathBuf,
    overlay: PathBuf,
    disk: Qcow2Disk,
    want: Vec<u8>,
    rng: Rng,
    job: bdev::Qcow2Job,
}

fn half_done(kind: bdev::Qcow2JobKind, seed: u64) -> Half {
    let (dir, base, overlay, disk, _, mut want) = snapshotted(seed);
    let mut rng = Rng::new(seed + 100);
    let mut job = match kind {
        bdev::Qcow2JobKind::Mirror => disk.start_mirror(&dir.path().join("m.qcow2"), true),
        k => disk.start_job(k),
    }
    .unwrap();
    let mut ch = disk.channel().unwrap();
    for _ in 0..(job.total_bytes() / (64 << 10)) / 2 {
        job.step().unwrap();
        random_ops(&mut *ch, &mut rng, &mut want, 1);
    }
    drop(ch);
    Half {
        _dir: dir,
        base,
        overlay,
        disk,
        want,
        rng,
        job,
    }
}

/// A job taken over by another process: the old disk is paused (its image's
/// and the job's target's metadata written back) and left as a process that
/// exits leaves it; a disk opened on the image it served (its spec still
/// naming the base) goes on with the job from where it stopped, under guest
/// writes, and the result is what the guest wrote.
fn handed_over(kind: bdev::Qcow2JobKind, seed: u64) {
    let Half {
        _dir,
        base,
        overlay,
        disk,
        mut want,
        mut rng,
        job,
    } = half_done(kind, seed);
    let ch = disk.channel().unwrap();
    disk.pause().unwrap();
    let (done, target, pivot) = (job.done_bytes(), job.target_path(), job.pivot());
    assert!(done > 0 && done < job.total_bytes());
    assert_eq!(target.is_some(), kind != bdev::Qcow2JobKind::Stream);
    std::mem::forget((job, ch, disk));

    let next = Qcow2Disk::open_serving(&overlay, &base, Qcow2Options::default()).unwrap();
    assert!(next.chain_changed());
    assert_eq!(first_difference(&read_all(&next), &want), None);
    // Hostile: a resume point off a cluster boundary or past the end, a
    // commit into another image than the base.
    for bad in [done + 512, 1 << 40] {
        assert!(matches!(
            next.resume_job(kind, target.as_deref(), pivot, bad),
            Err(bdev::Qcow2Error::Refused { .. })
        ));
    }
    if kind == bdev::Qcow2JobKind::Commit {
        assert!(matches!(
            next.resume_job(kind, Some(&overlay), pivot, done),
            Err(bdev::Qcow2Error::Refused { .. })
        ));
    }
    let job = next
        .resume_job(kind, target.as_deref(), pivot, done)
        .unwrap();
    assert_eq!(job.done_bytes(), done);
    run_with_guest(&next, job, &mut rng, &mut want);
    let result = next.active_path();
    drop(next);
    // The first disk was forgotten, not closed: its locks stay with this
    // process, as a predecessor's stay until it exits.
    qemu_check_held(&result);
    qemu_compare_held(&result, &want);
}

#[test]
fn jobs_go_on_in_a_disk_opened_on_the_image_served() {
    if !have_qemu_tools() {
        return;
    }
    handed_over(bdev::Qcow2JobKind::Commit, 46);
    handed_over(bdev::Qcow2JobKind::Mirror, 47);
    handed_over(bdev::Qcow2JobKind::Stream, 48);
}

/// A job on a disk whose VM migrates away and back: it waits while another
/// process writes the image (here `qemu-io`, as the destination would), its
/// target is let go with the image, and once the image is taken back a
/// commit or mirror copies again from the start, so that what the other
/// process wrote reaches the target too.
fn migrated_away_and_back(kind: bdev::Qcow2JobKind, seed: u64) {
    use bdev::WriterClaim;
    let Half {
        _dir,
        overlay,
        disk,
        mut want,
        mut rng,
        mut job,
        ..
    } = half_done(kind, seed);
    let done = job.done_bytes();
    let claim = disk.claim();
    claim.release().unwrap();
    let e = job.step().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
    assert_eq!(job.done_bytes(), done);
    // The other process can open the chain (QEMU's locks) and writes into
    // clusters the job had copied already.
    qemu_io(&overlay, &["write -P 0x6d 64k 128k".to_string()]);
    fill(&mut want, 0x6d, 64 << 10, 128 << 10);
    claim.take().unwrap();
    assert_eq!(first_difference(&read_all(&disk), &want), None);
    job.step().unwrap();
    let again = if kind == bdev::Qcow2JobKind::Stream {
        done + (64 << 10)
    } else {
        64 << 10
    };
    assert_eq!(job.done_bytes(), again, "{kind:?}");
    run_with_guest(&disk, job, &mut rng, &mut want);
    let result = disk.active_path();
    drop((claim, disk));
    qemu_check(&result);
    qemu_compare(&result, &want);
}

#[test]
fn a_job_waits_while_its_vm_is_away_and_starts_over_when_it_is_back() {
    if !have_qemu_tools() {
        return;
    }
    migrated_away_and_back(bdev::Qcow2JobKind::Commit, 51);
    migrated_away_and_back(bdev::Qcow2JobKind::Mirror, 52);
    migrated_away_and_back(bdev::Qcow2JobKind::Stream, 53);
}
