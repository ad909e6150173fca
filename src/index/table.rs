//! The shared key table: content keys interned to u32 ids, each with its holders.
//!
//! A holder is one packed word, `slot << 5 | flags`, sorted by slot. The flags are the Python
//! index's shared tables for that (key, worker): `H` (in `_holders`), `G` (in `_gpu_missing`),
//! and the `CPU` / `DISK` / `EXTERNAL` tier holders. Keeping them as separate bits (not one derived
//! mask) keeps every table update the Python index makes expressible one for one.
//!
//! Layout, for memory (a key is most often held by one worker): each id has a 24-byte record
//! (key, references, one holder word) in one vector; a key with two or more holders keeps them in
//! a side list the record points at. The id index is a table of bare u32 ids hashed by the key's
//! own bits, so no key is stored twice.

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

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
/// A record's `one` word tagged with this bit indexes `many` (two or more holders). A holder word
/// never has it: slots stay below 2^26 (`MAX_SLOTS`).
const MANY: u32 = 1 << 31;
/// Workers one index can name at once (slot << 5 must leave the `MANY` bit clear).
pub(crate) const MAX_SLOTS: usize = 1 << (31 - FLAG_BITS);

/// One interned key: 24 bytes, alignment 4 (the key is a byte array).
#[derive(Clone, Copy)]
struct Rec {
    key: Key,
    /// engine-hash entries of workers' primary tables naming this key
    refs: u32,
    /// the only holder word, `NO_HOLDER`, or `MANY | i` for `many[i]`
    one: u32,
}

/// Ids by key: the id index holds only the 4-byte ids, hashed and compared through `recs`.
#[derive(Default)]
pub(crate) struct KeyTable {
    ids: HashTable<u32>,
    recs: Vec<Rec>,
    free: Vec<u32>,
    /// holder lists of keys with two or more holders (sorted by slot), and their free places
    many: Vec<Vec<u32>>,
    many_free: Vec<u32>,
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
        let recs = &mut self.recs;
        let id = match self.ids.entry(
            hash(key),
            |&id| recs[id as usize].key == *key,
            |&i| hash(&recs[i as usize].key),
        ) {
            Entry::Occupied(o) => *o.get(),
            Entry::Vacant(v) => {
                let rec = Rec {
                    key: *key,
                    refs: 0,
                    one: NO_HOLDER,
                };
                let id = match self.free.pop() {
                    Some(id) => {
                        recs[id as usize] = rec;
                        id
                    }
                    None => {
                        recs.push(rec);
                        (recs.len() - 1) as u32
                    }
                };
                v.insert(id);
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
        self.recs[id as usize].refs -= 1;
        self.maybe_free(id);
    }

    fn maybe_free(&mut self, id: u32) {
        let rec = self.recs[id as usize];
        if rec.refs == 0 && rec.one == NO_HOLDER {
            if let Ok(entry) = self.ids.find_entry(hash(&rec.key), |&i| i == id) {
                entry.remove();
            }
            self.free.push(id);
        }
    }

    pub(crate) fn holders(&self, id: u32) -> &[u32] {
        let rec = &self.recs[id as usize];
        match rec.one {
            NO_HOLDER => &[],
            w if w & MANY != 0 => &self.many[(w & !MANY) as usize],
            _ => std::slice::from_ref(&rec.one),
        }
    }

    /// The flags of `slot` on key `id` (0: none).
    pub(crate) fn flags(&self, id: u32, slot: u32) -> u8 {
        let h = self.holders(id);
        match h.binary_search_by_key(&slot, |&w| slot_of(w)) {
            Ok(i) => flags_of(h[i]),
            Err(_) => 0,
        }
    }

    /// Set the flags of `slot` on key `id` (0 removes the holder).
    pub(crate) fn set_flags(&mut self, id: u32, slot: u32, flags: u8) {
        debug_assert!((slot as usize) < MAX_SLOTS);
        let word = slot << FLAG_BITS | u32::from(flags);
        let one = self.recs[id as usize].one;
        let (before, after) = if one == NO_HOLDER {
            if flags != 0 {
                self.recs[id as usize].one = word;
            }
            (0, flags)
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
                    let at = match self.many_free.pop() {
                        Some(at) => {
                            self.many[at as usize] = pair;
                            at
                        }
                        None => {
                            self.many.push(pair);
                            (self.many.len() - 1) as u32
                        }
                    };
                    self.recs[id as usize].one = MANY | at;
                }
                (before, before | flags)
            }
        } else {
            let at = (one & !MANY) as usize;
            let list = &mut self.many[at];
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
                self.many[at] = Vec::new();
                self.many_free.push(at as u32);
            }
            (before, after)
        };
        if before != after {
            for (i, c) in self.flag_keys.iter_mut().enumerate() {
                match (before >> i & 1, after >> i & 1) {
                    (0, 1) => *c += 1,
                    (1, 0) => *c -= 1,
                    _ => {}
                }
            }
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
        self.ids
            .iter()
            .map(|&id| (self.recs[id as usize].key, union(self.holders(id))))
    }

    /// Bytes the table has allocated (capacities, not lengths: what the process holds for it).
    pub(crate) fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        super::table_bytes::<u32>(self.ids.capacity())
            + self.recs.capacity() * size_of::<Rec>()
            + self.free.capacity() * size_of::<u32>()
            + self.many.capacity() * size_of::<Vec<u32>>()
            + self.many.iter().map(|v| v.capacity() * 4).sum::<usize>()
            + self.many_free.capacity() * size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_move_inline_and_out_as_they_come_and_go() {
        let mut t = KeyTable::default();
        let id = t.retain_key(&[7; 16]);
        assert_eq!(t.holders(id), &[] as &[u32]);
        t.set_flags(id, 3, H);
        assert_eq!(t.holders(id), &[3 << 5 | 1]);
        t.set_flags(id, 1, H | G);
        assert_eq!(t.holders(id), &[1 << 5 | 3, 3 << 5 | 1]);
        assert_eq!(t.flag_key_counts(), [1, 1, 0, 0, 0]);
        t.set_flags(id, 3, 0);
        assert_eq!(t.holders(id), &[1 << 5 | 3]);
        assert_eq!(t.flags(id, 1), H | G);
        assert_eq!(t.many_free, vec![0]);
        t.set_flags(id, 1, 0);
        assert_eq!(t.flag_key_counts(), [0; 5]);
        assert_eq!(t.id(&[7; 16]), Some(id));
        t.release(id);
        assert_eq!(t.id(&[7; 16]), None);
        assert_eq!(t.retain_key(&[8; 16]), id, "a freed id is reused");
    }
}
