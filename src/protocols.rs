//! The events the engines publish, as the wire decoder produces them and the index consumes them.
//! Field for field the Python Structs of `kvroute/_wire.py` (docs/protocol.md §3).

use smallvec::SmallVec;
use std::borrow::Cow;

/// A block hash as an engine sends it, normalised: ints in the uint64 space (SGLang's int64 folded
/// onto it), bytes kept as sent.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BlockHash {
    Int(u64),
    Bytes(Vec<u8>),
}

/// A storage medium as an engine names it (`BlockStored.medium`, `BlockRemoved.medium`). The names
/// the tiers know are borrowed, not allocated: a removal is one event per block in vLLM, and an
/// allocation for its `"GPU"` was a tenth of decoding one (session 20, `perf`).
pub type Medium = Cow<'static, str>;

/// `name` as a `Medium`: a known name borrowed from the binary, any other copied.
pub fn medium_of(name: &str) -> Medium {
    match name {
        "GPU" => Cow::Borrowed("GPU"),
        "CPU" => Cow::Borrowed("CPU"),
        "CPU_PINNED" => Cow::Borrowed("CPU_PINNED"),
        "DISK" => Cow::Borrowed("DISK"),
        "STORAGE" => Cow::Borrowed("STORAGE"),
        "EXTERNAL" => Cow::Borrowed("EXTERNAL"),
        other => Cow::Owned(other.to_owned()),
    }
}

/// A decoded msgpack value that the index looks into but does not type (extra keys, locality, ...).
#[derive(Clone, Debug, PartialEq, Default)]
pub enum Value {
    #[default]
    Nil,
    Bool(bool),
    /// Any msgpack integer (uint64 and int64 both fit).
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Array(Vec<Value>),
    /// A map, its pairs in wire order.
    Map(Vec<(Value, Value)>),
    /// A msgpack extension (type code, data); code -1 is a timestamp (a datetime in Python).
    Ext(i8, Vec<u8>),
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct BlockStored {
    pub block_hashes: Vec<BlockHash>,
    pub parent_block_hash: Option<BlockHash>,
    pub token_ids: Vec<i64>,
    pub block_size: i64,
    pub lora_id: Option<i64>,
    pub medium: Option<Medium>,
    pub lora_name: Option<String>,
    pub extra_keys: Option<Vec<Option<Vec<Value>>>>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<i64>,
    pub locality: Value,
    pub ownership: Value,
    pub session_id: Value,
    pub lookahead_token_ids: Option<Vec<Vec<i64>>>,
    pub cache_salt: Value,
    pub origin: Value,
    /// kvroute's mark, not an engine field: `token_ids` came as SGLang EAGLE `[token, next_token]`
    /// cells (folded into the tokens and one lookahead token per page). SGLang serves such a worker
    /// the bigram view of the prompt minus one token: a page less than vLLM's lookahead-1 rule
    /// when that prefix is whole pages.
    pub bigram: bool,
}

/// A removal's hashes: vLLM's block pool sends one removal per evicted block, so the one hash is
/// kept inline, not allocated (at a full engine's steady state, as many removals as stored blocks).
pub type RemovedHashes = SmallVec<[BlockHash; 1]>;

#[derive(Clone, Debug, PartialEq, Default)]
pub struct BlockRemoved {
    pub block_hashes: RemovedHashes,
    pub medium: Option<Medium>,
    pub group_idx: Option<i64>,
    pub locality: Value,
    pub ownership: Value,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    // Boxed: a store is large and most events in a batch are stores anyway.
    Stored(Box<BlockStored>),
    Removed(BlockRemoved),
    Cleared,
}

/// One published message (`EventBatch`): the events that decoded, per-reason skip counts, and
/// `untrusted` set when a removal or clear could not be read.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Event>,
    pub data_parallel_rank: Option<i64>,
    pub skipped: Vec<(String, u64)>,
    pub untrusted: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_medium_is_the_name_sent_borrowed_only_when_the_tiers_know_it() {
        for name in ["GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL"] {
            let m = medium_of(name);
            assert!(matches!(m, Cow::Borrowed(_)), "{name}");
            assert_eq!(m, name);
        }
        for name in ["gpu", "Cpu", "LocalDisk", "ssdé", ""] {
            let m = medium_of(name);
            assert!(matches!(m, Cow::Owned(_)), "{name}");
            assert_eq!(m, name);
        }
    }
}
