//! Driving a `bdev` channel directly: one request to its completion.

use bdev::{IoChannel, IoOp, IoRequest, IoStatus};
use guest_mem::MappedRegion;

use crate::wait::{wait_until, T};

/// `op` of `len` bytes at `offset` on `ch`, with the first `len` bytes of `buf`
/// as its data (reads and writes), waited for (polling) if it went
/// asynchronous.
pub fn one(
    ch: &mut dyn IoChannel,
    op: IoOp,
    offset: u64,
    buf: &MappedRegion,
    len: usize,
) -> IoStatus {
    let iov = [buf.slice(0, len).unwrap()];
    let n = usize::from(matches!(op, IoOp::Read | IoOp::Write));
    let req = IoRequest {
        op,
        offset,
        len: len as u64,
        iov: &iov[..n],
        fua: false,
    };
    if let Some(st) = ch.submit(7, &req) {
        return st;
    }
    let mut out = None;
    wait_until("completion", T, || {
        ch.flush();
        ch.poll(&mut |_, st| out = Some(st));
        out.is_some()
    });
    out.unwrap()
}
