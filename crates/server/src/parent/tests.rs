#![allow(clippy::disallowed_methods, reason = "the test bounds a real wait in tokio's time")]

use super::*;
use crate::LocalTransport;
use crate::store::{LeaseRequest, Predecessor, Requester, Role};
use usher_core::config::resources::ResourcesConfig;

const CFG: &str = "resources:\n  - identifier_glob: '*'\n    capacity: 100\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 30, learning_mode_duration: 0 }\n";

fn node(id: &str, clock: &Clock, role: Role) -> Arc<Node> {
    let mut n = Node::new(
        id.into(),
        "test".into(),
        ResourcesConfig::parse("test", CFG).unwrap(),
        clock.clone(),
        Duration::ZERO,
        prometheus::Registry::new(),
    );
    n.store.set_role(role);
    n.store.set_predecessor(Predecessor::NoneOutstanding);
    Arc::new(n)
}

/// 12,000 resources are more than a server takes in one GetServerCapacity
/// (`MAX_RESOURCES_PER_REQUEST`): an intermediate leases them in several
/// calls, and every one gets its lease from the parent.
#[tokio::test]
async fn an_intermediate_leases_more_resources_than_one_call_takes_in_several() {
    let n = 12_000;
    assert!(n > crate::service::MAX_RESOURCES_PER_REQUEST);
    let (clock, _time) = Clock::manual(Time::from_secs(1_700_000_000));
    let root = node("root", &clock, Role::Root);
    let mid = node("mid", &clock, Role::Intermediate { decay_factor: 0.5 });
    for i in 0..n {
        let req = LeaseRequest {
            bucket: Default::default(),
            resource_id: format!("t/{i}"),
            wants: 1.0,
            subclients: 1,
            reported_has: None,
            reported_expiry: None,
            requester: Requester::Client { priority: 0 },
            quota: None,
            account: None,
            window: None,
        };
        mid.store.get_capacity("client", &req);
    }
    let transport = Arc::new(LocalTransport::new());
    transport.add("root", root.clone());
    let link = Arc::new(ParentLink::default());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(run(mid.clone(), link.clone(), vec!["root".into()], transport, clock, shutdown.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let leased = mid.store.status().iter().filter(|r| r.parent_capacity.is_some_and(|c| c > 0.0)).count();
        if leased == n {
            break;
        }
        let st = link.status();
        assert!(
            tokio::time::Instant::now() < deadline,
            "{leased} of {n} resources leased from the parent; last error {:?}",
            st.last_error
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(root.store.status().len(), n, "the parent knows every resource");
    assert!(link.status().last_error.is_none(), "{:?}", link.status().last_error);
    shutdown.cancel();
    task.await.unwrap();
}
