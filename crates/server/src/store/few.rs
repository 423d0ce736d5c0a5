//! Small maps for a resource's per-client state, sized for the common case.
//!
//! A capacity server holding a fleet's tenant keys holds one resource per
//! key, most with one client (the sidecar that serves that tenant) and none
//! with a lapsed client's reservation. A `HashMap` costs a resource its
//! hasher state inline and, from its first entry, a table with room for
//! four, each entry a box of its own, and a vector naming each slot's
//! client. [`Clients`] keeps up to [`FEW_CLIENTS`] leases inline in one
//! vector, searched by id or slot, and moves to a hash map and a slot
//! vector past that. [`Reservations`] allocates nothing while empty, then
//! a vector while few and a map past that. Neither orders its entries:
//! callers never depended on a map's order.

use std::collections::HashMap;
use std::mem;
use std::sync::Arc;

use super::{ClientLease, ClientSlot, Reservation};

/// Past this many clients a resource's leases go in a hash map: a linear
/// search of a few short ids costs less than hashing one.
pub(super) const FEW_CLIENTS: usize = 8;

/// One resource's leases, by client id.
#[derive(Debug)]
pub(super) enum Clients {
    /// Up to [`FEW_CLIENTS`] leases inline, in no order; a new client gets
    /// the lowest slot none of them holds.
    Few(Vec<(Arc<str>, ClientLease)>),
    /// More.
    Many(Box<Many>),
}

/// A resource's leases past [`FEW_CLIENTS`].
#[derive(Debug, Default)]
pub(super) struct Many {
    /// Each lease boxed, so that the table's spare room stays small.
    map: HashMap<Arc<str>, Box<ClientLease>>,
    /// Each slot's client, the same `Arc` as its key in `map`; `None` while
    /// free or handed out by [`Clients::new_slot`] and not yet filed.
    owners: Vec<Option<Arc<str>>>,
    /// Slots free for reuse, the last freed first.
    free: Vec<ClientSlot>,
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
            Clients::Many(m) => m.map.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A slot for a new client, whose lease is [`insert`](Self::insert)ed next.
    pub(super) fn new_slot(&mut self) -> ClientSlot {
        match self {
            Clients::Few(v) => (0..).find(|s| v.iter().all(|(_, l)| l.slot != *s)).expect("a free slot"),
            Clients::Many(m) => m.free.pop().unwrap_or_else(|| {
                m.owners.push(None);
                (m.owners.len() - 1) as ClientSlot
            }),
        }
    }

    /// The id of the client in `slot`.
    pub(super) fn owner(&self, slot: ClientSlot) -> Option<Arc<str>> {
        match self {
            Clients::Few(v) => v.iter().find(|(_, l)| l.slot == slot).map(|(k, _)| k.clone()),
            Clients::Many(m) => m.owners.get(slot as usize)?.clone(),
        }
    }

    pub(super) fn contains_key(&self, id: &str) -> bool {
        self.get(id).is_some()
    }

    pub(super) fn get(&self, id: &str) -> Option<&ClientLease> {
        match self {
            Clients::Few(v) => v.iter().find(|(k, _)| **k == *id).map(|(_, l)| l),
            Clients::Many(m) => m.map.get(id).map(|l| &**l),
        }
    }

    pub(super) fn get_mut(&mut self, id: &str) -> Option<&mut ClientLease> {
        match self {
            Clients::Few(v) => v.iter_mut().find(|(k, _)| **k == *id).map(|(_, l)| l),
            Clients::Many(m) => m.map.get_mut(id).map(|l| &mut **l),
        }
    }

    /// Files `lease` under `id`, replacing any lease it had (in the same slot).
    pub(super) fn insert(&mut self, id: &str, lease: ClientLease) {
        if let Some(l) = self.get_mut(id) {
            *l = lease;
            return;
        }
        let id: Arc<str> = Arc::from(id);
        match self {
            Clients::Few(v) if v.len() < FEW_CLIENTS => {
                // Exact growth: most resources never have a second client.
                v.reserve_exact(1);
                v.push((id, lease));
            }
            Clients::Few(v) => {
                let mut m = Many::default();
                for (k, l) in mem::take(v) {
                    m.file(k, l);
                }
                let top = m.owners.len() as ClientSlot;
                m.free = (0..top).rev().filter(|s| m.owners[*s as usize].is_none() && *s != lease.slot).collect();
                m.file(id, lease);
                *self = Clients::Many(Box::new(m));
            }
            Clients::Many(m) => m.file(id, lease),
        }
    }

    /// Takes `id`'s lease out; the storage goes once the last one does.
    pub(super) fn remove(&mut self, id: &str) -> Option<ClientLease> {
        let lease = match self {
            Clients::Few(v) => {
                let i = v.iter().position(|(k, _)| **k == *id)?;
                v.swap_remove(i).1
            }
            Clients::Many(m) => {
                let l = m.map.remove(id)?;
                m.owners[l.slot as usize] = None;
                m.free.push(l.slot);
                *l
            }
        };
        if self.is_empty() {
            *self = Clients::default();
        }
        Some(lease)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &ClientLease)> {
        let (few, many) = match self {
            Clients::Few(v) => (Some(v.iter().map(|(k, l)| (k, l))), None),
            Clients::Many(m) => (None, Some(m.map.iter().map(|(k, l)| (k, &**l)))),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &ClientLease> {
        self.iter().map(|(_, l)| l)
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut ClientLease> {
        let (few, many) = match self {
            Clients::Few(v) => (Some(v.iter_mut().map(|(_, l)| l)), None),
            Clients::Many(m) => (None, Some(m.map.values_mut().map(|l| &mut **l))),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }
}

impl Many {
    /// Files a lease in its slot, which [`Clients::new_slot`] handed out.
    fn file(&mut self, id: Arc<str>, lease: ClientLease) {
        let slot = lease.slot as usize;
        if self.owners.len() <= slot {
            self.owners.resize(slot + 1, None);
        }
        self.owners[slot] = Some(id.clone());
        self.map.insert(id, Box::new(lease));
    }
}

/// What lapsed clients keep reserved, by client id: nothing allocated while
/// empty (almost always), then a vector while few (every lease of a tenant
/// key lapses into one reservation when its sidecar stops asking for it),
/// a hash map past [`FEW_CLIENTS`].
#[derive(Debug, Default)]
pub(super) enum Reservations {
    /// No reservation.
    #[default]
    None,
    /// Up to [`FEW_CLIENTS`], in no order.
    Few(Vec<(Arc<str>, Reservation)>),
    #[allow(clippy::box_collection, reason = "a map inline would widen every resource by 24 bytes")]
    Many(Box<HashMap<Arc<str>, Reservation>>),
}

impl Reservations {
    pub(super) fn is_empty(&self) -> bool {
        match self {
            Reservations::None => true,
            Reservations::Few(v) => v.is_empty(),
            Reservations::Many(m) => m.is_empty(),
        }
    }

    pub(super) fn get(&self, id: &str) -> Option<&Reservation> {
        match self {
            Reservations::None => None,
            Reservations::Few(v) => v.iter().find(|(k, _)| **k == *id).map(|(_, r)| r),
            Reservations::Many(m) => m.get(id),
        }
    }

    pub(super) fn contains_key(&self, id: &str) -> bool {
        self.get(id).is_some()
    }

    /// Files `r` under `id`; gives back what `id` had reserved before.
    pub(super) fn insert(&mut self, id: Arc<str>, r: Reservation) -> Option<Reservation> {
        match self {
            Reservations::None => {
                *self = Reservations::Few(vec![(id, r)]);
                None
            }
            Reservations::Few(v) => {
                if let Some((_, old)) = v.iter_mut().find(|(k, _)| *k == id) {
                    return Some(mem::replace(old, r));
                }
                if v.len() < FEW_CLIENTS {
                    v.reserve_exact(1);
                    v.push((id, r));
                } else {
                    let mut m: HashMap<_, _> = mem::take(v).into_iter().collect();
                    m.insert(id, r);
                    *self = Reservations::Many(Box::new(m));
                }
                None
            }
            Reservations::Many(m) => m.insert(id, r),
        }
    }

    pub(super) fn remove(&mut self, id: &str) -> Option<Reservation> {
        let r = match self {
            Reservations::None => None,
            Reservations::Few(v) => v.iter().position(|(k, _)| **k == *id).map(|i| v.swap_remove(i).1),
            Reservations::Many(m) => m.remove(id),
        };
        self.release_if_empty();
        r
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Arc<str>, &mut Reservation) -> bool) {
        match self {
            Reservations::None => {}
            Reservations::Few(v) => v.retain_mut(|(k, r)| keep(k, r)),
            Reservations::Many(m) => m.retain(keep),
        }
        self.release_if_empty();
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Reservation> + Clone {
        let (few, many) = match self {
            Reservations::None => (None, None),
            Reservations::Few(v) => (Some(v.iter().map(|(_, r)| r)), None),
            Reservations::Many(m) => (None, Some(m.values())),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }

    fn release_if_empty(&mut self) {
        if self.is_empty() {
            *self = Reservations::None;
        }
    }
}
