//! The resource store: per resource, every client's lease, kept so that one
//! GetCapacity decision costs O(log n) in the number of clients.
//!
//! A resource is created from the first matching template the first time it
//! is asked for. Expired leases are dropped on every access and by a periodic
//! [`Store::sweep`], so status and metrics never count one.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::Serialize;

use crate::algorithm::{self, ClientSlot, DemandIndex, Kind};
use crate::clock::{Clock, Time};
use crate::config::resources::{ResourcesConfig, Template};

/// One priority band of a lower server's demand.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Band {
    pub priority: i64,
    pub num_clients: i64,
    pub wants: f64,
}

/// Who is asking: an end client, or a lower server speaking for its clients.
#[derive(Debug, Clone, PartialEq)]
pub enum Requester {
    Client { priority: i64 },
    Server { bands: Vec<Band> },
}

/// One resource's part of a capacity request, already validated.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseRequest {
    pub resource_id: String,
    pub wants: f64,
    pub subclients: u64,
    /// The capacity the requester says it holds (its `has` lease).
    pub reported_has: Option<f64>,
    pub requester: Requester,
}

/// The answer for one resource.
#[derive(Debug, Clone)]
pub struct Grant {
    pub capacity: f64,
    pub expiry: Time,
    pub refresh_interval: Duration,
    pub safe_capacity: f64,
    pub template: Arc<Template>,
}

#[derive(Debug, Clone)]
struct ClientLease {
    slot: ClientSlot,
    has: f64,
    wants: f64,
    subclients: u64,
    requester: Requester,
    expiry: Time,
    refresh_interval: Duration,
    last_request: Time,
}

struct Resource {
    template: Arc<Template>,
    clients: HashMap<Arc<str>, ClientLease>,
    slot_owner: Vec<Option<Arc<str>>>,
    free_slots: Vec<ClientSlot>,
    index: DemandIndex,
    expiries: BTreeSet<(Time, ClientSlot)>,
}

/// The capacity server's state.
pub struct Store {
    clock: Clock,
    config: ArcSwap<ResourcesConfig>,
    resources: RwLock<HashMap<String, Arc<Mutex<Resource>>>>,
    master_since: AtomicU64,
    min_request_interval: Duration,
}

/// What status pages and metrics show of a resource.
#[derive(Debug, Clone, Serialize)]
pub struct ResourceStatus {
    pub id: String,
    pub template: String,
    pub algorithm: &'static str,
    pub capacity: f64,
    pub sum_has: f64,
    pub sum_wants: f64,
    pub clients: usize,
    pub subclients: u64,
    pub learning_mode: bool,
    /// Seconds left in learning mode.
    pub learning_left_s: f64,
}

/// One client's lease, for `/debug/resources`.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseStatus {
    pub client_id: String,
    pub kind: &'static str,
    pub priority: Option<i64>,
    pub bands: Vec<Band>,
    pub has: f64,
    pub wants: f64,
    pub subclients: u64,
    pub expires_in_s: f64,
    pub refresh_interval_s: u64,
}

impl Store {
    pub fn new(clock: Clock, config: ResourcesConfig, min_request_interval: Duration) -> Self {
        let now = clock.now();
        Store {
            clock,
            config: ArcSwap::from_pointee(config),
            resources: RwLock::new(HashMap::new()),
            master_since: AtomicU64::new(now.as_nanos()),
            min_request_interval,
        }
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    pub fn config(&self) -> Arc<ResourcesConfig> {
        self.config.load_full()
    }

    /// Marks the moment this server became master: learning mode starts over
    /// and everything known about leases is forgotten.
    pub fn become_master(&self) {
        let mut map = self.resources.write().expect("store lock poisoned");
        map.clear();
        self.master_since.store(self.clock.now().as_nanos(), Ordering::Release);
    }

    /// Installs a new configuration. Existing leases stay valid; the next
    /// decision for each resource uses its new template.
    pub fn reload(&self, config: ResourcesConfig) {
        let map = self.resources.read().expect("store lock poisoned");
        for (id, res) in map.iter() {
            if let Some(t) = config.find(id) {
                res.lock().expect("resource lock poisoned").template = t.clone();
            }
        }
        self.config.store(Arc::new(config));
    }

    fn learning_until(&self, template: &Template) -> Time {
        Time::from_nanos(self.master_since.load(Ordering::Acquire))
            .saturating_add(template.algorithm.learning_mode_duration)
    }

    /// Decides one resource of a request from `client`.
    pub fn get_capacity(&self, client: &str, req: &LeaseRequest) -> Grant {
        let now = self.clock.now();
        loop {
            {
                // The map's read lock is held while the resource changes, so a
                // sweep cannot drop a resource that a request is filling.
                let map = self.resources.read().expect("store lock poisoned");
                if let Some(res) = map.get(&req.resource_id) {
                    let mut r = res.lock().expect("resource lock poisoned");
                    r.expire(now);
                    let learning = now < self.learning_until(&r.template);
                    return r.decide(client, req, now, learning, self.min_request_interval);
                }
            }
            let cfg = self.config.load();
            let template = cfg.find(&req.resource_id).expect("validated config has a catch-all").clone();
            let mut map = self.resources.write().expect("store lock poisoned");
            map.entry(req.resource_id.clone()).or_insert_with(|| Arc::new(Mutex::new(Resource::new(template))));
        }
    }

    /// Forgets `client`'s leases on the named resources; unknown ids are ignored.
    pub fn release(&self, client: &str, resource_id: &str) {
        let map = self.resources.read().expect("store lock poisoned");
        if let Some(res) = map.get(resource_id) {
            res.lock().expect("resource lock poisoned").remove(client);
        }
    }

    /// Drops expired leases everywhere, and resources left with no client.
    pub fn sweep(&self) {
        let now = self.clock.now();
        let mut map = self.resources.write().expect("store lock poisoned");
        map.retain(|_, res| {
            let mut r = res.lock().expect("resource lock poisoned");
            r.expire(now);
            !r.clients.is_empty()
        });
    }

    /// Every known resource, sorted by id.
    pub fn status(&self) -> Vec<ResourceStatus> {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        let mut out: Vec<ResourceStatus> = map
            .iter()
            .map(|(id, res)| {
                let mut r = res.lock().expect("resource lock poisoned");
                r.expire(now);
                let until = self.learning_until(&r.template);
                ResourceStatus {
                    id: id.clone(),
                    template: r.template.identifier_glob.clone(),
                    algorithm: r.template.algorithm.kind.name(),
                    capacity: r.template.capacity,
                    sum_has: r.index.total_has(),
                    sum_wants: r.index.total_wants(),
                    clients: r.clients.len(),
                    subclients: r.index.total_subclients(),
                    learning_mode: now < until,
                    learning_left_s: until.since(now).as_secs_f64(),
                }
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// One resource's unexpired leases, sorted by client id.
    pub fn leases(&self, resource_id: &str) -> Option<Vec<LeaseStatus>> {
        let now = self.clock.now();
        let map = self.resources.read().expect("store lock poisoned");
        let mut r = map.get(resource_id)?.lock().expect("resource lock poisoned");
        r.expire(now);
        let mut out: Vec<LeaseStatus> = r
            .clients
            .iter()
            .map(|(id, l)| LeaseStatus {
                client_id: id.to_string(),
                kind: match l.requester {
                    Requester::Client { .. } => "client",
                    Requester::Server { .. } => "server",
                },
                priority: match l.requester {
                    Requester::Client { priority } => Some(priority),
                    Requester::Server { .. } => None,
                },
                bands: match &l.requester {
                    Requester::Server { bands } => bands.clone(),
                    Requester::Client { .. } => Vec::new(),
                },
                has: l.has,
                wants: l.wants,
                subclients: l.subclients,
                expires_in_s: l.expiry.since(now).as_secs_f64(),
                refresh_interval_s: l.refresh_interval.as_secs(),
            })
            .collect();
        out.sort_by(|a, b| a.client_id.cmp(&b.client_id));
        Some(out)
    }
}

// === impl Resource ===

impl Resource {
    fn new(template: Arc<Template>) -> Self {
        Resource {
            template,
            clients: HashMap::new(),
            slot_owner: Vec::new(),
            free_slots: Vec::new(),
            index: DemandIndex::new(),
            expiries: BTreeSet::new(),
        }
    }

    fn expire(&mut self, now: Time) {
        while let Some(&(expiry, slot)) = self.expiries.first() {
            if expiry > now {
                break;
            }
            let owner = self.slot_owner[slot as usize].clone().expect("expiring slot has an owner");
            self.remove(&owner);
        }
    }

    fn remove(&mut self, client: &str) {
        if let Some(l) = self.clients.remove(client) {
            self.expiries.remove(&(l.expiry, l.slot));
            self.index.remove(l.slot);
            self.slot_owner[l.slot as usize] = None;
            self.free_slots.push(l.slot);
        }
    }

    fn safe_capacity(&self) -> f64 {
        match self.template.safe_capacity {
            Some(s) => s,
            None => {
                let n = self.index.total_subclients();
                if n == 0 { self.template.capacity } else { self.template.capacity / n as f64 }
            }
        }
    }

    fn decide(&mut self, client: &str, req: &LeaseRequest, now: Time, learning: bool, min_interval: Duration) -> Grant {
        let template = self.template.clone();
        let alg = &template.algorithm;
        // A too-early request gets its lease back unchanged; only its demand is recorded.
        if let Some(l) = self.clients.get_mut(client)
            && now.since(l.last_request) < min_interval
        {
            l.wants = req.wants;
            l.subclients = req.subclients;
            l.requester = req.requester.clone();
            let (slot, has, expiry, refresh) = (l.slot, l.has, l.expiry, l.refresh_interval);
            self.index.upsert(slot, req.wants, req.subclients, has);
            return Grant {
                capacity: has,
                expiry,
                refresh_interval: refresh,
                safe_capacity: self.safe_capacity(),
                template: self.template.clone(),
            };
        }
        let slot = match self.clients.get(client) {
            Some(l) => {
                self.expiries.remove(&(l.expiry, l.slot));
                l.slot
            }
            None => self.new_slot(client),
        };
        let old_has = self.clients.get(client).map_or(0.0, |l| l.has);
        let capacity = if learning {
            req.reported_has.unwrap_or(0.0)
        } else {
            self.index.upsert(slot, req.wants, req.subclients, old_has);
            let r = algorithm::Request { wants: req.wants, subclients: req.subclients, has: old_has };
            algorithm::decide(alg.kind, self.template.capacity, &self.index, &r)
        };
        let expiry = now.saturating_add(alg.lease_length);
        let lease = ClientLease {
            slot,
            has: capacity,
            wants: req.wants,
            subclients: req.subclients,
            requester: req.requester.clone(),
            expiry,
            refresh_interval: alg.refresh_interval,
            last_request: now,
        };
        self.index.upsert(slot, req.wants, req.subclients, capacity);
        self.expiries.insert((expiry, slot));
        self.clients.insert(Arc::from(client), lease);
        Grant {
            capacity,
            expiry,
            refresh_interval: alg.refresh_interval,
            safe_capacity: self.safe_capacity(),
            template: self.template.clone(),
        }
    }

    fn new_slot(&mut self, client: &str) -> ClientSlot {
        let owner = Some(Arc::from(client));
        match self.free_slots.pop() {
            Some(s) => {
                self.slot_owner[s as usize] = owner;
                s
            }
            None => {
                self.slot_owner.push(owner);
                (self.slot_owner.len() - 1) as ClientSlot
            }
        }
    }
}

/// True for the kinds whose grants share one capacity.
pub fn is_shared(kind: Kind) -> bool {
    matches!(kind, Kind::ProportionalShare | Kind::FairShare)
}

#[cfg(test)]
mod tests;
