//! Admission and its accounting, on both engines: one outcome counted per
//! request (`admitted` or `upstream_error`, never both), and a client that
//! leaves while it waits for capacity gives its place in the queue back.

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::net::TcpListener;
use usher_core::clock::Clock;
use usher_proxy::{Http1, Proxy};

use support::upstream::Upstream;

use crate::client::Client;
use crate::{API, BASED, PATIENCE, handoffs, metrics_text, sidecar, sidecar_with, waiters};

// === one outcome per request ===

/// A request the upstream answers counts as `admitted`, one it could not
/// reach as `upstream_error` only, for the route and its resource, on both
/// engines: the counts of `usher_proxy_requests_total` add up to the
/// requests. The native path used to count a failed request as admitted
/// too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_has_one_outcome_on_both_engines() {
    let up = Upstream::start().await;
    let gone = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n  gone: {{ url: \"http://{gone}\" }}\n\
         resources:\n  slots: {{ kind: gauge, capacity: 10 }}\n\
         routes:\n  - {{ name: ok, match: {{ host: {API} }}, upstream: up, resources: [slots] }}\n  \
         - {{ name: down, match: {{ host: {BASED} }}, upstream: gone, resources: [slots] }}\n",
        up.addr
    );
    for engine in [Http1::Native, Http1::Hyper] {
        let side = sidecar(&yaml, engine).await;
        let mut c = Client::connect(side.addr).await;
        for host in [API, BASED, BASED] {
            c.send(format!("GET /x HTTP/1.1\r\nHost: {host}\r\n\r\n")).await;
            let r = c.response(false).await;
            assert_eq!(r.status, if host == API { 200 } else { 502 }, "{engine:?} {host}: {}", r.text());
        }
        let text = metrics_text(&side.proxy);
        let count = |name: &str, labels: &[(&str, &str)]| support::metric(&text, name, labels).unwrap_or(0.0);
        let requests = |route, outcome| count("usher_proxy_requests_total", &[("route", route), ("outcome", outcome)]);
        let got = [
            requests("ok", "admitted"),
            requests("ok", "upstream_error"),
            requests("down", "admitted"),
            requests("down", "upstream_error"),
            count("usher_proxy_resource_requests_total", &[("resource", "slots"), ("outcome", "admitted")]),
        ];
        assert_eq!(got, [1.0, 0.0, 0.0, 2.0, 1.0], "{engine:?}:\n{text}");
        assert_eq!(handoffs(&side.proxy), BTreeMap::new(), "{engine:?}");
    }
}

// === a client leaving while it waits ===

/// A gauge of capacity 1 (`max_wait: 5s`): one request holds it at a gated
/// upstream, a second waits; when the second client closes its socket, its
/// place in the queue is given back at once, well before `max_wait`, and it
/// never reaches the upstream. The same on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_waiting_gives_its_place_back() {
    for engine in [Http1::Native, Http1::Hyper] {
        let up = Upstream::gated().await;
        let yaml = format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  one: {{ kind: gauge, capacity: 1, max_wait: 5s }}\n\
             routes:\n  - {{ name: api, match: {{ host: {API} }}, upstream: up, resources: [one] }}\n",
            up.addr
        );
        let side = sidecar_with(&yaml, engine, Clock::system()).await;
        let p = side.proxy.clone();

        let mut holder = Client::connect(side.addr).await;
        holder.send(format!("GET /held HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
        assert_eventually!(up.stats.in_flight() == 1, PATIENCE, "{engine:?}: the first request holds the permit");

        let mut quitter = Client::connect(side.addr).await;
        quitter.send(format!("GET /waits HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
        assert_eventually!(waiters(&p, "one") == 1, PATIENCE, "{engine:?}: the second request waits");
        let metric = |p: &Proxy| support::metric(&metrics_text(p), "usher_proxy_waiters", &[("resource", "one")]);
        assert_eq!(metric(&p), Some(1.0), "{engine:?}");

        let left = std::time::Instant::now();
        drop(quitter);
        assert_eventually!(
            waiters(&p, "one") == 0,
            Duration::from_secs(2),
            "{engine:?}: the waiter left the queue with its client"
        );
        assert!(left.elapsed() < Duration::from_secs(2), "{engine:?}: well before max_wait (5 s)");
        assert_eq!(metric(&p), Some(0.0), "{engine:?}");

        up.gate.add_permits(1);
        let r = holder.response(false).await;
        assert_eq!((r.status, r.text().as_str()), (200, "ok"), "{engine:?}");
        // The permit is free again: the next request is admitted at once.
        up.gate.add_permits(1);
        holder.send(format!("GET /next HTTP/1.1\r\nHost: {API}\r\n\r\n")).await;
        assert_eq!(holder.response(false).await.status, 200, "{engine:?}");
        assert_eq!(up.stats.requests(), 2, "{engine:?}: the request that left never reached the upstream");
        assert_eq!(handoffs(&p), BTreeMap::new(), "{engine:?}");
    }
}
