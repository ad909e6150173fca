//! The shared key table: content keys interned to u32 ids, each with its holders.
//!
//! A holder is one packed word, `slot << 5 | flags`, sorted by slot. The flags are the Python
//! index's shared tables for that (key, worker): `H` (in `_holders`), `G` (in `_gpu_missing`),
//! and the `CPU` / `DISK` / `EXT` tier holders. Keeping them as separate bits (not one derived
//! mask) keeps every table update the Python index makes expressible one for one.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;
use smallvec::SmallVec;

use crate::keys::Key;

pub(crate) const H: u8 = 1;
pub(crate) const G: u8 = 2;
/// The flag of an off-GPU tier bit of a Python tier mask (2: CPU, 4: DISK, 8: EXTERNAL).
pub(crate) const fn tier_flag(tbit: u8) -> u8 {
    tbit << 1
}
const FLAG_BITS: u32 = 5;
const FLAG_MASK: u32 = (1 << FLAG_BITS) - 1;

/// Holders of one key: most keys have one or two, so they live inline.
pub(crate) type Holders = SmallVec<[u32; 2]>;

struct KeyRec {
    key: Key,
    /// engine-hash entries of workers' primary tables naming this key
    refs: u32,
    holders: Holders,
}

/// Ids by key: the table holds only the 4-byte ids, hashed and compared through `recs` (a map
/// from key to id would store every 16-byte key a second time).
#[derive(Default)]
pub(crate) struct KeyTable {
    ids: HashTable<u32>,
    recs: Vec<KeyRec>,
    free: Vec<u32>,
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

fn hash(key: &Key) -> u64 {
    FxBuildHasher.hash_one(key)
}

impl KeyTable {
    pub(crate) fn id(&self, key: &Key) -> Option<u32> {
        let recs = &self.recs;
        self.ids
            .find(hash(key), |&id| recs[id as usize].key == *key)
            .copied()
    }

    pub(crate) fn key(&self, id: u32) -> &Key {
        &self.recs[id as usize].key
    }

    /// The id of `key`, interned if new, with one more reference.
    pub(crate) fn retain_key(&mut self, key: &Key) -> u32 {
        let id = match self.id(key) {
            Some(id) => id,
            None => {
                let rec = KeyRec {
                    key: *key,
                    refs: 0,
                    holders: Holders::new(),
                };
                let id = match self.free.pop() {
                    Some(id) => {
                        self.recs[id as usize] = rec;
                        id
                    }
                    None => {
                        self.recs.push(rec);
                        (self.recs.len() - 1) as u32
                    }
                };
                let recs = &self.recs;
                self.ids
                    .insert_unique(hash(key), id, |&i| hash(&recs[i as usize].key));
                id
            }
        };
        self.recs[id as usize].refs += 1;
        id
    }

    pub(crate) fn retain(&mut self, id: u32) {
        self.recs[id as usize].refs += 1;
    }

    /// One reference fewer; the key goes once nothing refers to it and nobody holds it.
    pub(crate) fn release(&mut self, id: u32) {
        let rec = &mut self.recs[id as usize];
        rec.refs -= 1;
        self.maybe_free(id);
    }

    fn maybe_free(&mut self, id: u32) {
        let rec = &mut self.recs[id as usize];
        if rec.refs == 0 && rec.holders.is_empty() {
            if let Ok(entry) = self.ids.find_entry(hash(&rec.key), |&i| i == id) {
                entry.remove();
            }
            rec.holders = Holders::new();
            self.free.push(id);
        }
    }

    pub(crate) fn holders(&self, id: u32) -> &[u32] {
        &self.recs[id as usize].holders
    }

    /// The flags of `slot` on key `id` (0: none).
    pub(crate) fn flags(&self, id: u32, slot: u32) -> u8 {
        let h = &self.recs[id as usize].holders;
        match h.binary_search_by_key(&slot, |&w| slot_of(w)) {
            Ok(i) => flags_of(h[i]),
            Err(_) => 0,
        }
    }

    /// Set the flags of `slot` on key `id` (0 removes the holder).
    pub(crate) fn set_flags(&mut self, id: u32, slot: u32, flags: u8) {
        let rec = &mut self.recs[id as usize];
        let before = rec.holders.iter().fold(0u8, |acc, &w| acc | flags_of(w));
        match rec.holders.binary_search_by_key(&slot, |&w| slot_of(w)) {
            Ok(i) => {
                if flags == 0 {
                    rec.holders.remove(i);
                } else {
                    rec.holders[i] = slot << FLAG_BITS | u32::from(flags);
                }
            }
            Err(i) => {
                if flags != 0 {
                    rec.holders.insert(i, slot << FLAG_BITS | u32::from(flags));
                }
            }
        }
        let after = rec.holders.iter().fold(0u8, |acc, &w| acc | flags_of(w));
        if before != after {
            for (i, c) in self.flag_keys.iter_mut().enumerate() {
                match (before >> i & 1, after >> i & 1) {
                    (0, 1) => *c += 1,
                    (1, 0) => *c -= 1,
                    _ => {}
                }
            }
        }
        if rec.holders.is_empty() {
            rec.holders = Holders::new();
        }
        self.maybe_free(id);
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
        self.ids.iter().map(|&id| {
            let rec = &self.recs[id as usize];
            (
                rec.key,
                rec.holders.iter().fold(0u8, |acc, &w| acc | flags_of(w)),
            )
        })
    }
}
