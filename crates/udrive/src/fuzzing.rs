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
