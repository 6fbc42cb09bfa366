//! NVMe completion status values (SCT/SC) and NVMe's status table for the front-end
//! core: backend results and policy refusals to statuses ([`Nvme`]).

use bdev::{IoOp, IoStatus};
use frontend_core::{Protocol, Refusal};

/// A completion status: bits 7:0 SC, 10:8 SCT, 14 DNR (the CQE status field without
/// the phase bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Status(pub u16);

const DNR: u16 = 1 << 14;

const fn generic(sc: u16) -> Status {
    Status(DNR | sc)
}
const fn specific(sc: u16) -> Status {
    Status(DNR | (1 << 8) | sc)
}
const fn media(sc: u16) -> Status {
    Status(DNR | (2 << 8) | sc)
}

impl Status {
    pub const SUCCESS: Status = Status(0);
    pub const INVALID_OPCODE: Status = generic(0x01);
    pub const INVALID_FIELD: Status = generic(0x02);
    pub const DATA_TRANSFER_ERROR: Status = generic(0x04);
    // Internal errors may be transient, so the host may retry (no DNR).
    pub const INTERNAL_ERROR: Status = Status(0x06);
    pub const COMMAND_SEQUENCE_ERROR: Status = generic(0x0c);
    pub const INVALID_NAMESPACE: Status = generic(0x0b);
    pub const INVALID_SGL_SEGMENT: Status = generic(0x0d);
    pub const NAMESPACE_WRITE_PROTECTED: Status = generic(0x20);
    pub const INVALID_SGL_COUNT: Status = generic(0x0e);
    pub const DATA_SGL_LENGTH_INVALID: Status = generic(0x0f);
    pub const SGL_TYPE_INVALID: Status = generic(0x11);
    pub const PRP_OFFSET_INVALID: Status = generic(0x13);
    pub const LBA_OUT_OF_RANGE: Status = generic(0x80);
    pub const CAPACITY_EXCEEDED: Status = generic(0x81);
    /// Transient (the format ends), so the host may retry: no DNR.
    pub const FORMAT_IN_PROGRESS: Status = Status(0x84);

    pub const CQ_INVALID: Status = specific(0x00);
    pub const INVALID_QUEUE_ID: Status = specific(0x01);
    pub const INVALID_QUEUE_SIZE: Status = specific(0x02);
    pub const AER_LIMIT_EXCEEDED: Status = specific(0x05);
    pub const INVALID_VECTOR: Status = specific(0x08);
    pub const INVALID_LOG_PAGE: Status = specific(0x09);
    pub const INVALID_FORMAT: Status = specific(0x0a);
    pub const INVALID_QUEUE_DELETION: Status = specific(0x0c);
    pub const FEATURE_NOT_SAVEABLE: Status = specific(0x0d);
    pub const WRITE_TO_READ_ONLY: Status = specific(0x82);

    pub const WRITE_FAULT: Status = media(0x80);
    pub const UNRECOVERED_READ: Status = media(0x81);

    pub fn is_ok(self) -> bool {
        self.0 & 0x7ff == 0
    }
    pub fn sc(self) -> u8 {
        (self.0 & 0xff) as u8
    }
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 7) as u8
    }
}

/// The NVM command set as a front-end protocol: its status table.
pub struct Nvme;

impl Protocol for Nvme {
    type Status = Status;
    const OK: Status = Status::SUCCESS;

    /// Media errors are Write Fault on commands that change data (write, write
    /// zeroes, deallocate) and Internal Error otherwise (read, flush).
    fn from_io(st: IoStatus, op: IoOp) -> Status {
        let writes = matches!(op, IoOp::Write | IoOp::WriteZeroes | IoOp::Discard);
        match st {
            IoStatus::Ok => Status::SUCCESS,
            IoStatus::IoError if writes => Status::WRITE_FAULT,
            IoStatus::IoError => Status::INTERNAL_ERROR,
            IoStatus::ReadError => Status::UNRECOVERED_READ,
            IoStatus::OutOfRange => Status::LBA_OUT_OF_RANGE,
            IoStatus::ReadOnly => Status::WRITE_TO_READ_ONLY,
            IoStatus::Unsupported => Status::INVALID_OPCODE,
            IoStatus::Invalid => Status::INTERNAL_ERROR,
            IoStatus::NoSpace => Status::CAPACITY_EXCEEDED,
        }
    }

    fn refused(r: Refusal) -> Status {
        match r {
            // NVMe ranges are in blocks: they cannot be misaligned.
            Refusal::OutOfRange | Refusal::Misaligned => Status::LBA_OUT_OF_RANGE,
            Refusal::ReadOnly => Status::WRITE_TO_READ_ONLY,
        }
    }

    /// SCT and SC; DNR and More are not part of the error's identity.
    fn code(s: Status) -> u16 {
        s.0 & 0x7ff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_table() {
        use IoOp::*;
        use IoStatus as I;
        let cases: &[(IoStatus, IoOp, Status)] = &[
            (I::Ok, Read, Status::SUCCESS),
            (I::Ok, Write, Status::SUCCESS),
            (I::IoError, Write, Status::WRITE_FAULT),
            (I::IoError, WriteZeroes, Status::WRITE_FAULT),
            (I::IoError, Discard, Status::WRITE_FAULT),
            (I::IoError, Read, Status::INTERNAL_ERROR),
            (I::IoError, Flush, Status::INTERNAL_ERROR),
            (I::ReadError, Read, Status::UNRECOVERED_READ),
            (I::OutOfRange, Read, Status::LBA_OUT_OF_RANGE),
            (I::ReadOnly, Write, Status::WRITE_TO_READ_ONLY),
            (I::Unsupported, Flush, Status::INVALID_OPCODE),
            (I::Invalid, Write, Status::INTERNAL_ERROR),
            (I::NoSpace, Write, Status::CAPACITY_EXCEEDED),
        ];
        for &(st, op, want) in cases {
            assert_eq!(Nvme::from_io(st, op), want, "{st:?} on {op:?}");
        }
        assert_eq!(Nvme::refused(Refusal::OutOfRange), Status::LBA_OUT_OF_RANGE);
        assert_eq!(Nvme::refused(Refusal::Misaligned), Status::LBA_OUT_OF_RANGE);
        assert_eq!(Nvme::refused(Refusal::ReadOnly), Status::WRITE_TO_READ_ONLY);
        // Counted by SCT/SC: 0 is success, DNR does not split an error in two.
        assert_eq!(Nvme::code(Nvme::OK), 0);
        assert_eq!(Nvme::code(Status::WRITE_FAULT), 0x280);
        assert_eq!(
            Nvme::code(Status(Status::WRITE_FAULT.0 & !(1 << 14))),
            0x280
        );
        assert_eq!(Nvme::code(Status::INTERNAL_ERROR), 0x006);
    }
}
