//! What clients see of live handovers (a variant's `handovers`: `udrive upgrade`
//! during each run): per cell, the pauses between completions over its runs and how
//! long the upgrade command took (summary.md's "live handovers" table).

use serde::{Deserialize, Serialize};

use super::run::RunRecord;
use super::stat::Stat;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Handovers {
    /// Handovers per run.
    pub per_run: usize,
    /// Per run, the median and the longest pause a client saw (`perf --gaps`: as
    /// many longest pauses as there were handovers), ms.
    pub pause_ms: Option<Stat>,
    pub pause_max_ms: Option<Stat>,
    /// Per run, the median time of one `udrive upgrade`, ms.
    pub upgrade_ms: Option<Stat>,
    /// I/O and verify errors over all the runs: a handover must lose none.
    pub errors: f64,
}

fn median(v: &[f64]) -> Option<f64> {
    Stat::of(v).map(|s| s.median)
}

/// The handovers of a cell's successful runs, if they had any.
pub fn of(ok: &[&RunRecord]) -> Option<Handovers> {
    let runs: Vec<&&RunRecord> = ok.iter().filter(|r| !r.upgrades_ms.is_empty()).collect();
    let per_run = runs.iter().map(|r| r.upgrades_ms.len()).max()?;
    // Each run's pauses, read from its clients' JSON once.
    let pauses: Vec<Vec<f64>> = runs.iter().map(|r| r.pauses_ms()).collect();
    let stat = |v: Vec<f64>| Stat::of(&v);
    Some(Handovers {
        per_run,
        pause_ms: stat(pauses.iter().filter_map(|p| median(p)).collect()),
        pause_max_ms: stat(
            pauses
                .iter()
                .filter_map(|p| p.iter().copied().reduce(f64::max))
                .collect(),
        ),
        upgrade_ms: stat(runs.iter().filter_map(|r| median(&r.upgrades_ms)).collect()),
        errors: runs.iter().map(|r| r.errors()).sum(),
    })
}
