use std::io;
use std::sync::Arc;

use guest_mem::MappedRegion;

use crate::{in_range, BlockDevice, BlockInfo, IoChannel, IoOp, IoRequest, IoStatus, Prefetch};

/// Data kept in anonymous memory (reserved lazily, so a big disk costs only what is
/// written). Volatile: gone when udrive exits.
///
/// The memory is one mapping per extent: the one made at creation, plus one for
/// each growth beyond what the mappings cover ([`BlockDevice::resize`]). Growing
/// maps only the new bytes, so the data stays where it is (no copy under I/O) and
/// every handle of the disk shares it.
pub struct RamDisk {
    info: BlockInfo,
    extents: Arc<[Extent]>,
    /// `hugepages=on`: extents added later are advised too.
    huge: bool,
}

/// Bytes `[start, start + mem.len())` of the disk. Extents are in disk order and
/// adjacent; the last may reach past the disk's size (after a shrink).
#[derive(Clone)]
struct Extent {
    start: u64,
    mem: Arc<MappedRegion>,
}

impl Extent {
    fn end(&self) -> u64 {
        self.start + self.mem.len()
    }
}

/// The extent holding disk byte `at`.
fn extent_at(extents: &[Extent], at: u64) -> Option<&Extent> {
    extents.iter().find(|e| e.start <= at && at < e.end())
}

pub(crate) fn sized_info(size: u64, block_size: u32) -> io::Result<BlockInfo> {
    if block_size != 512 && block_size != 4096 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("block size {block_size} is not 512 or 4096"),
        ));
    }
    if size == 0 || !size.is_multiple_of(u64::from(block_size)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("size {size} is not a non-zero multiple of the block size {block_size}"),
        ));
    }
    Ok(BlockInfo {
        block_size,
        num_blocks: size / u64::from(block_size),
        volatile: true,
        write_cache: false,
        read_only: false,
        discard: true,
        write_zeroes: true,
        discard_zeroes: true,
    })
}

impl RamDisk {
    pub fn new(size: u64, block_size: u32) -> io::Result<Self> {
        let info = sized_info(size, block_size)?;
        let mem = Arc::new(MappedRegion::anonymous(0, size)?);
        Ok(RamDisk {
            info,
            extents: Arc::new([Extent { start: 0, mem }]),
            huge: false,
        })
    }

    /// A RAM disk in transparent huge pages where the kernel has them (`hugepages=on`):
    /// random 4 KiB I/O on a large disk costs no page walk (with 4 KiB pages a 1 GiB
    /// disk misses the TLB on nearly every request). The price: memory is taken in
    /// 2 MiB extents, and the first write to each extent zeroes 2 MiB, possibly after
    /// compacting memory (milliseconds), see docs/decisions/0017-spdk-client.md.
    pub fn with_huge_pages(size: u64, block_size: u32) -> io::Result<Self> {
        let mut disk = RamDisk::new(size, block_size)?;
        disk.huge = true;
        for e in disk.extents.iter() {
            e.mem.advise_hugepages();
        }
        Ok(disk)
    }
}

impl BlockDevice for RamDisk {
    fn describe(&self) -> String {
        format!("ram:{}", self.info.size_bytes())
    }
    fn info(&self) -> &BlockInfo {
        &self.info
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        Ok(Box::new(RamChannel {
            extents: self.extents.clone(),
            size: self.info.size_bytes(),
            next_read: None,
            started: None,
        }))
    }
    /// Shrinking returns the memory past the new end (it reads back as zeroes if
    /// the disk grows again); growing maps only the bytes beyond the existing
    /// mappings. The data below the smaller of the two sizes is kept.
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        let info = self.info.resized(bytes)?;
        let size = self.info.size_bytes();
        let mut extents: Vec<Extent> = self
            .extents
            .iter()
            .filter(|e| e.start < bytes)
            .cloned()
            .collect();
        let Some(last) = extents.last().cloned() else {
            return Err(io::Error::other("a ram disk without memory"));
        };
        // Bytes of the last mapping that the new size leaves out (a shrink), or that
        // it shows again after an earlier shrink: zero pages either way.
        let (from, to) = if bytes < size {
            (bytes, last.end())
        } else {
            (size, bytes.min(last.end()))
        };
        if to > from {
            last.mem
                .discard(from - last.start, to - from)
                .ok_or_else(|| io::Error::other("ram disk extent out of range"))?;
        }
        if bytes > last.end() {
            let mem = MappedRegion::anonymous(0, bytes - last.end())?;
            if self.huge {
                mem.advise_hugepages();
            }
            extents.push(Extent {
                start: last.end(),
                mem: Arc::new(mem),
            });
        }
        Ok(Arc::new(RamDisk {
            info,
            extents: extents.into(),
            huge: self.huge,
        }))
    }
    /// Memory has no alignment: any block size, erased by discarding the pages.
    fn format_support(&self) -> crate::FormatSupport {
        crate::FormatSupport::Exclusive {
            min_block_size: 512,
        }
    }
}

struct RamChannel {
    extents: Arc<[Extent]>,
    /// The device's size (the mappings may reach past it after a shrink).
    size: u64,
    /// Disk bytes (offset, length) the next read will copy, hinted by
    /// [`Prefetch::AfterCurrent`]: loaded in halves while the current request is
    /// copied, not all at once before it (docs/decisions/0027-prefetch-next-copy.md).
    next_read: Option<(u64, u64)>,
    /// Disk offset of the read whose first lines [`Prefetch::Now`] requested: the
    /// rest of its first blocks are requested right before its copy.
    started: Option<u64>,
}

impl RamChannel {
    /// Calls `f(mapping, offset in it, offset in the range, length)` for each piece
    /// of `[off, off + len)` that one extent holds (one piece unless the disk grew
    /// and the range straddles two mappings). `false` if a piece is missing or `f`
    /// refused it.
    fn pieces(
        &self,
        off: u64,
        len: u64,
        mut f: impl FnMut(&MappedRegion, u64, u64, u64) -> bool,
    ) -> bool {
        let mut done = 0u64;
        while done < len {
            let at = off + done;
            let Some(e) = extent_at(&self.extents, at) else {
                return false;
            };
            let n = (len - done).min(e.end() - at);
            if !f(&e.mem, at - e.start, done, n) {
                return false;
            }
            done += n;
        }
        true
    }

    /// Copies the request's bytes; with a hint of the next read, the hint's first
    /// half is loaded while the first half of these bytes is copied and its second
    /// half during the rest. A burst of prefetches for a whole block fills the
    /// core's queue of outstanding loads, and every load after it (the poller's
    /// own bookkeeping between two copies) waits until the block has arrived:
    /// spread over the copy, the block arrives while the copy runs.
    ///
    /// A read whose first lines were requested when it was decoded (`started`)
    /// gets the rest of its first blocks requested just before its copy: by then
    /// the page walk those lines started has filled the TLB, so the burst goes to
    /// DRAM at once, and the copy finds many lines on their way instead of the
    /// few its own loads and the hardware prefetcher keep in flight (4 KiB from
    /// DRAM about 20 % faster, measured: docs/decisions/0027-prefetch-next-copy.md,
    /// stop 33). Issued earlier, the burst waits for the walk and stalls the
    /// poller's own loads behind it (stop 32).
    fn transfer(&self, req: &IoRequest<'_>, hint: Option<(u64, u64)>, started: bool) -> IoStatus {
        // Checked before copying: buffers longer than `len` must not reach past the range.
        let total: u64 = req.iov.iter().map(|b| b.len() as u64).sum();
        if total != req.len {
            return IoStatus::Invalid;
        }
        if started && req.op == IoOp::Read {
            let rest = req.len.min(PREFETCH_MAX as u64);
            self.prefetch_disk(
                req.offset + PREFETCH_NOW as u64,
                rest.saturating_sub(PREFETCH_NOW as u64),
            );
        }
        let Some((at, len)) = hint else {
            return self.copy(req, 0, req.len);
        };
        let (half, mid) = (len / 2, req.len / 2);
        self.prefetch_disk(at, half);
        match self.copy(req, 0, mid) {
            IoStatus::Ok => {}
            st => return st,
        }
        self.prefetch_disk(at + half, len - half);
        self.copy(req, mid, req.len)
    }

    /// Copies bytes `[from, to)` of the request between its buffers and the disk.
    fn copy(&self, req: &IoRequest<'_>, from: u64, to: u64) -> IoStatus {
        let mut pos = 0u64;
        for buf in req.iov {
            let end = pos + buf.len() as u64;
            let (a, b) = (pos.max(from), end.min(to));
            if a < b {
                let st = self.copy_buf(req, buf, a - pos, req.offset + a, b - a);
                if st != IoStatus::Ok {
                    return st;
                }
            }
            pos = end;
            if pos >= to {
                break;
            }
        }
        IoStatus::Ok
    }

    /// Copies `len` bytes at `skip` in `buf` to or from disk offset `off`.
    fn copy_buf(
        &self,
        req: &IoRequest<'_>,
        buf: &guest_mem::DmaSlice<'_>,
        skip: u64,
        off: u64,
        len: u64,
    ) -> IoStatus {
        let mut bad = IoStatus::OutOfRange;
        let copied = self.pieces(off, len, |mem, at, from, n| {
            let (Ok(from), Ok(n)) = (usize::try_from(skip + from), usize::try_from(n)) else {
                return false;
            };
            let Some(disk) = mem.slice(at, n) else {
                return false;
            };
            bad = IoStatus::Invalid;
            let Some(part) = buf.sub(from, n) else {
                return false;
            };
            match req.op {
                IoOp::Read => disk.copy_to(&part),
                _ => part.copy_to(&disk),
            }
            .is_ok()
        });
        if copied {
            IoStatus::Ok
        } else {
            bad
        }
    }

    /// Starts loading disk bytes `[off, off + len)` into the outer caches.
    fn prefetch_disk(&self, off: u64, len: u64) {
        self.pieces(off, len, |mem, at, _, n| {
            let Ok(n) = usize::try_from(n) else {
                return false;
            };
            if let Some(disk) = mem.slice(at, n) {
                disk.prefetch(n);
            }
            true
        });
    }
}

/// Bytes of a request that [`IoChannel::prefetch`] loads ahead: two 4 KiB blocks.
/// Copying one 4 KiB block takes about as long as loading one from DRAM, so more
/// would arrive after the copy that wants them, and evict what it needs.
const PREFETCH_MAX: usize = 8192;

/// Bytes of a request submitted next ([`Prefetch::Now`]) loaded ahead: two cache
/// lines start the page walk and the DRAM access, and the copy streams the rest
/// (measured against none, one, four and 64 lines: docs/decisions/
/// 0027-prefetch-next-copy.md, stop 32).
const PREFETCH_NOW: usize = 128;

impl IoChannel for RamChannel {
    /// Starts loading what the copy of `req` will read: the disk's bytes for a read,
    /// the client's buffers for a write. A read that follows the current copy is
    /// loaded during it ([`RamChannel::transfer`]).
    fn prefetch(&mut self, req: &IoRequest<'_>, when: Prefetch) {
        let max = match when {
            Prefetch::Now => PREFETCH_NOW,
            Prefetch::Soon | Prefetch::AfterCurrent => PREFETCH_MAX,
        };
        match req.op {
            IoOp::Read if in_range(req.offset, req.len, self.size) => {
                let len = req.len.min(max as u64);
                match when {
                    Prefetch::AfterCurrent => self.next_read = Some((req.offset, len)),
                    Prefetch::Now => {
                        self.started = Some(req.offset);
                        self.prefetch_disk(req.offset, len);
                    }
                    Prefetch::Soon => self.prefetch_disk(req.offset, len),
                }
            }
            IoOp::Write => {
                let mut left = max;
                for buf in req.iov {
                    buf.prefetch(left);
                    left = left.saturating_sub(buf.len());
                    if left == 0 {
                        break;
                    }
                }
            }
            _ => {}
        }
    }

    fn submit(&mut self, _tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        // A hint is for the request after this one; a left-over one (the next
        // command went to another channel) is this request's own or stale: dropped.
        let hint = self.next_read.take().filter(|&(at, _)| at != req.offset);
        let started = self.started.take() == Some(req.offset);
        if req.op != IoOp::Flush && !in_range(req.offset, req.len, self.size) {
            return Some(IoStatus::OutOfRange);
        }
        Some(match req.op {
            IoOp::Read | IoOp::Write => self.transfer(req, hint, started),
            IoOp::Flush => IoStatus::Ok,
            IoOp::WriteZeroes | IoOp::Discard => {
                if self.pieces(req.offset, req.len, |mem, at, _, n| {
                    mem.discard(at, n).is_some()
                }) {
                    IoStatus::Ok
                } else {
                    IoStatus::OutOfRange
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_mem::SharedMem;

    #[test]
    fn write_read_discard() {
        let d = RamDisk::new(1 << 20, 512).unwrap();
        let mut ch = d.channel().unwrap();
        let buf = SharedMem::new("b", 8192).unwrap();
        let s = buf.all();
        s.write_from(0, &[7u8; 8192]).unwrap();
        let iov = [s.sub(0, 4096).unwrap(), s.sub(4096, 4096).unwrap()];
        let w = IoRequest {
            op: IoOp::Write,
            offset: 4096 * 3,
            len: 8192,
            iov: &iov,
            fua: false,
        };
        assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
        s.fill(0);
        let r = IoRequest {
            op: IoOp::Read,
            ..w
        };
        assert_eq!(ch.submit(2, &r), Some(IoStatus::Ok));
        let mut b = vec![0u8; 8192];
        s.read_into(0, &mut b).unwrap();
        assert!(b.iter().all(|x| *x == 7));
        let z = IoRequest {
            op: IoOp::Discard,
            offset: 4096 * 3 + 512,
            len: 4096,
            iov: &[],
            fua: false,
        };
        assert_eq!(ch.submit(3, &z), Some(IoStatus::Ok));
        assert_eq!(ch.submit(4, &r), Some(IoStatus::Ok));
        s.read_into(0, &mut b).unwrap();
        assert!(b[..512].iter().all(|x| *x == 7));
        assert!(b[512..4608].iter().all(|x| *x == 0));
        assert!(b[4608..].iter().all(|x| *x == 7));
        let oob = IoRequest {
            offset: (1 << 20) - 4096,
            ..r
        };
        assert_eq!(ch.submit(5, &oob), Some(IoStatus::OutOfRange));
        let wrap = IoRequest {
            offset: u64::MAX - 10,
            ..r
        };
        assert_eq!(ch.submit(6, &wrap), Some(IoStatus::OutOfRange));
    }

    /// `prefetch` gets requests before anything checked them: past the end, wrapping,
    /// empty, longer buffers than `len`, other ops; none may fault or change data.
    #[test]
    fn prefetch_takes_any_request_and_moves_no_data() {
        let d = RamDisk::new(1 << 20, 512).unwrap();
        let mut ch = d.channel().unwrap();
        let buf = SharedMem::new("p", 16384).unwrap();
        let s = buf.all();
        s.fill(3);
        let iov = [s.sub(0, 4096).unwrap(), s.sub(4096, 12288).unwrap()];
        let w = IoRequest {
            op: IoOp::Write,
            offset: 0,
            len: 16384,
            iov: &iov,
            fua: false,
        };
        assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
        s.fill(0);
        for (op, offset, len) in [
            (IoOp::Read, (1 << 20) - 4096, 8192),
            (IoOp::Read, u64::MAX - 10, 4096),
            (IoOp::Read, 1 << 40, 4096),
            (IoOp::Read, 0, 0),
            (IoOp::Read, 0, 1 << 20),
            (IoOp::Write, 1 << 40, 4096),
            (IoOp::Write, 0, 1),
            (IoOp::Flush, 0, 0),
            (IoOp::Discard, 0, 1 << 20),
            (IoOp::WriteZeroes, u64::MAX, u64::MAX),
        ] {
            for when in [Prefetch::Now, Prefetch::Soon, Prefetch::AfterCurrent] {
                for iov in [&iov[..], &[]] {
                    ch.prefetch(
                        &IoRequest {
                            op,
                            offset,
                            len,
                            iov,
                            fua: false,
                        },
                        when,
                    );
                }
            }
        }
        let mut b = vec![1u8; 16384];
        s.read_into(0, &mut b).unwrap();
        assert!(
            b.iter().all(|x| *x == 0),
            "prefetch wrote the client's buffer"
        );
        let r = IoRequest {
            op: IoOp::Read,
            ..w
        };
        assert_eq!(ch.submit(2, &r), Some(IoStatus::Ok));
        s.read_into(0, &mut b).unwrap();
        assert!(b.iter().all(|x| *x == 3), "prefetch changed the disk");
    }

    /// With a hint of the next read pending, a copy runs in two halves around the
    /// hint's loads: every split of the buffers (the midpoint inside a buffer, on a
    /// boundary, across two mappings of a grown disk) must still move the right
    /// bytes, and hints that are stale, out of range or the request's own change
    /// nothing.
    #[test]
    fn copies_split_around_a_pending_hint_move_the_right_bytes() {
        const MIB: u64 = 1 << 20;
        let small = RamDisk::new(MIB, 512).unwrap();
        let d = small.resize(2 * MIB).unwrap();
        let mut ch = d.channel().unwrap();
        let buf = SharedMem::new("split", 3 * 8192).unwrap();
        let s = buf.all();
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
        let hint = |ch: &mut Box<dyn IoChannel>, offset: u64| {
            ch.prefetch(
                &IoRequest {
                    op: IoOp::Read,
                    offset,
                    len: 4096,
                    iov: &[],
                    fua: false,
                },
                Prefetch::AfterCurrent,
            )
        };
        // (disk offset, buffer lengths): one buffer; the midpoint inside the second
        // of three; on the boundary of two; odd lengths; across the first mapping's end.
        let cases: [(u64, &[usize]); 5] = [
            (0, &[8192]),
            (8192, &[1000, 6000, 1192]),
            (65536, &[4096, 4096]),
            (4096 * 7, &[1, 4095, 3, 4093]),
            (MIB - 4096, &[512, 7680]),
        ];
        for (round, (offset, lens)) in cases.into_iter().enumerate() {
            // Buffers spread out in client memory, with gaps between them.
            let mut at = 0;
            let iov: Vec<_> = lens
                .iter()
                .map(|&n| {
                    let b = s.sub(at, n).unwrap();
                    at += n + 64;
                    b
                })
                .collect();
            let write_data: Vec<u8> = data.iter().map(|b| b ^ round as u8).collect();
            let mut pos = 0;
            for b in &iov {
                b.write_from(0, &write_data[pos..pos + b.len()]).unwrap();
                pos += b.len();
            }
            let req = |op| IoRequest {
                op,
                offset,
                len: 8192,
                iov: &iov,
                fua: false,
            };
            // The hint points elsewhere (and once out of range, once at itself).
            match round {
                1 => hint(&mut ch, u64::MAX - 100),
                2 => hint(&mut ch, offset),
                _ => hint(&mut ch, (offset + 3 * 4096) % MIB),
            }
            assert_eq!(ch.submit(1, &req(IoOp::Write)), Some(IoStatus::Ok));
            for b in &iov {
                b.fill(0);
            }
            hint(&mut ch, (offset + 4096) % MIB);
            assert_eq!(ch.submit(2, &req(IoOp::Read)), Some(IoStatus::Ok));
            let mut got = Vec::new();
            for b in &iov {
                let mut v = vec![0u8; b.len()];
                b.read_into(0, &mut v).unwrap();
                got.extend(v);
            }
            assert_eq!(got, write_data, "case {round}: read back through the split");
            assert_eq!(read(&*d, offset, 8192), (IoStatus::Ok, write_data));
        }
        // A bad request with a hint pending fails as without one.
        hint(&mut ch, 0);
        let short = [s.sub(0, 100).unwrap()];
        let bad = IoRequest {
            op: IoOp::Read,
            offset: 0,
            len: 512,
            iov: &short,
            fua: false,
        };
        assert_eq!(ch.submit(3, &bad), Some(IoStatus::Invalid));
    }

    /// A read whose first lines [`Prefetch::Now`] requested gets the rest of its
    /// first blocks requested before its copy: shorter than those lines, longer
    /// than the rest's cap, at the device's end, across two mappings of a grown
    /// disk, or after a `Now` for another offset, it moves exactly its own bytes.
    #[test]
    fn reads_started_now_move_their_own_bytes() {
        const MIB: u64 = 1 << 20;
        let d = RamDisk::new(MIB, 512).unwrap().resize(2 * MIB).unwrap();
        let pattern: Vec<u8> = (0..2 * MIB as u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(write(&*d, 0, &pattern), IoStatus::Ok);
        let mut ch = d.channel().unwrap();
        let buf = SharedMem::new("now", 3 * 8192).unwrap();
        let s = buf.all();
        // (offset the hint names, offset and length read)
        let cases = [
            (0, 0, 64),
            (4096, 4096, 4096),
            (8192, 8192, 3 * 8192),
            (2 * MIB - 512, 2 * MIB - 512, 512),
            (MIB - 4096, MIB - 4096, 8192),
            (12288, 16384, 4096),
            (u64::MAX - 100, 0, 4096),
        ];
        for (hinted, offset, len) in cases {
            s.fill(0);
            let iov = [s.sub(0, len).unwrap()];
            let req = |offset| IoRequest {
                op: IoOp::Read,
                offset,
                len: len as u64,
                iov: &iov,
                fua: false,
            };
            ch.prefetch(&req(hinted), Prefetch::Now);
            assert_eq!(ch.submit(1, &req(offset)), Some(IoStatus::Ok));
            let mut got = vec![0u8; len];
            s.read_into(0, &mut got).unwrap();
            let at = offset as usize;
            assert_eq!(got, pattern[at..at + len], "read of {len} at {offset}");
            let mut rest = vec![1u8; 3 * 8192 - len];
            s.read_into(len, &mut rest).unwrap();
            assert!(rest.iter().all(|b| *b == 0), "wrote past the buffer");
        }
    }

    #[test]
    fn huge_pages_disk_reads_back() {
        let d = RamDisk::with_huge_pages(4 << 20, 512).unwrap();
        let mut ch = d.channel().unwrap();
        let buf = SharedMem::new("h", 4096).unwrap();
        let s = buf.all();
        s.fill(9);
        let iov = [s.sub(0, 4096).unwrap()];
        let w = IoRequest {
            op: IoOp::Write,
            offset: (2 << 20) - 2048,
            len: 4096,
            iov: &iov,
            fua: false,
        };
        assert_eq!(ch.submit(1, &w), Some(IoStatus::Ok));
        s.fill(0);
        let r = IoRequest {
            op: IoOp::Read,
            ..w
        };
        assert_eq!(ch.submit(2, &r), Some(IoStatus::Ok));
        let mut b = vec![0u8; 4096];
        s.read_into(0, &mut b).unwrap();
        assert!(b.iter().all(|x| *x == 9));
    }

    /// Reads `len` bytes at `off` through a fresh channel of `d`.
    fn read(d: &dyn BlockDevice, off: u64, len: usize) -> (IoStatus, Vec<u8>) {
        let buf = SharedMem::new("r", len as u64).unwrap();
        let iov = [buf.all().sub(0, len).unwrap()];
        let r = IoRequest {
            op: IoOp::Read,
            offset: off,
            len: len as u64,
            iov: &iov,
            fua: false,
        };
        let st = d.channel().unwrap().submit(1, &r).unwrap();
        let mut b = vec![0u8; len];
        buf.all().read_into(0, &mut b).unwrap();
        (st, b)
    }

    fn write(d: &dyn BlockDevice, off: u64, data: &[u8]) -> IoStatus {
        let buf = SharedMem::new("w", data.len() as u64).unwrap();
        buf.all().write_from(0, data).unwrap();
        let iov = [buf.all().sub(0, data.len()).unwrap()];
        let w = IoRequest {
            op: IoOp::Write,
            offset: off,
            len: data.len() as u64,
            iov: &iov,
            fua: false,
        };
        d.channel().unwrap().submit(1, &w).unwrap()
    }

    #[test]
    fn grows_beyond_its_first_mapping_and_keeps_the_data() {
        const MIB: u64 = 1 << 20;
        let d = RamDisk::new(MIB, 512).unwrap();
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(write(&d, MIB - 4096, &pattern[..4096]), IoStatus::Ok);
        let big = d.resize(3 * MIB).unwrap();
        assert_eq!(big.info().size_bytes(), 3 * MIB);
        assert_eq!(
            read(&*big, MIB - 4096, 4096),
            (IoStatus::Ok, pattern[..4096].to_vec())
        );
        // New space reads as zeroes; a request across the old end spans two mappings.
        assert_eq!(read(&*big, MIB, 4096), (IoStatus::Ok, vec![0; 4096]));
        assert_eq!(write(&*big, MIB - 2048, &pattern), IoStatus::Ok);
        assert_eq!(
            read(&*big, MIB - 2048, 8192),
            (IoStatus::Ok, pattern.clone())
        );
        let zero = IoRequest::without_data(IoOp::WriteZeroes, MIB - 1024, 2048, false);
        assert_eq!(big.channel().unwrap().submit(2, &zero), Some(IoStatus::Ok));
        let (_, b) = read(&*big, MIB - 2048, 8192);
        assert_eq!(&b[..1024], &pattern[..1024]);
        assert!(b[1024..3072].iter().all(|x| *x == 0));
        assert_eq!(&b[3072..], &pattern[3072..]);
        // The old handle still ends where it did.
        assert_eq!(read(&d, MIB, 512).0, IoStatus::OutOfRange);
        // Twice more: a third mapping.
        let bigger = big.resize(5 * MIB).unwrap();
        assert_eq!(
            write(&*bigger, 3 * MIB - 512, &pattern[..1024]),
            IoStatus::Ok
        );
        assert_eq!(
            read(&*bigger, 3 * MIB - 512, 1024),
            (IoStatus::Ok, pattern[..1024].to_vec())
        );
        assert_eq!(read(&*bigger, 5 * MIB - 512, 1024).0, IoStatus::OutOfRange);
    }

    #[test]
    fn a_shrink_drops_the_tail_and_growing_again_shows_zeroes() {
        const MIB: u64 = 1 << 20;
        let d = RamDisk::new(4 * MIB, 512).unwrap();
        assert_eq!(write(&d, 2 * MIB, &[7u8; 4096]), IoStatus::Ok);
        assert_eq!(write(&d, MIB - 4096, &[5u8; 4096]), IoStatus::Ok);
        let small = d.resize(MIB).unwrap();
        assert_eq!(
            read(&*small, MIB - 4096, 4096),
            (IoStatus::Ok, vec![5; 4096])
        );
        assert_eq!(read(&*small, MIB, 512).0, IoStatus::OutOfRange);
        let again = small.resize(6 * MIB).unwrap();
        assert_eq!(read(&*again, 2 * MIB, 4096), (IoStatus::Ok, vec![0; 4096]));
        assert_eq!(
            read(&*again, MIB - 4096, 4096),
            (IoStatus::Ok, vec![5; 4096])
        );
        assert_eq!(write(&*again, 6 * MIB - 4096, &[3u8; 4096]), IoStatus::Ok);
        assert_eq!(
            read(&*again, 6 * MIB - 4096, 4096),
            (IoStatus::Ok, vec![3; 4096])
        );
        // A shrink below the second mapping drops it from the new handle.
        let tiny = again.resize(512).unwrap();
        assert_eq!(tiny.info().num_blocks, 1);
        assert_eq!(read(&*tiny, 0, 512), (IoStatus::Ok, vec![0; 512]));
        let huge = RamDisk::with_huge_pages(2 * MIB, 4096).unwrap();
        assert_eq!(huge.resize(8 * MIB).unwrap().info().num_blocks, 2048);
    }

    #[test]
    fn bad_sizes_refused() {
        assert!(RamDisk::new(0, 512).is_err());
        assert!(RamDisk::new(1000, 512).is_err());
        assert!(RamDisk::new(4096, 1024).is_err());
    }
}
