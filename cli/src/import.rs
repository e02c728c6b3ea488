//! `switchyard instance import --file F`: bulk registration from JSON lines, one instance each,
//! with the static file's field names plus the endpoint:
//!
//! ```text
//! {"EndpointName": "chat", "VariantName": "AllTraffic", "InstanceId": "i-7", "Url": "http://10.0.0.7:8000", "Role": "decode", "Weight": 1}
//! ```
//!
//! Every line is checked here first (errors name the line); the control plane then checks the
//! whole file again against its endpoints and writes it in batched transactions. If any line
//! is refused, nothing is imported. This module does not know how to reach the control plane:
//! its caller passes the call that sends the import.

use std::future::Future;
use std::path::PathBuf;

use clap::Args;
use serde::Deserialize;
use switchyard_proto::v1 as pb;
use switchyard_shared::{
    EndpointName, InstanceId, InstanceProtocol, InstanceRole, InvalidName, ValidationError,
    VariantName, validate_instance_url, validate_instance_weight,
};

use crate::output::OutputFormat;

/// Errors listed before giving up on a file.
const MAX_ERRORS_SHOWN: usize = 20;

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// JSON lines, one instance each: EndpointName, VariantName, InstanceId, Url (required),
    /// Role (both|prefill|decode), Protocol (http1|h2c), Weight, KvEvents, KvEventsReplay
    /// (tcp://host:port), DecodePartner, LmcacheReceiver ({Host, InitPorts, AllocPorts,
    /// BufferTokens}) (optional). Blank lines are
    /// skipped. Instances live until deregistered (no TTL: nothing would heartbeat them).
    #[arg(long)]
    pub file: PathBuf,
    /// Check every line with the control plane, import nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
struct Line {
    endpoint_name: String,
    variant_name: String,
    instance_id: String,
    url: String,
    /// both, prefill or decode, in any case.
    role: Option<String>,
    /// http1 or h2c, in any case.
    protocol: Option<String>,
    weight: Option<f64>,
    /// KV_AWARE: where the engine publishes its KV-cache events, and its replay socket.
    kv_events: Option<String>,
    kv_events_replay: Option<String>,
    /// A data-parallel engine's ranks (rank r on each KV-event port + r).
    kv_events_data_parallel_size: Option<u32>,
    /// LMCACHE disaggregation: the decode instance a prefill instance pushes to.
    decode_partner: Option<String>,
    /// LMCACHE_PD disaggregation: a decode instance's LMCache receiver
    /// (`{Host, InitPorts, AllocPorts, BufferTokens}`).
    lmcache_receiver: Option<switchyard_shared::LmcacheReceiver>,
    /// Only to refuse it with a clear message.
    #[serde(default, alias = "Ttl")]
    ttl_seconds: Option<u32>,
}

/// Why a line is refused, its field named as the file spells it.
#[derive(Debug, thiserror::Error)]
enum LineError {
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "TtlSeconds: an import cannot heartbeat; register instances with --ttl one by one (instance register)"
    )]
    Ttl,
    #[error("{field}: {source}")]
    Name {
        field: &'static str,
        source: InvalidName,
    },
    /// A Role or Protocol that is not one of its values.
    #[error("{field}: {message}")]
    Choice {
        field: &'static str,
        message: String,
    },
    /// A rule broken; the error names its field.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
}

/// A refused line, by its number (from 1).
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {error}")]
pub struct BadLine {
    line: usize,
    error: LineError,
}

/// One line checked and turned into a request.
fn parse_line(text: &str) -> Result<pb::RegisterInstanceRequest, LineError> {
    let line: Line = serde_json::from_str(text)?;
    if line.ttl_seconds.is_some() {
        return Err(LineError::Ttl);
    }
    let name = |field: &'static str| move |source| LineError::Name { field, source };
    EndpointName::new(&line.endpoint_name).map_err(name("EndpointName"))?;
    VariantName::new(&line.variant_name).map_err(name("VariantName"))?;
    InstanceId::new(&line.instance_id).map_err(name("InstanceId"))?;
    validate_instance_url(&line.url)?;
    if let Some(weight) = line.weight {
        validate_instance_weight(weight)?;
    }
    let choice = |field: &'static str| move |message| LineError::Choice { field, message };
    let role = match &line.role {
        Some(role) => role.parse::<InstanceRole>().map_err(choice("Role"))?,
        None => InstanceRole::default(),
    };
    let protocol = match &line.protocol {
        Some(protocol) => protocol
            .parse::<InstanceProtocol>()
            .map_err(choice("Protocol"))?,
        None => InstanceProtocol::default(),
    };
    let kv_events = line.kv_events.unwrap_or_default();
    let kv_events_replay = line.kv_events_replay.unwrap_or_default();
    let kv_events_data_parallel_size = line.kv_events_data_parallel_size.unwrap_or(0);
    switchyard_proto::convert::kv_events(
        &kv_events,
        &kv_events_replay,
        kv_events_data_parallel_size,
    )?;
    let lmcache_receiver = line.lmcache_receiver.clone();
    if let Some(receiver) = &lmcache_receiver {
        receiver.validate("LmcacheReceiver")?;
    }
    if let Some(partner) = &line.decode_partner {
        InstanceId::new(partner).map_err(name("DecodePartner"))?;
    }
    Ok(pb::RegisterInstanceRequest {
        endpoint_name: line.endpoint_name,
        variant_name: line.variant_name,
        url: line.url,
        id: line.instance_id,
        role: pb::InstanceRole::from(role) as i32,
        protocol: pb::InstanceProtocol::from(protocol) as i32,
        weight: line.weight,
        ttl_seconds: 0,
        kv_events_endpoint: kv_events,
        kv_events_replay_endpoint: kv_events_replay,
        kv_events_data_parallel_size,
        decode_partner: line.decode_partner.unwrap_or_default(),
        lmcache_receiver: lmcache_receiver
            .as_ref()
            .map(switchyard_proto::convert::lmcache_receiver_message),
    })
}

/// Every instance of the file with its line number, or every refused line.
fn read_file(text: &str) -> Result<(Vec<pb::RegisterInstanceRequest>, Vec<usize>), Vec<BadLine>> {
    let mut requests = Vec::new();
    let mut lines = Vec::new();
    let mut errors = Vec::new();
    for (index, text) in text.lines().enumerate() {
        if text.trim().is_empty() {
            continue;
        }
        match parse_line(text) {
            Ok(request) => {
                requests.push(request);
                lines.push(index + 1);
            }
            Err(error) => errors.push(BadLine {
                line: index + 1,
                error,
            }),
        }
    }
    if errors.is_empty() {
        Ok((requests, lines))
    } else {
        Err(errors)
    }
}

/// "Instances[7].Url: ..." from the control plane, told by line: "line 9: Url: ...".
fn by_line(message: &str, lines: &[usize]) -> String {
    let parsed = message.strip_prefix("Instances[").and_then(|rest| {
        let (index, rest) = rest.split_once(']')?;
        let line = lines.get(index.parse::<usize>().ok()?)?;
        Some(format!(
            "line {line}: {}",
            rest.strip_prefix('.').unwrap_or(rest)
        ))
    });
    parsed.unwrap_or_else(|| message.to_owned())
}

/// Why an import did not happen. All but `ControlPlane` are the user's to fix (exit 64).
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("--file {}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--file {}: {} bad line(s); nothing imported\n{}",
        path.display(),
        errors.len(),
        first_errors(errors)
    )]
    BadLines { path: PathBuf, errors: Vec<BadLine> },
    #[error("--file {}: no instances in it", path.display())]
    Empty { path: PathBuf },
    /// The control plane refused an instance (told by line).
    #[error("--file {}: {message}; nothing imported", path.display())]
    Refused { path: PathBuf, message: String },
    /// The control plane failed otherwise (its message told by line, when it names one).
    #[error(transparent)]
    ControlPlane(tonic::Status),
}

/// The first `MAX_ERRORS_SHOWN` errors, one a line, and how many more there are.
fn first_errors(errors: &[BadLine]) -> String {
    let shown = errors.len().min(MAX_ERRORS_SHOWN);
    let mut listed = errors[..shown]
        .iter()
        .map(BadLine::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    if errors.len() > shown {
        listed.push_str(&format!("\n... and {} more", errors.len() - shown));
    }
    listed
}

/// Reads and checks `args.file`, has `send` import it (or, with --dry-run, check it), and
/// prints what was done.
pub async fn import<Sent>(
    format: OutputFormat,
    args: ImportArgs,
    send: impl FnOnce(pb::ImportInstancesRequest) -> Sent,
) -> Result<(), ImportError>
where
    Sent: Future<Output = Result<tonic::Response<pb::ImportInstancesResponse>, tonic::Status>>,
{
    let path = args.file;
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(source) => return Err(ImportError::Unreadable { path, source }),
    };
    let (requests, lines) = match read_file(&text) {
        Ok(read) => read,
        Err(errors) => return Err(ImportError::BadLines { path, errors }),
    };
    if requests.is_empty() {
        return Err(ImportError::Empty { path });
    }
    let count = requests.len();
    let response = match send(pb::ImportInstancesRequest {
        instances: requests,
        dry_run: args.dry_run,
    })
    .await
    {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let message = by_line(status.message(), &lines);
            return Err(match status.code() {
                tonic::Code::InvalidArgument => ImportError::Refused { path, message },
                code => ImportError::ControlPlane(tonic::Status::new(code, message)),
            });
        }
    };
    let value = serde_json::json!({
        "Instances": count,
        "Imported": response.imported,
        "Transactions": response.transactions,
        "DryRun": args.dry_run,
    });
    match format {
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        ),
        OutputFormat::Table if args.dry_run => {
            println!("checked {count} instances: all would import")
        }
        OutputFormat::Table => println!(
            "imported {} instances in {} transactions",
            response.imported, response.transactions
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_checked_and_errors_name_them() {
        let text = concat!(
            r#"{"EndpointName":"chat","VariantName":"AllTraffic","InstanceId":"i-1","Url":"http://10.0.0.1:8000","Role":"decode","Weight":2}"#,
            "\n\n",
            r#"{"EndpointName":"chat","VariantName":"AllTraffic","InstanceId":"i-2","Url":"ftp://x"}"#,
            "\n",
            r#"{"EndpointName":"chat","VariantName":"AllTraffic","InstanceId":"i-3","Url":"http://10.0.0.3:8000","TtlSeconds":30}"#,
            "\n",
            r#"{"EndpointName":"chat","VariantName":"AllTraffic","InstanceId":"i-4","Url":"http://10.0.0.4:8000","Colour":"red"}"#,
            "\n",
        );
        let errors: Vec<String> = read_file(text)
            .unwrap_err()
            .iter()
            .map(BadLine::to_string)
            .collect();
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].starts_with("line 3: Url:"), "{errors:?}");
        assert!(errors[1].starts_with("line 4: TtlSeconds:"), "{errors:?}");
        assert!(
            errors[2].starts_with("line 5: unknown field `Colour`"),
            "{errors:?}"
        );
        let (requests, lines) = read_file(text.lines().next().unwrap()).unwrap();
        assert_eq!(lines, [1]);
        assert_eq!(requests[0].role, pb::InstanceRole::Decode as i32);
        assert_eq!(requests[0].weight, Some(2.0));
    }

    #[test]
    fn a_refused_file_lists_its_first_bad_lines_and_counts_the_rest() {
        let errors = read_file(&"{}\n".repeat(25)).unwrap_err();
        let message = ImportError::BadLines {
            path: "fleet.jsonl".into(),
            errors,
        }
        .to_string();
        let lines: Vec<&str> = message.lines().collect();
        assert_eq!(
            lines[0],
            "--file fleet.jsonl: 25 bad line(s); nothing imported"
        );
        assert_eq!(lines.len(), 1 + MAX_ERRORS_SHOWN + 1, "{message}");
        assert!(
            lines[1].starts_with("line 1: missing field `EndpointName`"),
            "{message}"
        );
        assert!(lines[20].starts_with("line 20: "), "{message}");
        assert_eq!(lines[21], "... and 5 more");
    }

    #[test]
    fn control_plane_errors_are_told_by_line() {
        assert_eq!(
            by_line(
                "Instances[1].VariantName: endpoint chat has no variant x",
                &[1, 3]
            ),
            "line 3: VariantName: endpoint chat has no variant x"
        );
        assert_eq!(by_line("something else", &[1]), "something else");
    }
}
