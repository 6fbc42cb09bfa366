//! NVMe conformance corners that independent clients and compliance suites probe,
//! through udrive's initiator with raw admin commands
//! (docs/decisions/0011-nvme-conformance.md).

mod common;

use common::*;
use initiator::cmd::opc;
use initiator::{Completion, NvmeDriver, Sqe};
use test_support::files::LoopDev;

const ERROR_RECOVERY: u32 = 0x05;
const QUEUES: u32 = 0x07;
const WRITE_ATOMICITY: u32 = 0x0a;
const HOST_BEHAVIOR: u32 = 0x16;

fn get_features(d: &NvmeDriver, fid: u32, sel: u32) -> Completion {
    let s = Sqe {
        cdw10: fid | (sel << 8),
        ..Sqe::new(opc::GET_FEATURES)
    };
    d.admin(s).unwrap()
}

fn set_features(d: &NvmeDriver, fid: u32, cdw11: u32) -> Completion {
    d.admin(Sqe::set_features(fid, cdw11)).unwrap()
}

/// Error Recovery and Write Atomicity Normal are mandatory for NVM controllers (NVMe
/// 1.4 §5.21.1, the Feature Identifiers table);
/// Host Behavior Support is what drivers with ACRE query. Each reads back what was
/// set, and SEL = 3 reports it changeable.
#[test]
fn mandatory_and_queried_features() {
    let dev = TestDev::start("features", &["ram:4M"]);
    let d = dev.connect();
    for fid in [ERROR_RECOVERY, WRITE_ATOMICITY, HOST_BEHAVIOR] {
        let c = get_features(&d, fid, 3);
        assert_ok(&c, &format!("capabilities of feature {fid:#x}"));
        assert_eq!(c.dw0, 0b100, "feature {fid:#x}: changeable, not saveable");
    }
    // Error Recovery: TLER round trip; DULBE refused (no namespace has DAE).
    assert_eq!(get_features(&d, ERROR_RECOVERY, 0).dw0, 0);
    assert_ok(&set_features(&d, ERROR_RECOVERY, 50), "set TLER");
    assert_eq!(get_features(&d, ERROR_RECOVERY, 0).dw0, 50);
    assert_status(
        &set_features(&d, ERROR_RECOVERY, 1 << 16),
        0,
        0x02,
        "DULBE without deallocated-block errors",
    );
    // Write Atomicity Normal: DN round trip.
    assert_eq!(get_features(&d, WRITE_ATOMICITY, 0).dw0, 0);
    assert_ok(&set_features(&d, WRITE_ATOMICITY, 1), "set DN");
    assert_eq!(get_features(&d, WRITE_ATOMICITY, 0).dw0, 1);
    // Host Behavior Support: a 512-byte structure in the data buffer.
    let buf = d.alloc_buf(4096).unwrap();
    let with_buf = |opcode: u8, cdw10: u32| Sqe {
        cdw10,
        dptr: [buf.iova(), 0],
        ..Sqe::new(opcode)
    };
    let acre = |d: &NvmeDriver| {
        buf.write(0, &[0xff; 512]).unwrap();
        assert_ok(
            &d.admin(with_buf(opc::GET_FEATURES, HOST_BEHAVIOR)).unwrap(),
            "get host behavior",
        );
        let mut b = [0u8; 512];
        buf.read(0, &mut b).unwrap();
        assert!(b[1..].iter().all(|x| *x == 0), "fields beyond ACRE read 0");
        b[0]
    };
    assert_eq!(acre(&d), 0);
    let mut page = [0u8; 512];
    page[0] = 1;
    buf.write(0, &page).unwrap();
    assert_ok(
        &d.admin(with_buf(opc::SET_FEATURES, HOST_BEHAVIOR)).unwrap(),
        "enable ACRE",
    );
    assert_eq!(acre(&d), 1);
    page[0] = 2;
    buf.write(0, &page).unwrap();
    let c = d.admin(with_buf(opc::SET_FEATURES, HOST_BEHAVIOR)).unwrap();
    assert_status(&c, 0, 0x02, "ACRE 2 is reserved");
    let c = d
        .admin(Sqe {
            dptr: [UNMAPPED, 0],
            ..with_buf(opc::SET_FEATURES, HOST_BEHAVIOR)
        })
        .unwrap();
    assert!(!c.status.is_ok(), "a data buffer outside the DMA map");
    assert_eq!(acre(&d), 1, "failed Sets change nothing");
    drop(d);
    dev.check_fresh_client(3);
}

/// Number of Queues may only be set before any I/O queue exists (NVMe 1.4
/// §5.21.1.7): afterwards Command Sequence Error, and again allowed once all are
/// deleted.
#[test]
fn number_of_queues_after_io_queues_exist() {
    let dev = TestDev::start("nqueues", &["ram:4M"]);
    let d = dev.connect();
    let want = (3 << 16) | 3;
    assert_ok(&set_features(&d, QUEUES, want), "before any I/O queue");
    let mem = d.alloc_buf(8192).unwrap();
    assert_ok(
        &d.admin(Sqe::create_io_cq(1, 16, mem.iova(), 0, true))
            .unwrap(),
        "CQ 1",
    );
    assert_status(
        &set_features(&d, QUEUES, want),
        0,
        0x0c,
        "with a completion queue",
    );
    assert_ok(
        &d.admin(Sqe::create_io_sq(1, 16, mem.iova() + 4096, 1))
            .unwrap(),
        "SQ 1",
    );
    assert_status(&set_features(&d, QUEUES, want), 0, 0x0c, "with a pair");
    assert_ok(&get_features(&d, QUEUES, 0), "Get stays allowed");
    assert_ok(&d.admin(Sqe::delete_io_sq(1)).unwrap(), "delete SQ 1");
    assert_ok(&d.admin(Sqe::delete_io_cq(1)).unwrap(), "delete CQ 1");
    assert_ok(&set_features(&d, QUEUES, want), "after deleting them");
    drop(d);
    dev.check_fresh_client(4);
}

/// Keep Alive is advertised (KAS = 100 ms), so it is enforced: while the host sends
/// Keep Alive within KATO the controller runs; once it stops, the controller sets
/// CSTS.CFS (NVMe 1.4 §7.12) and a reset clears it. The margins are 10×: this checks
/// behaviour, not timing.
#[test]
fn keep_alive_timeout_is_enforced() {
    let dev = TestDev::start("keepalive", &["ram:4M"]);
    let d = dev.connect();
    let fatal = |d: &NvmeDriver| {
        d.read_reg32(initiator::regs::CSTS).unwrap() & initiator::regs::CSTS_CFS != 0
    };
    assert_ok(&set_features(&d, 0x0f, 1000), "KATO 1 s");
    assert_eq!(get_features(&d, 0x0f, 0).dw0, 1000);
    for _ in 0..25 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_ok(&d.admin(Sqe::new(opc::KEEP_ALIVE)).unwrap(), "keep alive");
        assert!(!fatal(&d), "fatal although the host kept it alive");
    }
    wait_fatal(&d);
    drop(d);
    // A new client's reset clears it, with KATO back at 0 (no timer).
    let d = dev.connect();
    check_io(&d, 5);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(!fatal(&d), "no keep alive timer after the reset");
}

/// Identify CNS 05h/06h (I/O Command Set specific namespace and controller data,
/// NVMe 2.0), which Linux asks for whatever the version: answered for the NVM
/// command set (CSI 0), Invalid Field for others.
#[test]
fn identify_io_command_set_specific_structures() {
    let dev = TestDev::start("iocs", &["ram:4M"]);
    let d = dev.connect();
    let identify = |cns: u32, nsid: u32, csi: u32| Sqe {
        nsid,
        cdw10: cns,
        cdw11: csi << 24,
        ..Sqe::new(opc::IDENTIFY)
    };
    let page = d
        .admin_read_page(identify(0x06, 0, 0))
        .expect("CNS 06h, NVM");
    assert!(page.iter().all(|b| *b == 0), "no NVM limits reported");
    let page = d
        .admin_read_page(identify(0x05, 1, 0))
        .expect("CNS 05h, NVM");
    assert!(page.iter().all(|b| *b == 0), "no PI, no extended formats");
    d.admin_read_page(identify(0x05, 2, 0))
        .expect("CNS 05h, a valid inactive NSID");
    let c = d.admin(identify(0x05, 0x1_0000, 0)).unwrap();
    assert_status(&c, 0, 0x0b, "CNS 05h, NSID out of range");
    for (cns, nsid) in [(0x05, 1), (0x06, 0)] {
        let c = d.admin(identify(cns, nsid, 2)).unwrap();
        assert_status(
            &c,
            0,
            0x02,
            &format!("CNS {cns:#x} for the zoned command set"),
        );
    }
    drop(d);
    dev.check_fresh_client(6);
}

/// Format NVM of `nsid` to LBA format `lbaf` (0: 512 B, 1: 4096 B) with Secure
/// Erase Settings `ses` and Protection Information `pi`.
fn format_nvm(nsid: u32, lbaf: u32, ses: u32, pi: u32) -> Sqe {
    Sqe {
        nsid,
        cdw10: lbaf | (pi << 5) | (ses << 9),
        ..Sqe::new(opc::FORMAT_NVM)
    }
}

/// Identify Namespace bytes 24..34 and the first two LBA formats: (NLBAF, FLBAS,
/// LBADS of LBAF0 and LBAF1).
fn lba_formats(d: &NvmeDriver, nsid: u32) -> (u8, u8, [u8; 2]) {
    let p = d
        .admin_read_page(Sqe::identify(0, nsid))
        .expect("identify namespace");
    (p[25], p[26], [p[130], p[134]])
}

/// Fills LBAs `0..n` (in the namespace's current block size) with `byte`.
fn fill(qp: &mut initiator::QueuePair, nsid: u32, lba: u32, n: u32, byte: u8) {
    let buf = qp.alloc_buf((lba * n) as usize).expect("buffer");
    buf.write(0, &vec![byte; (lba * n) as usize]).expect("fill");
    let c = io(
        qp,
        initiator::IoOp::Write,
        nsid,
        0,
        n,
        Some(&buf),
        initiator::DataMode::Prp,
    );
    assert_ok(&c, "fill");
}

/// The first `n` blocks of `nsid` read back.
fn head(qp: &mut initiator::QueuePair, nsid: u32, lba: u32, n: u32) -> Vec<u8> {
    let buf = qp.alloc_buf((lba * n) as usize).expect("buffer");
    buf.write(0, &vec![0xee; (lba * n) as usize])
        .expect("poison");
    let c = io(
        qp,
        initiator::IoOp::Read,
        nsid,
        0,
        n,
        Some(&buf),
        initiator::DataMode::Sgl,
    );
    assert_ok(&c, "read");
    let mut b = vec![0u8; (lba * n) as usize];
    buf.read(0, &mut b).expect("read back");
    b
}

/// Format NVM on ram, null and file namespaces: to 4096-byte blocks and back,
/// erased (with and without Secure Erase), Identify and `get_devices` updated, a
/// Namespace Attribute Changed event, I/O in the new block size up to the new end.
#[test]
fn format_nvm_changes_the_block_size_and_erases() {
    let (_dir, img) = disk_file("fmt.img", 8 << 20);
    let file = format!("file:{}", img.display());
    let dev = TestDev::start("format", &["ram:8M", "null:8M", &file]);
    let mut d = dev.connect();
    let raw = d
        .admin_read_page(Sqe::identify(1, 0))
        .expect("identify controller page");
    assert_eq!(raw[256] & 0b10, 0b10, "OACS: Format NVM");
    assert_eq!(raw[524], 0, "FNA: per namespace, no cryptographic erase");
    d.enable_ns_events().expect("AER");
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    for nsid in 1..=3u32 {
        assert_eq!(lba_formats(&d, nsid), (1, 0, [9, 12]), "ns {nsid} before");
        fill(&mut qp, nsid, 512, 16, 0xa5);
        for (lbaf, ses, lba) in [(1u32, 1u32, 4096u32), (0, 0, 512)] {
            let c = d.admin(format_nvm(nsid, lbaf, ses, 0)).expect("format");
            assert_ok(&c, &format!("ns {nsid}: format to {lba} (SES {ses})"));
            let ev = d.wait_event(T).expect("namespace event");
            assert!(ev.is_namespace_change(), "{ev:?}");
            assert_eq!(d.rescan_namespaces().expect("rescan"), vec![nsid]);
            let ns = d.namespace(nsid).expect("namespace").clone();
            assert_eq!((ns.lba_size, ns.nsze), (lba, (8 << 20) / u64::from(lba)));
            assert_eq!(lba_formats(&d, nsid), (1, lbaf as u8, [9, 12]));
            let info = &dev.json()["namespaces"][nsid as usize - 1];
            assert_eq!(info["block_size"], lba, "get_devices");
            assert_eq!(info["size_bytes"], 8 << 20);
            if nsid != 2 {
                // The null backend keeps no data to erase.
                let data = head(&mut qp, nsid, lba, 8192 / lba);
                assert!(data.iter().all(|b| *b == 0), "ns {nsid}: erased");
            }
            // The new last block is addressable, one past it is not.
            let buf = qp.alloc_buf(lba as usize).expect("buffer");
            let last = ns.nsze - 1;
            let c = io(
                &mut qp,
                initiator::IoOp::Write,
                nsid,
                last,
                1,
                Some(&buf),
                initiator::DataMode::Prp,
            );
            assert_ok(&c, "write the last block");
            let c = io(
                &mut qp,
                initiator::IoOp::Read,
                nsid,
                last + 1,
                1,
                Some(&buf),
                initiator::DataMode::Prp,
            );
            assert_status(&c, 0, 0x80, "one past the end");
            fill(&mut qp, nsid, lba, 2, 0x3c);
        }
    }
    // The file's bytes themselves were zeroed (then 1 KiB written at the start).
    assert!(file_bytes(&img, 1024, 8192).iter().all(|b| *b == 0));
    d.delete_qpair(qp).expect("delete queue pair");
    drop(d);
    dev.check_fresh_client(7);
}

/// What cannot be formatted is refused with a status that says why, and nothing
/// changes: LBA formats beyond the two listed, protection information (no
/// metadata), cryptographic erase, slices and `shared` namespaces (a window on a
/// backend others use), a read-only namespace; NSID FFFFFFFFh is all or nothing.
#[test]
fn format_nvm_refusals() {
    let (_dir, img) = disk_file("shared.img", 32 << 20);
    let (_dir2, ro) = disk_file("ro.img", 4 << 20);
    let (_dir3, whole) = disk_file("whole.img", 4 << 20);
    let slice = format!("file:{},offset=8M,size=8M", img.display());
    let shared = format!("file:{},shared", whole.display());
    let ro = format!("file:{},ro", ro.display());
    let dev = TestDev::start("fmtrefuse", &["ram:4M", &slice, &shared, &ro]);
    let d = dev.connect();
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    fill(&mut qp, 1, 512, 8, 0x42);
    let cases = [
        ("LBA format 2", format_nvm(1, 2, 0, 0), (1, 0x0a)),
        ("LBA format 15", format_nvm(1, 15, 0, 0), (1, 0x0a)),
        ("protection information", format_nvm(1, 1, 0, 1), (1, 0x0a)),
        ("cryptographic erase", format_nvm(1, 1, 2, 0), (0, 0x02)),
        ("slice", format_nvm(2, 1, 1, 0), (0, 0x0b)),
        ("shared namespace", format_nvm(3, 1, 1, 0), (0, 0x0b)),
        ("read-only namespace", format_nvm(4, 1, 1, 0), (0, 0x20)),
        (
            "every namespace",
            format_nvm(0xffff_ffff, 1, 0, 0),
            (0, 0x0b),
        ),
        ("inactive namespace", format_nvm(9, 1, 0, 0), (0, 0x0b)),
    ];
    for (what, sqe, (sct, sc)) in cases {
        let c = d.admin(sqe).expect("format");
        assert_status(&c, sct, sc, what);
    }
    for nsid in 1..=4 {
        assert_eq!(lba_formats(&d, nsid), (1, 0, [9, 12]), "ns {nsid} kept");
    }
    assert!(
        head(&mut qp, 1, 512, 8).iter().all(|b| *b == 0x42),
        "data kept"
    );
    d.delete_qpair(qp).expect("delete queue pair");
    drop(d);
    dev.check_fresh_client(8);
}

/// Block devices through O_DIRECT: one with 4096-byte sectors cannot present
/// 512-byte blocks (Invalid Format) but can be erased in its own format; one with
/// 512-byte sectors opened with `bs=4096` can go down to 512. Needs root for the
/// loop devices; skipped otherwise.
#[test]
fn format_nvm_follows_the_device_sector_size() {
    let (_dir, img4k) = disk_file("4k.img", 4 << 20);
    let (_dir2, img512) = disk_file("512.img", 4 << 20);
    let (Some(dev4k), Some(dev512)) = (
        LoopDev::attach(&img4k, 4096).ok(),
        LoopDev::attach(&img512, 512).ok(),
    ) else {
        eprintln!("skipped: cannot attach loop devices (not root?)");
        return;
    };
    let ns4k = format!("file:{}", dev4k.path.display());
    let ns512 = format!("file:{},bs=4096", dev512.path.display());
    let dev = TestDev::start("fmtsector", &[&ns4k, &ns512]);
    let d = dev.connect();
    assert_eq!(lba_formats(&d, 1), (1, 1, [9, 12]), "4Kn device: 4096 now");
    let mut qp = d.create_qpair(16, false).expect("queue pair");
    fill(&mut qp, 1, 4096, 2, 0x99);
    let c = d.admin(format_nvm(1, 0, 1, 0)).expect("format");
    assert_status(&c, 1, 0x0a, "512-byte blocks on a 4Kn device");
    assert!(head(&mut qp, 1, 4096, 2).iter().all(|b| *b == 0x99));
    assert_ok(
        &d.admin(format_nvm(1, 1, 1, 0)).expect("format"),
        "erase 4Kn",
    );
    assert!(head(&mut qp, 1, 4096, 2).iter().all(|b| *b == 0));

    assert_eq!(lba_formats(&d, 2), (1, 1, [9, 12]));
    fill(&mut qp, 2, 4096, 2, 0x77);
    assert_ok(&d.admin(format_nvm(2, 0, 1, 0)).expect("format"), "to 512");
    assert_eq!(lba_formats(&d, 2), (1, 0, [9, 12]));
    assert!(head(&mut qp, 2, 512, 16).iter().all(|b| *b == 0));
    fill(&mut qp, 2, 512, 3, 0x12);
    assert!(head(&mut qp, 2, 512, 3).iter().all(|b| *b == 0x12));
    d.delete_qpair(qp).expect("delete queue pair");
}

/// The PCI function a guest's firmware and driver probe (what Windows' stornvme
/// and its PnP manager look at; no Windows image runs here): identity and class
/// 010802h, a type-0 header whose capability list is walkable (PM, MSI-X, PCI
/// Express, no loop), BAR0 a 64-bit non-prefetchable memory BAR of at least 16 KiB
/// whose size probe agrees with the region, no other BARs, and the MSI-X table and
/// PBA inside BAR0 past the registers and doorbells. With 300 I/O queues (301
/// vectors, more than one page of table) BAR0 grows instead of overlapping.
#[test]
fn pci_config_space_and_bar0_layout() {
    use vfio_user::proto::{PCI_BAR0_REGION, PCI_CONFIG_REGION};
    for io_queues in [32u16, 300] {
        let dev = TestDev::start_with("pci", &["ram:4M"], |c| c.io_queues = io_queues);
        let mut c = initiator::VfioUserClient::connect(&dev.sock).expect("connect");
        let cfg_region = c.region_info(PCI_CONFIG_REGION).expect("config region");
        assert_eq!(cfg_region.size, 4096, "PCIe extended config space");
        let mut cfg = vec![0u8; 4096];
        c.region_read(PCI_CONFIG_REGION, 0, &mut cfg)
            .expect("read config");
        let r16 = |o: usize| u16::from_le_bytes([cfg[o], cfg[o + 1]]);
        let r32 = |b: &[u8], o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        assert_eq!(r16(0), udrive::device::PCI_VENDOR);
        assert_eq!(r16(2), udrive::device::PCI_DEVICE_NVME);
        assert_eq!(&cfg[9..12], &[0x02, 0x08, 0x01], "class: NVM Express");
        assert_eq!(cfg[0x0e] & 0x7f, 0, "type-0 header");
        assert_ne!(r16(0x06) & 0x10, 0, "capability list");
        assert_eq!(cfg[0x3d], 1, "INTA#");

        // BAR0: memory, 64-bit, not prefetchable; its size probe.
        let bar0 = r32(&cfg, 0x10);
        assert_eq!(bar0 & 0xf, 0b0100, "64-bit memory BAR, not prefetchable");
        let probe = |c: &mut initiator::VfioUserClient, off: u64| {
            c.region_write(PCI_CONFIG_REGION, off, &[0xff; 4], false)
                .expect("size probe");
            let mut b = [0u8; 4];
            c.region_read(PCI_CONFIG_REGION, off, &mut b)
                .expect("read back");
            u32::from_le_bytes(b)
        };
        let mask = u64::from(probe(&mut c, 0x10) & !0xf) | u64::from(probe(&mut c, 0x14)) << 32;
        let size = (!mask).wrapping_add(1);
        assert!(size.is_power_of_two() && size >= 0x4000, "BAR0 {size:#x}");
        let region = c.region_info(PCI_BAR0_REGION).expect("BAR0 region");
        assert_eq!(region.size, size, "BAR0 region and size probe agree");
        for off in (0x18..0x28).step_by(4) {
            assert_eq!(probe(&mut c, off), 0, "BAR at {off:#x} is not implemented");
        }

        // The capability chain, bounded against loops.
        let mut caps = Vec::new();
        let mut p = usize::from(cfg[0x34]);
        while p != 0 {
            assert!(
                (0x40..0x100).contains(&p) && p % 4 == 0,
                "capability at {p:#x}"
            );
            assert!(caps.len() < 48, "capability list loops");
            caps.push((cfg[p], p));
            p = usize::from(cfg[p + 1]);
        }
        let ids: Vec<u8> = caps.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [0x01, 0x11, 0x10], "PM, MSI-X, PCI Express");
        assert_eq!(r32(&cfg, 0x100), 0, "no extended capabilities");
        let pcie = caps[2].1;
        assert_eq!(cfg[pcie + 2] & 0xf, 2, "PCI Express capability version 2");
        assert_eq!(cfg[pcie + 2] >> 4, 0, "endpoint");

        // MSI-X: one vector per queue plus the admin queue, table and PBA in BAR0.
        let msix = caps[1].1;
        let vectors = u64::from(r16(msix + 2) & 0x7ff) + 1;
        assert_eq!(vectors, u64::from(io_queues) + 1);
        let (table, pba) = (r32(&cfg, msix + 4), r32(&cfg, msix + 8));
        assert_eq!((table & 7, pba & 7), (0, 0), "both in BAR0");
        let (table, pba) = (u64::from(table & !7), u64::from(pba & !7));
        assert!(table >= 0x2000, "past the registers and doorbells");
        assert!(table + vectors * 16 <= pba, "table before the PBA");
        assert!(pba + vectors.div_ceil(64) * 8 <= size, "PBA inside BAR0");
        let want = nvme::bar0_layout(io_queues + 1);
        assert_eq!(
            (size, table, pba),
            (want.size, want.msix_table, want.msix_pba)
        );
        drop(c);
        dev.check_fresh_client(9);
    }
}
