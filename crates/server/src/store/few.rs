//! Small maps for a resource's per-client state, sized for the common case.
//!
//! A capacity server holding a fleet's tenant keys holds one resource per
//! key, most with one client (the sidecar that serves that tenant) and none
//! with a lapsed client's reservation. A `HashMap` costs a resource its
//! hasher state inline and, from its first entry, a table with room for
//! four, each entry a box of its own. [`Clients`] keeps up to
//! [`FEW_CLIENTS`] leases inline in one vector, searched by id, and moves to
//! a hash map past that; [`Reservations`] allocates nothing while empty.
//! Neither orders its entries: callers never depended on a map's order.

use std::collections::HashMap;
use std::mem;
use std::sync::Arc;

use super::{ClientLease, Reservation};

/// Past this many clients a resource's leases go in a hash map: a linear
/// search of a few short ids costs less than hashing one.
pub(super) const FEW_CLIENTS: usize = 8;

/// One resource's leases, by client id.
#[derive(Debug)]
pub(super) enum Clients {
    /// Up to [`FEW_CLIENTS`] leases inline, in no order.
    Few(Vec<(Arc<str>, ClientLease)>),
    /// More, each boxed so that the table's spare room stays small.
    #[allow(clippy::box_collection, reason = "a map inline would widen every resource by 24 bytes")]
    Many(Box<HashMap<Arc<str>, Box<ClientLease>>>),
}

impl Default for Clients {
    fn default() -> Self {
        Clients::Few(Vec::new())
    }
}

impl Clients {
    pub(super) fn len(&self) -> usize {
        match self {
            Clients::Few(v) => v.len(),
            Clients::Many(m) => m.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn contains_key(&self, id: &str) -> bool {
        self.get(id).is_some()
    }

    pub(super) fn get(&self, id: &str) -> Option<&ClientLease> {
        match self {
            Clients::Few(v) => v.iter().find(|(k, _)| **k == *id).map(|(_, l)| l),
            Clients::Many(m) => m.get(id).map(|l| &**l),
        }
    }

    pub(super) fn get_mut(&mut self, id: &str) -> Option<&mut ClientLease> {
        match self {
            Clients::Few(v) => v.iter_mut().find(|(k, _)| **k == *id).map(|(_, l)| l),
            Clients::Many(m) => m.get_mut(id).map(|l| &mut **l),
        }
    }

    /// Files `lease` under `id`, replacing any lease it had.
    pub(super) fn insert(&mut self, id: Arc<str>, lease: ClientLease) {
        match self {
            Clients::Few(v) => {
                if let Some(slot) = v.iter_mut().find(|(k, _)| *k == id) {
                    slot.1 = lease;
                } else if v.len() < FEW_CLIENTS {
                    // Exact growth: most resources never have a second client.
                    v.reserve_exact(1);
                    v.push((id, lease));
                } else {
                    let mut m: HashMap<_, _> = mem::take(v).into_iter().map(|(k, l)| (k, Box::new(l))).collect();
                    m.insert(id, Box::new(lease));
                    *self = Clients::Many(Box::new(m));
                }
            }
            Clients::Many(m) => {
                m.insert(id, Box::new(lease));
            }
        }
    }

    /// Takes `id`'s lease out; the storage goes once the last one does.
    pub(super) fn remove(&mut self, id: &str) -> Option<ClientLease> {
        let lease = match self {
            Clients::Few(v) => {
                let i = v.iter().position(|(k, _)| **k == *id)?;
                v.swap_remove(i).1
            }
            Clients::Many(m) => *m.remove(id)?,
        };
        if self.is_empty() {
            *self = Clients::default();
        }
        Some(lease)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &ClientLease)> {
        let (few, many) = match self {
            Clients::Few(v) => (Some(v.iter().map(|(k, l)| (k, l))), None),
            Clients::Many(m) => (None, Some(m.iter().map(|(k, l)| (k, &**l)))),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &ClientLease> {
        self.iter().map(|(_, l)| l)
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut ClientLease> {
        let (few, many) = match self {
            Clients::Few(v) => (Some(v.iter_mut().map(|(_, l)| l)), None),
            Clients::Many(m) => (None, Some(m.values_mut().map(|l| &mut **l))),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }
}

/// What lapsed clients keep reserved, by client id; no storage while empty,
/// which is almost always.
#[derive(Debug, Default)]
#[allow(clippy::box_collection, reason = "a map inline would widen every resource by 40 bytes")]
pub(super) struct Reservations(Option<Box<HashMap<Arc<str>, Reservation>>>);

impl Reservations {
    pub(super) fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|m| m.is_empty())
    }

    pub(super) fn get(&self, id: &str) -> Option<&Reservation> {
        self.0.as_ref()?.get(id)
    }

    pub(super) fn contains_key(&self, id: &str) -> bool {
        self.get(id).is_some()
    }

    pub(super) fn insert(&mut self, id: Arc<str>, r: Reservation) -> Option<Reservation> {
        self.0.get_or_insert_with(Default::default).insert(id, r)
    }

    pub(super) fn remove(&mut self, id: &str) -> Option<Reservation> {
        let r = self.0.as_mut()?.remove(id);
        self.release_if_empty();
        r
    }

    pub(super) fn retain(&mut self, keep: impl FnMut(&Arc<str>, &mut Reservation) -> bool) {
        if let Some(m) = &mut self.0 {
            m.retain(keep);
        }
        self.release_if_empty();
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Reservation> + Clone {
        self.0.iter().flat_map(|m| m.values())
    }

    fn release_if_empty(&mut self) {
        if self.is_empty() {
            self.0 = None;
        }
    }
}
