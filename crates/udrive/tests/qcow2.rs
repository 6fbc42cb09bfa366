//! qcow2 namespaces and disks (`qcow2:PATH`) end to end: an NVMe namespace on
//! an image `qemu-img` made over a raw backing file, next to one `create=`
//! made at start, driven by the initiator; what udrive wrote passes `qemu-img
//! check` and reads back in `qemu-img compare`; a namespace added over RPC
//! shows its format, sizes and backing chain in `get_devices`; hostile or
//! unsupported images fail at open with the reason. Skipped, saying so, where
//! qemu-img is not installed (Debian: qemu-utils).

mod common;

use std::path::Path;

use common::control::{serve_opts, Serve};
use common::*;
use initiator::{DataMode, IoOp};
use serde_json::json;
use test_support::qemu::{have_qemu_tools, qemu_check, qemu_compare, qemu_create, qemu_img};

const MIB: u64 = 1 << 20;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn nvme_namespaces_on_qemu_and_created_images() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut want = Rng::new(50).bytes(16 * MIB as usize);
    std::fs::write(d.join("base.raw"), &want).unwrap();
    let img = d.join("vm.qcow2");
    qemu_create(&img, "16M", Some(("base.raw", "raw")), None);
    let new = d.join("new.qcow2");
    let ns1 = format!("qcow2:{}", img.display());
    let ns2 = format!("qcow2:{},create=16M,cluster=4k", new.display());
    let mut want_new = vec![0u8; 16 * MIB as usize];
    {
        let dev = TestDev::start("qcow2-nvme", &[&ns1, &ns2]);
        let dc = dev.connect();
        let mut qp = dc.create_qpair(8, false).unwrap();
        let buf = qp.alloc_buf(128 << 10).unwrap();
        // The backing file's data shows through before any write.
        assert_ok(
            &io(&mut qp, IoOp::Read, 1, 8, 8, Some(&buf), DataMode::Prp),
            "read",
        );
        let mut got = vec![0u8; 4096];
        buf.read(0, &mut got).unwrap();
        assert!(got == want[4096..8192], "backing data through the image");
        let mut rng = Rng::new(51);
        for (i, slba) in [0u64, 7, 129, 20000, 32760].into_iter().enumerate() {
            let data = rng.bytes([4096, 512, 128 << 10, 8192, 4096][i]);
            let mode = [DataMode::Prp, DataMode::Sgl][i % 2];
            for (nsid, w) in [(1u32, &mut want), (2, &mut want_new)] {
                let at = (slba * 512) as usize;
                w[at..at + data.len()].copy_from_slice(&data);
                let buf = buf.sub(0, data.len()).unwrap();
                buf.write(0, &data).unwrap();
                let n = (data.len() / 512) as u32;
                assert_ok(
                    &io(&mut qp, IoOp::Write, nsid, slba, n, Some(&buf), mode),
                    "write",
                );
                buf.fill(0);
                assert_ok(
                    &io(&mut qp, IoOp::Read, nsid, slba, n, Some(&buf), mode),
                    "read",
                );
                let mut back = vec![0u8; data.len()];
                buf.read(0, &mut back).unwrap();
                assert!(back == data, "ns {nsid} LBA {slba} reads back");
            }
        }
        for nsid in [1, 2] {
            assert_ok(
                &io(&mut qp, IoOp::Flush, nsid, 0, 0, None, DataMode::Prp),
                "flush",
            );
        }
    }
    for (image, w) in [(&img, &want), (&new, &want_new)] {
        qemu_check(image);
        qemu_compare(image, w);
    }
}

#[test]
fn qcow2_namespace_added_over_rpc_shows_its_image() {
    if !have_qemu_tools() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![0x42u8; 4 * MIB as usize]).unwrap();
    let img = dir.path().join("top.qcow2");
    let srv = Serve::start(&["--allow-dir", dir.path().to_str().unwrap()]);
    let spec = format!("qcow2:{},create=32M,backing=base.raw", img.display());
    let a = srv.nvme.to_str().unwrap();
    let ns = srv.ok("nvme_add_namespace", json!({"socket": a, "spec": spec}));
    assert_eq!(ns["nsid"], 2);
    let got = &srv.ok("get_devices", json!({"socket": a}))[0]["namespaces"][1];
    assert_eq!(got["size_bytes"].as_u64(), Some(32 * MIB), "{got}");
    let image = &got["image"];
    assert_eq!(image["format"], "qcow2", "{got}");
    assert_eq!(image["virtual_size"].as_u64(), Some(32 * MIB), "{got}");
    assert_eq!(image["cluster_size"].as_u64(), Some(65536), "{got}");
    let chain = image["backing_chain"].as_array().unwrap();
    assert_eq!(chain.len(), 1, "{got}");
    assert!(chain[0].as_str().unwrap().ends_with("base.raw"), "{got}");
    let before = image["allocated_bytes"].as_u64().unwrap();
    let d = initiator::NvmeDriver::connect(&srv.nvme, serve_opts()).unwrap();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    assert_ok(
        &io(&mut qp, IoOp::Read, 2, 16, 8, Some(&buf), DataMode::Prp),
        "read",
    );
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0x42),
        "the backing file shows through"
    );
    buf.write(0, &[7u8; 4096]).unwrap();
    assert_ok(
        &io(&mut qp, IoOp::Write, 2, 16, 8, Some(&buf), DataMode::Prp),
        "write",
    );
    let got = &srv.ok("get_devices", json!({"socket": a}))[0]["namespaces"][1];
    assert!(
        got["image"]["allocated_bytes"].as_u64().unwrap() > before,
        "{got}"
    );
}

#[test]
fn images_that_cannot_be_served_fail_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let plain = d.join("plain.img");
    std::fs::write(&plain, vec![0x55; MIB as usize]).unwrap();
    let dirty = d.join("dirty.qcow2");
    let make: udrive::nsspec::NsSpec = format!("qcow2:{},create=1M", dirty.display())
        .parse()
        .unwrap();
    drop(
        udrive::backends::BackendSet::default()
            .open(&make, Path::new("/nonexistent/a.sock"), 1)
            .unwrap(),
    );
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&dirty)
            .unwrap();
        f.write_all_at(&1u64.to_be_bytes(), 72).unwrap();
        // An L1 entry past the end of the file: the refcounts cannot be rebuilt.
        let mut l1 = [0u8; 8];
        f.read_exact_at(&mut l1, 40).unwrap();
        let at = u64::from_be_bytes(l1);
        f.write_all_at(&((1u64 << 63) | (1 << 40)).to_be_bytes(), at)
            .unwrap();
    }
    for (ns, want) in [
        (format!("qcow2:{}", plain.display()), "bad magic"),
        (
            format!("qcow2:{},create=1M", plain.display()),
            "neither a qcow2 image nor empty",
        ),
        (format!("qcow2:{}", dirty.display()), "marked dirty"),
        (
            format!("qcow2:{}/missing.qcow2", d.display()),
            "does not exist",
        ),
    ] {
        let spec: udrive::nsspec::NsSpec = ns.parse().unwrap();
        let e = udrive::backends::BackendSet::default()
            .open(&spec, Path::new("/nonexistent/a.sock"), 1)
            .err()
            .unwrap_or_else(|| panic!("{ns} opened"));
        let text = format!("{e:#}");
        assert!(text.contains(want), "{ns}: {text}");
    }
    for bad in [
        "qcow2:",
        "qcow2:/x,backing=/b",
        "qcow2:/x,create=zz",
        "qcow2:/x,create=1M,cluster=3k,bogus",
    ] {
        assert!(bad.parse::<udrive::nsspec::NsSpec>().is_err(), "{bad}");
    }
}

/// `encrypt=luks` over a qcow2 image: a cryptsetup volume converted to qcow2 by
/// qemu-img unlocks and keeps what is written, through the same wrappers as on
/// any backend.
#[test]
fn luks_volume_inside_a_qcow2_image() {
    if !have_qemu_tools() {
        return;
    }
    use test_support::luks::{luks_format, volume};
    let dir = tempfile::tempdir().unwrap();
    let (raw, key) = volume(dir.path(), 24 * MIB);
    luks_format(&raw, &key, false);
    let img = dir.path().join("vol.qcow2");
    qemu_img(&["convert", "-q", "-O", "qcow2", s(&raw), s(&img)]);
    let ns = format!(
        "qcow2:{},encrypt=luks,key-file={}",
        img.display(),
        key.display()
    );
    let dev = TestDev::start("qcow2-luks", &[&ns]);
    let d = dev.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(64 << 10).unwrap();
    let mut rng = Rng::new(52);
    for (i, slba) in [0u64, 300, 16000].into_iter().enumerate() {
        let mode = [DataMode::Prp, DataMode::Sgl][i % 2];
        write_read(&mut qp, &buf, slba, &rng.bytes(8192), mode);
    }
    assert_ok(
        &io(&mut qp, IoOp::Flush, 1, 0, 0, None, DataMode::Prp),
        "flush",
    );
    drop(qp);
    drop(d);
    drop(dev);
    qemu_check(&img);
}

/// A vhost-user-blk disk on a qcow2 image made at start (`create=`, sliced and
/// rate-limited like any backend), driven by libblkio; the image passes
/// `qemu-img check` afterwards.
#[test]
fn vhost_disk_on_a_created_image() {
    use std::sync::Arc;
    use udrive::vhost_device::{self, VhostBlkConfig};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("blk.sock");
    let img = dir.path().join("disk.qcow2");
    let spec = format!(
        "qcow2:{},create=64M,cluster=64k,offset=1M,size=32M,iops=100000",
        img.display()
    );
    let cfg = VhostBlkConfig::new(sock.clone(), spec.parse().unwrap());
    let c = udrive::config::Config {
        cpus: "0".into(),
        vhost_user_blk: vec![cfg],
        ..Default::default()
    };
    c.validate().unwrap();
    let engine: Arc<engine::Engine> = engine();
    let dev = vhost_device::open_and_start(&c.vhost_user_blk[0], &engine, 1).unwrap();
    let mut s = test_support::blkio::BlkioSession::open(&sock).unwrap();
    for (i, off) in [0u64, 4096, 70 << 10, 31 * MIB].into_iter().enumerate() {
        s.round(off, 0x60 + i as u8).unwrap();
    }
    assert!(s.read(32 * MIB, 4096) < 0, "a read past the slice fails");
    drop(s);
    dev.stop();
    if have_qemu_tools() {
        qemu_check(&img);
    }
}
