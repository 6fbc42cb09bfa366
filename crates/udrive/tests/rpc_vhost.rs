//! vhost-user-blk devices through the control socket of a real `udrive serve
//! --rpc` process: adding and removing them (in use, read-only, hostile
//! parameters) and QoS limits on their disk.

mod common;

use common::control::{blkio_io, ns_sum, round_trip, serve_opts, wait_disconnected, Serve};
use initiator::NvmeDriver;
use serde_json::{json, Value};

/// set_qos / clear_qos reach a vhost-user-blk device's disk (no nsid) and apply to
/// its I/O at once.
#[test]
fn vhost_user_blk_disks_take_qos_limits() {
    let s = Serve::start(&[]);
    let v = s.path("v.sock");
    s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M"}),
    );
    let q = s.ok("set_qos", json!({"socket": v, "iops": 100}));
    assert_eq!(q["iops"], 100);
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["qos"]["iops"],
        100
    );
    // 0.6 s at 100 IOPS plus the 100 ms burst: never more than a second's worth,
    // however fast the machine.
    let limited = blkio_io(&v, 1);
    assert!(limited.ios <= 100, "{} requests at 100 IOPS", limited.ios);
    wait_disconnected(&s, &v);
    let q = s.ok("clear_qos", json!({"socket": v, "nsid": 1}));
    assert_eq!(q["iops"], Value::Null);
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["qos"]["iops"],
        Value::Null
    );
    blkio_io(&v, 1);
    s.err(
        "set_qos",
        json!({"socket": v, "nsid": 2, "iops": 1}),
        -32000,
        "its one disk is nsid 1",
    );
    s.err(
        "set_qos",
        json!({"socket": s.nvme, "iops": 1}),
        -32000,
        "give the nsid",
    );
}

#[test]
fn vhost_user_blk_add_and_remove() {
    let s = Serve::start(&[]);
    let v = s.path("v.sock");
    let added = s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M", "queues": 2, "poll_mode": "event", "serial": "vm-v"}),
    );
    assert_eq!(added["kind"], "vhost-user-blk");
    assert_eq!(added["config"]["queues"], 2);
    assert_eq!(added["config"]["poll"], "event");
    assert_eq!(added["config"]["read_only"], false);
    assert!(v.exists());
    let d = s.ok("get_devices", json!({}));
    assert_eq!(d.as_array().unwrap().len(), 2);
    blkio_io(&v, 2);
    // The queues count what went through them.
    let st = s.ok("get_stats", json!({"socket": v}));
    assert!(ns_sum(&st, 0, "ops", "read") > 0);

    // In use: refused unless forced.
    let in_use = udrive::blkio_target::BlkioTarget::connect(&v, 1, 4, 4096).expect("libblkio");
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["connected"],
        true
    );
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": v}),
        -32000,
        "connected client",
    );
    s.ok("vhost_user_blk_remove", json!({"socket": v, "force": true}));
    assert!(!v.exists());
    drop(in_use);
    s.err("get_devices", json!({"socket": v}), -32000, "no device");

    // The socket and the disk's file range are free again.
    let img = s.path("d.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let spec = format!("file:{},size=4M", img.display());
    s.ok("vhost_user_blk_add", json!({"socket": v, "disk": spec}));
    blkio_io(&v, 1);
    wait_disconnected(&s, &v);
    s.ok("vhost_user_blk_remove", json!({"socket": v}));
    s.ok(
        "vhost_user_blk_add",
        json!({"socket": v, "disk": spec, "read_only": true}),
    );
    assert_eq!(
        s.ok("get_devices", json!({"socket": v}))[0]["config"]["read_only"],
        true
    );
    // libblkio refuses a read-write session on a read-only device.
    assert!(udrive::blkio_target::BlkioTarget::connect(&v, 1, 4, 4096).is_err());
    wait_disconnected(&s, &v);
    s.ok("vhost_user_blk_remove", json!({"socket": v}));
    // The NVMe controller was never affected.
    let other = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    round_trip(&other, 5);
}

#[test]
fn vhost_user_blk_add_hostile_params() {
    let dir = tempfile::tempdir().unwrap();
    let s = Serve::start(&["--allow-dir", dir.path().to_str().unwrap()]);
    let v = s.path("v.sock");
    let add = |p: Value, code: i64, want: &str| s.err("vhost_user_blk_add", p, code, want);
    add(json!({"socket": v}), -32602, "disk");
    add(
        json!({"socket": v, "disk": "ram:1M", "colour": 1}),
        -32602,
        "unknown field",
    );
    add(json!({"socket": v, "disk": 5}), -32602, "invalid type");
    add(
        json!({"socket": v, "disk": "disk:1G"}),
        -32602,
        "unknown kind",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queues": 0}),
        -32602,
        "queues must be",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queues": 70000}),
        -32602,
        "invalid value",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queues": -1}),
        -32602,
        "invalid value",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "queue_size": 100}),
        -32602,
        "power of two",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "placement": "everywhere"}),
        -32602,
        "placement",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "poll_mode": "sometimes"}),
        -32602,
        "sometimes",
    );
    add(
        json!({"socket": v, "disk": "ram:1M", "cpus": "0-"}),
        -32602,
        "cpus",
    );
    add(
        json!({"socket": dir.path().join("no/such/dir.sock"), "disk": "ram:1M"}),
        -32602,
        "does not exist",
    );
    add(
        json!({"socket": v, "disk": format!("file:{}", dir.path().join("missing.img").display())}),
        -32000,
        "does not exist",
    );
    // Sockets that are taken: a device's, another process's file.
    add(
        json!({"socket": s.nvme, "disk": "ram:1M"}),
        -32000,
        "already has a device",
    );
    let precious = dir.path().join("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    add(
        json!({"socket": precious, "disk": "ram:1M"}),
        -32000,
        "not a socket",
    );
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    // Removing: wrong kind, unknown socket, bad params.
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": s.nvme}),
        -32000,
        "nvme_remove_controller",
    );
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": v}),
        -32000,
        "no device",
    );
    s.err("vhost_user_blk_remove", json!({}), -32602, "socket");
    s.err(
        "vhost_user_blk_remove",
        json!({"socket": v, "force": "yes"}),
        -32602,
        "invalid type",
    );
    // Nothing was left behind, and the server still works.
    assert!(!v.exists());
    assert_eq!(s.ok("get_devices", json!({})).as_array().unwrap().len(), 1);
    s.ok("vhost_user_blk_add", json!({"socket": v, "disk": "ram:1M"}));
    blkio_io(&v, 1);
}
