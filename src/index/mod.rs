//! The prefix-block index: which worker holds how many leading blocks of a token sequence.
//!
//! A port of kvroute/_index.py, rule for rule (tests/reference/ keeps the Python one as the
//! executable reference; tests/test_core_differential.py feeds both the same event streams):
//! `store` applies events (stores, removals, clears, KV-cache groups, copies, limits), `query`
//! answers `find_matches` (the hybrid rule, tiers), `snapshot` exports and imports a worker's
//! tables (kvroute/_snapshot.py writes them in today's file format).
//!
//! Layout: each worker has a slot (the Python index's bit). Content keys are interned to u32 ids
//! in one `KeyTable`; each key lists its holders as packed `slot << 5 | flags` words, sorted by
//! slot, where the flags mirror the Python index's shared tables one for one (`_holders`,
//! `_gpu_missing`, the three `_tier_holders`). Per worker, engine hashes map to key ids.
//!
//! ## The raw-bytes seam (for `PrefixIndex.apply_payload`)
//!
//! The integrator's glue is `wire::decode` + [`Index::apply_batch`], off the GIL, under the write
//! lock of the `PyIndex` that `src/py/index.rs` defines:
//!
//! ```ignore
//! // in src/py/index.rs, on PyIndex:
//! fn apply_payload(&self, py: Python<'_>, worker: &Bound<'_, PyAny>, payload: &[u8]) -> PyResult<...> {
//!     let key = PyKey::extract(worker)?;                  // WorkerKey -> the index's worker type
//!     let report = py.detach(|| {
//!         let batch = crate::wire::decode(payload)?;       // bytes -> protocols::Batch
//!         let counts = self.inner.write().apply_batch(&key, &batch);   // -> ApplyCounts
//!         Ok((batch.ts, batch.untrusted, batch.skipped, counts))
//!     });
//!     self.flush_logs(py);                                 // refusal warnings -> logging "kvroute.index"
//!     ...build the ApplyReport from `report`...
//! }
//! ```
//!
//! [`Index::apply_batch`] applies every event of the batch in order (the batch's `untrusted` and
//! `skipped` are the recovery machine's business, as in the Python `apply_batch`) and returns
//! [`ApplyCounts`] (stored blocks, removed blocks, events).

mod query;
mod snapshot;
mod store;
mod table;

use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::keys::Key;
use crate::protocols::BlockHash;

pub use query::{MatchResult, Query, QueryInput, Score};
pub use snapshot::{
    read as read_snapshot, SnapFile, SnapGroup, SnapKey, SnapReadError, SnapWorker,
};
pub(crate) use table::prefetch;
use table::{close_hole, huge_pages, prefetch_lines, scaled, KeyTable, MOVE_FROM, MOVE_SPREAD};

/// What identifies a worker (a `WorkerKey` in Python): hashable, cheap to clone, printable.
pub trait WorkerName: Clone + Eq + Hash + Send + Sync {
    /// "worker_id/dp_rank", as the log lines name a worker.
    fn label(&self) -> String;

    /// Start bringing what a clone of this name reads into cache: `find_matches` clones the
    /// names of a few hundred workers at once and prefetches them all first, so their misses
    /// overlap. A name held inline needs nothing (the default).
    #[inline]
    fn prefetch(&self) {}
}

/// `IndexLimits` (kvroute/_index.py): per-worker bounds and the namespace-root cache size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_block_sizes: usize,
    pub max_entries_per_worker: usize,
    pub max_groups_per_worker: usize,
    pub max_cached_roots: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_block_sizes: 8,
            max_entries_per_worker: 1 << 24,
            max_groups_per_worker: 64,
            max_cached_roots: 4096,
        }
    }
}

/// `IndexStats` (kvroute/_index.py), field for field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub workers: u64,
    pub entries: u64,
    pub distinct_keys: u64,
    pub unknown_parent_blocks: u64,
    pub unhashable_blocks: u64,
    pub unknown_removals: u64,
    pub ignored_group_events: u64,
    pub remote_blocks: u64,
    pub repeated_stores: u64,
    pub refused_block_sizes: u64,
    pub refused_entries: u64,
    pub uncached_roots: u64,
}

/// What `apply_batch` did: blocks named by the batch's stores and removals, and its events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyCounts {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub events: u64,
}

/// The index's tables as the Python index named them (`Index::tables`, for tests): content keys
/// per flag [holders, gpu_missing, CPU, DISK, EXTERNAL], classes with member slots, workers with
/// their slots, cached namespace roots.
pub struct Tables<K> {
    pub flagged: [Vec<Key>; 5],
    pub classes: Vec<(Class, Vec<u32>)>,
    pub workers: Vec<(K, u32)>,
    pub roots: Vec<(Option<String>, Option<String>)>,
}

/// A (block size, lookahead tokens) pair: how a worker's content keys are chained.
pub type Class = (i64, i64);

/// A uint64 engine hash as two u32 halves: alignment 4, so an (engine hash, key id) entry of a
/// worker's table packs into 12 bytes instead of 16 (the worker tables are most of the index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct H64([u32; 2]);

impl H64 {
    #[inline]
    fn new(h: u64) -> H64 {
        H64([h as u32, (h >> 32) as u32])
    }

    #[inline]
    fn get(self) -> u64 {
        u64::from(self.0[0]) | u64::from(self.0[1]) << 32
    }
}

/// An `IntMap` home's hash of an engine hash: a full-avalanche mix, every output bit depending
/// on every input bit. FxHash's (a multiply, then a rotate) put the product's low bits on top,
/// and the home is taken from the top bits, so engine hashes differing only above bit 37 all
/// shared one home: 20k of them took 2 s to insert, under the index's write lock.
///
/// The mix is foldhash's (a 64x64 -> 128-bit multiply folded in half, the hasher under
/// hashbrown's default), not XXH3 over the eight bytes, which it replaced: this hash is taken
/// once a block to store it, again for every entry at each growth of a worker's table, and for
/// every entry a removal shifts back (callgrind, `bench/callgrind_ingest.py` `dynamo`: 1,336 →
/// 1,217 instructions a block with the session's other cuts; a hand-written `fmix64` gave 1,237).
/// Only where entries sit in memory depends on it, never what the index answers.
#[inline]
fn hash_u64(h: u64) -> u64 {
    use std::hash::BuildHasher;
    const HOME: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0);
    HOME.hash_one(h)
}

/// The engine hash an `IntMap` slot holds when empty (an entry under this hash itself is kept
/// beside the slots, in `IntMap::at_empty`).
const EMPTY_HASH: u64 = u64::MAX;

/// Most entries an `IntMap` of `cap` slots holds: 7/8 full.
fn int_map_load(cap: usize) -> usize {
    cap.saturating_sub((cap / 8).max(1))
}

/// A worker's uint64 engine hashes to values, in an open-addressing table of its own (linear
/// probing over one vector of 12-byte `(H64, V)` slots for a key id), for memory: the worker
/// tables are most of the index, and a hashbrown table spent a control byte a bucket and
/// doubled at 7/8 full (~1.65 buckets of 13 bytes an entry on average). This one grows by half
/// at 7/8 full (~1.4 slots of 12 bytes) at any capacity (the home is the hash's high bits scaled
/// to it). A removal shifts the entries after it back: no tombstones, so churn never slows a
/// lookup.
///
/// A large table grows a few runs at a time (`OldSlots`), as the key table's id index does
/// (table.rs, `Ids`): re-placing every entry at once stalled the store that grew it, and every
/// query waiting for the index's lock, 22 ms at 1.6M slots; each worker's table grew in turn
/// (session 17).
#[derive(Clone, Debug)]
pub(crate) struct IntMap<V> {
    slots: Vec<(H64, V)>,
    /// entries in `slots`
    len: usize,
    /// the value under `EMPTY_HASH`, which no slot can hold
    at_empty: Option<V>,
    /// a growth under way: the slots it replaces, not yet all moved
    old: Option<Box<OldSlots<V>>>,
}

/// The slots a growth replaces, moved into the new ones a run at a time: a run (slots between
/// two empty ones) moves whole and is emptied, so every run left is as it was, and a probe of
/// these slots finds exactly the entries not moved yet (a moved run's home is empty now).
#[derive(Clone, Debug)]
struct OldSlots<V> {
    slots: Vec<(H64, V)>,
    /// entries left in `slots`
    len: usize,
    /// the next slot to visit, cyclically from an empty one
    at: usize,
    /// slots not visited yet
    todo: usize,
    /// slots visited per entry inserted or removed (then on to the end of the run)
    pace: usize,
}

impl<V> Default for IntMap<V> {
    fn default() -> Self {
        IntMap {
            slots: Vec::new(),
            len: 0,
            at_empty: None,
            old: None,
        }
    }
}

/// The slot holding engine hash `h` (its `hash_u64` is `hh`) in `slots`, or the empty slot
/// that ends its probe (None: no slots).
#[inline]
fn probe_slots<V>(slots: &[(H64, V)], h: u64, hh: u64) -> Option<usize> {
    let cap = slots.len();
    if cap == 0 {
        return None;
    }
    let mut i = scaled(hh, cap);
    loop {
        let k = slots[i].0.get();
        if k == h || k == EMPTY_HASH {
            return Some(i);
        }
        i += 1;
        if i == cap {
            i = 0;
        }
    }
}

/// Take the entry at `i` out of `slots`, shifting the entries after it back (no tombstones).
fn remove_slot<V: Copy + Default>(slots: &mut [(H64, V)], i: usize) {
    let cap = slots.len();
    close_hole(
        slots,
        i,
        (H64::new(EMPTY_HASH), V::default()),
        |e| e.0.get() == EMPTY_HASH,
        |e, _| scaled(hash_u64(e.0.get()), cap),
        |e, _, _| e,
    );
}

/// `cap` empty slots (huge pages asked for a large table).
fn empty_slots<V: Copy + Default>(cap: usize) -> Vec<(H64, V)> {
    let mut slots = Vec::with_capacity(cap);
    huge_pages(slots.spare_capacity_mut());
    slots.resize(cap, (H64::new(EMPTY_HASH), V::default()));
    slots
}

impl<V: Copy + Default> IntMap<V> {
    /// The slot a probe of `h` starts at (the tests' check of how homes spread).
    #[cfg(test)]
    fn home(&self, h: u64) -> usize {
        scaled(hash_u64(h), self.slots.len())
    }

    /// The slot holding `h`, or the empty slot that ends its probe (None: no slots yet).
    #[inline]
    fn probe(&self, h: u64) -> Option<usize> {
        self.probe_hashed(h, hash_u64(h))
    }

    /// `probe` with `hh`, `hash_u64(h)`, computed by the caller (the store path computes it
    /// once, to prefetch the slot ahead of the insert).
    #[inline]
    fn probe_hashed(&self, h: u64, hh: u64) -> Option<usize> {
        probe_slots(&self.slots, h, hh)
    }

    /// The old slots' index of `h` while a growth moves them (None: not there, or no growth).
    #[inline]
    fn old_slot(&self, h: u64, hh: u64) -> Option<usize> {
        let old = self.old.as_deref()?;
        let i = probe_slots(&old.slots, h, hh)?;
        (old.slots[i].0.get() == h).then_some(i)
    }

    #[inline]
    fn get(&self, h: u64) -> Option<&V> {
        if h == EMPTY_HASH {
            return self.at_empty.as_ref();
        }
        let hh = hash_u64(h);
        if let Some(i) = self.probe_hashed(h, hh) {
            let e = &self.slots[i];
            if e.0.get() == h {
                return Some(&e.1);
            }
        }
        let i = self.old_slot(h, hh)?;
        self.old.as_deref().map(|o| &o.slots[i].1)
    }

    #[inline]
    fn get_mut(&mut self, h: u64) -> Option<&mut V> {
        if h == EMPTY_HASH {
            return self.at_empty.as_mut();
        }
        let hh = hash_u64(h);
        if let Some(i) = self.probe_hashed(h, hh) {
            if self.slots[i].0.get() == h {
                return Some(&mut self.slots[i].1);
            }
        }
        let i = self.old_slot(h, hh)?;
        self.old.as_deref_mut().map(|o| &mut o.slots[i].1)
    }

    /// The value under `h`, inserted as `v` if absent: (its place, whether it was inserted).
    #[inline]
    fn entry(&mut self, h: u64, v: V) -> (&mut V, bool) {
        self.entry_hashed(h, hash_u64(h), v)
    }

    /// `entry` with `hh`, `hash_u64(h)`, computed by the caller.
    #[inline]
    fn entry_hashed(&mut self, h: u64, hh: u64, v: V) -> (&mut V, bool) {
        if h == EMPTY_HASH {
            let fresh = self.at_empty.is_none();
            return (self.at_empty.get_or_insert(v), fresh);
        }
        if self.held() >= int_map_load(self.slots.len()) {
            self.make_room(self.held() + 1);
        }
        if self.old.is_some() {
            // Before the probe: moving entries changes the new slots. (A growth begun just
            // above has every entry in the old slots.)
            self.step();
            if let Some(i) = self.old_slot(h, hh) {
                let old = self.old.as_deref_mut().expect("a growth under way");
                return (&mut old.slots[i].1, false);
            }
        }
        let i = self.probe_hashed(h, hh).expect("room was made");
        let fresh = self.slots[i].0.get() == EMPTY_HASH;
        if fresh {
            self.slots[i] = (H64::new(h), v);
            self.len += 1;
        }
        (&mut self.slots[i].1, fresh)
    }

    /// The entry under `h` taken out of the slots that hold it.
    fn take_out(&mut self, h: u64) -> Option<V> {
        if h == EMPTY_HASH {
            return self.at_empty.take();
        }
        let hh = hash_u64(h);
        if let Some(i) = self
            .probe_hashed(h, hh)
            .filter(|&i| self.slots[i].0.get() == h)
        {
            let out = self.slots[i].1;
            remove_slot(&mut self.slots, i);
            self.len -= 1;
            return Some(out);
        }
        let i = self.old_slot(h, hh)?;
        let old = self.old.as_deref_mut().expect("a growth under way");
        let out = old.slots[i].1;
        // Within the entry's run, which has not moved: the runs left stay whole.
        remove_slot(&mut old.slots, i);
        old.len -= 1;
        Some(out)
    }

    /// Take the entry under `h` out, and move the next runs of a growth under way: a growth ends
    /// even while no new engine hash comes (a worker that only evicts), and lookups stop probing
    /// two tables.
    fn remove(&mut self, h: u64) -> Option<V> {
        let out = self.take_out(h);
        if self.old.is_some() {
            self.step();
        }
        out
    }

    /// Entries in the slots, new and old.
    #[inline]
    fn held(&self) -> usize {
        self.len + self.old.as_deref().map_or(0, |o| o.len)
    }

    /// Room for `want` entries: finish a growth under way, then grow by half until they fit,
    /// a few runs at a time past `MOVE_FROM` entries (`OldSlots`), else at once.
    fn make_room(&mut self, want: usize) {
        self.finish();
        if self.len < MOVE_FROM {
            self.grow_to(want);
            return;
        }
        let cap = self.grown(want);
        if cap == self.slots.len() {
            return;
        }
        let slots = std::mem::replace(&mut self.slots, empty_slots(cap));
        let len = std::mem::take(&mut self.len);
        // The runs move from an empty slot on (one always is: at most 7/8 full).
        let at = slots
            .iter()
            .position(|e| e.0.get() == EMPTY_HASH)
            .expect("an empty slot");
        // Every slot is visited within `MOVE_SPREAD` of the entries the new slots take before
        // they grow again.
        let room = int_map_load(cap).saturating_sub(len);
        let pace = slots.len().div_ceil((room / MOVE_SPREAD).max(1)) + 1;
        self.old = Some(Box::new(OldSlots {
            todo: slots.len(),
            slots,
            len,
            at,
            pace,
        }));
    }

    /// The capacity that holds `want` entries: the slots' grown by half until they fit.
    fn grown(&self, want: usize) -> usize {
        let mut cap = self.slots.len().max(4);
        while int_map_load(cap) < want {
            cap += cap / 2;
        }
        cap
    }

    /// Room for `want` entries in the slots, made at once: grow by half until they fit, and
    /// re-place every entry (a growth under way finishes first).
    fn grow_to(&mut self, want: usize) {
        self.finish();
        let cap = self.grown(want);
        if cap == self.slots.len() {
            return;
        }
        let old = std::mem::replace(&mut self.slots, empty_slots(cap));
        for e in old {
            if e.0.get() != EMPTY_HASH {
                let i = self.probe(e.0.get()).expect("slots");
                self.slots[i] = e;
            }
        }
    }

    /// Move the next runs of a growth under way (at least `pace` slots, then on to the end of
    /// the run); the old slots go once every one was visited.
    #[inline(never)]
    fn step(&mut self) {
        let Some(old) = self.old.as_deref_mut() else {
            return;
        };
        let cap = old.slots.len();
        let mut visited = 0usize;
        while old.todo > 0 {
            let e = old.slots[old.at];
            let empty = e.0.get() == EMPTY_HASH;
            if !empty {
                let i = probe_slots(&self.slots, e.0.get(), hash_u64(e.0.get())).expect("slots");
                self.slots[i] = e;
                self.len += 1;
                old.slots[old.at].0 = H64::new(EMPTY_HASH);
                old.len -= 1;
            }
            old.at += 1;
            if old.at == cap {
                old.at = 0;
            }
            old.todo -= 1;
            visited += 1;
            // Stop only after an empty slot: the runs left are whole.
            if empty && visited >= old.pace {
                return;
            }
        }
        debug_assert_eq!(old.len, 0, "every entry moved");
        self.old = None;
    }

    /// Move every entry a growth under way has left.
    fn finish(&mut self) {
        if let Some(old) = self.old.as_deref_mut() {
            old.pace = usize::MAX;
            self.step();
        }
    }

    /// Room for `more` entries beyond those held, made at once: a store of many new blocks
    /// re-places the entries once, where growing by half entry by entry could re-place them
    /// two or three times over one store into a small table. The capacity is the one those
    /// inserts would have grown it to.
    fn reserve(&mut self, more: usize) {
        let want = self.held() + more;
        if want > int_map_load(self.slots.len()) {
            self.make_room(want);
        }
    }

    /// Start bringing the slots a probe of an engine hash whose `hash_u64` is `hh` reads into
    /// cache (a worker's table at 1M entries is megabytes: every insert missed on it): its
    /// home's line and the next, since a new hash's probe runs to an empty slot, ~6 slots of 12
    /// bytes at 7/12 full and more near 7/8.
    #[inline]
    fn prefetch_hashed(&self, hh: u64) {
        self.prefetch_from_home(hh, 128);
    }

    /// Start bringing `bytes` of slots from the home of hash `hh` on into cache (in the slots
    /// of a growth under way too).
    #[inline]
    fn prefetch_from_home(&self, hh: u64, bytes: usize) {
        for slots in std::iter::once(&self.slots).chain(self.old.as_deref().map(|o| &o.slots)) {
            if !slots.is_empty() {
                let home = slots.as_ptr().wrapping_add(scaled(hh, slots.len()));
                prefetch_lines(home.cast(), bytes);
            }
        }
    }

    fn len(&self) -> usize {
        self.held() + usize::from(self.at_empty.is_some())
    }

    fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        (self.slots.iter())
            .chain(self.old.as_deref().into_iter().flat_map(|o| o.slots.iter()))
            .filter(|e| e.0.get() != EMPTY_HASH)
            .map(|e| (e.0.get(), &e.1))
            .chain(self.at_empty.iter().map(|v| (EMPTY_HASH, v)))
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        (self.slots.iter_mut())
            .chain((self.old.as_deref_mut().into_iter()).flat_map(|o| o.slots.iter_mut()))
            .filter(|e| e.0.get() != EMPTY_HASH)
            .map(|e| &mut e.1)
            .chain(self.at_empty.iter_mut())
    }

    fn memory_bytes(&self) -> usize {
        let old = self.old.as_deref().map_or(0, |o| o.slots.capacity());
        (self.slots.capacity() + old) * std::mem::size_of::<(H64, V)>()
    }
}

/// A map keyed by engine block hashes, ints and bytes apart (a uint64 stays 8 bytes, packed).
#[derive(Clone, Debug)]
pub(crate) struct EMap<V> {
    ints: IntMap<V>,
    bytes: FxHashMap<Box<[u8]>, V>,
}

impl<V> Default for EMap<V> {
    fn default() -> Self {
        EMap {
            ints: IntMap::default(),
            bytes: FxHashMap::default(),
        }
    }
}

impl<V: Copy + Default> EMap<V> {
    #[inline]
    pub(crate) fn get(&self, h: &BlockHash) -> Option<&V> {
        match h {
            BlockHash::Int(i) => self.ints.get(*i),
            BlockHash::Bytes(b) => self.bytes.get(b.as_slice()),
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, h: &BlockHash) -> Option<&mut V> {
        match h {
            BlockHash::Int(i) => self.ints.get_mut(*i),
            BlockHash::Bytes(b) => self.bytes.get_mut(b.as_slice()),
        }
    }

    #[inline]
    pub(crate) fn contains(&self, h: &BlockHash) -> bool {
        self.get(h).is_some()
    }

    #[inline]
    pub(crate) fn insert(&mut self, h: &BlockHash, v: V) -> Option<V> {
        match h {
            BlockHash::Int(i) => match self.ints.entry(*i, v) {
                (_, true) => None,
                (at, false) => Some(std::mem::replace(at, v)),
            },
            BlockHash::Bytes(b) => self.bytes.insert(b.clone().into_boxed_slice(), v),
        }
    }

    /// The hash a uint64 engine hash's slot comes from (0 for a bytes hash, which a hashbrown
    /// table keeps): computed once per block by the store path, for `prefetch_hashed` and
    /// `try_insert_hashed`.
    #[inline]
    pub(crate) fn slot_hash(h: &BlockHash) -> u64 {
        match h {
            BlockHash::Int(i) => hash_u64(*i),
            BlockHash::Bytes(_) => 0,
        }
    }

    /// Room for `more` new uint64 hashes (`IntMap::reserve`).
    #[inline]
    pub(crate) fn reserve_ints(&mut self, more: usize) {
        self.ints.reserve(more);
    }

    /// Bytes of the uint64 hashes' slots (what a probe reads at random).
    #[inline]
    pub(crate) fn slot_bytes(&self) -> usize {
        self.ints.memory_bytes()
    }

    /// Start bringing the slot of an engine hash whose `slot_hash` is `hh` into cache.
    #[inline]
    pub(crate) fn prefetch_hashed(&self, hh: u64) {
        self.ints.prefetch_hashed(hh);
    }

    /// Start bringing what a removal of engine hash `h` reads into cache: its slot and the run
    /// after it, which the removal shifts back to the run's end (~30 slots of 12 bytes at 7/8
    /// full: the first four lines of it). A bytes hash: nothing.
    #[inline]
    pub(crate) fn prefetch_removal(&self, h: &BlockHash) {
        if let BlockHash::Int(i) = h {
            self.ints.prefetch_from_home(hash_u64(*i), 256);
        }
    }

    /// Start bringing the slot of engine hash `h` into cache (a bytes hash: nothing).
    #[inline]
    pub(crate) fn prefetch(&self, h: &BlockHash) {
        if let BlockHash::Int(i) = h {
            self.ints.prefetch_hashed(hash_u64(*i));
        }
    }

    /// Insert `v` under `h` unless `h` is there already: Ok when inserted, Err (`v` back) when
    /// not (the store path's one probe: present or not, and the insert, in one lookup). The
    /// store path calls `try_insert_hashed`; this is the tests' form.
    #[cfg(test)]
    pub(crate) fn try_insert(&mut self, h: &BlockHash, v: V) -> Result<(), V> {
        self.try_insert_hashed(h, Self::slot_hash(h), v)
    }

    /// `try_insert` with `hh`, `slot_hash(h)`, computed by the caller.
    #[inline]
    pub(crate) fn try_insert_hashed(&mut self, h: &BlockHash, hh: u64, v: V) -> Result<(), V> {
        match h {
            BlockHash::Int(i) => match self.ints.entry_hashed(*i, hh, v) {
                (_, true) => Ok(()),
                (_, false) => Err(v),
            },
            BlockHash::Bytes(b) => {
                if self.bytes.contains_key(b.as_slice()) {
                    return Err(v);
                }
                self.bytes.insert(b.clone().into_boxed_slice(), v);
                Ok(())
            }
        }
    }

    pub(crate) fn remove(&mut self, h: &BlockHash) -> Option<V> {
        match h {
            BlockHash::Int(i) => self.ints.remove(*i),
            BlockHash::Bytes(b) => self.bytes.remove(b.as_slice()),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.ints.len() + self.bytes.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.ints.iter().map(|e| e.1).chain(self.bytes.values())
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.ints.values_mut().chain(self.bytes.values_mut())
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, &V)> {
        self.ints.iter().map(|(h, v)| (BlockHash::Int(h), v)).chain(
            self.bytes
                .iter()
                .map(|(k, v)| (BlockHash::Bytes(k.to_vec()), v)),
        )
    }

    /// Room for `hashes` (a restore, which knows every hash a worker's table will hold).
    pub(crate) fn reserve_for(&mut self, hashes: &[BlockHash]) {
        let ints = hashes
            .iter()
            .filter(|h| matches!(h, BlockHash::Int(i) if *i != EMPTY_HASH))
            .count();
        self.ints.grow_to(self.ints.held() + ints);
    }

    /// Bytes the map has allocated (slots and buckets; a bytes key's own allocation too).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.ints.memory_bytes()
            + table_bytes::<(Box<[u8]>, V)>(self.bytes.capacity())
            + self.bytes.keys().map(|k| k.len()).sum::<usize>()
    }
}

/// Bytes a hashbrown table with room for `capacity` entries of `T` has allocated: its buckets
/// (a power of two, 8/7 of the capacity past 8 entries) and one control byte each, plus a group.
pub(crate) fn table_bytes<T>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<T>() + 1) + 16
}

/// The hit rule of a non-primary KV-cache group (vLLM's single_type_kv_cache_manager).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupKind {
    Full,
    Window,
    State,
    Unknown,
}

impl GroupKind {
    /// The kind of an event's `kv_cache_spec_kind` (kvroute/_index.py `_group_kind`).
    pub fn of(kind: Option<&str>) -> GroupKind {
        match kind {
            None
            | Some(
                "full_attention"
                | "mla_attention"
                | "sink_full_attention"
                | "FullAttentionSpec"
                | "MLAAttentionSpec"
                | "SinkFullAttentionSpec",
            ) => GroupKind::Full,
            Some(
                "sliding_window"
                | "sliding_window_mla"
                | "SlidingWindowSpec"
                | "SlidingWindowMLASpec",
            ) => GroupKind::Window,
            Some("mamba" | "MambaSpec") => GroupKind::State,
            Some(_) => GroupKind::Unknown,
        }
    }

    /// The name snapshots store.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Full => "full",
            GroupKind::Window => "window",
            GroupKind::State => "state",
            GroupKind::Unknown => "unknown",
        }
    }

    /// The kind a snapshot names (None: not a kind).
    pub fn from_name(name: &str) -> Option<GroupKind> {
        match name {
            "full" => Some(GroupKind::Full),
            "window" => Some(GroupKind::Window),
            "state" => Some(GroupKind::State),
            "unknown" => Some(GroupKind::Unknown),
            _ => None,
        }
    }
}

/// A KV-cache group of a worker other than its primary full-attention group (`_Group`).
#[derive(Clone, Debug)]
pub(crate) struct Group {
    pub(crate) kind: GroupKind,
    pub(crate) window: Option<i64>,
    pub(crate) block_size: i64,
    /// engine hash -> (content key, None: held but never claimable; tier mask)
    pub(crate) blocks: EMap<(Option<Key>, u8)>,
    /// claimable content key -> engine hashes holding it
    pub(crate) held: FxHashMap<Key, u32>,
    /// engine hash -> GPU copies beyond the first
    pub(crate) copies: EMap<u32>,
}

impl Group {
    fn new(kind: GroupKind, window: Option<i64>, block_size: i64) -> Group {
        Group {
            kind,
            window,
            block_size,
            blocks: EMap::default(),
            held: FxHashMap::default(),
            copies: EMap::default(),
        }
    }
}

/// No content key: held, but never claimable (the Python index's `b""`).
pub(crate) const NOKEY: u32 = u32::MAX;

/// One worker's tables (`_Worker`); see kvroute/_index.py for what each one is for.
pub(crate) struct Worker<K> {
    pub(crate) key: K,
    pub(crate) slot: u32,
    /// creation order (the Python index's `_workers` dict order: snapshots list workers in it)
    pub(crate) created: u64,
    /// engine hash -> content key id (NOKEY: held, never claimable), primary group
    pub(crate) blocks: EMap<u32>,
    /// engine hash -> presence per tier [GPU, CPU, DISK, EXTERNAL]; absent = one GPU copy
    pub(crate) special: EMap<[i32; 4]>,
    /// content key id -> engine hashes present per tier, once two engine hashes map to one key
    pub(crate) multi: FxHashMap<u32, [i32; 4]>,
    /// engine hash -> GPU copies beyond the first, primary group
    pub(crate) copies: EMap<u32>,
    /// the last event was a primary store from block 0 naming blocks held on GPU: (tokens, hashes)
    pub(crate) pending: Option<(Vec<i64>, Vec<BlockHash>)>,
    pub(crate) classes: Vec<Class>,
    pub(crate) bs: i64,
    pub(crate) primary: Option<i64>,
    /// group_idx -> group, in the order groups were first seen
    pub(crate) groups: Vec<(i64, Group)>,
    pub(crate) lookahead: i64,
    pub(crate) hybrid: bool,
    /// SGLang with EAGLE: its stores came as bigram cells (`BlockStored::bigram`); query.rs caps it
    pub(crate) bigram: bool,
    pub(crate) warned: FxHashSet<&'static str>,
    /// the engine hashes of the last parentless primary store that named a block not held yet
    pub(crate) fresh_root: Vec<BlockHash>,
}

impl<K> Worker<K> {
    /// A new worker, boxed: the store path takes a worker out of its slot and puts it back on
    /// every event (`Index::take` / `put`), and its tables' headers are most of a kilobyte, which
    /// a box moves as one pointer (callgrind: ~200 instructions an event).
    fn new(key: K, slot: u32, created: u64) -> Box<Worker<K>> {
        Box::new(Worker {
            key,
            slot,
            created,
            blocks: EMap::default(),
            special: EMap::default(),
            multi: FxHashMap::default(),
            copies: EMap::default(),
            pending: None,
            classes: Vec::new(),
            bs: 0,
            primary: None,
            groups: Vec::new(),
            lookahead: 0,
            hybrid: false,
            bigram: false,
            warned: FxHashSet::default(),
            fresh_root: Vec::new(),
        })
    }

    pub(crate) fn holds_nothing(&self) -> bool {
        self.blocks.is_empty() && self.groups.iter().all(|(_, g)| g.blocks.is_empty())
    }

    pub(crate) fn entries(&self) -> usize {
        self.blocks.len()
            + self
                .groups
                .iter()
                .map(|(_, g)| g.blocks.len())
                .sum::<usize>()
    }

    /// Bytes this worker's tables have allocated (see `Index::memory_bytes`).
    fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let groups: usize = self
            .groups
            .iter()
            .map(|(_, g)| {
                g.blocks.memory_bytes()
                    + table_bytes::<(Key, u32)>(g.held.capacity())
                    + g.copies.memory_bytes()
            })
            .sum();
        let pending = self.pending.as_ref().map_or(0, |(t, h)| {
            t.capacity() * 8 + h.capacity() * size_of::<BlockHash>()
        });
        self.blocks.memory_bytes()
            + self.special.memory_bytes()
            + table_bytes::<(u32, [i32; 4])>(self.multi.capacity())
            + self.copies.memory_bytes()
            + pending
            + self.classes.capacity() * size_of::<Class>()
            + self.groups.capacity() * size_of::<(i64, Group)>()
            + groups
            + table_bytes::<&'static str>(self.warned.capacity())
            + self.fresh_root.capacity() * size_of::<BlockHash>()
    }

    pub(crate) fn group(&self, g: i64) -> Option<usize> {
        self.groups.iter().position(|(idx, _)| *idx == g)
    }
}

/// The namespace-root cache (adapter, salt) -> root key, bounded by `max_cached_roots`.
type RootCache = FxHashMap<(Option<String>, Option<String>), Key>;

/// The prefix index over workers named by `K`.
pub struct Index<K: WorkerName> {
    pub(crate) limits: Limits,
    /// workers by slot (None: a free slot)
    pub(crate) workers: Vec<Option<Box<Worker<K>>>>,
    pub(crate) by_key: FxHashMap<K, u32>,
    /// slots freed, reused last-in first-out (as the Python index reuses bits)
    pub(crate) free_slots: Vec<u32>,
    pub(crate) table: KeyTable,
    /// class -> member slots (sorted), in the order classes first came into use
    pub(crate) bs_members: Vec<(Class, Vec<u32>)>,
    pub(crate) hybrid_workers: usize,
    /// workers marked `bigram` (0: queries skip the bigram cap)
    pub(crate) bigram_workers: usize,
    /// workers created so far (each worker's `created`)
    pub(crate) created: u64,
    roots: Mutex<RootCache>,
    uncached_roots: AtomicU64,
    pub(crate) entries: u64,
    pub(crate) unknown_parent: u64,
    pub(crate) unhashable: u64,
    pub(crate) unknown_removals: u64,
    pub(crate) ignored_group: u64,
    pub(crate) remote: u64,
    pub(crate) repeated: u64,
    pub(crate) refused_bs: u64,
    pub(crate) refused_entries: u64,
    /// warnings to log (drained by the caller: the core never logs itself)
    pub(crate) logs: Vec<String>,
    /// buffers a store reuses (keys, ids, holder flags), so the hot path allocates nothing
    pub(crate) scratch: Scratch,
    /// Whether the engines may publish reuse reports (store.rs's reuse-report rule).
    pub(crate) reuse_reports: bool,
}

/// Per-store working buffers, kept between stores (their capacity is the largest store's).
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) keys: Vec<Key>,
    /// each block's `EMap::slot_hash` (store.rs: computed once, to prefetch then insert)
    pub(crate) slot_hashes: Vec<u64>,
    pub(crate) ids: Vec<u32>,
    /// per block: `store.rs`'s `FRESH_KEY`, `UNHELD_KEY` or `HELD_KEY`
    pub(crate) held: Vec<u8>,
}

impl<K: WorkerName> Index<K> {
    /// An empty index with `limits`.
    pub fn new(limits: Limits) -> Index<K> {
        Index {
            limits,
            workers: Vec::new(),
            by_key: FxHashMap::default(),
            free_slots: Vec::new(),
            table: KeyTable::default(),
            bs_members: Vec::new(),
            hybrid_workers: 0,
            bigram_workers: 0,
            created: 0,
            roots: Mutex::new(FxHashMap::default()),
            uncached_roots: AtomicU64::new(0),
            entries: 0,
            unknown_parent: 0,
            unhashable: 0,
            unknown_removals: 0,
            ignored_group: 0,
            remote: 0,
            repeated: 0,
            refused_bs: 0,
            refused_entries: 0,
            logs: Vec::new(),
            scratch: Scratch::default(),
            reuse_reports: true,
        }
    }

    /// Say whether the engines may publish reuse reports (vLLM's `kv_cache_report_mode "full"`).
    /// True (the default): a repeat store from block 0 counts once. False: every store is a new
    /// engine cache entry, so a repeat from block 0 is one more GPU copy (store.rs).
    pub fn set_reuse_reports(&mut self, on: bool) {
        self.reuse_reports = on;
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Warnings since the last call (refusals, once per worker and kind), for the caller to log.
    pub fn take_logs(&mut self) -> Vec<String> {
        std::mem::take(&mut self.logs)
    }

    pub(crate) fn worker(&self, key: &K) -> Option<&Worker<K>> {
        self.by_key
            .get(key)
            .and_then(|&s| self.workers[s as usize].as_deref())
    }

    /// Workers that hold at least one block.
    pub fn workers(&self) -> Vec<K> {
        self.workers
            .iter()
            .flatten()
            .filter(|w| !w.holds_nothing())
            .map(|w| w.key.clone())
            .collect()
    }

    /// Blocks held by `worker` (every KV-cache group), or (block, worker) entries over all workers.
    pub fn num_blocks(&self, worker: Option<&K>) -> u64 {
        match worker {
            None => self.entries,
            Some(k) => self.worker(k).map_or(0, |w| w.entries() as u64),
        }
    }

    /// The largest block size `worker`'s events use (None when it has none).
    pub fn block_size(&self, worker: &K) -> Option<i64> {
        self.worker(worker).map(|w| w.bs).filter(|&bs| bs != 0)
    }

    /// The (block size, lookahead) classes `worker` stores under.
    pub fn classes_of(&self, worker: &K) -> Vec<Class> {
        self.worker(worker)
            .map_or_else(Vec::new, |w| w.classes.clone())
    }

    /// The index's size and counters.
    pub fn stats(&self) -> Stats {
        Stats {
            workers: self
                .workers
                .iter()
                .flatten()
                .filter(|w| !w.holds_nothing())
                .count() as u64,
            entries: self.entries,
            distinct_keys: self.table.holder_keys() as u64,
            unknown_parent_blocks: self.unknown_parent,
            unhashable_blocks: self.unhashable,
            unknown_removals: self.unknown_removals,
            ignored_group_events: self.ignored_group,
            remote_blocks: self.remote,
            repeated_stores: self.repeated,
            refused_block_sizes: self.refused_bs,
            refused_entries: self.refused_entries,
            uncached_roots: self.uncached_roots.load(Ordering::Relaxed),
        }
    }

    /// Bytes the index's tables have allocated, from their capacities (the shared key table, each
    /// worker's maps, the root cache): an honest figure for "how much memory is the index", which
    /// Python's `sys.getsizeof` cannot see. Heap bookkeeping and allocator slack are not included.
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let workers: usize = self
            .workers
            .iter()
            .flatten()
            .map(|w| w.memory_bytes())
            .sum();
        let members: usize = self.bs_members.iter().map(|(_, m)| m.capacity() * 4).sum();
        let roots = self.roots.lock();
        let root_strings: usize = roots
            .keys()
            .map(|(l, s)| {
                l.as_ref().map_or(0, String::capacity) + s.as_ref().map_or(0, String::capacity)
            })
            .sum();
        size_of::<Self>()
            + self.table.memory_bytes()
            + workers
            + self.workers.capacity() * size_of::<Option<Worker<K>>>()
            + table_bytes::<(K, u32)>(self.by_key.capacity())
            + self.free_slots.capacity() * 4
            + self.bs_members.capacity() * size_of::<(Class, Vec<u32>)>()
            + members
            + table_bytes::<((Option<String>, Option<String>), Key)>(roots.capacity())
            + root_strings
            + self.scratch.keys.capacity() * size_of::<Key>()
            + self.scratch.ids.capacity() * 4
            + self.scratch.held.capacity()
    }

    /// The root key of a namespace, through the bounded cache (`_root`). Safe under a read lock.
    pub(crate) fn root(&self, lora: Option<&str>, salt: Option<&str>) -> Key {
        let lora = lora.filter(|s| !s.is_empty());
        let salt = salt.filter(|s| !s.is_empty());
        if lora.is_none() && salt.is_none() {
            // The base root is the common case: no cache entry needed beyond the first.
            let mut roots = self.roots.lock();
            if let Some(r) = roots.get(&(None, None)) {
                return *r;
            }
            let r = crate::keys::root_key(None, None);
            if roots.len() < self.limits.max_cached_roots {
                roots.insert((None, None), r);
            } else {
                self.uncached_roots.fetch_add(1, Ordering::Relaxed);
            }
            return r;
        }
        let ns = (lora.map(str::to_owned), salt.map(str::to_owned));
        let mut roots = self.roots.lock();
        if let Some(r) = roots.get(&ns) {
            return *r;
        }
        let r = crate::keys::root_key(lora, salt);
        if roots.len() < self.limits.max_cached_roots {
            roots.insert(ns, r);
        } else {
            self.uncached_roots.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Introspection for tests: the contents of the tables the Python index kept.
    pub fn tables(&self) -> Tables<K> {
        let mut flagged: [Vec<Key>; 5] = Default::default();
        for (key, flags) in self.table.keys_with_flags() {
            for (i, v) in flagged.iter_mut().enumerate() {
                if flags & (1 << i) != 0 {
                    v.push(key);
                }
            }
        }
        Tables {
            flagged,
            classes: self.bs_members.clone(),
            workers: self
                .workers
                .iter()
                .flatten()
                .map(|w| (w.key.clone(), w.slot))
                .collect(),
            roots: self.roots.lock().keys().cloned().collect(),
        }
    }
}

#[cfg(test)]
impl<K: WorkerName> Index<K> {
    fn table_sizes_for_tests(&self) -> [usize; 5] {
        self.table.flag_key_counts()
    }
}

/// The tier position of an engine's `medium` (`normalize_medium`: nil = GPU, unknown = EXTERNAL).
pub fn tier_pos(medium: Option<&str>) -> usize {
    fn alias(m: &str) -> Option<usize> {
        match m {
            "GPU" => Some(0),
            "CPU" | "CPU_PINNED" => Some(1),
            "DISK" | "STORAGE" => Some(2),
            "EXTERNAL" => Some(3),
            _ => None,
        }
    }
    match medium {
        None => 0,
        Some(m) => alias(m)
            .or_else(|| {
                if m.is_empty() {
                    Some(0)
                } else {
                    alias(&m.to_uppercase())
                }
            })
            .unwrap_or(3),
    }
}

/// The tier mask of per-tier counts (`_mask`).
pub(crate) fn mask_of(c: &[i32; 4]) -> u8 {
    u8::from(c[0] > 0) | u8::from(c[1] > 0) << 1 | u8::from(c[2] > 0) << 2 | u8::from(c[3] > 0) << 3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::{Batch, BlockRemoved, BlockStored, Event};

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct W(&'static str);

    impl WorkerName for W {
        fn label(&self) -> String {
            format!("{}/0", self.0)
        }
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[i64], bs: i64) -> Event {
        Event::Stored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: bs,
            ..BlockStored::default()
        }))
    }

    fn matches(idx: &Index<W>, tokens: &[u32]) -> Vec<(&'static str, i64)> {
        let mut q = idx.query(QueryInput {
            tokens: tokens.to_vec(),
            ..QueryInput::default()
        });
        idx.find_matches(&mut q)
            .scores
            .iter()
            .map(|s| (s.worker.0, s.blocks))
            .collect()
    }

    #[test]
    fn a_batch_is_applied_and_counted() {
        let mut idx: Index<W> = Index::new(Limits::default());
        let batch = Batch {
            events: vec![
                stored(&[1, 2], None, &[1, 2, 3, 4], 2),
                stored(&[3], Some(2), &[5, 6], 2),
                Event::Removed(BlockRemoved {
                    block_hashes: smallvec::smallvec![BlockHash::Int(3)],
                    ..BlockRemoved::default()
                }),
            ],
            ..Batch::default()
        };
        let counts = idx.apply_batch(&W("a"), &batch);
        assert_eq!(
            counts,
            ApplyCounts {
                stored_blocks: 3,
                removed_blocks: 1,
                events: 3
            }
        );
        assert_eq!(matches(&idx, &[1, 2, 3, 4, 5, 6]), vec![("a", 2)]);
        assert_eq!(idx.stats().entries, 2);
    }

    #[test]
    fn the_longest_prefix_wins_and_a_cleared_worker_leaves_no_residue() {
        let mut idx: Index<W> = Index::new(Limits::default());
        idx.apply(&W("a"), &stored(&[1, 2], None, &[1, 2, 3, 4], 2));
        idx.apply(&W("b"), &stored(&[7], None, &[1, 2], 2));
        assert_eq!(matches(&idx, &[1, 2, 3, 4, 5]), vec![("b", 1), ("a", 2)]);
        idx.apply(&W("a"), &Event::Cleared);
        idx.remove_worker(&W("b"));
        assert_eq!(matches(&idx, &[1, 2, 3, 4, 5]), vec![]);
        assert_eq!(idx.table_sizes_for_tests(), [0; 5]);
        assert!(idx.workers().is_empty() && idx.bs_members.is_empty());
    }

    #[test]
    fn a_whole_aligned_prompt_is_served_one_block_short() {
        let mut idx: Index<W> = Index::new(Limits::default());
        idx.apply(&W("a"), &stored(&[1, 2], None, &[1, 2, 3, 4], 2));
        assert_eq!(matches(&idx, &[1, 2, 3, 4]), vec![("a", 1)]);
        assert_eq!(matches(&idx, &[1, 2, 3]), vec![("a", 1)]);
        assert_eq!(matches(&idx, &[1, 2]), vec![]);
    }

    #[test]
    fn without_reuse_reports_a_repeat_from_block_0_is_a_copy() {
        for (reports, left) in [(true, vec![]), (false, vec![("a", 2)])] {
            let mut idx: Index<W> = Index::new(Limits::default());
            idx.set_reuse_reports(reports);
            let store = stored(&[1, 2], None, &[1, 2, 3, 4], 2);
            idx.apply(&W("a"), &store);
            idx.apply(&W("a"), &store);
            idx.apply(
                &W("a"),
                &Event::Removed(BlockRemoved {
                    block_hashes: smallvec::smallvec![BlockHash::Int(1), BlockHash::Int(2)],
                    ..BlockRemoved::default()
                }),
            );
            assert_eq!(matches(&idx, &[1, 2, 3, 4, 5]), left, "reports {reports}");
        }
    }

    #[test]
    fn engine_hashes_differing_only_in_high_bits_spread_over_the_slots() {
        // With FxHash's homes every one of these shared one home: a probe as long as the map.
        let mut m: IntMap<u32> = IntMap::default();
        for i in 0..20_000u64 {
            m.entry(i << 40, i as u32);
        }
        let cap = m.slots.len();
        let longest = m
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.0.get() != EMPTY_HASH)
            .map(|(at, s)| (at + cap - m.home(s.0.get())) % cap)
            .max()
            .unwrap();
        assert!(longest < 1_000, "longest probe {longest} of {cap} slots");
    }

    /// A growth moves a worker table's entries a few runs at a time (`OldSlots`): throughout
    /// one, every entry is found, updated and removed in whichever slots hold it, and listed
    /// once. Checked after every step against std's HashMap.
    #[test]
    fn an_engine_hash_map_is_a_map_while_a_growth_moves_it() {
        let mut m: IntMap<u32> = IntMap::default();
        let mut model: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
        let mut keys: Vec<u64> = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let (mut growths, mut gone_old, mut set_old) = (0, 0, 0);
        for step in 0..30_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let was = m.old.is_some();
            let in_old = |m: &IntMap<u32>, k: u64| m.old_slot(k, hash_u64(k)).is_some();
            if x % 5 < 3 || keys.is_empty() {
                // A new hash (some share a home: their low bits are all that differs), or one
                // held already (found wherever it is, even as a growth begins).
                let k = match x % 11 {
                    0 if !keys.is_empty() => keys[(x >> 24) as usize % keys.len()],
                    1..=2 => (x >> 20) << 20 | u64::from(step % 64),
                    _ => x >> 1,
                };
                let fresh = model.insert(k, step).is_none();
                if fresh {
                    keys.push(k);
                }
                let (at, inserted) = m.entry(k, step);
                *at = step;
                assert_eq!(inserted, fresh, "step {step}");
            } else {
                let at = (x >> 32) as usize % keys.len();
                let k = keys[at];
                if x % 5 == 3 {
                    gone_old += usize::from(in_old(&m, k));
                    assert_eq!(m.remove(k), model.remove(&k), "step {step}");
                    keys.swap_remove(at);
                } else {
                    set_old += usize::from(in_old(&m, k));
                    *m.get_mut(k).expect("held") = step;
                    model.insert(k, step);
                }
            }
            growths += usize::from(!was && m.old.is_some());
            assert_eq!(m.len(), model.len(), "step {step}");
            for j in 0..keys.len().min(4) {
                let k = keys[(x as usize >> (8 * j)) % keys.len()];
                assert_eq!(m.get(k), model.get(&k), "step {step}");
            }
            if step % 1_000 == 0 || (m.old.is_some() && step % 50 == 0) || (was && m.old.is_none())
            {
                let mut got: Vec<(u64, u32)> = m.iter().map(|(k, &v)| (k, v)).collect();
                got.sort_unstable();
                let mut want: Vec<(u64, u32)> = model.iter().map(|(&k, &v)| (k, v)).collect();
                want.sort_unstable();
                assert_eq!(got, want, "step {step}");
            }
        }
        assert!(growths >= 4, "{growths} growths moved entries");
        assert!(
            gone_old > 0 && set_old > 0,
            "{gone_old} removed, {set_old} set in old slots"
        );
        for (&k, v) in &model {
            assert_eq!(m.get(k), Some(v));
        }
    }

    /// The insert that begins a growth may be of a hash held already: every entry is in the
    /// old slots then, and it is found there, not inserted a second time.
    #[test]
    fn a_held_hash_is_found_by_the_insert_that_begins_a_growth() {
        let mut m: IntMap<u32> = IntMap::default();
        let key = |n: u64| n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut n = 0u64;
        while m.old.is_some() || m.held() < MOVE_FROM || m.held() < int_map_load(m.slots.len()) {
            m.entry(key(n), 1);
            n += 1;
        }
        let (v, inserted) = m.entry(key(n / 2), 2);
        assert_eq!((*v, inserted), (1, false));
        assert!(m.old.is_some(), "the insert began a growth");
        assert_eq!(m.len(), n as usize);
        assert_eq!(m.iter().count(), n as usize);
    }

    /// Removals alone move a growth under way on, to its end (a worker that only evicts).
    #[test]
    fn removals_alone_end_a_growth() {
        let mut m: IntMap<u32> = IntMap::default();
        let key = |n: u64| n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut n = 0u64;
        while m.old.is_none() || n < 2 * MOVE_FROM as u64 {
            m.entry(key(n), n as u32);
            n += 1;
        }
        assert!(m.old.is_some(), "a growth under way");
        let mut gone = 0u64;
        while m.old.is_some() {
            assert_eq!(m.remove(key(gone)), Some(gone as u32));
            gone += 1;
        }
        assert!(
            gone < n,
            "the growth ended with {} of {n} entries left",
            n - gone
        );
        for i in gone..n {
            assert_eq!(m.get(key(i)), Some(&(i as u32)));
        }
    }

    #[test]
    fn an_engine_hash_map_is_a_map_through_churn() {
        // Random inserts, overwrites, refused inserts and removals against std's HashMap.
        let mut m: EMap<u32> = EMap::default();
        let mut model: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // u64::MAX is the slots' empty marker, kept beside them.
            let k = if x % 4096 == 7 { u64::MAX } else { x % 4096 };
            let h = BlockHash::Int(k);
            match step % 4 {
                0 => assert_eq!(m.insert(&h, step), model.insert(k, step)),
                1 => {
                    let fresh = !model.contains_key(&k);
                    assert_eq!(m.try_insert(&h, step).is_ok(), fresh);
                    model.entry(k).or_insert(step);
                }
                2 => assert_eq!(m.remove(&h), model.remove(&k)),
                _ => assert_eq!(m.get(&h), model.get(&k)),
            }
            assert_eq!(m.len(), model.len());
        }
        let mut got: Vec<(u64, u32)> = m
            .iter()
            .map(|(h, &v)| match h {
                BlockHash::Int(i) => (i, v),
                BlockHash::Bytes(_) => unreachable!("ints only"),
            })
            .collect();
        got.sort_unstable();
        let mut want: Vec<(u64, u32)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(got, want);
    }

    /// Past `FAR_TABLE_BYTES` of slots the store path prefetches with the slot hashes it took
    /// before the inserts; the table grows under those inserts, so the hashes must be the
    /// ones every other lookup uses (the empty marker, stored as a real hash, included).
    #[test]
    fn a_worker_past_the_prefetch_threshold_stores_and_finds_every_block() {
        let mut idx: Index<W> = Index::new(Limits::default());
        let (bs, per, events) = (2i64, 512u64, 120u64); // 61,440 blocks: > 512 KB of 12-byte slots
        let mut prev: Option<u64> = None;
        for e in 0..events {
            let hashes: Vec<u64> = (0..per)
                .map(|i| match e * per + i {
                    7 => u64::MAX, // the slots' empty marker, as an engine hash
                    n => n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                })
                .collect();
            let tokens: Vec<i64> = (0..per as i64 * bs)
                .map(|t| t + (e * per) as i64 * bs)
                .collect();
            idx.apply(&W("a"), &stored(&hashes, prev, &tokens, bs));
            prev = hashes.last().copied();
        }
        assert_eq!(idx.num_blocks(Some(&W("a"))), events * per);
        let slot = idx.by_key[&W("a")];
        let w = idx.workers[slot as usize].as_ref().expect("live worker");
        assert!(w.blocks.slot_bytes() > super::store::FAR_TABLE_BYTES);
        for n in [0, 7, 8, 30_000, events * per - 1] {
            let h = if n == 7 {
                u64::MAX
            } else {
                n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
            };
            assert!(w.blocks.contains(&BlockHash::Int(h)), "block {n}");
        }
        // The chain matches through the first 10,000 blocks (a prompt of 20,001 tokens: the
        // last token is never served from cache).
        let prompt: Vec<u32> = (0..20_001).collect();
        assert_eq!(matches(&idx, &prompt), vec![("a", 10_000)]);
    }

    /// Past `FAR_TABLE_BYTES` a batch's removals are prefetched a link or two ahead
    /// (`prefetch_removals_ahead`): only hints, so a batch applies exactly as its events one by
    /// one do, whatever the removals name (held, unknown, removed earlier in the batch, another
    /// tier's, several hashes).
    #[test]
    fn a_far_worker_applies_a_batch_of_removals_as_its_events_one_by_one() {
        let h = |n: u64| n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let removal = |ns: &[u64], medium: &'static str| {
            Event::Removed(BlockRemoved {
                block_hashes: ns.iter().map(|&n| BlockHash::Int(h(n))).collect(),
                medium: Some(std::borrow::Cow::Borrowed(medium)),
                ..BlockRemoved::default()
            })
        };
        let (per, events) = (512u64, 100u64); // 51,200 blocks: > 512 KB of 12-byte slots
        let fill: Vec<Event> = (0..events)
            .map(|e| {
                let hashes: Vec<u64> = (e * per..(e + 1) * per).map(h).collect();
                let tokens: Vec<i64> = (0..per as i64).map(|t| t + (e * per) as i64).collect();
                stored(
                    &hashes,
                    e.checked_sub(1).map(|p| h((p + 1) * per - 1)),
                    &tokens,
                    1,
                )
            })
            .collect();
        let batch = Batch {
            events: vec![
                removal(&[40_000], "GPU"),
                removal(&[40_001], "GPU"),
                removal(&[40_000], "GPU"),     // removed two events before
                removal(&[99_999_999], "GPU"), // never stored
                removal(&[40_003, 40_004], "GPU"),
                removal(&[40_005], "CPU"), // another tier's: an unknown removal
                stored(&[h(40_001)], Some(h(39_999)), &[40_000], 1),
                removal(&[40_001], "GPU"), // stored again just before
                removal(&[45_000], "GPU"),
                removal(&[51_199], "GPU"),
            ],
            ..Batch::default()
        };
        let (mut whole, mut each): (Index<W>, Index<W>) =
            (Index::new(Limits::default()), Index::new(Limits::default()));
        for ev in &fill {
            whole.apply(&W("a"), ev);
            each.apply(&W("a"), ev);
        }
        let slot = whole.by_key[&W("a")];
        let w = whole.workers[slot as usize].as_ref().expect("live worker");
        assert!(w.blocks.slot_bytes() > super::store::FAR_TABLE_BYTES);
        whole.apply_batch(&W("a"), &batch);
        for ev in &batch.events {
            each.apply(&W("a"), ev);
        }
        assert_eq!(whole.stats(), each.stats());
        assert_eq!(whole.stats().unknown_removals, 3);
        assert_eq!(whole.num_blocks(Some(&W("a"))), events * per - 6);
        let prompt: Vec<u32> = (0..45_000).collect();
        assert_eq!(matches(&whole, &prompt), matches(&each, &prompt));
        // (block n holds token n: the chain breaks at block 40,000)
        assert_eq!(matches(&whole, &prompt), vec![("a", 40_000)]);
    }

    #[test]
    fn an_unknown_parent_is_held_but_never_claimed() {
        let mut idx: Index<W> = Index::new(Limits::default());
        idx.apply(&W("a"), &stored(&[5], Some(99), &[3, 4], 2));
        assert_eq!(idx.num_blocks(Some(&W("a"))), 1);
        assert_eq!(idx.stats().unknown_parent_blocks, 1);
        assert_eq!(matches(&idx, &[3, 4]), vec![]);
    }
}
