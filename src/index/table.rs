//! The shared key table: content keys interned to u32 ids, each with its holders.
//!
//! A holder is one packed word, `slot << 5 | flags`. The flags are the Python index's shared
//! tables for that (key, worker): `H` (in `_holders`), `G` (in `_gpu_missing`), and the `CPU` /
//! `DISK` / `EXTERNAL` tier holders. Keeping them as separate bits (not one derived mask) keeps
//! every table update the Python index makes expressible one for one.
//!
//! Layout, for memory (a key is most often held by one worker): each id has a 24-byte record
//! (key, references, one holder word) in one vector; a key with two or more holders keeps them in
//! a side list the record points at. The id index is an open-addressing table of u32 slots (an
//! id and a few bits of the key's own hash), so no key is stored twice (`IdIndex`).
//!
//! A key many workers hold (a system prompt's blocks across a fleet) keeps them as a bit set over
//! slots instead, with the few holders whose flags are not exactly `H` listed beside it: the match
//! (query.rs) then intersects its alive set with the key word by word, 64 workers a step, instead
//! of walking one holder at a time, and the set is smaller than the list it replaces. A key moves
//! between the three forms as holders come and go, with hysteresis so it does not flap.

use crate::keys::Key;

pub(crate) const H: u8 = 1;
pub(crate) const G: u8 = 2;
/// The flag of an off-GPU tier bit of a Python tier mask (2: CPU, 4: DISK, 8: EXTERNAL).
pub(crate) const fn tier_flag(tbit: u8) -> u8 {
    tbit << 1
}
const FLAG_BITS: u32 = 5;
const FLAG_MASK: u32 = (1 << FLAG_BITS) - 1;

/// A record's `one` word when the key has no holder.
const NO_HOLDER: u32 = u32::MAX;
/// A record's `one` word tagged with this bit indexes a side entry (two or more holders): `lists`,
/// or `sets` when `SET` is set too. A holder word never has it: slots stay below 2^26
/// (`MAX_SLOTS`).
const MANY: u32 = 1 << 31;
const SET: u32 = 1 << 30;
/// The side entry's place in a tagged `one` word (`NO_HOLDER`'s bits never name a place: there
/// are fewer than 2^30 - 1 side entries of either kind).
const PLACE: u32 = SET - 1;
/// Workers one index can name at once (slot << 5 must leave the `MANY` bit clear).
pub(crate) const MAX_SLOTS: usize = 1 << (31 - FLAG_BITS);

/// One interned key: 24 bytes, alignment 4 (the key is a byte array).
#[derive(Clone, Copy)]
struct Rec {
    key: Key,
    /// engine-hash entries of workers' primary tables naming this key
    refs: u32,
    /// the only holder word, `NO_HOLDER`, `MANY | i` for `lists[i]`, `MANY | SET | i` for `sets[i]`
    one: u32,
}

impl Rec {
    /// Whether the record is in use (referenced or held): exactly the records the id index holds.
    #[inline]
    fn live(&self) -> bool {
        self.refs != 0 || self.one != NO_HOLDER
    }
}

/// The holders of a key with many: a bit per slot, and the holders whose flags are not `H`.
#[derive(Default)]
struct Bits {
    /// a bit per holding slot (any flags), up to the word of the highest one (no zero tail)
    present: Vec<u64>,
    /// the holder words of present slots whose flags are not exactly `H`, sorted by slot
    odd: Vec<u32>,
    /// slots present
    count: u32,
}

impl Bits {
    fn union(&self) -> u8 {
        let plain = if self.count as usize > self.odd.len() {
            H
        } else {
            0
        };
        self.odd.iter().fold(plain, |acc, &w| acc | flags_of(w))
    }

    fn flags(&self, slot: u32) -> u8 {
        let (wi, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        if self.present.get(wi).is_none_or(|&w| w & bit == 0) {
            return 0;
        }
        match self.odd.binary_search_by_key(&slot, |&w| slot_of(w)) {
            Ok(i) => flags_of(self.odd[i]),
            Err(_) => H,
        }
    }

    fn set(&mut self, slot: u32, flags: u8) {
        let (wi, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        let at = self.odd.binary_search_by_key(&slot, |&w| slot_of(w));
        if flags == 0 {
            if self.present.get(wi).is_some_and(|&w| w & bit != 0) {
                self.present[wi] &= !bit;
                self.count -= 1;
                while self.present.last() == Some(&0) {
                    self.present.pop();
                }
            }
            if let Ok(i) = at {
                self.odd.remove(i);
            }
            return;
        }
        if self.present.len() <= wi {
            self.present.resize(wi + 1, 0);
        }
        if self.present[wi] & bit == 0 {
            self.present[wi] |= bit;
            self.count += 1;
        }
        let word = slot << FLAG_BITS | u32::from(flags);
        match (at, flags == H) {
            (Ok(i), true) => {
                self.odd.remove(i);
            }
            (Ok(i), false) => self.odd[i] = word,
            (Err(i), false) => self.odd.insert(i, word),
            (Err(_), true) => {}
        }
    }

    /// The holder words, sorted by slot.
    fn words(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.count as usize);
        let mut odd = self.odd.iter().peekable();
        for (wi, &w) in self.present.iter().enumerate() {
            let mut left = w;
            while left != 0 {
                let slot = wi as u32 * 64 + left.trailing_zeros();
                left &= left - 1;
                match odd.peek() {
                    Some(&&o) if slot_of(o) == slot => {
                        out.push(o);
                        odd.next();
                    }
                    _ => out.push(slot << FLAG_BITS | u32::from(H)),
                }
            }
        }
        out
    }

    fn from_words(words: &[u32]) -> Bits {
        let mut b = Bits::default();
        for &w in words {
            b.set(slot_of(w), flags_of(w));
        }
        b
    }

    fn memory_bytes(&self) -> usize {
        self.present.capacity() * 8 + self.odd.capacity() * 4
    }
}

/// Words a bit set over slots up to `max_slot` takes.
fn words_for(max_slot: u32) -> usize {
    max_slot as usize / 64 + 1
}

/// A sorted holder list this long becomes a bit set: past about twice its words, the set is the
/// smaller of the two, and a match step over it costs a word per 64 slots, not one per holder.
fn list_is_dense(len: usize, max_slot: u32) -> bool {
    len >= 2 * words_for(max_slot) + 8
}

/// A bit set this sparse goes back to a list (well below `list_is_dense`, so a key near the line
/// does not move back and forth as one holder comes and goes).
fn set_is_sparse(b: &Bits) -> bool {
    (b.count as usize) <= b.present.len() / 2 + 4
}

/// A key's holders, as its representation keeps them (query.rs walks each form its own way).
#[derive(Clone, Copy)]
pub(crate) enum Holders<'a> {
    /// holder words, sorted by slot (none, one, or a side list)
    List(&'a [u32]),
    /// a bit per holding slot (any flags, `present[slot / 64] >> slot % 64`), and the words of
    /// the holders whose flags are not exactly `H` (sorted by slot; every other holder is `H`)
    Set { present: &'a [u64], odd: &'a [u32] },
}

impl Holders<'_> {
    /// Start bringing the holder words into cache ahead of their match step (query.rs issues
    /// a chunk's prefetches before stepping through it): the words up to the first four lines.
    #[inline]
    pub(crate) fn prefetch(&self) {
        match self {
            Holders::List(l) => prefetch_lines(l.as_ptr().cast(), std::mem::size_of_val(*l)),
            Holders::Set { present, odd } => {
                prefetch_lines(present.as_ptr().cast(), std::mem::size_of_val(*present));
                prefetch_lines(odd.as_ptr().cast(), std::mem::size_of_val(*odd));
            }
        }
    }
}

/// Cache lines `prefetch_lines` fetches at most: a set over 2,048 slots.
const PREFETCH_LINES: usize = 4;

/// Prefetch the cache lines of `len` bytes at `p` (at most `PREFETCH_LINES` of them).
#[inline]
pub(crate) fn prefetch_lines(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len && off < PREFETCH_LINES * 64 {
        prefetch(p.wrapping_add(off));
        off += 64;
    }
}

/// Fewest bytes of a table `huge_pages` asks huge pages for (a 2 MB page would mostly hold less).
const HUGE_FROM: usize = 4 << 20;

/// Ask Linux to back the pages of a large table with transparent huge pages (where they are
/// enabled "madvise", as on this machine, none is used unless asked). The index reads its big
/// tables at random: with 4 KB pages a new table of 40 MB took ~11,000 page faults as the first
/// keys moved in (14 ms in one store at 6.8M keys, session 17), and each random read risks a
/// TLB miss. Nothing happens elsewhere, or for a table below `HUGE_FROM`.
pub(crate) fn huge_pages<T>(v: &[T]) {
    #[cfg(target_os = "linux")]
    {
        let bytes = std::mem::size_of_val(v);
        if bytes < HUGE_FROM {
            return;
        }
        let page = 4096usize;
        let start = (v.as_ptr() as usize + page - 1) & !(page - 1);
        let end = (v.as_ptr() as usize + bytes) & !(page - 1);
        // SAFETY: the range is whole pages inside `v`'s own allocation. MADV_HUGEPAGE neither
        // reads nor writes the memory, only how the kernel backs it; an error (a kernel without
        // transparent huge pages) leaves everything as it was, so it is ignored.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// A hint to load the cache line at `p`. It never faults, whatever `p` is (an empty slice's
/// dangling pointer included), and does nothing off x86-64.
#[inline(always)]
pub(crate) fn prefetch(p: *const u8) {
    // SAFETY: SSE is part of the x86-64 baseline, and a prefetch is only a hint: it reads
    // nothing into the program and never faults, on any address. Pays for itself at fleet
    // scale (bench/bench_select.py's 1,024-worker figure; see the CHANGELOG).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The id index: key ids by key, in an open-addressing table of its own (linear probing over
/// one `Vec<u32>`), not a hashbrown table, for two reasons measured at fleet scale:
/// - a lookup's slot is `home(hash)`, known before anything is read, so a match prefetches the
///   slots of a whole chunk of keys first and their cache misses overlap (hashbrown does not
///   expose its buckets: the lookup pass stalled on each one in turn, ~17 % of a 1,024-worker
///   `select`);
/// - a slot is 4 bytes with no control byte, and the table grows by half, not by doubling, at
///   most 3/4 full: ~1.6 slots per key on average (hashbrown: ~1.65 buckets of 5 bytes).
///
/// A slot holds `tag << (id_bits + d) | dist << id_bits | (id + 1)` (0: empty), where `id_bits`
/// covers every id the records can name, `dist` (`d` bits, `DIST_BITS` while the ids leave room)
/// is how far the entry sits past its home, saturated at `2^d - 1`, and the tag is the key
/// hash's low bits in the rest of the word. A probe `k` slots past a key's home compares a
/// record's key only when tag and distance both match (an entry at another home has another
/// distance there): a false match is rarer than the tag alone would make it. The distance is
/// what a removal needs: it shifts back the run after the hole, and each shifted entry's home
/// is its slot less its distance, where it was a read of its record's key (a cache miss each
/// at 1M keys: 48 % of the removal's time, `perf`, a full engine's steady state; session 21).
/// The home is the hash's high bits scaled to the capacity, so any capacity works.
#[derive(Default)]
struct IdIndex {
    slots: Vec<u32>,
    len: usize,
    /// bits of a slot the id (+ 1) takes
    id_bits: u32,
    /// bits below the tag: the id's and the distance's (`set_id_bits`)
    low: u32,
    /// the saturated distance, `2^d - 1` for `d` distance bits (0 when the ids leave none:
    /// every entry's home is then read from its record)
    far: usize,
}

/// The empty slot a new key's probe ended on (`IdIndex::find_or_vacancy`), and how far past the
/// key's home it lies: the distance its entry will hold, known without computing the home again.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Vacancy {
    at: usize,
    past: usize,
}

/// How many records ahead of its insert a rebuild prefetches a record's new slot.
const REBUILD_AHEAD: usize = 16;

/// Most slots after a removed id's slot a removal looks at to prefetch the records of entries
/// whose distance saturated (a probe run past this is rare below 3/4 full).
const REMOVE_AHEAD: usize = 32;

/// Bits of a slot that hold its entry's distance from its home, where the ids leave room (up to
/// 2^28 ids): distances 0..=14 exact, 15 for any farther (whose home is then read from its
/// record). Linear probing at most 3/4 full puts an entry 1.5 slots past its home on average.
const DIST_BITS: u32 = 4;

/// The id bits an `IdIndex` takes for ids of `need_bits` bits: one bit of headroom, so the
/// records' growth does not re-encode the slots at each doubling; at least 16, at most 32.
#[inline]
fn id_bits_for(need_bits: u32) -> u32 {
    (need_bits + 1).clamp(16, 32)
}

/// A 64-bit hash scaled to a slot of `cap` (its high bits: any capacity, not only powers of two).
#[inline]
pub(crate) fn scaled(h: u64, cap: usize) -> usize {
    ((u128::from(h) * cap as u128) >> 64) as usize
}

/// Empty the slot `hole` of a linear-probing table, shifting back the entries after it whose
/// probe runs through it, so that no probe sequence has a hole (no tombstones: lookups never
/// slow down with churn). `is_empty` tells a slot that ends a run, `home` an entry's home slot
/// (given the slot it is in), `moved` what an entry becomes in a new slot (given that slot and
/// its home); the slot left over at the end becomes `empty`.
pub(crate) fn close_hole<S: Copy>(
    slots: &mut [S],
    mut hole: usize,
    empty: S,
    is_empty: impl Fn(&S) -> bool,
    home: impl Fn(&S, usize) -> usize,
    moved: impl Fn(S, usize, usize) -> S,
) {
    let cap = slots.len();
    let mut j = hole;
    loop {
        j += 1;
        if j == cap {
            j = 0;
        }
        let s = slots[j];
        if is_empty(&s) {
            break;
        }
        let h = home(&s, j);
        // The entry at j may fill the hole unless its home lies cyclically in (hole, j].
        let stays = if hole <= j {
            hole < h && h <= j
        } else {
            hole < h || h <= j
        };
        if !stays {
            slots[hole] = moved(s, hole, h);
            hole = j;
        }
    }
    slots[hole] = empty;
}

/// Bit `j` set when slot `group[j]` is empty or its tag (the bits `hi` selects) is `tag`.
/// On x86-64 the four compares are one SSE2 compare each (SSE2 is part of the x86-64 baseline,
/// so no detection): scalar, the four slots cost about as many instructions as probing them
/// one by one (callgrind).
#[cfg(target_arch = "x86_64")]
#[inline]
fn group_hits(group: &[u32; 4], tag: u32, hi: u32) -> u32 {
    // SAFETY: SSE2 is part of the x86-64 baseline: every x86-64 CPU has it, and rustc enables
    // it for every x86-64 target, so calling a function that requires it cannot fault.
    unsafe { group_hits_sse2(group, tag, hi) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
#[inline]
fn group_hits_sse2(group: &[u32; 4], tag: u32, hi: u32) -> u32 {
    use std::arch::x86_64::{
        _mm_and_si128, _mm_castsi128_ps, _mm_cmpeq_epi32, _mm_movemask_ps, _mm_or_si128,
        _mm_set1_epi32, _mm_set_epi32, _mm_setzero_si128,
    };
    let [a, b, c, d] = group.map(|s| s as i32);
    let v = _mm_set_epi32(d, c, b, a);
    let empty = _mm_cmpeq_epi32(v, _mm_setzero_si128());
    let tagged = _mm_cmpeq_epi32(
        _mm_and_si128(v, _mm_set1_epi32(hi as i32)),
        _mm_set1_epi32(tag as i32),
    );
    _mm_movemask_ps(_mm_castsi128_ps(_mm_or_si128(empty, tagged))) as u32
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn group_hits(group: &[u32; 4], tag: u32, hi: u32) -> u32 {
    group_hits_scalar(group, tag, hi)
}

/// `group_hits` one slot at a time (other targets; the tests hold the SSE2 one to it).
#[cfg(any(test, not(target_arch = "x86_64")))]
#[inline]
fn group_hits_scalar(group: &[u32; 4], tag: u32, hi: u32) -> u32 {
    let mut hits = 0u32;
    for (j, &s) in group.iter().enumerate() {
        hits |= u32::from(s == 0 || s & hi == tag) << j;
    }
    hits
}

/// Most keys an `IdIndex` of `cap` slots holds: 3/4 full. A removal shifts back every entry
/// of the run after it: ~30 at 7/8 full (linear probing's unsuccessful search), ~8 at 3/4. When
/// each shifted entry's home was a read of its record (a cache miss at 1M keys; session 21 keeps
/// the distance in the slot instead), 7/8 → 3/4 took a full engine's steady-state apply (as
/// many removals as stores) to ~0.85 × its CPU (session 20, alternated); a fill from empty was
/// level, and memory per (block, worker) entry at 1M entries unchanged (the slots are 4 bytes:
/// ~0.8 B a key more on average). The workers' `IntMap`s stay at 7/8: at 12 bytes a slot, 3/4
/// cost 4 B an entry.
fn max_load(cap: usize) -> usize {
    cap - cap / 4
}

/// The distance bits (above `id_bits`, saturated at `far`) of an entry `k` slots past its home.
/// Free functions, as `IdIndex::remove` needs them while its slots are borrowed for `close_hole`.
#[inline]
fn dist_field(k: usize, id_bits: u32, far: usize) -> u32 {
    // (`far` is 0 when `id_bits` is 32: the shift, masked to 0 then, shifts a 0)
    (k.min(far) as u32).wrapping_shl(id_bits)
}

/// The distance slot `s` holds (`far` when saturated).
#[inline]
fn dist_of(s: u32, id_bits: u32, far: usize) -> usize {
    (u64::from(s) >> id_bits) as usize & far
}

/// How far slot `i` of a table of `cap` slots lies past slot `home`, cyclically.
#[inline]
fn past(home: usize, i: usize, cap: usize) -> usize {
    if i >= home {
        i - home
    } else {
        i + cap - home
    }
}

impl IdIndex {
    #[inline]
    fn home(&self, h: u64) -> usize {
        scaled(h, self.slots.len())
    }

    /// An empty table of `cap` slots for ids of `id_bits` bits.
    fn new(cap: usize, id_bits: u32) -> IdIndex {
        let slots = vec![0; cap];
        huge_pages(&slots);
        let mut ix = IdIndex {
            slots,
            ..IdIndex::default()
        };
        ix.set_id_bits(id_bits);
        ix
    }

    /// Give the ids `id_bits` bits (1..=32), the distance `DIST_BITS` of what they leave, the
    /// tag the rest (the slots are not re-encoded: `widen` does that).
    fn set_id_bits(&mut self, id_bits: u32) {
        debug_assert!((1..=32).contains(&id_bits));
        let dist_bits = (32 - id_bits).min(DIST_BITS);
        self.id_bits = id_bits;
        self.low = id_bits + dist_bits;
        self.far = (1 << dist_bits) - 1;
    }

    /// A slot's tag bits for hash `h` (the distance and id bits 0).
    #[inline]
    fn tag(&self, h: u64) -> u32 {
        // `low` is at most 32: the shifts stay in range in u64.
        ((h & ((1u64 << (32 - self.low)) - 1)) << self.low) as u32
    }

    /// The bits of a slot that hold its tag.
    #[inline]
    fn tag_mask(&self) -> u32 {
        !(((1u64 << self.low) - 1) as u32)
    }

    #[inline]
    fn id_mask(&self) -> u32 {
        ((1u64 << self.id_bits) - 1) as u32
    }

    /// The distance bits of an entry `k` slots past its home.
    #[inline]
    fn dist_field(&self, k: usize) -> u32 {
        dist_field(k, self.id_bits, self.far)
    }

    /// The distance slot `s` holds (`far` when saturated).
    #[inline]
    fn dist_of(&self, s: u32) -> usize {
        dist_of(s, self.id_bits, self.far)
    }

    /// How far slot `i` lies past slot `home`, cyclically.
    #[inline]
    fn past(&self, home: usize, i: usize) -> usize {
        past(home, i, self.slots.len())
    }

    /// Start bringing the slot a lookup of hash `h` reads first into cache.
    #[inline]
    fn prefetch(&self, h: u64) {
        if !self.slots.is_empty() {
            prefetch(self.slots.as_ptr().wrapping_add(self.home(h)).cast());
        }
    }

    /// Start bringing the two lines a new key's probe of hash `h` reads into cache: its home's
    /// and the next. A new key's probe runs to an empty slot, on average ~3 slots at 1/2 full
    /// and ~8 at 3/4 (linear probing's unsuccessful search), past its home's line about half
    /// the time; a present key's is a slot or two, where `prefetch` does.
    #[inline]
    fn prefetch_run(&self, h: u64) {
        if !self.slots.is_empty() {
            prefetch_lines(self.slots.as_ptr().wrapping_add(self.home(h)).cast(), 128);
        }
    }

    /// The id whose record holds `key` (hashed `h`).
    #[inline]
    fn find(&self, h: u64, key: &Key, recs: &[Rec]) -> Option<u32> {
        // Slot by slot: a query's keys are mostly present and found within a slot or two, where
        // the four-slot step of `find_or_vacancy` cost more (callgrind, `bench/callgrind_select.py`
        // `find_matches`: 708k instructions a call slot by slot, 712k with the step out of line,
        // 723k inlined).
        let cap = self.slots.len();
        if cap == 0 {
            return None;
        }
        let (tag, mask) = (self.tag(h), self.id_mask());
        let mut i = self.home(h);
        // slots probed so far: the distance the key's entry holds if it is at `i`
        let mut k = 0;
        loop {
            let s = self.slots[i];
            if s == 0 {
                return None;
            }
            if s & !mask == tag | self.dist_field(k) {
                let id = (s & mask) - 1;
                if recs[id as usize].key == *key {
                    return Some(id);
                }
            }
            k += 1;
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// The id whose record holds `key` (hashed `h`), or else the empty slot its probe ended on
    /// (at `usize::MAX` when there are no slots): a new key goes there unless the table is rebuilt
    /// first, so an insert does not probe a second time. The store path's lookup (`retain_key`),
    /// always inlined there: with the four-slot step LLVM left it out of line, whose call cost
    /// ~25 instructions a key (callgrind).
    #[inline(always)]
    fn find_or_vacancy(&self, h: u64, key: &Key, recs: &[Rec]) -> Result<u32, Vacancy> {
        let cap = self.slots.len();
        if cap == 0 {
            return Err(Vacancy {
                at: usize::MAX,
                past: 0,
            });
        }
        let (tag, mask) = (self.tag(h), self.id_mask());
        let mut i = self.home(h);
        // slots probed so far: the distance a key at `i` would hold
        let mut k = 0;
        loop {
            // Four slots a step: which of them end the probe (empty) or may hold the key (its
            // tag), as one bit mask; a tagged slot's distance is checked before its record is
            // read. A new key's probe (most of a fill's lookups) runs to an empty slot, ~5 slots
            // on average between 1/2 and 3/4 full; slot by slot that was 14 instructions a slot
            // (callgrind, `bench/callgrind_ingest.py`).
            if let Some(group) = self.slots.get(i..).and_then(|g| g.first_chunk::<4>()) {
                let mut hits = group_hits(group, tag, self.tag_mask());
                while hits != 0 {
                    let j = hits.trailing_zeros() as usize;
                    let s = group[j];
                    if s == 0 {
                        return Err(Vacancy {
                            at: i + j,
                            past: k + j,
                        });
                    }
                    if s & !mask == tag | self.dist_field(k + j) {
                        let id = (s & mask) - 1;
                        if recs[id as usize].key == *key {
                            return Ok(id);
                        }
                    }
                    hits &= hits - 1;
                }
                i += 4;
                k += 4;
                if i == cap {
                    i = 0;
                }
                continue;
            }
            // The last three slots, one by one, then on from slot 0.
            let s = self.slots[i];
            if s == 0 {
                return Err(Vacancy { at: i, past: k });
            }
            if s & !mask == tag | self.dist_field(k) {
                let id = (s & mask) - 1;
                if recs[id as usize].key == *key {
                    return Ok(id);
                }
            }
            i += 1;
            k += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// Widen the id bits to hold ids of `need_bits` bits (with `grown`'s headroom) without moving
    /// any slot: a slot's home is its hash scaled to the capacity, which is unchanged, and its
    /// new, shorter tag is the low bits of the tag it has, so no record is read. The records'
    /// passing 2^20 ids at ~1M keys rebuilt the table from every record instead (a random write
    /// a key, and the 24-byte records streamed: most of `bench_fill.py`'s `at1M` window,
    /// callgrind); this is one pass over the slots in order.
    fn widen(&mut self, need_bits: u32) {
        let bits = id_bits_for(need_bits);
        let old = self.id_bits;
        debug_assert!(old >= 1 && bits > old);
        let (old_mask, old_low, old_far) = (self.id_mask(), self.low, self.far);
        self.set_id_bits(bits);
        // The distance keeps its value (saturated anew when the ids leave fewer bits for it);
        // the tag keeps its low bits, `32 - low` of them (u64, so a 32-bit id leaves none).
        let (low, far) = (self.low, self.far as u64);
        let tag_mask = (1u64 << (32 - low)) - 1;
        // No branch on empty slots: an empty slot (0) maps to 0 by the same arithmetic, and
        // the loop vectorises. With the branch, a pass over 6.8M slots took 26 ms (session 17:
        // a mispredicted branch on every other slot), one store's stall at 4.2M keys.
        for s in &mut self.slots {
            let w = u64::from(*s);
            let tag = ((w >> old_low) & tag_mask) << low;
            let d = ((w >> old) & old_far as u64).min(far) << bits;
            *s = (tag | d) as u32 | (*s & old_mask);
        }
    }

    /// The capacity and id bits a growth to room for `want` keys and ids of `need_bits` bits
    /// takes: by half until they fit, and one bit of headroom, so the records' growth does not
    /// rebuild at each doubling (at least 16).
    fn grown(&self, want: usize, need_bits: u32) -> (usize, u32) {
        let mut cap = self.slots.len().max(16);
        while max_load(cap) < want {
            cap += cap / 2;
        }
        let bits = if need_bits <= self.id_bits {
            self.id_bits
        } else {
            id_bits_for(need_bits)
        };
        (cap, bits)
    }

    /// A new table of `cap` slots and `id_bits`, holding every live record's id. The records
    /// are read in order (a live record is one `maybe_free` has not freed: referenced or held),
    /// so a rebuild streams through them instead of missing the cache on each.
    fn rebuild(&mut self, cap: usize, id_bits: u32, recs: &[Rec]) {
        let len = self.len;
        *self = IdIndex::new(cap, id_bits);
        self.place_live(recs, 0..recs.len() as u32);
        debug_assert_eq!(self.len, len, "every indexed key is a live record");
    }

    /// Index the live records among ids `ids` (none indexed yet); how many there were. The
    /// records stream in order, but their homes in the table are random: the slot of the record
    /// `REBUILD_AHEAD` places on is prefetched, so the misses overlap (a rebuild stalled on each
    /// in turn: most of a fill's time in the key index).
    fn place_live(&mut self, recs: &[Rec], ids: std::ops::Range<u32>) -> usize {
        let mut placed = 0;
        let span = &recs[ids.start as usize..ids.end as usize];
        for (id, rec) in ids.zip(span) {
            if let Some(ahead) = recs.get(id as usize + REBUILD_AHEAD) {
                self.prefetch(hash(&ahead.key));
            }
            if rec.live() {
                self.insert(hash(&rec.key), id);
                placed += 1;
            }
        }
        placed
    }

    /// Index `id` under hash `h` at `vacancy`, the empty slot `find_or_vacancy` ended on (no
    /// rebuild since).
    #[inline]
    fn insert_at(&mut self, vacancy: Vacancy, h: u64, id: u32) {
        let Vacancy { at, past } = vacancy;
        debug_assert_eq!(self.slots[at], 0);
        debug_assert_eq!(past, self.past(self.home(h), at));
        self.slots[at] = self.tag(h) | self.dist_field(past) | (id + 1);
        self.len += 1;
    }

    /// Index `id` under hash `h` (not indexed yet; room made by `reserve_one`).
    #[inline]
    fn insert(&mut self, h: u64, id: u32) {
        let cap = self.slots.len();
        let home = self.home(h);
        let mut i = home;
        while self.slots[i] != 0 {
            i += 1;
            if i == cap {
                i = 0;
            }
        }
        self.slots[i] = self.tag(h) | self.dist_field(self.past(home, i)) | (id + 1);
        self.len += 1;
    }

    /// Take `id` (hashed `h`) out, shifting the entries after it back so that no probe
    /// sequence has a hole (no tombstones: lookups never slow down with churn).
    fn remove(&mut self, h: u64, id: u32, recs: &[Rec]) {
        let cap = self.slots.len();
        let mask = self.id_mask();
        let mut i = self.home(h);
        while self.slots[i] & mask != id + 1 {
            if self.slots[i] == 0 {
                // `id` is not here (no caller removes an id twice): the empty slot ends its
                // probe; looping on would spin for ever with the index's write lock held.
                return;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
        // `close_hole` needs the home of every entry after the hole up to the run's end: its slot
        // less its distance, or, where the distance saturated, its record's key (at 1M keys a
        // miss each, taken one after another: requested first, they overlap).
        let far = self.far;
        let mut j = i;
        for _ in 0..REMOVE_AHEAD {
            j += 1;
            if j == cap {
                j = 0;
            }
            let s = self.slots[j];
            if s == 0 {
                break;
            }
            if self.dist_of(s) == far {
                prefetch(recs.as_ptr().wrapping_add(((s & mask) - 1) as usize).cast());
            }
        }
        let id_bits = self.id_bits;
        let dist_mask = dist_field(far, id_bits, far);
        close_hole(
            &mut self.slots,
            i,
            0,
            |&s| s == 0,
            |&s, at| match dist_of(s, id_bits, far) {
                d if d == far => scaled(hash(&recs[((s & mask) - 1) as usize].key), cap),
                // `at` less `d`, cyclically
                d => past(d, at, cap),
            },
            |s, to, home| s & !dist_mask | dist_field(past(home, to, cap), id_bits, far),
        );
        self.len -= 1;
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mask = self.id_mask();
        self.slots
            .iter()
            .filter(|&&s| s != 0)
            .map(move |&s| (s & mask) - 1)
    }

    fn memory_bytes(&self) -> usize {
        self.slots.capacity() * 4
    }
}

/// Fewest entries a growth moves a few at a time (`Moving` here, `OldSlots` for a worker's
/// table); a smaller table re-places them all at once (at 64k entries that takes well under a
/// millisecond). The unit tests move small tables too.
pub(crate) const MOVE_FROM: usize = if cfg!(test) { 64 } else { 1 << 16 };

/// A growth moves every entry within this fraction of the inserts the new table takes before it
/// grows again. Filling to 6.6M entries with `find_matches` on another thread (session 17): 1/8
/// kept queries' p99 near 100 µs but slowed their p50 by a third (both tables probed over a longer
/// window); 1/128 left p50 alone and put p99 at 410 µs (stores moving ~10k entries each); 1/32,
/// taken: p50 as before, p99 180 µs, and no wait beyond 10 ms where re-placing at once made
/// queries wait up to 150 ms. The unit tests take 1/4, so their small tables move for a while.
pub(crate) const MOVE_SPREAD: usize = if cfg!(test) { 4 } else { 32 };

/// The id index as the key table keeps it: one `IdIndex` and, while a growth is under way, the
/// one it replaces (`Moving`), whose keys move into the new one a few records per key interned
/// or freed.
///
/// Re-placing every key at once stalled the store that grew the table, and every query waiting
/// for the index's lock, for a time that grows with the index: 14 ms at 1.3M keys, 33 ms at
/// 3.0M, 82 ms at 6.8M (session 17, one store each, one process), and the replicas of a
/// JetStream fleet, holding the same keys, grew in the same second (docs/performance.md
/// "Session 17"). Moving keys costs the same in all, spread over the stores after the growth.
///
/// While keys move, no record id is reused (the key table appends), so a live record below
/// `next` or from `end` on is in the new table only, and one in `next..end` in the old table
/// only. The old table keeps the entries of moved records (removing each would shift its probe
/// run back): a lookup there counts only ids in `next..end`.
#[derive(Default)]
struct Ids {
    cur: IdIndex,
    moving: Option<Box<Moving>>,
}

/// A growth under way: the table it replaces, and which records have moved out of it.
struct Moving {
    old: IdIndex,
    /// the next record id to move: every live record below it is in the new table
    next: u32,
    /// the records' length when the growth began (later records never were in `old`)
    end: u32,
    /// live records in `next..end`, each in `old` and not yet in the new table
    left: usize,
    /// records moved per key interned or freed
    pace: u32,
}

impl Moving {
    /// Whether record `id` is indexed in the old table: one of its records not moved yet.
    #[inline]
    fn unmoved(&self, id: u32) -> bool {
        self.next <= id && id < self.end
    }

    /// The id of `key` in the old table, if that record has not moved yet.
    #[inline]
    fn find(&self, h: u64, key: &Key, recs: &[Rec]) -> Option<u32> {
        self.old.find(h, key, recs).filter(|&id| self.unmoved(id))
    }
}

impl Ids {
    /// Whether a growth is moving keys (record ids are not reused meanwhile).
    #[inline]
    fn moving(&self) -> bool {
        self.moving.is_some()
    }

    /// Keys indexed.
    fn len(&self) -> usize {
        self.cur.len + self.moving.as_ref().map_or(0, |m| m.left)
    }

    #[inline]
    fn find(&self, h: u64, key: &Key, recs: &[Rec]) -> Option<u32> {
        match self.cur.find(h, key, recs) {
            None => self.moving.as_ref()?.find(h, key, recs),
            got => got,
        }
    }

    /// `IdIndex::find_or_vacancy` over both tables: the vacancy is always the new table's.
    #[inline(always)]
    fn find_or_vacancy(&self, h: u64, key: &Key, recs: &[Rec]) -> Result<u32, Vacancy> {
        let got = self.cur.find_or_vacancy(h, key, recs);
        if let (Err(_), Some(m)) = (&got, &self.moving) {
            if let Some(id) = m.find(h, key, recs) {
                return Ok(id);
            }
        }
        got
    }

    #[inline]
    fn prefetch(&self, h: u64) {
        self.cur.prefetch(h);
        if let Some(m) = &self.moving {
            m.old.prefetch(h);
        }
    }

    #[inline]
    fn prefetch_run(&self, h: u64) {
        self.cur.prefetch_run(h);
        if let Some(m) = &self.moving {
            m.old.prefetch_run(h);
        }
    }

    /// Make room for one more key whose id is below `ids` (the records' length after it is
    /// placed): move the next records of a growth under way, widen the id bits, or begin a
    /// growth. True when any slot moved (a vacancy found before is stale).
    fn reserve_one(&mut self, ids: usize, recs: &[Rec]) -> bool {
        // (the check inline: `step` is a call, and most keys come with no growth under way)
        let stepped = self.moving.is_some() && self.step(recs);
        let need_bits = (usize::BITS - ids.leading_zeros()).max(1);
        let fits = self.len() < max_load(self.cur.slots.len());
        if fits && need_bits <= self.cur.id_bits {
            return stepped;
        }
        self.make_room(fits, need_bits, recs)
    }

    /// `reserve_one`'s rare part, out of line so that its common path stays small enough to
    /// inline: widen the id bits, or begin a growth. Always true (slots moved).
    #[cold]
    #[inline(never)]
    fn make_room(&mut self, fits: bool, need_bits: u32, recs: &[Rec]) -> bool {
        if fits {
            // Only the ids outgrew their bits: re-encode the new table's slots where they are
            // (the old table's ids all fit its own bits).
            self.cur.widen(need_bits);
            return true;
        }
        // The pace ends a growth long before the new table fills: this is a table that was
        // too small to move keys a few at a time, or a store far larger than the table.
        self.finish(recs);
        let (cap, bits) = self.cur.grown(self.cur.len + 1, need_bits);
        if self.cur.len < MOVE_FROM {
            self.cur.rebuild(cap, bits, recs);
            return true;
        }
        let old = std::mem::replace(&mut self.cur, IdIndex::new(cap, bits));
        // Every record moves within `MOVE_SPREAD` of the keys the new table takes before it
        // grows again.
        let room = max_load(cap) - old.len;
        let pace = recs.len().div_ceil((room / MOVE_SPREAD).max(1)) + 1;
        self.moving = Some(Box::new(Moving {
            left: old.len,
            old,
            next: 0,
            end: u32::try_from(recs.len()).expect("ids fit u32"),
            pace: u32::try_from(pace).unwrap_or(u32::MAX),
        }));
        true
    }

    /// Move the next `pace` records of a growth under way into the new table; the old table
    /// goes after the last. True when a growth was under way.
    #[inline(never)]
    fn step(&mut self, recs: &[Rec]) -> bool {
        let Some(m) = self.moving.as_deref_mut() else {
            return false;
        };
        let stop = m.next.saturating_add(m.pace).min(m.end);
        m.left -= self.cur.place_live(recs, m.next..stop);
        m.next = stop;
        if stop == m.end {
            debug_assert_eq!(m.left, 0, "every live record moved");
            self.moving = None;
        }
        true
    }

    /// Move every record a growth under way has left.
    fn finish(&mut self, recs: &[Rec]) {
        if let Some(m) = self.moving.as_deref_mut() {
            m.pace = u32::MAX;
        }
        self.step(recs);
    }

    /// Index `id` under hash `h` at `vacancy` (`find_or_vacancy`'s, no slot moved since).
    #[inline]
    fn insert_at(&mut self, vacancy: Vacancy, h: u64, id: u32) {
        self.cur.insert_at(vacancy, h, id);
    }

    /// Index `id` under hash `h` (a new record: room made by `reserve_one`).
    #[inline]
    fn insert(&mut self, h: u64, id: u32) {
        self.cur.insert(h, id);
    }

    /// Take `id` (hashed `h`) out of the table that holds it. A removal moves the next records
    /// of a growth under way too, so a growth ends even while no new key comes (a fleet that only
    /// evicts), and lookups stop probing two tables.
    fn remove(&mut self, h: u64, id: u32, recs: &[Rec]) {
        let Some(m) = self.moving.as_deref_mut() else {
            self.cur.remove(h, id, recs);
            return;
        };
        if m.unmoved(id) {
            m.old.remove(h, id, recs);
            m.left -= 1;
        } else {
            self.cur.remove(h, id, recs);
        }
        // `id`'s record is no longer live (its caller frees it): a step passes it by.
        self.step(recs);
    }

    /// Every indexed id, once.
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let unmoved = self
            .moving
            .as_deref()
            .map(|m| m.old.iter().filter(move |&id| m.unmoved(id)));
        self.cur.iter().chain(unmoved.into_iter().flatten())
    }

    fn memory_bytes(&self) -> usize {
        self.cur.memory_bytes() + self.moving.as_ref().map_or(0, |m| m.old.memory_bytes())
    }
}

/// How many keys ahead of its lookup a key's id-index slot is prefetched (query.rs).
pub(crate) const LOOKUP_AHEAD: usize = 8;

/// Ids by key: the id index holds only the 4-byte ids (and tags), compared through `recs`.
#[derive(Default)]
pub(crate) struct KeyTable {
    ids: Ids,
    recs: Vec<Rec>,
    free: Vec<u32>,
    /// holder lists of keys with two or more holders (sorted by slot), and their free places
    lists: Vec<Vec<u32>>,
    lists_free: Vec<u32>,
    /// holder sets of keys with many holders, and their free places
    sets: Vec<Bits>,
    sets_free: Vec<u32>,
    /// keys with at least one holder with each flag (`len(_holders)`, `len(_gpu_missing)`, ...)
    flag_keys: [usize; 5],
}

#[inline]
pub(crate) fn slot_of(word: u32) -> u32 {
    word >> FLAG_BITS
}

#[inline]
pub(crate) fn flags_of(word: u32) -> u8 {
    (word & FLAG_MASK) as u8
}

/// A key's place in the id index: its first eight bytes. A key is an XXH3-128 digest, already
/// uniformly spread, so hashing it again would only cost time.
#[inline]
fn hash(key: &Key) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[..8]);
    u64::from_le_bytes(b)
}

fn union(words: &[u32]) -> u8 {
    words.iter().fold(0u8, |acc, &w| acc | flags_of(w))
}

/// Put `v` in a free place of `store` (or a new one) and return the place.
fn place<T>(store: &mut Vec<T>, free: &mut Vec<u32>, v: T) -> u32 {
    match free.pop() {
        Some(at) => {
            store[at as usize] = v;
            at
        }
        None => {
            store.push(v);
            (store.len() - 1) as u32
        }
    }
}

impl KeyTable {
    pub(crate) fn id(&self, key: &Key) -> Option<u32> {
        self.ids.find(hash(key), key, &self.recs)
    }

    /// Start bringing the id index's slot for `key` into cache, for an `id` or `retain_key`
    /// call a few keys later (a chunk's or a store's keys are prefetched before the first).
    #[inline]
    pub(crate) fn prefetch_key(&self, key: &Key) {
        self.ids.prefetch(hash(key));
    }

    /// `prefetch_key` for the store path, whose keys are mostly new: the two lines a new key's
    /// probe reads (`IdIndex::prefetch_run`).
    #[inline]
    pub(crate) fn prefetch_new_key(&self, key: &Key) {
        self.ids.prefetch_run(hash(key));
    }

    /// Start bringing key `id`'s record into cache (a removal's, a little before it reads it).
    #[inline]
    pub(crate) fn prefetch_record(&self, id: u32) {
        prefetch(self.recs.as_ptr().wrapping_add(id as usize).cast());
    }

    /// Start bringing the id-index slot that a removal of key `id` would start at into cache,
    /// with the line after it (the run the removal shifts back), for a `release` a little later
    /// that may free the key: at a full engine's steady state nearly every removal frees its key,
    /// and that slot was a cache miss on the removal's path.
    #[inline]
    pub(crate) fn prefetch_key_slot(&self, id: u32) {
        self.ids.prefetch_run(hash(&self.recs[id as usize].key));
    }

    pub(crate) fn key(&self, id: u32) -> &Key {
        &self.recs[id as usize].key
    }

    /// The id of `key`, interned if new, with one more reference.
    pub(crate) fn retain_key(&mut self, key: &Key) -> u32 {
        self.retain_key_new(key).0
    }

    /// `retain_key`, and whether the key was interned by this call: a new record, with one
    /// reference and no holder (the store path then knows, without reading the record back,
    /// that no worker holds it, and gives it its first holder with `set_first_holder`).
    #[inline]
    pub(crate) fn retain_key_new(&mut self, key: &Key) -> (u32, bool) {
        let h = hash(key);
        let vacancy = match self.ids.find_or_vacancy(h, key, &self.recs) {
            Ok(id) => {
                self.recs[id as usize].refs += 1;
                return (id, false);
            }
            Err(at) => at,
        };
        // The id is at most the records' length (a free one, or a new record at the end).
        let rebuilt = self.ids.reserve_one(self.recs.len() + 1, &self.recs);
        let rec = Rec {
            key: *key,
            refs: 1,
            one: NO_HOLDER,
        };
        let id = if self.ids.moving() {
            // No id is reused while a growth moves keys (`Ids`).
            self.recs.push(rec);
            (self.recs.len() - 1) as u32
        } else {
            place(&mut self.recs, &mut self.free, rec)
        };
        if rebuilt {
            self.ids.insert(h, id);
        } else {
            self.ids.insert_at(vacancy, h, id);
        }
        (id, true)
    }

    /// `set_flags(id, slot, flags)` for a key with no holder yet (one `retain_key_new` just
    /// interned, not held since), `flags` not 0: the holder word goes inline and the key counts
    /// once per flag. The store path's common case, without `set_flags`'s reading of the
    /// record's form and its side entries (callgrind: ~49 instructions a block went to
    /// `set_flags` on `bench/callgrind_ingest.py`'s streams).
    #[inline]
    pub(crate) fn set_first_holder(&mut self, id: u32, slot: u32, flags: u8) {
        debug_assert!((slot as usize) < MAX_SLOTS && flags != 0);
        let rec = &mut self.recs[id as usize];
        debug_assert_eq!(rec.one, NO_HOLDER, "a first holder only");
        rec.one = slot << FLAG_BITS | u32::from(flags);
        self.count_flags(0, flags);
    }

    pub(crate) fn retain(&mut self, id: u32) {
        self.recs[id as usize].refs += 1;
    }

    /// One reference fewer; the key goes once nothing refers to it and nobody holds it.
    pub(crate) fn release(&mut self, id: u32) {
        self.recs[id as usize].refs -= 1;
        self.maybe_free(id);
    }

    fn maybe_free(&mut self, id: u32) {
        let rec = self.recs[id as usize];
        if !rec.live() {
            self.ids.remove(hash(&rec.key), id, &self.recs);
            self.free.push(id);
        }
    }

    /// Start bringing key `id`'s side entry (its holder list's or set's header) into cache,
    /// for a `holders` call a few keys later. Its place is known from the record alone.
    #[inline]
    pub(crate) fn prefetch_side(&self, id: u32) {
        let one = self.recs[id as usize].one;
        if one != NO_HOLDER && one & MANY != 0 {
            let at = (one & PLACE) as usize;
            let p: *const u8 = if one & SET == 0 {
                self.lists.as_ptr().wrapping_add(at).cast()
            } else {
                self.sets.as_ptr().wrapping_add(at).cast()
            };
            prefetch(p);
        }
    }

    /// The holders of key `id`, in the form the table keeps them.
    #[inline]
    pub(crate) fn holders(&self, id: u32) -> Holders<'_> {
        let rec = &self.recs[id as usize];
        match rec.one {
            NO_HOLDER => Holders::List(&[]),
            w if w & MANY == 0 => Holders::List(std::slice::from_ref(&rec.one)),
            w if w & SET == 0 => Holders::List(&self.lists[(w & PLACE) as usize]),
            w => {
                let b = &self.sets[(w & PLACE) as usize];
                Holders::Set {
                    present: &b.present,
                    odd: &b.odd,
                }
            }
        }
    }

    /// The holder words of key `id`, sorted by slot, whatever its form (tests, diagnostics).
    #[cfg(test)]
    pub(crate) fn holder_words(&self, id: u32) -> Vec<u32> {
        match self.recs[id as usize].one {
            w if w != NO_HOLDER && w & MANY != 0 && w & SET != 0 => {
                self.sets[(w & PLACE) as usize].words()
            }
            _ => match self.holders(id) {
                Holders::List(l) => l.to_vec(),
                Holders::Set { .. } => unreachable!("a set is tagged SET"),
            },
        }
    }

    /// The union of the flags of key `id`'s holders.
    fn union_of(&self, id: u32) -> u8 {
        match self.recs[id as usize].one {
            NO_HOLDER => 0,
            w if w & MANY == 0 => flags_of(w),
            w if w & SET == 0 => union(&self.lists[(w & PLACE) as usize]),
            w => self.sets[(w & PLACE) as usize].union(),
        }
    }

    /// The flags of `slot` on key `id` (0: none).
    pub(crate) fn flags(&self, id: u32, slot: u32) -> u8 {
        match self.recs[id as usize].one {
            NO_HOLDER => 0,
            w if w & MANY == 0 => {
                if slot_of(w) == slot {
                    flags_of(w)
                } else {
                    0
                }
            }
            w if w & SET == 0 => {
                let h = &self.lists[(w & PLACE) as usize];
                match h.binary_search_by_key(&slot, |&w| slot_of(w)) {
                    Ok(i) => flags_of(h[i]),
                    Err(_) => 0,
                }
            }
            w => self.sets[(w & PLACE) as usize].flags(slot),
        }
    }

    /// Set the flags of `slot` on key `id` (0 removes the holder).
    pub(crate) fn set_flags(&mut self, id: u32, slot: u32, flags: u8) {
        debug_assert!((slot as usize) < MAX_SLOTS);
        let one = self.recs[id as usize].one;
        if one == NO_HOLDER && flags != 0 {
            // A key's first holder (the store path's common case): nothing to free after it.
            self.set_first_holder(id, slot, flags);
            return;
        }
        let word = slot << FLAG_BITS | u32::from(flags);
        let (before, after) = if one == NO_HOLDER {
            (0, 0) // nothing held and nothing set (a first holder returned above)
        } else if one & MANY == 0 {
            let before = flags_of(one);
            if slot_of(one) == slot {
                self.recs[id as usize].one = if flags == 0 { NO_HOLDER } else { word };
                (before, flags)
            } else {
                if flags != 0 {
                    // A second holder: the pair moves to a side list.
                    let pair = if slot_of(one) < slot {
                        vec![one, word]
                    } else {
                        vec![word, one]
                    };
                    let at = place(&mut self.lists, &mut self.lists_free, pair);
                    self.recs[id as usize].one = MANY | at;
                }
                (before, before | flags)
            }
        } else if one & SET == 0 {
            let at = (one & PLACE) as usize;
            let list = &mut self.lists[at];
            let before = union(list);
            match list.binary_search_by_key(&slot, |&w| slot_of(w)) {
                Ok(i) => {
                    if flags == 0 {
                        list.remove(i);
                    } else {
                        list[i] = word;
                    }
                }
                Err(i) => {
                    if flags != 0 {
                        list.insert(i, word);
                    }
                }
            }
            let after = union(list);
            if list.len() == 1 {
                // Back to one holder: inline again, the side list's place reused.
                self.recs[id as usize].one = list[0];
                self.lists[at] = Vec::new();
                self.lists_free.push(at as u32);
            } else if list_is_dense(list.len(), slot_of(list[list.len() - 1])) {
                let bits = Bits::from_words(list);
                self.lists[at] = Vec::new();
                self.lists_free.push(at as u32);
                let to = place(&mut self.sets, &mut self.sets_free, bits);
                self.recs[id as usize].one = MANY | SET | to;
            }
            (before, after)
        } else {
            let at = (one & PLACE) as usize;
            let bits = &mut self.sets[at];
            let before = bits.union();
            bits.set(slot, flags);
            let after = bits.union();
            if set_is_sparse(bits) {
                let words = bits.words();
                self.sets[at] = Bits::default();
                self.sets_free.push(at as u32);
                self.recs[id as usize].one = match words.len() {
                    0 => NO_HOLDER,
                    1 => words[0],
                    _ => MANY | place(&mut self.lists, &mut self.lists_free, words),
                };
            }
            (before, after)
        };
        self.count_flags(before, after);
        self.maybe_free(id);
    }

    /// A key's union of holder flags went from `before` to `after`: count it in `flag_keys`.
    #[inline]
    fn count_flags(&mut self, before: u8, after: u8) {
        // Only the flags that changed, one set bit at a time (most often one: `H`).
        let mut up = after & !before;
        while up != 0 {
            self.flag_keys[up.trailing_zeros() as usize] += 1;
            up &= up - 1;
        }
        let mut down = before & !after;
        while down != 0 {
            self.flag_keys[down.trailing_zeros() as usize] -= 1;
            down &= down - 1;
        }
    }

    /// Keys with at least one `H` holder.
    pub(crate) fn holder_keys(&self) -> usize {
        self.flag_keys[0]
    }

    /// Keys per Python table: [holders, gpu_missing, CPU, DISK, EXTERNAL].
    pub(crate) fn flag_key_counts(&self) -> [usize; 5] {
        self.flag_keys
    }

    /// Every interned key with the union of its holders' flags.
    pub(crate) fn keys_with_flags(&self) -> impl Iterator<Item = (Key, u8)> + '_ {
        self.ids
            .iter()
            .map(|id| (self.recs[id as usize].key, self.union_of(id)))
    }

    /// Bytes the table has allocated (capacities, not lengths: what the process holds for it).
    pub(crate) fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        self.ids.memory_bytes()
            + self.recs.capacity() * size_of::<Rec>()
            + self.free.capacity() * size_of::<u32>()
            + self.lists.capacity() * size_of::<Vec<u32>>()
            + self.lists.iter().map(|v| v.capacity() * 4).sum::<usize>()
            + self.lists_free.capacity() * size_of::<u32>()
            + self.sets.capacity() * size_of::<Bits>()
            + self.sets.iter().map(Bits::memory_bytes).sum::<usize>()
            + self.sets_free.capacity() * size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The form key `id` is kept in: 0 none, 1 inline, 2 list, 3 set.
    fn form(t: &KeyTable, id: u32) -> u8 {
        match t.recs[id as usize].one {
            NO_HOLDER => 0,
            w if w & MANY == 0 => 1,
            w if w & SET == 0 => 2,
            _ => 3,
        }
    }

    fn h(slot: u32, flags: u8) -> u32 {
        slot << FLAG_BITS | u32::from(flags)
    }

    /// A key of `i`: its digest bits spread like an XXH3 digest's (the id index places a key by
    /// its first eight bytes).
    fn spread_key(i: u32) -> Key {
        crate::keys::xxh128(&i.to_le_bytes())
    }

    /// Every entry of `ix` holds its distance from its home (saturated) and its key's tag, and
    /// `find` and `find_or_vacancy` find every id of `live`.
    fn check_ids(ix: &IdIndex, recs: &[Rec], live: &[u32]) {
        let (cap, mask) = (ix.slots.len(), ix.id_mask());
        for (at, &s) in ix.slots.iter().enumerate() {
            if s == 0 {
                continue;
            }
            let h = hash(&recs[((s & mask) - 1) as usize].key);
            let k = (at + cap - ix.home(h)) % cap;
            assert_eq!(ix.dist_of(s), k.min(ix.far), "slot {at}");
            assert_eq!(s & ix.tag_mask(), ix.tag(h), "slot {at}");
        }
        assert_eq!(ix.iter().count(), live.len());
        for &id in live {
            let key = &recs[id as usize].key;
            assert_eq!(ix.find(hash(key), key, recs), Some(id));
            assert_eq!(ix.find_or_vacancy(hash(key), key, recs), Ok(id));
        }
    }

    /// A key whose id-index hash is `h` (the rest of its digest from `i`).
    fn key_hashed(h: u64, i: u32) -> Key {
        let mut k = spread_key(i);
        k[..8].copy_from_slice(&h.to_le_bytes());
        k
    }

    #[test]
    fn removals_keep_each_entry_distance_through_long_runs_and_the_wrap() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..40u32 {
            let cap = 64;
            let mut ix = IdIndex::new(cap, 16);
            // Half the keys share a home near the table's end (runs past 15 slots, across the
            // wrap: saturated distances), the rest spread; their tags collide often.
            let recs: Vec<Rec> = (0..44u32)
                .map(|i| {
                    let h = if i % 2 == 0 {
                        (60u64 << 58) | u64::from(i % 3)
                    } else {
                        next() & !0xfff | u64::from(i % 3)
                    };
                    Rec {
                        key: key_hashed(h, i + 100 * round),
                        refs: 1,
                        one: NO_HOLDER,
                    }
                })
                .collect();
            let mut live: Vec<u32> = Vec::new();
            for step in 0..400 {
                let add = live.len() < 8 || (live.len() < 44 && next() % 2 == 0);
                if add {
                    let free: Vec<u32> = (0..44).filter(|i| !live.contains(i)).collect();
                    let id = free[(next() % free.len() as u64) as usize];
                    let key = &recs[id as usize].key;
                    match ix.find_or_vacancy(hash(key), key, &recs) {
                        Err(at) if step % 2 == 0 => ix.insert_at(at, hash(key), id),
                        Err(_) => ix.insert(hash(key), id),
                        Ok(got) => panic!("id {id} found as {got} before it was indexed"),
                    }
                    live.push(id);
                } else {
                    let id = live.swap_remove((next() % live.len() as u64) as usize);
                    ix.remove(hash(&recs[id as usize].key), id, &recs);
                    let key = &recs[id as usize].key;
                    assert_eq!(ix.find(hash(key), key, &recs), None);
                }
                check_ids(&ix, &recs, &live);
            }
            // Wider ids leave the distance fewer bits (2 at 30 id bits, none at 32): every
            // entry keeps it, saturated anew, and removals go on by the records' keys.
            for need in [29, 31] {
                ix.widen(need);
                check_ids(&ix, &recs, &live);
            }
            assert_eq!(ix.far, 0);
            while let Some(id) = live.pop() {
                ix.remove(hash(&recs[id as usize].key), id, &recs);
                check_ids(&ix, &recs, &live);
            }
        }
    }

    #[test]
    fn ids_widen_in_place_and_every_key_is_still_found() {
        let mut t = KeyTable::default();
        // 2^16 ids fill the 16 starting id bits at 65,536 keys, in a table of 78,895 slots
        // (room for 69,033): the bits widen there without a rebuild; growth follows.
        let n = 100_000u32;
        let mut widened = false;
        for i in 0..n {
            let (cap, bits) = (t.ids.cur.slots.len(), t.ids.cur.id_bits);
            assert_eq!(t.retain_key(&spread_key(i)), i);
            if t.ids.cur.id_bits != bits && t.ids.cur.slots.len() == cap {
                widened = true;
                assert_eq!((bits, t.ids.cur.id_bits), (16, 18));
                for j in 0..=i {
                    assert_eq!(t.id(&spread_key(j)), Some(j), "key {j} after widening");
                }
            }
        }
        assert!(widened, "the fill widened the ids in place");
        for i in (0..n).step_by(2) {
            t.release(i);
        }
        for i in 0..n {
            let want = (i % 2 == 1).then_some(i);
            assert_eq!(t.id(&spread_key(i)), want, "key {i}");
        }
    }

    #[test]
    fn holders_move_inline_and_out_as_they_come_and_go() {
        let mut t = KeyTable::default();
        let id = t.retain_key(&[7; 16]);
        assert_eq!(t.holder_words(id), Vec::<u32>::new());
        t.set_flags(id, 3, H);
        assert_eq!(t.holder_words(id), vec![h(3, H)]);
        t.set_flags(id, 1, H | G);
        assert_eq!(t.holder_words(id), vec![h(1, H | G), h(3, H)]);
        assert_eq!(t.flag_key_counts(), [1, 1, 0, 0, 0]);
        t.set_flags(id, 3, 0);
        assert_eq!(t.holder_words(id), vec![h(1, H | G)]);
        assert_eq!(t.flags(id, 1), H | G);
        assert_eq!(t.lists_free, vec![0]);
        t.set_flags(id, 1, 0);
        assert_eq!(t.flag_key_counts(), [0; 5]);
        assert_eq!(t.id(&[7; 16]), Some(id));
        t.release(id);
        assert_eq!(t.id(&[7; 16]), None);
        assert_eq!(t.retain_key(&[8; 16]), id, "a freed id is reused");
    }

    #[test]
    fn a_key_moves_between_inline_list_and_set_as_holders_come_and_go() {
        let mut t = KeyTable::default();
        let id = t.retain_key(&[1; 16]);
        // A list becomes a set at 2 * words + 8 holders (the words its highest slot needs).
        let slots: Vec<u32> = (0..40).map(|i| i * 5).collect();
        let mut want: Vec<u32> = Vec::new();
        for (n, &s) in slots.iter().enumerate() {
            let f = if s % 3 == 0 { H | G } else { H };
            t.set_flags(id, s, f);
            want.push(h(s, f));
            assert_eq!(t.holder_words(id), want);
            let expect = match n + 1 {
                1 => 1,
                2..=9 => 2, // 10 holders in one word (slots 0..45): 2 * 1 + 8
                _ => 3,
            };
            assert_eq!(form(&t, id), expect, "{} holders", n + 1);
        }
        for &s in &slots {
            let f = if s % 3 == 0 { H | G } else { H };
            assert_eq!(t.flags(id, s), f);
            assert_eq!(t.flags(id, s + 1), 0);
        }
        assert_eq!(t.flag_key_counts(), [1, 1, 0, 0, 0]);
        // A holder's flags change in place, to `H` and back.
        t.set_flags(id, 0, H);
        assert_eq!(t.flags(id, 0), H);
        t.set_flags(id, 0, H | tier_flag(2));
        assert_eq!(t.flags(id, 0), H | tier_flag(2));
        assert_eq!(t.flag_key_counts(), [1, 1, 1, 0, 0]);
        // Holders go from the top: the set shrinks its words, and becomes a list again once
        // it holds no more than half its words plus 4.
        let mut left: Vec<u32> = t.holder_words(id);
        while let Some(last) = left.pop() {
            t.set_flags(id, slot_of(last), 0);
            assert_eq!(t.holder_words(id), left);
            let n = left.len();
            let words = left.last().map_or(0, |&w| words_for(slot_of(w)));
            if form(&t, id) == 3 {
                assert!(n > words / 2 + 4, "{n} holders in {words} words stay a set");
            }
            assert_eq!(form(&t, id) == 0, n == 0);
            assert_eq!(form(&t, id) == 1, n == 1);
        }
        assert_eq!(t.flag_key_counts(), [0; 5]);
        assert!(t.sets_free.len() == t.sets.len() && t.lists_free.len() == t.lists.len());
        t.release(id);
        assert_eq!(t.id(&[1; 16]), None);
    }

    #[test]
    fn a_removed_worker_leaves_every_form_and_a_clear_empties_a_set() {
        let mut t = KeyTable::default();
        let ids: Vec<u32> = (0..3u8).map(|i| t.retain_key(&[i; 16])).collect();
        // key 0 inline, key 1 a list, key 2 a set; slot 7 holds all three, with a tier on one.
        t.set_flags(ids[0], 7, H);
        for s in [2, 7] {
            t.set_flags(ids[1], s, H);
        }
        for s in 0..64 {
            t.set_flags(ids[2], s, if s == 7 { H | G | tier_flag(2) } else { H });
        }
        assert_eq!(
            (0..3).map(|i| form(&t, ids[i])).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        assert_eq!(t.flag_key_counts(), [3, 1, 1, 0, 0]);
        // Removing worker 7 is a flag reset on every key it holds.
        for &id in &ids {
            t.set_flags(id, 7, 0);
            assert_eq!(t.flags(id, 7), 0);
        }
        assert_eq!(t.flag_key_counts(), [2, 0, 0, 0, 0]);
        assert_eq!(form(&t, ids[0]), 0);
        assert_eq!(t.holder_words(ids[1]), vec![h(2, H)]);
        assert_eq!(form(&t, ids[2]), 3);
        match t.holders(ids[2]) {
            Holders::Set { present, odd } => {
                assert_eq!(present, &[!(1u64 << 7)]);
                assert!(odd.is_empty());
            }
            Holders::List(_) => panic!("63 holders in one word are a set"),
        }
        // A clear: every holder goes, the set's place is free again, the key with it.
        for s in 0..64 {
            t.set_flags(ids[2], s, 0);
        }
        assert_eq!(form(&t, ids[2]), 0);
        assert_eq!(t.flag_key_counts(), [1, 0, 0, 0, 0]);
        assert_eq!(t.sets_free, vec![0]);
        for &id in &ids {
            t.release(id);
        }
        assert_eq!(t.flag_key_counts()[0], 1, "key 1 is still held by slot 2");
        assert!(t.id(&[1; 16]).is_some() && t.id(&[2; 16]).is_none());
        // The freed set's place is reused by the next key that becomes a set.
        let id = t.retain_key(&[9; 16]);
        for s in 0..20 {
            t.set_flags(id, s, H);
        }
        assert_eq!(form(&t, id), 3);
        assert!(t.sets_free.is_empty() && t.sets.len() == 1);
    }

    #[test]
    fn group_hits_marks_the_empty_and_tagged_slots_of_a_group() {
        // Slots drawn from a few tags and ids, empty among them, under every id width.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for id_bits in 1..=31u32 {
            let hi = !((1u32 << id_bits) - 1);
            for _ in 0..2_000 {
                let tag = ((next() % 3) as u32) << id_bits;
                let group = [0; 4].map(|_| match next() % 4 {
                    0 => 0,
                    r => (((r % 3) as u32) << id_bits) | (next() as u32 & !hi).max(1),
                });
                let want = group_hits_scalar(&group, tag, hi);
                assert_eq!(group_hits(&group, tag, hi), want, "{group:?} tag {tag:#x}");
                for (j, &s) in group.iter().enumerate() {
                    assert_eq!(want >> j & 1 == 1, s == 0 || s & hi == tag);
                }
            }
        }
    }

    /// A growth moves keys a few per interned key (`Ids`): throughout one, a key is found in
    /// whichever table holds it, a removal reaches that table, no id is reused, and the ids
    /// listed are every key's once. Checked after every step against a plain map.
    #[test]
    fn keys_are_found_and_removed_while_a_growth_moves_them() {
        let mut t = KeyTable::default();
        let mut want: std::collections::HashMap<Key, u32> = std::collections::HashMap::new();
        let mut live: Vec<Key> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut growths, mut gone_unmoved, mut gone_moved, mut found_unmoved) = (0, 0, 0, 0);
        let mut fresh = 0u32;
        for round in 0..40_000u32 {
            let was = t.ids.moving();
            let unmoved =
                |t: &KeyTable, id: u32| t.ids.moving.as_deref().is_some_and(|m| m.unmoved(id));
            let r = next() % 10;
            if r < 6 || live.is_empty() {
                let k = spread_key(fresh);
                fresh += 1;
                let id = t.retain_key(&k);
                if t.ids.moving() {
                    assert_eq!(
                        id as usize,
                        t.recs.len() - 1,
                        "no id reused while keys move"
                    );
                }
                want.insert(k, id);
                live.push(k);
            } else {
                let at = (next() % live.len() as u64) as usize;
                let k = live[at];
                let id = want[&k];
                if r < 9 {
                    if unmoved(&t, id) {
                        gone_unmoved += 1;
                    } else if t.ids.moving() {
                        gone_moved += 1;
                    }
                    t.release(id);
                    want.remove(&k);
                    live.swap_remove(at);
                    assert_eq!(t.id(&k), None, "round {round}");
                } else {
                    found_unmoved += usize::from(unmoved(&t, id));
                    assert_eq!(t.retain_key(&k), id, "round {round}");
                    t.release(id);
                }
            }
            growths += usize::from(!was && t.ids.moving());
            assert_eq!(t.ids.len(), want.len(), "round {round}");
            for _ in 0..if live.is_empty() { 0 } else { 8 } {
                let k = live[(next() % live.len() as u64) as usize];
                assert_eq!(t.id(&k), Some(want[&k]), "round {round}");
            }
            if round % 1_000 == 0 || (t.ids.moving() && round % 50 == 0) || (was && !t.ids.moving())
            {
                let mut ids: Vec<u32> = t.ids.iter().collect();
                ids.sort_unstable();
                let mut expect: Vec<u32> = want.values().copied().collect();
                expect.sort_unstable();
                assert_eq!(ids, expect, "round {round}");
            }
        }
        assert!(growths >= 3, "{growths} growths moved keys");
        assert!(gone_unmoved > 0 && gone_moved > 0 && found_unmoved > 0);
        for (k, &id) in &want {
            assert_eq!(t.id(k), Some(id));
        }
    }

    /// Releases alone move a growth under way on, to its end (an index that only evicts).
    #[test]
    fn releases_alone_end_a_growth() {
        let mut t = KeyTable::default();
        let mut ids = Vec::new();
        while !t.ids.moving() || ids.len() < 2 * MOVE_FROM {
            ids.push(t.retain_key(&spread_key(ids.len() as u32)));
        }
        assert!(t.ids.moving(), "a growth under way");
        let mut gone = 0;
        while t.ids.moving() {
            t.release(ids[gone]);
            gone += 1;
        }
        assert!(gone < ids.len(), "the growth ended with keys left");
        for (i, &id) in ids.iter().enumerate().skip(gone) {
            assert_eq!(t.id(&spread_key(i as u32)), Some(id));
        }
        assert_eq!(t.ids.len(), ids.len() - gone);
    }

    /// The id index against a plain map through churn: keys come and go in a pseudo-random
    /// order (a fixed xorshift), across growths, id-width rebuilds and backward-shift removals,
    /// including keys whose homes collide (the same high bits: one cluster that wraps around).
    #[test]
    fn the_id_index_agrees_with_a_map_through_churn() {
        let mut t = KeyTable::default();
        let mut want: std::collections::HashMap<Key, u32> = std::collections::HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let key = |n: u64| -> Key {
            let mut k = [0u8; 16];
            // Half the keys share their hash's high bits (one home: the last slot, so their cluster
            // wraps around), the rest spread out.
            let h = if n.is_multiple_of(2) {
                u64::MAX - n
            } else {
                n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            };
            k[..8].copy_from_slice(&h.to_le_bytes());
            k[8..].copy_from_slice(&n.to_le_bytes());
            k
        };
        for round in 0..40_000u64 {
            let n = next() % 3_000;
            let k = key(n);
            match want.get(&k) {
                Some(&id) if next() % 3 != 0 => {
                    t.release(id);
                    want.remove(&k);
                    assert_eq!(t.id(&k), None);
                }
                Some(&id) => {
                    assert_eq!(t.retain_key(&k), id);
                    t.release(id);
                }
                None => {
                    assert_eq!(t.id(&k), None);
                    let id = t.retain_key(&k);
                    want.insert(k, id);
                }
            }
            if round % 997 == 0 {
                for (k, &id) in &want {
                    assert_eq!(t.id(k), Some(id));
                    assert_eq!(t.key(id), k);
                }
                let mut ids: Vec<u32> = t.ids.iter().collect();
                ids.sort_unstable();
                let mut expect: Vec<u32> = want.values().copied().collect();
                expect.sort_unstable();
                assert_eq!(ids, expect);
                assert_eq!(t.ids.len(), want.len());
                assert!(t.ids.cur.len < t.ids.cur.slots.len(), "a slot stays empty");
            }
        }
        // Then past 2^16 ids, so the slots' id field widens (a rebuild of every slot), and back.
        let widths = t.ids.cur.id_mask();
        // (odd n: keys spread out; the shared-home cluster is exercised above)
        let many: Vec<Key> = (500_000..570_000u64).map(|n| key(2 * n + 1)).collect();
        for k in &many {
            let id = t.retain_key(k);
            want.insert(*k, id);
        }
        assert_ne!(t.ids.cur.id_mask(), widths, "the id field widened");
        for (k, &id) in &want {
            assert_eq!(t.id(k), Some(id));
        }
        for k in &many {
            t.release(want.remove(k).unwrap());
            assert_eq!(t.id(k), None);
        }
        for (k, &id) in &want {
            assert_eq!(t.id(k), Some(id));
        }
        assert_eq!(t.ids.len(), want.len());
        for (_, id) in want.drain() {
            t.release(id);
        }
        assert!(t.ids.iter().next().is_none());
    }
}
