//! Baselines for `switchyard-bench overhead`: what one more hop costs on this machine,
//! measured in the same run as the router.
//!
//! - `--mode http`: a bare HTTP/1.1 reverse proxy: every request forwarded unchanged to one
//!   upstream over pooled keep-alive connections (`TCP_NODELAY`), the answer streamed back.
//!   No parsing beyond HTTP framing, no routing.
//! - `--mode tcp`: a TCP relay: each client connection gets its own upstream connection and
//!   bytes are copied both ways. No HTTP at all: the floor of any user-space proxy.
//!
//! Both run on one thread with a single-threaded runtime, like each of the router's serving
//! threads.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ForwardMode {
    Http,
    Tcp,
}

/// `switchyard-bench forward` (internal: started by `overhead`).
#[derive(Debug, Clone, clap::Args)]
pub struct ForwardArgs {
    #[arg(long, value_name = "ADDR")]
    pub listen: SocketAddr,
    /// Base URL every request is forwarded to (`http://HOST:PORT`).
    #[arg(long, value_name = "URL")]
    pub upstream: String,
    /// An HTTP reverse proxy, or a byte-copying TCP relay.
    #[arg(long, value_enum, default_value = "http")]
    pub mode: ForwardMode,
}

/// Serves until the process is stopped, on a thread and runtime of its own.
pub async fn forward(args: ForwardArgs) -> anyhow::Result<()> {
    let upstream = args.upstream.trim_end_matches('/').to_owned();
    let uri = upstream
        .parse::<http::Uri>()
        .with_context(|| format!("--upstream {upstream:?}"))?;
    let listener = std::net::TcpListener::bind(args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let served = std::thread::spawn(move || {
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            match args.mode {
                ForwardMode::Http => serve_http(listener, upstream).await,
                ForwardMode::Tcp => {
                    let authority = uri
                        .authority()
                        .with_context(|| format!("--upstream {upstream:?} has no host:port"))?
                        .to_string();
                    serve_tcp(listener, authority).await
                }
            }
        })
    });
    tokio::task::spawn_blocking(move || served.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the forwarding thread panicked"))?
}

async fn accept(listener: &tokio::net::TcpListener) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                return stream;
            }
            Err(err) => {
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_tcp(listener: tokio::net::TcpListener, authority: String) -> anyhow::Result<()> {
    loop {
        let mut client = accept(&listener).await;
        let authority = authority.clone();
        tokio::spawn(async move {
            let mut upstream = match tokio::net::TcpStream::connect(&authority).await {
                Ok(upstream) => upstream,
                Err(err) => {
                    tracing::warn!(error = %err, %authority, "cannot connect upstream");
                    return;
                }
            };
            let _ = upstream.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        });
    }
}

async fn serve_http(listener: tokio::net::TcpListener, upstream: String) -> anyhow::Result<()> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(connector);
    loop {
        let stream = accept(&listener).await;
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
