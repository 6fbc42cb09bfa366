//! Namespaces added and removed at run time.
//!
//! The control path owns the table in `State::ns`; every queue group holds its own
//! copy (with its I/O channels), so the I/O path looks namespaces up without a lock.
//! A change goes to the groups as a message: each group is taken off its reactor
//! (`Engine::remove_poller` returns once the reactor let go of it between two poll
//! iterations), the change is applied, and the group goes back. Commands in flight
//! keep their channel: a removed namespace's channel moves to the group's retiring
//! list and is polled until its requests complete; new commands for that NSID get
//! Invalid Namespace. Then the host is told with a Namespace Attribute Changed event
//! and the Changed Namespace List log page.
//!
//! A resize (docs/decisions/0018-online-resize.md) replaces the namespace's backend
//! handle the same way: each group gets a channel on the new handle, the old one
//! retires with the requests it holds, and commands from then on are checked
//! against the new size (beyond it: LBA Out of Range).

use bdev::BlockInfo;

use crate::ctrl::{Inner, State};
use crate::io::{NsChan, NsChange};
pub(crate) use crate::ns::{
    check_block_size, Namespace, Ns, NsError, NsNotice, AEC_NS_ATTR, EVENT_NS_CHANGED,
};

/// Entries the Changed Namespace List holds before it reports "more than 1024".
const CHANGED_LIST_MAX: usize = 1024;

impl Inner {
    fn ns_range(&self, nsid: u32) -> Result<usize, NsError> {
        if nsid == 0 || nsid > self.cfg.max_namespaces {
            return Err(NsError::OutOfRange(nsid, self.cfg.max_namespaces));
        }
        Ok(nsid as usize - 1)
    }

    /// The lowest inactive NSID.
    pub(crate) fn free_nsid(&self, st: &State) -> Result<u32, NsError> {
        let max = self.cfg.max_namespaces;
        (1..=max)
            .find(|n| st.ns(*n).is_none())
            .ok_or(NsError::Full(max))
    }

    pub(crate) fn add_namespace(&self, nsid: Option<u32>, ns: Namespace) -> Result<u32, NsError> {
        check_block_size(ns.dev.as_ref())?;
        let mut st = self.lock();
        let nsid = match nsid {
            Some(n) => n,
            None => self.free_nsid(&st)?,
        };
        let i = self.ns_range(nsid)?;
        if st.ns.get(i).is_some_and(Option::is_some) {
            return Err(NsError::Exists(nsid));
        }
        // Channels are opened first so a failure changes nothing.
        let ns = Ns::new(ns);
        let mut chans = Vec::new();
        for _ in 0..st.groups.len() {
            chans.push(NsChan::open(&ns).map_err(NsError::Channel)?);
        }
        if st.ns.len() <= i {
            st.ns.resize_with(i + 1, || None);
        }
        st.ns[i] = Some(ns);
        self.change_groups(&mut st, || chans.pop().map(|c| NsChange::Add(nsid, c)));
        self.namespace_changed(&mut st, nsid);
        Ok(nsid)
    }

    pub(crate) fn remove_namespace(&self, nsid: u32) -> Result<Namespace, NsError> {
        let i = self.ns_range(nsid)?;
        let mut st = self.lock();
        if st.ns.get(i).is_none_or(Option::is_none) {
            return Err(NsError::NotFound(nsid));
        }
        // A format erasing it stops first: the backend may be handed to someone
        // else as soon as this returns.
        if st.format.as_ref().is_some_and(|f| f.nsids.contains(&nsid)) {
            self.cancel_format(&st);
        }
        let ns = st
            .ns
            .get_mut(i)
            .and_then(Option::take)
            .map(Ns::namespace)
            .ok_or(NsError::NotFound(nsid))?;
        while st.ns.last().is_some_and(Option::is_none) {
            st.ns.pop();
        }
        self.change_groups(&mut st, || Some(NsChange::Remove(nsid)));
        self.namespace_changed(&mut st, nsid);
        Ok(ns)
    }

    /// Gives namespace `nsid` `bytes` bytes: `resize` makes the backend's new handle
    /// and label (called under the controller's lock after the checks, so no
    /// Format NVM can start in between), every queue group switches to a channel on
    /// it, and the host is told. The LBA size stays the one the host formatted.
    pub(crate) fn resize_namespace(
        &self,
        nsid: u32,
        bytes: u64,
        resize: impl FnOnce(u64) -> std::io::Result<Namespace>,
    ) -> Result<NsNotice, NsError> {
        let i = self.ns_range(nsid)?;
        let mut st = self.lock();
        let Some(ns) = st.ns(nsid) else {
            return Err(NsError::NotFound(nsid));
        };
        if ns.formatting || st.format.as_ref().is_some_and(|f| f.nsids.contains(&nsid)) {
            return Err(NsError::Formatting(nsid));
        }
        let bs = ns.info.block_size;
        if bytes == 0 || !bytes.is_multiple_of(u64::from(bs)) {
            return Err(NsError::Size {
                bytes,
                block_size: bs,
            });
        }
        let old = ns.info.clone();
        let new = resize(bytes).map_err(NsError::Backend)?;
        check_block_size(new.dev.as_ref())?;
        let ns = Ns {
            info: BlockInfo {
                num_blocks: new.dev.info().size_bytes() / u64::from(bs),
                ..old
            },
            dev: new.dev,
            label: new.label,
            formatting: false,
        };
        let mut chans = Vec::new();
        for _ in 0..st.groups.len() {
            chans.push(NsChan::open(&ns).map_err(NsError::Channel)?);
        }
        st.ns[i] = Some(ns);
        self.change_groups(&mut st, || chans.pop().map(|c| NsChange::Add(nsid, c)));
        Ok(self.namespace_changed(&mut st, nsid))
    }

    /// Takes every queue group off its reactor, applies the change, puts it back.
    pub(crate) fn change_groups(
        &self,
        st: &mut State,
        mut change: impl FnMut() -> Option<NsChange>,
    ) {
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        for cqid in ids {
            let Some(mut g) = self.take_group(st, cqid) else {
                continue;
            };
            if let Some(c) = change() {
                g.apply(c);
            }
            if let Err(s) = self.place_group(st, g) {
                tracing::error!(cqid, status = ?s, "nvme: queue group lost during a namespace change");
            }
        }
    }

    /// Records `nsid` in the Changed Namespace List and queues the event unless one
    /// is already waiting for the host to read the log (or the host disabled it).
    pub(crate) fn namespace_changed(&self, st: &mut State, nsid: u32) -> NsNotice {
        if !st.regs.rdy {
            return NsNotice::NotReady;
        }
        st.changed_ns.insert(nsid);
        if st.features.async_events & AEC_NS_ATTR == 0 {
            return NsNotice::Disabled;
        }
        if st.ns_event_masked {
            return NsNotice::Pending;
        }
        st.ns_event_masked = true;
        st.events.push_back(EVENT_NS_CHANGED);
        // Posted now if the host has an AER outstanding (its doorbells may come by
        // message only when it sends something).
        self.admin_poll(st);
        NsNotice::Event
    }

    /// Log page 04h; reading it without Retain Asynchronous Event clears the list
    /// and unmasks the event.
    pub(crate) fn changed_ns_log(&self, st: &mut State, retain: bool) -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        if st.changed_ns.len() > CHANGED_LIST_MAX {
            b[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        } else {
            for (k, id) in st.changed_ns.iter().enumerate() {
                b[k * 4..k * 4 + 4].copy_from_slice(&id.to_le_bytes());
            }
        }
        if !retain {
            st.changed_ns.clear();
            st.ns_event_masked = false;
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_encoding() {
        // Type 2 (notice), info 0 (namespace attribute changed), log page 4.
        assert_eq!(EVENT_NS_CHANGED & 7, 2);
        assert_eq!((EVENT_NS_CHANGED >> 8) & 0xff, 0);
        assert_eq!((EVENT_NS_CHANGED >> 16) & 0xff, 4);
    }
}
