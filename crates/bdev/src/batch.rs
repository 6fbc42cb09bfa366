//! How a front end hands a channel several requests at once ([`Batch`]), and a
//! batch over a list of requests for callers that have them in one
//! ([`RequestList`]: tests and tools; front ends keep requests in their own slots).

use crate::{IoRequest, IoStatus};

/// Requests a front end hands a channel together ([`IoChannel::submit_batch`]).
///
/// The front end keeps the requests and their buffer lists in its own
/// preallocated slots (no copy, no allocation); the channel reads them by index,
/// any number of times, and reports each one's start exactly once, in index
/// order, before `submit_batch` returns. A request read ahead of its start may
/// be read again: the front end does not change it in between.
pub trait Batch {
    /// Request `i` and the tag its asynchronous completion is reported with;
    /// `None` from the end of the batch on.
    fn request(&self, i: usize) -> Option<(u64, IoRequest<'_>)>;
    /// Request `i` has been started: `Some(status)` if the channel finished it
    /// inline (the front end may post it at once), `None` if
    /// [`IoChannel::poll`] reports it later.
    fn started(&mut self, i: usize, inline: Option<IoStatus>);
}

/// Starts the requests of `batch` one by one with `submit`, reporting each start:
/// [`IoChannel::submit_batch`]'s default, for channels and wrappers that take
/// requests one at a time. Returns how many did not finish inline.
pub fn submit_each(
    batch: &mut dyn Batch,
    mut submit: impl FnMut(u64, &IoRequest<'_>) -> Option<IoStatus>,
) -> usize {
    let mut pending = 0;
    let mut i = 0;
    loop {
        let Some(st) = batch.request(i).map(|(tag, req)| submit(tag, &req)) else {
            return pending;
        };
        pending += usize::from(st.is_none());
        batch.started(i, st);
        i += 1;
    }
}

/// Requests in a list, as a [`Batch`] that records how each one started. It
/// allocates: for tests and tools, not the I/O path.
#[derive(Debug, Default)]
pub struct RequestList<'a> {
    requests: Vec<(u64, IoRequest<'a>)>,
    started: Vec<Option<Option<IoStatus>>>,
}

impl<'a> RequestList<'a> {
    /// The requests, each with its tag, in submission order.
    pub fn new(requests: impl IntoIterator<Item = (u64, IoRequest<'a>)>) -> RequestList<'a> {
        let requests: Vec<_> = requests.into_iter().collect();
        let started = vec![None; requests.len()];
        RequestList { requests, started }
    }

    /// How request `i` started: `None` if it was not (yet), else what
    /// [`Batch::started`] was told.
    pub fn start(&self, i: usize) -> Option<Option<IoStatus>> {
        self.started.get(i).copied().flatten()
    }

    /// The inline statuses, in order (`None` for requests that went
    /// asynchronous or did not start).
    pub fn inline(&self) -> Vec<Option<IoStatus>> {
        self.started.iter().map(|s| s.flatten()).collect()
    }
}

impl Batch for RequestList<'_> {
    fn request(&self, i: usize) -> Option<(u64, IoRequest<'_>)> {
        self.requests.get(i).copied()
    }

    /// Records the start; a second start of one request is a channel's bug.
    fn started(&mut self, i: usize, inline: Option<IoStatus>) {
        if let Some(s) = self.started.get_mut(i) {
            assert!(s.is_none(), "request {i} of a batch started twice");
            *s = Some(inline);
        }
    }
}
