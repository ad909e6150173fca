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

use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::Mutex;
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use crate::keys::Key;
use crate::protocols::BlockHash;

pub use query::{MatchResult, Query, QueryInput, Score};
pub use snapshot::{
    read as read_snapshot, SnapFile, SnapGroup, SnapKey, SnapReadError, SnapWorker,
};
pub(crate) use table::prefetch;
use table::KeyTable;

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

#[inline]
fn hash_u64(h: u64) -> u64 {
    FxBuildHasher.hash_one(h)
}

/// Shards a growing table is split into (`Sharded`).
const SHARDS: usize = 4;

/// Where each shard past the first starts, in bits 24..56 of a hash (bits hashbrown uses for
/// neither the bucket index of a table below 2^24 buckets nor its 7-bit tag): the shards take
/// slices of the hash space in proportion 1 : 2^(1/4) : 2^(1/2) : 2^(3/4).
const SHARD_START: [u32; SHARDS - 1] = [812_638_371, 1_779_033_704, 2_928_277_910];

#[inline]
fn shard_of(h: u64) -> usize {
    let t = (h >> 24) as u32;
    usize::from(t >= SHARD_START[0])
        + usize::from(t >= SHARD_START[1])
        + usize::from(t >= SHARD_START[2])
}

/// A hashbrown table split into `SHARDS` tables by hash value, for memory. A hashbrown table
/// doubles when it reaches 7/8 load, so one table holding n entries spends between 8/7 and 16/7
/// buckets per entry, by where n falls between two powers of two: a worker's map or the key
/// index just past a doubling costs twice the buckets it needs, and the doubling itself holds
/// the old and the new buckets at once. Shards with unequal slices of the hash space double at
/// four different sizes of the whole, a quarter of it at a time: the worst case over n drops
/// from 16/7 to about 13/7 buckets per entry (the mean stays ~1.65), a doubling's transient is
/// a shard's, and a lookup still probes one table (the shard costs two compares to pick).
pub(crate) struct Sharded<T> {
    shards: [HashTable<T>; SHARDS],
}

impl<T> Default for Sharded<T> {
    fn default() -> Self {
        Sharded {
            shards: std::array::from_fn(|_| HashTable::new()),
        }
    }
}

impl<T: Clone> Clone for Sharded<T> {
    fn clone(&self) -> Self {
        Sharded {
            shards: self.shards.clone(),
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Sharded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T> Sharded<T> {
    #[inline]
    pub(crate) fn find(&self, h: u64, eq: impl FnMut(&T) -> bool) -> Option<&T> {
        self.shards[shard_of(h)].find(h, eq)
    }

    #[inline]
    pub(crate) fn find_mut(&mut self, h: u64, eq: impl FnMut(&T) -> bool) -> Option<&mut T> {
        self.shards[shard_of(h)].find_mut(h, eq)
    }

    /// The entry for hash `h` (`hasher` rehashes the shard's entries if it grows).
    #[inline]
    pub(crate) fn entry(
        &mut self,
        h: u64,
        eq: impl FnMut(&T) -> bool,
        hasher: impl Fn(&T) -> u64,
    ) -> hashbrown::hash_table::Entry<'_, T> {
        self.shards[shard_of(h)].entry(h, eq, hasher)
    }

    /// Remove and return the entry for hash `h` that `eq` picks.
    #[inline]
    pub(crate) fn remove(&mut self, h: u64, eq: impl FnMut(&T) -> bool) -> Option<T> {
        self.shards[shard_of(h)]
            .find_entry(h, eq)
            .ok()
            .map(|o| o.remove().0)
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(HashTable::len).sum()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.shards.iter().all(HashTable::is_empty)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.shards.iter().flat_map(HashTable::iter)
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.shards.iter_mut().flat_map(HashTable::iter_mut)
    }

    /// Room for the entries hashed `hashes` (each shard reserves exactly its own share).
    pub(crate) fn reserve_hashes(
        &mut self,
        hashes: impl Iterator<Item = u64>,
        hasher: impl Fn(&T) -> u64,
    ) {
        let mut n = [0usize; SHARDS];
        for h in hashes {
            n[shard_of(h)] += 1;
        }
        for (s, k) in self.shards.iter_mut().zip(n) {
            s.reserve(k, &hasher);
        }
    }

    /// Bytes the shards have allocated (see `table_bytes`).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| table_bytes::<T>(s.capacity()))
            .sum()
    }
}

/// A map keyed by engine block hashes, ints and bytes apart (a uint64 stays 8 bytes, packed).
#[derive(Clone, Debug)]
pub(crate) struct EMap<V> {
    ints: Sharded<(H64, V)>,
    bytes: FxHashMap<Box<[u8]>, V>,
}

impl<V> Default for EMap<V> {
    fn default() -> Self {
        EMap {
            ints: Sharded::default(),
            bytes: FxHashMap::default(),
        }
    }
}

impl<V> EMap<V> {
    #[inline]
    pub(crate) fn get(&self, h: &BlockHash) -> Option<&V> {
        match h {
            BlockHash::Int(i) => self
                .ints
                .find(hash_u64(*i), |e| e.0.get() == *i)
                .map(|e| &e.1),
            BlockHash::Bytes(b) => self.bytes.get(b.as_slice()),
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, h: &BlockHash) -> Option<&mut V> {
        match h {
            BlockHash::Int(i) => self
                .ints
                .find_mut(hash_u64(*i), |e| e.0.get() == *i)
                .map(|e| &mut e.1),
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
            BlockHash::Int(i) => {
                match self
                    .ints
                    .entry(hash_u64(*i), |e| e.0.get() == *i, |e| hash_u64(e.0.get()))
                {
                    hashbrown::hash_table::Entry::Occupied(mut o) => {
                        Some(std::mem::replace(&mut o.get_mut().1, v))
                    }
                    hashbrown::hash_table::Entry::Vacant(slot) => {
                        slot.insert((H64::new(*i), v));
                        None
                    }
                }
            }
            BlockHash::Bytes(b) => self.bytes.insert(b.clone().into_boxed_slice(), v),
        }
    }

    /// Insert `v` under `h` unless `h` is there already: Ok when inserted, Err (`v` back) when
    /// not (the store path's one probe: present or not, and the insert, in one lookup).
    #[inline]
    pub(crate) fn try_insert(&mut self, h: &BlockHash, v: V) -> Result<(), V> {
        match h {
            BlockHash::Int(i) => {
                match self
                    .ints
                    .entry(hash_u64(*i), |e| e.0.get() == *i, |e| hash_u64(e.0.get()))
                {
                    hashbrown::hash_table::Entry::Occupied(_) => Err(v),
                    hashbrown::hash_table::Entry::Vacant(slot) => {
                        slot.insert((H64::new(*i), v));
                        Ok(())
                    }
                }
            }
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
            BlockHash::Int(i) => self
                .ints
                .remove(hash_u64(*i), |e| e.0.get() == *i)
                .map(|e| e.1),
            BlockHash::Bytes(b) => self.bytes.remove(b.as_slice()),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.ints.len() + self.bytes.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ints.is_empty() && self.bytes.is_empty()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.ints.iter().map(|e| &e.1).chain(self.bytes.values())
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.ints
            .iter_mut()
            .map(|e| &mut e.1)
            .chain(self.bytes.values_mut())
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, &V)> {
        self.ints
            .iter()
            .map(|e| (BlockHash::Int(e.0.get()), &e.1))
            .chain(
                self.bytes
                    .iter()
                    .map(|(k, v)| (BlockHash::Bytes(k.to_vec()), v)),
            )
    }

    /// Room for `hashes` (a restore, which knows every hash a worker's table will hold).
    pub(crate) fn reserve_for(&mut self, hashes: &[BlockHash]) {
        let ints = hashes.iter().filter_map(|h| match h {
            BlockHash::Int(i) => Some(hash_u64(*i)),
            BlockHash::Bytes(_) => None,
        });
        self.ints.reserve_hashes(ints, |e| hash_u64(e.0.get()));
    }

    /// Bytes the map has allocated (buckets and control bytes; a bytes key's own allocation too).
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
    pub(crate) ids: Vec<u32>,
    pub(crate) held: Vec<bool>,
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
                    block_hashes: vec![BlockHash::Int(3)],
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
                    block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
                    ..BlockRemoved::default()
                }),
            );
            assert_eq!(matches(&idx, &[1, 2, 3, 4, 5]), left, "reports {reports}");
        }
    }

    #[test]
    fn an_engine_hash_map_is_a_map_across_its_shards() {
        // Random inserts, overwrites, refused inserts and removals against std's HashMap.
        let mut m: EMap<u32> = EMap::default();
        let mut model: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let h = BlockHash::Int(x % 4096);
            let k = x % 4096;
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

    #[test]
    fn the_shards_take_unequal_slices_and_reserve_their_own_share() {
        let mut t: Sharded<u64> = Sharded::default();
        let hashes: Vec<u64> = (0..40_000u64).map(hash_u64).collect();
        t.reserve_hashes(hashes.iter().copied(), |&h| h);
        let room: Vec<usize> = t.shards.iter().map(HashTable::capacity).collect();
        for &h in &hashes {
            match t.entry(h, |&e| e == h, |&e| e) {
                hashbrown::hash_table::Entry::Vacant(v) => {
                    v.insert(h);
                }
                hashbrown::hash_table::Entry::Occupied(_) => panic!("distinct hashes"),
            }
        }
        let sizes: Vec<usize> = t.shards.iter().map(HashTable::len).collect();
        // In proportion 1 : 2^(1/4) : 2^(1/2) : 2^(3/4) of 40,000 (about 7.6k, 9.0k, 10.7k, 12.7k).
        let want = [7_568.0, 9_000.0, 10_703.0, 12_728.0];
        for (n, w) in sizes.iter().zip(want) {
            assert!((*n as f64 - w).abs() < 0.05 * w, "{sizes:?}");
        }
        // Reserved exactly: no shard grew while it filled.
        let after: Vec<usize> = t.shards.iter().map(HashTable::capacity).collect();
        assert_eq!(room, after);
        assert_eq!(t.len(), 40_000);
        assert_eq!(t.remove(hashes[7], |&e| e == hashes[7]), Some(hashes[7]));
        assert!(t.find(hashes[7], |&e| e == hashes[7]).is_none());
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
