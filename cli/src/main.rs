//! `switchyard`: the command-line tool. Admin client of the control plane, and `switchyard up`,
//! a whole local cluster in one command.

mod admin;
mod demo;
mod import;
mod output;
mod up;

use clap::{Parser, Subcommand};
use switchyard_process::{self as process, EXIT_USAGE};

/// Switchyard: an open routing layer for fleets of LLM inference servers.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    connection: admin::Connection,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Endpoint configs: SageMaker-shaped production variants and their routing.
    #[command(subcommand)]
    EndpointConfig(admin::ConfigCommand),
    /// Endpoints: a name clients call, served by an endpoint config.
    #[command(subcommand)]
    Endpoint(admin::EndpointCommand),
    /// Instances: the inference servers behind an endpoint.
    #[command(subcommand)]
    Instance(admin::InstanceCommand),
    /// Start a whole local cluster: control plane (embedded store), router(s) and simulated
    /// engines behind a ready-made endpoint. Ctrl-C stops it.
    Up(up::UpArgs),
    /// The prefix-routing article's experiment in miniature: 7 simulated engines, a long-context
    /// workload, RANDOM vs LEAST_OUTSTANDING_REQUESTS vs PREFIX_AWARE with 1 and 4 routers,
    /// side by side (table, and --json/--svg files). Runs `switchyard-bench compare` (from
    /// beside this binary, else from PATH) with the same flags: `switchyard demo --help`
    /// lists them.
    #[command(disable_help_flag = true)]
    Demo(demo::DemoArgs),
}

fn exit_for(err: &anyhow::Error) -> i32 {
    if err.downcast_ref::<admin::UsageError>().is_some() {
        return EXIT_USAGE;
    }
    1
}

fn describe(err: &anyhow::Error) -> String {
    if let Some(status) = err.downcast_ref::<tonic::Status>() {
        let code = match status.code() {
            tonic::Code::InvalidArgument => "invalid argument",
            tonic::Code::NotFound => "not found",
            tonic::Code::AlreadyExists => "already exists",
            tonic::Code::FailedPrecondition => "failed precondition",
            tonic::Code::Unauthenticated => "unauthenticated",
            tonic::Code::Unavailable => "unavailable",
            tonic::Code::Aborted => "aborted",
            _ => "error",
        };
        return format!("{code}: {}", status.message());
    }
    format!("{err:#}")
}

#[tokio::main]
async fn main() {
    let cli: Cli = process::parse_args();
    let default_log = if matches!(cli.command, Command::Up(_)) {
        "warn,switchyard_control=info,switchyard_router=info"
    } else {
        "warn"
    };
    // `up` runs the control plane in this process: its spans need the subscriber's layer.
    let telemetry = match &cli.command {
        Command::Up(args) => match args.telemetry.validate() {
            Ok(Some(settings)) => {
                match switchyard_telemetry::Telemetry::start(&settings, "switchyard-control") {
                    Ok(telemetry) => Some(telemetry),
                    Err(err) => {
                        eprintln!("error: {err}");
                        std::process::exit(1);
                    }
                }
            }
            Ok(None) => None,
            Err(message) => process::exit_usage(message),
        },
        _ => None,
    };
    process::init_logging_with(
        process::LogFormat::Text,
        default_log,
        telemetry
            .as_ref()
            .map(switchyard_telemetry::Telemetry::span_layer),
    );
    let result = match cli.command {
        Command::EndpointConfig(command) => admin::endpoint_config(&cli.connection, command).await,
        Command::Endpoint(command) => admin::endpoint_command(&cli.connection, command).await,
        Command::Instance(command) => admin::instance_command(&cli.connection, command).await,
        Command::Up(args) => up::run(args).await,
        Command::Demo(args) => demo::run(args),
    };
    if let Some(telemetry) = telemetry {
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    }
    if let Err(err) = result {
        eprintln!("error: {}", describe(&err));
        std::process::exit(exit_for(&err));
    }
}
