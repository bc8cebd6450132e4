//! What the host says of itself (Linux's /proc and control groups): the memory this process may use and the
//! most it has used, for the memory checks and reports, and the CPU's name, for the model card.

/// Peak resident memory of this process in bytes (Linux `VmHWM`), for memory-bound checks and reports.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kib_field("/proc/self/status", "VmHWM:")
}

/// The memory this process may use on the host, in bytes: Linux's `MemTotal`, or its control group's limit
/// where one is lower (a container's: cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`). The CPU backend's
/// device memory.
pub fn host_memory_bytes() -> Option<u64> {
    let limits = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok().and_then(|text| cgroup_limit(&text)));
    limits.chain(proc_kib_field("/proc/meminfo", "MemTotal:")).min()
}

/// A control group's memory limit in bytes; `None` for none ("max", or v1's page-rounded `i64::MAX`).
fn cgroup_limit(text: &str) -> Option<u64> {
    text.trim().parse::<u64>().ok().filter(|&bytes| bytes < 1 << 62)
}

/// A `<field> <n> kB` line of a Linux /proc file, in bytes.
fn proc_kib_field(path: &str, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The CPU's model name (`model name` in /proc/cpuinfo).
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines().find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_limits_read_as_bytes_or_none() {
        assert_eq!(cgroup_limit("8589934592\n"), Some(8 << 30));
        assert_eq!(cgroup_limit("max\n"), None);
        assert_eq!(cgroup_limit("9223372036854771712\n"), None);
        assert!(host_memory_bytes().is_some_and(|bytes| bytes > 0));
    }
}
