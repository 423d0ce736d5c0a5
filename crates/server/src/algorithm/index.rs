//! The per-resource demand index: every client's (wants, subclients, has),
//! with the aggregate queries the share algorithms need.
//!
//! It owns the ordering of clients by demand per subclient and the running
//! sums over them. Clients live in an AVL tree stored in a `Vec` arena (u32
//! links, a free list for reuse), ordered by `(wants / subclients, slot)`;
//! every node carries the sums of wants, subclients and has over its subtree.
//! Past [`FEW`] clients a slot -> node map finds a client without
//! searching; below, a scan of the arena does (most indexes, a capacity
//! server's tenant keys, hold one client and pay for no map).
//!
//! Cost, with n clients: `upsert` and `remove` O(log n) worst case (AVL height
//! is at most ~1.44 log2 n); `sums_at_or_below` and `water_level` O(log n), as
//! both are one root-to-leaf descent over prefix sums; the totals O(1), read
//! off the root.
//!
//! Float sums never drift: a node's sums are recomputed from its children and
//! its own values whenever anything below it changes, never adjusted by
//! adding and subtracting deltas. So each sum is a pure function of the
//! current contents of its subtree (and its shape), whatever the history, and
//! the totals are the root's sums.
//!
//! Input values are sanitised on the way in: a `wants` or `has` that is
//! negative or NaN is stored as 0, so the ordering key is never NaN. A client
//! with 0 subclients (which the server should reject) is ordered as if it
//! wanted infinitely much per subclient, or 0 if it wants nothing:
//! `water_level` never counts it as satisfied, and as it adds no subclients
//! its share of any finite level is 0.

use std::collections::HashMap;

/// A stable handle for one client inside one index, chosen by the caller.
pub type ClientSlot = u32;

/// Arena index of a node; `NIL` is the empty subtree.
type NodeId = u32;
const NIL: NodeId = NodeId::MAX;

/// Sums over a subtree. Subclients are summed in u128 so that even clients
/// claiming `u64::MAX` subclients each cannot overflow; the public API
/// saturates to u64.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    wants: f64,
    subclients: u128,
    has: f64,
}

#[derive(Debug, Clone)]
struct Node {
    /// Wants per subclient: the primary ordering key, cached because every
    /// comparison on a descent needs it.
    level: f64,
    slot: ClientSlot,
    wants: f64,
    subclients: u64,
    has: f64,
    left: NodeId,
    right: NodeId,
    height: u8,
    sums: Sums,
}

impl Node {
    fn own(&self) -> Sums {
        Sums { wants: self.wants, subclients: self.subclients as u128, has: self.has }
    }
}

/// One resource's clients ordered by demand per subclient, with running
/// sums of wants, subclients and has.
#[derive(Debug, Clone)]
pub struct DemandIndex {
    nodes: Vec<Node>,
    /// Arena entries not in the tree, reused before the arena grows.
    free: Vec<NodeId>,
    /// Slot -> arena index, once the index has held more than [`FEW`]
    /// clients. A map rather than a slot-indexed vector because slots are
    /// the caller's to choose and need not be dense.
    #[allow(clippy::box_collection, reason = "a map inline would widen every index by 40 bytes")]
    by_slot: Option<Box<HashMap<ClientSlot, NodeId>>>,
    root: NodeId,
}

impl Default for DemandIndex {
    fn default() -> Self {
        Self { nodes: Vec::new(), free: Vec::new(), by_slot: None, root: NIL }
    }
}

/// Up to this many clients an index finds a slot by scanning its arena.
const FEW: usize = 8;

fn level_of(wants: f64, subclients: u64) -> f64 {
    if subclients == 0 { if wants > 0.0 { f64::INFINITY } else { 0.0 } } else { wants / subclients as f64 }
}

/// Maps NaN, negative values and -0.0 to +0.0, so levels order totally and
/// `total_cmp` agrees with `<=` on them.
fn sanitise(x: f64) -> f64 {
    if x > 0.0 { x } else { 0.0 }
}

fn saturate(x: u128) -> u64 {
    u64::try_from(x).unwrap_or(u64::MAX)
}

impl DemandIndex {
    /// An index with no client.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of clients.
    pub fn len(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// True when no client is in the index.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The node holding `slot`. Free nodes have height 0 (see `remove`).
    fn find(&self, slot: ClientSlot) -> Option<NodeId> {
        match &self.by_slot {
            Some(m) => m.get(&slot).copied(),
            None => self.nodes.iter().position(|n| n.height > 0 && n.slot == slot).map(|i| i as NodeId),
        }
    }

    /// Files a new node under its slot, building the map once the arena
    /// outgrows a scan.
    fn file(&mut self, slot: ClientSlot, id: NodeId) {
        if self.by_slot.is_none() && self.len() > FEW {
            let live = self.nodes.iter().enumerate().filter(|(_, n)| n.height > 0);
            self.by_slot = Some(Box::new(live.map(|(i, n)| (n.slot, i as NodeId)).collect()));
        }
        if let Some(m) = &mut self.by_slot {
            m.insert(slot, id);
        }
    }

    /// Inserts or replaces a client's demand.
    pub fn upsert(&mut self, slot: ClientSlot, wants: f64, subclients: u64, has: f64) {
        let wants = sanitise(wants);
        let has = sanitise(has);
        let level = level_of(wants, subclients);
        match self.find(slot) {
            // The server's second upsert of a request only changes has; the
            // node keeps its place and only the sums on its path change.
            Some(id) if self.node(id).level.to_bits() == level.to_bits() => {
                let n = self.node_mut(id);
                n.wants = wants;
                n.subclients = subclients;
                n.has = has;
                self.root = self.refresh_path(self.root, id);
            }
            Some(id) => {
                self.root = self.detach(self.root, id);
                let n = self.node_mut(id);
                n.level = level;
                n.wants = wants;
                n.subclients = subclients;
                n.has = has;
                self.reset_links(id);
                self.root = self.attach(self.root, id);
            }
            None => {
                let node = Node {
                    level,
                    slot,
                    wants,
                    subclients,
                    has,
                    left: NIL,
                    right: NIL,
                    height: 1,
                    sums: Sums::default(),
                };
                let id = match self.free.pop() {
                    Some(id) => {
                        self.nodes[id as usize] = node;
                        id
                    }
                    None => {
                        let id = NodeId::try_from(self.nodes.len())
                            .ok()
                            .filter(|&id| id != NIL)
                            .expect("DemandIndex holds at most u32::MAX - 1 clients");
                        // Room for one at first: most indexes (a sidecar's
                        // tenant keys) never hold a second client.
                        if self.nodes.capacity() == 0 {
                            self.nodes.reserve_exact(1);
                        }
                        self.nodes.push(node);
                        id
                    }
                };
                self.reset_links(id);
                self.file(slot, id);
                self.root = self.attach(self.root, id);
            }
        }
    }

    /// Removes a client; a missing slot is ignored.
    pub fn remove(&mut self, slot: ClientSlot) {
        if let Some(id) = self.find(slot) {
            if let Some(m) = &mut self.by_slot {
                m.remove(&slot);
            }
            self.root = self.detach(self.root, id);
            self.node_mut(id).height = 0;
            self.free.push(id);
        }
        if self.is_empty() {
            // Nothing refers into the arena any more: release what a resource
            // that once had many clients would otherwise keep on its free list.
            *self = Self::default();
        }
    }

    /// What every client wants, summed.
    pub fn total_wants(&self) -> f64 {
        self.sums(self.root).wants.max(0.0)
    }

    /// What every client holds, summed.
    pub fn total_has(&self) -> f64 {
        self.sums(self.root).has.max(0.0)
    }

    /// Every client's subclients, summed; saturates at `u64::MAX`.
    pub fn total_subclients(&self) -> u64 {
        saturate(self.sums(self.root).subclients)
    }

    /// Sum of wants and of subclients over the clients whose wants per
    /// subclient is at most `per_subclient`.
    pub fn sums_at_or_below(&self, per_subclient: f64) -> (f64, u64) {
        // Those clients are a prefix of the tree order.
        let mut acc = Sums::default();
        let mut t = self.root;
        while t != NIL {
            let n = self.node(t);
            if n.level <= per_subclient {
                acc = add(add(acc, self.sums(n.left)), n.own());
                t = n.right;
            } else {
                t = n.left;
            }
        }
        (acc.wants, saturate(acc.subclients))
    }

    /// The max-min level `L` per subclient with `sum(min(wants, L * subclients)) = capacity`;
    /// infinite when every client's wants fit.
    pub fn water_level(&self, capacity: f64) -> f64 {
        if self.total_wants() <= capacity {
            return f64::INFINITY;
        }
        let capacity = capacity.max(0.0);
        let total = self.sums(self.root).subclients;
        // In level order, client `c` is fully satisfied iff, with `W`, `S` the
        // sums over the clients before it, `level(c) * (total - S) <= capacity - W`:
        // what is left, split over everyone not yet satisfied, covers it. Once
        // false it stays false for every later client, so the satisfied
        // clients are a prefix and one descent finds its end.
        let mut satisfied = Sums::default();
        let mut t = self.root;
        let mut before = Sums::default();
        while t != NIL {
            let n = self.node(t);
            let preceding = add(before, self.sums(n.left));
            if n.level * (total - preceding.subclients) as f64 <= capacity - preceding.wants {
                before = add(preceding, n.own());
                satisfied = before;
                t = n.right;
            } else {
                t = n.left;
            }
        }
        let unsatisfied = total - satisfied.subclients;
        if unsatisfied == 0 {
            return f64::INFINITY;
        }
        ((capacity - satisfied.wants) / unsatisfied as f64).max(0.0)
    }

    /// The floor `F` per subclient with `sum(max(wants, F * subclients)) =
    /// target`: the clients that want least raised to one level, as far as
    /// `target` allows (how spare capacity is handed out: it goes where
    /// least is wanted). 0 when `target` is no more than the total wants.
    pub fn floor_level(&self, target: f64) -> f64 {
        let total = self.sums(self.root);
        if target <= total.wants || total.subclients == 0 {
            return 0.0;
        }
        // In level order, raising the clients up to `c` (and `c`) to `c`'s
        // level stays within `target` for a prefix of the clients: one
        // descent finds its end.
        let mut raised = Sums::default();
        let mut before = Sums::default();
        let mut t = self.root;
        while t != NIL {
            let n = self.node(t);
            let with = add(add(before, self.sums(n.left)), n.own());
            if (total.wants - with.wants) + n.level * with.subclients as f64 <= target {
                before = with;
                raised = with;
                t = n.right;
            } else {
                t = n.left;
            }
        }
        if raised.subclients == 0 {
            return 0.0;
        }
        ((target - (total.wants - raised.wants)) / raised.subclients as f64).max(0.0)
    }

    // === tree plumbing ===

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn height(&self, id: NodeId) -> u8 {
        if id == NIL { 0 } else { self.node(id).height }
    }

    fn sums(&self, id: NodeId) -> Sums {
        if id == NIL { Sums::default() } else { self.node(id).sums }
    }

    /// Strict tree order: by level, ties broken by slot, so keys are unique.
    fn precedes(&self, a: NodeId, b: NodeId) -> bool {
        let (a, b) = (self.node(a), self.node(b));
        a.level.total_cmp(&b.level).then(a.slot.cmp(&b.slot)).is_lt()
    }

    fn reset_links(&mut self, id: NodeId) {
        let n = self.node_mut(id);
        n.left = NIL;
        n.right = NIL;
        n.height = 1;
        n.sums = n.own();
    }

    /// Recomputes `id`'s height and sums from its children, which must be up
    /// to date. Always left + own + right, in that order, so the result
    /// depends only on the subtree, not on how it came to be.
    fn update(&mut self, id: NodeId) {
        let n = self.node(id);
        let (l, r) = (n.left, n.right);
        let height = 1 + self.height(l).max(self.height(r));
        let sums = add(add(self.sums(l), n.own()), self.sums(r));
        let n = self.node_mut(id);
        n.height = height;
        n.sums = sums;
    }

    fn rotate_right(&mut self, id: NodeId) -> NodeId {
        let l = self.node(id).left;
        self.node_mut(id).left = self.node(l).right;
        self.node_mut(l).right = id;
        self.update(id);
        self.update(l);
        l
    }

    fn rotate_left(&mut self, id: NodeId) -> NodeId {
        let r = self.node(id).right;
        self.node_mut(id).right = self.node(r).left;
        self.node_mut(r).left = id;
        self.update(id);
        self.update(r);
        r
    }

    /// Updates `id` and restores the AVL balance at it; returns the new
    /// subtree root.
    fn rebalance(&mut self, id: NodeId) -> NodeId {
        self.update(id);
        let (l, r) = (self.node(id).left, self.node(id).right);
        let (hl, hr) = (self.height(l), self.height(r));
        if hl > hr + 1 {
            if self.height(self.node(l).left) < self.height(self.node(l).right) {
                let nl = self.rotate_left(l);
                self.node_mut(id).left = nl;
            }
            self.rotate_right(id)
        } else if hr > hl + 1 {
            if self.height(self.node(r).right) < self.height(self.node(r).left) {
                let nr = self.rotate_right(r);
                self.node_mut(id).right = nr;
            }
            self.rotate_left(id)
        } else {
            id
        }
    }

    /// Inserts the lone node `x` into subtree `t`; returns the new root.
    fn attach(&mut self, t: NodeId, x: NodeId) -> NodeId {
        if t == NIL {
            return x;
        }
        if self.precedes(x, t) {
            let l = self.attach(self.node(t).left, x);
            self.node_mut(t).left = l;
        } else {
            let r = self.attach(self.node(t).right, x);
            self.node_mut(t).right = r;
        }
        self.rebalance(t)
    }

    /// Unlinks node `x`, which must be in subtree `t`; returns the new root.
    /// Nodes are relinked, never copied, so `by_slot` stays valid.
    fn detach(&mut self, t: NodeId, x: NodeId) -> NodeId {
        if t == x {
            let (l, r) = (self.node(t).left, self.node(t).right);
            if l == NIL {
                return r;
            }
            if r == NIL {
                return l;
            }
            let (r, successor) = self.detach_min(r);
            let s = self.node_mut(successor);
            s.left = l;
            s.right = r;
            return self.rebalance(successor);
        }
        if self.precedes(x, t) {
            let l = self.detach(self.node(t).left, x);
            self.node_mut(t).left = l;
        } else {
            let r = self.detach(self.node(t).right, x);
            self.node_mut(t).right = r;
        }
        self.rebalance(t)
    }

    /// Unlinks the first node of non-empty subtree `t`; returns the new root
    /// and that node.
    fn detach_min(&mut self, t: NodeId) -> (NodeId, NodeId) {
        let l = self.node(t).left;
        if l == NIL {
            return (self.node(t).right, t);
        }
        let (l, min) = self.detach_min(l);
        self.node_mut(t).left = l;
        (self.rebalance(t), min)
    }

    /// Recomputes the sums on the path from `t` down to `x` after `x`'s own
    /// values changed without changing its position.
    fn refresh_path(&mut self, t: NodeId, x: NodeId) -> NodeId {
        if t != x {
            let next = if self.precedes(x, t) { self.node(t).left } else { self.node(t).right };
            self.refresh_path(next, x);
        }
        self.update(t);
        t
    }
}

fn add(a: Sums, b: Sums) -> Sums {
    Sums { wants: a.wants + b.wants, subclients: a.subclients + b.subclients, has: a.has + b.has }
}

#[cfg(test)]
impl DemandIndex {
    /// Panics unless the tree is a valid AVL tree in `(level, slot)` order
    /// whose cached heights and sums are exactly what recomputation gives, and
    /// `by_slot`, the arena and the free list agree with it.
    pub(crate) fn check_invariants(&self) {
        fn walk(ix: &DemandIndex, t: NodeId, seen: &mut Vec<NodeId>) -> (u8, Sums) {
            if t == NIL {
                return (0, Sums::default());
            }
            let n = ix.node(t);
            let (hl, sl) = walk(ix, n.left, seen);
            seen.push(t);
            let (hr, sr) = walk(ix, n.right, seen);
            assert!(hl.abs_diff(hr) <= 1, "node {t} unbalanced: {hl} vs {hr}");
            assert_eq!(n.height, 1 + hl.max(hr), "node {t} height");
            let sums = add(add(sl, n.own()), sr);
            assert_eq!(n.sums, sums, "node {t} sums");
            assert!(!n.level.is_nan() && n.wants >= 0.0 && n.has >= 0.0, "node {t} values");
            assert_eq!(n.level.to_bits(), level_of(n.wants, n.subclients).to_bits());
            (n.height, sums)
        }
        let mut in_order = Vec::new();
        walk(self, self.root, &mut in_order);
        for w in in_order.windows(2) {
            assert!(self.precedes(w[0], w[1]), "nodes {} and {} out of order", w[0], w[1]);
        }
        assert_eq!(in_order.len(), self.len(), "tree size vs arena");
        if let Some(m) = &self.by_slot {
            assert_eq!(in_order.len(), m.len(), "tree size vs slot map");
            for (&slot, &id) in m.iter() {
                assert_eq!(self.node(id).slot, slot, "slot map points at the wrong node");
            }
        }
        for &id in &in_order {
            assert_eq!(self.find(self.node(id).slot), Some(id), "a live node's slot finds another");
        }
        assert_eq!(in_order.len() + self.free.len(), self.nodes.len(), "arena accounting");
        for id in &self.free {
            assert!(!in_order.contains(id), "free node {id} still in the tree");
            assert_eq!(self.node(*id).height, 0, "free node {id} not marked free");
        }
    }
}
