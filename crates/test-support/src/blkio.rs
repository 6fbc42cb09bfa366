//! A libblkio (`virtio-blk-vhost-user`) session: an independent vhost-user-blk
//! client to test devices with.
//!
//! libblkio is a complete front end of its own (negotiation, memory table, rings,
//! kicks, interrupts); this wraps one queue of it and one buffer region for
//! requests a test issues one at a time or in small batches. It does nothing
//! hostile: for that, use [`crate::vhost_fe`].

use std::mem::MaybeUninit;
use std::path::Path;
use std::time::Duration;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

/// Bytes of the buffer region of [`BlkioSession::open`].
pub const SESSION_BUF: usize = 64 << 10;

/// One connected libblkio instance with one queue and one buffer region.
pub struct BlkioSession {
    pub q: Blkioq,
    pub region: MemoryRegion,
    pub b: Blkio,
    comps: Vec<MaybeUninit<Completion>>,
}

impl BlkioSession {
    /// A read-write session with a [`SESSION_BUF`] buffer.
    pub fn open(sock: &Path) -> Result<BlkioSession, String> {
        Self::open_with(sock, false, SESSION_BUF)
    }

    /// A session (`read_only` asks libblkio for a read-only one) with a buffer of
    /// `buf_bytes`.
    pub fn open_with(
        sock: &Path,
        read_only: bool,
        buf_bytes: usize,
    ) -> Result<BlkioSession, String> {
        let e = |e: blkio::Error| format!("libblkio on {}: {e}", sock.display());
        let mut b = Blkio::new("virtio-blk-vhost-user").map_err(e)?;
        let path = sock.to_str().ok_or("socket path is not UTF-8")?;
        b.set_str("path", path).map_err(e)?;
        b.set_bool("read-only", read_only).map_err(e)?;
        b.connect().map_err(e)?;
        b.set_i32("num-queues", 1).map_err(e)?;
        let mut s = b.start().map_err(e)?;
        let region = b.alloc_mem_region(buf_bytes).map_err(e)?;
        b.map_mem_region(&region).map_err(e)?;
        Ok(BlkioSession {
            q: s.queues.remove(0),
            region,
            b,
            comps: (0..8).map(|_| MaybeUninit::uninit()).collect(),
        })
    }

    /// The start of the buffer region (libblkio wants raw pointers).
    pub fn buf(&self) -> *mut u8 {
        self.region.addr as *mut u8
    }

    /// Sets the first `len` bytes of the buffer to `byte`.
    pub fn fill(&self, byte: u8, len: usize) {
        assert!(len <= self.region.len);
        // SAFETY: the region is mapped read/write for the session's lifetime and no
        // request is in flight when a test fills it.
        unsafe { std::ptr::write_bytes(self.buf(), byte, len) };
    }

    /// A copy of the first `len` bytes of the buffer.
    pub fn bytes(&self, len: usize) -> Vec<u8> {
        assert!(len <= self.region.len);
        let mut v = vec![0u8; len];
        // SAFETY: as in `fill`.
        unsafe { std::ptr::copy_nonoverlapping(self.buf(), v.as_mut_ptr(), len) };
        v
    }

    /// Waits for the one outstanding request; its `ret` (0 or -errno), or why none
    /// came.
    pub fn try_wait(&mut self) -> Result<i32, String> {
        let mut t = Duration::from_secs(10);
        let n = self
            .q
            .do_io(&mut self.comps[..1], 1, Some(&mut t), None)
            .map_err(|e| format!("libblkio do_io: {e}"))?;
        if n != 1 {
            return Err("libblkio: the request did not complete".into());
        }
        // SAFETY: do_io initialised one completion.
        Ok(unsafe { self.comps[0].assume_init_ref() }.ret)
    }

    /// As [`try_wait`](Self::try_wait), failing the test if nothing completes.
    pub fn wait(&mut self) -> i32 {
        self.try_wait().expect("completion")
    }

    /// Reads `len` bytes at `off` into the buffer; the request's `ret`.
    pub fn read(&mut self, off: u64, len: usize) -> i32 {
        self.q.read(off, self.buf(), len, 1, ReqFlags::empty());
        self.wait()
    }

    /// Writes the buffer's first `len` bytes at `off`; the request's `ret`.
    pub fn write(&mut self, off: u64, len: usize) -> i32 {
        self.q.write(off, self.buf(), len, 1, ReqFlags::empty());
        self.wait()
    }

    /// Writes 4 KiB of `byte` at `off`, reads it back and compares.
    pub fn round(&mut self, off: u64, byte: u8) -> Result<(), String> {
        self.fill(byte, 4096);
        self.q.write(off, self.buf(), 4096, 1, ReqFlags::empty());
        match self.try_wait()? {
            0 => {}
            r => return Err(format!("libblkio write at {off} failed: {r}")),
        }
        self.fill(0, 4096);
        self.q.read(off, self.buf(), 4096, 1, ReqFlags::empty());
        match self.try_wait()? {
            0 => {}
            r => return Err(format!("libblkio read at {off} failed: {r}")),
        }
        if !self.bytes(4096).iter().all(|x| *x == byte) {
            return Err(format!("libblkio: data mismatch at {off}"));
        }
        Ok(())
    }

    /// Submits `(write, offset, len)` requests at once (each with its own 8 KiB of
    /// the buffer) and returns their `ret`s in order.
    pub fn batch(&mut self, reqs: &[(bool, u64, usize)]) -> Vec<i32> {
        assert!(reqs.len() <= 8 && reqs.iter().all(|r| r.2 <= 8192));
        assert!(reqs.len() * 8192 <= self.region.len);
        for (i, &(write, off, len)) in reqs.iter().enumerate() {
            // SAFETY: i * 8 KiB + len stays inside the region (asserted above).
            let buf = unsafe { self.buf().add(i * 8192) };
            if write {
                self.q.write(off, buf, len, i, ReqFlags::empty());
            } else {
                self.q.read(off, buf, len, i, ReqFlags::empty());
            }
        }
        let mut rets = vec![None; reqs.len()];
        let mut left = reqs.len();
        while left > 0 {
            let mut t = Duration::from_secs(10);
            let n = self
                .q
                .do_io(&mut self.comps[..left], 1, Some(&mut t), None)
                .expect("do_io");
            assert!(n > 0, "requests did not complete");
            for c in &self.comps[..n] {
                // SAFETY: do_io initialised the first n completions.
                let c = unsafe { c.assume_init_ref() };
                rets[c.user_data] = Some(c.ret);
            }
            left -= n;
        }
        rets.into_iter()
            .map(|r| r.expect("completed once"))
            .collect()
    }
}

impl Drop for BlkioSession {
    fn drop(&mut self) {
        self.b.unmap_mem_region(&self.region);
        self.b.free_mem_region(&self.region);
    }
}

/// One verified write/read round with a new libblkio session on `sock`.
pub fn blkio_round(sock: &Path, byte: u8) {
    BlkioSession::open(sock)
        .and_then(|mut c| c.round(0, byte))
        .expect("libblkio round");
}
