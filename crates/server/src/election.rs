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
    // While master: the lease id, when the last successful renewal was *sent*
    // (etcd restarted the lease's TTL no earlier than that), and when to try next.
    let mut lease: Option<(i64, Time)> = None;
    let mut next_try: Option<Time> = None;
    // The first campaign goes at once: a fresh tree (etcd, servers and
    // sidecars started together) waited a whole poll (2 s) for its masters.
    let mut campaigned = false;
    // Until etcd first answers, campaigns retry 200 ms, 400 ms, ... apart, up
    // to a poll: in a fresh tree etcd starts with the servers and answers a
    // second or two later, and a whole poll (2 s) after that was added to
    // every sidecar's first admitted request. `None` once etcd answered.
    let mut unreached: Option<u32> = Some(0);
    loop {
        let wait = match (lease, next_try) {
            (Some(_), Some(at)) => at.since(clock.now()),
            (Some((_, renewed)), None) => (renewed.saturating_add(renew_every)).since(clock.now()),
            (None, _) if !campaigned => Duration::ZERO,
            (None, _) => match unreached {
                Some(n) => (Duration::from_millis(200) * 2u32.saturating_pow(n.saturating_sub(1))).min(poll),
                None => poll,
            },
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        campaigned |= lease.is_none();
        match lease {
            Some((id, renewed)) => {
                let sent = clock.now();
                let renew = async {
                    match etcd.keep_alive(id).await {
                        Ok(left) if left > 0 => {
                            let still = matches!(etcd.get(&key).await, Ok(Some(v)) if v == me);
                            if still && let Err(e) = horizon::renew(&etcd, &key, &node, &clock, renew_every).await {
                                // Leases now end at the last time recorded.
                                tracing::warn!(error = %e, "cannot record until when leases may be outstanding");
                            }
                            still
                        }
                        Ok(_) => false,
                        Err(e) => {
                            election.set(|s| s.last_error = Some(e.to_string()));
                            tracing::warn!(error = %e, "cannot renew the election lease");
                            false
                        }
                    }
                };
                // Fencing: an etcd that does not answer must not keep this server
                // master past its step-down deadline, however long a call hangs.
                let left = step_down_after.saturating_sub(clock.now().since(renewed));
                let ok = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    ok = renew => ok,
                    _ = tokio::time::sleep(left) => false,
                };
                if ok {
                    lease = Some((id, sent));
                    next_try = None;
                    election.set(|s| {
                        s.last_error = None;
                        s.renewed_at = Some(sent.as_secs());
                    });
                } else if clock.now().since(renewed) >= step_down_after {
                    tracing::warn!(key = %key, lease_id = id, "lost or cannot renew mastership; stepping down");
                    node.set_mastership(Mastership { is_master: false, master_address: None });
                    election.set(|s| {
                        s.state = "follower";
                        s.lease_id = None;
                        s.revision = None;
                        s.renewed_at = None;
                    });
                    let revoke = etcd.revoke(id);
                    let _ = tokio::time::timeout(Duration::from_secs(1), revoke).await;
                    lease = None;
                    next_try = None;
                } else {
                    // Retry soon, still before the step-down deadline.
                    let deadline = renewed.saturating_add(step_down_after);
                    let soon = clock.now().saturating_add(Duration::from_millis(300));
                    next_try = Some(if soon < deadline { soon } else { deadline });
                }
            }
            None => match follow_or_campaign(&etcd, &key, &me, ttl, &clock).await.inspect(|_| unreached = None) {
                Ok(Outcome::Won { lease: id, revision, at }) => {
                    // Before acting as master: what the predecessor may have
                    // left outstanding, and a record covering this master's leases.
                    let record = match horizon::take_over(&etcd, &key, &node, &clock, renew_every).await {
                        Ok(r) => r,
                        Err(e) => {
                            tracing::warn!(error = %e, "won the election but cannot record the lease horizon; giving the claim up");
                            election.set(|s| s.last_error = Some(e.to_string()));
                            let give_up = async {
                                let _ = etcd.delete_if(&key, &me).await;
                                let _ = etcd.revoke(id).await;
                            };
                            let _ = tokio::time::timeout(Duration::from_secs(2), give_up).await;
                            continue;
                        }
                    };
                    tracing::info!(key = %key, server_id = %me, lease_id = id, revision, "won the election: now master");
                    node.set_mastership(Mastership { is_master: true, master_address: Some(me.clone()) });
                    horizon::apply(&node, record);
                    election.set(|s| {
                        s.state = "master";
                        s.lease_id = Some(id);
                        s.revision = Some(revision);
                        s.renewed_at = Some(at.as_secs());
                        s.last_error = None;
                    });
                    lease = Some((id, at));
                    next_try = None;
                }
                Ok(Outcome::Follow(master)) if master == me => {
                    // A claim left by an earlier run of this server: wait for its lease to expire.
                    node.set_mastership(Mastership { is_master: false, master_address: None });
                }
                Ok(Outcome::Follow(master)) => {
                    if node.mastership().master_address.as_deref() != Some(master.as_str()) {
                        tracing::info!(master = %master, "following master");
                    }
                    node.set_mastership(Mastership { is_master: false, master_address: Some(master) });
                    election.set(|s| {
                        s.state = "follower";
                        s.last_error = None;
                    });
                }
                Err(e) => {
                    if let Some(n) = unreached.as_mut() {
                        *n += 1;
                    }
                    election.set(|s| s.last_error = Some(e.to_string()));
                    tracing::warn!(error = %e, "election: etcd unreachable; keeping the last known master");
                }
            },
        }
    }
    if let Some((id, _)) = lease {
        let resign = async {
            let _ = etcd.delete_if(&key, &me).await;
            let _ = etcd.revoke(id).await;
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), resign).await;
        tracing::info!(key = %key, "resigned mastership");
    }
}

enum Outcome {
    /// This server created the key: its lease, the key's revision, and when the lease was granted.
    Won {
        lease: i64,
        revision: i64,
        at: Time,
    },
    Follow(String),
}

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
