//! What every datapath gives the runner: a target to drive, and one run's numbers.

use serde_json::Value;

use super::cpu::{CpuShare, ServerCpu};
use super::matrix::Point;
use super::process::DatapathError;

/// One run's numbers: each client's `perf --json`, and the CPU used over the run.
#[derive(Default)]
pub struct Measured {
    /// In client order.
    pub clients: Vec<Value>,
    /// None where there is no server (bare io_uring, librbd).
    pub server_cpu: Option<ServerCpu>,
    /// Every role's CPU, where the matrix's `cpu` asks for more than the server's.
    pub cpu: Option<CpuShare>,
    /// How long each `udrive upgrade` of the run took, in ms (a variant's
    /// `handovers`).
    pub upgrades_ms: Vec<f64>,
}

/// A datapath ready to be driven: its server (if any) is up, with a device per client.
pub trait Target {
    /// Run one workload on every client at once for the matrix's time, after its
    /// warm-up.
    fn run(&mut self, p: &Point, rep: u32) -> Result<Measured, DatapathError>;
}
