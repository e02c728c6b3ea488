//! `switchyard-bench dpd`'s flags, and the settings a run is made from.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

/// The smallest long prompt, as a multiple of the threshold (the acceptance rule).
pub const MIN_LONG_FACTOR: f64 = 1.25;

#[derive(Debug, Clone, clap::Args)]
pub struct DpdArgs {
    /// A smoke run of a few seconds: 1P1D only, concurrency 4, a mixed load at 4, 2 requests
    /// per client, 32 output tokens (flags given explicitly still win).
    #[arg(long)]
    pub quick: bool,
    /// Topologies, each `<P>P<D>D` (prefill and decode engines), compared with a colocated
    /// fleet of P + D engines. Default: 1P1D,2P1D,2P2D.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub topologies: Option<Vec<String>>,
    /// Client concurrencies (closed loop) of the long-prompt loads. Default: 8,16,32.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub concurrency: Option<Vec<usize>>,
    /// Engines of the colocated baseline. Default: as many as the topology has (P + D); 1
    /// with 1P1D is the article's own baseline (one node against DPD's two).
    #[arg(long, value_name = "N")]
    pub colocated_engines: Option<usize>,
    /// Concurrency of the mixed long/short load; 0 leaves it out. Default: 16.
    #[arg(long, value_name = "N")]
    pub mixed_concurrency: Option<usize>,
    /// Fraction of long prompts in the mixed load (the rest: 64–900 tokens).
    #[arg(long, default_value_t = 0.5, value_name = "F")]
    pub long_fraction: f64,
    /// The disaggregated endpoint's RouteThreshold, in tokens (as the router counts them).
    #[arg(long, default_value_t = 4096, value_name = "TOKENS")]
    pub threshold: u32,
    /// Tokens of each long prompt as the router counts them (cl100k_base); at least 1.25 ×
    /// the threshold. Default: 1.27 × the threshold (5,202 for 4,096).
    #[arg(long, value_name = "TOKENS")]
    pub long_tokens: Option<u32>,
    /// Output tokens per request. Default: 256 (quick: 32).
    #[arg(long, value_name = "TOKENS")]
    pub output_tokens: Option<u32>,
    /// Requests in each run per client (a run sends this × its concurrency). Default: 6
    /// (quick: 2).
    #[arg(long, value_name = "N")]
    pub requests_per_client: Option<usize>,
    /// The simulated engines' clock: 0.25 runs four times faster than the modelled GPUs.
    #[arg(long, default_value_t = 0.25, value_name = "X")]
    pub time_scale: f64,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub seed: u64,
    /// A request that has not finished after this many wall seconds counts as failed.
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    pub request_timeout_seconds: u64,
    /// No progress line on stderr.
    #[arg(long)]
    pub no_progress: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the chart (changes against colocated) as SVG.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
}

/// `P` prefill and `D` decode engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Topology {
    pub prefill: usize,
    pub decode: usize,
}

impl Topology {
    /// `1P1D`, `2p1d`, …
    pub fn parse(text: &str) -> Result<Self, TopologyError> {
        let upper = text.trim().to_ascii_uppercase();
        let parsed = upper.strip_suffix('D').and_then(|rest| {
            let (prefill, decode) = rest.split_once('P')?;
            Some((prefill.parse().ok()?, decode.parse().ok()?))
        });
        match parsed {
            Some((prefill, decode)) if (1..=8).contains(&prefill) && (1..=8).contains(&decode) => {
                Ok(Self { prefill, decode })
            }
            _ => Err(TopologyError {
                text: text.to_owned(),
            }),
        }
    }

    pub fn engines(self) -> usize {
        self.prefill + self.decode
    }

    pub fn name(self) -> String {
        format!("{}P{}D", self.prefill, self.decode)
    }
}

/// A `--topologies` entry that is not `<P>P<D>D`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--topologies: {text:?} is not <P>P<D>D with 1 to 8 engines of each role (e.g. 2P1D)")]
pub struct TopologyError {
    pub text: String,
}

/// One load: a closed loop of `concurrency` clients over `long_fraction` long prompts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Load {
    pub name: String,
    pub concurrency: usize,
    pub long_fraction: f64,
    pub requests: usize,
}

/// Everything a `dpd` run is made from.
#[derive(Debug, Clone)]
pub struct DpdSettings {
    pub topologies: Vec<Topology>,
    /// `None`: as many as each topology.
    pub colocated_engines: Option<usize>,
    pub loads: Vec<Load>,
    pub threshold: u32,
    pub long_tokens: u32,
    pub output_tokens: u32,
    pub time_scale: f64,
    pub seed: u64,
    pub request_timeout: Duration,
    pub progress: bool,
}

impl DpdSettings {
    pub fn from_args(args: &DpdArgs) -> Result<Self, DpdArgsError> {
        let quick = args.quick;
        let topologies = match &args.topologies {
            Some(list) => list
                .iter()
                .map(|text| Topology::parse(text))
                .collect::<Result<Vec<_>, _>>()?,
            None if quick => vec![Topology {
                prefill: 1,
                decode: 1,
            }],
            None => ["1P1D", "2P1D", "2P2D"]
                .iter()
                .map(|text| Topology::parse(text))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let concurrency = args
            .concurrency
            .clone()
            .unwrap_or_else(|| if quick { vec![4] } else { vec![8, 16, 32] });
        let mixed = args.mixed_concurrency.unwrap_or(if quick { 4 } else { 16 });
        let per_client = args
            .requests_per_client
            .unwrap_or(if quick { 2 } else { 6 });
        if per_client == 0 || per_client > 1000 {
            return Err(DpdArgsError::RequestsPerClient);
        }
        if concurrency.iter().any(|&c| c == 0 || c > 512) || mixed > 512 {
            return Err(DpdArgsError::Concurrency);
        }
        if !(args.long_fraction > 0.0 && args.long_fraction < 1.0) {
            return Err(DpdArgsError::LongFraction);
        }
        let mut loads: Vec<Load> = concurrency
            .iter()
            .map(|&c| Load {
                name: format!("long c={c}"),
                concurrency: c,
                long_fraction: 1.0,
                requests: c * per_client,
            })
            .collect();
        if mixed > 0 {
            loads.push(Load {
                name: format!("mixed c={mixed}"),
                concurrency: mixed,
                long_fraction: args.long_fraction,
                requests: mixed * per_client,
            });
        }
        if loads.is_empty() || topologies.is_empty() {
            return Err(DpdArgsError::NothingToRun);
        }
        if args.threshold < 64 || args.threshold > 100_000 {
            return Err(DpdArgsError::Threshold);
        }
        let minimum = (f64::from(args.threshold) * MIN_LONG_FACTOR).ceil() as u32;
        let long_tokens = args
            .long_tokens
            .unwrap_or((f64::from(args.threshold) * 1.27).ceil() as u32);
        if long_tokens < minimum || long_tokens > 120_000 {
            return Err(DpdArgsError::LongTokens { minimum });
        }
        let output_tokens = args.output_tokens.unwrap_or(if quick { 32 } else { 256 });
        if !(2..=4096).contains(&output_tokens) {
            return Err(DpdArgsError::OutputTokens);
        }
        if !(args.time_scale > 0.0 && args.time_scale <= 10.0) {
            return Err(DpdArgsError::TimeScale);
        }
        if args.request_timeout_seconds == 0 {
            return Err(DpdArgsError::RequestTimeout);
        }
        if args
            .colocated_engines
            .is_some_and(|engines| !(1..=16).contains(&engines))
        {
            return Err(DpdArgsError::ColocatedEngines);
        }
        Ok(Self {
            topologies,
            colocated_engines: args.colocated_engines,
            loads,
            threshold: args.threshold,
            long_tokens,
            output_tokens,
            time_scale: args.time_scale,
            seed: args.seed,
            request_timeout: Duration::from_secs(args.request_timeout_seconds),
            progress: !args.no_progress,
        })
    }
}

/// A `dpd` flag out of range; the message names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DpdArgsError {
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error("--requests-per-client must be within 1..=1000")]
    RequestsPerClient,
    #[error("--concurrency and --mixed-concurrency must be within 1..=512")]
    Concurrency,
    #[error("--long-fraction must be strictly between 0 and 1")]
    LongFraction,
    #[error("nothing to run: no load or no topology")]
    NothingToRun,
    #[error("--threshold must be within 64..=100000 tokens")]
    Threshold,
    #[error("--long-tokens must be within {minimum}..=120000 (at least 1.25 × --threshold)")]
    LongTokens { minimum: u32 },
    #[error("--output-tokens must be within 2..=4096")]
    OutputTokens,
    #[error("--time-scale must be within (0, 10]")]
    TimeScale,
    #[error("--request-timeout-seconds must be at least 1")]
    RequestTimeout,
    #[error("--colocated-engines must be within 1..=16")]
    ColocatedEngines,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topologies_parse_and_bad_ones_name_the_flag() {
        assert_eq!(
            Topology::parse("2p1d"),
            Ok(Topology {
                prefill: 2,
                decode: 1
            })
        );
        assert_eq!(Topology::parse("1P1D").unwrap().engines(), 2);
        for bad in ["", "1P", "P1D", "0P1D", "1P9D", "xPyD"] {
            assert!(
                Topology::parse(bad)
                    .unwrap_err()
                    .to_string()
                    .contains("--topologies"),
                "{bad}"
            );
        }
    }
}
