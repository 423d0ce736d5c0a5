use std::collections::HashMap;

use proptest::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::*;

/// Runs `(client, wants, subclients)` requests in order against one resource,
/// storing each grant as that client's has. `preload` first stores every client
/// with has 0 and its wants.
fn run(kind: Kind, capacity: f64, preload: bool, seq: &[(u32, f64, u64)]) -> Vec<f64> {
    let mut idx = DemandIndex::new();
    let mut has = HashMap::new();
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

/// One row of DOORMAN.md §4: algorithm, capacity, preloaded, requests
/// `(client, wants, subclients)`, expected grants.
type Vector = (Kind, f64, bool, &'static [(u32, f64, u64)], &'static [f64]);

#[test]
fn doorman_vectors() {
    use Kind::*;
    #[rustfmt::skip]
    let cases: &[Vector] = &[
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

/// The first, plain-vector `DemandIndex`: slow but obviously right, kept as
/// the reference the tree is checked against.
mod naive {
    use crate::algorithm::ClientSlot;

    #[derive(Debug, Clone, Copy)]
    struct Entry {
        slot: ClientSlot,
        wants: f64,
        subclients: u64,
        has: f64,
    }

    #[derive(Debug, Default, Clone)]
    pub(super) struct DemandIndex {
        entries: Vec<Entry>,
        total_wants: f64,
        total_has: f64,
        total_subclients: u64,
    }

    impl DemandIndex {
        pub(super) fn len(&self) -> usize {
            self.entries.len()
        }

        pub(super) fn upsert(&mut self, slot: ClientSlot, wants: f64, subclients: u64, has: f64) {
            self.remove(slot);
            self.entries.push(Entry { slot, wants, subclients, has });
            self.total_wants += wants;
            self.total_has += has;
            self.total_subclients += subclients;
        }

        pub(super) fn remove(&mut self, slot: ClientSlot) {
            if let Some(i) = self.entries.iter().position(|e| e.slot == slot) {
                let e = self.entries.swap_remove(i);
                self.total_wants -= e.wants;
                self.total_has -= e.has;
                self.total_subclients -= e.subclients;
            }
            if self.entries.is_empty() {
                self.total_wants = 0.0;
                self.total_has = 0.0;
            }
        }

        pub(super) fn get(&self, slot: ClientSlot) -> Option<(f64, u64, f64)> {
            self.entries.iter().find(|e| e.slot == slot).map(|e| (e.wants, e.subclients, e.has))
        }

        pub(super) fn total_wants(&self) -> f64 {
            self.total_wants.max(0.0)
        }

        pub(super) fn total_has(&self) -> f64 {
            self.total_has.max(0.0)
        }

        pub(super) fn total_subclients(&self) -> u64 {
            self.total_subclients
        }

        pub(super) fn sums_at_or_below(&self, per_subclient: f64) -> (f64, u64) {
            self.entries
                .iter()
                .filter(|e| e.wants / e.subclients as f64 <= per_subclient)
                .fold((0.0, 0), |(w, s), e| (w + e.wants, s + e.subclients))
        }

        pub(super) fn water_level(&self, capacity: f64) -> f64 {
            if self.total_wants() <= capacity {
                return f64::INFINITY;
            }
            let mut by_level: Vec<&Entry> = self.entries.iter().collect();
            by_level.sort_by(|a, b| (a.wants / a.subclients as f64).total_cmp(&(b.wants / b.subclients as f64)));
            let mut left = capacity.max(0.0);
            let mut subs_left = self.total_subclients as f64;
            for e in by_level {
                let level = e.wants / e.subclients as f64;
                if level * subs_left > left {
                    break;
                }
                left -= e.wants;
                subs_left -= e.subclients as f64;
            }
            if subs_left <= 0.0 { f64::INFINITY } else { left / subs_left }
        }
    }
}

/// Equal within 1e-6, relative to the larger magnitude (absolute below 1).
fn close(a: f64, b: f64) -> bool {
    if a.is_infinite() || b.is_infinite() {
        return a == b;
    }
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

/// The exact max-min allocation by progressive filling, written
/// independently of the prefix search the index uses: repeatedly split what
/// is left equally per subclient over the unsatisfied clients, and satisfy
/// every client that the split covers.
fn max_min(capacity: f64, clients: &[(f64, u64)]) -> Vec<f64> {
    let mut alloc: Vec<Option<f64>> = vec![None; clients.len()];
    let mut left = capacity.max(0.0);
    loop {
        let open: Vec<usize> = (0..clients.len()).filter(|&i| alloc[i].is_none()).collect();
        if open.is_empty() {
            break;
        }
        let subs: f64 = open.iter().map(|&i| clients[i].1 as f64).sum();
        let level = left / subs;
        let fits: Vec<usize> = open.iter().copied().filter(|&i| clients[i].0 <= level * clients[i].1 as f64).collect();
        if fits.is_empty() {
            for i in open {
                alloc[i] = Some(level * clients[i].1 as f64);
            }
            break;
        }
        for i in fits {
            alloc[i] = Some(clients[i].0);
            left -= clients[i].0;
        }
    }
    alloc.into_iter().map(|a| a.unwrap()).collect()
}

// === DemandIndex against the reference ===

#[derive(Debug, Clone)]
enum Op {
    Upsert {
        slot: u32,
        wants: f64,
        subclients: u64,
        has: f64,
    },
    /// Re-upserts an existing slot with only its has changed.
    SetHas {
        slot: u32,
        has: f64,
    },
    /// Re-upserts an existing slot with wants and subclients both multiplied
    /// by `factor`: same level, so the node keeps its place.
    Rescale {
        slot: u32,
        factor: u64,
    },
    Remove(u32),
    AtOrBelow(f64),
    WaterLevel(f64),
}

/// Multiples of 1/8: their sums are exact in f64, so the tree and the
/// reference take every comparison the same way, including exact ties.
fn eighths(max: u32) -> impl Strategy<Value = f64> + Clone {
    prop_oneof![1 => Just(0.0), 4 => (0..=max * 8).prop_map(|k| k as f64 / 8.0)]
}

fn op(slots: u32) -> impl Strategy<Value = Op> {
    let subclients = prop_oneof![3 => 1..=3u64, 1 => 1..=1000u64];
    // Levels that coincide with clients' levels hit the ties.
    let level = prop_oneof![eighths(1000), (eighths(1000), 1..=5u64).prop_map(|(w, s)| w / s as f64)];
    prop_oneof![
        6 => (0..slots, eighths(1000), subclients, eighths(1000))
            .prop_map(|(slot, wants, subclients, has)| Op::Upsert { slot, wants, subclients, has }),
        2 => (0..slots, eighths(1000)).prop_map(|(slot, has)| Op::SetHas { slot, has }),
        1 => (0..slots, 1..=4u64).prop_map(|(slot, factor)| Op::Rescale { slot, factor }),
        // Some removals miss: slots beyond the range are never inserted.
        2 => (0..slots + slots / 4 + 1).prop_map(Op::Remove),
        2 => level.prop_map(Op::AtOrBelow),
        2 => eighths(20_000).prop_map(Op::WaterLevel),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop_oneof![Just(6u32), Just(40), Just(400)].prop_flat_map(|slots| prop::collection::vec(op(slots), 1..300))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn index_matches_naive_reference(ops in ops()) {
        let mut tree = DemandIndex::new();
        let mut naive = naive::DemandIndex::default();
        for op in ops {
            match op {
                Op::Upsert { slot, wants, subclients, has } => {
                    tree.upsert(slot, wants, subclients, has);
                    naive.upsert(slot, wants, subclients, has);
                }
                Op::SetHas { slot, has } => {
                    if let Some((w, s, _)) = naive.get(slot) {
                        tree.upsert(slot, w, s, has);
                        naive.upsert(slot, w, s, has);
                    }
                }
                Op::Rescale { slot, factor } => {
                    if let Some((w, s, h)) = naive.get(slot) {
                        tree.upsert(slot, w * factor as f64, s * factor, h);
                        naive.upsert(slot, w * factor as f64, s * factor, h);
                    }
                }
                Op::Remove(slot) => {
                    tree.remove(slot);
                    naive.remove(slot);
                }
                Op::AtOrBelow(level) => {
                    let (tw, ts) = tree.sums_at_or_below(level);
                    let (nw, ns) = naive.sums_at_or_below(level);
                    prop_assert!(close(tw, nw), "sums_at_or_below({level}) wants {tw} vs {nw}");
                    prop_assert_eq!(ts, ns, "sums_at_or_below({}) subclients", level);
                }
                Op::WaterLevel(capacity) => {
                    let (t, n) = (tree.water_level(capacity), naive.water_level(capacity));
                    prop_assert!(close(t, n), "water_level({capacity}) {t} vs {n}");
                }
            }
            tree.check_invariants();
            prop_assert_eq!(tree.len(), naive.len());
            prop_assert_eq!(tree.is_empty(), naive.len() == 0);
            prop_assert!(close(tree.total_wants(), naive.total_wants()));
            prop_assert!(close(tree.total_has(), naive.total_has()));
            prop_assert_eq!(tree.total_subclients(), naive.total_subclients());
        }
    }
}

/// The reference's sums drift under heavy churn, so it is only compared on
/// fresh copies: a long random run on a deep tree, with arbitrary
/// (non-dyadic) floats, checked against the reference rebuilt from scratch.
#[test]
fn index_matches_fresh_reference_on_a_deep_tree() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut tree = DemandIndex::new();
    let mut model: HashMap<u32, (f64, u64, f64)> = HashMap::new();
    for step in 0..20_000 {
        let slot = rng.random_range(0..3000);
        if rng.random_bool(0.2) {
            tree.remove(slot);
            model.remove(&slot);
        } else {
            let v = (rng.random_range(0.0..500.0), rng.random_range(1..=20), rng.random_range(0.0..50.0));
            tree.upsert(slot, v.0, v.1, v.2);
            model.insert(slot, v);
        }
        if step % 2000 == 1999 {
            tree.check_invariants();
            let mut naive = naive::DemandIndex::default();
            for (&slot, &(w, s, h)) in &model {
                naive.upsert(slot, w, s, h);
            }
            assert_eq!(tree.len(), naive.len());
            assert!(close(tree.total_wants(), naive.total_wants()));
            assert!(close(tree.total_has(), naive.total_has()));
            assert_eq!(tree.total_subclients(), naive.total_subclients());
            for level in [0.0, 1.0, 12.5, 25.0, 100.0, 499.0, f64::INFINITY] {
                let (tw, ts) = tree.sums_at_or_below(level);
                let (nw, ns) = naive.sums_at_or_below(level);
                assert!(close(tw, nw) && ts == ns, "at or below {level}: {tw},{ts} vs {nw},{ns}");
            }
            for capacity in [0.0, 10.0, 1_000.0, 50_000.0, 200_000.0, 1e9] {
                let (t, n) = (tree.water_level(capacity), naive.water_level(capacity));
                assert!(close(t, n), "water_level({capacity}) {t} vs {n}");
            }
        }
    }
}

// === decide ===

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::NoAlgorithm), Just(Kind::Static), Just(Kind::ProportionalShare), Just(Kind::FairShare)]
}

fn amount(max: f64) -> impl Strategy<Value = f64> + Clone {
    prop_oneof![1 => Just(0.0), 2 => eighths(max as u32), 3 => 0.0..max]
}

fn subclients() -> impl Strategy<Value = u64> + Clone {
    prop_oneof![8 => 1..=10u64, 1 => 1..=1_000_000_000_000u64]
}

proptest! {
    #[test]
    fn decide_keeps_its_invariants(
        kind in kind(),
        capacity in amount(2000.0),
        clients in prop::collection::vec((amount(1000.0), subclients()), 1..20),
        preload in any::<bool>(),
        // (client, new wants if the demand changes)
        requests in prop::collection::vec((any::<prop::sample::Index>(), prop::option::of(amount(1000.0))), 1..120),
    ) {
        let mut clients = clients;
        let mut idx = DemandIndex::new();
        let mut has = vec![0.0; clients.len()];
        if preload {
            for (c, &(w, s)) in clients.iter().enumerate() {
                idx.upsert(c as u32, w, s, 0.0);
            }
        }
        for (who, new_wants) in requests {
            let c = who.index(clients.len());
            if let Some(w) = new_wants {
                clients[c].0 = w;
            }
            let (wants, subclients) = clients[c];
            idx.upsert(c as u32, wants, subclients, has[c]);
            let g = decide(kind, capacity, &idx, &Request { wants, subclients, has: has[c] });
            prop_assert!(!g.is_nan() && g >= 0.0, "{kind:?}: grant {g}");
            if kind == Kind::NoAlgorithm {
                prop_assert_eq!(g, wants);
            } else {
                prop_assert!(g <= wants, "{kind:?}: grant {g} > wants {wants}");
            }
            if kind == Kind::Static {
                prop_assert!(g <= capacity, "STATIC grant {g} > capacity {capacity}");
            }
            idx.upsert(c as u32, wants, subclients, g);
            has[c] = g;
            if matches!(kind, Kind::ProportionalShare | Kind::FairShare) {
                let held: f64 = has.iter().sum();
                prop_assert!(held <= capacity + 1e-9 * capacity.max(1.0),
                    "{kind:?}: clients hold {held} > capacity {capacity}");
            }
        }
    }

    /// With demand unchanged, FAIR_SHARE reaches the exact max-min allocation
    /// by the third round, whatever order the clients arrive and re-request in.
    #[test]
    fn fair_share_reaches_max_min_in_three_rounds(
        capacity in amount(2000.0),
        clients in prop::collection::vec((amount(1000.0), 1..=10u64), 1..30),
        orders in prop::collection::vec(Just((0..30usize).collect::<Vec<_>>()).prop_shuffle(), 3),
    ) {
        let mut idx = DemandIndex::new();
        let mut has = vec![0.0; clients.len()];
        for order in &orders {
            for c in order.iter().copied().filter(|&c| c < clients.len()) {
                let (wants, subclients) = clients[c];
                idx.upsert(c as u32, wants, subclients, has[c]);
                has[c] = decide(Kind::FairShare, capacity, &idx, &Request { wants, subclients, has: has[c] });
                idx.upsert(c as u32, wants, subclients, has[c]);
            }
        }
        let want = max_min(capacity, &clients);
        for (c, (g, w)) in has.iter().zip(&want).enumerate() {
            prop_assert!(close(*g, *w), "client {c} {:?}: got {g}, max-min {w}\nall: {has:?}\nmax-min: {want:?}", clients[c]);
        }
    }
}

// === edge cases ===

const ALL_KINDS: [Kind; 4] = [Kind::NoAlgorithm, Kind::Static, Kind::ProportionalShare, Kind::FairShare];

#[test]
fn capacity_zero_grants_nothing_but_no_algorithm() {
    let seq = [(0, 10.0, 1), (1, 100.0, 3), (2, 0.5, 1)];
    for kind in ALL_KINDS {
        for preload in [false, true] {
            let got = run(kind, 0.0, preload, &seq);
            let want: Vec<f64> = if kind == Kind::NoAlgorithm { vec![10.0, 100.0, 0.5] } else { vec![0.0; 3] };
            assert_eq!(got, want, "{kind:?} preload {preload}");
        }
    }
    let mut idx = DemandIndex::new();
    idx.upsert(0, 10.0, 1, 0.0);
    assert_eq!(idx.water_level(0.0), 0.0);
    // A negative capacity counts as 0.
    assert_eq!(idx.water_level(-5.0), 0.0);
    assert_eq!(decide(Kind::FairShare, -5.0, &idx, &Request { wants: 10.0, subclients: 1, has: 0.0 }), 0.0);
}

#[test]
fn all_wants_zero() {
    let seq = [(0, 0.0, 1), (1, 0.0, 4), (2, 0.0, 2)];
    for kind in ALL_KINDS {
        assert_eq!(run(kind, 100.0, true, &seq), vec![0.0; 3], "{kind:?}");
    }
    let mut idx = DemandIndex::new();
    for &(c, w, s) in &seq {
        idx.upsert(c, w, s, 0.0);
    }
    assert_eq!(idx.water_level(100.0), f64::INFINITY);
    assert_eq!(idx.water_level(0.0), f64::INFINITY);
    assert_eq!(idx.sums_at_or_below(0.0), (0.0, 7));
    assert_eq!(idx.sums_at_or_below(-1.0), (0.0, 0));
}

#[test]
fn single_client() {
    for (wants, capacity) in [(50.0, 100.0), (150.0, 100.0), (100.0, 100.0)] {
        for kind in ALL_KINDS {
            let got = run(kind, capacity, false, &[(9, wants, 3)]);
            let want = if kind == Kind::NoAlgorithm { wants } else { f64::min(wants, capacity) };
            assert_eq!(got, vec![want], "{kind:?} wants {wants} capacity {capacity}");
        }
    }
    let mut idx = DemandIndex::new();
    idx.upsert(9, 150.0, 3, 20.0);
    assert_eq!((idx.len(), idx.total_wants(), idx.total_subclients(), idx.total_has()), (1, 150.0, 3, 20.0));
    assert_eq!(idx.water_level(90.0), 30.0);
    assert_eq!(idx.sums_at_or_below(50.0), (150.0, 3));
    assert_eq!(idx.sums_at_or_below(49.9), (0.0, 0));
    idx.check_invariants();
}

#[test]
fn huge_subclient_counts() {
    let mut idx = DemandIndex::new();
    for slot in 0..3 {
        idx.upsert(slot, 1000.0, u64::MAX / 2, 0.0);
    }
    idx.check_invariants();
    // The true total does not fit in a u64; it saturates instead of wrapping
    // or panicking.
    assert_eq!(idx.total_subclients(), u64::MAX);
    assert_eq!(idx.sums_at_or_below(f64::INFINITY), (3000.0, u64::MAX));
    idx.remove(0);
    idx.remove(1);
    assert_eq!(idx.total_subclients(), u64::MAX / 2);

    // One client speaking for u64::MAX end clients against one speaking for
    // one: max-min gives the crowd nearly everything.
    let seq = [(0, 1000.0, u64::MAX), (1, 1000.0, 1)];
    let fair = run(Kind::FairShare, 100.0, true, &seq);
    assert!(close(fair[0], 100.0) && fair[1] >= 0.0 && fair[1] < 1e-12, "{fair:?}");
    for kind in ALL_KINDS {
        let got = run(kind, 100.0, false, &[(0, 1000.0, u64::MAX), (1, 1000.0, 1), (2, 1000.0, u64::MAX)]);
        assert!(got.iter().all(|g| g.is_finite() && *g >= 0.0), "{kind:?}: {got:?}");
        if matches!(kind, Kind::ProportionalShare | Kind::FairShare) {
            assert!(got.iter().sum::<f64>() <= 100.0 + 1e-9, "{kind:?}: {got:?}");
        }
    }
}

#[test]
fn removing_unknown_slots_changes_nothing() {
    let mut idx = DemandIndex::new();
    idx.remove(3);
    assert!(idx.is_empty());
    idx.upsert(1, 10.0, 2, 4.0);
    idx.upsert(2, 30.0, 1, 6.0);
    for slot in [0, 3, u32::MAX] {
        idx.remove(slot);
    }
    idx.check_invariants();
    assert_eq!((idx.len(), idx.total_wants(), idx.total_subclients(), idx.total_has()), (2, 40.0, 3, 10.0));
    idx.remove(1);
    idx.remove(1);
    idx.check_invariants();
    assert_eq!((idx.len(), idx.total_wants(), idx.total_subclients(), idx.total_has()), (1, 30.0, 1, 6.0));
    idx.remove(2);
    assert!(idx.is_empty());
    assert_eq!((idx.total_wants(), idx.total_subclients(), idx.total_has()), (0.0, 0, 0.0));
    // Usable again after being emptied.
    idx.upsert(2, 5.0, 1, 0.0);
    idx.check_invariants();
    assert_eq!(idx.total_wants(), 5.0);
}

#[test]
fn default_is_an_empty_index() {
    let mut idx = DemandIndex::default();
    assert!(idx.is_empty());
    assert_eq!(idx.water_level(1.0), f64::INFINITY);
    idx.upsert(4, 2.0, 1, 1.0);
    idx.upsert(5, 3.0, 1, 1.0);
    idx.check_invariants();
    assert_eq!((idx.len(), idx.total_wants()), (2, 5.0));
}

#[test]
fn invalid_values_are_stored_as_zero() {
    let mut idx = DemandIndex::new();
    idx.upsert(0, f64::NAN, 1, -3.0);
    idx.upsert(1, -2.0, 2, f64::NAN);
    idx.upsert(2, 8.0, 0, 1.0);
    idx.check_invariants();
    assert_eq!((idx.total_wants(), idx.total_has(), idx.total_subclients()), (8.0, 1.0, 3));
    assert_eq!(idx.sums_at_or_below(0.0), (0.0, 3));
    assert_eq!(idx.sums_at_or_below(f64::NAN), (0.0, 0));
    // The client with no subclients can never be satisfied; the others are.
    assert_eq!(idx.water_level(5.0), f64::INFINITY);
}

/// Values of wildly different magnitudes come and go; then every client
/// settles on a small demand. Sums kept by adding and subtracting deltas
/// would be off by far more than 1e-6 of the small final total.
#[test]
fn a_million_upserts_do_not_drift() {
    const SLOTS: u32 = 100;
    let mut rng = StdRng::seed_from_u64(42);
    let mut idx = DemandIndex::new();
    let mut current = vec![(0.0, 0u64, 0.0); SLOTS as usize];
    let check = |idx: &DemandIndex, current: &[(f64, u64, f64)]| {
        idx.check_invariants();
        let wants: f64 = current.iter().map(|c| c.0).sum();
        let subs: u64 = current.iter().map(|c| c.1).sum();
        let has: f64 = current.iter().map(|c| c.2).sum();
        let rel = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs();
        assert!(rel(idx.total_wants(), wants), "total wants {} vs fresh {wants}", idx.total_wants());
        assert!(rel(idx.total_has(), has), "total has {} vs fresh {has}", idx.total_has());
        assert_eq!(idx.total_subclients(), subs);
    };
    let magnitude = |rng: &mut StdRng| 10f64.powi(rng.random_range(-3..=15)) * rng.random::<f64>();
    for _ in 0..1_000_000 {
        let slot = rng.random_range(0..SLOTS);
        let v = (magnitude(&mut rng), rng.random_range(1..=1000), magnitude(&mut rng));
        idx.upsert(slot, v.0, v.1, v.2);
        current[slot as usize] = v;
    }
    check(&idx, &current);
    for slot in 0..SLOTS {
        let v = (rng.random_range(0.0..10.0), rng.random_range(1..=5), rng.random_range(0.0..1.0));
        idx.upsert(slot, v.0, v.1, v.2);
        current[slot as usize] = v;
    }
    check(&idx, &current);
}

/// The floor level raises the clients that want least, per subclient, as
/// far as the target allows; the others keep their wants.
#[test]
fn the_floor_level_raises_those_that_want_least() {
    let mut idx = DemandIndex::new();
    idx.upsert(0, 11.5, 1, 0.0);
    idx.upsert(1, 23.0, 1, 0.0);
    idx.upsert(2, 46.0, 1, 0.0);
    assert_eq!(idx.floor_level(80.5), 0.0, "no more than the wants: no floor");
    let f = idx.floor_level(95.0);
    assert!((f - 24.5).abs() < 1e-9, "{f}");
    let f = idx.floor_level(150.0);
    assert!((f - 50.0).abs() < 1e-9, "everyone raised: {f}");
    // Subclients weigh: a client of three subclients is raised three times as far.
    idx.upsert(3, 0.0, 3, 0.0);
    let f = idx.floor_level(80.5 + 30.0);
    assert!((f - 10.0).abs() < 1e-9, "{f}");
    let floor: f64 = [(11.5f64, 1.0), (23.0, 1.0), (46.0, 1.0), (0.0, 3.0)].iter().map(|(w, s)| w.max(f * s)).sum();
    assert!((floor - 110.5).abs() < 1e-9, "{floor}");
}
