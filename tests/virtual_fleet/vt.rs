//! The harness: real capacity servers (`usher_server::Node`) and real
//! sidecar limiters (`usher_enforce::embed::Limits`: the lease table, the
//! enforcer, the lease client and its driver), all in one process, on one
//! manual clock that moves in step with tokio's paused time.
//!
//! Tokio's clock is paused, so it jumps to the next timer whenever every
//! task is idle. A ticker task advances the manual clock by [`TICK`] each
//! time tokio's does: the lease client's sleeps (tokio's), the limiters'
//! waits (the manual clock, polled each millisecond) and the load's
//! arrivals (tokio's) all see one virtual time. Ten virtual minutes of a
//! fleet take a few seconds.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tower::{ServiceBuilder, ServiceExt};
use usher_core::clock::{Clock, ManualClock, Time};
use usher_core::config::resources::ResourcesConfig;
use usher_enforce::embed::{Limits, RoutesConfig, Runs, Wiring};
use usher_server::{LocalTransport, Node};

/// The manual clock's step, and how often it catches up with tokio's.
pub const TICK: Duration = Duration::from_millis(1);

/// How long a closed-loop client takes to come back after a refusal: a
/// round trip, kept long enough that hammering stays cheap to simulate.
pub const CLOSED_LOOP_PAUSE: Duration = Duration::from_millis(20);

/// One virtual world: a clock, the in-process network, its servers.
#[derive(Clone)]
pub struct World {
    pub clock: Clock,
    time: Arc<ManualClock>,
    pub net: Arc<LocalTransport>,
    start: Time,
}

impl World {
    /// A world starting at a fixed moment (a whole UTC minute, so that
    /// units start at known offsets), its clock ticking with tokio's.
    /// Must run on a paused current-thread runtime.
    pub fn new() -> Self {
        let start = Time::from_secs(1_800_000_000);
        let (clock, time) = Clock::manual(start);
        let ticker = time.clone();
        tokio::spawn(async move {
            let origin = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(TICK).await;
                // Catch up with tokio's clock, however far it jumped.
                let at = start.saturating_add(origin.elapsed());
                let now = ticker.now();
                if at > now {
                    ticker.advance(at.since(now));
                }
            }
        });
        World { clock, time, net: Arc::new(LocalTransport::new()), start }
    }

    /// Virtual seconds since the world began.
    pub fn elapsed(&self) -> f64 {
        self.time.now().since(self.start).as_secs_f64()
    }

    /// A capacity server at `addr` with this resources file, reachable in the world.
    pub fn server(&self, addr: &str, resources: &str) -> Arc<Node> {
        let cfg = ResourcesConfig::parse(addr, resources).expect("a valid resources file");
        let node = Arc::new(Node::new(
            addr.to_string(),
            "virtual".into(),
            cfg,
            self.clock.clone(),
            Duration::ZERO,
            prometheus::Registry::new(),
        ));
        node.store.set_predecessor(usher_server::store::Predecessor::NoneOutstanding);
        self.net.add(addr, node.clone());
        node
    }

    /// A sidecar's limiter with this routes file, leasing over the world's network.
    pub async fn sidecar(&self, routes: &str) -> Limits {
        let cfg = RoutesConfig::parse("routes.yaml", routes).expect("a valid routes file");
        let wiring = Wiring { transport: Some(self.net.clone()), runs: Runs::Here };
        Limits::start_wired(cfg, self.clock.clone(), wiring).await.expect("limits start")
    }
}

/// What one request met.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Virtual seconds since the world began, at arrival.
    pub at: f64,
    /// How long it took to be answered (waited for its slot, plus the upstream's latency).
    pub took: f64,
    pub status: u16,
    /// A refusal's Retry-After, in seconds.
    pub retry_after: Option<u64>,
    /// The units it was charged.
    pub cost: f64,
}

/// What a sidecar's apps met, request by request.
#[derive(Default, Clone)]
pub struct Record(Arc<Mutex<Vec<Outcome>>>);

impl Record {
    pub fn all(&self) -> Vec<Outcome> {
        self.0.lock().unwrap().clone()
    }

    /// Every record's outcomes in one.
    pub fn merged(records: &[Record]) -> Record {
        let all: Vec<Outcome> = records.iter().flat_map(Record::all).collect();
        Record(Arc::new(Mutex::new(all)))
    }

    /// Units admitted in each whole virtual second, from second `from` to `to`.
    pub fn admitted_per_second(&self, from: usize, to: usize) -> Vec<f64> {
        let mut per = vec![0.0; to.saturating_sub(from)];
        for o in self.all().iter().filter(|o| o.status == 200) {
            let s = (o.at + o.took) as usize;
            if (from..to).contains(&s) {
                per[s - from] += o.cost;
            }
        }
        per
    }

    /// Requests refused.
    pub fn refused(&self) -> usize {
        self.all().iter().filter(|o| o.status == 429).count()
    }

    /// The `q` quantile of the time to an answer, over admitted requests.
    pub fn took_quantile(&self, q: f64) -> f64 {
        let mut t: Vec<f64> = self.all().iter().filter(|o| o.status == 200).map(|o| o.took).collect();
        t.sort_by(f64::total_cmp);
        t.get(((t.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0)
    }

    /// Every Retry-After given, to be checked.
    pub fn retry_afters(&self) -> Vec<u64> {
        self.all().iter().filter_map(|o| o.retry_after).collect()
    }
}

/// Sends one request of `cost` units through `limits`'s `resource` to an
/// upstream that answers after `latency`; records it.
pub async fn send(
    world_clock: &Clock,
    start: Time,
    limits: &Limits,
    resource: &str,
    cost: f64,
    latency: Duration,
    rec: &Record,
) -> Outcome {
    let svc = ServiceBuilder::new().layer(limits.layer_with_cost(resource, cost).expect("a resource")).service(
        tower::service_fn(move |_req: http::Request<String>| async move {
            tokio::time::sleep(latency).await;
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from_static(b"ok"))))
        }),
    );
    let t0 = world_clock.now();
    let resp = svc.oneshot(http::Request::new(String::new())).await.expect("the layer answers");
    let retry_after = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
    let o = Outcome {
        at: t0.since(start).as_secs_f64(),
        took: world_clock.now().since(t0).as_secs_f64(),
        status: resp.status().as_u16(),
        retry_after,
        cost,
    };
    rec.0.lock().unwrap().push(o);
    o
}

/// A load of one app on one sidecar.
#[derive(Debug, Clone, Copy)]
pub enum Load {
    /// Poisson arrivals at this many requests a second.
    Poisson(f64),
    /// Requests at this fixed rate, whatever the answers (open loop).
    Open(f64),
    /// This many connections, each sending its next request when the last is answered.
    Closed(usize),
    /// Poisson arrivals; a refused request is retried after its Retry-After, at most this many times.
    Retrying(f64, u32),
}

/// Drives `limits` with `load` from virtual second `from` for `secs`, each
/// request costing what `cost` draws. Returns when the load is over and its
/// requests are answered.
#[allow(clippy::too_many_arguments)]
pub async fn drive(
    world: World,
    limits: Limits,
    resource: &'static str,
    load: Load,
    cost: impl Fn(&mut SmallRng) -> f64 + Clone + Send + 'static,
    latency: Duration,
    from: f64,
    secs: f64,
    seed: u64,
    rec: Record,
) {
    let (clock, start) = (world.clock.clone(), world.start);
    tokio::time::sleep(Duration::from_secs_f64((from - world.elapsed()).max(0.0))).await;
    let end = from + secs;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut tasks = tokio::task::JoinSet::new();
    match load {
        Load::Poisson(rate) | Load::Open(rate) | Load::Retrying(rate, _) => loop {
            let gap = match load {
                Load::Open(_) => 1.0 / rate,
                _ => -(1.0 - rng.random::<f64>()).ln() / rate,
            };
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
            if world.elapsed() >= end {
                break;
            }
            let (l, c, r, clk) = (limits.clone(), cost(&mut rng), rec.clone(), clock.clone());
            let retries = if let Load::Retrying(_, n) = load { n } else { 0 };
            tasks.spawn(async move {
                for _ in 0..=retries {
                    let o = send(&clk, start, &l, resource, c, latency, &r).await;
                    match o.retry_after {
                        Some(s) if o.status == 429 => tokio::time::sleep(Duration::from_secs(s)).await,
                        _ => break,
                    }
                }
            });
        },
        Load::Closed(conns) => {
            for i in 0..conns {
                let (l, r, clk, cost) = (limits.clone(), rec.clone(), clock.clone(), cost.clone());
                let mut rng = SmallRng::seed_from_u64(seed ^ (i as u64 + 1));
                let end_at = start.saturating_add(Duration::from_secs_f64(end));
                tasks.spawn(async move {
                    while clk.now() < end_at {
                        let o = send(&clk, start, &l, resource, cost(&mut rng), latency, &r).await;
                        if o.status != 200 {
                            // A refused client comes back after a round trip of its own.
                            tokio::time::sleep(CLOSED_LOOP_PAUSE).await;
                        }
                    }
                });
            }
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// Units admitted per virtual second over every record, summed.
pub fn fleet_per_second(records: &[Record], from: usize, to: usize) -> Vec<f64> {
    let mut total = vec![0.0; to.saturating_sub(from)];
    for r in records {
        for (t, v) in total.iter_mut().zip(r.admitted_per_second(from, to)) {
            *t += v;
        }
    }
    total
}

/// A summary of records for failure messages.
pub fn summary(records: &[Record]) -> String {
    let mut s = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        let all = r.all();
        s.insert(
            i,
            format!(
                "{} requests, {} refused, p50 {:.2}s p95 {:.2}s, max Retry-After {:?}; refused at {:?}; slow at {:?}",
                all.len(),
                r.refused(),
                r.took_quantile(0.5),
                r.took_quantile(0.95),
                r.retry_afters().iter().max(),
                all.iter().filter(|o| o.status == 429).map(|o| o.at.round() as u64).take(8).collect::<Vec<_>>(),
                all.iter()
                    .filter(|o| o.status == 200 && o.took > 1.5)
                    .map(|o| (o.at.round() as u64, o.took.round() as u64))
                    .take(8)
                    .collect::<Vec<_>>(),
            ),
        );
    }
    format!("{s:#?}")
}
