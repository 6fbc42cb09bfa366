//! JSON shapes that `get_devices` and the RPC answers share: QoS limits and socket
//! access. A leaf module, so devices describe themselves without depending on the
//! RPC layer.

use serde_json::{json, Value};

pub fn qos_json(l: bdev::QosLimits) -> Value {
    json!({
        "iops": l.iops, "read_iops": l.read_iops, "write_iops": l.write_iops,
        "bw": l.bw_bytes, "read_bw": l.read_bw, "write_bw": l.write_bw,
    })
}

/// The effective mode (octal text) and group of a device socket.
pub fn socket_access_json(p: &crate::config::SocketPerms) -> Value {
    match p.access() {
        Ok(a) => json!({"mode": format!("{:04o}", a.mode), "gid": a.gid}),
        Err(_) => Value::Null,
    }
}

/// What an image-format backend shows about itself (`qcow2`: format, virtual
/// and allocated size, cluster size, backing chain); `None` for other backends
/// and for slices (whose `as_any` hides the backend).
pub fn image_json(dev: &dyn bdev::BlockDevice) -> Option<Value> {
    let q = dev.as_any()?.downcast_ref::<bdev::Qcow2Disk>()?;
    let s = q.status();
    Some(json!({
        "format": "qcow2",
        "path": s.path,
        "virtual_size": s.virtual_size,
        "allocated_bytes": s.allocated,
        "cluster_size": s.cluster_size,
        "backing_chain": s.backing_chain,
    }))
}
