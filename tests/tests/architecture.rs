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

/// Asserts that no crate `forbidden` says is forbidden is reachable from `crate_name` in
/// `graph`; a failure says which `rule` is broken (`{crate_name} {rule}`) and by which crates.
fn assert_reaches_none(
    graph: &Graph,
    crate_name: &str,
    forbidden: impl Fn(&str) -> bool,
    rule: &str,
) {
    let found: Vec<String> = graph
        .closure(&graph.member(crate_name))
        .into_iter()
        .filter(|dep| forbidden(dep))
        .collect();
    assert!(
        found.is_empty(),
        "{crate_name} {rule}, but depends on {found:?}"
    );
}

/// For [`assert_reaches_none`]: the crates named `names`.
fn named<'a>(names: &'a [&str]) -> impl Fn(&str) -> bool + 'a {
    move |dep| names.contains(&dep)
}

#[test]
fn the_routing_policy_stays_free_of_runtimes_and_network_stacks() {
    let graph = Graph::load();
    assert_reaches_none(
        &graph,
        "switchyard-policy",
        named(&[
            "tokio",
            "tonic",
            "axum",
            "hyper",
            "mio",
            "h2",
            "etcd-client",
        ]),
        "must stay pure (ARCHITECTURE.md)",
    );
}

#[test]
fn the_simulator_and_the_policy_carry_no_opentelemetry_and_no_grpc() {
    let graph = Graph::load();
    for name in ["switchyard-engine-sim", "switchyard-policy"] {
        assert_reaches_none(
            &graph,
            name,
            |dep| {
                dep.starts_with("opentelemetry")
                    || dep.starts_with("tracing-opentelemetry")
                    || dep.starts_with("tonic")
            },
            "must not depend on OpenTelemetry or tonic (ARCHITECTURE.md)",
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
        assert_reaches_none(
            &graph,
            name,
            named(&["switchyard-bench", "switchyard-testkit", "switchyard-tests"]),
            "is part of what users run and must carry no benchmark or test code",
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
        assert_reaches_none(
            &graph,
            name,
            named(&["etcd-client"]),
            "is under data-plane/ and must never talk to etcd",
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

/// The module path of `file` under a crate's `src` (`plan/mod.rs` → `plan`, `lib.rs` → ``).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut path: Vec<String> = relative
        .components()
        .map(|part| part.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        path.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        path.pop();
    }
    path
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            out.push(path);
        }
    }
}

/// The module paths a file's code names: `crate::a::b`, `super::a`, `self::a` (braced use
/// trees too) and `child::x` for its own `mod child;`, read as text, `//` comments and the
/// unit-test module left out.
fn named_paths(text: &str, own: &[String], is_mod_file: bool) -> Vec<Vec<String>> {
    let code: String = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default()
        .lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let parent: Vec<String> = if is_mod_file || own.is_empty() {
        own[..own.len().saturating_sub(usize::from(!own.is_empty()))].to_vec()
    } else {
        own[..own.len() - 1].to_vec()
    };
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut paths = Vec::new();
    let tokens: Vec<&str> = code
        .split(|c: char| !(ident(c) || c == ':' || c == '{' || c == '}' || c == ','))
        .collect();
    for token in tokens {
        for (start, base) in [
            ("crate::", Vec::new()),
            ("super::", parent.clone()),
            ("self::", own.to_vec()),
        ] {
            let mut rest = token;
            while let Some(at) = rest.find(start) {
                let before = rest[..at].chars().last();
                rest = &rest[at + start.len()..];
                if before.is_some_and(ident) {
                    continue;
                }
                let (head, tail) = match rest.split_once('{') {
                    Some((head, tail)) => (head, Some(tail)),
                    None => (rest, None),
                };
                let head: Vec<String> = head
                    .split("::")
                    .filter(|part| !part.is_empty() && part.chars().all(ident))
                    .map(str::to_owned)
                    .collect();
                let mut prefix = base.clone();
                prefix.extend(head.clone());
                match tail {
                    Some(tail) => {
                        for item in tail.split([',', '}']) {
                            let mut path = prefix.clone();
                            path.extend(
                                item.split("::")
                                    .filter(|part| !part.is_empty() && part.chars().all(ident))
                                    .map(str::to_owned),
                            );
                            paths.push(path);
                        }
                    }
                    None => paths.push(prefix),
                }
            }
        }
    }
    // `child::item` for the file's own `mod child;` declarations.
    for line in code.lines() {
        let declaration = line
            .trim_start()
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub ");
        if let Some(child) = declaration
            .strip_prefix("mod ")
            .and_then(|rest| rest.strip_suffix(';'))
        {
            let child = child.trim();
            if code.contains(&format!("{child}::")) {
                let mut path = own.to_vec();
                path.push(child.to_owned());
                paths.push(path);
            }
        }
    }
    paths
}

#[test]
fn no_source_file_imports_a_file_that_imports_it() {
    let graph = Graph::load();
    let mut cycles = Vec::new();
    for id in &graph.members {
        let dir = &graph.packages[id].1;
        let src = dir.join("src");
        if !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        // The library's files (binaries' own main.rs files name the library from outside).
        let modules: BTreeMap<Vec<String>, PathBuf> = files
            .iter()
            .filter(|file| !file.ends_with("main.rs") || !src.join("lib.rs").exists())
            .map(|file| (module_path(&src, file), file.clone()))
            .collect();
        let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
        for (own, file) in &modules {
            let text = std::fs::read_to_string(file).expect("a source file");
            let is_mod_file = file.ends_with("mod.rs") || file.ends_with("lib.rs");
            for path in named_paths(&text, own, is_mod_file) {
                let target = (0..=path.len())
                    .rev()
                    .find_map(|length| modules.get(&path[..length]));
                // The crate root (lib.rs) is its face: children reach its items through
                // `crate::`, and it declares them; that is not counted as a loop.
                if let Some(target) = target
                    && target != file
                    && !target.ends_with("lib.rs")
                {
                    edges
                        .entry(file.clone())
                        .or_default()
                        .insert(target.clone());
                }
            }
        }
        // A file that reaches itself through the files it imports is on a cycle.
        for start in edges.keys() {
            let mut seen = BTreeSet::new();
            let mut stack: Vec<&PathBuf> = edges[start].iter().collect();
            while let Some(next) = stack.pop() {
                if next == start {
                    cycles.push(
                        start
                            .strip_prefix(&graph.root)
                            .unwrap_or(start)
                            .display()
                            .to_string(),
                    );
                    break;
                }
                if seen.insert(next) {
                    stack.extend(edges.get(next).into_iter().flatten());
                }
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "files on an import cycle (a file imports one that, directly or not, imports it): {cycles:?}"
    );
}
