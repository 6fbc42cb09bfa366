//! Entry points for the coverage-guided fuzzer (`fuzz/`, cargo feature `fuzzing`).
//! Nothing here executes a control request (that would create sockets and open
//! files wherever the input says); the parsing and checking in front of it is
//! what a client controls.

use std::str::FromStr;

use crate::framing::{Framer, Push};

/// The control socket's byte stream: framing into messages (input split at the
/// byte `data[0]` says, as two reads), JSON parsing, and the checks of the
/// add-device parameters on every object found.
pub fn rpc_stream(data: &[u8]) {
    let Some((&cut, rest)) = data.split_first() else {
        return;
    };
    let cut = usize::from(cut).min(rest.len());
    let mut f = Framer::new(crate::rpc::MAX_MESSAGE);
    for chunk in [&rest[..cut], &rest[cut..]] {
        let mut at = 0;
        while at < chunk.len() {
            let (used, push) = f.push(&chunk[at..]);
            assert!(
                used > 0 && at + used <= chunk.len(),
                "framer makes progress"
            );
            at += used;
            match push {
                Push::Message(m) => params(&m),
                Push::More => {}
                Push::TooLarge | Push::Junk(_) => return,
            }
        }
    }
}

fn params(msg: &[u8]) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(msg) else {
        return;
    };
    let reqs = match v {
        serde_json::Value::Array(a) => a,
        v => vec![v],
    };
    for r in reqs {
        let p = r.get("params").cloned().unwrap_or(r);
        if let Ok(c) = serde_json::from_value::<crate::config::ControllerConfig>(p.clone()) {
            let _ = c.validate();
        }
        if let Ok(c) = serde_json::from_value::<crate::config::VhostBlkConfig>(p.clone()) {
            let _ = crate::config::validate(std::slice::from_ref(&c), &mut Default::default());
        }
        if let Ok(c) = serde_json::from_value::<crate::config::Config>(p) {
            let _ = c.validate();
        }
    }
}

/// A namespace / disk spec (`ram:1G,iops=5000,...`); one that parses prints back
/// to a spec that parses to the same thing.
pub fn ns_spec(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(spec) = crate::nsspec::NsSpec::from_str(s) {
        let again = crate::nsspec::NsSpec::from_str(&spec.to_string());
        assert!(again.is_ok(), "{spec} does not parse back");
    }
}

/// A qcow2 image made of input bytes: the header parser on them, then, when the
/// header parses, the image opened (L1 and refcount tables loaded), read through
/// a channel (the inline engine, so that requests complete in the call) at 16
/// places through L2 tables and entries the input wrote, then opened writable and
/// written at four of them (allocation, refcount blocks and tables the input
/// wrote), zeroed and flushed. Any outcome but a panic or a hang is fine.
pub fn qcow2_image(data: &[u8]) {
    if bdev::parse_qcow2_header(data, data.len() as u64).is_err() {
        return;
    }
    let path = std::env::temp_dir().join(format!("udrive-fuzz-qcow2-{}", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        for read_only in [true, false] {
            qcow2_requests(&path, read_only);
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// Reads (and unless `read_only`, writes, zeroes and a flush) on the image at
/// `path`.
fn qcow2_requests(path: &std::path::Path, read_only: bool) {
    use bdev::{BlockDevice, IoOp, IoRequest};
    let opts = bdev::Qcow2Options {
        read_only,
        engine: bdev::FileEngine::Inline,
        l2_cache: 64 << 10,
        ..Default::default()
    };
    let (Ok(disk), Ok(buf)) = (
        bdev::Qcow2Disk::open(path, opts),
        guest_mem::MappedRegion::anonymous(0, 4096),
    ) else {
        return;
    };
    let (Ok(mut ch), Some(iov)) = (disk.channel(), buf.slice(0, 4096)) else {
        return;
    };
    let iov = [iov];
    let size = disk.info().size_bytes();
    if size < 4096 {
        return;
    }
    let at = |i: u64| ((size / 16 * i) & !4095).min(size - 4096);
    let ops = if read_only {
        &[IoOp::Read][..]
    } else {
        &[IoOp::Write, IoOp::WriteZeroes, IoOp::Read][..]
    };
    for &op in ops {
        for i in (0..16u64).step_by(if read_only { 1 } else { 4 }) {
            let n = usize::from(op != IoOp::WriteZeroes);
            let req = IoRequest {
                op,
                offset: at(i),
                len: 4096,
                iov: &iov[..n],
                fua: false,
            };
            let _ = ch.submit(i, &req);
        }
    }
    if !read_only {
        let _ = ch.submit(99, &IoRequest::without_data(IoOp::Flush, 0, 0, false));
    }
}

/// An NBD client's byte stream into udrive's NBD server: the handshake's
/// options, then requests, against a 64 KiB writable export `x` in memory
/// (what the server sends back is dropped).
pub fn nbd_server(data: &[u8]) {
    struct Duplex<'a>(std::io::Cursor<&'a [u8]>);
    impl std::io::Read for Duplex<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(buf)
        }
    }
    impl std::io::Write for Duplex<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    struct Memory(Vec<u8>);
    impl Memory {
        fn range(&mut self, offset: u64, len: usize) -> std::io::Result<&mut [u8]> {
            let at = usize::try_from(offset).map_err(|_| std::io::ErrorKind::InvalidInput)?;
            let end = at
                .checked_add(len)
                .ok_or(std::io::ErrorKind::InvalidInput)?;
            // The server checks every range against the size before it calls.
            assert!(end <= self.0.len(), "request past the export's end");
            Ok(&mut self.0[at..end])
        }
    }
    impl nbd::Export for Memory {
        fn size(&self) -> u64 {
            self.0.len() as u64
        }
        fn read_only(&self) -> bool {
            false
        }
        fn read(&mut self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
            buf.copy_from_slice(self.range(offset, buf.len())?);
            Ok(())
        }
        fn write(&mut self, offset: u64, data: &[u8], _fua: bool) -> std::io::Result<()> {
            self.range(offset, data.len())?.copy_from_slice(data);
            Ok(())
        }
        fn write_zeroes(&mut self, offset: u64, len: u64, _may_trim: bool) -> std::io::Result<()> {
            let len = usize::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
            self.range(offset, len)?.fill(0);
            Ok(())
        }
        fn trim(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
            self.write_zeroes(offset, len, true)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        fn min_block(&self) -> u32 {
            512
        }
    }
    let names = || vec!["x".to_string()];
    let mut open = |name: &str| -> Result<Box<dyn nbd::Export>, String> {
        match name {
            "x" => Ok(Box::new(Memory(vec![0; 64 << 10]))),
            _ => Err(format!("no export named {name:?}")),
        }
    };
    let _ = nbd::serve(Duplex(std::io::Cursor::new(data)), &names, &mut open);
}
