//! The namespaces a queue group submits to: each one's facts and the group's
//! channel on its backend, and the channels of removed namespaces that still owe
//! completions. A leaf: the stages take the table (or one channel) as a parameter.

use bdev::{BlockInfo, IoChannel};

use crate::ns::Ns;

/// One namespace as a queue group sees it: its facts in the current LBA format and
/// this group's channel on the backend. `inflight` counts backend requests this
/// channel still owes a completion.
pub(crate) struct NsChan {
    pub(super) info: BlockInfo,
    /// A Format NVM is erasing the namespace: commands get Format In Progress.
    pub(super) formatting: bool,
    pub(super) chan: Box<dyn IoChannel>,
    pub(super) inflight: u32,
}

impl NsChan {
    pub fn open(ns: &Ns) -> std::io::Result<NsChan> {
        Ok(NsChan {
            info: ns.info.clone(),
            formatting: ns.formatting,
            chan: ns.dev.channel()?,
            inflight: 0,
        })
    }
}

/// A change of the namespace table, applied to each group while it is off its
/// reactor (see `Inner::change_groups`).
pub(crate) enum NsChange {
    Add(u32, NsChan),
    Remove(u32),
    /// Format NVM: new facts and whether the erase is still running. The channel
    /// stays: backends address bytes, so a new block size needs no new channel.
    Format {
        nsid: u32,
        info: BlockInfo,
        formatting: bool,
    },
}

/// The namespaces a group submits to.
pub(super) struct NsTable {
    /// Active namespaces by `nsid - 1`.
    pub(super) live: Vec<Option<NsChan>>,
    /// Channels of removed (or replaced: resized) namespaces that still have
    /// requests in flight, by NSID: polled until those complete, then dropped. New
    /// commands never reach them.
    pub(super) retiring: Vec<(u32, NsChan)>,
}

impl NsTable {
    pub(super) fn new(live: Vec<Option<NsChan>>) -> NsTable {
        NsTable {
            live,
            retiring: Vec::new(),
        }
    }

    #[inline]
    pub(super) fn get(&self, nsid: u32) -> Option<&NsChan> {
        self.live
            .get((nsid as usize).wrapping_sub(1))
            .and_then(Option::as_ref)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, nsid: u32) -> Option<&mut NsChan> {
        self.live
            .get_mut((nsid as usize).wrapping_sub(1))
            .and_then(Option::as_mut)
    }

    /// Every channel that may owe completions.
    #[inline]
    pub(super) fn all_mut(&mut self) -> impl Iterator<Item = &mut NsChan> {
        self.live
            .iter_mut()
            .flatten()
            .chain(self.retiring.iter_mut().map(|(_, c)| c))
    }

    #[inline]
    pub(super) fn all(&self) -> impl Iterator<Item = &NsChan> {
        self.live
            .iter()
            .flatten()
            .chain(self.retiring.iter().map(|(_, c)| c))
    }

    /// Whether every live namespace is on a slow channel, so that the driver's next
    /// command, wherever it goes, could not complete before the next slow
    /// completion anyway. A fast namespace beside a slow one keeps its doorbells:
    /// its commands must not wait for the other's next completion (a throttled
    /// namespace's next token may be milliseconds away).
    pub(super) fn only_slow(&self) -> bool {
        self.live
            .iter()
            .flatten()
            .all(|c| c.chan.slow_completions())
    }

    /// Requests the group's channels take now (back-pressure): the least of them.
    #[inline]
    pub(super) fn room(&self) -> usize {
        self.live
            .iter()
            .flatten()
            .map(|c| c.chan.room())
            .min()
            .unwrap_or(usize::MAX)
    }

    #[inline]
    pub(super) fn flush(&mut self) {
        for c in self.live.iter_mut().flatten() {
            c.chan.flush();
        }
    }

    #[inline]
    pub(super) fn drop_retired(&mut self) {
        if !self.retiring.is_empty() {
            self.retiring.retain(|(_, c)| c.inflight > 0);
        }
    }

    fn retire(&mut self, nsid: u32, c: NsChan) {
        if c.inflight > 0 {
            self.retiring.push((nsid, c));
        }
    }

    pub(super) fn apply(&mut self, change: NsChange) {
        match change {
            NsChange::Add(nsid, chan) => {
                let i = (nsid as usize).saturating_sub(1);
                if self.live.len() <= i {
                    self.live.resize_with(i + 1, || None);
                }
                // A replaced channel (the namespace was resized) finishes what it holds.
                if let Some(old) = self.live[i].replace(chan) {
                    self.retire(nsid, old);
                }
            }
            NsChange::Remove(nsid) => {
                let i = (nsid as usize).wrapping_sub(1);
                if let Some(old) = self.live.get_mut(i).and_then(Option::take) {
                    self.retire(nsid, old);
                }
                while self.live.last().is_some_and(Option::is_none) {
                    self.live.pop();
                }
            }
            NsChange::Format {
                nsid,
                info,
                formatting,
            } => {
                if let Some(c) = self.get_mut(nsid) {
                    c.info = info;
                    c.formatting = formatting;
                }
            }
        }
    }
}
