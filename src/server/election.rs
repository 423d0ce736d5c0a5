//! Master election on etcd v3, lease-based.
//!
//! A candidate grants itself an etcd lease of `ttl` and creates the election
//! key, holding its advertise address, only if the key does not exist. The
//! winner keeps the lease alive; everyone else reads the key to learn the
//! master and redirects clients there. A master that cannot renew its lease
//! steps down when half the TTL has passed since its last renewal — before
//! etcd can expire the key and let another server win — so two masters never
//! hand out capacity at once. A new master starts with empty state in
//! learning mode. On shutdown the master deletes its key at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::etcd::Etcd;
use super::{Mastership, Node};
use crate::clock::{Clock, Time};

/// Default `--election-ttl`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Default `--election-key`.
pub const DEFAULT_KEY: &str = "/usher/master";

#[derive(Debug, Clone, Default, Serialize)]
pub struct ElectionStatus {
    pub key: String,
    pub ttl_s: u64,
    pub state: &'static str,
    pub lease_id: Option<i64>,
    pub last_error: Option<String>,
}

#[derive(Default)]
pub struct Election {
    status: Mutex<ElectionStatus>,
}

impl Election {
    pub fn status(&self) -> ElectionStatus {
        self.status.lock().expect("election status poisoned").clone()
    }

    fn set(&self, f: impl FnOnce(&mut ElectionStatus)) {
        f(&mut self.status.lock().expect("election status poisoned"));
    }
}

/// Campaigns and follows until `shutdown`.
pub async fn run(
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
    let renew_every = ttl / 3;
    let step_down_after = ttl / 2;
    election.set(|s| {
        s.key = key.clone();
        s.ttl_s = ttl.as_secs();
        s.state = "follower";
    });
    let mut lease: Option<(i64, Time)> = None; // (lease id, last renewal) while master
    loop {
        let wait = if lease.is_some() { renew_every } else { poll };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        match lease {
            Some((id, renewed)) => {
                let ok = match etcd.keep_alive(id).await {
                    Ok(left) if left > 0 => matches!(etcd.get(&key).await, Ok(Some(v)) if v == me),
                    Ok(_) => false,
                    Err(e) => {
                        election.set(|s| s.last_error = Some(e.to_string()));
                        tracing::warn!(error = %e, "cannot renew the election lease");
                        false
                    }
                };
                if ok {
                    lease = Some((id, clock.now()));
                    election.set(|s| s.last_error = None);
                } else if clock.now().since(renewed) >= step_down_after {
                    tracing::warn!(key = %key, "lost or cannot renew mastership; stepping down");
                    node.set_mastership(Mastership { is_master: false, master_address: None });
                    election.set(|s| {
                        s.state = "follower";
                        s.lease_id = None;
                    });
                    let _ = etcd.revoke(id).await;
                    lease = None;
                } else {
                    // Retry soon, still before the step-down deadline.
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(300)) => {}
                    }
                }
            }
            None => match follow_or_campaign(&etcd, &key, &me, ttl).await {
                Ok(Outcome::Won(id)) => {
                    tracing::info!(key = %key, server_id = %me, "won the election: now master (learning mode starts)");
                    node.set_mastership(Mastership { is_master: true, master_address: Some(me.clone()) });
                    election.set(|s| {
                        s.state = "master";
                        s.lease_id = Some(id);
                        s.last_error = None;
                    });
                    lease = Some((id, clock.now()));
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
                    election.set(|s| s.last_error = Some(e.to_string()));
                    tracing::warn!(error = %e, "election: etcd unreachable; keeping the last known master");
                }
            },
        }
    }
    if let Some((id, _)) = lease {
        let _ = etcd.delete_if(&key, &me).await;
        let _ = etcd.revoke(id).await;
        tracing::info!(key = %key, "resigned mastership");
    }
}

enum Outcome {
    Won(i64),
    Follow(String),
}

async fn follow_or_campaign(
    etcd: &Etcd,
    key: &str,
    me: &str,
    ttl: Duration,
) -> Result<Outcome, super::etcd::EtcdError> {
    if let Some(master) = etcd.get(key).await? {
        return Ok(Outcome::Follow(master));
    }
    let id = etcd.grant(ttl).await?;
    match etcd.create_if_absent(key, me, id).await? {
        None => Ok(Outcome::Won(id)),
        Some(master) => {
            let _ = etcd.revoke(id).await;
            Ok(Outcome::Follow(master))
        }
    }
}
