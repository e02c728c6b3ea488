//! `switchyard up` as a user runs it.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use switchyard_testkit::{binary, signal};

/// A `switchyard up` process (its own ports all `127.0.0.1:0`), once it has printed its
/// banner; `extra` adds arguments. Killed on drop.
pub struct SwitchyardUp {
    pub child: Child,
    /// The banner's first router URL.
    pub router: String,
    /// The banner's `curl` example.
    pub curl: String,
}

impl SwitchyardUp {
    pub fn start(engines: usize, extra: &[&str]) -> anyhow::Result<Self> {
        let engines = engines.to_string();
        let mut child = Command::new(binary("switchyard"))
            .args(["up", "--engines", &engines, "--time-scale", "0.05"])
            .args(["--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start switchyard up")?;
        let stdout = child.stdout.take().context("stdout")?;
        let (lines_tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut up = Self {
            child,
            router: String::new(),
            curl: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            else {
                bail!("switchyard up printed no whole banner within 60 s");
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["router", _, url, ..] = words[..]
                && up.router.is_empty()
            {
                up.router = url.to_owned();
            }
            if line.trim_start().starts_with("curl -s") && line.contains("chat/completions") {
                up.curl = line.trim().to_owned();
            }
            if line.contains("Ctrl-C stops everything") {
                break;
            }
        }
        if up.router.is_empty() || up.curl.is_empty() {
            bail!("the banner named no router or no curl example");
        }
        Ok(up)
    }

    /// SIGTERM, then its exit status (SIGKILL after 30 s).
    pub fn terminate(&mut self) -> anyhow::Result<ExitStatus> {
        signal(self.child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("switchyard up did not exit within 30 s of SIGTERM")
    }
}

impl Drop for SwitchyardUp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
