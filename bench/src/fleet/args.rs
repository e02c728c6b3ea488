//! `switchyard-bench fleet`'s flags.

use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args)]
pub struct FleetArgs {
    /// Instances registered (spread evenly over the endpoints).
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    pub instances: usize,
    /// Endpoints (each on one of 10 endpoint configs).
    #[arg(long, default_value_t = 1_000, value_name = "N")]
    pub endpoints: usize,
    /// Sync clients in this process, each running the router's sync code on its own thread.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub routers: usize,
    /// Timed changes (alternately an instance registered and deregistered).
    #[arg(long, default_value_t = 200, value_name = "N")]
    pub changes: usize,
    /// New routers timed joining the running fleet, one after another.
    #[arg(long, default_value_t = 5, value_name = "N")]
    pub joins: usize,
    /// Measure on etcd too, at this URL (a prefix of its own is used and removed).
    #[arg(long, value_name = "URL")]
    pub etcd: Option<String>,
    /// Skip the embedded store (with --etcd: measure etcd only).
    #[arg(long)]
    pub skip_embedded: bool,
    /// Workers of the rolling restart (each deregisters and registers its share, one instance
    /// at a time); 0 skips it.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub rolling_workers: usize,
    /// Real `switchyard-router` processes in the smoke run; 0 skips it.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub processes: usize,
    /// The switchyard-router executable for the smoke run. Default: next to this one.
    #[arg(long, value_name = "FILE")]
    pub router_bin: Option<PathBuf>,
    /// The switchyard-control executable for the smoke run (embedded store). Default: next
    /// to this one.
    #[arg(long, value_name = "FILE")]
    pub control_bin: Option<PathBuf>,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

impl FleetArgs {
    pub(crate) fn check(&self) -> Result<(), FleetArgsError> {
        if self.endpoints == 0 || self.endpoints > 100_000 {
            return Err(FleetArgsError::Endpoints(self.endpoints));
        }
        if self.instances < self.endpoints || self.instances > 1_000_000 {
            return Err(FleetArgsError::Instances {
                instances: self.instances,
                endpoints: self.endpoints,
            });
        }
        if self.routers == 0 || self.routers > 1000 {
            return Err(FleetArgsError::Routers(self.routers));
        }
        if self.changes == 0 || self.changes > 100_000 {
            return Err(FleetArgsError::Changes(self.changes));
        }
        if let Some(url) = &self.etcd
            && !url.starts_with("http://")
        {
            return Err(FleetArgsError::Etcd(url.clone()));
        }
        if self.skip_embedded && self.etcd.is_none() {
            return Err(FleetArgsError::SkipEmbeddedWithoutEtcd);
        }
        Ok(())
    }
}

/// A `fleet` flag out of range; the message names the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetArgsError {
    #[error("--endpoints: {0} is outside 1..=100000")]
    Endpoints(usize),
    #[error(
        "--instances: {instances} must be at least --endpoints ({endpoints}) and at most 1000000"
    )]
    Instances { instances: usize, endpoints: usize },
    #[error("--routers: {0} is outside 1..=1000")]
    Routers(usize),
    #[error("--changes: {0} is outside 1..=100000")]
    Changes(usize),
    #[error("--etcd: {0:?} must start with http://")]
    Etcd(String),
    #[error("--skip-embedded needs --etcd URL")]
    SkipEmbeddedWithoutEtcd,
}
