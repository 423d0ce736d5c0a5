//! Settling a route resource's cost from the upstream's answer: the real
//! cost replaces what was charged at admission, the difference charged to
//! the key (a debt later requests wait for) or given back, and counted in
//! its demand.
//!
//! ```yaml
//! resources:
//!   - { resource: llm-tokens, cost: 150, settle: { response_header: x-usage-total-tokens } }
//!   - { resource: llm-tokens, cost: 150, settle: { response_json: usage.total_tokens } }
//!   - { resource: llm-tokens, cost: 150, settle: { usage: openai } }
//! ```
//!
//! A header is read when the answer's head arrives ([`on_answer`]). A body
//! is never held back: the engines hand its bytes, as they relay them to
//! the app, to a [`BodySettle`] (which the request's `Held` carries). A JSON
//! body is copied, up to [`MAX_JSON_BODY`], and read once its last bytes
//! are in hand, before they are written, so the app's next request finds
//! the key settled. A stream of server-sent events (`text/event-stream`) is
//! read event by event as it passes (`events`), keeping one event at most:
//! a JSON path's number is the last event's that has one, and token counts
//! ([`usage`](usher_core::config::usage)) are merged over the events.
//!
//! A request whose usage usher asked for on the app's behalf
//! (`usage_injected`) has that usage taken out of its stream again
//! (`hide`): the engines then relay what [`BodySettle::edit`] gives them.
//!
//! A body that cannot be read (compressed, too large, not JSON, without the
//! cost, or cut short) keeps the admission's charge; each outcome is
//! counted (`usher_proxy_settles_total`) and each reason warned about once
//! per route and resource. An app that leaves a stream does not end it:
//! the engines read on ([`BodySettle::left`]), and the answer counts as
//! `client_gone`, settled if its cost came in time.

use std::fmt;
use std::sync::Arc;

use http::StatusCode;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::metrics::SettleOutcome;
use crate::resource::{RouteResource, Settle};
use events::{Scanner, Verdict};
use usher_core::config::quota::decimal;
use usher_core::config::routes::{JsonPath, SettleFrom};
use usher_core::config::usage::UsageRule;
use usher_limit::admit::Plan;

pub use events::MAX_EVENT;

/// The largest JSON body read for a settled cost (256 KiB): a larger one
/// is relayed all the same, and its admission's charge stands.
pub const MAX_JSON_BODY: usize = 256 * 1024;

/// The most bytes of a stream the engines read on after its app left (16
/// MiB), for its cost; within the route's upstream `timeout` too.
pub const MAX_READ_ON: u64 = 16 * 1024 * 1024;

/// Settles the costs the answer's head carries, and returns what reads
/// the body for the costs it carries (none when the route reads no body,
/// or the head says it cannot be read: those keep their charge).
/// `usage_injected`: usher asked for the usage the app did not, and takes
/// it out of a stream again.
pub fn on_answer<'a>(
    resources: &Arc<[RouteResource]>,
    plan: &Plan,
    status: StatusCode,
    header: &impl Fn(&str) -> Option<&'a [u8]>,
    usage_injected: bool,
) -> Option<Box<BodySettle>> {
    let success = status.is_success();
    if !from_headers(resources, plan, status, header) {
        return None;
    }
    let length =
        header("content-length").and_then(|v| std::str::from_utf8(v).ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let stream = is_event_stream(header);
    if let Some((outcome, why)) = unreadable(header, length, stream) {
        for (_, s) in body_rules(resources) {
            record(s, failed(outcome, success), format_args!("{why}"));
        }
        return None;
    }
    let body = match stream {
        true => Body::Events(Box::new(Events::new(resources, usage_injected))),
        false => {
            let room = length.map_or(0, |n| usize::try_from(n).unwrap_or(MAX_JSON_BODY).min(MAX_JSON_BODY));
            Body::Json(Copied { bytes: Vec::with_capacity(room), over: false })
        }
    };
    Some(Box::new(BodySettle {
        resources: resources.clone(),
        plan: plan.clone(),
        body,
        success,
        done: false,
        gone: false,
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
    let mut body = false;
    for r in resources {
        let Some(s) = &r.settle else { continue };
        let SettleFrom::Header(name) = &s.from else {
            body = true;
            continue;
        };
        match header(name).and_then(decimal).filter(|v| v.is_finite() && *v >= 0.0) {
            Some(real) => charge(plan, r, s, real, SettleOutcome::Settled),
            None => record(
                s,
                failed(SettleOutcome::Missing, status.is_success()),
                format_args!("the answer has no `{name}` header holding a number of at least 0"),
            ),
        }
    }
    body
}

/// Whether the answer is a stream of server-sent events.
fn is_event_stream<'a>(header: &impl Fn(&str) -> Option<&'a [u8]>) -> bool {
    let stream = b"text/event-stream";
    header("content-type")
        .map(<[u8]>::trim_ascii)
        .is_some_and(|t| t.get(..stream.len()).is_some_and(|t| t.eq_ignore_ascii_case(stream)))
}

/// Why the head says the body cannot be read for a cost, if it does
/// (`stream`: it is a stream of events, read whatever its length).
fn unreadable<'a>(
    header: &impl Fn(&str) -> Option<&'a [u8]>,
    length: Option<u64>,
    stream: bool,
) -> Option<(SettleOutcome, String)> {
    let value = |name| header(name).map(<[u8]>::trim_ascii);
    if let Some(coding) = value("content-encoding").filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity")) {
        let why = format!(
            "the answer is compressed (content-encoding: {}) and usher reads only uncompressed bodies; \
             have the app ask for none (accept-encoding: identity)",
            String::from_utf8_lossy(coding)
        );
        return Some((SettleOutcome::Encoded, why));
    }
    match length {
        Some(n) if n > MAX_JSON_BODY as u64 && !stream => Some((SettleOutcome::TooLarge, too_large())),
        _ => None,
    }
}

fn too_large() -> String {
    format!("the answer's body is over {} KiB, the most read for a settled cost", MAX_JSON_BODY / 1024)
}

/// The resources whose cost the body settles.
fn body_rules(resources: &[RouteResource]) -> impl Iterator<Item = (&RouteResource, &Settle)> {
    resources.iter().filter_map(|r| match &r.settle {
        Some(s) if !matches!(s.from, SettleFrom::Header(_)) => Some((r, &**s)),
        _ => None,
    })
}

/// An answer other than 2xx that does not carry its cost is no mistake
/// (an error body has no usage): it counts as `status`, unwarned.
fn failed(outcome: SettleOutcome, success: bool) -> SettleOutcome {
    if success { outcome } else { SettleOutcome::Status }
}

/// Charges the difference between the real cost and what `r`'s keys were
/// charged at admission (or gives it back), counts it in their demand, and
/// counts the answer as `outcome` (settled, or client_gone).
fn charge(plan: &Plan, r: &RouteResource, s: &Settle, real: f64, outcome: SettleOutcome) {
    for (l, charged) in r.keys_in(plan) {
        l.charge(real - charged);
        l.demand().settle(real - charged);
    }
    s.metrics.count(outcome);
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
    if first && !matches!(outcome, SettleOutcome::Status | SettleOutcome::Empty | SettleOutcome::ClientGone) {
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

/// Reads an answer's body, as it is relayed to the app, for the costs it
/// settles: a JSON body's copy (up to [`MAX_JSON_BODY`]), or a stream of
/// events read as it passes. Dropped before [`BodySettle::finish`] (the
/// upstream cut the body, the app left), the charges stand and count as
/// `incomplete` (`client_gone` once the app left).
pub struct BodySettle {
    resources: Arc<[RouteResource]>,
    plan: Plan,
    body: Body,
    /// The answer's status is 2xx.
    success: bool,
    done: bool,
    /// The app left; the engine reads on.
    gone: bool,
}

/// What is kept of the body.
enum Body {
    Json(Copied),
    Events(Box<Events>),
}

impl BodySettle {
    /// Reads the next bytes of the body (de-chunked).
    pub fn push(&mut self, data: &[u8]) {
        match &mut self.body {
            Body::Json(copy) => copy.push(data),
            Body::Events(ev) => {
                let Events { scan, found, any } = &mut **ev;
                *any |= !data.is_empty();
                scan.scan(data, &mut |event| read_event(&self.resources, found, event, false));
            }
        }
    }

    /// Whether the app gets the body edited ([`BodySettle::edit`]): a stream
    /// of events whose usage usher asked for on the app's behalf.
    pub fn edits(&self) -> bool {
        matches!(&self.body, Body::Events(ev) if ev.scan.edits())
    }

    /// Whether the body is a stream of events, which the engines read on
    /// when the app leaves ([`BodySettle::left`]).
    pub fn is_stream(&self) -> bool {
        matches!(self.body, Body::Events(_))
    }

    /// Reads the next bytes of an edited body (de-chunked), and appends to
    /// `out` what of them the app gets: whole events, without the usage it
    /// did not ask for. What ends no event yet is held until it does (or
    /// until [`BodySettle::flush`]).
    pub fn edit(&mut self, data: &[u8], out: &mut Vec<u8>) {
        match &mut self.body {
            Body::Events(ev) if ev.scan.edits() => {
                let Events { scan, found, any } = &mut **ev;
                *any |= !data.is_empty();
                scan.edit(data, out, &mut |event| read_event(&self.resources, found, event, true));
            }
            _ => {
                self.push(data);
                out.extend_from_slice(data);
            }
        }
    }

    /// The body has ended: appends to `out` what an edited body still held
    /// back (an event the stream did not end).
    pub fn flush(&mut self, out: &mut Vec<u8>) {
        if let Body::Events(ev) = &mut self.body {
            let Events { scan, found, .. } = &mut **ev;
            scan.end(out, &mut |event| read_event(&self.resources, found, event, false));
        }
    }

    /// The app left before the body's end: the engine reads on, unedited,
    /// for the cost, which then counts as `client_gone`, settled or not.
    pub fn left(&mut self) {
        self.gone = true;
        if let Body::Events(ev) = &mut self.body {
            ev.scan.stop_editing();
        }
    }

    /// The body has ended: reads each cost it settles and charges the difference.
    pub fn finish(mut self) {
        self.flush(&mut Vec::new());
        self.done = true;
        for (i, (r, s)) in body_rules(&self.resources).enumerate() {
            let real = match &self.body {
                Body::Json(copy) => copy.cost(&s.from),
                Body::Events(ev) => ev.cost(i, &s.from),
            };
            match (real, self.gone) {
                (Ok(real), false) => charge(&self.plan, r, s, real, SettleOutcome::Settled),
                (Ok(real), true) => charge(&self.plan, r, s, real, SettleOutcome::ClientGone),
                (Err(_), true) => {
                    record(s, SettleOutcome::ClientGone, format_args!("the app left, and the answer had no cost"))
                }
                (Err((outcome, why)), false) => record(s, failed(outcome, self.success), format_args!("{why}")),
            }
        }
    }

    /// Counts the events passed over for their size.
    fn count_skipped(&self) {
        if let Body::Events(ev) = &self.body
            && ev.scan.skipped > 0
        {
            for (_, s) in body_rules(&self.resources) {
                s.metrics.skipped(ev.scan.skipped);
            }
        }
    }
}

impl Drop for BodySettle {
    fn drop(&mut self) {
        self.count_skipped();
        if self.done {
            return;
        }
        let (outcome, why) = match self.gone {
            true => (SettleOutcome::ClientGone, "the app left, and the rest of the stream did not come in time"),
            false => {
                (SettleOutcome::Incomplete, "the answer's body did not end (the app left, or the upstream cut it)")
            }
        };
        for (_, s) in body_rules(&self.resources) {
            record(s, failed(outcome, self.success || self.gone), format_args!("{why}"));
        }
    }
}

/// Why a body holds no cost for a rule.
type NoCost = (SettleOutcome, String);

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

    /// The cost the body says, as `from` reads it.
    fn cost(&self, from: &SettleFrom) -> Result<f64, NoCost> {
        if self.over {
            return Err((SettleOutcome::TooLarge, too_large()));
        }
        if self.bytes.is_empty() {
            return Err((SettleOutcome::Empty, "the answer's body is empty".into()));
        }
        let not_json = |e: serde_json::Error| (SettleOutcome::NotJson, format!("the answer's body is not JSON ({e})"));
        match from {
            SettleFrom::Json(path) => find(&self.bytes, path).map_err(not_json)?.ok_or_else(|| {
                (SettleOutcome::Missing, format!("the answer's JSON has no number of at least 0 at `{}`", path.text))
            }),
            SettleFrom::Usage(rule) => {
                let counts = usage::read(&self.bytes, rule.api).map_err(not_json)?;
                rule_cost(rule, counts)
            }
            SettleFrom::Header(_) => Err((SettleOutcome::Missing, "read from a header".into())),
        }
    }
}

/// The cost `rule` counts of `counts`, or why there is none.
fn rule_cost(rule: &UsageRule, counts: usage::Counts) -> Result<f64, NoCost> {
    rule.cost(counts.input, counts.output, counts.total).filter(|c| c.is_finite() && *c >= 0.0).ok_or_else(|| {
        let why =
            format!("the answer reports no {} token counts where {} puts them ({counts:?})", rule.tokens, rule.api);
        (SettleOutcome::Missing, why)
    })
}

// === impl Events ===

/// A stream of events being read: the scanner, and per body rule (in
/// [`body_rules`] order) what its events said so far.
struct Events {
    scan: Scanner,
    found: Vec<Found>,
    /// Some byte of the body came.
    any: bool,
}

/// What a stream's events said so far for one rule.
enum Found {
    /// The last number at a JSON path, and the key that must be in an
    /// event's data for it to have one (quoted), if any.
    Number(Option<f64>, Option<Vec<u8>>),
    /// The token counts, merged.
    Counts(usage::Counts),
}

impl Events {
    fn new(resources: &[RouteResource], edited: bool) -> Self {
        let found = body_rules(resources)
            .map(|(_, s)| match &s.from {
                SettleFrom::Usage(_) => Found::Counts(usage::Counts::default()),
                SettleFrom::Json(path) => {
                    let key = path.steps.iter().rev().find(|s| !s.bytes().all(|b| b.is_ascii_digit()));
                    Found::Number(None, key.map(|k| format!("\"{k}\"").into_bytes()))
                }
                SettleFrom::Header(_) => Found::Number(None, None),
            })
            .collect();
        Events { scan: Scanner::new(edited), found, any: false }
    }

    /// The cost the stream said for the `i`th body rule, reading `from`.
    fn cost(&self, i: usize, from: &SettleFrom) -> Result<f64, NoCost> {
        let none = |what: String| match self.scan.skipped {
            0 => (SettleOutcome::Missing, what),
            n => (
                SettleOutcome::TooLarge,
                format!("{what}; {n} event(s) over {} KiB were passed over", MAX_EVENT / 1024),
            ),
        };
        match (&self.found[i], from) {
            _ if !self.any => Err((SettleOutcome::Empty, "the answer's body is empty".into())),
            (Found::Number(Some(v), _), _) => Ok(*v),
            (Found::Counts(counts), SettleFrom::Usage(rule)) => rule_cost(rule, *counts).map_err(|(_, why)| none(why)),
            (_, SettleFrom::Json(path)) => {
                Err(none(format!("no event of the stream has a number of at least 0 at `{}`", path.text)))
            }
            _ => Err(none("no event of the stream has the cost".into())),
        }
    }
}

/// Reads one whole event's data for each body rule of `resources` into
/// `found`; `edited`: returns what becomes of the event.
fn read_event(resources: &[RouteResource], found: &mut [Found], data: &[u8], edited: bool) -> Verdict {
    for ((_, s), f) in body_rules(resources).zip(found.iter_mut()) {
        match (f, &s.from) {
            (Found::Number(last, key), SettleFrom::Json(path)) => {
                if key.as_ref().is_none_or(|k| memchr::memmem::find(data, k).is_some())
                    && let Ok(Some(v)) = find(data, path)
                {
                    *last = Some(v);
                }
            }
            (Found::Counts(counts), SettleFrom::Usage(rule)) => {
                if usage::may_have(data)
                    && let Ok(c) = usage::read(data, rule.api)
                {
                    counts.merge(c);
                }
            }
            _ => {}
        }
    }
    if edited { hide::judge(data) } else { Verdict::Keep }
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

mod events;
mod hide;
mod usage;

#[cfg(test)]
mod tests;
