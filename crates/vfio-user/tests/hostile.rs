//! Malformed input: each class gets an error reply (connection continues) or a
//! disconnect, and a well-behaved client works afterwards.

use guest_mem::SharedMem;
use test_support::vfio_client::*;
use test_support::vfio_server::*;
use vfio_user::proto::*;
use zerocopy::IntoBytes;

fn version_with(caps: &[u8]) -> Vec<u8> {
    let mut p = Version { major: 0, minor: 0 }.as_bytes().to_vec();
    p.extend_from_slice(caps);
    p
}

fn then_good_client_works(f: &Fixture) {
    let mut r = f.raw();
    r.negotiate();
    assert_eq!(r.cfg_read32(0) & 0xffff, 0x1b36);
}

#[test]
fn bad_version_messages_get_errors() {
    let f = Fixture::new();
    let mut r = f.raw();
    let v = Command::Version as u16;
    r.expect_err(
        Command::DeviceGetInfo as u16,
        DeviceInfo {
            argsz: 16,
            ..Default::default()
        }
        .as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(v, &[0, 0], &[], libc::EINVAL); // short
    r.expect_err(
        v,
        &version_with(br#"{"capabilities":{}}"#),
        &[],
        libc::EINVAL,
    ); // no NUL
    r.expect_err(v, &version_with(b"{}\0{}\0"), &[], libc::EINVAL); // interior NUL
    r.expect_err(v, &version_with(b"\xff\xfe\0"), &[], libc::EINVAL); // not UTF-8
    r.expect_err(v, &version_with(b"{not json\0"), &[], libc::EINVAL);
    r.expect_err(v, &version_with(br#"{"capabilities":{"max_msg_fds":"x"}}"#.iter().chain(b"\0").copied().collect::<Vec<_>>().as_slice()), &[], libc::EINVAL);
    let mut huge = vec![b' '; 100_000];
    huge.push(0);
    r.expect_err(v, &version_with(&huge), &[], libc::E2BIG);
    let mut p = Version { major: 1, minor: 0 }.as_bytes().to_vec();
    p.push(0);
    r.expect_err(v, &p[..4], &[], libc::ENOTSUP);
    // Still usable: negotiate now, and a second VERSION is refused.
    r.negotiate();
    r.expect_err(v, &version_with(b""), &[], libc::EINVAL);
    drop(r);
    then_good_client_works(&f);
}

#[test]
fn bad_commands_get_errors_and_connection_continues() {
    let f = Fixture::new();
    let mut r = f.raw();
    r.negotiate();
    for cmd in [0u16, 6, 11, 12, 14, 15, 0xffff] {
        r.expect_err(cmd, &[], &[], libc::ENOTSUP);
    }
    replies_and_short_info(&mut r);
    let g = SharedMem::new("g", 0x4000).unwrap();
    bad_dma_maps(&mut r, &g);
    bad_region_accesses(&mut r);
    bad_set_irqs(&mut r, &g);
    r.expect_err(Command::DeviceReset as u16, &[1], &[], libc::EINVAL);
    // After all that the connection still works.
    assert_eq!(r.cfg_read32(0) & 0xffff, 0x1b36);
    assert!(f.mem.snapshot().1.regions().is_empty());
}

/// A reply sent as a request, and GET_INFO/GET_IRQ_INFO with argsz too small or a
/// payload shorter than the struct.
fn replies_and_short_info(r: &mut RawClient) {
    // A reply to nothing we asked is dropped, never answered (a reply to a reply
    // would be a protocol error of ours); the next command is served.
    r.send(Command::DeviceReset as u16, FLAG_TYPE_REPLY, &[], &[]);
    r.expect_err(0, &[], &[], libc::ENOTSUP);
    // argsz too small / payload shorter than the struct.
    let gi = Command::DeviceGetInfo as u16;
    r.expect_err(
        gi,
        DeviceInfo {
            argsz: 8,
            ..Default::default()
        }
        .as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(gi, &16u32.to_le_bytes(), &[], libc::EINVAL);
    r.expect_err(
        Command::DeviceGetIrqInfo as u16,
        IrqInfo {
            argsz: 16,
            index: 5,
            ..Default::default()
        }
        .as_bytes(),
        &[],
        libc::EINVAL,
    );
}

/// DMA_MAP: missing fd (this device model cannot serve DMA by messages), two fds,
/// wrong argsz, zero size, unknown flags, fd on a command that takes none (closed
/// by the server), size beyond the file.
fn bad_dma_maps(r: &mut RawClient, g: &SharedMem) {
    let map = DmaMap {
        argsz: 32,
        flags: DMA_READ,
        offset: 0,
        addr: 0x1000,
        size: 0x4000,
    };
    let dm = Command::DmaMap as u16;
    r.expect_err(dm, map.as_bytes(), &[], libc::ENOTSUP);
    r.expect_err(dm, map.as_bytes(), &[fd_of(g), fd_of(g)], libc::EINVAL);
    r.expect_err(
        dm,
        DmaMap { argsz: 40, ..map }.as_bytes(),
        &[fd_of(g)],
        libc::EINVAL,
    );
    r.expect_err(
        dm,
        DmaMap { size: 0, ..map }.as_bytes(),
        &[fd_of(g)],
        libc::EINVAL,
    );
    r.expect_err(
        dm,
        DmaMap { flags: 0x10, ..map }.as_bytes(),
        &[fd_of(g)],
        libc::EINVAL,
    );
    r.expect_err(
        dm,
        DmaMap {
            size: 0x10_0000,
            ..map
        }
        .as_bytes(),
        &[fd_of(g)],
        libc::EINVAL,
    );
    r.expect_err(
        dm,
        DmaMap {
            addr: u64::MAX - 10,
            ..map
        }
        .as_bytes(),
        &[fd_of(g)],
        libc::EINVAL,
    );
    r.expect_err(
        Command::DeviceGetInfo as u16,
        DeviceInfo {
            argsz: 16,
            ..Default::default()
        }
        .as_bytes(),
        &[fd_of(g)],
        libc::EINVAL,
    );
    r.expect_err(
        Command::DmaUnmap as u16,
        DmaUnmap {
            argsz: 24,
            flags: UNMAP_GET_DIRTY_BITMAP,
            addr: 0,
            size: 0x1000,
        }
        .as_bytes(),
        &[],
        libc::ENOTSUP,
    );
}

/// Region access: bad region, out of bounds, count too big, size mismatch.
fn bad_region_accesses(r: &mut RawClient) {
    let rr = Command::RegionRead as u16;
    let acc = |region, offset, count| RegionAccess {
        offset,
        region,
        count,
    };
    r.expect_err(rr, acc(3, 0, 4).as_bytes(), &[], libc::EINVAL);
    r.expect_err(
        rr,
        acc(PCI_CONFIG_REGION, 4094, 4).as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(
        rr,
        acc(PCI_BAR0_REGION, u64::MAX, 4).as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(
        rr,
        acc(PCI_BAR0_REGION, 0, u32::MAX).as_bytes(),
        &[],
        libc::E2BIG,
    );
    r.expect_err(
        rr,
        &[acc(PCI_BAR0_REGION, 0, 4).as_bytes(), &[0; 4]].concat(),
        &[],
        libc::EINVAL,
    );
    let rw = Command::RegionWrite as u16;
    r.expect_err(
        rw,
        &[acc(PCI_BAR0_REGION, 0, 8).as_bytes(), &[0; 4]].concat(),
        &[],
        libc::EINVAL,
    );
    // Straddling the MSI-X table boundary.
    r.expect_err(
        rr,
        acc(PCI_BAR0_REGION, u64::from(TABLE) - 4, 8).as_bytes(),
        &[],
        libc::EINVAL,
    );
}

/// SET_IRQS: bad flags, range, fd count, non-eventfd fd.
fn bad_set_irqs(r: &mut RawClient, g: &SharedMem) {
    let si = Command::DeviceSetIrqs as u16;
    let set = |flags, index, start, count| SetIrqs {
        argsz: 20,
        flags,
        index,
        start,
        count,
    };
    let ev = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
    r.expect_err(
        si,
        set(
            IRQ_SET_DATA_NONE | IRQ_SET_DATA_BOOL | IRQ_SET_ACTION_TRIGGER,
            2,
            0,
            1,
        )
        .as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(
        si,
        set(ev, PCI_MSIX_IRQ, 3, 2).as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(
        si,
        set(ev, PCI_MSIX_IRQ, u32::MAX, 2).as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(si, set(ev, PCI_MSI_IRQ, 0, 1).as_bytes(), &[], libc::EINVAL);
    let e = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
    let efd = std::os::fd::AsRawFd::as_raw_fd(&e);
    r.expect_err(
        si,
        set(ev, PCI_MSIX_IRQ, 0, 2).as_bytes(),
        &[efd],
        libc::EINVAL,
    );
    r.expect_err(
        si,
        set(ev, PCI_MSIX_IRQ, 0, 1).as_bytes(),
        &[fd_of(g)],
        libc::EINVAL,
    );
    r.expect_err(
        si,
        set(IRQ_SET_DATA_BOOL | IRQ_SET_ACTION_TRIGGER, 2, 0, 2).as_bytes(),
        &[],
        libc::EINVAL,
    );
    r.expect_err(
        si,
        set(IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_UNMASK, 0, 0, 1).as_bytes(),
        &[efd],
        libc::ENOTSUP,
    );
    r.expect_err(
        si,
        SetIrqs {
            argsz: 24,
            ..set(ev, 2, 0, 1)
        }
        .as_bytes(),
        &[efd],
        libc::EINVAL,
    );
    // Too many fds for one message: the kernel truncates, we refuse.
    let many = vec![efd; 20];
    r.expect_err(
        si,
        set(ev, PCI_MSIX_IRQ, 0, 4).as_bytes(),
        &many,
        libc::EINVAL,
    );
}

#[test]
fn framing_errors_disconnect() {
    let f = Fixture::new();
    // msg_size below the header.
    let mut r = f.raw();
    r.negotiate();
    let h = Header {
        msg_id: 7,
        cmd: 4,
        msg_size: 8,
        flags: 0,
        error: 0,
    };
    r.send_raw(h.as_bytes(), &[]);
    let rep = r.recv().unwrap();
    assert!(rep.hdr.is_error() && rep.hdr.msg_id == 7);
    assert!(r.is_closed());
    f.wait_gone(1);
    // msg_size above the maximum: E2BIG, then disconnect (nothing allocated).
    let mut r = f.raw();
    let h = Header {
        msg_id: 8,
        cmd: 10,
        msg_size: u32::MAX,
        flags: 0,
        error: 0,
    };
    r.send_raw(h.as_bytes(), &[]);
    let rep = r.recv().unwrap();
    assert_eq!(rep.hdr.error, libc::E2BIG as u32);
    assert!(r.is_closed());
    // Short header, then EOF.
    let mut r = f.raw();
    r.negotiate();
    r.send_raw(&[1, 2, 3], &[]);
    r.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(r.is_closed());
    f.wait_gone(2);
    // Payload shorter than msg_size, then EOF.
    let mut r = f.raw();
    r.negotiate();
    let h = Header {
        msg_id: 9,
        cmd: 10,
        msg_size: 100,
        flags: 0,
        error: 0,
    };
    r.send_raw(h.as_bytes(), &[]);
    r.send_raw(&[0; 10], &[]);
    r.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(r.is_closed());
    f.wait_gone(3);
    then_good_client_works(&f);
}

#[test]
fn garbage_stream_never_panics() {
    let f = Fixture::new();
    // Deterministic pseudo-random bytes in valid-looking frames and raw noise.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..50 {
        let mut r = f.raw();
        if round % 2 == 0 {
            r.negotiate();
        }
        for _ in 0..20 {
            let len = (next() % 64) as usize;
            let payload: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let cmd = (next() % 16) as u16;
            r.send(cmd, (next() % 2) as u32 * FLAG_NO_REPLY, &payload, &[]);
        }
        drop(r);
    }
    then_good_client_works(&f);
}
