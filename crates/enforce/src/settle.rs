//! Settling a route resource's cost from the upstream's answer: the real
//! cost replaces what was charged at admission, the difference charged to
//! the key (a debt later requests wait for) or given back, and counted in
//! its demand.
//!
//! ```yaml
//! resources:
//!   - { resource: llm-tokens, cost: 150, settle: { response_header: x-usage-total-tokens } }
//!   - { resource: llm-tokens, cost: 150, settle: { response_json: usage.total_tokens } }
//! ```
//!
//! A header is read when the answer's head arrives ([`on_answer`]). A JSON
//! body is never held back: the engines copy its bytes, as they relay them
//! to the app, into a buffer of at most [`MAX_JSON_BODY`] ([`BodySettle`],
//! which the request's `Held` carries), and once its last bytes are in hand
//! it is read before they are written, so the app's next request finds the
//! key settled. A body that cannot be read (compressed, a stream, too
//! large, not JSON, without the path, or cut short) keeps the admission's
//! charge; each outcome is counted (`usher_proxy_settles_total`) and each
//! reason warned about once per route and resource.

use std::fmt;
use std::sync::Arc;

use http::StatusCode;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::metrics::SettleOutcome;
use crate::resource::{RouteResource, Settle};
use usher_core::config::quota::decimal;
use usher_core::config::routes::{JsonPath, SettleFrom};
use usher_limit::admit::Plan;

/// The largest JSON body read for a settled cost (256 KiB): a larger one
/// is relayed all the same, and its admission's charge stands.
pub const MAX_JSON_BODY: usize = 256 * 1024;

/// Settles the costs the answer's head carries, and returns what reads
/// the body for the costs it carries (none when the route reads no body,
/// or the head says it cannot be read: those keep their charge).
pub fn on_answer<'a>(
    resources: &Arc<[RouteResource]>,
    plan: &Plan,
    status: StatusCode,
    header: &impl Fn(&str) -> Option<&'a [u8]>,
) -> Option<Box<BodySettle>> {
    let success = status.is_success();
    if !from_headers(resources, plan, status, header) {
        return None;
    }
    let length =
        header("content-length").and_then(|v| std::str::from_utf8(v).ok()).and_then(|v| v.trim().parse::<u64>().ok());
    if let Some((outcome, why)) = unreadable(header, length) {
        for (_, s) in json_rules(resources) {
            record(s, failed(outcome, success), format_args!("{why}"));
        }
        return None;
    }
    let room = length.map_or(0, |n| usize::try_from(n).unwrap_or(MAX_JSON_BODY).min(MAX_JSON_BODY));
    Some(Box::new(BodySettle {
        resources: resources.clone(),
        plan: plan.clone(),
        body: Copied { bytes: Vec::with_capacity(room), over: false },
        success,
        done: false,
    }))
}

/// Settles the costs `resources` read from the answer's headers; true if
/// any reads the body instead.
pub(crate) fn from_headers<'a>(
    resources: &[RouteResource],
    plan: &Plan,
    status: StatusCode,
    header: &impl Fn(&str) -> Option<&'a [u8]>,
) -> bool {
    let mut json = false;
    for r in resources {
        let Some(s) = &r.settle else { continue };
        let SettleFrom::Header(name) = &s.from else {
            json = true;
            continue;
        };
        match header(name).and_then(decimal).filter(|v| v.is_finite() && *v >= 0.0) {
            Some(real) => charge(plan, r, s, real),
            None => record(
                s,
                failed(SettleOutcome::Missing, status.is_success()),
                format_args!("the answer has no `{name}` header holding a number of at least 0"),
            ),
        }
    }
    json
}

/// Why the head says the body cannot be read for a cost, if it does.
fn unreadable<'a>(header: &impl Fn(&str) -> Option<&'a [u8]>, length: Option<u64>) -> Option<(SettleOutcome, String)> {
    let value = |name| header(name).map(<[u8]>::trim_ascii);
    if let Some(coding) = value("content-encoding").filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity")) {
        let why = format!(
            "the answer is compressed (content-encoding: {}) and usher reads only uncompressed bodies; \
             have the app ask for none (accept-encoding: identity)",
            String::from_utf8_lossy(coding)
        );
        return Some((SettleOutcome::Encoded, why));
    }
    let stream = b"text/event-stream";
    if value("content-type").is_some_and(|t| t.get(..stream.len()).is_some_and(|t| t.eq_ignore_ascii_case(stream))) {
        let why = "the answer is a stream of events (text/event-stream), which is not settled from JSON; \
                   settle streamed answers from a header (response_header)";
        return Some((SettleOutcome::Streaming, why.into()));
    }
    match length {
        Some(n) if n > MAX_JSON_BODY as u64 => Some((SettleOutcome::TooLarge, too_large())),
        _ => None,
    }
}

fn too_large() -> String {
    format!("the answer's body is over {} KiB, the most read for a settled cost", MAX_JSON_BODY / 1024)
}

/// The resources whose cost the JSON body settles.
fn json_rules(resources: &[RouteResource]) -> impl Iterator<Item = (&RouteResource, &Settle)> {
    resources.iter().filter_map(|r| match &r.settle {
        Some(s) if matches!(s.from, SettleFrom::Json(_)) => Some((r, &**s)),
        _ => None,
    })
}

/// An answer other than 2xx that does not carry its cost is no mistake
/// (an error body has no usage): it counts as `status`, unwarned.
fn failed(outcome: SettleOutcome, success: bool) -> SettleOutcome {
    if success { outcome } else { SettleOutcome::Status }
}

/// Charges the difference between the real cost and what `r`'s keys were
/// charged at admission (or gives it back), and counts it in their demand.
fn charge(plan: &Plan, r: &RouteResource, s: &Settle, real: f64) {
    for (l, charged) in r.keys_in(plan) {
        l.charge(real - charged);
        l.demand().settle(real - charged);
    }
    s.metrics.count(SettleOutcome::Settled);
}

/// Counts an answer whose cost was not settled, logs it, and warns the
/// first time a route's resource fails so for this reason. `why` is
/// formatted only if it is written: an upstream that never sends the header
/// a cost is settled from costs a counter per answer, not a string.
#[cold]
fn record(s: &Settle, outcome: SettleOutcome, why: fmt::Arguments<'_>) {
    let (route, resource) = (&s.metrics.route, &s.metrics.resource);
    let first = s.metrics.count(outcome);
    // A field is built only when debug is on: `why` is a string there, as it was.
    tracing::debug!(
        route,
        resource,
        outcome = outcome.label(),
        why = why.to_string().as_str(),
        "cost not settled; the admission's charge stands"
    );
    if first && !matches!(outcome, SettleOutcome::Status | SettleOutcome::Empty) {
        tracing::warn!(
            route,
            resource,
            outcome = outcome.label(),
            "cost not settled: {why}; the admission's charge stands \
             (said once per route, resource and reason; usher_proxy_settles_total counts them)"
        );
    }
}

// === impl BodySettle ===

/// A JSON answer's body, copied as it is relayed to the app, up to
/// [`MAX_JSON_BODY`], for the costs it settles. Dropped before
/// [`BodySettle::finish`] (the app left, the upstream cut the body), the
/// charges stand and count as `incomplete`.
pub struct BodySettle {
    resources: Arc<[RouteResource]>,
    plan: Plan,
    body: Copied,
    /// The answer's status is 2xx.
    success: bool,
    done: bool,
}

impl BodySettle {
    /// Copies the next bytes of the body (de-chunked).
    pub fn push(&mut self, data: &[u8]) {
        self.body.push(data);
    }

    /// The body has ended: reads each cost it settles and charges the difference.
    pub fn finish(mut self) {
        self.done = true;
        let success = self.success;
        for (r, s) in json_rules(&self.resources) {
            let SettleFrom::Json(path) = &s.from else { continue };
            let (outcome, why) = match (self.body.over, self.body.bytes.is_empty()) {
                (true, _) => (SettleOutcome::TooLarge, too_large()),
                (_, true) => (SettleOutcome::Empty, "the answer's body is empty".to_string()),
                _ => match find(&self.body.bytes, path) {
                    Ok(Some(real)) => {
                        charge(&self.plan, r, s, real);
                        continue;
                    }
                    Ok(None) => (
                        SettleOutcome::Missing,
                        format!("the answer's JSON has no number of at least 0 at `{}`", path.text),
                    ),
                    Err(e) => (SettleOutcome::NotJson, format!("the answer's body is not JSON ({e})")),
                },
            };
            record(s, failed(outcome, success), format_args!("{why}"));
        }
    }
}

/// A body's bytes, up to [`MAX_JSON_BODY`].
struct Copied {
    bytes: Vec<u8>,
    /// The body passed the limit: what came is dropped, the rest ignored.
    over: bool,
}

impl Copied {
    fn push(&mut self, data: &[u8]) {
        if self.over {
            return;
        }
        if self.bytes.len() + data.len() > MAX_JSON_BODY {
            self.over = true;
            self.bytes = Vec::new();
            return;
        }
        self.bytes.extend_from_slice(data);
    }
}

impl Drop for BodySettle {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let why = "the answer's body did not end (the app left, or the upstream cut it)";
        for (_, s) in json_rules(&self.resources) {
            record(s, failed(SettleOutcome::Incomplete, self.success), format_args!("{why}"));
        }
    }
}

// === the JSON path ===

/// The number of at least 0 at `path` in the JSON document `body`: `None`
/// when there is none, `Err` when `body` is not one JSON document. Only the
/// path's values are looked at; everything else is skipped unbuilt.
pub fn find(body: &[u8], path: &JsonPath) -> Result<Option<f64>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = Find(&path.steps).deserialize(&mut de)?;
    de.end()?;
    Ok(found.filter(|v| v.is_finite() && *v >= 0.0))
}

/// Follows the rest of a path into the value being read.
struct Find<'p>(&'p [String]);

impl<'de> DeserializeSeed<'de> for Find<'_> {
    type Value = Option<f64>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Find<'_> {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<f64>, A::Error> {
        let Some((step, rest)) = self.0.split_first() else {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            return Ok(None);
        };
        let mut found = None;
        while let Some(matches) = map.next_key_seed(KeyIs(step))? {
            match matches {
                // A key given twice: the last one counts, as in most parsers.
                true => found = map.next_value_seed(Find(rest))?,
                false => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<f64>, A::Error> {
        let at = self.0.split_first().and_then(|(step, rest)| Some((step.parse::<usize>().ok()?, rest)));
        let (mut found, mut i) = (None, 0);
        loop {
            let more = match at {
                Some((index, rest)) if i == index => match seq.next_element_seed(Find(rest))? {
                    Some(f) => {
                        found = f;
                        true
                    }
                    None => false,
                },
                _ => seq.next_element::<IgnoredAny>()?.is_some(),
            };
            if !more {
                return Ok(found);
            }
            i += 1;
        }
    }

    fn visit_u64<E>(self, v: u64) -> Result<Option<f64>, E> {
        Ok(self.0.is_empty().then_some(v as f64))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Option<f64>, E> {
        Ok(self.0.is_empty().then_some(v as f64))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Option<f64>, E> {
        Ok(self.0.is_empty().then_some(v))
    }

    fn visit_str<E>(self, _: &str) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Option<f64>, E> {
        Ok(None)
    }
}

/// Whether an object key is the path's next step, compared without
/// building the key (unless it has escapes).
struct KeyIs<'p>(&'p str);

impl<'de> DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, v: &str) -> Result<bool, E> {
        Ok(v == self.0)
    }
}

#[cfg(test)]
mod tests;
