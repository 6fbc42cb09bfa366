//! A mirror's target on another host: an NBD export (udrive's
//! `nbd_server_add`, `qemu-nbd`, QEMU's `nbd-server-add`), written through
//! one connection under the image's metadata lock
//! (docs/decisions/0045-mirror-to-another-host.md).

use std::io;

use anyhow::{Context, Result};

/// An NBD connection as a mirror's target.
pub struct NbdTarget {
    uri: nbd::Uri,
    client: nbd::Client,
}

/// Connects to the export `uri` names (`nbd://HOST[:PORT]/NAME` or
/// `nbd+unix:///NAME?socket=PATH`), which must be writable.
pub fn connect(uri: &str) -> Result<NbdTarget> {
    let parsed = nbd::Uri::parse(uri).map_err(anyhow::Error::msg)?;
    let client = nbd::Client::connect(&parsed)
        .with_context(|| format!("cannot connect to the NBD export {uri}"))?;
    if client.read_only() {
        anyhow::bail!(
            "the NBD export {uri} is read-only: export it writable on the destination \
             (udrive: nbd_server_add with \"writable\": true; qemu-nbd without -r)"
        );
    }
    Ok(NbdTarget {
        uri: parsed,
        client,
    })
}

impl bdev::RemoteTarget for NbdTarget {
    fn name(&self) -> String {
        self.uri.to_string()
    }
    fn size(&self) -> u64 {
        self.client.size()
    }
    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.client.write(offset, data, false)
    }
    fn write_zeroes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.client.write_zeroes(offset, len)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.client.flush()
    }
}
