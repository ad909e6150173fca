//! Warm restart: a worker's tables out to the snapshot file and back in (kvroute/_snapshot.py
//! writes and reads the file, in today's format; `PrefixIndex.snapshot` / `restore` glue them).
//! Every restored worker is checked first (`_snapshot_problem`): an inconsistent one is refused
//! with the reason, never the whole index.

use rustc_hash::{FxHashMap, FxHashSet};

use super::{mask_of, EMap, Group, GroupKind, Index, WorkerName, NOKEY};
use crate::keys::Key;
use crate::protocols::BlockHash;

/// One non-primary KV-cache group as a snapshot holds it (`SnapGroup`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapGroup {
    pub group_idx: i64,
    pub kind: String,
    pub window: Option<i64>,
    pub block_size: i64,
    pub hashes: Vec<BlockHash>,
    /// content keys: 16 bytes, or empty for a block held but never claimable
    pub keys: Vec<Vec<u8>>,
    pub masks: Vec<i64>,
}

/// One worker's tables as a snapshot holds them (`SnapWorker`, its name aside).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapWorker {
    pub classes: Vec<(i64, i64)>,
    pub primary: Option<i64>,
    pub lookahead: i64,
    pub hashes: Vec<BlockHash>,
    pub keys: Vec<Vec<u8>>,
    pub special: Vec<(BlockHash, Vec<i64>)>,
    pub groups: Vec<SnapGroup>,
    /// SGLang with EAGLE (`Worker::bigram`); false in a file written before the mark
    pub bigram: bool,
}

fn key_of(k: &[u8]) -> Option<Key> {
    k.try_into().ok()
}

fn distinct(hashes: &[BlockHash]) -> bool {
    let set: FxHashSet<&BlockHash> = hashes.iter().collect();
    set.len() == hashes.len()
}

impl<K: WorkerName> Index<K> {
    /// Every worker holding something, with its tables.
    pub fn export(&self) -> Vec<(K, SnapWorker)> {
        let mut out = Vec::new();
        let mut live: Vec<&super::Worker<K>> = self
            .workers
            .iter()
            .flatten()
            .filter(|w| !w.holds_nothing())
            .collect();
        // In creation order, as the Python index lists them: a restore adds block-size classes
        // in file order, and that order breaks ties between classes in find_matches.
        live.sort_by_key(|w| w.created);
        for w in live {
            let mut classes = w.classes.clone();
            classes.sort_unstable();
            let (mut hashes, mut keys) = (
                Vec::with_capacity(w.blocks.len()),
                Vec::with_capacity(w.blocks.len()),
            );
            for (h, &id) in w.blocks.iter() {
                hashes.push(h);
                keys.push(if id == NOKEY {
                    Vec::new()
                } else {
                    self.table.key(id).to_vec()
                });
            }
            let special = w
                .special
                .iter()
                .map(|(h, c)| (h, c.iter().map(|&v| i64::from(v)).collect()))
                .collect();
            let groups = w
                .groups
                .iter()
                .map(|(g, grp)| {
                    let mut sg = SnapGroup {
                        group_idx: *g,
                        kind: grp.kind.name().to_owned(),
                        window: grp.window,
                        block_size: grp.block_size,
                        ..SnapGroup::default()
                    };
                    for (h, (k, m)) in grp.blocks.iter() {
                        sg.hashes.push(h);
                        sg.keys.push(k.map_or_else(Vec::new, |k| k.to_vec()));
                        sg.masks.push(i64::from(*m));
                    }
                    sg
                })
                .collect();
            let sw = SnapWorker {
                classes,
                primary: w.primary,
                lookahead: w.lookahead,
                hashes,
                keys,
                special,
                groups,
                bigram: w.bigram,
            };
            out.push((w.key.clone(), sw));
        }
        out
    }

    /// Why a snapshot worker cannot be restored (`_snapshot_problem`; None: it can).
    fn snapshot_problem(&self, sw: &SnapWorker) -> Option<String> {
        let lim = self.limits;
        if sw.hashes.is_empty() && sw.groups.iter().all(|g| g.hashes.is_empty()) {
            return Some("holds nothing".into());
        }
        if sw.hashes.len() != sw.keys.len() {
            return Some("mismatched tables".into());
        }
        if !distinct(&sw.hashes) {
            return Some("duplicate engine hashes".into());
        }
        if sw.classes.is_empty() || sw.classes.len() > lim.max_block_sizes {
            return Some(format!("{} block sizes", sw.classes.len()));
        }
        for &(bs, la) in &sw.classes {
            if !(1..=1 << 20).contains(&bs) || !(0..=1 << 16).contains(&la) {
                return Some(format!("block size / lookahead ({bs}, {la})"));
            }
        }
        if !(0..=1 << 16).contains(&sw.lookahead) {
            return Some(format!("lookahead {}", sw.lookahead));
        }
        if sw.keys.iter().any(|k| !k.is_empty() && k.len() != 16) {
            return Some("malformed content keys".into());
        }
        let present: FxHashSet<&BlockHash> = sw.hashes.iter().collect();
        let mut seen: FxHashSet<&BlockHash> = FxHashSet::default();
        for (h, c) in &sw.special {
            if !present.contains(h)
                || seen.contains(h)
                || c.len() != 4
                || c.iter().any(|&v| v != 0 && v != 1)
            {
                return Some("inconsistent tier entries".into());
            }
            seen.insert(h);
        }
        let mut total = sw.hashes.len();
        if sw.groups.len() > lim.max_groups_per_worker {
            return Some(format!("{} groups", sw.groups.len()));
        }
        let mut gids: FxHashSet<i64> = FxHashSet::default();
        for g in &sw.groups {
            let idx = g.group_idx;
            if gids.contains(&idx) || Some(idx) == sw.primary {
                return Some(format!("group {idx} listed twice"));
            }
            gids.insert(idx);
            if GroupKind::from_name(&g.kind).is_none() || !(0..=1 << 20).contains(&g.block_size) {
                return Some(format!(
                    "group {idx}: kind '{}' / block size {}",
                    g.kind, g.block_size
                ));
            }
            if g.hashes.len() != g.keys.len()
                || g.keys.len() != g.masks.len()
                || !distinct(&g.hashes)
            {
                return Some(format!("group {idx}: inconsistent tables"));
            }
            if g.keys.iter().any(|k| !k.is_empty() && k.len() != 16)
                || g.masks.iter().any(|m| !(1..=15).contains(m))
            {
                return Some(format!("group {idx}: malformed entries"));
            }
            total += g.hashes.len();
        }
        if total > lim.max_entries_per_worker {
            return Some(format!("{total} entries exceed max_entries_per_worker"));
        }
        None
    }

    /// Restore one worker from snapshot tables (`restore` + `_load_worker`): Err(reason) when
    /// its tables are inconsistent or it is already in the index; nothing is changed then.
    pub fn import_worker(&mut self, key: &K, sw: &SnapWorker) -> Result<(), String> {
        if let Some(problem) = self.snapshot_problem(sw) {
            return Err(problem);
        }
        if self.by_key.contains_key(key) {
            return Err("listed twice".into());
        }
        let slot = {
            // A fresh worker, as `_worker` makes one.
            let slot = match self.free_slots.pop() {
                Some(s) => s,
                None => {
                    self.workers.push(None);
                    (self.workers.len() - 1) as u32
                }
            };
            self.workers[slot as usize] = Some(super::Worker::new(key.clone(), slot, self.created));
            self.by_key.insert(key.clone(), slot);
            self.created += 1;
            slot
        };
        let mut w = self.take(slot);
        for (h, k) in sw.hashes.iter().zip(&sw.keys) {
            let id = match key_of(k) {
                Some(k) => self.table.retain_key(&k),
                None => NOKEY,
            };
            w.blocks.insert(h, id);
        }
        for (h, c) in &sw.special {
            if c.iter().any(|&v| v != 0) {
                w.special.insert(h, [0, 1, 2, 3].map(|i| c[i] as i32));
            }
        }
        w.primary = sw.primary;
        w.lookahead = sw.lookahead;
        if sw.bigram {
            w.bigram = true;
            self.bigram_workers += 1;
        }
        for &cls in &sw.classes {
            if !w.classes.contains(&cls) {
                w.classes.push(cls);
                w.bs = w.bs.max(cls.0);
                self.add_member(cls, slot);
            }
        }
        for sg in &sw.groups {
            let kind = GroupKind::from_name(&sg.kind).expect("checked");
            let mut grp = Group {
                kind,
                window: sg.window,
                block_size: sg.block_size,
                blocks: EMap::default(),
                held: FxHashMap::default(),
                copies: EMap::default(),
            };
            for ((h, k), &m) in sg.hashes.iter().zip(&sg.keys).zip(&sg.masks) {
                let k = key_of(k);
                grp.blocks.insert(h, (k, m as u8));
                if let Some(k) = k {
                    *grp.held.entry(k).or_insert(0) += 1;
                }
            }
            w.groups.push((sg.group_idx, grp));
            if !w.hybrid {
                w.hybrid = true;
                self.hybrid_workers += 1;
            }
        }
        self.entries += w.entries() as u64;
        // The shared tables follow from the worker's: per key, its tiers and engine hashes.
        let mut per_key: FxHashMap<u32, [i32; 5]> = FxHashMap::default();
        let mut order: Vec<u32> = Vec::new();
        for (h, &id) in w.blocks.iter() {
            if id == NOKEY {
                continue;
            }
            let mask = w.special.get(&h).map_or(1, mask_of);
            let t = per_key.entry(id).or_insert_with(|| {
                order.push(id);
                [0; 5]
            });
            for (i, c) in t.iter_mut().take(4).enumerate() {
                *c += i32::from(mask >> i & 1);
            }
            t[4] += 1;
        }
        for id in order {
            let t = per_key[&id];
            let counts = [t[0], t[1], t[2], t[3]];
            if t[4] > 1 {
                w.multi.insert(id, counts);
            }
            self.set_mask(slot, id, 0, mask_of(&counts));
        }
        self.put(w);
        Ok(())
    }
}
