//! [`LimitLayer`]: wraps a service in the limit stage.

use tower::Layer;

use super::Limit;
use usher_core::clock::Clock;

/// Admits requests by the limiters' clock.
#[derive(Clone)]
pub struct LimitLayer {
    clock: Clock,
}

impl LimitLayer {
    /// A limit stage that admits by `clock`.
    #[inline]
    pub(in crate::pipeline) fn new(clock: Clock) -> Self {
        LimitLayer { clock }
    }
}

impl<S> Layer<S> for LimitLayer {
    type Service = Limit<S>;
    fn layer(&self, inner: S) -> Limit<S> {
        Limit::new(inner, self.clock.clone())
    }
}
