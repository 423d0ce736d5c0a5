//! `upstream_quota:` on a routes-file resource: which response headers carry
//! the upstream's own account of its quota, and how to read them. Presets
//! name the headers of well-known APIs; the fields name any others.

use super::yaml::{Checker, Node, closest};

/// How a reset header says when the quota renews.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetFormat {
    /// Seconds since the Unix epoch (GitHub's `x-ratelimit-reset`).
    EpochSeconds,
    /// Seconds from now (the IETF draft's `t`).
    DelaySeconds,
    /// A duration such as `6m0s` or `20ms` (OpenAI's).
    Duration,
    /// An RFC 3339 time (Anthropic's).
    Rfc3339,
}

/// Where and how a resource reads the upstream's quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamQuota {
    /// The preset's name, or `headers` for named fields: shown on status pages.
    pub source: String,
    /// `RateLimit` and `RateLimit-Policy` of draft-ietf-httpapi-ratelimit-headers.
    pub ietf: bool,
    /// The header (lower-case) holding the quota's size; unused when `ietf`.
    pub limit: String,
    /// The header (lower-case) holding what is left of the quota; unused when `ietf`.
    pub remaining: String,
    /// The header (lower-case) saying when the quota renews; unused when `ietf`.
    pub reset: String,
    /// How the reset header says it.
    pub reset_format: ResetFormat,
    /// Refilled continuously (a token bucket) rather than renewed whole at the reset.
    pub continuous: bool,
}

/// The presets, by name.
pub const PRESETS: &[&str] = &[
    "ietf",
    "github",
    "openai-requests",
    "openai-tokens",
    "anthropic-requests",
    "anthropic-tokens",
    "anthropic-input-tokens",
    "anthropic-output-tokens",
];

fn preset(name: &str) -> Option<UpstreamQuota> {
    let named = |limit: &str, remaining: &str, reset: &str, reset_format, continuous| UpstreamQuota {
        source: name.to_string(),
        ietf: false,
        limit: limit.into(),
        remaining: remaining.into(),
        reset: reset.into(),
        reset_format,
        continuous,
    };
    let anthropic = |what: &str| {
        let h = |field: &str| format!("anthropic-ratelimit-{what}-{field}");
        named(&h("limit"), &h("remaining"), &h("reset"), ResetFormat::Rfc3339, true)
    };
    use ResetFormat::*;
    Some(match name {
        "ietf" => {
            UpstreamQuota { ietf: true, ..named("ratelimit-policy", "ratelimit", "ratelimit", DelaySeconds, false) }
        }
        "github" => named("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset", EpochSeconds, false),
        "openai-requests" => named(
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            Duration,
            true,
        ),
        "openai-tokens" => named(
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            Duration,
            true,
        ),
        "anthropic-requests" => anthropic("requests"),
        "anthropic-tokens" => anthropic("tokens"),
        // Anthropic's separate input (ITPM) and output (OTPM) token limits.
        "anthropic-input-tokens" => anthropic("input-tokens"),
        "anthropic-output-tokens" => anthropic("output-tokens"),
        _ => return None,
    })
}

const FIELDS: &[&str] = &["headers", "limit", "remaining", "reset", "reset_format", "refill"];
const FORMATS: &[&str] = &["epoch-seconds", "delay-seconds", "duration", "rfc3339"];

/// Reads `upstream_quota:` at `path`.
pub(crate) fn read(ck: &mut Checker, node: &Node, path: &str) -> Option<UpstreamQuota> {
    let m = ck.map(node, path, FIELDS)?;
    if let Some(n) = m.get("headers") {
        let name = ck.string(n, &m.child("headers"))?;
        for other in ["limit", "remaining", "reset", "reset_format", "refill"] {
            if let Some(o) = m.get(other) {
                ck.error(
                    o.loc,
                    &m.child(other),
                    "a preset names its own headers",
                    Some("drop `headers:` or this field".into()),
                );
            }
        }
        return match preset(&name) {
            Some(p) => Some(p),
            None => {
                let hint = closest(&name, PRESETS)
                    .map_or_else(|| format!("presets: {}", PRESETS.join(", ")), |c| format!("did you mean `{c}`?"));
                ck.error(n.loc, &m.child("headers"), format!("unknown preset `{name}`"), Some(hint));
                None
            }
        };
    }
    let header = |ck: &mut Checker, key: &str| {
        let n = ck.required(&m, key, Some("a response header name, or `headers: PRESET`"))?;
        let v = ck.string(n, &m.child(key))?;
        if http::HeaderName::from_bytes(v.as_bytes()).is_err() {
            ck.error(n.loc, &m.child(key), format!("`{v}` is not a valid header name"), None);
            return None;
        }
        Some(v.to_ascii_lowercase())
    };
    let (limit, remaining, reset) = (header(ck, "limit"), header(ck, "remaining"), header(ck, "reset"));
    let reset_format = match m.get("reset_format") {
        None => Some(ResetFormat::EpochSeconds),
        Some(n) => match ck.string(n, &m.child("reset_format")).as_deref() {
            Some("epoch-seconds") => Some(ResetFormat::EpochSeconds),
            Some("delay-seconds") => Some(ResetFormat::DelaySeconds),
            Some("duration") => Some(ResetFormat::Duration),
            Some("rfc3339") => Some(ResetFormat::Rfc3339),
            Some(other) => {
                ck.error(
                    n.loc,
                    &m.child("reset_format"),
                    format!("unknown format `{other}`"),
                    Some(FORMATS.join(", ")),
                );
                None
            }
            None => None,
        },
    };
    let continuous = match m.get("refill") {
        None => Some(false),
        Some(n) => match ck.string(n, &m.child("refill")).as_deref() {
            Some("window") => Some(false),
            Some("continuous") => Some(true),
            Some(other) => {
                ck.error(
                    n.loc,
                    &m.child("refill"),
                    format!("unknown refill `{other}`"),
                    Some("window or continuous".into()),
                );
                None
            }
            None => None,
        },
    };
    Some(UpstreamQuota {
        source: "headers".into(),
        ietf: false,
        limit: limit?,
        remaining: remaining?,
        reset: reset?,
        reset_format: reset_format?,
        continuous: continuous?,
    })
}

/// What one answer says of the quota: (limit, remaining, seconds until the
/// reset, from `now_unix_s`), if it says all three. `now_unix_s` is called
/// only for a reset given as a time, once the three are found.
pub fn parse<'a>(
    q: &UpstreamQuota,
    header: impl Fn(&str) -> Option<&'a [u8]>,
    now_unix_s: impl FnOnce() -> f64,
) -> Option<(f64, f64, f64)> {
    let text = |name: &str| header(name).and_then(|v| std::str::from_utf8(v).ok()).map(str::trim);
    let number = |name: &str| header(name).and_then(decimal);
    if q.ietf {
        let state = text("ratelimit")?;
        let remaining = sf_param(state, "r")?;
        let reset = sf_param(state, "t")?;
        let limit = text("ratelimit-policy").and_then(|p| sf_param(p, "q")).unwrap_or(remaining);
        return Some((limit, remaining, reset));
    }
    let count = |name: &str| number(name).filter(|v| v.is_finite() && *v >= 0.0);
    let (limit, remaining) = (count(&q.limit)?, count(&q.remaining)?);
    let secs = match q.reset_format {
        ResetFormat::EpochSeconds => number(&q.reset)? - now_unix_s(),
        ResetFormat::DelaySeconds => number(&q.reset)?,
        ResetFormat::Duration => go_duration(text(&q.reset)?)?,
        ResetFormat::Rfc3339 => {
            let t = humantime::parse_rfc3339_weak(text(&q.reset)?).ok()?;
            t.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs_f64() - now_unix_s()
        }
    };
    secs.is_finite().then_some((limit, remaining, secs.max(0.0)))
}

/// A header value as the number `str::parse::<f64>` reads in it, trimmed
/// (None: not UTF-8, or not a number). A whole number, which is what quota
/// and cost headers nearly always hold, is read digit by digit: the same
/// value (exact below 2^53, and rounded as the parser rounds above), with
/// no UTF-8 check, Unicode trim or float parser on the request path.
pub fn decimal(v: &[u8]) -> Option<f64> {
    let v = v.trim_ascii();
    // 19 digits stay below u64::MAX.
    if v.is_empty() || v.len() > 19 {
        return general(v);
    }
    let mut n = 0u64;
    for &b in v {
        let digit = b.wrapping_sub(b'0');
        if digit > 9 {
            return general(v);
        }
        n = n * 10 + u64::from(digit);
    }
    Some(n as f64)
}

/// What [`decimal`] stands in for: the general parser, on trimmed UTF-8.
#[cold]
fn general(v: &[u8]) -> Option<f64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

/// A parameter `key=N` of the first item of a structured field (`"x";r=5;t=30`).
fn sf_param(field: &str, key: &str) -> Option<f64> {
    let item = field.split(',').next()?;
    item.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        (k.trim() == key).then(|| v.trim().parse::<f64>().ok()).flatten()
    })
}

/// A Go duration (`6m0s`, `1h2m3.5s`, `20ms`, `0s`) in seconds.
pub fn go_duration(s: &str) -> Option<f64> {
    let mut total = 0.0;
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let n: f64 = rest[..end].parse().ok()?;
        rest = &rest[end..];
        let unit_end = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += n * scale;
        rest = &rest[unit_end..];
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers<'a>(h: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<&'a [u8]> {
        move |name| h.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_bytes())
    }

    #[test]
    fn every_preset_reads_its_apis_headers() {
        let now = 1_800_000_000.0;
        let gh = preset("github").unwrap();
        let h = [("x-ratelimit-limit", "5000"), ("x-ratelimit-remaining", "4999"), ("x-ratelimit-reset", "1800000030")];
        assert_eq!(parse(&gh, headers(&h), || now), Some((5000.0, 4999.0, 30.0)));
        let oa = preset("openai-tokens").unwrap();
        let h = [
            ("x-ratelimit-limit-tokens", "6000"),
            ("x-ratelimit-remaining-tokens", "5850"),
            ("x-ratelimit-reset-tokens", "1m30.5s"),
        ];
        assert_eq!(parse(&oa, headers(&h), || now), Some((6000.0, 5850.0, 90.5)));
        assert!(oa.continuous && !gh.continuous);
        let an = preset("anthropic-requests").unwrap();
        let h = [
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", "2027-01-15T08:00:10Z"),
        ];
        // 2027-01-15T08:00:10Z is 1,800,000,010 s after the epoch: 10 s from now.
        assert_eq!(parse(&an, headers(&h), || now), Some((50.0, 49.0, 10.0)));
        for (what, name) in [("input", "anthropic-input-tokens"), ("output", "anthropic-output-tokens")] {
            let p = preset(name).unwrap();
            let limit = format!("anthropic-ratelimit-{what}-tokens-limit");
            let remaining = format!("anthropic-ratelimit-{what}-tokens-remaining");
            let reset = format!("anthropic-ratelimit-{what}-tokens-reset");
            let h = [(&*limit, "40000"), (&*remaining, "39000"), (&*reset, "2027-01-15T08:00:30Z")];
            assert_eq!(parse(&p, headers(&h), || now), Some((40000.0, 39000.0, 30.0)), "{name}");
            assert!(p.continuous, "{name}");
            // The combined preset's headers are not these.
            assert_eq!(parse(&preset("anthropic-tokens").unwrap(), headers(&h), || now), None);
        }
        let ietf = preset("ietf").unwrap();
        let h = [("ratelimit", "\"api\";r=7;t=12"), ("ratelimit-policy", "\"api\";q=100;w=60")];
        assert_eq!(parse(&ietf, headers(&h), || now), Some((100.0, 7.0, 12.0)));
        // Missing or rude values say nothing.
        assert_eq!(parse(&gh, headers(&[("x-ratelimit-limit", "5000")]), || now), None);
        let h = [("x-ratelimit-limit", "lots"), ("x-ratelimit-remaining", "1"), ("x-ratelimit-reset", "1")];
        assert_eq!(parse(&gh, headers(&h), || now), None);
    }

    /// What `decimal` stands in for, on the bytes as they come.
    fn parsed(v: &[u8]) -> Option<f64> {
        std::str::from_utf8(v).ok()?.trim().parse().ok()
    }

    #[test]
    fn decimal_reads_what_the_float_parser_reads() {
        let cases: &[&[u8]] = &[
            b"0",
            b"007",
            b" 5000\t",
            b"\x0b42",
            b"4999.5",
            b"1e3",
            b"+5",
            b"-1",
            b"",
            b"  ",
            b"NaN",
            b"inf",
            b"12 34",
            b"\xff1",
            b"9007199254740993",
            b"9999999999999999999",
            b"18446744073709551616",
            b"123456789012345678901234567890",
        ];
        for v in cases {
            let (got, want) = (decimal(v), parsed(v));
            assert!(got == want || got.is_some_and(f64::is_nan) && want.is_some_and(f64::is_nan), "{v:?}: {got:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn decimal_is_the_float_parser_on_any_bytes(v in proptest::collection::vec(
            proptest::prop_oneof![8 => b'0'..=b'9', 1 => proptest::sample::select(b" \t.e+-x\x0b\xc2\xa0".to_vec())],
            0..24,
        )) {
            let (got, want) = (decimal(&v), parsed(&v));
            proptest::prop_assert!(got == want, "{:?}: {:?} against {:?}", String::from_utf8_lossy(&v), got, want);
        }
    }

    #[test]
    fn go_durations_read_as_openai_writes_them() {
        assert_eq!(go_duration("6m0s"), Some(360.0));
        assert_eq!(go_duration("20ms"), Some(0.02));
        assert_eq!(go_duration("1h2m3.5s"), Some(3723.5));
        assert_eq!(go_duration("5 parsecs"), None);
        assert_eq!(go_duration(""), None);
    }
}
