//! Property tests that feed hostile input to every parser and decoder a user
//! or a peer can reach: routes files, resources files, scenarios, and every
//! Doorman message. A failure is a panic (or a hang, bounded by the runner);
//! each input must get either a value or a clear error.

use usher_test_support::edits;

use proptest::prelude::*;
use prost::Message;
use usher::sim::Scenario;
use usher_core::config::resources::ResourcesConfig;
use usher_core::config::routes::RoutesConfig;
use usher_proto as proto;

const ROUTES: &str = include_str!("../deploy/examples/quickstart.yaml");
const RESOURCES: &str = include_str!("../deploy/examples/resources.yaml");
const SCENARIO: &str = include_str!("../deploy/examples/sim/seven.yaml");

/// A valid file with some bytes replaced, inserted or cut: close enough to
/// real input to get deep into the parsers.
fn mutated(base: &'static str) -> impl Strategy<Value = String> {
    use edits::{CUT, INSERT, REPLACE};
    edits::edits(&[REPLACE, INSERT, CUT], 1..12).prop_map(move |e| {
        let mut b = base.as_bytes().to_vec();
        edits::apply(&mut b, &e);
        String::from_utf8_lossy(&b).into_owned()
    })
}

fn yamlish() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just(": ".to_string()),
            Just("\n  ".to_string()),
            Just("- ".to_string()),
            Just("{".to_string()),
            Just("}".to_string()),
            Just("[".to_string()),
            Just("]".to_string()),
            Just("&a ".to_string()),
            Just("*a".to_string()),
            Just("resources".to_string()),
            Just("routes".to_string()),
            Just("capacity".to_string()),
            "[a-z_]{1,8}",
            "[0-9./a-z]{1,6}",
        ],
        0..40,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn routes_files_never_panic(text in prop_oneof![mutated(ROUTES), yamlish()]) {
        if let Err(e) = RoutesConfig::parse("fuzz.yaml", &text) {
            prop_assert!(!e.diagnostics.is_empty());
            prop_assert!(e.to_string().starts_with("fuzz.yaml:"));
        }
    }

    #[test]
    fn resources_files_never_panic(text in prop_oneof![mutated(RESOURCES), yamlish()]) {
        if let Err(e) = ResourcesConfig::parse("fuzz.yaml", &text) {
            prop_assert!(e.to_string().starts_with("fuzz.yaml:"));
        }
    }

    #[test]
    fn scenarios_never_panic(text in prop_oneof![mutated(SCENARIO), yamlish()]) {
        let _ = Scenario::parse("fuzz.yaml", &text);
    }

    #[test]
    fn doorman_messages_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = proto::GetCapacityRequest::decode(bytes.as_slice());
        let _ = proto::GetCapacityResponse::decode(bytes.as_slice());
        let _ = proto::GetServerCapacityRequest::decode(bytes.as_slice());
        let _ = proto::GetServerCapacityResponse::decode(bytes.as_slice());
        let _ = proto::ReleaseCapacityRequest::decode(bytes.as_slice());
        let _ = proto::ReleaseCapacityResponse::decode(bytes.as_slice());
        let _ = proto::DiscoveryResponse::decode(bytes.as_slice());
        let _ = proto::ResourceRepository::decode(bytes.as_slice());
        if let Ok(req) = proto::GetCapacityRequest::decode(bytes.as_slice()) {
            let _ = usher_server::service::client_requests(&req);
        }
        if let Ok(req) = proto::GetServerCapacityRequest::decode(bytes.as_slice()) {
            let _ = usher_server::service::server_requests(&req);
        }
    }

    /// Any request that passes validation can be served without panicking,
    /// and its grants respect capacity.
    #[test]
    fn validated_requests_are_served(
        asks in prop::collection::vec(("[a-c]{1,2}", "[a-c]{1,2}", any::<f64>(), any::<i64>()), 1..20)
    ) {
        let cfg = ResourcesConfig::parse("r", "resources:\n  - identifier_glob: '*'\n    capacity: 10\n    algorithm: { kind: FAIR_SHARE, lease_length: 5, refresh_interval: 5, learning_mode_duration: 0 }\n").unwrap();
        let (clock, _t) = usher_core::clock::Clock::manual(usher_core::clock::Time::from_secs(1000));
        let store = usher_server::Store::new(clock, cfg, std::time::Duration::ZERO);
        for (client, resource, wants, priority) in asks {
            let req = proto::GetCapacityRequest {
                client_id: client.clone(),
                resource: vec![proto::ResourceRequest { unit_account: None, window: None, reserve: None, returned: None, backlog: None, upstream_quota: None, resource_id: resource, priority, has: None, wants }],
            };
            if let Ok(valid) = usher_server::service::client_requests(&req) {
                for a in &valid {
                    let g = store.get_capacity(&client, a);
                    prop_assert!(g.capacity >= 0.0 && g.capacity <= 10.0 + 1e-9, "{g:?}");
                }
            }
        }
        for r in store.status() {
            prop_assert!(r.sum_has <= 10.0 + 1e-6);
        }
    }
}
