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
}

impl BackendKind for Ram {
    fn name(&self) -> &'static str {
        "ram"
    }
    fn example(&self) -> &'static str {
        "ram:1G"
    }
    fn parse(
        &self,
        arg: &str,
        _opts: &[(&str, &str)],
        block_size: Option<u32>,
    ) -> Result<Arc<dyn KindSpec>, String> {
        Ok(Arc::new(RamSpec {
            size: parse_sized(arg, block_size)?,
        }))
    }
}

impl KindSpec for RamSpec {
    fn canonical(&self) -> Option<String> {
        Some(format!("ram:{}", format_size(self.size)))
    }
    fn backing(&self) -> Result<Option<Backing>> {
        Ok(None)
    }
    fn open(&self, block_size: Option<u32>, _read_only: bool) -> Result<Arc<dyn BlockDevice>> {
        let size = self.size;
        let disk = RamDisk::new(size, block_size.unwrap_or(512))
            .with_context(|| format!("cannot reserve {size} bytes"))?;
        Ok(Arc::new(disk))
    }
}
