//! Calls to capacity servers that keep failing, logged when the failures
//! start, then at most once a minute, and once when the servers answer again
//! (a sidecar whose servers are down for an hour logs some 60 lines, not one
//! a second).

use std::fmt::Debug;
use std::time::{Duration, Instant};

/// A run of failed calls of one kind (discovery, refresh).
#[derive(Debug)]
pub struct Failing {
    /// Said once the servers answer again, e.g. "the parent answers again".
    answers_again: &'static str,
    /// When the failures began, how many there were, and when one was last logged.
    run: Option<(Instant, u64, Instant)>,
}

impl Failing {
    /// How often a run of failures is logged after its first.
    pub const EVERY: Duration = Duration::from_secs(60);

    /// No failure yet; `answers_again` is logged when a run of them ends.
    pub fn new(answers_again: &'static str) -> Self {
        Failing { answers_again, run: None }
    }

    /// Counts one call to `server`: failed with `error`, or answered (`None`).
    pub fn saw<E: Debug>(&mut self, server: &str, what: &str, error: Option<&E>) {
        #[allow(
            clippy::disallowed_methods,
            reason = "log lines are paced in real time, a minute apart, whatever clock the caller's logic runs on"
        )]
        let now = Instant::now();
        match (error, &mut self.run) {
            (Some(e), None) => {
                tracing::warn!(server, error = ?e, "{what}");
                self.run = Some((now, 1, now));
            }
            (Some(e), Some((since, n, logged))) => {
                *n += 1;
                if now.duration_since(*logged) >= Self::EVERY {
                    *logged = now;
                    let for_secs = now.duration_since(*since).as_secs();
                    tracing::warn!(server, error = ?e, failures = *n, for_secs, "{what}; still failing");
                } else {
                    tracing::debug!(server, error = ?e, failures = *n, "{what}");
                }
            }
            (None, Some((since, n, _))) => {
                let after_secs = now.duration_since(*since).as_secs();
                tracing::info!(server, failures = *n, after_secs, "{}", self.answers_again);
                self.run = None;
            }
            (None, None) => {}
        }
    }

    /// Whether the last call failed.
    pub fn failing(&self) -> bool {
        self.run.is_some()
    }
}
