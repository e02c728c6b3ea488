//! ARCHITECTURE.md's invariants as tests over the dependency graph (`cargo metadata`), so
//! they cannot silently go false: the routing policy stays free of async runtimes and network
//! stacks, the simulator and the policy of OpenTelemetry and gRPC, nothing under `data-plane/`
//! reaches etcd, no product crate carries benchmark or test code, and every workspace crate
//! depends only on the crates the code map allows it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The resolved dependency graph of the workspace, for this machine's platform.
struct Graph {
    root: PathBuf,
    /// Package id -> (name, manifest directory).
    packages: BTreeMap<String, (String, PathBuf)>,
    /// Package id -> ids of its normal and build dependencies (dev-dependencies left out: they
    /// never reach a built binary).
    edges: BTreeMap<String, Vec<String>>,
    members: BTreeSet<String>,
}

fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let output = Command::new(rustc)
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("host: "))
        .expect("rustc -vV names the host")
        .to_owned()
}

impl Graph {
    fn load() -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        // --locked: never rewrite Cargo.lock from a test; --offline with the host platform
        // only: everything needed to build here is already downloaded.
        let output = Command::new(cargo)
            .args(["metadata", "--format-version", "1", "--locked", "--offline"])
            .args(["--filter-platform", &host_triple()])
            .arg("--manifest-path")
            .arg(root.join("Cargo.toml"))
            .output()
            .expect("cargo metadata runs");
        assert!(
            output.status.success(),
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let metadata: Value = serde_json::from_slice(&output.stdout).expect("metadata JSON");
        let packages = metadata["packages"]
            .as_array()
            .expect("packages")
            .iter()
            .map(|package| {
                let manifest = PathBuf::from(package["manifest_path"].as_str().expect("path"));
                (
                    package["id"].as_str().expect("id").to_owned(),
                    (
                        package["name"].as_str().expect("name").to_owned(),
                        manifest.parent().expect("manifest directory").to_path_buf(),
                    ),
                )
            })
            .collect();
        let edges = metadata["resolve"]["nodes"]
            .as_array()
            .expect("resolve.nodes")
            .iter()
            .map(|node| {
                let deps = node["deps"]
                    .as_array()
                    .expect("deps")
                    .iter()
                    .filter(|dep| {
                        dep["dep_kinds"]
                            .as_array()
                            .expect("dep_kinds")
                            .iter()
                            .any(|kind| kind["kind"] != "dev")
                    })
                    .map(|dep| dep["pkg"].as_str().expect("pkg").to_owned())
                    .collect();
                (node["id"].as_str().expect("id").to_owned(), deps)
            })
            .collect();
        let members = metadata["workspace_members"]
            .as_array()
            .expect("workspace_members")
            .iter()
            .map(|id| id.as_str().expect("id").to_owned())
            .collect();
        let root = PathBuf::from(metadata["workspace_root"].as_str().expect("root"));
        Self {
            root,
            packages,
            edges,
            members,
        }
    }

    fn name(&self, id: &str) -> &str {
        &self.packages[id].0
    }

    fn member(&self, name: &str) -> String {
        self.members
            .iter()
            .find(|id| self.name(id) == name)
            .unwrap_or_else(|| panic!("no workspace crate {name}"))
            .clone()
    }

    /// Names of every package `id` depends on, directly or not (normal and build kinds).
    fn closure(&self, id: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![id.to_owned()];
        while let Some(next) = stack.pop() {
            for dep in self.edges.get(&next).into_iter().flatten() {
                if seen.insert(dep.clone()) {
                    stack.push(dep.clone());
                }
            }
        }
        seen.iter().map(|dep| self.name(dep).to_owned()).collect()
    }

    /// Direct dependencies of `id` that are workspace crates.
    fn internal_deps(&self, id: &str) -> BTreeSet<String> {
        self.edges
            .get(id)
            .into_iter()
            .flatten()
            .filter(|dep| self.members.contains(*dep))
            .map(|dep| self.name(dep).to_owned())
            .collect()
    }
}

/// A rule broken in `graph`, if any: `forbidden` crates reachable from `crate_name`.
fn reachable(graph: &Graph, crate_name: &str, forbidden: &[&str]) -> Vec<String> {
    let closure = graph.closure(&graph.member(crate_name));
    forbidden
        .iter()
        .filter(|name| closure.contains(**name))
        .map(|name| (*name).to_owned())
        .collect()
}

#[test]
fn the_routing_policy_stays_free_of_runtimes_and_network_stacks() {
    let graph = Graph::load();
    let found = reachable(
        &graph,
        "switchyard-policy",
        &[
            "tokio",
            "tonic",
            "axum",
            "hyper",
            "mio",
            "h2",
            "etcd-client",
        ],
    );
    assert!(
        found.is_empty(),
        "switchyard-policy must stay pure (ARCHITECTURE.md) but depends on {found:?}"
    );
}

#[test]
fn the_simulator_and_the_policy_carry_no_opentelemetry_and_no_grpc() {
    let graph = Graph::load();
    for name in ["switchyard-engine-sim", "switchyard-policy"] {
        let found: Vec<String> = graph
            .closure(&graph.member(name))
            .into_iter()
            .filter(|dep| {
                dep.starts_with("opentelemetry")
                    || dep.starts_with("tracing-opentelemetry")
                    || dep.starts_with("tonic")
            })
            .collect();
        assert!(
            found.is_empty(),
            "{name} must not depend on OpenTelemetry or tonic (ARCHITECTURE.md), but reaches {found:?}"
        );
    }
}

#[test]
fn no_product_crate_carries_benchmark_or_test_code() {
    let graph = Graph::load();
    for name in [
        "switchyard-router",
        "switchyard-control",
        "switchyard-engine-sim",
        "switchyard-cluster",
        "switchyard-cli",
    ] {
        let found = reachable(
            &graph,
            name,
            &["switchyard-bench", "switchyard-testkit", "switchyard-tests"],
        );
        assert!(
            found.is_empty(),
            "{name} is part of what users run and must not depend on {found:?}"
        );
    }
}

#[test]
fn nothing_under_data_plane_reaches_etcd() {
    let graph = Graph::load();
    let data_plane = graph.root.join("data-plane");
    let crates: Vec<&str> = graph
        .members
        .iter()
        .filter(|id| graph.packages[*id].1.starts_with(&data_plane))
        .map(|id| graph.name(id))
        .collect();
    assert!(
        crates.contains(&"switchyard-router") && crates.contains(&"switchyard-policy"),
        "the data plane's crates were not found under {}: {crates:?}",
        data_plane.display()
    );
    for name in crates {
        let found = reachable(&graph, name, &["etcd-client"]);
        assert!(
            found.is_empty(),
            "{name} is under data-plane/ and must never talk to etcd, but depends on etcd-client"
        );
    }
}

/// The code map of ARCHITECTURE.md: crate name -> the workspace crates it may depend on.
fn code_map(graph: &Graph) -> BTreeMap<String, BTreeSet<String>> {
    let text =
        std::fs::read_to_string(graph.root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let workspace: BTreeSet<String> = graph
        .members
        .iter()
        .map(|id| graph.name(id).to_owned())
        .collect();
    let mut map = BTreeMap::new();
    let mut above = BTreeSet::new();
    for line in text
        .lines()
        .filter(|line| line.starts_with("| `switchyard-"))
    {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let name = cells[0]
            .split('`')
            .nth(1)
            .expect("a crate name in backticks")
            .to_owned();
        let allowed_cell = cells.last().copied().unwrap_or_default();
        let allowed: BTreeSet<String> = match allowed_cell {
            "all" => workspace.clone(),
            "all of the above" => above.clone(),
            list => list
                .split(',')
                .map(|short| format!("switchyard-{}", short.trim()))
                .filter(|name| workspace.contains(name))
                .collect(),
        };
        above.insert(name.clone());
        map.insert(name, allowed);
    }
    map
}

#[test]
fn every_crate_depends_only_on_what_the_code_map_allows() {
    let graph = Graph::load();
    let map = code_map(&graph);
    let mut problems = Vec::new();
    for id in &graph.members {
        let name = graph.name(id);
        let Some(allowed) = map.get(name) else {
            problems.push(format!("{name} has no row in ARCHITECTURE.md's code map"));
            continue;
        };
        for dep in graph.internal_deps(id) {
            if !allowed.contains(&dep) {
                problems.push(format!(
                    "{name} depends on {dep}; ARCHITECTURE.md allows only {allowed:?}"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // The map was read, not found empty: the router's row names the policy.
    assert!(map["switchyard-router"].contains("switchyard-policy"));
}
