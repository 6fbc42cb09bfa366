//! Namespace specs, on the command line (`--ns`) and in the TOML config:
//!
//! * `null:SIZE` — completes at once, no data (software-path measurements)
//! * `ram:SIZE` — data in memory, gone when udrive exits
//! * `file:PATH` — a file or block device through io_uring
//!
//! (each kind is a module of `crate::kinds`, which also parses its own options),
//! followed by options: `bs=512|4096`, `offset=SIZE,size=SIZE` (a slice of the
//! backend: the namespace sees only those bytes), `direct=on|off` (file; default on),
//! `engine=auto|uring|inline` (file; default auto: inline only for memory-filesystem
//! files that io_uring would hand to kernel workers, see `bdev::FileEngine`), `ro`, `shared` (allow overlapping writable slices),
//! `incoming` (a vhost-user-blk disk that receives a migrating VM: it opens without
//! the writer's claim, which it takes when the VM starts there; docs/attach.md), and QoS limits `iops=`,
//! `read_iops=`, `write_iops=`, `bw=`, `read_bw=`, `write_bw=` (bytes/s, with K/M/G).
//! Example: `file:/var/lib/vm.img,offset=1G,size=8G,iops=5000`.
//!
//! Encryption at rest: `encrypt=luks,key-file=PATH` serves the payload of a
//! LUKS1/LUKS2 volume (aes-xts-plain64) on the backend, unlocked with the
//! passphrase in the key file (`bdev::CryptDisk`,
//! docs/decisions/0037-luks-encryption.md); with `create=on` a blank backend is
//! formatted as a new LUKS2 volume first (for kinds whose `create=SIZE` makes the
//! image, rbd and qcow2, that option does both). Slices are cut from the payload.
//!
//! Test-only fault injection (wraps the namespace in a `bdev::FaultDisk`, after the
//! slice, so LBAs are the namespace's): `fault_lbas=START-END` (inclusive LBA range
//! that fails), `fault_rate=0.01` (fraction of requests that fail at random),
//! `fault_ops=read|write|all` (which requests faults apply to; default all),
//! `fault_latency_us=N` (every completion is held back N µs). Failed reads end in
//! Unrecovered Read Error, failed writes in Write Fault.

use crate::size::parse_size;

pub use crate::kinds::NsKind;

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
    /// The destination of a live migration (vhost-user-blk): opened without what
    /// a writer holds, taken when the VM starts on this device.
    pub incoming: bool,
    pub qos: bdev::QosLimits,
    /// Test-only error/latency injection.
    pub fault: Option<FaultSpec>,
    /// `encrypt=luks`: the backend holds a LUKS volume.
    pub encrypt: Option<EncryptSpec>,
    text: String,
}

/// The `encrypt=luks` options of a namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncryptSpec {
    pub key: KeySpec,
    /// Format a blank backend as a new LUKS2 volume.
    pub create: bool,
}

/// Where an encrypted namespace's passphrase comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySpec {
    /// `key-file=PATH`: the whole file (as `cryptsetup --key-file`).
    File(std::path::PathBuf),
    /// `key-secret=NAME`: a secret given over the control socket (`secret_add`).
    Secret(String),
}

impl KeySpec {
    /// The key file, if the passphrase is one.
    pub fn file(&self) -> Option<&std::path::Path> {
        match self {
            KeySpec::File(p) => Some(p),
            KeySpec::Secret(_) => None,
        }
    }

    /// The passphrase ready to use: a secret is looked up in `env`.
    pub fn resolve(&self, env: &dyn crate::kinds::OpenEnv) -> Result<Passphrase, EncryptError> {
        Ok(match self {
            KeySpec::File(p) => Passphrase::File(p.clone()),
            KeySpec::Secret(name) => Passphrase::Secret(
                name.clone(),
                env.secret(name)
                    .ok_or_else(|| EncryptError::NoSecret(name.clone()))?,
            ),
        })
    }
}

/// A passphrase a [`KeySpec`] names: a key file, or a secret's name and a copy
/// of its bytes (zeroed when dropped).
pub enum Passphrase {
    File(std::path::PathBuf),
    Secret(String, zeroize::Zeroizing<Vec<u8>>),
}

impl Passphrase {
    pub fn key(&self) -> bdev::Key<'_> {
        match self {
            Passphrase::File(p) => bdev::Key::File(p),
            Passphrase::Secret(name, bytes) => bdev::Key::Secret { name, bytes },
        }
    }
}

/// Why an encrypted namespace cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum EncryptError {
    #[error(transparent)]
    Luks(#[from] bdev::LuksError),
    #[error("no secret named {0}: add it with secret_add first")]
    NoSecret(String),
}

/// The `encrypt=` options.
const ENCRYPT_OPTIONS: [&str; 4] = ["encrypt", "key-file", "key-secret", "create"];

impl EncryptSpec {
    /// The options `encrypt=`, `key-file=`, `key-secret=`, `create=` as given
    /// (`(name, value)`).
    fn parse(opts: &[(&str, &str)]) -> Result<Option<EncryptSpec>, String> {
        let get = |k: &str| {
            opts.iter()
                .rev()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| *v)
                .filter(|v| !v.is_empty())
        };
        match get("encrypt") {
            None if opts.is_empty() => Ok(None),
            None => Err("key-file=, key-secret= and create= go with encrypt=luks".into()),
            Some("luks") => {
                let key = match (get("key-file"), get("key-secret")) {
                    (Some(f), None) => KeySpec::File(f.into()),
                    (None, Some(n)) => KeySpec::Secret(n.into()),
                    (Some(_), Some(_)) => {
                        return Err("give key-file= or key-secret=, not both".into())
                    }
                    (None, None) => {
                        return Err("encrypt=luks needs key-file=PATH or key-secret=NAME".into())
                    }
                };
                let create = match get("create") {
                    None | Some("off") => false,
                    Some("on") => true,
                    Some(_) => return Err("create must be on or off".into()),
                };
                Ok(Some(EncryptSpec { key, create }))
            }
            Some(_) => Err("encrypt must be luks".into()),
        }
    }

    /// `dev`'s LUKS payload; a `key-secret=` comes from `env`.
    pub fn open(
        &self,
        dev: std::sync::Arc<dyn bdev::BlockDevice>,
        env: &dyn crate::kinds::OpenEnv,
    ) -> Result<bdev::CryptDisk, EncryptError> {
        let pass = self.key.resolve(env)?;
        let key = pass.key();
        Ok(match self.create {
            true => bdev::open_or_format_luks(dev, key)?,
            false => bdev::open_luks(dev, key)?,
        })
    }
}

/// The `fault_*` options of a namespace.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct FaultSpec {
    /// Inclusive LBA range `(first, last)` whose requests fail.
    pub lbas: Option<(u64, u64)>,
    /// Fraction of requests that fail, in millionths.
    pub rate_ppm: u32,
    pub ops: Option<bdev::FaultOps>,
    pub latency_us: u64,
}

/// The `fault_*` options.
const FAULT_OPTIONS: [&str; 4] = ["fault_lbas", "fault_rate", "fault_ops", "fault_latency_us"];

impl FaultSpec {
    /// The wrapper's configuration for a namespace of `block_size`-byte blocks.
    pub fn config(&self, block_size: u32) -> bdev::FaultConfig {
        let bs = u64::from(block_size);
        bdev::FaultConfig {
            error_lbas: self
                .lbas
                .map(|(a, b)| {
                    let len = (b - a).saturating_add(1).saturating_mul(bs);
                    (a.saturating_mul(bs), len)
                })
                .into_iter()
                .collect(),
            error_rate: f64::from(self.rate_ppm) / 1e6,
            ops: self.ops.unwrap_or(bdev::FaultOps::All),
            latency: std::time::Duration::from_micros(self.latency_us),
            ..Default::default()
        }
    }

    /// Takes option `k` (one of [`FAULT_OPTIONS`]) with value `v`; what is wrong
    /// with the value.
    fn set(&mut self, k: &str, v: &str) -> Result<(), String> {
        match k {
            "fault_lbas" => {
                let r = v
                    .split_once('-')
                    .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)))
                    .filter(|(a, b)| a <= b)
                    .ok_or_else(|| "fault_lbas must be FIRST-LAST, e.g. 0-7".to_string())?;
                self.lbas = Some(r);
            }
            "fault_rate" => {
                let r = v
                    .parse::<f64>()
                    .ok()
                    .filter(|r| (0.0..=1.0).contains(r))
                    .ok_or_else(|| "fault_rate must be a number from 0 to 1".to_string())?;
                self.rate_ppm = (r * 1e6).round() as u32;
            }
            "fault_ops" => {
                let ops = match v {
                    "read" => bdev::FaultOps::Read,
                    "write" => bdev::FaultOps::Write,
                    "all" => bdev::FaultOps::All,
                    _ => return Err("fault_ops must be read, write or all".into()),
                };
                self.ops = Some(ops);
            }
            "fault_latency_us" => {
                let us = v
                    .parse::<u64>()
                    .ok()
                    .filter(|u| *u <= 60_000_000)
                    .ok_or_else(|| "fault_latency_us must be 0..=60000000".to_string())?;
                self.latency_us = us;
            }
            _ => return Err(format!("`{k}` is not a fault option")),
        }
        Ok(())
    }
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
        let backend = crate::kinds::find(kind).map_err(&bad)?;
        let mut kind_opts = Vec::new();
        let mut block_size = None;
        let mut read_only = false;
        let mut shared = false;
        let mut incoming = false;
        let mut qos = bdev::QosLimits::default();
        let mut fault: Option<FaultSpec> = None;
        let mut encrypt = Vec::new();
        let mut offset = None;
        let mut size = None;
        for opt in parts {
            let (k, v) = opt.split_once('=').unwrap_or((opt, ""));
            let num = || parse_size(v).map_err(|e| bad(format!("{k}: {e}")));
            let rate = || num().map(Some);
            match k {
                "bs" => {
                    block_size = Some(
                        v.parse()
                            .ok()
                            .filter(|b| *b == 512 || *b == 4096)
                            .ok_or_else(|| bad("bs must be 512 or 4096".into()))?,
                    )
                }
                "offset" => offset = Some(num()?),
                "size" => size = Some(num()?),
                k if backend.options().contains(&k) => kind_opts.push((k, v)),
                "ro" if backend.read_only_ok() => read_only = true,
                "shared" => shared = true,
                "incoming" => incoming = true,
                "iops" => qos.iops = rate()?,
                "read_iops" => qos.read_iops = rate()?,
                "write_iops" => qos.write_iops = rate()?,
                "bw" => qos.bw_bytes = rate()?,
                "read_bw" => qos.read_bw = rate()?,
                "write_bw" => qos.write_bw = rate()?,
                k if ENCRYPT_OPTIONS.contains(&k) => encrypt.push((k, v)),
                k if FAULT_OPTIONS.contains(&k) => fault
                    .get_or_insert_with(Default::default)
                    .set(k, v)
                    .map_err(&bad)?,
                _ => return Err(bad(unknown_option(opt, backend))),
            }
        }
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
        // A kind with a `create=` of its own (rbd, qcow2: make the image) takes the
        // option; with encrypt=luks it also formats the new, blank image.
        if !encrypt.is_empty() && kind_opts.iter().any(|(k, _)| *k == "create") {
            encrypt.push(("create", "on"));
        }
        let encrypt = EncryptSpec::parse(&encrypt).map_err(&bad)?;
        let kind = backend.parse(arg, &kind_opts, block_size).map_err(&bad)?;
        if let Some(why) = kind.migration_refusal().filter(|_| incoming) {
            return Err(bad(format!("incoming: {why}")));
        }
        if let Some(why) = kind.shared_refusal().filter(|_| shared) {
            return Err(bad(format!("shared: {why}")));
        }
        Ok(NsSpec {
            kind: NsKind(kind),
            block_size,
            slice: match (offset, size) {
                (None, None) => None,
                (o, s) => Some((o.unwrap_or(0), s)),
            },
            read_only,
            shared,
            incoming,
            qos,
            fault,
            encrypt,
            text: s.to_string(),
        })
    }
}

impl NsSpec {
    /// The same disk, whatever the QoS limits: a reload then only sets the limits.
    pub fn same_backend(&self, other: &NsSpec) -> bool {
        let (mut a, mut b) = (self.clone(), other.clone());
        a.qos = bdev::QosLimits::default();
        b.qos = bdev::QosLimits::default();
        a.text.clear();
        b.text.clear();
        a == b
    }

    /// The spec of this disk after an online resize to `bytes` (`ram:1G` becomes
    /// `ram:2G`; a file's spec stays: its size is the file's).
    pub fn resized(&self, bytes: u64) -> NsSpec {
        let mut s = self.clone();
        if let Some(k) = self.kind.0.resized(bytes) {
            s.kind = NsKind(k);
        }
        s
    }
}

/// As written (options included), so that it parses back the same.
impl serde::Serialize for NsSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl std::fmt::Display for NsSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(short) = self.kind.0.canonical() else {
            return f.write_str(&self.text);
        };
        f.write_str(&short)?;
        if let Some(bs) = self.block_size.filter(|b| *b != 512) {
            write!(f, ",bs={bs}")?;
        }
        if self.encrypt.is_some() {
            f.write_str(",encrypt=luks")?;
        }
        Ok(())
    }
}

/// The options a kind accepts, for the message about one it does not.
fn unknown_option(opt: &str, kind: &dyn crate::kinds::BackendKind) -> String {
    let mut known = vec!["bs", "offset", "size"];
    known.extend(kind.options());
    if kind.read_only_ok() {
        known.push("ro");
    }
    known.extend([
        "shared",
        "incoming",
        "iops",
        "read_iops",
        "write_iops",
        "bw",
        "read_bw",
        "write_bw",
    ]);
    known.extend(ENCRYPT_OPTIONS);
    known.extend(FAULT_OPTIONS);
    format!(
        "unknown option `{opt}` for {} (known: {})",
        kind.name(),
        known.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_key_secret_names_the_passphrase() {
        let s: NsSpec = "ram:64M,encrypt=luks,key-secret=vm1,create=on"
            .parse()
            .unwrap();
        assert_eq!(s.encrypt.unwrap().key, KeySpec::Secret("vm1".into()));
    }

    #[test]
    fn specs() {
        let s: NsSpec = "ram:1G".parse().unwrap();
        assert_eq!(s.kind, "ram:1024M".parse::<NsSpec>().unwrap().kind);
        assert_eq!(s.to_string(), "ram:1G");
        let h: NsSpec = "ram:1G,hugepages=on".parse().unwrap();
        assert_ne!(h.kind, s.kind);
        assert_eq!(h.to_string(), "ram:1G,hugepages=on");
        assert!("ram:1G,hugepages=yes".parse::<NsSpec>().is_err());
        assert!("null:1G,hugepages=on".parse::<NsSpec>().is_err());
        let s: NsSpec = "null:8G,bs=4096".parse().unwrap();
        assert_eq!(s.block_size, Some(4096));
        assert_eq!(s.to_string(), "null:8G,bs=4096");
        assert_eq!(s.resized(12 << 30).to_string(), "null:12G,bs=4096");
        let h: NsSpec = "ram:1G,hugepages=on".parse().unwrap();
        assert_eq!(h.resized(1536 << 20).to_string(), "ram:1536M,hugepages=on");
        let s: NsSpec = "file:/x/y.img,offset=1G,size=2G,direct=off,ro,iops=5000,bw=100M"
            .parse()
            .unwrap();
        assert_eq!(
            format!("{:?}", s.kind),
            r#"NsKind(FileSpec { path: "/x/y.img", direct: false, engine: Auto })"#
        );
        assert_eq!(s.slice, Some((1 << 30, Some(2 << 30))));
        assert!(s.read_only);
        assert_eq!(s.qos.iops, Some(5000));
        assert_eq!(s.qos.bw_bytes, Some(100 << 20));
        let s: NsSpec = "file:/x/y.img,engine=inline".parse().unwrap();
        assert!(format!("{:?}", s.kind).contains("engine: Inline"));
        assert_eq!(s.resized(1 << 30), s, "a file's spec has no size");
        let e = "ram:1G,ro".parse::<NsSpec>().unwrap_err();
        assert!(e.contains("unknown option `ro` for ram"), "{e}");
        let e = "disk:1G".parse::<NsSpec>().unwrap_err();
        // (`rbd` follows when the feature is on.)
        assert!(
            e.contains("unknown kind `disk` (known: null, ram, file"),
            "{e}"
        );
        let s: NsSpec = "ram:1M,fault_lbas=8-15,fault_rate=0.25,fault_ops=read,fault_latency_us=50"
            .parse()
            .unwrap();
        let f = s.fault.unwrap();
        assert_eq!(f.lbas, Some((8, 15)));
        let c = f.config(512);
        assert_eq!(c.error_lbas, vec![(4096, 4096)]);
        assert_eq!(c.error_rate, 0.25);
        assert_eq!(c.ops, bdev::FaultOps::Read);
        assert_eq!(c.latency, std::time::Duration::from_micros(50));
        let s: NsSpec = "file:/x.img,encrypt=luks,key-file=/k/vm1,size=1G"
            .parse()
            .unwrap();
        let e = s.encrypt.as_ref().unwrap();
        assert_eq!(e.key, KeySpec::File("/k/vm1".into()));
        assert!(!e.create);
        assert!(s.to_string().contains("encrypt=luks"));
        let s: NsSpec = "ram:64M,encrypt=luks,key-file=k,create=on".parse().unwrap();
        assert!(s.encrypt.unwrap().create);
        // A kind's own create= (qcow2's, rbd's) makes the image and formats it.
        let s: NsSpec = "qcow2:/q,create=64M,encrypt=luks,key-file=k"
            .parse()
            .unwrap();
        assert!(s.encrypt.unwrap().create);
        let s: NsSpec = "qcow2:/q,encrypt=luks,key-file=k".parse().unwrap();
        assert!(!s.encrypt.unwrap().create);
        assert!("qcow2:/q,create=64M"
            .parse::<NsSpec>()
            .unwrap()
            .encrypt
            .is_none());
        for bad in [
            "ram:64M,encrypt=luks",
            "ram:64M,encrypt=luks,key-file=",
            "ram:64M,encrypt=aes,key-file=k",
            "ram:64M,key-file=k",
            "ram:64M,create=on",
            "ram:64M,encrypt=luks,key-file=k,create=yes",
            "ram:64M,encrypt=luks,key-file=k,key-secret=s",
            "ram:64M,encrypt=luks,key-secret=",
            "ram:64M,key-secret=s",
            "ram",
            "disk:1G",
            "ram:1000",
            "ram:1G,bs=1024",
            "ram:1G,foo=1",
            "ram:0",
            "file:",
            "file:/a,direct=maybe",
            "file:/a,engine=spdk",
            "ram:1G,engine=uring",
            "ram:1G,direct=off",
            "ram:1G,ro",
            "ram:1G,iops=0",
            "ram:1G,offset=x",
            "ram:1G,fault_lbas=5",
            "ram:1G,fault_lbas=9-3",
            "ram:1G,fault_rate=2",
            "ram:1G,fault_ops=trim",
            "ram:1G,fault_latency_us=-1",
        ] {
            assert!(bad.parse::<NsSpec>().is_err(), "accepted {bad}");
        }
    }
}
