//! usher's limiter inside your own Rust service: lease capacity from a
//! Doorman tree (real `usher server`s, or an embedded capacity server) and
//! enforce it in-process, with no sidecar hop.
//!
//! - [`Limits`]: the lease-client handle. It enforces the resources of a
//!   routes file's `resources:` section and leases their capacity from the
//!   servers its `doorman:` section names, or, without one, from an embedded
//!   capacity server ([`Source`] tells which). Same code, same settings and
//!   same defaults as `usher proxy` (README, "The routes file").
//! - [`LimitLayer`]: a tower layer admitting each request by one resource
//!   (a templated id is rendered from the request, as in the sidecar), and
//!   answering a refusal itself with the ready-made response.
//! - [`Refusal`]: a typed refusal, with that response: `429` with
//!   `Retry-After`, `RateLimit-Policy`, `RateLimit` and a problem+json body,
//!   or for gRPC requests `grpc-status: 8` (RESOURCE_EXHAUSTED).
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use usher::embed::Limits;
//!
//! // No `doorman:` section: an embedded capacity server hands out the capacity.
//! // Add `doorman: { servers: [capacity:15100], client_id: my-service }` to
//! // lease it from usher servers instead.
//! let config = usher::config::routes::RoutesConfig::parse(
//!     "limits.yaml",
//!     "resources:\n  api: { kind: rate, capacity: 2/s, burst: 2 }\n",
//! )
//! .unwrap();
//! let limits = Limits::start(config).await;
//!
//! let hello = tower::service_fn(|_req: http::Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(bytes::Bytes::from("hello"))))
//! });
//! let mut svc = ServiceBuilder::new().layer(limits.layer("api").unwrap()).service(hello);
//! let mut statuses = Vec::new();
//! for _ in 0..3 {
//!     let req = http::Request::new(String::new());
//!     statuses.push(svc.ready().await.unwrap().call(req).await.unwrap().status().as_u16());
//! }
//! // A burst of 2, then the third is refused with the ready-made 429.
//! assert_eq!(statuses, [200, 200, 429]);
//! limits.shutdown().await;
//! # });
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio_util::sync::CancellationToken;
use tower::{Layer, Service};

use crate::clock::Clock;
use crate::config::routes::{IdTemplate, RoutesConfig};
use crate::lease::LeaseClient;
use crate::limit::admit::{self, Admission, Admitted, Plan};
use crate::limit::layer::BoxError;
use crate::limit::{LeaseTable, Limiter, ResourceLimits};
use crate::proxy::respond::{self, ProxyError};
use crate::proxy::{ProxyBody, lease, pushback, route};

pub use crate::limit::Refused;

/// How long [`Limits::start`] waits for the first leases before enforcing
/// the resources' `on_expiry` capacity (as `usher proxy` does).
pub const FIRST_LEASE_WAIT: Duration = crate::proxy::FIRST_LEASE_WAIT;

/// Where capacity comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An in-process capacity server, configured from the resources' capacities.
    Embedded,
    /// These Doorman (or `usher server`) addresses, as `client_id`.
    Remote { servers: Vec<String>, client_id: String },
}

/// The lease-client handle: the resources it enforces and the lease client
/// that keeps their capacity. Cheap to clone.
#[derive(Clone)]
pub struct Limits {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<RoutesConfig>,
    table: Arc<LeaseTable>,
    client: LeaseClient,
    clock: Clock,
    stop: CancellationToken,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Limits {
    /// Starts enforcing `config`'s resources and leasing their capacity;
    /// returns once the first leases are in, or after [`FIRST_LEASE_WAIT`]
    /// (from then on a key without a lease follows its `on_expiry`).
    /// Needs a tokio runtime.
    pub async fn start(config: RoutesConfig) -> Limits {
        let clock = Clock::system();
        let table = Arc::new(LeaseTable::new(clock.clone()));
        table.configure(route::specs(&config));
        let registry = prometheus::Registry::new();
        let pushback = Arc::new(pushback::Pushback::new(&registry));
        let config = Arc::new(config);
        let source = config.clone();
        let stop = CancellationToken::new();
        let (client, task) =
            lease::start_with(Arc::new(move || source.clone()), table.clone(), pushback, &registry, stop.clone());
        // Every key leased (at once from a cache), or the first call answered or failed, or the wait over.
        client.ready(FIRST_LEASE_WAIT).await;
        Limits {
            inner: Arc::new(Inner { config, table, client, clock, stop, task: std::sync::Mutex::new(Some(task)) }),
        }
    }

    /// Where capacity comes from.
    pub fn source(&self) -> Source {
        match &self.inner.config.doorman {
            None => Source::Embedded,
            Some(d) => Source::Remote { servers: d.servers.clone(), client_id: d.client_id.clone() },
        }
    }

    /// The lease client: its status (master, last error, each key's lease).
    pub fn lease_client(&self) -> &LeaseClient {
        &self.inner.client
    }

    /// The capacity `id` (a resource id) may use now: units per second
    /// (rate) or in flight (gauge); `None` for an id nothing has used yet.
    pub fn capacity(&self, id: &str) -> Option<f64> {
        self.inner.table.limiters().into_iter().find(|(_, l)| l.id() == id).map(|(_, l)| l.capacity())
    }

    /// A tower layer admitting every request by `resource`, one unit each.
    pub fn layer(&self, resource: &str) -> Result<LimitLayer, UnknownResource> {
        self.layer_with_cost(resource, 1.0)
    }

    /// A tower layer admitting every request by `resource`, `cost` units each.
    pub fn layer_with_cost(&self, resource: &str, cost: f64) -> Result<LimitLayer, UnknownResource> {
        let limits = self.inner.table.resource(resource).ok_or_else(|| UnknownResource(resource.to_string()))?;
        let template = self.inner.config.resources[resource].id.clone();
        let fixed = template.is_fixed().then(|| Plan::new(vec![(limits.limiter(&template.text), cost)]));
        Ok(LimitLayer {
            resource: Arc::new(Resource { limits, template, cost, fixed, clock: self.inner.clock.clone() }),
        })
    }

    /// Admits `cost` units of `resource` (a fixed id) outside any tower
    /// stack; the admission holds gauge permits until dropped.
    pub async fn admit(&self, resource: &str, cost: f64) -> Result<Admitted, Refusal> {
        let limits = self.inner.table.resource(resource).ok_or_else(|| Refusal::unknown(resource))?;
        let plan = Plan::new(vec![(limits.limiter(&self.inner.config.resources[resource].id.text), cost)]);
        admit::start(&plan, &self.inner.clock).await.map_err(Refusal::Refused)
    }

    /// Stops leasing and gives every lease back to its server.
    pub async fn shutdown(self) {
        self.inner.stop.cancel();
        let task = self.inner.task.lock().expect("task lock").take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A resource the configuration does not name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no resource `{0}` in the configuration")]
pub struct UnknownResource(pub String);

/// Why a request was not admitted, and the answer to give it.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// No capacity in time (or too many waiting, or capacity 0).
    #[error("{0}")]
    Refused(Refused),
    /// Routing-side refusals: a templated resource at its `max_keys`, an unknown resource.
    #[error("{0}")]
    Other(ProxyError),
}

impl Refusal {
    fn unknown(resource: &str) -> Self {
        Refusal::Other(ProxyError::BadRequest(UnknownResource(resource.to_string()).to_string()))
    }

    /// The ready-made answer: `429` with `Retry-After`, `RateLimit-Policy`,
    /// `RateLimit` and a problem+json body, or for gRPC (`grpc`) a
    /// trailers-only `RESOURCE_EXHAUSTED`.
    pub fn response(&self, grpc: bool) -> Response<ProxyBody> {
        match self {
            Refusal::Refused(r) => respond::refused(r, grpc),
            Refusal::Other(e) => respond::proxy_error(e, grpc),
        }
    }
}

/// One resource as a layer admits by it.
struct Resource {
    limits: Arc<ResourceLimits>,
    template: IdTemplate,
    cost: f64,
    /// The plan of a fixed id: the same for every request.
    fixed: Option<Plan>,
    clock: Clock,
}

impl Resource {
    fn plan<B>(&self, req: &Request<B>) -> Result<Plan, ProxyError> {
        if let Some(p) = &self.fixed {
            return Ok(p.clone());
        }
        let limiter: Arc<Limiter> =
            route::templated_limiter(&self.limits, &self.template, req, &route::request_host(req))?;
        Ok(Plan::new(vec![(limiter, self.cost)]))
    }
}

/// Admits requests by one resource (see [`Limits::layer`]). Every clone
/// shares one budget: the limiter state lives in the [`Limits`], never here.
#[derive(Clone)]
pub struct LimitLayer {
    resource: Arc<Resource>,
}

impl<S> Layer<S> for LimitLayer {
    type Service = Limit<S>;
    fn layer(&self, inner: S) -> Limit<S> {
        Limit { inner, resource: self.resource.clone() }
    }
}

/// The service [`LimitLayer`] makes.
#[derive(Clone)]
pub struct Limit<S> {
    inner: S,
    resource: Arc<Resource>,
}

impl<S, B, RB> Service<Request<B>> for Limit<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone,
    RB: Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    type Response = Response<LimitBody<RB>>;
    type Error = S::Error;
    type Future = LimitFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let grpc = respond::is_grpc(req.headers());
        let plan = match self.resource.plan(&req) {
            Ok(p) => p,
            Err(e) => return LimitFuture::Answered { resp: Some(respond::proxy_error(&e, grpc)) },
        };
        // The ready service goes with the request; a clone stays for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        LimitFuture::Admitting {
            admission: admit::start(&plan, &self.resource.clock),
            pending: Some((inner, req)),
            grpc,
        }
    }
}

pin_project! {
    /// Admits, then calls the inner service.
    #[project = LimitProj]
    pub enum LimitFuture<S: Service<Request<B>>, B> {
        Answered { resp: Option<Response<ProxyBody>> },
        Admitting { admission: Admission, pending: Option<(S, Request<B>)>, grpc: bool },
        Calling { #[pin] fut: S::Future, admitted: Option<Admitted> },
    }
}

impl<S, B, RB> Future for LimitFuture<S, B>
where
    S: Service<Request<B>, Response = Response<RB>>,
{
    type Output = Result<Response<LimitBody<RB>>, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match self.as_mut().project() {
                LimitProj::Answered { resp } => {
                    let resp = resp.take().expect("polled after completion");
                    return Poll::Ready(Ok(resp.map(|body| LimitBody::Refused { body })));
                }
                LimitProj::Admitting { admission, pending, grpc } => {
                    let grpc = *grpc;
                    match ready!(Pin::new(admission).poll(cx)) {
                        Ok(a) => {
                            let (mut svc, req) = pending.take().expect("request pending");
                            let fut = svc.call(req);
                            self.set(LimitFuture::Calling { fut, admitted: Some(a) });
                        }
                        Err(r) => {
                            let resp = Refusal::Refused(r).response(grpc);
                            self.set(LimitFuture::Answered { resp: Some(resp) });
                        }
                    }
                }
                LimitProj::Calling { fut, admitted } => {
                    let resp = ready!(fut.poll(cx))?;
                    let admitted = admitted.take();
                    return Poll::Ready(Ok(resp.map(|body| LimitBody::Admitted { body, admitted })));
                }
            }
        }
    }
}

pin_project! {
    /// A limited service's response body: the inner one, holding the
    /// admission (gauge permits) until it ends, or a refusal's.
    #[project = BodyProj]
    pub enum LimitBody<B> {
        Admitted { #[pin] body: B, admitted: Option<Admitted> },
        Refused { #[pin] body: ProxyBody },
    }
}

impl<B> Body for LimitBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            BodyProj::Admitted { body, admitted } => {
                let frame = ready!(body.poll_frame(cx));
                if !matches!(frame, Some(Ok(_))) {
                    *admitted = None;
                }
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            BodyProj::Refused { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            LimitBody::Admitted { body, .. } => body.is_end_stream(),
            LimitBody::Refused { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            LimitBody::Admitted { body, .. } => body.size_hint(),
            LimitBody::Refused { body } => body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests;
