//! `udrive libvirt-xml`: the libvirt domain XML that attaches a running server's
//! device, from `get_devices` — the `<disk type='vhostuser'>` of a vhost-user-blk
//! device, or the `<qemu:commandline>` of an NVMe controller (libvirt has no
//! element for vfio-user) — with the shared-memory backing both need. The same
//! shapes as the domains in dist/libvirt/, which the package test runs.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub struct LibvirtXmlArgs {
    /// Control socket of the running server
    #[arg(long, value_name = "PATH", default_value = crate::rpc_client::DEFAULT_SOCKET)]
    pub rpc: PathBuf,
    /// The device's socket, as `get_devices` lists it
    #[arg(value_name = "DEVICE_SOCKET")]
    pub device: PathBuf,
    /// Guest disk name of a vhost-user-blk device
    #[arg(long, value_name = "NAME", default_value = "vda")]
    pub target: String,
}

pub fn run(a: LibvirtXmlArgs) -> Result<()> {
    let devices = crate::rpc_client::call(
        &a.rpc,
        "get_devices",
        json!({"socket": a.device}),
        Duration::from_secs(10),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))
    .with_context(|| format!("cannot ask {} for its devices", a.rpc.display()))?;
    let dev = devices.get(0).with_context(|| {
        format!(
            "{} serves no device on {}",
            a.rpc.display(),
            a.device.display()
        )
    })?;
    crate::outln!("{}", xml(dev, &a.target)?)?;
    Ok(())
}

/// The XML for device `dev` (one entry of `get_devices`).
pub fn xml(dev: &Value, target: &str) -> Result<String> {
    let socket = dev["socket"].as_str().context("the device has no socket")?;
    let socket = escape(socket);
    let memory = "<!-- in <domain>: udrive reads and writes the guest's RAM directly -->\n\
                  <memoryBacking>\n  <source type='memfd'/>\n  <access mode='shared'/>\n</memoryBacking>";
    match dev["kind"].as_str() {
        Some("vhost-user-blk") => {
            let queues = dev["config"]["queues"].as_u64().unwrap_or(1);
            let ro = if dev["config"]["read_only"] == true {
                "\n  <readonly/>"
            } else {
                ""
            };
            Ok(format!(
                "{memory}\n<!-- in <devices> -->\n\
                 <disk type='vhostuser' device='disk'>\n  \
                 <driver name='qemu' type='raw' queues='{queues}'/>\n  \
                 <source type='unix' path='{socket}'>\n    \
                 <reconnect enabled='yes' timeout='1'/>\n  </source>\n  \
                 <target dev='{}' bus='virtio'/>{ro}\n</disk>",
                escape(target)
            ))
        }
        Some("nvme") => {
            let arg = json!({"driver": "vfio-user-pci", "socket": {"path": dev["socket"], "type": "unix"}});
            Ok(format!(
                "{memory}\n<!-- <domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>; \
                 the emulator must be QEMU 10.1 or later -->\n\
                 <qemu:commandline>\n  <qemu:arg value='-device'/>\n  <qemu:arg value='{}'/>\n</qemu:commandline>",
                escape(&arg.to_string())
            ))
        }
        other => bail!("no libvirt XML for a device of kind {other:?}"),
    }
}

/// Text for an XML attribute in single quotes.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('\'', "&apos;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vhost_disk_and_nvme_controller() {
        let v = json!({"kind": "vhost-user-blk", "socket": "/run/udrive/a'b.sock",
                       "config": {"queues": 2, "read_only": true}});
        let x = xml(&v, "vdb").unwrap();
        assert!(
            x.contains("<driver name='qemu' type='raw' queues='2'/>"),
            "{x}"
        );
        assert!(x.contains("path='/run/udrive/a&apos;b.sock'"), "{x}");
        assert!(
            x.contains("<target dev='vdb' bus='virtio'/>\n  <readonly/>"),
            "{x}"
        );
        assert!(x.contains("<access mode='shared'/>"), "{x}");
        let n = json!({"kind": "nvme", "socket": "/run/udrive/n.sock"});
        let x = xml(&n, "vda").unwrap();
        assert!(x.contains(r#"<qemu:arg value='{"driver":"vfio-user-pci","socket":{"path":"/run/udrive/n.sock","type":"unix"}}'/>"#), "{x}");
        assert!(xml(&json!({"kind": "x", "socket": "s"}), "vda").is_err());
    }
}
