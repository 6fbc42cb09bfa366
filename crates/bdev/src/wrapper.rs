//! Devices and channels that wrap another one (slice, QoS, fault injection) pass
//! every method they do not change on to what they wrap. The forwarding is
//! written here once, as the defaults of [`DeviceWrapper`] and
//! [`ChannelWrapper`], and a blanket impl makes every wrapper a [`BlockDevice`]
//! or [`IoChannel`]: a method added to those traits gets its forwarding default
//! here, and no wrapper can drop it by forgetting to write it.

use std::any::Any;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Instant;

use crate::{
    submit_each, Armed, Batch, BlockDevice, BlockInfo, FormatSupport, IoChannel, IoOp, IoRequest,
    IoStatus,
};

/// A device that wraps another one. Implementing it implements [`BlockDevice`];
/// override what the wrapper changes.
pub trait DeviceWrapper: Send + Sync {
    /// The device this one wraps.
    fn inner(&self) -> &dyn BlockDevice;
    /// What the wrapper is called in [`BlockDevice::describe`] (`qos` in
    /// `qos:ram:1073741824`).
    fn kind(&self) -> &'static str;
    /// A channel for the calling thread: the wrapper's own, around one of the
    /// inner device's.
    fn channel(&self) -> io::Result<Box<dyn IoChannel>>;
    /// This wrapper, with its state, around `inner`: a new handle of the inner
    /// device ([`BlockDevice::resize`]). No default, so that a resize through a
    /// wrapper never loses the wrapper.
    fn rewrap(&self, inner: Arc<dyn BlockDevice>) -> io::Result<Arc<dyn BlockDevice>>;

    fn describe(&self) -> String {
        format!("{}:{}", self.kind(), self.inner().describe())
    }
    fn info(&self) -> &BlockInfo {
        self.inner().info()
    }
    /// The inner device resized, wrapped again ([`DeviceWrapper::rewrap`]).
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        self.rewrap(self.inner().resize(bytes)?)
    }
    /// The inner backend: a wrapper that shows only part of it overrides this.
    fn as_any(&self) -> Option<&dyn Any> {
        self.inner().as_any()
    }
    fn encrypted_volume(&self) -> Option<&dyn BlockDevice> {
        self.inner().encrypted_volume()
    }
    fn format_support(&self) -> FormatSupport {
        self.inner().format_support()
    }
    fn pause(&self) -> io::Result<()> {
        self.inner().pause()
    }
    fn resume(&self, dead_owners: &[String]) -> io::Result<()> {
        self.inner().resume(dead_owners)
    }
}

impl<W: DeviceWrapper> BlockDevice for W {
    fn describe(&self) -> String {
        DeviceWrapper::describe(self)
    }
    fn info(&self) -> &BlockInfo {
        DeviceWrapper::info(self)
    }
    fn channel(&self) -> io::Result<Box<dyn IoChannel>> {
        DeviceWrapper::channel(self)
    }
    fn resize(&self, bytes: u64) -> io::Result<Arc<dyn BlockDevice>> {
        DeviceWrapper::resize(self, bytes)
    }
    fn as_any(&self) -> Option<&dyn Any> {
        DeviceWrapper::as_any(self)
    }
    fn encrypted_volume(&self) -> Option<&dyn BlockDevice> {
        DeviceWrapper::encrypted_volume(self)
    }
    fn format_support(&self) -> FormatSupport {
        DeviceWrapper::format_support(self)
    }
    fn pause(&self) -> io::Result<()> {
        DeviceWrapper::pause(self)
    }
    fn resume(&self, dead_owners: &[String]) -> io::Result<()> {
        DeviceWrapper::resume(self, dead_owners)
    }
}

/// A channel that wraps another one. Implementing it implements [`IoChannel`];
/// override what the wrapper changes.
pub trait ChannelWrapper: Send {
    /// The channel this one wraps.
    fn inner(&self) -> &dyn IoChannel;
    fn inner_mut(&mut self) -> &mut dyn IoChannel;

    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        self.inner_mut().submit(tag, req)
    }
    /// Each request through this wrapper's own [`ChannelWrapper::submit`], so
    /// that whatever the wrapper does to a request applies to a batch too. A
    /// wrapper that can hand a batch on whole overrides this, so that the backend
    /// orders the batch's work itself.
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        submit_each(batch, |tag, req| ChannelWrapper::submit(self, tag, req))
    }
    fn announce(&mut self, op: IoOp, offset: u64, len: u64) {
        self.inner_mut().announce(op, offset, len)
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        self.inner_mut().poll(done)
    }
    fn flush(&mut self) {
        self.inner_mut().flush()
    }
    fn room(&self) -> usize {
        self.inner().room()
    }
    fn arm_notifier(&mut self) -> Armed {
        self.inner_mut().arm_notifier()
    }
    fn wake_by(&self) -> Option<Instant> {
        self.inner().wake_by()
    }
    fn notifier(&self) -> Option<BorrowedFd<'_>> {
        self.inner().notifier()
    }
    fn slow_completions(&self) -> bool {
        self.inner().slow_completions()
    }
}

impl<W: ChannelWrapper> IoChannel for W {
    fn submit(&mut self, tag: u64, req: &IoRequest<'_>) -> Option<IoStatus> {
        ChannelWrapper::submit(self, tag, req)
    }
    fn submit_batch(&mut self, batch: &mut dyn Batch) -> usize {
        ChannelWrapper::submit_batch(self, batch)
    }
    fn announce(&mut self, op: IoOp, offset: u64, len: u64) {
        ChannelWrapper::announce(self, op, offset, len)
    }
    fn poll(&mut self, done: &mut dyn FnMut(u64, IoStatus)) -> usize {
        ChannelWrapper::poll(self, done)
    }
    fn flush(&mut self) {
        ChannelWrapper::flush(self)
    }
    fn room(&self) -> usize {
        ChannelWrapper::room(self)
    }
    fn arm_notifier(&mut self) -> Armed {
        ChannelWrapper::arm_notifier(self)
    }
    fn wake_by(&self) -> Option<Instant> {
        ChannelWrapper::wake_by(self)
    }
    fn notifier(&self) -> Option<BorrowedFd<'_>> {
        ChannelWrapper::notifier(self)
    }
    fn slow_completions(&self) -> bool {
        ChannelWrapper::slow_completions(self)
    }
}
