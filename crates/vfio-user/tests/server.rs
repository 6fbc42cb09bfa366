//! The server against rust-vmm's independent `vfio_user::Client` and our raw client.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Duration;

use guest_mem::{Access, MappedRegion, Prot, SharedMem};
use test_support::vfio_client::*;
use test_support::vfio_server::*;
use vfio_user::proto::*;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use zerocopy::IntoBytes;

fn rv(f: &Fixture) -> ::vfio_user_rv::Client {
    ::vfio_user_rv::Client::new(&f.path).expect("rust-vmm client connects")
}

#[test]
fn rust_vmm_client_regions_and_bar_mmap() {
    let f = Fixture::new();
    let c = rv(&f);
    let bar = c.region(PCI_BAR0_REGION).unwrap();
    assert_eq!(bar.size, BAR_SIZE);
    assert_eq!(
        bar.flags,
        REGION_READ | REGION_WRITE | REGION_MMAP | REGION_CAPS
    );
    assert_eq!(bar.sparse_areas.len(), 1);
    assert_eq!(bar.sparse_areas[0].offset, DOORBELLS);
    assert_eq!(bar.sparse_areas[0].size, 0x1000);
    let fo = bar.file_offset.as_ref().expect("BAR0 fd");
    let m = MappedRegion::map_fd(
        fo.file().as_fd(),
        fo.start() + DOORBELLS,
        0,
        0x1000,
        Prot::RW,
    )
    .unwrap();
    f.bar_mem
        .slice(DOORBELLS + 8, 4)
        .unwrap()
        .store_u32(0, 0xabcd_1234)
        .unwrap();
    assert_eq!(m.slice(8, 4).unwrap().load_u32(0), Some(0xabcd_1234));
    let cfg = c.region(PCI_CONFIG_REGION).unwrap();
    assert_eq!(cfg.size, 4096);
    assert_eq!(cfg.flags, REGION_READ | REGION_WRITE);
    assert!(cfg.file_offset.is_none());
    for i in [1, 2, 3, 4, 5, 6, 8] {
        assert_eq!(c.region(i).unwrap().size, 0, "region {i}");
    }
}

#[test]
fn rust_vmm_client_config_bar_irq_reset() {
    let f = Fixture::new();
    let mut c = rv(&f);
    let mut id = [0u8; 4];
    c.region_read(PCI_CONFIG_REGION, 0, &mut id).unwrap();
    assert_eq!(u32::from_le_bytes(id), 0x0010_1b36);
    c.region_write(PCI_BAR0_REGION, 0x14, &[1, 2, 3, 4])
        .unwrap();
    assert_eq!(
        f.backend.writes.lock().unwrap().as_slice(),
        &[(0x14, vec![1, 2, 3, 4])]
    );
    let mut back = [0u8; 4];
    c.region_read(PCI_BAR0_REGION, 0x14, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3, 4]);
    let intx = c.get_irq_info(PCI_INTX_IRQ).unwrap();
    assert_eq!(
        (intx.count, intx.flags),
        (
            1,
            IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED
        )
    );
    let msix = c.get_irq_info(PCI_MSIX_IRQ).unwrap();
    assert_eq!(
        (msix.count, msix.flags),
        (u32::from(VECTORS), IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE)
    );
    assert_eq!(c.get_irq_info(PCI_MSI_IRQ).unwrap().count, 0);
    c.reset().unwrap();
    assert_eq!(f.backend.resets.load(Ordering::SeqCst), 1);
}

#[test]
fn rust_vmm_client_dma_map_unmap() {
    let f = Fixture::new();
    let mut c = rv(&f);
    let guest = SharedMem::new("guest", 0x10000).unwrap();
    guest
        .slice(0x100, 4)
        .unwrap()
        .store_u32(0, 0x5555_aaaa)
        .unwrap();
    c.dma_map(0, 0x10_0000, 0x10000, fd_of(&guest)).unwrap();
    let (_, map) = f.mem.snapshot();
    let s = map.translate(0x10_0100, 4, Access::Read).unwrap();
    assert_eq!(s.load_u32(0), Some(0x5555_aaaa));
    // The server writes, the client sees it: same pages.
    map.translate(0x10_0200, 4, Access::Write)
        .unwrap()
        .store_u32(0, 7)
        .unwrap();
    assert_eq!(guest.slice(0x200, 4).unwrap().load_u32(0), Some(7));
    drop(map);
    c.dma_unmap(0x10_0000, 0x10000).unwrap();
    assert!(f.mem.snapshot().1.regions().is_empty());
}

#[test]
fn msix_eventfds_in_chunks_and_masking() {
    let f = Fixture::new();
    let mut c = rv(&f);
    let efds: Vec<EventFd> = (0..VECTORS)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();
    let raw: Vec<i32> = efds.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
    let fl = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
    c.set_irqs(PCI_MSIX_IRQ, fl, 0, 2, &raw[..2]).unwrap();
    c.set_irqs(PCI_MSIX_IRQ, fl, 2, 2, &raw[2..]).unwrap();
    // The table is not armed (never written), so vectors fire despite reset masks.
    f.irqs.signal(3);
    assert_eq!(efds[3].read().unwrap(), 1);
    assert!(efds[0].read().is_err() && efds[2].read().is_err());
    f.irqs.signal(1);
    assert_eq!(efds[1].read().unwrap(), 1);

    // Mask vector 2 via SET_IRQS: pending, then unmask fires.
    c.set_irqs(
        PCI_MSIX_IRQ,
        IRQ_SET_DATA_NONE | IRQ_SET_ACTION_MASK,
        2,
        1,
        &[],
    )
    .unwrap();
    f.irqs.signal(2);
    assert!(efds[2].read().is_err());
    assert!(f.irqs.is_pending(2));
    c.set_irqs(
        PCI_MSIX_IRQ,
        IRQ_SET_DATA_NONE | IRQ_SET_ACTION_UNMASK,
        2,
        1,
        &[],
    )
    .unwrap();
    assert_eq!(efds[2].read().unwrap(), 1);
    assert!(!f.irqs.is_pending(2));

    // Mask through the MSI-X table (vector control), PBA shows it, unmask fires.
    let ctl = u64::from(TABLE) + 16 + 12;
    c.region_write(PCI_BAR0_REGION, ctl, &1u32.to_le_bytes())
        .unwrap();
    f.irqs.signal(1);
    assert!(efds[1].read().is_err());
    let mut pba = [0u8; 8];
    c.region_read(PCI_BAR0_REGION, u64::from(PBA), &mut pba)
        .unwrap();
    // Vector 1 pending; 0, 2, 3 are masked by the now-armed table but not pending.
    assert_eq!(pba[0], 0b0010);
    c.region_write(PCI_BAR0_REGION, ctl, &0u32.to_le_bytes())
        .unwrap();
    assert_eq!(efds[1].read().unwrap(), 1);

    // Function mask in config space holds everything back.
    let ctrl = 0x50 + 2;
    c.region_write(PCI_CONFIG_REGION, ctrl, &0xc000u16.to_le_bytes())
        .unwrap();
    f.irqs.signal(1);
    assert!(efds[1].read().is_err());
    c.region_write(PCI_CONFIG_REGION, ctrl, &0x8000u16.to_le_bytes())
        .unwrap();
    assert_eq!(efds[1].read().unwrap(), 1);

    // Teardown: count 0 drops all MSI-X fds, signal falls back to INTx (none set).
    c.set_irqs(
        PCI_MSIX_IRQ,
        IRQ_SET_DATA_NONE | IRQ_SET_ACTION_TRIGGER,
        0,
        0,
        &[],
    )
    .unwrap();
    f.irqs.signal(1);
    assert!(efds[1].read().is_err());
}

#[test]
fn intx_automask_and_unmask() {
    let f = Fixture::new();
    let mut c = rv(&f);
    let e = EventFd::new(EFD_NONBLOCK).unwrap();
    let fl = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
    c.set_irqs(
        PCI_INTX_IRQ,
        fl,
        0,
        1,
        &[std::os::fd::AsRawFd::as_raw_fd(&e)],
    )
    .unwrap();
    f.irqs.signal(0);
    assert_eq!(e.read().unwrap(), 1);
    f.irqs.signal(0); // automasked: pending
    assert!(e.read().is_err());
    c.set_irqs(
        PCI_INTX_IRQ,
        IRQ_SET_DATA_NONE | IRQ_SET_ACTION_UNMASK,
        0,
        1,
        &[],
    )
    .unwrap();
    assert_eq!(e.read().unwrap(), 1);
    // DATA_BOOL trigger from the client.
    c.set_irqs(
        PCI_INTX_IRQ,
        IRQ_SET_DATA_NONE | IRQ_SET_ACTION_TRIGGER,
        0,
        1,
        &[],
    )
    .unwrap();
    assert_eq!(e.read().unwrap(), 1);
}

#[test]
fn bar_size_probing_through_config_space() {
    let f = Fixture::new();
    let mut r = f.raw();
    r.negotiate();
    r.region_write(PCI_CONFIG_REGION, 0x10, &[0xff; 4]);
    r.region_write(PCI_CONFIG_REGION, 0x14, &[0xff; 4]);
    let lo = r.cfg_read32(0x10);
    let hi = r.cfg_read32(0x14);
    let mask = (u64::from(hi) << 32) | u64::from(lo & !0xf);
    assert_eq!(lo & 0xf, 0x4, "64-bit memory BAR");
    assert_eq!(!mask + 1, BAR_SIZE);
    // ROM and other BARs read 0 after probing.
    r.region_write(PCI_CONFIG_REGION, 0x18, &[0xff; 4]);
    assert_eq!(r.cfg_read32(0x18), 0);
    assert_eq!(r.cfg_read32(0x3c) >> 8 & 0xff, 1, "INTA");
}

#[test]
fn pipelined_dma_map_unmap_and_unmap_all() {
    let f = Fixture::new();
    let mut r = f.raw();
    r.negotiate();
    let g = SharedMem::new("g", 0x4000).unwrap();
    let map = |addr: u64| DmaMap {
        argsz: 32,
        flags: DMA_READ | DMA_WRITE,
        offset: 0,
        addr,
        size: 0x4000,
    };
    let unmap = |addr: u64, flags: u32, size: u64| DmaUnmap {
        argsz: 24,
        flags,
        addr,
        size,
    };
    let mut ids = vec![];
    for i in 0..8u64 {
        ids.push(r.send(
            Command::DmaMap as u16,
            0,
            map(i << 20).as_bytes(),
            &[fd_of(&g)],
        ));
    }
    for i in 0..4u64 {
        ids.push(r.send(
            Command::DmaUnmap as u16,
            0,
            unmap(i << 20, 0, 0x4000).as_bytes(),
            &[],
        ));
    }
    for id in ids {
        let rep = r.recv().unwrap();
        assert_eq!(rep.hdr.msg_id, id);
        assert!(!rep.hdr.is_error(), "id {id}: {}", rep.hdr.error);
        if rep.hdr.cmd == Command::DmaUnmap as u16 {
            assert_eq!(rep.payload.len(), 24);
        }
    }
    assert_eq!(f.mem.snapshot().1.regions().len(), 4);
    // Overlap refused.
    r.expect_err(
        Command::DmaMap as u16,
        map(5 << 20).as_bytes(),
        &[fd_of(&g)],
        libc::EEXIST,
    );
    // Unknown region.
    r.expect_err(
        Command::DmaUnmap as u16,
        unmap(0, 0, 0x4000).as_bytes(),
        &[],
        libc::ENOENT,
    );
    // UNMAP_ALL needs addr = size = 0.
    r.expect_err(
        Command::DmaUnmap as u16,
        unmap(1, UNMAP_ALL, 0).as_bytes(),
        &[],
        libc::EINVAL,
    );
    let rep = r.call(Command::DmaUnmap, unmap(0, UNMAP_ALL, 0).as_bytes(), &[]);
    assert!(!rep.hdr.is_error());
    assert!(f.mem.snapshot().1.regions().is_empty());
}

#[test]
fn no_reply_region_write_is_silent() {
    let f = Fixture::new();
    let mut r = f.raw();
    r.negotiate();
    let a = RegionAccess {
        offset: 0x20,
        region: PCI_BAR0_REGION,
        count: 4,
    };
    let mut p = a.as_bytes().to_vec();
    p.extend_from_slice(&[9, 9, 9, 9]);
    r.send(Command::RegionWrite as u16, FLAG_NO_REPLY, &p, &[]);
    // The next reply must belong to the next request.
    let rep = r.call(
        Command::DeviceGetInfo,
        DeviceInfo {
            argsz: 16,
            ..Default::default()
        }
        .as_bytes(),
        &[],
    );
    let info: DeviceInfo = parse(&rep.payload).unwrap();
    assert_eq!((info.num_regions, info.num_irqs), (9, 5));
    assert_eq!(info.flags, DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET);
    assert_eq!(
        f.backend.writes.lock().unwrap()[0],
        (0x20, vec![9, 9, 9, 9])
    );
}

#[test]
fn region_info_small_argsz_then_full() {
    let f = Fixture::new();
    let mut r = f.raw();
    r.negotiate();
    let q = RegionInfo {
        argsz: 32,
        index: 0,
        ..Default::default()
    };
    let rep = r.call(Command::DeviceGetRegionInfo, q.as_bytes(), &[]);
    let info: RegionInfo = parse(&rep.payload).unwrap();
    assert_eq!(rep.payload.len(), 32);
    assert!(rep.fd.is_none());
    assert_eq!(info.argsz, 32 + 8 + 8 + 16);
    let q = RegionInfo {
        argsz: 1000,
        index: 0,
        ..Default::default()
    };
    let rep = r.call(Command::DeviceGetRegionInfo, q.as_bytes(), &[]);
    let info: RegionInfo = parse(&rep.payload).unwrap();
    assert_eq!(rep.hdr.msg_size as usize, 16 + info.argsz as usize);
    assert_eq!(info.cap_offset, 32);
    assert!(rep.fd.is_some());
    let cap: CapHeader = parse(&rep.payload[32..]).unwrap();
    assert_eq!(
        (cap.id, cap.version, cap.next),
        (REGION_CAP_SPARSE_MMAP, 1, 0)
    );
    r.expect_err(
        Command::DeviceGetRegionInfo as u16,
        RegionInfo {
            argsz: 32,
            index: 9,
            ..Default::default()
        }
        .as_bytes(),
        &[],
        libc::EINVAL,
    );
}

#[test]
fn disconnect_drops_dma_and_irqs_then_new_client_works() {
    let f = Fixture::new();
    let g = SharedMem::new("g", 0x4000).unwrap();
    let e = EventFd::new(EFD_NONBLOCK).unwrap();
    let mut second;
    {
        let mut c = rv(&f);
        c.dma_map(0, 0x1000_0000, 0x4000, fd_of(&g)).unwrap();
        c.set_irqs(
            PCI_MSIX_IRQ,
            IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER,
            0,
            1,
            &[std::os::fd::AsRawFd::as_raw_fd(&e)],
        )
        .unwrap();
        assert_eq!(f.mem.snapshot().1.regions().len(), 1);
        // While it is connected, a second client waits unanswered...
        second = f.raw();
        let mut p = Version { major: 0, minor: 0 }.as_bytes().to_vec();
        p.push(0);
        second
            .s
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        second.send(Command::Version as u16, 0, &p, &[]);
        let mut b = [0u8; 1];
        assert!(
            std::io::Read::read(&mut second.s, &mut b).is_err(),
            "no reply yet"
        );
    }
    // ...and is served once the first has gone.
    second
        .s
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let rep = second
        .recv()
        .expect("version reply after the first client left");
    assert!(!rep.hdr.is_error());
    drop(second);
    f.wait_gone(2);
    assert!(f.mem.snapshot().1.regions().is_empty());
    f.irqs.signal(0);
    assert!(e.read().is_err(), "eventfd dropped with the client");
    let mut c = rv(&f);
    let mut id = [0u8; 2];
    c.region_read(PCI_CONFIG_REGION, 0, &mut id).unwrap();
    assert_eq!(u16::from_le_bytes(id), 0x1b36);
    c.dma_map(0, 0x1000_0000, 0x4000, fd_of(&g)).unwrap();
    assert_eq!(f.mem.snapshot().1.regions().len(), 1);
}

#[test]
fn stop_removes_socket_and_restart_replaces_stale() {
    let mut f = Fixture::new();
    let _c = rv(&f);
    f.server.take().unwrap().stop();
    assert!(!f.path.exists());
    assert_eq!(f.backend.gone.load(Ordering::SeqCst), 1);
    // A stale socket file (no listener) is replaced; a live one is refused.
    let l = std::os::unix::net::UnixListener::bind(&f.path).unwrap();
    let bar = SharedMem::new("b", BAR_SIZE).unwrap();
    let start = || {
        let spec = spec(&bar);
        let irqs = vfio_user::VfioUserServer::irqs_for(&spec);
        vfio_user::VfioUserServer::start(
            vfio_user::ServerConfig {
                access: Default::default(),
                socket: f.path.clone(),
                name: "t2".into(),
                dma_reply_timeout: vfio_user::DEFAULT_DMA_REPLY_TIMEOUT,
                keep: None,
                listener: None,
                start_paused: false,
            },
            spec,
            f.backend.clone(),
            f.mem.clone(),
            irqs,
        )
    };
    assert_eq!(start().unwrap_err().kind(), std::io::ErrorKind::AddrInUse);
    drop(l);
    // The socket listens once start returns.
    let s = start().unwrap();
    let _c = rv(&f);
    s.stop();
}
