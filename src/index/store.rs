//! Applying events: stores (primary and other KV-cache groups, copies, placeholders, limits),
//! removals, clears and worker removal. kvroute/_index.py's `_store`, `_store_one`,
//! `_store_group`, `_remove`, `_remove_group`, `_clear`, rule for rule; the comments there say why
//! each rule is what it is.

use rustc_hash::{FxHashMap, FxHashSet};

use super::table::{tier_flag, G, H};
use super::{
    mask_of, tier_pos, ApplyCounts, Class, EMap, Group, GroupKind, Index, Worker, WorkerName, NOKEY,
};
use crate::keys::{self, Key};
use crate::protocols::{Batch, BlockHash, BlockRemoved, BlockStored, Event, Value};

/// A worker's engine-hash table past this many bytes of slots has its slots prefetched on the
/// store path (half of this machine's 1 MB L2 per core: a smaller one is mostly in cache).
pub(crate) const FAR_TABLE_BYTES: usize = 512 << 10;

/// Most engine-hash slots `prefetch_batch` requests for one batch (about the misses a core
/// keeps in flight, a few times over).
const BATCH_PREFETCH: usize = 64;

/// How many events ahead of a removal its key's record is prefetched, and its id-index slot
/// (`prefetch_removals_ahead`), and how many of each removal's hashes (vLLM sends one a removal).
const RECORD_AHEAD: usize = 4;
const KEY_SLOT_AHEAD: usize = 2;
const AHEAD_HASHES: usize = 2;

/// `Scratch::held` in `store_fresh`: a key interned by the store itself (no holder at all)...
const FRESH_KEY: u8 = 0;
/// ...a key interned before that the worker does not hold...
const UNHELD_KEY: u8 = 1;
/// ...and one it holds already (under another engine hash).
const HELD_KEY: u8 = 2;

/// An event's per-block extras, encoded (None: a block without extras).
pub(crate) type Extras = Vec<Option<Vec<u8>>>;

/// The adapter, salt and encoded per-block extras of a store (`_namespaces`); Err when an extra
/// cannot be encoded (an integer outside 64 bits): its blocks are unhashable.
pub(crate) struct Namespaces {
    pub(crate) lora: Option<String>,
    pub(crate) salt: Option<String>,
    pub(crate) extras: Result<Option<Extras>, keys::Unencodable>,
}

fn namespaces(ev: &BlockStored) -> Namespaces {
    let lora = ev.lora_name.clone().filter(|s| !s.is_empty());
    let mut salt = match &ev.cache_salt {
        Value::Str(s) if !s.is_empty() => Some(s.clone()),
        _ => None,
    };
    let Some(extras) = &ev.extra_keys else {
        return Namespaces {
            lora,
            salt,
            extras: Ok(None),
        };
    };
    let mut out: Vec<Option<Vec<Value>>> = Vec::with_capacity(extras.len());
    let mut found = false;
    for (i, ek) in extras.iter().enumerate() {
        let Some(ek) = ek.as_ref().filter(|e| !e.is_empty()) else {
            out.push(None);
            continue;
        };
        let mut ks: Vec<Value> = ek.clone();
        if let (Some(l), Some(Value::Str(first))) = (&lora, ks.first()) {
            if first == l {
                ks.remove(0);
            }
        }
        if i == 0 && ev.parent_block_hash.is_none() {
            let strs: Vec<&String> = ks
                .iter()
                .filter_map(|k| match k {
                    Value::Str(s) => Some(s),
                    _ => None,
                })
                .collect();
            if strs.len() == 1 && salt.as_ref().is_none_or(|s| s == strs[0]) {
                salt = Some(strs[0].clone());
                ks.retain(|k| !matches!(k, Value::Str(_)));
            }
        }
        if ks.is_empty() {
            out.push(None);
        } else {
            found = true;
            out.push(Some(ks));
        }
    }
    let extras = if found {
        out.iter()
            .map(|e| keys::encode_extras(e.as_deref()))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    } else {
        Ok(None)
    };
    Namespaces { lora, salt, extras }
}

/// `_remote`: locality "REMOTE" (any case) is a shared tier, not the worker's own cache.
fn remote(locality: &Value) -> bool {
    matches!(locality, Value::Str(s) if s.to_uppercase() == "REMOTE")
}

/// Block keys as `_hashing.block_keys` chains them; None when a token is outside uint32 or the
/// lookahead rows do not cover the blocks.
fn chain(
    parent: &Key,
    tokens: &[i64],
    bs: usize,
    n: usize,
    extras: Option<&Extras>,
    lookahead: Option<&[Vec<u32>]>,
) -> Option<Vec<Key>> {
    let toks = keys::tokens_u32(&tokens[..n * bs])?;
    if let Some(la) = lookahead {
        if la.len() < n {
            return None;
        }
    }
    let mut out = Vec::with_capacity(n);
    keys::chain_into(
        &mut out,
        parent,
        &toks,
        bs,
        n,
        |i| extras.and_then(|e| e.get(i)).and_then(|x| x.as_deref()),
        |i| lookahead.map(|la| la[i].as_slice()),
    );
    Some(out)
}

fn lookahead_u32(la: &[Vec<i64>]) -> Option<Vec<Vec<u32>>> {
    la.iter().map(|row| keys::tokens_u32(row)).collect()
}

/// `_hit_tail`: blocks a hit of `grp` needs just before the hit point (0: no such rule).
pub(crate) fn hit_tail(grp: &Group) -> i64 {
    match grp.kind {
        GroupKind::State => 1,
        GroupKind::Window => match grp.window {
            Some(win) if win > 1 && grp.block_size != 0 => div_ceil(win - 1, grp.block_size),
            _ => 0,
        },
        _ => 0,
    }
}

/// Python's `a // b` (floor division; `b` != 0).
pub(crate) fn floor_div(a: i64, b: i64) -> i64 {
    let q = a / b;
    if a % b != 0 && ((a < 0) != (b < 0)) {
        q - 1
    } else {
        q
    }
}

/// Python's `-(-a // b)` (`b` != 0).
pub(crate) fn div_ceil(a: i64, b: i64) -> i64 {
    -floor_div(-a, b)
}

/// `_anchor`: the primary block size when `grp`'s blocks are keyed by anchored ids, else 0.
pub(crate) fn anchor<K>(w: &Worker<K>, grp: &Group) -> i64 {
    let (s_bs, p) = (grp.block_size, w.bs);
    if grp.kind == GroupKind::Full || s_bs == 0 || p <= s_bs || p % s_bs != 0 || w.lookahead != 0 {
        return 0;
    }
    p
}

fn drop_copy(copies: &mut EMap<u32>, ehash: &BlockHash) {
    if let Some(c) = copies.get_mut(ehash) {
        *c -= 1;
        if *c == 0 {
            copies.remove(ehash);
        }
    }
}

fn add_copy(copies: &mut EMap<u32>, ehash: &BlockHash) {
    match copies.get_mut(ehash) {
        Some(c) => *c += 1,
        None => {
            copies.insert(ehash, 1);
        }
    }
}

fn warn<K: WorkerName>(
    logs: &mut Vec<String>,
    w: &mut Worker<K>,
    what: &'static str,
    detail: String,
) {
    if w.warned.insert(what) {
        let label = w.key.label();
        logs.push(format!(
            "worker {label}: {what} ({detail}); further ones are counted, not logged"
        ));
    }
}

/// Python's repr of a sorted list of (int, int) tuples.
fn classes_repr(classes: &[Class]) -> String {
    let mut c = classes.to_vec();
    c.sort_unstable();
    let parts: Vec<String> = c.iter().map(|(a, b)| format!("({a}, {b})")).collect();
    format!("[{}]", parts.join(", "))
}

/// How many of `hashes` the worker holds (in its primary table).
fn held_count<K>(w: &Worker<K>, hashes: &[BlockHash]) -> usize {
    hashes.iter().filter(|h| w.blocks.contains(h)).count()
}

/// A worker's tier mask on a key from its holder flags there (0: not a holder).
pub(crate) fn mask_of_flags(f: u8) -> u8 {
    if f & H == 0 {
        return 0;
    }
    let mut mask = if f & G != 0 { 0 } else { 1 };
    for tbit in [2u8, 4, 8] {
        if f & tier_flag(tbit) != 0 {
            mask |= tbit;
        }
    }
    mask
}

impl<K: WorkerName> Index<K> {
    /// Apply every event of one decoded batch, in order; what it named, counted.
    pub fn apply_batch(&mut self, worker: &K, batch: &Batch) -> ApplyCounts {
        let far = self.prefetch_batch(worker, batch);
        let mut counts = ApplyCounts::default();
        for (i, ev) in batch.events.iter().enumerate() {
            if let Some(slot) = far {
                self.prefetch_removals_ahead(slot, &batch.events, i);
            }
            counts.events += 1;
            match ev {
                Event::Stored(s) => counts.stored_blocks += s.block_hashes.len() as u64,
                Event::Removed(r) => counts.removed_blocks += r.block_hashes.len() as u64,
                Event::Cleared => {}
            }
            self.apply(worker, ev);
        }
        counts
    }

    /// Start bringing into cache what the batch's events look up first in `worker`'s engine-hash
    /// table when it is megabytes (`FAR_TABLE_BYTES`): each store's parent and each removed
    /// hash. Each event otherwise waits on these misses in turn (a parent's slot, then its key's
    /// record; a removed hash's slot, then its record); requested together before the first
    /// event, they overlap each other and the events before them. Only a hint: the events still
    /// apply in order, and a table that grows meanwhile only makes a prefetch useless.
    ///
    /// Returns the worker's slot when it did (its table is far): `prefetch_removals_ahead` then
    /// follows each removal's chain further, an event or two ahead of it.
    fn prefetch_batch(&self, worker: &K, batch: &Batch) -> Option<u32> {
        if batch.events.len() < 2 {
            return None; // the one event's lookups come at once: nothing to overlap them with
        }
        let &slot = self.by_key.get(worker)?;
        let w = self.workers[slot as usize].as_deref()?;
        if w.blocks.slot_bytes() <= FAR_TABLE_BYTES {
            return None;
        }
        let mut left = BATCH_PREFETCH;
        for ev in &batch.events {
            let named: &[BlockHash] = match ev {
                Event::Stored(s) => s.parent_block_hash.as_slice(),
                Event::Removed(r) => &r.block_hashes,
                Event::Cleared => &[],
            };
            for h in named.iter().take(left) {
                w.blocks.prefetch(h);
            }
            left = left.saturating_sub(named.len());
            if left == 0 {
                break;
            }
        }
        Some(slot)
    }

    /// Before event `i` of a batch: start bringing into cache the next links of the removals
    /// `RECORD_AHEAD` and `KEY_SLOT_AHEAD` events on. A removal's misses depend on each other:
    /// the engine hash's slot in the worker's table (`prefetch_batch` asked for it), then its
    /// key's record, then the key's slot in the id index, which the release of the block's last
    /// holder empties. At a full engine's steady state (a removal per stored block, each event
    /// one hash) each event waited on its own two later misses in turn; asked for an event or
    /// two ahead, they overlap the events before. Only a hint, as `prefetch_batch`.
    fn prefetch_removals_ahead(&self, slot: u32, events: &[Event], i: usize) {
        let Some(w) = self.workers[slot as usize].as_deref() else {
            return;
        };
        // The first hashes of the removal at event `at` (none if it is another event).
        let removed = |at: usize| match events.get(at) {
            Some(Event::Removed(r)) => &r.block_hashes[..r.block_hashes.len().min(AHEAD_HASHES)],
            _ => &[],
        };
        // The key a removed hash names in the worker's table, if it names one.
        let key = |h: &BlockHash| w.blocks.get(h).copied().filter(|&id| id != NOKEY);
        for h in removed(i + RECORD_AHEAD) {
            w.blocks.prefetch_removal(h);
            if let Some(id) = key(h) {
                self.table.prefetch_record(id);
            }
        }
        for id in removed(i + KEY_SLOT_AHEAD).iter().filter_map(key) {
            self.table.prefetch_key_slot(id);
        }
    }

    /// Apply one engine event of `worker`.
    pub fn apply(&mut self, worker: &K, ev: &Event) {
        match ev {
            Event::Stored(s) => self.store(worker, s),
            Event::Removed(r) => self.remove(worker, r),
            Event::Cleared => self.remove_worker(worker),
        }
    }

    /// Forget everything `worker` holds (a reset, a restart, a worker gone).
    pub fn remove_worker(&mut self, worker: &K) {
        if let Some(&slot) = self.by_key.get(worker) {
            let w = self.take(slot);
            self.clear(w);
        }
    }

    // --- workers -------------------------------------------------------------------------

    /// The slot of `key`'s worker, created when new (a freed slot is reused last-in first-out).
    fn slot_for(&mut self, key: &K) -> u32 {
        if let Some(&s) = self.by_key.get(key) {
            return s;
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.workers.push(None);
                (self.workers.len() - 1) as u32
            }
        };
        self.workers[slot as usize] = Some(Worker::new(key.clone(), slot, self.created));
        self.by_key.insert(key.clone(), slot);
        self.created += 1;
        slot
    }

    /// Take a worker out of its slot to work on it beside the shared tables; `put` brings it back.
    pub(crate) fn take(&mut self, slot: u32) -> Box<Worker<K>> {
        self.workers[slot as usize].take().expect("live worker")
    }

    /// Put a worker back, or forget it when it holds nothing any more (`_maybe_release`).
    pub(crate) fn put(&mut self, w: Box<Worker<K>>) {
        if w.holds_nothing() {
            self.release(&w);
        } else {
            let slot = w.slot as usize;
            self.workers[slot] = Some(w);
        }
    }

    /// Forget a worker that holds nothing any more (`_release`; its slot is reused).
    fn release(&mut self, w: &Worker<K>) {
        self.by_key.remove(&w.key);
        let slot = w.slot;
        for cls in &w.classes {
            if let Some(i) = self.bs_members.iter().position(|(c, _)| c == cls) {
                let members = &mut self.bs_members[i].1;
                if let Ok(j) = members.binary_search(&slot) {
                    members.remove(j);
                }
                if members.is_empty() {
                    self.bs_members.remove(i);
                }
            }
        }
        if w.hybrid {
            self.hybrid_workers -= 1;
        }
        if w.bigram {
            self.bigram_workers -= 1;
        }
        for &id in w.blocks.values() {
            if id != NOKEY {
                self.table.release(id);
            }
        }
        self.workers[slot as usize] = None;
        self.free_slots.push(slot);
    }

    fn clear(&mut self, w: Box<Worker<K>>) {
        let slot = w.slot;
        if w.special.is_empty() && w.multi.is_empty() {
            for &id in w.blocks.values() {
                if id != NOKEY {
                    let f = self.table.flags(id, slot);
                    self.table.set_flags(id, slot, f & !H);
                }
            }
        } else {
            let ids: FxHashSet<u32> = w
                .blocks
                .values()
                .copied()
                .filter(|&id| id != NOKEY)
                .collect();
            for id in ids {
                let old = self.worker_mask(slot, id);
                self.set_mask(slot, id, old, 0);
            }
        }
        self.entries -= w.entries() as u64;
        self.release(&w);
    }

    // --- the shared tables ---------------------------------------------------------------

    /// Move one worker's presence on key `id` from tier mask `old` to `new` (`_set_mask`).
    pub(crate) fn set_mask(&mut self, slot: u32, id: u32, old: u8, new: u8) {
        if old == new {
            return;
        }
        let mut f = self.table.flags(id, slot);
        if old == 0 {
            f |= H;
        } else if new == 0 {
            f &= !H;
        }
        let old_off = old != 0 && old & 1 == 0;
        let new_off = new != 0 && new & 1 == 0;
        if old_off != new_off {
            f ^= G;
        }
        let changed = (old ^ new) & 14;
        for tbit in [2u8, 4, 8] {
            if changed & tbit != 0 {
                f ^= tier_flag(tbit);
            }
        }
        self.table.set_flags(id, slot, f);
    }

    /// The worker's tier mask on key `id`, read back from the shared tables (`_worker_mask`).
    pub(crate) fn worker_mask(&self, slot: u32, id: u32) -> u8 {
        mask_of_flags(self.table.flags(id, slot))
    }

    /// An engine hash mapping to key `id` became present (+1) or absent (-1) on tier `pos`.
    fn presence(
        &mut self,
        w: &mut Worker<K>,
        ehash: &BlockHash,
        id: u32,
        pos: usize,
        delta: i32,
        new_ehash: bool,
    ) {
        if id == NOKEY {
            return;
        }
        let slot = w.slot;
        if !w.multi.contains_key(&id) && new_ehash && self.table.flags(id, slot) & H != 0 {
            // A second engine hash for content this worker already holds: count per tier.
            let old = self.worker_mask(slot, id);
            let m = [0, 1, 2, 3].map(|i| i32::from((old >> i) & 1));
            w.multi.insert(id, m);
        }
        let (old, new) = if let Some(m) = w.multi.get_mut(&id) {
            let old = mask_of(m);
            m[pos] += delta;
            let new = mask_of(m);
            if m.iter().all(|&c| c == 0) {
                w.multi.remove(&id);
            }
            (old, new)
        } else {
            let new = match w.special.get(ehash) {
                Some(c) => mask_of(c),
                None => u8::from(w.blocks.contains(ehash)),
            };
            (new ^ (1 << pos), new)
        };
        self.set_mask(slot, id, old, new);
    }

    // --- stores ----------------------------------------------------------------------------

    fn admit(&mut self, w: &mut Worker<K>, cls: Class, n: usize) -> bool {
        let lim = self.limits;
        if !w.classes.contains(&cls) {
            if w.classes.len() >= lim.max_block_sizes {
                self.refused_bs += 1;
                let detail = format!("{} past {}", cls.0, classes_repr(&w.classes));
                warn(
                    &mut self.logs,
                    w,
                    "store refused: too many block sizes",
                    detail,
                );
                return false;
            }
            w.classes.push(cls);
            w.bs = w.bs.max(cls.0);
            self.add_member(cls, w.slot);
        }
        if w.entries() + n > lim.max_entries_per_worker {
            self.refused_entries += n as u64;
            let detail = format!("max_entries_per_worker={}", lim.max_entries_per_worker);
            warn(
                &mut self.logs,
                w,
                "store refused: entry bound reached",
                detail,
            );
            return false;
        }
        true
    }

    pub(crate) fn add_member(&mut self, cls: Class, slot: u32) {
        match self.bs_members.iter_mut().find(|(c, _)| *c == cls) {
            Some((_, members)) => {
                if let Err(j) = members.binary_search(&slot) {
                    members.insert(j, slot);
                }
            }
            None => self.bs_members.push((cls, vec![slot])),
        }
    }

    /// Where a store goes (`_group_of`): Ok(None) the primary group, Ok(Some(i)) group i, Err refused.
    fn group_of(&mut self, w: &mut Worker<K>, ev: &BlockStored) -> Result<Option<usize>, ()> {
        let kind = GroupKind::of(ev.kv_cache_spec_kind.as_deref());
        let Some(g) = ev.group_idx else {
            return Ok(None);
        };
        if ev.block_size == 0 && ev.token_ids.is_empty() && ev.kv_cache_spec_kind.is_none() {
            return Ok(None);
        }
        if kind == GroupKind::Full && w.primary.is_none_or(|p| p == g) && w.group(g).is_none() {
            w.primary = Some(g);
            return Ok(None);
        }
        match w.group(g) {
            None => {
                if w.groups.len() >= self.limits.max_groups_per_worker {
                    self.ignored_group += 1;
                    warn(
                        &mut self.logs,
                        w,
                        "store refused: too many KV-cache groups",
                        format!("group {g}"),
                    );
                    return Err(());
                }
                w.groups.push((
                    g,
                    Group::new(kind, ev.kv_cache_spec_sliding_window, ev.block_size),
                ));
                if !w.hybrid {
                    w.hybrid = true;
                    self.hybrid_workers += 1;
                }
                if kind == GroupKind::Unknown {
                    self.ignored_group += 1;
                    let shown = match &ev.kv_cache_spec_kind {
                        Some(k) => format!("'{k}'"),
                        None => "None".to_owned(),
                    };
                    warn(
                        &mut self.logs,
                        w,
                        "no hit rule for KV-cache group kind",
                        format!("{shown}: its hits are 0"),
                    );
                }
                Ok(Some(w.groups.len() - 1))
            }
            Some(i) => {
                if ev.block_size != 0 && !ev.token_ids.is_empty() {
                    let grp = &mut w.groups[i].1;
                    grp.block_size = ev.block_size;
                    if ev.kv_cache_spec_sliding_window.is_some() {
                        grp.window = ev.kv_cache_spec_sliding_window;
                    }
                }
                Ok(Some(i))
            }
        }
    }

    fn store(&mut self, worker: &K, ev: &BlockStored) {
        let hashes = &ev.block_hashes;
        let n = hashes.len();
        if remote(&ev.locality) {
            self.remote += n as u64;
            return;
        }
        let slot = self.slot_for(worker);
        let mut w = self.take(slot);
        self.store_in(&mut w, ev);
        self.put(w);
    }

    fn store_in(&mut self, w: &mut Worker<K>, ev: &BlockStored) {
        let hashes = &ev.block_hashes;
        let n = hashes.len();
        let pending = w.pending.take();
        let la = ev.lookahead_token_ids.as_deref().filter(|l| !l.is_empty());
        if let Some(l) = la {
            w.lookahead = l[0].len() as i64;
        }
        if ev.bigram && !w.bigram {
            w.bigram = true;
            self.bigram_workers += 1;
        }
        match self.group_of(w, ev) {
            Err(()) => return,
            Ok(Some(gi)) => return self.store_group(w, gi, ev, pending),
            Ok(None) => {}
        }
        if n == 0 {
            return;
        }
        let pos = tier_pos(ev.medium.as_deref());
        let bs = ev.block_size;
        let tokens = &ev.token_ids;
        if tokens.is_empty() {
            // A placeholder: names a tier for hashes the worker holds (unknown ones: unclaimable).
            if w.entries() + n > self.limits.max_entries_per_worker {
                self.refused_entries += n as u64;
                return;
            }
            for ehash in hashes {
                let id = w.blocks.get(ehash).copied().unwrap_or(NOKEY);
                self.store_one_id(w, ehash, id, pos, false);
            }
            return;
        }
        // Read before `admit` may raise the worker's block size.
        let partial = n == 1 && 0 < bs && bs < w.bs;
        // The pending and fresh-root rules (`settle`) read how many of the hashes the worker
        // held before this store. On the hot path, a store of new blocks, that count comes from
        // the inserts themselves (`store_fresh`: 0 when every one was new); elsewhere from one
        // probe per hash, taken before anything is stored.
        if bs <= 0 {
            // Never decoded (the wire refuses it); a hand-made event must not divide by zero.
            let present = held_count(w, hashes);
            self.settle(w, ev, pending, partial, pos, present);
            return;
        }
        let cls = (bs, la.map_or(0, |l| l[0].len() as i64));
        if !self.admit(w, cls, n) {
            let present = held_count(w, hashes);
            self.settle(w, ev, pending, partial, pos, present);
            return;
        }
        let ns = namespaces(ev);
        let parent = ev.parent_block_hash.as_ref();
        let mut key: Option<Key> = match parent {
            None => Some(self.root(ns.lora.as_deref(), ns.salt.as_deref())),
            Some(p) => match w.blocks.get(p) {
                Some(&id) => (id != NOKEY).then(|| *self.table.key(id)),
                None => {
                    self.unknown_parent += n as u64;
                    None
                }
            },
        };
        let bsu = bs as usize;
        let full = tokens.len() / bsu;
        let mut lookahead: Option<Vec<Vec<u32>>> = None;
        if key.is_some() {
            let toks_ok = keys::all_u32(&tokens[..full * bsu]);
            let la_ok = match la {
                Some(l) => {
                    lookahead = lookahead_u32(l);
                    lookahead.is_some()
                }
                None => true,
            };
            if !toks_ok || !la_ok {
                self.unhashable += n as u64;
                key = None;
            }
        }
        let extras = match ns.extras {
            Ok(e) => e,
            Err(_) => {
                if key.is_some() {
                    self.unhashable += n as u64;
                    key = None;
                }
                None
            }
        };
        // Plain keys (no extras, no lookahead) of whole GPU blocks: `store_fresh` may take it.
        let plain = key.filter(|_| {
            pos == 0 && extras.is_none() && ev.lookahead_token_ids.is_none() && full == n
        });
        if let Some(k) = plain {
            if self.store_fresh(w, hashes, &k, tokens, bsu) {
                self.settle(w, ev, pending, partial, pos, 0);
                return;
            }
        }
        let present = held_count(w, hashes);
        self.settle(w, ev, pending, partial, pos, present);
        let keys: Vec<Option<Key>> = if plain.is_some() {
            // `store_fresh` chained these keys and stored nothing (a hash was held already, or
            // came twice in this event).
            let ks = std::mem::take(&mut self.scratch.keys);
            if present == 0 {
                // The same hash twice in one event (never from vLLM): one by one.
                for (ehash, k) in hashes.iter().zip(&ks) {
                    self.store_one(w, ehash, Some(*k), 0, false);
                }
                self.scratch.keys = ks;
                return;
            }
            let out = ks.iter().map(|&k| Some(k)).collect();
            self.scratch.keys = ks;
            out
        } else {
            match key {
                Some(k) => {
                    match chain(&k, tokens, bsu, full, extras.as_ref(), lookahead.as_deref()) {
                        Some(ks) => {
                            let mut out: Vec<Option<Key>> = ks.into_iter().map(Some).collect();
                            if full < n {
                                out.push(None); // SGLang's short last page: held, not a full block to match
                            }
                            out
                        }
                        None => {
                            self.unhashable += n as u64;
                            vec![None; n]
                        }
                    }
                }
                None => vec![None; n],
            }
        };
        let copy = (parent.is_some() || self.root_repeat_is_copy()) && pos == 0;
        for (ehash, k) in hashes.iter().zip(keys) {
            self.store_one(w, ehash, k, pos, copy);
        }
    }

    /// The rules of a store with tokens that read how many of its hashes the worker held
    /// before it (`present`): vLLM's partial entry keeps the pending store; a GPU store from
    /// block 0 of held blocks may be a reuse report (`pending`, for the groups that follow);
    /// a store from block 0 naming a new block is the fresh root.
    fn settle(
        &self,
        w: &mut Worker<K>,
        ev: &BlockStored,
        pending: Option<(Vec<i64>, Vec<BlockHash>)>,
        partial: bool,
        pos: usize,
        present: usize,
    ) {
        let hashes = &ev.block_hashes;
        if partial {
            // vLLM's partial entry comes between the full group's store and the other groups'.
            w.pending = pending;
        } else if ev.parent_block_hash.is_none()
            && pos == 0
            && present > 0
            && !self.root_repeat_is_copy()
        {
            let again: Vec<BlockHash> = hashes
                .iter()
                .filter(|h| w.blocks.contains(h) && w.special.get(h).is_none_or(|c| c[0] != 0))
                .cloned()
                .collect();
            if !again.is_empty() {
                w.pending = Some((ev.token_ids.clone(), again));
            }
        }
        if ev.parent_block_hash.is_none() {
            w.fresh_root.clear();
            if present < hashes.len() {
                w.fresh_root.extend_from_slice(hashes);
            }
        }
    }

    /// The hot path: n whole GPU blocks chained on a known parent, stored when every engine hash
    /// is new to the worker (true). Otherwise (a hash held already, or twice in the event) it
    /// stores nothing and returns false, with the chained keys left in `scratch.keys`.
    fn store_fresh(
        &mut self,
        w: &mut Worker<K>,
        hashes: &[BlockHash],
        parent: &Key,
        tokens: &[i64],
        bs: usize,
    ) -> bool {
        let n = hashes.len();
        let slot = w.slot;
        let mut sc = std::mem::take(&mut self.scratch);
        // Every hash is inserted below unless one is held already (then the slow path inserts
        // the new ones): grow the worker's table once for all of them, before any of its slots
        // is prefetched.
        let ints = hashes
            .iter()
            .filter(|h| matches!(h, BlockHash::Int(_)))
            .count();
        w.blocks.reserve_ints(ints);
        // Each block's slot hash is taken once, for the prefetch and the insert. A worker's own
        // table is megabytes at 1M entries over a few workers (bench_fill.py's `at1M`: a cache
        // miss a block); one that fits a core's share of L2 gains nothing from the prefetch (the
        // 64-worker fill measured slower with it).
        sc.slot_hashes.clear();
        sc.slot_hashes
            .extend(hashes.iter().map(EMap::<u32>::slot_hash));
        let far = w.blocks.slot_bytes() > FAR_TABLE_BYTES;
        // Memory-level parallelism: as each key is made, the id-index slots its lookup reads and
        // its block's engine-hash slot are requested, so those misses (two or three random lines
        // a new block at 1M entries) overlap the hashing of the blocks after it and each other,
        // instead of stalling the interning and insert loops below one block at a time. A
        // prefetch is only a hint: the loops below still run in order, whatever is cached.
        sc.keys.clear();
        let (table, blocks, slot_hashes) = (&self.table, &w.blocks, &sc.slot_hashes);
        keys::plain_keys_into(&mut sc.keys, parent, &tokens[..n * bs], bs, n, |i, k| {
            table.prefetch_new_key(k);
            if far {
                blocks.prefetch_hashed(slot_hashes[i]);
            }
        });
        // Each key's id, and whether the worker held it before this store (read before any
        // update, as the Python index reads its holder sets once; interning changes no holder,
        // so a key's read may follow its interning). A key interned here has no holder at all:
        // its record is not read back, and it gets its first holder directly below.
        sc.ids.clear();
        sc.held.clear();
        for k in &sc.keys {
            let (id, new) = self.table.retain_key_new(k);
            sc.ids.push(id);
            sc.held.push(if new {
                FRESH_KEY
            } else if self.table.flags(id, slot) & H != 0 {
                HELD_KEY
            } else {
                UNHELD_KEY
            });
        }
        for (i, ((ehash, &hh), &id)) in hashes.iter().zip(&sc.slot_hashes).zip(&sc.ids).enumerate()
        {
            if w.blocks.try_insert_hashed(ehash, hh, id).is_err() {
                // Held already, or earlier in this event: undo, for the caller's slow path.
                for h in &hashes[..i] {
                    w.blocks.remove(h);
                }
                for &id in &sc.ids {
                    self.table.release(id);
                }
                self.scratch = sc;
                return false;
            }
        }
        self.entries += n as u64;
        for ((ehash, &id), &was) in hashes.iter().zip(&sc.ids).zip(&sc.held) {
            match was {
                // content it already holds under another engine hash
                HELD_KEY => self.presence(w, ehash, id, 0, 1, true),
                // Interned by this store, so held by nobody yet: an earlier block of this
                // store with the same key would have been found, not interned (`UNHELD_KEY`).
                FRESH_KEY => self.table.set_first_holder(id, slot, H),
                _ => {
                    let f = self.table.flags(id, slot);
                    self.table.set_flags(id, slot, f | H);
                }
            }
        }
        self.scratch = sc;
        true
    }

    fn store_one(
        &mut self,
        w: &mut Worker<K>,
        ehash: &BlockHash,
        key: Option<Key>,
        pos: usize,
        copy: bool,
    ) {
        if w.blocks.contains(ehash) {
            let id = *w.blocks.get(ehash).expect("checked");
            self.store_one_id(w, ehash, id, pos, copy);
            return;
        }
        let id = match key {
            Some(k) => self.table.retain_key(&k),
            None => NOKEY,
        };
        self.store_new(w, ehash, id, pos);
    }

    fn store_new(&mut self, w: &mut Worker<K>, ehash: &BlockHash, id: u32, pos: usize) {
        w.blocks.insert(ehash, id);
        self.entries += 1;
        if pos != 0 {
            let mut counts = [0; 4];
            counts[pos] = 1;
            w.special.insert(ehash, counts);
        }
        self.presence(w, ehash, id, pos, 1, true);
    }

    /// `_store_one` for a key already interned (`id`, with no reference taken for it yet).
    fn store_one_id(
        &mut self,
        w: &mut Worker<K>,
        ehash: &BlockHash,
        id: u32,
        pos: usize,
        copy: bool,
    ) {
        let Some(&old_id) = w.blocks.get(ehash) else {
            if id != NOKEY {
                self.table.retain(id);
            }
            return self.store_new(w, ehash, id, pos);
        };
        // A block the worker already holds: with a parent a real copy; from block 0 a reuse
        // report and a copy look alike, so it counts once (never claim more than the engine holds).
        let got = w.special.get(ehash).copied();
        if copy && got.is_none_or(|c| c[0] != 0) {
            add_copy(&mut w.copies, ehash);
            return;
        }
        let mut counts = match got {
            None => {
                if pos == 0 {
                    self.repeated += 1;
                    return;
                }
                [1, 0, 0, 0]
            }
            Some(c) => c,
        };
        if counts[pos] != 0 {
            if got.is_none() {
                w.special.insert(ehash, counts);
            }
            self.repeated += 1;
            return;
        }
        counts[pos] = 1;
        w.special.insert(ehash, counts);
        self.presence(w, ehash, old_id, pos, 1, false);
    }

    /// `_lookup`: the content key of an engine hash in a group of the worker with group `gi`'s
    /// block size. Some(None): found, but unclaimable.
    fn lookup(
        &self,
        w: &Worker<K>,
        gi: usize,
        ehash: &BlockHash,
        anchored: bool,
    ) -> Option<Option<Key>> {
        let grp = &w.groups[gi].1;
        if let Some(&(k, _)) = grp.blocks.get(ehash) {
            return Some(k);
        }
        let bs = grp.block_size;
        if anchored || w.classes.iter().all(|c| c.0 == bs) {
            if let Some(&id) = w.blocks.get(ehash) {
                return Some((id != NOKEY).then(|| *self.table.key(id)));
            }
        }
        for (j, (_, other)) in w.groups.iter().enumerate() {
            if j != gi && other.block_size == bs {
                if let Some(&(k, _)) = other.blocks.get(ehash) {
                    return Some(k);
                }
            }
        }
        None
    }

    fn store_group(
        &mut self,
        w: &mut Worker<K>,
        gi: usize,
        ev: &BlockStored,
        pending: Option<(Vec<i64>, Vec<BlockHash>)>,
    ) {
        let hashes = &ev.block_hashes;
        let n = hashes.len();
        let tokens = &ev.token_ids;
        let kind = w.groups[gi].1.kind;
        let sparse = ev.parent_block_hash.is_none()
            && (n as i64).saturating_mul(ev.block_size) < tokens.len() as i64
            && kind != GroupKind::Full;
        if sparse {
            if let Some((ptoks, phashes)) = &pending {
                if ptoks == tokens {
                    self.add_copies(w, phashes);
                }
            }
        }
        if n == 0 {
            return;
        }
        let mut skip = 0;
        if ev.parent_block_hash.is_none()
            && !self.root_repeat_is_copy()
            && kind != GroupKind::Full
            && (n as i64).saturating_mul(ev.block_size) == tokens.len() as i64
            && hashes.iter().all(|h| w.blocks.contains(h))
            && !{
                let fresh: FxHashSet<&BlockHash> = w.fresh_root.iter().collect();
                hashes.iter().all(|h| fresh.contains(h))
            }
        {
            // Maybe a reuse report, maybe a real store of content the primary group holds: keep
            // only the blocks a hit used (the last `_hit_tail`), held either way.
            let tail = hit_tail(&w.groups[gi].1).max(0) as usize;
            skip = n - n.min(tail);
            self.repeated += skip as u64;
            if skip == n {
                return;
            }
        }
        if w.entries() + n > self.limits.max_entries_per_worker {
            self.refused_entries += n as u64;
            let detail = format!(
                "max_entries_per_worker={}",
                self.limits.max_entries_per_worker
            );
            warn(
                &mut self.logs,
                w,
                "store refused: entry bound reached",
                detail,
            );
            return;
        }
        let bs = ev.block_size;
        let mut keys: Option<Vec<Option<Key>>> = None;
        let anchor_p = anchor(w, &w.groups[gi].1);
        if anchor_p != 0 && !tokens.is_empty() && bs == w.groups[gi].1.block_size {
            keys = self.anchored_keys(w, ev, anchor_p);
        } else if !tokens.is_empty() && bs > 0 && tokens.len() as i64 == n as i64 * bs {
            let ns = namespaces(ev);
            let key = match &ev.parent_block_hash {
                None => Some(self.root(ns.lora.as_deref(), ns.salt.as_deref())),
                Some(p) => self.lookup(w, gi, p, false).flatten(),
            };
            if let Some(k) = key {
                let la = match ev.lookahead_token_ids.as_deref().filter(|l| !l.is_empty()) {
                    Some(l) => lookahead_u32(l).map(Some),
                    None => Some(None),
                };
                let chained = match (ns.extras, la) {
                    (Ok(extras), Some(la)) => {
                        chain(&k, tokens, bs as usize, n, extras.as_ref(), la.as_deref())
                    }
                    _ => None,
                };
                match chained {
                    Some(ks) => keys = Some(ks.into_iter().map(Some).collect()),
                    None => self.unhashable += n as u64,
                }
            }
        }
        let keys = match keys {
            Some(k) => k,
            None => hashes
                .iter()
                .map(|h| self.lookup(w, gi, h, anchor_p != 0).flatten())
                .collect(),
        };
        let bit = 1u8 << tier_pos(ev.medium.as_deref());
        let copy =
            (ev.parent_block_hash.is_some() || sparse || self.root_repeat_is_copy()) && bit == 1;
        let grp = &mut w.groups[gi].1;
        let mut added = 0u64;
        for (ehash, k) in hashes.iter().zip(keys).skip(skip) {
            if let Some(cur) = grp.blocks.get_mut(ehash) {
                if copy && cur.1 & 1 != 0 {
                    add_copy(&mut grp.copies, ehash);
                    continue;
                }
                if cur.1 & bit != 0 {
                    self.repeated += 1;
                }
                cur.1 |= bit;
                continue;
            }
            grp.blocks.insert(ehash, (k, bit));
            added += 1;
            if let Some(k) = k {
                *grp.held.entry(k).or_insert(0) += 1;
            }
        }
        self.entries += added;
    }

    fn add_copies(&mut self, w: &mut Worker<K>, hashes: &[BlockHash]) {
        for h in hashes {
            if w.blocks.contains(h) && w.special.get(h).is_none_or(|c| c[0] != 0) {
                add_copy(&mut w.copies, h);
            }
        }
    }

    /// `_anchored_keys`: keys of a store of a group with blocks smaller than the primary's.
    fn anchored_keys(
        &mut self,
        w: &Worker<K>,
        ev: &BlockStored,
        p: i64,
    ) -> Option<Vec<Option<Key>>> {
        let ns = namespaces(ev);
        let s_bs = ev.block_size;
        let tokens = &ev.token_ids;
        let has_la = ev
            .lookahead_token_ids
            .as_ref()
            .is_some_and(|l| !l.is_empty());
        if !matches!(ns.extras, Ok(None)) || has_la || s_bs <= 0 || tokens.len() as i64 % s_bs != 0
        {
            return None;
        }
        let anchor_key = match &ev.parent_block_hash {
            None => Some(self.root(ns.lora.as_deref(), ns.salt.as_deref())),
            Some(parent) => match w.blocks.get(parent) {
                Some(&id) if id != NOKEY => Some(*self.table.key(id)),
                _ => None,
            },
        }?;
        let hashes = &ev.block_hashes;
        let Some(toks) = keys::tokens_u32(tokens) else {
            self.unhashable += hashes.len() as u64;
            return None;
        };
        let (s_bs, p) = (s_bs as usize, p as usize);
        let ids = keys::anchored_ids(&anchor_key, &toks, s_bs, p, toks.len() / s_bs);
        let (n, slots) = (hashes.len(), ids.len());
        if n == slots {
            return Some(ids.into_iter().map(Some).collect());
        }
        let mut at: FxHashMap<Key, usize> = FxHashMap::default();
        for (j, k) in ids.iter().enumerate() {
            at.insert(*k, j);
        }
        let mut pos: Vec<Option<usize>> = hashes
            .iter()
            .map(|h| match w.blocks.get(h) {
                Some(&id) if id != NOKEY => at.get(self.table.key(id)).copied(),
                _ => None,
            })
            .collect();
        let known: Vec<usize> = pos.iter().flatten().copied().collect();
        if known.windows(2).any(|ab| ab[1] <= ab[0]) {
            return Some(vec![None; n]); // out of order: nothing can be placed
        }
        let per = p / s_bs;
        let slot = w.slot;
        let (mut prev_i, mut prev_j): (i64, i64) = (-1, -1);
        for i in 0..=n {
            let j = if i == n { Some(slots) } else { pos[i] };
            let Some(j) = j else { continue };
            let (ii, jj) = (i as i64, j as i64);
            let gap = ii - prev_i - 1;
            let room = jj - prev_j - 1;
            let fits = gap > 0
                && (gap == room
                    || (gap < room
                        && ((prev_j + 1) as usize..j)
                            .filter(|b| (b + 1) % per == 0)
                            .all(|b| {
                                self.table
                                    .id(&ids[b])
                                    .is_some_and(|id| self.table.flags(id, slot) & H != 0)
                            })));
            if fits {
                for d in 0..gap {
                    pos[(prev_i + 1 + d) as usize] = Some((jj - gap + d) as usize);
                }
            }
            prev_i = ii;
            prev_j = jj;
        }
        Some(pos.into_iter().map(|j| j.map(|j| ids[j])).collect())
    }

    // --- removals --------------------------------------------------------------------------

    fn remove(&mut self, worker: &K, ev: &BlockRemoved) {
        let hashes = &ev.block_hashes;
        if remote(&ev.locality) {
            self.remote += hashes.len() as u64;
            return;
        }
        let Some(&slot) = self.by_key.get(worker) else {
            self.unknown_removals += hashes.len() as u64;
            return;
        };
        let mut w = self.take(slot);
        w.pending = None;
        match ev.group_idx {
            Some(g) if Some(g) != w.primary => {
                match w.group(g) {
                    None => self.unknown_removals += hashes.len() as u64,
                    Some(gi) => self.remove_group(&mut w.groups[gi].1, ev),
                }
                self.put(w);
                return;
            }
            _ => {}
        }
        let pos = tier_pos(ev.medium.as_deref());
        for ehash in hashes {
            let Some(&id) = w.blocks.get(ehash) else {
                self.unknown_removals += 1;
                continue;
            };
            if id != NOKEY {
                self.table.prefetch_key_slot(id);
            }
            if pos == 0 && w.copies.contains(ehash) {
                drop_copy(&mut w.copies, ehash);
                continue;
            }
            let Some(mut counts) = w.special.get(ehash).copied() else {
                if pos != 0 {
                    self.unknown_removals += 1;
                    continue;
                }
                w.blocks.remove(ehash);
                self.entries -= 1;
                self.presence(&mut w, ehash, id, 0, -1, false);
                if id != NOKEY {
                    self.table.release(id);
                }
                continue;
            };
            if counts[pos] == 0 {
                self.unknown_removals += 1;
                continue;
            }
            counts[pos] = 0;
            if counts.iter().all(|&c| c == 0) {
                w.special.remove(ehash);
                w.blocks.remove(ehash);
                self.entries -= 1;
                self.presence(&mut w, ehash, id, pos, -1, false);
                if id != NOKEY {
                    self.table.release(id);
                }
            } else {
                if counts == [1, 0, 0, 0] {
                    w.special.remove(ehash);
                } else {
                    w.special.insert(ehash, counts);
                }
                self.presence(&mut w, ehash, id, pos, -1, false);
            }
        }
        self.put(w);
    }

    fn remove_group(&mut self, grp: &mut Group, ev: &BlockRemoved) {
        let bit = 1u8 << tier_pos(ev.medium.as_deref());
        for ehash in &ev.block_hashes {
            let Some(cur) = grp.blocks.get_mut(ehash) else {
                self.unknown_removals += 1;
                continue;
            };
            if cur.1 & bit == 0 {
                self.unknown_removals += 1;
                continue;
            }
            if bit == 1 && grp.copies.contains(ehash) {
                drop_copy(&mut grp.copies, ehash);
                continue;
            }
            cur.1 &= !bit;
            if cur.1 != 0 {
                continue;
            }
            let (k, _) = grp.blocks.remove(ehash).expect("present");
            self.entries -= 1;
            if let Some(k) = k {
                if let Some(c) = grp.held.get_mut(&k) {
                    *c -= 1;
                    if *c == 0 {
                        grp.held.remove(&k);
                    }
                }
            }
        }
    }
}

// --- the reuse-report rule (issue 18) ----------------------------------------------------------
// The one place that decides what a repeat store from block 0 is; its four call sites are
// `store_in` (pending, copy) and `store_group` (skip, copy).
impl<K: WorkerName> Index<K> {
    /// Whether a store that names no parent, of blocks the worker already holds, is one more GPU
    /// copy. vLLM publishes one store per new cache entry (`BlockPool.cache_full_blocks`: a block
    /// it holds twice is removed twice), except a reuse report (`emit_cached_block_events`, for a
    /// request sent with `kv_cache_report_mode "full"`), which lists a hit's blocks from block 0,
    /// a window's null blocks included, and adds no entry. Where reports may come the two look
    /// alike, so the repeat counts once (never claim more than the engine holds); where the router
    /// says none come (`PrefixIndex(reuse_reports=False)`), it is a copy.
    fn root_repeat_is_copy(&self) -> bool {
        !self.reuse_reports
    }
}
