//! Warm restart: a worker's tables out to the snapshot file and back in. kvroute/_snapshot.py
//! writes the file (today's format) and checks its header; [`read`] reads the rest here, off the
//! GIL and without a Python object per entry, and [`Index::import_worker`] rebuilds each worker.
//! Every restored worker is checked first (`_snapshot_problem`): an inconsistent one is refused
//! with the reason, never the whole index.

use rustc_hash::{FxHashMap, FxHashSet};

use super::store::mask_of_flags;
use super::table::H;
use super::{mask_of, EMap, Group, GroupKind, Index, WorkerName, NOKEY};
use crate::keys::Key;
use crate::protocols::BlockHash;
use crate::wire::{DecodeError, Reader, Tok};

/// A content key as a snapshot holds it (`bytes` in the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapKey {
    /// 16 bytes: the key.
    Key(Key),
    /// Empty: a block held but never claimable.
    Unclaimable,
    /// Any other length: refused by the worker's check.
    Malformed,
}

impl SnapKey {
    /// A key's bytes as the file holds them.
    pub fn of(b: &[u8]) -> SnapKey {
        match b.len() {
            0 => SnapKey::Unclaimable,
            _ => b.try_into().map_or(SnapKey::Malformed, SnapKey::Key),
        }
    }

    fn key(self) -> Option<Key> {
        match self {
            SnapKey::Key(k) => Some(k),
            _ => None,
        }
    }
}

/// One non-primary KV-cache group as a snapshot holds it (`SnapGroup`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapGroup {
    pub group_idx: i64,
    pub kind: String,
    pub window: Option<i64>,
    pub block_size: i64,
    pub hashes: Vec<BlockHash>,
    pub keys: Vec<SnapKey>,
    pub masks: Vec<i64>,
}

/// One worker's tables as a snapshot holds them (`SnapWorker`, its name aside).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapWorker {
    pub classes: Vec<(i64, i64)>,
    pub primary: Option<i64>,
    pub lookahead: i64,
    pub hashes: Vec<BlockHash>,
    pub keys: Vec<SnapKey>,
    pub special: Vec<(BlockHash, Vec<i64>)>,
    pub groups: Vec<SnapGroup>,
    /// SGLang with EAGLE (`Worker::bigram`); false in a file written before the mark
    pub bigram: bool,
}

/// A snapshot file: its header fields (for kvroute/_snapshot.py to check), its workers
/// (worker_id, dp_rank, tables) and cursors (worker_id, dp_rank, seq, ts), in file order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapFile {
    pub format: String,
    pub version: i128,
    pub hash_version: i128,
    pub workers: Vec<(String, i64, SnapWorker)>,
    pub cursors: Vec<(String, i64, i128, f64)>,
}

// --- reading the file ----------------------------------------------------------------------
//
// The file is msgpack of kvroute/_snapshot.py's `_Snapshot` (a map) whose workers and cursors are
// array-like Structs. This reader takes what msgspec took for those types, with its wording for
// what it refuses, and one stricter rule: an integer outside int64 where the index keeps an int64
// (msgspec took it, and the index then failed with an OverflowError) is refused here.

/// Why a snapshot body was refused, with the path to the value (`$.workers[3].keys[7]`).
#[derive(Debug)]
pub struct SnapReadError {
    msg: String,
    /// innermost first
    path: Vec<String>,
}

impl std::fmt::Display for SnapReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            return f.write_str(&self.msg);
        }
        let path: String = self.path.iter().rev().map(String::as_str).collect();
        write!(f, "{} - at `${path}`", self.msg)
    }
}

impl From<DecodeError> for SnapReadError {
    fn from(e: DecodeError) -> Self {
        SnapReadError {
            msg: e.message,
            path: Vec::new(),
        }
    }
}

type R<T> = Result<T, SnapReadError>;

fn fail<T>(msg: impl Into<String>) -> R<T> {
    Err(SnapReadError {
        msg: msg.into(),
        path: Vec::new(),
    })
}

fn expected<T>(what: &str, got: &Tok<'_>) -> R<T> {
    fail(format!("Expected `{what}`, got `{}`", got.name()))
}

/// Adds one path step to an error on its way out.
fn at<T>(r: R<T>, seg: impl FnOnce() -> String) -> R<T> {
    r.map_err(|mut e| {
        e.path.push(seg());
        e
    })
}

fn field(name: &str) -> impl FnOnce() -> String + '_ {
    move || format!(".{name}")
}

fn index(i: usize) -> impl FnOnce() -> String {
    move || format!("[{i}]")
}

/// Reads the body of a snapshot file.
struct Body<'a> {
    r: Reader<'a>,
}

impl<'a> Body<'a> {
    fn int(&mut self) -> R<i128> {
        if let Some(v) = self.r.int()? {
            return Ok(v);
        }
        match self.r.item()? {
            Tok::Int(v) => Ok(v),
            t => expected("int", &t),
        }
    }

    fn i64(&mut self) -> R<i64> {
        let v = self.int()?;
        i64::try_from(v).or_else(|_| fail("Integer value out of range"))
    }

    fn opt_i64(&mut self) -> R<Option<i64>> {
        if let Some(v) = self.r.int()? {
            return i64::try_from(v)
                .map(Some)
                .or_else(|_| fail("Integer value out of range"));
        }
        match self.r.item()? {
            Tok::Nil => Ok(None),
            t => expected("int | None", &t),
        }
    }

    fn bool(&mut self) -> R<bool> {
        match self.r.item()? {
            Tok::Bool(b) => Ok(b),
            t => expected("bool", &t),
        }
    }

    fn float(&mut self) -> R<f64> {
        match self.r.item()? {
            Tok::Float(v) => Ok(v),
            // msgspec takes an int for a float field
            Tok::Int(v) => Ok(v as f64),
            t => expected("float", &t),
        }
    }

    fn str(&mut self) -> R<&'a str> {
        match self.r.item()? {
            Tok::Str(s) => std::str::from_utf8(s).or_else(|_| fail("Invalid UTF-8 encoded string")),
            t => expected("str", &t),
        }
    }

    fn bin(&mut self) -> R<&'a [u8]> {
        match self.r.item()? {
            Tok::Bin(b) => Ok(b),
            t => expected("bytes", &t),
        }
    }

    /// An engine hash: an int (a negative int64 folded onto uint64, as the index keeps it) or bytes.
    #[inline]
    fn hash(&mut self) -> R<BlockHash> {
        // kvroute writes most engine hashes as uint64 (0xcf + 8 bytes): read those directly.
        if let Some((&0xcf, tail)) = self.r.rest().split_first() {
            if let Some(b) = tail.first_chunk::<8>() {
                self.r.advance(9);
                return Ok(BlockHash::Int(u64::from_be_bytes(*b)));
            }
        }
        if let Some(v) = self.r.int()? {
            return Ok(BlockHash::Int(v as u64));
        }
        match self.r.item()? {
            Tok::Int(v) => Ok(BlockHash::Int(v as u64)),
            Tok::Bin(b) => Ok(BlockHash::Bytes(b.to_vec())),
            t => expected("int | bytes", &t),
        }
    }

    /// A content key's bytes.
    #[inline]
    fn key(&mut self) -> R<SnapKey> {
        // A 16-byte key is 0xc4 0x10 + 16 bytes: read it directly.
        if let Some((&[0xc4, 16], tail)) = self.r.rest().split_first_chunk::<2>() {
            if let Some(k) = tail.first_chunk::<16>() {
                self.r.advance(18);
                return Ok(SnapKey::Key(*k));
            }
        }
        self.bin().map(SnapKey::of)
    }

    /// An array's length (entered: `leave` after its items). `exact`: an array-like Struct's fields.
    fn array(&mut self, exact: Option<u32>) -> R<u32> {
        let n = match self.r.item()? {
            Tok::Arr(n) => n,
            t => return expected("array", &t),
        };
        if let Some(want) = exact {
            if n != want {
                return fail(format!("Expected `array` of length {want}, got {n}"));
            }
        }
        self.r.enter()?;
        Ok(n)
    }

    /// Room to reserve for `n` items: never more than the bytes left (each item takes one).
    fn room(&self, n: u32) -> usize {
        (n as usize).min(self.r.remaining())
    }

    /// A list of items read by `item`, each error placed at its index.
    fn list<T>(&mut self, mut item: impl FnMut(&mut Self) -> R<T>) -> R<Vec<T>> {
        let n = self.array(None)?;
        let mut out = Vec::with_capacity(self.room(n));
        for i in 0..n as usize {
            out.push(at(item(self), index(i))?);
        }
        self.r.leave();
        Ok(out)
    }

    fn keys(&mut self) -> R<Vec<SnapKey>> {
        self.list(Self::key)
    }

    fn hashes(&mut self) -> R<Vec<BlockHash>> {
        self.list(Self::hash)
    }

    fn group(&mut self) -> R<SnapGroup> {
        self.array(Some(7))?;
        let g = SnapGroup {
            group_idx: at(self.i64(), field("group_idx"))?,
            kind: at(self.str(), field("kind"))?.to_owned(),
            window: at(self.opt_i64(), field("window"))?,
            block_size: at(self.i64(), field("block_size"))?,
            hashes: at(self.hashes(), field("hashes"))?,
            keys: at(self.keys(), field("keys"))?,
            masks: at(self.list(Self::i64), field("masks"))?,
        };
        self.r.leave();
        Ok(g)
    }

    fn worker(&mut self) -> R<(String, i64, SnapWorker)> {
        // 9 fields, or 10 with the trailing SGLang bigram mark (a file written before the mark
        // has 9 and restores every worker unmarked; kvroute/_snapshot.py's `SnapWorker.bigram`).
        let n = self.array(None)?;
        if n != 9 && n != 10 {
            return fail(format!("Expected `array` of length 9 or 10, got {n}"));
        }
        let worker_id = at(self.str(), field("worker_id"))?.to_owned();
        let dp_rank = at(self.i64(), field("dp_rank"))?;
        let classes = at(
            self.list(|b| {
                b.array(Some(2))?;
                let c = (at(b.i64(), index(0))?, at(b.i64(), index(1))?);
                b.r.leave();
                Ok(c)
            }),
            field("classes"),
        )?;
        let sw = SnapWorker {
            classes,
            primary: at(self.opt_i64(), field("primary"))?,
            lookahead: at(self.i64(), field("lookahead"))?,
            hashes: at(self.hashes(), field("hashes"))?,
            keys: at(self.keys(), field("keys"))?,
            special: at(
                self.list(|b| {
                    b.array(Some(2))?;
                    let h = at(b.hash(), index(0))?;
                    let c = at(b.list(Self::i64), index(1))?;
                    b.r.leave();
                    Ok((h, c))
                }),
                field("special"),
            )?,
            groups: at(self.list(Self::group), field("groups"))?,
            bigram: n == 10 && at(self.bool(), field("bigram"))?,
        };
        self.r.leave();
        Ok((worker_id, dp_rank, sw))
    }

    fn cursor(&mut self) -> R<(String, i64, i128, f64)> {
        self.array(Some(3))?;
        let worker_id = at(self.str(), field("worker_id"))?.to_owned();
        let dp_rank = at(self.i64(), field("dp_rank"))?;
        self.array(Some(2)).map_err(|mut e| {
            e.path.push(".cursor".into());
            e
        })?;
        let seq = at(at(self.int(), field("seq")), field("cursor"))?;
        let ts = at(at(self.float(), field("ts")), field("cursor"))?;
        self.r.leave();
        self.r.leave();
        Ok((worker_id, dp_rank, seq, ts))
    }

    fn file(&mut self) -> R<SnapFile> {
        let n = match self.r.item()? {
            Tok::Map(n) => n,
            t => return expected("object", &t),
        };
        self.r.enter()?;
        let (mut workers, mut cursors) = (None, None);
        let (mut format, mut version, mut hash_version) = (String::new(), 0, 0);
        let mut seen = [false; 4];
        for _ in 0..n {
            let name = match self.r.item()? {
                Tok::Str(s) => s,
                t => return at(expected("str", &t), || "key".into()),
            };
            // A repeated key: the last one wins, as in msgspec.
            match name {
                b"format" => {
                    format = at(self.str(), field("format"))?.to_owned();
                    seen[0] = true;
                }
                b"version" => {
                    version = at(self.int(), field("version"))?;
                    seen[1] = true;
                }
                b"hash_version" => {
                    hash_version = at(self.int(), field("hash_version"))?;
                    seen[2] = true;
                }
                b"created" => {
                    at(self.float(), field("created"))?;
                    seen[3] = true;
                }
                b"workers" => workers = Some(at(self.list(Self::worker), field("workers"))?),
                b"cursors" => cursors = Some(at(self.list(Self::cursor), field("cursors"))?),
                _ => self.r.skip()?,
            }
        }
        self.r.leave();
        let names = ["format", "version", "hash_version", "created"];
        if let Some(i) = seen.iter().position(|s| !s) {
            return fail(format!("Object missing required field `{}`", names[i]));
        }
        let Some(workers) = workers else {
            return fail("Object missing required field `workers`");
        };
        let Some(cursors) = cursors else {
            return fail("Object missing required field `cursors`");
        };
        if self.r.remaining() != 0 {
            return fail(format!(
                "MessagePack data is malformed: trailing characters (byte {})",
                self.r.pos()
            ));
        }
        Ok(SnapFile {
            format,
            version,
            hash_version,
            workers,
            cursors,
        })
    }
}

/// Read a snapshot file (its header's values are kvroute/_snapshot.py's to check): every worker's
/// tables and the cursors, or why the file is unreadable. Any bytes give one or the other.
pub fn read(data: &[u8]) -> Result<SnapFile, SnapReadError> {
    Body {
        r: Reader::new(data),
    }
    .file()
}

// --- writing the file ----------------------------------------------------------------------
//
// The same bytes kvroute/_snapshot.py's `write_snapshot` has msgspec write for `_Snapshot` (a map;
// workers and cursors array-like, every field written), so a snapshot can be taken without a Python
// object per entry and without a file (the JetStream relay puts it in an object store). Writes go
// to a `Vec`, which grows and cannot fail: their `Result`s carry nothing.

fn put_hash(out: &mut Vec<u8>, h: &BlockHash) {
    match h {
        BlockHash::Int(i) => drop(rmp::encode::write_uint(out, *i)),
        BlockHash::Bytes(b) => drop(rmp::encode::write_bin(out, b)),
    }
}

fn put_hashes(out: &mut Vec<u8>, hs: &[BlockHash]) {
    let _ = rmp::encode::write_array_len(out, hs.len() as u32);
    hs.iter().for_each(|h| put_hash(out, h));
}

fn put_keys(out: &mut Vec<u8>, ks: &[SnapKey]) {
    let _ = rmp::encode::write_array_len(out, ks.len() as u32);
    for k in ks {
        // A malformed key is never exported (the index holds 16 bytes or nothing): written empty.
        let _ = rmp::encode::write_bin(out, if let SnapKey::Key(k) = k { k } else { b"" });
    }
}

fn put_ints(out: &mut Vec<u8>, vs: &[i64]) {
    let _ = rmp::encode::write_array_len(out, vs.len() as u32);
    vs.iter()
        .for_each(|&v| drop(rmp::encode::write_sint(out, v)));
}

fn put_opt(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => drop(rmp::encode::write_sint(out, v)),
        None => drop(rmp::encode::write_nil(out)),
    }
}

/// An int the file holds as msgspec writes a Python int (int64, else uint64); None beyond both.
fn put_int(out: &mut Vec<u8>, v: i128) -> Option<()> {
    match (i64::try_from(v), u64::try_from(v)) {
        (Ok(v), _) => drop(rmp::encode::write_sint(out, v)),
        (_, Ok(v)) => drop(rmp::encode::write_uint(out, v)),
        _ => return None,
    }
    Some(())
}

fn put_worker(out: &mut Vec<u8>, worker_id: &str, dp_rank: i64, sw: &SnapWorker) {
    use rmp::encode as e;
    let _ = e::write_array_len(out, 10);
    let _ = e::write_str(out, worker_id);
    let _ = e::write_sint(out, dp_rank);
    let _ = e::write_array_len(out, sw.classes.len() as u32);
    for &(a, b) in &sw.classes {
        let _ = e::write_array_len(out, 2);
        let _ = e::write_sint(out, a);
        let _ = e::write_sint(out, b);
    }
    put_opt(out, sw.primary);
    let _ = e::write_sint(out, sw.lookahead);
    put_hashes(out, &sw.hashes);
    put_keys(out, &sw.keys);
    let _ = e::write_array_len(out, sw.special.len() as u32);
    for (h, copies) in &sw.special {
        let _ = e::write_array_len(out, 2);
        put_hash(out, h);
        put_ints(out, copies);
    }
    let _ = e::write_array_len(out, sw.groups.len() as u32);
    for g in &sw.groups {
        let _ = e::write_array_len(out, 7);
        let _ = e::write_sint(out, g.group_idx);
        let _ = e::write_str(out, &g.kind);
        put_opt(out, g.window);
        let _ = e::write_sint(out, g.block_size);
        put_hashes(out, &g.hashes);
        put_keys(out, &g.keys);
        put_ints(out, &g.masks);
    }
    let _ = e::write_bool(out, sw.bigram);
}

impl SnapFile {
    /// The file's bytes (``created``: its creation time), as `read` reads them back; None when
    /// an int (version, hash version, a cursor's seq) is outside what msgpack holds.
    pub fn to_bytes(&self, created: f64) -> Option<Vec<u8>> {
        use rmp::encode as e;
        let mut out = Vec::with_capacity(64 + 64 * self.workers.len());
        let o = &mut out;
        let _ = e::write_map_len(o, 6);
        let _ = e::write_str(o, "format");
        let _ = e::write_str(o, &self.format);
        let _ = e::write_str(o, "version");
        put_int(o, self.version)?;
        let _ = e::write_str(o, "hash_version");
        put_int(o, self.hash_version)?;
        let _ = e::write_str(o, "created");
        let _ = e::write_f64(o, created);
        let _ = e::write_str(o, "workers");
        let _ = e::write_array_len(o, self.workers.len() as u32);
        for (worker_id, dp_rank, sw) in &self.workers {
            put_worker(o, worker_id, *dp_rank, sw);
        }
        let _ = e::write_str(o, "cursors");
        let _ = e::write_array_len(o, self.cursors.len() as u32);
        for (worker_id, dp_rank, seq, ts) in &self.cursors {
            let _ = e::write_array_len(o, 3);
            let _ = e::write_str(o, worker_id);
            let _ = e::write_sint(o, *dp_rank);
            let _ = e::write_array_len(o, 2);
            put_int(o, *seq)?;
            let _ = e::write_f64(o, *ts);
        }
        Some(out)
    }
}

// --- exporting and importing a worker ------------------------------------------------------

impl<K: WorkerName> Index<K> {
    /// Every worker holding something, with its tables.
    pub fn export(&self) -> Vec<(K, SnapWorker)> {
        let mut out = Vec::new();
        let mut live: Vec<&super::Worker<K>> = self
            .workers
            .iter()
            .filter_map(Option::as_deref)
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
                    SnapKey::Unclaimable
                } else {
                    SnapKey::Key(*self.table.key(id))
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
                        sg.keys.push(k.map_or(SnapKey::Unclaimable, SnapKey::Key));
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

    /// Why a snapshot worker cannot be restored (`_snapshot_problem`, check for check and in its
    /// order; None: it can). The distinct-hash checks build the worker's own engine-hash tables
    /// (each hash mapped to its position in the file), so a restorable worker's tables are built
    /// once, by the check; `import_worker` then fills in the key ids.
    fn check_and_build(&self, sw: &SnapWorker) -> Result<(EMap<u32>, Vec<Group>), String> {
        let lim = self.limits;
        if sw.hashes.is_empty() && sw.groups.iter().all(|g| g.hashes.is_empty()) {
            return Err("holds nothing".into());
        }
        if sw.hashes.len() != sw.keys.len() {
            return Err("mismatched tables".into());
        }
        let blocks = positions(&sw.hashes).ok_or("duplicate engine hashes")?;
        if sw.classes.is_empty() || sw.classes.len() > lim.max_block_sizes {
            return Err(format!("{} block sizes", sw.classes.len()));
        }
        for &(bs, la) in &sw.classes {
            if !(1..=1 << 20).contains(&bs) || !(0..=1 << 16).contains(&la) {
                return Err(format!("block size / lookahead ({bs}, {la})"));
            }
        }
        if !(0..=1 << 16).contains(&sw.lookahead) {
            return Err(format!("lookahead {}", sw.lookahead));
        }
        if sw.keys.contains(&SnapKey::Malformed) {
            return Err("malformed content keys".into());
        }
        let mut seen: FxHashSet<&BlockHash> = FxHashSet::default();
        for (h, c) in &sw.special {
            if !blocks.contains(h)
                || !seen.insert(h)
                || c.len() != 4
                || c.iter().any(|&v| v != 0 && v != 1)
            {
                return Err("inconsistent tier entries".into());
            }
        }
        let mut total = sw.hashes.len();
        if sw.groups.len() > lim.max_groups_per_worker {
            return Err(format!("{} groups", sw.groups.len()));
        }
        let mut gids: FxHashSet<i64> = FxHashSet::default();
        let mut groups = Vec::with_capacity(sw.groups.len());
        for g in &sw.groups {
            let idx = g.group_idx;
            if Some(idx) == sw.primary || !gids.insert(idx) {
                return Err(format!("group {idx} listed twice"));
            }
            let kind = GroupKind::from_name(&g.kind);
            let Some(kind) = kind.filter(|_| (0..=1 << 20).contains(&g.block_size)) else {
                return Err(format!(
                    "group {idx}: kind '{}' / block size {}",
                    g.kind, g.block_size
                ));
            };
            let inconsistent = || format!("group {idx}: inconsistent tables");
            if g.hashes.len() != g.keys.len() || g.keys.len() != g.masks.len() {
                return Err(inconsistent());
            }
            let mut grp = Group::new(kind, g.window, g.block_size);
            grp.blocks.reserve_for(&g.hashes);
            for h in &g.hashes {
                if grp.blocks.insert(h, (None, 0)).is_some() {
                    return Err(inconsistent());
                }
            }
            if g.keys.contains(&SnapKey::Malformed) || g.masks.iter().any(|m| !(1..=15).contains(m))
            {
                return Err(format!("group {idx}: malformed entries"));
            }
            total += g.hashes.len();
            groups.push(grp);
        }
        if total > lim.max_entries_per_worker {
            return Err(format!("{total} entries exceed max_entries_per_worker"));
        }
        Ok((blocks, groups))
    }

    /// Restore one worker from snapshot tables (`restore` + `_load_worker`): Err(reason) when
    /// its tables are inconsistent or it is already in the index; nothing is changed then.
    pub fn import_worker(&mut self, key: &K, sw: &SnapWorker) -> Result<(), String> {
        let (mut blocks, mut groups) = self.check_and_build(sw)?;
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
        // Keys are interned in file order (ids as a restore always gave them).
        let ids: Vec<u32> = sw
            .keys
            .iter()
            .map(|k| match k.key() {
                Some(k) => self.table.retain_key(&k),
                None => NOKEY,
            })
            .collect();
        for v in blocks.values_mut() {
            *v = ids[*v as usize];
        }
        w.blocks = blocks;
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
        for (sg, mut grp) in sw.groups.iter().zip(groups.drain(..)) {
            for ((h, k), &m) in sg.hashes.iter().zip(&sg.keys).zip(&sg.masks) {
                let k = k.key();
                if let Some(cur) = grp.blocks.get_mut(h) {
                    *cur = (k, m as u8);
                }
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
        // The shared tables follow from the worker's: per key, the union of its engine hashes'
        // tier masks. A key two engine hashes name (rare) also gets its per-tier counts.
        let mut twice: Vec<u32> = Vec::new();
        for (h, &id) in sw.hashes.iter().zip(&ids) {
            if id == NOKEY {
                continue;
            }
            let mask = if w.special.is_empty() {
                1
            } else {
                w.special.get(h).map_or(1, mask_of)
            };
            let flags = self.table.flags(id, slot);
            if flags == 0 && mask == 1 {
                // The common case, `set_mask(slot, id, 0, 1)` without reading the flags again.
                self.table.set_flags(id, slot, H);
                continue;
            }
            let old = mask_of_flags(flags);
            if old != 0 {
                twice.push(id);
            }
            self.set_mask(slot, id, old, old | mask);
        }
        if !twice.is_empty() {
            let twice: FxHashSet<u32> = twice.into_iter().collect();
            let mut counts: FxHashMap<u32, [i32; 4]> = FxHashMap::default();
            for (h, &id) in sw.hashes.iter().zip(&ids) {
                if twice.contains(&id) {
                    let mask = w.special.get(h).map_or(1, mask_of);
                    let t = counts.entry(id).or_default();
                    for (i, c) in t.iter_mut().enumerate() {
                        *c += i32::from(mask >> i & 1);
                    }
                }
            }
            w.multi.extend(counts);
        }
        self.put(w);
        Ok(())
    }
}

/// Engine hash -> its position, for distinct `hashes` (None: one appears twice).
fn positions(hashes: &[BlockHash]) -> Option<EMap<u32>> {
    let mut map = EMap::default();
    map.reserve_for(hashes);
    for (i, h) in hashes.iter().enumerate() {
        if map.insert(h, i as u32).is_some() {
            return None;
        }
    }
    Some(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Limits;
    use crate::protocols::{medium_of, BlockStored, Event};
    use rmp::encode as e;

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct W(String, i64);

    impl WorkerName for W {
        fn label(&self) -> String {
            format!("{}/{}", self.0, self.1)
        }
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[i64], medium: Option<&str>) -> Event {
        Event::Stored(Box::new(BlockStored {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: 2,
            medium: medium.map(medium_of),
            ..BlockStored::default()
        }))
    }

    fn hash(out: &mut Vec<u8>, h: &BlockHash) {
        match h {
            BlockHash::Int(i) => drop(e::write_uint(out, *i)),
            BlockHash::Bytes(b) => drop(e::write_bin(out, b)),
        }
    }

    fn keys(out: &mut Vec<u8>, ks: &[SnapKey]) {
        e::write_array_len(out, ks.len() as u32).unwrap();
        for k in ks {
            match k {
                SnapKey::Key(k) => e::write_bin(out, k).unwrap(),
                _ => e::write_bin(out, b"").unwrap(),
            }
        }
    }

    /// A snapshot file as kvroute/_snapshot.py writes it (msgspec's encoding of `_Snapshot`).
    fn file(workers: &[(W, SnapWorker)], cursors: &[(W, i64, f64)]) -> Vec<u8> {
        let mut out = Vec::new();
        let o = &mut out;
        e::write_map_len(o, 6).unwrap();
        e::write_str(o, "format").unwrap();
        e::write_str(o, "kvroute-index").unwrap();
        for (name, v) in [("version", 1), ("hash_version", 2)] {
            e::write_str(o, name).unwrap();
            e::write_sint(o, v).unwrap();
        }
        e::write_str(o, "created").unwrap();
        e::write_f64(o, 1.5).unwrap();
        e::write_str(o, "workers").unwrap();
        e::write_array_len(o, workers.len() as u32).unwrap();
        for (w, sw) in workers {
            e::write_array_len(o, 9).unwrap();
            e::write_str(o, &w.0).unwrap();
            e::write_sint(o, w.1).unwrap();
            e::write_array_len(o, sw.classes.len() as u32).unwrap();
            for &(a, b) in &sw.classes {
                e::write_array_len(o, 2).unwrap();
                e::write_sint(o, a).unwrap();
                e::write_sint(o, b).unwrap();
            }
            match sw.primary {
                Some(p) => drop(e::write_sint(o, p)),
                None => e::write_nil(o).unwrap(),
            }
            e::write_sint(o, sw.lookahead).unwrap();
            e::write_array_len(o, sw.hashes.len() as u32).unwrap();
            sw.hashes.iter().for_each(|h| hash(o, h));
            keys(o, &sw.keys);
            e::write_array_len(o, sw.special.len() as u32).unwrap();
            for (h, c) in &sw.special {
                e::write_array_len(o, 2).unwrap();
                hash(o, h);
                e::write_array_len(o, c.len() as u32).unwrap();
                c.iter().for_each(|&v| drop(e::write_sint(o, v)));
            }
            e::write_array_len(o, sw.groups.len() as u32).unwrap();
            for g in &sw.groups {
                e::write_array_len(o, 7).unwrap();
                e::write_sint(o, g.group_idx).unwrap();
                e::write_str(o, &g.kind).unwrap();
                match g.window {
                    Some(v) => drop(e::write_sint(o, v)),
                    None => e::write_nil(o).unwrap(),
                }
                e::write_sint(o, g.block_size).unwrap();
                e::write_array_len(o, g.hashes.len() as u32).unwrap();
                g.hashes.iter().for_each(|h| hash(o, h));
                keys(o, &g.keys);
                e::write_array_len(o, g.masks.len() as u32).unwrap();
                g.masks.iter().for_each(|&v| drop(e::write_sint(o, v)));
            }
        }
        e::write_str(o, "cursors").unwrap();
        e::write_array_len(o, cursors.len() as u32).unwrap();
        for (w, seq, ts) in cursors {
            e::write_array_len(o, 3).unwrap();
            e::write_str(o, &w.0).unwrap();
            e::write_sint(o, w.1).unwrap();
            e::write_array_len(o, 2).unwrap();
            e::write_sint(o, *seq).unwrap();
            e::write_f64(o, *ts).unwrap();
        }
        out
    }

    /// Two workers sharing content, one with an off-GPU tier, one with a second engine hash for a
    /// key it holds and a block that can never be claimed (unknown parent).
    fn sample() -> Index<W> {
        let mut idx: Index<W> = Index::new(Limits::default());
        let (a, b) = (W("a".into(), 0), W("b".into(), 1));
        idx.apply(&a, &stored(&[1, 2], None, &[1, 2, 3, 4], None));
        idx.apply(&a, &stored(&[2], None, &[1, 2, 3, 4], Some("CPU")));
        idx.apply(&b, &stored(&[7, 8], None, &[1, 2, 3, 4], None));
        idx.apply(&b, &stored(&[9], None, &[1, 2], None));
        idx.apply(&b, &stored(&[10], Some(99), &[5, 6], None));
        idx
    }

    fn restored(data: &[u8]) -> Index<W> {
        let f = read(data).expect("readable");
        let mut idx: Index<W> = Index::new(Limits::default());
        for (id, rank, sw) in &f.workers {
            idx.import_worker(&W(id.clone(), *rank), sw)
                .expect("restorable");
        }
        idx
    }

    #[test]
    fn a_snapshot_restores_to_the_same_tables() {
        let idx = sample();
        let data = file(&idx.export(), &[(W("a".into(), 0), 41, 2.5)]);
        let f = read(&data).expect("readable");
        assert_eq!(
            (f.format.as_str(), f.version, f.hash_version),
            ("kvroute-index", 1, 2)
        );
        assert_eq!(f.cursors, vec![("a".to_owned(), 0, 41, 2.5)]);
        let back = restored(&data);
        // Equal tables (a hash table's iteration order follows its history, so entries are sorted).
        let sorted = |idx: &Index<W>| {
            let mut out = idx.export();
            for (_, sw) in &mut out {
                let mut pairs: Vec<(BlockHash, SnapKey)> =
                    sw.hashes.drain(..).zip(sw.keys.drain(..)).collect();
                pairs.sort_by_key(|(h, _)| format!("{h:?}"));
                (sw.hashes, sw.keys) = pairs.into_iter().unzip();
            }
            out
        };
        assert_eq!(sorted(&back), sorted(&idx));
        let size = |idx: &Index<W>| {
            let s = idx.stats();
            (s.workers, s.entries, s.distinct_keys) // the event counters are not saved
        };
        assert_eq!(size(&back), size(&idx));
        assert_eq!(back.table.flag_key_counts(), idx.table.flag_key_counts());
        // The per-tier counts of a key held under two engine hashes come back too.
        let multi = |idx: &Index<W>| -> Vec<(Key, [i32; 4])> {
            let mut m: Vec<(Key, [i32; 4])> = (idx.workers.iter().flatten())
                .flat_map(|w| w.multi.iter().map(|(id, c)| (*idx.table.key(*id), *c)))
                .collect();
            m.sort();
            m
        };
        assert_eq!(multi(&back), multi(&idx));
        assert!(!multi(&idx).is_empty(), "the sample holds a key twice");
    }

    #[test]
    fn to_bytes_writes_what_read_reads_back() {
        let workers: Vec<(String, i64, SnapWorker)> = sample()
            .export()
            .into_iter()
            .map(|(w, sw)| (w.0, w.1, sw))
            .collect();
        let f = SnapFile {
            format: "kvroute-index".into(),
            version: 1,
            hash_version: 2,
            workers,
            // A seq past int64 is written as msgpack's uint64, as msgspec writes a Python int.
            cursors: vec![
                ("a".into(), 0, 41, 2.5),
                ("b".into(), 1, i128::from(u64::MAX), 1.0),
            ],
        };
        let data = f.to_bytes(1.5).expect("every int fits");
        assert_eq!(read(&data).expect("readable"), f);
        // The same tables as the format's other writer (the tests' `file`, msgspec's layout) restore.
        assert_eq!(
            restored(&data).export(),
            restored(&file(&sample().export(), &[])).export()
        );
        let too_big = SnapFile {
            cursors: vec![("a".into(), 0, i128::from(u64::MAX) + 1, 0.0)],
            ..SnapFile::default()
        };
        assert_eq!(too_big.to_bytes(0.0), None);
    }

    #[test]
    fn an_inconsistent_worker_is_refused_and_changes_nothing() {
        let idx = sample();
        let mut workers = idx.export();
        workers[1].1.hashes[1] = workers[1].1.hashes[0].clone();
        let mut fresh: Index<W> = Index::new(Limits::default());
        let f = read(&file(&workers, &[])).unwrap();
        let (id, rank, sw) = &f.workers[1];
        let err = fresh.import_worker(&W(id.clone(), *rank), sw);
        assert_eq!(err, Err("duplicate engine hashes".into()));
        assert_eq!(fresh.stats(), Index::<W>::new(Limits::default()).stats());
        assert!(fresh.by_key.is_empty() && fresh.table.flag_key_counts() == [0; 5]);
    }

    #[test]
    fn a_damaged_file_is_an_error_never_a_panic() {
        let data = file(&sample().export(), &[(W("b".into(), 1), 3, 1.0)]);
        for n in 0..data.len() {
            assert!(read(&data[..n]).is_err(), "a file cut at {n} reads");
        }
        let mut longer = data.clone();
        longer.push(0);
        let err = read(&longer).unwrap_err().to_string();
        assert!(err.contains("trailing characters"), "{err}");
        // Every byte replaced by every value that changes a marker's kind: read, and restore what
        // reads, without a panic.
        for i in 0..data.len() {
            for v in [
                0x00, 0x7f, 0x90, 0xc0, 0xc1, 0xc4, 0xcf, 0xd9, 0xdc, 0xdd, 0xff,
            ] {
                let mut bad = data.clone();
                bad[i] = v;
                if let Ok(f) = read(&bad) {
                    let mut idx: Index<W> = Index::new(Limits::default());
                    for (id, rank, sw) in &f.workers {
                        let _ = idx.import_worker(&W(id.clone(), *rank), sw);
                    }
                }
            }
        }
    }

    #[test]
    fn a_wrong_type_is_named_with_its_path() {
        let mut data = file(&sample().export(), &[]);
        // the first worker's `primary` (nil) becomes a str
        let at = data
            .windows(3)
            .position(|w| w == [0xc0, 0x00, 0x92])
            .expect("primary nil, lookahead 0, two hashes");
        data[at] = 0xa0;
        let err = read(&data).unwrap_err().to_string();
        assert_eq!(
            err,
            "Expected `int | None`, got `str` - at `$.workers[0].primary`"
        );
    }
}
