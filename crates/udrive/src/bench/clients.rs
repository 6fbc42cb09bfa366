//! What a cell with several clients needs besides its processes: each client's CPUs
//! and the clients' numbers taken together.

use serde_json::{json, Map, Value};

/// The CPU lists of `n` clients over the CPUs of `list` (a list the matrix checked):
/// with as many CPUs as clients or more, each client has its own share of them;
/// with fewer, every client may run on all of them and the scheduler shares them.
/// Pinning them in turn instead would pin client i beside the reactor that serves
/// it whenever the server's CPUs are the clients' too (controllers are placed in
/// turn as well): each I/O would then wait a whole time slice (8 clients on 2
/// shared CPUs: 0.5 k IOPS pinned, 250 k floating).
pub fn spread(list: &str, n: u32) -> Vec<String> {
    let cpus = engine::parse_cpu_list(list).unwrap_or_default();
    let n = n as usize;
    if cpus.len() < n {
        return vec![list.to_string(); n];
    }
    (0..n)
        .map(|i| engine::format_cpu_list(&cpus[i * cpus.len() / n..(i + 1) * cpus.len() / n]))
        .collect()
}

/// The clients' `perf --json` taken together, in its shape: IOPS, I/Os and errors
/// added, the mean latency over every I/O (each client's weighted by its I/Os), the
/// percentiles and the maximum those of the worst client, the minimum of the best.
/// One client's is its own.
pub fn aggregate(clients: &[Value]) -> Value {
    if let [one] = clients {
        return one.clone();
    }
    let f = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
    let lat = |v: &Value, k: &str| {
        v.get("lat_ns")
            .and_then(|l| l.get(k))
            .and_then(Value::as_f64)
    };
    let sum = |k: &str| clients.iter().filter_map(|v| f(v, k)).sum::<f64>();
    let weight = |v: &Value| f(v, "ios").or_else(|| f(v, "iops")).unwrap_or(0.0);
    let total_w: f64 = clients.iter().map(weight).sum();
    let mean = clients
        .iter()
        .filter_map(|v| Some(lat(v, "mean")? * weight(v)))
        .sum::<f64>()
        / total_w;
    let mut l = Map::new();
    l.insert("mean".into(), json!(mean));
    let worst = |k: &str, best: bool| {
        let it = clients.iter().filter_map(|v| lat(v, k));
        if best {
            it.fold(f64::INFINITY, f64::min)
        } else {
            it.fold(f64::NEG_INFINITY, f64::max)
        }
    };
    l.insert("min".into(), json!(worst("min", true)));
    for k in ["p50", "p99", "p99_9", "p99_99", "max"] {
        l.insert(k.into(), json!(worst(k, false)));
    }
    let first = clients.first().cloned().unwrap_or(Value::Null);
    let mut o = Map::new();
    for k in ["rw", "bs", "qd", "jobs_count"] {
        if let Some(v) = first.get(k) {
            o.insert(k.into(), v.clone());
        }
    }
    o.insert("clients".into(), json!(clients.len()));
    for k in ["iops", "ios", "errors"] {
        o.insert(k.into(), json!(sum(k)));
    }
    o.insert("lat_ns".into(), Value::Object(l));
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_share_or_take_turns_on_cpus() {
        assert_eq!(spread("2-5", 2), ["2-3", "4-5"]);
        assert_eq!(spread("2-4", 2), ["2", "3-4"]);
        assert_eq!(spread("1", 3), ["1", "1", "1"]);
        assert_eq!(spread("0,1", 3), ["0,1", "0,1", "0,1"]);
    }

    #[test]
    fn clients_add_up() {
        let c = |iops: f64, ios: f64, mean: f64, p99: f64| {
            json!({"iops": iops, "ios": ios, "errors": 0,
                "lat_ns": {"mean": mean, "min": mean / 2.0, "p50": mean, "p99": p99,
                "p99_9": p99, "p99_99": p99, "max": p99}})
        };
        let one = c(10.0, 10.0, 5.0, 9.0);
        assert_eq!(aggregate(std::slice::from_ref(&one)), one);
        let a = aggregate(&[c(100.0, 300.0, 10.0, 20.0), c(50.0, 100.0, 30.0, 90.0)]);
        assert_eq!(a["iops"], 150.0);
        assert_eq!(a["clients"], 2);
        // (300 × 10 + 100 × 30) / 400
        assert_eq!(a["lat_ns"]["mean"], 15.0);
        assert_eq!(a["lat_ns"]["p99"], 90.0);
        assert_eq!(a["lat_ns"]["min"], 5.0);
    }
}
