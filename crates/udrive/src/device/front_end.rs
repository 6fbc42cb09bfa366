//! What the control plane sees of an NVMe controller ([`FrontEnd`]): its
//! configuration and state as JSON, its disks, and the lifecycle.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use lifecycle::Record;
use serde_json::{json, Value};

use super::namespaces::{namespace_json, Namespace};
use super::{qemu_command, NvmeDevice};
use crate::frontend::{DiskRef, FrontEnd};
use crate::resize::{ResizeError, ResizeRequest, Resized};

impl FrontEnd for NvmeDevice {
    fn what(&self) -> &'static str {
        "an NVMe controller"
    }
    fn remove_method(&self) -> &'static str {
        "nvme_remove_controller"
    }
    fn connected(&self) -> bool {
        NvmeDevice::connected(self)
    }
    fn stop(self: Box<Self>) {
        NvmeDevice::stop(*self)
    }
    fn json(&self) -> Value {
        let d = self;
        let st = d.ctrl.stats();
        let groups: Vec<Value> = d
            .ctrl
            .queue_reactors()
            .into_iter()
            .map(|(cqid, reactor)| json!({"cqid": cqid, "reactor": reactor}))
            .collect();
        json!({
            "kind": "nvme",
            "socket": d.socket,
            "socket_access": crate::json::socket_access_json(&d.cfg.socket_perms()),
            "serial": d.cfg.serial(),
            "cntlid": d.cntlid,
            "connected": d.connected(),
            "placement": d.cfg.placement.as_str(),
            "poll": d.cfg.poll.as_str(),
            "poll_idle_us": d.cfg.poll_idle_us,
            "io_queues": d.cfg.io_queues,
            "max_namespaces": d.ctrl.max_namespaces(),
            "state": {
                "ready": st.ready,
                "fatal": st.fatal,
                "poll_mode": d.ctrl.poll_mode().as_str(),
                // mapped: the client writes doorbells into shared memory, so queues
                // cannot sleep; messages: doorbells arrive as vfio-user messages.
                "doorbells": if d.ctrl.doorbells_mapped() { "mapped" } else { "messages" },
                "can_sleep": d.ctrl.poll_mode() != engine::PollMode::Busy && !d.ctrl.doorbells_mapped(),
                "doorbell_buffer_configured": st.doorbell_buffer_configured,
                "doorbell_buffer_configs": st.doorbell_buffer_configs,
                // The client's memory (some of it) is not shared: it moves by
                // DMA_READ/DMA_WRITE messages (the slow path).
                "dma_messages": d.ctrl.dma_messages(),
                "io_submission_queues": st.io_queues,
                "io_completion_queues": st.io_completion_queues,
                "queue_groups": groups,
            },
            "dma_message_counts": d.dma_messages(),
            "namespaces": d.ctrl.namespaces().iter().filter_map(|v| {
                let ns = v.label.get::<Namespace>()?;
                Some(namespace_json(v.nsid, ns, Some(v.info.clone())))
            }).collect::<Vec<_>>(),
        })
    }
    fn banner(&self) -> String {
        format!(
            "udrive: NVMe controller on {} with namespaces {}",
            self.socket.display(),
            self.namespaces()
                .iter()
                .map(|(_, n)| n.spec.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
    fn attach_hint(&self) -> String {
        format!(
            "\nAttach a VM (QEMU 10.1+; share guest RAM as a memfd, as below, for the fast \
             path: without it QEMU keeps RAM to itself and every byte of I/O travels as a \
             DMA_READ/DMA_WRITE message, several times slower):\n\n{}\n\n{}",
            qemu_command(&self.socket),
            crate::frontend::measure_hint("vfio-user", &self.socket)
        )
    }
    fn qos(&self, nsid: Option<u32>) -> Result<Arc<bdev::QosDisk>> {
        let Some(nsid) = nsid else {
            bail!(
                "give the nsid of the namespace of NVMe controller {}",
                self.socket.display()
            );
        };
        Ok(self.namespace(nsid)?.qos)
    }
    fn set_poll_mode(&mut self, mode: engine::PollMode) -> Result<()> {
        self.ctrl.set_poll_mode(mode);
        self.cfg.poll = mode;
        if mode != engine::PollMode::Busy && self.ctrl.doorbells_mapped() {
            tracing::warn!(
                socket = %self.socket.display(),
                "poll mode {mode}: the connected client has the doorbell page mapped, so its \
                 queues keep polling busily until it reconnects (doorbells then come by message)"
            );
        }
        Ok(())
    }
    fn resize(&mut self, nsid: Option<u32>, req: &ResizeRequest) -> Result<Resized, ResizeError> {
        let Some(nsid) = nsid else {
            return Err(anyhow!(
                "give the nsid of the namespace of NVMe controller {} to resize",
                self.socket.display()
            )
            .into());
        };
        self.resize_namespace(nsid, req)
    }
    /// The vfio-user endpoint pauses at a message boundary, then the controller
    /// lets its queues finish what they fetched (decisions 0022, 0023).
    fn pause(&self, limit: std::time::Duration) -> Result<()> {
        let what = || format!("controller {}", self.socket.display());
        let Some(s) = &self.server else {
            bail!("{} is stopping", what());
        };
        s.pause()
            .map_err(|e| anyhow!(e).context(format!("{}: cannot pause", what())))?;
        if let Err(e) = self.ctrl.pause(limit) {
            self.ctrl.resume();
            s.resume();
            return Err(anyhow!(e).context(format!("{}: cannot pause", what())));
        }
        Ok(())
    }

    /// After a failed handover: the controller and its endpoint go on. A restored
    /// controller first takes the state its predecessor saved; one that does not
    /// restore (it was checked before, so this is not expected) is left in fatal
    /// status, which the host's driver resets: the client keeps its disk either way.
    fn resume(&mut self) {
        match self.pending_state.take() {
            Some((bytes, f)) => {
                let restored = serde_json::from_slice::<nvme::ControllerState>(&bytes)
                    .map_err(|e| e.to_string())
                    .and_then(|st| self.ctrl.restore(st).map_err(|e| e.to_string()));
                if let Err(e) = restored {
                    tracing::error!(
                        socket = %self.socket.display(),
                        "handover: controller state not restored ({e}); the host will reset the controller"
                    );
                    self.ctrl
                        .restore_lost(f.bar_mmap.load(std::sync::atomic::Ordering::Acquire));
                }
            }
            None => self.ctrl.resume(),
        }
        if let Some(s) = &self.server {
            s.resume();
        }
    }

    /// The listening socket and the controller's state; the connection's records
    /// are kept as the client changes them.
    fn save(&self) -> Result<Vec<Record>> {
        let Some(s) = &self.server else {
            bail!("controller {} is stopping", self.socket.display());
        };
        let listener = s
            .listener()
            .try_clone_to_owned()
            .context("cannot duplicate the listening socket")?;
        let state = self.ctrl.save().with_context(|| {
            format!(
                "controller {}: cannot save its state",
                self.socket.display()
            )
        })?;
        let prefix = self.keep.prefix();
        Ok(vec![
            Record::new(format!("{prefix}listen"), Vec::new(), vec![listener]),
            Record::new(
                format!("{prefix}state"),
                serde_json::to_vec(&state)?,
                Vec::new(),
            ),
        ])
    }

    fn check_restored(&self) -> Result<()> {
        if let Some((bytes, _)) = &self.pending_state {
            let st: nvme::ControllerState = serde_json::from_slice(bytes)
                .with_context(|| format!("controller {}: bad state", self.socket.display()))?;
            if st.version != nvme::STATE_VERSION {
                bail!(
                    "controller {}: state version {} (this udrive restores {})",
                    self.socket.display(),
                    st.version,
                    nvme::STATE_VERSION
                );
            }
        }
        Ok(())
    }

    fn disks(&self) -> Vec<DiskRef> {
        self.namespaces()
            .into_iter()
            .map(|(id, ns)| DiskRef {
                name: format!("namespace {id} of {}", self.socket.display()),
                spec: ns.spec,
                disk: ns.qos,
            })
            .collect()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl crate::stats::Traced for NvmeDevice {
    fn socket(&self) -> &Path {
        &self.socket
    }
    fn kind(&self) -> &'static str {
        "nvme"
    }
    fn observed(&self) -> &dyn frontend_core::Observed {
        &self.ctrl
    }
}

/// What only an NVMe controller has (namespaces).
impl dyn FrontEnd {
    pub fn as_nvme_mut(&mut self) -> Option<&mut NvmeDevice> {
        self.as_any_mut().downcast_mut()
    }
    pub fn as_nvme(&self) -> Option<&NvmeDevice> {
        self.as_any().downcast_ref()
    }
}
