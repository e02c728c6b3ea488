//! What every benchmark's report shares: where it was measured and the table on stdout.

use serde::Serialize;

/// Where the numbers were measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: Option<String>,
    pub os: String,
}

impl Machine {
    pub fn current() -> Self {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find(|line| line.starts_with("model name"))
                    .and_then(|line| line.split_once(':'))
                    .map(|(_, model)| model.trim().to_owned())
            });
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|release| release.trim().to_owned())
            .unwrap_or_default();
        Self {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            os: format!("{} {release}", std::env::consts::OS)
                .trim()
                .to_owned(),
        }
    }
}

/// Writes `text` and a newline to stdout; a closed pipe (`| head`) is not an error.
pub fn print_stdout(text: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}
