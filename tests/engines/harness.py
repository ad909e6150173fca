"""The side of the conformance suite that is not an engine: kvroute's subscriber and the judge.

An engine driver (``vllm_driver.py``, ``sglang_driver.py``) runs the engine's own cache manager and
publishes what it emits through the engine's own ``ZmqEventPublisher``. This module runs a real
`kvroute.KvEventClient` against that publisher, in an event loop on a helper thread (asyncio or trio,
through an anyio blocking portal: the engines' cache code is synchronous and runs on the test's
thread), and compares kvroute's answer with the engine's at every admission.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq
from anyio.from_thread import BlockingPortal, start_blocking_portal

import kvroute


def free_port() -> int:
    """A TCP port on ::1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


def loopback_endpoints() -> tuple[str, str]:
    """(publish, replay) endpoints on IPv6 loopback.

    The engines' publishers connect (instead of binding) to an endpoint naming a plain host, and bind
    only wildcard or ``::`` endpoints; ``[::1]`` is such an endpoint and stays on loopback.
    """
    return f"tcp://[::1]:{free_port()}", f"tcp://[::1]:{free_port()}"


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive TCP ports on ::1 that nothing listens on right now."""
    for _ in range(100):
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("::1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on ::1")


def rank_endpoints(ranks: int) -> tuple[str, str]:
    """(publish, replay) base endpoints for ``ranks`` data-parallel ranks on IPv6 loopback.

    vLLM's publisher of rank r binds the base port + r (``ZmqEventPublisher.offset_endpoint_port``),
    so each base has ``ranks`` free ports after it.
    """
    return f"tcp://[::1]:{free_ports(ranks)}", f"tcp://[::1]:{free_ports(ranks)}"


def offset_port(endpoint: str, rank: int) -> str:
    """``endpoint`` with its port moved up by ``rank`` (where rank r's publisher binds)."""
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def enable_ipv6(ctx: zmq.Context[Any]) -> None:
    """Sockets made from ``ctx`` accept IPv6 endpoints (libzmq refuses them by default)."""
    ctx.setsockopt(zmq.IPV6, 1)


@dataclass
class Mm:
    """One multimodal item of a request: identifier, placeholder token offset, token count."""

    identifier: str
    offset: int
    length: int


@dataclass
class Tally:
    """Per-configuration verdict: admissions compared, over-claims, under-claims (with examples)."""

    name: str
    admissions: int = 0
    hits: int = 0  # admissions where the engine had a non-zero prefix hit
    over: int = 0
    under: int = 0
    over_tokens: int = 0
    under_tokens: int = 0
    examples: list[str] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)  # what the engine published, by event type
    kvroute: dict[str, int] = field(default_factory=dict)  # kvroute's counters at the end of the run

    def saw(self, kind: str, n: int = 1) -> None:
        self.events[kind] = self.events.get(kind, 0) + n

    def record(self, rid: str, kv: int, engine: int) -> None:
        self.admissions += 1
        self.hits += engine > 0
        if kv > engine:
            self.over += 1
            self.over_tokens += kv - engine
        elif kv < engine:
            self.under += 1
            self.under_tokens += engine - kv
        if kv != engine and len(self.examples) < 5:
            self.examples.append(f"{rid}: kvroute {kv} tokens, engine {engine}")

    def line(self) -> str:
        return (
            f"{self.name}: admissions {self.admissions} (engine hits {self.hits}), "
            f"over-claims {self.over} ({self.over_tokens} tokens), "
            f"under-claims {self.under} ({self.under_tokens} tokens); published "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.events.items()))
            + "; kvroute " + ", ".join(f"{k} {v}" for k, v in sorted(self.kvroute.items()))
        )


class Judge:
    """A running `KvEventClient` subscribed to one engine worker, queried from the test's thread."""

    def __init__(self, portal: BlockingPortal, client: kvroute.KvEventClient, worker: kvroute.WorkerKey) -> None:
        self._portal = portal
        self.client = client
        self.worker = worker

    def wait_seq(self, seq: int, timeout: float = 30.0) -> None:
        """Block until kvroute has taken in the engine's batch ``seq`` (bounded in time).

        Taken in = applied (the worker's cursor reached it), or received and found undecodable (kvroute
        then recovers as it sees fit: a router asking now sees whatever state that leaves).
        """
        if seq < 0:  # nothing published yet
            return
        deadline = time.monotonic() + timeout
        while True:
            cur, st = self._portal.call(self._progress)
            if cur >= seq or (st is not None and st.last_seq >= seq and st.decode_errors > 0):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvroute did not reach seq {seq} (at {cur}, {st}) in {timeout} s")
            time.sleep(0.002)

    def _progress(self) -> tuple[int, Any]:
        cur = self.client.cursors().get(self.worker)
        return (-1 if cur is None else cur.seq), self.client.stats().sources.get(self.worker)

    def kvroute_counters(self) -> dict[str, int]:
        """kvroute's own view of the run: undecodable batches, resets, gaps."""
        st = self._portal.call(self.client.stats).sources.get(self.worker)
        if st is None:
            return {}
        return {"decode_errors": st.decode_errors, "resets": st.resets, "gaps": st.gaps}

    def tokens(self, prompt: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None,
               mm: Sequence[Mm] = ()) -> int:
        """Leading prompt tokens kvroute says this worker holds, asked as a router would ask."""
        return int(self._portal.call(self._tokens, list(prompt), lora_name, cache_salt, tuple(mm)))

    def _tokens(self, prompt: list[int], lora_name: str | None, cache_salt: str | None,
                mm: tuple[Mm, ...]) -> int:
        items = [kvroute.MultimodalItem(identifier=m.identifier, offset=m.offset, length=m.length) for m in mm]
        scores = self.client.index.find_matches(prompt, lora_name=lora_name, cache_salt=cache_salt, mm_items=items)
        return int(scores.tokens(self.worker))


@contextmanager
def judge(backend: str, endpoint: str, replay: str, *, worker_id: str, block_size: int,
          topic: str = "") -> Iterator[Judge]:
    """Start a real `KvEventClient` for one engine publisher, synced before the workload starts."""
    with judges(backend, [(endpoint, replay)], worker_id=worker_id, block_size=block_size, topic=topic) as js:
        yield js[0]


@contextmanager
def judges(backend: str, ranks: Sequence[tuple[str, str]], *, worker_id: str, block_size: int,
           topic: str = "", reuse_reports: bool | None = None) -> Iterator[list[Judge]]:
    """One real `KvEventClient` for an engine's data-parallel ranks (rank r publishes on ``ranks[r]``),
    synced before the workload starts; a `Judge` per rank. ``reuse_reports``: the client's setting
    (None: the index's default)."""
    ctx: zmq.Context[Any] = zmq.Context()
    enable_ipv6(ctx)
    sources = [kvroute.EventSource(worker_id=worker_id, dp_rank=r, endpoint=endpoint, replay_endpoint=replay,
                                   topic=topic, block_size=block_size, engine="static")
               for r, (endpoint, replay) in enumerate(ranks)]
    client = kvroute.KvEventClient(sources, context=ctx, reuse_reports=reuse_reports)
    try:
        # The client's task group lives in one task of the portal's loop for the whole run.
        with start_blocking_portal(backend) as portal, portal.wrap_async_context_manager(client):
            portal.call(client.wait_synced, 30.0)
            yield [Judge(portal, client, s.key) for s in sources]
    finally:
        ctx.term()


@dataclass(frozen=True)
class Gap:
    """A known gap of one configuration on one side: the measured count of admissions (its upper
    bound from now on) and why."""

    count: int
    why: str


# Every configuration run in this process, for the summary the suite prints at the end.
RESULTS: list[Tally] = []


class Suite:
    """One engine's configurations: each run once (on first use) and recorded in `RESULTS`; its known gaps.

    ``run(config, backend)`` drives the engine and returns its `Tally`. ``known`` maps (engine version
    or "*", configuration, "over" | "under") to a `Gap`: that case becomes a strict xfail, so a fix
    fails it until the entry is deleted, and its measured count an upper bound (`bound`), so a change
    that adds to the gap fails too.
    """

    def __init__(
        self,
        configs: dict[str, tuple[Any, str]],
        run: Callable[[Any, str], Tally],
        known: dict[tuple[str, str, str], Gap],
        version: str,
    ) -> None:
        self.configs = configs
        self._run = run
        self._known = known
        self._version = version
        self._results: dict[str, Tally] = {}

    def tally(self, name: str) -> Tally:
        """Configuration ``name``'s counts, running it the first time it is asked for."""
        if name not in self._results:
            cfg, backend = self.configs[name]
            self._results[name] = self._run(cfg, backend)
            RESULTS.append(self._results[name])
        return self._results[name]

    def gap(self, name: str, side: str) -> Gap | None:
        """The known gap of ``name`` on ``side`` ("over" | "under") for this engine version, if any."""
        return self._known.get((self._version, name, side)) or self._known.get(("*", name, side))

    def bound(self, name: str, side: str) -> int:
        """The most admissions of ``name`` that may be off on ``side``: a known gap's measured count, else 0."""
        gap = self.gap(name, side)
        return 0 if gap is None else gap.count

    def case(self, name: str, side: str) -> object:
        """A pytest parameter for ``name``, a strict xfail where ``known`` names a gap on ``side``."""
        gap = self.gap(name, side)
        marks = [pytest.mark.xfail(strict=True, reason=f"{gap.count} admissions: {gap.why}")] if gap else []
        return pytest.param(name, marks=marks, id=name)


def report(tallies: Sequence[Tally], emit: Callable[[str], None] = print) -> None:
    """Print the per-configuration table (the README's measured table is copied from it)."""
    for t in tallies:
        emit(t.line())
        for e in t.examples:
            emit(f"    e.g. {e}")
