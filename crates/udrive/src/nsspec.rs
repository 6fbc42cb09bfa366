//! Namespace specs, on the command line (`--ns`) and in the TOML config:
//!
//! * `null:SIZE` — completes at once, no data (software-path measurements)
//! * `ram:SIZE` — data in memory, gone when udrive exits
//! * `file:PATH` — a file or block device through io_uring
//!
//! followed by options: `bs=512|4096`, `offset=SIZE,size=SIZE` (a slice of the
//! backend: the namespace sees only those bytes), `direct=on|off` (file; default on),
//! `ro`, `shared` (allow overlapping writable slices), and QoS limits `iops=`,
//! `read_iops=`, `write_iops=`, `bw=`, `read_bw=`, `write_bw=` (bytes/s, with K/M/G).
//! Example: `file:/var/lib/vm.img,offset=1G,size=8G,iops=5000`.

use std::path::PathBuf;

use crate::size::{format_size, parse_size};

#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub struct NsSpec {
    pub kind: NsKind,
    /// Logical block size; `None`: the backend's default (512 for files and memory).
    pub block_size: Option<u32>,
    /// `(offset, size)` in bytes of the backend this namespace sees.
    pub slice: Option<(u64, Option<u64>)>,
    pub read_only: bool,
    pub shared: bool,
    pub qos: bdev::QosLimits,
    text: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NsKind {
    Null { size: u64 },
    Ram { size: u64 },
    File { path: PathBuf, direct: bool },
}

impl TryFrom<String> for NsSpec {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl std::str::FromStr for NsSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |m: String| format!("namespace `{s}`: {m}");
        let (kind, rest) = s.split_once(':').ok_or_else(|| {
            bad("expected KIND:ARG, e.g. ram:1G, null:8G or file:/path/disk.img".into())
        })?;
        let mut parts = rest.split(',');
        let arg = parts.next().unwrap_or_default();
        let mut direct = true;
        let mut spec = NsSpec {
            kind: NsKind::Null { size: 0 },
            block_size: None,
            slice: None,
            read_only: false,
            shared: false,
            qos: bdev::QosLimits::default(),
            text: s.to_string(),
        };
        let mut offset = None;
        let mut size = None;
        for opt in parts {
            let (k, v) = opt.split_once('=').unwrap_or((opt, ""));
            let num = || parse_size(v).map_err(|e| bad(format!("{k}: {e}")));
            let rate = || num().map(Some);
            match k {
                "bs" => {
                    spec.block_size = Some(
                        v.parse()
                            .ok()
                            .filter(|b| *b == 512 || *b == 4096)
                            .ok_or_else(|| bad("bs must be 512 or 4096".into()))?,
                    )
                }
                "offset" => offset = Some(num()?),
                "size" => size = Some(num()?),
                "direct" => {
                    direct = match v {
                        "on" => true,
                        "off" => false,
                        _ => return Err(bad("direct must be on or off".into())),
                    }
                }
                "ro" => spec.read_only = true,
                "shared" => spec.shared = true,
                "iops" => spec.qos.iops = rate()?,
                "read_iops" => spec.qos.read_iops = rate()?,
                "write_iops" => spec.qos.write_iops = rate()?,
                "bw" => spec.qos.bw_bytes = rate()?,
                "read_bw" => spec.qos.read_bw = rate()?,
                "write_bw" => spec.qos.write_bw = rate()?,
                _ => return Err(bad(format!(
                    "unknown option `{opt}` (known: bs, offset, size, direct, ro, shared, iops, read_iops, write_iops, bw, read_bw, write_bw)"
                ))),
            }
        }
        let qos = &spec.qos;
        if [
            qos.iops,
            qos.read_iops,
            qos.write_iops,
            qos.bw_bytes,
            qos.read_bw,
            qos.write_bw,
        ]
        .contains(&Some(0))
        {
            return Err(bad("QoS limits must be above 0".into()));
        }
        spec.kind = match kind {
            "null" | "ram" => {
                let size = parse_size(arg).map_err(bad)?;
                let bs = u64::from(spec.block_size.unwrap_or(512));
                if size == 0 || !size.is_multiple_of(bs) {
                    return Err(bad(format!(
                        "size must be a non-zero multiple of the block size {bs}"
                    )));
                }
                if kind == "null" {
                    NsKind::Null { size }
                } else {
                    NsKind::Ram { size }
                }
            }
            "file" => {
                if arg.is_empty() {
                    return Err(bad("file needs a path, e.g. file:/var/lib/vm1.img".into()));
                }
                NsKind::File {
                    path: PathBuf::from(arg),
                    direct,
                }
            }
            other => {
                return Err(bad(format!(
                    "unknown kind `{other}` (known: null, ram, file)"
                )))
            }
        };
        if (!direct || spec.read_only) && !matches!(spec.kind, NsKind::File { .. }) {
            return Err(bad("direct= and ro apply to file namespaces only".into()));
        }
        spec.slice = match (offset, size) {
            (None, None) => None,
            (o, s) => Some((o.unwrap_or(0), s)),
        };
        Ok(spec)
    }
}

impl std::fmt::Display for NsSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            NsKind::Null { size } => write!(f, "null:{}", format_size(*size)),
            NsKind::Ram { size } => write!(f, "ram:{}", format_size(*size)),
            NsKind::File { .. } => f.write_str(&self.text),
        }?;
        if !matches!(self.kind, NsKind::File { .. }) {
            if let Some(bs) = self.block_size.filter(|b| *b != 512) {
                write!(f, ",bs={bs}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn specs() {
        let s: NsSpec = "ram:1G".parse().unwrap();
        assert_eq!(s.kind, NsKind::Ram { size: 1 << 30 });
        let s: NsSpec = "null:8G,bs=4096".parse().unwrap();
        assert_eq!(s.block_size, Some(4096));
        assert_eq!(s.to_string(), "null:8G,bs=4096");
        let s: NsSpec = "file:/x/y.img,offset=1G,size=2G,direct=off,ro,iops=5000,bw=100M"
            .parse()
            .unwrap();
        assert_eq!(
            s.kind,
            NsKind::File {
                path: "/x/y.img".into(),
                direct: false
            }
        );
        assert_eq!(s.slice, Some((1 << 30, Some(2 << 30))));
        assert!(s.read_only);
        assert_eq!(s.qos.iops, Some(5000));
        assert_eq!(s.qos.bw_bytes, Some(100 << 20));
        for bad in [
            "ram",
            "disk:1G",
            "ram:1000",
            "ram:1G,bs=1024",
            "ram:1G,foo=1",
            "ram:0",
            "file:",
            "file:/a,direct=maybe",
            "ram:1G,direct=off",
            "ram:1G,ro",
            "ram:1G,iops=0",
            "ram:1G,offset=x",
        ] {
            assert!(bad.parse::<NsSpec>().is_err(), "accepted {bad}");
        }
    }
}
