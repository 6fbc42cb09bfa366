//! Compressed clusters: the extent an L2 entry gives, decoded into exactly one
//! cluster. Raw deflate (`flate2`) or zstd (`ruzstd`, pure Rust): QEMU writes
//! one zstd frame per cluster but reads on frame after frame until the cluster
//! is full, and so does this. Hostile data ends in an error, never a panic: the
//! output is the caller's one cluster, the input at most two, and a zstd
//! frame's window is bounded before the decoder reserves it.

use std::io::{self, Read};

use ruzstd::decoding::{BlockDecodingStrategy, FrameDecoder};

/// The compression type field of the header.
pub(super) const DEFLATE: u8 = 0;
pub(super) const ZSTD: u8 = 1;

pub(super) fn bad_compressed() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "qcow2: corrupt compressed cluster",
    )
}

/// Decodes `input` (a compressed cluster and whatever padding follows it)
/// into `out`, which it must fill exactly.
pub(super) fn decompress(kind: u8, input: &[u8], out: &mut [u8]) -> io::Result<()> {
    match kind {
        DEFLATE => inflate(input, out),
        ZSTD => unzstd(input, out),
        _ => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "qcow2: unknown compression type",
        )),
    }
}

fn inflate(input: &[u8], out: &mut [u8]) -> io::Result<()> {
    let mut z = flate2::Decompress::new(false);
    let st = z.decompress(input, out, flate2::FlushDecompress::Finish);
    // A full cluster out is success even if the stream has padding left.
    match st {
        Ok(_) if z.total_out() == out.len() as u64 => Ok(()),
        _ => Err(bad_compressed()),
    }
}

/// zstd frames, one after another, until `out` is full; a frame that would
/// produce more than `out` holds is corrupt (as for QEMU; empty blocks after
/// the cluster's bytes are not). Every turn of the loop hands out bytes,
/// consumes input or ends the frame, so it ends; the decoder holds at most its
/// window and one block (128 KiB) it could not hand out.
fn unzstd(input: &[u8], out: &mut [u8]) -> io::Result<()> {
    let mut src = input;
    let mut dec = FrameDecoder::new();
    // QEMU compresses a cluster in one pass with its size known, so zstd picks
    // a window no larger than the cluster; a larger one is not QEMU's and
    // would be reserved up front by the decoder.
    dec.set_max_window_size((out.len() as u64).max(1 << 17));
    let mut at = 0;
    while at < out.len() {
        dec.reset(&mut src).map_err(|_| bad_compressed())?;
        loop {
            if dec.can_collect() > 0 {
                if at == out.len() {
                    return Err(bad_compressed());
                }
                at += dec.read(&mut out[at..]).map_err(|_| bad_compressed())?;
            } else if dec.is_finished() {
                break;
            } else {
                dec.decode_blocks(&mut src, BlockDecodingStrategy::UptoBlocks(1))
                    .map_err(|_| bad_compressed())?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_zstd_is_an_error_not_a_panic() {
        let mut out = vec![0u8; 65536];
        // Empty, garbage, a bare magic, a frame header claiming a huge window.
        let huge_window = [0x28, 0xb5, 0x2f, 0xfd, 0x00, 0xf8, 0, 0, 0];
        let cases: [&[u8]; 4] = [&[], &[0xffu8; 512], &[0x28, 0xb5, 0x2f, 0xfd], &huge_window];
        for c in cases {
            assert!(decompress(ZSTD, c, &mut out).is_err(), "{c:x?}");
        }
        // An empty frame (no blocks, last) then nothing: the cluster stays short.
        let empty = [0x28, 0xb5, 0x2f, 0xfd, 0x20, 0x00, 0x01, 0x00, 0x00];
        assert!(decompress(ZSTD, &empty, &mut out).is_err());
        assert!(decompress(7, &empty, &mut out).is_err());
    }

    #[test]
    fn raw_zstd_blocks_decode_and_overruns_are_refused() {
        // A frame of one raw (stored) last block of 16 bytes, no content size:
        // magic, descriptor (single segment off, window byte), block header.
        let frame = |data: &[u8]| {
            let mut f = vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x00];
            let hdr = ((data.len() as u32) << 3) | 1;
            f.extend_from_slice(&hdr.to_le_bytes()[..3]);
            f.extend_from_slice(data);
            f
        };
        let mut two = frame(&[1u8; 16]);
        two.extend(frame(&[2u8; 16]));
        two.extend([0u8; 100]); // padding after the cluster's frames
        let mut out = [0u8; 32];
        decompress(ZSTD, &two, &mut out).unwrap();
        assert_eq!(&out[..16], &[1u8; 16]);
        assert_eq!(&out[16..], &[2u8; 16]);
        // More than a cluster out of one frame.
        let mut small = [0u8; 8];
        assert!(decompress(ZSTD, &frame(&[3u8; 16]), &mut small).is_err());
        // A frame whose last block is empty, after the cluster's bytes.
        let mut trailing = frame(&[4u8; 16]);
        trailing[6] &= !1; // not the last block
        trailing.extend_from_slice(&1u32.to_le_bytes()[..3]); // empty last raw block
        let mut out = [0u8; 16];
        decompress(ZSTD, &trailing, &mut out).unwrap();
        assert_eq!(out, [4u8; 16]);
    }
}
