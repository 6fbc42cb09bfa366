//! `null:SIZE` — completes at once, moves no data (software-path measurements).

use std::sync::Arc;

use anyhow::Result;
use bdev::{BlockDevice, NullDisk};

use super::{parse_sized, BackendKind, Backing, KindSpec};
use crate::size::format_size;

pub struct Null;

#[derive(Debug)]
struct NullSpec {
    size: u64,
}

impl BackendKind for Null {
    fn name(&self) -> &'static str {
        "null"
    }
    fn example(&self) -> &'static str {
        "null:8G"
    }
    fn parse(
        &self,
        arg: &str,
        _opts: &[(&str, &str)],
        block_size: Option<u32>,
    ) -> Result<Arc<dyn KindSpec>, String> {
        Ok(Arc::new(NullSpec {
            size: parse_sized(arg, block_size)?,
        }))
    }
}

impl KindSpec for NullSpec {
    fn canonical(&self) -> Option<String> {
        Some(format!("null:{}", format_size(self.size)))
    }
    fn backing(&self) -> Result<Option<Backing>> {
        Ok(None)
    }
    fn open(&self, block_size: Option<u32>, _read_only: bool) -> Result<Arc<dyn BlockDevice>> {
        Ok(Arc::new(NullDisk::new(
            self.size,
            block_size.unwrap_or(512),
        )?))
    }
}
