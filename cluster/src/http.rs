//! The HTTP client a local cluster's users talk to it with: keep-alive, `TCP_NODELAY` (small
//! answers would otherwise wait on Nagle's algorithm), and a plain `GET` of a text page.

use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A pooling client (idle connections kept 90 s, up to 4,096 per host) that connects within 5 s.
pub fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(4096)
        .build(connector)
}

/// `GET url` within 10 s: the body as text, or an error for any status but 2xx.
pub async fn get_text(client: &HttpClient, url: &str) -> anyhow::Result<String> {
    let uri: http::Uri = url.parse().with_context(|| format!("bad URL {url}"))?;
    let request = http::Request::get(uri).body(Full::new(Bytes::new()))?;
    let response = tokio::time::timeout(Duration::from_secs(10), client.request(request))
        .await
        .with_context(|| format!("GET {url} timed out"))?
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status.is_success(), "GET {url}: status {status}");
    Ok(String::from_utf8_lossy(&body).into_owned())
}
