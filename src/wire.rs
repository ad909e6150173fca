//! The wire decoder: one msgpack payload (an engine's `EventBatch`) into a [`Batch`], with every rule
//! `kvroute/_wire.py` had when it decoded with msgspec (docs/protocol.md §3), result for result.
//!
//! Both event encodings decode: the map form (`{"type": "BlockStored", ...}`) and the tagged-array
//! form (`["BlockStored", f1, f2, ...]`), in an array batch (`[ts, events, dp_rank]`) or a map batch
//! (`{"ts": .., "events": [..]}`). A bad event costs that event, never the batch: a store kvroute
//! cannot use is skipped and counted per reason; an unreadable event that may have been a removal or
//! a clear is counted and makes the batch `untrusted`; an unknown `type` is skipped and counted.
//! Only an unreadable envelope (the msgpack itself, `ts`, the event array) or a batch past a
//! [`Limits`] cap is a [`DecodeError`].
//!
//! Any input gives a batch or a `DecodeError`: nothing here indexes without a bound check or unwraps
//! input-derived data, and allocation is bounded by the payload (every reserved element is backed
//! by at least one payload byte) and by the hard ceilings, which are checked on each length header.
//!
//! The reasons an event is unreadable are worded the way msgspec worded them (they end up in
//! `Batch::untrusted`, which the recovery machine logs), paths included.

use std::fmt;

use rmp::decode::{self as rd, Bytes, RmpRead};
use rmp::Marker;

#[cfg(fuzzing)]
pub use token_ids::both_readers;
use token_ids::{uint_run, WRITE_SLACK};

use crate::protocols::{
    medium_of, Batch, BlockHash, BlockRemoved, BlockStored, Event, Medium, RemovedHashes, Value,
};

mod token_ids;

/// Hard ceiling on the events of one batch, checked on the event array's length header.
pub const MAX_EVENTS_PER_BATCH: u32 = 65_536;
/// Hard ceiling on the hashes of one event, checked on its `block_hashes` length header.
pub const MAX_BLOCKS_PER_EVENT: u32 = 65_536;
/// Hard ceiling on the token ids of one store, checked on its `token_ids` length header.
pub const MAX_TOKENS_PER_EVENT: u32 = 1 << 22;
/// Deepest container nesting a payload may have. msgspec refused nesting past Python's recursion
/// limit (1,000 frames less the caller's stack); this fixes the cap where a shallow caller had it,
/// and keeps the decoder's own recursion bounded.
pub const MAX_DEPTH: usize = 990;

/// Reason tokens of skipped events (`Batch::skipped`), the strings kvroute/_wire.py uses.
pub const SKIP_UNKNOWN_TYPE: &str = "unknown-type";
pub const SKIP_MALFORMED: &str = "malformed";
pub const SKIP_SHAPE: &str = "shape";
pub const SKIP_BLOCK_SIZE: &str = "block-size";
pub const SKIP_EXTRA_KEYS: &str = "extra-keys";
pub const SKIP_LOOKAHEAD: &str = "lookahead";

/// Full-attention KV-cache group kinds (None: an engine from before hybrid models). Other kinds'
/// stores may skip null blocks (fewer hashes than blocks) or carry no tokens at all.
const FULL_KINDS: [&str; 6] = [
    "full_attention",
    "mla_attention",
    "sink_full_attention",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SinkFullAttentionSpec",
];

/// Caps on what one decoded batch may hold (kvroute's `Limits`); past one, the batch is a
/// `DecodeError`. i128 so that any cap a Python caller sets compares with any msgpack integer
/// exactly as Python compared them (a negative cap refuses everything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_events_per_batch: i128,
    pub max_blocks_per_event: i128,
    pub max_block_size: i128,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_events_per_batch: MAX_EVENTS_PER_BATCH.into(),
            max_blocks_per_event: MAX_BLOCKS_PER_EVENT.into(),
            max_block_size: 65_536,
        }
    }
}

/// A payload that is not a batch: unreadable envelope or msgpack, or a batch past a cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError {
    pub message: String,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DecodeError {}

fn fatal(message: impl Into<String>) -> DecodeError {
    DecodeError {
        message: message.into(),
    }
}

/// Decode one payload into a [`Batch`]. Integers past `i64::MAX` in i64 fields (token ids, sizes,
/// group indexes: never meaningful, only a hostile publisher sends them) saturate to `i64::MAX`;
/// block hashes keep all 64 bits.
pub fn decode(payload: &[u8], limits: &Limits) -> Result<Batch, DecodeError> {
    decode_full(payload, limits).map(|d| d.batch)
}

/// Why a decoded batch must not be applied, or None when it may be: the twin rule the raw-bytes
/// ingest (`PrefixIndex.apply_payload`) and the subscriber's decode of a batch for an `events()`
/// listener share. A NaN or infinite ts cannot tell a duplicate from a restart, nor be saved as a
/// position: the batch is a hole, like an undecodable one (the detail names the ts as Python's
/// repr does). An untrusted batch (a removal or clear that could not be read) could leave blocks
/// the engine dropped. Returns (kind, detail) with kind "undecodable payload" or "untrusted batch".
pub fn verdict(batch: &Batch) -> Option<(&'static str, String)> {
    let ts = batch.ts;
    if !ts.is_finite() {
        let shown = if ts.is_nan() {
            "nan"
        } else if ts > 0.0 {
            "inf"
        } else {
            "-inf"
        };
        return Some(("undecodable payload", format!("ts {shown} is not finite")));
    }
    batch
        .untrusted
        .as_ref()
        .map(|why| ("untrusted batch", why.clone()))
}

/// What the recovery machine needs from one decode, without walking the events again.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    pub events: usize,
    pub stored_blocks: usize,
    pub removed_blocks: usize,
    pub clears: usize,
    /// Events of a type this kvroute does not know (also counted in `Batch::skipped`).
    pub unknown_events: u64,
}

impl Summary {
    /// Count `batch`'s events and the blocks they store and remove.
    pub fn of(batch: &Batch) -> Summary {
        let unknown_events = (batch.skipped.iter())
            .find(|(r, _)| r == SKIP_UNKNOWN_TYPE)
            .map_or(0, |(_, n)| *n);
        let mut s = Summary {
            events: batch.events.len(),
            unknown_events,
            ..Summary::default()
        };
        for ev in &batch.events {
            match ev {
                Event::Stored(st) => s.stored_blocks += st.block_hashes.len(),
                Event::Removed(rm) => s.removed_blocks += rm.block_hashes.len(),
                Event::Cleared => s.clears += 1,
            }
        }
        s
    }
}

/// Where an integer past `i64::MAX` sits in a decoded batch (it is stored saturated there), so the
/// Python layer can rebuild the exact int msgspec gave. Empty for every sane payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WideField {
    DataParallelRank,
    BlockSize,
    LoraId,
    GroupIdx,
    SlidingWindow,
    Token(usize),
    Lookahead(usize, usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wide {
    /// Index in `Batch::events` (unused for the data-parallel rank).
    pub event: usize,
    pub field: WideField,
    pub value: u64,
}

pub(crate) struct Decoded {
    pub batch: Batch,
    pub wide: Vec<Wide>,
}

pub(crate) fn decode_full(payload: &[u8], limits: &Limits) -> Result<Decoded, DecodeError> {
    let Some(&first) = payload.first() else {
        return Err(fatal("empty payload"));
    };
    let mut d = Dec {
        buf: payload,
        pos: 0,
        depth: 0,
        event_start: 0,
        limits: *limits,
        wide: Vec::new(),
    };
    let mut st = State::new(limits);
    let mut ts: Option<f64> = None;
    let mut dpr: Option<i128> = None;
    let mut have_events = false;
    if matches!(
        Marker::from_u8(first),
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32
    ) {
        let n = d.map_len_fatal()?;
        for _ in 0..n {
            let key = match d.tok()? {
                Tok::Str(s) => s,
                t => {
                    return Err(fatal(format!(
                        "Expected `str`, got `{}` - at `key` in `$`",
                        t.name()
                    )))
                }
            };
            match key {
                b"ts" => ts = Some(d.envelope_ts("$.ts")?),
                b"events" => {
                    // A repeated key: the last one wins, as in msgspec (the earlier list was only skipped).
                    st = State::new(limits);
                    d.wide.clear();
                    d.events(&mut st, "$.events")?;
                    have_events = true;
                }
                b"data_parallel_rank" => dpr = d.envelope_dpr("$.data_parallel_rank")?,
                _ => d.skip()?,
            }
        }
        d.leave();
        if ts.is_none() {
            return Err(fatal("Object missing required field `ts`"));
        }
        if !have_events {
            return Err(fatal("Object missing required field `events`"));
        }
    } else {
        let n = match d.tok()? {
            Tok::Arr(n) => n,
            t => return Err(fatal(format!("Expected `array`, got `{}`", t.name()))),
        };
        d.enter()?;
        if n < 2 {
            return Err(fatal(format!(
                "Expected `array` of at least length 2, got {n}"
            )));
        }
        ts = Some(d.envelope_ts("$[0]")?);
        d.events(&mut st, "$[1]")?;
        if n > 2 {
            dpr = d.envelope_dpr("$[2]")?;
            for _ in 3..n {
                d.skip()?;
            }
        }
        d.leave();
    }
    if d.pos != payload.len() {
        return Err(fatal(format!(
            "MessagePack data is malformed: trailing characters (byte {})",
            d.pos
        )));
    }
    let mut wide = std::mem::take(&mut d.wide);
    let batch = st.finish(ts.unwrap_or_default(), dpr, &mut wide)?;
    Ok(Decoded { batch, wide })
}

/// One msgpack item, as far as its header: containers give their length, the rest their value.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Tok<'a> {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Arr(u32),
    Map(u32),
    Ext(i8, &'a [u8]),
}

impl Tok<'_> {
    /// msgspec's name for the type of a value, in "Expected `X`, got `Y`".
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Tok::Nil => "None",
            Tok::Bool(_) => "bool",
            Tok::Int(_) => "int",
            Tok::Float(_) => "float",
            Tok::Str(_) => "str",
            Tok::Bin(_) => "bytes",
            Tok::Arr(_) => "array",
            Tok::Map(_) => "object",
            Tok::Ext(..) => "ext",
        }
    }
}

/// One step of the path to an invalid value (msgspec's error suffix).
#[derive(Clone, Debug)]
enum Seg {
    Field(&'static str),
    Index(usize),
    /// A map value inside an untyped field (msgspec writes `[...]`).
    Value,
    /// The key of a map entry.
    Key,
}

/// Why an event did not decode: a msgspec-style message and, innermost first, the path to the value.
#[derive(Debug)]
struct Invalid {
    msg: String,
    path: Vec<Seg>,
    /// Errors msgspec raised as DecodeError carry no path.
    bare: bool,
}

impl Invalid {
    fn render(&self) -> String {
        if self.bare || self.path.is_empty() {
            return self.msg.clone();
        }
        // Root-first; each Key starts a new group, and msgspec prints the groups innermost first.
        let mut groups: Vec<String> = vec!["$".to_owned()];
        for seg in self.path.iter().rev() {
            let Some(cur) = groups.last_mut() else { break };
            match seg {
                Seg::Field(f) => {
                    cur.push('.');
                    cur.push_str(f);
                }
                Seg::Index(i) => cur.push_str(&format!("[{i}]")),
                Seg::Value => cur.push_str("[...]"),
                Seg::Key => groups.push("key".to_owned()),
            }
        }
        let joined: Vec<String> = groups.iter().rev().map(|g| format!("`{g}`")).collect();
        format!("{} - at {}", self.msg, joined.join(" in "))
    }
}

enum E {
    /// The payload itself is unreadable (msgpack, envelope, depth): the batch is a DecodeError.
    Fatal(DecodeError),
    /// The event does not have kvroute's types: it is skipped.
    Invalid(Invalid),
}

impl From<DecodeError> for E {
    fn from(e: DecodeError) -> Self {
        E::Fatal(e)
    }
}

fn invalid(msg: impl Into<String>) -> E {
    E::Invalid(Invalid {
        msg: msg.into(),
        path: Vec::new(),
        bare: false,
    })
}

fn bare(msg: impl Into<String>) -> E {
    E::Invalid(Invalid {
        msg: msg.into(),
        path: Vec::new(),
        bare: true,
    })
}

fn expected(what: &str, got: &Tok<'_>) -> E {
    invalid(format!("Expected `{what}`, got `{}`", got.name()))
}

/// A struct's key that is not a str (msgspec names a nil key `null`, a nil value `None`).
fn expected_key(got: &Tok<'_>) -> E {
    match got {
        Tok::Nil => invalid("Expected `str`, got `null`"),
        t => expected("str", t),
    }
}

/// Adds one path step to an `Invalid` on its way out.
trait At<T> {
    fn at(self, seg: Seg) -> Result<T, E>;
}

impl<T> At<T> for Result<T, E> {
    fn at(self, seg: Seg) -> Result<T, E> {
        self.map_err(|e| match e {
            E::Invalid(mut inv) => {
                inv.path.push(seg);
                E::Invalid(inv)
            }
            f => f,
        })
    }
}

fn utf8(b: &[u8]) -> Result<&str, E> {
    std::str::from_utf8(b).map_err(|_| bare("Invalid UTF-8 encoded string"))
}

/// The next `n` bytes of `r` (a str, bin or ext body).
#[inline]
fn take<'a>(r: &mut Bytes<'a>, n: usize) -> Result<&'a [u8], DecodeError> {
    let rest = r.remaining_slice();
    let (out, after) = rest.split_at_checked(n).ok_or_else(truncated)?;
    *r = Bytes::new(after);
    Ok(out)
}

/// A str (0xd9-0xdb) or bin (0xc4-0xc6) body, by its marker.
#[inline]
fn str_or_bin(marker: u8, body: &[u8]) -> Tok<'_> {
    if marker >= 0xd9 {
        Tok::Str(body)
    } else {
        Tok::Bin(body)
    }
}

fn truncated() -> DecodeError {
    fatal("Input data was truncated")
}

/// A msgpack item reader over one whole buffer, for kvroute's own files (the snapshot reader in
/// src/index/snapshot.rs): the decoder's own item reader and depth bound, nothing event-specific.
pub(crate) struct Reader<'a>(Dec<'a>);

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader(Dec {
            buf,
            pos: 0,
            depth: 0,
            event_start: 0,
            limits: Limits::default(),
            wide: Vec::new(),
        })
    }

    /// The next item's header (a container's length, a scalar's value).
    #[inline]
    pub(crate) fn item(&mut self) -> Result<Tok<'a>, DecodeError> {
        self.0.tok()
    }

    /// The next item if it is an int, else None without moving (no `Tok` built).
    #[inline]
    pub(crate) fn int(&mut self) -> Result<Option<i128>, DecodeError> {
        self.0.int_fast()
    }

    /// Skip one item, checking only that it is well-formed msgpack.
    pub(crate) fn skip(&mut self) -> Result<(), DecodeError> {
        self.0.skip()
    }

    /// One container level deeper (Err past `MAX_DEPTH`); `leave` when it is read.
    pub(crate) fn enter(&mut self) -> Result<(), DecodeError> {
        self.0.enter()
    }

    pub(crate) fn leave(&mut self) {
        self.0.leave()
    }

    /// The bytes not read yet (for a caller's fast path over a known encoding; `advance` past
    /// what it took).
    #[inline]
    pub(crate) fn rest(&self) -> &'a [u8] {
        self.0.rest()
    }

    /// Move past `n` bytes of `rest()` (at most all of them).
    #[inline]
    pub(crate) fn advance(&mut self, n: usize) {
        self.0.pos = (self.0.pos + n).min(self.0.buf.len());
    }

    /// Bytes read so far.
    pub(crate) fn pos(&self) -> usize {
        self.0.pos
    }

    /// Bytes left to read.
    pub(crate) fn remaining(&self) -> usize {
        self.0.buf.len() - self.0.pos
    }
}

/// The event types this kvroute knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn of(tag: &[u8]) -> Option<Kind> {
        match tag {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }

    fn tag(self) -> &'static [u8] {
        match self {
            Kind::Stored => b"BlockStored",
            Kind::Removed => b"BlockRemoved",
            Kind::Cleared => b"AllBlocksCleared",
        }
    }
}

/// Per-reason counts in first-seen order (the order Python's dict kept).
#[derive(Default)]
struct Counts(Vec<(&'static str, u64)>);

impl Counts {
    fn add(&mut self, reason: &'static str) {
        if let Some(c) = self.0.iter_mut().find(|(r, _)| *r == reason) {
            c.1 += 1;
        } else {
            self.0.push((reason, 1));
        }
    }
}

/// The events of one batch as they decode.
struct State<'l> {
    limits: &'l Limits,
    events: Vec<Event>,
    /// Events that decoded (kept or skipped by the checks): what the events cap counts.
    decoded: usize,
    /// Skips while decoding (unknown, malformed), then skips by the checks: Python counted in two passes.
    decode_skips: Counts,
    check_skips: Counts,
    untrusted: Option<String>,
    /// A cap was passed: the batch is refused once the envelope is known to be readable.
    refused: Option<DecodeError>,
}

impl<'l> State<'l> {
    fn new(limits: &'l Limits) -> Self {
        State {
            limits,
            events: Vec::new(),
            decoded: 0,
            decode_skips: Counts::default(),
            check_skips: Counts::default(),
            untrusted: None,
            refused: None,
        }
    }

    fn finish(
        self,
        ts: f64,
        dpr: Option<i128>,
        wide: &mut Vec<Wide>,
    ) -> Result<Batch, DecodeError> {
        if self.decoded as i128 > self.limits.max_events_per_batch {
            return Err(fatal(format!(
                "{} events in one batch exceed the cap of {}",
                self.decoded, self.limits.max_events_per_batch
            )));
        }
        if let Some(e) = self.refused {
            return Err(e);
        }
        let data_parallel_rank = dpr.map(|v| {
            if v > i128::from(i64::MAX) {
                wide.push(Wide {
                    event: 0,
                    field: WideField::DataParallelRank,
                    value: v as u64,
                });
            }
            sat(v)
        });
        let mut skipped = Vec::with_capacity(self.decode_skips.0.len() + self.check_skips.0.len());
        for (r, n) in self.decode_skips.0.into_iter().chain(self.check_skips.0) {
            skipped.push((r.to_owned(), n));
        }
        Ok(Batch {
            ts,
            events: self.events,
            data_parallel_rank,
            skipped,
            untrusted: self.untrusted,
        })
    }
}

/// An optional i64 field's value, and the value itself if it was past i64.
fn wide_opt(v: Option<i128>) -> (Option<i64>, Option<u64>) {
    match v {
        Some(v) if v > i128::from(i64::MAX) => (Some(i64::MAX), Some(v as u64)),
        v => (v.map(sat), None),
    }
}

/// An i64 field's value: msgpack ints reach 2^64 - 1, kvroute's fields stop at i64::MAX.
fn sat(v: i128) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn hash_of(v: i128) -> BlockHash {
    // SGLang's signed int64 hashes fold onto uint64 (two's complement), so a block has one key
    // whatever the form. msgpack holds nothing below i64::MIN, so this never fails ("hash-range").
    BlockHash::Int(v as u64)
}

/// A decoded store before its checks: ints still wide, token cells (SGLang EAGLE) not yet folded.
#[derive(Default)]
struct RawStore {
    ev: BlockStored,
    block_size: i128,
    lora_id: Option<i128>,
    group_idx: Option<i128>,
    window: Option<i128>,
    /// Token ids saturated to i64, and those that were past it (index, value).
    tokens: Vec<i64>,
    wide_tokens: Vec<(usize, u64)>,
    /// `[token, next_token]` cells: token_ids as SGLang with EAGLE speculative decoding sends them.
    cells: Option<Vec<(i128, i128)>>,
    /// Whether a non-empty `token_ids` of ints came before (that one of cells did is `cells`): a
    /// map that repeats the key is read against one form, as msgspec read it (`token_ids`).
    ints_seen: bool,
    lookahead: Option<Vec<Vec<i128>>>,
    /// The hashes header was past `max_blocks_per_event`: the rest was checked but not kept.
    n_hashes: usize,
}

struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
    depth: usize,
    /// Where the event being decoded starts (msgspec decoded each event from its own bytes, and
    /// reported byte offsets from there).
    event_start: usize,
    limits: Limits,
    wide: Vec<Wide>,
}

impl<'a> Dec<'a> {
    fn rest(&self) -> &'a [u8] {
        self.buf.get(self.pos..).unwrap_or(&[])
    }

    /// The next item's header (and value, for scalars), through rmp's low-level reader: the
    /// marker decoded by `Marker::from_u8`, its data read by `RmpRead` over `rmp::decode::Bytes`.
    #[inline]
    fn tok(&mut self) -> Result<Tok<'a>, DecodeError> {
        let rest = self.rest();
        let Some((&b, data)) = rest.split_first() else {
            return Err(truncated());
        };
        let mut r = Bytes::new(data);
        let tr = |_| truncated();
        let tok = match Marker::from_u8(b) {
            Marker::FixPos(v) => Tok::Int(i128::from(v)),
            Marker::FixNeg(v) => Tok::Int(i128::from(v)),
            Marker::U8 => Tok::Int(i128::from(r.read_data_u8().map_err(tr)?)),
            Marker::U16 => Tok::Int(i128::from(r.read_data_u16().map_err(tr)?)),
            Marker::U32 => Tok::Int(i128::from(r.read_data_u32().map_err(tr)?)),
            Marker::U64 => Tok::Int(i128::from(r.read_data_u64().map_err(tr)?)),
            Marker::I8 => Tok::Int(i128::from(r.read_data_i8().map_err(tr)?)),
            Marker::I16 => Tok::Int(i128::from(r.read_data_i16().map_err(tr)?)),
            Marker::I32 => Tok::Int(i128::from(r.read_data_i32().map_err(tr)?)),
            Marker::I64 => Tok::Int(i128::from(r.read_data_i64().map_err(tr)?)),
            Marker::Null => Tok::Nil,
            Marker::True => Tok::Bool(true),
            Marker::False => Tok::Bool(false),
            Marker::F32 => Tok::Float(f64::from(r.read_data_f32().map_err(tr)?)),
            Marker::F64 => Tok::Float(r.read_data_f64().map_err(tr)?),
            Marker::FixStr(n) => Tok::Str(take(&mut r, usize::from(n))?),
            Marker::Str8 | Marker::Bin8 => {
                let n = usize::from(r.read_data_u8().map_err(tr)?);
                str_or_bin(b, take(&mut r, n)?)
            }
            Marker::Str16 | Marker::Bin16 => {
                let n = usize::from(r.read_data_u16().map_err(tr)?);
                str_or_bin(b, take(&mut r, n)?)
            }
            Marker::Str32 | Marker::Bin32 => {
                let n = r.read_data_u32().map_err(tr)? as usize;
                str_or_bin(b, take(&mut r, n)?)
            }
            Marker::FixArray(n) => Tok::Arr(u32::from(n)),
            Marker::Array16 => Tok::Arr(u32::from(r.read_data_u16().map_err(tr)?)),
            Marker::Array32 => Tok::Arr(r.read_data_u32().map_err(tr)?),
            Marker::FixMap(n) => Tok::Map(u32::from(n)),
            Marker::Map16 => Tok::Map(u32::from(r.read_data_u16().map_err(tr)?)),
            Marker::Map32 => Tok::Map(r.read_data_u32().map_err(tr)?),
            Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32 => {
                // rmp reads the marker itself here: hand it the item from its first byte.
                let mut whole = Bytes::new(rest);
                let meta = rd::read_ext_meta(&mut whole).map_err(tr)?;
                let mut r2 = whole;
                let d = take(&mut r2, meta.size as usize)?;
                r = r2;
                Tok::Ext(meta.typeid, d)
            }
            Marker::Reserved => {
                return Err(fatal(format!(
                    "MessagePack data is malformed: invalid opcode '\\xc1' (byte {})",
                    self.pos
                )))
            }
        };
        self.pos = self.buf.len() - r.remaining_slice().len();
        Ok(tok)
    }

    /// `tok` for a map-form event's keys and its `type` value: a fixstr (what every field name
    /// and event type is) is sliced here, anything else (or a truncated fixstr, for `tok`'s
    /// error) goes through `tok`. `tok`'s marker decoding was ~50 instructions an item, ~8 of
    /// them an event (callgrind, `bench/callgrind_ingest.py at1M`: 1-32 blocks an event).
    #[inline]
    fn key_tok(&mut self) -> Result<Tok<'a>, DecodeError> {
        if let Some((&b, data)) = self.rest().split_first() {
            // 0xa0-0xbf: a fixstr, its length the marker's low five bits.
            if b & 0xe0 == 0xa0 {
                if let Some(s) = data.get(..usize::from(b & 0x1f)) {
                    self.pos += 1 + s.len();
                    return Ok(Tok::Str(s));
                }
            }
        }
        self.tok()
    }

    /// The next item if it is an int (the token-id loop's hot path: no `Tok` built), else None
    /// without moving.
    #[inline]
    fn int_fast(&mut self) -> Result<Option<i128>, DecodeError> {
        let rest = self.rest();
        let Some((&b, data)) = rest.split_first() else {
            return Err(truncated());
        };
        let mut r = Bytes::new(data);
        let tr = |_| truncated();
        let v = match Marker::from_u8(b) {
            Marker::FixPos(v) => i128::from(v),
            Marker::U8 => i128::from(r.read_data_u8().map_err(tr)?),
            Marker::U16 => i128::from(r.read_data_u16().map_err(tr)?),
            Marker::U32 => i128::from(r.read_data_u32().map_err(tr)?),
            Marker::U64 => i128::from(r.read_data_u64().map_err(tr)?),
            Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
                match self.tok()? {
                    Tok::Int(v) => return Ok(Some(v)),
                    _ => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        self.pos = self.buf.len() - r.remaining_slice().len();
        Ok(Some(v))
    }

    fn enter(&mut self) -> Result<(), DecodeError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(fatal(
                "maximum recursion depth exceeded while deserializing an object",
            ));
        }
        Ok(())
    }

    fn leave(&mut self) {
        self.depth -= 1;
    }

    /// Skip one item, checking only that it is well-formed msgpack.
    fn skip(&mut self) -> Result<(), DecodeError> {
        match self.tok()? {
            Tok::Arr(n) => self.skip_items(u64::from(n)),
            Tok::Map(n) => self.skip_items(2 * u64::from(n)),
            _ => Ok(()),
        }
    }

    fn skip_items(&mut self, n: u64) -> Result<(), DecodeError> {
        self.enter()?;
        for _ in 0..n {
            self.skip()?;
        }
        self.leave();
        Ok(())
    }

    fn map_len_fatal(&mut self) -> Result<u32, DecodeError> {
        match self.tok()? {
            Tok::Map(n) => {
                self.enter()?;
                Ok(n)
            }
            t => Err(fatal(format!("Expected `object`, got `{}`", t.name()))),
        }
    }

    fn envelope_ts(&mut self, at: &str) -> Result<f64, DecodeError> {
        match self.tok()? {
            // msgspec takes an int for a float field (rounded to nearest, as `as` does).
            Tok::Int(v) => Ok(v as f64),
            Tok::Float(f) => Ok(f),
            t => Err(fatal(format!(
                "Expected `float`, got `{}` - at `{at}`",
                t.name()
            ))),
        }
    }

    fn envelope_dpr(&mut self, at: &str) -> Result<Option<i128>, DecodeError> {
        match self.tok()? {
            Tok::Int(v) => Ok(Some(v)),
            Tok::Nil => Ok(None),
            t => Err(fatal(format!(
                "Expected `int | null`, got `{}` - at `{at}`",
                t.name()
            ))),
        }
    }

    /// The event array: each event decodes on its own; a bad one is skipped and counted.
    fn events(&mut self, st: &mut State<'_>, at: &str) -> Result<(), DecodeError> {
        let n = match self.tok()? {
            Tok::Arr(n) => n,
            t => {
                return Err(fatal(format!(
                    "Expected `array`, got `{}` - at `{at}`",
                    t.name()
                )))
            }
        };
        if n > MAX_EVENTS_PER_BATCH {
            return Err(fatal(format!(
                "Expected `array` of length <= {MAX_EVENTS_PER_BATCH} - at `{at}`"
            )));
        }
        self.enter()?;
        // Every event takes at least one byte, so the payload bounds this reservation.
        st.events.reserve(self.reserve_for(n));
        for _ in 0..n {
            self.event(st)?;
        }
        self.leave();
        Ok(())
    }

    fn event(&mut self, st: &mut State<'_>) -> Result<(), DecodeError> {
        let start = self.pos;
        self.event_start = start;
        if st.refused.is_some() {
            // The batch is refused already: the rest only has to be readable msgpack.
            return self.skip();
        }
        let first = self.rest().first().copied().ok_or_else(truncated)?;
        let res = match Marker::from_u8(first) {
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => self.map_event(st, start),
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => self.array_event(st),
            _ => {
                self.skip()?;
                Err((None, bare("no event type")))
            }
        };
        match res {
            Ok(Some(ev)) => {
                st.decoded += 1;
                if st.decoded as i128 > st.limits.max_events_per_batch {
                    // Refused: the rest only has to be readable.
                    st.refused = Some(fatal(format!(
                        "{} or more events in one batch exceed the cap of {}",
                        st.decoded, st.limits.max_events_per_batch
                    )));
                } else {
                    self.check(st, ev);
                }
                Ok(())
            }
            Ok(None) => Ok(()),
            Err((kind, E::Invalid(inv))) => {
                // The event's bytes must still be readable msgpack: skip it from its start.
                self.pos = start;
                self.depth_reset_to_event();
                self.skip()?;
                st.decode_skips.add(SKIP_MALFORMED);
                if kind != Some(Kind::Stored) {
                    // A removal or clear (or an event whose type is unreadable, which may be one)
                    // was lost: the index may now hold blocks the engine dropped.
                    let what = match kind {
                        Some(Kind::Removed) => "BlockRemoved",
                        Some(Kind::Cleared) => "AllBlocksCleared",
                        _ => "event",
                    };
                    st.untrusted = Some(format!("unreadable {what}: {}", short(&inv.render())));
                }
                Ok(())
            }
            Err((_, E::Fatal(f))) => Err(f),
        }
    }

    /// Events sit at depth 2 in either batch shape.
    fn depth_reset_to_event(&mut self) {
        self.depth = 2;
    }

    /// A map-form event: its type is the last `type` key (what kvroute read first); its fields
    /// decode as the struct of the first `type` key (what msgspec's tagged union read), which must
    /// agree with every other `type` key.
    fn map_event(&mut self, st: &mut State<'_>, start: usize) -> EvResult {
        if let Some(ev) = self.vllm_removal() {
            return Ok(Some(ev));
        }
        // Engines write `type` first: decode straight away, and take the long way (which reads
        // the type first, then the fields) only when that fails.
        if let Some(kind) = self.leading_type() {
            match self.map_struct(kind, kind == Kind::Stored) {
                Ok(ev) => return Ok(Some(ev)),
                Err(E::Fatal(f)) => return Err((None, E::Fatal(f))),
                Err(E::Invalid(_)) => {
                    self.pos = start;
                    self.depth_reset_to_event();
                }
            }
        }
        let scan = self.scan_tag().map_err(|e| (None, e))?;
        let (first, last) = match scan {
            (Some(f), Some(l)) => (f, l),
            _ => return Err((None, invalid("Object missing required field `type`"))),
        };
        let Some(kind) = Kind::of(last) else {
            st.decode_skips.add(SKIP_UNKNOWN_TYPE);
            return Ok(None);
        };
        self.pos = start;
        self.depth_reset_to_event();
        let Some(as_kind) = Kind::of(first) else {
            return Err((
                Some(kind),
                invalid(format!("Invalid value '{}' - at `$.type`", lossy(first))),
            ));
        };
        let bigrams = kind == Kind::Stored;
        self.map_struct(as_kind, bigrams)
            .map(Some)
            .map_err(|e| (Some(kind), e))
    }

    /// vLLM's own removal, byte for byte as its block pool writes one (`_emit_block_removed_events`
    /// in vLLM 0.34.0's `block_pool.py`: one event an evicted block, `medium` "GPU", `group_idx`
    /// its KV-cache group; msgspec writes the tag first, then the fields in order, `locality` and
    /// `ownership` left out as defaults): decoded by comparing its fixed bytes, taking the hash
    /// (a uint 64) and the group (a positive fixint) from between them. The event the general
    /// path makes of the same bytes, exactly (the tests hold the two to each other); anything else
    /// (another medium, another form of the hash or the group, another key order, a cap of no
    /// blocks) goes the general way. At a full engine's steady state a router decodes one of these
    /// for every block stored: the general path took ~150 ns on each (session 20).
    #[inline]
    fn vllm_removal(&mut self) -> Option<Decd> {
        const HEAD: &[u8] = b"\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\xcf";
        const TAIL: &[u8] = b"\xa6medium\xa3GPU\xa9group_idx";
        if self.limits.max_blocks_per_event < 1 {
            return None;
        }
        let rest = self.rest().strip_prefix(HEAD)?;
        let (hash, rest) = rest.split_first_chunk::<8>()?;
        let group = *rest.strip_prefix(TAIL)?.first()?;
        if group > 0x7f {
            return None;
        }
        self.pos += HEAD.len() + 8 + TAIL.len() + 1;
        let rm = BlockRemoved {
            block_hashes: smallvec::smallvec![BlockHash::Int(u64::from_be_bytes(*hash))],
            medium: Some(medium_of("GPU")),
            group_idx: Some(i64::from(group)),
            ..BlockRemoved::default()
        };
        Some(Decd::Removed(rm, 1, None))
    }

    /// The known type of a map event whose first key is `type`, without moving.
    fn leading_type(&mut self) -> Option<Kind> {
        let start = self.pos;
        let kind = match (self.tok(), self.tok(), self.tok()) {
            (Ok(Tok::Map(_)), Ok(Tok::Str(b"type")), Ok(Tok::Str(tag))) => Kind::of(tag),
            _ => None,
        };
        self.pos = start;
        kind
    }

    /// Read a map event's keys: every key a str, every `type` a valid str; the first and last type.
    #[allow(clippy::type_complexity)]
    fn scan_tag(&mut self) -> Result<(Option<&'a [u8]>, Option<&'a [u8]>), E> {
        let n = match self.tok()? {
            Tok::Map(n) => n,
            _ => return Err(E::Fatal(fatal("not a map"))),
        };
        self.enter()?;
        let (mut first, mut last) = (None, None);
        for _ in 0..n {
            match self.tok()? {
                Tok::Str(b"type") => match self.tok()? {
                    Tok::Str(s) => {
                        utf8(s)?;
                        first.get_or_insert(s);
                        last = Some(s);
                    }
                    t => return Err(expected("str", &t)).at(Seg::Field("type")),
                },
                Tok::Str(_) => self.skip()?,
                t => return Err(expected_key(&t)).at(Seg::Key),
            }
        }
        self.leave();
        Ok((first, last))
    }

    fn map_struct(&mut self, kind: Kind, bigrams: bool) -> Result<Decd, E> {
        let n = match self.tok()? {
            Tok::Map(n) => n,
            _ => return Err(E::Fatal(fatal("not a map"))),
        };
        self.enter()?;
        // Made at a store's first field only: a removal (one a block, at a full engine's steady
        // state) spent a tenth of its decode making and dropping an unused one (session 20).
        let mut s: Option<RawStore> = None;
        let mut rm = BlockRemoved::default();
        let mut n_removed = 0;
        let mut rm_wide = None;
        let (mut have_hashes, mut have_tokens, mut have_bs) = (false, false, false);
        for _ in 0..n {
            let key = match self.key_tok()? {
                Tok::Str(k) => k,
                t => return Err(expected_key(&t)).at(Seg::Key),
            };
            if key == b"type" {
                match self.key_tok()? {
                    Tok::Str(v) if v == kind.tag() => {}
                    Tok::Str(v) => {
                        return Err(invalid(format!("Invalid value '{}'", lossy(v))))
                            .at(Seg::Field("type"))
                    }
                    t => return Err(expected("str", &t)).at(Seg::Field("type")),
                }
                continue;
            }
            match kind {
                Kind::Cleared => self.skip()?,
                Kind::Removed => match key {
                    b"block_hashes" => {
                        (rm.block_hashes, n_removed) =
                            self.hashes().at(Seg::Field("block_hashes"))?;
                        have_hashes = true;
                    }
                    b"medium" => rm.medium = self.opt_medium().at(Seg::Field("medium"))?,
                    b"group_idx" => {
                        (rm.group_idx, rm_wide) =
                            wide_opt(self.opt_int().at(Seg::Field("group_idx"))?)
                    }
                    b"locality" => rm.locality = self.any().at(Seg::Field("locality"))?,
                    b"ownership" => rm.ownership = self.any().at(Seg::Field("ownership"))?,
                    _ => self.skip()?,
                },
                Kind::Stored => {
                    let Some(f) = stored_field_index(key) else {
                        self.skip()?;
                        continue;
                    };
                    let s = s.get_or_insert_with(RawStore::default);
                    self.stored_field(s, f, bigrams)
                        .at(Seg::Field(STORED_FIELDS[f]))?;
                    match f {
                        0 => have_hashes = true,
                        2 => have_tokens = true,
                        3 => have_bs = true,
                        _ => {}
                    }
                }
            }
        }
        self.leave();
        let missing = |f: &str| invalid(format!("Object missing required field `{f}`"));
        match kind {
            Kind::Cleared => Ok(Decd::Cleared),
            Kind::Removed if !have_hashes => Err(missing("block_hashes")),
            Kind::Removed => Ok(Decd::Removed(rm, n_removed, rm_wide)),
            Kind::Stored if !have_hashes => Err(missing("block_hashes")),
            Kind::Stored if !have_tokens => Err(missing("token_ids")),
            Kind::Stored if !have_bs => Err(missing("block_size")),
            Kind::Stored => self.finish_store(s.unwrap_or_default()),
        }
    }

    /// A tagged-array event: `[type, field, ...]`, the required fields first, trailing ones optional,
    /// extra ones ignored.
    fn array_event(&mut self, st: &mut State<'_>) -> EvResult {
        let n = match self.tok().map_err(|e| (None, e.into()))? {
            Tok::Arr(n) => n,
            _ => return Err((None, E::Fatal(fatal("not an array")))),
        };
        self.enter().map_err(|e| (None, e.into()))?;
        if n == 0 {
            return Err((None, bare("no event type")));
        }
        let tag = match self.tok().map_err(|e| (None, e.into()))? {
            Tok::Str(s) => s,
            t => return Err((None, expected("str", &t))),
        };
        utf8(tag).map_err(|e| (None, e))?;
        let Some(kind) = Kind::of(tag) else {
            st.decode_skips.add(SKIP_UNKNOWN_TYPE);
            for _ in 1..n {
                self.skip().map_err(|e| (None, e.into()))?;
            }
            self.leave();
            return Ok(None);
        };
        self.array_struct(kind, n)
            .map(Some)
            .map_err(|e| (Some(kind), e))
    }

    fn array_struct(&mut self, kind: Kind, n: u32) -> Result<Decd, E> {
        let required = match kind {
            Kind::Stored => 4,
            Kind::Removed => 1,
            Kind::Cleared => 0,
        };
        if n < required + 1 {
            return Err(invalid(format!(
                "Expected `array` of at least length {}, got {n}",
                required + 1
            )));
        }
        let fields = match kind {
            Kind::Stored => STORED_FIELDS.len(),
            Kind::Removed => 5,
            Kind::Cleared => 0,
        };
        let mut s = RawStore::default();
        let mut rm = BlockRemoved::default();
        let mut n_removed = 0;
        let mut rm_wide = None;
        for i in 1..n as usize {
            let f = i - 1;
            if f >= fields {
                self.skip()?;
                continue;
            }
            match kind {
                Kind::Stored => self
                    .stored_field(&mut s, f, kind == Kind::Stored)
                    .at(Seg::Index(i))?,
                Kind::Removed => match f {
                    0 => (rm.block_hashes, n_removed) = self.hashes().at(Seg::Index(i))?,
                    1 => rm.medium = self.opt_medium().at(Seg::Index(i))?,
                    2 => (rm.group_idx, rm_wide) = wide_opt(self.opt_int().at(Seg::Index(i))?),
                    3 => rm.locality = self.any().at(Seg::Index(i))?,
                    _ => rm.ownership = self.any().at(Seg::Index(i))?,
                },
                Kind::Cleared => self.skip()?,
            }
        }
        self.leave();
        match kind {
            Kind::Stored => self.finish_store(s),
            Kind::Removed => Ok(Decd::Removed(rm, n_removed, rm_wide)),
            Kind::Cleared => Ok(Decd::Cleared),
        }
    }

    /// Field `f` (an index in `STORED_FIELDS`) of a store.
    fn stored_field(&mut self, s: &mut RawStore, f: usize, bigrams: bool) -> Result<(), E> {
        match f {
            0 => (s.ev.block_hashes, s.n_hashes) = self.hashes()?,
            1 => s.ev.parent_block_hash = self.opt_hash()?,
            2 => self.token_ids(s, bigrams)?,
            3 => s.block_size = self.int("int")?,
            4 => s.lora_id = self.opt_int()?,
            5 => s.ev.medium = self.opt_medium()?,
            6 => s.ev.lora_name = self.opt_str()?,
            7 => s.ev.extra_keys = self.extra_keys()?,
            8 => s.group_idx = self.opt_int()?,
            9 => s.ev.kv_cache_spec_kind = self.opt_str()?,
            10 => s.window = self.opt_int()?,
            11 => s.ev.locality = self.any()?,
            12 => s.ev.ownership = self.any()?,
            13 => s.ev.session_id = self.any()?,
            14 => s.lookahead = self.lookahead()?,
            15 => s.ev.cache_salt = self.any()?,
            _ => s.ev.origin = self.any()?,
        }
        Ok(())
    }

    fn int(&mut self, what: &str) -> Result<i128, E> {
        match self.tok()? {
            Tok::Int(v) => Ok(v),
            t => Err(expected(what, &t)),
        }
    }

    fn opt_int(&mut self) -> Result<Option<i128>, E> {
        match self.tok()? {
            Tok::Int(v) => Ok(Some(v)),
            Tok::Nil => Ok(None),
            t => Err(expected("int | null", &t)),
        }
    }

    /// A str or nil, borrowed from the payload.
    fn opt_str_ref(&mut self) -> Result<Option<&'a str>, E> {
        match self.tok()? {
            Tok::Str(s) => Ok(Some(utf8(s)?)),
            Tok::Nil => Ok(None),
            t => Err(expected("str | null", &t)),
        }
    }

    fn opt_str(&mut self) -> Result<Option<String>, E> {
        Ok(self.opt_str_ref()?.map(str::to_owned))
    }

    fn opt_medium(&mut self) -> Result<Option<Medium>, E> {
        Ok(self.opt_str_ref()?.map(medium_of))
    }

    fn opt_hash(&mut self) -> Result<Option<BlockHash>, E> {
        match self.tok()? {
            Tok::Int(v) => Ok(Some(hash_of(v))),
            Tok::Bin(b) => Ok(Some(BlockHash::Bytes(b.to_vec()))),
            Tok::Nil => Ok(None),
            t => Err(expected("int | bytes | null", &t)),
        }
    }

    /// An array header, its length checked against `max` before anything is reserved.
    fn array(&mut self, what: &str, max: Option<u32>) -> Result<u32, E> {
        match self.tok()? {
            Tok::Arr(n) => {
                if let Some(max) = max {
                    if n > max {
                        return Err(invalid(format!("Expected `array` of length <= {max}")));
                    }
                }
                self.enter()?;
                Ok(n)
            }
            t => Err(expected(what, &t)),
        }
    }

    /// A reservation for `n` items of at least one byte each: never more than the payload holds.
    fn reserve_for(&self, n: u32) -> usize {
        (n as usize).min(self.rest().len())
    }

    /// `block_hashes` and their count. Past `max_blocks_per_event` (known from the length header)
    /// the hashes are checked but not kept: the event is then refused, or skipped if malformed.
    fn hashes<C: HashList>(&mut self) -> Result<(C, usize), E> {
        let n = self.array("array", Some(MAX_BLOCKS_PER_EVENT))?;
        let keep = i128::from(n) <= self.limits.max_blocks_per_event;
        let mut out = C::with_room(if keep { self.reserve_for(n) } else { 0 });
        for i in 0..n as usize {
            // A uint 64 (0xcf), the form a real engine hash takes, read straight from the bytes.
            if let Some((&0xcf, tail)) = self.rest().split_first() {
                if let Some(b) = tail.first_chunk::<8>() {
                    self.pos += 9;
                    if keep {
                        out.push(BlockHash::Int(u64::from_be_bytes(*b)));
                    }
                    continue;
                }
            }
            let h = match self.tok()? {
                Tok::Int(v) => hash_of(v),
                Tok::Bin(b) => BlockHash::Bytes(b.to_vec()),
                t => return Err(expected("int | bytes", &t)).at(Seg::Index(i)),
            };
            if keep {
                out.push(h);
            }
        }
        self.leave();
        Ok((out, n as usize))
    }

    /// `token_ids`: ints, or (for a store's own type) SGLang EAGLE `[token, next_token]` cells.
    fn token_ids(&mut self, s: &mut RawStore, bigrams: bool) -> Result<(), E> {
        let n = match self.tok()? {
            Tok::Arr(n) => n,
            t => return Err(expected("array", &t)),
        };
        self.enter()?;
        let cells = if n == 0 {
            s.cells.is_some()
        } else {
            bigrams
                && matches!(
                    Marker::from_u8(self.rest().first().copied().unwrap_or(0)),
                    Marker::FixArray(_) | Marker::Array16 | Marker::Array32
                )
        };
        // msgspec decoded a store against one schema, ints or (when any `token_ids` of the map
        // was cells) cells, and the last of a repeated key won: a non-empty `token_ids` of the
        // other form than one before it is an error, an empty one takes the form seen.
        let other_form_before = if cells {
            s.ints_seen
        } else {
            s.cells.is_some()
        };
        if n > 0 && other_form_before {
            return Err(invalid("Expected `array`, got `int`")).at(Seg::Index(0));
        }
        s.ints_seen |= n > 0 && !cells;
        if !cells && n > MAX_TOKENS_PER_EVENT {
            return Err(invalid(format!(
                "Expected `array` of length <= {MAX_TOKENS_PER_EVENT}"
            )));
        }
        if cells {
            let mut out = Vec::with_capacity(self.reserve_for(n));
            for i in 0..n as usize {
                let m = self.array("array", None).at(Seg::Index(i))?;
                if m != 2 {
                    return Err(invalid(
                        "token_ids cells are neither ints nor [token, next_token] pairs",
                    ));
                }
                let a = self.int("int").at(Seg::Index(0)).at(Seg::Index(i))?;
                let b = self.int("int").at(Seg::Index(1)).at(Seg::Index(i))?;
                self.leave();
                out.push((a, b));
            }
            s.cells = Some(out);
            s.tokens.clear();
            s.wide_tokens.clear();
        } else {
            s.wide_tokens.clear();
            // The hot loop of a store (`uint_run`): the int forms token ids take (fixint, uint
            // 8/16/32; the table is checked against rmp's `Marker` in the tests) are read without
            // a branch on the form (a branch between uint 16 and uint 32 mispredicts on every
            // other token of a real vocabulary). Anything else (wider or signed ints, another
            // type, an item the payload's end cuts) goes through rmp's `read_int`, then `tok`,
            // one item, and the ids after it through `uint_run` again.
            let whole: &'a [u8] = self.buf;
            let base = self.pos;
            let buf = &whole[base..];
            let n = n as usize;
            // Each token takes at least one byte: the payload bounds this allocation (and the
            // few slots a window read may write past the last).
            let mut out = Vec::with_capacity(self.reserve_for(n as u32) + WRITE_SLACK);
            let mut p = 0;
            loop {
                let left = n - out.len();
                p += uint_run(&buf[p..], &mut out, left);
                let i = out.len();
                if i == n {
                    break;
                }
                let mut r = Bytes::new(&buf[p..]);
                if let Ok(v) = rd::read_int::<i64, _>(&mut r) {
                    out.push(v);
                    p = buf.len() - r.remaining_slice().len();
                    continue;
                }
                self.pos = base + p;
                match self.int_fast()? {
                    Some(v) => {
                        s.wide_tokens.push((i, v as u64));
                        out.push(sat(v));
                    }
                    None => {
                        let t = self.tok()?;
                        return Err(expected("int", &t)).at(Seg::Index(i));
                    }
                }
                p = self.pos - base;
            }
            self.pos = base + p;
            s.tokens = out;
            s.cells = None;
        }
        self.leave();
        Ok(())
    }

    fn extra_keys(&mut self) -> Result<Option<Vec<Option<Vec<Value>>>>, E> {
        let n = match self.tok()? {
            Tok::Nil => return Ok(None),
            Tok::Arr(n) => n,
            t => return Err(expected("array | null", &t)),
        };
        self.enter()?;
        let mut out = Vec::with_capacity(self.reserve_for(n));
        for i in 0..n as usize {
            let item = match self.tok()? {
                Tok::Nil => None,
                Tok::Arr(m) => Some(self.any_items(m).at(Seg::Index(i))?),
                t => return Err(expected("array | null", &t)).at(Seg::Index(i)),
            };
            out.push(item);
        }
        self.leave();
        Ok(Some(out))
    }

    fn lookahead(&mut self) -> Result<Option<Vec<Vec<i128>>>, E> {
        let n = match self.tok()? {
            Tok::Nil => return Ok(None),
            Tok::Arr(n) => n,
            t => return Err(expected("array | null", &t)),
        };
        self.enter()?;
        let mut out = Vec::with_capacity(self.reserve_for(n));
        for i in 0..n as usize {
            let m = self.array("array", None).at(Seg::Index(i))?;
            let mut row = Vec::with_capacity(self.reserve_for(m));
            for j in 0..m as usize {
                row.push(self.int("int").at(Seg::Index(j)).at(Seg::Index(i))?);
            }
            self.leave();
            out.push(row);
        }
        self.leave();
        Ok(Some(out))
    }

    /// An untyped value (msgspec's `Any`): kept whole; strings must be UTF-8, map keys hashable in
    /// Python (arrays become tuples there), timestamps (ext -1) valid.
    fn any(&mut self) -> Result<Value, E> {
        let t = self.tok()?;
        self.any_from(t)
    }

    fn any_from(&mut self, t: Tok<'a>) -> Result<Value, E> {
        Ok(match t {
            Tok::Nil => Value::Nil,
            Tok::Bool(b) => Value::Bool(b),
            Tok::Int(v) => Value::Int(v),
            Tok::Float(f) => Value::Float(f),
            Tok::Str(s) => Value::Str(utf8(s)?.to_owned()),
            Tok::Bin(b) => Value::Bytes(b.to_vec()),
            Tok::Arr(n) => Value::Array(self.any_items(n)?),
            Tok::Map(n) => {
                self.enter()?;
                let mut pairs = Vec::with_capacity(self.reserve_for(n));
                for _ in 0..n {
                    let k = self.any().at(Seg::Key)?;
                    let v = self.any().at(Seg::Value)?;
                    if !hashable(&k) {
                        return Err(bare(format!(
                            "MessagePack data is malformed: map keys must be hashable (byte {})",
                            self.pos - self.event_start
                        )));
                    }
                    pairs.push((k, v));
                }
                self.leave();
                Value::Map(pairs)
            }
            Tok::Ext(code, data) => {
                if code == -1 {
                    timestamp(data)?;
                }
                Value::Ext(code, data.to_vec())
            }
        })
    }

    fn any_items(&mut self, n: u32) -> Result<Vec<Value>, E> {
        self.enter()?;
        let mut out = Vec::with_capacity(self.reserve_for(n));
        for i in 0..n as usize {
            out.push(self.any().at(Seg::Index(i))?);
        }
        self.leave();
        Ok(out)
    }

    /// The store's own conversions: token cells folded, ints narrowed (wide ones recorded).
    fn finish_store(&mut self, mut s: RawStore) -> Result<Decd, E> {
        if let Some(cells) = s.cells.take() {
            // SGLang EAGLE stores: each cell's token is the token, and each page's last next_token
            // its one lookahead token (the engine's key covers it).
            s.ev.bigram = true;
            s.wide_tokens = (cells.iter().enumerate())
                .filter(|(_, c)| c.0 > i128::from(i64::MAX))
                .map(|(i, c)| (i, c.0 as u64))
                .collect();
            s.tokens = cells.iter().map(|c| sat(c.0)).collect();
            if s.lookahead.is_none() && s.block_size > 0 {
                let bs = usize::try_from(s.block_size).unwrap_or(usize::MAX);
                let mut la = Vec::with_capacity(cells.len().div_ceil(bs.max(1)));
                let mut i = 0usize;
                while i < cells.len() {
                    let end = i.saturating_add(bs).min(cells.len());
                    if let Some(c) = cells.get(end - 1) {
                        la.push(vec![c.1]);
                    }
                    i = end;
                }
                s.lookahead = Some(la);
            }
        }
        Ok(Decd::Stored(Box::new(narrow(s))))
    }
    /// The checks that follow decoding (caps, shape): keep the event, skip it, or refuse the batch.
    fn check(&mut self, st: &mut State<'_>, ev: Decd) {
        let lim = *st.limits;
        match ev {
            Decd::Cleared => st.events.push(Event::Cleared),
            Decd::Removed(rm, n, wide_group) => {
                if let Some(e) = over_cap(n as i128, 0, &lim) {
                    st.refused = Some(e);
                    return;
                }
                if let Some(value) = wide_group {
                    let event = st.events.len();
                    self.wide.push(Wide {
                        event,
                        field: WideField::GroupIdx,
                        value,
                    });
                }
                st.events.push(Event::Removed(rm));
            }
            Decd::Stored(s) => {
                if let Some(e) = over_cap(s.n_hashes as i128, s.block_size, &lim) {
                    st.refused = Some(e);
                    return;
                }
                if let Some(reason) = store_skip(&s.ev, s.block_size) {
                    st.check_skips.add(reason);
                    return;
                }
                let idx = st.events.len();
                for (field, value) in s.wide {
                    self.wide.push(Wide {
                        event: idx,
                        field,
                        value,
                    });
                }
                st.events.push(Event::Stored(Box::new(s.ev)));
            }
        }
    }
}

/// Narrow a store's ints into `BlockStored`, noting those past i64 (to rebuild for Python).
fn narrow(s: RawStore) -> Stored {
    let RawStore {
        mut ev,
        block_size,
        lora_id,
        group_idx,
        window,
        tokens,
        wide_tokens,
        lookahead,
        n_hashes,
        ..
    } = s;
    let mut wide: Vec<(WideField, u64)> = wide_tokens
        .into_iter()
        .map(|(i, v)| (WideField::Token(i), v))
        .collect();
    let mut note = |field: WideField, v: i128| {
        if v > i128::from(i64::MAX) {
            wide.push((field, v as u64));
        }
        sat(v)
    };
    ev.block_size = note(WideField::BlockSize, block_size);
    ev.lora_id = lora_id.map(|v| note(WideField::LoraId, v));
    ev.group_idx = group_idx.map(|v| note(WideField::GroupIdx, v));
    ev.kv_cache_spec_sliding_window = window.map(|v| note(WideField::SlidingWindow, v));
    ev.token_ids = tokens;
    ev.lookahead_token_ids = lookahead.map(|rows| {
        rows.iter()
            .enumerate()
            .map(|(i, row)| {
                row.iter()
                    .enumerate()
                    .map(|(j, &v)| note(WideField::Lookahead(i, j), v))
                    .collect()
            })
            .collect()
    });
    Stored {
        ev,
        block_size,
        n_hashes,
        wide,
    }
}

/// `STORED_FIELDS[i]` is BlockStored's field i, in the engines' order (the array form's positions).
const STORED_FIELDS: [&str; 17] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "cache_salt",
    "origin",
];

/// `STORED_FIELDS`' index of a map-form store's key: one match on the bytes (length first),
/// not a scan comparing the key with each name in turn.
fn stored_field_index(key: &[u8]) -> Option<usize> {
    Some(match key {
        b"block_hashes" => 0,
        b"parent_block_hash" => 1,
        b"token_ids" => 2,
        b"block_size" => 3,
        b"lora_id" => 4,
        b"medium" => 5,
        b"lora_name" => 6,
        b"extra_keys" => 7,
        b"group_idx" => 8,
        b"kv_cache_spec_kind" => 9,
        b"kv_cache_spec_sliding_window" => 10,
        b"locality" => 11,
        b"ownership" => 12,
        b"session_id" => 13,
        b"lookahead_token_ids" => 14,
        b"cache_salt" => 15,
        b"origin" => 16,
        _ => return None,
    })
}

/// A store as decoded, with what its checks need that `BlockStored` cannot hold.
struct Stored {
    ev: BlockStored,
    block_size: i128,
    n_hashes: usize,
    wide: Vec<(WideField, u64)>,
}

/// A decoded event on its way to the checks.
enum Decd {
    // Boxed: a store is large, and moves through a few calls before it lands in the batch.
    Stored(Box<Stored>),
    /// With its hash count (the hashes are not kept past `max_blocks_per_event`) and its
    /// `group_idx` if that was past i64.
    Removed(BlockRemoved, usize, Option<u64>),
    Cleared,
}

/// An event's outcome: decoded, skipped as unknown (None), or unreadable (with the type it had,
/// if that was readable).
type EvResult = Result<Option<Decd>, (Option<Kind>, E)>;

fn over_cap(n: i128, bs: i128, lim: &Limits) -> Option<DecodeError> {
    if n > lim.max_blocks_per_event {
        return Some(fatal(format!(
            "{n} blocks in one event exceed the cap of {}",
            lim.max_blocks_per_event
        )));
    }
    if bs > lim.max_block_size {
        return Some(fatal(format!(
            "block_size {bs} exceeds the cap of {}",
            lim.max_block_size
        )));
    }
    None
}

/// None when a store is usable, else the reason to skip it (docs/protocol.md §3.1).
fn store_skip(ev: &BlockStored, bs: i128) -> Option<&'static str> {
    let n = ev.block_hashes.len() as i128;
    let nt = ev.token_ids.len() as i128;
    let full = ev
        .kv_cache_spec_kind
        .as_deref()
        .is_none_or(|k| FULL_KINDS.contains(&k));
    // Group and kind first: sparse and token-less stores are normal outside full attention.
    if nt == 0 && (bs == 0 || !full) {
        // A placeholder (offload tier, block_size 0) or a state checkpoint (Mamba): hashes only.
        return if bs >= 0 { None } else { Some(SKIP_BLOCK_SIZE) };
    }
    if bs < 1 {
        return Some(SKIP_BLOCK_SIZE);
    }
    if full {
        // Full blocks: exactly bs tokens each. SGLang's last page may be short (docs/protocol.md §3).
        if nt != bs * n && !(n > 0 && bs * (n - 1) < nt && nt < bs * n) {
            return Some(SKIP_SHAPE);
        }
    } else if nt % bs != 0 || n > nt / bs {
        // A sparse group's store spans every block of its range, null ones included.
        return Some(SKIP_SHAPE);
    }
    if ev.extra_keys.as_ref().is_some_and(|e| e.len() as i128 != n) {
        return Some(SKIP_EXTRA_KEYS);
    }
    if let Some(la) = &ev.lookahead_token_ids {
        let w = la.first().map_or(0, Vec::len);
        if la.len() as i128 != n || la.iter().any(|t| t.len() != w) {
            return Some(SKIP_LOOKAHEAD);
        }
    }
    None
}

/// Python's hash() accepts a decoded key: not a dict, not an Ext; a tuple only of hashable items.
fn hashable(v: &Value) -> bool {
    match v {
        Value::Map(_) => false,
        Value::Ext(code, _) => *code == -1,
        Value::Array(items) => items.iter().all(hashable),
        _ => true,
    }
}

/// Seconds before 0001-01-01 and after 9999-12-31T23:59:59 do not fit a Python datetime.
const MIN_TS: i64 = -62_135_596_800;
const MAX_TS: i64 = 253_402_300_799;

/// A msgpack timestamp (ext -1) as (seconds, microseconds), rounded the way msgspec builds its
/// datetime; the errors are msgspec's.
pub(crate) fn timestamp_parts(data: &[u8]) -> Result<(i64, u32), &'static str> {
    let (secs, nanos) = match *data {
        [a, b, c, d] => (i64::from(u32::from_be_bytes([a, b, c, d])), 0u32),
        [a, b, c, d, e, f, g, h] => {
            let v = u64::from_be_bytes([a, b, c, d, e, f, g, h]);
            ((v & 0x3_ffff_ffff) as i64, (v >> 34) as u32)
        }
        [a, b, c, d, e, f, g, h, i, j, k, l] => (
            i64::from_be_bytes([e, f, g, h, i, j, k, l]),
            u32::from_be_bytes([a, b, c, d]),
        ),
        _ => return Err("Invalid MessagePack timestamp"),
    };
    if nanos > 999_999_999 {
        return Err("Invalid MessagePack timestamp: nanoseconds out of range");
    }
    let mut micros = (nanos + 500) / 1000;
    let mut secs = secs;
    if micros >= 1_000_000 {
        micros -= 1_000_000;
        secs = secs.saturating_add(1);
    }
    if !(MIN_TS..=MAX_TS).contains(&secs) {
        return Err("Timestamp is out of range ");
    }
    Ok((secs, micros))
}

fn timestamp(data: &[u8]) -> Result<(i64, u32), E> {
    timestamp_parts(data).map_err(invalid)
}

/// A `type` value in a message (it was checked to be UTF-8 when it was read).
fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// kvroute/_wire.py's `_reason`: a message cut to 200 characters.
fn short(msg: &str) -> String {
    if msg.chars().count() <= 200 {
        return msg.to_owned();
    }
    let mut s: String = msg.chars().take(197).collect();
    s.push_str("...");
    s
}

/// Where `Dec::hashes` collects: a store's `Vec`, or a removal's inline list.
trait HashList {
    fn with_room(n: usize) -> Self;
    fn push(&mut self, h: BlockHash);
}

impl HashList for Vec<BlockHash> {
    fn with_room(n: usize) -> Self {
        Vec::with_capacity(n)
    }
    fn push(&mut self, h: BlockHash) {
        Vec::push(self, h);
    }
}

impl HashList for RemovedHashes {
    fn with_room(n: usize) -> Self {
        RemovedHashes::with_capacity(n)
    }
    fn push(&mut self, h: BlockHash) {
        RemovedHashes::push(self, h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmp::encode as en;

    /// A map-form store of `n` blocks of `bs` tokens (hash i+1, tokens 0..).
    fn store(out: &mut Vec<u8>, n: u32, bs: u32) {
        en::write_map_len(out, 4).unwrap();
        en::write_str(out, "type").unwrap();
        en::write_str(out, "BlockStored").unwrap();
        en::write_str(out, "block_hashes").unwrap();
        en::write_array_len(out, n).unwrap();
        for i in 0..n {
            en::write_sint(out, -i64::from(i) - 1).unwrap();
        }
        en::write_str(out, "token_ids").unwrap();
        en::write_array_len(out, n * bs).unwrap();
        for t in 0..n * bs {
            en::write_uint(out, u64::from(t) * 1000).unwrap();
        }
        en::write_str(out, "block_size").unwrap();
        en::write_uint(out, u64::from(bs)).unwrap();
    }

    fn batch(events: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        en::write_array_len(&mut out, 2).unwrap();
        en::write_f64(&mut out, 1.5).unwrap();
        en::write_array_len(&mut out, events.len() as u32).unwrap();
        for e in events {
            out.extend_from_slice(e);
        }
        out
    }

    #[test]
    fn map_form_store_decodes_with_signed_hashes_folded() {
        let mut ev = Vec::new();
        store(&mut ev, 2, 4);
        let b = decode(&batch(&[&ev]), &Limits::default()).unwrap();
        assert_eq!(b.ts, 1.5);
        let Some(Event::Stored(s)) = b.events.first() else {
            panic!("{b:?}")
        };
        assert_eq!(
            s.block_hashes,
            vec![BlockHash::Int(u64::MAX), BlockHash::Int(u64::MAX - 1)]
        );
        assert_eq!(s.token_ids.len(), 8);
        assert_eq!(
            Summary::of(&b),
            Summary {
                events: 1,
                stored_blocks: 2,
                removed_blocks: 0,
                clears: 0,
                unknown_events: 0,
            }
        );
    }

    /// A map-form removal of one hash written in `order` (of "type", "block_hashes", "medium",
    /// "group_idx"; a key left out is not written).
    fn removal(out: &mut Vec<u8>, order: &[&str], hash: u64, medium: &str, group: u64) {
        en::write_map_len(out, order.len() as u32).unwrap();
        for &key in order {
            en::write_str(out, key).unwrap();
            match key {
                "type" => en::write_str(out, "BlockRemoved").map(drop).unwrap(),
                "block_hashes" => {
                    en::write_array_len(out, 1).unwrap();
                    en::write_u64(out, hash).unwrap(); // always uint 64 (0xcf), as msgspec writes a big one
                }
                "medium" => en::write_str(out, medium).unwrap(),
                _ => en::write_uint(out, group).map(drop).unwrap(),
            }
        }
    }

    /// vLLM's removal (fixed bytes compared, `Dec::vllm_removal`) decodes to exactly what the
    /// general path makes of the same event with its keys in another order, for every hash, group
    /// and medium around the fast path's edges, and every cap; each truncation is an error.
    #[test]
    fn a_vllm_removal_decodes_as_the_general_path_does() {
        const VLLM: [&str; 4] = ["type", "block_hashes", "medium", "group_idx"];
        const OTHER: [&str; 4] = ["type", "medium", "block_hashes", "group_idx"];
        for hash in [0, 1, 0x7f, 1 << 32, u64::MAX - 1, u64::MAX] {
            for group in [0, 1, 0x7f, 0x80, 1 << 20] {
                for medium in ["GPU", "CPU", "gpu", "GPUS"] {
                    for max_blocks in [0, 1, 1_000] {
                        let lim = Limits {
                            max_blocks_per_event: max_blocks,
                            ..Limits::default()
                        };
                        let (mut fast, mut general) = (Vec::new(), Vec::new());
                        removal(&mut fast, &VLLM, hash, medium, group);
                        removal(&mut general, &OTHER, hash, medium, group);
                        let (fast, general) =
                            (batch(&[&fast, &fast]), batch(&[&general, &general]));
                        let got = decode(&fast, &lim);
                        let want = decode(&general, &lim);
                        assert_eq!(
                            format!("{got:?}"),
                            format!("{want:?}"),
                            "{hash} {group} {medium}"
                        );
                        assert_eq!(got.is_ok(), max_blocks > 0, "a cap of no blocks refuses it");
                        for cut in 0..fast.len() {
                            assert!(decode(&fast[..cut], &lim).is_err(), "cut at {cut}");
                        }
                    }
                }
            }
        }
        // The bytes the fast path compares are vLLM's: a 4-key map, the tag first.
        let mut ev = Vec::new();
        removal(&mut ev, &VLLM, 7, "GPU", 0);
        assert!(ev.starts_with(b"\x84\xa4type\xacBlockRemoved\xacblock_hashes\x91\xcf"));
        assert!(ev.ends_with(b"\xa6medium\xa3GPU\xa9group_idx\x00"));
        // Without group_idx (a 3-key map) it is the general path's too.
        let mut three = Vec::new();
        removal(&mut three, &VLLM[..3], 7, "GPU", 0);
        let b = decode(&batch(&[&three]), &Limits::default()).unwrap();
        assert_eq!(
            b.events,
            vec![Event::Removed(BlockRemoved {
                block_hashes: smallvec::smallvec![BlockHash::Int(7)],
                medium: Some(medium_of("GPU")),
                ..BlockRemoved::default()
            })]
        );
    }

    #[test]
    fn unknown_and_unreadable_events_are_counted() {
        let unknown = b"\x81\xa4type\xa1X";
        let bad_removal = b"\x82\xa4type\xacBlockRemoved\xacblock_hashes\xa1x";
        let b = decode(&batch(&[unknown, bad_removal]), &Limits::default()).unwrap();
        assert!(b.events.is_empty());
        assert_eq!(
            b.skipped,
            vec![("unknown-type".to_owned(), 1), ("malformed".to_owned(), 1)]
        );
        assert_eq!(Summary::of(&b).unknown_events, 1);
        assert_eq!(
            b.untrusted.as_deref(),
            Some("unreadable BlockRemoved: Expected `array`, got `str` - at `$.block_hashes`")
        );
    }

    #[test]
    fn bigram_cells_fold_into_lookahead() {
        // ["BlockStored", [7, 8], nil, [[1, 2], [3, 4], [5, 6]], 2]
        let ev = b"\x95\xabBlockStored\x92\x07\x08\xc0\x93\x92\x01\x02\x92\x03\x04\x92\x05\x06\x02";
        let b = decode(&batch(&[ev]), &Limits::default()).unwrap();
        // 3 tokens, block size 2, two hashes: SGLang's short last page; one lookahead per page.
        let Some(Event::Stored(s)) = b.events.first() else {
            panic!("{b:?}")
        };
        assert_eq!(s.token_ids, vec![1, 3, 5]);
        assert_eq!(s.lookahead_token_ids, Some(vec![vec![4], vec![6]]));
        assert!(s.bigram, "cells mark the store (SGLang EAGLE)");
        assert!(b.skipped.is_empty());
    }

    #[test]
    fn a_repeated_token_ids_key_is_read_against_one_form() {
        // {"type": "BlockStored", "block_hashes": [], "block_size": 0, "token_ids": A,
        // "token_ids": B}: msgspec read the map against one schema (cells when any `token_ids`
        // is cells), the last key winning: cells then [] is an empty bigram store; ints beside
        // cells, a malformed one.
        let store = |a: &[u8], b: &[u8]| {
            let mut ev =
                b"\x85\xa4type\xabBlockStored\xacblock_hashes\x90\xaablock_size\x00".to_vec();
            for t in [a, b] {
                ev.extend_from_slice(b"\xa9token_ids");
                ev.extend_from_slice(t);
            }
            decode(&batch(&[&ev]), &Limits::default()).unwrap()
        };
        let cells = b"\x91\x92\x01\x02";
        let b = store(cells, b"\x90");
        let Some(Event::Stored(s)) = b.events.first() else {
            panic!("{b:?}")
        };
        assert!(s.bigram && s.token_ids.is_empty(), "{s:?}");
        for (a, z) in [(&b"\x91\x01"[..], &cells[..]), (cells, b"\x91\x01")] {
            let b = store(a, z);
            assert!(b.events.is_empty(), "{b:?}");
            assert_eq!(b.skipped, vec![("malformed".to_string(), 1)]);
        }
    }

    #[test]
    fn caps_refuse_the_batch() {
        let mut ev = Vec::new();
        store(&mut ev, 3, 2);
        let payload = batch(&[&ev]);
        let lim = Limits {
            max_blocks_per_event: 2,
            ..Limits::default()
        };
        assert!(decode(&payload, &lim)
            .unwrap_err()
            .message
            .contains("blocks"));
        let lim = Limits {
            max_block_size: 1,
            ..Limits::default()
        };
        assert!(decode(&payload, &lim)
            .unwrap_err()
            .message
            .contains("block_size"));
        let lim = Limits {
            max_events_per_batch: 0,
            ..Limits::default()
        };
        assert!(decode(&payload, &lim)
            .unwrap_err()
            .message
            .contains("events"));
    }

    #[test]
    fn every_prefix_and_byte_flip_gives_a_batch_or_an_error() {
        let mut ev = Vec::new();
        store(&mut ev, 3, 2);
        let payload = batch(&[&ev, b"\x81\xa4type\xb0AllBlocksCleared"]);
        for end in 0..payload.len() {
            assert!(decode(&payload[..end], &Limits::default()).is_err());
        }
        for i in 0..payload.len() {
            for v in [0x00, 0x7f, 0xc1, 0xdd, 0xdf, 0xff] {
                let mut p = payload.clone();
                p[i] = v;
                let _ = decode(&p, &Limits::default());
            }
        }
    }

    #[test]
    fn stored_field_index_names_each_field_at_its_position() {
        for (i, name) in STORED_FIELDS.iter().enumerate() {
            assert_eq!(stored_field_index(name.as_bytes()), Some(i), "{name}");
        }
        for other in [
            "",
            "type",
            "block_hash",
            "token_idss",
            "Block_hashes",
            "origin\0",
        ] {
            assert_eq!(stored_field_index(other.as_bytes()), None, "{other:?}");
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let mut p = b"\x92\x00\x91".to_vec();
        p.extend(std::iter::repeat_n(0x91u8, 1_000_000));
        p.push(0);
        assert!(decode(&p, &Limits::default())
            .unwrap_err()
            .message
            .contains("recursion"));
    }

    /// Inputs from `cargo fuzz` runs (fuzz/regressions/: corpus entries, and any crash it finds):
    /// each decodes or errors, without a panic.
    #[test]
    fn fuzz_regressions() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
        for entry in std::fs::read_dir(&dir).unwrap() {
            let data = std::fs::read(entry.unwrap().path()).unwrap();
            let _ = decode(&data, &Limits::default());
            let _ = decode(
                &data,
                &Limits {
                    max_events_per_batch: 1,
                    max_blocks_per_event: 1,
                    max_block_size: 1,
                },
            );
        }
    }
}
