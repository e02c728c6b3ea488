//! A bare HTTP/1.1 reverse proxy: every request forwarded unchanged to one upstream over
//! pooled keep-alive connections (`TCP_NODELAY`), the answer streamed back. No parsing, no
//! routing. `switchyard-bench overhead` runs it as a separate process beside the router, as
//! the baseline of what one more hop costs on this machine.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// `switchyard-bench forward` (internal: started by `overhead`).
#[derive(Debug, Clone, clap::Args)]
pub struct ForwardArgs {
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Base URL every request is forwarded to (`http://HOST:PORT`).
    #[arg(long, value_name = "URL")]
    pub upstream: String,
}

/// Serves until the process is stopped.
pub async fn forward(args: ForwardArgs) -> anyhow::Result<()> {
    let upstream = args.upstream.trim_end_matches('/').to_owned();
    upstream
        .parse::<http::Uri>()
        .with_context(|| format!("--upstream {upstream:?}"))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(connector);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: http::Request<Incoming>| {
                let client = client.clone();
                let upstream = upstream.clone();
                async move {
                    let (mut parts, body) = request.into_parts();
                    let path = parts.uri.path_and_query().map_or("/", |path| path.as_str());
                    parts.uri = format!("{upstream}{path}")
                        .parse()
                        .map_err(|err: http::uri::InvalidUri| anyhow::anyhow!(err))?;
                    let response = client
                        .request(http::Request::from_parts(parts, body))
                        .await
                        .map_err(anyhow::Error::from)?;
                    Ok::<_, anyhow::Error>(response)
                }
            });
            let served = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(err) = served {
                tracing::debug!(error = %err, "forwarded connection ended with an error");
            }
        });
    }
}
