//! The cost of one share decision as the server makes it on a GetCapacity
//! RPC: upsert the requester's new demand, decide, upsert its grant, with 10,
//! 1,000 and 100,000 clients on the resource.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use rand::{Rng, SeedableRng, rngs::StdRng};
use usher_server::algorithm::{DemandIndex, Kind, Request, decide};

/// One resource in steady state, and a fixed random stream of requests.
struct Resource {
    index: DemandIndex,
    /// (wants, subclients, has) per client slot.
    clients: Vec<(f64, u64, f64)>,
    capacity: f64,
    /// (client, new wants): demand keeps changing, so the requester's node
    /// moves in the tree on most requests, the expensive path.
    requests: Vec<(u32, f64)>,
    next: usize,
}

impl Resource {
    fn new(kind: Kind, n: u32) -> Self {
        let mut rng = StdRng::seed_from_u64(u64::from(n));
        let clients: Vec<_> = (0..n).map(|_| (rng.random_range(0.0..100.0), rng.random_range(1..=4), 0.0)).collect();
        let mut index = DemandIndex::new();
        for (slot, &(w, s, h)) in clients.iter().enumerate() {
            index.upsert(slot as u32, w, s, h);
        }
        // Oversubscribed by 2x, so the share algorithms do their full work.
        let capacity = index.total_wants() / 2.0;
        let requests = (0..4096).map(|_| (rng.random_range(0..n), rng.random_range(0.0..100.0))).collect();
        let mut r = Resource { index, clients, capacity, requests, next: 0 };
        // Settle: every client has asked once, so has reflects real grants.
        for slot in 0..n {
            let w = r.clients[slot as usize].0;
            r.decide(kind, slot, w);
        }
        r
    }

    fn decide(&mut self, kind: Kind, slot: u32, wants: f64) -> f64 {
        let (_, subclients, has) = self.clients[slot as usize];
        self.index.upsert(slot, wants, subclients, has);
        let grant = decide(kind, self.capacity, &self.index, &Request { wants, subclients, has });
        self.index.upsert(slot, wants, subclients, grant);
        self.clients[slot as usize] = (wants, subclients, grant);
        grant
    }

    fn next_request(&mut self) -> (u32, f64) {
        let r = self.requests[self.next];
        self.next = (self.next + 1) % self.requests.len();
        r
    }
}

fn decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    for kind in [Kind::FairShare, Kind::ProportionalShare] {
        for n in [10, 1_000, 100_000] {
            let mut resource = Resource::new(kind, n);
            group.bench_function(BenchmarkId::new(kind.name(), n), |b| {
                b.iter(|| {
                    let (slot, wants) = resource.next_request();
                    black_box(resource.decide(kind, black_box(slot), black_box(wants)))
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);
