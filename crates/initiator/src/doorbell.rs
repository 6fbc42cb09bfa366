//! Doorbell writes: into the shared sparse-mmap page when the server offers one,
//! otherwise (or for doorbells outside it) as REGION_WRITE messages.

use std::sync::{Arc, Mutex};

use guest_mem::MappedRegion;
use vfio_user::proto::PCI_BAR0_REGION;

use crate::client::VfioUserClient;
use crate::error::Result;

#[derive(Debug)]
pub(crate) struct Doorbells {
    /// A mapping of BAR0 offsets `.1 .. .1 + .0.len()`.
    pub map: Option<(MappedRegion, u64)>,
    pub client: Arc<Mutex<VfioUserClient>>,
}

impl Doorbells {
    /// Writes `v` to the doorbell at BAR0 offset `bar_off`.
    pub fn write(&self, bar_off: u64, v: u32) -> Result<()> {
        if let Some((map, base)) = &self.map {
            if let Some(s) = bar_off.checked_sub(*base).and_then(|o| map.slice(o, 4)) {
                // Release orders our queue-entry writes before the doorbell value.
                if s.store_u32(0, v).is_some() {
                    return Ok(());
                }
            }
        }
        self.client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .region_write_u32(PCI_BAR0_REGION, bar_off, v)
    }

    pub fn is_mmap(&self) -> bool {
        self.map.is_some()
    }
}
