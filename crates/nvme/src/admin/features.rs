//! Get/Set Features state.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use crate::identify::{TEMPERATURE, WCTEMP};
use crate::status::Status;
use crate::ControllerConfig;

pub(crate) const FID_ARBITRATION: u8 = 0x01;
pub(crate) const FID_POWER: u8 = 0x02;
pub(crate) const FID_TEMP: u8 = 0x04;
pub(crate) const FID_ERROR_RECOVERY: u8 = 0x05;
pub(crate) const FID_VWC: u8 = 0x06;
pub(crate) const FID_QUEUES: u8 = 0x07;
pub(crate) const FID_COALESCING: u8 = 0x08;
pub(crate) const FID_VECTOR_CFG: u8 = 0x09;
pub(crate) const FID_WRITE_ATOMICITY: u8 = 0x0a;
pub(crate) const FID_ASYNC_EVENT: u8 = 0x0b;
pub(crate) const FID_KEEP_ALIVE: u8 = 0x0f;
/// Its value is a 512-byte data structure, moved through the command's data pointer.
pub(crate) const FID_HOST_BEHAVIOR: u8 = 0x16;

/// Size of the Host Behavior Support data structure.
pub(crate) const HOST_BEHAVIOR_LEN: usize = 512;

/// Features whose value is changeable (Get Features SEL = 3 reports them so).
const CHANGEABLE: [u8; 11] = [
    FID_ARBITRATION,
    FID_POWER,
    FID_TEMP,
    FID_ERROR_RECOVERY,
    FID_QUEUES,
    FID_COALESCING,
    FID_VECTOR_CFG,
    FID_WRITE_ATOMICITY,
    FID_ASYNC_EVENT,
    FID_KEEP_ALIVE,
    FID_HOST_BEHAVIOR,
];

#[derive(Debug, Clone)]
pub(crate) struct Features {
    pub arbitration: u32,
    pub power_state: u32,
    pub temp_over: u16,
    pub temp_under: u16,
    /// Present iff some backend has a volatile write cache.
    pub vwc_present: bool,
    pub wce: bool,
    pub queues: u32,
    /// Interrupt Coalescing: applied by the queue groups (`Shared::coalescing_for`).
    pub coalescing: u32,
    pub no_coalesce: Vec<bool>,
    pub async_events: u32,
    pub kato: u32,
    /// Error Recovery: TLER (bits 15:0). DULBE (bit 16) is refused: no namespace
    /// reports deallocated blocks as errors (NSFEAT.DAE = 0).
    pub error_recovery: u32,
    /// Write Atomicity Normal: DN (bit 0). Every write is atomic up to what the
    /// namespaces report either way, so it changes nothing but what Get returns.
    pub write_atomicity: u32,
    /// Host Behavior Support: ACRE (byte 0), the only field of NVMe 1.4.
    pub acre: bool,
}

impl Features {
    pub fn new(cfg: &ControllerConfig, vwc_present: bool) -> Features {
        let n = u32::from(cfg.max_io_queues.max(1) - 1);
        Features {
            arbitration: 0,
            power_state: 0,
            temp_over: WCTEMP,
            temp_under: 0,
            vwc_present,
            wce: vwc_present,
            queues: n | (n << 16),
            coalescing: 0,
            no_coalesce: vec![false; usize::from(cfg.msix_vectors)],
            async_events: 0,
            kato: 0,
            error_recovery: 0,
            write_atomicity: 0,
            acre: false,
        }
    }

    fn known(&self, fid: u8) -> bool {
        CHANGEABLE.contains(&fid) || (fid == FID_VWC && self.vwc_present)
    }

    fn temp_sel(cdw11: u32) -> Result<bool, Status> {
        let tmpsel = (cdw11 >> 16) & 0xf;
        let thsel = (cdw11 >> 20) & 3;
        if (tmpsel != 0 && tmpsel != 0xf) || thsel > 1 {
            return Err(Status::INVALID_FIELD);
        }
        Ok(thsel == 0)
    }

    pub fn get(&self, fid: u8, sel: u32, cdw11: u32) -> Result<u32, Status> {
        if sel == 3 {
            // Supported capabilities: changeable, not saveable, not per namespace.
            return if self.known(fid) {
                Ok(0b100)
            } else {
                Err(Status::INVALID_FIELD)
            };
        }
        Ok(match fid {
            FID_ARBITRATION => self.arbitration,
            FID_POWER => self.power_state,
            FID_TEMP => {
                if Self::temp_sel(cdw11)? {
                    u32::from(self.temp_over)
                } else {
                    u32::from(self.temp_under)
                }
            }
            FID_VWC if self.vwc_present => u32::from(self.wce),
            FID_QUEUES => self.queues,
            FID_COALESCING => self.coalescing,
            FID_VECTOR_CFG => {
                let iv = cdw11 & 0xffff;
                let cd = self
                    .no_coalesce
                    .get(iv as usize)
                    .ok_or(Status::INVALID_FIELD)?;
                iv | (u32::from(*cd) << 16)
            }
            FID_ASYNC_EVENT => self.async_events,
            FID_KEEP_ALIVE => self.kato,
            FID_ERROR_RECOVERY => self.error_recovery,
            FID_WRITE_ATOMICITY => self.write_atomicity,
            // The value travels in the data buffer (`host_behavior`); dw0 is 0.
            FID_HOST_BEHAVIOR => 0,
            _ => return Err(Status::INVALID_FIELD),
        })
    }

    /// The Host Behavior Support data structure as Get Features returns it.
    pub fn host_behavior(&self) -> [u8; HOST_BEHAVIOR_LEN] {
        let mut b = [0u8; HOST_BEHAVIOR_LEN];
        b[0] = u8::from(self.acre);
        b
    }

    /// Set Features for Host Behavior Support with the host's data structure.
    /// Fields newer than NVMe 1.4 are ignored and read back as 0.
    pub fn set_host_behavior(&mut self, save: bool, data: &[u8]) -> Result<u32, Status> {
        if save {
            return Err(Status::FEATURE_NOT_SAVEABLE);
        }
        self.acre = match data.first() {
            Some(0) => false,
            Some(1) => true,
            _ => return Err(Status::INVALID_FIELD),
        };
        Ok(0)
    }

    pub fn set(&mut self, fid: u8, save: bool, cdw11: u32) -> Result<u32, Status> {
        // Host Behavior Support goes through `set_host_behavior` (it has data).
        if !self.known(fid) || fid == FID_HOST_BEHAVIOR {
            return Err(Status::INVALID_FIELD);
        }
        if save {
            return Err(Status::FEATURE_NOT_SAVEABLE);
        }
        match fid {
            FID_ARBITRATION => self.arbitration = cdw11,
            FID_POWER => {
                if cdw11 & 0x1f != 0 {
                    return Err(Status::INVALID_FIELD);
                }
                self.power_state = cdw11 & 0xff;
            }
            FID_TEMP => {
                let t = crate::bits::lo16(cdw11);
                if Self::temp_sel(cdw11)? {
                    self.temp_over = t;
                } else {
                    self.temp_under = t;
                }
            }
            FID_VWC => self.wce = cdw11 & 1 != 0,
            FID_QUEUES => {
                if cdw11 & 0xffff == 0xffff || cdw11 >> 16 == 0xffff {
                    return Err(Status::INVALID_FIELD);
                }
                return Ok(self.queues);
            }
            FID_COALESCING => self.coalescing = cdw11 & 0xffff,
            FID_VECTOR_CFG => {
                let iv = (cdw11 & 0xffff) as usize;
                let cd = self.no_coalesce.get_mut(iv).ok_or(Status::INVALID_FIELD)?;
                *cd = cdw11 & (1 << 16) != 0;
            }
            FID_ASYNC_EVENT => self.async_events = cdw11,
            FID_ERROR_RECOVERY => {
                if cdw11 & (1 << 16) != 0 {
                    return Err(Status::INVALID_FIELD);
                }
                self.error_recovery = cdw11 & 0xffff;
            }
            FID_WRITE_ATOMICITY => self.write_atomicity = cdw11 & 1,
            _ => self.kato = cdw11,
        }
        Ok(0)
    }

    pub fn temperature(&self) -> u16 {
        TEMPERATURE
    }
}
