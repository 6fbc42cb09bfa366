//! `null:SIZE` (completes at once, moves no data: software-path measurements) and
//! `ram:SIZE` (data in anonymous memory, gone when udrive exits): memory backends
//! that take a size and nothing else.

use std::sync::Arc;

use anyhow::{Context, Result};
use bdev::{BlockDevice, NullDisk, RamDisk};

use super::{parse_sized, BackendKind, Backing, KindSpec};
use crate::size::format_size;

/// One memory kind: its name, an example, and how a device of `size` bytes with
/// `block_size`-byte blocks opens.
pub struct Memory {
    name: &'static str,
    example: &'static str,
    open: fn(u64, u32) -> Result<Arc<dyn BlockDevice>>,
}

pub static NULL: Memory = Memory {
    name: "null",
    example: "null:8G",
    open: |size, bs| Ok(Arc::new(NullDisk::new(size, bs)?)),
};

pub static RAM: Memory = Memory {
    name: "ram",
    example: "ram:1G",
    open: |size, bs| {
        let disk =
            RamDisk::new(size, bs).with_context(|| format!("cannot reserve {size} bytes"))?;
        Ok(Arc::new(disk))
    },
};

#[derive(Debug)]
struct MemorySpec {
    name: &'static str,
    size: u64,
    open: fn(u64, u32) -> Result<Arc<dyn BlockDevice>>,
}

impl BackendKind for Memory {
    fn name(&self) -> &'static str {
        self.name
    }
    fn example(&self) -> &'static str {
        self.example
    }
    fn parse(
        &self,
        arg: &str,
        _opts: &[(&str, &str)],
        block_size: Option<u32>,
    ) -> Result<Arc<dyn KindSpec>, String> {
        Ok(Arc::new(MemorySpec {
            name: self.name,
            size: parse_sized(arg, block_size)?,
            open: self.open,
        }))
    }
}

impl KindSpec for MemorySpec {
    fn canonical(&self) -> Option<String> {
        Some(format!("{}:{}", self.name, format_size(self.size)))
    }
    fn backing(&self) -> Result<Option<Backing>> {
        Ok(None)
    }
    fn open(&self, block_size: Option<u32>, _read_only: bool) -> Result<Arc<dyn BlockDevice>> {
        (self.open)(self.size, block_size.unwrap_or(512))
    }
}
