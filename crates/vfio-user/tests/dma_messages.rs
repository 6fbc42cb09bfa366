//! The server's DMA_READ/DMA_WRITE requests, message by message, against a raw
//! client: probing the client's layout, splitting at its `max_data_xfer_size`,
//! serving the client's own requests while a transfer waits, bounded waits, and
//! replies that do not fit. A test device moves bytes when BAR0 is written.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_mem::{Access, DmaSpace, MemError, RemoteError};
use test_support::vfio_client::{RawClient, RawReply};
use test_support::vfio_server::Fixture;
use test_support::{wait_until, T};
use vfio_user::proto::*;
use vfio_user::PciBackend;
use zerocopy::IntoBytes;

const BASE: u64 = 0x10_0000;
const SIZE: u64 = 0x10_0000;

/// What one transfer of the test device gave, and how long it took.
type Done = (Result<Vec<u8>, MemError>, Duration);

/// A device that, on a 16-byte BAR0 write at 0x100 of (addr u64, len u32, push
/// u32), fetches that range from the client (or fills it with a pattern and
/// pushes it) on the writing thread, and records the outcome.
struct Mover {
    mem: Arc<DmaSpace>,
    done: Mutex<Vec<Done>>,
}

impl PciBackend for Mover {
    fn bar_read(&self, _bar: u32, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn bar_write(&self, _bar: u32, offset: u64, data: &[u8]) {
        if offset != 0x100 || data.len() != 16 {
            return;
        }
        let addr = u64::from_le_bytes(data[..8].try_into().unwrap());
        let len = u32::from_le_bytes(data[8..12].try_into().unwrap()) as usize;
        let push = data[12] != 0;
        let t0 = Instant::now();
        let (_, map) = self.mem.snapshot();
        let r = if push {
            let s = map.translate(addr, len, Access::Write).unwrap();
            let pat: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            s.write_from(0, &pat).unwrap();
            map.push(&[(addr, len as u64)]).map(|_| pat)
        } else {
            map.fetch(&[(addr, len as u64)]).map(|_| {
                let mut v = vec![0u8; len];
                map.translate(addr, len, Access::Read)
                    .unwrap()
                    .read_into(0, &mut v)
                    .unwrap();
                v
            })
        };
        self.done.lock().unwrap().push((r, t0.elapsed()));
    }
    fn reset(&self) {}
    fn client_gone(&self) {}
    fn dma_messages(&self, _writable: bool) -> Result<(), i32> {
        Ok(())
    }
}

type Fix = Fixture<Mover>;

fn fixture(timeout: Duration) -> Fix {
    Fixture::start(
        |mem| Mover {
            mem: mem.clone(),
            done: Mutex::new(Vec::new()),
        },
        timeout,
    )
}

/// Negotiates with `max_xfer` and maps [BASE, BASE+SIZE) without an fd.
fn client(f: &Fix, max_xfer: u32) -> RawClient {
    let mut r = f.raw();
    r.negotiate_with(max_xfer);
    let map = DmaMap {
        argsz: 32,
        flags: DMA_READ | DMA_WRITE,
        offset: 0,
        addr: BASE,
        size: SIZE,
    };
    let rep = r.call(Command::DmaMap, map.as_bytes(), &[]);
    assert!(
        !rep.hdr.is_error(),
        "DMA_MAP without fd: errno {}",
        rep.hdr.error
    );
    r
}

/// Asks the device (posted BAR0 write) to move `len` bytes at `addr`.
fn trigger(r: &mut RawClient, addr: u64, len: u32, push: bool) {
    let mut p = RegionAccess {
        offset: 0x100,
        region: PCI_BAR0_REGION,
        count: 16,
    }
    .as_bytes()
    .to_vec();
    p.extend_from_slice(&addr.to_le_bytes());
    p.extend_from_slice(&len.to_le_bytes());
    p.extend_from_slice(&u32::from(push).to_le_bytes());
    r.send(Command::RegionWrite as u16, FLAG_NO_REPLY, &p, &[]);
}

/// Answers the layout probe (a zero-length DMA_WRITE) as `wire` does.
fn answer_probe(r: &mut RawClient, wire: DmaWire) {
    let p = r.recv().expect("probe");
    assert_eq!(p.hdr.cmd, Command::DmaWrite as u16);
    assert!(!p.hdr.is_reply());
    let (addr, count, _) = DmaWire::Spec.parse_request(&p.payload, true).unwrap();
    assert_eq!(count, 0, "the probe moves nothing");
    r.reply(&p, &wire.write_reply(addr, 0));
}

fn client_mem(addr: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((addr as usize + i) * 7 % 256) as u8)
        .collect()
}

/// Serves DMA requests correctly in layout `wire` until `n` were answered.
fn serve(r: &mut RawClient, wire: DmaWire, n: usize) -> Vec<(u16, u64, u32)> {
    let mut seen = Vec::new();
    while seen.len() < n {
        let m = r.recv().expect("request");
        let write = m.hdr.cmd == Command::DmaWrite as u16;
        let (addr, count, _) = wire.parse_request(&m.payload, write).unwrap();
        seen.push((m.hdr.cmd, addr, count));
        if write {
            r.reply(&m, &wire.write_reply(addr, count));
        } else {
            r.reply(
                &m,
                &wire.read_reply(addr, &client_mem(addr, count as usize)),
            );
        }
    }
    seen
}

fn wait_done(f: &Fix, n: usize) -> Vec<Done> {
    let done = || f.backend.done.lock().unwrap().clone();
    wait_until("the transfers", T, || done().len() >= n);
    done()
}

#[test]
fn both_layouts_are_probed_and_transfers_split_at_the_clients_limit() {
    for wire in [DmaWire::Spec, DmaWire::Qemu] {
        let f = fixture(Duration::from_secs(5));
        let mut r = client(&f, 4096);
        let addr = BASE + 0x123;
        trigger(&mut r, addr, 10_000, false);
        answer_probe(&mut r, wire);
        let seen = serve(&mut r, wire, 3);
        let counts: Vec<u32> = seen.iter().map(|s| s.2).collect();
        assert_eq!(counts, vec![4096, 4096, 1808], "{wire:?}");
        let done = wait_done(&f, 1);
        assert_eq!(done[0].0.as_ref().unwrap(), &client_mem(addr, 10_000));
        // A push goes out as DMA_WRITE with the data in the client's layout.
        trigger(&mut r, BASE, 5000, true);
        let m = r.recv().unwrap();
        assert_eq!(m.hdr.cmd, Command::DmaWrite as u16);
        let (a, c, data) = wire.parse_request(&m.payload, true).unwrap();
        assert_eq!((a, c), (BASE, 4096));
        assert_eq!(
            data,
            &(0..4096).map(|i| (i % 251) as u8).collect::<Vec<_>>()[..]
        );
        r.reply(&m, &wire.write_reply(a, c));
        serve(&mut r, wire, 1);
        assert!(wait_done(&f, 2)[1].0.is_ok());
    }
}

/// While a transfer waits for its reply, the client's own requests are read (by
/// the waiter) and served in order once the device is free again.
#[test]
fn the_clients_requests_are_served_while_a_transfer_waits() {
    let f = fixture(Duration::from_secs(5));
    let mut r = client(&f, 1 << 20);
    trigger(&mut r, BASE, 64, false);
    answer_probe(&mut r, DmaWire::Spec);
    let m = r.recv().expect("DMA_READ");
    assert_eq!(m.hdr.cmd, Command::DmaRead as u16);
    // Before answering: two requests of ours.
    let a = RegionAccess {
        offset: 0,
        region: PCI_CONFIG_REGION,
        count: 4,
    };
    let id1 = r.send(Command::RegionRead as u16, 0, a.as_bytes(), &[]);
    let id2 = r.send(
        Command::DeviceGetInfo as u16,
        0,
        DeviceInfo {
            argsz: 16,
            ..Default::default()
        }
        .as_bytes(),
        &[],
    );
    std::thread::sleep(Duration::from_millis(50));
    r.reply(&m, &DmaWire::Spec.read_reply(BASE, &client_mem(BASE, 64)));
    let r1 = r.recv().unwrap();
    let r2 = r.recv().unwrap();
    assert_eq!((r1.hdr.msg_id, r2.hdr.msg_id), (id1, id2), "in order");
    assert!(!r1.hdr.is_error() && !r2.hdr.is_error());
    assert!(wait_done(&f, 1)[0].0.is_ok());
}

/// No reply: the transfer fails after the timeout; the late reply is dropped; the
/// next transfer works.
#[test]
fn a_missing_reply_is_a_bounded_wait() {
    let f = fixture(Duration::from_millis(300));
    let mut r = client(&f, 1 << 20);
    trigger(&mut r, BASE, 64, false);
    answer_probe(&mut r, DmaWire::Spec);
    let m = r.recv().expect("DMA_READ");
    let done = wait_done(&f, 1);
    assert!(
        matches!(
            done[0].0,
            Err(MemError::Remote {
                source: RemoteError::Timeout,
                ..
            })
        ),
        "{:?}",
        done[0].0
    );
    // It waited for its own deadline (load only lengthens a wait), and that
    // deadline, not the default one, ended it.
    let waited = done[0].1;
    assert!(waited >= Duration::from_millis(250), "{waited:?}");
    assert!(waited < vfio_user::DEFAULT_DMA_REPLY_TIMEOUT, "{waited:?}");
    // Too late now, and harmless.
    r.reply(&m, &DmaWire::Spec.read_reply(BASE, &client_mem(BASE, 64)));
    trigger(&mut r, BASE + 64, 64, false);
    serve(&mut r, DmaWire::Spec, 1);
    assert!(wait_done(&f, 2)[1].0.is_ok());
}

/// Replies that do not fit their request fail the transfer, never the process.
#[test]
fn replies_that_do_not_fit_fail_the_transfer() {
    let f = fixture(Duration::from_secs(5));
    let mut r = client(&f, 1 << 20);
    let w = DmaWire::Spec;
    type Make = Box<dyn Fn(&RawReply) -> Vec<u8>>;
    let bad: Vec<Make> = vec![
        // Error reply.
        Box::new(|m| {
            Header::error_reply(&m.hdr, libc::EFAULT)
                .as_bytes()
                .to_vec()
        }),
        // One byte short.
        Box::new(move |m| {
            let mut p = w.read_reply(BASE, &[0; 64]);
            p.pop();
            let mut b = Header::reply_to(&m.hdr, p.len()).as_bytes().to_vec();
            b.extend_from_slice(&p);
            b
        }),
        // Another address.
        Box::new(move |m| {
            let p = w.read_reply(BASE + 8, &[0; 64]);
            let mut b = Header::reply_to(&m.hdr, p.len()).as_bytes().to_vec();
            b.extend_from_slice(&p);
            b
        }),
        // Another command's reply.
        Box::new(|m| {
            let mut h = Header::reply_to(&m.hdr, 0);
            h.cmd = Command::RegionRead as u16;
            h.as_bytes().to_vec()
        }),
    ];
    let mut n = 0;
    for (i, make) in bad.iter().enumerate() {
        trigger(&mut r, BASE, 64, false);
        if i == 0 {
            answer_probe(&mut r, w);
        }
        let m = r.recv().unwrap();
        r.send_raw(&make(&m), &[]);
        n += 1;
        let done = wait_done(&f, n);
        assert!(
            matches!(done[n - 1].0, Err(MemError::Remote { .. })),
            "case {i}: {:?}",
            done[n - 1].0
        );
    }
    // Replies to nothing, then a good transfer.
    for id in [0xfff0u16, 0xfff1] {
        let h = Header {
            msg_id: id,
            cmd: Command::DmaRead as u16,
            msg_size: HEADER_SIZE as u32,
            flags: FLAG_TYPE_REPLY,
            error: 0,
        };
        r.send_raw(h.as_bytes(), &[]);
    }
    trigger(&mut r, BASE, 64, false);
    serve(&mut r, w, 1);
    assert!(wait_done(&f, n + 1)[n].0.is_ok());
    assert!(f.server.as_ref().unwrap().dma_messages().unexpected_replies >= 2);
}

/// A device model that cannot work by messages refuses memory without an fd.
#[test]
fn a_model_without_dma_messages_refuses_memory_without_an_fd() {
    let f = Fixture::new();
    let mut r = f.raw();
    r.negotiate();
    let map = DmaMap {
        argsz: 32,
        flags: DMA_READ,
        offset: 0,
        addr: BASE,
        size: SIZE,
    };
    r.expect_err(Command::DmaMap as u16, map.as_bytes(), &[], libc::ENOTSUP);
}
