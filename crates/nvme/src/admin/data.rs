//! An admin command's data buffer as its transport carries it. The admin command set
//! reads and writes whole buffers through [`HostData`] and never walks data pointers
//! itself: over PCIe the buffer is the command's PRP list in guest memory
//! ([`PrpData`]); an NVMe-oF transport would carry it as in-capsule data or data PDUs.

use guest_mem::{Access, MemoryMap};

use crate::iov::Iov;
use crate::queue::Sqe;
use crate::status::Status;

pub(crate) trait HostData {
    /// Copies `data` into the host's buffer for this command.
    fn write_host(&mut self, data: &[u8]) -> Result<(), Status>;
    /// Fills `buf` from the host's buffer for this command.
    fn read_host(&mut self, buf: &mut [u8]) -> Result<(), Status>;
}

/// PCIe: the data pointer of an admin command (PRPs only, NVMe 1.4 §4.2: admin
/// commands that transfer data use PRPs) over the client's memory map.
pub(crate) struct PrpData<'a> {
    map: &'a MemoryMap,
    sqe: &'a Sqe,
}

impl<'a> PrpData<'a> {
    pub fn new(map: &'a MemoryMap, sqe: &'a Sqe) -> PrpData<'a> {
        PrpData { map, sqe }
    }

    fn buffer(&self, len: usize, access: Access) -> Result<Iov<'a>, Status> {
        if self.sqe.psdt() != 0 {
            return Err(Status::INVALID_FIELD);
        }
        let mut iov = Iov::new();
        let (p1, p2) = (self.sqe.prp1(), self.sqe.prp2());
        crate::prp::walk(self.map, p1, p2, len as u64, access, &mut iov)?;
        Ok(iov)
    }
}

impl HostData for PrpData<'_> {
    fn write_host(&mut self, data: &[u8]) -> Result<(), Status> {
        let iov = self.buffer(data.len(), Access::Write)?;
        iov.copy_out(data);
        // Unshared client memory: the data goes over before the completion.
        self.map
            .push(iov.runs())
            .map_err(|_| Status::DATA_TRANSFER_ERROR)
    }

    fn read_host(&mut self, buf: &mut [u8]) -> Result<(), Status> {
        let iov = self.buffer(buf.len(), Access::Read)?;
        self.map
            .fetch(iov.runs())
            .map_err(|_| Status::DATA_TRANSFER_ERROR)?;
        iov.copy_in(buf);
        Ok(())
    }
}
