//! `switchyard-router`: the HTTP data plane.

use clap::Parser;
use switchyard_process::{self as process, LogFormat};
use switchyard_router::{RouterConfig, RouterHandle, StartError};

/// Switchyard router: routes OpenAI-compatible and SageMaker-style requests to inference
/// instances (prefix-aware, least outstanding requests, or random), following a control plane
/// or a static file.
#[derive(Debug, Parser)]
#[command(name = "switchyard-router", version)]
struct Cli {
    #[command(flatten)]
    config: RouterConfig,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli: Cli = process::parse_args();
    process::init_logging(cli.log_format, "info");
    // Each client connection and each upstream request holds a descriptor.
    process::raise_open_file_limit();
    let settings = match cli.config.validate() {
        Ok(settings) => settings,
        Err(message) => process::exit_usage(message),
    };
    let router = match RouterHandle::start(settings).await {
        Ok(router) => router,
        Err(err @ StartError::Listen(..)) => process::exit_usage(err.to_string()),
        Err(err) => {
            tracing::error!(error = %err, "router did not start");
            std::process::exit(1);
        }
    };
    let token = router.shutdown_token();
    tokio::spawn(async move {
        process::shutdown_signal().await;
        token.cancel();
    });
    if router.wait().await {
        tracing::info!("router stopped");
    } else {
        tracing::error!("router stopped after a failure");
        std::process::exit(1);
    }
}
