//! `switchyard-router`: the HTTP data plane.

use clap::Parser;
use switchyard_router::{RouterConfig, RouterHandle};
use switchyard_shared::process::{self, LogFormat};

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
    let settings = match cli.config.validate() {
        Ok(settings) => settings,
        Err(message) => process::exit_usage(message),
    };
    let listen = settings.config.listen;
    let router = match RouterHandle::start(settings).await {
        Ok(router) => router,
        Err(err) => process::exit_usage(format!("--listen {listen}: {err}")),
    };
    let token = router.shutdown_token();
    tokio::spawn(async move {
        process::shutdown_signal().await;
        token.cancel();
    });
    router.wait().await;
    tracing::info!("router stopped");
}
