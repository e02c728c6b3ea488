//! Table and JSON output of CLI results.

use serde_json::{Value, json};
use switchyard_shared::{Endpoint, EndpointConfig, Instance, InstanceProtocol};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OutputFormat {
    #[default]
    Table,
    Json,
}

/// Renders rows as aligned columns under a header.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|header| header.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let last = cells.len().saturating_sub(1);
        for (index, (cell, width)) in cells.iter().zip(&widths).enumerate() {
            out.push_str(cell);
            if index < last {
                let pad = width.saturating_sub(cell.chars().count()) + 2;
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push('\n');
    };
    line(headers.to_vec(), &mut out);
    for row in rows {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

fn time(ms: i64) -> String {
    if ms <= 0 {
        return "-".into();
    }
    let seconds = ms / 1000;
    let days = seconds.div_euclid(86_400);
    let rem = seconds.rem_euclid(86_400);
    let (year, month, day) = switchyard_process::clock::civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

pub fn config_json(config: &EndpointConfig) -> Value {
    json!({
        "EndpointConfigName": config.endpoint_config_name,
        "ProductionVariants": config.production_variants,
        "HealthCheckConfig": config.health_check_config,
        "CreationTime": time(config.creation_time_ms),
    })
}

pub fn endpoint_json(endpoint: &Endpoint) -> Value {
    json!({
        "EndpointName": endpoint.endpoint_name,
        "EndpointConfigName": endpoint.endpoint_config_name,
        "EndpointStatus": endpoint.endpoint_status.to_string(),
        "CreationTime": time(endpoint.creation_time_ms),
        "LastModifiedTime": time(endpoint.last_modified_time_ms),
    })
}

pub fn instance_json(instance: &Instance) -> Value {
    json!({
        "InstanceId": instance.instance_id,
        "EndpointName": instance.endpoint_name,
        "VariantName": instance.variant_name,
        "Url": instance.url,
        "Role": instance.role.as_str(),
        "Protocol": instance.protocol.as_str(),
        "Weight": instance.weight,
        "Health": instance.health.to_string(),
        "HealthDetail": instance.health_detail,
        "TtlSeconds": instance.ttl_seconds,
        "RegisteredTime": time(instance.registered_time_ms),
        "KvEvents": instance.kv_events.as_ref().map(|kv| kv.publisher.as_str()),
        "KvEventsReplay": instance.kv_events.as_ref().and_then(|kv| kv.replay.as_deref()),
        "KvEventsDataParallelSize": instance.kv_events.as_ref().map(|kv| kv.data_parallel_size),
    })
}

pub fn config_rows(configs: &[EndpointConfig]) -> String {
    let rows: Vec<Vec<String>> = configs
        .iter()
        .flat_map(|config| {
            config.production_variants.iter().map(move |variant| {
                let routing = variant.routing();
                let prefix = routing
                    .prefix_aware_routing_config
                    .map(|prefix| {
                        let bounded = prefix
                            .load_balance()
                            .map(|(factor, slack)| format!(" load≤{factor}×mean+{slack}"))
                            .unwrap_or_default();
                        format!(
                            "{}/{}{bounded}",
                            prefix.prefix_length, prefix.concurrency_threshold
                        )
                    })
                    .unwrap_or_else(|| "-".into());
                vec![
                    config.endpoint_config_name.to_string(),
                    variant.variant_name.to_string(),
                    variant.model_name.clone().unwrap_or_else(|| "-".into()),
                    variant.weight().to_string(),
                    routing.routing_strategy.to_string(),
                    prefix,
                    time(config.creation_time_ms),
                ]
            })
        })
        .collect();
    table(
        &[
            "NAME",
            "VARIANT",
            "MODEL",
            "WEIGHT",
            "STRATEGY",
            "PREFIX/THRESHOLD",
            "CREATED",
        ],
        &rows,
    )
}

pub fn endpoint_rows(endpoints: &[Endpoint]) -> String {
    let rows: Vec<Vec<String>> = endpoints
        .iter()
        .map(|endpoint| {
            vec![
                endpoint.endpoint_name.to_string(),
                endpoint.endpoint_config_name.to_string(),
                endpoint.endpoint_status.to_string(),
                time(endpoint.creation_time_ms),
                time(endpoint.last_modified_time_ms),
            ]
        })
        .collect();
    table(
        &["NAME", "CONFIG", "STATUS", "CREATED", "LAST MODIFIED"],
        &rows,
    )
}

pub fn instance_rows(instances: &[Instance]) -> String {
    let rows: Vec<Vec<String>> = instances
        .iter()
        .map(|instance| {
            let health = if instance.health_detail.is_empty() {
                instance.health.to_string()
            } else {
                format!("{} ({})", instance.health, instance.health_detail)
            };
            vec![
                instance.endpoint_name.to_string(),
                instance.instance_id.to_string(),
                instance.variant_name.to_string(),
                instance.url.clone(),
                instance.role.to_string(),
                match instance.protocol {
                    InstanceProtocol::Unspecified => "-".into(),
                    protocol => protocol.to_string(),
                },
                instance.weight.to_string(),
                if instance.ttl_seconds == 0 {
                    "-".into()
                } else {
                    format!("{}s", instance.ttl_seconds)
                },
                health,
            ]
        })
        .collect();
    table(
        &[
            "ENDPOINT", "ID", "VARIANT", "URL", "ROLE", "PROTOCOL", "WEIGHT", "TTL", "HEALTH",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let out = table(
            &["A", "LONG"],
            &[
                vec!["xyz".into(), "1".into()],
                vec!["q".into(), "22".into()],
            ],
        );
        assert_eq!(out, "A    LONG\nxyz  1\nq    22\n");
    }

    #[test]
    fn times_are_iso() {
        assert_eq!(time(0), "-");
        assert_eq!(time(1_700_000_000_000), "2023-11-14T22:13:20Z");
    }
}
