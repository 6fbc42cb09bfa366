//! udrive: userspace storage virtualization server.

use udrive::{perf, serve};

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
        Cmd::Perf(a) => perf::run(a),
    };
    if let Err(e) = r {
        eprintln!("udrive: error: {e:#}");
        std::process::exit(1);
    }
}
