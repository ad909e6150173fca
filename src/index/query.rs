//! Queries: `find_matches` (leading blocks per worker, any tier and GPU), the hybrid rule over
//! a worker's KV-cache groups, and the off-GPU tier answers. kvroute/_index.py's
//! `find_matches`, `_hybrid_rule`, `_group_hit`, `_tier_scores`, rule for rule.
//!
//! The prompt is hashed lazily, once per (block size, lookahead) class, and only as far as
//! some worker still continues the prefix: a short match never pays for hashing a long prompt.

use rustc_hash::FxHashMap;

use super::store::{anchor, div_ceil, floor_div};
use super::table::{flags_of, prefetch, slot_of, tier_flag, Holders, G, H, LOOKUP_AHEAD};
use super::{Class, Group, GroupKind, Index, WorkerName};
use crate::keys::{self, Key, MmItem};

/// A query's prompt and namespaces, checked: every token is a uint32.
#[derive(Clone, Debug, Default)]
pub struct QueryInput {
    pub tokens: Vec<u32>,
    pub lora: Option<String>,
    pub salt: Option<String>,
    /// multimodal items (sorted by offset here, stably, as `mm_extras` sorts them)
    pub mm_items: Vec<MmItem>,
    /// deprecated per-block extras, encoded (None: a block without extras)
    pub extra_keys: Option<Vec<Option<Vec<u8>>>>,
}

/// One prompt with its content keys per class, computed on demand (`_Query`).
pub struct Query {
    pub input: QueryInput,
    pub root: Key,
    keys: FxHashMap<Class, Vec<Key>>,
}

impl Query {
    fn n_blocks(&self, cls: Class) -> usize {
        let (bs, la) = cls;
        if bs <= 0 {
            return 0;
        }
        floor_div(self.input.tokens.len() as i64 - la, bs).max(0) as usize
    }

    /// Full blocks the query has at `classes`' block sizes (the most over them).
    pub fn query_blocks(&self, classes: &[Class]) -> usize {
        classes.iter().map(|&c| self.n_blocks(c)).max().unwrap_or(0)
    }

    /// The keys hashed so far, per class.
    pub fn hashed(&self) -> impl Iterator<Item = (&Class, &Vec<Key>)> {
        self.keys.iter()
    }

    /// Extend class `cls`'s keys to `n` blocks (at most the prompt's).
    fn extend(&mut self, cls: Class, n: usize) {
        let n = n.min(self.n_blocks(cls));
        let have = self.keys.get(&cls).map_or(0, Vec::len);
        if have >= n {
            return;
        }
        let (bs, la) = (cls.0 as usize, cls.1 as usize);
        let mut got = self.keys.remove(&cls).unwrap_or_default();
        // Room for this extension and about two more of the match's doubling chunks (at most the
        // prompt's keys): a match that stops early (32 blocks of an 8k prompt) does not allocate
        // for the whole prompt, and a long one grows the vector every other chunk, not each time.
        if got.capacity() < n {
            got.reserve_exact((4 * n).min(self.n_blocks(cls)) - have);
        }
        let parent = got.last().copied().unwrap_or(self.root);
        let input = &self.input;
        let toks = &input.tokens[have * bs..n * bs];
        let mm = if input.extra_keys.is_none() && !input.mm_items.is_empty() {
            keys::mm_extras(&input.mm_items, bs, have, n, la)
        } else {
            None
        };
        let extras = |i: usize| -> Option<&[u8]> {
            match &input.extra_keys {
                Some(ek) => ek.get(have + i).and_then(|x| x.as_deref()),
                None => mm.as_ref().and_then(|m| m[i].as_deref()),
            }
        };
        let tokens = &input.tokens;
        let lookahead = |i: usize| -> Option<&[u32]> {
            (la > 0).then(|| {
                let start = (have + i + 1) * bs;
                &tokens[start..start + la]
            })
        };
        keys::chain_into(&mut got, &parent, toks, bs, n - have, extras, lookahead);
        self.keys.insert(cls, got);
    }

    /// The first `n` keys of class `cls` (fewer when the prompt has fewer).
    fn upto(&mut self, cls: Class, n: usize) -> &[Key] {
        self.extend(cls, n);
        let got = self.keys.get(&cls).map_or(&[][..], Vec::as_slice);
        &got[..n.min(got.len())]
    }
}

/// One worker's answer: leading blocks, counted in `block_size`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Score<K> {
    pub worker: K,
    pub slot: u32,
    pub blocks: i64,
    pub block_size: i64,
}

/// `find_matches`' answer: per worker on any tier (in the Python dict's insertion order), and on
/// GPU (None: every held block is on GPU, the GPU answer is the same).
#[derive(Clone, Debug)]
pub struct MatchResult<K> {
    pub scores: Vec<Score<K>>,
    pub gpu: Option<Vec<Score<K>>>,
}

/// A `Scores::row` entry for a slot not recorded.
const NO_ROW: u32 = u32::MAX;

/// Scores by slot, kept in first-insertion order (`_record` semantics). A slot finds its row
/// through a vector over the fleet's slots, not a hash map: a 1,024-worker match records a few
/// hundred workers, and a hash map insert and lookup each was ~4 % of a `select` there (perf).
#[derive(Default)]
struct Scores {
    /// (slot, blocks, block size), in the order slots were first recorded
    rows: Vec<(u32, i64, i64)>,
    /// slot -> its place in `rows` (`NO_ROW`: none); sized to the fleet's slots on first record
    row: Vec<u32>,
}

impl Scores {
    /// Give `slot` `value` blocks of `bs`; its best in tokens over block sizes wins.
    fn record(&mut self, slot: u32, value: i64, bs: i64, slots: usize) {
        if self.row.is_empty() {
            self.row = vec![NO_ROW; slots];
        }
        match self.row[slot as usize] {
            NO_ROW => {
                self.row[slot as usize] = self.rows.len() as u32;
                self.rows.push((slot, value, bs));
            }
            r => {
                let old = &mut self.rows[r as usize];
                if old.1 * old.2 < value * bs {
                    (old.1, old.2) = (value, bs);
                }
            }
        }
    }

    fn reserve(&mut self, n: usize) {
        self.rows.reserve(n);
    }

    /// `slot`'s (blocks, block size), if recorded.
    fn get(&self, slot: u32) -> Option<(i64, i64)> {
        match self.row.get(slot as usize) {
            None | Some(&NO_ROW) => None,
            Some(&r) => {
                let (_, blocks, bs) = self.rows[r as usize];
                Some((blocks, bs))
            }
        }
    }

    /// Replace the value of `slot`, which is recorded.
    fn set(&mut self, slot: u32, value: i64, bs: i64) {
        let r = self.row[slot as usize] as usize;
        (self.rows[r].1, self.rows[r].2) = (value, bs);
    }

    fn remove(&mut self, slot: u32) {
        let Some(&r) = self.row.get(slot as usize) else {
            return;
        };
        if r == NO_ROW {
            return;
        }
        self.rows.remove(r as usize);
        self.row[slot as usize] = NO_ROW;
        for &(s, _, _) in &self.rows[r as usize..] {
            self.row[s as usize] -= 1;
        }
    }

    fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn into_vec<K: WorkerName>(self, index: &Index<K>) -> Vec<Score<K>> {
        // Each clone below reads the worker's box and then its name's shared record (an atomic
        // increment, which keeps later loads from passing it): prefetch the boxes, then the
        // names, so the clones find both in cache instead of missing twice a row in turn.
        let live = |slot: u32| index.workers[slot as usize].as_deref();
        for w in self.rows.iter().filter_map(|r| live(r.0)) {
            prefetch(std::ptr::addr_of!(w.key).cast());
        }
        for w in self.rows.iter().filter_map(|r| live(r.0)) {
            w.key.prefetch();
        }
        self.rows
            .iter()
            .map(|&(slot, blocks, block_size)| {
                let w = index.workers[slot as usize].as_ref().expect("live worker");
                Score {
                    worker: w.key.clone(),
                    slot,
                    blocks,
                    block_size,
                }
            })
            .collect()
    }
}

/// The workers still continuing a prefix, as a bit set over slots, with the words that still
/// have a worker in them: a step costs the words left alive, not the fleet's.
struct Alive {
    words: Vec<u64>,
    /// indices of the nonzero `words`, ascending
    active: Vec<u32>,
    /// a list step's kept bits (zero between steps)
    mask: Vec<u64>,
    count: usize,
    /// the fleet's slots (`Scores::record` sizes its row vector to them)
    slots: usize,
}

impl Alive {
    fn new(members: &[u32], slots: usize) -> Alive {
        let mut words = vec![0u64; slots.div_ceil(64).max(1)];
        for &s in members {
            words[s as usize / 64] |= 1 << (s % 64);
        }
        let active = (0..words.len() as u32)
            .filter(|&wi| words[wi as usize] != 0)
            .collect();
        let mask = vec![0u64; words.len()];
        Alive {
            words,
            active,
            mask,
            count: members.len(),
            slots,
        }
    }

    /// Keep the workers whose flags on this key have `flags & need == want` (a worker that does
    /// not hold the key has none: `want` always has `H`); record the others at `at` blocks (when
    /// > 0), lowest slot first (as the Python index records bits).
    fn step(
        &mut self,
        holders: Holders<'_>,
        need: u8,
        want: u8,
        at: i64,
        bs: i64,
        out: &mut Scores,
    ) {
        match holders {
            Holders::List(list) => {
                // Branch-free: this loop runs once per (block, holder) pair of a key held by
                // few workers. Only alive workers' bits are set, so only active words need
                // clearing afterwards.
                for &h in list {
                    let s = slot_of(h) as usize;
                    let (wi, b) = (s / 64, s % 64);
                    let keep = u64::from(flags_of(h) & need == want) & (self.words[wi] >> b);
                    self.mask[wi] |= (keep & 1) << b;
                }
                self.apply(at, bs, out, |mask, wi| std::mem::take(&mut mask[wi]));
            }
            Holders::Set { present, odd } => {
                // A key many workers hold: its bit set is the kept set, word for word, except
                // the few holders whose flags are not exactly `H` (`odd`, sorted by slot).
                let plain = if H & need == want { u64::MAX } else { 0 };
                let mut o = 0usize;
                self.apply(at, bs, out, |_, wi| {
                    let mut m = present.get(wi).map_or(0, |&p| p & plain);
                    while o < odd.len() && (slot_of(odd[o]) as usize) / 64 < wi {
                        o += 1;
                    }
                    while o < odd.len() && (slot_of(odd[o]) as usize) / 64 == wi {
                        let h = odd[o];
                        let bit = 1u64 << (slot_of(h) % 64);
                        if flags_of(h) & need == want {
                            m |= bit;
                        } else {
                            m &= !bit;
                        }
                        o += 1;
                    }
                    m
                });
            }
        }
    }

    /// Keep, in each active word `wi` (ascending), the bits `kept(mask, wi)` gives; record the
    /// workers dropped at `at` blocks (when > 0), and forget the words left empty.
    #[inline]
    fn apply(
        &mut self,
        at: i64,
        bs: i64,
        out: &mut Scores,
        mut kept: impl FnMut(&mut [u64], usize) -> u64,
    ) {
        let mut n = 0;
        for j in 0..self.active.len() {
            let wi = self.active[j] as usize;
            let a = self.words[wi];
            let k = a & kept(&mut self.mask, wi);
            let mut dropped = a & !k;
            if dropped != 0 {
                self.words[wi] = k;
                self.count -= dropped.count_ones() as usize;
                if at > 0 {
                    while dropped != 0 {
                        out.record(
                            wi as u32 * 64 + dropped.trailing_zeros(),
                            at,
                            bs,
                            self.slots,
                        );
                        dropped &= dropped - 1;
                    }
                }
            }
            if k != 0 {
                self.active[n] = wi as u32;
                n += 1;
            }
        }
        self.active.truncate(n);
    }

    /// Record every worker left at `at` blocks.
    fn record_all(&self, at: i64, bs: i64, out: &mut Scores) {
        for &wi in &self.active {
            let mut left = self.words[wi as usize];
            while left != 0 {
                out.record(wi * 64 + left.trailing_zeros(), at, bs, self.slots);
                left &= left - 1;
            }
        }
    }
}

impl<K: WorkerName> Index<K> {
    /// A query for `input`, rooted in its namespace (through the bounded root cache).
    pub fn query(&self, input: QueryInput) -> Query {
        let mut input = input;
        input.mm_items.sort_by_key(|m| m.offset);
        let root = self.root(input.lora.as_deref(), input.salt.as_deref());
        Query {
            input,
            root,
            keys: FxHashMap::default(),
        }
    }

    /// Whether `worker` holds any block (a member of `workers()`).
    pub fn holds(&self, worker: &K) -> bool {
        self.by_key
            .get(worker)
            .and_then(|&slot| self.workers[slot as usize].as_ref())
            .is_some_and(|w| !w.holds_nothing())
    }

    /// `worker`'s slot: `select` keeps it to find the worker again there (`at_slot`) instead of
    /// looking its name up each call.
    pub fn slot_of(&self, worker: &K) -> Option<u32> {
        let &slot = self.by_key.get(worker)?;
        self.workers[slot as usize].as_ref().map(|_| slot)
    }

    /// The worker at `slot`: its key and whether it holds any block (None: a free slot).
    pub fn at_slot(&self, slot: u32) -> Option<(&K, bool)> {
        self.workers
            .get(slot as usize)?
            .as_ref()
            .map(|w| (&w.key, !w.holds_nothing()))
    }

    /// How many workers hold any block (`workers().len()` without building the list).
    pub fn holding_count(&self) -> usize {
        self.workers
            .iter()
            .flatten()
            .filter(|w| !w.holds_nothing())
            .count()
    }

    /// How many leading full blocks of the query each worker holds (`find_matches`).
    pub fn find_matches(&self, q: &mut Query) -> MatchResult<K> {
        let mut scores = Scores::default();
        let track_gpu = self.table.flag_key_counts()[1] > 0;
        let mut gpu = Scores::default();
        let mut held: Vec<Holders<'_>> = Vec::new();
        let mut ids: Vec<Option<u32>> = Vec::new();
        for (cls, members) in &self.bs_members {
            let cls = *cls;
            let bs = cls.0;
            let n = served_blocks(q, cls);
            let slots = self.workers.len();
            let mut alive = Alive::new(members, slots);
            let mut alive_gpu = Alive::new(if track_gpu { members } else { &[] }, slots);
            let mut i = 0usize;
            let mut chunk = 8usize;
            while i < n && alive.count > 0 {
                // Hash in chunks that double: a short match hashes little, a long one few times.
                let end = n.min(i + chunk);
                chunk *= 2;
                q.extend(cls, end);
                // Look the whole chunk's keys up, then fetch their holders, before the first
                // step, in passes: the lookups do not depend on each other, so their cache
                // misses overlap instead of queueing one behind the other. At fleet scale the
                // misses (the id table, the record, the side entry, the holder words), not the
                // steps, are most of a match. Each pass only issues prefetches of what the next
                // one reads, so no pass waits on a miss the previous one could have started.
                let keys = &q.keys[&cls][i..end];
                for k in keys.iter().take(LOOKUP_AHEAD) {
                    self.table.prefetch_key(k);
                }
                ids.clear();
                for (j, k) in keys.iter().enumerate() {
                    if let Some(ahead) = keys.get(j + LOOKUP_AHEAD) {
                        self.table.prefetch_key(ahead);
                    }
                    ids.push(self.table.id(k));
                }
                for &id in ids.iter().flatten() {
                    self.table.prefetch_side(id);
                }
                held.clear();
                held.extend(
                    ids.iter()
                        .map(|id| id.map_or(Holders::List(&[]), |id| self.table.holders(id))),
                );
                for h in &held {
                    h.prefetch();
                }
                for &holders in &held {
                    alive.step(holders, H, H, i as i64, bs, &mut scores);
                    if alive_gpu.count > 0 {
                        // held, and not missing on GPU
                        alive_gpu.step(holders, H | G, H, i as i64, bs, &mut gpu);
                    }
                    if i == 0 {
                        // Only the workers holding block 0 can be recorded from here on.
                        scores.reserve(alive.count);
                        gpu.reserve(alive_gpu.count);
                    }
                    i += 1;
                    if alive.count == 0 {
                        break;
                    }
                }
            }
            if i > 0 {
                alive.record_all(i as i64, bs, &mut scores);
                alive_gpu.record_all(i as i64, bs, &mut gpu);
            }
        }
        if self.bigram_workers > 0 {
            bigram_cap(self, q, &mut scores);
            bigram_cap(self, q, &mut gpu);
        }
        if self.hybrid_workers > 0 && !scores.is_empty() {
            self.hybrid_rule(q, &mut scores, track_gpu.then_some(&mut gpu));
        }
        MatchResult {
            scores: scores.into_vec(self),
            gpu: track_gpu.then(|| gpu.into_vec(self)),
        }
    }

    /// Cut each hybrid worker's run to what every KV-cache group serves (`_hybrid_rule`).
    fn hybrid_rule(&self, q: &mut Query, scores: &mut Scores, mut gpu: Option<&mut Scores>) {
        let hybrid: Vec<u32> = (scores.rows.iter())
            .map(|r| r.0)
            .filter(|&s| self.workers[s as usize].as_ref().is_some_and(|w| w.hybrid))
            .collect();
        for slot in hybrid {
            let w = self.workers[slot as usize].as_ref().expect("live worker");
            let (value, bs) = scores.get(slot).expect("recorded");
            let mut align = lcm(bs, w.bs);
            for (_, grp) in &w.groups {
                if grp.block_size != 0 {
                    align = lcm(align, grp.block_size);
                }
            }
            // `value` is already within the prompt minus one token (`served_blocks`).
            let mut hit = value * bs;
            if align != 0 {
                hit -= hit.rem_euclid(align);
            }
            while hit != 0 && align != 0 {
                let before = hit;
                for (_, grp) in &w.groups {
                    let gbs = if grp.block_size != 0 {
                        grp.block_size
                    } else {
                        bs
                    };
                    hit = group_hit(grp, q, (gbs, w.lookahead), hit, align, anchor(w, grp));
                    if hit == 0 {
                        break;
                    }
                }
                if hit == before {
                    break;
                }
            }
            if hit != 0 {
                let v = hit / bs;
                scores.set(slot, v, bs);
                if let Some(g) = gpu.as_deref_mut() {
                    if let Some((gv, gbs)) = g.get(slot) {
                        g.set(slot, gv.min(v), gbs);
                    }
                }
            } else {
                scores.remove(slot);
                if let Some(g) = gpu.as_deref_mut() {
                    g.remove(slot);
                }
            }
        }
    }

    /// Leading blocks held on an off-GPU tier (`pos` 1 CPU, 2 DISK, 3 EXTERNAL) by the workers of
    /// `any` (`_tier_scores`), from the index as it is now.
    pub fn tier_scores(&self, q: &mut Query, pos: usize, any: &[(K, i64, i64)]) -> Vec<(K, i64)> {
        let flag = tier_flag(1 << pos);
        if self.table.flag_key_counts()[pos + 1] == 0 {
            return Vec::new();
        }
        let mut out: Vec<(K, i64)> = Vec::new();
        for (wk, n, bs) in any {
            let Some(w) = self.worker(wk) else { continue };
            let mut best: Option<i64> = None;
            let classes: Vec<Class> = w.classes.iter().copied().filter(|c| c.0 == *bs).collect();
            for cls in classes {
                let ks = q.upto(cls, (*n).max(0) as usize);
                let run = ks
                    .iter()
                    .take_while(|k| {
                        self.table
                            .id(k)
                            .is_some_and(|id| self.table.flags(id, w.slot) & flag != 0)
                    })
                    .count() as i64;
                if run > 0 {
                    best = Some(best.map_or(run, |b| b.max(run)));
                }
            }
            if let Some(b) = best {
                // a hybrid worker's run is already cut to its groups
                out.push((wk.clone(), b.min(*n)));
            }
        }
        out
    }
}

fn gcd(a: i64, b: i64) -> i64 {
    let (mut a, mut b) = (a.abs(), b.abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Python's `math.lcm` for two ints (0 when either is 0).
fn lcm(a: i64, b: i64) -> i64 {
    if a == 0 || b == 0 {
        return 0;
    }
    (a / gcd(a, b) * b).abs()
}

/// The longest hit (tokens, <= `max_tokens`) group `grp` serves, by the engine's rule for its kind.
fn group_hit(
    grp: &Group,
    q: &mut Query,
    cls: Class,
    max_tokens: i64,
    align: i64,
    anchor_p: i64,
) -> i64 {
    if grp.kind == GroupKind::Unknown {
        return 0;
    }
    let bs = cls.0;
    if bs <= 0 {
        return 0;
    }
    let want = (max_tokens / bs).max(0) as usize;
    let anchored: Vec<Key>;
    let keys: &[Key] = if anchor_p != 0 {
        let count = want.min(q.n_blocks((bs, 0)));
        let b = bs as usize;
        anchored = keys::anchored_ids(
            &q.root,
            &q.input.tokens[..count * b],
            b,
            anchor_p as usize,
            count,
        );
        &anchored
    } else {
        q.upto(cls, want)
    };
    let held = &grp.held;
    let m = keys.len() as i64;
    if grp.kind == GroupKind::Full {
        let run = keys.iter().take_while(|k| held.contains_key(*k)).count() as i64;
        let t = run * bs;
        return t - t.rem_euclid(align);
    }
    let need = if grp.kind == GroupKind::State {
        1
    } else {
        match grp.window {
            Some(win) if win >= 1 => div_ceil(win - 1, bs),
            _ => m + 1, // no window known: only a run from the start can be trusted
        }
    };
    if need <= 0 {
        return max_tokens - max_tokens.rem_euclid(align);
    }
    // vLLM's SlidingWindowManager.find_longest_cache_hit: from the right, the first run of
    // `need` held blocks ending on an aligned boundary; else the run from block 0.
    let mut count = 0i64;
    for i in (0..m).rev() {
        if held.contains_key(&keys[i as usize]) {
            if count == 0 && bs != align && ((i + 1) * bs).rem_euclid(align) != 0 {
                continue;
            }
            count += 1;
            if count >= need {
                return (i + count) * bs;
            }
        } else {
            count = 0;
        }
    }
    let t = count * bs;
    t - t.rem_euclid(align)
}

// --- the engines' last-token rule (issue 18) ---------------------------------------------------
/// Leading blocks of class `cls` any worker can serve the query: the engine always computes the
/// prompt's last token (for its logits), so it serves at most the prompt minus one token from
/// cache, in whole blocks — vLLM's `Request.get_max_cache_hit_length` (`num_tokens - 1`, then
/// `find_longest_cache_hit` takes whole blocks) and SGLang's `Req._compute_max_prefix_len`
/// (`input_len - 1`, then `RadixKey.page_aligned`). A lookahead class's own bound (its last block
/// needs `la` tokens after it) is the tighter one whenever `la` >= 1. SGLang EAGLE workers serve a
/// page less at one edge (`bigram_cap`).
fn served_blocks(q: &Query, cls: Class) -> usize {
    let bs = cls.0;
    if bs <= 0 {
        return 0;
    }
    let cap = floor_div(q.input.tokens.len() as i64 - 1, bs).max(0) as usize;
    q.n_blocks(cls).min(cap)
}

/// Cut SGLang EAGLE workers (`Worker::bigram`) to what they serve: SGLang takes the bigram view of
/// the prompt minus one token (`Req._compute_max_prefix_len`, then `RadixKey` with `is_bigram`: one
/// bigram fewer than those tokens), then whole pages (`page_aligned`), so floor((n - 2) / P) pages
/// of an n-token prompt — a page less than `served_blocks` when n - 1 is whole pages.
fn bigram_cap<K: WorkerName>(index: &Index<K>, q: &Query, scores: &mut Scores) {
    let n = q.input.tokens.len() as i64;
    let over: Vec<(u32, i64, i64)> = (scores.rows.iter())
        .filter_map(|&(slot, blocks, bs)| {
            let cap = floor_div(n - 2, bs).max(0);
            let bigram = || {
                index.workers[slot as usize]
                    .as_ref()
                    .is_some_and(|w| w.bigram)
            };
            (blocks > cap && bigram()).then_some((slot, cap, bs))
        })
        .collect();
    for (slot, cap, bs) in over {
        if cap > 0 {
            scores.set(slot, cap, bs);
        } else {
            scores.remove(slot);
        }
    }
}

#[cfg(test)]
mod bigram_tests {
    use super::super::{Index, Limits, WorkerName};
    use super::QueryInput;
    use crate::protocols::{BlockHash, BlockStored, Event};

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct W(&'static str);

    impl WorkerName for W {
        fn label(&self) -> String {
            format!("{}/0", self.0)
        }
    }

    /// Pages of 2 tokens over 1..=6 with one lookahead token each (7 after the last), as vLLM with
    /// lookahead 1 sends them, or (`bigram`) as SGLang EAGLE's cells fold.
    fn store(bigram: bool) -> Event {
        Event::Stored(Box::new(BlockStored {
            block_hashes: (1..=3).map(BlockHash::Int).collect(),
            token_ids: (1..=6).collect(),
            block_size: 2,
            lookahead_token_ids: Some(vec![vec![3], vec![5], vec![7]]),
            bigram,
            ..BlockStored::default()
        }))
    }

    fn served(idx: &Index<W>, n: u32) -> Vec<(&'static str, i64)> {
        let mut q = idx.query(QueryInput {
            tokens: (1..=n).collect(),
            ..QueryInput::default()
        });
        let m = idx.find_matches(&mut q);
        assert_eq!(m.gpu, None);
        m.scores.iter().map(|s| (s.worker.0, s.blocks)).collect()
    }

    #[test]
    fn an_sglang_bigram_worker_is_served_a_page_less_when_the_prompt_minus_one_is_whole_pages() {
        let mut idx: Index<W> = Index::new(Limits::default());
        idx.apply(&W("vllm"), &store(false));
        idx.apply(&W("sglang"), &store(true));
        // n = 7: vLLM floor((7 - 1) / 2) = 3 pages, SGLang floor((7 - 2) / 2) = 2.
        assert_eq!(served(&idx, 7), vec![("vllm", 3), ("sglang", 2)]);
        // n = 8: both 3; n = 6: both 2; n = 3: SGLang's bigram view of 2 tokens is 1 bigram, no page.
        assert_eq!(served(&idx, 8), vec![("vllm", 3), ("sglang", 3)]);
        assert_eq!(served(&idx, 6), vec![("vllm", 2), ("sglang", 2)]);
        assert_eq!(served(&idx, 3), vec![("vllm", 1)]);
        assert_eq!(idx.bigram_workers, 1);
        // A cleared worker is forgotten, its mark too.
        idx.apply(&W("sglang"), &Event::Cleared);
        assert_eq!(idx.bigram_workers, 0);
        assert_eq!(served(&idx, 7), vec![("vllm", 3)]);
    }

    #[test]
    fn the_mark_survives_a_snapshot_and_a_worker_without_it_restores_as_before() {
        let mut idx: Index<W> = Index::new(Limits::default());
        idx.apply(&W("vllm"), &store(false));
        idx.apply(&W("sglang"), &store(true));
        let out = idx.export();
        assert_eq!(
            out.iter()
                .map(|(k, sw)| (k.0, sw.bigram))
                .collect::<Vec<_>>(),
            vec![("vllm", false), ("sglang", true)]
        );
        let mut back: Index<W> = Index::new(Limits::default());
        for (k, sw) in &out {
            back.import_worker(k, sw).unwrap();
        }
        assert_eq!(back.bigram_workers, 1);
        assert_eq!(served(&back, 7), vec![("vllm", 3), ("sglang", 2)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Limits;
    use crate::protocols::{medium_of, BlockHash, BlockStored, Event};

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct W(u32);

    impl WorkerName for W {
        fn label(&self) -> String {
            format!("w{}/0", self.0)
        }
    }

    const BS: usize = 2;

    fn store(idx: &mut Index<W>, w: u32, depth: usize, tokens: &[u32], medium: Option<&str>) {
        idx.apply(
            &W(w),
            &Event::Stored(Box::new(BlockStored {
                block_hashes: (1..=depth as u64).map(BlockHash::Int).collect(),
                token_ids: tokens[..depth * BS].iter().map(|&t| i64::from(t)).collect(),
                block_size: BS as i64,
                medium: medium.map(medium_of),
                ..BlockStored::default()
            })),
        );
    }

    type Answer = (Vec<(u32, i64)>, Option<Vec<(u32, i64)>>);

    fn answer(idx: &Index<W>, tokens: &[u32]) -> Answer {
        let mut q = idx.query(QueryInput {
            tokens: tokens.to_vec(),
            ..QueryInput::default()
        });
        let r = idx.find_matches(&mut q);
        let f = |v: &[Score<W>]| v.iter().map(|s| (s.worker.0, s.blocks)).collect::<Vec<_>>();
        (f(&r.scores), r.gpu.as_deref().map(f))
    }

    /// What the Python index answers: each worker its depth, capped at the blocks the prompt
    /// serves, recorded as it drops out (by depth, then slot; slot = worker here).
    fn expected(depths: &[(u32, usize, bool)], served: usize) -> Answer {
        let mut all: Vec<(u32, i64, bool)> = depths
            .iter()
            .filter(|d| d.1 > 0)
            .map(|&(w, d, cpu)| (w, d.min(served) as i64, cpu))
            .collect();
        all.sort_by_key(|&(w, d, _)| (d, w));
        let scores = all.iter().map(|&(w, d, _)| (w, d)).collect();
        let gpu = all
            .iter()
            .filter(|a| !a.2)
            .map(|&(w, d, _)| (w, d))
            .collect();
        (scores, Some(gpu))
    }

    #[test]
    fn a_fleet_sharing_a_prefix_is_matched_through_bit_sets_as_workers_come_and_go() {
        let tokens: Vec<u32> = (0..40).collect();
        let served = (tokens.len() - 1) / BS;
        let mut idx: Index<W> = Index::new(Limits::default());
        // 150 workers over three 64-slot words; two keep their blocks on CPU only (`G` holders,
        // a set's exceptions), so the GPU answer is tracked too.
        let mut depths: Vec<(u32, usize, bool)> = (0..150u32)
            .map(|w| (w, 1 + (w as usize * 7) % 20, w == 5 || w == 77))
            .collect();
        for &(w, d, cpu) in &depths {
            store(&mut idx, w, d, &tokens, cpu.then_some("CPU"));
        }
        let mut q = idx.query(QueryInput {
            tokens: tokens.clone(),
            ..QueryInput::default()
        });
        q.extend((BS as i64, 0), 1);
        let id = idx.table.id(&q.keys[&(BS as i64, 0)][0]).expect("held");
        assert!(matches!(idx.table.holders(id), Holders::Set { .. }));
        assert_eq!(answer(&idx, &tokens), expected(&depths, served));
        // A clear, then a removed worker: their slots leave every key's set.
        for w in (0..150u32).step_by(3) {
            idx.apply(&W(w), &Event::Cleared);
            depths[w as usize].1 = 0;
        }
        for w in (1..150u32).step_by(5) {
            idx.remove_worker(&W(w));
            depths[w as usize].1 = 0;
        }
        assert_eq!(answer(&idx, &tokens), expected(&depths, served));
        // A shorter prompt stops every worker at its end.
        assert_eq!(answer(&idx, &tokens[..9]), expected(&depths, 4));
        // Every worker gone: nothing left in any form.
        for w in 0..150u32 {
            idx.remove_worker(&W(w));
        }
        assert_eq!(answer(&idx, &tokens), (vec![], None));
        assert_eq!(idx.table.flag_key_counts(), [0; 5]);
    }
}
