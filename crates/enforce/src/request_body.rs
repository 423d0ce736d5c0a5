//! What the sidecar reads of a request's body, for a route that needs it:
//! costs taken from its JSON (`cost: "{json.PATH}"`, `cost: { estimate:
//! API }`), and OpenAI's usage asked for on the app's behalf (a route that
//! settles from it, `settle: { usage: openai }`).
//!
//! ```yaml
//! resources:
//!   - { resource: llm-budget, cost: "{json.max_tokens}", default_cost: 500 }
//!   - { resource: llm-tokens, cost: { estimate: openai }, settle: { usage: openai } }
//! ```
//!
//! The engine reads the body before admission, up to [`MAX_REQUEST_BODY`]
//! bytes, and [`read`] works out the plan's costs from it and the body to
//! send instead, if any. A body that is not JSON, empty, or over the bound
//! is forwarded as it came and its costs fall back (`default_cost`, or an
//! estimate's fallback); each outcome is counted
//! (`usher_proxy_request_body_total`). Routes that read no body never come
//! here.

pub mod estimate;
pub mod include_usage;

use std::sync::Arc;

use serde_json::Value;

use crate::metrics::BodyOutcome;
use crate::resource::RouteResource;
use usher_limit::{Limiter, Plan};

/// The most of a request body read for its costs or to ask for usage
/// (1 MiB): a larger one is forwarded as it is, its costs fall back.
pub const MAX_REQUEST_BODY: usize = 1024 * 1024;

/// A request's body as the engine read it.
#[derive(Debug, Clone, Copy)]
pub enum Body<'a> {
    /// The whole body (empty when the request has none).
    Whole(&'a [u8]),
    /// A body over [`MAX_REQUEST_BODY`].
    TooLarge,
}

/// What a request's body makes of it.
#[derive(Debug)]
pub struct Read {
    /// The plan with the costs the body gives, when a resource takes one from it.
    pub plan: Option<Plan>,
    /// The body to send instead of the app's (`include_usage` added).
    pub body: Option<Vec<u8>>,
    /// What became of the body, for `usher_proxy_request_body_total`.
    pub outcome: BodyOutcome,
}

/// Reads `body` for the route whose `resources` admitted it by `plan`:
/// the costs its resources take from it, and, with `ask_usage`, the body
/// with OpenAI's usage asked for when it is a streamed Chat Completions call
/// that did not ask ([`include_usage`]).
pub fn read(resources: &[RouteResource], plan: &Plan, body: Body<'_>, ask_usage: bool) -> Read {
    let (doc, outcome) = match body {
        Body::TooLarge => (None, BodyOutcome::TooLarge),
        Body::Whole([]) => (None, BodyOutcome::Empty),
        Body::Whole(b) => match serde_json::from_slice::<Value>(b) {
            Ok(doc) => (Some(doc), BodyOutcome::Read),
            Err(_) => (None, BodyOutcome::NotJson),
        },
    };
    let Some(doc) = doc else {
        // The costs the plan was made with are the fallbacks already.
        return Read { plan: None, body: None, outcome };
    };
    let plan = resources.iter().any(RouteResource::reads_body).then(|| recost(resources, plan, &doc));
    let added = match body {
        Body::Whole(b) if ask_usage && include_usage::wanted(&doc) => include_usage::add(b),
        _ => None,
    };
    let outcome = if added.is_some() { BodyOutcome::UsageAdded } else { outcome };
    Read { plan, body: added, outcome }
}

/// `plan` with each key of a resource that takes its cost from the body
/// charged what `doc` gives; the keys keep their order.
fn recost(resources: &[RouteResource], plan: &Plan, doc: &Value) -> Plan {
    let cost = |(l, c): &(Arc<Limiter>, f64)| {
        let r = resources.iter().find(|r| r.reads_body() && r.owns(l));
        (l.clone(), r.map_or(*c, |r| r.body_cost(doc)))
    };
    Plan { items: plan.items.iter().map(cost).collect(), shadow: plan.shadow.iter().map(cost).collect() }
}

/// The number at `path` in `doc`: each step an object's key, or an array's
/// index (as `settle: { response_json }` reads it).
pub fn number_at(doc: &Value, path: &usher_core::config::routes::JsonPath) -> Option<f64> {
    let mut at = doc;
    for step in &path.steps {
        at = match at {
            Value::Object(m) => m.get(step)?,
            Value::Array(a) => a.get(step.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    at.as_f64()
}

#[cfg(test)]
mod tests;
