//! The control plane's view of a device, whatever its front end: every kind (NVMe
//! over vfio-user, virtio-blk over vhost-user, the next one) implements
//! [`FrontEnd`], and the server, the RPC methods, stats, traces and metrics work
//! with `Box<dyn FrontEnd>` only. What one kind alone can do (NVMe namespaces,
//! moving vhost-user-blk queues) is reached through `as_nvme_mut`/`as_vhost_mut`,
//! defined next to each device type.

use std::time::Duration;

use anyhow::Result;
use lifecycle::Record;
use serde_json::Value;

use crate::nsspec::NsSpec;
use crate::stats::Traced;

/// One disk of a device as the lifecycle sees it: named for messages, with its spec
/// (whose kind says whether another process may open it) and its handle.
pub struct DiskRef {
    pub name: String,
    pub spec: NsSpec,
    pub disk: std::sync::Arc<bdev::QosDisk>,
}

pub trait FrontEnd: Traced + Send {
    /// What it is, for messages: "an NVMe controller".
    fn what(&self) -> &'static str;
    /// The RPC method that removes it.
    fn remove_method(&self) -> &'static str;
    /// A client (VMM) is connected.
    fn connected(&self) -> bool;
    /// Whether it writes its disks now (a live migration's source after its
    /// VM left, or destination before it arrived, does not).
    fn writes_disk(&self) -> bool {
        true
    }
    /// Stops serving and removes the socket.
    fn stop(self: Box<Self>);
    /// Its `get_devices` entry: configuration and state.
    fn json(&self) -> Value;
    /// One line for the start-up banner.
    fn banner(&self) -> String;
    /// How to attach a VM (and measure the device), printed at start-up.
    fn attach_hint(&self) -> String;
    /// The QoS wrapper of disk `nsid` (`None`: the device's only disk).
    fn qos(&self, nsid: Option<u32>) -> Result<std::sync::Arc<bdev::QosDisk>>;
    /// How its queues wait for work, applied while they run.
    fn set_poll_mode(&mut self, mode: engine::PollMode) -> Result<()>;
    /// Gives disk `nsid` (`None`: the device's only disk) a new size while the
    /// guest uses it (decision 0018): `crate::resize::check`, the backend's resized
    /// handle through the disk's QoS wrapper, the queues switched to it, the guest
    /// told, and the configuration (`json`) updated.
    fn resize(
        &mut self,
        nsid: Option<u32>,
        req: &crate::resize::ResizeRequest,
    ) -> std::result::Result<crate::resize::Resized, crate::resize::ResizeError>;

    // The lifecycle (docs/decisions/0031-lifecycle-layer.md): a live handover and
    // a supervised restart are sequences of these, and VM migration will be.

    /// Stops serving at a message boundary (the client's messages wait in its
    /// socket) and lets what is in flight finish, within `limit`. On error nothing
    /// stays paused.
    fn pause(&self, limit: Duration) -> Result<()>;
    /// Serves again: after a pause whose handover failed, or — a device restored
    /// from a predecessor's records, built paused — once the predecessor let go.
    fn resume(&mut self);
    /// While paused: the records a successor restores the device from, besides
    /// those the device keeps with its keeper as it runs (keys under its prefix).
    fn save(&self) -> Result<Vec<Record>>;
    /// A device restored from a predecessor's records: checks the state it
    /// brought, before the predecessor is told to let go.
    fn check_restored(&self) -> Result<()> {
        Ok(())
    }
    /// Its disks.
    fn disks(&self) -> Vec<DiskRef>;

    /// The concrete device, for what one kind alone has: `as_nvme_mut` (in
    /// `device.rs`) and `as_vhost`/`as_vhost_mut` (in `vhost_device.rs`) downcast
    /// through these, so this trait needs neither type.
    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// A device the server runs.
pub type Device = Box<dyn FrontEnd>;

/// `udrive perf` on a device, when the tools are built in.
pub fn measure_hint(flag: &str, socket: &std::path::Path) -> String {
    if cfg!(feature = "tools") {
        format!(
            "Or measure it: {} perf --{flag} {} --rw randread --bs 4096 --qd 32 --time 10",
            crate::stdout::self_command(),
            socket.display()
        )
    } else {
        String::new()
    }
}
