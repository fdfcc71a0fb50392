//! Topology through the controller's real gRPC service (issue 12 item 4): CreateVolume places a
//! volume only on an agent reachable from a requisite topology, most preferred first, and
//! reports the volume's topology; GetCapacity answers per topology segment.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::{BTreeMap, HashMap};

use pillar_csi::csi;
use pillar_state::crd::PillarAgentSpec;
use pillar_state::store::Revision;
use support::{AGENT, Env, Mode, StoreKind, create};
use tonic::Code;

const ZONE: &str = "topology.pillar-csi.io/zone";
const NODE_KEY: &str = "pillar.io/node";

fn segments(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn node_in(zone: &str) -> csi::Topology {
    csi::Topology {
        segments: segments(&[(ZONE, zone), (NODE_KEY, &format!("node-{zone}"))]),
    }
}

fn wanting(
    name: &str,
    requisite: Vec<csi::Topology>,
    preferred: Vec<csi::Topology>,
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        accessibility_requirements: Some(csi::TopologyRequirement {
            requisite,
            preferred,
        }),
        ..create(name, Mode::SingleNodeWriter)
    }
}

/// The test agent in zone a, and a second PillarAgent record in zone b (the same agent
/// process: placement is the controller's decision, the agent does not know its name).
async fn two_zones(env: &Env) {
    let a = env.store.get_agent(AGENT).await.unwrap().unwrap();
    let mut spec = a.spec.clone();
    spec.topology = BTreeMap::from([(ZONE.to_owned(), "zone-a".to_owned())]);
    env.store
        .replace_agent_spec(AGENT, &Revision::of(&a).unwrap(), spec.clone())
        .await
        .unwrap();
    let b = PillarAgentSpec {
        node: "storage-2".into(),
        topology: BTreeMap::from([(ZONE.to_owned(), "zone-b".to_owned())]),
        ..spec
    };
    env.store.create_agent("storage-2", b).await.unwrap();
}

fn zone_of(v: &csi::Volume) -> Vec<HashMap<String, String>> {
    v.accessible_topology
        .iter()
        .map(|t| t.segments.clone())
        .collect()
}

// proves issue 12 item 4: a volume is never placed where the requesting node cannot reach it
#[tokio::test]
async fn a_volume_is_placed_only_where_its_node_can_reach_it() {
    for kind in [StoreKind::Embedded, StoreKind::Kube] {
        let mut env = Env::start(kind, true).await;
        two_zones(&env).await;
        let c = &mut env.client;

        // Requisite zone b: the zone-b agent, and the volume says so.
        let v = c
            .create_volume(wanting("in-b", vec![node_in("zone-b")], vec![]))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(zone_of(&v), [segments(&[(ZONE, "zone-b")])]);
        let rec = env.store.get_volume("in-b").await.unwrap().unwrap();
        assert_eq!(rec.spec.agent, "storage-2");

        // Either zone is allowed; zone a is preferred.
        let c = &mut env.client;
        let v = c
            .create_volume(wanting(
                "pref-a",
                vec![node_in("zone-b"), node_in("zone-a")],
                vec![node_in("zone-a"), node_in("zone-b")],
            ))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(zone_of(&v), [segments(&[(ZONE, "zone-a")])]);

        // Nobody in zone c: RESOURCE_EXHAUSTED and no record.
        let s = c
            .create_volume(wanting("in-c", vec![node_in("zone-c")], vec![]))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::ResourceExhausted, "{}", s.message());
        assert!(env.store.get_volume("in-c").await.unwrap().is_none());
        // A node that reports no zone reaches neither zoned agent.
        let c = &mut env.client;
        let s = c
            .create_volume(wanting(
                "no-zone",
                vec![csi::Topology {
                    segments: segments(&[(NODE_KEY, "node-x")]),
                }],
                vec![],
            ))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::ResourceExhausted, "{}", s.message());
        // The StorageClass names the zone-a agent, the node is in zone b: refused.
        let mut named = wanting("named", vec![node_in("zone-b")], vec![]);
        named
            .parameters
            .insert(pillar_csi::controller::params::AGENT.into(), AGENT.into());
        let s = c.create_volume(named).await.unwrap_err();
        assert_eq!(s.code(), Code::ResourceExhausted, "{}", s.message());
        // A clone stays with its source: refused for a node in the other zone.
        let mut clone = wanting("clone-to-a", vec![node_in("zone-a")], vec![]);
        clone.volume_content_source = Some(csi::VolumeContentSource {
            r#type: Some(csi::volume_content_source::Type::Volume(
                csi::volume_content_source::VolumeSource {
                    volume_id: "in-b".into(),
                },
            )),
        });
        let s = c.create_volume(clone).await.unwrap_err();
        assert_eq!(s.code(), Code::ResourceExhausted, "{}", s.message());

        // ListVolumes and ControllerGetVolume report where each volume is reachable from.
        let listed = c
            .list_volumes(csi::ListVolumesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let zones: Vec<(String, Vec<HashMap<String, String>>)> = listed
            .entries
            .iter()
            .map(|e| {
                let v = e.volume.as_ref().unwrap();
                (v.volume_id.clone(), zone_of(v))
            })
            .collect();
        assert_eq!(
            zones,
            [
                ("in-b".to_owned(), vec![segments(&[(ZONE, "zone-b")])]),
                ("pref-a".to_owned(), vec![segments(&[(ZONE, "zone-a")])]),
            ]
        );
    }
}

// proves issue 12 item 4: GetCapacity per topology segment counts only the agents reachable
// from it (the external-provisioner's storage capacity tracking)
#[tokio::test]
async fn capacity_is_answered_per_topology_segment() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    let capacity = |env: &mut Env, topology: Option<csi::Topology>| {
        let mut c = env.client.clone();
        async move {
            c.get_capacity(csi::GetCapacityRequest {
                accessible_topology: topology,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .available_capacity
        }
    };
    let one = capacity(&mut env, None).await;
    assert!(one > 0);
    two_zones(&env).await;
    // Both records reach the same pool: the whole is counted twice, each zone once.
    let all = capacity(&mut env, None).await;
    let a = capacity(&mut env, Some(node_in("zone-a"))).await;
    let b = capacity(&mut env, Some(node_in("zone-b"))).await;
    let c = capacity(&mut env, Some(node_in("zone-c"))).await;
    // The pool is a directory of the machine's disk: other tests change its free space, so
    // compare within 64 MiB.
    let close = |x: i64, y: i64| (x - y).abs() < 64 << 20;
    assert!(close(all, 2 * one), "{all} vs 2 x {one}");
    assert!(close(a, one) && close(b, one), "{a} {b} vs {one}");
    assert_eq!(c, 0);
}

// Issue 22, defect 13: a StorageClass that names only `pillar.io/pool` (CreateVolume places it
// by topology among the agents with that pool) gets capacity for each topology segment: the
// agents reachable from the segment that have the pool, summed; a segment without one has
// none, and so does a pool no agent has. On the old code GetCapacity answered
// INVALID_ARGUMENT ("2 agents exist; name one"), and capacity tracking got nothing.
#[tokio::test]
async fn capacity_of_a_pool_named_alone_is_answered_per_topology_segment() {
    let mut env = Env::start(StoreKind::Embedded, true).await;
    let capacity = |env: &mut Env, pool: &str, topology: Option<csi::Topology>| {
        let mut c = env.client.clone();
        let parameters = HashMap::from([("pillar.io/pool".to_owned(), pool.to_owned())]);
        async move {
            c.get_capacity(csi::GetCapacityRequest {
                accessible_topology: topology,
                parameters,
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().available_capacity)
        }
    };
    let one = capacity(&mut env, "p1", None).await.unwrap();
    assert!(one > 0);
    two_zones(&env).await;
    let all = capacity(&mut env, "p1", None).await.unwrap();
    let a = capacity(&mut env, "p1", Some(node_in("zone-a")))
        .await
        .unwrap();
    let b = capacity(&mut env, "p1", Some(node_in("zone-b")))
        .await
        .unwrap();
    let c = capacity(&mut env, "p1", Some(node_in("zone-c")))
        .await
        .unwrap();
    let close = |x: i64, y: i64| (x - y).abs() < 64 << 20;
    assert!(close(all, 2 * one), "{all} vs 2 x {one}");
    assert!(close(a, one) && close(b, one), "{a} {b} vs {one}");
    assert_eq!(c, 0);
    assert_eq!(
        capacity(&mut env, "no-such-pool", Some(node_in("zone-a")))
            .await
            .unwrap(),
        0
    );
    // CreateVolume with the same parameters places by topology: the capacity counted for a
    // segment is the capacity of where a volume for it goes.
    let mut req = wanting("pool-only", vec![node_in("zone-b")], vec![]);
    req.parameters = HashMap::from([("pillar.io/pool".to_owned(), "p1".to_owned())]);
    let created = env.client.create_volume(req).await.unwrap().into_inner();
    assert_eq!(
        zone_of(created.volume.as_ref().unwrap()),
        vec![segments(&[(ZONE, "zone-b")])]
    );
    // Naming an agent still counts that agent's pool alone.
    let mut c2 = env.client.clone();
    let named = c2
        .get_capacity(csi::GetCapacityRequest {
            parameters: HashMap::from([
                ("pillar.io/agent".to_owned(), "storage-2".to_owned()),
                ("pillar.io/pool".to_owned(), "p1".to_owned()),
            ]),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .available_capacity;
    assert!(close(named, one), "{named} vs {one}");
}
