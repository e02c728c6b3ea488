//! Control plane against a real etcd (and the embedded store): admin round trips, validation,
//! concurrency, the sync stream, leases, restarts, leader fail-over, auth, gRPC conventions,
//! TLS to etcd (client certificates, refusals).

use std::time::Duration;

use futures::StreamExt;
use switchyard_control::store::contract;
use switchyard_control::store::etcd::EtcdStore;
use switchyard_control::{ControlConfig, ControlPlane};
use switchyard_proto::v1 as pb;
use switchyard_tests::*;
use tonic::Code;

async fn etcd_control_plane(etcd: &Etcd, prefix: &str) -> anyhow::Result<ControlPlane> {
    control_plane(ControlConfig::etcd(
        loopback_any(),
        vec![etcd.url.clone()],
        prefix,
    ))
    .await
}

#[tokio::test]
async fn etcd_store_keeps_the_storage_contract() -> anyhow::Result<()> {
    let etcd = Etcd::start().await?;
    let store = EtcdStore::connect(std::slice::from_ref(&etcd.url), "/contract/", None).await?;
    contract::create_if_absent_and_compare_revision(&store).await;
    contract::watch_follows_listing(&store).await;
    contract::lapsed_lease_deletes_its_keys(&store).await;
    Ok(())
}

#[tokio::test]
async fn admin_round_trips_on_etcd() -> anyhow::Result<()> {
    let etcd = Etcd::start().await?;
    let cp = etcd_control_plane(&etcd, "/rt/").await?;
    let mut admin = admin(&cp.url()).await?;

    let created = admin
        .create_endpoint_config(config_request(
            "cfg-a",
            &variant_json("PREFIX_AWARE", Some((4096, 10))),
        ))
        .await?
        .into_inner();
    assert_eq!(created.name, "cfg-a");
    assert!(created.creation_time_ms > 0);
    let described = admin
        .describe_endpoint_config(pb::DescribeEndpointConfigRequest {
            name: "cfg-a".into(),
        })
        .await?
        .into_inner();
    assert_eq!(described, created);
    admin
        .create_endpoint_config(config_request("cfg-b", &variant_json("RANDOM", None)))
        .await?;
    let listed = admin
        .list_endpoint_configs(pb::ListEndpointConfigsRequest {})
        .await?
        .into_inner();
    assert_eq!(listed.endpoint_configs.len(), 2);

    let endpoint = admin
        .create_endpoint(pb::CreateEndpointRequest {
            name: "chat".into(),
            endpoint_config_name: "cfg-a".into(),
        })
        .await?
        .into_inner();
    assert_eq!(endpoint.status, pb::EndpointStatus::InService as i32);
    let updated = admin
        .update_endpoint(pb::UpdateEndpointRequest {
            name: "chat".into(),
            endpoint_config_name: "cfg-b".into(),
        })
        .await?
        .into_inner();
    assert_eq!(updated.endpoint_config_name, "cfg-b");
    let described = admin
        .describe_endpoint(pb::DescribeEndpointRequest {
            name: "chat".into(),
        })
        .await?
        .into_inner();
    assert_eq!(described.endpoint_config_name, "cfg-b");

    // A config in use cannot go; an unused one can.
    let err = admin
        .delete_endpoint_config(pb::DeleteEndpointConfigRequest {
            name: "cfg-b".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("chat"), "{err}");
    admin
        .delete_endpoint_config(pb::DeleteEndpointConfigRequest {
            name: "cfg-a".into(),
        })
        .await?;

    register(&mut admin, "chat", "i1", "http://127.0.0.1:9").await?;
    let instances = admin
        .list_instances(pb::ListInstancesRequest {
            endpoint_name: "chat".into(),
        })
        .await?
        .into_inner()
        .instances;
    assert_eq!(instances.len(), 1);
    admin
        .deregister_instance(pb::DeregisterInstanceRequest {
            endpoint_name: "chat".into(),
            id: "i1".into(),
        })
        .await?;

    admin
        .delete_endpoint(pb::DeleteEndpointRequest {
            name: "chat".into(),
        })
        .await?;
    let err = admin
        .describe_endpoint(pb::DescribeEndpointRequest {
            name: "chat".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = admin
        .create_endpoint(pb::CreateEndpointRequest {
            name: "x".into(),
            endpoint_config_name: "missing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("EndpointConfigName"), "{err}");
    cp.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn every_validation_rule_names_its_field() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cp = embedded_control_plane(dir.path()).await?;
    let mut admin = admin(&cp.url()).await?;
    let variant = |name: &str, routing: Option<pb::RoutingConfig>| pb::ProductionVariant {
        variant_name: name.into(),
        routing_config: routing,
        ..Default::default()
    };
    let prefix = |strategy: pb::RoutingStrategy, params: Option<(u32, u32)>| {
        Some(pb::RoutingConfig {
            routing_strategy: strategy as i32,
            prefix_aware_routing_config: params.map(|(prefix_length, concurrency_threshold)| {
                pb::PrefixAwareRoutingConfig {
                    prefix_length,
                    concurrency_threshold,
                    ..Default::default()
                }
            }),
            kv_aware_routing_config: None,
        })
    };
    let kv = |strategy: pb::RoutingStrategy, threshold: u32, weight: Option<f64>| {
        Some(pb::RoutingConfig {
            routing_strategy: strategy as i32,
            prefix_aware_routing_config: None,
            kv_aware_routing_config: Some(pb::KvAwareRoutingConfig {
                concurrency_threshold: threshold,
                load_weight: weight,
            }),
        })
    };
    let kv_base = "ProductionVariants[0].RoutingConfig.KvAwareRoutingConfig";
    // Switchyard's bounded-load extension of PrefixAwareRoutingConfig.
    let balanced = |factor: Option<f64>, slack: Option<u32>| {
        Some(pb::RoutingConfig {
            routing_strategy: pb::RoutingStrategy::PrefixAware as i32,
            prefix_aware_routing_config: Some(pb::PrefixAwareRoutingConfig {
                prefix_length: 4096,
                concurrency_threshold: 16,
                load_balance_factor: factor,
                load_balance_slack: slack,
            }),
            kv_aware_routing_config: None,
        })
    };
    let config =
        |name: &str, variants: Vec<pb::ProductionVariant>| pb::CreateEndpointConfigRequest {
            endpoint_config: Some(pb::EndpointConfig {
                name: name.into(),
                production_variants: variants,
                ..Default::default()
            }),
        };
    let base = "ProductionVariants[0].RoutingConfig.PrefixAwareRoutingConfig";
    let cases: Vec<(pb::CreateEndpointConfigRequest, String)> = vec![
        (
            config("bad name", vec![variant("v", None)]),
            "EndpointConfigName".into(),
        ),
        (
            config(&"x".repeat(64), vec![variant("v", None)]),
            "EndpointConfigName".into(),
        ),
        (config("c", vec![]), "ProductionVariants".into()),
        (
            config(
                "c",
                (0..11).map(|i| variant(&format!("v{i}"), None)).collect(),
            ),
            "ProductionVariants".into(),
        ),
        (
            config("c", vec![variant("-v", None)]),
            "ProductionVariants[0].VariantName".into(),
        ),
        (
            config("c", vec![variant("v", None), variant("v", None)]),
            "ProductionVariants[1].VariantName".into(),
        ),
        (
            config(
                "c",
                vec![pb::ProductionVariant {
                    initial_variant_weight: Some(-0.5),
                    ..variant("v", None)
                }],
            ),
            "ProductionVariants[0].InitialVariantWeight".into(),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    Some(pb::RoutingConfig {
                        routing_strategy: 42,
                        prefix_aware_routing_config: None,
                        kv_aware_routing_config: None,
                    }),
                )],
            ),
            "ProductionVariants[0].RoutingConfig.RoutingStrategy".into(),
        ),
        (
            config(
                "c",
                vec![variant("v", prefix(pb::RoutingStrategy::PrefixAware, None))],
            ),
            base.into(),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    prefix(pb::RoutingStrategy::Random, Some((4096, 10))),
                )],
            ),
            base.into(),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    prefix(
                        pb::RoutingStrategy::LeastOutstandingRequests,
                        Some((4096, 10)),
                    ),
                )],
            ),
            base.into(),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    prefix(pb::RoutingStrategy::PrefixAware, Some((1023, 10))),
                )],
            ),
            format!("{base}.PrefixLength"),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    prefix(pb::RoutingStrategy::PrefixAware, Some((65537, 10))),
                )],
            ),
            format!("{base}.PrefixLength"),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    prefix(pb::RoutingStrategy::PrefixAware, Some((4096, 0))),
                )],
            ),
            format!("{base}.ConcurrencyThreshold"),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    prefix(pb::RoutingStrategy::PrefixAware, Some((4096, 1025))),
                )],
            ),
            format!("{base}.ConcurrencyThreshold"),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    prefix(pb::RoutingStrategy::KvAware, Some((4096, 10))),
                )],
            ),
            base.into(),
        ),
        (
            config(
                "c",
                vec![variant("v", kv(pb::RoutingStrategy::Random, 0, None))],
            ),
            kv_base.into(),
        ),
        (
            config(
                "c",
                vec![variant("v", kv(pb::RoutingStrategy::KvAware, 1025, None))],
            ),
            format!("{kv_base}.ConcurrencyThreshold"),
        ),
        (
            config(
                "c",
                vec![variant(
                    "v",
                    kv(pb::RoutingStrategy::KvAware, 0, Some(-1.0)),
                )],
            ),
            format!("{kv_base}.LoadWeight"),
        ),
        (
            config("c", vec![variant("v", balanced(Some(0.5), None))]),
            format!("{base}.LoadBalanceFactor"),
        ),
        (
            config("c", vec![variant("v", balanced(Some(f64::NAN), Some(2)))]),
            format!("{base}.LoadBalanceFactor"),
        ),
        (
            config("c", vec![variant("v", balanced(Some(1.25), Some(1025)))]),
            format!("{base}.LoadBalanceSlack"),
        ),
        (
            config("c", vec![variant("v", balanced(None, Some(2)))]),
            format!("{base}.LoadBalanceSlack"),
        ),
    ];
    for (request, field) in cases {
        let err = admin.create_endpoint_config(request).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(
            err.message().starts_with(&format!("{field}:")),
            "expected the message to name {field}, got {:?}",
            err.message()
        );
    }
    // Nothing invalid was stored.
    let listed = admin
        .list_endpoint_configs(pb::ListEndpointConfigsRequest {})
        .await?
        .into_inner();
    assert!(listed.endpoint_configs.is_empty());

    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    for (request, field) in [
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: "not a url".into(),
                ..Default::default()
            },
            "Url",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "Other".into(),
                url: "http://127.0.0.1:1".into(),
                ..Default::default()
            },
            "VariantName",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "nope".into(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:1".into(),
                ..Default::default()
            },
            "EndpointName",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:1".into(),
                weight: Some(0.0),
                ..Default::default()
            },
            "Weight",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:1".into(),
                ttl_seconds: 1,
                ..Default::default()
            },
            "TtlSeconds",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:1".into(),
                id: "a/b".into(),
                ..Default::default()
            },
            "InstanceId",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:1".into(),
                protocol: 7,
                ..Default::default()
            },
            "Protocol",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:1".into(),
                kv_events_endpoint: "tcp://*:5557".into(),
                ..Default::default()
            },
            "KvEventsEndpoint",
        ),
        (
            pb::RegisterInstanceRequest {
                endpoint_name: "chat".into(),
                variant_name: "AllTraffic".into(),
                url: "http://127.0.0.1:1".into(),
                kv_events_replay_endpoint: "tcp://127.0.0.1:5558".into(),
                ..Default::default()
            },
            "KvEventsReplayEndpoint",
        ),
    ] {
        let err = admin.register_instance(request).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err}");
        assert!(
            err.message().starts_with(&format!("{field}:")),
            "{field}: {err}"
        );
    }
    cp.shutdown().await?;
    Ok(())
}

async fn concurrent_creates_one_wins(cp: &ControlPlane) -> anyhow::Result<()> {
    for round in 0..5 {
        let name = format!("race-{round}");
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let url = cp.url();
            let name = name.clone();
            tasks.push(tokio::spawn(async move {
                let mut admin = admin(&url).await.expect("admin client");
                admin
                    .create_endpoint_config(config_request(&name, &variant_json("RANDOM", None)))
                    .await
            }));
        }
        let mut won = 0;
        for task in tasks {
            match task.await? {
                Ok(_) => won += 1,
                Err(status) => assert_eq!(status.code(), Code::AlreadyExists, "{status}"),
            }
        }
        assert_eq!(won, 1, "exactly one create of {name} wins");
    }
    Ok(())
}

#[tokio::test]
async fn concurrent_creates_exactly_one_wins_on_both_stores() -> anyhow::Result<()> {
    let etcd = Etcd::start().await?;
    // Two replicas on one etcd race each other.
    let first = etcd_control_plane(&etcd, "/race/").await?;
    let second = etcd_control_plane(&etcd, "/race/").await?;
    let mut tasks = Vec::new();
    for replica in [first.url(), second.url()] {
        for _ in 0..4 {
            let url = replica.clone();
            tasks.push(tokio::spawn(async move {
                let mut admin = admin(&url).await.expect("admin client");
                admin
                    .create_endpoint_config(config_request("shared", &variant_json("RANDOM", None)))
                    .await
            }));
        }
    }
    let mut won = 0;
    for task in tasks {
        if task.await?.is_ok() {
            won += 1;
        }
    }
    assert_eq!(won, 1, "one create wins across replicas");
    concurrent_creates_one_wins(&first).await?;

    let dir = tempfile::tempdir()?;
    let embedded = embedded_control_plane(dir.path()).await?;
    concurrent_creates_one_wins(&embedded).await?;
    Ok(())
}

/// A raw sync client, as a router built before protocol 2 would hold: its hello names no
/// protocol, so the control plane answers in protocol 1 (one whole Snapshot, then one message
/// per change).
async fn sync_client(
    url: &str,
    router_id: &str,
) -> anyhow::Result<(
    tokio::sync::mpsc::Sender<pb::RouterMessage>,
    tonic::Streaming<pb::SyncMessage>,
)> {
    let mut client = pb::router_sync_client::RouterSyncClient::connect(url.to_owned()).await?;
    let (sender, receiver) = tokio::sync::mpsc::channel(8);
    sender
        .send(pb::RouterMessage {
            message: Some(pb::router_message::Message::Hello(pb::RouterHello {
                router_id: router_id.into(),
                ..Default::default()
            })),
        })
        .await?;
    let stream = client
        .sync(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    Ok((sender, stream))
}

async fn next_change(
    stream: &mut tonic::Streaming<pb::SyncMessage>,
) -> anyhow::Result<pb::sync_message::Message> {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
        match message.message {
            Some(pb::sync_message::Message::FleetLoad(_)) | None => continue,
            Some(other) => return Ok(other),
        }
    }
}

#[tokio::test]
async fn changes_reach_a_connected_sync_client() -> anyhow::Result<()> {
    let etcd = Etcd::start().await?;
    let cp = etcd_control_plane(&etcd, "/sync/").await?;
    let mut admin = admin(&cp.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;

    let (_sender, mut stream) = sync_client(&cp.url(), "r1").await?;
    match next_change(&mut stream).await? {
        pb::sync_message::Message::Snapshot(snapshot) => assert!(snapshot.instances.is_empty()),
        other => panic!("expected a snapshot first, got {other:?}"),
    }
    // A config change (endpoint switched to a new config) arrives. (The creation of "chat"
    // itself may arrive first if the snapshot was taken before the control plane saw it.)
    admin
        .create_endpoint_config(config_request(
            "cfg-prefix",
            &variant_json("PREFIX_AWARE", Some((2048, 5))),
        ))
        .await?;
    admin
        .update_endpoint(pb::UpdateEndpointRequest {
            name: "chat".into(),
            endpoint_config_name: "cfg-prefix".into(),
        })
        .await?;
    loop {
        if let pb::sync_message::Message::EndpointChanged(routed) = next_change(&mut stream).await?
        {
            let config = routed.config.unwrap();
            if config.name != "cfg-prefix" {
                continue;
            }
            let routing = config.production_variants[0].routing_config.unwrap();
            assert_eq!(
                routing.prefix_aware_routing_config.unwrap().prefix_length,
                2048
            );
            break;
        }
    }
    // An instance registration arrives.
    register(&mut admin, "chat", "engine-1", "http://127.0.0.1:9").await?;
    match next_change(&mut stream).await? {
        pb::sync_message::Message::InstanceChanged(instance) => {
            assert_eq!(instance.id, "engine-1");
        }
        other => panic!("expected InstanceChanged, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn fleet_load_is_the_sum_of_the_other_routers_over_known_instances() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cp = embedded_control_plane(dir.path()).await?;
    let mut admin = admin(&cp.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    register(&mut admin, "chat", "i1", "http://127.0.0.1:9").await?;
    let (a, mut a_stream) = sync_client(&cp.url(), "router-a").await?;
    let (b, _b_stream) = sync_client(&cp.url(), "router-b").await?;
    let load = |instance: &str, count: u32| pb::InstanceLoad {
        endpoint_name: "chat".into(),
        instance_id: instance.into(),
        in_flight: count,
    };
    let report = |loads: Vec<pb::InstanceLoad>| pb::RouterMessage {
        message: Some(pb::router_message::Message::Load(pb::LoadReport { loads })),
    };
    a.send(report(vec![load("i1", 3)])).await?;
    // Router B also claims load on an instance that does not exist: ignored, so one router
    // cannot make up load the fleet would route around.
    b.send(report(vec![load("i1", 4), load("ghost", 1000)]))
        .await?;
    // Router A hears about B's 4, never its own 3, nor the ghost.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no fleet load for router A"
        );
        let message = tokio::time::timeout(Duration::from_secs(10), a_stream.next())
            .await?
            .unwrap()?;
        if let Some(pb::sync_message::Message::FleetLoad(fleet)) = message.message
            && !fleet.loads.is_empty()
        {
            assert_eq!(fleet.loads.len(), 1, "{fleet:?}");
            assert_eq!(fleet.loads[0].instance_id, "i1");
            assert_eq!(fleet.loads[0].in_flight, 4);
            break;
        }
    }
    Ok(())
}

#[tokio::test]
async fn an_instance_whose_heartbeats_stop_leaves_after_its_ttl() -> anyhow::Result<()> {
    let etcd = Etcd::start().await?;
    let cp = etcd_control_plane(&etcd, "/ttl/").await?;
    let mut admin = admin(&cp.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    admin
        .register_instance(pb::RegisterInstanceRequest {
            endpoint_name: "chat".into(),
            variant_name: "AllTraffic".into(),
            url: "http://127.0.0.1:9".into(),
            id: "leased".into(),
            ttl_seconds: 2,
            ..Default::default()
        })
        .await?;
    // Heartbeats keep it past its TTL...
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let beat = admin
            .heartbeat(pb::HeartbeatRequest {
                endpoint_name: "chat".into(),
                id: "leased".into(),
            })
            .await?
            .into_inner();
        assert_eq!(beat.ttl_seconds, 2);
    }
    let count = |admin: &pb::admin_client::AdminClient<tonic::transport::Channel>| {
        let mut admin = admin.clone();
        async move {
            admin
                .list_instances(pb::ListInstancesRequest::default())
                .await
                .map(|response| response.into_inner().instances.len())
                .unwrap_or(usize::MAX)
        }
    };
    assert_eq!(count(&admin).await, 1);
    // ...and without them it goes.
    eventually(Duration::from_secs(10), "the lease to lapse", || {
        let pending = count(&admin);
        async move { pending.await == 0 }
    })
    .await?;
    let err = admin
        .heartbeat(pb::HeartbeatRequest {
            endpoint_name: "chat".into(),
            id: "leased".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    Ok(())
}

async fn populate(
    admin: &mut pb::admin_client::AdminClient<tonic::transport::Channel>,
) -> anyhow::Result<()> {
    create_endpoint(
        admin,
        "chat",
        &variant_json("PREFIX_AWARE", Some((4096, 8))),
    )
    .await?;
    register(admin, "chat", "persistent", "http://127.0.0.1:9").await?;
    admin
        .register_instance(pb::RegisterInstanceRequest {
            endpoint_name: "chat".into(),
            variant_name: "AllTraffic".into(),
            url: "http://127.0.0.1:10".into(),
            id: "leased".into(),
            ttl_seconds: 30,
            ..Default::default()
        })
        .await?;
    Ok(())
}

async fn assert_populated(url: &str) -> anyhow::Result<()> {
    let mut admin = admin(url).await?;
    let config = admin
        .describe_endpoint_config(pb::DescribeEndpointConfigRequest {
            name: "chat-cfg".into(),
        })
        .await?
        .into_inner();
    let routing = config.production_variants[0].routing_config.unwrap();
    assert_eq!(
        routing
            .prefix_aware_routing_config
            .unwrap()
            .concurrency_threshold,
        8
    );
    admin
        .describe_endpoint(pb::DescribeEndpointRequest {
            name: "chat".into(),
        })
        .await?;
    let mut ids: Vec<String> = admin
        .list_instances(pb::ListInstancesRequest::default())
        .await?
        .into_inner()
        .instances
        .into_iter()
        .map(|instance| instance.id)
        .collect();
    ids.sort();
    assert_eq!(ids, ["leased", "persistent"]);
    // The leased instance's lease still works after the restart.
    admin
        .heartbeat(pb::HeartbeatRequest {
            endpoint_name: "chat".into(),
            id: "leased".into(),
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_restart_loses_nothing_on_either_store() -> anyhow::Result<()> {
    // Embedded: stop, start again on the same directory.
    let dir = tempfile::tempdir()?;
    let cp = embedded_control_plane(dir.path()).await?;
    populate(&mut admin(&cp.url()).await?).await?;
    cp.shutdown().await?;
    let cp = embedded_control_plane(dir.path()).await?;
    assert_populated(&cp.url()).await?;
    cp.shutdown().await?;

    // Embedded, crashed instead of stopped: acknowledged writes are on disk.
    let dir = tempfile::tempdir()?;
    let cp = embedded_control_plane(dir.path()).await?;
    populate(&mut admin(&cp.url()).await?).await?;
    cp.abort();
    let cp = embedded_control_plane(dir.path()).await?;
    assert_populated(&cp.url()).await?;
    cp.shutdown().await?;

    // etcd: a new control plane finds everything.
    let etcd = Etcd::start().await?;
    let cp = etcd_control_plane(&etcd, "/restart/").await?;
    populate(&mut admin(&cp.url()).await?).await?;
    cp.shutdown().await?;
    let cp = etcd_control_plane(&etcd, "/restart/").await?;
    assert_populated(&cp.url()).await?;
    Ok(())
}

#[tokio::test]
async fn killing_the_leader_hands_probing_to_the_other_replica() -> anyhow::Result<()> {
    let etcd = Etcd::start().await?;
    let first = etcd_control_plane(&etcd, "/leader/").await?;
    first.wait_leader().await;
    let second = etcd_control_plane(&etcd, "/leader/").await?;
    assert!(first.is_leader());
    assert!(!second.is_leader());

    let mut admin = admin(&second.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    let engine = switchyard_engine_sim::spawn(switchyard_engine_sim::SimConfig::default()).await?;
    register(&mut admin, "chat", "engine", &engine.url).await?;
    let health = |admin: &pb::admin_client::AdminClient<tonic::transport::Channel>| {
        let mut admin = admin.clone();
        async move {
            admin
                .list_instances(pb::ListInstancesRequest::default())
                .await
                .ok()
                .and_then(|response| response.into_inner().instances.first().map(|i| i.health))
                .unwrap_or(-1)
        }
    };
    eventually(
        Duration::from_secs(10),
        "the leader to mark the engine healthy",
        || {
            let probe = health(&admin);
            async move { probe.await == pb::HealthStatus::Healthy as i32 }
        },
    )
    .await?;

    // The leader crashes (no hand-over); the other replica takes over within a few seconds.
    first.abort();
    eventually(
        Duration::from_secs(10),
        "the second replica to lead",
        || async { second.is_leader() },
    )
    .await?;
    // Probing runs on the new leader: the engine dies and is marked unhealthy.
    engine.kill();
    eventually(
        Duration::from_secs(10),
        "the new leader to mark the engine unhealthy",
        || {
            let probe = health(&admin);
            async move { probe.await == pb::HealthStatus::Unhealthy as i32 }
        },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn admin_token_is_required_when_set() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n")?;
    let mut config = ControlConfig::embedded(loopback_any(), dir.path().join("data"));
    config.admin_token_file = Some(token_file);
    let cp = control_plane(config).await?;
    let channel = tonic::transport::Channel::from_shared(cp.url())?
        .connect()
        .await?;

    let mut anonymous = pb::admin_client::AdminClient::new(channel.clone());
    let err = anonymous
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    let token = |value: &'static str| {
        move |mut request: tonic::Request<()>| {
            request
                .metadata_mut()
                .insert("authorization", value.parse().unwrap());
            Ok(request)
        }
    };
    let mut wrong =
        pb::admin_client::AdminClient::with_interceptor(channel.clone(), token("Bearer nope"));
    let err = wrong
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    let mut right =
        pb::admin_client::AdminClient::with_interceptor(channel, token("Bearer s3cret"));
    right.list_endpoints(pb::ListEndpointsRequest {}).await?;
    Ok(())
}

#[tokio::test]
async fn grpc_health_and_reflection_are_served() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cp = embedded_control_plane(dir.path()).await?;
    let channel = tonic::transport::Channel::from_shared(cp.url())?
        .connect()
        .await?;
    let health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    // SERVING once the replica's view of its store is current (at once, on an embedded store).
    eventually(Duration::from_secs(10), "Admin to be SERVING", || {
        let mut health = health.clone();
        async move {
            let status = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: "switchyard.v1.Admin".into(),
                })
                .await;
            status.is_ok_and(|status| {
                status.into_inner().status
                    == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
            })
        }
    })
    .await?;
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut responses = reflection
        .server_reflection_info(futures::stream::iter([request]))
        .await?
        .into_inner();
    let response = responses.next().await.unwrap()?;
    let names: Vec<String> = match response.message_response {
        Some(tonic_reflection::pb::v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) => {
            list.service.into_iter().map(|service| service.name).collect()
        }
        other => panic!("unexpected reflection answer {other:?}"),
    };
    assert!(
        names.contains(&"switchyard.v1.Admin".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"switchyard.v1.RouterSync".to_owned()),
        "{names:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_etcd_store_reports_unavailable_when_etcd_dies() -> anyhow::Result<()> {
    let mut etcd = Etcd::start().await?;
    let cp = etcd_control_plane(&etcd, "/down/").await?;
    let mut admin = admin(&cp.url()).await?;
    admin.list_endpoints(pb::ListEndpointsRequest {}).await?;
    etcd.kill();
    let err = admin
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    Ok(())
}

#[tokio::test]
async fn the_grpc_server_speaks_tls_when_given_a_certificate() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    let status = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
        ])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-addext",
            "basicConstraints=critical,CA:FALSE",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()?;
    assert!(
        status.success(),
        "openssl could not make a test certificate"
    );
    let mut config = ControlConfig::embedded(loopback_any(), dir.path().join("data"));
    config.tls_cert = Some(cert.clone());
    config.tls_key = Some(key);
    let cp = control_plane(config).await?;
    let port = cp.addr.port();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(
            &cert,
        )?))
        .domain_name("localhost");
    let channel = tonic::transport::Channel::from_shared(format!("https://localhost:{port}"))?
        .tls_config(tls)?
        .connect()
        .await?;
    pb::admin_client::AdminClient::new(channel)
        .list_endpoints(pb::ListEndpointsRequest {})
        .await?;
    // Plain text is refused.
    let plain = admin(&cp.url()).await;
    let refused = match plain {
        Err(_) => true,
        Ok(mut client) => client
            .list_endpoints(pb::ListEndpointsRequest {})
            .await
            .is_err(),
    };
    assert!(refused, "a plain-text client must not get through");
    Ok(())
}

/// A control-plane configuration for the TLS etcd at `etcd`, trusting `ca`, with `pki`'s client
/// certificate when `client_cert` is set.
fn etcd_tls_config(
    etcd: &Etcd,
    ca: &std::path::Path,
    pki: &TestPki,
    client_cert: bool,
) -> ControlConfig {
    let mut config = ControlConfig::etcd(loopback_any(), vec![etcd.url.clone()], "/tls/");
    config.etcd_ca = Some(ca.to_path_buf());
    if client_cert {
        config.etcd_cert = Some(pki.client_cert.clone());
        config.etcd_key = Some(pki.client_key.clone());
    }
    config
}

#[tokio::test]
async fn a_control_plane_keeps_its_state_in_etcd_over_tls() -> anyhow::Result<()> {
    let pki = TestPki::generate()?;
    let etcd = Etcd::start_tls(&pki).await?;
    assert!(etcd.url.starts_with("https://127.0.0.1:"), "{}", etcd.url);
    let cp = control_plane(etcd_tls_config(&etcd, &pki.ca, &pki, true)).await?;
    let mut client = admin(&cp.url()).await?;
    let created = client
        .create_endpoint_config(config_request(
            "cfg-tls",
            &variant_json("PREFIX_AWARE", Some((4096, 10))),
        ))
        .await?
        .into_inner();
    let described = client
        .describe_endpoint_config(pb::DescribeEndpointConfigRequest {
            name: "cfg-tls".into(),
        })
        .await?
        .into_inner();
    assert_eq!(described, created);
    cp.shutdown().await?;

    // The write is in etcd, not in the control plane: a fresh one reads it back.
    let cp = control_plane(etcd_tls_config(&etcd, &pki.ca, &pki, true)).await?;
    let listed = admin(&cp.url())
        .await?
        .list_endpoint_configs(pb::ListEndpointConfigsRequest {})
        .await?
        .into_inner();
    let names: Vec<&str> = listed
        .endpoint_configs
        .iter()
        .map(|config| config.name.as_str())
        .collect();
    assert_eq!(names, ["cfg-tls"]);
    cp.shutdown().await?;

    // Watches and leases ride the same TLS connection.
    let settings = etcd_tls_config(&etcd, &pki.ca, &pki, true).validate()?;
    let store = EtcdStore::connect(
        std::slice::from_ref(&etcd.url),
        "/tls-contract/",
        settings.etcd_tls.as_ref(),
    )
    .await?;
    contract::watch_follows_listing(&store).await;
    contract::lapsed_lease_deletes_its_keys(&store).await;
    Ok(())
}

#[tokio::test]
async fn etcd_over_tls_refuses_a_missing_client_certificate_and_a_wrong_ca() -> anyhow::Result<()> {
    let pki = TestPki::generate()?;
    let other = TestPki::generate()?;
    let etcd = Etcd::start_tls(&pki).await?;
    let cases = [
        (
            "no client certificate",
            etcd_tls_config(&etcd, &pki.ca, &pki, false),
            "no client certificate was presented",
        ),
        (
            "a client certificate from another CA",
            etcd_tls_config(&etcd, &pki.ca, &other, true),
            "etcd refused the client certificate",
        ),
        (
            "another CA for etcd's certificate",
            etcd_tls_config(&etcd, &other.ca, &pki, true),
            "invalid peer certificate",
        ),
    ];
    for (case, config, expected) in cases {
        let started = tokio::time::timeout(Duration::from_secs(20), control_plane(config))
            .await
            .map_err(|_| anyhow::anyhow!("{case}: start hung instead of failing"))?;
        let Err(err) = started else {
            panic!("{case}: the control plane started");
        };
        let err = format!("{err:#}");
        assert!(
            err.contains(&format!("etcd at {}", etcd.url)),
            "{case}: {err}"
        );
        assert!(
            err.contains("TLS") && err.contains(expected),
            "{case}: {err}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn routers_need_the_router_token_when_one_is_set() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("router-token");
    std::fs::write(&token_file, "r0uter\n")?;
    let mut config = ControlConfig::embedded(loopback_any(), dir.path().join("data"));
    config.router_token_file = Some(token_file.clone());
    let cp = control_plane(config).await?;

    let anonymous = router(&[cp.url()]).await?;
    let mut with_token =
        switchyard_router::RouterConfig::with_control_plane(loopback_any(), vec![cp.url()]);
    with_token.control_plane_token_file = Some(token_file);
    let trusted =
        switchyard_router::RouterHandle::start(with_token.validate().map_err(anyhow::Error::msg)?)
            .await?;
    eventually(
        Duration::from_secs(10),
        "the router with the token to sync",
        || async { trusted.table().version > 0 },
    )
    .await?;
    assert_eq!(
        anonymous.table().version,
        0,
        "a router without the token gets nothing"
    );
    let (status, _) = http_get(&format!("{}/readyz", anonymous.url())).await?;
    assert_eq!(status, 503);
    Ok(())
}
