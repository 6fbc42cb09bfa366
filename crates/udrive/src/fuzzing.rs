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
/// header parses, the image opened read-only (L1 and refcount tables loaded) and
/// read through a channel (the inline engine, so that reads complete in the
/// call): the first clusters, the last, and a spread between, through L2 tables
/// and entries the input wrote. Any outcome but a panic or a hang is fine.
pub fn qcow2_image(data: &[u8]) {
    if bdev::parse_qcow2_header(data, data.len() as u64).is_err() {
        return;
    }
    let path = std::env::temp_dir().join(format!("udrive-fuzz-qcow2-{}", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let opts = bdev::Qcow2Options {
        read_only: true,
        engine: bdev::FileEngine::Inline,
        l2_cache: 64 << 10,
        ..Default::default()
    };
    let disk = bdev::Qcow2Disk::open(&path, opts);
    let _ = std::fs::remove_file(&path);
    let (Ok(disk), Ok(buf)) = (disk, guest_mem::MappedRegion::anonymous(0, 64 << 10)) else {
        return;
    };
    let Ok(mut ch) = bdev::BlockDevice::channel(&disk) else {
        return;
    };
    let size = bdev::BlockDevice::info(&disk).size_bytes();
    let Some(iov) = buf.slice(0, 4096) else {
        return;
    };
    let iov = [iov];
    for i in 0..16u64 {
        let offset = (size / 16 * i) & !4095;
        let req = bdev::IoRequest {
            op: bdev::IoOp::Read,
            offset: offset.min(size.saturating_sub(4096)),
            len: 4096.min(size),
            iov: &iov,
            fua: false,
        };
        if req.len == 4096 {
            let _ = ch.submit(i, &req);
        }
    }
}
