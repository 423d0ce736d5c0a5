//! Heap bytes per templated key, by component: the embedded capacity
//! server's store, the sidecar's LeaseTable, and the lease client with its
//! enforcer, for a sidecar with no `doorman:` section whose tenant keys are
//! local (no lease: the table's key alone) or leased from its embedded server.
//!
//! A counting global allocator, in this test binary only, tracks the bytes
//! live at any moment; each component's cost is the growth of that figure
//! while it takes N keys, divided by N. Allocation is deterministic, so the
//! bounds asserted here are generous ceilings against a regression, not
//! timings. `cargo test --test key_memory -- --nocapture` prints the figures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use usher_core::clock::{Clock, Time};
use usher_core::config::routes::RoutesConfig;
use usher_enforce::enforcer::{EMBEDDED, LOCAL_IDLE, embedded_resources, start_with};
use usher_enforce::pushback::Pushback;
use usher_lease::transport::Transport;
use usher_limit::LeaseTable;
use usher_proto as proto;
use usher_server::store::Limits;
use usher_server::{LocalTransport, Node};

/// The system allocator, counting the bytes live. The only unsafe code of
/// the project: a global allocator cannot be written without it.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

const KEYS: usize = 10_000;

/// The most heap bytes a one-client key may cost the capacity server's
/// store (measured: 616). With malloc's overhead (five allocations a key)
/// and the map's spare room on top, a key then costs a server under 1,000
/// bytes of RSS: a million tenant keys fit in 1 GB (benches/RESULTS.md,
/// run AB: 752 MB, a tenth of the keys on three clients).
const STORE_CEILING: f64 = 750.0;

/// The most heap bytes a local tenant key may cost the LeaseTable, and with
/// it the whole sidecar (measured: 288; its limiter is 256 of them in its
/// `Arc`, the id and the set's slot the rest).
const LOCAL_CEILING: f64 = 320.0;

/// A sidecar with no `doorman:` section (so an embedded server) and the e2e
/// bench's tenant resource.
fn routes() -> Arc<RoutesConfig> {
    routes_with(250_000)
}

/// The bench's routes file, its resource allowing `max_keys` tenants.
fn routes_with(max_keys: usize) -> Arc<RoutesConfig> {
    let yaml = format!(
        "upstreams:\n  up: {{ url: \"http://127.0.0.1:9\" }}\n\
         resources:\n  tenant: {{ kind: rate, capacity: 1000/s, burst: 50, \
         id: \"t/{{header.x-tenant}}\", max_keys: {max_keys} }}\n\
         routes:\n  - {{ name: all, upstream: up, resources: [tenant] }}\n"
    );
    Arc::new(RoutesConfig::parse("routes.yaml", &yaml).expect("valid routes"))
}

fn tenant(i: usize) -> String {
    format!("t/tenant-{i:06}")
}

/// The sidecar's embedded server, as `proxy::lease::start_with` builds it.
fn embedded(cfg: &RoutesConfig) -> Arc<Node> {
    let mut node = Node::new(
        EMBEDDED.into(),
        "embedded".into(),
        embedded_resources(cfg),
        Clock::system(),
        Duration::ZERO,
        prometheus::Registry::new(),
    );
    node.store.set_limits(Limits { max_resources: usize::MAX, max_clients_per_resource: 1 });
    Arc::new(node)
}

/// Bytes per key the embedded server keeps, the keys asked for through its
/// GetCapacity service in the lease client's batches.
async fn store_bytes_per_key() -> f64 {
    let node = embedded(&routes());
    let transport = LocalTransport::new();
    transport.add(EMBEDDED, node.clone());
    let ask = |ids: std::ops::Range<usize>| proto::GetCapacityRequest {
        client_id: "sidecar".into(),
        resource: ids
            .map(|i| proto::ResourceRequest {
                returned: None,
                reserve: None,
                backlog: None,
                unit_account: None,
                window: None,
                upstream_quota: None,
                resource_id: tenant(i),
                priority: 0,
                has: None,
                wants: 1000.0,
            })
            .collect(),
    };
    // One key first: the resource map, metrics and the service exist before counting.
    transport.get_capacity(EMBEDDED, ask(KEYS..KEYS + 1)).await.expect("granted");
    let before = live();
    for start in (0..KEYS).step_by(1000) {
        let answer = transport.get_capacity(EMBEDDED, ask(start..start + 1000)).await.expect("granted");
        assert_eq!(answer.response.len(), 1000);
    }
    let grown = live() - before;
    assert_eq!(node.store.status().len(), KEYS + 1);
    drop((transport, node));
    grown as f64 / KEYS as f64
}

/// A sidecar's lease table with the tenant resource configured.
fn table(cfg: &RoutesConfig) -> Arc<LeaseTable> {
    let table = Arc::new(LeaseTable::new(Clock::system()));
    table.configure(usher_enforce::resource::specs(cfg));
    table
}

fn make_keys(table: &LeaseTable, keys: std::ops::Range<usize>) {
    let res = table.resource("tenant").expect("configured");
    for i in keys {
        res.try_limiter(&tenant(i)).expect("under max_keys");
    }
    table.settle();
}

/// Bytes per key of the LeaseTable: limiter, GCRA state, demand meter, maps.
fn table_bytes_per_key() -> f64 {
    let cfg = routes();
    let table = table(&cfg);
    make_keys(&table, KEYS..KEYS + 1);
    let before = live();
    make_keys(&table, 0..KEYS);
    (live() - before) as f64 / KEYS as f64
}

/// How a sidecar's tenant keys are enforced in [`sidecar_bytes_per_key`].
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// The bench's resource: local keys, no lease (`usher_enforce::resource::is_local`).
    Local,
    /// The same resource asking for less than its capacity: each key leases
    /// from the embedded server, through the lease client.
    Leased,
}

/// The routes file of [`routes`], or of its leased variant.
fn routes_of(keys: Keys) -> Arc<RoutesConfig> {
    match keys {
        Keys::Local => routes(),
        Keys::Leased => {
            let yaml = "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
                        resources:\n  tenant: { kind: rate, capacity: 1000/s, burst: 50, wants: 999, \
                        id: \"t/{header.x-tenant}\", max_keys: 250000 }\n\
                        routes:\n  - { name: all, upstream: up, resources: [tenant] }\n";
            Arc::new(RoutesConfig::parse("routes.yaml", yaml).expect("valid routes"))
        }
    }
}

/// Bytes per key of the whole sidecar flow: table keys, the enforcer's
/// memory of each, and for leased keys the lease client's state and the
/// embedded server's store. Counted once the lease client has seen every
/// key (leased: each holds a lease; local: a demand poll read it).
async fn sidecar_bytes_per_key(keys: Keys) -> f64 {
    let cfg = routes_of(keys);
    let table = table(&cfg);
    let registry = prometheus::Registry::new();
    let pushback = Arc::new(Pushback::new(&registry));
    let shutdown = CancellationToken::new();
    let source = cfg.clone();
    let (client, task) =
        start_with(Arc::new(move || source.clone()), table.clone(), pushback, &registry, shutdown.clone())
            .expect("the embedded server starts");
    let limits = table.resource("tenant").expect("configured");
    let seen = |range: std::ops::Range<usize>| {
        range.clone().all(|i| match keys {
            Keys::Leased => client.lease_of(&tenant(i)).is_some(),
            Keys::Local => limits.get(&tenant(i)).is_some_and(|l| l.watched()),
        })
    };
    // The lease client, its thread and the embedded server are up, with one key.
    make_keys(&table, KEYS..KEYS + 1);
    wait_for(|| seen(KEYS..KEYS + 1)).await;
    let before = live();
    make_keys(&table, 0..KEYS);
    wait_for(|| seen(0..KEYS)).await;
    // The least of a few readings: a demand poll's buffers (the lease
    // client's thread polls on its own) are gone between polls.
    let mut grown = isize::MAX;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        grown = grown.min(live() - before);
    }
    if keys == Keys::Local {
        assert!(client.lease_of(&tenant(0)).is_none(), "a local key holds no lease");
    }
    shutdown.cancel();
    task.await.expect("lease client ends");
    grown as f64 / KEYS as f64
}

/// Bytes per key still held once local keys, each used once, have idled
/// [`LOCAL_IDLE`] with full buckets: the enforcer forgets them (a key made
/// anew would be the same), so a tenant seen once costs nothing after that.
/// A manual clock moves the idle time; a nudge wakes the lease client.
async fn idle_local_bytes_per_key() -> f64 {
    // Over half its max_keys: crowded, so its idle keys go after LOCAL_IDLE.
    let cfg = routes_with(KEYS + KEYS / 2);
    assert!(usher_enforce::enforcer::crowded(KEYS + 1, KEYS + KEYS / 2));
    let (clock, time) = Clock::manual(Time::from_secs(1_000_000));
    let table = Arc::new(LeaseTable::new(clock));
    table.configure(usher_enforce::resource::specs(&cfg));
    let registry = prometheus::Registry::new();
    let shutdown = CancellationToken::new();
    let source = cfg.clone();
    let pushback = Arc::new(Pushback::new(&registry));
    let (_client, task) =
        start_with(Arc::new(move || source.clone()), table.clone(), pushback, &registry, shutdown.clone())
            .expect("the embedded server starts");
    let limits = table.resource("tenant").expect("configured");
    make_keys(&table, KEYS..KEYS + 1);
    wait_for(|| limits.get(&tenant(KEYS)).is_some_and(|l| l.watched())).await;
    let before = live();
    make_keys(&table, 0..KEYS);
    wait_for(|| (0..KEYS).all(|i| limits.get(&tenant(i)).is_some_and(|l| l.watched()))).await;
    let held = (live() - before) as f64 / KEYS as f64;
    time.advance(LOCAL_IDLE);
    table.activity().nudge();
    wait_for(|| limits.is_empty()).await;
    let mut left = isize::MAX;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = left.min(live() - before);
    }
    shutdown.cancel();
    task.await.expect("lease client ends");
    assert!(held > 100.0, "the keys were held before they idled: {held:.0} bytes each");
    left as f64 / KEYS as f64
}

/// Waits up to 30 s for `done` (every key leased, read, or forgotten).
async fn wait_for(mut done: impl FnMut() -> bool) {
    for _ in 0..600 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the keys did not get there within 30 s");
}

/// One test, so no other test allocates while a figure is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_per_templated_key_stay_bounded() {
    let store = store_bytes_per_key().await;
    let table = table_bytes_per_key();
    let local = sidecar_bytes_per_key(Keys::Local).await;
    let leased = sidecar_bytes_per_key(Keys::Leased).await;
    let idle = idle_local_bytes_per_key().await;
    let enforcer = local - table;
    let client = leased - store - table;
    println!(
        "bytes per key ({KEYS} keys): store {store:.0}, table {table:.0}; \
         local keys: enforcer {enforcer:.0}, whole sidecar {local:.0}; \
         leased keys: lease client and enforcer {client:.0}, whole sidecar {leased:.0}; \
         local keys seen once, after {LOCAL_IDLE:?} idle: {idle:.1}"
    );
    // Ceilings with room for another allocator's or map's growth policy
    // (benches/RESULTS.md, "Memory per key" and "a million tenant keys on
    // one server", has the figures measured).
    assert!(store > 0.0 && table > 0.0 && client > 0.0);
    assert!(store < STORE_CEILING, "store: {store:.0} bytes per key");
    assert!(table < LOCAL_CEILING, "table: {table:.0} bytes per key");
    assert!(client < 1_000.0, "lease client and enforcer: {client:.0} bytes per key");
    assert!(leased < 3_000.0, "whole sidecar, leased keys: {leased:.0} bytes per key");
    // A local key is the table's key and nothing more.
    assert!(enforcer < 50.0, "enforcer, local keys: {enforcer:.0} bytes per key");
    assert!(local < LOCAL_CEILING, "whole sidecar, local keys: {local:.0} bytes per key");
    // What a forgotten key leaves: nothing but the shards' emptied sets.
    assert!(idle < 8.0, "local keys seen once, idle: {idle:.1} bytes per key left");
}
