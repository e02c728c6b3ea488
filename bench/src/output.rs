//! What every benchmark's report shares: where it was measured, the command line, the table
//! on stdout and the JSON file.

use std::path::Path;

use anyhow::Context as _;
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

/// This process's command line, as a report records it.
pub fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// The first keys of a report: which tool wrote it, how it was called, and where it ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Invocation {
    pub tool: String,
    pub command: String,
    pub machine: Machine,
}

impl Invocation {
    /// This process, as the tool `tool`.
    pub fn current(tool: String) -> Self {
        Self {
            tool,
            command: command_line(),
            machine: Machine::current(),
        }
    }
}

/// Writes `report` as pretty-printed JSON and a newline.
pub fn write_json(path: &Path, report: &impl Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}

/// Prints `table` on stdout and, with `--json FILE`, writes `report` there and says so.
pub fn emit_json(table: &str, report: &impl Serialize, json: Option<&Path>) -> anyhow::Result<()> {
    print_stdout(table);
    if let Some(path) = json {
        write_json(path, report)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `1 router`, `4 routers`.
pub fn count(count: usize, noun: &str) -> String {
    format!("{count} {noun}{}", if count == 1 { "" } else { "s" })
}
