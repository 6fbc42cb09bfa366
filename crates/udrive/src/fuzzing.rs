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
