//! udrive: userspace storage virtualization server.

#[cfg(feature = "tools")]
use udrive::{bench, perf, trace_cmd};
use udrive::{check, generate, handover, rpc_client, serve};

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "udrive",
    version,
    about = "Virtual drives for VMs: NVMe controllers over vfio-user and virtio-blk devices over vhost-user",
    long_about = "Virtual drives for VMs, served from one userspace process: NVMe controllers \
over vfio-user (QEMU's vfio-user-pci, SPDK, libvfio-user clients) and virtio-blk devices over \
vhost-user (QEMU's vhost-user-blk-pci, libvirt's <disk type='vhostuser'>, libblkio), on RAM, \
null, file/block-device (io_uring) and Ceph RBD backends. Documentation: docs/ in the source \
tree; `udrive serve --help` for the options."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve NVMe controllers over vfio-user and virtio-blk devices over vhost-user
    /// (default: one NVMe controller with a 1 GiB RAM namespace on ./udrive-nvme.sock)
    #[command(
        long_about = "Serve virtual drives until SIGINT or SIGTERM: NVMe controllers on \
vfio-user sockets (--vfio-user, --ns) and virtio-blk devices on vhost-user sockets \
(--vhost-user-blk, --disk), or every device of a TOML file (--config, docs/config.md). \
Without device options: one NVMe controller with a 1 GiB RAM namespace on \
./udrive-nvme.sock. The banner printed at start says how to attach QEMU to each device. \
SIGHUP re-reads the --config file and applies what changed (docs/rpc.md, reload_config); \
under systemd (Type=notify) the server reports READY once every socket listens."
    )]
    Serve(Box<serve::ServeArgs>),
    /// Check a configuration without starting anything (the arguments of `serve`);
    /// lists every problem and exits non-zero, or prints a one-line summary
    Check(Box<check::CheckArgs>),
    /// Drive a device and report IOPS and latency: an NVMe controller with udrive's
    /// initiator, a vhost-user-blk device with libblkio, or a bare backend
    #[cfg(feature = "tools")]
    Perf(Box<perf::PerfArgs>),
    /// Run a matrix of datapaths (udrive's and its peers') × workloads, alternated and
    /// repeated, and write raw JSON, a summary and an HTML report with figures
    #[cfg(feature = "tools")]
    Bench(Box<bench::BenchArgs>),
    /// Replace the running server with a new process (e.g. a new binary) while its
    /// clients stay connected (docs/decisions/0022-live-handover.md)
    Upgrade(handover::upgrade::UpgradeArgs),
    /// Call a method on a running server's control socket (JSON-RPC 2.0, docs/rpc.md)
    Rpc(rpc_client::RpcArgs),
    /// Print a running server's counters in Prometheus text format
    Metrics(rpc_client::MetricsArgs),
    /// Print the libvirt domain XML that attaches a running server's device
    LibvirtXml(udrive::libvirt_xml::LibvirtXmlArgs),
    /// Trace a running server's requests for a while and print the time per layer
    #[cfg(feature = "tools")]
    Trace(trace_cmd::TraceArgs),
    /// Write man pages or print shell completions (for packaging)
    #[command(hide = true)]
    Generate(generate::GenerateArgs),
    /// Started by a sandboxed server: starts its successor outside its filters
    #[command(hide = true)]
    Launcher,
}

/// `RUST_LOG` (default `info`), with the virtqueue library silenced unless named:
/// it logs an error for every bad ring access a guest makes, unthrottled (one
/// hostile ring wrote thousands of lines a millisecond); the virtio-blk worker logs
/// the same conditions itself, rate-limited per device.
fn log_filter() -> tracing_subscriber::EnvFilter {
    let spec = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    let spec = if spec.contains("virtio_queue") {
        spec
    } else {
        format!("{spec},virtio_queue=off")
    };
    tracing_subscriber::EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,virtio_queue=off"))
}

/// Whether stderr is the journal stream systemd connected (`JOURNAL_STREAM` names
/// its device and inode): then events go to the journal with their fields
/// (`SOCKET=`, `NSID=`, …) as journal fields, so `journalctl -u udrive SOCKET=…`
/// picks one device's lines.
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|v| v.split_once(':')) else {
        return false;
    };
    std::fs::metadata("/proc/self/fd/2")
        .is_ok_and(|m| dev.parse() == Ok(m.dev()) && ino.parse() == Ok(m.ino()))
}

fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    if stderr_is_journal() {
        if let Ok(journal) = tracing_journald::layer() {
            tracing_subscriber::registry()
                .with(log_filter())
                // `SOCKET=`, not the default `F_SOCKET=`: what an operator types.
                .with(
                    journal
                        .with_syslog_identifier("udrive".into())
                        .with_field_prefix(None),
                )
                .init();
            return;
        }
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, not for log files.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(log_filter())
        .init();
}

fn main() {
    // A server keeps no descriptor its parent left open (as a jailer does); the
    // journal's socket and everything else are opened after this.
    if std::env::args_os().nth(1).is_some_and(|a| a == "serve") {
        if let Err(e) = sandbox::close_inherited_fds() {
            eprintln!("udrive: cannot close inherited descriptors: {e}");
            std::process::exit(1);
        }
    }
    init_logging();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve::run(*a),
        Cmd::Check(a) => check::run(*a),
        #[cfg(feature = "tools")]
        Cmd::Perf(a) => match a.rpc.clone() {
            Some(rpc) => {
                let server = trace_cmd::RpcServerTrace {
                    rpc,
                    device: a.vfio_user.clone().or_else(|| a.vhost_user.clone()),
                };
                perf::run_with(*a, Some(&server))
            }
            None => perf::run(*a),
        },
        #[cfg(feature = "tools")]
        Cmd::Bench(a) => bench::run(*a),
        Cmd::Upgrade(a) => handover::upgrade::run(a),
        Cmd::Rpc(a) => rpc_client::run(a),
        Cmd::Metrics(a) => rpc_client::run_metrics(a),
        Cmd::LibvirtXml(a) => udrive::libvirt_xml::run(a),
        #[cfg(feature = "tools")]
        Cmd::Trace(a) => trace_cmd::run(a),
        Cmd::Generate(a) => generate::run(a, Cli::command()),
        Cmd::Launcher => handover::launcher::run(),
    };
    if let Err(e) = r {
        if udrive::stdout::is_closed(&e) {
            // `udrive rpc ... | head`: the reader has what it wanted.
            std::process::exit(0);
        }
        eprintln!("udrive: error: {e:#}");
        std::process::exit(1);
    }
}
