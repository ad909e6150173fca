"""The router's own block identity: a chained 128-bit content hash, stable across processes and machines.

Definition (version 1; snapshots and router replicas depend on it, so it never changes silently)::

    root(lora)  = XXH3-128(b"kvroute/1/root" + (b"\\x00" + lora_name.encode("utf-8") if lora_name else b""))
    key(-1)     = root(lora)
    key(i)      = XXH3-128(key(i-1)
                           + tokens of block i, each as uint32 little-endian
                           [+ b"\\xff" + msgpack(extra_keys of block i), when the block has extra keys])

Keys are the 16-byte canonical (big-endian) XXH3-128 digests, seed 0. Bytes, not ints:
chaining then needs no conversion, which halves the cost of hashing a prompt.
A 128-bit key makes an accidental collision negligible at any index
size a router will meet: among 10^9 blocks the chance that any two collide is ~1.5e-21 (a 64-bit
key would give ~3 %). Python's ``hash()`` is salted per process for str/bytes and cannot serve.
Tokens outside uint32 (no tokenizer has 2^32 ids) make a block unhashable: it is never claimed.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

__all__ = ["HASH_VERSION", "block_keys", "chain_keys", "root_key", "tokens_to_bytes", "xxh128"]

HASH_VERSION = 1

xxh128 = xxhash.xxh3_128_digest
_ROOT_PREFIX = b"kvroute/1/root"
_BASE_ROOT = xxh128(_ROOT_PREFIX)
_BIG_ENDIAN = sys.byteorder == "big"
_encode_extra = msgspec.msgpack.Encoder().encode


def root_key(lora_name: str | None) -> bytes:
    """The chain's starting key for an adapter (None = base model): adapters never share a block."""
    if not lora_name:
        return _BASE_ROOT
    return xxh128(_ROOT_PREFIX + b"\x00" + lora_name.encode("utf-8"))


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive uint32 little-endian; raises OverflowError for ids outside uint32."""
    arr = array("I", token_ids)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def block_keys(
    parent: bytes,
    data: bytes,
    block_size: int,
    n_blocks: int,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
) -> list[bytes]:
    """Chain ``n_blocks`` keys on ``parent`` over ``data`` (from `tokens_to_bytes`), one C-level hash per block."""
    step = 4 * block_size
    keys: list[bytes] = []
    append = keys.append
    key = parent
    if extra_keys is None:
        for off in range(0, step * n_blocks, step):
            key = xxh128(key + data[off : off + step])
            append(key)
        return keys
    for i in range(n_blocks):
        off = i * step
        chunk = key + data[off : off + step]
        extra = extra_keys[i] if i < len(extra_keys) else None
        if extra:
            chunk += b"\xff" + _encode_extra(extra)
        key = xxh128(chunk)
        append(key)
    return keys


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
) -> list[bytes]:
    """Content keys of every full block of ``token_ids`` (a trailing partial block has none)."""
    n = len(token_ids) // block_size
    if n == 0:
        return []
    data = tokens_to_bytes(token_ids[: n * block_size])
    return block_keys(root_key(lora_name), data, block_size, n, extra_keys)
