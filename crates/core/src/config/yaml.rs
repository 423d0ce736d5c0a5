//! A YAML tree that remembers where every node came from, and a checker that
//! turns it into typed values while collecting *every* error with its
//! `file:line:column`, the field's path, what was expected, and a hint.
//!
//! serde-based loaders stop at the first error and lose positions after
//! deserialisation; configuration errors are the most common thing a user of
//! usher will see, so both config files are read through this module instead.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use saphyr_parser::{Event, Parser, ScalarStyle};

/// A position in a file, 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Loc {
    /// Line, from 1.
    pub line: usize,
    /// Column in characters, from 1.
    pub col: usize,
}

/// One problem found in a config file.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnostic {
    /// The file's name as given to the parser (a path, or `<built-in default>`).
    pub file: String,
    /// Where in the file the problem is.
    pub loc: Loc,
    /// The field's path, e.g. `resources[2].algorithm.lease_length`; empty for the document.
    pub field: String,
    /// What is wrong.
    pub message: String,
    /// What to write instead, when there is a likely fix.
    pub hint: Option<String>,
}

// Every config error is shown through this (logs, `/debug/status`, `usher
// check`), so this is where values quoted from the file are cut short.
impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file, self.loc.line, self.loc.col)?;
        if !self.field.is_empty() {
            write!(f, "{}: ", shorten(&self.field))?;
        }
        f.write_str(&shorten(&self.message))?;
        if let Some(h) = &self.hint {
            write!(f, " (hint: {})", shorten(h))?;
        }
        Ok(())
    }
}

/// The most characters of one value an error message quotes.
pub const MAX_QUOTED_CHARS: usize = 100;
/// The longest a message, field or hint is shown, whatever it holds (a value
/// of a thousand backticks would make a thousand short quotes).
const MAX_SHOWN_CHARS: usize = 2000;

/// `text` with each over-long value cut to [`MAX_QUOTED_CHARS`], an
/// ellipsis and its full length: a `quoted` one, or any word outside
/// quotes. A 20 MB URL in a config file must not make a 20 MB log line.
pub fn shorten(text: &str) -> Cow<'_, str> {
    if text.len() <= MAX_QUOTED_CHARS {
        return Cow::Borrowed(text);
    }
    let mut out = String::new();
    for (i, segment) in text.split('`').enumerate() {
        if i > 0 {
            out.push('`');
        }
        if i % 2 == 1 {
            out.push_str(&cut(segment, MAX_QUOTED_CHARS));
        } else {
            for (j, word) in segment.split(' ').enumerate() {
                if j > 0 {
                    out.push(' ');
                }
                out.push_str(&cut(word, MAX_QUOTED_CHARS));
            }
        }
        if out.len() > MAX_SHOWN_CHARS * 4 {
            break;
        }
    }
    match out.char_indices().nth(MAX_SHOWN_CHARS) {
        None if out == text => Cow::Borrowed(text),
        None => Cow::Owned(out),
        Some((end, _)) => Cow::Owned(format!("{}… ({} bytes)", &out[..end], text.len())),
    }
}

/// `s` cut to `max` characters, an ellipsis and its full length in bytes.
fn cut(s: &str, max: usize) -> Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => Cow::Borrowed(s),
        Some((end, _)) => Cow::Owned(format!("{}… ({} bytes)", &s[..end], s.len())),
    }
}

/// Every problem found in one file; never empty.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    /// The problems, in file order.
    pub diagnostics: Vec<Diagnostic>,
}

impl ConfigError {
    /// An error about the file as a whole (unreadable, empty, ...).
    pub fn whole_file(file: &str, message: impl Into<String>) -> Self {
        ConfigError {
            diagnostics: vec![Diagnostic {
                file: file.to_string(),
                loc: Loc { line: 1, col: 1 },
                field: String::new(),
                message: message.into(),
                hint: None,
            }],
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.diagnostics.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// A YAML node and where it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// What the node holds.
    pub value: Value,
    /// Where the node starts.
    pub loc: Loc,
}

/// What a YAML node holds, its aliases already expanded.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar's text, and whether it was plain (unquoted): only plain
    /// scalars can be numbers, booleans or null.
    Scalar(String, bool),
    /// A list, in file order.
    Seq(Vec<Node>),
    /// A mapping's (key, value) pairs, in file order, duplicates kept.
    Map(Vec<(Node, Node)>),
}

impl Node {
    /// Whether the node is YAML's null: empty, `~` or `null` unquoted.
    pub fn is_null(&self) -> bool {
        matches!(&self.value, Value::Scalar(s, true) if matches!(s.as_str(), "" | "~" | "null" | "Null" | "NULL"))
    }

    fn kind_name(&self) -> &'static str {
        match &self.value {
            _ if self.is_null() => "null",
            Value::Scalar(..) => "a scalar",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }

    /// A scalar's text; `None` for a list or a mapping.
    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Scalar(s, _) => Some(s),
            _ => None,
        }
    }
}

/// The most nodes a document may make, its aliases expanded: far above any
/// real config (a routes file of 10,000 routes makes about 100,000), far
/// below what a few nested aliases can make of a file of a kilobyte (an
/// "alias bomb": nine aliases of nine aliases, eight deep, are 43 million).
pub const MAX_NODES: usize = 200_000;

/// Parses one YAML document; a syntax error is reported at its position.
pub fn parse(file: &str, text: &str) -> Result<Node, ConfigError> {
    // (container, pending map key, anchor, nodes in it so far)
    let mut stack: Vec<(Node, Option<Node>, usize, usize)> = Vec::new();
    // Each anchored node, with how many nodes it holds.
    let mut anchors: HashMap<usize, (Node, usize)> = HashMap::new();
    let mut nodes = 0usize;
    let mut root: Option<Node> = None;
    let mut docs = 0;
    let err = |loc: Loc, msg: String| ConfigError {
        diagnostics: vec![Diagnostic { file: file.to_string(), loc, field: String::new(), message: msg, hint: None }],
    };
    for ev in Parser::new_from_str(text) {
        let (ev, span) = ev.map_err(|e| {
            let m = e.marker();
            err(Loc { line: m.line(), col: m.col() + 1 }, format!("YAML syntax error: {}", e.info()))
        })?;
        let loc = Loc { line: span.start.line(), col: span.start.col() + 1 };
        let finished: Option<(Node, usize, usize)> = match ev {
            Event::DocumentStart(_) => {
                docs += 1;
                if docs > 1 {
                    return Err(err(loc, "expected one YAML document, found several".into()));
                }
                None
            }
            Event::Scalar(text, style, anchor, _tag) => {
                let plain = matches!(style, ScalarStyle::Plain);
                nodes += 1;
                Some((Node { value: Value::Scalar(Cow::into_owned(text), plain), loc }, anchor, 1))
            }
            Event::Alias(id) => match anchors.get(&id) {
                // Counted before it is copied: a bomb stops at the limit.
                Some((_, size)) if nodes.saturating_add(*size) > MAX_NODES => {
                    return Err(err(
                        loc,
                        format!(
                            "this alias would make the document more than {MAX_NODES} nodes long \
                             (its anchor holds {size}): aliases that nest aliases grow exponentially"
                        ),
                    ));
                }
                Some((n, size)) => {
                    nodes += size;
                    Some((n.clone(), 0, *size))
                }
                None => return Err(err(loc, "alias refers to an unknown anchor".into())),
            },
            Event::SequenceStart(anchor, _) => {
                nodes += 1;
                stack.push((Node { value: Value::Seq(Vec::new()), loc }, None, anchor, 1));
                None
            }
            Event::MappingStart(anchor, _) => {
                nodes += 1;
                stack.push((Node { value: Value::Map(Vec::new()), loc }, None, anchor, 1));
                None
            }
            Event::SequenceEnd | Event::MappingEnd => stack.pop().map(|(n, _, a, size)| (n, a, size)),
            _ => None,
        };
        if nodes > MAX_NODES {
            return Err(err(loc, format!("the document has more than {MAX_NODES} nodes")));
        }
        let Some((node, anchor, size)) = finished else { continue };
        if anchor != 0 {
            anchors.insert(anchor, (node.clone(), size));
        }
        if let Some((_, _, _, parent)) = stack.last_mut() {
            *parent += size;
        }
        match stack.last_mut() {
            None => root = Some(node),
            Some((Node { value: Value::Seq(items), .. }, _, _, _)) => items.push(node),
            Some((Node { value: Value::Map(entries), .. }, pending, _, _)) => match pending.take() {
                None => *pending = Some(node),
                Some(key) => entries.push((key, node)),
            },
            Some(_) => unreachable!("only sequences and mappings are pushed"),
        }
    }
    Ok(root.unwrap_or(Node { value: Value::Scalar(String::new(), true), loc: Loc { line: 1, col: 1 } }))
}

/// Collects diagnostics while a tree is checked and converted.
pub struct Checker {
    file: String,
    /// The problems reported so far, in the order they were found.
    pub diagnostics: Vec<Diagnostic>,
    /// `None`: an unset `${VAR}` is an error. `Some`: it is left as written
    /// and its name recorded here (`usher check --allow-unset-env`).
    pub unset_env: Option<Vec<String>>,
    /// What is valid but likely not what the file means (a setting that is
    /// ignored): reported, and the file is still taken.
    pub warnings: Vec<Diagnostic>,
}

/// A mapping being read: remembers which keys were used so unknown ones can be reported.
pub struct MapView<'a> {
    node: &'a Node,
    entries: &'a [(Node, Node)],
    path: String,
}

impl<'a> MapView<'a> {
    /// Where the mapping starts.
    pub fn loc(&self) -> Loc {
        self.node.loc
    }

    /// The mapping's own field path, for diagnostics.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The value of `key`; `None` when it is absent or null.
    pub fn get(&self, key: &str) -> Option<&'a Node> {
        self.entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v).filter(|v| !v.is_null())
    }

    /// The path of a child field, for diagnostics.
    pub fn child(&self, key: &str) -> String {
        if self.path.is_empty() { key.to_string() } else { format!("{}.{}", self.path, key) }
    }

    /// Every (key, value) pair, in file order, nulls included.
    pub fn entries(&self) -> impl Iterator<Item = (&'a Node, &'a Node)> {
        self.entries.iter().map(|(k, v)| (k, v))
    }
}

impl Checker {
    /// A checker for `file`, with no diagnostics yet.
    pub fn new(file: &str) -> Self {
        Checker { file: file.to_string(), diagnostics: Vec::new(), unset_env: None, warnings: Vec::new() }
    }

    /// The file's name, as diagnostics give it.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// Reports a problem at `loc` in the field at `field`.
    pub fn error(&mut self, loc: Loc, field: &str, message: impl Into<String>, hint: Option<String>) {
        self.diagnostics.push(Diagnostic {
            file: self.file.clone(),
            loc,
            field: field.to_string(),
            message: message.into(),
            hint,
        });
    }

    /// Reports, at `loc` in the field at `field`, a setting that is valid but
    /// will not do what it says; the file is still taken.
    pub fn warn(&mut self, loc: Loc, field: &str, message: impl Into<String>, hint: Option<String>) {
        self.warnings.push(Diagnostic {
            file: self.file.clone(),
            loc,
            field: field.to_string(),
            message: message.into(),
            hint,
        });
    }

    /// `Ok(value)` if nothing was reported, else every diagnostic, in file order.
    pub fn finish<T>(mut self, value: T) -> Result<T, ConfigError> {
        if self.diagnostics.is_empty() {
            return Ok(value);
        }
        self.diagnostics.sort_by_key(|d| (d.loc.line, d.loc.col));
        Err(ConfigError { diagnostics: self.diagnostics })
    }

    /// Reads `node` as a mapping and reports keys outside `allowed` (and duplicates).
    pub fn map<'a>(&mut self, node: &'a Node, path: &str, allowed: &[&str]) -> Option<MapView<'a>> {
        let Value::Map(entries) = &node.value else {
            self.error(node.loc, path, format!("expected a mapping, found {}", node.kind_name()), None);
            return None;
        };
        let mut seen: Vec<&str> = Vec::new();
        for (k, _) in entries {
            let Some(key) = k.as_str() else {
                self.error(k.loc, path, "expected a plain string key", None);
                continue;
            };
            let field = if path.is_empty() { key.to_string() } else { format!("{path}.{key}") };
            if seen.contains(&key) {
                self.error(k.loc, &field, "duplicate key", Some("each key may appear once".into()));
            }
            seen.push(key);
            if !allowed.is_empty() && !allowed.contains(&key) {
                let hint = closest(key, allowed)
                    .map(|c| format!("did you mean `{c}`?"))
                    .or_else(|| Some(format!("known fields: {}", allowed.join(", "))));
                self.error(k.loc, &field, "unknown field", hint);
            }
        }
        Some(MapView { node, entries, path: path.to_string() })
    }

    /// Reads `node` as a list.
    pub fn seq<'a>(&mut self, node: &'a Node, path: &str) -> Option<&'a [Node]> {
        match &node.value {
            Value::Seq(items) => Some(items),
            _ => {
                self.error(node.loc, path, format!("expected a list, found {}", node.kind_name()), None);
                None
            }
        }
    }

    /// A required field; reports it missing at the mapping's position.
    pub fn required<'a>(&mut self, m: &MapView<'a>, key: &str, hint: Option<&str>) -> Option<&'a Node> {
        let v = m.get(key);
        if v.is_none() {
            self.error(m.loc(), &m.child(key), "missing required field", hint.map(str::to_string));
        }
        v
    }

    /// A non-null scalar's text; reports anything else.
    pub fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match &node.value {
            Value::Scalar(s, _) if !node.is_null() => Some(s.clone()),
            _ => {
                self.error(node.loc, path, format!("expected a string, found {}", node.kind_name()), None);
                None
            }
        }
    }

    /// A plain scalar read as a YAML number (`.inf` and `.nan` too); reports anything else.
    pub fn f64(&mut self, node: &Node, path: &str) -> Option<f64> {
        let parsed = match &node.value {
            Value::Scalar(s, true) => parse_yaml_float(s),
            _ => None,
        };
        if parsed.is_none() {
            self.error(node.loc, path, format!("expected a number, found {}", describe(node)), None);
        }
        parsed
    }

    /// A plain scalar read as a whole number (`_` separators and `0x` allowed); reports anything else.
    pub fn i64(&mut self, node: &Node, path: &str) -> Option<i64> {
        let parsed = match &node.value {
            Value::Scalar(s, true) => parse_yaml_int(s),
            _ => None,
        };
        if parsed.is_none() {
            self.error(node.loc, path, format!("expected a whole number, found {}", describe(node)), None);
        }
        parsed
    }

    /// A plain `true` or `false` (or its capitalised forms); reports anything else.
    pub fn bool(&mut self, node: &Node, path: &str) -> Option<bool> {
        let parsed = match &node.value {
            Value::Scalar(s, true) => match s.as_str() {
                "true" | "True" | "TRUE" => Some(true),
                "false" | "False" | "FALSE" => Some(false),
                _ => None,
            },
            _ => None,
        };
        if parsed.is_none() {
            self.error(node.loc, path, format!("expected true or false, found {}", describe(node)), None);
        }
        parsed
    }

    /// A duration such as `500ms`, `2s` or `1m30s`; a bare number is seconds.
    pub fn duration(&mut self, node: &Node, path: &str) -> Option<Duration> {
        let parsed = node.as_str().and_then(parse_duration);
        if parsed.is_none() {
            self.error(
                node.loc,
                path,
                format!("expected a duration, found {}", describe(node)),
                Some("write it like 500ms, 2s or 1m30s".into()),
            );
        }
        parsed
    }
}

/// Parses `500ms`, `2s`, `1m30s` (humantime syntax) or a bare number of seconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if let Some(secs) = parse_yaml_float(s) {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    humantime::parse_duration(s).ok()
}

fn describe(node: &Node) -> String {
    match &node.value {
        Value::Scalar(s, _) if !node.is_null() => format!("`{s}`"),
        _ => node.kind_name().to_string(),
    }
}

fn parse_yaml_int(s: &str) -> Option<i64> {
    let t = s.replace('_', "");
    if let Some(h) = t.strip_prefix("0x") {
        return i64::from_str_radix(h, 16).ok();
    }
    t.parse::<i64>().ok()
}

fn parse_yaml_float(s: &str) -> Option<f64> {
    match s {
        ".inf" | ".Inf" | ".INF" | "+.inf" => return Some(f64::INFINITY),
        "-.inf" | "-.Inf" | "-.INF" => return Some(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return Some(f64::NAN),
        _ => {}
    }
    if let Some(i) = parse_yaml_int(s) {
        return Some(i as f64);
    }
    let t = s.replace('_', "");
    // Rust accepts "inf"/"nan" spellings that YAML does not.
    if t.chars().any(|c| c.is_ascii_alphabetic() && c != 'e' && c != 'E') {
        return None;
    }
    t.parse::<f64>().ok()
}

/// The allowed word closest to `word`, if it is close enough to be a typo.
pub fn closest<'a>(word: &str, allowed: &[&'a str]) -> Option<&'a str> {
    allowed
        .iter()
        .map(|a| (edit_distance(word, a), *a))
        .filter(|(d, a)| *d <= 2.max(a.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, a)| a)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_one_based_and_point_at_the_value() {
        let n = parse("f.yaml", "a: 1\nb:\n  c: [x, 'y']\n").unwrap();
        let mut ck = Checker::new("f.yaml");
        let m = ck.map(&n, "", &["a", "b"]).unwrap();
        let b = m.get("b").unwrap();
        let bm = ck.map(b, "b", &["c"]).unwrap();
        let c = bm.get("c").unwrap();
        assert_eq!(c.loc, Loc { line: 3, col: 6 });
        let items = ck.seq(c, "b.c").unwrap();
        assert_eq!(items[1].value, Value::Scalar("y".into(), false));
        assert!(ck.diagnostics.is_empty());
    }

    #[test]
    fn collects_every_error_with_hints() {
        let n = parse("f.yaml", "capacty: 1\nlease: x\nlease: 2\n").unwrap();
        let mut ck = Checker::new("f.yaml");
        let m = ck.map(&n, "", &["capacity", "lease"]).unwrap();
        ck.f64(m.get("lease").unwrap(), "lease");
        let err = ck.finish(()).unwrap_err();
        let text = err.to_string();
        assert_eq!(err.diagnostics.len(), 3, "{text}");
        assert!(text.contains("f.yaml:1:1: capacty: unknown field (hint: did you mean `capacity`?)"), "{text}");
        assert!(text.contains("f.yaml:2:8: lease: expected a number, found `x`"), "{text}");
        assert!(text.contains("f.yaml:3:1: lease: duplicate key"), "{text}");
    }

    #[test]
    fn syntax_errors_carry_a_position() {
        let err = parse("bad.yaml", "a: [1, 2\nb: 3\n").unwrap_err();
        let d = &err.diagnostics[0];
        assert!(d.message.starts_with("YAML syntax error"), "{err}");
        assert!(d.loc.line >= 1);
    }

    #[test]
    fn quoted_numbers_are_strings_and_durations_parse() {
        let n = parse("f", "a: '5'\nb: 1m30s\nc: 250ms\nd: 2\n").unwrap();
        let mut ck = Checker::new("f");
        let m = ck.map(&n, "", &[]).unwrap();
        assert_eq!(ck.f64(m.get("a").unwrap(), "a"), None);
        assert_eq!(ck.duration(m.get("b").unwrap(), "b"), Some(Duration::from_secs(90)));
        assert_eq!(ck.duration(m.get("c").unwrap(), "c"), Some(Duration::from_millis(250)));
        assert_eq!(ck.duration(m.get("d").unwrap(), "d"), Some(Duration::from_secs(2)));
    }

    #[test]
    fn anchors_and_aliases_resolve() {
        let n = parse("f", "a: &x {k: 1}\nb: *x\n").unwrap();
        let mut ck = Checker::new("f");
        let m = ck.map(&n, "", &[]).unwrap();
        assert_eq!(m.get("a").unwrap().value, m.get("b").unwrap().value);
    }

    /// Nine aliases of nine aliases, eight deep: 43 million nodes from 300
    /// bytes. Refused at the alias that would pass the limit, at once.
    #[test]
    #[allow(clippy::disallowed_methods, reason = "bounds how long parsing takes on the wall clock")]
    fn an_alias_bomb_is_refused_before_it_is_expanded() {
        let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x]\n");
        for i in 1..=8 {
            let refs = vec![format!("*a{}", i - 1); 9].join(", ");
            text.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
        }
        let started = std::time::Instant::now();
        let e = parse("bomb.yaml", &text).unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "took {:?}", started.elapsed());
        let d = &e.diagnostics[0];
        assert_eq!((d.loc.line, d.loc.col), (6, 15), "{d}");
        assert!(d.message.contains("more than 200000 nodes"), "{d}");
        // Aliases within the limit still resolve.
        let small = parse("f", &text.lines().take(4).collect::<Vec<_>>().join("\n")).unwrap();
        assert!(matches!(&small.value, Value::Map(m) if m.len() == 4));
    }

    #[test]
    fn long_values_are_cut_in_messages() {
        let url = format!("http://{}", "a".repeat(20_000_000));
        let text = format!("upstreams:\n  raw:\n    url: \"{url}\"\n");
        let mut ck = Checker::new("f.yaml");
        let root = parse("f.yaml", &text).unwrap();
        ck.error(root.loc, "upstreams.raw.url", format!("`{url}` is not an http:// URL"), None);
        ck.error(root.loc, &format!("upstreams.{url}"), format!("must be 1, not {url}"), None);
        let shown = ck.finish(()).unwrap_err().to_string();
        let first = format!(
            "f.yaml:1:1: upstreams.raw.url: `http://{}… (20000007 bytes)` is not an http:// URL",
            "a".repeat(93)
        );
        assert!(shown.starts_with(&first), "{}", &shown[..shown.len().min(500)]);
        assert!(shown.len() < 800, "{} bytes", shown.len());
        // Short values, and messages without any, are shown as they are.
        assert_eq!(shorten("`x` is not a number"), "`x` is not a number");
        let many = "`a` ".repeat(10_000);
        assert!(shorten(&many).chars().count() < MAX_SHOWN_CHARS + 30);
        assert!(shorten(&many).ends_with("… (40000 bytes)"));
    }
}
