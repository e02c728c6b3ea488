//! HTTP/1 exchanges for tests, each with a deadline: read whole ([`http_get`], [`http_post`],
//! [`http_request`]), frame by frame ([`http_post_frames`]), or left to the caller
//! ([`post_streaming`], then [`read_body`]).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The longest any one HTTP exchange of the helpers below may take (response head and whole
/// body): a stuck server fails the test with a message instead of hanging it.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// `exchange`, failing after [`HTTP_TIMEOUT`] instead of waiting forever.
async fn within_http_timeout<T>(
    what: impl std::fmt::Display,
    exchange: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(HTTP_TIMEOUT, exchange)
        .await
        .with_context(|| format!("{what}: no complete answer within {HTTP_TIMEOUT:?}"))?
        .with_context(|| what.to_string())
}

/// GET, returning (status, body).
pub async fn http_get(url: &str) -> anyhow::Result<(u16, String)> {
    within_http_timeout(format!("GET {url}"), async {
        let response = http_client().get(url.parse()?).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    })
    .await
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
}

/// A response header's value as text (None if absent or not visible ASCII).
pub fn header_text<'a>(headers: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok())
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        header_text(&self.headers, name)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// POST a JSON body with headers, reading the whole response.
pub async fn http_post(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<Reply> {
    let mut with_type = Vec::with_capacity(headers.len() + 1);
    with_type.push(("content-type", "application/json"));
    with_type.extend_from_slice(headers);
    http_request(http::Method::POST, url, &with_type, body).await
}

/// Any method, with headers and a body (empty for none), reading the whole response (bounded
/// like [`http_get`]).
pub async fn http_request(
    method: http::Method,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<Reply> {
    let mut request = http::Request::builder().method(method.clone()).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body.into()))?;
    within_http_timeout(format!("{method} {url}"), async {
        let response = http_client().request(request).await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Reply {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    })
    .await
}

/// POST and read the response frame by frame, noting when each arrived.
pub async fn http_post_frames(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<(u16, http::HeaderMap, Vec<(Instant, Bytes)>)> {
    let mut response = post_streaming(url, headers, body).await?;
    let status = response.status().as_u16();
    let response_headers = response.headers().clone();
    within_http_timeout(format!("POST {url} (reading the body)"), async {
        let mut frames = Vec::new();
        while let Some(frame) = response.body_mut().frame().await {
            if let Ok(data) = frame?.into_data() {
                frames.push((Instant::now(), data));
            }
        }
        Ok((status, response_headers, frames))
    })
    .await
}

/// POST and return the response with its body unread (to read it slowly, or drop it early);
/// the response head must come within [`HTTP_TIMEOUT`].
pub async fn post_streaming(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
    let mut request = http::Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body.into()))?;
    within_http_timeout(format!("POST {url}"), async {
        Ok(http_client().request(request).await?)
    })
    .await
}

/// The rest of a response body, as it ended.
#[derive(Debug)]
pub struct Body {
    /// The data frames read, as text.
    pub text: String,
    /// Whether the body ended in an error (a stream cut short) rather than cleanly.
    pub broke: bool,
}

/// Reads the rest of `response`'s body; each frame must come within
/// [`STEP_TIMEOUT`](crate::wait::STEP_TIMEOUT) (panics otherwise, as [`bounded`](crate::bounded)
/// does).
pub async fn read_body(response: &mut http::Response<hyper::body::Incoming>) -> Body {
    let mut text = String::new();
    while let Some(frame) = crate::bounded("a frame", response.body_mut().frame()).await {
        match frame {
            Ok(frame) => {
                if let Some(data) = frame.data_ref() {
                    text.push_str(&String::from_utf8_lossy(data));
                }
            }
            Err(_) => return Body { text, broke: true },
        }
    }
    Body { text, broke: false }
}

/// The text of data frames `frames` (as [`http_post_frames`] returns them), in order.
pub fn frames_text(frames: &[(Instant, Bytes)]) -> String {
    frames
        .iter()
        .map(|(_, data)| String::from_utf8_lossy(data).into_owned())
        .collect()
}
