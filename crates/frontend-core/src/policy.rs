//! The block-device rules every front end applies before a request reaches the
//! backend, whatever its protocol: the range check (blocks or sectors to bytes, with
//! overflow and capacity checks), the read-only policy, and FUA when the guest turned
//! the volatile write cache off. Pure functions of the request and the disk's facts;
//! what a refusal is called on the wire is the protocol's business
//! ([`crate::StatusMap::refused`]).

use bdev::{BlockInfo, IoOp};

/// Why a request is refused before it reaches the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The range does not fit in the disk (or its arithmetic overflows).
    OutOfRange,
    /// The range is not a whole number of the disk's blocks.
    Misaligned,
    /// A write, write zeroes or discard to a read-only disk.
    ReadOnly,
}

/// A checked request range in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub offset: u64,
    pub len: u64,
}

/// What the policy needs to know about a disk as one guest sees it.
#[derive(Clone, Copy, Debug)]
pub struct Disk<'a> {
    pub info: &'a BlockInfo,
    /// The guest has the volatile write cache enabled (NVMe Set Features 06h,
    /// virtio-blk `writeback`). Meaningless when the backend has no cache.
    pub cache_on: bool,
}

impl Disk<'_> {
    /// `count` blocks from block `first` (NVMe: SLBA and NLB, DSM ranges). `count`
    /// may be 0 (an empty range, valid anywhere up to the end of the disk).
    pub fn blocks(&self, first: u64, count: u64) -> Result<ByteRange, Refusal> {
        let end = first.checked_add(count).ok_or(Refusal::OutOfRange)?;
        if end > self.info.num_blocks {
            return Err(Refusal::OutOfRange);
        }
        let bs = u64::from(self.info.block_size);
        match (first.checked_mul(bs), count.checked_mul(bs)) {
            (Some(offset), Some(len)) => Ok(ByteRange { offset, len }),
            _ => Err(Refusal::OutOfRange),
        }
    }

    /// `len` bytes from `first` units of `unit` bytes (virtio-blk: 512-byte
    /// sectors), which must be whole blocks of the disk and inside it. `len` may be
    /// 0.
    pub fn units(&self, first: u64, unit: u64, len: u64) -> Result<ByteRange, Refusal> {
        let offset = first.checked_mul(unit).ok_or(Refusal::OutOfRange)?;
        let bs = u64::from(self.info.block_size.max(1));
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(Refusal::Misaligned);
        }
        if !bdev::in_range(offset, len, self.info.size_bytes()) {
            return Err(Refusal::OutOfRange);
        }
        Ok(ByteRange { offset, len })
    }

    /// Whether the disk takes `op`: a read-only disk refuses everything that
    /// changes its content (flush is fine).
    pub fn allows(&self, op: IoOp) -> Result<(), Refusal> {
        match op {
            IoOp::Write | IoOp::WriteZeroes | IoOp::Discard if self.info.read_only => {
                Err(Refusal::ReadOnly)
            }
            _ => Ok(()),
        }
    }

    /// Whether the request must be durable on completion: the guest asked for it
    /// (`requested`), or it is a write to a disk with a volatile cache that the
    /// guest turned off (then every write is made durable, since the guest will not
    /// send flushes).
    pub fn fua(&self, op: IoOp, requested: bool) -> bool {
        requested || (op == IoOp::Write && self.info.write_cache && !self.cache_on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(block_size: u32, num_blocks: u64) -> BlockInfo {
        BlockInfo {
            block_size,
            num_blocks,
            volatile: false,
            write_cache: true,
            read_only: false,
            discard: true,
            write_zeroes: true,
            discard_zeroes: true,
        }
    }

    #[test]
    fn block_ranges() {
        let i = info(512, 1000);
        let d = Disk {
            info: &i,
            cache_on: true,
        };
        let r = |offset, len| Ok(ByteRange { offset, len });
        use Refusal::OutOfRange as Out;
        let cases: &[(&str, u64, u64, Result<ByteRange, Refusal>)] = &[
            ("first block", 0, 1, r(0, 512)),
            ("last block", 999, 1, r(999 * 512, 512)),
            ("whole disk", 0, 1000, r(0, 512_000)),
            ("one past the end", 999, 2, Err(Out)),
            ("starts at the end", 1000, 1, Err(Out)),
            ("zero length inside", 5, 0, r(2560, 0)),
            ("zero length at the end", 1000, 0, r(512_000, 0)),
            ("zero length past the end", 1001, 0, Err(Out)),
            ("first + count overflows", u64::MAX, 1, Err(Out)),
            ("count overflows", 1, u64::MAX, Err(Out)),
            ("huge first", u64::MAX / 2, 0, Err(Out)),
        ];
        for (what, first, count, want) in cases {
            assert_eq!(d.blocks(*first, *count), *want, "{what}");
        }
        // A disk whose size in bytes would not fit in u64: the byte arithmetic
        // overflows before the block check can let it through.
        let big = info(4096, u64::MAX);
        let d = Disk {
            info: &big,
            cache_on: true,
        };
        assert_eq!(d.blocks(u64::MAX / 2, 1), Err(Out));
        assert_eq!(d.blocks(0, u64::MAX / 2), Err(Out));
    }

    #[test]
    fn sector_ranges() {
        let i = info(4096, 100); // 409600 bytes, 800 sectors
        let d = Disk {
            info: &i,
            cache_on: true,
        };
        let r = |offset, len| Ok(ByteRange { offset, len });
        let cases: &[(&str, u64, u64, Result<ByteRange, Refusal>)] = &[
            ("first block", 0, 4096, r(0, 4096)),
            ("last block", 792, 4096, r(792 * 512, 4096)),
            ("past the end", 792, 8192, Err(Refusal::OutOfRange)),
            ("sector not on a block", 1, 4096, Err(Refusal::Misaligned)),
            ("length not whole blocks", 0, 512, Err(Refusal::Misaligned)),
            ("zero length", 8, 0, r(4096, 0)),
            ("zero length at the end", 800, 0, r(409_600, 0)),
            ("zero length past the end", 808, 0, Err(Refusal::OutOfRange)),
            ("sector overflows", u64::MAX, 0, Err(Refusal::OutOfRange)),
            (
                "length overflows",
                8,
                u64::MAX - 4095,
                Err(Refusal::OutOfRange),
            ),
        ];
        for (what, sector, len, want) in cases {
            assert_eq!(d.units(*sector, 512, *len), *want, "{what}");
        }
    }

    #[test]
    fn read_only_and_fua() {
        let mut i = info(512, 10);
        let on = Disk {
            info: &i,
            cache_on: true,
        };
        assert!(!on.fua(IoOp::Write, false));
        assert!(on.fua(IoOp::Write, true));
        let off = Disk {
            info: &i,
            cache_on: false,
        };
        assert!(off.fua(IoOp::Write, false), "cache off: writes are FUA");
        assert!(!off.fua(IoOp::Read, false));
        assert!(!off.fua(IoOp::WriteZeroes, false));
        assert!(off.fua(IoOp::WriteZeroes, true));
        i.write_cache = false;
        let nocache = Disk {
            info: &i,
            cache_on: false,
        };
        assert!(!nocache.fua(IoOp::Write, false), "no cache to bypass");
        for op in [
            IoOp::Read,
            IoOp::Write,
            IoOp::Flush,
            IoOp::WriteZeroes,
            IoOp::Discard,
        ] {
            assert_eq!(nocache.allows(op), Ok(()));
        }
        i.read_only = true;
        let ro = Disk {
            info: &i,
            cache_on: true,
        };
        for (op, ok) in [
            (IoOp::Read, true),
            (IoOp::Flush, true),
            (IoOp::Write, false),
            (IoOp::WriteZeroes, false),
            (IoOp::Discard, false),
        ] {
            let want = if ok { Ok(()) } else { Err(Refusal::ReadOnly) };
            assert_eq!(ro.allows(op), want, "{op:?}");
        }
    }
}
