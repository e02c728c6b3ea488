//! The deployment material in `deploy/`, checked against the binaries it runs so the two
//! cannot drift apart: every flag given to a Switchyard binary (Kubernetes manifests, systemd
//! units, the Dockerfile, the commands in deploy/README.md) is one its `--help` lists; every
//! Kubernetes document is well-formed, and its probes, Services, selectors, Prometheus
//! annotations, token files and in-cluster URLs point at things that exist; stop timeouts
//! outlast the shutdown grace periods. Needs no Docker, cluster or network: the binaries only
//! print their help.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

const BINARIES: [&str; 5] = [
    "switchyard",
    "switchyard-control",
    "switchyard-router",
    "switchyard-engine-sim",
    "switchyard-bench",
];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// Files of `dir` whose names end with one of `extensions`, sorted.
fn files(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| {
            path.extension()
                .and_then(|extension| extension.to_str())
                .is_some_and(|extension| extensions.contains(&extension))
        })
        .collect();
    found.sort();
    assert!(
        !found.is_empty(),
        "no {extensions:?} files in {}",
        dir.display()
    );
    found
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn fail_on(problems: &[String]) {
    assert!(
        problems.is_empty(),
        "deploy/ or the documentation has drifted from the code:\n  {}",
        problems.join("\n  ")
    );
}

// --- What the binaries accept, from their --help -------------------------------------------

/// One level of a binary's command line, as its `--help` describes it.
#[derive(Debug, Default)]
struct Help {
    /// Long options, each with whether it takes a value and its default, if shown.
    options: BTreeMap<String, Opt>,
    subcommands: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct Opt {
    takes_value: bool,
    default: Option<String>,
}

impl Help {
    /// Parses clap's help: option lines start (after at most 6 spaces) with `--name` or
    /// `-x, --name`; their description runs to the next option line; subcommands are listed
    /// under `Commands:`.
    fn parse(text: &str) -> Self {
        let mut help = Self::default();
        let mut current: Option<String> = None;
        let mut in_commands = false;
        for line in text.lines() {
            let trimmed = line.trim_start();
            let indent = line.len() - trimmed.len();
            if line.trim_end() == "Commands:" {
                in_commands = true;
                continue;
            }
            if in_commands {
                match trimmed.split_whitespace().next() {
                    Some(command) if indent > 0 => {
                        help.subcommands.insert(command.to_owned());
                    }
                    _ => in_commands = false,
                }
                continue;
            }
            let words: Vec<&str> = trimmed.split_whitespace().collect();
            let long = match words.as_slice() {
                [first, rest @ ..] if indent <= 6 && first.starts_with("--") => {
                    Some((*first, rest))
                }
                [short, second, rest @ ..]
                    if indent <= 6
                        && short.len() == 3
                        && short.starts_with('-')
                        && short.ends_with(',')
                        && second.starts_with("--") =>
                {
                    Some((*second, rest))
                }
                _ => None,
            };
            if let Some((name, rest)) = long {
                let takes_value = rest.first().is_some_and(|word| word.starts_with('<'));
                help.options.insert(
                    name.to_owned(),
                    Opt {
                        takes_value,
                        default: None,
                    },
                );
                current = Some(name.to_owned());
            }
            if let Some(name) = &current
                && let Some(start) = line.find("[default: ")
            {
                let value = &line[start + "[default: ".len()..];
                let value = value.split(']').next().unwrap_or_default();
                if let Some(option) = help.options.get_mut(name) {
                    option.default.get_or_insert_with(|| value.to_owned());
                }
            }
        }
        help
    }
}

/// `--help` of each (binary, subcommand path), run once.
#[derive(Default)]
struct Helps(HashMap<(String, Vec<String>), Help>);

impl Helps {
    fn get(&mut self, binary: &str, path: &[String]) -> &Help {
        self.0
            .entry((binary.to_owned(), path.to_vec()))
            .or_insert_with(|| {
                let output = Command::new(switchyard_tests::binary(binary))
                    .args(path)
                    .arg("--help")
                    .env_remove("SWITCHYARD_CONTROL_PLANE")
                    .output()
                    .expect("the binary runs");
                assert!(
                    output.status.success(),
                    "{binary} {} --help failed",
                    path.join(" ")
                );
                Help::parse(&String::from_utf8_lossy(&output.stdout))
            })
    }
}

/// A command line of one of our binaries, found in deploy/.
#[derive(Debug)]
struct Invocation {
    binary: String,
    args: Vec<String>,
    /// Where it was found, for messages.
    origin: String,
}

/// The flags of a checked invocation: name -> value (None for a flag without one).
type Flags = BTreeMap<String, Option<String>>;

/// Checks each flag of `invocation` against the `--help` of the (sub)command it is given to,
/// descending into subcommands as they appear, and returns the flags.
fn check_flags(helps: &mut Helps, invocation: &Invocation, problems: &mut Vec<String>) -> Flags {
    let binary = invocation.binary.as_str();
    let mut path: Vec<String> = Vec::new();
    let mut flags = Flags::new();
    let mut args = invocation.args.iter();
    while let Some(arg) = args.next() {
        if arg == "--" {
            break;
        }
        let help = helps.get(binary, &path);
        if let Some(flag) = arg.strip_prefix("--") {
            let (name, inline) = match flag.split_once('=') {
                Some((name, value)) => (format!("--{name}"), Some(value.to_owned())),
                None => (format!("--{flag}"), None),
            };
            let Some(option) = help.options.get(&name) else {
                problems.push(format!(
                    "{}: `{}` does not accept {name} (not in its --help)",
                    invocation.origin,
                    std::iter::once(binary.to_owned())
                        .chain(path.iter().cloned())
                        .collect::<Vec<_>>()
                        .join(" ")
                ));
                continue;
            };
            let value = match inline {
                Some(value) => Some(value),
                None if option.takes_value => args.next().cloned(),
                None => None,
            };
            flags.insert(name, value);
        } else if !arg.starts_with('-') && help.subcommands.contains(arg) {
            path.push(arg.clone());
        }
    }
    flags
}

/// The value of `flag` in `flags`, or its default from the binary's `--help`.
fn flag_or_default(helps: &mut Helps, binary: &str, flags: &Flags, flag: &str) -> Option<String> {
    match flags.get(flag) {
        Some(value) => value.clone(),
        None => helps
            .get(binary, &[])
            .options
            .get(flag)
            .and_then(|option| option.default.clone()),
    }
}

// --- Command lines in text: systemd units, the Dockerfile, README code blocks ---------------

fn end_word(word: &mut String, in_word: &mut bool, words: &mut Vec<String>) {
    if *in_word {
        words.push(std::mem::take(word));
        *in_word = false;
    }
}

/// Splits `text` into logical lines of shell-like words: whitespace separates words, quotes
/// group them (across line ends too), a backslash before a line end continues the line, and
/// `#` at the start of a word comments out the rest of the line.
fn shell_lines(text: &str) -> Vec<Vec<String>> {
    let mut lines = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if let Some(open) = quote {
            if c == open {
                quote = None;
            } else {
                word.push(c);
            }
            continue;
        }
        match c {
            '\'' | '"' => {
                quote = Some(c);
                in_word = true;
            }
            '\\' if chars.peek() == Some(&'\n') => {
                chars.next();
                end_word(&mut word, &mut in_word, &mut words);
            }
            '#' if !in_word => {
                while chars.peek().is_some_and(|next| *next != '\n') {
                    chars.next();
                }
            }
            '\n' => {
                end_word(&mut word, &mut in_word, &mut words);
                if !words.is_empty() {
                    lines.push(std::mem::take(&mut words));
                }
            }
            c if c.is_whitespace() => end_word(&mut word, &mut in_word, &mut words),
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    end_word(&mut word, &mut in_word, &mut words);
    if !words.is_empty() {
        lines.push(words);
    }
    lines
}

/// Words after which the next word is a command.
const COMMAND_SEPARATORS: [&str; 6] = ["--", "&&", "||", ";", "|", "&"];
/// Words that run the next word as a command.
const COMMAND_PREFIXES: [&str; 9] = [
    "sudo", "exec", "env", "nohup", "time", "RUN", "CMD", "command:", "$",
];

fn ends_arguments(word: &str) -> bool {
    COMMAND_SEPARATORS[1..].contains(&word)
        || word.ends_with(';')
        || word.starts_with('>')
        || word.starts_with('<')
        || word.starts_with("2>")
        || word.starts_with("&>")
}

/// Strips the brackets and commas of a JSON-form command (`CMD ["switchyard", "--help"]`).
fn unbracket(word: &str) -> &str {
    word.trim_start_matches('[').trim_end_matches([',', ']'])
}

/// A binary of ours that `word` (a command, maybe with a directory) names.
fn our_binary(word: &str) -> Option<&'static str> {
    let name = word.rsplit('/').next().unwrap_or(word);
    BINARIES.iter().copied().find(|binary| *binary == name)
}

/// Invocations of our binaries in `text`, found where a command can stand: at the start of a
/// line, after a separator (`&&`, `|`, `--`, ...), after a prefix (`sudo`, `RUN`, ...), after
/// `NAME=value` assignments, or as the value of a systemd `Exec*=` key.
fn invocations_in_text(text: &str, origin: &str) -> Vec<Invocation> {
    let mut found = Vec::new();
    for words in shell_lines(text) {
        let mut at_command = true;
        let mut index = 0;
        while index < words.len() {
            let mut word = words[index].as_str();
            index += 1;
            if !at_command {
                at_command = COMMAND_SEPARATORS.contains(&word) || word.ends_with(';');
                continue;
            }
            if let Some((name, value)) = word.split_once('=')
                && !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                if !name.starts_with("Exec") {
                    continue; // an environment assignment, or a unit key: still at a command
                }
                word = value;
            }
            let word = unbracket(word);
            if let Some(binary) = our_binary(word) {
                let mut args = Vec::new();
                while index < words.len() && !ends_arguments(&words[index]) {
                    args.push(unbracket(&words[index]).to_owned());
                    index += 1;
                }
                found.push(Invocation {
                    binary: binary.to_owned(),
                    args,
                    origin: format!("{origin}: `{}`", words.join(" ")),
                });
                at_command = false;
                continue;
            }
            at_command = word.is_empty() || COMMAND_PREFIXES.contains(&word);
        }
    }
    found
}

/// The fenced code blocks of a Markdown file, joined.
fn markdown_code(text: &str) -> String {
    let mut code = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
            code.push('\n');
        } else if inside {
            code.push_str(line);
            code.push('\n');
        }
    }
    code
}

/// `KEY=value` settings of a systemd unit (the last one of each key wins).
fn unit_settings(text: &str) -> HashMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.starts_with('#') && !line.starts_with(';'))
        .filter_map(|line| line.split_once('='))
        .map(|(key, value)| (key.trim().to_owned(), value.trim().to_owned()))
        .collect()
}

/// A systemd time span in whole seconds: `45`, `45s`, `2min`.
fn unit_seconds(value: &str) -> Option<u64> {
    if let Some(minutes) = value.strip_suffix("min") {
        return minutes
            .trim()
            .parse::<u64>()
            .ok()
            .map(|minutes| minutes * 60);
    }
    value.trim_end_matches('s').trim().parse().ok()
}

// --- Kubernetes -----------------------------------------------------------------------------

/// Every document of deploy/kubernetes/*.yaml, with the file it came from.
fn kubernetes_documents() -> Vec<(String, Value)> {
    let mut documents = Vec::new();
    for path in files(&deploy_dir().join("kubernetes"), &["yaml", "yml"]) {
        let text = read(&path);
        let mut chunk = String::new();
        for line in text.lines().chain(std::iter::once("---")) {
            if line.trim_end() != "---" {
                chunk.push_str(line);
                chunk.push('\n');
                continue;
            }
            let blank = chunk
                .lines()
                .all(|line| line.trim().is_empty() || line.trim_start().starts_with('#'));
            if !blank {
                let value: Value = serde_yaml::from_str(&chunk).unwrap_or_else(|err| {
                    panic!("{}: a document is not YAML: {err}", path.display())
                });
                documents.push((file_name(&path), value));
            }
            chunk.clear();
        }
    }
    documents
}

fn text(value: &Value) -> Option<&str> {
    value.as_str()
}

fn describe(file: &str, document: &Value) -> String {
    format!(
        "{file}: {} {}",
        text(&document["kind"]).unwrap_or("?"),
        text(&document["metadata"]["name"]).unwrap_or("?")
    )
}

fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_mapping()
        .map(|mapping| {
            mapping
                .iter()
                .filter_map(|(key, value)| {
                    let value = match value {
                        Value::String(text) => text.clone(),
                        Value::Number(number) => number.to_string(),
                        Value::Bool(flag) => flag.to_string(),
                        _ => return None,
                    };
                    Some((key.as_str()?.to_owned(), value))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn list(value: &Value) -> &[Value] {
    value.as_sequence().map(Vec::as_slice).unwrap_or_default()
}

fn strings(value: &Value) -> Vec<String> {
    list(value)
        .iter()
        .map(|item| match item {
            Value::String(text) => text.clone(),
            other => serde_yaml::to_string(other)
                .unwrap_or_default()
                .trim()
                .to_owned(),
        })
        .collect()
}

/// A pod template of a workload (Deployment, StatefulSet, DaemonSet, Job, CronJob).
struct Workload<'a> {
    origin: String,
    document: &'a Value,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    pod: &'a Value,
}

fn workloads(documents: &[(String, Value)]) -> Vec<Workload<'_>> {
    documents
        .iter()
        .filter_map(|(file, document)| {
            let template = match text(&document["kind"])? {
                "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
                    &document["spec"]["template"]
                }
                "CronJob" => &document["spec"]["jobTemplate"]["spec"]["template"],
                _ => return None,
            };
            Some(Workload {
                origin: describe(file, document),
                document,
                labels: string_map(&template["metadata"]["labels"]),
                annotations: string_map(&template["metadata"]["annotations"]),
                pod: &template["spec"],
            })
        })
        .collect()
}

fn containers(pod: &Value) -> impl Iterator<Item = &Value> {
    list(&pod["initContainers"])
        .iter()
        .chain(list(&pod["containers"]))
}

/// A container's ports: numbers, and name -> number.
fn container_ports(container: &Value) -> (BTreeSet<u64>, BTreeMap<String, u64>) {
    let mut numbers = BTreeSet::new();
    let mut names = BTreeMap::new();
    for port in list(&container["ports"]) {
        if let Some(number) = port["containerPort"].as_u64() {
            numbers.insert(number);
            if let Some(name) = text(&port["name"]) {
                names.insert(name.to_owned(), number);
            }
        }
    }
    (numbers, names)
}

/// Whether `port` (a number or a port name) is one of the given container ports.
fn port_matches(port: &Value, numbers: &BTreeSet<u64>, names: &BTreeMap<String, u64>) -> bool {
    match port {
        Value::Number(number) => number.as_u64().is_some_and(|n| numbers.contains(&n)),
        Value::String(name) => {
            names.contains_key(name) || name.parse().is_ok_and(|n: u64| numbers.contains(&n))
        }
        _ => false,
    }
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty()
        && selector
            .iter()
            .all(|(key, value)| labels.get(key) == Some(value))
}

/// Seconds a preStop hook waits: `exec: [sleep, N]` or `sleep: {seconds: N}`.
fn pre_stop_seconds(container: &Value) -> u64 {
    let hook = &container["lifecycle"]["preStop"];
    if let Some(seconds) = hook["sleep"]["seconds"].as_u64() {
        return seconds;
    }
    match strings(&hook["exec"]["command"]).as_slice() {
        [sleep, seconds] if sleep == "sleep" || sleep == "/bin/sleep" => {
            seconds.parse().unwrap_or(0)
        }
        _ => 0,
    }
}

/// Services defined here: (namespace, name) -> ports served.
fn services(documents: &[(String, Value)]) -> BTreeMap<(String, String), BTreeSet<u64>> {
    documents
        .iter()
        .filter(|(_, document)| document["kind"] == "Service")
        .map(|(_, document)| {
            let metadata = &document["metadata"];
            let key = (
                text(&metadata["namespace"]).unwrap_or("default").to_owned(),
                text(&metadata["name"]).unwrap_or_default().to_owned(),
            );
            let ports = list(&document["spec"]["ports"])
                .iter()
                .filter_map(|port| port["port"].as_u64())
                .collect();
            (key, ports)
        })
        .collect()
}

/// A container of a workload that runs one of our binaries, with its checked flags.
struct OurContainer<'a> {
    origin: String,
    binary: &'static str,
    flags: Flags,
    container: &'a Value,
    workload: &'a Workload<'a>,
}

/// Every container running one of our binaries, its flags checked against the binary's help.
fn our_containers<'a>(
    workloads: &'a [Workload<'a>],
    helps: &mut Helps,
    problems: &mut Vec<String>,
) -> Vec<OurContainer<'a>> {
    let mut found = Vec::new();
    for workload in workloads {
        for container in containers(workload.pod) {
            let argv: Vec<String> = strings(&container["command"])
                .into_iter()
                .chain(strings(&container["args"]))
                .collect();
            let Some(binary) = argv.first().and_then(|command| our_binary(command)) else {
                continue;
            };
            let name = text(&container["name"]).unwrap_or("?");
            let origin = format!("{} container {name}", workload.origin);
            let invocation = Invocation {
                binary: binary.to_owned(),
                args: argv[1..].to_vec(),
                origin: origin.clone(),
            };
            let flags = check_flags(helps, &invocation, problems);
            found.push(OurContainer {
                origin,
                binary,
                flags,
                container,
                workload,
            });
        }
    }
    found
}

fn flag_value<'a>(flags: &'a Flags, flag: &str) -> Option<&'a str> {
    flags.get(flag).and_then(|value| value.as_deref())
}

/// It must listen where the pod's ports and probes expect it, not on the loopback default:
/// `--listen`, and every other `--…-listen` it is given (`--sagemaker-api-listen`, …).
fn check_listen(ours: &OurContainer<'_>, problems: &mut Vec<String>) {
    let origin = &ours.origin;
    let (numbers, _) = container_ports(ours.container);
    if flag_value(&ours.flags, "--listen").is_none() {
        problems.push(format!(
            "{origin}: no --listen, so it listens on loopback only"
        ));
    }
    for (flag, value) in &ours.flags {
        let Some(listen) = value.as_deref().filter(|_| flag.ends_with("-listen")) else {
            continue;
        };
        let (host, port) = listen.rsplit_once(':').unwrap_or_default();
        if host.starts_with("127.") || host == "localhost" || host == "[::1]" {
            problems.push(format!("{origin}: {flag} {listen} is loopback only"));
        }
        if !port.parse().is_ok_and(|port: u64| numbers.contains(&port)) {
            problems.push(format!(
                "{origin}: {flag} {listen} is not one of its containerPorts {numbers:?}"
            ));
        }
    }
}

/// Files it reads must be on a mounted volume, and among that volume's projected items.
fn check_files_are_mounted(ours: &OurContainer<'_>, problems: &mut Vec<String>) {
    let origin = &ours.origin;
    for (flag, value) in &ours.flags {
        let is_file = flag.ends_with("-file")
            || flag.starts_with("--tls-")
            || ["--config", "--etcd-ca", "--etcd-cert", "--etcd-key"].contains(&flag.as_str());
        let Some(path) = value.as_deref().filter(|_| is_file) else {
            continue;
        };
        let mounted = list(&ours.container["volumeMounts"])
            .iter()
            .find_map(|mount| {
                let dir = text(&mount["mountPath"])?.trim_end_matches('/');
                let relative = path.strip_prefix(dir)?.strip_prefix('/')?;
                Some((mount, relative))
            });
        let Some((mount, relative)) = mounted else {
            problems.push(format!(
                "{origin}: {flag} {path} is not under any volumeMount"
            ));
            continue;
        };
        let volume = list(&ours.workload.pod["volumes"])
            .iter()
            .find(|volume| volume["name"] == mount["name"]);
        let Some(volume) = volume else {
            problems.push(format!(
                "{origin}: {flag} {path}: its volumeMount names no volume"
            ));
            continue;
        };
        for source in ["secret", "configMap"] {
            let items = list(&volume[source]["items"]);
            if !items.is_empty()
                && !items
                    .iter()
                    .any(|item| text(&item["path"]) == Some(relative))
            {
                problems.push(format!(
                    "{origin}: {flag} {path}: the {source} volume projects no item {relative}"
                ));
            }
        }
    }
}

/// Control-plane and etcd URLs naming in-cluster Services (`NAME.NAMESPACE.svc`, or
/// `POD.NAME.NAMESPACE.svc`) must name Services defined here, on ports they serve.
fn check_service_urls(
    ours: &OurContainer<'_>,
    services: &BTreeMap<(String, String), BTreeSet<u64>>,
    problems: &mut Vec<String>,
) {
    for flag in ["--control-plane", "--etcd-endpoints"] {
        let urls = flag_value(&ours.flags, flag).unwrap_or_default();
        for url in urls.split(',').filter(|url| !url.is_empty()) {
            let authority = url.split("://").nth(1).unwrap_or(url);
            let authority = authority.split('/').next().unwrap_or_default();
            let (host, port) = authority.rsplit_once(':').unwrap_or((authority, "80"));
            let labels: Vec<&str> = host.split('.').collect();
            let Some(svc) = labels.iter().position(|label| *label == "svc") else {
                continue;
            };
            if svc < 2 {
                continue;
            }
            let (namespace, name) = (labels[svc - 1], labels[svc - 2]);
            let served = services.get(&(namespace.to_owned(), name.to_owned()));
            if !served
                .is_some_and(|ports| port.parse().is_ok_and(|port: u64| ports.contains(&port)))
            {
                problems.push(format!(
                    "{}: {flag} {url}: no Service {name} in namespace {namespace} serves port {port}",
                    ours.origin
                ));
            }
        }
    }
}

/// Each long-running binary's shutdown grace flag (what SIGTERM waits for in-flight work),
/// spelled as that binary spells it. A binary run by deploy/ must be listed here, and its
/// flag must be in its `--help`: a renamed flag is a problem, never a silently skipped check.
const GRACE_FLAGS: [(&str, &str); 3] = [
    ("switchyard-control", "--shutdown-grace-seconds"),
    ("switchyard-router", "--shutdown-grace-seconds"),
    ("switchyard-engine-sim", "--shutdown-grace-s"),
];

/// The shutdown grace period (seconds) `binary` runs with given `flags`: the flag's value, else
/// its default from `--help`. `None`, with a problem recorded, when it cannot be known.
fn grace_seconds(
    helps: &mut Helps,
    binary: &str,
    flags: &Flags,
    origin: &str,
    problems: &mut Vec<String>,
) -> Option<f64> {
    let Some((_, flag)) = GRACE_FLAGS.iter().find(|(name, _)| *name == binary) else {
        problems.push(format!(
            "{origin}: runs {binary}, whose shutdown grace flag is not known (add it to GRACE_FLAGS)"
        ));
        return None;
    };
    if !helps.get(binary, &[]).options.contains_key(*flag) {
        problems.push(format!(
            "{origin}: {binary} --help lists no {flag} (renamed? update GRACE_FLAGS)"
        ));
        return None;
    }
    let Some(value) = flag_or_default(helps, binary, flags, flag) else {
        problems.push(format!(
            "{origin}: {binary} {flag} has no value and no default"
        ));
        return None;
    };
    match value.parse::<f64>() {
        Ok(seconds) => Some(seconds),
        Err(_) => {
            problems.push(format!(
                "{origin}: {binary} {flag} {value:?} is not a number"
            ));
            None
        }
    }
}

/// Kubernetes must wait out the preStop sleep plus the binary's own shutdown grace period.
fn check_termination_grace(ours: &OurContainer<'_>, helps: &mut Helps, problems: &mut Vec<String>) {
    let Some(grace) = grace_seconds(helps, ours.binary, &ours.flags, &ours.origin, problems) else {
        return;
    };
    let pre_stop = pre_stop_seconds(ours.container) as f64;
    let termination = ours.workload.pod["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap_or(30) as f64;
    if termination <= pre_stop + grace {
        problems.push(format!(
            "{}: terminationGracePeriodSeconds {termination} does not exceed preStop {pre_stop} s \
             + the shutdown grace period {grace} s",
            ours.origin
        ));
    }
}

#[test]
fn every_kubernetes_document_has_a_kind_a_name_and_a_known_namespace() {
    let documents = kubernetes_documents();
    let mut problems = Vec::new();
    let namespaces: BTreeSet<&str> = documents
        .iter()
        .filter(|(_, document)| document["kind"] == "Namespace")
        .filter_map(|(_, document)| text(&document["metadata"]["name"]))
        .collect();
    for (file, document) in &documents {
        for field in ["apiVersion", "kind"] {
            if text(&document[field]).is_none_or(str::is_empty) {
                problems.push(format!("{file}: a document without {field}"));
            }
        }
        if text(&document["metadata"]["name"]).is_none_or(str::is_empty) {
            problems.push(format!("{}: no metadata.name", describe(file, document)));
        }
        if let Some(namespace) = text(&document["metadata"]["namespace"])
            && !namespaces.contains(namespace)
        {
            problems.push(format!(
                "{}: namespace {namespace} is not created by any manifest",
                describe(file, document)
            ));
        }
    }
    fail_on(&problems);
}

#[test]
fn switchyard_containers_use_real_flags_mounted_files_and_enough_grace() {
    let documents = kubernetes_documents();
    let workloads = workloads(&documents);
    let services = services(&documents);
    let mut helps = Helps::default();
    let mut problems = Vec::new();
    let ours = our_containers(&workloads, &mut helps, &mut problems);
    for binary in ["switchyard-control", "switchyard-router"] {
        if !ours.iter().any(|ours| ours.binary == binary) {
            problems.push(format!("no Kubernetes workload runs {binary}"));
        }
    }
    for ours in &ours {
        check_listen(ours, &mut problems);
        check_files_are_mounted(ours, &mut problems);
        check_service_urls(ours, &services, &mut problems);
        check_termination_grace(ours, &mut helps, &mut problems);
        if ours.binary == "switchyard-router" {
            for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
                if text(&ours.container[probe]["httpGet"]["path"]) != Some(path) {
                    problems.push(format!("{}: {probe} should GET {path}", ours.origin));
                }
            }
        }
    }
    fail_on(&problems);
}

#[test]
fn probes_and_prometheus_annotations_use_declared_ports() {
    let documents = kubernetes_documents();
    let mut problems = Vec::new();
    for workload in workloads(&documents) {
        let mut pod_ports = BTreeSet::new();
        for container in containers(workload.pod) {
            let name = text(&container["name"]).unwrap_or("?");
            let (numbers, names) = container_ports(container);
            pod_ports.extend(numbers.iter().copied());
            for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
                for handler in ["httpGet", "tcpSocket", "grpc"] {
                    let port = &container[probe][handler]["port"];
                    if !port.is_null() && !port_matches(port, &numbers, &names) {
                        problems.push(format!(
                            "{} container {name}: {probe} port {} is not a containerPort",
                            workload.origin,
                            serde_yaml::to_string(port).unwrap_or_default().trim()
                        ));
                    }
                }
            }
        }
        let annotation = |key: &str| workload.annotations.get(key).map(String::as_str);
        if annotation("prometheus.io/scrape") != Some("true") {
            continue;
        }
        let port = annotation("prometheus.io/port");
        if !port.is_some_and(|port| {
            port.parse()
                .is_ok_and(|port: u64| pod_ports.contains(&port))
        }) {
            problems.push(format!(
                "{}: prometheus.io/port {port:?} is not a containerPort",
                workload.origin
            ));
        }
        if annotation("prometheus.io/path") != Some("/metrics") {
            problems.push(format!(
                "{}: prometheus.io/path should be /metrics",
                workload.origin
            ));
        }
    }
    fail_on(&problems);
}

#[test]
fn selectors_pick_pods_defined_here_and_services_reach_their_ports() {
    let documents = kubernetes_documents();
    let workloads = workloads(&documents);
    let mut problems = Vec::new();
    let matches_a_pod = |selector: &BTreeMap<String, String>| {
        workloads
            .iter()
            .any(|workload| selects(selector, &workload.labels))
    };
    for workload in &workloads {
        let selector = string_map(&workload.document["spec"]["selector"]["matchLabels"]);
        if !selector.is_empty() && !selects(&selector, &workload.labels) {
            problems.push(format!(
                "{}: spec.selector does not match the pod template's labels",
                workload.origin
            ));
        }
    }
    for (file, document) in &documents {
        let spec = &document["spec"];
        let selector = match text(&document["kind"]) {
            Some("Service") => string_map(&spec["selector"]),
            Some("PodDisruptionBudget") => string_map(&spec["selector"]["matchLabels"]),
            Some("NetworkPolicy") => string_map(&spec["podSelector"]["matchLabels"]),
            _ => continue,
        };
        let origin = describe(file, document);
        if !matches_a_pod(&selector) {
            problems.push(format!(
                "{origin}: its selector {selector:?} matches no pod template"
            ));
        }
        // A network policy's peers must exist too.
        for rule in list(&spec["ingress"]).iter().chain(list(&spec["egress"])) {
            for peer in list(&rule["from"]).iter().chain(list(&rule["to"])) {
                let peer = string_map(&peer["podSelector"]["matchLabels"]);
                if !peer.is_empty() && !matches_a_pod(&peer) {
                    problems.push(format!(
                        "{origin}: its peer selector {peer:?} matches no pod template"
                    ));
                }
            }
        }
        if document["kind"] != "Service" {
            continue;
        }
        for port in list(&spec["ports"]) {
            let target = match &port["targetPort"] {
                Value::Null => &port["port"],
                target => target,
            };
            let served = workloads
                .iter()
                .filter(|workload| selects(&selector, &workload.labels))
                .flat_map(|workload| containers(workload.pod))
                .any(|container| {
                    let (numbers, names) = container_ports(container);
                    port_matches(target, &numbers, &names)
                });
            if !served {
                problems.push(format!(
                    "{origin}: targetPort {} is not a containerPort of the pods it selects",
                    serde_yaml::to_string(target).unwrap_or_default().trim()
                ));
            }
        }
    }
    fail_on(&problems);
}

#[test]
fn systemd_units_use_real_flags_and_stop_after_the_grace_period() {
    let mut helps = Helps::default();
    let mut problems = Vec::new();
    for path in files(&deploy_dir().join("systemd"), &["service"]) {
        let origin = file_name(&path);
        let text = read(&path);
        let settings = unit_settings(&text);
        for (key, expected) in [("Restart", "on-failure"), ("KillSignal", "SIGTERM")] {
            if settings.get(key).map(String::as_str) != Some(expected) {
                problems.push(format!("{origin}: {key}= should be {expected}"));
            }
        }
        let invocations = invocations_in_text(&text, &origin);
        let expected_binary = origin.trim_end_matches(".service");
        let Some(main) = invocations
            .iter()
            .find(|invocation| invocation.binary == expected_binary)
        else {
            problems.push(format!(
                "{origin}: ExecStart does not run {expected_binary}"
            ));
            continue;
        };
        for invocation in &invocations {
            check_flags(&mut helps, invocation, &mut problems);
        }
        let flags = check_flags(&mut helps, main, &mut Vec::new());
        if let Some(grace) =
            grace_seconds(&mut helps, expected_binary, &flags, &origin, &mut problems)
        {
            let stop = settings
                .get("TimeoutStopSec")
                .and_then(|value| unit_seconds(value));
            if stop.is_none_or(|stop| stop as f64 <= grace) {
                problems.push(format!(
                    "{origin}: TimeoutStopSec {stop:?} must exceed the shutdown grace period {grace} s"
                ));
            }
        }
    }
    fail_on(&problems);
}

#[test]
fn the_dockerfile_builds_locked_and_ships_every_binary_with_real_flags() {
    let path = deploy_dir().join("Dockerfile");
    let text = read(&path);
    let mut problems = Vec::new();
    if !text.contains("cargo build --release --locked") {
        problems.push("Dockerfile: the build is not `cargo build --release --locked`".to_owned());
    }
    if text
        .lines()
        .any(|line| line.trim_start().starts_with("ENTRYPOINT"))
    {
        problems.push("Dockerfile: an ENTRYPOINT; the command should pick the binary".to_owned());
    }
    let mut helps = Helps::default();
    let invocations = invocations_in_text(&text, "Dockerfile");
    for binary in BINARIES {
        if !text.contains(&format!("target/release/{binary}")) {
            problems.push(format!("Dockerfile: {binary} is not copied into the image"));
        }
        if !invocations
            .iter()
            .any(|invocation| invocation.binary == binary)
        {
            problems.push(format!("Dockerfile: {binary} is never run (smoke test)"));
        }
    }
    for invocation in &invocations {
        check_flags(&mut helps, invocation, &mut problems);
    }
    fail_on(&problems);
}

/// Every Markdown file a user reads commands from: the READMEs, ARCHITECTURE.md, docs/.
fn documentation() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = vec![
        root.join("README.md"),
        root.join("ARCHITECTURE.md"),
        deploy_dir().join("README.md"),
    ];
    found.extend(files(&root.join("docs"), &["md"]));
    found
}

#[test]
fn commands_in_the_documentation_use_real_subcommands_and_flags() {
    let mut helps = Helps::default();
    let mut problems = Vec::new();
    for path in documentation() {
        let origin = path
            .strip_prefix(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
            .unwrap_or(&path)
            .display()
            .to_string();
        let code = markdown_code(&read(&path));
        let invocations = invocations_in_text(&code, &origin);
        // The scan must find what these are known to show (a scan that finds nothing passes).
        let expected: &[&str] = match origin.as_str() {
            "deploy/README.md" => &["switchyard", "switchyard-control", "switchyard-router"],
            "README.md" => &["switchyard"],
            _ => &[],
        };
        for binary in expected {
            if !invocations
                .iter()
                .any(|invocation| invocation.binary == *binary)
            {
                problems.push(format!("{origin}: no command runs {binary}"));
            }
        }
        for invocation in &invocations {
            check_flags(&mut helps, invocation, &mut problems);
        }
    }
    fail_on(&problems);
}

#[test]
fn the_static_routes_example_is_a_valid_router_config() {
    let path = deploy_dir().join("routes.example.yaml");
    let config =
        switchyard_router::parts::read_static_config(&path).unwrap_or_else(|err| panic!("{err}"));
    assert!(!config.endpoints.is_empty() && !config.instances.is_empty());
}

#[test]
fn the_flag_checker_catches_what_it_should() {
    // Guards the guard: a scan that finds nothing, or accepts anything, would pass silently.
    let text = "# switchyard-router --not-checked\n\
                ExecStart=/usr/local/bin/switchyard-router \\\n    --listen 0.0.0.0:8080 --no-such-flag\n\
                RUN switchyard --help >/dev/null && switchyard-control --bogus=1\n\
                kubectl -n switchyard exec deploy/switchyard-control -- switchyard instance register --endpoint chat --nope\n\
                sudo systemctl edit switchyard-router\n";
    let invocations = invocations_in_text(text, "sample");
    let binaries: Vec<&str> = invocations
        .iter()
        .map(|invocation| invocation.binary.as_str())
        .collect();
    assert_eq!(
        binaries,
        [
            "switchyard-router",
            "switchyard",
            "switchyard-control",
            "switchyard"
        ]
    );
    let mut helps = Helps::default();
    let mut problems = Vec::new();
    let flags: Vec<Flags> = invocations
        .iter()
        .map(|invocation| check_flags(&mut helps, invocation, &mut problems))
        .collect();
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(problems[0].contains("--no-such-flag"));
    assert!(problems[1].contains("--bogus"));
    assert!(problems[2].contains("`switchyard instance register` does not accept --nope"));
    assert_eq!(flags[0]["--listen"].as_deref(), Some("0.0.0.0:8080"));
    assert_eq!(
        flag_or_default(
            &mut helps,
            "switchyard-router",
            &flags[0],
            "--shutdown-grace-seconds"
        )
        .as_deref(),
        Some("30")
    );
    // The grace period is found for every binary that has one, however it spells its flag,
    // and a binary whose flag is unknown is a problem, not a skipped check.
    let mut problems = Vec::new();
    for (binary, _) in GRACE_FLAGS {
        assert!(
            grace_seconds(&mut helps, binary, &Flags::new(), "sample", &mut problems)
                .is_some_and(|seconds| seconds > 0.0),
            "{binary}: {problems:?}"
        );
    }
    let bench = grace_seconds(
        &mut helps,
        "switchyard-bench",
        &Flags::new(),
        "sample",
        &mut problems,
    );
    assert_eq!(bench, None);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(problems[0].contains("GRACE_FLAGS"), "{problems:#?}");
}
