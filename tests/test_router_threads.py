"""One Router served from several threads: `select` from worker threads while another thread ingests.

A router in a threaded server calls `select` from its request threads while the client's thread
applies the engines' events and others start and finish requests. Each test runs real threads on
one real `Router` and `PrefixIndex` (payloads through `apply_payload`, as the subscriber applies
them) and requires every call to succeed and the router's bookkeeping to add up afterwards.

Prompts are longer than the core keeps the GIL for (`HOLD_GIL_TOKENS`, src/py/index.rs), so every
compiled `select` releases the GIL in the middle of its call and the threads truly interleave there;
the interpreter's switch interval is shortened, and the request ids and worker keys hash in Python
and hand the GIL to another thread while they do (any hashable is a request id; a key type's
``__hash__`` may release the GIL), so that another thread runs inside every step of the router's
bookkeeping that looks one up: a lost update needs a switch inside a read-modify-write.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator

import anyio
import pytest

from kvroute import EventBatch, PrefixIndex, WorkerKey, encode_batch
from kvroute._client import KvEventClient
from kvroute._load import EngineLoad, EngineLoads
from kvroute._router import CostModel, Router
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._wire import BlockStored
from kvroute.sim._engine import SimConfig, SimEngine

BS = 16


class _YieldingKey(WorkerKey):
    """A worker key whose hash lets other threads run (``time.sleep(0)`` releases the GIL)."""

    __slots__ = ()

    def __hash__(self) -> int:
        time.sleep(0)
        return tuple.__hash__(self)


class _Rid:
    """A request id whose hash lets other threads run."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        time.sleep(0)
        return hash(self.n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Rid) and other.n == self.n


WORKERS: list[WorkerKey] = [_YieldingKey(f"w{i}", 0) for i in range(8)]
# Above the core's GIL-holding bound (32,768 tokens): the match runs with the GIL released.
PROMPT = list(range(40_000))
SECONDS = 1.5


class _Python(CostModel, frozen=True, kw_only=True):
    """The stock weights through the Python scoring path (every CostModel subclass takes it)."""


def _payload(ts: float, depth: int) -> bytes:
    """A batch storing the first ``depth`` blocks of PROMPT."""
    store = BlockStored(block_hashes=list(range(1, depth + 1)), token_ids=PROMPT[: depth * BS], block_size=BS)
    return encode_batch(EventBatch(ts, [store]))


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class _Selects:
    """What selector threads share: request ids, and the count of their `select` calls (each thread adds
    its own once, at its end), to compare with `RouterStats.selections`."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.total = 0
        self._lock = threading.Lock()

    def rid(self) -> _Rid:
        """A new request id."""
        return _Rid(next(self.ids))

    def add(self, done: int) -> None:
        """Count one thread's ``done`` selects."""
        with self._lock:
            self.total += done


@pytest.fixture
def selects() -> _Selects:
    return _Selects()


def _run(workers: list[Callable[[threading.Event], None]]) -> None:
    """Run each function on its own thread for SECONDS; re-raise the first error any of them hit."""
    threads, stop, errors = _start(workers)
    time.sleep(SECONDS)
    _join(threads, stop, errors)


def _start(
    workers: list[Callable[[threading.Event], None]],
) -> tuple[list[threading.Thread], threading.Event, list[BaseException]]:
    """Start each function on its own thread: the threads, the event that stops them, their errors."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def guard(fn: Callable[[threading.Event], None]) -> None:
        try:
            fn(stop)
        except BaseException as exc:  # reported on the main thread below
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=guard, args=(fn,)) for fn in workers]
    for t in threads:
        t.start()
    return threads, stop, errors


def _join(threads: list[threading.Thread], stop: threading.Event, errors: list[BaseException]) -> None:
    """Stop the threads `_start` started and re-raise the first error any of them hit."""
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("model", [CostModel(), _Python()], ids=["compiled", "python"])
@pytest.mark.parametrize("engine_load", [False, True], ids=["tracked-load", "engine-load"])
def test_select_from_threads_while_another_thread_ingests(
    model: CostModel, engine_load: bool, selects: _Selects
) -> None:
    index = PrefixIndex()
    for i, w in enumerate(WORKERS):
        assert index.apply_payload(w, _payload(0.0, 1 + i * 300)).ok
    loads = EngineLoads() if engine_load else None
    router = Router(index, cost=model, block_size=BS, seed=1, engine_loads=loads)

    def selector(stop: threading.Event) -> None:
        done = 0
        while not stop.is_set():
            rid = selects.rid()
            d = router.select(PROMPT, request_id=rid)
            assert d.worker in WORKERS
            assert d.query_tokens == len(PROMPT)
            # the candidates are read too (the compiled path builds them lazily): every worker holds a prefix
            assert {c.worker for c in d.candidates} == set(WORKERS)
            router.select(PROMPT[: 33_000 + done % 7], candidates=WORKERS[:4])
            assert router.on_finish(rid)
            done += 2
        selects.add(done)

    def starter(stop: threading.Event) -> None:
        # on_start / on_prefill_done / on_finish for requests routed elsewhere, on every worker
        while not stop.is_set():
            rid = selects.rid()
            w = WORKERS[rid.n % len(WORKERS)]
            router.on_start(rid, w, PROMPT[:4096], cached_tokens=16)
            router.on_prefill_done(rid)
            assert router.on_finish(rid)

    def ingest(stop: threading.Event) -> None:
        ts = 1.0
        while not stop.is_set():
            for i, w in enumerate(WORKERS):
                assert index.apply_payload(w, _payload(ts, 1 + (i * 300 + int(ts)) % 2500)).ok
                if loads is not None:
                    loads.update(w, EngineLoad(waiting_uncached_tokens=int(ts) % 900, received=loads.clock()))
                ts += 1.0

    def churn(stop: threading.Event) -> None:
        # registration changes the candidate set the selectors read
        extra = WorkerKey("extra", 0)
        while not stop.is_set():
            router.add_worker(extra)
            router.remove_worker(extra)

    _run([selector, selector, selector, starter, ingest, churn])
    stats = router.stats()
    # every started request finished: no load and no request left behind by a lost update
    assert stats.active_requests == 0
    assert len(router._load) == 0
    assert stats.selections == selects.total
    assert sum(router.load_blocks(w) for w in WORKERS) == 0.0


@pytest.mark.anyio
async def test_worker_threads_select_while_the_client_ingests_a_live_engine(selects: _Selects) -> None:
    """A simulated engine publishes over loopback ZMQ into a real `KvEventClient`, whose index the
    router reads; worker threads select, start and finish requests while the client ingests."""
    config = SimConfig(
        ranks=2, grpc_port=None, http_port=None, decode_time_per_step=0.0005, prefill_time_per_token=1e-7
    )
    fast = SubscriberConfig(reconnect_ivl=0.02, reconnect_ivl_max=0.1, replay_timeout=0.3, quiet_interval=0.3)
    async with SimEngine(config) as engine, KvEventClient(engine.sources(), config=fast) as client:
        await client.wait_synced(5.0)
        router = Router(client.index, block_size=BS, seed=2)
        workers = [WorkerKey(s.worker_id, s.dp_rank) for s in engine.sources()]
        for w in workers:
            router.add_worker(w)

        def selector(stop: threading.Event) -> None:
            done = 0
            while not stop.is_set():
                rid = selects.rid()
                d = router.select(PROMPT, request_id=rid)
                assert d.worker in workers and d.query_tokens == len(PROMPT)
                assert router.on_finish(rid)
                done += 1
            selects.add(done)

        def starter(stop: threading.Event) -> None:
            while not stop.is_set():
                rid = selects.rid()
                router.on_start(rid, workers[rid.n % 2], PROMPT[:2048])
                assert router.on_finish(rid)

        threads, stop, errors = _start([selector, selector, starter])
        try:
            # the engine stores prefixes of PROMPT of every depth on both ranks (evicting as its
            # cache fills); the client applies their events, all for SECONDS
            end = anyio.current_time() + SECONDS
            depth = 8
            with anyio.fail_after(30 + SECONDS):
                while anyio.current_time() < end and not errors:
                    await engine.complete(PROMPT[: depth * BS], max_tokens=1, rank=depth % 2)
                    depth = 8 + (depth + 7) % 300
        finally:
            _join(threads, stop, errors)
        assert client.index.num_blocks() > 0  # the engine's events reached the index
        stats = router.stats()
        assert stats.active_requests == 0 and len(router._load) == 0
        assert stats.selections == selects.total > 0
