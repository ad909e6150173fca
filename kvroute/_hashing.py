"""The router's own block identity: a chained 128-bit content hash, stable across processes and machines.

Definition (version 2; snapshots and router replicas depend on it, so it never changes silently)::

    root(lora, salt) = XXH3-128(b"kvroute/2/root"
                                [+ b"\\x00" + lora_name as UTF-8, when there is an adapter]
                                [+ b"\\x01" + cache_salt as UTF-8, when the prompt is salted])
    key(-1)          = root(lora, salt)
    key(i)           = XXH3-128(key(i-1)
                                + tokens of block i, each as uint32 little-endian
                                [+ b"\\xff" + msgpack(extras of block i), when the block has extras]
                                [+ b"\\xfe" + its lookahead tokens as uint32 little-endian, when the
                                   engine hashes lookahead tokens])

The namespaces are the ones the engines fold into their own block hashes (docs/protocol.md §3.1):
the LoRA adapter and the cache salt name the whole chain (vLLM sends the salt in the first
block's extra keys, SGLang in ``cache_salt``; the adapter in ``lora_name`` and, on vLLM, again
first in every block's extra keys — one namespace, however it arrives). A block's *extras* are
what is left of the engine's per-block extra keys: multimodal items overlapping the block as
``[identifier, offset of the item relative to the block's first token]`` (vLLM's
``_gen_mm_extra_hash_keys``) and prompt-embedding digests, in the engine's order.

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

__all__ = [
    "HASH_VERSION",
    "MultimodalItem",
    "block_keys",
    "chain_keys",
    "mm_extras",
    "root_key",
    "tokens_to_bytes",
    "xxh128",
]

HASH_VERSION = 2

xxh128 = xxhash.xxh3_128_digest
_ROOT_PREFIX = b"kvroute/2/root"
_BASE_ROOT = xxh128(_ROOT_PREFIX)
_BIG_ENDIAN = sys.byteorder == "big"
_encode_extra = msgspec.msgpack.Encoder().encode


class MultimodalItem(msgspec.Struct, frozen=True):
    """One multimodal input of a request, as the engine hashes it into the blocks it overlaps.

    ``identifier``: the engine's identifier of the item (vLLM's ``mm_feature.identifier``, the
    multimodal hash unless the request overrides it). ``offset``: the token offset of the item's
    placeholder run in the prompt. ``length``: its number of tokens.
    """

    identifier: str
    offset: int
    length: int


def root_key(lora_name: str | None, cache_salt: str | None = None) -> bytes:
    """The chain's starting key for an adapter and a cache salt (None = base model, unsalted)."""
    if not lora_name and not cache_salt:
        return _BASE_ROOT
    data = _ROOT_PREFIX
    if lora_name:
        data += b"\x00" + lora_name.encode("utf-8")
    if cache_salt:
        data += b"\x01" + cache_salt.encode("utf-8")
    return xxh128(data)


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
    lookahead: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Chain ``n_blocks`` keys on ``parent`` over ``data`` (from `tokens_to_bytes`), one C-level hash per block.

    ``extra_keys``: each block's extras (None or empty = none); ``lookahead``: each block's
    lookahead tokens as bytes (from `tokens_to_bytes`), for engines that hash them.
    """
    step = 4 * block_size
    keys: list[bytes] = []
    append = keys.append
    key = parent
    if extra_keys is None and lookahead is None:
        for off in range(0, step * n_blocks, step):
            key = xxh128(key + data[off : off + step])
            append(key)
        return keys
    for i in range(n_blocks):
        off = i * step
        chunk = key + data[off : off + step]
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        if extra:
            chunk += b"\xff" + _encode_extra(extra)
        if lookahead is not None:
            chunk += b"\xfe" + lookahead[i]
        key = xxh128(chunk)
        append(key)
    return keys


def mm_extras(
    mm_items: Sequence[MultimodalItem], block_size: int, first: int, end: int, lookahead: int = 0
) -> list[list[Any] | None] | None:
    """Per-block extras of blocks ``first..end-1`` for a request's multimodal items, as vLLM builds them.

    A block starting at token ``s`` lists ``[identifier, offset - s]`` for every item with
    ``offset < s + block_size + lookahead`` and ``s < offset + length`` (an engine that hashes
    ``lookahead`` tokens past a block also keys the items they overlap), in offset order. None
    when no block has any.
    """
    if not mm_items:
        return None
    items = sorted(mm_items, key=lambda m: m.offset)
    out: list[list[Any] | None] = []
    found = False
    for i in range(first, end):
        start = i * block_size
        stop = start + block_size + lookahead
        keys: list[Any] = [
            [m.identifier, m.offset - start] for m in items if m.offset < stop and start < m.offset + m.length
        ]
        if keys:
            found = True
            out.append(keys)
        else:
            out.append(None)
    return out if found else None


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MultimodalItem] = (),
    lookahead: int = 0,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
) -> list[bytes]:
    """Content keys of every full block of ``token_ids`` (a trailing partial block has none).

    With ``lookahead`` N > 0 a block is keyed with the N tokens after it too, so only blocks
    followed by N tokens have a key. ``extra_keys`` (deprecated) gives per-block extras
    directly instead of deriving them from ``mm_items``.
    """
    n = (len(token_ids) - lookahead) // block_size if len(token_ids) > lookahead else 0
    if n <= 0:
        return []
    data = tokens_to_bytes(token_ids[: n * block_size])
    extras = extra_keys if extra_keys is not None else mm_extras(mm_items, block_size, 0, n, lookahead)
    la = None
    if lookahead:
        la = [tokens_to_bytes(token_ids[(i + 1) * block_size : (i + 1) * block_size + lookahead]) for i in range(n)]
    return block_keys(root_key(lora_name, cache_salt), data, block_size, n, extras, la)
