"""The simulated engines' paged KV cache with prefix caching: a pure model, no I/O.

One `PrefixCache` is one data-parallel rank's KV cache, modelled the way vLLM's block pool and
SGLang's radix cache behave where a router can see it:

- The cache holds ``capacity_blocks`` blocks of ``block_size`` tokens. A *full* block of a
  request's tokens is identified by a hash chained over its parent block's hash, its tokens and
  its LoRA namespace, so equal prefixes share blocks. Partial blocks are private and never
  published (vLLM and SGLang publish full pages only).
- A request is admitted only when every block it can need (prompt + ``max_tokens``) fits; the
  leading cached blocks of its prompt are shared (a hit), the rest are reserved. Blocks a running
  request uses are referenced and never evicted; on release they stay cached, unreferenced.
- To make room, the least recently used unreferenced *leaf* block is evicted, then the next —
  a freed chain goes tail first, as vLLM's free queue and SGLang's radix eviction do.
- Every change becomes the engine's real events (`BlockStored` with parent hash, token ids,
  block size, medium, LoRA; `BlockRemoved`; `AllBlocksCleared` on `reset`), collected until
  the engine drains them as one batch per step.

Hash styles: ``"vllm"`` — sha256 chained from a per-process random seed (vLLM's NONE_HASH), so
hashes differ across restarts; sent as uint64 (vLLM's default int block hashes) or as the
32-byte digest (``bytes_hashes=True``). ``"sglang"`` — unseeded sha256 chain folded to int64
(SGLang's ``hash_str_to_int64``), identical across restarts. Hashes here live in the space
`kvroute._wire.decode_batch` yields (uint64 or bytes); the publisher signs them for SGLang.

Ground truth (`block_hashes`, `blocks`, `held_prefixes`, `match_blocks`) lets tests check that
an index fed by the events never claims a block the engine does not hold.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Iterator, Sequence
from typing import Literal

import msgspec

from .._errors import KvRouteError
from .._wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EngineEvent

__all__ = [
    "BlockInfo",
    "CacheStats",
    "CapacityError",
    "InvalidRequestError",
    "PrefixCache",
    "hash_seed",
]

HashStyle = Literal["vllm", "sglang"]

_MEDIUM_GPU = "GPU"
# vLLM ≥ 0.30 tags each BlockStored / BlockRemoved with its KV-cache group; a plain (non-hybrid)
# model has one full-attention group, index 0 (docs/protocol.md §3, golden payload).
_FULL_ATTENTION = "full_attention"
# Token ids go into the hash as uint64 (array typecode "Q"), which also rejects negative and
# oversized ids in C: no tokenizer produces an id outside [0, 2**64).
_TOKEN_TYPE = "Q"


class CapacityError(KvRouteError):
    """A request needs more KV blocks than the whole cache has (the engine would reject it)."""


class InvalidRequestError(KvRouteError):
    """A request's tokens, ids or limits are not valid (token out of range, duplicate id, ...)."""


def hash_seed(seed: int, *parts: object) -> bytes:
    """A 32-byte hash seed derived deterministically from ``seed`` and ``parts`` (rank, restart count, ...).

    vLLM draws its NONE_HASH from os.urandom per process; deriving it here keeps simulations
    reproducible under a seed while still giving each process (rank, restart) its own hashes.
    """
    return hashlib.sha256(repr((seed, *parts)).encode()).digest()


class BlockInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One cached block as ground truth: its hash, its parent's, its tokens, its LoRA and depth (1 = first block)."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    lora_name: str | None
    depth: int
    ref_count: int


class CacheStats(msgspec.Struct, kw_only=True):
    """Counters of one cache since it was created (or last `PrefixCache.clear`)."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    rejected: int = 0


class _Block:
    """A cached full block: a node of the prefix tree."""

    __slots__ = ("children", "depth", "digest", "hash", "last_used", "lora_name", "parent", "refs", "tokens")

    def __init__(
        self,
        digest: bytes,
        block_hash: BlockHash,
        parent: _Block | None,
        tokens: tuple[int, ...],
        lora_name: str | None,
    ) -> None:
        self.digest = digest
        self.hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.lora_name = lora_name
        self.depth: int = parent.depth + 1 if parent is not None else 1
        self.children = 0
        self.refs = 0
        self.last_used = 0


class _Request:
    __slots__ = ("chain", "lora_name", "private", "stored_tokens")

    def __init__(self, chain: list[_Block], private: int, lora_name: str | None) -> None:
        self.chain = chain  # the request's full blocks in the tree, each referenced once
        self.private = private  # reserved blocks not (yet) in the tree
        self.lora_name = lora_name
        self.stored_tokens: array[int] = array(_TOKEN_TYPE)


class PrefixCache:
    """One rank's paged KV cache with prefix caching; see the module docstring for the model.

    Call order per request: `admit` (shares the cached prefix, reserves the rest, or returns
    None when it does not fit yet), `computed` as its KV is computed (stores newly full blocks),
    `release` when it ends. `drain_events` returns what happened since the last drain.
    """

    def __init__(
        self,
        *,
        capacity_blocks: int,
        block_size: int,
        style: HashStyle = "vllm",
        bytes_hashes: bool = False,
        seed: bytes = b"",
        new_fields: bool = True,
        lora_ids: dict[str, int] | None = None,
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks {capacity_blocks} < 1")
        if block_size < 1:
            raise ValueError(f"block_size {block_size} < 1")
        if style not in ("vllm", "sglang"):
            raise ValueError(f"unknown hash style {style!r}")
        if bytes_hashes and style != "vllm":
            raise ValueError("bytes hashes exist only in the vllm style")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.style: HashStyle = style
        self.bytes_hashes = bytes_hashes
        #: Whether events carry the fields newer vLLM adds (extra_keys, group_idx, kv_cache_spec_kind).
        self.new_fields = new_fields and style == "vllm"
        # SGLang's page hash chain has no seed (identical across restarts); vLLM's root is NONE_HASH.
        self._root = seed if style == "vllm" else b""
        self._lora_ids = dict(lora_ids or {})
        self._blocks: dict[BlockHash, _Block] = {}
        self._requests: dict[object, _Request] = {}
        self._free = capacity_blocks  # neither in the tree nor reserved by a request
        self._unreferenced = 0  # tree blocks with refs == 0 (all evictable, leaves first)
        self._heap: list[tuple[int, int, _Block]] = []  # (last_used, push order, block): candidate leaves
        self._pushes = 0
        self._tick = 0
        self._events: list[EngineEvent] = []
        self.stats = CacheStats()

    # --- hashing -------------------------------------------------------------------------

    def _digest(self, parent: bytes, lora_name: str | None, tokens: array[int]) -> bytes:
        h = hashlib.sha256(parent)
        if lora_name is not None:
            # A LoRA is a namespace: the same tokens under two adapters are different KV.
            h.update(b"\x00lora\x00" + lora_name.encode())
        h.update(tokens.tobytes())
        return h.digest()

    def _wire_hash(self, digest: bytes) -> BlockHash:
        if self.bytes_hashes:
            return digest
        return int.from_bytes(digest[:8], "big")

    def _chain(
        self, tokens: array[int], lora_name: str | None, parent: _Block | None, start: int
    ) -> Iterator[tuple[bytes, BlockHash, array[int]]]:
        """Yield (digest, hash, tokens) for each full block from block index ``start``, chained on ``parent``."""
        bs = self.block_size
        prev = parent.digest if parent is not None else self._root
        for i in range(start, len(tokens) // bs):
            part = tokens[i * bs : (i + 1) * bs]
            prev = self._digest(prev, lora_name, part)
            yield prev, self._wire_hash(prev), part

    @staticmethod
    def _tokens(token_ids: Sequence[int]) -> array[int]:
        if isinstance(token_ids, array) and token_ids.typecode == _TOKEN_TYPE:
            return token_ids
        try:
            return array(_TOKEN_TYPE, token_ids)
        except (OverflowError, TypeError) as exc:
            raise InvalidRequestError(f"token ids must be ints in [0, 2**64): {exc}") from None

    def _walk(self, tokens: array[int], lora_name: str | None) -> list[_Block]:
        """The leading cached blocks of ``tokens``."""
        out: list[_Block] = []
        for _digest, h, _part in self._chain(tokens, lora_name, None, 0):
            block = self._blocks.get(h)
            if block is None:
                break
            out.append(block)
        return out

    # --- requests ------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    def admit(
        self, request_id: object, token_ids: Sequence[int], *, max_tokens: int, lora_name: str | None = None
    ) -> int | None:
        """Start a request: share its cached prefix and reserve room for prompt + ``max_tokens``.

        Returns the number of prompt blocks found cached, or None (nothing changed) when the blocks
        cannot be found even after evicting every unreferenced block — the engine then waits. The
        last prompt token is never a hit: the engine must compute at least one token to produce
        logits (vLLM caps the hit at ``num_tokens - 1``; SGLang likewise). Raises `CapacityError`
        when the request could never fit, `InvalidRequestError` on bad tokens or a duplicate id.
        """
        if request_id in self._requests:
            raise InvalidRequestError(f"request {request_id!r} is already running")
        if max_tokens < 0:
            raise InvalidRequestError(f"max_tokens {max_tokens} < 0")
        tokens = self._tokens(token_ids)
        if not tokens:
            raise InvalidRequestError("empty prompt")
        total = self.blocks_needed(len(tokens) + max_tokens)
        if total > self.capacity_blocks:
            self.stats.rejected += 1
            raise CapacityError(
                f"request needs {total} blocks of {self.block_size} tokens; the cache holds {self.capacity_blocks}"
            )
        hits = self._walk(tokens[: len(tokens) - 1], lora_name)
        newly_referenced = sum(1 for b in hits if b.refs == 0)
        need = total - len(hits)
        if need > self._free + self._unreferenced - newly_referenced:
            return None
        self._tick += 1
        for block in hits:
            if block.refs == 0:
                self._unreferenced -= 1
            block.refs += 1
            block.last_used = self._tick
        self._evict(need)
        self._free -= need
        self._requests[request_id] = _Request(hits, need, lora_name)
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        self.stats.hit_tokens += len(hits) * self.block_size
        return len(hits)

    def computed(self, request_id: object, token_ids: Sequence[int]) -> None:
        """Record that the KV of the request's first ``len(token_ids)`` tokens is computed.

        ``token_ids`` is the request's whole sequence so far (prompt, then generated tokens);
        every block that became full is stored (or, when an equal block is already cached —
        another request computed it meanwhile — shared, with no event).
        """
        req = self._requests.get(request_id)
        if req is None:
            raise InvalidRequestError(f"request {request_id!r} is not running")
        tokens = self._tokens(token_ids)
        bs = self.block_size
        done = len(req.chain)
        if len(tokens) // bs <= done:
            return
        if req.stored_tokens and tokens[: len(req.stored_tokens)] != req.stored_tokens:
            raise InvalidRequestError("computed tokens do not extend the request's sequence")
        if len(tokens) // bs - done > req.private:
            raise InvalidRequestError("computed tokens exceed the blocks reserved for the request")
        parent = req.chain[-1] if req.chain else None
        run: list[_Block] = []
        run_parent = parent
        for digest, h, part in self._chain(tokens, req.lora_name, parent, done):
            req.private -= 1
            block = self._blocks.get(h)
            if block is None:
                block = _Block(digest, h, parent, tuple(part), req.lora_name)
                if parent is not None:
                    parent.children += 1
                self._blocks[h] = block
                self.stats.stored_blocks += 1
                run.append(block)
            else:
                # Already cached: share it, give back our reserved block.
                self._free += 1
                if block.refs == 0:
                    self._unreferenced -= 1
                self._flush_stored(run_parent, run)
                run = []
                run_parent = block
            block.refs += 1
            block.last_used = self._tick
            req.chain.append(block)
            parent = block
            if self.style == "sglang":
                # SGLang publishes one BlockStored per page.
                self._flush_stored(run_parent, run)
                run = []
                run_parent = block
        self._flush_stored(run_parent, run)
        req.stored_tokens = tokens[: len(req.chain) * bs]

    def release(self, request_id: object) -> None:
        """End a request: its blocks stay cached but unreferenced (evictable); its private blocks are freed."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise InvalidRequestError(f"request {request_id!r} is not running")
        self._tick += 1
        self._free += req.private
        for block in req.chain:
            block.refs -= 1
            block.last_used = self._tick
            if block.refs == 0:
                self._unreferenced += 1
                if block.children == 0:
                    self._push(block)

    def reset(self) -> bool:
        """Drop every cached block, as vLLM's reset_prefix_cache does: emits AllBlocksCleared.

        Returns False, changing nothing, while requests run (vLLM refuses then too).
        """
        if self._requests:
            return False
        self._drop_all()
        self._events.append(AllBlocksCleared())
        return True

    def clear(self) -> None:
        """Forget everything silently, running requests included (the engine process died): no event."""
        self._requests.clear()
        self._drop_all()
        self._events.clear()
        self.stats = CacheStats()

    def _drop_all(self) -> None:
        self._blocks.clear()
        self._heap.clear()
        self._free = self.capacity_blocks
        self._unreferenced = 0

    def drain_events(self) -> list[EngineEvent]:
        """The events since the last drain, in order (one engine step's batch)."""
        events, self._events = self._events, []
        return events

    # --- eviction ------------------------------------------------------------------------

    def _push(self, block: _Block) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (block.last_used, self._pushes, block))
        # Stale entries pile up as blocks are re-referenced; rebuild once they dominate.
        if len(self._heap) > 2 * len(self._blocks) + 64:
            heap = []
            for b in self._blocks.values():
                if b.refs == 0 and b.children == 0:
                    self._pushes += 1
                    heap.append((b.last_used, self._pushes, b))
            heapq.heapify(heap)
            self._heap = heap

    def _evict(self, need: int) -> None:
        while self._free < need:
            last_used, _, block = heapq.heappop(self._heap)
            if (
                block.refs
                or block.children
                or block.last_used != last_used
                or self._blocks.get(block.hash) is not block
            ):
                continue  # stale entry
            del self._blocks[block.hash]
            self._unreferenced -= 1
            self._free += 1
            self.stats.evicted_blocks += 1
            if self.new_fields:
                self._events.append(BlockRemoved(block_hashes=[block.hash], medium=_MEDIUM_GPU, group_idx=0))
            else:
                self._events.append(BlockRemoved(block_hashes=[block.hash], medium=_MEDIUM_GPU))
            parent = block.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0:
                    self._push(parent)

    def _flush_stored(self, parent: _Block | None, run: list[_Block]) -> None:
        if not run:
            return
        lora_name = run[0].lora_name
        tokens: list[int] = []
        for b in run:
            tokens.extend(b.tokens)
        # Engines without the newer fields leave them off the wire (None is omitted when encoding).
        newer = self.new_fields
        event = BlockStored(
            block_hashes=[b.hash for b in run],
            parent_block_hash=parent.hash if parent is not None else None,
            token_ids=tokens,
            block_size=self.block_size,
            lora_id=self._lora_ids.get(lora_name) if lora_name is not None else None,
            medium=_MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=[None] * len(run) if newer else None,
            group_idx=0 if newer else None,
            kv_cache_spec_kind=_FULL_ATTENTION if newer else None,
        )
        self._events.append(event)

    # --- ground truth and gauges ---------------------------------------------------------

    def match_blocks(self, token_ids: Sequence[int], *, lora_name: str | None = None) -> int:
        """How many leading full blocks of ``token_ids`` the cache holds now (no side effect)."""
        return len(self._walk(self._tokens(token_ids), lora_name))

    def block_hashes(self) -> set[BlockHash]:
        """The hash of every cached block, in the space decoded events carry."""
        return set(self._blocks)

    def blocks(self) -> list[BlockInfo]:
        """Every cached block, parents before children."""
        ordered = sorted(self._blocks.values(), key=lambda b: b.depth)
        return [
            BlockInfo(
                block_hash=b.hash,
                parent_block_hash=b.parent.hash if b.parent is not None else None,
                token_ids=b.tokens,
                lora_name=b.lora_name,
                depth=b.depth,
                ref_count=b.refs,
            )
            for b in ordered
        ]

    def held_prefixes(self) -> set[tuple[str | None, tuple[int, ...]]]:
        """Every cached block as (LoRA, the full token prefix up to and including that block)."""
        memo: dict[int, tuple[int, ...]] = {}

        def prefix(b: _Block) -> tuple[int, ...]:
            key = id(b)
            got = memo.get(key)
            if got is None:
                got = (prefix(b.parent) if b.parent is not None else ()) + b.tokens
                memo[key] = got
            return got

        return {(b.lora_name, prefix(b)) for b in sorted(self._blocks.values(), key=lambda b: b.depth)}

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks in the prefix cache (referenced or not)."""
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks usable right now without evicting: capacity minus cached minus reserved."""
        return self._free

    @property
    def num_unreferenced_blocks(self) -> int:
        """Cached blocks no running request uses (the eviction candidates)."""
        return self._unreferenced

    @property
    def num_running(self) -> int:
        """Requests admitted and not yet released."""
        return len(self._requests)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by running requests (referenced or reserved), as engines report KV usage."""
        used = self.capacity_blocks - self._free - self._unreferenced
        return used / self.capacity_blocks
