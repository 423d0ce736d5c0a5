use super::*;

fn short(name: &str, secs: u64) -> Scenario {
    let mut sc = Scenario::builtin(name).unwrap();
    sc.duration = Duration::from_secs(secs);
    sc
}

#[test]
fn every_builtin_scenario_parses_and_runs_short() {
    for (name, _) in scenario::BUILTIN {
        let mut sim = Sim::new(short(name, 150), 1);
        let r = sim.run(|_| {});
        assert!(r.utilisation > 0.5, "{name}: {r:?}");
        assert!(!sim.samples.is_empty());
    }
}

#[test]
fn the_same_seed_gives_the_same_series() {
    let a = {
        let mut s = Sim::new(short("six", 300), 42);
        s.run(|_| {});
        csv(&s.samples)
    };
    let b = {
        let mut s = Sim::new(short("six", 300), 42);
        s.run(|_| {});
        csv(&s.samples)
    };
    assert_eq!(a, b);
    let c = {
        let mut s = Sim::new(short("six", 300), 43);
        s.run(|_| {});
        csv(&s.samples)
    };
    assert_ne!(a, c, "another seed gives another run");
}

#[test]
fn one_level_never_exceeds_capacity() {
    let mut sim = Sim::new(short("one", 600), 7);
    let r = sim.run(|_| {});
    assert!(r.max_overshoot <= 1.0 + 1e-9, "{r:?}");
    assert_eq!(r.shortfall_events, 0);
    assert!(r.utilisation > 0.95, "{r:?}");
}

#[test]
fn the_real_algorithm_runs() {
    let mut prop = short("five", 300);
    let mut stat = prop.clone();
    stat.algorithm = crate::algorithm::Kind::Static;
    prop.demand = DemandModel::Constant { wants: 20.0 };
    stat.demand = DemandModel::Constant { wants: 20.0 };
    let a = Sim::new(prop, 1).run(|_| {});
    let b = Sim::new(stat, 1).run(|_| {});
    assert_ne!(a, b, "changing the algorithm kind changes the outcome");
    assert!(b.max_overshoot > 1.5, "STATIC caps per client, so 45 × 20 exceeds 500: {b:?}");
    assert!(a.max_overshoot <= 1.0 + 1e-9, "{a:?}");
}

#[test]
fn scenario_errors_have_positions() {
    let e = Scenario::parse("s.yaml", "name: x\nduration: forever\ncapacity: 5\nalgorithm: FAIR\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("s.yaml:2:11: duration: expected a duration, found `forever`"), "{e}");
    assert!(e.contains("s.yaml:4:12: algorithm: unknown algorithm `FAIR`"), "{e}");
}

#[test]
fn the_cli_writes_json_csv_and_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let (csv_path, png) = (dir.path().join("s.csv"), dir.path().join("s.png"));
    let args = SimArgs {
        file: None,
        scenario: Some("four".into()),
        seed: Some(3),
        duration: Some(Duration::from_secs(120)),
        json: true,
        csv: Some(csv_path.clone()),
        trace: false,
        plot: Some(png.clone()),
    };
    run(args).unwrap();
    let text = std::fs::read_to_string(&csv_path).unwrap();
    assert!(text.starts_with("t_s,capacity,total_wants,total_has\n"));
    assert_eq!(text.lines().count(), 1 + 25, "one sample every 5 s over 120 s, and t = 0");
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
}
