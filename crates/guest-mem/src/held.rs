//! [`HeldIov`]: a request's buffer list kept beyond the `submit` call that lent it.

use crate::DmaSlice;

/// A copy of a request's buffer list, for a backend wrapper that holds requests
/// past `submit` (the QoS wrapper while a request waits for tokens). The caller's
/// iovec array is borrowed only for the call, but the memory it points to stays
/// valid until the request completes (the backend contract, `bdev::BlockDevice`);
/// this type is that promise written down once. One per request slot, reused: once
/// its capacity has grown to the longest list, holding a request allocates nothing.
#[derive(Debug, Default)]
pub struct HeldIov {
    segs: Vec<DmaSlice<'static>>,
}

impl HeldIov {
    /// Holds a copy of `iov`, replacing what was held.
    ///
    /// # Safety
    /// The memory behind every slice of `iov` must stay valid until [`HeldIov::clear`]
    /// is called (or this value is dropped), and [`HeldIov::slices`] must not be used
    /// after the request it belongs to completed.
    pub unsafe fn hold(&mut self, iov: &[DmaSlice<'_>]) {
        self.segs.clear();
        self.segs.extend(iov.iter().map(|s| {
            // SAFETY: valid for as long as this hold, per the caller's promise; the
            // 'static lifetime never leaves this type (`slices` borrows `self`).
            unsafe { DmaSlice::from_raw_parts(s.as_ptr(), s.len()) }
        }));
    }

    /// The held buffers, to pass the request on.
    pub fn slices(&self) -> &[DmaSlice<'_>] {
        &self.segs
    }

    /// Forgets the buffers (the request was passed on or dropped).
    pub fn clear(&mut self) {
        self.segs.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MappedRegion;

    #[test]
    fn held_buffers_reach_the_same_memory_and_clear() {
        let r = MappedRegion::anonymous(0, 8192).unwrap();
        let a = r.slice(0, 4096).unwrap();
        let b = r.slice(4096, 512).unwrap();
        let mut held = HeldIov::default();
        // SAFETY: `r` outlives `held`'s use below.
        unsafe { held.hold(&[a, b]) };
        assert_eq!(held.slices().len(), 2);
        held.slices()[1].fill(7);
        let mut out = [0u8; 1];
        b.read_into(0, &mut out).unwrap();
        assert_eq!(out[0], 7);
        held.clear();
        assert!(held.slices().is_empty());
    }
}
