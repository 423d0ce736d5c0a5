use super::*;

const GOOD: &str = r#"
listen: 127.0.0.1:15001
admin: 127.0.0.1:15000
default: deny
upstreams:
  github:
    url: https://api.github.com
    connect_timeout: 2s
    timeout: 30s
resources:
  github-core:
    kind: rate
    id: "github/{header.x-tenant}"
    capacity: 3000/min
    max_wait: 500ms
    burst: 5
    max_keys: 1000
  github-inflight:
    kind: gauge
    capacity: 10
    max_wait: 2s
  daily:
    kind: rate
    capacity: 1000/day
routes:
  - name: github
    match: { host: api.github.com, path_prefix: /, methods: [GET, POST] }
    upstream: github
    resources: [github-core, { resource: github-inflight, cost: 1 }]
"#;

#[test]
fn the_issue_example_parses() {
    let c = RoutesConfig::parse("r.yaml", GOOD).unwrap();
    assert_eq!(c.listen.to_string(), "127.0.0.1:15001");
    assert_eq!(c.default, DefaultAction::Deny);
    let core = &c.resources["github-core"];
    assert_eq!(core.kind, ResourceKind::Rate);
    assert_eq!(core.capacity.per_second(), 50.0);
    assert_eq!(core.max_wait, Duration::from_millis(500));
    assert_eq!(core.id.segments, vec![Segment::Literal("github/".into()), Segment::Header("x-tenant".into())]);
    assert_eq!(c.resources["github-inflight"].kind, ResourceKind::Gauge);
    assert_eq!(c.resources["daily"].burst, 1000.0, "a daily quota's burst defaults to the whole quota");
    assert_eq!(c.resources["daily"].id.text, "daily", "id defaults to the key");
    let r = &c.routes[0];
    assert_eq!(r.upstream.as_deref(), Some("github"));
    assert_eq!(r.resources, vec![("github-core".to_string(), 1.0), ("github-inflight".to_string(), 1.0)]);
    assert_eq!(r.matcher.methods, vec![http::Method::GET, http::Method::POST]);
    assert_eq!(c.upstreams["github"].timeout, DEFAULT_TIMEOUT);
}

#[test]
fn capacity_forms() {
    for (s, per_s) in [
        ("50", 50.0),
        ("50/s", 50.0),
        ("3000/min", 50.0),
        ("18000/h", 5.0),
        ("86400/day", 1.0),
        ("0.5", 0.5),
        ("0", 0.0),
    ] {
        assert_eq!(parse_capacity(s).unwrap().per_second(), per_s, "{s}");
    }
    assert!(parse_capacity("5/week").is_err());
    assert!(parse_capacity("-1").is_err());
    assert!(parse_capacity("x/s").is_err());
}

#[test]
fn lease_rates_take_units_too() {
    let text = "resources:\n  a: { kind: rate, capacity: 5000/h, safe_capacity: 360/h, wants: 60/min, min_wants: 0.5, max_wants: 2/s }\n";
    let c = RoutesConfig::parse("r.yaml", text).unwrap();
    let l = &c.resources["a"].lease;
    assert_eq!(l.safe_capacity, Some(0.1));
    assert_eq!(l.wants, Some(super::super::doorman::Wants::Fixed(1.0)));
    assert_eq!((l.min_wants, l.max_wants), (0.5, Some(2.0)));
    let e = RoutesConfig::parse("r.yaml", "resources:\n  a: { kind: rate, capacity: 5, safe_capacity: 3/week }\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("r.yaml:2:48: resources.a.safe_capacity: unknown unit `/week`"), "{e}");
}

#[test]
fn every_error_is_reported_with_its_position() {
    let text = "\
listen: nowhere
upstreams:
  api:
    url: ftp://x
    timeout: soon
resources:
  r1:
    kind: rat
    capacity: 5/week
  g1:
    kind: gauge
    capacity: 5/s
routes:
  - name: a
    upstream: apii
    resources: [r2, { resource: g1, cost: 1.5 }]
    match: { methods: [GET], colour: red }
";
    let e = RoutesConfig::parse("bad.yaml", text).unwrap_err();
    // No route serves these listeners either: another error (below), not this test's.
    let lines: Vec<String> =
        e.diagnostics.iter().map(|d| d.to_string()).filter(|l| !l.contains("no route has")).collect();
    let want = [
        "bad.yaml:1:9: listen:",
        "bad.yaml:4:10: upstreams.api.url:",
        "bad.yaml:5:14: upstreams.api.timeout:",
        "bad.yaml:8:11: resources.r1.kind: unknown kind `rat` (hint: did you mean `rate`?)",
        "bad.yaml:9:15: resources.r1.capacity: unknown unit `/week`",
        "bad.yaml:12:15: resources.g1.capacity: a gauge's capacity is a number of requests in flight",
        "bad.yaml:15:15: routes[0].upstream: unknown upstream `apii` (hint: did you mean `api`?)",
        "bad.yaml:16:17: routes[0].resources[0]: unknown resource `r2`",
        "bad.yaml:17:30: routes[0].match.colour: unknown field",
    ];
    for w in want {
        assert!(lines.iter().any(|l| l.starts_with(w)), "missing {w:?} in:\n{}", lines.join("\n"));
    }
}

#[test]
fn templates() {
    assert!(IdTemplate::parse("a/{host}/{method}/{path.2}").is_ok());
    assert!(IdTemplate::parse("a/{path.0}").is_err());
    assert!(IdTemplate::parse("a/{nope}").is_err());
    assert!(IdTemplate::parse("a/{host").is_err());
    assert!(IdTemplate::parse("plain").unwrap().is_fixed());
}

#[test]
fn http2_is_offered_unless_turned_off_and_cannot_contradict_h2c() {
    let text = "upstreams:\n  a: { url: \"https://x\" }\n  b: { url: \"https://x\", http2: false }\nroutes:\n  - { name: r, upstream: a }\n";
    let c = RoutesConfig::parse("r.yaml", text).unwrap();
    assert!(c.upstreams["a"].http2, "offered by default");
    assert!(!c.upstreams["b"].http2);
    let bad = "upstreams:\n  a: { url: \"http://x\", h2c: true, http2: false }\n";
    let e = RoutesConfig::parse("bad.yaml", bad).unwrap_err();
    let lines: Vec<String> = e.diagnostics.iter().map(|d| d.to_string()).collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("bad.yaml:2:") && l.contains("upstreams.a.http2: `http2: false` contradicts")),
        "{lines:?}"
    );
}

/// Two resources on one fixed lease id would each enforce the whole lease:
/// the second is refused at its `id` (or its name: an id defaults to the name).
#[test]
fn a_fixed_id_belongs_to_one_resource() {
    let text = "\
resources:
  a:
    kind: rate
    id: shared
    capacity: 5/s
  b:
    kind: rate
    capacity: 5/s
    id: shared
  shared:
    kind: gauge
    capacity: 3
  t:
    kind: rate
    id: \"shared/{header.x}\"
    capacity: 5/s
";
    let e = RoutesConfig::parse("ids.yaml", text).unwrap_err();
    let lines: Vec<String> = e.diagnostics.iter().map(|d| d.to_string()).collect();
    assert_eq!(
        lines,
        [
            "ids.yaml:9:9: resources.b.id: id `shared` is already resource `a`'s (hint: each resource leases its own id; routes can share one resource)",
            "ids.yaml:10:3: resources.shared.id: id `shared` is already resource `b`'s (hint: each resource leases its own id; routes can share one resource)",
        ],
    );
}

/// Two resources whose ids could make the same lease id, templated or not,
/// would each enforce that one lease: the second is refused at its `id`
/// (or its name, which a missing id defaults to).
#[test]
fn templated_ids_that_could_meet_belong_to_one_resource() {
    let text = "\
resources:
  a:
    kind: rate
    id: \"t/{header.x}\"
    capacity: 5/s
  b:
    kind: rate
    capacity: 5/s
    id: \"t/{header.y}\"
  c:
    kind: gauge
    id: \"t/{path.1}/{method}\"
    capacity: 3
  t/1:
    kind: rate
    capacity: 5/s
  e:
    kind: rate
    id: u-1
    capacity: 5/s
  f:
    kind: rate
    id: \"u-{header.x}\"
    capacity: 5/s
  g:
    kind: rate
    id: \"v/{header.x}/in\"
    capacity: 5/s
  h:
    kind: rate
    id: \"v/{header.x}/out\"
    capacity: 5/s
  i:
    kind: rate
    id: \"w/{header.x}\"
    capacity: 5/s
  j:
    kind: rate
    id: w/
    capacity: 5/s
  k:
    kind: rate
    id: w
    capacity: 5/s
  l:
    kind: rate
    id: \"{host}/in\"
    capacity: 5/s
";
    let e = RoutesConfig::parse("ids.yaml", text).unwrap_err();
    let lines: Vec<String> = e.diagnostics.iter().map(|d| d.to_string()).collect();
    let hint = "(hint: each resource leases its own ids: give the two literal prefixes neither of which begins the \
                other (e.g. `a/{header.x}` and `b/{header.x}`), or let the routes share one resource)";
    assert_eq!(
        lines,
        [
            format!(
                "ids.yaml:9:9: resources.b.id: id `t/{{header.y}}` could make the same lease id as resource `a`'s id `t/{{header.x}}` {hint}"
            ),
            format!(
                "ids.yaml:12:9: resources.c.id: id `t/{{path.1}}/{{method}}` could make the same lease id as resource `b`'s id `t/{{header.y}}` {hint}"
            ),
            format!(
                "ids.yaml:14:3: resources.t/1.id: id `t/1` is one resource `b`'s id `t/{{header.y}}` could make {hint}"
            ),
            format!("ids.yaml:23:9: resources.f.id: id `u-{{header.x}}` could make resource `e`'s id `u-1` {hint}"),
            format!(
                "ids.yaml:39:9: resources.j.id: id `w/` is one resource `i`'s id `w/{{header.x}}` could make {hint}"
            ),
            format!(
                "ids.yaml:47:9: resources.l.id: id `{{host}}/in` could make the same lease id as resource `i`'s id `w/{{header.x}}` {hint}"
            ),
        ],
        "g and h differ in their suffixes, i and k in their prefixes, c cannot make `t/1`",
    );
}

/// When two ids could be the same lease id: the literal prefix of one begins
/// the other's and the literal suffix of one ends the other's; a fixed id is
/// matched against the template, each placeholder making any text.
#[test]
fn when_two_ids_could_meet() {
    let id = |t: &str| IdTemplate::parse(t).unwrap();
    let meet = |a: &str, b: &str| {
        let (a, b) = (id(a), id(b));
        assert_eq!(a.could_meet(&b), b.could_meet(&a), "symmetric");
        a.could_meet(&b)
    };
    for (a, b) in [
        ("x", "x"),
        ("t/{header.a}", "t/{header.b}"),
        ("t/{header.a}", "t/x/{path.1}"),
        ("{host}", "anything/{method}"),
        ("a{header.x}b{header.y}c", "a{header.z}c"),
        ("ab{header.x}", "{header.y}bc"),
        ("t/{header.x}", "t/"),
        ("t/{header.x}/{path.2}", "t//"),
        ("t/{header.x}-{header.y}/z", "t/1-2/z"),
    ] {
        assert!(meet(a, b), "`{a}` and `{b}` could meet");
    }
    for (a, b) in [
        ("x", "y"),
        ("a/{header.x}", "b/{header.x}"),
        ("{header.x}/in", "{header.x}/out"),
        ("t/{header.x}", "t"),
        ("t/{header.x}-{header.y}/z", "t/12/z"),
        ("ab{header.x}b", "ab"),
    ] {
        assert!(!meet(a, b), "`{a}` and `{b}` could not meet");
    }
}

/// An id that capacity servers would refuse (over 1,024 bytes) is refused
/// here, at its position: in a GetCapacity it would fail every key's lease.
#[test]
fn an_id_longer_than_servers_accept_is_refused() {
    let long = "x".repeat(1100);
    let text = format!(
        "resources:\n  a:\n    kind: rate\n    id: {long}\n    capacity: 5/s\n  b:\n    kind: rate\n    id: \"{long}/{{header.x}}\"\n    capacity: 5/s\n  ok:\n    kind: rate\n    id: \"{}/{{header.x}}\"\n    capacity: 5/s\n",
        "y".repeat(1000)
    );
    let e = RoutesConfig::parse("long.yaml", &text).unwrap_err();
    let lines: Vec<String> = e.diagnostics.iter().map(|d| d.to_string()).collect();
    assert_eq!(
        lines,
        [
            "long.yaml:4:9: resources.a.id: is 1100 bytes long; capacity servers accept at most 1024",
            "long.yaml:8:9: resources.b.id: is 1101 bytes long without its placeholders; capacity servers accept at most 1024",
        ]
    );
}

#[test]
fn a_rate_bursts_what_its_unit_allows_by_default() {
    let yaml = "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
                resources:\n  fast: { kind: rate, capacity: 100/s }\n  slow: { kind: rate, capacity: 5000/h }\n  \
                day: { kind: rate, capacity: 300/day }\n  tpm: { kind: rate, capacity: 6000/min }\n  \
                trickle: { kind: rate, capacity: 30/h }\n\
                routes:\n  - { name: all, upstream: up, resources: [fast, slow, day, tpm, trickle] }\n";
    let c = RoutesConfig::parse("r.yaml", yaml).unwrap();
    assert_eq!(c.resources["fast"].burst, 100.0, "two requests in a row within 100/s both pass");
    assert_eq!(c.resources["fast"].burst_span, Some(Duration::from_secs(1)));
    assert_eq!(c.resources["tpm"].burst, 6000.0, "a per-minute limit may be spent at once");
    assert_eq!(c.resources["tpm"].burst_span, Some(Duration::from_secs(60)), "a minute of each key's lease");
    assert!((c.resources["slow"].burst - 5000.0 / 60.0).abs() < 1e-9, "a minute's worth");
    assert_eq!(c.resources["trickle"].burst, 1.0, "at least one request");
    assert_eq!(c.resources["day"].burst, 300.0);
}

#[test]
fn a_cost_that_can_never_pass_is_refused_where_it_is_written() {
    let yaml = "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
                resources:\n  tokens: { kind: rate, capacity: 100/s, burst: 50 }\n  slots: { kind: gauge, capacity: 2 }\n\
                routes:\n  - name: all\n    upstream: up\n    resources:\n      - { resource: tokens, cost: 150 }\n      - { resource: slots, cost: 3 }\n";
    let e = RoutesConfig::parse("r.yaml", yaml).unwrap_err().to_string();
    assert!(e.contains("r.yaml:10:"), "{e}");
    assert!(e.contains("cost 150 is larger than resource `tokens`'s burst of 50"), "{e}");
    assert!(e.contains("r.yaml:11:") && e.contains("cost 3 is more than gauge `slots`'s capacity of 2"), "{e}");
}

/// An upstream's own listener: parsed as IP:port; an address another
/// listener of the file has is refused at the upstream's `listen`.
#[test]
fn upstream_listeners_have_addresses_of_their_own() {
    let good = "upstreams:\n  a: { url: http://a.test, listen: 127.0.0.1:15002 }\n  b: { url: http://b.test, listen: 127.0.0.1:0 }\n  c: { url: http://c.test, listen: \"127.0.0.1:0\" }\n  d: { url: http://d.test }\n\
                routes:\n  - { name: a, upstream: a }\n  - { name: b, upstream: b }\n  - { name: c, upstream: c }\n";
    let c = RoutesConfig::parse("ok.yaml", good).unwrap();
    assert_eq!(c.upstreams["a"].listen, Some("127.0.0.1:15002".parse().unwrap()));
    assert_eq!(c.upstreams["b"].listen, Some("127.0.0.1:0".parse().unwrap()), "port 0 clashes with nothing");
    assert_eq!(c.upstreams["d"].listen, None);

    let text = "\
listen: 127.0.0.1:15001
admin: 127.0.0.1:15000
upstreams:
  main: { url: http://a.test, listen: 127.0.0.1:15001 }
  admin:
    url: http://b.test
    listen: 127.0.0.1:15000
  one: { url: http://c.test, listen: 127.0.0.1:15002 }
  two: { url: http://d.test, listen: 0.0.0.0:15002 }
  bad: { url: http://e.test, listen: localhost:15003 }
  port: { url: http://f.test, listen: 15004 }
";
    let e = RoutesConfig::parse("bad.yaml", text).unwrap_err();
    // No route serves these listeners either: another error (below), not this test's.
    let lines: Vec<String> =
        e.diagnostics.iter().map(|d| d.to_string()).filter(|l| !l.contains("no route has")).collect();
    let want = [
        "bad.yaml:4:39: upstreams.main.listen: `127.0.0.1:15001` is already the address of `listen`",
        "bad.yaml:7:13: upstreams.admin.listen: `127.0.0.1:15000` is already the address of `admin`",
        "bad.yaml:9:38: upstreams.two.listen: `0.0.0.0:15002` is already the address of upstream `one`",
        "bad.yaml:10:38: upstreams.bad.listen: `localhost:15003` is not an IP:port address",
        "bad.yaml:11:39: upstreams.port.listen: `15004` is not an IP:port address",
    ];
    assert_eq!(lines.len(), want.len(), "{}", lines.join("\n"));
    for w in want {
        assert!(lines.iter().any(|l| l.starts_with(w)), "missing {w:?} in:\n{}", lines.join("\n"));
    }
}

#[test]
fn costs_from_the_request_and_the_response_are_read_and_checked() {
    let head = "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
                resources:\n  tokens: { kind: rate, capacity: 100/s, burst: 500 }\n\
                routes:\n  - name: all\n    upstream: up\n    resources:\n";
    let ok = format!(
        "{head}      - {{ resource: tokens, cost: \"{{header.X-Max-Tokens}}\", default_cost: 200, settle: {{ response_header: X-Usage-Total-Tokens }} }}\n"
    );
    let c = RoutesConfig::parse("r.yaml", &ok).unwrap();
    let route = &c.routes[0];
    assert_eq!(route.resources, vec![("tokens".to_string(), 200.0)]);
    let rule = &route.cost_rules["tokens"];
    assert_eq!(rule.header.as_deref(), Some("x-max-tokens"));
    assert_eq!(rule.settle, Some(SettleFrom::Header("x-usage-total-tokens".into())));
    for (entry, error) in [
        ("{ resource: tokens, cost: \"{path.1}\" }", "expected a number, \"{header.NAME}\", \"{json.PATH}\""),
        ("{ resource: tokens, cost: 5, default_cost: 3 }", "default_cost applies to a cost read from the request"),
        ("{ resource: tokens, settle: { response_header: \"a b\" } }", "`a b` is not a valid header name"),
        ("{ resource: tokens, settle: { body: usage.total } }", "settle.body: unknown field"),
    ] {
        let e = RoutesConfig::parse("r.yaml", &format!("{head}      - {entry}\n")).unwrap_err().to_string();
        assert!(e.contains("r.yaml:9:") && e.contains(error), "{entry}: {e}");
    }
}

#[test]
fn costs_from_the_request_body_are_read_and_checked() {
    let head = "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
                resources:\n  tokens: { kind: rate, capacity: 100/s, burst: 5000 }\n  \
                slots: { kind: gauge, capacity: 4 }\n\
                routes:\n  - name: all\n    upstream: up\n    resources:\n";
    let parse = |entry: &str| RoutesConfig::parse("r.yaml", &format!("{head}      - {entry}\n"));
    let rule = |entry: &str| {
        let c = parse(entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
        let route = &c.routes[0];
        (route.resources[0].1, route.cost_rules["tokens"].clone())
    };
    let (cost, r) = rule("{ resource: tokens, cost: \"{json.usage.0.max}\", default_cost: 20 }");
    let Some(BodyCost::Json(p)) = &r.body else { panic!("{r:?}") };
    assert_eq!((cost, p.text.as_str(), p.steps.len()), (20.0, "usage.0.max", 3));
    assert_eq!(r.header, None);
    assert_eq!(r.body.as_ref().unwrap().to_string(), "the number at `usage.0.max` in the request's JSON");
    let estimate = |api, default_output_tokens| Some(BodyCost::Estimate(Estimate { api, default_output_tokens }));
    // An estimate's fallback is the estimate of a request without prompt or output limit.
    let (cost, r) = rule("{ resource: tokens, cost: { estimate: openai } }");
    assert_eq!((cost, r.body), (DEFAULT_OUTPUT_TOKENS as f64, estimate(LlmApi::OpenAi, DEFAULT_OUTPUT_TOKENS)));
    let (cost, r) = rule("{ resource: tokens, cost: { estimate: anthropic, default_output_tokens: 300 } }");
    let said = "an estimate of the anthropic call's tokens (300 output tokens when it sets no limit)";
    assert_eq!(r.body.as_ref().unwrap().to_string(), said);
    assert_eq!((cost, r.body), (300.0, estimate(LlmApi::Anthropic, 300)));
    let (cost, r) =
        rule("{ resource: tokens, cost: { estimate: openai }, default_output_tokens: 200, default_cost: 9 }");
    assert_eq!((cost, r.body), (9.0, estimate(LlmApi::OpenAi, 200)));
    // Worked out, not written: above the burst it counts as the burst.
    let (cost, _) = rule("{ resource: tokens, cost: { estimate: openai, default_output_tokens: 90000 } }");
    assert_eq!(cost, 5000.0);
    let (_, r) = rule("{ resource: tokens, settle: { usage: openai } }");
    assert!(r.wants_openai_usage());
    let (_, r) = rule("{ resource: tokens, settle: { usage: anthropic } }");
    assert!(!r.wants_openai_usage());
    for (entry, error) in [
        ("{ resource: tokens, cost: \"{json.}\" }", "resources[0].cost: `{json.}`: the path is empty"),
        ("{ resource: tokens, cost: \"{json.a..b}\" }", "`a..b` has an empty step"),
        ("{ resource: tokens, cost: { estimate: gemini } }", "resources[0].cost.estimate: unknown API `gemini`"),
        ("{ resource: tokens, cost: { estimat: openai } }", "did you mean `estimate`?"),
        ("{ resource: tokens, cost: { default_output_tokens: 5 } }", "cost.estimate: missing required field"),
        ("{ resource: tokens, cost: { estimate: openai, default_output_tokens: 0 } }", "must be at least 1, not 0"),
        (
            "{ resource: tokens, cost: { estimate: openai, default_output_tokens: 5 }, default_output_tokens: 5 }",
            "default_output_tokens is given twice",
        ),
        ("{ resource: tokens, cost: 5, default_output_tokens: 5 }", "applies to an estimated cost"),
        ("{ resource: slots, cost: \"{json.n}\" }", "`slots` is a gauge: a cost read from the request's body"),
    ] {
        let e = parse(entry).unwrap_err().to_string();
        assert!(e.starts_with("r.yaml:10:") && e.contains(error), "{entry}: {e}");
        assert_eq!(e.lines().count(), 1, "{entry}: one error, not a cascade: {e}");
    }
}

#[test]
fn a_calendar_window_is_for_rates_written_with_a_unit() {
    let base = "resources:\n  r: { kind: rate, capacity: 120/min, window: calendar }\n";
    let c = RoutesConfig::parse("r.yaml", base).unwrap();
    assert!(c.resources["r"].calendar);
    assert_eq!(c.resources["r"].capacity.window, Duration::from_secs(60));
    let e = RoutesConfig::parse("r.yaml", &base.replace("120/min", "2")).unwrap_err().to_string();
    assert!(e.contains("resources.r.window: a calendar window needs a capacity with a unit"), "{e}");
    let e = RoutesConfig::parse("r.yaml", "resources:\n  g: { kind: gauge, capacity: 4, window: calendar }\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("resources.g.window: a window applies to rate resources only"), "{e}");
}

/// A routes file whose one route lists `entry` (at line 9) among its resources.
fn parse_entry(entry: &str) -> Result<RoutesConfig, ConfigError> {
    let head = "upstreams:\n  up: { url: \"http://127.0.0.1:9\" }\n\
                resources:\n  tokens: { kind: rate, capacity: 100/s, burst: 500 }\n\
                routes:\n  - name: all\n    upstream: up\n    resources:\n";
    RoutesConfig::parse("r.yaml", &format!("{head}      - {entry}\n"))
}

#[test]
fn a_cost_settled_from_the_json_body_is_read_and_checked() {
    for (entry, steps) in [
        (
            "{ resource: tokens, cost: 150, settle: { response_json: usage.total_tokens } }",
            &["usage", "total_tokens"][..],
        ),
        ("{ resource: tokens, settle: { response_json: choices.0.usage.n } }", &["choices", "0", "usage", "n"]),
        ("{ resource: tokens, settle: { response_json: \"tokens\" } }", &["tokens"]),
    ] {
        let c = parse_entry(entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
        let Some(SettleFrom::Json(p)) = &c.routes[0].cost_rules["tokens"].settle else {
            panic!("{entry}: no JSON path")
        };
        assert_eq!(p.steps, steps, "{entry}");
    }
    let prefix = "r.yaml:9:";
    for (entry, error) in [
        (
            "{ resource: tokens, settle: { response_header: x-tokens, response_json: usage.total } }",
            "resources[0].settle.response_json: give one of response_header, response_json or usage",
        ),
        ("{ resource: tokens, settle: {} }", "resources[0].settle: expected response_header, response_json or usage"),
        ("{ resource: tokens, settle: { response_json: \"\" } }", "settle.response_json: the path is empty"),
        ("{ resource: tokens, settle: { response_json: } }", "settle.response_json: expected a string"),
        ("{ resource: tokens, settle: { response_json: usage..total } }", "`usage..total` has an empty step"),
        ("{ resource: tokens, settle: { response_json: .total } }", "`.total` has an empty step"),
        ("{ resource: tokens, settle: { response_json: [usage] } }", "settle.response_json: expected a string"),
        ("{ resource: tokens, settle: { response_jsn: usage.total } }", "did you mean `response_json`?"),
        ("{ resource: tokens, settle: usage.total }", "settle: expected a mapping"),
    ] {
        let e = parse_entry(entry).unwrap_err().to_string();
        assert!(e.starts_with(prefix) && e.contains(error), "{entry}: {e}");
        assert_eq!(e.lines().count(), 1, "{entry}: one error, not a cascade: {e}");
    }
    let deep = vec!["a"; MAX_JSON_PATH_STEPS + 1].join(".");
    let e =
        parse_entry(&format!("{{ resource: tokens, settle: {{ response_json: {deep} }} }}")).unwrap_err().to_string();
    assert!(e.contains(&format!("more than {MAX_JSON_PATH_STEPS}")), "{e}");
}

#[test]
fn a_doorman_section_without_backoff_backs_off_as_documented() {
    let cfg = RoutesConfig::parse(
        "routes.yaml",
        "doorman: { servers: [\"capacity:15100\"], client_id: app }\nresources:\n  api: { kind: rate, capacity: 5/s }\n",
    )
    .unwrap();
    let b = cfg.doorman.expect("the doorman section").backoff;
    // docs/proxy.md's `doorman.` table: 500ms, 2s, 1.5, 0.3.
    assert_eq!(b.initial, Duration::from_millis(500));
    assert_eq!(b.max, Duration::from_secs(2));
    assert_eq!(b.multiplier, 1.5);
    assert_eq!(b.randomization, 0.3);
}

/// An upstream's own listener serves only the routes that name its
/// upstream: with none, every request there would get 403, so the file is
/// refused at that `listen`, naming the routes that lack `upstream:`. A
/// route without `upstream` stays valid: it serves the main listener
/// (forward-proxy style).
#[test]
fn an_upstream_listener_no_route_serves_is_refused() {
    let text = "\
upstreams:
  api: { url: http://a.test, listen: 127.0.0.1:0 }
routes:
  - name: chat
    resources: []
";
    let e = RoutesConfig::parse("r.yaml", text).unwrap_err().to_string();
    assert!(
        e.contains(
            "r.yaml:2:38: upstreams.api.listen: no route has `upstream: api`, so every request on this listener \
             would get 403 (no-route) (hint: add `upstream: api` to route `chat` (line 4): a route without \
             `upstream` serves only the main listener)"
        ),
        "{e}"
    );
    let e = RoutesConfig::parse("r.yaml", "upstreams:\n  api: { url: http://a.test, listen: 127.0.0.1:0 }\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("hint: add a route with `upstream: api`, or drop this `listen`"), "{e}");
    // Named by one route, the listener is served; the route without `upstream` stays (forward proxy).
    let ok = format!("{text}  - {{ name: api, upstream: api }}\n");
    let c = RoutesConfig::parse("r.yaml", &ok).unwrap();
    assert_eq!(c.routes[0].upstream, None);
    // Without upstream listeners, routes without `upstream` are a forward proxy's.
    let forward = "resources:\n  r: { kind: rate, capacity: 5 }\nroutes:\n  - { name: any, resources: [r] }\n";
    assert!(RoutesConfig::parse("r.yaml", forward).is_ok());
}

/// With a `doorman:` section the capacity servers decide a resource's
/// window: a routes file's `window: calendar` is taken, with a warning at
/// the field saying so; without one there is nothing to warn of.
#[test]
fn a_calendar_window_with_a_doorman_section_is_warned_of() {
    let res = "resources:\n  r:\n    kind: rate\n    capacity: 120/min\n    window: calendar\n";
    let c = RoutesConfig::parse("r.yaml", res).unwrap();
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let c = RoutesConfig::parse("r.yaml", &format!("doorman:\n  servers: [\"127.0.0.1:1\"]\n{res}")).unwrap();
    let w: Vec<String> = c.warnings.iter().map(|d| d.to_string()).collect();
    assert_eq!(
        w,
        ["r.yaml:7:13: resources.r.window: `window: calendar` applies only without a `doorman:` section; with \
          capacity servers it is ignored here (hint: write `window: calendar` in the capacity server's resources \
          file, on the entry whose identifier_glob matches `r` (docs/server.md, \"Calendar windows\"))"]
    );
}

/// The API a route leads to, from its resources' quota presets.
#[test]
fn a_routes_api_dialect_comes_from_its_quota_presets() {
    let text = "\
upstreams:
  up: { url: http://a.test }
resources:
  oa: { kind: rate, capacity: 5, upstream_quota: { headers: openai-tokens } }
  an: { kind: rate, capacity: 5, upstream_quota: { headers: anthropic-input-tokens } }
  gh: { kind: rate, capacity: 5, upstream_quota: { headers: github } }
  plain: { kind: rate, capacity: 5 }
routes:
  - { name: openai, upstream: up, resources: [plain, oa] }
  - { name: anthropic, upstream: up, resources: [an, oa] }
  - { name: github, upstream: up, resources: [gh, plain] }
  - { name: none, upstream: up }
";
    let c = RoutesConfig::parse("r.yaml", text).unwrap();
    let dialects: Vec<_> = c.routes.iter().map(|r| c.api_dialect(r)).collect();
    assert_eq!(dialects, [Some(ApiDialect::OpenAi), Some(ApiDialect::Anthropic), None, None]);
    // A cost settled from an API's usage, or estimated from its requests, names the API too.
    let text = "\
upstreams:
  up: { url: http://a.test }
resources:
  tokens: { kind: rate, capacity: 5 }
routes:
  - { name: settled, upstream: up, resources: [{ resource: tokens, settle: { usage: anthropic } }] }
  - { name: estimated, upstream: up, resources: [{ resource: tokens, cost: { estimate: openai } }] }
";
    let c = RoutesConfig::parse("r.yaml", text).unwrap();
    let dialects: Vec<_> = c.routes.iter().map(|r| c.api_dialect(r)).collect();
    assert_eq!(dialects, [Some(ApiDialect::Anthropic), Some(ApiDialect::OpenAi)]);
}

#[test]
fn a_cost_settled_from_token_counts_is_read_and_checked() {
    use crate::config::usage::{Price, Tokens, UsageApi, UsageRule};
    let price = Some(Price { input_per_million: 0.15, output_per_million: 0.6 });
    for (entry, want) in [
        ("{ resource: tokens, settle: { usage: openai } }", (UsageApi::OpenAi, Tokens::Total, None)),
        (
            "{ resource: tokens, settle: { usage: anthropic, tokens: output } }",
            (UsageApi::Anthropic, Tokens::Output, None),
        ),
        ("{ resource: tokens, settle: { usage: openai, tokens: input } }", (UsageApi::OpenAi, Tokens::Input, None)),
        (
            "{ resource: tokens, cost: 0.05, settle: { usage: openai, price: { input_per_million: 0.15, output_per_million: 0.60 } } }",
            (UsageApi::OpenAi, Tokens::Total, price),
        ),
        (
            "{ resource: tokens, settle: { usage: anthropic, tokens: output, price: { output_per_million: 15 } } }",
            (UsageApi::Anthropic, Tokens::Output, Some(Price { input_per_million: 0.0, output_per_million: 15.0 })),
        ),
    ] {
        let c = parse_entry(entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
        let (api, tokens, price) = want;
        assert_eq!(c.routes[0].cost_rules["tokens"].settle, Some(SettleFrom::Usage(UsageRule { api, tokens, price })));
    }
    assert_eq!(
        parse_entry("{ resource: tokens, cost: 0.05, settle: { usage: openai } }").unwrap().routes[0].resources[0].1,
        0.05
    );
    for (entry, error) in [
        (
            "{ resource: tokens, settle: { usage: openia } }",
            "settle.usage: unknown usage preset `openia` (hint: did you mean `openai`?)",
        ),
        (
            "{ resource: tokens, settle: { usage: gemini } }",
            "unknown usage preset `gemini` (hint: one of openai, anthropic)",
        ),
        (
            "{ resource: tokens, settle: { usage: openai, tokens: all } }",
            "settle.tokens: expected input, output or total, not `all`",
        ),
        (
            "{ resource: tokens, settle: { usage: openai, price: { input_per_million: -1, output_per_million: 1 } } }",
            "settle.price.input_per_million: must be a number of at least 0, not -1",
        ),
        (
            "{ resource: tokens, settle: { usage: openai, price: { input_per_million: 1 } } }",
            "settle.price.output_per_million: missing required field: tokens: total counts these tokens",
        ),
        (
            "{ resource: tokens, settle: { usage: openai, price: { input: 1 } } }",
            "price.input: unknown field (hint: known fields: input_per_million",
        ),
        (
            "{ resource: tokens, settle: { response_header: x-cost, price: { input_per_million: 1, output_per_million: 1 } } }",
            "settle.price: `price` applies to a cost settled from token counts (usage)",
        ),
        ("{ resource: tokens, settle: { response_json: usage.n, tokens: output } }", "settle.tokens: `tokens` applies"),
        ("{ resource: tokens, settle: { tokens: output } }", "settle.tokens: `tokens` applies"),
        (
            "{ resource: tokens, settle: { usage: openai, response_json: usage.n } }",
            "give one of response_header, response_json or usage",
        ),
        ("{ resource: tokens, settle: { usage: } }", "settle.usage: expected a string"),
        ("{ resource: tokens, settle: { usage: openai, tokens: [input] } }", "settle.tokens: expected a string"),
    ] {
        let e = parse_entry(entry).unwrap_err().to_string();
        assert!(e.starts_with("r.yaml:9:") && e.contains(error), "{entry}: {e}");
        assert_eq!(e.lines().count(), 1, "{entry}: one error, not a cascade: {e}");
    }
}
