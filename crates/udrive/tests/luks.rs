//! Encrypted namespaces and disks (`encrypt=luks`): an NVMe namespace on a
//! volume `cryptsetup luksFormat` made, whose writes decrypt with the volume key
//! `cryptsetup luksDump` gives and an independent AES-XTS; a vhost-user-blk disk
//! on a RAM disk formatted at start (`create=on`), driven by libblkio; an
//! encrypted namespace added over RPC to a running `udrive serve`, whose status
//! shows no key; specs that cannot open fail with the reason; a Ceph RBD image
//! made and formatted by its spec, reopened, and read by cryptsetup after
//! `rbd export`.

mod common;

use std::sync::Arc;

use common::control::{serve_opts, Serve};
use common::rbd::rbd_ns;
use common::*;
use initiator::{DataMode, IoOp};
use serde_json::json;
use test_support::blkio::BlkioSession;
use test_support::ceph::Cluster;
use test_support::luks::{luks_format, openssl_xts, set_keyslot_kdf, volume, volume_key};
use udrive::vhost_device::{self, VhostBlkConfig};

const MIB: u64 = 1 << 20;

#[test]
fn nvme_namespace_on_a_cryptsetup_volume() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    luks_format(&img, &key, false);
    let ns = format!(
        "file:{},encrypt=luks,key-file={}",
        img.display(),
        key.display()
    );
    let dev = TestDev::start("luks-nvme", &[&ns]);
    let d = dev.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(64 << 10).unwrap();
    let mut rng = Rng::new(40);
    let writes = [(100u64, rng.bytes(4096)), (2000, rng.bytes(64 << 10))];
    for (i, (slba, data)) in writes.iter().enumerate() {
        let mode = [DataMode::Prp, DataMode::Sgl][i % 2];
        write_read(&mut qp, &buf, *slba, data, mode);
    }
    assert_ok(
        &io(&mut qp, IoOp::Flush, 1, 0, 0, None, DataMode::Prp),
        "flush",
    );
    // The payload is 8 MiB: the header's 16 MiB are not the guest's.
    let last = io(&mut qp, IoOp::Read, 1, 16383, 1, Some(&buf), DataMode::Prp);
    assert_ok(&last, "last payload block");
    let past = io(&mut qp, IoOp::Read, 1, 16384, 1, Some(&buf), DataMode::Prp);
    assert!(!past.ok(), "a read past the payload fails");

    let vk = volume_key(&img, &key);
    for (slba, data) in &writes {
        let raw = file_bytes(&img, 16 * MIB + slba * 512, data.len());
        assert!(raw != *data, "LBA {slba} is stored encrypted");
        assert!(
            openssl_xts(false, &vk, 512, *slba, &raw) == *data,
            "LBA {slba} decrypts independently"
        );
    }
}

#[test]
fn vhost_disk_on_a_ram_volume_formatted_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, b"a passphrase").unwrap();
    let sock = dir.path().join("blk.sock");
    let spec = format!("ram:32M,encrypt=luks,key-file={},create=on", key.display());
    let cfg = VhostBlkConfig::new(sock.clone(), spec.parse().unwrap());
    let c = udrive::config::Config {
        cpus: "0".into(),
        vhost_user_blk: vec![cfg],
        ..Default::default()
    };
    c.validate().unwrap();
    let engine: Arc<engine::Engine> = engine();
    let dev = vhost_device::open_and_start(&c.vhost_user_blk[0], &engine, 1).unwrap();
    let mut s = BlkioSession::open(&sock).unwrap();
    for (i, off) in [0u64, 4096, 15 * MIB].into_iter().enumerate() {
        s.round(off, 0x30 + i as u8).unwrap();
    }
    // 32 MiB less LUKS2's 16 MiB header.
    assert!(s.read(16 * MIB, 4096) < 0, "a read past the payload fails");
    drop(s);
    dev.stop();
}

#[test]
fn specs_that_cannot_unlock_fail_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    luks_format(&img, &key, false);
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, b"guess").unwrap();
    let plain = dir.path().join("plain.img");
    std::fs::write(&plain, vec![0x55; 4 * MIB as usize]).unwrap();
    for (ns, want) in [
        (
            format!(
                "file:{},encrypt=luks,key-file={}",
                img.display(),
                wrong.display()
            ),
            "opens no keyslot",
        ),
        (
            format!(
                "file:{},encrypt=luks,key-file=/nonexistent/k",
                img.display()
            ),
            "key file /nonexistent/k",
        ),
        (
            format!(
                "file:{},encrypt=luks,key-file={}",
                plain.display(),
                key.display()
            ),
            "no valid LUKS header",
        ),
        (
            format!(
                "file:{},encrypt=luks,key-file={},create=on",
                plain.display(),
                key.display()
            ),
            "holds data but no LUKS header",
        ),
    ] {
        let spec: udrive::nsspec::NsSpec = ns.parse().unwrap();
        let e = udrive::backends::BackendSet::default()
            .open(&spec, std::path::Path::new("/nonexistent/a.sock"), 1)
            .err()
            .unwrap_or_else(|| panic!("{ns} opened"));
        let text = format!("{e:#}");
        assert!(text.contains(want), "{ns}: {text}");
        assert!(!text.contains("correct horse"), "{text}");
    }
}

#[test]
fn encrypted_namespace_added_over_rpc() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    luks_format(&img, &key, false);
    let s = Serve::start(&["--allow-dir", dir.path().to_str().unwrap()]);
    let spec = format!(
        "file:{},encrypt=luks,key-file={}",
        img.display(),
        key.display()
    );
    let a = s.nvme.to_str().unwrap();
    let ns = s.ok("nvme_add_namespace", json!({"socket": a, "spec": spec}));
    assert_eq!(ns["nsid"], 2);
    let devices = s.ok("get_devices", json!({})).to_string();
    assert!(devices.contains("encrypt=luks"), "{devices}");
    assert!(!devices.contains("correct horse"), "{devices}");
    // The new namespace's payload: the header's 16 MiB are not in it.
    let got = &s.ok("get_devices", json!({"socket": a}))[0]["namespaces"][1];
    assert_eq!(got["size_bytes"].as_u64(), Some(8 * MIB), "{got}");
    assert!(got["backend"].as_str().unwrap().contains("luks:"), "{got}");
    let d = initiator::NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    let data = Rng::new(41).bytes(4096);
    buf.write(0, &data).unwrap();
    assert_ok(
        &io(&mut qp, IoOp::Write, 2, 64, 8, Some(&buf), DataMode::Prp),
        "write",
    );
    buf.fill(0);
    assert_ok(
        &io(&mut qp, IoOp::Read, 2, 64, 8, Some(&buf), DataMode::Sgl),
        "read",
    );
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert!(back == data, "read back through the encrypted namespace");
    let vk = volume_key(&img, &key);
    let raw = file_bytes(&img, 16 * MIB + 64 * 512, 4096);
    assert!(openssl_xts(false, &vk, 512, 64, &raw) == data);
}

/// Keyslots change over RPC while the guest's verified I/O runs: a key added,
/// changed and removed, the last key refused, a wrong key refused; the header
/// cryptsetup then reads agrees, and the I/O saw no error.
#[test]
fn keys_change_under_verified_io() {
    let dir = tempfile::tempdir().unwrap();
    let (img, k1) = volume(dir.path(), 48 * MIB);
    luks_format(&img, &k1, false);
    let key = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let (k2, k3, bad) = (key("k2", "second"), key("k3", "third"), key("bad", "nope"));
    let spec = format!(
        "file:{},encrypt=luks,key-file={}",
        img.display(),
        k1.display()
    );
    let s = Serve::start(&["--allow-dir", dir.path().to_str().unwrap()]);
    let a = s.nvme.to_str().unwrap().to_string();
    s.ok(
        "nvme_add_namespace",
        json!({"socket": a, "spec": spec, "nsid": 2}),
    );
    let st = s.ok("luks_status", json!({"socket": a, "nsid": 2}));
    assert_eq!(st["version"], "LUKS2", "{st}");
    assert_eq!(st["cipher"], "aes-xts-plain64", "{st}");
    assert_eq!(st["keyslots"], json!([0]), "{st}");
    let (code, msg) = s
        .call("luks_status", json!({"socket": a, "nsid": 1}))
        .unwrap_err();
    assert_eq!(code, -32000);
    assert!(msg.contains("not encrypted"), "{msg}");

    let driver = initiator::NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    let report = std::thread::scope(|t| {
        let io = t.spawn(|| {
            let target = initiator::workload::NvmeTarget::new(&driver, 2, DataMode::Prp).unwrap();
            let cfg = initiator::workload::WorkloadConfig {
                rw: initiator::workload::Rw::RandRw { read_pct: 50 },
                qd: 4,
                jobs: 1,
                verify: true,
                time: std::time::Duration::from_secs(3),
                ..Default::default()
            };
            initiator::workload::run(&target, &cfg).unwrap()
        });
        let p = |k: &std::path::Path, n: Option<&std::path::Path>| {
            // A cheap key derivation: the test is about the header, not its cost.
            let mut v = json!({"socket": a, "nsid": 2, "key_file": k, "iter_time_ms": 50});
            if let Some(n) = n {
                v["new_key_file"] = json!(n);
            }
            v
        };
        // Key derivation takes a while on a busy machine: a generous reply limit.
        let slow = |m: &str, v| {
            common::control::call_within(&s.rpc, m, v, std::time::Duration::from_secs(120))
        };
        let added = slow("luks_add_key", p(&k1, Some(&k2))).unwrap();
        assert_eq!(added["keyslots"], json!([0, 1]), "{added}");
        let changed = slow("luks_change_key", p(&k2, Some(&k3))).unwrap();
        assert_eq!(
            changed["keyslots"].as_array().unwrap().len(),
            2,
            "{changed}"
        );
        let (_, msg) = slow("luks_add_key", p(&bad, Some(&k2))).unwrap_err();
        assert!(msg.contains("opens no keyslot"), "{msg}");
        let removed = slow("luks_remove_key", p(&k1, None)).unwrap();
        assert_eq!(
            removed["keyslots"].as_array().unwrap().len(),
            1,
            "{removed}"
        );
        let (_, msg) = slow("luks_remove_key", p(&k3, None)).unwrap_err();
        assert!(msg.contains("last one"), "{msg}");
        io.join().unwrap()
    });
    assert!(report.ios > 0);
    assert_eq!((report.errors, report.verify_errors), (0, 0));
    drop(driver);

    // cryptsetup reads the header udrive wrote: k3 opens it, k1 and k2 do not.
    let opens = |k: &std::path::Path| {
        std::process::Command::new("cryptsetup")
            .args(["open", "--test-passphrase", "--key-file"])
            .arg(k)
            .arg(&img)
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap()
            .success()
    };
    assert!(opens(&k3), "the new key opens the volume");
    assert!(
        !opens(&k1) && !opens(&k2),
        "the removed and replaced keys do not"
    );
}

/// A header whose keyslot asks for an absurd key derivation (argon2 passes,
/// PBKDF2 rounds) is refused at open, naming the slot, instead of holding the
/// open for hours; the same volume with sane costs opens.
#[test]
fn absurd_key_derivation_costs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (img, key) = volume(dir.path(), 24 * MIB);
    luks_format(&img, &key, false);
    let open = |img: &std::path::Path| {
        let spec: udrive::nsspec::NsSpec = format!(
            "file:{},encrypt=luks,key-file={}",
            img.display(),
            key.display()
        )
        .parse()
        .unwrap();
        udrive::backends::BackendSet::default()
            .open(&spec, std::path::Path::new("/nonexistent/a.sock"), 1)
            .map(drop)
    };
    // The rewrite keeps the header valid: with the value it was made with (the
    // derived key depends on it) it opens.
    set_keyslot_kdf(&img, "time", 4);
    open(&img).expect("a rewritten header with sane costs opens");
    set_keyslot_kdf(&img, "time", 2_000_000_000);
    let e = open(&img).expect_err("an absurd argon2 cost opened");
    let text = format!("{e:#}");
    assert!(
        text.contains("keyslot 0 asks for a key derivation"),
        "{text}"
    );
    assert!(text.contains("2000000000 passes"), "{text}");
}

/// `rbd:...,create=SIZE,encrypt=luks`: the image is made and formatted at the
/// first start, the same volume opens at the next (nothing reformatted), and
/// the exported image is a LUKS2 volume cryptsetup unlocks, whose sectors
/// decrypt independently.
#[test]
fn rbd_image_made_formatted_and_reopened() {
    if !test_support::ceph::available() {
        return;
    }
    let c = Cluster::start();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, b"an rbd passphrase").unwrap();
    let spec = rbd_ns(
        &c,
        "enc",
        &format!(",create=32M,encrypt=luks,key-file={}", key.display()),
    );
    let mut rng = Rng::new(41);
    // Namespace blocks are LUKS2's 4096-byte sectors.
    let writes = [(0u64, rng.bytes(4096)), (1000, rng.bytes(32 << 10))];
    let dev = TestDev::start("rbd-luks", &[&spec]);
    let d = dev.connect();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(32 << 10).unwrap();
    for (slba, data) in &writes {
        buf.write(0, data).unwrap();
        let nlb = (data.len() / 4096) as u32;
        let w = io(
            &mut qp,
            IoOp::Write,
            1,
            *slba,
            nlb,
            Some(&buf),
            DataMode::Prp,
        );
        assert_ok(&w, "write");
    }
    let flush = io(&mut qp, IoOp::Flush, 1, 0, 0, None, DataMode::Prp);
    assert_ok(&flush, "flush");
    drop((buf, qp, d, dev));

    // Reopened: the same volume, the same data.
    let dev = TestDev::start("rbd-luks2", &[&spec]);
    let d = dev.connect();
    assert_eq!(d.namespaces()[0].lba_size, 4096);
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(32 << 10).unwrap();
    for (slba, data) in &writes {
        let nlb = (data.len() / 4096) as u32;
        let r = io(
            &mut qp,
            IoOp::Read,
            1,
            *slba,
            nlb,
            Some(&buf),
            DataMode::Prp,
        );
        assert_ok(&r, "read after reopening");
        let mut back = vec![0u8; data.len()];
        buf.read(0, &mut back).unwrap();
        assert!(back == *data, "LBA {slba} after reopening");
    }
    drop((buf, qp, d, dev));

    let img = dir.path().join("enc.img");
    std::fs::write(&img, c.export("enc")).unwrap();
    let vk = volume_key(&img, &key);
    for (slba, data) in &writes {
        let raw = file_bytes(&img, 16 * MIB + slba * 4096, data.len());
        assert!(raw != *data, "LBA {slba} is stored encrypted");
        let plain = openssl_xts(false, &vk, 4096, slba * 8, &raw);
        assert!(plain == *data, "LBA {slba} decrypts independently");
    }
}

/// A passphrase given over the control socket (`secret_add`) opens a disk whose
/// spec names it (`key-secret=`), changes its keyslots (`key_secret`), is never
/// in a reply or a log, cannot be removed while a disk names it, and passes to
/// the new process in a live handover, which reopens the volume with it.
#[test]
fn a_secret_over_rpc_opens_a_volume_and_survives_a_handover() {
    const PASS: &str = "correct horse";
    const NEW: &str = "battery staple";
    let s = common::served::Service::start(|dir| {
        std::fs::File::create(dir.join("v.img"))
            .and_then(|f| f.set_len(24 * MIB))
            .unwrap();
        format!(
            "cpus = \"0\"\nrpc = \"{}\"\n[[controller]]\nsocket = \"{}\"\nnamespaces = [\"null:64M\"]\n",
            dir.join("rpc.sock").display(),
            dir.join("a.sock").display()
        )
    });
    let a = s.path("a.sock").display().to_string();
    s.rpc("secret_add", json!({"name": "vm1", "data": PASS}))
        .unwrap();
    let b64 = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, NEW);
    s.rpc(
        "secret_add",
        json!({"name": "vm1-new", "data": b64, "format": "base64"}),
    )
    .unwrap();
    let e = s.rpc("secret_add", json!({"name": "vm1", "data": "x"}));
    assert!(e.unwrap_err().contains("exists already"));
    let e = s.rpc(
        "secret_add",
        json!({"name": "bad", "data": "%%", "format": "base64"}),
    );
    assert!(e.unwrap_err().contains("not valid base64"));
    let spec = |secret: &str| {
        format!(
            "file:{},encrypt=luks,key-secret={secret},create=on",
            s.path("v.img").display()
        )
    };
    let e = s.rpc(
        "nvme_add_namespace",
        json!({"socket": a, "spec": spec("nope")}),
    );
    assert!(e.unwrap_err().contains("no secret named nope"));
    s.rpc(
        "nvme_add_namespace",
        json!({"socket": a, "nsid": 2, "spec": spec("vm1")}),
    )
    .unwrap();
    let data = Rng::new(43).bytes(4096);
    let rw = |write: bool| round_on_nsid_2(&s.path("a.sock"), &data, write);
    rw(true);
    let list = s.rpc("secret_list", json!({})).unwrap();
    assert_eq!(list[0]["name"], "vm1", "{list}");
    assert!(
        list[0]["used_by"][0]
            .as_str()
            .unwrap()
            .ends_with("a.sock nsid 2"),
        "{list}"
    );
    let e = s.rpc("secret_remove", json!({"name": "vm1"}));
    assert!(e.unwrap_err().contains("is named by"));
    let slot = s
        .rpc(
            "luks_add_key",
            json!({"socket": a, "nsid": 2, "key_secret": "vm1", "new_key_secret": "vm1-new", "iter_time_ms": 10}),
        )
        .unwrap();
    assert_eq!(slot["keyslots"].as_array().unwrap().len(), 2, "{slot}");
    s.upgrade_ok("handover with secrets");
    rw(false);
    let list = s.rpc("secret_list", json!({})).unwrap().to_string();
    assert!(list.contains("vm1-new"), "{list}");
    s.rpc("secret_remove", json!({"name": "vm1-new"})).unwrap();
    let everything = format!(
        "{}{}{}",
        s.rpc("get_devices", json!({})).unwrap(),
        s.rpc("secret_list", json!({})).unwrap(),
        s.log()
    );
    for secret in [PASS, NEW, &b64] {
        assert!(!everything.contains(secret), "{secret} shown: {everything}");
    }
}

/// Writes (if `write`) then reads back 4 KiB `data` at the namespace's 4 KiB
/// block 1 of namespace 2 on a new connection to `sock`.
fn round_on_nsid_2(sock: &std::path::Path, data: &[u8], write: bool) {
    let d = initiator::NvmeDriver::connect(sock, serve_opts()).unwrap();
    let mut qp = d.create_qpair(8, false).unwrap();
    let buf = qp.alloc_buf(4096).unwrap();
    // A volume formatted by create=on has 4096-byte sectors.
    let lba = d
        .namespaces()
        .iter()
        .find(|n| n.nsid == 2)
        .unwrap()
        .lba_size;
    let (slba, nlb) = (8 * 512 / u64::from(lba), 4096 / lba);
    if write {
        buf.write(0, data).unwrap();
    }
    let ops: &[IoOp] = if write {
        &[IoOp::Write, IoOp::Read]
    } else {
        &[IoOp::Read]
    };
    for &op in ops {
        if op == IoOp::Read {
            buf.fill(0);
        }
        let st = io(&mut qp, op, 2, slba, nlb, Some(&buf), DataMode::Prp);
        assert_ok(&st, &format!("{op:?}"));
    }
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back).unwrap();
    assert!(back == data, "read back through the encrypted namespace");
}
