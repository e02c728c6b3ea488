//! `switchyard`: the command-line tool. Admin client of the control plane, and `switchyard up`,
//! a whole local cluster in one command.

mod admin;
mod output;

use clap::{Parser, Subcommand};
use switchyard_shared::process::{self, EXIT_USAGE};

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
    process::init_logging(process::LogFormat::Text, "warn");
    let result = match cli.command {
        Command::EndpointConfig(command) => admin::endpoint_config(&cli.connection, command).await,
        Command::Endpoint(command) => admin::endpoint_command(&cli.connection, command).await,
        Command::Instance(command) => admin::instance_command(&cli.connection, command).await,
    };
    if let Err(err) = result {
        eprintln!("error: {}", describe(&err));
        std::process::exit(exit_for(&err));
    }
}
