//! Process conventions shared by every binary: exit code 64 on a bad flag or config, logs in
//! text or JSON, one shutdown signal (SIGTERM or Ctrl-C), the open-file limit, the
//! clocks ([`clock`]) and Prometheus's text format ([`metrics`]). No OpenTelemetry here: `switchyard-telemetry`
//! hands its layer to [`init_logging_with`].

pub mod clock;
pub mod metrics;

use clap::Parser;
use tracing_subscriber::layer::{Layer, Layered};
use tracing_subscriber::{EnvFilter, Registry};

/// `EX_USAGE` from sysexits.h: a bad flag, argument or configuration.
pub const EXIT_USAGE: i32 = 64;

/// Parses the command line; prints `--help`/`--version` and exits 0, or prints the problem
/// and exits 64 on a bad flag (clap alone would exit 2).
pub fn parse_args<T: Parser>() -> T {
    match T::try_parse() {
        Ok(args) => args,
        Err(err) => {
            let code = if err.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = err.print();
            std::process::exit(code);
        }
    }
}

/// Prints `error: {message}` and exits 64.
pub fn exit_usage(message: impl std::fmt::Display) -> ! {
    eprintln!("error: {message}");
    std::process::exit(EXIT_USAGE)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the global tracing subscriber. `RUST_LOG` overrides `default_filter`.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    init_logging_with(
        format,
        default_filter,
        None::<tracing_subscriber::layer::Identity>,
    );
}

/// The subscriber a layer given to [`init_logging_with`] sits on: the filter, then the logs.
pub type LogSubscriber = Layered<
    Box<dyn Layer<Layered<EnvFilter, Registry>> + Send + Sync>,
    Layered<EnvFilter, Registry>,
>;

/// Installs the global tracing subscriber with `extra` on top of the logs (the OpenTelemetry
/// layer of `switchyard-telemetry`, which turns this project's own spans into trace spans).
/// Text logs carry colour codes only when stderr is a terminal.
pub fn init_logging_with<L>(format: LogFormat, default_filter: &str, extra: Option<L>)
where
    L: Layer<LogSubscriber> + Send + Sync + 'static,
{
    use std::io::IsTerminal as _;
    use tracing_subscriber::fmt;
    use tracing_subscriber::prelude::*;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let logs = match format {
        LogFormat::Text => fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let result = tracing_subscriber::registry()
        .with(filter)
        .with(logs)
        .with(extra)
        .try_init();
    // A second call (tests, `switchyard up` running several components) keeps the first.
    drop(result);
}

/// Resolves when the process receives SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("received Ctrl-C, shutting down"),
        () = terminate => tracing::info!("received SIGTERM, shutting down"),
    }
}

/// A flag, a variable, or a file one names, that cannot be used; the message names it
/// (`--max-attempts: 0 is outside 1..=10`). Binaries print it and exit 64 ([`exit_usage`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Reads a bearer token from a file (`flag` names it in errors): one word, surrounding
/// whitespace and a trailing newline ignored.
pub fn read_token_file(path: &std::path::Path, flag: &str) -> Result<String, UsageError> {
    let token = std::fs::read_to_string(path)
        .map_err(|err| UsageError(format!("{flag} {}: {err}", path.display())))?;
    let token = token.trim();
    if token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(UsageError(format!(
            "{flag} {}: the token must be one non-empty word",
            path.display()
        )));
    }
    Ok(token.to_owned())
}

/// Checks that a flag's value lies in `range`; the error names the flag:
/// `--max-attempts: 0 is outside 1..=10`.
pub fn check_range<T>(
    flag: &str,
    value: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<(), UsageError>
where
    T: PartialOrd + std::fmt::Display,
{
    if range.contains(&value) {
        Ok(())
    } else {
        Err(UsageError(format!(
            "{flag}: {value} is outside {}..={}",
            range.start(),
            range.end()
        )))
    }
}

/// This process's limit on open files, where it can be read.
pub fn open_file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Raises this process's soft limit on open files to its hard limit (servers that hold many
/// sockets need more than the usual 1024) and returns the limit now in force, or `None` where
/// it cannot be read.
pub fn raise_open_file_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if let (Some(current), Some(hard)) = (limit.current, limit.maximum)
        && current < hard
    {
        limit.current = Some(hard);
        if setrlimit(Resource::Nofile, limit).is_err() {
            limit.current = Some(current);
        }
    }
    limit.current
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_name_the_flag() {
        assert_eq!(check_range("--n", 3, 1..=10), Ok(()));
        assert_eq!(
            check_range("--n", 0, 1..=10).unwrap_err().to_string(),
            "--n: 0 is outside 1..=10"
        );
        assert!(check_range("--n", 11, 1..=10).is_err());
    }

    #[test]
    fn the_open_file_limit_is_at_least_what_it_was() {
        let before = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        let after = raise_open_file_limit();
        assert!(after >= before, "{after:?} < {before:?}");
    }
}
