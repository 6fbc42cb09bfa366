//! The copy floor: what a server that copies each 4 KiB read out of RAM reaches on
//! this host at best — a bare C server and client with the `ram` path's rings,
//! prefetches and per-copy completions (`scripts/copy-floor.c`, built here with
//! `cc`). It is measured in every report's run, on the same CPUs, because ratios that
//! depend on memory latency (`ram` at QD32) move with the host's state from day to
//! day: the floor says how far from the host's best a `ram` cell is.

use std::process::Command;

use super::datapath::Env;

const SOURCE: &str = include_str!("../../../../scripts/copy-floor.c");

/// The first CPU of a CPU list (`0-1` → `0`; 0 for a list that does not parse).
fn first_cpu(list: &str) -> String {
    let cpus = engine::parse_cpu_list(list).unwrap_or_default();
    cpus.first().copied().unwrap_or(0).to_string()
}

/// `QD1 2.01 M IOPS (497 ns per I/O), QD32 …`, or why it was not measured.
pub fn measure(env: &Env) -> String {
    let src = env.work.join("copy-floor.c");
    let exe = env.work.join("copy-floor");
    if let Err(e) = std::fs::write(&src, SOURCE) {
        return format!("not measured: writing {}: {e}", src.display());
    }
    let built = Command::new("cc")
        .args(["-O2", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output();
    match built {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            return format!(
                "not measured: cc failed: {}",
                err.lines().next().unwrap_or("")
            );
        }
        Err(e) => return format!("not measured: no C compiler (cc: {e}; apt-get install gcc)"),
    }
    let secs = env.matrix.time.clamp(1.0, 3.0).round().to_string();
    let (server, client) = (
        first_cpu(&env.matrix.cpus.server),
        first_cpu(&env.matrix.cpus.client),
    );
    let mut cells = Vec::new();
    for qd in ["1", "32"] {
        let out = Command::new(&exe)
            .args([qd, &secs, "client", &server, &client])
            .output();
        let text = out
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        cells.push(match parse(&text) {
            Some((miops, ns)) => format!("QD{qd} {miops:.2} M IOPS ({ns:.0} ns per I/O)"),
            None => format!("QD{qd} failed"),
        });
    }
    cells.join(", ")
}

/// `client QD32: 2.01 M IOPS, 497 ns (1292 cycles) per I/O, …` → (M IOPS, ns).
fn parse(line: &str) -> Option<(f64, f64)> {
    let w: Vec<&str> = line.split_whitespace().collect();
    Some((w.get(2)?.parse().ok()?, w.get(5)?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_line_is_read() {
        let l = "client QD32: 2.01 M IOPS, 497 ns (1292 cycles) per I/O, 810 cycles in memcpy, 3.1 per batch\n";
        assert_eq!(parse(l), Some((2.01, 497.0)));
        assert_eq!(parse(""), None);
        assert_eq!(first_cpu("2-3"), "2");
        assert_eq!(first_cpu("1"), "1");
    }
}
