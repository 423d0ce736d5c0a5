use super::*;

/// Runs `(client, wants, subclients)` requests in order against one resource,
/// storing each grant as that client's has. `preload` first stores every client
/// with has 0 and its wants.
fn run(kind: Kind, capacity: f64, preload: bool, seq: &[(u32, f64, u64)]) -> Vec<f64> {
    let mut idx = DemandIndex::new();
    let mut has = std::collections::HashMap::new();
    if preload {
        for &(c, w, s) in seq {
            idx.upsert(c, w, s, 0.0);
            has.insert(c, 0.0);
        }
    }
    seq.iter()
        .map(|&(c, w, s)| {
            let h = *has.get(&c).unwrap_or(&0.0);
            idx.upsert(c, w, s, h);
            let g = decide(kind, capacity, &idx, &Request { wants: w, subclients: s, has: h });
            idx.upsert(c, w, s, g);
            has.insert(c, g);
            g
        })
        .collect()
}

#[test]
fn doorman_vectors() {
    use Kind::*;
    let cases: &[(Kind, f64, bool, &[(u32, f64, u64)], &[f64])] = &[
        (NoAlgorithm, 0.0, false, &[(0, 10.0, 1), (1, 100.0, 1)], &[10.0, 100.0]),
        (Static, 100.0, false, &[(0, 100.0, 1), (1, 10.0, 1), (2, 120.0, 1)], &[100.0, 10.0, 100.0]),
        (FairShare, 120.0, true, &[(0, 1000.0, 1), (1, 60.0, 1), (2, 10.0, 1)], &[55.0, 55.0, 10.0]),
        (FairShare, 120.0, true, &[(0, 1000.0, 1), (1, 50.0, 1), (2, 10.0, 1)], &[60.0, 50.0, 10.0]),
        (FairShare, 120.0, true, &[(0, 1000.0, 6), (1, 500.0, 4), (2, 200.0, 2)], &[60.0, 40.0, 20.0]),
        (FairShare, 1000.0, true, &[(0, 2000.0, 10), (1, 500.0, 10), (2, 700.0, 30)], &[200.0, 200.0, 600.0]),
        (ProportionalShare, 120.0, true, &[(0, 60.0, 1), (1, 60.0, 1), (2, 10.0, 1)], &[55.0, 55.0, 10.0]),
        (ProportionalShare, 120.0, false, &[(0, 60.0, 1), (1, 75.0, 1), (2, 10.0, 1)], &[60.0, 60.0, 0.0]),
        (ProportionalShare, 120.0, true, &[(0, 65.0, 3), (1, 45.0, 2), (2, 20.0, 1)], &[60.0, 40.0, 20.0]),
        (ProportionalShare, 120.0, false, &[(0, 65.0, 3), (1, 45.0, 2), (2, 20.0, 1)], &[65.0, 45.0, 10.0]),
    ];
    for (kind, cap, preload, seq, want) in cases {
        let got = run(*kind, *cap, *preload, seq);
        for (g, w) in got.iter().zip(want.iter()) {
            assert!((g - w).abs() < 1e-9, "{kind:?} cap {cap} preload {preload}: got {got:?}, want {want:?}");
        }
    }
}
