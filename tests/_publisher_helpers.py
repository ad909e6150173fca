"""Test helpers for socket tests: a seeded engine workload, an engine-side ground truth, and index comparisons."""

from __future__ import annotations

import os
import random
import socket
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import anyio
import pytest
import zmq

from kvroute._client import EventStream, KvEventClient
from kvroute._events import Envelope
from kvroute._index import PrefixIndex
from kvroute._models import WorkerKey
from kvroute._transports.zmq import sockets as _zmq
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent, EventBatch, encode_batch
from kvroute.sim._publisher import EventPublisher

BLOCK_SIZE = 4


class Workload:
    """A seeded stand-in for an engine's cache activity: chains stored, blocks evicted.

    Every batch it makes is valid for an engine to send (removals name held blocks). It
    remembers each stored chain so that `queries` can rebuild its full token prefix.
    """

    def __init__(self, seed: int, *, block_size: int = BLOCK_SIZE, evict_rate: float = 0.2) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.evict_rate = evict_rate
        # Every block ever stored: engine hash -> (parent hash, its own tokens).
        self._lineage: dict[int, tuple[int | None, list[int]]] = {}
        self._tails: list[int] = []
        # The held hashes as a list for O(1) random picks (swap-remove keeps it dense).
        self._held: list[int] = []
        self._pos: dict[int, int] = {}
        # The tokens of each chain stored under a parent, on their own.
        self._own: list[tuple[int, ...]] = []

    @property
    def queries(self) -> list[tuple[int, ...]]:
        """The full token prefix of every stored chain, oldest first."""
        out = []
        for h in self._tails:
            parts: list[list[int]] = []
            cur: int | None = h
            while cur is not None:
                parent, tokens = self._lineage[cur]
                parts.append(tokens)
                cur = parent
            out.append(tuple(t for block in reversed(parts) for t in block))
        return out

    @property
    def probes(self) -> list[tuple[int, ...]]:
        """`queries`, then each chain stored under a parent, its own tokens alone.

        The second kind asks whether an index claims a chain from the root although it was
        stored under a parent (which the index may never have seen: a partial history).
        """
        out = self.queries
        full = set(out)
        return out + [q for q in self._own if q not in full]

    def clear(self) -> list[EngineEvent]:
        """The engine dropped its whole cache (``reset_prefix_cache``): one `AllBlocksCleared`."""
        self._held.clear()
        self._pos.clear()
        return [AllBlocksCleared()]

    def _pick(self) -> int:
        return self._held[self.rng.randrange(len(self._held))]

    def batch(self, max_blocks: int = 4) -> list[EngineEvent]:
        """One engine step: store a chain (extending a held block half the time), sometimes evict one."""
        rng, bs = self.rng, self.block_size
        events: list[EngineEvent] = []
        parent = self._pick() if self._held and rng.random() < 0.5 else None
        n = rng.randint(1, max_blocks)
        hashes = [rng.getrandbits(64) for _ in range(n)]
        tokens = array("H", rng.randbytes(2 * n * bs)).tolist()  # uint16 ids, one C call
        events.append(
            BlockStored(
                block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens, block_size=bs, medium="GPU"
            )
        )
        prev = parent
        for i, h in enumerate(hashes):
            self._lineage[h] = (prev, tokens[i * bs : (i + 1) * bs])
            self._pos[h] = len(self._held)
            self._held.append(h)
            prev = h
        self._tails.append(hashes[-1])
        if parent is not None:
            self._own.append(tuple(tokens))
        if rng.random() < self.evict_rate:
            victim = self._pick()
            i = self._pos.pop(victim)
            last = self._held.pop()
            if last != victim:
                self._held[i] = last
                self._pos[last] = i
            events.append(BlockRemoved(block_hashes=[victim], medium="GPU"))
        return events


class EngineTruth:
    """What the engines' published histories say each worker holds, computed without kvroute's index.

    A model of the engine's cache, independent of `PrefixIndex`: per worker, every held engine
    hash maps to the full token prefix it ends (its parent's prefix plus its own tokens), or to
    None when its parent was not held when it was stored (such a block, and every block under
    it, proves no prefix). A stored block whose hash is held already is another copy (kept
    until every copy is removed); `AllBlocksCleared` empties the worker. A worker holds a
    prefix of ``q`` of n blocks when each of ``q``'s first 1..n blocks is some held block's
    prefix. It offers the three questions the tests ask an index: `workers`, `num_blocks`,
    `find_matches`.
    """

    def __init__(self) -> None:
        self._held: dict[WorkerKey, dict[object, tuple[tuple[int, ...] | None, int]]] = {}
        self._block_size: dict[WorkerKey, int] = {}
        self._prefixes: dict[WorkerKey, set[tuple[int, ...]]] = {}  # cache, dropped on each change

    def apply(self, worker: WorkerKey, batch: EventBatch) -> None:
        """One published batch of ``worker``."""
        self._prefixes.pop(worker, None)
        held = self._held.setdefault(worker, {})
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                bs = ev.block_size
                self._block_size[worker] = bs
                parent = ev.parent_block_hash
                prefix: tuple[int, ...] | None = () if parent is None else (
                    held[parent][0] if parent in held else None
                )
                for i, h in enumerate(ev.block_hashes):
                    if prefix is not None:
                        prefix = prefix + tuple(ev.token_ids[i * bs : (i + 1) * bs])
                    cur = held.get(h)
                    held[h] = (cur[0], cur[1] + 1) if cur is not None else (prefix, 1)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    cur = held.get(h)
                    if cur is not None:
                        if cur[1] > 1:
                            held[h] = (cur[0], cur[1] - 1)
                        else:
                            del held[h]
            elif isinstance(ev, AllBlocksCleared):
                held.clear()

    def workers(self) -> set[WorkerKey]:
        """Workers holding at least one block."""
        return {w for w, held in self._held.items() if held}

    def num_blocks(self, worker: WorkerKey) -> int:
        """Distinct engine hashes ``worker`` holds."""
        return len(self._held.get(worker, {}))

    def find_matches(self, query: Sequence[int]) -> dict[WorkerKey, int]:
        """Leading full blocks of ``query`` each worker holds (workers with none left out)."""
        out: dict[WorkerKey, int] = {}
        for w, held in self._held.items():
            bs = self._block_size.get(w)
            if not bs:
                continue
            prefixes = self._prefixes.get(w)
            if prefixes is None:
                prefixes = self._prefixes[w] = {p for p, _ in held.values() if p is not None}
            n = 0
            # Within the prompt minus its last token, which the engine always computes.
            while (n + 1) * bs <= len(query) - 1 and tuple(query[: (n + 1) * bs]) in prefixes:
                n += 1
            if n:
                out[w] = n
        return out


def served(cache: Any, prompt: Sequence[int]) -> int:
    """Leading blocks of ``prompt`` a simulated engine's ``cache`` would serve: what it holds, within the prompt
    minus its last token (vLLM and SGLang always compute the last token), in whole blocks."""
    return min(cache.match_blocks(prompt), max(0, len(prompt) - 1) // cache.block_size)


def truth_index(publishers: Mapping[WorkerKey, EventPublisher]) -> EngineTruth:
    """What each publisher's full history (its current process) says its worker holds: the ground truth.

    Computed by `EngineTruth`, not by kvroute: an index that agrees with it agrees with the engine.
    """
    truth = EngineTruth()
    for key, pub in publishers.items():
        for batch in pub.history:
            truth.apply(key, batch)
    return truth


class _Answers(Protocol):
    def workers(self) -> set[WorkerKey]: ...
    def num_blocks(self, worker: WorkerKey) -> int: ...
    def find_matches(self, query: Sequence[int]) -> Mapping[WorkerKey, int]: ...


def _scores(index: _Answers, query: Sequence[int]) -> dict[WorkerKey, int]:
    return {w: s for w, s in index.find_matches(query).items() if s}


def assert_index_equal(index: PrefixIndex, truth: _Answers, queries: Iterable[Sequence[int]]) -> None:
    """Same workers, same block counts, same scores for every query."""
    assert index.workers() == truth.workers()
    for w in truth.workers():
        assert index.num_blocks(w) == truth.num_blocks(w), w
    for q in queries:
        assert _scores(index, q) == _scores(truth, q), q


def assert_index_subset(index: PrefixIndex, truth: _Answers, queries: Iterable[Sequence[int]]) -> None:
    """The index claims nothing the truth does not: never more blocks, never a longer match."""
    assert index.workers() <= truth.workers()
    for w in index.workers():
        assert index.num_blocks(w) <= truth.num_blocks(w), w
    for q in queries:
        got, want = _scores(index, q), _scores(truth, q)
        for w, s in got.items():
            assert s <= want.get(w, 0), (w, q)


async def recv_frames(sock: zmq.Socket[bytes], count: int) -> list[list[bytes]]:
    """Read exactly ``count`` messages from a raw socket (fails the test after 5 s)."""
    out: list[list[bytes]] = []
    with anyio.fail_after(5):
        while len(out) < count:
            out.extend(await _zmq.recv_many(sock, count - len(out)))
    return out


async def nothing_arrives(sock: zmq.Socket[bytes], wait: float) -> bool:
    """True when no message reaches ``sock`` within ``wait`` seconds."""
    with anyio.move_on_after(wait):
        await _zmq.wait_readable(sock)
        return False
    return True


#: Fast settings for socket tests: quick reconnects, short replay timeouts and quiet ticks. On the
#: default receiver (the native thread); ``KVROUTE_TEST_RECEIVER=python`` runs every test that uses
#: these settings on the Python receiver instead, which the default no longer exercises.
FAST = SubscriberConfig(
    reconnect_ivl=0.02,
    reconnect_ivl_max=0.1,
    replay_timeout=0.3,
    quiet_interval=0.3,
    native_receive=os.environ.get("KVROUTE_TEST_RECEIVER", "native") != "python",
)


async def settle(client: KvEventClient, stream: EventStream, last_seqs: Mapping[WorkerKey, int]) -> None:
    """Wait (reading ``stream``) until each worker applied up to its seq and every source is synced.

    Every change a driver makes emits an envelope, so re-checking after each one never misses
    the moment; fails the test after 10 s.
    """

    def done() -> bool:
        per = client.stats().sources
        return all(k in per and per[k].last_seq == s for k, s in last_seqs.items()) and all(
            st.state == "synced" for st in per.values()
        )

    with anyio.fail_after(10):
        while not done():
            await stream.__anext__()


async def next_event(stream: EventStream, kind: str) -> Envelope:
    """The next lifecycle envelope of ``kind`` ("connected", "reset", ...); fails the test after 10 s."""
    with anyio.fail_after(10):
        async for env in stream:
            if getattr(env.event, "kind", None) == kind:
                return env
    raise AssertionError(f"stream ended before a {kind!r} event")


async def first_batch_lands(client: KvEventClient, pub: EventPublisher, key: WorkerKey, wl: Workload) -> None:
    """Publish ``wl``'s batches to ``pub`` until one is applied (``key``'s last_seq reaches it; at most 10 s).

    For a test with quiet probes off: the first batches after `wait_synced` may reach the PUB before
    the SUB's subscription does (ZMQ's slow joiner), and then only a later batch's gap brings them back.
    """

    def landed() -> bool:
        st = client.stats().sources.get(key)
        return st is not None and st.last_seq == pub.next_seq - 1 and st.state == "synced"

    with anyio.fail_after(10):
        while True:
            pub.publish(wl.batch())
            with anyio.move_on_after(0.5):
                while not landed():  # noqa: ASYNC110 (the client's task applies it)
                    await anyio.sleep(0.005)
                return


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition()`` holds, checking every 5 ms; fails the test after 10 s.

    For conditions no event announces (a counter of another component, a socket's peer):
    the test waits for the state it needs instead of sleeping a fixed time and hoping.
    """
    with anyio.fail_after(10):
        while not condition():  # noqa: ASYNC110 (nothing to wait on: the state is polled)
            await anyio.sleep(0.005)
    assert condition(), what


async def following_live(client: KvEventClient, pub: EventPublisher, key: WorkerKey, wl: Workload) -> None:
    """Publish intact batches of ``wl`` until one arrives live: the SUB's subscription reached the PUB.

    A synced source is connected and replayed, but its subscription may reach the PUB later (a
    slow joiner): what the PUB sends before that never reaches this subscriber, and comes back by
    replay. A test counting what the live stream itself carries (damaged copies, bad frames)
    starts after this.
    """
    rate, pub.corrupt_rate = pub.corrupt_rate, 0.0
    try:
        with anyio.fail_after(10):
            while client.stats().sources[key].messages == 0:
                pub.publish(wl.batch())
                await anyio.sleep(0.02)
    finally:
        pub.corrupt_rate = rate


async def subscribed(client: KvEventClient, pub: EventPublisher, key: WorkerKey) -> None:
    """Send frames with a malformed seq until ``key``'s source counts one: the SUB's subscription reached the PUB.

    As `following_live`, for a test whose live batches must reach the SUB (quiet probes off, or a
    count only the live stream makes), but it publishes no batch: no seq is taken and no gap can
    follow (a skipped frame touches no source state), for a test that counts gaps or exact seqs.
    """
    before = client.stats().sources[key].skipped_frames
    with anyio.fail_after(10):
        while client.stats().sources[key].skipped_frames == before:
            pub.publish_raw([pub.topic.encode(), b"\x00\x01", b"\x90"])
            await anyio.sleep(0.02)


async def duplicates_arrive(pub: EventPublisher, messages: Callable[[], int]) -> None:
    """Resend ``pub``'s newest batch (a duplicate, dropped by rule 2) until ``messages()`` counts one arrived live.

    As `subscribed`, for a test that counts the skipped frames itself: this takes no seq and
    counts neither a decode error nor a skipped frame.
    """
    seq = pub.next_seq - 1
    frames = [pub.topic.encode(), seq.to_bytes(8, "big"), encode_batch(pub.history[seq])]
    with anyio.fail_after(10):
        while messages() == 0:
            pub.publish_raw(frames)
            await anyio.sleep(0.02)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


#: For a test that runs an engine or server on [::1]: skipped where the machine has no IPv6 loopback.
needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


def plain_seqs(plain: list[tuple[bytes, bytes]]) -> list[int]:
    """The applied seqs in a native drain's plain records (`kvroute._core.NativeReceiver.drain`'s first item:
    chunks whose first byte string holds native u64 ``token, n, elided, blocks`` then ``n`` seqs, a source after
    another)."""
    seqs: list[int] = []
    for chunk, _ in plain:
        ints = memoryview(chunk).cast("Q")
        p = 0
        while p < len(ints):
            n = ints[p + 1]
            seqs += ints[p + 4 : p + 4 + n].tolist()
            p += 4 + n
    return seqs
