//! Content keys, HASH_VERSION 2 (kvroute/_hashing.py holds the definition): chained XXH3-128
//! digests, 16 bytes big-endian, seed 0.
//!
//! ```text
//! root(lora, salt) = XXH3-128(b"kvroute/2/root" [+ 0x00 + lora] [+ 0x01 + salt])
//! key(i)           = XXH3-128(key(i-1) + tokens of block i as uint32 LE
//!                             [+ 0xff + msgpack(extras of block i)] [+ 0xfe + lookahead tokens as uint32 LE])
//! ```
//!
//! Every function here is byte for byte `kvroute._hashing` (tests/test_core_differential.py
//! checks it against the Python definition with generated inputs).

use xxhash_rust::xxh3::xxh3_128;

use crate::protocols::Value;

pub const HASH_VERSION: u32 = 2;

/// A content key: the 16 canonical (big-endian) bytes of an XXH3-128 digest.
pub type Key = [u8; 16];

const ROOT_PREFIX: &[u8] = b"kvroute/2/root";

/// One XXH3-128 digest as the 16 canonical (big-endian) bytes `xxhash.xxh3_128_digest` returns.
pub fn xxh128(data: &[u8]) -> Key {
    xxh3_128(data).to_be_bytes()
}

/// The chain's starting key for an adapter and a cache salt (None or "" = base model, unsalted).
pub fn root_key(lora: Option<&str>, salt: Option<&str>) -> Key {
    let lora = lora.filter(|s| !s.is_empty());
    let salt = salt.filter(|s| !s.is_empty());
    let mut data = ROOT_PREFIX.to_vec();
    if let Some(l) = lora {
        data.push(0);
        data.extend_from_slice(l.as_bytes());
    }
    if let Some(s) = salt {
        data.push(1);
        data.extend_from_slice(s.as_bytes());
    }
    xxh128(&data)
}

/// A value msgpack cannot carry the way msgspec encodes it (an integer outside int64 / uint64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unencodable;

/// ``value`` as msgspec's msgpack encoder writes the same Python value: the smallest integer
/// format (unsigned for >= 0), floats as float64, str / bin / array / map with the smallest header.
pub fn encode_value(value: &Value, out: &mut Vec<u8>) -> Result<(), Unencodable> {
    use rmp::encode as e;
    // Writing into a Vec cannot fail: the results below only carry the writer's (infallible) error.
    match value {
        Value::Nil => e::write_nil(out).map_err(|_| Unencodable)?,
        Value::Bool(b) => e::write_bool(out, *b).map_err(|_| Unencodable)?,
        Value::Int(i) => {
            if let Ok(v) = i64::try_from(*i) {
                e::write_sint(out, v).map_err(|_| Unencodable)?;
            } else if let Ok(v) = u64::try_from(*i) {
                e::write_uint(out, v).map_err(|_| Unencodable)?;
            } else {
                return Err(Unencodable);
            }
        }
        Value::Float(f) => e::write_f64(out, *f).map_err(|_| Unencodable)?,
        Value::Str(s) => {
            let n = u32::try_from(s.len()).map_err(|_| Unencodable)?;
            e::write_str_len(out, n).map_err(|_| Unencodable)?;
            out.extend_from_slice(s.as_bytes());
        }
        Value::Bytes(b) => {
            let n = u32::try_from(b.len()).map_err(|_| Unencodable)?;
            e::write_bin_len(out, n).map_err(|_| Unencodable)?;
            out.extend_from_slice(b);
        }
        Value::Array(items) => {
            let n = u32::try_from(items.len()).map_err(|_| Unencodable)?;
            e::write_array_len(out, n).map_err(|_| Unencodable)?;
            for v in items {
                encode_value(v, out)?;
            }
        }
        Value::Map(pairs) => {
            let n = u32::try_from(pairs.len()).map_err(|_| Unencodable)?;
            e::write_map_len(out, n).map_err(|_| Unencodable)?;
            for (k, v) in pairs {
                encode_value(k, out)?;
                encode_value(v, out)?;
            }
        }
        // A timestamp becomes a datetime in Python, which msgspec re-encodes in the smallest
        // timestamp form, not necessarily the wire's: no engine sends one in extra keys, so such
        // a block is held but never keyed (never claimed) rather than keyed by a guess.
        Value::Ext(-1, _) => return Err(Unencodable),
        Value::Ext(code, data) => {
            let n = u32::try_from(data.len()).map_err(|_| Unencodable)?;
            e::write_ext_meta(out, n, *code).map_err(|_| Unencodable)?;
            out.extend_from_slice(data);
        }
    }
    Ok(())
}

/// One block's extras as `_hashing.block_keys` appends them: None when the block has none
/// (None or an empty list), else the msgpack of the list.
pub fn encode_extras(extras: Option<&[Value]>) -> Result<Option<Vec<u8>>, Unencodable> {
    match extras {
        Some(items) if !items.is_empty() => {
            let mut out = Vec::with_capacity(16 * items.len());
            let n = u32::try_from(items.len()).map_err(|_| Unencodable)?;
            rmp::encode::write_array_len(&mut out, n).map_err(|_| Unencodable)?;
            for v in items {
                encode_value(v, &mut out)?;
            }
            Ok(Some(out))
        }
        _ => Ok(None),
    }
}

/// Token ids as uint32, or None when one is outside uint32 (such a block is never claimed).
pub fn tokens_u32(tokens: &[i64]) -> Option<Vec<u32>> {
    tokens.iter().map(|&t| u32::try_from(t).ok()).collect()
}

/// Whether every token id fits uint32 (a block with one that does not is never claimed).
pub fn all_u32(tokens: &[i64]) -> bool {
    // A token is in range when its 64 bits have none set above the low 32 (a negative one has
    // them all): one OR over every token, with no early exit, which the compiler vectorises
    // (the check reads every token of every store).
    tokens.iter().fold(0u64, |acc, &t| acc | t as u64) >> 32 == 0
}

fn push_tokens(buf: &mut Vec<u8>, tokens: &[u32]) {
    let at = buf.len();
    buf.resize(at + tokens.len() * 4, 0);
    write_tokens(&mut buf[at..], tokens);
}

/// Chain `n` keys on `parent` over `tokens` (`block_size` each), appending them to `out`.
///
/// `extras(i)`: block i's encoded extras (from `encode_extras`); `lookahead(i)`: block i's
/// lookahead tokens, for engines that hash them. `_hashing.block_keys`, byte for byte.
pub fn chain_into<'a>(
    out: &mut Vec<Key>,
    parent: &Key,
    tokens: &[u32],
    block_size: usize,
    n: usize,
    extras: impl Fn(usize) -> Option<&'a [u8]>,
    lookahead: impl Fn(usize) -> Option<&'a [u32]>,
) {
    // The parent key and the block's tokens have the same length every block: they are
    // written over the buffer's fixed part in place (no clearing, no zero fill), and only a
    // block's extras or lookahead tokens are appended after it. The buffer work was more of a
    // match's hashing than the digest itself (perf, bench_select.py's 1,024-worker fleet).
    let fixed = 16 + 4 * block_size;
    let mut buf: Vec<u8> = Vec::with_capacity(fixed + 16);
    buf.resize(fixed, 0);
    let mut key = *parent;
    out.reserve(n);
    for i in 0..n {
        let block = &tokens[i * block_size..(i + 1) * block_size];
        buf.truncate(fixed);
        buf[..16].copy_from_slice(&key);
        write_tokens(&mut buf[16..fixed], block);
        if let Some(x) = extras(i) {
            buf.push(0xff);
            buf.extend_from_slice(x);
        }
        if let Some(la) = lookahead(i) {
            buf.push(0xfe);
            push_tokens(&mut buf, la);
        }
        key = xxh128(&buf);
        out.push(key);
    }
}

/// `tokens` as uint32 LE into `dst` (4 bytes each; `dst` is exactly that long).
#[inline]
fn write_tokens(dst: &mut [u8], tokens: &[u32]) {
    for (d, t) in dst.chunks_exact_mut(4).zip(tokens) {
        d.copy_from_slice(&t.to_le_bytes());
    }
}

/// Keys of `n` plain blocks (no extras, no lookahead) chained on `parent`, appended to `out`:
/// `chain_into` for token ids as decoded (i64), which the caller has checked with `all_u32`.
/// `each(i, key)` is called as block `i`'s key is made, before the next one is hashed: the store
/// path prefetches the key's table slots there, so their cache misses overlap the hashing of the
/// blocks after it.
pub fn plain_keys_into(
    out: &mut Vec<Key>,
    parent: &Key,
    tokens: &[i64],
    block_size: usize,
    n: usize,
    mut each: impl FnMut(usize, &Key),
) {
    let mut buf = vec![0u8; 16 + 4 * block_size];
    let mut key = *parent;
    out.reserve(n);
    for (i, block) in tokens.chunks_exact(block_size).take(n).enumerate() {
        buf[..16].copy_from_slice(&key);
        for (dst, &t) in buf[16..].chunks_exact_mut(4).zip(block) {
            // In range: `all_u32` checked every token before (a wrong cast would only
            // mis-key, never crash; the differential tests hold it to `chain_into`).
            dst.copy_from_slice(&(t as u32).to_le_bytes());
        }
        key = xxh128(&buf);
        each(i, &key);
        out.push(key);
    }
}

/// One multimodal item of a query (`kvroute.MultimodalItem`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmItem {
    pub identifier: String,
    pub offset: i64,
    pub length: i64,
}

/// Per-block encoded extras of blocks `first..end` for multimodal `items` (sorted by offset,
/// stably), as `_hashing.mm_extras` builds them; None when no block has any.
pub fn mm_extras(
    items: &[MmItem],
    block_size: usize,
    first: usize,
    end: usize,
    lookahead: usize,
) -> Option<Vec<Option<Vec<u8>>>> {
    if items.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(end.saturating_sub(first));
    let mut found = false;
    for i in first..end {
        let start = (i * block_size) as i64;
        let stop = start + (block_size + lookahead) as i64;
        let vals: Vec<Value> = items
            .iter()
            .filter(|m| m.offset < stop && start < m.offset.saturating_add(m.length))
            .map(|m| {
                Value::Array(vec![
                    Value::Str(m.identifier.clone()),
                    Value::Int(i128::from(m.offset) - i128::from(start)),
                ])
            })
            .collect();
        if vals.is_empty() {
            out.push(None);
        } else {
            found = true;
            // Strings and int64 always encode.
            out.push(encode_extras(Some(&vals)).ok().flatten());
        }
    }
    found.then_some(out)
}

/// Identities of `count` blocks of `s_bs` tokens after a `p`-token boundary whose key is
/// `anchor` (kvroute/_index.py `_anchored_ids`): at a `p` boundary the primary group's content
/// key; between two, XXH3-128(key at the last boundary + 0xfd + the tokens since).
pub fn anchored_ids(anchor: &Key, tokens: &[u32], s_bs: usize, p: usize, count: usize) -> Vec<Key> {
    let mut out = Vec::with_capacity(count);
    let per = p / s_bs;
    let mut key = *anchor;
    let mut buf: Vec<u8> = Vec::with_capacity(17 + 4 * p);
    for j in 1..=count {
        let end = j * s_bs;
        buf.clear();
        buf.extend_from_slice(&key);
        if j % per == 0 {
            push_tokens(&mut buf, &tokens[end - p..end]);
            key = xxh128(&buf);
            out.push(key);
        } else {
            buf.push(0xfd);
            push_tokens(&mut buf, &tokens[end - (j % per) * s_bs..end]);
            out.push(xxh128(&buf));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_canonical_big_endian() {
        let d = xxh128(b"");
        assert_eq!(u128::from_be_bytes(d), xxh3_128(b""));
    }

    #[test]
    fn base_root_is_the_prefix_digest() {
        assert_eq!(root_key(None, None), xxh128(b"kvroute/2/root"));
        assert_eq!(root_key(Some(""), Some("")), root_key(None, None));
        assert_eq!(root_key(Some("a"), None), xxh128(b"kvroute/2/root\x00a"));
        assert_eq!(
            root_key(Some("a"), Some("s")),
            xxh128(b"kvroute/2/root\x00a\x01s")
        );
    }

    #[test]
    fn msgpack_uses_the_smallest_integer_formats() {
        let enc = |v: Value| {
            let mut out = Vec::new();
            encode_value(&v, &mut out).unwrap();
            out
        };
        assert_eq!(enc(Value::Int(5)), [5]);
        assert_eq!(enc(Value::Int(200)), [0xcc, 200]);
        assert_eq!(enc(Value::Int(-1)), [0xff]);
        assert_eq!(enc(Value::Int(-33)), [0xd0, 0xdf]);
        assert_eq!(enc(Value::Int(1 << 63)), [0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0]);
        let mut out = Vec::new();
        assert_eq!(
            encode_value(&Value::Int(1 << 64), &mut out),
            Err(Unencodable)
        );
        assert_eq!(encode_extras(Some(&[])).unwrap(), None);
    }

    #[test]
    fn chained_keys_follow_the_definition() {
        let root = root_key(None, None);
        let mut keys = Vec::new();
        let mut seen = Vec::new();
        plain_keys_into(&mut keys, &root, &[1, 2, 3, 4], 2, 2, |i, k| {
            seen.push((i, *k))
        });
        let mut chained = Vec::new();
        chain_into(&mut chained, &root, &[1, 2, 3, 4], 2, 2, |_| None, |_| None);
        assert_eq!(keys, chained);
        assert_eq!(seen, vec![(0, keys[0]), (1, keys[1])]);
        let mut first = root.to_vec();
        first.extend_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(keys[0], xxh128(&first));
        let mut second = keys[0].to_vec();
        second.extend_from_slice(&[3, 0, 0, 0, 4, 0, 0, 0]);
        assert_eq!(keys[1], xxh128(&second));
    }
}
