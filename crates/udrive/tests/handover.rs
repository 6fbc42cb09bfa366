//! Live handover (`udrive upgrade`, `serve --takeover`): clients doing verified I/O
//! at QD32 on two NVMe controllers (udrive's initiator) and two vhost-user-blk
//! devices (libblkio) keep their connections and queues through many
//! handovers in a row; nothing is lost or completed twice and every byte is there.
//! A takeover that dies at any step leaves the running server serving; changes
//! made over the control socket are there after a handover.

mod common;

use std::process::Command;
use std::time::Duration;

use common::opts;
use common::served::Service;
use initiator::NvmeDriver;
use serde_json::{json, Value};
use test_support::gens::{GenClient, BLOCK};

const BLOCKS: u64 = 512;
const UDRIVE: &str = env!("CARGO_BIN_EXE_udrive");

/// A server from a config with two controllers on files (one in busy mode, whose
/// client writes doorbells into the mapped page), two vhost-user-blk devices on
/// files (adaptive and event poll modes), and a control socket.
fn start_service() -> Service {
    Service::start(|dir| {
        let p = |n: &str| dir.join(n).display().to_string();
        for (f, len) in [
            ("a.img", BLOCKS * BLOCK as u64),
            ("b.img", BLOCKS * BLOCK as u64),
            ("v.img", 16 << 20),
            ("w.img", 16 << 20),
        ] {
            std::fs::File::create(p(f))
                .and_then(|h| h.set_len(len))
                .unwrap();
        }
        format!(
            "cpus = \"0\"\nrpc = \"{}\"\n\
             [[controller]]\nsocket = \"{}\"\nnamespaces = [\"file:{}\", \"null:1G\"]\n\
             [[controller]]\nsocket = \"{}\"\nnamespaces = [\"file:{}\"]\npoll = \"busy\"\n\
             [[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"file:{}\"\n\
             [[vhost_user_blk]]\nsocket = \"{}\"\ndisk = \"file:{}\"\npoll = \"event\"\n",
            p("rpc.sock"),
            p("a.sock"),
            p("a.img"),
            p("b.sock"),
            p("b.img"),
            p("v.sock"),
            p("v.img"),
            p("w.sock"),
            p("w.img")
        )
    })
}

fn handovers() -> usize {
    std::env::var("UDRIVE_TEST_HANDOVERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

#[test]
fn many_handovers_lose_nothing_under_verified_qd32() {
    let s = start_service();
    let clients = [
        GenClient::start(s.path("a.sock"), 1, BLOCKS),
        GenClient::start(s.path("b.sock"), 2, BLOCKS),
    ];
    // libblkio at QD32 with verify on each vhost-user-blk device; it does not
    // reconnect, so a handover that dropped its connection fails it.
    let vhost = [
        test_support::blkio_load::Qd32Client::start(&s.path("v.sock")),
        test_support::blkio_load::Qd32Client::start(&s.path("w.sock")),
    ];
    common::wait_until("clients running", Duration::from_secs(30), || {
        clients.iter().all(|c| c.ops() > 0)
    });
    let n = handovers();
    let mut pid = s.pid();
    for i in 0..n {
        let before: Vec<u64> = clients.iter().map(GenClient::ops).collect();
        s.upgrade_ok(&format!("handover {i}"));
        let now = s.pid();
        assert_ne!(now, pid, "handover {i}: a new process serves");
        pid = now;
        // Both clients make progress on the new process before the next one.
        common::wait_until("I/O after the handover", Duration::from_secs(30), || {
            clients.iter().zip(&before).all(|(c, b)| c.ops() > *b)
        });
        vhost.iter().for_each(|v| v.wait_progress(100));
    }
    for v in vhost {
        let tally = v.finish();
        assert!(tally.verified > 0, "{tally:?}");
    }
    for c in clients {
        c.finish()
            .unwrap_or_else(|e| panic!("client: {e}\n{}", s.log()));
    }
    let log = s.log();
    assert_eq!(log.matches("took every device over").count(), n, "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn a_takeover_that_dies_at_any_step_rolls_back() {
    let s = start_service();
    let client = GenClient::start(s.path("a.sock"), 3, BLOCKS);
    common::wait_until("client running", Duration::from_secs(30), || {
        client.ops() > 0
    });
    let pid = s.pid();
    for step in ["receive", "start", "confirm"] {
        let out = Command::new(UDRIVE)
            .args(["serve", "--takeover"])
            .arg(s.path("rpc.sock"))
            .env("UDRIVE_TAKEOVER_DIE_AT", step)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{step}: the takeover died");
        assert_eq!(s.pid(), pid, "{step}: the old process still serves");
        let before = client.ops();
        common::wait_until("I/O after the rollback", Duration::from_secs(30), || {
            client.ops() > before
        });
    }
    // Refused outright: nothing paused.
    let out = Command::new(UDRIVE)
        .args(["serve", "--takeover"])
        .arg(s.path("no-such-rpc.sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    client
        .finish()
        .unwrap_or_else(|e| panic!("client: {e}\n{}", s.log()));
    let log = s.log();
    assert_eq!(
        log.matches("handover failed, devices resumed").count(),
        3,
        "{log}"
    );
}

/// What a handover must carry: namespaces, QoS and poll modes as changed at run time.
fn device_summary(s: &Service) -> Vec<Value> {
    let devs = s.rpc("get_devices", json!({})).unwrap();
    devs.as_array()
        .unwrap()
        .iter()
        .map(|d| {
            json!({
                "socket": d["socket"],
                "poll": d["poll"],
                "placement": d["placement"],
                "namespaces": d["namespaces"].as_array().map(|ns| ns.iter().map(|n| json!({
                    "nsid": n["nsid"], "spec": n["spec"], "qos": n["qos"], "size": n["size_bytes"],
                })).collect::<Vec<_>>()),
            })
        })
        .collect()
}

#[test]
fn changes_made_over_rpc_survive_a_handover() {
    let s = start_service();
    let a = s.path("a.sock").display().to_string();
    s.rpc(
        "nvme_add_namespace",
        json!({"socket": a, "nsid": 5, "spec": "null:64M"}),
    )
    .unwrap();
    s.rpc("nvme_remove_namespace", json!({"socket": a, "nsid": 2}))
        .unwrap();
    s.rpc("set_qos", json!({"socket": a, "nsid": 1, "iops": 100000}))
        .unwrap();
    s.rpc("set_poll_mode", json!({"socket": a, "mode": "event"}))
        .unwrap();
    let before = device_summary(&s);
    s.upgrade_ok("handover");
    let after = device_summary(&s);
    assert_eq!(before, after);
    // A client attaches to the new process as to any.
    let d = NvmeDriver::connect(s.path("a.sock"), opts()).expect("attach after the handover");
    let ids: Vec<u32> = d.namespaces().iter().map(|n| n.nsid).collect();
    assert_eq!(ids, vec![1, 5]);
}
