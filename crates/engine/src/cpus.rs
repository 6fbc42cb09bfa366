/// Highest CPU number accepted, plus one.
const MAX_CPUS: usize = 4096;

/// Parses a CPU list like `0,2-3` into CPU numbers (sorted, no duplicates). Lists
/// come from the control socket too: repeated ranges cost no memory beyond a
/// [`MAX_CPUS`] bitmap.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut seen = vec![false; MAX_CPUS];
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let parse = |x: &str| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{part}` in CPU list `{s}` is not a CPU number or range"))
        };
        let (a, b) = (parse(a)?, parse(b)?);
        if a > b || b >= MAX_CPUS {
            return Err(format!("bad CPU range `{part}` in `{s}`"));
        }
        seen[a..=b].fill(true);
    }
    let cpus: Vec<usize> = (0..MAX_CPUS).filter(|&c| seen[c]).collect();
    if cpus.is_empty() {
        return Err(format!("CPU list `{s}` names no CPU"));
    }
    Ok(cpus)
}

/// The CPUs this process may run on (its affinity mask: `taskset`, a cgroup cpuset,
/// systemd's `CPUAffinity=`), in order. Falls back to CPUs 0.. by count if the mask
/// cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    match nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

/// Formats CPU numbers as a list with ranges, e.g. `0-3,6`: the inverse of
/// [`parse_cpu_list`].
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// Checks that every CPU of `cpus` is one this process may run on.
pub fn check_allowed(cpus: &[usize]) -> Result<(), String> {
    let allowed = allowed_cpus();
    match cpus.iter().find(|c| !allowed.contains(c)) {
        None => Ok(()),
        Some(bad) => Err(format!(
            "CPU {bad} is not one this process may run on; allowed CPUs: {} \
             (the affinity mask set by taskset, a cgroup cpuset or systemd's CPUAffinity=)",
            format_cpu_list(&allowed)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_ranges_and_checks_the_allowed_set() {
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 6]), "0-3,6");
        assert_eq!(format_cpu_list(&[4]), "4");
        assert_eq!(format_cpu_list(&[1, 3, 4]), "1,3-4");
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        assert_eq!(parse_cpu_list(&format_cpu_list(&allowed)).unwrap(), allowed);
        assert!(check_allowed(&allowed).is_ok());
        let err = check_allowed(&[4095]).unwrap_err();
        assert!(err.contains(&format_cpu_list(&allowed)), "{err}");
    }

    #[test]
    fn lists() {
        assert_eq!(parse_cpu_list("0").unwrap(), vec![0]);
        assert_eq!(parse_cpu_list("3,0-1,1").unwrap(), vec![0, 1, 3]);
        assert!(parse_cpu_list("").is_err());
        assert!(parse_cpu_list("2-1").is_err());
        assert!(parse_cpu_list("x").is_err());
        assert!(parse_cpu_list("0-99999").is_err());
        // Repeated ranges (hostile control-socket input) stay one bitmap's worth.
        let many = "0-4095,".repeat(20_000);
        assert_eq!(parse_cpu_list(&many).unwrap().len(), 4096);
    }
}
