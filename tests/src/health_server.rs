//! An instance whose health a test controls.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::Full;
use switchyard_testkit::loopback_any;

/// An HTTP server on loopback whose `GET /health` answers 200 while `healthy` is set and 503
/// otherwise, counting the 200s: an instance whose health a test controls.
pub struct HealthServer {
    pub url: String,
    healthy: Arc<AtomicBool>,
    successes: Arc<AtomicU64>,
    _task: tokio_util::task::AbortOnDropHandle<()>,
}

impl HealthServer {
    pub async fn start(healthy: bool) -> anyhow::Result<Self> {
        use hyper::service::service_fn;
        let listener = tokio::net::TcpListener::bind(loopback_any()).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let state = (
            Arc::new(AtomicBool::new(healthy)),
            Arc::new(AtomicU64::new(0)),
        );
        let (serving_health, serving_successes) = (Arc::clone(&state.0), Arc::clone(&state.1));
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                let (healthy, successes) =
                    (Arc::clone(&serving_health), Arc::clone(&serving_successes));
                let service = service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let status = if request.uri().path() != "/health" {
                        404
                    } else if healthy.load(Ordering::SeqCst) {
                        successes.fetch_add(1, Ordering::SeqCst);
                        200
                    } else {
                        503
                    };
                    async move {
                        http::Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::new()))
                    }
                });
                connections.spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
        Ok(Self {
            url,
            healthy: state.0,
            successes: state.1,
            _task: tokio_util::task::AbortOnDropHandle::new(task),
        })
    }

    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::SeqCst);
    }

    /// Probes answered 200 so far.
    pub fn successes(&self) -> u64 {
        self.successes.load(Ordering::SeqCst)
    }
}
