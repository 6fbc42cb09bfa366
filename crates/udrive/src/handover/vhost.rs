//! vhost-user-blk devices in a handover (the device side: decision 0024): the old
//! process pauses and saves each device, the new one restores it (paused) and,
//! once the old one let go, resumes it.

use std::os::fd::OwnedFd;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use vhost_user_blk::HandoverState;

use crate::vhost_device::VhostBlkDevice;

fn prefix(d: &VhostBlkDevice) -> String {
    format!("vhost:{}#", d.cfg.socket.display())
}

impl super::HandedOver for VhostBlkDevice {
    /// Old process: stop taking requests and finish those in flight (bounded).
    fn pause_for_handover(&self, limit: Duration) -> Result<()> {
        self.dev.pause(limit).map_err(|e| {
            self.dev.resume();
            anyhow!(e).context(format!("{}: cannot pause", self.cfg.what()))
        })
    }

    /// Old process: the handover failed; serve on.
    fn resume_after_handover_failed(&self) {
        self.dev.resume();
    }

    /// Old process: the device's state and its fds, one record per fd (a message
    /// carries few).
    fn handover_records(&self) -> Result<Vec<super::Record>> {
        let (state, fds) = self
            .dev
            .save()
            .with_context(|| format!("{}: cannot save it", self.cfg.what()))?;
        let p = prefix(self);
        let mut out = vec![(format!("{p}state"), serde_json::to_vec(&state)?, Vec::new())];
        for (i, fd) in fds.into_iter().enumerate() {
            out.push((format!("{p}fd/{i:04}"), Vec::new(), vec![fd]));
        }
        Ok(out)
    }

    fn backends(&self) -> Vec<(String, &crate::nsspec::NsSpec, &bdev::QosDisk)> {
        vec![(self.cfg.what(), &self.cfg.disk, &*self.disk)]
    }

    /// New process: the old one let go; run.
    fn start_after_takeover(&mut self) {
        if self.dev.paused() {
            self.dev.resume();
        }
    }
}

/// New process: what the old one exported for the device on `socket`, if anything.
pub fn take_state(socket: &std::path::Path) -> Result<Option<(HandoverState, Vec<OwnedFd>)>> {
    let mut recs = crate::supervise::take(&format!("vhost:{}#", socket.display()));
    let Some(state) = recs.remove("state") else {
        return Ok(None);
    };
    let state: HandoverState = serde_json::from_slice(&state.bytes)
        .with_context(|| format!("{}: bad handover state", socket.display()))?;
    // `fd/NNNN` in order (fixed width: the map's order is the index order).
    let mut fds = Vec::new();
    for (key, mut r) in recs {
        if !key.starts_with("fd/") {
            continue;
        }
        fds.push(
            r.fds
                .pop()
                .ok_or_else(|| anyhow!("{}: handover record {key} has no fd", socket.display()))?,
        );
    }
    Ok(Some((state, fds)))
}
