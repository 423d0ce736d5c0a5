use super::*;

const DOORMAN_EXAMPLE: &str = r#"
resources:
  - identifier_glob: proportional      # exact match first, then glob match, in file order
    capacity: 100
    safe_capacity: 10
    description: proportional example
    algorithm:
      kind: PROPORTIONAL_SHARE
      lease_length: 15
      refresh_interval: 5
      learning_mode_duration: 0
  - identifier_glob: "*"
    capacity: 1000
    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }
"#;

fn errors(text: &str) -> String {
    ResourcesConfig::parse("r.yaml", text).unwrap_err().to_string()
}

#[test]
fn reads_doorman_yaml_as_is() {
    let c = ResourcesConfig::parse("r.yaml", DOORMAN_EXAMPLE).unwrap();
    assert_eq!(c.templates.len(), 2);
    let t = &c.templates[0];
    assert_eq!(t.identifier_glob, "proportional");
    assert_eq!(t.capacity, 100.0);
    assert_eq!(t.safe_capacity, Some(10.0));
    assert_eq!(t.algorithm.kind, Kind::ProportionalShare);
    assert_eq!(t.algorithm.lease_length, Duration::from_secs(15));
    assert_eq!(t.algorithm.learning_mode_duration, Duration::ZERO);
    let star = &c.templates[1];
    assert_eq!(star.safe_capacity, None);
    assert_eq!(star.algorithm.learning_mode_duration, Duration::from_secs(60), "defaults to the lease length");
}

#[test]
fn exact_match_beats_an_earlier_glob() {
    let text = r#"
resources:
  - identifier_glob: "api/*"
    capacity: 1
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
  - identifier_glob: api/special
    capacity: 2
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
  - identifier_glob: "*"
    capacity: 3
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
"#;
    let c = ResourcesConfig::parse("r.yaml", text).unwrap();
    assert_eq!(c.find("api/special").unwrap().capacity, 2.0);
    assert_eq!(c.find("api/other").unwrap().capacity, 1.0);
    assert_eq!(c.find("db").unwrap().capacity, 3.0);
}

#[test]
fn catch_all_is_required_and_last() {
    let missing = errors(
        "resources:\n  - identifier_glob: a\n    capacity: 1\n    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }\n",
    );
    assert!(missing.contains("r.yaml:2:3: resources: no catch-all entry"), "{missing}");
    let not_last = errors(
        "resources:\n  - identifier_glob: '*'\n    capacity: 1\n    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }\n  - identifier_glob: a\n    capacity: 1\n    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }\n",
    );
    assert!(
        not_last.contains("r.yaml:2:5: resources[0].identifier_glob: the catch-all `*` entry must be the last entry"),
        "{not_last}"
    );
}

#[test]
fn original_validation_with_positions() {
    let text = r#"resources:
  - identifier_glob: a
    capacity: 1
    algorithm:
      kind: FAIR_SHAER
      lease_length: 5
      refresh_interval: 10
  - identifier_glob: b
    algorithm: { kind: STATIC, lease_length: 0, refresh_interval: x }
  - identifier_glob: "*"
    capacity: -4
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
"#;
    let e = errors(text);
    for want in [
        "r.yaml:5:13: resources[0].algorithm.kind: unknown algorithm `FAIR_SHAER` (hint: did you mean `FAIR_SHARE`?)",
        "r.yaml:6:21: resources[0].algorithm.lease_length: lease_length (5) must be at least refresh_interval (10)",
        "r.yaml:8:5: resources[1].capacity: missing required field",
        "r.yaml:9:46: resources[1].algorithm.lease_length: must be at least 1 second, not 0",
        "r.yaml:9:67: resources[1].algorithm.refresh_interval: expected a whole number, found `x`",
        "r.yaml:11:15: resources[2].capacity: must be a finite number >= 0, not -4",
    ] {
        assert!(e.contains(want), "missing {want:?} in:\n{e}");
    }
    assert_eq!(e.lines().count(), 6, "{e}");
}

#[test]
fn safe_capacity_alone_is_accepted_and_neither_is_an_error_not_a_crash() {
    let only_safe = "resources:\n  - identifier_glob: '*'\n    safe_capacity: 3\n    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }\n";
    let c = ResourcesConfig::parse("r.yaml", only_safe).unwrap();
    assert_eq!(c.templates[0].capacity, 0.0);
    let neither =
        "resources:\n  - identifier_glob: '*'\n    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }\n";
    assert!(errors(neither).contains("capacity: missing required field"));
}

#[test]
fn unknown_fields_and_bad_types_are_reported() {
    let e = errors("resources:\n  - identifier_glob: '*'\n    capacty: 3\n    algorithm: 7\n");
    assert!(e.contains("r.yaml:3:5: resources[0].capacty: unknown field (hint: did you mean `capacity`?)"), "{e}");
    assert!(e.contains("r.yaml:4:16: resources[0].algorithm: expected a mapping, found a scalar"), "{e}");
    let e = errors("");
    assert!(e.contains("expected a mapping, found null"), "{e}");
}

#[test]
fn parameters_are_read() {
    let text = "resources:\n  - identifier_glob: '*'\n    capacity: 3\n    algorithm:\n      kind: FAIR_SHARE\n      lease_length: 5\n      refresh_interval: 5\n      parameters: [{name: priority_mode, value: strict}]\n";
    let c = ResourcesConfig::parse("r.yaml", text).unwrap();
    assert_eq!(c.templates[0].algorithm.parameter("priority_mode"), Some("strict"));
}

#[test]
fn globs() {
    assert!(glob_match("*", ""));
    assert!(glob_match("*", "a/b/c"));
    assert!(glob_match("api/*", "api/x/y"));
    assert!(!glob_match("api/*", "db/x"));
    assert!(glob_match("a?c", "abc"));
    assert!(!glob_match("a?c", "ac"));
    assert!(glob_match("shard-[0-9]", "shard-7"));
    assert!(!glob_match("shard-[!0-9]", "shard-7"));
    assert!(glob_match("*-[ab]*z", "x-bqqz"));
    assert!(glob_match(r"lit\*", "lit*"));
    assert!(!glob_match(r"lit\*", "litx"));
}

#[test]
fn shipped_examples_and_builtin_default_are_valid() {
    let example = include_str!("../../../../../deploy/examples/resources.yaml");
    let c = ResourcesConfig::parse("deploy/examples/resources.yaml", example).unwrap();
    assert_eq!(c.find("tenant/acme").unwrap().capacity, 20.0);
    let d = ResourcesConfig::builtin_default();
    assert_eq!(d.find("x").unwrap().algorithm.kind, Kind::FairShare);
}

#[test]
fn capacities_take_the_routes_files_units_and_a_bare_number_is_per_second() {
    let text = r#"resources:
  - identifier_glob: a
    capacity: 600/min
    safe_capacity: 60/h
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
  - identifier_glob: b
    capacity: 5000/h
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
  - identifier_glob: c
    capacity: 86400/day
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
  - identifier_glob: d
    capacity: 7/s
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
  - identifier_glob: "*"
    capacity: 12.5
    safe_capacity: -1
    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }
"#;
    let c = ResourcesConfig::parse("r.yaml", text).unwrap();
    let cap = |id: &str| c.find(id).unwrap().capacity;
    assert_eq!(cap("a"), 10.0);
    assert_eq!(c.find("a").unwrap().safe_capacity, Some(1.0 / 60.0));
    assert!((cap("b") - 5000.0 / 3600.0).abs() < 1e-12, "{}", cap("b"));
    assert_eq!(cap("c"), 1.0);
    assert_eq!(cap("d"), 7.0);
    assert_eq!(cap("zzz"), 12.5);
    assert_eq!(c.find("zzz").unwrap().safe_capacity, Some(-1.0));
}

#[test]
fn a_bad_rate_names_its_position_and_the_units() {
    let e = errors(
        "resources:\n  - identifier_glob: '*'\n    capacity: 600/week\n    safe_capacity: x/s\n    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }\n",
    );
    assert!(
        e.contains("r.yaml:3:15: resources[0].capacity: unknown unit `/week`; use /s, /min, /h or /day (hint: a number per second"),
        "{e}"
    );
    assert!(e.contains("r.yaml:4:20: resources[0].safe_capacity: `x` is not a number"), "{e}");
    let e = errors(
        "resources:\n  - identifier_glob: '*'\n    capacity: -5/h\n    algorithm: { kind: STATIC, lease_length: 5, refresh_interval: 5 }\n",
    );
    assert!(e.contains("r.yaml:3:15: resources[0].capacity: must be a finite number >= 0, not -5"), "{e}");
}

#[test]
fn a_calendar_window_takes_its_unit_from_the_capacity() {
    let text = "resources:\n  - identifier_glob: a\n    capacity: 1000/day\n    window: calendar\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n  - identifier_glob: '*'\n    capacity: 5\n    window: rolling\n    algorithm: { kind: FAIR_SHARE, lease_length: 60, refresh_interval: 15 }\n";
    let c = ResourcesConfig::parse("r.yaml", text).unwrap();
    assert_eq!(c.find("a").unwrap().calendar, Some(Duration::from_secs(86400)));
    assert_eq!(c.find("b").unwrap().calendar, None);
    let e = errors(&text.replace("capacity: 1000/day", "capacity: 12"));
    assert!(e.contains("r.yaml:4:13: resources[0].window: a calendar window needs a capacity with a unit (hint: e.g. `capacity: 1000/day`"), "{e}");
    let e = errors(&text.replace("window: calendar", "window: calender"));
    assert!(e.contains("resources[0].window: unknown window `calender` (hint: did you mean `calendar`?)"), "{e}");
}
