//! `switchyard demo`: the benchmark's side-by-side comparison (`switchyard-bench compare`), run
//! as its own program so that the command-line tool carries no benchmark code.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;

const BENCH: &str = "switchyard-bench";

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Flags for `switchyard-bench compare` (`switchyard demo --help` lists them).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "FLAGS"
    )]
    pub flags: Vec<OsString>,
}

/// `switchyard-bench` beside this executable (as `cargo build` and the release archives lay
/// them out), else the one on `PATH`.
fn bench_binary() -> PathBuf {
    std::env::current_exe()
        .ok()
        .map(|exe| exe.with_file_name(BENCH))
        .filter(|beside| beside.is_file())
        .unwrap_or_else(|| PathBuf::from(BENCH))
}

/// Replaces this process with `switchyard-bench compare FLAGS…` (its output, exit code and
/// Ctrl-C are the demo's); returns only if it cannot be started.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let binary = bench_binary();
    let error = std::process::Command::new(&binary)
        .arg("compare")
        .args(&args.flags)
        .exec();
    Err(error).with_context(|| {
        format!(
            "switchyard demo runs {}, which could not be started; build it beside this \
             binary with `cargo build --release -p switchyard-bench`",
            binary.display()
        )
    })
}
