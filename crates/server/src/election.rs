//! Master election on etcd v3, lease-based.
//!
//! A candidate grants itself an etcd lease of `ttl` and creates the election
//! key, holding its advertise address, only if the key does not exist. The
//! winner keeps the lease alive; everyone else reads the key to learn the
//! master and redirects clients there. A master that cannot renew its lease
//! steps down when half the TTL has passed since its last renewal — before
//! etcd can expire the key and let another server win — so two masters never
//! hand out capacity at once. A new master starts with empty state in
//! learning mode, for as long as its predecessor's leases may be outstanding
//! (see `horizon`). On shutdown the master deletes its key at once.
//!
//! The deadline is counted from when the last successful renewal was *sent*
//! (etcd restarted the TTL no earlier), and a renewal that hangs is abandoned
//! at the deadline, so a master cut off from etcd stops granting before etcd
//! can expire its key (tests/election.rs measures this through a fault proxy).
//! `/debug/status` shows the lease id and the key's revision (a fencing
//! token), and `usher_server_mastership_changes_total` counts the changes.

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::etcd::{Claim, Etcd};
use super::{Mastership, Node, horizon};
use usher_core::clock::{Clock, Time};

/// Default `--election-ttl`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Default `--election-key`.
pub const DEFAULT_KEY: &str = "/usher/master";

/// What status pages show of the election.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ElectionStatus {
    /// The etcd key the node's servers campaign for (`--election-key`).
    pub key: String,
    /// The TTL of the etcd lease that holds the key, in seconds (`--election-ttl`).
    pub ttl_s: u64,
    /// `master` or `follower`.
    pub state: &'static str,
    /// The etcd lease that holds the election key, while this server is master.
    pub lease_id: Option<i64>,
    /// The etcd revision at which this server created the election key: a
    /// fencing token (a later master always has a higher one).
    pub revision: Option<i64>,
    /// Unix seconds of the last successful lease renewal, while master.
    pub renewed_at: Option<i64>,
    /// A master steps down this long after its last renewal when it cannot
    /// renew: before etcd can expire the key and let another server win.
    pub step_down_after_ms: u64,
    /// The last etcd error, until a call succeeds again.
    pub last_error: Option<String>,
}

/// The election's shared state, readable by status pages.
#[derive(Default)]
pub struct Election {
    status: Mutex<ElectionStatus>,
}

impl Election {
    /// The election as it stands now.
    pub fn status(&self) -> ElectionStatus {
        self.status.lock().expect("election status poisoned").clone()
    }

    /// Changes the status under its lock.
    fn set(&self, f: impl FnOnce(&mut ElectionStatus)) {
        f(&mut self.status.lock().expect("election status poisoned"));
    }
}

/// Campaigns and follows until `shutdown`.
pub(crate) async fn run(
    node: Arc<Node>,
    election: Arc<Election>,
    etcd: Etcd,
    key: String,
    ttl: Duration,
    clock: Clock,
    shutdown: CancellationToken,
) {
    let mut c = Campaign::new(node, election, etcd, key, ttl, clock);
    loop {
        let wait = c.wait();
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        c.campaigned |= c.lease.is_none();
        match c.lease {
            Some((id, renewed)) => {
                if c.renew(id, renewed, &shutdown).await.is_break() {
                    break;
                }
            }
            None => c.campaign().await,
        }
    }
    c.resign().await;
}

/// One server's campaign: its settings, and what it knows between turns.
struct Campaign {
    node: Arc<Node>,
    election: Arc<Election>,
    etcd: Etcd,
    key: String,
    ttl: Duration,
    clock: Clock,
    /// This server's id: the key's value while it is master.
    me: String,
    /// How often a follower reads the key.
    poll: Duration,
    /// How often a master renews its lease.
    renew_every: Duration,
    /// How long after its last renewal a master that cannot renew steps down.
    step_down_after: Duration,
    /// While master: the lease id, and when the last successful renewal was
    /// *sent* (etcd restarted the lease's TTL no earlier than that).
    lease: Option<(i64, Time)>,
    /// While master: when to try a failed renewal again.
    next_try: Option<Time>,
    /// The first campaign goes at once: a fresh tree (etcd, servers and
    /// sidecars started together) waited a whole poll (2 s) for its masters.
    campaigned: bool,
    /// Until etcd first answers, campaigns retry 200 ms, 400 ms, ... apart, up
    /// to a poll: in a fresh tree etcd starts with the servers and answers a
    /// second or two later, and a whole poll (2 s) after that was added to
    /// every sidecar's first admitted request. `None` once etcd answered.
    unreached: Option<u32>,
}

impl Campaign {
    /// A follower about to campaign for `key`, with an etcd lease of `ttl`.
    fn new(node: Arc<Node>, election: Arc<Election>, etcd: Etcd, key: String, ttl: Duration, clock: Clock) -> Self {
        let me = node.server_id.clone();
        let poll = (ttl / 4).clamp(Duration::from_millis(200), Duration::from_secs(2));
        // Renewing at a quarter of the TTL leaves another quarter, before the
        // step-down deadline, to retry on the next etcd endpoint.
        let renew_every = ttl / 4;
        let step_down_after = ttl / 2;
        election.set(|s| {
            s.key = key.clone();
            s.ttl_s = ttl.as_secs();
            s.state = "follower";
            s.step_down_after_ms = step_down_after.as_millis() as u64;
        });
        Campaign {
            node,
            election,
            etcd,
            key,
            ttl,
            clock,
            me,
            poll,
            renew_every,
            step_down_after,
            lease: None,
            next_try: None,
            campaigned: false,
            unreached: Some(0),
        }
    }

    /// How long to wait before the next turn.
    fn wait(&self) -> Duration {
        match (self.lease, self.next_try) {
            (Some(_), Some(at)) => at.since(self.clock.now()),
            (Some((_, renewed)), None) => (renewed.saturating_add(self.renew_every)).since(self.clock.now()),
            (None, _) if !self.campaigned => Duration::ZERO,
            (None, _) => match self.unreached {
                Some(n) => (Duration::from_millis(200) * 2u32.saturating_pow(n.saturating_sub(1))).min(self.poll),
                None => self.poll,
            },
        }
    }

    /// A master's turn: renews lease `id`, last renewed at `renewed`, or
    /// steps down once it cannot before its deadline. Breaks on shutdown.
    async fn renew(&mut self, id: i64, renewed: Time, shutdown: &CancellationToken) -> ControlFlow<()> {
        let sent = self.clock.now();
        // Fencing: an etcd that does not answer must not keep this server
        // master past its step-down deadline, however long a call hangs.
        let left = self.step_down_after.saturating_sub(self.clock.now().since(renewed));
        let ok = tokio::select! {
            _ = shutdown.cancelled() => return ControlFlow::Break(()),
            ok = self.keep_alive(id) => ok,
            _ = tokio::time::sleep(left) => false,
        };
        if ok {
            self.lease = Some((id, sent));
            self.next_try = None;
            self.election.set(|s| {
                s.last_error = None;
                s.renewed_at = Some(sent.as_secs());
            });
        } else if self.clock.now().since(renewed) >= self.step_down_after {
            self.step_down(id).await;
        } else {
            // Retry soon, still before the step-down deadline.
            let deadline = renewed.saturating_add(self.step_down_after);
            let soon = self.clock.now().saturating_add(Duration::from_millis(300));
            self.next_try = Some(if soon < deadline { soon } else { deadline });
        }
        ControlFlow::Continue(())
    }

    /// Renews lease `id` and records the lease horizon again; false when
    /// the lease is gone, the key is no longer this server's, or etcd fails.
    async fn keep_alive(&self, id: i64) -> bool {
        match self.etcd.keep_alive(id).await {
            Ok(left) if left > 0 => {
                let still = matches!(self.etcd.get(&self.key).await, Ok(Some(v)) if v == self.me);
                if still
                    && let Err(e) =
                        horizon::renew(&self.etcd, &self.key, &self.node, &self.clock, self.renew_every).await
                {
                    // Leases now end at the last time recorded.
                    tracing::warn!(error = %e, "cannot record until when leases may be outstanding");
                }
                still
            }
            Ok(_) => false,
            Err(e) => {
                self.election.set(|s| s.last_error = Some(e.to_string()));
                tracing::warn!(error = %e, "cannot renew the election lease");
                false
            }
        }
    }

    /// Stops being master and gives lease `id` up.
    async fn step_down(&mut self, id: i64) {
        tracing::warn!(key = %self.key, lease_id = id, "lost or cannot renew mastership; stepping down");
        self.node.set_mastership(Mastership { is_master: false, master_address: None });
        self.election.set(|s| {
            s.state = "follower";
            s.lease_id = None;
            s.revision = None;
            s.renewed_at = None;
        });
        let revoke = self.etcd.revoke(id);
        let _ = tokio::time::timeout(Duration::from_secs(1), revoke).await;
        self.lease = None;
        self.next_try = None;
    }

    /// A follower's turn: follows the master the key names, or claims the key.
    async fn campaign(&mut self) {
        let outcome = follow_or_campaign(&self.etcd, &self.key, &self.me, self.ttl, &self.clock).await;
        if outcome.is_ok() {
            self.unreached = None;
        }
        match outcome {
            Ok(Outcome::Won { lease: id, revision, at }) => self.take_office(id, revision, at).await,
            Ok(Outcome::Follow(master)) if master == self.me => {
                // A claim left by an earlier run of this server: wait for its lease to expire.
                self.node.set_mastership(Mastership { is_master: false, master_address: None });
            }
            Ok(Outcome::Follow(master)) => {
                if self.node.mastership().master_address.as_deref() != Some(master.as_str()) {
                    tracing::info!(master = %master, "following master");
                }
                self.node.set_mastership(Mastership { is_master: false, master_address: Some(master) });
                self.election.set(|s| {
                    s.state = "follower";
                    s.last_error = None;
                });
            }
            Err(e) => {
                if let Some(n) = self.unreached.as_mut() {
                    *n += 1;
                }
                self.election.set(|s| s.last_error = Some(e.to_string()));
                tracing::warn!(error = %e, "election: etcd unreachable; keeping the last known master");
            }
        }
    }

    /// Becomes master with lease `id`, which created the key at `revision`
    /// and was granted at `at`; gives the claim up when the lease horizon
    /// cannot be recorded.
    async fn take_office(&mut self, id: i64, revision: i64, at: Time) {
        // Before acting as master: what the predecessor may have
        // left outstanding, and a record covering this master's leases.
        let record = match horizon::take_over(&self.etcd, &self.key, &self.node, &self.clock, self.renew_every).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "won the election but cannot record the lease horizon; giving the claim up");
                self.election.set(|s| s.last_error = Some(e.to_string()));
                let give_up = async {
                    let _ = self.etcd.delete_if(&self.key, &self.me).await;
                    let _ = self.etcd.revoke(id).await;
                };
                let _ = tokio::time::timeout(Duration::from_secs(2), give_up).await;
                return;
            }
        };
        tracing::info!(key = %self.key, server_id = %self.me, lease_id = id, revision, "won the election: now master");
        self.node.set_mastership(Mastership { is_master: true, master_address: Some(self.me.clone()) });
        horizon::apply(&self.node, record);
        self.election.set(|s| {
            s.state = "master";
            s.lease_id = Some(id);
            s.revision = Some(revision);
            s.renewed_at = Some(at.as_secs());
            s.last_error = None;
        });
        self.lease = Some((id, at));
        self.next_try = None;
    }

    /// At shutdown, a master deletes its key at once and gives its lease up.
    async fn resign(self) {
        if let Some((id, _)) = self.lease {
            let resign = async {
                let _ = self.etcd.delete_if(&self.key, &self.me).await;
                let _ = self.etcd.revoke(id).await;
            };
            let _ = tokio::time::timeout(Duration::from_secs(2), resign).await;
            tracing::info!(key = %self.key, "resigned mastership");
        }
    }
}

/// What a follower's turn found.
enum Outcome {
    /// This server created the key: its lease, the key's revision, and when the lease was granted.
    Won { lease: i64, revision: i64, at: Time },
    /// The key holds this master's id.
    Follow(String),
}

/// Reads the key, and claims it with a fresh lease when nobody holds it.
async fn follow_or_campaign(
    etcd: &Etcd,
    key: &str,
    me: &str,
    ttl: Duration,
    clock: &Clock,
) -> Result<Outcome, super::etcd::EtcdError> {
    if let Some(master) = etcd.get(key).await? {
        return Ok(Outcome::Follow(master));
    }
    // The lease's TTL runs from its grant: count the step-down deadline from before it.
    let at = clock.now();
    let id = etcd.grant(ttl).await?;
    match etcd.create_if_absent(key, me, id).await? {
        Claim::Won { revision } => Ok(Outcome::Won { lease: id, revision, at }),
        Claim::Held(master) => {
            let _ = etcd.revoke(id).await;
            Ok(Outcome::Follow(master))
        }
    }
}
