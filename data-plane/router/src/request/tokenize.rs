//! The `/tokenize` client of the settle phase: the request's token ids from the engine itself,
//! vLLM's `POST /tokenize`, as vLLM's own router does.
//!
//! The request path asks the least loaded available instance of the variant
//! ([`least_loaded`]) with a short deadline ([`DEFAULT_TIMEOUT`], 250 ms: a tokenization takes
//! about a millisecond on a vLLM server that is not saturated). On any failure (no instance,
//! refused connection, timeout, an error status, an unreadable answer) the caller routes that
//! request as LEAST_OUTSTANDING_REQUESTS; nothing is retried, so a slow engine costs at most
//! the deadline. An instance whose `/tokenize` failed twice in a row on its side (no
//! connection, no answer in time, a 5xx, 408 or 429 status, an unreadable answer; not another
//! 4xx, which is the request's own fault) is not asked again for a while
//! ([`crate::routing::cells::TokenizeBackoff`]: `--kv-tokenize-pause-ms`, 1 s, doubling with
//! each further failure up to 30 s), then by one request before the others, so a hung
//! tokenizer costs the deadline about once per pause instead of on every request; the others
//! are asked meanwhile. What is sent: [`crate::plan::tokens`].

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

use crate::plan::tokens::{Prompt, PromptKind, PromptTokens, TokenizeError};
use crate::request::read::OFFLOAD_BYTES;
use crate::routing::cells::InstanceCell;
use crate::routing::table::VariantRoute;

/// How long the engine may take to answer `/tokenize`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);
/// The first pause of an instance whose `/tokenize` keeps failing (`--kv-tokenize-pause-ms`).
pub const DEFAULT_PAUSE: Duration = Duration::from_millis(1_000);
/// Largest `/tokenize` answer read (a 128 K-token prompt is about 1 MB of JSON).
const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// Answers above this are parsed on a blocking thread (about 40 K tokens, ~0.5 ms of parsing).
const OFFLOAD_ANSWER_BYTES: usize = 256 * 1024;

/// The least loaded available instance not paused whose turn a request asked at `asked_ms`
/// can claim for `deadline_ms` (after a pause only one request probes): each instance is
/// tried at most once.
fn claim_instance(
    variant: &VariantRoute,
    now_ms: u64,
    asked_ms: u64,
    deadline_ms: u64,
) -> Result<usize, TokenizeError> {
    let mut passed = Vec::new();
    loop {
        let candidate = least(variant, |index, cell| {
            cell.available(now_ms)
                && cell.tokenize_backoff.ready(asked_ms)
                && !passed.contains(&index)
        });
        match candidate {
            Some(index)
                if variant.instances[index]
                    .cell
                    .tokenize_backoff
                    .claim(asked_ms, deadline_ms) =>
            {
                return Ok(index);
            }
            Some(index) => passed.push(index),
            None if least(variant, |_, cell| cell.available(now_ms)).is_some() => {
                return Err(TokenizeError::BackingOff);
            }
            None => return Err(TokenizeError::NoInstance),
        }
    }
}

/// The instance to ask: the available one, not paused after failing to tokenize, with the
/// fewest fleet-wide requests in flight (the first such in table order on a tie: an idle fleet
/// sends every `/tokenize` to the same instance; spreading ties at random would send half of
/// them to an instance that has just died and is not yet ejected, as a test showed).
pub fn least_loaded(variant: &VariantRoute, now_ms: u64) -> Option<usize> {
    let clock = switchyard_process::clock::monotonic_ms();
    least(variant, |_, cell| {
        cell.available(now_ms) && cell.tokenize_backoff.ready(clock)
    })
}

fn least(variant: &VariantRoute, wanted: impl Fn(usize, &InstanceCell) -> bool) -> Option<usize> {
    variant
        .instances
        .iter()
        .enumerate()
        .filter(|(index, instance)| wanted(*index, &instance.cell))
        .min_by_key(|(position, instance)| (instance.cell.fleet_load(), *position))
        .map(|(position, _)| position)
}

/// `prompt`'s `/tokenize` body ([`Prompt::tokenize_body`]: a parse and a copy of the request's
/// body), made on a blocking thread for a body above [`OFFLOAD_BYTES`] as planning is.
pub(crate) async fn tokenize_body(prompt: &Prompt) -> Result<Bytes, TokenizeError> {
    if prompt.body_len() <= OFFLOAD_BYTES {
        return prompt.tokenize_body();
    }
    let prompt = prompt.clone();
    tokio::task::spawn_blocking(move || prompt.tokenize_body())
        .await
        .unwrap_or_else(|err| Err(TokenizeError::Input(err.to_string())))
}

#[derive(Deserialize)]
struct Answer {
    tokens: Vec<u32>,
}

/// The request's token ids as the engine sees them: a token-id prompt as given, else the least
/// loaded available instance's `/tokenize`, cut as the engine cuts a truncated prompt. An
/// error means "route by load" (also a cut that needs the model's tokenizer). (The request
/// path does the same in two steps: `PromptTokens::of` at planning,
/// [`TokenizeClient::token_ids`] when it settles.)
pub async fn request_tokens(
    client: &TokenizeClient,
    variant: &VariantRoute,
    kind: PromptKind,
    body: &[u8],
    now_ms: u64,
) -> Result<Vec<u32>, TokenizeError> {
    let tokens = PromptTokens::of(kind, body)?;
    let kept = match &tokens {
        PromptTokens::Ask(prompt) => prompt.kept(),
        PromptTokens::Known(_) => None,
    };
    let ids = client.token_ids(tokens, variant, now_ms).await?;
    match kept {
        None => Ok(ids),
        Some(kept) if kept.needs_tokenizer() => Err(TokenizeError::Input(
            "which ids the engine's tokenizer added is not known here".into(),
        )),
        Some(kept) => Ok(kept.apply(ids, switchyard_tokenize::truncation::Cut::LEFT)),
    }
}

/// A `/tokenize` client (HTTP/1.1 keep-alive, `TCP_NODELAY`), one per serving thread.
#[derive(Debug, Clone)]
pub struct TokenizeClient {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    /// The first pause of an instance that keeps failing
    /// ([`crate::routing::cells::TokenizeBackoff`]).
    pause_ms: u64,
}

impl TokenizeClient {
    /// With the default first pause ([`DEFAULT_PAUSE`]).
    pub fn new(timeout: Duration) -> Self {
        Self::with_pause(timeout, DEFAULT_PAUSE)
    }

    pub fn with_pause(timeout: Duration, pause: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            timeout,
            pause_ms: u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// A client of its own with the same settings.
    pub fn like(&self) -> Self {
        Self::with_pause(self.timeout, Duration::from_millis(self.pause_ms))
    }

    /// The deadline of one `/tokenize` exchange.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The token ids: as given, or from the least loaded available instance of `variant`
    /// that is not paused ([`crate::routing::cells::TokenizeBackoff`]).
    pub async fn token_ids(
        &self,
        tokens: PromptTokens,
        variant: &VariantRoute,
        now_ms: u64,
    ) -> Result<Vec<u32>, TokenizeError> {
        let body = match tokens {
            PromptTokens::Known(ids) => return Ok(ids),
            PromptTokens::Ask(prompt) => tokenize_body(&prompt).await?,
        };
        let clock = switchyard_process::clock::monotonic_ms;
        let asked = clock();
        let deadline = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        let instance = claim_instance(variant, now_ms, asked, deadline)?;
        let route = &variant.instances[instance];
        let backoff = &route.cell.tokenize_backoff;
        let result = self.tokenize(&route.url, body).await;
        match &result {
            Ok(_) => {
                if backoff.answered() {
                    tracing::info!(instance = %route.id, "the instance's /tokenize answers again");
                }
            }
            Err(err) if err.instance_at_fault() => {
                if let Some(pause) = backoff.failed(asked, clock(), self.pause_ms) {
                    tracing::warn!(instance = %route.id, error = %err, pause_ms = pause, "/tokenize keeps failing on the instance; asking the others meanwhile");
                }
            }
            Err(_) => {}
        }
        result
    }

    /// Asks the engine at `base_url` to tokenize `body` (see [`crate::plan::tokens::tokenize_body`]).
    pub async fn tokenize(&self, base_url: &str, body: Bytes) -> Result<Vec<u32>, TokenizeError> {
        let url = format!("{base_url}/tokenize");
        let request_error = |message: String| TokenizeError::Request {
            url: url.clone(),
            message,
        };
        let request = http::Request::post(&url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|err| request_error(err.to_string()))?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|err| request_error(err.to_string()))?;
            let status = response.status().as_u16();
            if status != 200 {
                return Err(TokenizeError::Status {
                    url: url.clone(),
                    status,
                });
            }
            let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|err| TokenizeError::Answer {
                    url: url.clone(),
                    message: err.to_string(),
                })?
                .to_bytes();
            let large = body.len() > OFFLOAD_ANSWER_BYTES;
            let parse = move || {
                serde_json::from_slice::<Answer>(&body)
                    .map(|answer| answer.tokens)
                    .map_err(|err| err.to_string())
            };
            let parsed = if large {
                tokio::task::spawn_blocking(parse)
                    .await
                    .unwrap_or_else(|err| Err(err.to_string()))
            } else {
                parse()
            };
            parsed.map_err(|message| TokenizeError::Answer {
                url: url.clone(),
                message,
            })
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| TokenizeError::Timeout {
                url: url.clone(),
                timeout: self.timeout,
            })?
    }
}

impl Default for TokenizeClient {
    fn default() -> Self {
        Self::new(DEFAULT_TIMEOUT)
    }
}
