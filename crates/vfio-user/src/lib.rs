//! vfio-user: the wire format ([`proto`]) and a server that exposes a PCI device
//! to many clients, one socket per device.

pub mod proto;
