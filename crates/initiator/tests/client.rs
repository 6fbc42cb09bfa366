use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use guest_mem::{Prot, SharedMem};
use initiator::{Error, VfioUserClient};
use test_support::fake_nvme;
use vfio_user::proto::{self, Command, Header};
use vmm_sys_util::eventfd::EventFd;
use zerocopy::IntoBytes;

#[test]
fn negotiation_info_and_regions() {
    let (f, sock) = fake_nvme::start(Default::default());
    let mut c = VfioUserClient::from_stream(sock).unwrap();
    let v = &f.logged(Command::Version)[0];
    let json = std::str::from_utf8(&v.payload[4..v.payload.len() - 1]).unwrap();
    assert!(
        json.contains("\"max_msg_fds\":16") && json.contains("\"max_data_xfer_size\":1048576"),
        "{json}"
    );
    assert_eq!(
        *v.payload.last().unwrap(),
        0,
        "caps string is NUL terminated"
    );
    assert_eq!(c.max_msg_fds(), 4);
    assert_eq!(c.max_data_xfer(), 64 << 10);

    let di = c.device_info().unwrap();
    assert_eq!(di.num_regions, proto::PCI_NUM_REGIONS);

    let r = c.region_info(0).unwrap();
    assert_eq!(r.size, fake_nvme::BAR0_SIZE);
    assert_eq!(
        r.sparse_areas,
        vec![proto::SparseArea {
            offset: 0x1000,
            size: 0x1000
        }]
    );
    assert!(r.fd.is_some());
    let asks = f.logged(Command::DeviceGetRegionInfo);
    assert_eq!(asks.len(), 2, "asked again with the larger argsz");
    assert_eq!(
        proto::parse::<proto::RegionInfo>(&asks[1].payload)
            .unwrap()
            .argsz,
        64
    );

    let cfg = c.region_info(7).unwrap();
    assert!(cfg.fd.is_none() && cfg.sparse_areas.is_empty());

    match c.region_info(99) {
        Err(Error::Remote { cmd, errno }) => assert_eq!((cmd, errno), (5, libc::EINVAL)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn region_access_chunks_and_no_reply() {
    let (f, sock) = fake_nvme::start(Default::default());
    let mut c = VfioUserClient::from_stream(sock).unwrap();
    let mut cap = [0u8; 8];
    c.region_read(0, 0, &mut cap).unwrap();
    assert_eq!(u64::from_le_bytes(cap) & 0xffff, 255);

    c.region_write(0, 0x24, &0x001f_001fu32.to_le_bytes(), false)
        .unwrap();
    c.region_write(0, 0x28, &0x1234_5000u64.to_le_bytes(), true)
        .unwrap();
    let mut b = [0u8; 12];
    c.region_read(0, 0x24, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b[..4].try_into().unwrap()), 0x001f_001f);
    assert_eq!(u64::from_le_bytes(b[4..].try_into().unwrap()), 0x1234_5000);
    let w = f.logged(Command::RegionWrite);
    assert_eq!(w[1].flags & proto::FLAG_NO_REPLY, proto::FLAG_NO_REPLY);

    // 100 KiB with a 64 KiB server limit: two messages.
    let mut big = vec![0u8; 100 << 10];
    c.region_read(7, 0, &mut big).unwrap();
    let r: Vec<_> = f
        .logged(Command::RegionRead)
        .iter()
        .map(|l| proto::parse::<proto::RegionAccess>(&l.payload).unwrap())
        .filter(|a| a.region == 7)
        .map(|a| (a.offset, a.count))
        .collect();
    assert_eq!(r, vec![(0, 64 << 10), (64 << 10, 36 << 10)]);
}

#[test]
fn irqs_dma_and_reset() {
    let (f, sock) = fake_nvme::start(Default::default());
    let mut c = VfioUserClient::from_stream(sock).unwrap();
    let info = c.irq_info(proto::PCI_MSIX_IRQ).unwrap();
    assert_eq!(info.count, 64);
    let efds: Vec<EventFd> = (0..6).map(|_| EventFd::new(0).unwrap()).collect();
    let files: Vec<std::fs::File> = efds
        .iter()
        .map(|e| {
            use std::os::fd::{AsRawFd, FromRawFd};
            // SAFETY: dup gives us a new fd that we own.
            unsafe { std::fs::File::from_raw_fd(libc::dup(e.as_raw_fd())) }
        })
        .collect();
    let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
    c.set_irqs(proto::PCI_MSIX_IRQ, 2, &fds).unwrap();
    let s: Vec<_> = f
        .logged(Command::DeviceSetIrqs)
        .iter()
        .map(|l| {
            let si = proto::parse::<proto::SetIrqs>(&l.payload).unwrap();
            (si.start, si.count, l.nfds)
        })
        .collect();
    assert_eq!(s, vec![(2, 4, 4), (6, 2, 2)]);

    let m = SharedMem::new("dma", 1 << 20).unwrap();
    c.dma_map(m.fd(), 0, 0x1_0000_0000, m.len(), Prot::RW)
        .unwrap();
    assert_eq!(f.ctrl.lock().unwrap().mem.len(), 1);
    let l = &f.logged(Command::DmaMap)[0];
    assert_eq!(l.nfds, 1);
    let dm = proto::parse::<proto::DmaMap>(&l.payload).unwrap();
    assert_eq!((dm.addr, dm.size, dm.flags), (0x1_0000_0000, 1 << 20, 3));
    c.dma_unmap(0x1_0000_0000, m.len()).unwrap();
    assert_eq!(f.ctrl.lock().unwrap().mem.len(), 0);
    c.dma_map(m.fd(), 0, 0x2000_0000, m.len(), Prot::RW)
        .unwrap();
    c.unmap_all().unwrap();
    assert_eq!(f.ctrl.lock().unwrap().mem.len(), 0);
    c.device_reset().unwrap();
}

#[test]
fn raw_messages() {
    let (_f, sock) = fake_nvme::start(Default::default());
    let mut c = VfioUserClient::from_stream(sock).unwrap();
    let h = Header {
        msg_id: 0x7777,
        cmd: 99,
        msg_size: 16,
        flags: 0,
        error: 0,
    };
    c.send_raw(h.as_bytes(), &[]).unwrap();
    let r = c.recv_reply().unwrap();
    assert!(r.header.is_error() && r.header.msg_id == 0x7777);
    assert_eq!(r.header.error as i32, libc::ENOSYS);
    // The connection is still usable.
    c.device_info().unwrap();
}

/// A server that answers VERSION properly, then misbehaves in the given way.
fn hostile(bad: impl FnOnce(&mut UnixStream, Header) + Send + 'static) -> Result<(), Error> {
    let (a, mut b) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let mut hb = [0u8; 16];
        b.read_exact(&mut hb).unwrap();
        let h: Header = proto::parse(&hb).unwrap();
        let mut p = vec![0u8; h.msg_size as usize - 16];
        b.read_exact(&mut p).unwrap();
        let mut r = Header::reply_to(&h, 4).as_bytes().to_vec();
        r.extend_from_slice(&[0, 0, 0, 0]);
        b.write_all(&r).unwrap();
        b.read_exact(&mut hb).unwrap();
        let h: Header = proto::parse(&hb).unwrap();
        let mut p = vec![0u8; h.msg_size as usize - 16];
        b.read_exact(&mut p).unwrap();
        bad(&mut b, h);
    });
    let mut c = VfioUserClient::from_stream(a)?;
    let r = c.region_info(0).map(|_| ());
    t.join().unwrap();
    r
}

#[test]
fn hostile_servers_give_errors_not_panics() {
    // Huge msg_size.
    let r = hostile(|s, h| {
        let mut x = Header::reply_to(&h, 0);
        x.msg_size = u32::MAX;
        s.write_all(x.as_bytes()).unwrap();
    });
    assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
    // msg_size smaller than a header.
    let r = hostile(|s, h| {
        let mut x = Header::reply_to(&h, 0);
        x.msg_size = 3;
        s.write_all(x.as_bytes()).unwrap();
    });
    assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
    // Reply too short for a RegionInfo.
    let r = hostile(|s, h| {
        let mut x = Header::reply_to(&h, 4).as_bytes().to_vec();
        x.extend_from_slice(&[1, 2, 3, 4]);
        s.write_all(&x).unwrap();
    });
    assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
    // Caps pointing outside the reply.
    let r = hostile(|s, h| {
        let ri = proto::RegionInfo {
            argsz: 32,
            flags: proto::REGION_CAPS,
            cap_offset: 1000,
            ..Default::default()
        };
        let mut x = Header::reply_to(&h, 32).as_bytes().to_vec();
        x.extend_from_slice(ri.as_bytes());
        s.write_all(&x).unwrap();
    });
    assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
    // Hang up mid-message.
    let r = hostile(|s, h| {
        s.write_all(&Header::reply_to(&h, 32).as_bytes()[..10])
            .unwrap();
    });
    assert!(matches!(r, Err(Error::Disconnected)), "{r:?}");
    // Reply for the wrong command.
    let r = hostile(|s, h| {
        let mut x = Header::reply_to(&h, 0);
        x.cmd = 9;
        s.write_all(x.as_bytes()).unwrap();
    });
    assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
}
