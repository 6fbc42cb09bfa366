//! Helpers the bdev integration tests share.

use bdev::{IoChannel, IoOp, IoRequest, IoStatus, RequestList};
use guest_mem::DmaSlice;

pub fn req<'a>(op: IoOp, offset: u64, len: u64, iov: &'a [DmaSlice<'a>]) -> IoRequest<'a> {
    IoRequest {
        op,
        offset,
        len,
        iov,
        fua: false,
    }
}

/// Submits `reqs` as one batch (tags 0, 1, ...); their inline statuses.
pub fn batch(ch: &mut dyn IoChannel, reqs: &[IoRequest<'_>]) -> Vec<Option<IoStatus>> {
    let mut list = RequestList::new(reqs.iter().enumerate().map(|(i, r)| (i as u64, *r)));
    ch.submit_batch(&mut list);
    list.inline()
}
