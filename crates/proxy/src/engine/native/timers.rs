//! A connection's timers: the deadline for the next request head, the one
//! for the upstream's answer, and the shutdown signal. The deadlines are
//! lazy (nginx's lazy timers), so a busy connection re-arms its timer once
//! per timeout period, not twice per request.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::Connection;

/// A deadline that moves with every request but whose timer is re-armed
/// only when it fires before the deadline (nginx's lazy timers): one timer
/// registration per timeout period on a busy connection, not two per request.
pub(super) struct Lazy {
    sleep: Pin<Box<Sleep>>,
    deadline: Instant,
}

impl Lazy {
    /// Arms a timer for `deadline`.
    fn new(deadline: Instant) -> Self {
        Lazy { sleep: Box::pin(tokio::time::sleep_until(deadline)), deadline }
    }

    /// Moves the deadline; the timer is touched only if it must fire sooner.
    pub(super) fn set(&mut self, deadline: Instant) {
        self.deadline = deadline;
        if deadline < self.sleep.deadline() {
            self.sleep.as_mut().reset(deadline);
        }
    }

    /// Completes once the deadline has passed.
    pub(super) async fn expired(&mut self) {
        std::future::poll_fn(|cx| {
            while self.sleep.as_mut().poll(cx).is_ready() {
                if self.sleep.deadline() >= self.deadline {
                    return Poll::Ready(());
                }
                let deadline = self.deadline;
                self.sleep.as_mut().reset(deadline);
            }
            Poll::Pending
        })
        .await
    }
}

/// One connection's timers and its shutdown signal, kept across requests.
pub(super) struct Timers {
    /// The next request head (and its small body) must be in by then.
    pub(super) head: Lazy,
    /// The upstream's response head must be in by then.
    pub(super) upstream: Lazy,
    /// Shutdown's end: idle connections close.
    pub(super) closing: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl Timers {
    /// The timers of a connection of `server` whose first request head is due by `deadline`.
    pub(super) fn new(server: &impl Connection, deadline: Instant) -> Self {
        Timers {
            head: Lazy::new(deadline),
            upstream: Lazy::new(deadline),
            closing: Box::pin(server.closing().clone().cancelled_owned()),
        }
    }

    /// Gives the next request head `timeout` from now.
    #[inline]
    #[allow(
        clippy::disallowed_methods,
        reason = "the header timeout is an I/O deadline on tokio's timer, which keeps tokio's time"
    )]
    pub(super) fn next_head(&mut self, timeout: Duration) {
        self.head.set(Instant::now() + timeout);
    }
}
