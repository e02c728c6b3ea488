//! The upstream side of an attempt: each serving thread's connection pools, the request as the
//! engine gets it (the client's headers but the hop-by-hop ones), its URL on the instance, and
//! how a failed attempt is sorted under the retry rule (could the request have reached the
//! engine?).

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use switchyard_shared::InstanceProtocol;

use crate::operation::Operation;
use crate::routing::table::InstanceRoute;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One serving thread's upstream connection pools: HTTP/1.1 keep-alive and h2c, and the one
/// used for instances that do not name a protocol.
#[derive(Debug, Clone)]
pub struct UpstreamClients {
    pub http1: HttpClient,
    pub h2c: HttpClient,
    pub default_h2c: bool,
}

impl UpstreamClients {
    pub fn for_instance(&self, protocol: InstanceProtocol) -> &HttpClient {
        match protocol {
            InstanceProtocol::Http1 => &self.http1,
            InstanceProtocol::H2c => &self.h2c,
            InstanceProtocol::Unspecified if self.default_h2c => &self.h2c,
            InstanceProtocol::Unspecified => &self.http1,
        }
    }
}

/// How one attempt failed.
#[derive(Debug)]
pub enum Failure {
    /// The request never reached an engine: safe to send elsewhere.
    NotSent(String),
    /// The connection failed after the request was (perhaps) written.
    AfterSend(String),
    /// No response head within the deadline.
    TimedOut,
}

/// Sorts a client error by whether the request can have reached the engine.
pub(super) fn classify(err: &hyper_util::client::legacy::Error) -> Failure {
    let description = describe(err);
    if err.is_connect() {
        return Failure::NotSent(description);
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(current) = source {
        // hyper hands an unsent request back as "canceled" (a connection closed before
        // the request was written to it).
        if let Some(hyper_error) = current.downcast_ref::<hyper::Error>()
            && hyper_error.is_canceled()
        {
            return Failure::NotSent(description);
        }
        if let Some(h2_error) = current.downcast_ref::<h2::Error>()
            && h2_error.reason() == Some(h2::Reason::REFUSED_STREAM)
        {
            return Failure::NotSent(description);
        }
        source = current.source();
    }
    Failure::AfterSend(description)
}

fn describe(err: &hyper_util::client::legacy::Error) -> String {
    let mut innermost: &dyn std::error::Error = err;
    while let Some(inner) = innermost.source() {
        innermost = inner;
    }
    innermost.to_string()
}

/// The request's URL on `instance` (`path`: the plan's, for operations without a prepared
/// URL); `None`, logged, if the instance's URL cannot make one.
pub(crate) fn upstream_uri(
    operation: Operation,
    path: Option<&str>,
    instance: &InstanceRoute,
) -> Option<http::Uri> {
    let uri = match path {
        Some(path) => instance.uri_for(path),
        None => operation.upstream(instance).cloned(),
    };
    if uri.is_none() {
        tracing::warn!(instance = %instance.id, url = %instance.url, ?path, "cannot make the request's URL on this instance; skipping it");
    }
    uri
}

/// Headers that belong to one connection (RFC 9110 §7.6.1), plus those the router sets itself.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// The header names a `Connection:` header lists (they are hop-by-hop too).
fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

/// Removes hop-by-hop headers from an upstream response, in place.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in connection_listed(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

pub(crate) fn upstream_request(
    method: http::Method,
    uri: http::Uri,
    client_headers: &HeaderMap,
    body: Bytes,
) -> http::Request<Full<Bytes>> {
    let has_body = !body.is_empty();
    let mut request = http::Request::new(Full::new(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    let listed = connection_listed(client_headers);
    let headers = request.headers_mut();
    for (name, value) in client_headers {
        // The data-parallel rank is the router's choice (`with_rank`), never the client's.
        let routers_own = name == header::HOST
            || name == header::CONTENT_LENGTH
            || name == crate::headers::DATA_PARALLEL_RANK;
        if !routers_own && !is_hop_by_hop(name) && !listed.contains(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    if has_body {
        headers
            .entry(header::CONTENT_TYPE)
            .or_insert(HeaderValue::from_static("application/json"));
    }
    request
}

/// Sends `request` to data-parallel rank `ranks[index]` (vLLM's `X-data-parallel-rank`), if
/// the KV index named one for the instance at `index`; returns it.
pub(crate) fn with_rank(
    request: &mut http::Request<Full<Bytes>>,
    ranks: &[Option<u32>],
    index: usize,
) -> Option<u32> {
    let rank = ranks.get(index).copied().flatten()?;
    request
        .headers_mut()
        .insert(crate::headers::DATA_PARALLEL_RANK, HeaderValue::from(rank));
    Some(rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_named_by_connection_are_not_forwarded() {
        let mut client = HeaderMap::new();
        client.insert(header::CONNECTION, "keep-alive, X-Secret".parse().unwrap());
        client.insert("x-secret", "token".parse().unwrap());
        client.insert("x-kept", "yes".parse().unwrap());
        client.insert(header::HOST, "router".parse().unwrap());
        client.insert("x-data-parallel-rank", "3".parse().unwrap());
        client.insert(header::TE, "trailers".parse().unwrap());
        let uri: http::Uri = "http://127.0.0.1:1/v1/completions".parse().unwrap();
        let request = upstream_request(http::Method::POST, uri.clone(), &client, Bytes::from("{}"));
        let sent = request.headers();
        assert!(sent.get("x-secret").is_none());
        assert!(sent.get(header::CONNECTION).is_none());
        assert!(sent.get(header::HOST).is_none());
        assert!(sent.get(header::TE).is_none());
        assert!(sent.get("x-data-parallel-rank").is_none());
        let mut ranked = upstream_request(http::Method::POST, uri.clone(), &client, Bytes::new());
        assert_eq!(with_rank(&mut ranked, &[None, Some(2)], 1), Some(2));
        assert_eq!(ranked.headers()["x-data-parallel-rank"], "2");
        let mut unranked = upstream_request(http::Method::POST, uri.clone(), &client, Bytes::new());
        assert_eq!(with_rank(&mut unranked, &[None, Some(2)], 0), None);
        assert_eq!(with_rank(&mut unranked, &[], 0), None);
        assert!(unranked.headers().get("x-data-parallel-rank").is_none());
        assert_eq!(sent["x-kept"], "yes");
        assert_eq!(sent[header::CONTENT_TYPE], "application/json");

        let mut upstream = HeaderMap::new();
        upstream.insert(header::CONNECTION, "x-hop".parse().unwrap());
        upstream.insert("x-hop", "1".parse().unwrap());
        upstream.insert(header::RETRY_AFTER, "3".parse().unwrap());
        strip_hop_by_hop(&mut upstream);
        assert!(upstream.get("x-hop").is_none());
        assert_eq!(upstream[header::RETRY_AFTER], "3");
    }
}
