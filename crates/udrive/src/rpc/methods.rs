//! The control methods (docs/rpc.md). Each parses typed params (unknown fields are
//! refused) and returns JSON; failures of the operation itself are -32000 with the
//! reason.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{parse_params, Registry, Rpc, RpcError, SERVER_ERROR};
use super::params::{device_json_by_socket, DeviceFilter, Empty, Rate};
use crate::config::ControllerConfig;
use crate::nsspec::NsSpec;

pub fn register(r: &mut Registry) {
    r.register("get_version", "udrive's name and version", |_, p| {
        parse_params::<Empty>(p)?;
        Ok(version())
    });
    r.register("rpc_get_methods", "names of all methods", |rpc, p| {
        parse_params::<Empty>(p)?;
        Ok(json!(rpc
            .registry
            .names()
            .map(|(n, _)| n)
            .collect::<Vec<_>>()))
    });
    r.register(
        "handover",
        "hand every device to a new udrive process (`udrive serve --takeover`); this one exits",
        |rpc, p| {
            /// The new process's private handover socket.
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct Params {
                socket: std::path::PathBuf,
            }
            let p: Params = parse_params(p)?;
            Ok(crate::handover::handover(&rpc.server, &p.socket)?)
        },
    );
    r.register(
        "get_devices",
        "devices and namespaces with config and state",
        get_devices,
    );
    r.register(
        "nvme_add_controller",
        "start an NVMe controller on a new vfio-user socket",
        |rpc, p| {
            let cfg: ControllerConfig = parse_params(p)?;
            let socket = cfg.socket.clone();
            rpc.server.add_controller(cfg)?;
            device_json_by_socket(&rpc.server, &socket)
        },
    );
    r.register(
        "nvme_remove_controller",
        "stop a controller (error if a client is connected, unless force)",
        |rpc, p| {
            let a: RemoveController = parse_params(p)?;
            rpc.server.remove_device(&a.socket, a.force)?;
            Ok(Value::Bool(true))
        },
    );
    r.register(
        "nvme_add_namespace",
        "add a namespace at run time (the host gets a Namespace Attribute Changed event)",
        |rpc, p| {
            let a: AddNamespace = parse_params(p)?;
            let spec: NsSpec = a.spec.parse().map_err(RpcError::params)?;
            let nsid = rpc.server.add_namespace(&a.socket, spec, a.nsid)?;
            Ok(json!({"nsid": nsid}))
        },
    );
    r.register(
        "nvme_remove_namespace",
        "remove a namespace at run time (I/O in flight finishes; new I/O gets Invalid Namespace)",
        |rpc, p| {
            let a: NsRef = parse_params(p)?;
            rpc.server.remove_namespace(&a.socket, a.nsid)?;
            Ok(Value::Bool(true))
        },
    );
    r.register(
        "set_qos",
        "change the QoS limits of a namespace or vhost-user-blk disk (given ones; 0 removes a limit)",
        set_qos,
    );
    r.register(
        "clear_qos",
        "remove all QoS limits of a namespace or vhost-user-blk disk",
        |rpc, p| {
            let a: QosRef = parse_params(p)?;
            rpc.server
                .with_qos(&a.socket, a.nsid, |qos| {
                    qos.set_limits(bdev::QosLimits::default())?;
                    Ok(crate::json::qos_json(qos.limits()))
                })
                .map_err(RpcError::from)
        },
    );
    r.register(
        "resize",
        "change the size of an NVMe namespace or vhost-user-blk disk while in use (the guest is told; shrinking needs \"shrink\": true)",
        resize,
    );
    r.register(
        "set_placement",
        "queue placement of a device: NVMe round-robin or single (queues created afterwards); vhost-user-blk also dedicated (moves its queues now)",
        |rpc, p| {
            let a: SetPlacement = parse_params(p)?;
            rpc.server.set_placement(&a.socket, a.placement)?;
            Ok(Value::Bool(true))
        },
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveController {
    socket: PathBuf,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddNamespace {
    socket: PathBuf,
    /// As `--ns`: `ram:1G`, `file:/img,offset=1G,size=8G,iops=5000`, ...
    spec: String,
    #[serde(default)]
    nsid: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NsRef {
    socket: PathBuf,
    nsid: u32,
}

/// A disk with QoS: an NVMe namespace, or a vhost-user-blk device's disk (no nsid).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QosRef {
    socket: PathBuf,
    nsid: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetPlacement {
    socket: PathBuf,
    #[serde(with = "crate::serde_str")]
    placement: engine::Placement,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetQos {
    socket: PathBuf,
    /// NVMe: the namespace; vhost-user-blk: absent (or 1).
    nsid: Option<u32>,
    iops: Option<Rate>,
    read_iops: Option<Rate>,
    write_iops: Option<Rate>,
    bw: Option<Rate>,
    read_bw: Option<Rate>,
    write_bw: Option<Rate>,
}

fn set_qos(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: SetQos = parse_params(p)?;
    let given = [
        &a.iops,
        &a.read_iops,
        &a.write_iops,
        &a.bw,
        &a.read_bw,
        &a.write_bw,
    ];
    if given.iter().all(|r| r.is_none()) {
        return Err(RpcError::params(
            "give at least one of iops, read_iops, write_iops, bw, read_bw, write_bw (0 removes a limit)",
        ));
    }
    // Each given rate: Some(new value), where a new value of None removes the limit.
    let rate = |r: &Option<Rate>, name: &str| r.as_ref().map(|r| r.value(name)).transpose();
    let iops = rate(&a.iops, "iops")?;
    let read_iops = rate(&a.read_iops, "read_iops")?;
    let write_iops = rate(&a.write_iops, "write_iops")?;
    let bw = rate(&a.bw, "bw")?;
    let read_bw = rate(&a.read_bw, "read_bw")?;
    let write_bw = rate(&a.write_bw, "write_bw")?;
    rpc.server
        .with_qos(&a.socket, a.nsid, |qos| {
            let c = qos.limits();
            let l = bdev::QosLimits {
                iops: iops.unwrap_or(c.iops),
                read_iops: read_iops.unwrap_or(c.read_iops),
                write_iops: write_iops.unwrap_or(c.write_iops),
                bw_bytes: bw.unwrap_or(c.bw_bytes),
                read_bw: read_bw.unwrap_or(c.read_bw),
                write_bw: write_bw.unwrap_or(c.write_bw),
            };
            qos.set_limits(l)?;
            Ok(crate::json::qos_json(l))
        })
        .map_err(RpcError::from)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Resize {
    socket: PathBuf,
    /// NVMe: the namespace; vhost-user-blk: absent (or 1).
    nsid: Option<u32>,
    size: Rate,
    #[serde(default)]
    shrink: bool,
}

fn resize(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    use crate::resize::{ResizeError, ResizeRequest};
    let a: Resize = parse_params(p)?;
    let bytes = match &a.size {
        Rate::N(n) => *n,
        Rate::S(s) => {
            crate::size::parse_size(s).map_err(|e| RpcError::params(format!("size: {e}")))?
        }
    };
    if bytes == 0 {
        return Err(RpcError::params("size must be above 0"));
    }
    let req = ResizeRequest {
        bytes,
        shrink: a.shrink,
    };
    match rpc.server.resize(&a.socket, a.nsid, req) {
        Ok(r) => Ok(json!({
            "old_size_bytes": r.old_bytes,
            "size_bytes": r.new_bytes,
            "block_size": r.block_size,
            "notified": r.notified,
            "notice": r.notice,
        })),
        Err(e @ ResizeError::BadSize { .. }) => Err(RpcError::params(e.to_string())),
        Err(e) => Err(RpcError::new(SERVER_ERROR, e.to_string())),
    }
}

fn get_devices(rpc: &Rpc, p: Value) -> Result<Value, RpcError> {
    let a: DeviceFilter = parse_params(p)?;
    let st = rpc.server.lock();
    if let Some(s) = &a.socket {
        let d = st.find(s).ok_or_else(|| RpcError::from(st.not_found(s)))?;
        return Ok(json!([d.json()]));
    }
    Ok(Value::Array(st.devices.iter().map(|d| d.json()).collect()))
}

/// `get_version`: also the pid and whether a service manager runs this server, which
/// `udrive upgrade` needs.
fn version() -> Value {
    json!({
        "name": "udrive",
        "version": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "service_manager": crate::handover::successor::under_service_manager(),
    })
}
