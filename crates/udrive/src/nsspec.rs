//! Namespace specs: `KIND:SIZE[,bs=512|4096]`, e.g. `ram:1G`, `null:64G,bs=4096`.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bdev::{BlockDevice, NullDisk, RamDisk};

use crate::size::parse_size;

#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub struct NsSpec {
    pub kind: NsKind,
    pub size: u64,
    pub block_size: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsKind {
    Null,
    Ram,
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
        let (kind, rest) = s.split_once(':').ok_or_else(|| {
            format!("namespace `{s}`: expected KIND:SIZE, e.g. ram:1G or null:8G")
        })?;
        let kind = match kind {
            "null" => NsKind::Null,
            "ram" => NsKind::Ram,
            other => {
                return Err(format!(
                    "namespace `{s}`: unknown kind `{other}` (known: null, ram)"
                ))
            }
        };
        let mut parts = rest.split(',');
        let size = parse_size(parts.next().unwrap_or_default())
            .map_err(|e| format!("namespace `{s}`: {e}"))?;
        let mut block_size = 512;
        for opt in parts {
            match opt.split_once('=') {
                Some(("bs", v)) => {
                    block_size = v
                        .parse()
                        .ok()
                        .filter(|b| *b == 512 || *b == 4096)
                        .ok_or_else(|| format!("namespace `{s}`: bs must be 512 or 4096"))?
                }
                _ => {
                    return Err(format!(
                        "namespace `{s}`: unknown option `{opt}` (known: bs=)"
                    ))
                }
            }
        }
        if size == 0 || size % u64::from(block_size) != 0 {
            return Err(format!(
                "namespace `{s}`: size must be a non-zero multiple of the block size {block_size}"
            ));
        }
        Ok(NsSpec {
            kind,
            size,
            block_size,
        })
    }
}

impl std::fmt::Display for NsSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            NsKind::Null => "null",
            NsKind::Ram => "ram",
        };
        write!(f, "{kind}:{}", crate::size::format_size(self.size))?;
        if self.block_size != 512 {
            write!(f, ",bs={}", self.block_size)?;
        }
        Ok(())
    }
}

impl NsSpec {
    pub fn open(&self) -> Result<Arc<dyn BlockDevice>> {
        Ok(match self.kind {
            NsKind::Null => {
                Arc::new(NullDisk::new(self.size, self.block_size).context("null namespace")?)
            }
            NsKind::Ram => Arc::new(
                RamDisk::new(self.size, self.block_size)
                    .with_context(|| format!("cannot reserve {self}"))?,
            ),
        })
    }
}

pub fn check_nonempty(ns: &[NsSpec], what: &str) -> Result<()> {
    if ns.is_empty() {
        bail!("{what} has no namespace: add one, e.g. --ns ram:1G");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn specs() {
        let s: NsSpec = "ram:1G".parse().unwrap();
        assert_eq!((s.kind, s.size, s.block_size), (NsKind::Ram, 1 << 30, 512));
        let s: NsSpec = "null:8G,bs=4096".parse().unwrap();
        assert_eq!(s.block_size, 4096);
        assert_eq!(s.to_string(), "null:8G,bs=4096");
        assert!("ram".parse::<NsSpec>().is_err());
        assert!("disk:1G".parse::<NsSpec>().is_err());
        assert!("ram:1000".parse::<NsSpec>().is_err());
        assert!("ram:1G,bs=1024".parse::<NsSpec>().is_err());
        assert!("ram:1G,foo=1".parse::<NsSpec>().is_err());
        assert!("ram:0".parse::<NsSpec>().is_err());
    }
}
