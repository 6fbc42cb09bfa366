//! The control socket's methods over a real `udrive serve --rpc` process: every
//! method and its refusals, the `udrive rpc` CLI, removing a device in use, and the
//! access mode of the sockets it creates.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::control::{call, ns_sum, round_trip, serve_opts, udrive, udrive_ok, Serve};
use initiator::NvmeDriver;
use serde_json::{json, Value};
use test_support::T;

#[test]
fn every_method_over_the_socket() {
    let s = Serve::start(&[]);
    let mode = std::fs::metadata(&s.rpc).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "control socket mode");
    let a = s.nvme.to_str().unwrap().to_string();
    let b = s.path("b.sock").to_str().unwrap().to_string();

    version_methods_and_devices(&s, &a);
    add_controller_and_namespaces(&s, &b);
    qos_and_placement(&s, &b);
    stats_and_metrics(&s, &a);
    remove_namespace_and_controller(&s, &b);
    the_cli(&s, &a);

    // SIGTERM: clean exit, control and device sockets removed.
    let mut s = s;
    let st = s.terminate().expect("exits after SIGTERM");
    assert!(st.success(), "{st:?}");
    assert!(!s.rpc.exists() && !s.nvme.exists(), "sockets removed");
}

/// `get_version`, `rpc_get_methods` (every method listed), and `get_devices` with
/// the one controller the server started with (on socket `a`).
fn version_methods_and_devices(s: &Serve, a: &str) {
    let v = s.ok("get_version", Value::Null);
    assert_eq!(v["name"], "udrive");
    let m = s.ok("rpc_get_methods", json!({}));
    for name in [
        "get_version",
        "rpc_get_methods",
        "get_devices",
        "nvme_add_controller",
        "nvme_remove_controller",
        "nvme_add_namespace",
        "nvme_remove_namespace",
        "set_qos",
        "clear_qos",
        "resize",
        "set_placement",
        "set_poll_mode",
        "vhost_user_blk_add",
        "vhost_user_blk_remove",
        "get_stats",
        "get_metrics",
        "reload_config",
    ] {
        assert!(
            m.as_array().unwrap().contains(&json!(name)),
            "{name} missing"
        );
    }

    let d = s.ok("get_devices", json!({}));
    assert_eq!(d.as_array().unwrap().len(), 1);
    assert_eq!(d[0]["socket"], a);
    assert_eq!(d[0]["connected"], false);
    assert_eq!(d[0]["namespaces"][0]["spec"], "ram:64M");
}

/// A second controller on socket `b`, then namespaces on it (next free nsid, a
/// given one); duplicates, out-of-range nsids and unknown kinds are refused.
fn add_controller_and_namespaces(s: &Serve, b: &str) {
    let added = s.ok(
        "nvme_add_controller",
        json!({"socket": b, "namespaces": ["ram:16M", "null:1G,bs=4096"], "io_queues": 4, "placement": "single", "serial": "vm-b"}),
    );
    assert_eq!(added["serial"], "vm-b");
    assert_eq!(added["namespaces"][1]["block_size"], 4096);
    assert!(Path::new(b).exists());
    s.err(
        "nvme_add_controller",
        json!({"socket": b, "namespaces": ["ram:1M"]}),
        -32000,
        "already has a device",
    );
    let d = s.ok("get_devices", json!({"socket": b}));
    assert_eq!(d[0]["placement"], "single");
    assert_eq!(d[0]["io_queues"], 4);

    let ns = s.ok("nvme_add_namespace", json!({"socket": b, "spec": "ram:8M"}));
    assert_eq!(ns["nsid"], 3);
    let ns = s.ok(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "null:1G", "nsid": 10}),
    );
    assert_eq!(ns["nsid"], 10);
    s.err(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "null:1G", "nsid": 10}),
        -32000,
        "already exists",
    );
    s.err(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "null:1G", "nsid": 33}),
        -32000,
        "out of range",
    );
    s.err(
        "nvme_add_namespace",
        json!({"socket": b, "spec": "disk:1G"}),
        -32602,
        "unknown kind",
    );
}

/// QoS limits on namespace 3 of `b` (set, lifted one at a time, cleared) and the
/// controller's placement.
fn qos_and_placement(s: &Serve, b: &str) {
    let q = s.ok(
        "set_qos",
        json!({"socket": b, "nsid": 3, "iops": 5000, "bw": "100M"}),
    );
    assert_eq!(q["iops"], 5000);
    assert_eq!(q["bw"], 100 << 20);
    let q = s.ok("set_qos", json!({"socket": b, "nsid": 3, "iops": 0}));
    assert_eq!(q["iops"], Value::Null, "0 removes one limit");
    assert_eq!(q["bw"], 100 << 20, "others stay");
    let d = s.ok("get_devices", json!({"socket": b}));
    let ns3 = d[0]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nsid"] == 3)
        .unwrap()
        .clone();
    assert_eq!(ns3["qos"]["bw"], 100 << 20);
    let q = s.ok("clear_qos", json!({"socket": b, "nsid": 3}));
    assert_eq!(q["bw"], Value::Null);
    s.err(
        "set_qos",
        json!({"socket": b, "nsid": 3}),
        -32602,
        "at least one",
    );
    s.err(
        "set_qos",
        json!({"socket": b, "nsid": 4, "iops": 1}),
        -32000,
        "no namespace 4",
    );

    s.ok(
        "set_placement",
        json!({"socket": b, "placement": "round-robin"}),
    );
    s.err(
        "set_placement",
        json!({"socket": b, "placement": "fastest"}),
        -32602,
        "unknown placement",
    );
}

/// `get_stats` of every device and of `a` alone, and `get_metrics`.
fn stats_and_metrics(s: &Serve, a: &str) {
    let st = s.ok("get_stats", json!({}));
    assert_eq!(st["devices"].as_array().unwrap().len(), 2);
    assert_eq!(st["reactors"].as_array().unwrap().len(), 1);
    assert_eq!(ns_sum(&st, 0, "ops", "read"), 0);
    let st = s.ok("get_stats", json!({"socket": a}));
    assert_eq!(st["devices"].as_array().unwrap().len(), 1);

    let text = s.ok("get_metrics", json!({}));
    let text = text.as_str().unwrap();
    assert!(
        text.contains("# TYPE udrive_io_ops_total counter"),
        "{text}"
    );
    assert!(text.contains("udrive_reactor_polls_total{reactor=\"0\",state=\"busy\"}"));
}

/// Namespace 10 and then controller `b` go, each once.
fn remove_namespace_and_controller(s: &Serve, b: &str) {
    s.ok("nvme_remove_namespace", json!({"socket": b, "nsid": 10}));
    s.err(
        "nvme_remove_namespace",
        json!({"socket": b, "nsid": 10}),
        -32000,
        "does not exist",
    );
    s.ok("nvme_remove_controller", json!({"socket": b}));
    assert!(!Path::new(b).exists(), "socket removed");
    s.err(
        "nvme_remove_controller",
        json!({"socket": b}),
        -32000,
        "no device",
    );
}

/// The CLI: pretty result, and a message + non-zero exit on errors.
fn the_cli(s: &Serve, a: &str) {
    let out = udrive_ok(&[
        "rpc",
        "--socket",
        s.rpc.to_str().unwrap(),
        "get_devices",
        &json!({"socket": a}).to_string(),
    ]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0]["socket"], a);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("\n  "),
        "pretty"
    );
    let out = udrive(&[
        "rpc",
        "--socket",
        s.rpc.to_str().unwrap(),
        "nvme_remove_namespace",
        "{\"socket\":\"nope.sock\",\"nsid\":1}",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no device on socket nope.sock"), "{err}");
    let out = udrive_ok(&["metrics", "--rpc", s.rpc.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("udrive_reactor_polls_total"));
}

#[test]
fn removing_a_device_in_use_needs_force() {
    let s = Serve::start(&[]);
    let b = s.path("b.sock");
    s.ok(
        "nvme_add_controller",
        json!({"socket": b, "namespaces": ["ram:16M"]}),
    );
    let in_use = NvmeDriver::connect(&b, serve_opts()).unwrap();
    round_trip(&in_use, 1);
    let d = s.ok("get_devices", json!({"socket": b}));
    assert_eq!(d[0]["connected"], true);
    assert_eq!(d[0]["state"]["ready"], true);
    s.err(
        "nvme_remove_controller",
        json!({"socket": b}),
        -32000,
        "connected client",
    );
    // Still there and working.
    round_trip(&in_use, 2);
    s.ok(
        "nvme_remove_controller",
        json!({"socket": b, "force": true}),
    );
    assert!(!b.exists());
    // The other device and the control socket are unaffected.
    let other = NvmeDriver::connect(&s.nvme, serve_opts()).unwrap();
    round_trip(&other, 4);
    s.ok("get_devices", json!({}));
    drop(in_use);
}

/// Device sockets are owner-only unless the operator says otherwise: on the command
/// line (for every device), per device over RPC, and in the TOML config.
#[test]
fn device_sockets_get_the_mode_and_group_asked_for() {
    use std::os::unix::fs::MetadataExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o777;
    let s = Serve::start(&[]);
    assert_eq!(mode(&s.nvme), 0o600, "default: owner only");
    let v = s.dir.path().join("v.sock");
    call(
        &s.rpc,
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M"}),
    )
    .unwrap();
    assert_eq!(mode(&v), 0o600, "RPC-added devices too");
    drop(s);

    let s = Serve::start(&["--socket-mode", "0660", "--socket-group", "root"]);
    assert_eq!(mode(&s.nvme), 0o660);
    assert_eq!(std::fs::metadata(&s.nvme).unwrap().gid(), 0);
    let v = s.dir.path().join("v.sock");
    call(
        &s.rpc,
        "vhost_user_blk_add",
        json!({"socket": v, "disk": "ram:16M"}),
    )
    .unwrap();
    assert_eq!(
        mode(&v),
        0o660,
        "the CLI's default reaches RPC-added devices"
    );
    let w = s.dir.path().join("w.sock");
    call(
        &s.rpc,
        "vhost_user_blk_add",
        json!({"socket": w, "disk": "ram:16M", "socket_mode": "0640"}),
    )
    .unwrap();
    assert_eq!(mode(&w), 0o640);
    let c = s.dir.path().join("c.sock");
    call(
        &s.rpc,
        "nvme_add_controller",
        json!({"socket": c, "namespaces": ["ram:16M"], "socket_mode": "0620"}),
    )
    .unwrap();
    assert_eq!(mode(&c), 0o620);
    let devs = call(&s.rpc, "get_devices", json!({})).unwrap();
    let modes: Vec<&str> = devs
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["socket_access"]["mode"].as_str().unwrap())
        .collect();
    assert!(modes.contains(&"0640") && modes.contains(&"0620"), "{devs}");
    for bad in [
        json!({"socket": s.dir.path().join("x.sock"), "disk": "ram:1M", "socket_mode": "999"}),
        json!({"socket": s.dir.path().join("y.sock"), "disk": "ram:1M", "socket_group": "no-such-group-here"}),
    ] {
        let (_, msg) = call(&s.rpc, "vhost_user_blk_add", bad).unwrap_err();
        assert!(msg.contains("octal") || msg.contains("no group"), "{msg}");
    }
    drop(s);

    // TOML: a top-level default and a per-device override.
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let cfg = dir.path().join("u.toml");
    std::fs::write(
        &cfg,
        format!(
            "cpus = \"0\"\nsocket_mode = \"0640\"\n\n[[controller]]\nsocket = \"{}\"\nnamespaces = [\"ram:16M\"]\n\n[[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"ram:16M\"\nsocket_mode = \"0660\"\n",
            a.display(),
            b.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_udrive"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = std::time::Instant::now() + T;
    while !(a.exists() && b.exists()) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ma, mb) = (mode(&a), mode(&b));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!((ma, mb), (0o640, 0o660));
}
