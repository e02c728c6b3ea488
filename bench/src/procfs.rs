//! Readings of /proc: a process's CPU time and memory, its threads' CPU time, the listening
//! port of a child, the load average.

/// The TCP ports process `pid` listens on, from /proc (a server may listen on several: the
/// simulator's HTTP port, its NIXL side channel, its KV-event sockets).
pub fn listening_ports(pid: u32) -> Vec<u16> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let sockets: Vec<String> = fds
        .filter_map(Result::ok)
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy();
            let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
            Some(inode.to_owned())
        })
        .collect();
    let Ok(table) = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")) else {
        return Vec::new();
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
            if *state != "0A" || !sockets.iter().any(|socket| socket == inode) {
                return None;
            }
            u16::from_str_radix(local.rsplit(':').next()?, 16).ok()
        })
        .collect()
}

/// (user + system) CPU seconds of a process, from /proc/PID/stat.
pub fn process_cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|output| String::from_utf8(output.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .filter(|ticks: &f64| *ticks > 0.0)
            .unwrap_or(100.0)
    })
}

/// CPU seconds of this process's threads whose name starts with `prefix` (from each thread's
/// `schedstat`: nanoseconds on a CPU, exact, unlike the 10 ms ticks of `stat`).
pub fn threads_cpu(prefix: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let mut nanos = 0u64;
    for task in tasks.flatten() {
        let path = task.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if !name.trim_end().starts_with(prefix) {
            continue;
        }
        let schedstat = std::fs::read_to_string(path.join("schedstat")).unwrap_or_default();
        nanos += schedstat
            .split_whitespace()
            .next()
            .and_then(|value| value.parse::<u64>().ok())
            .unwrap_or(0);
    }
    nanos as f64 / 1e9
}

/// The load average over the last minute (others' work on this machine shows here).
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// Resident memory of a process, MiB (`self` or a PID); 0 if it cannot be read.
pub fn resident_mib(pid: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status_mib(&status, "VmRSS:").unwrap_or(0.0)
}

/// `VmHWM` (peak) and `VmRSS` of a process, in MiB.
pub fn memory_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some((
        status_mib(&status, "VmHWM:")?,
        status_mib(&status, "VmRSS:")?,
    ))
}

/// A field of /proc/PID/status counted in kB (`VmRSS:`, `VmHWM:`), in MiB.
fn status_mib(status: &str, field: &str) -> Option<f64> {
    let line = status.lines().find(|line| line.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time of a process's main thread, from the scheduler's own nanosecond count (a
    /// second, independent reading of what `process_cpu_seconds` reads in clock ticks).
    fn main_thread_cpu_seconds(pid: u32) -> f64 {
        let schedstat =
            std::fs::read_to_string(format!("/proc/{pid}/schedstat")).expect("/proc/PID/schedstat");
        let nanoseconds: f64 = schedstat
            .split_whitespace()
            .next()
            .and_then(|field| field.parse().ok())
            .expect("sum_exec_runtime");
        nanoseconds / 1e9
    }

    /// A child process killed on drop.
    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn reads_a_process_cpu_time() {
        // A single-threaded shell spinning: its CPU time (every thread's, in clock ticks) is
        // its one thread's, within the clock-tick rounding (10 ms) and 10%. A child, not this
        // process: the tests running beside this one burn CPU here too. However busy the
        // machine, a thread's CPU time is what it got, so the bound holds under load.
        let child = Child(
            std::process::Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .expect("sh"),
        );
        let pid = child.0.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while main_thread_cpu_seconds(pid) < 0.3 {
            assert!(std::time::Instant::now() < deadline, "no CPU in 60 s");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let process = process_cpu_seconds(&pid.to_string()).expect("/proc/PID/stat");
        let thread = main_thread_cpu_seconds(pid);
        assert!(
            (process - thread).abs() <= 0.02 + 0.1 * thread,
            "the process's CPU time is {process:.3} s while its one thread used {thread:.3} s"
        );
    }

    #[test]
    fn reads_this_process_memory() {
        let (peak, now) = memory_mib(std::process::id()).expect("/proc/self/status");
        assert!(peak >= now && now > 0.0, "{peak} {now}");
    }
}
