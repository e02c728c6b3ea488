//! Instances: the inference servers behind an endpoint's variant, how routers reach them
//! (URL, protocol, KV-event sockets), their role under disaggregation, and their health.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::error::ValidationError;
use crate::names::{EndpointName, InstanceId, VariantName};

pub const DEFAULT_INSTANCE_WEIGHT: f64 = 1.0;
/// Longest instance lease a registration may ask for.
pub const MAX_TTL_SECONDS: u32 = 86_400;
/// Longest instance base URL, in bytes. Every record that travels to routers is bounded, so a
/// sync message of one record stays small.
pub const MAX_URL_BYTES: usize = 2048;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InstanceRole {
    #[default]
    Both,
    Prefill,
    Decode,
}

impl InstanceRole {
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceRole::Both => "both",
            InstanceRole::Prefill => "prefill",
            InstanceRole::Decode => "decode",
        }
    }
}

impl fmt::Display for InstanceRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for InstanceRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "both" => Ok(InstanceRole::Both),
            "prefill" => Ok(InstanceRole::Prefill),
            "decode" => Ok(InstanceRole::Decode),
            _ => Err(format!("{s:?} is not one of both, prefill, decode")),
        }
    }
}

/// How routers talk to an instance: HTTP/1.1 keep-alive (what vLLM and SGLang serve), h2c
/// (HTTP/2 without TLS, prior knowledge), or unspecified: the router's `--upstream-protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceProtocol {
    #[default]
    #[serde(alias = "UNSPECIFIED")]
    Unspecified,
    #[serde(alias = "HTTP1")]
    Http1,
    #[serde(alias = "H2C")]
    H2c,
}

impl InstanceProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceProtocol::Unspecified => "unspecified",
            InstanceProtocol::Http1 => "http1",
            InstanceProtocol::H2c => "h2c",
        }
    }
}

impl fmt::Display for InstanceProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for InstanceProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "unspecified" => Ok(InstanceProtocol::Unspecified),
            "http1" => Ok(InstanceProtocol::Http1),
            "h2c" => Ok(InstanceProtocol::H2c),
            _ => Err(format!("{s:?} is not one of http1, h2c, unspecified")),
        }
    }
}

fn is_unspecified(protocol: &InstanceProtocol) -> bool {
    *protocol == InstanceProtocol::Unspecified
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Health {
    /// Not probed yet. Routable: a router ejects it locally if it fails.
    #[default]
    Unknown,
    Healthy,
    Unhealthy,
}

impl Health {
    pub fn routable(self) -> bool {
        self != Health::Unhealthy
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Health::Unknown => "unknown",
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
        })
    }
}

#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct Instance {
    pub instance_id: InstanceId,
    pub endpoint_name: EndpointName,
    pub variant_name: VariantName,
    pub url: String,
    #[serde(default)]
    pub role: InstanceRole,
    /// Unspecified is left out of the stored JSON, so records written before this field
    /// existed and records that do not set it read the same.
    #[serde(default, skip_serializing_if = "is_unspecified")]
    pub protocol: InstanceProtocol,
    pub weight: f64,
    #[serde(default)]
    pub health: Health,
    #[serde(default)]
    pub health_detail: String,
    /// 0: no lease, the instance stays until deregistered.
    #[serde(default)]
    pub ttl_seconds: u32,
    #[serde(default)]
    pub registered_time_ms: i64,
    /// The store lease the instance lives on (0: none). Internal to the control plane.
    #[serde(default)]
    pub lease_id: i64,
    /// Where the engine publishes its KV-cache events (vLLM's `--kv-events-config`), for
    /// KV_AWARE routing. Left out of the stored JSON when absent.
    pub kv_events: Option<KvEventsEndpoints>,
    /// LMCACHE disaggregation: the decode instance this prefill instance pushes its KV cache
    /// to (named in the engine's own LMCache config). Left out of the stored JSON when absent.
    pub decode_partner: Option<InstanceId>,
    /// LMCACHE_PD disaggregation: where this decode instance's LMCache PD receiver listens
    /// (its `pd_peer_host`, `pd_peer_init_port`, `pd_peer_alloc_port`), named to the prefiller
    /// in each request's `disagg_spec`. Left out of the stored JSON when absent.
    pub lmcache_receiver: Option<LmcacheReceiver>,
}

/// The most tensor-parallel ranks an LMCache receiver may list (one port pair per rank).
pub const MAX_LMCACHE_RECEIVER_RANKS: usize = 64;

/// A decode engine's LMCache PD receiver (LMCache's `pd_role: receiver`): the host prefillers
/// reach it at, one init port and one alloc port per tensor-parallel rank (LMCache's proxy
/// sends the lists as `receiver_init_port` and `receiver_alloc_port` and waits for one notice
/// per rank), and optionally how many prompt tokens its PD buffer holds
/// (`pd_buffer_size` / KV bytes per token), which caps this router's hand-offs in flight to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct LmcacheReceiver {
    pub host: String,
    pub init_ports: Vec<u16>,
    pub alloc_ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer_tokens: Option<u32>,
}

impl LmcacheReceiver {
    /// Checks the receiver; `field` prefixes the names in errors (`LmcacheReceiver`).
    pub fn validate(&self, field: &str) -> Result<(), ValidationError> {
        let at = |name: &str| format!("{field}.{name}");
        let host = self.host.trim();
        if host.is_empty()
            || host.len() > 253
            || host.contains(['/', ' ', '@', ',', ':'])
                && host.parse::<std::net::Ipv6Addr>().is_err()
        {
            return Err(ValidationError::new(
                at("Host"),
                format!(
                    "must be a host name or IP address the prefill engines reach the decoder's \
                     LMCache receiver at, got {:?}",
                    self.host
                ),
            ));
        }
        let ranks = self.init_ports.len();
        if ranks == 0 || ranks > MAX_LMCACHE_RECEIVER_RANKS {
            return Err(ValidationError::new(
                at("InitPorts"),
                format!(
                    "must list 1 to {MAX_LMCACHE_RECEIVER_RANKS} ports (one per tensor-parallel \
                     rank, LMCache's pd_peer_init_port), got {ranks}"
                ),
            ));
        }
        if self.alloc_ports.len() != ranks {
            return Err(ValidationError::new(
                at("AllocPorts"),
                format!(
                    "must list one port per InitPorts entry ({ranks}), got {}",
                    self.alloc_ports.len()
                ),
            ));
        }
        for (name, ports) in [
            ("InitPorts", &self.init_ports),
            ("AllocPorts", &self.alloc_ports),
        ] {
            if ports.contains(&0) {
                return Err(ValidationError::new(at(name), "ports must be 1 to 65535"));
            }
        }
        let mut all: Vec<u16> = self
            .init_ports
            .iter()
            .chain(&self.alloc_ports)
            .copied()
            .collect();
        all.sort_unstable();
        if all.windows(2).any(|pair| pair[0] == pair[1]) {
            return Err(ValidationError::new(
                at("AllocPorts"),
                "every init and alloc port must be different",
            ));
        }
        if self.buffer_tokens == Some(0) {
            return Err(ValidationError::new(
                at("BufferTokens"),
                "must be at least 1 token (leave it out for no cap)",
            ));
        }
        Ok(())
    }

    /// Builds a receiver from the optional inputs of a flag or a file (all absent: none);
    /// `fields` names the host, init-port, alloc-port and buffer fields for errors.
    pub fn parse(
        host: Option<&str>,
        init_ports: Option<Vec<u16>>,
        alloc_ports: Option<Vec<u16>>,
        buffer_tokens: Option<u32>,
        fields: [&str; 4],
    ) -> Result<Option<Self>, ValidationError> {
        let host = host.map(str::trim).filter(|host| !host.is_empty());
        let init_ports = init_ports.filter(|ports| !ports.is_empty());
        let alloc_ports = alloc_ports.filter(|ports| !ports.is_empty());
        let buffer_tokens = buffer_tokens.filter(|&tokens| tokens != 0);
        let Some(host) = host else {
            if init_ports.is_some() || alloc_ports.is_some() || buffer_tokens.is_some() {
                return Err(ValidationError::new(
                    fields[0],
                    "the LMCache receiver needs its host as well",
                ));
            }
            return Ok(None);
        };
        let receiver = Self {
            host: host.to_owned(),
            init_ports: init_ports.unwrap_or_default(),
            alloc_ports: alloc_ports.unwrap_or_default(),
            buffer_tokens,
        };
        receiver.validate("").map_err(|err| {
            let field = match err.field.trim_start_matches('.') {
                "Host" => fields[0],
                "InitPorts" => fields[1],
                "AllocPorts" => fields[2],
                _ => fields[3],
            };
            ValidationError::new(field, err.message)
        })?;
        Ok(Some(receiver))
    }
}

impl Instance {
    /// An instance of `variant_name` in `endpoint_name` at `url`, as registered with nothing
    /// else said: role BOTH, the router's protocol, weight 1, health not probed yet, no lease,
    /// no KV-event sockets, no decode partner, no LMCache receiver. Set what differs with struct update syntax.
    pub fn new(
        instance_id: InstanceId,
        endpoint_name: EndpointName,
        variant_name: VariantName,
        url: String,
    ) -> Self {
        Self {
            instance_id,
            endpoint_name,
            variant_name,
            url,
            role: InstanceRole::Both,
            protocol: InstanceProtocol::Unspecified,
            weight: DEFAULT_INSTANCE_WEIGHT,
            health: Health::Unknown,
            health_detail: String::new(),
            ttl_seconds: 0,
            registered_time_ms: 0,
            lease_id: 0,
            kv_events: None,
            decode_partner: None,
            lmcache_receiver: None,
        }
    }
}

/// An engine's KV-cache event sockets: vLLM's ZMQ PUB endpoint and, optionally, its ROUTER
/// replay endpoint (`tcp://host:port` each; routers connect to them), and how many
/// data-parallel ranks publish (vLLM's rank r on each port + r).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct KvEventsEndpoints {
    pub publisher: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// A data-parallel engine's ranks (`--data-parallel-size`): vLLM publishes rank r's
    /// events on the publisher's port + r and answers its replays on the replay port + r.
    /// 1 (left out of the stored JSON): one stream.
    #[serde(default = "one_rank", skip_serializing_if = "is_one_rank")]
    pub data_parallel_size: u32,
}

fn one_rank() -> u32 {
    1
}

fn is_one_rank(size: &u32) -> bool {
    *size == 1
}

/// The largest data-parallel size an instance may register (vLLM's wide expert-parallel
/// deployments run DP 256 and fewer). Each rank costs every router two sockets and an index
/// budget of its own (`--kv-index-max-blocks` is per stream).
pub const MAX_DATA_PARALLEL_SIZE: u32 = 256;

/// Where a [`KvEventsEndpoints::parse`] input comes from: each field's name, for errors.
#[derive(Debug, Clone, Copy)]
pub struct KvEventsFields<'a> {
    pub publisher: &'a str,
    pub replay: &'a str,
    pub data_parallel_size: &'a str,
}

impl KvEventsEndpoints {
    /// One stream (no data parallelism), checked by [`parse`](Self::parse)'s rules.
    pub fn single(publisher: &str, replay: Option<&str>) -> Self {
        Self {
            publisher: publisher.to_owned(),
            replay: replay.map(str::to_owned),
            data_parallel_size: 1,
        }
    }

    /// Builds the endpoints from the optional inputs (empty or 0 counts as absent), checking
    /// each is `tcp://host:port`, that a replay endpoint or a data-parallel size comes with a
    /// publisher, and that the size is 1..=[`MAX_DATA_PARALLEL_SIZE`] with every rank's port
    /// (port + size - 1) at most 65535 and the ranks' publisher and replay ports apart on one
    /// host. The error names the field of `fields`.
    pub fn parse(
        publisher: Option<&str>,
        replay: Option<&str>,
        data_parallel_size: Option<u32>,
        fields: KvEventsFields<'_>,
    ) -> Result<Option<Self>, ValidationError> {
        fn present(value: Option<&str>) -> Option<&str> {
            value.map(str::trim).filter(|text| !text.is_empty())
        }
        let size = data_parallel_size.filter(|&size| size != 0);
        let Some(publisher) = present(publisher) else {
            return match (present(replay), size) {
                (None, None) => Ok(None),
                (Some(_), _) => Err(ValidationError::new(
                    fields.replay,
                    format!("needs {} (the event publisher) as well", fields.publisher),
                )),
                (None, Some(_)) => Err(ValidationError::new(
                    fields.data_parallel_size,
                    format!(
                        "needs {} (the event publisher of rank 0) as well",
                        fields.publisher
                    ),
                )),
            };
        };
        let size = size.unwrap_or(1);
        if size > MAX_DATA_PARALLEL_SIZE {
            return Err(ValidationError::new(
                fields.data_parallel_size,
                format!("is {size}; at most {MAX_DATA_PARALLEL_SIZE}"),
            ));
        }
        let endpoints = Self {
            publisher: validate_zmq_tcp_endpoint(publisher, fields.publisher)?,
            replay: present(replay)
                .map(|replay| validate_zmq_tcp_endpoint(replay, fields.replay))
                .transpose()?,
            data_parallel_size: size,
        };
        for (endpoint, field) in [
            (Some(&endpoints.publisher), fields.publisher),
            (endpoints.replay.as_ref(), fields.replay),
        ] {
            if let Some(endpoint) = endpoint
                && port_of(endpoint) + u64::from(size) - 1 > u64::from(u16::MAX)
            {
                return Err(ValidationError::new(
                    fields.data_parallel_size,
                    format!(
                        "is {size}, but rank {} would publish past port 65535 ({field} {endpoint})",
                        size - 1
                    ),
                ));
            }
        }
        if let Some(replay) = &endpoints.replay
            && size > 1
            && host_of(replay) == host_of(&endpoints.publisher)
            && port_of(replay).abs_diff(port_of(&endpoints.publisher)) < u64::from(size)
        {
            return Err(ValidationError::new(
                fields.data_parallel_size,
                format!(
                    "is {size}: ranks publish on {} + 0..{size} and replay on {replay} + \
                     0..{size}, which overlap; give the replay socket a port at least {size} \
                     away",
                    endpoints.publisher
                ),
            ));
        }
        Ok(Some(endpoints))
    }

    /// The sockets of data-parallel rank `rank` (vLLM's `offset_endpoint_port`: each port +
    /// rank), as one stream.
    pub fn rank(&self, rank: u32) -> Self {
        let offset = |endpoint: &str| match endpoint.rsplit_once(':') {
            Some((address, port)) if rank > 0 => {
                format!("{address}:{}", port_of_text(port) + u64::from(rank))
            }
            _ => endpoint.to_owned(),
        };
        Self {
            publisher: offset(&self.publisher),
            replay: self.replay.as_deref().map(offset),
            data_parallel_size: 1,
        }
    }
}

fn port_of_text(port: &str) -> u64 {
    port.parse::<u16>().map_or(0, u64::from)
}

/// The host of a checked `tcp://host:port` endpoint.
fn host_of(endpoint: &str) -> &str {
    endpoint.rsplit_once(':').map_or(endpoint, |(host, _)| host)
}

/// The port of a checked `tcp://host:port` endpoint.
fn port_of(endpoint: &str) -> u64 {
    endpoint
        .rsplit_once(':')
        .map_or(0, |(_, port)| port_of_text(port))
}

/// Checks a ZMQ endpoint a router can connect to: `tcp://host:port` (host a name, an IPv4
/// address or a bracketed IPv6 address; not the bind wildcard `*`; port 1–65535).
pub fn validate_zmq_tcp_endpoint(endpoint: &str, field: &str) -> Result<String, ValidationError> {
    let bad = |why: &str| ValidationError::new(field, format!("{endpoint:?} {why}"));
    let Some(address) = endpoint.strip_prefix("tcp://") else {
        return Err(bad("must look like tcp://host:port"));
    };
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err(bad("needs a port (tcp://host:port)"));
    };
    if host.is_empty() || host == "*" || host.contains('/') || host.chars().any(char::is_whitespace)
    {
        return Err(bad(
            "needs a host routers can connect to (not *), e.g. tcp://10.0.0.7:5557",
        ));
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(endpoint.to_owned()),
        _ => Err(bad("needs a port between 1 and 65535")),
    }
}

/// Checks an instance base URL: `http://host[:port][/path-prefix]`, no query, no fragment.
/// Returns the URL without a trailing slash.
pub fn validate_instance_url(url: &str) -> Result<String, ValidationError> {
    let field = "Url";
    if url.len() > MAX_URL_BYTES {
        return Err(ValidationError::new(
            field,
            format!("is {} bytes long; at most {MAX_URL_BYTES}", url.len()),
        ));
    }
    let uri: http::Uri = url
        .parse()
        .map_err(|err| ValidationError::new(field, format!("{url:?} is not a URL: {err}")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(ValidationError::new(
                field,
                format!("{url:?}: https to instances is not supported yet; use http://"),
            ));
        }
        _ => {
            return Err(ValidationError::new(
                field,
                format!("{url:?} must start with http://"),
            ));
        }
    }
    let Some(authority) = uri.authority() else {
        return Err(ValidationError::new(field, format!("{url:?} has no host")));
    };
    if authority.host().is_empty() || authority.as_str().contains('@') {
        return Err(ValidationError::new(
            field,
            format!("{url:?} needs a host and no user info"),
        ));
    }
    // `http::Uri` accepts any port text and then reports no port: an unusable port would
    // silently become 80.
    let after_host = authority
        .as_str()
        .rsplit_once(']')
        .map_or(authority.as_str(), |(_, rest)| rest);
    if let Some((_, port)) = after_host.rsplit_once(':')
        && !matches!(port.parse::<u16>(), Ok(1..))
    {
        return Err(ValidationError::new(
            field,
            format!("{url:?}: the port {port:?} is not a number in 1..=65535"),
        ));
    }
    if uri.query().is_some() || url.contains('#') {
        return Err(ValidationError::new(
            field,
            format!("{url:?} must not have a query or fragment"),
        ));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

pub fn validate_instance_weight(weight: f64) -> Result<(), ValidationError> {
    if weight.is_finite() && weight > 0.0 && weight <= 1_000_000.0 {
        Ok(())
    } else {
        Err(ValidationError::new(
            "Weight",
            format!("must be above 0 and at most 1000000, got {weight}"),
        ))
    }
}

pub fn validate_ttl(ttl_seconds: u32) -> Result<(), ValidationError> {
    if ttl_seconds == 0 || (2..=MAX_TTL_SECONDS).contains(&ttl_seconds) {
        Ok(())
    } else {
        Err(ValidationError::new(
            "TtlSeconds",
            format!("must be 0 (no lease) or 2..={MAX_TTL_SECONDS}, got {ttl_seconds}"),
        ))
    }
}
