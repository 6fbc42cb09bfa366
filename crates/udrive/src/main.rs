//! udrive: userspace storage virtualization server.

use udrive::{perf, rpc, serve, trace_cmd};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "udrive",
    version,
    about = "Virtual NVMe drives for VMs over vfio-user"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve NVMe controllers on vfio-user sockets (default: one 1 GiB RAM namespace
    /// on ./udrive-nvme.sock)
    Serve(serve::ServeArgs),
    /// Drive a controller with udrive's userspace initiator and report IOPS and latency
    Perf(perf::PerfArgs),
    /// Call a method on a running server's control socket (JSON-RPC 2.0, docs/rpc.md)
    Rpc(rpc::client::RpcArgs),
    /// Print a running server's counters in Prometheus text format
    Metrics(rpc::client::MetricsArgs),
    /// Trace a running server's requests for a while and print the time per layer
    Trace(trace_cmd::TraceArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(a) => serve::run(a),
        Cmd::Perf(a) => match a.rpc.clone() {
            Some(rpc) => {
                let server = trace_cmd::RpcServerTrace {
                    rpc,
                    device: a.vfio_user.clone(),
                };
                perf::run_with(a, Some(&server))
            }
            None => perf::run(a),
        },
        Cmd::Rpc(a) => rpc::client::run(a),
        Cmd::Metrics(a) => rpc::client::run_metrics(a),
        Cmd::Trace(a) => trace_cmd::run(a),
    };
    if let Err(e) = r {
        eprintln!("udrive: error: {e:#}");
        std::process::exit(1);
    }
}
