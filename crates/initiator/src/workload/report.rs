//! Results of a workload run: JSON via serde, a text table via `Display`.

use std::fmt;

use hdrhistogram::Histogram;
use serde::Serialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatStats {
    pub mean: f64,
    pub min: u64,
    pub p50: u64,
    pub p99: u64,
    pub p99_9: u64,
    pub p99_99: u64,
    pub max: u64,
}

impl LatStats {
    pub fn from_hist(h: &Histogram<u64>) -> LatStats {
        if h.is_empty() {
            return LatStats::default();
        }
        LatStats {
            mean: h.mean(),
            min: h.min(),
            p50: h.value_at_quantile(0.50),
            p99: h.value_at_quantile(0.99),
            p99_9: h.value_at_quantile(0.999),
            p99_99: h.value_at_quantile(0.9999),
            max: h.max(),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct JobReport {
    pub job: u32,
    pub ios: u64,
    pub iops: f64,
    pub bw_mib_s: f64,
    pub errors: u64,
    pub verify_errors: u64,
    pub lat_ns: LatStats,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub rw: String,
    pub bs: u32,
    pub qd: u32,
    pub jobs_count: u32,
    pub elapsed_s: f64,
    pub iops: f64,
    pub bw_mib_s: f64,
    pub ios: u64,
    pub reads: u64,
    pub writes: u64,
    /// Commands that completed with a non-zero NVMe status (or failed to submit).
    pub errors: u64,
    /// Reads whose data did not match what this job last wrote.
    pub verify_errors: u64,
    /// Reads of blocks with no known content (never written, or last write failed).
    pub unverified_reads: u64,
    pub lat_ns: LatStats,
    pub jobs: Vec<JobReport>,
    /// The longest pauses between consecutive completions, longest first
    /// (`WorkloadConfig::gaps`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gaps: Vec<super::gaps::Gap>,
    /// The initiator's layer table, with `WorkloadConfig::trace`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<trace::Breakdown>,
}

pub(crate) fn rate(ios: u64, bs: u32, secs: f64) -> (f64, f64) {
    if secs <= 0.0 {
        return (0.0, 0.0);
    }
    let iops = ios as f64 / secs;
    (iops, iops * bs as f64 / (1024.0 * 1024.0))
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "rw={} bs={} qd={} jobs={} time={:.2}s",
            self.rw, self.bs, self.qd, self.jobs_count, self.elapsed_s
        )?;
        writeln!(
            f,
            "  iops {:.0}  bw {:.1} MiB/s  ios {} (r {} / w {})  errors {}  verify_errors {}  unverified_reads {}",
            self.iops,
            self.bw_mib_s,
            self.ios,
            self.reads,
            self.writes,
            self.errors,
            self.verify_errors,
            self.unverified_reads
        )?;
        writeln!(
            f,
            "  {:>6} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "lat", "iops", "mean(us)", "min", "p50", "p99", "p99.9", "p99.99", "max"
        )?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, iops: f64, l: &LatStats| {
            writeln!(
                f,
                "  {:>6} {:>10.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                name,
                iops,
                l.mean / 1000.0,
                us(l.min),
                us(l.p50),
                us(l.p99),
                us(l.p99_9),
                us(l.p99_99),
                us(l.max)
            )
        };
        row(f, "all", self.iops, &self.lat_ns)?;
        if self.jobs.len() > 1 {
            for j in &self.jobs {
                row(f, &format!("job{}", j.job), j.iops, &j.lat_ns)?;
            }
        }
        if !self.gaps.is_empty() {
            let list: Vec<String> = self
                .gaps
                .iter()
                .map(|g| format!("{:.2} ms at {:.1}s", g.ns as f64 / 1e6, g.at_s))
                .collect();
            writeln!(f, "  longest gaps between completions: {}", list.join(", "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_and_json_fields() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 100_000_000_000, 3).unwrap();
        for v in 1..=10_000u64 {
            h.record(v * 1000).unwrap();
        }
        let l = LatStats::from_hist(&h);
        assert_eq!(l.min, 1000);
        assert!((l.p50 as i64 - 5_000_000).abs() < 10_000, "{}", l.p50);
        assert!(l.p99 >= 9_890_000 && l.p99 <= 9_910_000);
        assert!(l.p99_99 <= l.max && l.p99_9 <= l.p99_99);
        assert!((l.mean - 5_000_500.0).abs() < 5_000.0);
        let (iops, bw) = rate(1000, 4096, 2.0);
        let r = Report {
            iops,
            bw_mib_s: bw,
            lat_ns: l,
            ..Default::default()
        };
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        for k in ["iops", "bw_mib_s", "errors", "verify_errors", "ios", "jobs"] {
            assert!(v.get(k).is_some(), "{k}");
        }
        for k in ["mean", "p50", "p99", "p99_9", "p99_99", "max", "min"] {
            assert!(v["lat_ns"].get(k).is_some(), "{k}");
        }
        assert_eq!(v["iops"], 500.0);
        assert!(r.to_string().contains("p99.99"));
        assert_eq!(
            LatStats::from_hist(&Histogram::new(3).unwrap()),
            LatStats::default()
        );
    }
}
