//! `switchyard-control`: the control-plane server.

use clap::Parser;
use switchyard_control::{ControlConfig, ControlPlane, StartError};
use switchyard_process::{self as process, LogFormat};
use switchyard_telemetry::Telemetry;

/// Switchyard control plane: admin gRPC API (endpoint configs, endpoints, instances), state in
/// an embedded store or etcd, health checks, and the stream that keeps routers up to date.
#[derive(Debug, Parser)]
#[command(name = "switchyard-control", version)]
struct Cli {
    #[command(flatten)]
    config: ControlConfig,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() {
    let cli: Cli = process::parse_args();
    let settings = match cli.config.validate() {
        Ok(settings) => settings,
        Err(err) => process::exit_usage(err),
    };
    // Traces first: the log subscriber carries the layer that turns spans into OpenTelemetry's.
    let telemetry = match &settings.telemetry {
        Some(telemetry) => match Telemetry::start(telemetry, "switchyard-control") {
            Ok(telemetry) => Some(telemetry),
            Err(err) => {
                eprintln!("error: {err}");
                std::process::exit(1);
            }
        },
        None => None,
    };
    process::init_logging_with(
        cli.log_format,
        "info",
        telemetry.as_ref().map(Telemetry::span_layer),
    );
    let control_plane = match ControlPlane::start(settings).await {
        Ok(control_plane) => control_plane,
        Err(StartError::Config(message)) => process::exit_usage(message),
        Err(err) => {
            tracing::error!(error = %err, "control plane failed to start");
            std::process::exit(1);
        }
    };
    let token = control_plane.shutdown_token();
    tokio::spawn(async move {
        process::shutdown_signal().await;
        token.cancel();
    });
    let stopped = control_plane.wait().await;
    if let Some(telemetry) = telemetry {
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    }
    if let Err(err) = stopped {
        tracing::error!(error = %err, "control plane stopped with an error");
        std::process::exit(1);
    }
    tracing::info!("control plane stopped");
}
