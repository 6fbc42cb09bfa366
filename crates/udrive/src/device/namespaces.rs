//! An NVMe controller's namespaces as udrive sees them. The controller's table is
//! the only one: each entry carries a label ([`Namespace`]: how it was specified
//! and its QoS handle) that the NVMe model keeps without looking at it, so adding,
//! removing and resizing change one table under the controller's lock.

use std::sync::Arc;

use anyhow::anyhow;
use bdev::{BlockDevice, QosDisk};
use serde_json::{json, Value};

use super::NvmeDevice;
use crate::config::ControllerConfig;
use crate::nsspec::NsSpec;
use crate::resize::{ResizeError, ResizeRequest, Resized};

/// One namespace of a running controller: how it was specified and its QoS handle
/// (the label of its entry in the controller's table).
#[derive(Clone)]
pub struct Namespace {
    pub spec: NsSpec,
    pub qos: Arc<QosDisk>,
}

impl Namespace {
    fn entry(self) -> nvme::Namespace {
        let dev: Arc<dyn BlockDevice> = self.qos.clone();
        nvme::Namespace::new(dev, nvme::NsLabel::new(self))
    }
}

/// A label the controller keeps for us.
fn label(l: &nvme::NsLabel) -> Option<Namespace> {
    l.get::<Namespace>().cloned()
}

/// The configured namespaces by NSID (`None`: inactive), as the controller starts
/// with them: `devs` are the opened backends in `cfg.namespaces` order.
pub(super) fn by_nsid(
    cfg: &ControllerConfig,
    devs: Vec<Arc<QosDisk>>,
) -> Vec<Option<nvme::Namespace>> {
    let mut out: Vec<Option<nvme::Namespace>> = Vec::new();
    for (i, (spec, qos)) in cfg.namespaces.iter().zip(devs).enumerate() {
        let at = cfg.nsid(i) as usize - 1;
        if out.len() <= at {
            out.resize_with(at + 1, || None);
        }
        let ns = Namespace {
            spec: spec.clone(),
            qos,
        };
        out[at] = Some(ns.entry());
    }
    out
}

impl NvmeDevice {
    /// The active namespaces, by NSID.
    pub fn namespaces(&self) -> Vec<(u32, Namespace)> {
        self.ctrl
            .namespaces()
            .iter()
            .filter_map(|v| Some((v.nsid, label(&v.label)?)))
            .collect()
    }

    /// Namespace `nsid`, or an error that names the ones there are.
    pub fn namespace(&self, nsid: u32) -> anyhow::Result<Namespace> {
        self.ctrl
            .namespace(nsid)
            .and_then(|v| label(&v.label))
            .ok_or_else(|| {
                anyhow!(
                    "controller {} has no namespace {nsid} (namespaces: {})",
                    self.socket.display(),
                    self.namespace_specs().join(", ")
                )
            })
    }

    /// Namespace specs in NSID order, for messages.
    pub fn namespace_specs(&self) -> Vec<String> {
        self.namespaces()
            .iter()
            .map(|(id, n)| format!("{id}={}", n.spec))
            .collect()
    }

    /// Adds namespace `nsid` (`None`: the lowest free one) on the backend `open`
    /// gives for the NSID it gets; returns the NSID. The host is told.
    pub fn add_namespace(
        &self,
        nsid: Option<u32>,
        spec: NsSpec,
        open: impl FnOnce(u32) -> anyhow::Result<Arc<QosDisk>>,
    ) -> anyhow::Result<u32> {
        let what = || format!("controller {}", self.socket.display());
        let nsid = match nsid {
            Some(n) => n,
            None => self
                .ctrl
                .free_nsid()
                .map_err(|e| anyhow!(e).context(what()))?,
        };
        let qos = open(nsid)?;
        let ns = Namespace { spec, qos }.entry();
        self.ctrl
            .add_namespace(nsid, ns)
            .map_err(|e| anyhow!(e).context(format!("{}: cannot add namespace {nsid}", what())))
    }

    /// Removes namespace `nsid`: commands in flight finish, new ones fail with
    /// Invalid Namespace, and the host is told.
    pub fn remove_namespace(&self, nsid: u32) -> anyhow::Result<()> {
        self.ctrl
            .remove_namespace(nsid)
            .map_err(|e| anyhow!(e).context(format!("controller {}", self.socket.display())))?;
        Ok(())
    }

    /// Gives namespace `nsid` a new size while the guest uses it (decision 0018).
    pub(super) fn resize_namespace(
        &self,
        nsid: u32,
        req: &ResizeRequest,
    ) -> Result<Resized, ResizeError> {
        let ns = self.namespace(nsid)?;
        let who = format!(
            "namespace {nsid} ({}) of {}",
            ns.spec,
            self.socket.display()
        );
        // The host addresses it in its current LBA size (Format NVM may have
        // changed it); the backend's size is what grows or shrinks.
        let block_size = self
            .ctrl
            .namespace_info(nsid)
            .map_or(ns.qos.info().block_size, |i| i.block_size);
        let old_bytes = ns.qos.info().size_bytes();
        crate::resize::check(&who, &ns.spec, old_bytes, block_size, req)?;
        if req.bytes == old_bytes {
            return Ok(crate::resize::unchanged(old_bytes, block_size));
        }
        let notice = self
            .ctrl
            .resize_namespace(nsid, req.bytes, |b| {
                let resized = Namespace {
                    spec: ns.spec.resized(b),
                    qos: Arc::new(ns.qos.resized(b)?),
                };
                Ok(resized.entry())
            })
            .map_err(|e| resize_error(e, &who))?;
        let (notified, notice) = notice_text(notice);
        Ok(Resized {
            old_bytes,
            new_bytes: req.bytes,
            block_size,
            notified,
            notice: notice.into(),
        })
    }
}

fn resize_error(e: nvme::NsError, who: &str) -> ResizeError {
    match e {
        nvme::NsError::Size { bytes, block_size } => ResizeError::BadSize {
            who: who.to_string(),
            bytes,
            block_size,
        },
        // Only the channels come after the backend's resize.
        e @ nvme::NsError::Channel(_) => anyhow::Error::new(e)
            .context(format!(
                "{who}: the backend has the new size, the namespace keeps the old one"
            ))
            .into(),
        e => anyhow::Error::new(e).context(who.to_string()).into(),
    }
}

/// Whether the host was told of a resize, and how.
fn notice_text(n: nvme::NsNotice) -> (bool, &'static str) {
    match n {
        nvme::NsNotice::Event => (
            true,
            "Namespace Attribute Changed event sent; the host reads the Changed Namespace List",
        ),
        nvme::NsNotice::Pending => (
            true,
            "added to the Changed Namespace List of the event the host has not acknowledged yet",
        ),
        nvme::NsNotice::Disabled => (
            false,
            "the host did not enable Namespace Attribute Notices: it sees the new size when it \
             identifies the namespace again (e.g. nvme ns-rescan)",
        ),
        nvme::NsNotice::NotReady => (
            false,
            "the controller is not enabled: the host sees the new size when it identifies the namespace",
        ),
    }
}

/// `info`: the namespace as the host sees it (after a Format NVM its block size
/// is no longer the backend's); `None` uses the backend's.
pub(crate) fn namespace_json(nsid: u32, ns: &Namespace, info: Option<bdev::BlockInfo>) -> Value {
    let info = info.unwrap_or_else(|| ns.qos.info().clone());
    let mut v = json!({
        "nsid": nsid,
        "spec": ns.spec.to_string(),
        "backend": ns.qos.describe(),
        "size_bytes": info.size_bytes(),
        "block_size": info.block_size,
        "read_only": info.read_only,
        "qos": crate::json::qos_json(ns.qos.limits()),
    });
    if let Some(image) = crate::json::image_json(&*ns.qos) {
        v["image"] = image;
    }
    v
}
