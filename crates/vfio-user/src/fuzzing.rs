//! Entry point for the coverage-guided fuzzer (`fuzz/`, cargo feature `fuzzing`):
//! a whole client session against the real connection state machine and device
//! model, with a fake PCI function behind it.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use guest_mem::{DmaSpace, SharedMem};

use crate::conn::{Conn, Flow};
use crate::device::{BarSpec, Device, MsixSpec, PciBackend, PciDeviceSpec};
use crate::irqs::Irqs;
use crate::pci::ConfigSpace;
use crate::pci::PciIds;
use crate::proto::SparseArea;

#[derive(Default)]
struct Regs(Mutex<Vec<u8>>);

impl PciBackend for Regs {
    fn bar_read(&self, _bar: u32, offset: u64, data: &mut [u8]) {
        let r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for (i, b) in data.iter_mut().enumerate() {
            *b = r.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn bar_write(&self, _bar: u32, offset: u64, data: &[u8]) {
        let mut r = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for (i, b) in data.iter().enumerate() {
            if let Some(x) = r.get_mut(offset as usize + i) {
                *x = *b;
            }
        }
    }
    fn reset(&self) {}
    fn client_gone(&self) {}
}

/// Feeds `data` to a fresh device as one client's byte stream. `data` is a series
/// of records `[flags][len lo][len hi][bytes]`: each record is one `sendmsg`, with
/// a 64 KiB memfd attached when `flags & 1` (so DMA_MAP and SET_IRQS see fds), and
/// the stream ends early (an abrupt close) when `flags & 2`.
pub fn session(data: &[u8]) {
    let Ok(bar_mem) = SharedMem::new("fuzz-bar0", 0x4000) else {
        return;
    };
    let Ok(extra) = SharedMem::new("fuzz-dma", 64 << 10) else {
        return;
    };
    let Ok(bar_fd) = bar_mem.fd().try_clone_to_owned() else {
        return;
    };
    let spec = PciDeviceSpec {
        ids: PciIds {
            vendor: 0x1b36,
            device: 0x0010,
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
            class_code: 0x010802,
            revision: 2,
        },
        bar0: BarSpec {
            size: 0x4000,
            mmap_fd: Some(bar_fd),
            fd_offset: 0,
            sparse: vec![SparseArea {
                offset: 0x1000,
                size: 0x1000,
            }],
        },
        msix: MsixSpec {
            vectors: 4,
            table_bar: 0,
            table_offset: 0x2000,
            pba_bar: 0,
            pba_offset: 0x3000,
        },
    };
    let irqs = Irqs::new(spec.msix.vectors);
    let Ok(mem) = DmaSpace::try_new() else { return };
    let mut dev = Device {
        config: ConfigSpace::new(&spec.ids, spec.bar0.size, &spec.msix),
        spec,
        backend: Arc::new(Regs(Mutex::new(vec![0; 0x1000]))),
        irqs,
        mem,
        log: trace::LogLimiter::new(),
    };
    let Ok((client, server)) = UnixStream::pair() else {
        return;
    };
    // Replies are drained by a thread so the server never blocks on a full socket.
    let Ok(reader) = client.try_clone() else {
        return;
    };
    let drain = std::thread::spawn(move || {
        let mut r = reader;
        let _ = std::io::copy(&mut r, &mut std::io::sink());
    });
    let policy = crate::conn::DmaPolicy {
        reply_timeout: std::time::Duration::from_millis(100),
        stats: Default::default(),
    };
    let mut conn = Conn::new(server, policy, None);
    // The whole stream is written first (it fits the socket buffer), then the
    // server reads it to the end: no message waits on the deadline for bytes that
    // are still to come.
    let mut rest = &data[..data.len().min(64 << 10)];
    while let [flags, lo, hi, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*lo, *hi])).min(tail.len());
        let (bytes, next) = tail.split_at(len);
        rest = next;
        let fds = if flags & 1 != 0 {
            vec![extra.fd()]
        } else {
            Vec::new()
        };
        if !bytes.is_empty() && lifecycle::fdpass::send(client.as_fd(), &[bytes], &fds).is_err() {
            break;
        }
        if flags & 2 != 0 {
            break;
        }
    }
    let _ = client.shutdown(std::net::Shutdown::Write);
    while let Flow::Continue = conn.handle_next(&mut dev) {}
    drop(conn);
    dev.client_gone();
    let _ = client.shutdown(std::net::Shutdown::Both);
    let _ = drain.join();
}
