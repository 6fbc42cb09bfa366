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

#[cfg(test)]
mod tests {
    use super::*;
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
