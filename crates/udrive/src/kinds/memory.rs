//! `null:SIZE` (completes at once, moves no data: software-path measurements) and
//! `ram:SIZE` (data in anonymous memory, gone when udrive exits; `hugepages=on`
//! backs it with transparent huge pages, decision 0017): memory backends that take a
//! size.

use std::sync::Arc;

use anyhow::{Context, Result};
use bdev::{BlockDevice, NullDisk, RamDisk};

use super::kind::{parse_sized, BackendKind, Backing, KindSpec, OpenEnv};
use crate::size::format_size;

/// How a memory device of `size` bytes with `block_size`-byte blocks opens
/// (`huge`: `hugepages=on`).
type Open = fn(u64, u32, bool) -> Result<Arc<dyn BlockDevice>>;

/// One memory kind: its name, an example, its options and how it opens.
pub struct Memory {
    name: &'static str,
    example: &'static str,
    options: &'static [&'static str],
    open: Open,
}

pub static NULL: Memory = Memory {
    name: "null",
    example: "null:8G",
    options: &[],
    open: |size, bs, _| Ok(Arc::new(NullDisk::new(size, bs)?)),
};

pub static RAM: Memory = Memory {
    name: "ram",
    example: "ram:1G",
    options: &["hugepages"],
    open: |size, bs, huge| {
        let disk = if huge {
            RamDisk::with_huge_pages(size, bs)
        } else {
            RamDisk::new(size, bs)
        }
        .with_context(|| format!("cannot reserve {size} bytes"))?;
        Ok(Arc::new(disk))
    },
};

#[derive(Clone, Copy, Debug)]
struct MemorySpec {
    name: &'static str,
    size: u64,
    /// `hugepages=on`: transparent huge pages (`RamDisk::with_huge_pages`).
    huge: bool,
    open: Open,
}

impl BackendKind for Memory {
    fn name(&self) -> &'static str {
        self.name
    }
    fn example(&self) -> &'static str {
        self.example
    }
    fn options(&self) -> &'static [&'static str] {
        self.options
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
        Ok(Arc::new(MemorySpec {
            name: self.name,
            size: parse_sized(arg, block_size)?,
            huge,
            open: self.open,
        }))
    }
}

impl KindSpec for MemorySpec {
    fn canonical(&self) -> Option<String> {
        let huge = if self.huge { ",hugepages=on" } else { "" };
        Some(format!("{}:{}{huge}", self.name, format_size(self.size)))
    }
    fn backing(&self) -> Result<Option<Backing>> {
        Ok(None)
    }
    fn check(&self, _read_only: bool, problems: &mut Vec<String>) -> Option<u64> {
        if self.name == "ram" {
            if let Some(total) = memory_total().filter(|t| self.size > *t) {
                problems.push(format!(
                    "ram:{} is more than this host's memory ({})",
                    format_size(self.size),
                    format_size(total)
                ));
            }
        }
        Some(self.size)
    }
    fn handover_refusal(&self) -> Option<&'static str> {
        (self.name == "ram").then_some(
            "a ram disk's data lives in this process's memory and would not move with a handover",
        )
    }
    fn migration_refusal(&self) -> Option<&'static str> {
        (self.name == "ram").then_some(
            "a ram disk's data lives in this udrive process's memory: the destination of a \
             migration would serve an empty disk (use file: on shared storage or rbd:)",
        )
    }
    fn open(
        &self,
        _env: &dyn OpenEnv,
        block_size: Option<u32>,
        _read_only: bool,
    ) -> Result<Arc<dyn BlockDevice>> {
        (self.open)(self.size, block_size.unwrap_or(512), self.huge)
    }
    fn resized(&self, bytes: u64) -> Option<Arc<dyn KindSpec>> {
        Some(Arc::new(MemorySpec {
            size: bytes,
            ..*self
        }))
    }
}

/// The host's memory in bytes (MemTotal of /proc/meminfo).
fn memory_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}
