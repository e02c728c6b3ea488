//! The workspace's built binaries as real processes: found (and refused when older than their
//! sources), started with their JSON logs collected, signalled; and the test venv's Python.

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};

use crate::ports::loopback_any;

/// Kills a child process (SIGKILL), as a crash would, and reaps it; one already gone is fine.
pub(crate) fn kill_and_reap(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Sends a signal by name to a child process that must still be there (`kill -NAME PID`).
pub(crate) fn signal_child(child: &Child, name: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(child.id().to_string())
        .status()
        .context("cannot run kill")?;
    if !status.success() {
        bail!("kill -{name} {} failed: {status}", child.id());
    }
    Ok(())
}

/// Sends `signal` (a name `kill -s` knows: TERM, KILL, STOP, CONT) to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
    // A process that already exited cannot be signalled; callers check what they expect.
    drop(status);
}

/// A built binary of this workspace (`scripts/test` builds them before the tests run).
///
/// Refuses (panics) when the binary is missing or older than any source file it was built
/// from (its cargo dep-info, `target/debug/NAME.d`, lists them), so `cargo test` after an edit
/// cannot silently test yesterday's binary.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/debug/deps/<test> -> target/debug/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory")
        .to_path_buf();
    let path = dir.join(name);
    let rebuild = "build the binaries first: cargo build --workspace --bins (scripts/test does)";
    let built = std::fs::metadata(&path)
        .and_then(|meta| meta.modified())
        .unwrap_or_else(|_| panic!("{} is missing: {rebuild}", path.display()));
    let dep_info = dir.join(format!("{name}.d"));
    let sources = std::fs::read_to_string(&dep_info).unwrap_or_else(|err| {
        panic!(
            "{}: {err}: cannot tell whether {name} is up to date; {rebuild}",
            dep_info.display()
        )
    });
    if let Some(newer) = newer_sources(&sources, built).first() {
        panic!(
            "{} is older than its source {}: {rebuild}",
            path.display(),
            newer.display()
        );
    }
    path
}

/// The files of a Makefile-style dep-info (`target: a.rs b.rs`, spaces in names escaped with
/// a backslash) changed after `built`. A source that no longer exists counts as changed. A
/// source a build script generated (`.../build/PKG-HASH/out/...`) is rewritten, with the same
/// text, whenever cargo runs the script again (another build's features, say), so it counts
/// by the script's own inputs, its `rerun-if-changed` paths (see [`generated_inputs`]).
fn newer_sources(dep_info: &str, built: SystemTime) -> Vec<PathBuf> {
    let first_rule = dep_info.lines().next().unwrap_or_default();
    let Some((_, sources)) = first_rule.split_once(": ") else {
        return Vec::new();
    };
    let mut files = Vec::new();
    let mut current = String::new();
    let mut chars = sources.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                current.push(' ');
                chars.next();
            }
            ' ' => files.push(std::mem::take(&mut current)),
            c => current.push(c),
        }
    }
    files.push(current);
    let files: Vec<PathBuf> = files
        .into_iter()
        .filter(|file| !file.is_empty())
        .map(PathBuf::from)
        .collect();
    let changed = |file: &Path| {
        let modified = std::fs::metadata(file).and_then(|meta| meta.modified());
        !modified.is_ok_and(|modified| modified <= built)
    };
    let mut newer = Vec::new();
    for file in &files {
        if !changed(file) {
            continue;
        }
        match generated_inputs(file, &files) {
            Some(inputs) => newer.extend(inputs.into_iter().filter(|input| changed(input))),
            None => newer.push(file.clone()),
        }
    }
    newer
}

/// For a file a build script wrote (`.../build/PKG-HASH/out/...`): the files its script said
/// to rerun on (`cargo:rerun-if-changed` in `.../build/PKG-HASH/output`, relative to the
/// package's directory, a directory standing for every file in it). The package's directory
/// is found among the ancestors of the other `sources` (the package's own sources are among
/// them). `None` when the file is not generated or this cannot be told: then it counts as is.
fn generated_inputs(file: &Path, sources: &[PathBuf]) -> Option<Vec<PathBuf>> {
    let build_dir = file
        .ancestors()
        .find(|dir| dir.file_name() == Some("out".as_ref()))?
        .parent()?;
    if build_dir.parent()?.file_name() != Some("build".as_ref()) {
        return None;
    }
    let (package, _hash) = build_dir.file_name()?.to_str()?.rsplit_once('-')?;
    let output = std::fs::read_to_string(build_dir.join("output")).ok()?;
    let reruns: Vec<&str> = output
        .lines()
        .filter_map(|line| {
            line.strip_prefix("cargo:rerun-if-changed=")
                .or_else(|| line.strip_prefix("cargo::rerun-if-changed="))
        })
        .collect();
    if reruns.is_empty() {
        // Without it, cargo reruns the script on any change in the package: not told here.
        return None;
    }
    let name_line = format!("name = \"{package}\"");
    let package_dir = sources
        .iter()
        .flat_map(|source| source.ancestors().skip(1))
        .find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml"))
                .is_ok_and(|manifest| manifest.lines().any(|line| line.trim() == name_line))
        })?;
    let mut inputs = Vec::new();
    for rerun in reruns {
        let mut pending = vec![package_dir.join(rerun)];
        while let Some(path) = pending.pop() {
            match std::fs::read_dir(&path) {
                Ok(entries) => pending.extend(entries.filter_map(Result::ok).map(|e| e.path())),
                // A file, or a path that does not exist (which cargo also reruns on).
                Err(_) => inputs.push(path),
            }
        }
    }
    Some(inputs)
}

/// One of the workspace's binaries running as a real process, its JSON log lines collected.
/// Killed (SIGKILL) on drop.
pub struct Process {
    /// The address it reported it listens on.
    pub addr: SocketAddr,
    child: Child,
    logs: Arc<Mutex<Vec<String>>>,
    name: String,
}

impl Process {
    /// Starts `binary` with `args` and `--log-format json`, and waits (at most 30 s) for its
    /// log line with message `listening`, whose `addr` field is the address it bound (give it
    /// `--listen 127.0.0.1:0`).
    pub fn start(binary_name: &str, args: &[&str], listening: &str) -> anyhow::Result<Self> {
        Self::start_with_env(binary_name, args, &[], listening)
    }

    /// [`Process::start`] with environment variables set for the process.
    pub fn start_with_env(
        binary_name: &str,
        args: &[&str],
        env: &[(&str, &str)],
        listening: &str,
    ) -> anyhow::Result<Self> {
        let mut child = Command::new(binary(binary_name))
            .args(args)
            .envs(env.iter().copied())
            .args(["--log-format", "json"])
            .env_remove("SWITCHYARD_CONTROL_PLANE")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {binary_name}"))?;
        let stderr = child.stderr.take().context("stderr")?;
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
        let collected = Arc::clone(&logs);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                collected
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner())
                    .push(line.clone());
                let _ = lines_tx.send(line);
            }
        });
        let mut process = Self {
            addr: loopback_any(),
            child,
            logs,
            name: binary_name.to_owned(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let line = match lines.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => line,
                Err(_) => {
                    process.kill();
                    bail!(
                        "{binary_name} did not log {listening:?} within 30 s:\n{}",
                        process.logs().join("\n")
                    );
                }
            };
            let Ok(entry) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if entry["message"] == listening
                && let Some(addr) = entry["addr"].as_str()
            {
                process.addr = addr.parse().with_context(|| format!("address {addr}"))?;
                return Ok(process);
            }
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log lines so far.
    pub fn logs(&self) -> Vec<String> {
        self.logs
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        signal(self.child.id(), "TERM");
    }

    /// Waits at most `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not exit within {limit:?}:\n{}",
                    self.name,
                    self.logs().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops it abruptly (SIGKILL), as a crash would, and reaps it.
    pub fn kill(&mut self) {
        kill_and_reap(&mut self.child);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The workspace's root directory (this crate is `tests/kit/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The test venv's Python (`scripts/ensure-deps --for-tests` installs the `openai`, `boto3`,
/// `msgspec` and `pyzmq` clients there): `$SWITCHYARD_TEST_PYTHON`, else
/// `target/python/bin/python` of the workspace.
pub fn test_python() -> PathBuf {
    let python = std::env::var("SWITCHYARD_TEST_PYTHON")
        .unwrap_or_else(|_| "target/python/bin/python".into());
    let python = if Path::new(&python).is_absolute() {
        PathBuf::from(python)
    } else {
        workspace_root().join(python)
    };
    assert!(
        python.is_file(),
        "{} is missing: scripts/test installs the Python clients there",
        python.display()
    );
    python
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regenerated_file_counts_by_its_build_scripts_inputs() {
        let root = tempfile::tempdir().unwrap();
        let package = root.path().join("proto");
        let source = package.join("src/lib.rs");
        let input = package.join("defs/a.proto");
        let build = root.path().join("target/debug/build/my-proto-0123abcd");
        let generated = build.join("out/a.rs");
        for dir in [source.parent(), input.parent(), generated.parent()] {
            std::fs::create_dir_all(dir.unwrap()).unwrap();
        }
        std::fs::write(
            package.join("Cargo.toml"),
            "[package]\nname = \"my-proto\"\n",
        )
        .unwrap();
        std::fs::write(build.join("output"), "cargo:rerun-if-changed=defs\n").unwrap();
        for file in [&source, &input] {
            std::fs::write(file, "").unwrap();
        }
        let built = SystemTime::now();
        std::thread::sleep(Duration::from_millis(20));
        // The script ran again and wrote its output anew: the inputs did not change.
        std::fs::write(&generated, "").unwrap();
        let dep_info = format!("/t/bin: {} {}\n", source.display(), generated.display());
        assert_eq!(newer_sources(&dep_info, built), Vec::<PathBuf>::new());
        // An input changed: that is what is named.
        std::fs::write(&input, "message A {}").unwrap();
        assert_eq!(newer_sources(&dep_info, built), vec![input.clone()]);
        // A plain source changed.
        std::fs::write(&source, "").unwrap();
        assert!(newer_sources(&dep_info, built).contains(&source));
    }
}
