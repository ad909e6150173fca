"""A KV-event publisher that speaks docs/protocol.md exactly: the engine side of one data-parallel rank.

It is the mirror image of kvroute's subscriber: a PUB socket sending ``[topic, seq8, payload]``
(seq from 0 at every process start, +1 per published batch) and a ROUTER replay buffer answering
``[b"", seq8]`` requests with every buffered batch from that seq on, then the end marker. Fault
knobs reproduce what real engines do to subscribers: seeded drops (a high-water-mark drop: the
seq is consumed and the batch stays replayable), restarts (seq back to 0, nothing announced),
a dead replay endpoint, held-back publishing, and raw frames for garbage.

`history` is the ground truth: every batch the current process published (dropped ones too),
so tests can build the index the subscriber *should* hold and compare.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from collections.abc import Iterable
from typing import Literal

import anyio
import anyio.lowlevel
import zmq

from .._models import EventSource
from .._recovery import REPLAY_END_MARKER
from .._transports.zmq import sockets as _zmq
from .._wire import EngineEvent, EventBatch, encode_batch
from ._lifecycle import AsyncService
from ._ports import bind_zmq

__all__ = ["END_SEQ", "EventPublisher"]

#: The replay end marker's seq: 0xFF x 8 (-1 as a signed int64), docs/protocol.md §4 (defined once, in _recovery).
END_SEQ = REPLAY_END_MARKER

# A payload no decoder accepts: 0xc1 is the one byte msgpack never uses.
_GARBAGE = b"\xc1garbage"

# How often a long replay yields to the event loop: an engine serves replay from its own
# thread, so the live stream (and a subscriber in the same process) keeps moving meanwhile.
_REPLAY_YIELD_EVERY = 64
# Rebinding a port just released: libzmq closes listeners asynchronously in its I/O thread,
# so the first bind can see EADDRINUSE for a moment: milliseconds on an idle machine, but over
# 2 s was seen once with CPU hogs beside the suite (load average 20), the I/O thread unscheduled.
_REBIND_TIMEOUT = 10.0
_REBIND_PAUSE = 0.005


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    host, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port == "0":
        bind_zmq(sock, host)  # below the ephemeral range, so a restart can bind it again
        return _bound(sock)
    deadline = time.monotonic() + _REBIND_TIMEOUT
    while True:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(_REBIND_PAUSE)
        else:
            return _bound(sock)


def _bound(sock: zmq.Socket[bytes]) -> str:
    last: bytes = sock.getsockopt(zmq.LAST_ENDPOINT)  # type: ignore[assignment]
    return last.decode("ascii")


class EventPublisher(AsyncService):
    """One simulated engine rank's KV-event publisher (PUB) and replay server (ROUTER).

    Use as ``async with EventPublisher(...) as pub:``; it binds on entry and runs its replay
    server in its own task group until exit. ``endpoint="tcp://127.0.0.1:0"`` binds a free
    port; `endpoint` / `replay_endpoint` then give the bound addresses. ``replay_endpoint=None``
    publishes without a replay buffer, like an engine with replay off.

    Every method except the context manager is synchronous (call it from the event loop's
    thread): `publish` never blocks, like an engine's publisher, and a test can restart the
    engine or publish a burst without letting any subscriber task run in between.

    Wire knobs: ``form`` ("map" or "array" events), ``signed_hashes`` (int64 hashes, as
    SGLang), ``reply_layout`` ("new": ``[b"", topic, seq8, payload]``; "old":
    ``[b"", seq8, payload]``), ``data_parallel_rank`` (written into every batch).
    ``hwm`` is the PUB send high-water mark; ``replay_sndhwm`` the ROUTER's (libzmq's
    default 1,000, like the engines: a long replay can lose replies mid-way, docs/protocol.md §4).
    ``sndbuf`` sets the PUB's kernel send buffer: small, it makes a slow subscriber reach the
    high-water mark after a few hundred kilobytes instead of megabytes.
    ``curve`` is the server's CURVE key pair: clients must then use CURVE with its public key.
    Fault knobs: ``drop_rate`` and ``corrupt_rate`` (with ``seed``), `replay_mute`, `restart`,
    `kill_replay` / `revive_replay`, `pause` / `resume`, `publish_raw`. ``keep_history=False``
    skips the ground-truth record (benchmarks).
    """

    def __init__(
        self,
        *,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        form: Literal["map", "array"] = "map",
        signed_hashes: bool = False,
        reply_layout: Literal["new", "old"] = "new",
        data_parallel_rank: int | None = 0,
        drop_rate: float = 0.0,
        corrupt_rate: float = 0.0,
        seed: int = 0,
        replay_sndhwm: int = 1000,
        sndbuf: int | None = None,
        curve: _zmq.CurveKeys | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        keep_history: bool = True,
    ) -> None:
        if reply_layout not in ("new", "old"):
            raise ValueError(f"unknown reply layout {reply_layout!r}")
        if form not in ("map", "array"):
            raise ValueError(f"unknown form {form!r}")
        for name, rate in (("drop_rate", drop_rate), ("corrupt_rate", corrupt_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} {rate} is not in [0, 1]")
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps {buffer_steps} < 1")
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.form: Literal["map", "array"] = form
        self.signed_hashes = signed_hashes
        self.reply_layout: Literal["new", "old"] = reply_layout
        self.data_parallel_rank = data_parallel_rank
        self.drop_rate = drop_rate
        self.corrupt_rate = corrupt_rate
        #: While True, replay requests are read and never answered (a loaded engine dropping
        #: every reply, end marker included, docs/protocol.md §4); counted in `replays_ignored`.
        self.replay_mute = False
        self.replay_sndhwm = replay_sndhwm
        self.sndbuf = sndbuf
        self.curve = curve
        self.keep_history = keep_history
        #: Every batch published since the current process start, dropped ones included.
        self.history: list[EventBatch] = []
        #: Counters: batches published (since construction), of which dropped or sent
        #: corrupted, restarts, replay requests answered, replay replies sent (end markers excluded).
        self.published = 0
        self.dropped = 0
        self.corrupted = 0
        self.restarts = 0
        self.replays_served = 0
        self.replays_ignored = 0
        self.replies_sent = 0
        self._bind_endpoint = endpoint
        self._bind_replay = replay_endpoint
        self._endpoint = ""
        self._replay_endpoint: str | None = None
        self._rng = random.Random(seed)
        self._topic = topic.encode("utf-8")
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._held: list[list[bytes]] = []
        self._paused = False
        self._ctx = context
        self._own_ctx = context is None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        # Set (and replaced) whenever the ROUTER is rebound; created on entry (anyio events
        # need a running event loop).
        self._router_changed: anyio.Event | None = None

    # --- lifecycle ---------------------------------------------------------------------

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        if self._ctx is None:
            self._ctx = zmq.Context()
        self._router_changed = anyio.Event()
        self._open_pub(self._bind_endpoint)
        if self._bind_replay is not None:
            self._open_router(self._bind_replay)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        tg.start_soon(self._serve_replay)

    def _release(self) -> None:
        self._close_sockets()
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _context(self) -> zmq.Context[zmq.Socket[bytes]]:
        if self._ctx is None:
            raise RuntimeError("EventPublisher is not running (use `async with`)")
        return self._ctx

    def _open_pub(self, endpoint: str) -> None:
        sock: zmq.Socket[bytes] = self._context().socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        if self.sndbuf is not None:
            sock.setsockopt(zmq.SNDBUF, self.sndbuf)
        self._set_curve(sock)
        self._pub = sock
        self._endpoint = _bind(sock, endpoint)

    def _open_router(self, endpoint: str) -> None:
        sock: zmq.Socket[bytes] = self._context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.replay_sndhwm)
        self._set_curve(sock)
        self._router = sock
        self._replay_endpoint = _bind(sock, endpoint)
        if self._router_changed is not None:
            self._router_changed.set()
        self._router_changed = anyio.Event()

    def _set_curve(self, sock: zmq.Socket[bytes]) -> None:
        if self.curve is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret.encode("ascii"))

    def _close_router(self) -> None:
        if self._router is not None:
            _zmq.close(self._router)
            self._router = None

    def _close_sockets(self) -> None:
        if self._pub is not None:
            _zmq.close(self._pub)
            self._pub = None
        self._close_router()

    # --- addresses -----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The PUB's bound endpoint (the real port when bound to port 0)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER's bound endpoint, or None when this publisher has no replay buffer."""
        return self._replay_endpoint if self._bind_replay is not None else None

    @property
    def next_seq(self) -> int:
        """The seq the next published batch gets."""
        return self._seq

    def source(self, worker_id: str = "sim", **overrides: object) -> EventSource:
        """An `EventSource` describing this publisher, as discovery would report it."""
        fields: dict[str, object] = {
            "worker_id": worker_id,
            "dp_rank": self.data_parallel_rank or 0,
            "endpoint": self.endpoint,
            "topic": self.topic,
            "replay_endpoint": self.replay_endpoint,
            "hwm": self.hwm,
            "buffer_steps": self.buffer_steps if self.replay_endpoint else None,
            "curve_server_key": self.curve.public if self.curve else None,
        }
        fields.update(overrides)
        return EventSource(**fields)  # type: ignore[arg-type]

    # --- publishing ------------------------------------------------------------------------

    def publish(self, events: Iterable[EngineEvent], ts: float | None = None) -> int:
        """Publish one batch (one engine step) and return its seq; never blocks.

        The batch enters the replay buffer and `history` whatever happens to the live copy:
        with probability ``drop_rate`` it is not sent (as a PUB drops past its high-water
        mark), with probability ``corrupt_rate`` its live payload is garbage, and while
        paused it is held until `resume`.
        """
        batch = EventBatch(time.time() if ts is None else ts, list(events), self.data_parallel_rank)
        return self.publish_batch(batch)

    def publish_batch(self, batch: EventBatch) -> int:
        """Publish an already-built batch (its ``data_parallel_rank`` is kept as given); see `publish`."""
        payload = encode_batch(batch, form=self.form, signed_hashes=self.signed_hashes)
        seq = self._seq
        self._seq += 1
        self.published += 1
        if self._bind_replay is not None:
            self._buffer.append((seq, payload))
        if self.keep_history:
            self.history.append(batch)
        if self.drop_rate and self._rng.random() < self.drop_rate:
            self.dropped += 1
            return seq
        if self.corrupt_rate and self._rng.random() < self.corrupt_rate:
            # Damaged in transit: the live copy does not decode, the buffered one is intact.
            self.corrupted += 1
            payload = _GARBAGE
        frames = [self._topic, seq.to_bytes(8, "big"), payload]
        if self._paused:
            self._held.append(frames)
        else:
            self._send(frames)
        return seq

    def publish_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames on the PUB (garbage, wrong frame counts); consumes no seq."""
        self._send(frames)

    def _send(self, frames: list[bytes]) -> None:
        if self._pub is None:
            raise RuntimeError("EventPublisher is not running (use `async with`)")
        _zmq.send_nowait(self._pub, frames)

    def pause(self) -> None:
        """Hold live messages back (seqs and the replay buffer still advance) until `resume`."""
        self._paused = True

    def resume(self) -> None:
        """Send every held message in one burst (the PUB drops past ``hwm``, as engines do)."""
        self._paused = False
        held, self._held = self._held, []
        for frames in held:
            self._send(frames)

    # --- faults ------------------------------------------------------------------------------

    def restart(self, *, new_ports: bool = False) -> None:
        """Simulate an engine process restart: seq back to 0, buffer and history emptied, sockets new.

        The engine announces nothing (no AllBlocksCleared, docs/protocol.md §2). With
        ``new_ports=False`` it binds the same ports again; otherwise fresh ones (see
        `endpoint`). Held messages die with the old process.
        """
        self.restarts += 1
        self._seq = 0
        self._buffer.clear()
        self.history.clear()
        self._held.clear()
        self._paused = False
        had_router = self._router is not None
        self._close_sockets()
        self._open_pub(self._bind_endpoint if new_ports else self._endpoint)
        if had_router and self._replay_endpoint is not None:
            self._open_router(self._bind_replay if new_ports and self._bind_replay else self._replay_endpoint)

    def kill_replay(self) -> None:
        """Close the replay endpoint: requests go unanswered (connections are refused) until revived."""
        self._close_router()

    def revive_replay(self) -> None:
        """Bind the replay endpoint again on its old port; the buffer is intact."""
        if self._router is None and self._replay_endpoint is not None:
            self._open_router(self._replay_endpoint)

    # --- replay server ---------------------------------------------------------------------------

    async def _serve_replay(self) -> None:
        while True:
            sock = self._router
            if sock is None:
                assert self._router_changed is not None  # created on entry
                await self._router_changed.wait()
                continue
            try:
                requests = await _zmq.recv_many(sock, 64)
            except (anyio.ClosedResourceError, zmq.ZMQError):
                continue  # killed or restarted: pick up the new socket (or wait for one)
            for frames in requests:
                if self._router is not sock:
                    break
                await self._answer(sock, frames)

    async def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        # A ROUTER prefixes the peer identity; the request itself is [b"", seq8]. Anything
        # else is malformed and gets no reply at all (docs/protocol.md §4).
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            return
        if self.replay_mute:
            self.replays_ignored += 1
            return
        ident = frames[0]
        start = int.from_bytes(frames[2], "big")
        # A start older than the buffer starts at the oldest; a future one matches nothing.
        items = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        self.replays_served += 1
        new = self.reply_layout == "new"
        for i, (seq, payload) in enumerate(items):
            if i and i % _REPLAY_YIELD_EVERY == 0:
                await anyio.lowlevel.checkpoint()
                if self._router is not sock:
                    return  # restarted or killed mid-replay: the rest died with the socket
            seq8 = seq.to_bytes(8, "big")
            out = [ident, b"", self._topic, seq8, payload] if new else [ident, b"", seq8, payload]
            _zmq.send_nowait(sock, out)
            self.replies_sent += 1
        end = [ident, b"", b"", END_SEQ, b""] if new else [ident, b"", END_SEQ, b""]
        _zmq.send_nowait(sock, end)
