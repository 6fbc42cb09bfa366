//! NVM command set decoding: from a submission queue entry and the facts of its
//! namespace to the I/O the command asks for, or the status that refuses it. Pure —
//! no guest memory, no backend, no queue: the transport (PCIe queues in `io/`)
//! resolves data pointers and submits. Checks run in the order the statuses are
//! reported: opcode, fused operation, namespace, then the command's own fields.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use bdev::{BlockInfo, IoOp};
use frontend_core::{Disk, Protocol};

use crate::queue::Sqe;
use crate::status::{Nvme, Status};

pub(crate) const OP_FLUSH: u8 = 0x00;
pub(crate) const OP_WRITE: u8 = 0x01;
pub(crate) const OP_READ: u8 = 0x02;
pub(crate) const OP_WRITE_ZEROES: u8 = 0x08;
pub(crate) const OP_DSM: u8 = 0x09;

/// Force Unit Access: CDW12 bit 30 of Read, Write and Write Zeroes.
const FUA: u32 = 1 << 30;

/// What decoding needs to know about the namespace and the controller.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Facts<'a> {
    pub info: &'a BlockInfo,
    /// Volatile Write Cache enabled by the host (Set Features 06h).
    pub wce: bool,
    /// Largest transfer (MDTS) in bytes.
    pub mdts_bytes: u64,
    /// A Format NVM is erasing the namespace.
    pub formatting: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IoCmd {
    Flush,
    /// Read (`write == false`) or Write of `bytes` at byte `offset`.
    Rw {
        write: bool,
        slba: u64,
        offset: u64,
        bytes: u64,
        fua: bool,
    },
    WriteZeroes {
        slba: u64,
        offset: u64,
        len: u64,
        fua: bool,
    },
    /// Dataset Management: `ranges` range descriptors in the data buffer.
    Dsm {
        ranges: usize,
        deallocate: bool,
    },
}

impl<'a> Facts<'a> {
    /// The namespace under the front-end core's policy (range, read-only, FUA).
    pub fn disk(&self) -> Disk<'a> {
        Disk {
            info: self.info,
            cache_on: self.wce,
        }
    }
}

/// First LBA, and byte offset and length, of a Read/Write/Write Zeroes command,
/// range-checked (the core's block→byte check).
fn lba_range(sqe: &Sqe, disk: &Disk<'_>) -> Result<(u64, u64, u64), Status> {
    let slba = u64::from(sqe.cdw(10)) | (u64::from(sqe.cdw(11)) << 32);
    let nlb = u64::from(sqe.cdw(12) & 0xffff) + 1;
    let r = disk.blocks(slba, nlb).map_err(Nvme::refused)?;
    Ok((slba, r.offset, r.len))
}

/// The I/O command `sqe` asks of a namespace with `ns` facts (`None`: no such
/// active namespace). Per command on the I/O path: the per-command decoders are
/// `#[inline]` so that this stays one function after optimization.
pub(crate) fn decode(sqe: &Sqe, ns: Option<Facts<'_>>) -> Result<IoCmd, Status> {
    let op = sqe.opcode();
    if !matches!(op, OP_FLUSH | OP_WRITE | OP_READ | OP_WRITE_ZEROES | OP_DSM) {
        return Err(Status::INVALID_OPCODE);
    }
    let ns = usable_namespace(sqe, ns)?;
    match op {
        OP_FLUSH => Ok(IoCmd::Flush),
        OP_READ => read_write(sqe, &ns, IoOp::Read),
        OP_WRITE => read_write(sqe, &ns, IoOp::Write),
        OP_WRITE_ZEROES => write_zeroes(sqe, &ns),
        _ => Ok(dataset_management(sqe)),
    }
}

/// What every command of the set checks after its opcode, in the order the
/// statuses are reported: no fused operation, an active namespace, not being
/// formatted.
#[inline]
fn usable_namespace<'a>(sqe: &Sqe, ns: Option<Facts<'a>>) -> Result<Facts<'a>, Status> {
    if sqe.fuse() != 0 {
        return Err(Status::INVALID_FIELD);
    }
    let Some(ns) = ns else {
        return Err(Status::INVALID_NAMESPACE);
    };
    if ns.formatting {
        return Err(Status::FORMAT_IN_PROGRESS);
    }
    Ok(ns)
}

/// Read or Write (`io`): range, MDTS, the disk's policy on `io` and FUA.
#[inline]
fn read_write(sqe: &Sqe, ns: &Facts<'_>, io: IoOp) -> Result<IoCmd, Status> {
    let disk = ns.disk();
    let (slba, offset, bytes) = lba_range(sqe, &disk)?;
    if bytes > ns.mdts_bytes {
        return Err(Status::INVALID_FIELD);
    }
    disk.allows(io).map_err(Nvme::refused)?;
    // With the write cache turned off by the host, every write is made durable.
    let fua = disk.fua(io, sqe.cdw(12) & FUA != 0);
    Ok(IoCmd::Rw {
        write: io == IoOp::Write,
        slba,
        offset,
        bytes,
        fua,
    })
}

/// Write Zeroes: only on a namespace whose backend offers it; no MDTS, no data.
#[inline]
fn write_zeroes(sqe: &Sqe, ns: &Facts<'_>) -> Result<IoCmd, Status> {
    if !ns.info.write_zeroes {
        return Err(Status::INVALID_OPCODE);
    }
    let disk = ns.disk();
    let (slba, offset, len) = lba_range(sqe, &disk)?;
    disk.allows(IoOp::WriteZeroes).map_err(Nvme::refused)?;
    Ok(IoCmd::WriteZeroes {
        slba,
        offset,
        len,
        fua: disk.fua(IoOp::WriteZeroes, sqe.cdw(12) & FUA != 0),
    })
}

/// Dataset Management: its ranges are in the data buffer, checked when read.
#[inline]
fn dataset_management(sqe: &Sqe) -> IoCmd {
    IoCmd::Dsm {
        ranges: (sqe.cdw(10) & 0xff) as usize + 1,
        deallocate: sqe.cdw(11) & (1 << 2) != 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqe(op: u8, fuse: u32, nsid: u32, cdw: [u32; 3]) -> Sqe {
        let mut s = Sqe::default();
        s.dw[0] = u32::from(op) | (fuse << 8);
        s.dw[1] = nsid;
        s.dw[10] = cdw[0];
        s.dw[11] = cdw[1];
        s.dw[12] = cdw[2];
        s
    }

    fn info(write_cache: bool, write_zeroes: bool) -> BlockInfo {
        BlockInfo {
            block_size: 512,
            num_blocks: 1000,
            volatile: true,
            write_cache,
            read_only: false,
            discard: true,
            write_zeroes,
            discard_zeroes: true,
        }
    }

    fn read_only_info() -> BlockInfo {
        BlockInfo {
            read_only: true,
            ..info(false, true)
        }
    }

    fn facts(info: &BlockInfo, wce: bool) -> Option<Facts<'_>> {
        Some(Facts {
            info,
            wce,
            mdts_bytes: 128 << 10,
            formatting: false,
        })
    }

    fn formatting(info: &BlockInfo) -> Option<Facts<'_>> {
        Some(Facts {
            formatting: true,
            ..facts(info, true)?
        })
    }

    fn rw(write: bool, slba: u64, nlb: u64, fua: bool) -> Result<IoCmd, Status> {
        Ok(IoCmd::Rw {
            write,
            slba,
            offset: slba * 512,
            bytes: nlb * 512,
            fua,
        })
    }

    type Case<'a> = (&'a str, Sqe, Option<Facts<'a>>, Result<IoCmd, Status>);

    fn check(cases: &[Case<'_>]) {
        for (what, s, ns, want) in cases {
            assert_eq!(decode(s, *ns), *want, "{what}");
        }
    }

    /// Read and Write: the range in blocks, MDTS, and FUA as the host's write cache
    /// setting makes it.
    #[test]
    fn reads_and_writes() {
        let plain = info(false, true);
        let cached = info(true, false);
        check(&[
            (
                "read",
                sqe(OP_READ, 0, 1, [10, 0, 7]),
                facts(&plain, true),
                rw(false, 10, 8, false),
            ),
            (
                "write FUA",
                sqe(OP_WRITE, 0, 1, [0, 0, FUA]),
                facts(&plain, true),
                rw(true, 0, 1, true),
            ),
            (
                "write, cache on",
                sqe(OP_WRITE, 0, 1, [0, 0, 0]),
                facts(&cached, true),
                rw(true, 0, 1, false),
            ),
            (
                "write, cache off by host",
                sqe(OP_WRITE, 0, 1, [0, 0, 0]),
                facts(&cached, false),
                rw(true, 0, 1, true),
            ),
            (
                "read, cache off",
                sqe(OP_READ, 0, 1, [0, 0, 0]),
                facts(&cached, false),
                rw(false, 0, 1, false),
            ),
            (
                "last block",
                sqe(OP_READ, 0, 1, [999, 0, 0]),
                facts(&plain, true),
                rw(false, 999, 1, false),
            ),
            (
                "past the end",
                sqe(OP_READ, 0, 1, [999, 0, 1]),
                facts(&plain, true),
                Err(Status::LBA_OUT_OF_RANGE),
            ),
            (
                "SLBA high dword",
                sqe(OP_READ, 0, 1, [0, 1, 0]),
                facts(&plain, true),
                Err(Status::LBA_OUT_OF_RANGE),
            ),
            (
                "SLBA wraps",
                sqe(OP_WRITE, 0, 1, [u32::MAX, u32::MAX, 0xffff]),
                facts(&plain, true),
                Err(Status::LBA_OUT_OF_RANGE),
            ),
            (
                "beyond MDTS",
                sqe(OP_READ, 0, 1, [0, 0, 256]),
                facts(&plain, true),
                Err(Status::INVALID_FIELD),
            ),
            (
                "at MDTS",
                sqe(OP_READ, 0, 1, [0, 0, 255]),
                facts(&plain, true),
                rw(false, 0, 256, false),
            ),
        ]);
    }

    /// Statuses in the order NVMe reports them: opcode, fused operation, namespace,
    /// a Format NVM in progress.
    #[test]
    fn refusals_in_status_order() {
        let plain = info(false, true);
        check(&[
            (
                "unknown opcode",
                sqe(0x7f, 0, 1, [0; 3]),
                facts(&plain, true),
                Err(Status::INVALID_OPCODE),
            ),
            (
                "unknown opcode, no namespace",
                sqe(0x7f, 0, 9, [0; 3]),
                None,
                Err(Status::INVALID_OPCODE),
            ),
            (
                "fused",
                sqe(OP_READ, 1, 1, [0; 3]),
                facts(&plain, true),
                Err(Status::INVALID_FIELD),
            ),
            (
                "fused, no namespace",
                sqe(OP_READ, 2, 9, [0; 3]),
                None,
                Err(Status::INVALID_FIELD),
            ),
            (
                "no namespace",
                sqe(OP_READ, 0, 9, [0; 3]),
                None,
                Err(Status::INVALID_NAMESPACE),
            ),
            (
                "read while formatting",
                sqe(OP_READ, 0, 1, [0; 3]),
                formatting(&plain),
                Err(Status::FORMAT_IN_PROGRESS),
            ),
            (
                "flush while formatting",
                sqe(OP_FLUSH, 0, 1, [0; 3]),
                formatting(&plain),
                Err(Status::FORMAT_IN_PROGRESS),
            ),
            (
                "unknown opcode while formatting",
                sqe(0x7f, 0, 1, [0; 3]),
                formatting(&plain),
                Err(Status::INVALID_OPCODE),
            ),
        ]);
    }

    /// Flush, Write Zeroes (only where the backend has it) and Dataset Management.
    #[test]
    fn flush_write_zeroes_and_dsm() {
        let plain = info(false, true);
        let cached = info(true, false);
        check(&[
            (
                "flush",
                sqe(OP_FLUSH, 0, 1, [0; 3]),
                facts(&plain, true),
                Ok(IoCmd::Flush),
            ),
            (
                "write zeroes",
                sqe(OP_WRITE_ZEROES, 0, 1, [4, 0, 3 | FUA]),
                facts(&plain, true),
                Ok(IoCmd::WriteZeroes {
                    slba: 4,
                    offset: 2048,
                    len: 2048,
                    fua: true,
                }),
            ),
            (
                "write zeroes past the end",
                sqe(OP_WRITE_ZEROES, 0, 1, [999, 0, 1]),
                facts(&plain, true),
                Err(Status::LBA_OUT_OF_RANGE),
            ),
            (
                "write zeroes unsupported",
                sqe(OP_WRITE_ZEROES, 0, 1, [0; 3]),
                facts(&cached, true),
                Err(Status::INVALID_OPCODE),
            ),
            (
                "DSM deallocate",
                sqe(OP_DSM, 0, 1, [2, 1 << 2, 0]),
                facts(&plain, true),
                Ok(IoCmd::Dsm {
                    ranges: 3,
                    deallocate: true,
                }),
            ),
            (
                "DSM most ranges",
                sqe(OP_DSM, 0, 1, [0xff, 0, 0]),
                facts(&plain, true),
                Ok(IoCmd::Dsm {
                    ranges: 256,
                    deallocate: false,
                }),
            ),
        ]);
    }

    /// A read-only namespace refuses what writes, after the range check.
    #[test]
    fn read_only_namespace() {
        let ro = read_only_info();
        check(&[
            (
                "read, read-only",
                sqe(OP_READ, 0, 1, [0, 0, 0]),
                facts(&ro, true),
                rw(false, 0, 1, false),
            ),
            (
                "write, read-only",
                sqe(OP_WRITE, 0, 1, [0, 0, 0]),
                facts(&ro, true),
                Err(Status::WRITE_TO_READ_ONLY),
            ),
            (
                "write past the end, read-only",
                sqe(OP_WRITE, 0, 1, [999, 0, 1]),
                facts(&ro, true),
                Err(Status::LBA_OUT_OF_RANGE),
            ),
            (
                "write zeroes, read-only",
                sqe(OP_WRITE_ZEROES, 0, 1, [0, 0, 0]),
                facts(&ro, true),
                Err(Status::WRITE_TO_READ_ONLY),
            ),
            (
                "flush, read-only",
                sqe(OP_FLUSH, 0, 1, [0; 3]),
                facts(&ro, true),
                Ok(IoCmd::Flush),
            ),
        ]);
    }
}
