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
    stat.algorithm = usher_core::config::resources::Kind::Static;
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
        clients: None,
        trace: false,
        plot: Some(png.clone()),
    };
    run(args).unwrap();
    let text = std::fs::read_to_string(&csv_path).unwrap();
    assert!(text.starts_with("t_s,capacity,total_wants,total_has,total_used\n"));
    assert_eq!(text.lines().count(), 1 + 121, "one sample a second over 120 s, and t = 0");
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
}

fn sample(t: f64, wants: f64, has: f64) -> Sample {
    Sample {
        t,
        capacity: 100.0,
        wants,
        has,
        used: has.min(wants),
        rpcs: t as u64 * 10,
        rpcs_by_level: vec![t as u64 * 2, t as u64 * 8],
        fairness: None,
    }
}

#[test]
fn the_report_keeps_start_up_apart_and_times_recovery_after_each_mishap() {
    // 0-2 s start-up (below 95%), then full; an election at 5 s dips at 7-8 s;
    // a master loss from 12 s to 14 s dips at 16 s; over capacity at 20 s.
    let has = [
        0.0, 50.0, 90.0, 100.0, 100.0, 100.0, 100.0, 60.0, 80.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 50.0,
        100.0, 100.0, 100.0, 110.0, 100.0,
    ];
    let samples: Vec<Sample> = has.iter().enumerate().map(|(i, h)| sample(i as f64, 200.0, *h)).collect();
    let mishaps = vec![
        Mishap { kind: "election", at: 5.0, recover_from: 5.0 },
        Mishap { kind: "master_loss", at: 12.0, recover_from: 14.0 },
    ];
    let r = report(&samples, &mishaps, 22.0, 60.0);
    assert_eq!(r.startup_s, 3.0, "{r:?}");
    assert!((r.startup_utilisation - (0.0 + 0.5 + 0.9) / 3.0).abs() < 1e-9, "{r:?}");
    let steady = (has.len() - 3) as f64;
    let expected = (steady - 0.4 - 0.2 - 0.5) / steady;
    assert!((r.utilisation - expected).abs() < 1e-9, "used is capped at the target: {r:?}");
    let e = &r.mishaps["election"];
    assert_eq!((e.count, e.convergence_worst_s), (1, 4.0), "5 s to the end of the 8 s sample: {r:?}");
    let m = &r.mishaps["master_loss"];
    assert_eq!(m.convergence_worst_s, 3.0, "counted from the end of the outage (14 s) to 17 s: {r:?}");
    assert_eq!(r.convergence_mean_s, 3.5);
    assert_eq!(r.max_overshoot, 1.1);
    assert_eq!(r.shortfall_events, 1);
    assert!(r.mishaps["none"].utilisation == 1.0 && r.mishaps["none"].count == 0, "{r:?}");
    assert_eq!(r.rpcs_per_s, 10.0);
    assert_eq!(r.rpcs_per_s_by_level, vec![2.0, 8.0]);
    // A tree that never recovers within a window is charged the whole window.
    let r = report(&samples[..17], &mishaps, 17.0, 60.0);
    assert_eq!(r.mishaps["master_loss"].convergence_worst_s, 3.0, "{r:?}");
    let r = report(&samples, &mishaps, 22.0, 1.5);
    assert_eq!(r.mishaps["master_loss"].convergence_worst_s, 0.0, "the dip at 16 s is past the horizon: {r:?}");
}

/// The scale scenario with `clients` in all, over `tree`, for 200 s.
fn scale(tree: Vec<usize>, clients: usize) -> Scenario {
    let mut sc = Scenario::parse("scale-flat.yaml", include_str!("../../deploy/examples/sim/scale-flat.yaml")).unwrap();
    sc.tree = tree;
    sc.clients_per_leaf = clients / sc.leaves();
    sc.duration = Duration::from_secs(200);
    sc
}

#[test]
fn the_root_of_a_tree_carries_its_intermediates_and_a_flat_root_every_client() {
    let refresh = scale(vec![], 1).refresh_interval.as_secs_f64();
    let run = |tree: Vec<usize>, clients| {
        let mut sim = Sim::new(scale(tree, clients), 1);
        let r = sim.run(|_| {});
        let last = sim.samples.last().unwrap();
        assert_eq!(last.rpcs, last.rpcs_by_level.iter().sum::<u64>(), "every RPC reaches some level");
        assert_eq!(r.clients, clients as u64);
        r
    };
    let (flat_small, flat_big) = (run(vec![], 40), run(vec![], 160));
    let (tree_small, tree_big) = (run(vec![4], 40), run(vec![4], 160));
    for (r, clients) in [(&flat_small, 40.0), (&flat_big, 160.0)] {
        assert_eq!(r.rpcs_per_s_by_level.len(), 1, "{r:?}");
        assert!(r.rpcs_per_s_by_level[0] >= 0.9 * clients / refresh, "each client refreshes at the root: {r:?}");
    }
    assert!(flat_big.rpcs_per_s_by_level[0] > 3.0 * flat_small.rpcs_per_s_by_level[0], "{flat_small:?} {flat_big:?}");
    for r in [&tree_small, &tree_big] {
        let (root, level1) = (r.rpcs_per_s_by_level[0], r.rpcs_per_s_by_level[1]);
        assert!(root > 0.0 && root <= 1.5 * 4.0 / refresh, "only the 4 intermediates refresh at the root: {r:?}");
        assert!(level1 > 10.0 * root, "{r:?}");
    }
    assert!(
        tree_big.rpcs_per_s_by_level[0] <= 1.5 * tree_small.rpcs_per_s_by_level[0],
        "four times the clients leave the root's load bounded: {tree_small:?} {tree_big:?}"
    );
    assert!(tree_big.rpcs_per_s_by_level[1] > 3.0 * tree_small.rpcs_per_s_by_level[1]);
}
