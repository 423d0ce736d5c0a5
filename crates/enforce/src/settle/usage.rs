//! The token counts an LLM API reports, read from one JSON document: an
//! answer's body, or the data of one of its server-sent events.
//!
//! | preset | where | input | output | total |
//! |---|---|---|---|---|
//! | `openai` | `usage` (Chat Completions: the body, and the stream's last chunk) | `prompt_tokens` | `completion_tokens` | `total_tokens` |
//! | `openai` | `usage` (Responses: the body), `response.usage` (its `response.completed` event) | `input_tokens` | `output_tokens` | `total_tokens` |
//! | `anthropic` | `usage` (the body, and each `message_delta` event), `message.usage` (`message_start`) | `input_tokens` | `output_tokens` | |
//!
//! A stream's counts are merged event by event ([`Counts::merge`]):
//! Anthropic's `message_start` says the input tokens (its output count is a
//! placeholder), and each `message_delta` the output tokens so far.

use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use usher_core::config::usage::UsageApi;

/// Which count a path holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Count {
    Input,
    Output,
    Total,
}

/// A preset's paths, each with the count it holds; a count found at two
/// paths of one document is the later path's.
type Paths = &'static [(&'static [&'static str], Count)];

const OPENAI: Paths = &[
    (&["usage", "prompt_tokens"], Count::Input),
    (&["usage", "input_tokens"], Count::Input),
    (&["usage", "completion_tokens"], Count::Output),
    (&["usage", "output_tokens"], Count::Output),
    (&["usage", "total_tokens"], Count::Total),
    (&["response", "usage", "input_tokens"], Count::Input),
    (&["response", "usage", "output_tokens"], Count::Output),
    (&["response", "usage", "total_tokens"], Count::Total),
];

const ANTHROPIC: Paths = &[
    (&["usage", "input_tokens"], Count::Input),
    (&["usage", "output_tokens"], Count::Output),
    (&["message", "usage", "input_tokens"], Count::Input),
    (&["message", "usage", "output_tokens"], Count::Output),
];

/// The most paths a preset has (a bit each in [`Many`]'s masks).
const MAX_PATHS: usize = 8;

/// Token counts, as far as they are known.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Counts {
    pub(crate) input: Option<f64>,
    pub(crate) output: Option<f64>,
    /// As reported; a count without it totals input and output.
    pub(crate) total: Option<f64>,
}

impl Counts {
    /// Takes in the counts of a later document: each count it has replaces
    /// the earlier one. A reported total goes with the counts it was
    /// reported with: a later document with counts but no total drops it.
    pub(crate) fn merge(&mut self, later: Counts) {
        if later != Counts::default() {
            self.total = later.total;
        }
        self.input = later.input.or(self.input);
        self.output = later.output.or(self.output);
    }
}

/// Whether `doc` may hold counts: it has a `"usage"` key whose value is an
/// object (most chunks of a stream have none, or `"usage":null`). A quoted
/// `"usage"` followed by `:` can only be a key: in a string, the quote
/// after `usage` would be escaped.
pub(crate) fn may_have(doc: &[u8]) -> bool {
    memchr::memmem::find_iter(doc, b"\"usage\"").any(|at| {
        let mut rest = doc[at + 7..].iter().copied().skip_while(u8::is_ascii_whitespace);
        rest.next() == Some(b':') && rest.find(|b| !b.is_ascii_whitespace()) == Some(b'{')
    })
}

/// The counts `api` reports in the JSON document `doc`; `Err` when `doc` is not one.
pub(crate) fn read(doc: &[u8], api: UsageApi) -> Result<Counts, serde_json::Error> {
    let paths = match api {
        UsageApi::OpenAi => OPENAI,
        UsageApi::Anthropic => ANTHROPIC,
    };
    let mut found = [None; MAX_PATHS];
    let mut de = serde_json::Deserializer::from_slice(doc);
    let all = (1u32 << paths.len()) - 1;
    Many { paths, depth: 0, mask: all, found: &mut found }.deserialize(&mut de)?;
    de.end()?;
    let mut counts = Counts::default();
    for ((_, count), value) in paths.iter().zip(found) {
        let Some(v) = value else { continue };
        match count {
            Count::Input => counts.input = Some(v),
            Count::Output => counts.output = Some(v),
            Count::Total => counts.total = Some(v),
        }
    }
    Ok(counts)
}

/// Follows several paths at once into the value being read: `mask` has a
/// bit for each path (of `paths`) that leads here, `depth` steps down.
/// Everything off the paths is skipped unbuilt.
struct Many<'a> {
    paths: Paths,
    depth: usize,
    mask: u32,
    found: &'a mut [Option<f64>; MAX_PATHS],
}

impl Many<'_> {
    /// Records a number at the end of the paths that end here.
    fn number(self, v: f64) {
        if !v.is_finite() || v < 0.0 {
            return;
        }
        for (i, (path, _)) in self.paths.iter().enumerate() {
            if self.mask & (1 << i) != 0 && path.len() == self.depth {
                self.found[i] = Some(v);
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Many<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Many<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Many { paths, depth, mask, found } = self;
        while let Some(next) = map.next_key_seed(Keys { paths, depth, mask })? {
            match next {
                0 => {
                    map.next_value::<IgnoredAny>()?;
                }
                mask => map.next_value_seed(Many { paths, depth: depth + 1, mask, found: &mut *found })?,
            }
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.number(v as f64);
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.number(v as f64);
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        self.number(v);
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
}

/// The paths (a mask of `mask`'s) whose next step is an object key, compared
/// without building the key (unless it has escapes).
struct Keys {
    paths: Paths,
    depth: usize,
    mask: u32,
}

impl<'de> DeserializeSeed<'de> for Keys {
    type Value = u32;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Keys {
    type Value = u32;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_str<E>(self, key: &str) -> Result<u32, E> {
        let mut mask = 0;
        for (i, (path, _)) in self.paths.iter().enumerate() {
            if self.mask & (1 << i) != 0 && path.get(self.depth) == Some(&key) {
                mask |= 1 << i;
            }
        }
        Ok(mask)
    }
}
