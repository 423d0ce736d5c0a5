//! The per-resource demand index: every client's (wants, subclients, has),
//! with the aggregate queries the share algorithms need.
//!
//! NOTE: this first version is a plain vector (O(n) queries); it fixes the
//! interface that the server codes against.

/// A stable handle for one client inside one index, chosen by the caller.
pub type ClientSlot = u32;

#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: ClientSlot,
    wants: f64,
    subclients: u64,
    has: f64,
}

#[derive(Debug, Default, Clone)]
pub struct DemandIndex {
    entries: Vec<Entry>,
    total_wants: f64,
    total_has: f64,
    total_subclients: u64,
}

impl DemandIndex {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Inserts or replaces a client's demand.
    pub fn upsert(&mut self, slot: ClientSlot, wants: f64, subclients: u64, has: f64) {
        self.remove(slot);
        self.entries.push(Entry { slot, wants, subclients, has });
        self.total_wants += wants;
        self.total_has += has;
        self.total_subclients += subclients;
    }

    /// Removes a client; a missing slot is ignored.
    pub fn remove(&mut self, slot: ClientSlot) {
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

    pub fn total_wants(&self) -> f64 {
        self.total_wants.max(0.0)
    }

    pub fn total_has(&self) -> f64 {
        self.total_has.max(0.0)
    }

    pub fn total_subclients(&self) -> u64 {
        self.total_subclients
    }

    /// Sum of wants and of subclients over the clients whose wants per
    /// subclient is at most `per_subclient`.
    pub fn sums_at_or_below(&self, per_subclient: f64) -> (f64, u64) {
        self.entries
            .iter()
            .filter(|e| e.wants / e.subclients as f64 <= per_subclient)
            .fold((0.0, 0), |(w, s), e| (w + e.wants, s + e.subclients))
    }

    /// The max-min level `L` per subclient with `sum(min(wants, L * subclients)) = capacity`;
    /// infinite when every client's wants fit.
    pub fn water_level(&self, capacity: f64) -> f64 {
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
