//! `ram:SIZE` — data in anonymous memory, gone when udrive exits.

use std::sync::Arc;

use anyhow::{Context, Result};
use bdev::{BlockDevice, RamDisk};

use super::{parse_sized, BackendKind, Backing, KindSpec};
use crate::size::format_size;

pub struct Ram;

#[derive(Debug)]
struct RamSpec {
    size: u64,
    /// `hugepages=on`: transparent huge pages (`RamDisk::with_huge_pages`).
    huge: bool,
}

impl BackendKind for Ram {
    fn name(&self) -> &'static str {
        "ram"
    }
    fn example(&self) -> &'static str {
        "ram:1G"
    }
    fn options(&self) -> &'static [&'static str] {
        &["hugepages"]
    }
    fn parse(
        &self,
        arg: &str,
        opts: &[(&str, &str)],
        block_size: Option<u32>,
    ) -> Result<Arc<dyn KindSpec>, String> {
        let mut huge = false;
        for &(k, v) in opts {
            if k == "hugepages" {
                huge = match v {
                    "on" => true,
                    "off" => false,
                    _ => return Err("hugepages must be on or off".into()),
                }
            }
        }
        Ok(Arc::new(RamSpec {
            size: parse_sized(arg, block_size)?,
            huge,
        }))
    }
}

impl KindSpec for RamSpec {
    fn canonical(&self) -> Option<String> {
        let huge = if self.huge { ",hugepages=on" } else { "" };
        Some(format!("ram:{}{huge}", format_size(self.size)))
    }
    fn backing(&self) -> Result<Option<Backing>> {
        Ok(None)
    }
    fn open(&self, block_size: Option<u32>, _read_only: bool) -> Result<Arc<dyn BlockDevice>> {
        let size = self.size;
        let bs = block_size.unwrap_or(512);
        let disk = if self.huge {
            RamDisk::with_huge_pages(size, bs)
        } else {
            RamDisk::new(size, bs)
        }
        .with_context(|| format!("cannot reserve {size} bytes"))?;
        Ok(Arc::new(disk))
    }
}
