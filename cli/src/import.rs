//! `switchyard instance import --file F`: bulk registration from JSON lines, one instance each,
//! with the static file's field names plus the endpoint:
//!
//! ```text
//! {"EndpointName": "chat", "VariantName": "AllTraffic", "InstanceId": "i-7", "Url": "http://10.0.0.7:8000", "Role": "decode", "Weight": 1}
//! ```
//!
//! Every line is checked here first (errors name the line); the control plane then checks the
//! whole file again against its endpoints and writes it in batched transactions. If any line
//! is refused, nothing is imported.

use std::path::PathBuf;

use anyhow::anyhow;
use clap::Args;
use serde::Deserialize;
use switchyard_proto::v1 as pb;
use switchyard_shared::{
    EndpointName, InstanceId, InstanceProtocol, InstanceRole, VariantName, validate_instance_url,
    validate_instance_weight,
};

use crate::admin::{Client, UsageError};
use crate::output::OutputFormat;

/// Errors listed before giving up on a file.
const MAX_ERRORS_SHOWN: usize = 20;

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// JSON lines, one instance each: EndpointName, VariantName, InstanceId, Url (required),
    /// Role (both|prefill|decode), Protocol (http1|h2c), Weight, KvEvents, KvEventsReplay
    /// (tcp://host:port), DecodePartner (optional). Blank lines are
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
    #[serde(default)]
    role: Option<String>,
    /// http1 or h2c, in any case.
    #[serde(default)]
    protocol: Option<String>,
    #[serde(default)]
    weight: Option<f64>,
    /// KV_AWARE: where the engine publishes its KV-cache events, and its replay socket.
    #[serde(default)]
    kv_events: Option<String>,
    #[serde(default)]
    kv_events_replay: Option<String>,
    /// LMCACHE disaggregation: the decode instance a prefill instance pushes to.
    #[serde(default)]
    decode_partner: Option<String>,
    /// Only to refuse it with a clear message.
    #[serde(default, alias = "Ttl")]
    ttl_seconds: Option<u32>,
}

/// One line checked and turned into a request.
fn parse_line(text: &str) -> Result<pb::RegisterInstanceRequest, String> {
    let line: Line = serde_json::from_str(text).map_err(|err| err.to_string())?;
    if line.ttl_seconds.is_some() {
        return Err("TtlSeconds: an import cannot heartbeat; register instances with --ttl one by one (instance register)".into());
    }
    EndpointName::new(&line.endpoint_name).map_err(|err| format!("EndpointName: {err}"))?;
    VariantName::new(&line.variant_name).map_err(|err| format!("VariantName: {err}"))?;
    InstanceId::new(&line.instance_id).map_err(|err| format!("InstanceId: {err}"))?;
    validate_instance_url(&line.url).map_err(|err| err.to_string())?;
    if let Some(weight) = line.weight {
        validate_instance_weight(weight).map_err(|err| err.to_string())?;
    }
    let role = match &line.role {
        Some(role) => role
            .parse::<InstanceRole>()
            .map_err(|err| format!("Role: {err}"))?,
        None => InstanceRole::default(),
    };
    let protocol = match &line.protocol {
        Some(protocol) => protocol
            .parse::<InstanceProtocol>()
            .map_err(|err| format!("Protocol: {err}"))?,
        None => InstanceProtocol::default(),
    };
    let kv_events = line.kv_events.unwrap_or_default();
    let kv_events_replay = line.kv_events_replay.unwrap_or_default();
    switchyard_proto::convert::kv_events(&kv_events, &kv_events_replay)
        .map_err(|err| err.to_string())?;
    if let Some(partner) = &line.decode_partner {
        InstanceId::new(partner).map_err(|err| format!("DecodePartner: {err}"))?;
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
        decode_partner: line.decode_partner.unwrap_or_default(),
    })
}

/// Every instance of the file with its line number, or every error (up to a bound), by line.
fn read_file(text: &str) -> Result<(Vec<pb::RegisterInstanceRequest>, Vec<usize>), Vec<String>> {
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
            Err(err) => errors.push(format!("line {}: {err}", index + 1)),
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

pub async fn import(
    client: &mut Client,
    format: OutputFormat,
    args: ImportArgs,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .map_err(|err| UsageError(format!("--file {}: {err}", args.file.display())))?;
    let (requests, lines) = match read_file(&text) {
        Ok(read) => read,
        Err(errors) => {
            let shown = errors.len().min(MAX_ERRORS_SHOWN);
            let mut message = format!(
                "--file {}: {} bad line(s); nothing imported\n{}",
                args.file.display(),
                errors.len(),
                errors[..shown].join("\n")
            );
            if errors.len() > shown {
                message.push_str(&format!("\n... and {} more", errors.len() - shown));
            }
            return Err(UsageError(message).into());
        }
    };
    if requests.is_empty() {
        return Err(UsageError(format!(
            "--file {}: no instances in it",
            args.file.display()
        ))
        .into());
    }
    let count = requests.len();
    let response = client
        .import_instances(pb::ImportInstancesRequest {
            instances: requests,
            dry_run: args.dry_run,
        })
        .await
        .map_err(|status| {
            let message = by_line(status.message(), &lines);
            match status.code() {
                tonic::Code::InvalidArgument => anyhow::Error::new(UsageError(format!(
                    "--file {}: {message}; nothing imported",
                    args.file.display()
                ))),
                code => anyhow!(tonic::Status::new(code, message)),
            }
        })?
        .into_inner();
    let value = serde_json::json!({
        "Instances": count,
        "Imported": response.imported,
        "Transactions": response.transactions,
        "DryRun": args.dry_run,
    });
    match format {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&value)?),
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
        let errors = read_file(text).unwrap_err();
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
