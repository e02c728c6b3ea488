//! Control plane against a real etcd (and the embedded store): admin round trips, validation,
//! concurrency, the sync stream, leases, restarts, leader fail-over, auth, gRPC conventions,
//! TLS to etcd (client certificates, refusals).

use std::time::Duration;

use futures::StreamExt;
use switchyard_control::ControlConfig;
use switchyard_control::store::contract;
use switchyard_control::store::etcd::EtcdStore;
use switchyard_proto::v1 as pb;
use switchyard_tests::*;
use tonic::Code;

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
    let (_etcd, cp, mut admin) = etcd_admin("/rt/").await?;

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
    let updated = switch_endpoint_config(&mut admin, "chat", "cfg-b").await?;
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
    let (cp, mut admin) = embedded_admin(dir.path()).await?;
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
                tokenizer: None,
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
                vec![pb::ProductionVariant {
                    migration_limit: Some(11),
                    ..variant("v", None)
                }],
            ),
            "ProductionVariants[0].MigrationLimit".into(),
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

/// `per_replica` concurrent creates of config `name` through each of `replicas`: exactly
/// one wins, and the losers are told why (ALREADY_EXISTS).
async fn one_create_wins(
    replicas: &[String],
    per_replica: usize,
    name: &str,
) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    for replica in replicas {
        for _ in 0..per_replica {
            let url = replica.clone();
            let name = name.to_owned();
            tasks.push(tokio::spawn(async move {
                let mut admin = admin(&url).await.expect("admin client");
                admin
                    .create_endpoint_config(config_request(&name, &variant_json("RANDOM", None)))
                    .await
            }));
        }
    }
    let mut won = 0;
    for task in tasks {
        match task.await? {
            Ok(_) => won += 1,
            Err(status) => assert_eq!(status.code(), Code::AlreadyExists, "{status}"),
        }
    }
    assert_eq!(won, 1, "exactly one create of {name} wins on {replicas:?}");
    Ok(())
}

#[tokio::test]
async fn concurrent_creates_exactly_one_wins_on_both_stores() -> anyhow::Result<()> {
    let etcd = Etcd::start().await?;
    // Two replicas on one etcd race each other, 4 creates each.
    let first = etcd_control_plane(&etcd, "/race/").await?;
    let second = etcd_control_plane(&etcd, "/race/").await?;
    one_create_wins(&[first.url(), second.url()], 4, "shared").await?;
    // 8 creates on one replica, five times, on etcd and on the embedded store.
    let dir = tempfile::tempdir()?;
    let embedded = embedded_control_plane(dir.path()).await?;
    for replica in [first.url(), embedded.url()] {
        for round in 0..5 {
            one_create_wins(std::slice::from_ref(&replica), 8, &format!("race-{round}")).await?;
        }
    }
    Ok(())
}

/// A raw sync client's two halves: what it sends, and what the control plane sends it.
type SyncClient = (
    tokio::sync::mpsc::Sender<pb::RouterMessage>,
    tonic::Streaming<pb::SyncMessage>,
);

/// A raw sync client, as a router built before protocol 2 would hold: its hello names no
/// protocol, so the control plane answers in protocol 1 (one whole Snapshot, then one message
/// per change).
async fn sync_client(url: &str, router_id: &str) -> anyhow::Result<SyncClient> {
    sync_client_speaking(
        tonic::transport::Endpoint::from_shared(url.to_owned())?,
        router_id,
        0,
    )
    .await
}

/// A raw sync client on `endpoint` whose hello announces `protocol` (0: none, which the
/// control plane reads as 1; 2: snapshots and change batches as `StateUpdate`s, as routers
/// speak it).
async fn sync_client_speaking(
    endpoint: tonic::transport::Endpoint,
    router_id: &str,
    protocol: u32,
) -> anyhow::Result<SyncClient> {
    let mut client = pb::router_sync_client::RouterSyncClient::new(endpoint.connect().await?);
    let (sender, receiver) = tokio::sync::mpsc::channel(8);
    sender
        .send(pb::RouterMessage {
            message: Some(pb::router_message::Message::Hello(pb::RouterHello {
                router_id: router_id.into(),
                protocol,
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
    let (_etcd, cp, mut admin) = etcd_admin("/sync/").await?;
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
    switch_endpoint_config(&mut admin, "chat", "cfg-prefix").await?;
    loop {
        if let pb::sync_message::Message::EndpointChanged(routed) = next_change(&mut stream).await?
        {
            let config = routed.config.unwrap();
            if config.name != "cfg-prefix" {
                continue;
            }
            let routing = config.production_variants[0]
                .routing_config
                .clone()
                .unwrap();
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
    let (cp, mut admin) = embedded_admin(dir.path()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    register(&mut admin, "chat", "i1", "http://127.0.0.1:9").await?;
    let (a, mut a_stream) = sync_client(&cp.url(), "router-a").await?;
    let (b, _b_stream) = sync_client(&cp.url(), "router-b").await?;
    // The control plane takes reports only about instances it knows: wait until it does.
    until_known(&mut a_stream, &["i1"]).await?;
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
    let (_etcd, _control_plane, mut admin) = etcd_admin("/ttl/").await?;
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
    let routing = config.production_variants[0]
        .routing_config
        .clone()
        .unwrap();
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
    assert_eq!(
        listed_instances(&mut admin, "chat").await?,
        ["leased", "persistent"]
    );
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

    // Crashed instead of stopped: a real process killed with SIGKILL, in
    // the_embedded_store_fsyncs_then_renames_then_fsyncs_its_directory_and_survives_sigkill.

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
    wait_first_instance_health(
        &admin,
        pb::HealthStatus::Healthy,
        "the leader to mark the engine healthy",
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
    wait_first_instance_health(
        &admin,
        pb::HealthStatus::Unhealthy,
        "the new leader to mark the engine unhealthy",
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

    // The stream itself is refused, with the reason, without the token or with a wrong one
    // (not merely slow: the call answers UNAUTHENTICATED).
    let channel = tonic::transport::Channel::from_shared(cp.url())?
        .connect()
        .await?;
    for token in [None, Some("Bearer nope")] {
        let mut request = tonic::Request::new(futures::stream::iter([pb::RouterMessage {
            message: Some(pb::router_message::Message::Hello(pb::RouterHello {
                router_id: "intruder".into(),
                ..Default::default()
            })),
        }]));
        if let Some(token) = token {
            request
                .metadata_mut()
                .insert("authorization", token.parse()?);
        }
        let refused = tokio::time::timeout(
            Duration::from_secs(10),
            pb::router_sync_client::RouterSyncClient::new(channel.clone()).sync(request),
        )
        .await?;
        let status = refused.map(|_| ()).expect_err("a stream without the token");
        assert_eq!(status.code(), Code::Unauthenticated, "{token:?}: {status}");
    }

    let anonymous = router(&[cp.url()]).await?;
    let mut with_token =
        switchyard_router::RouterConfig::with_control_plane(loopback_any(), vec![cp.url()]);
    with_token.control_plane_token_file = Some(token_file);
    let trusted = router_with(with_token).await?;
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

// --- Fleet-wide load ----------------------------------------------------------------------

fn load_report(loads: &[(&str, u32)]) -> pb::RouterMessage {
    pb::RouterMessage {
        message: Some(pb::router_message::Message::Load(pb::LoadReport {
            loads: loads
                .iter()
                .map(|(instance, in_flight)| pb::InstanceLoad {
                    endpoint_name: "chat".into(),
                    instance_id: (*instance).into(),
                    in_flight: *in_flight,
                })
                .collect(),
        })),
    }
}

/// The next fleet-load figures on `stream` (other messages skipped), as instance -> count.
async fn next_fleet_load(
    stream: &mut tonic::Streaming<pb::SyncMessage>,
) -> anyhow::Result<std::collections::BTreeMap<String, u32>> {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
        if let Some(pb::sync_message::Message::FleetLoad(fleet)) = message.message {
            return Ok(fleet
                .loads
                .into_iter()
                .map(|load| (load.instance_id, load.in_flight))
                .collect());
        }
    }
}

/// Reads `stream` until it has been sent instances `ids` of endpoint `chat`: from then on the
/// replica behind it knows them and takes load reports about them (it drops figures for
/// instances it does not know).
async fn until_known(
    stream: &mut tonic::Streaming<pb::SyncMessage>,
    ids: &[&str],
) -> anyhow::Result<()> {
    Follower::default()
        .follow_until(stream, Duration::from_secs(10), |known| {
            ids.iter().all(|id| {
                known
                    .instances
                    .contains_key(&("chat".to_owned(), (*id).to_owned()))
            })
        })
        .await
}

#[tokio::test]
async fn a_router_is_never_sent_its_own_load_as_someone_elses() -> anyhow::Result<()> {
    // Router a's load on i1 comes and goes between the control plane's ticks; b holds 2 on
    // i2 throughout. Whatever the timing of a's reports against the ticks, a must hear only
    // of b's 2, never of its own requests (it adds those itself). A hub that mixed a tick's
    // totals with a's latest report would send a its own finished requests back.
    let dir = tempfile::tempdir()?;
    let mut config = ControlConfig::embedded(loopback_any(), dir.path().to_path_buf());
    config.load_interval_ms = 20;
    let cp = control_plane(config).await?;
    let mut admin = admin(&cp.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    for id in ["i1", "i2"] {
        register(&mut admin, "chat", id, "http://127.0.0.1:9").await?;
    }
    let (a, mut a_stream) = sync_client(&cp.url(), "router-a").await?;
    let (b, _b_stream) = sync_client(&cp.url(), "router-b").await?;
    until_known(&mut a_stream, &["i1", "i2"]).await?;
    b.send(load_report(&[("i2", 2)])).await?;
    let flipping = tokio::spawn(async move {
        // 100 flips, 7 ms apart: a's report lands at every phase of the 20 ms ticks.
        for flip in 0..100 {
            let report = if flip % 2 == 0 {
                load_report(&[("i1", 10)])
            } else {
                load_report(&[])
            };
            if a.send(report).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(7)).await;
        }
        a
    });
    let mut saw_b = 0;
    while !flipping.is_finished() {
        let figures = next_fleet_load(&mut a_stream).await?;
        assert_eq!(
            figures.get("i1"),
            None,
            "router a was sent its own load: {figures:?}"
        );
        if figures.get("i2") == Some(&2) {
            saw_b += 1;
        }
    }
    drop(flipping.await?);
    assert!(saw_b > 0, "router a never heard of router b's load");
    Ok(())
}

#[tokio::test]
async fn fleet_load_crosses_replicas_and_a_dead_replicas_share_lapses() -> anyhow::Result<()> {
    // Two replicas on one etcd: a router on replica 1 reports load; a router on replica 2 must
    // see it (replica 1 publishes its routers' sum under load/{replica}, replica 2 follows).
    // Replica 1 is a real process, killed with SIGKILL: its share goes with its lease.
    let (_etcd, mut first, second) = etcd_replica_pair("/xload/").await?;
    let mut admin = admin(&second.url()).await?;
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    register(&mut admin, "chat", "i1", "http://127.0.0.1:9").await?;
    let (a, mut a_stream) = sync_client(&first.url(), "router-a").await?;
    let (_b, mut b_stream) = sync_client(&second.url(), "router-b").await?;
    for stream in [&mut a_stream, &mut b_stream] {
        until_known(stream, &["i1"]).await?;
    }
    // Router a keeps reporting (a silent router would be dropped from the sums anyway).
    let reporting = tokio::spawn(async move {
        while a.send(load_report(&[("i1", 3)])).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let figures = next_fleet_load(&mut b_stream).await?;
        if figures.get("i1") == Some(&3) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "router b never saw router a's load through the other replica: {figures:?}"
        );
    }
    first.kill();
    // The dead replica's lease (3 s) lapses; its routers' load must not stay frozen.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let figures = next_fleet_load(&mut b_stream).await?;
        if !figures.contains_key("i1") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a dead replica's load stayed: {figures:?}"
        );
    }
    reporting.abort();
    Ok(())
}

// --- Leader election and fencing on etcd ------------------------------------------------------

#[tokio::test]
async fn a_leader_whose_renewals_stall_steps_down_before_another_takes_over() -> anyhow::Result<()>
{
    // Replica 1 reaches etcd through a relay that the test freezes (a partition between it and
    // etcd; replica 2 still reaches etcd). Replica 1's renewals stop answering: it must step
    // down before its lease lapses and replica 2 takes the key. At no moment may both lead.
    let etcd = Etcd::start().await?;
    let etcd_addr: std::net::SocketAddr = etcd.url.trim_start_matches("http://").parse()?;
    let relay = Relay::start(etcd_addr).await?;
    let first = control_plane(ControlConfig::etcd(
        loopback_any(),
        vec![relay.url()],
        "/stepdown/",
    ))
    .await?;
    wait_leader(&first, Duration::from_secs(10)).await?;
    let second = etcd_control_plane(&etcd, "/stepdown/").await?;
    assert!(first.is_leader() && !second.is_leader());

    relay.freeze();
    let frozen_at = tokio::time::Instant::now();
    let mut stepped_down = None;
    let deadline = frozen_at + Duration::from_secs(15);
    loop {
        let (first_leads, second_leads) = (first.is_leader(), second.is_leader());
        assert!(
            !(first_leads && second_leads),
            "two leaders {:?} after the partition",
            frozen_at.elapsed()
        );
        if !first_leads && stepped_down.is_none() {
            stepped_down = Some(frozen_at.elapsed());
        }
        if second_leads {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replica 2 did not take over"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took_over = frozen_at.elapsed();
    let stepped_down = stepped_down.expect("replica 1 stepped down first");
    // Renewals every ttl/3 (1 s), each allowed ttl/3: replica 1 gives up at most 2 s after
    // its last renewal, while its lease lives 3 s from that renewal.
    assert!(
        stepped_down < took_over,
        "stepped down at {stepped_down:?}, taken over at {took_over:?}"
    );
    relay.thaw();
    // The deposed replica does not take the key back while the new leader renews it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(second.is_leader() && !first.is_leader());
    Ok(())
}

#[tokio::test]
async fn health_writes_are_fenced_by_the_leader_key_on_etcd() -> anyhow::Result<()> {
    // The embedded store's unit test, on a real etcd: a write fenced by a leader-key revision
    // that is no longer current is refused.
    use switchyard_control::keys;
    use switchyard_control::registry::Registry;
    use switchyard_control::store::{Store, Txn};
    use switchyard_shared::{EndpointName, Health, Instance, InstanceId};

    let etcd = Etcd::start().await?;
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(
        EtcdStore::connect(std::slice::from_ref(&etcd.url), "/fence/", None).await?,
    );
    let registry = Registry::new(std::sync::Arc::clone(&store));
    let instance: Instance = serde_json::from_value(serde_json::json!({
        "InstanceId": "a", "EndpointName": "chat", "VariantName": "v",
        "Url": "http://127.0.0.1:9", "Weight": 1.0
    }))?;
    let key = keys::instance("chat", "a");
    store
        .commit(Txn::new().put(&key, serde_json::to_vec(&instance)?, 0))
        .await?;
    let put_leader = |replica: &'static str| {
        let store = std::sync::Arc::clone(&store);
        async move {
            store
                .commit(Txn::new().put(keys::LEADER, replica.as_bytes().to_vec(), 0))
                .await
                .map(|revision| revision.expect("an unguarded put commits"))
        }
    };
    let health = || {
        let store = std::sync::Arc::clone(&store);
        let key = key.clone();
        async move {
            let kv = store.get(&key).await?.expect("the instance");
            anyhow::Ok(serde_json::from_slice::<Instance>(&kv.value)?.health)
        }
    };
    let (endpoint, id) = (EndpointName::new("chat")?, InstanceId::new("a")?);

    let first = put_leader("replica-1").await?;
    assert!(
        registry
            .set_health(&endpoint, &id, Health::Healthy, "", first)
            .await?
    );
    assert_eq!(health().await?, Health::Healthy);
    let second = put_leader("replica-2").await?;
    assert!(
        !registry
            .set_health(&endpoint, &id, Health::Unhealthy, "late", first)
            .await?,
        "a deposed leader's write went through"
    );
    assert_eq!(health().await?, Health::Healthy);
    assert!(
        registry
            .set_health(&endpoint, &id, Health::Unhealthy, "current", second)
            .await?
    );
    assert_eq!(health().await?, Health::Unhealthy);
    Ok(())
}

// --- Health transitions ------------------------------------------------------------------------

#[tokio::test]
async fn an_unhealthy_instance_returns_only_after_healthy_threshold_successes() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let (cp, mut admin) = embedded_admin(dir.path()).await?;
    admin
        .create_endpoint_config(config_request_with_health(
            "chat-cfg",
            &variant_json("RANDOM", None),
            switchyard_shared::HealthCheckConfig {
                interval_ms: 100,
                unhealthy_threshold: 2,
                healthy_threshold: 3,
                ..Default::default()
            },
        ))
        .await?;
    admin
        .create_endpoint(pb::CreateEndpointRequest {
            name: "chat".into(),
            endpoint_config_name: "chat-cfg".into(),
        })
        .await?;
    let server = HealthServer::start(true).await?;
    register(&mut admin, "chat", "flaky", &server.url).await?;
    let router = router(&[cp.url()]).await?;
    let routed = || routed_count(&router, "chat") == Some(1);
    eventually(Duration::from_secs(10), "healthy and routed", || {
        let health = first_instance_health(&admin);
        async move { health.await == pb::HealthStatus::Healthy as i32 && routed() }
    })
    .await?;

    server.set_healthy(false);
    eventually(
        Duration::from_secs(10),
        "unhealthy and out of the table",
        || {
            let health = first_instance_health(&admin);
            async move { health.await == pb::HealthStatus::Unhealthy as i32 && !routed() }
        },
    )
    .await?;

    server.set_healthy(true);
    let successes_before = server.successes();
    wait_first_instance_health(&admin, pb::HealthStatus::Healthy, "healthy again").await?;
    // Polled every 20 ms against probes every 100 ms: seen within a probe of the transition.
    let successes = server.successes() - successes_before;
    assert!(
        successes >= 3,
        "healthy again after {successes} successful probes; HealthyThreshold is 3"
    );
    eventually(Duration::from_secs(10), "routed again", || async {
        routed()
    })
    .await?;
    Ok(())
}

// --- The sync stream: nothing missed or repeated ---------------------------------------------

/// What a router following a sync stream knows of the instances, built from the messages as
/// a router builds it, in either protocol; checks that no change is repeated (after a
/// snapshot at version V every change has a version above V, and versions never go down).
/// In protocol 1, where every change comes on its own, it also checks that a removal follows
/// the registration it removes (protocol 2 folds a registration and its removal into one
/// batch, so there a removal of an unknown instance is normal).
#[derive(Debug, Default)]
struct Follower {
    instances: std::collections::BTreeMap<(String, String), String>,
    /// Protocol 2: the snapshot being received (from its `reset` piece to its `complete` one).
    incoming: Option<std::collections::BTreeMap<(String, String), String>>,
    snapshot_version: u64,
    version: u64,
    snapshots: usize,
}

impl Follower {
    fn apply(&mut self, message: pb::SyncMessage) -> anyhow::Result<()> {
        use pb::sync_message::Message;
        let version = message.version;
        match message.message {
            Some(Message::Snapshot(snapshot)) => {
                anyhow::ensure!(
                    version >= self.version,
                    "a snapshot at {version} after version {}",
                    self.version
                );
                self.instances = snapshot
                    .instances
                    .into_iter()
                    .map(|instance| ((instance.endpoint_name, instance.id), instance.url))
                    .collect();
                self.snapshot_version = version;
                self.version = version;
                self.snapshots += 1;
                return Ok(());
            }
            Some(Message::Update(update)) => return self.apply_update(version, update),
            Some(Message::FleetLoad(_) | Message::Placements(_)) | None => return Ok(()),
            Some(Message::InstanceChanged(instance)) => {
                self.instances
                    .insert((instance.endpoint_name, instance.id), instance.url);
            }
            Some(Message::InstanceRemoved(removed)) => {
                let key = (removed.endpoint_name, removed.id);
                anyhow::ensure!(
                    self.instances.remove(&key).is_some(),
                    "{key:?} removed at version {version}, but its registration never arrived"
                );
            }
            Some(Message::EndpointChanged(_) | Message::EndpointRemoved(_)) => {}
        }
        self.check_change(version)
    }

    /// A change (protocol 1) or a batch of changes (protocol 2) at `version`.
    fn check_change(&mut self, version: u64) -> anyhow::Result<()> {
        anyhow::ensure!(
            version > self.snapshot_version && version >= self.version,
            "change at version {version} repeated (snapshot {}, last {})",
            self.snapshot_version,
            self.version
        );
        self.version = version;
        Ok(())
    }

    /// Protocol 2: a piece of a snapshot (the first with `reset`, the last with `complete`)
    /// or a batch of changes (`complete`, without `reset`).
    fn apply_update(&mut self, version: u64, update: pb::StateUpdate) -> anyhow::Result<()> {
        if update.reset {
            anyhow::ensure!(
                version >= self.version,
                "a snapshot at {version} after version {}",
                self.version
            );
            self.incoming = Some(Default::default());
        }
        let in_snapshot = self.incoming.is_some();
        let target = self.incoming.as_mut().unwrap_or(&mut self.instances);
        for endpoint in update.removed_endpoints {
            target.retain(|(name, _), _| *name != endpoint);
        }
        for instance in update.instances {
            target.insert((instance.endpoint_name, instance.id), instance.url);
        }
        for removed in update.removed_instances {
            target.remove(&(removed.endpoint_name, removed.id));
        }
        if !in_snapshot {
            return self.check_change(version);
        }
        if update.complete {
            self.instances = self.incoming.take().unwrap_or_default();
            self.snapshot_version = version;
            self.version = version;
            self.snapshots += 1;
        }
        Ok(())
    }

    /// Reads `stream` until `done` holds of what it knows (at most `limit`).
    async fn follow_until(
        &mut self,
        stream: &mut tonic::Streaming<pb::SyncMessage>,
        limit: Duration,
        done: impl Fn(&Self) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + limit;
        while !done(self) {
            let message = tokio::time::timeout_at(deadline, stream.next())
                .await
                .map_err(|_| anyhow::anyhow!("not done within {limit:?}: {self:?}"))?
                .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
            self.apply(message)?;
        }
        Ok(())
    }
}

/// A raw protocol-2 sync client whose HTTP/2 receive windows are the protocol minimum
/// (64 KiB), so a client that stops reading stops the control plane's sending within about
/// 64 KiB.
async fn small_window_sync_client(url: &str, router_id: &str) -> anyhow::Result<SyncClient> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned())?
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535);
    sync_client_speaking(endpoint, router_id, 2).await
}

/// An instance record of endpoint `chat` whose URL is about `url_bytes` long.
fn instance_record(id: &str, url_bytes: usize) -> anyhow::Result<Vec<u8>> {
    let base = "http://127.0.0.1:9/";
    let url = format!("{base}{}", "p".repeat(url_bytes.saturating_sub(base.len())));
    let instance: switchyard_shared::Instance = serde_json::from_value(serde_json::json!({
        "InstanceId": id, "EndpointName": "chat", "VariantName": "AllTraffic",
        "Url": url, "Weight": 1.0
    }))?;
    Ok(serde_json::to_vec(&instance)?)
}

#[tokio::test]
async fn a_sync_stream_that_falls_behind_gets_a_fresh_snapshot() -> anyhow::Result<()> {
    use switchyard_control::keys;
    use switchyard_control::store::{Store, Txn};
    const TRANSACTIONS: usize = 60;
    const PER_TRANSACTION: usize = 50;
    const INSTANCES: usize = TRANSACTIONS * PER_TRANSACTION;
    // A stream falls behind once it has not taken 16,384 published batches (one per store
    // transaction; a stream folds whatever is waiting into one batch whenever it sends). This
    // control plane keeps 16, so that 60 transactions are plenty.
    const CHANGE_BUFFER: usize = 16;
    let etcd = Etcd::start().await?;
    let mut config = ControlConfig::etcd(loopback_any(), vec![etcd.url.clone()], "/lag/");
    config.change_buffer = CHANGE_BUFFER;
    let cp = control_plane(config).await?;
    create_endpoint(
        &mut admin(&cp.url()).await?,
        "chat",
        &variant_json("RANDOM", None),
    )
    .await?;
    // Two followers speaking the routers' protocol: one reads as fast as it can, the other
    // stops reading after its snapshot.
    let reading_endpoint = tonic::transport::Endpoint::from_shared(cp.url())?;
    let (_keep, mut reading) = sync_client_speaking(reading_endpoint, "reading", 2).await?;
    let (_keep_stalled, mut stalled) = small_window_sync_client(&cp.url(), "stalled").await?;
    let mut laggard = Follower::default();
    laggard
        .follow_until(&mut stalled, Duration::from_secs(10), |f| f.snapshots == 1)
        .await?;
    let all = |follower: &Follower| follower.instances.len() == INSTANCES;
    let reader = tokio::spawn(async move {
        let mut reader = Follower::default();
        reader
            .follow_until(&mut reading, Duration::from_secs(60), all)
            .await
            .map(|()| reader)
    });
    // 60 transactions of 50 instances with 300-byte URLs, about 18 KiB of records each: the
    // first few fill the stalled stream's 64 KiB window (and what gRPC buffers before it),
    // and the rest are far more than the 16 batches it may fall behind. The reading stream
    // takes each batch as it comes (and has a 2 MiB window), so it never falls behind.
    let store = EtcdStore::connect(std::slice::from_ref(&etcd.url), "/lag/", None).await?;
    for batch in 0..TRANSACTIONS {
        let mut txn = Txn::new();
        for index in 0..PER_TRANSACTION {
            let id = format!("i-{:04}", batch * PER_TRANSACTION + index);
            txn = txn.put(keys::instance("chat", &id), instance_record(&id, 300)?, 0);
        }
        store.commit(txn).await?;
    }
    let reader = reader.await??;
    laggard
        .follow_until(&mut stalled, Duration::from_secs(30), all)
        .await?;
    assert!(
        laggard.snapshots >= 2,
        "the stalled stream caught up without a fresh snapshot: it cannot have fallen behind"
    );
    assert!(
        cp.sync_stats()
            .fell_behind
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1,
        "the control plane did not count a stream falling behind"
    );
    assert_eq!(reader.snapshots, 1, "the reading stream never fell behind");
    assert_eq!(laggard.instances, reader.instances);
    Ok(())
}

#[tokio::test]
async fn concurrent_writers_on_two_replicas_miss_or_repeat_no_change() -> anyhow::Result<()> {
    // Four writers register and deregister instances through two replicas on one etcd (and
    // the leader's probes of their dead URLs write health changes) while twelve followers join
    // at different moments, on either replica. An id is registered once and deregistered at
    // most once, so a missed change cannot be covered up by a later one: a missed registration
    // shows as a removal of an unknown instance or a missing instance at the end, a missed
    // removal as an extra one; a repeated change shows as a version at or below the snapshot's.
    // The replicas are real processes: their watch applies changes on one thread while a
    // stream subscribes on another, as in production (in this test's single-threaded runtime
    // the two could never interleave).
    let etcd = Etcd::start().await?;
    let replicas = [
        etcd_control_process(&etcd, "/writers/")?,
        etcd_control_process(&etcd, "/writers/")?,
    ];
    let urls: Vec<String> = replicas.iter().map(Process::url).collect();
    create_endpoint(
        &mut admin(&urls[0]).await?,
        "chat",
        &variant_json("RANDOM", None),
    )
    .await?;
    const WRITES: usize = 4 * 40;
    const FOLLOWERS: usize = 12;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut writers = Vec::new();
    for writer in 0..4u64 {
        let url = urls[writer as usize % 2].clone();
        let done = std::sync::Arc::clone(&done);
        writers.push(tokio::spawn(async move {
            let mut admin = admin(&url).await?;
            let mut random = fastrand::Rng::with_seed(writer);
            let mut present = Vec::new();
            for write in 0..WRITES / 4 {
                if !present.is_empty() && random.bool() {
                    let id: String = present.swap_remove(random.usize(..present.len()));
                    // A health write landing between the deregistration's read and its delete
                    // makes it refuse (ABORTED, nothing deleted); a client tries again.
                    let mut attempts = 0;
                    loop {
                        let deregistered = admin
                            .deregister_instance(pb::DeregisterInstanceRequest {
                                endpoint_name: "chat".into(),
                                id: id.clone(),
                            })
                            .await;
                        match deregistered {
                            Err(status) if status.code() == Code::Aborted && attempts < 10 => {
                                attempts += 1;
                            }
                            other => {
                                other?;
                                break;
                            }
                        }
                    }
                } else {
                    let id = format!("w{writer}-{write}");
                    register(
                        &mut admin,
                        "chat",
                        &id,
                        // Ports 1-4 (an instance URL may not name port 0).
                        &format!("http://127.0.0.1:{}", writer + 1),
                    )
                    .await?;
                    present.push(id);
                }
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let mut followers = Vec::new();
    for follower in 0..FOLLOWERS {
        let url = urls[follower % 2].clone();
        let done = std::sync::Arc::clone(&done);
        followers.push(tokio::spawn(async move {
            // Join after 0, 12, 24, ... of the 160 writes.
            eventually(Duration::from_secs(30), "writes to progress", || async {
                done.load(std::sync::atomic::Ordering::Relaxed) >= follower * WRITES / 13
            })
            .await?;
            // Both protocols on both replicas: 1 (each change on its own, so a removal must
            // follow its registration) and 2 (batches and pieces, as routers speak it).
            let protocol = if (follower / 2) % 2 == 0 { 0 } else { 2 };
            let (_keep, mut stream) = sync_client_speaking(
                tonic::transport::Endpoint::from_shared(url)?,
                &format!("follower-{follower}"),
                protocol,
            )
            .await?;
            let mut known = Follower::default();
            known
                .follow_until(&mut stream, Duration::from_secs(60), |known| {
                    known
                        .instances
                        .contains_key(&("chat".to_owned(), "marker".to_owned()))
                })
                .await?;
            anyhow::Ok(known)
        }));
    }
    for writer in writers {
        writer.await??;
    }
    let mut admin = admin(&urls[1]).await?;
    register(&mut admin, "chat", "marker", "http://127.0.0.1:9").await?;
    let truth: std::collections::BTreeSet<String> = listed_instances(&mut admin, "chat")
        .await?
        .into_iter()
        .collect();
    for (index, follower) in followers.into_iter().enumerate() {
        let known = follower
            .await?
            .map_err(|err| anyhow::anyhow!("follower {index}: {err:#}"))?;
        let ids: std::collections::BTreeSet<String> =
            known.instances.keys().map(|(_, id)| id.clone()).collect();
        assert_eq!(ids, truth, "follower {index} disagrees with the store");
    }
    Ok(())
}

#[tokio::test]
async fn routers_sync_over_tls() -> anyhow::Result<()> {
    let pki = TestPki::generate()?;
    let dir = tempfile::tempdir()?;
    let mut config = ControlConfig::embedded(loopback_any(), dir.path().join("data"));
    config.tls_cert = Some(pki.server_cert.clone());
    config.tls_key = Some(pki.server_key.clone());
    let cp = control_plane(config).await?;
    let url = format!("https://{}", cp.addr);
    let tls_channel = |ca: &std::path::Path| -> anyhow::Result<tonic::transport::Endpoint> {
        Ok(tonic::transport::Endpoint::from_shared(url.clone())?
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(ca)?)),
            )?
            .connect_timeout(Duration::from_secs(5)))
    };
    let mut admin = pb::admin_client::AdminClient::new(tls_channel(&pki.ca)?.connect().await?);
    create_endpoint(&mut admin, "chat", &variant_json("RANDOM", None)).await?;
    let engine = switchyard_engine_sim::spawn(switchyard_engine_sim::SimConfig {
        time_scale: 0.02,
        ..Default::default()
    })
    .await?;
    register(&mut admin, "chat", "engine-0", &engine.url).await?;

    let mut trusting =
        switchyard_router::RouterConfig::with_control_plane(loopback_any(), vec![url.clone()]);
    trusting.tls_ca = Some(pki.ca.clone());
    let router = router_with(trusting).await?;
    eventually(
        Duration::from_secs(10),
        "the router to sync over TLS",
        || async { routed_count(&router, "chat") == Some(1) },
    )
    .await?;
    let reply = http_post(&chat_url(&router), &[], chat_body("over TLS", 1, false)).await?;
    assert_eq!(reply.status, 200, "{}", reply.body);

    // The stream really is TLS: a client trusting another CA is refused the handshake.
    let other = TestPki::generate()?;
    let refused = tls_channel(&other.ca)?.connect().await;
    let err = refused
        .map(|_| ())
        .expect_err("a client trusting another CA connected");
    assert!(
        format!("{err:?}").contains("InvalidCertificate"),
        "not a certificate refusal: {err:?}"
    );
    Ok(())
}

// --- The embedded store on disk ---------------------------------------------------------------

/// A system call of the embedded store on its files, as `strace -f -y` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreCall {
    /// A write to `wal.jsonl` (a commit's log line, or part of it).
    LogWrite,
    /// fsync or fdatasync of `wal.jsonl`.
    LogSync,
    /// ftruncate of `wal.jsonl` (the log emptied once the state holds it).
    LogTruncate,
    /// Creation of `state.json.tmp`.
    StateCreate,
    StateWrite,
    StateSync,
    /// `state.json.tmp` renamed over `state.json`.
    Rename,
    /// fsync of the data directory.
    DirectorySync,
}

/// What a line of `strace -f -y` output says the embedded store in `data` did: (thread id,
/// call), or `None` for anything else. A call another thread interrupted is shown as
/// `NAME(ARGS <unfinished ...>` and counted there; its `<... NAME resumed>` line is not.
fn store_call<'a>(line: &'a str, data: &str) -> Option<(&'a str, StoreCall)> {
    // "PID call(...)", the thread id padded with spaces when it is short.
    let (thread, call) = line.split_once(' ')?;
    let (name, args) = call.trim_start().split_once('(')?;
    // The first argument: a descriptor decorated with its path, "7</dir/wal.jsonl>".
    let fd_path = args
        .trim_start_matches(|c: char| c.is_ascii_digit())
        .strip_prefix('<')
        .and_then(|rest| rest.split_once('>'))
        .map(|(path, _)| path);
    let log = format!("{data}/wal.jsonl");
    let temporary = format!("{data}/state.json.tmp");
    let call = match (name, fd_path) {
        ("write" | "pwrite64" | "writev", Some(path)) if path == log => StoreCall::LogWrite,
        ("fsync" | "fdatasync", Some(path)) if path == log => StoreCall::LogSync,
        ("ftruncate", Some(path)) if path == log => StoreCall::LogTruncate,
        ("write" | "pwrite64" | "writev", Some(path)) if path == temporary => StoreCall::StateWrite,
        ("fsync" | "fdatasync", Some(path)) if path == temporary => StoreCall::StateSync,
        ("fsync", Some(path)) if path == data => StoreCall::DirectorySync,
        ("openat", _) if args.contains(&format!("\"{temporary}\"")) => StoreCall::StateCreate,
        ("rename" | "renameat" | "renameat2", _)
            if args.contains(&format!("\"{temporary}\""))
                && args.contains(&format!("\"{data}/state.json\"")) =>
        {
            StoreCall::Rename
        }
        _ => return None,
    };
    Some((thread, call))
}

#[test]
fn strace_lines_are_read_whatever_the_width_of_the_thread_id() {
    let data = "/tmp/d";
    for (line, expected) in [
        (
            r#"432   write(12</tmp/d/wal.jsonl>, "{\"revision\":7"..., 677) = 677"#,
            Some(("432", StoreCall::LogWrite)),
        ),
        (
            "14911 fdatasync(12</tmp/d/wal.jsonl>) = 0",
            Some(("14911", StoreCall::LogSync)),
        ),
        (
            "7 fdatasync(12</tmp/d/wal.jsonl> <unfinished ...>",
            Some(("7", StoreCall::LogSync)),
        ),
        ("7     <... fdatasync resumed>) = 0", None),
        (
            r#"14911 openat(AT_FDCWD</x>, "/tmp/d/state.json.tmp", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0666) = 13</tmp/d/state.json.tmp>"#,
            Some(("14911", StoreCall::StateCreate)),
        ),
        (
            r#"432   write(13</tmp/d/state.json.tmp>, "{"..., 4194304) = 4194304"#,
            Some(("432", StoreCall::StateWrite)),
        ),
        (
            "432   fsync(13</tmp/d/state.json.tmp>) = 0",
            Some(("432", StoreCall::StateSync)),
        ),
        (
            r#"7     rename("/tmp/d/state.json.tmp", "/tmp/d/state.json") = 0"#,
            Some(("7", StoreCall::Rename)),
        ),
        (
            "432   fsync(14</tmp/d>)        = 0",
            Some(("432", StoreCall::DirectorySync)),
        ),
        (
            "432   ftruncate(12</tmp/d/wal.jsonl>, 0) = 0",
            Some(("432", StoreCall::LogTruncate)),
        ),
        (
            "432   fsync(12</tmp/d/wal.jsonl>) = 0",
            Some(("432", StoreCall::LogSync)),
        ),
        (
            r#"432   write(4<anon_inode:[eventfd]>, "\1\0", 8) = 8"#,
            None,
        ),
        ("432   fsync(9</tmp/d/LOCK>) = 0", None),
        ("432   fsync(9</tmp/dd>) = 0", None),
    ] {
        assert_eq!(store_call(line, data), expected, "{line}");
    }
}

/// Checks the order of the embedded store's calls on its files, as traced: each write to the
/// log (one per commit) is followed by a sync of the log, and each compaction creates,
/// writes and syncs the temporary state, renames it over `state.json`, syncs the directory,
/// and only then empties the log and syncs it. The trace may begin in the middle of a commit
/// (strace attached while it ran) and end in the middle of one (the SIGKILL). Returns (log
/// syncs after a write, compactions).
fn check_store_calls(calls: &[StoreCall]) -> Result<(usize, usize), String> {
    use StoreCall::*;
    let mut log_syncs = 0;
    let mut compactions = 0;
    let mut index = calls
        .iter()
        .position(|call| matches!(call, LogWrite | StateCreate))
        .unwrap_or(calls.len());
    // Each step must be the expected one, or the end of the trace.
    let expect = |at: usize, step: StoreCall, what: &str| match calls.get(at) {
        Some(call) if *call == step => Ok(true),
        None => Ok(false),
        Some(other) => Err(format!(
            "call {at}: {what} did {other:?} where {step:?} was due"
        )),
    };
    while index < calls.len() {
        match calls[index] {
            LogWrite => {
                if !expect(index + 1, LogSync, "a commit")? {
                    break;
                }
                log_syncs += 1;
                index += 2;
            }
            StateCreate => {
                let mut next = index + 1;
                if !expect(next, StateWrite, "a compaction")? {
                    break;
                }
                while calls.get(next) == Some(&StateWrite) {
                    next += 1;
                }
                let mut complete = true;
                for step in [StateSync, Rename, DirectorySync, LogTruncate, LogSync] {
                    if !expect(next, step, "a compaction")? {
                        complete = false;
                        break;
                    }
                    next += 1;
                }
                compactions += usize::from(complete);
                index = next;
            }
            other => {
                return Err(format!(
                    "call {index}: {other:?} outside a commit or a compaction"
                ));
            }
        }
    }
    Ok((log_syncs, compactions))
}

#[test]
fn the_store_call_checker_refuses_each_missing_or_misplaced_step() {
    use StoreCall::*;
    let commit = [LogWrite, LogSync];
    let compaction = [
        StateCreate,
        StateWrite,
        StateWrite,
        StateSync,
        Rename,
        DirectorySync,
        LogTruncate,
        LogSync,
    ];
    // Calls 0-3 two commits, 4-11 a compaction, 12-13 a commit, 14 a commit cut short.
    let good: Vec<StoreCall> = [&commit[..], &commit, &compaction, &commit, &[LogWrite]].concat();
    assert_eq!(check_store_calls(&good), Ok((3, 1)));
    // Traced from the middle of a commit; killed in the middle of a compaction.
    let partial = [&[LogSync][..], &commit, &compaction[..4]].concat();
    assert_eq!(check_store_calls(&partial), Ok((1, 0)));
    let broken = |edit: &dyn Fn(&mut Vec<StoreCall>)| {
        let mut calls = good.clone();
        edit(&mut calls);
        check_store_calls(&calls)
    };
    // A commit without a sync of the log.
    assert!(
        broken(&|calls| {
            calls.remove(1);
        })
        .is_err()
    );
    // Each step of the compaction after its writes left out, in turn.
    for step in 7..=11 {
        assert!(
            broken(&|calls| {
                calls.remove(step);
            })
            .is_err(),
            "{step}"
        );
    }
    // No write of the state at all.
    assert!(broken(&|calls| calls.retain(|call| *call != StateWrite)).is_err());
    // The rename before the sync of the state; the log emptied before the rename.
    assert!(broken(&|calls| calls.swap(7, 8)).is_err());
    assert!(broken(&|calls| calls.swap(8, 10)).is_err());
}

/// Threads of process `pid` not traced yet (TracerPid 0 in /proc/PID/task/*/status).
fn untraced_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|task| {
                    std::fs::read_to_string(task.path().join("status"))
                        .is_ok_and(|status| status.contains("TracerPid:\t0\n"))
                })
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn the_embedded_store_syncs_its_log_and_compacts_in_order_and_survives_sigkill()
-> anyhow::Result<()> {
    // No crash on one machine can expose a missing fsync (the page cache survives a killed
    // process), so the order of the system calls is read with strace (Debian's `strace`,
    // installed by scripts/ensure-deps) on a real `switchyard-control` process: every commit
    // appends its line to wal.jsonl and syncs it; once the log outgrows the state (and
    // 4 MiB), a compaction writes the state to a temporary file, syncs it, renames it over
    // state.json, syncs the directory, and only then empties the log and syncs it. Then the
    // process is killed with SIGKILL and a new one finds every acknowledged write.
    let strace = std::process::Command::new("strace").arg("-V").output();
    assert!(
        strace.is_ok_and(|output| output.status.success()),
        "strace is not installed: run scripts/test (it installs it) or apt-get install strace"
    );
    let dir = tempfile::tempdir()?;
    let data_dir = dir.path().canonicalize()?;
    let data = data_dir.to_str().expect("utf-8 path").to_owned();
    let mut control = control_process(&["--data-dir", &data])?;
    let trace_dir = tempfile::tempdir()?;
    let log = trace_dir.path().join("strace.log");
    let mut tracer = std::process::Command::new("strace")
        .args(["-f", "-qq", "-y", "-e"])
        .arg("trace=openat,write,pwrite64,writev,ftruncate,fsync,fdatasync,rename,renameat,renameat2")
        .arg("-o")
        .arg(&log)
        .arg("-p")
        .arg(control.pid().to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let pid = control.pid();
    eventually(
        Duration::from_secs(10),
        "strace to attach to every thread",
        || async { untraced_threads(pid) == 0 },
    )
    .await?;

    let mut admin = admin(&control.url()).await?;
    populate(&mut admin).await?;
    // 2,400 instances with 2,000-byte URLs, over 4 MiB of log lines, on an endpoint whose
    // instances are probed once an hour (no health writes): at least one compaction.
    create_quiet_endpoint(&mut admin, "bulk").await?;
    let long_path = "p".repeat(2000 - "http://127.0.0.1:9/".len() - 5);
    let imported = admin
        .import_instances(pb::ImportInstancesRequest {
            instances: (0..2400)
                .map(|index| pb::RegisterInstanceRequest {
                    endpoint_name: "bulk".into(),
                    variant_name: "AllTraffic".into(),
                    url: format!("http://127.0.0.1:9/{long_path}{index:05}"),
                    id: format!("b-{index}"),
                    ..Default::default()
                })
                .collect(),
            dry_run: false,
        })
        .await?
        .into_inner();
    assert_eq!(imported.imported, 2400);
    // populate's 4 writes, the bulk endpoint's 2 and the import's transactions.
    let acknowledged = 6 + imported.transactions as usize;
    control.kill();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while tracer.try_wait()?.is_none() {
        assert!(std::time::Instant::now() < deadline, "strace did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let trace = std::fs::read_to_string(&log)?;
    // Commits are serialised by the store's writer lock (on whichever blocking thread), so
    // the trace's order is their order.
    let calls: Vec<StoreCall> = trace
        .lines()
        .filter_map(|line| store_call(line, &data).map(|(_, call)| call))
        .collect();
    let (log_syncs, compactions) = check_store_calls(&calls).map_err(|err| {
        let traced: Vec<&str> = trace
            .lines()
            .filter(|line| store_call(line, &data).is_some())
            .collect();
        anyhow::anyhow!("{err}\n{}", traced.join("\n"))
    })?;
    assert!(
        log_syncs >= acknowledged,
        "{log_syncs} synced log writes traced for {acknowledged} acknowledged commits"
    );
    assert!(compactions >= 1, "no compaction traced: {calls:?}");

    // SIGKILLed after acknowledging: a new process on the same directory has everything.
    let control = control_process(&["--data-dir", &data])?;
    assert_populated(&control.url()).await?;
    let bulk = switchyard_tests::admin(&control.url())
        .await?
        .max_decoding_message_size(64 << 20)
        .list_instances(pb::ListInstancesRequest {
            endpoint_name: "bulk".into(),
        })
        .await?
        .into_inner()
        .instances;
    assert_eq!(bulk.len(), 2400, "every imported instance is there");
    Ok(())
}
