//! Leases and templated keys: the embedded server's lease refreshed rarely
//! and following a reloaded capacity, an idle key (leased or local)
//! forgotten at its timeout, a header that is not UTF-8 making no key, an id
//! that is a placeholder alone, and per-key lease state and transition metrics.

use usher_test_support as support;
use usher_test_support::assert_eventually;

use std::time::Duration;

use http::{Request, StatusCode};

use support::upstream::{self, Upstream, h1, send1};
use support::{Usher, http_get, metric, write_file};

use crate::{replace, start_proxy};

/// The embedded server's lease of `api`: (capacity, refresh interval in seconds).
fn embedded_lease(admin: std::net::SocketAddr) -> Option<(f64, f64)> {
    let (_, body) = http_get(admin, "/debug/status?format=json");
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    let key = v["lease"]["keys"].as_array()?.iter().find(|k| k["resource_id"] == "api")?.clone();
    Some((key["capacity"].as_f64()?, key["refresh_interval_s"].as_f64()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_lease_is_refreshed_rarely_and_follows_a_reloaded_capacity_at_once() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = |capacity: &str| {
        format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  api: {{ kind: rate, capacity: {capacity} }}\n\
             routes:\n  - {{ name: api, upstream: up, resources: [api] }}\n",
            up.addr
        )
    };
    let routes = write_file(dir.path(), "routes.yaml", &file("10/s"));
    let u = start_proxy(&routes);
    let admin = u.addr("admin");
    // The sidecar is its embedded server's only client: it refreshes every
    // hour (an idle sidecar wakes rarely), and asks early when it must.
    assert_eventually!(
        embedded_lease(admin) == Some((10.0, 3600.0)),
        Duration::from_secs(10),
        "{:?}",
        embedded_lease(admin)
    );
    // A raised capacity, with no request at all (no pressure to ask early):
    // leased at once, not at the next refresh.
    replace(&routes, &file("50/s"));
    u.wait_for_log("routes reloaded", Duration::from_secs(20));
    assert_eventually!(
        embedded_lease(admin).is_some_and(|l| l.0 == 50.0),
        Duration::from_secs(5),
        "{:?}",
        embedded_lease(admin)
    );
    // And a lowered one.
    replace(&routes, &file("5/s"));
    assert_eventually!(
        embedded_lease(admin).is_some_and(|l| l.0 == 5.0),
        Duration::from_secs(25),
        "{:?}",
        embedded_lease(admin)
    );
}

/// A templated key nobody uses is forgotten at its `key_idle_timeout`, and
/// its lease released, on a sidecar where nothing else happens (its lease
/// client otherwise sleeps until the next hourly refresh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_key_is_forgotten_at_its_timeout_on_a_quiet_sidecar() {
    idle_key_forgotten(Held::Lease).await;
}

/// The same for a local key (no lease: see `usher_enforce::resource::is_local`):
/// it leaves the table at its timeout, and a tenant that comes back makes
/// a key again, at the routes file's capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_local_key_is_forgotten_at_its_timeout_on_a_quiet_sidecar() {
    idle_key_forgotten(Held::Local).await;
}

/// A sidecar with no `doorman:` section whose one route limits each tenant
/// (`x-tenant`) by the resource `tenant`, written as `spec` (its YAML
/// fields inside the braces).
struct TenantSidecar {
    u: Usher,
    up: Upstream,
    _dir: tempfile::TempDir,
}

impl TenantSidecar {
    async fn start(spec: &str) -> TenantSidecar {
        let up = Upstream::start().await;
        let dir = tempfile::tempdir().unwrap();
        let yaml = format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  tenant: {{ kind: rate, {spec} }}\n\
             routes:\n  - {{ name: api, upstream: up, resources: [tenant] }}\n",
            up.addr
        );
        let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
        TenantSidecar { u, up, _dir: dir }
    }

    /// The ids of the table's keys, as the status page lists them.
    fn keys(&self) -> Vec<String> {
        let (_, body) = http_get(self.u.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let keys = v["keys"].as_array().cloned().unwrap_or_default();
        keys.iter().map(|k| k["id"].as_str().unwrap_or_default().to_string()).collect()
    }

    /// One request from each of `tenants`, one after another on one connection.
    async fn send_all(&self, tenants: &[String]) -> Vec<StatusCode> {
        let mut c = h1(self.u.addr("listen")).await;
        let mut codes = Vec::with_capacity(tenants.len());
        for tenant in tenants {
            let req =
                Request::get("/x").header("host", "app").header("x-tenant", tenant).body(upstream::empty()).unwrap();
            codes.push(send1(&mut c, req).await.status);
        }
        codes
    }

    /// One request of `tenant`'s, on a connection of its own (a kept-alive
    /// one could idle out between requests seconds apart).
    async fn send(&self, tenant: &str) -> upstream::Got {
        let mut c = h1(self.u.addr("listen")).await;
        let req = Request::get("/x").header("host", "app").header("x-tenant", tenant).body(upstream::empty()).unwrap();
        send1(&mut c, req).await
    }
}

/// A local key holds nothing but its bucket: once that is full and the
/// tenant has been away for 10 s, the key is dropped long before its
/// `key_idle_timeout` (5 minutes by default), and its place under
/// `max_keys` goes to a new tenant. A key whose bucket is still filling
/// stays until it is full, and a tenant that comes back is limited as a new
/// one is, since a new key is what it would have been. (Two keys of
/// `max_keys: 2` make the resource crowded, which early forgetting needs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_key_with_a_full_bucket_is_forgotten_after_ten_idle_seconds() {
    let t = TenantSidecar::start("capacity: 6/min, burst: 2, id: \"t/{header.x-tenant}\", max_keys: 2").await;
    let (keys, send) = (|| t.keys(), |tenant| t.send(tenant));
    let start = std::time::Instant::now();
    // `once` spends one unit of two (full again 10 s later), `heavy` both (20 s).
    assert_eq!(send("once").await.status, StatusCode::OK);
    for expect in [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        assert_eq!(send("heavy").await.status, expect);
    }
    let r = send("new").await;
    assert_eq!(r.json()["type"], "urn:usher:problem:too-many-keys", "max_keys is 2: {}", r.text());
    assert_eventually!(keys() == ["t/heavy"], Duration::from_secs(16), "{:?}", keys());
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(10), "`once` forgotten after {took:?}, before it was idle 10 s");
    // `new` spends both units: full 20 s on, it keeps the resource crowded
    // (two keys) until `heavy` is full and gone.
    for expect in [StatusCode::OK, StatusCode::OK] {
        assert_eq!(send("new").await.status, expect, "the place `once` held is free");
    }
    assert!(keys().contains(&"t/heavy".to_string()), "still filling at {:?}: kept", start.elapsed());
    assert_eventually!(!keys().contains(&"t/heavy".to_string()), Duration::from_secs(14), "{:?}", keys());
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(20), "`heavy` forgotten after {took:?}, before its bucket was full");
    // It comes back to a full bucket, as it would have had if kept.
    for expect in [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        assert_eq!(send("heavy").await.status, expect);
    }
}

/// The same with the routes file's defaults (no burst, `max_keys` or
/// `key_idle_timeout` written). A tenant that spent its second's burst
/// keeps its key past 10 s idle while the resource holds few keys (one of
/// the 1,000 `max_keys` allows): when it comes back, its key is there. Once
/// the resource holds more than 500, keys idle for 10 s go, long before
/// the 5-minute timeout, until it holds 500 or fewer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_key_with_defaults_is_kept_and_forgotten_after_ten_idle_seconds_once_crowded() {
    let t = TenantSidecar::start("capacity: 5/s, id: \"t/{header.x-tenant}\"").await;
    let mut refused = 0;
    for _ in 0..8 {
        refused += usize::from(t.send("acme").await.status == StatusCode::TOO_MANY_REQUESTS);
    }
    assert!(refused > 0, "8 at once pass a 5/s key's default burst only in part");
    assert_eq!(t.keys(), ["t/acme"]);
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(t.keys(), ["t/acme"], "one key of 1,000 allowed: kept past 10 s idle");
    // 400 new tenants, and 110 more 2 s later: 510 keys of 1,000 allowed.
    let tenants = |r: std::ops::Range<usize>| r.map(|i| format!("other-{i}")).collect::<Vec<_>>();
    let start = std::time::Instant::now();
    let mut codes = t.send_all(&tenants(0..400)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    codes.extend(t.send_all(&tenants(400..510)).await);
    assert!(codes.iter().all(|c| *c == StatusCode::OK), "each new tenant's first call passes: {codes:?}");
    assert_eventually!(!t.keys().contains(&"t/acme".to_string()), Duration::from_secs(5), "{} keys", t.keys().len());
    assert_eq!(t.keys().len(), 510, "the 510 new keys are not idle yet");
    // Keys of the first 400 go once idle 10 s, until 500 or fewer are left;
    // those left are not crowded and stay, the 110 newest among them.
    assert_eventually!(t.keys().len() <= 500, Duration::from_secs(14), "{} keys", t.keys().len());
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(10), "new keys forgotten after {took:?}, before they idled 10 s");
    let left = t.keys();
    assert!(tenants(400..510).iter().all(|id| left.contains(&format!("t/{id}"))), "the newest are kept");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(t.keys().len(), left.len(), "idle 10 s and more, but no longer crowded: kept");
}

/// Whether a tenant key holds a lease (it asks for less than the capacity)
/// or is local.
#[derive(Clone, Copy, PartialEq)]
enum Held {
    Lease,
    Local,
}

async fn idle_key_forgotten(held: Held) {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let wants = if held == Held::Lease { "wants: 5, " } else { "" };
    let routes = write_file(
        dir.path(),
        "routes.yaml",
        &format!(
            "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
             resources:\n  tenant: {{ kind: rate, capacity: 10/s, {wants}id: \"t/{{header.x-tenant}}\", key_idle_timeout: 2s }}\n\
             routes:\n  - {{ name: api, upstream: up, resources: [tenant] }}\n",
            up.addr
        ),
    );
    let u = start_proxy(&routes);
    // The lease client's keys, or the table's local ones.
    let keys = || {
        let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let (list, field) = match held {
            Held::Lease => (&v["lease"]["keys"], "resource_id"),
            Held::Local => (&v["keys"], "id"),
        };
        let ids: Option<Vec<String>> = list.as_array().map(|k| k.iter().map(|k| k[field].to_string()).collect());
        ids.unwrap_or_default()
    };
    let mut c = h1(u.addr("listen")).await;
    let req = || Request::get("/x").header("host", "app").header("x-tenant", "acme").body(upstream::empty()).unwrap();
    let sent = std::time::Instant::now();
    assert_eq!(send1(&mut c, req()).await.status, StatusCode::OK);
    assert_eventually!(keys() == ["\"t/acme\""], Duration::from_secs(5), "{:?}", keys());
    // Nothing more happens: the key goes at 2 s after its last use (the
    // lease client's reads between then and now end in a quiet wait).
    assert_eventually!(keys().is_empty(), Duration::from_secs(10), "{:?}", keys());
    let took = sent.elapsed();
    assert!(took >= Duration::from_secs(2), "forgotten after {took:?}, before its idle timeout");
    assert_eq!(forgotten_in_summary(&u), 1);
    if held == Held::Local {
        // (On a new connection: the first one may have idled out meanwhile.)
        let mut c = h1(u.addr("listen")).await;
        assert_eq!(send1(&mut c, req()).await.status, StatusCode::OK, "the tenant comes back");
        assert_eq!(keys(), ["\"t/acme\""], "as a new key");
    }
}

/// The `forgotten` count of the sidecar's first `templated keys` line (10 s
/// after its first templated key's event).
fn forgotten_in_summary(u: &Usher) -> u64 {
    u.wait_for_log("templated keys", Duration::from_secs(15));
    let log = u.log();
    let line = log.lines().find(|l| l.contains("templated keys")).expect("the summary");
    support::log_fields(line).get("forgotten").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

/// A header whose value is not UTF-8 makes no lease id: two such values
/// would both become U+FFFD and share one budget. The request gets a 400
/// naming the resource and the header, makes no key, and UTF-8 beyond ASCII
/// is a key as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_that_is_not_utf8_makes_no_key() {
    let t = TenantSidecar::start("capacity: 10/s, burst: 5, id: \"t/{header.x-tenant}\"").await;
    let (up, keys) = (&t.up, || t.keys());
    // Raw bytes on the wire, one request per connection.
    let listen = t.u.addr("listen");
    let send = |tenant: &'static [u8]| async move {
        let mut s = tokio::net::TcpStream::connect(listen).await.unwrap();
        let mut req = b"GET /x HTTP/1.1\r\nHost: app\r\nConnection: close\r\nX-Tenant: ".to_vec();
        req.extend_from_slice(tenant);
        req.extend_from_slice(b"\r\n\r\n");
        tokio::io::AsyncWriteExt::write_all(&mut s, &req).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read_to_end(&mut s, &mut out))
            .await
            .expect("answered")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    };
    for tenant in [&b"\xff"[..], b"ac\xfeme"] {
        let got = send(tenant).await;
        assert!(got.starts_with("HTTP/1.1 400"), "{got}");
        assert!(got.contains("resource `tenant`") && got.contains("`x-tenant` is not UTF-8"), "{got}");
    }
    assert_eq!(up.stats.requests(), 0, "nothing went upstream");
    let got = send("café".as_bytes()).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eventually!(keys() == ["t/café"], Duration::from_secs(5), "{:?}", keys());
}

/// A resource whose id is a placeholder alone (the tenant's name is the
/// key's id) enforces its capacity, not the catch-all's nothing: a local
/// key (no `doorman:` section) holds the routes file's capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_that_is_a_placeholder_alone_enforces_its_capacity() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  tenant: {{ kind: rate, capacity: 10/s, burst: 5, id: \"{{header.x-tenant}}\" }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [tenant] }}\n",
        up.addr
    );
    let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
    let key = || {
        let (_, body) = http_get(u.addr("admin"), "/debug/status?format=json");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let keys = v["keys"].as_array().cloned().unwrap_or_default();
        keys.iter().find(|k| k["id"] == "acme").map(|k| (k["local"].clone(), k["capacity"].clone()))
    };
    let mut c = h1(u.addr("listen")).await;
    let req = || Request::get("/x").header("host", "app").header("x-tenant", "acme").body(upstream::empty()).unwrap();
    assert_eq!(send1(&mut c, req()).await.status, StatusCode::OK);
    assert_eq!(key(), Some((true.into(), 10.0.into())), "local, at the resource's capacity");
    assert_eq!(send1(&mut c, req()).await.status, StatusCode::OK, "and requests pass at it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_keys_lease_state_and_transitions_show_on_every_scrape() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  tenant: {{ kind: rate, capacity: 10/s, wants: 5, id: \"t/{{header.x-tenant}}\", max_keys: 10 }}\n  \
         local: {{ kind: rate, capacity: 10/s, id: \"l/{{header.x-tenant}}\", max_keys: 10 }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [tenant, local] }}\n",
        up.addr
    );
    let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
    let mut c = h1(u.addr("listen")).await;
    let req = Request::get("/x").header("host", "api.test").header("x-tenant", "acme").body(upstream::empty()).unwrap();
    assert_eq!(send1(&mut c, req).await.status, StatusCode::OK);
    let state =
        |text: &str, s: &str| metric(text, "usher_proxy_lease_state", &[("resource_id", "t/acme"), ("state", s)]);
    let local =
        |text: &str, s: &str| metric(text, "usher_proxy_lease_state", &[("resource_id", "l/acme"), ("state", s)]);
    let labels = [("resource_id", "t/acme"), ("from", "pending"), ("to", "leased")];
    // The lease client counts the transition just after the key's state changed.
    assert_eventually!(
        {
            let text = http_get(u.addr("admin"), "/metrics").1;
            state(&text, "leased") == Some(1.0) && metric(&text, "usher_lease_transitions_total", &labels).is_some()
        },
        Duration::from_secs(10),
        "the key is leased"
    );
    // The lease states are filled for each scrape (and dropped after it): the
    // next scrape shows them all the same, with the transition counted once.
    for _ in 0..2 {
        let (_, text) = http_get(u.addr("admin"), "/metrics");
        assert_eq!(state(&text, "leased"), Some(1.0), "{text}");
        assert_eq!(state(&text, "pending"), Some(0.0), "{text}");
        assert_eq!(metric(&text, "usher_lease_transitions_total", &labels), Some(1.0), "{text}");
        // A local key (no lease: its capacity is the routes file's) has one state, and no transition.
        assert_eq!(local(&text, "local"), Some(1.0), "{text}");
        assert_eq!(local(&text, "leased"), None, "{text}");
        assert_eq!(metric(&text, "usher_lease_transitions_total", &[("resource_id", "l/acme")]), None, "{text}");
    }
}

/// Tenants that come and go leave no `usher_lease_transitions_total` series
/// behind once their keys are forgotten (README: per-key series carry at
/// most `max_keys` ids per resource); a tenant that comes back counts anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_keys_transition_counts_leave_metrics() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://{}\" }}\n\
         resources:\n  fixed: {{ kind: rate, capacity: 100/s, burst: 50 }}\n  \
         tenant: {{ kind: rate, capacity: 10/s, wants: 5, id: \"t/{{header.x-tenant}}\", key_idle_timeout: 1s }}\n\
         routes:\n  - {{ name: api, upstream: up, resources: [fixed, tenant] }}\n",
        up.addr
    );
    let u = start_proxy(&write_file(dir.path(), "routes.yaml", &yaml));
    let tenants = ["acme", "globex", "initech", "umbrella", "hooli"];
    let series = |text: &str| -> Vec<String> {
        text.lines().filter(|l| l.starts_with("usher_lease_transitions_total{")).map(str::to_string).collect()
    };
    let tenant_series =
        |text: &str| -> usize { series(text).iter().filter(|l| l.contains("resource_id=\"t/")).count() };
    let mut c = h1(u.addr("listen")).await;
    for round in 0..2 {
        for t in tenants {
            let req =
                Request::get("/x").header("host", "api.test").header("x-tenant", t).body(upstream::empty()).unwrap();
            let r = send1(&mut c, req).await;
            assert_eq!(r.status, StatusCode::OK, "round {round}, {t}: {:?}", r.body);
        }
        // Each tenant's key is leased (pending → leased), and counted.
        assert_eventually!(
            {
                let text = http_get(u.addr("admin"), "/metrics").1;
                tenants.iter().all(|t| {
                    let labels =
                        [("resource_id", format!("t/{t}")), ("from", "pending".into()), ("to", "leased".into())];
                    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    metric(&text, "usher_lease_transitions_total", &labels) == Some(1.0)
                })
            },
            Duration::from_secs(10),
            "round {round}: every tenant's transition is counted once:\n{:?}",
            series(&http_get(u.addr("admin"), "/metrics").1)
        );
        // Idle for their timeout, the keys are forgotten, and their series with them.
        assert_eventually!(
            tenant_series(&http_get(u.addr("admin"), "/metrics").1) == 0,
            Duration::from_secs(10),
            "round {round}: series of forgotten tenants stay:\n{:?}",
            series(&http_get(u.addr("admin"), "/metrics").1)
        );
        let text = http_get(u.addr("admin"), "/metrics").1;
        assert!(
            metric(&text, "usher_lease_transitions_total", &[("resource_id", "fixed")]).is_some(),
            "the fixed key, never forgotten, keeps its count: {:?}",
            series(&text)
        );
    }
    assert!(forgotten_in_summary(&u) >= 1, "{}", u.log());
}
