"""The native receive loop: the compiled core's own thread reads every eligible source's SUB (`NativeReceiver`)."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import anyio
import zmq

import kvroute._core as _core

from ..._errors import ClientStateError
from ..._models import EventSource
from .._base import EventSink
from . import sockets as _zmq
from .config import SubscriberConfig
from .driver import SourceDriver
from .receiver import _VISIT, _LoopLeader

__all__ = ["NativeReceiver"]

log = logging.getLogger("kvroute.subscriber")

_tokens = itertools.count(1)
# How long the feed of a drain's records pauses after each chunk, in multiples of the chunk's own time (`_loop`).
_PACE = 4.0
# Sources' records with events skipped or payloads kept fed to the drivers between two turns of the event
# loop's other tasks (`_loop`; the plain records come in chunks, `kvroute._core.NativeReceiver.drain`).
_SLICE = 128
_replay_ids = itertools.count(1)
_index_log = logging.getLogger("kvroute.index")


class NativeReceiver(_LoopLeader):
    """The receive loop on the compiled core's own thread (`kvroute._core.NativeReceiver`), for every eligible source.

    The thread owns each source's SUB and monitor (the core's vendored libzmq, its own context),
    checks rule 1 against a mirror of the machine's state (``last_seq + 1`` and a fast-path
    flag only this side opens) and applies in-order batches to the index itself, the GIL
    released. It hands everything else over as it came: messages while the flag is closed
    (gaps, old seqs, undecodable or untrusted payloads, held batches, identity checks),
    monitor events and quiet ticks; each hand-over closes the flag. One pipe wakes the event
    loop once per batch of hand-overs: `serve` drains it, feeds ``on_applied`` with the
    thread's (seq, ts) records, passes each hand-over to its driver as the Python receiver
    would (`SourceDriver._on_messages`, `_on_monitor_event`, `_on_quiet`), and opens the flag
    again where `SourceMachine.in_order` holds. The thread opens it only once this side has
    taken every hand-over of that source, so it never applies what the machine would not have.

    Like `Receiver`, the loop runs inside one driver's session (`serve`). The thread starts with
    the first source and stops with the last. A thread that stops on its own is an error every
    serving session raises (`ClientStateError`), not a silent stall.
    """

    def __init__(self, config: SubscriberConfig, max_sources: int) -> None:
        self._cfg = config
        self._max_sockets = max_sources * _zmq.SOCKETS_PER_SOURCE + 1024
        self._core: _core.NativeReceiver | None = None
        self._fd = -1
        self._drivers: dict[int, SourceDriver] = {}
        # The drivers' sinks (a client's one fan-out), with how many drivers share each: `hold`
        # asks these whether anybody listens instead of every driver (a deferred quiet probe
        # holds the thread: a pass over 4,096 drivers each time was most of a cold sync's CPU).
        # (Keyed by identity: a sink need not be hashable.)
        self._sinks: dict[int, tuple[EventSink, int]] = {}
        super().__init__()
        self._dead: str | None = None
        # Set while `_drain` feeds drivers: they open their fast paths at its end, not per action.
        self.draining = False
        # The core receiver whose thread this side holds (`hold`), if any.
        self._held: _core.NativeReceiver | None = None
        # The replay requests the thread carries out, and whose they are.
        self._replays: dict[int, SourceDriver] = {}
        # What drains took and the drivers were not fed yet, in order (`_take`, `_feed`).
        self._backlog: deque[Callable[[], None]] = deque()

    @staticmethod
    def eligible(source: EventSource) -> bool:
        """Sources the thread can follow: plaintext tcp:// and ipc:// (its libzmq has no CURVE, and
        inproc:// endpoints live in pyzmq's context)."""
        return source.curve_server_key is None and source.endpoint.startswith(("tcp://", "ipc://"))

    def add(self, driver: SourceDriver) -> int:
        """Subscribe ``driver``'s source on the thread (a new SUB); returns its token (OSError: libzmq refused)."""
        if self._dead is not None:
            raise ClientStateError(f"the native receive thread stopped: {self._dead}")
        core = self._core
        if core is None:
            cfg, lim = self._cfg, self._cfg.limits
            core = _core.NativeReceiver(
                driver._index._core,
                max(1, min(cfg.recv_batch, _VISIT)),
                cfg.wakeup_bytes,
                cfg.quiet_interval,
                cfg.held_bytes,
                self._max_sockets,
                lim.max_events_per_batch,
                lim.max_blocks_per_event,
                lim.max_block_size,
                cfg.receive_nice,
            )
            self._core, self._fd = core, core.fileno()
        src, cfg = driver.source, self._cfg
        token = next(_tokens)
        core.add(
            token,
            driver.key,
            src.endpoint,
            src.topic.encode("utf-8"),
            cfg.sub_rcvhwm(src.hwm),
            cfg.max_message_size,
            *cfg.reconnect_ms(),
            cfg.tcp_keepalive,
        )
        self._drivers[token] = driver
        sink = driver._sink
        self._sinks[id(sink)] = (sink, self._sinks.get(id(sink), (sink, 0))[1] + 1)
        return token

    def remove(self, token: int) -> None:
        """Stop following ``token`` (its sockets close on the thread; its later hand-overs are dropped)."""
        core = self._core
        driver = self._drivers.pop(token, None)
        if driver is None:
            return
        sink, sharing = self._sinks[id(driver._sink)]
        if sharing > 1:
            self._sinks[id(sink)] = (sink, sharing - 1)
        else:
            del self._sinks[id(sink)]
        if core is None:
            return
        core.remove(token)
        if not self._drivers:
            # The client may be leaving: no thread, no sockets while no source runs.
            anyio.notify_closing(self._fd)
            self.release()
            core.close()
            self._core, self._fd = None, -1
            # Its replay requests end with it: their drivers ask again.
            replays, self._replays = self._replays, {}
            for rid, d in replays.items():
                d._native_replay_gone(rid)

    def stop(self, token: int) -> None:
        """Apply nothing more for ``token`` from now on (synchronous: before its worker leaves the index)."""
        if self._core is not None and token in self._drivers:
            self._core.stop(token)

    def open(self, token: int, next_seq: int, consumed: int, keep: bool) -> None:
        """Let the thread apply ``token``'s batches from ``next_seq`` (see `kvroute._core.NativeReceiver.open`).

        ``keep``: each batch applied so comes back with its payload (for a raw tap).
        """
        if self._core is not None and token in self._drivers:
            self._core.open(token, next_seq, consumed, keep)

    def close_fast(self, token: int) -> None:
        """Hand every message of ``token`` over until it is opened again."""
        if self._core is not None and token in self._drivers:
            self._core.close_fast(token)

    def park(self, token: int, parked: bool) -> None:
        """Leave ``token``'s messages unread while ``parked`` (a replay of it is in flight), or read them again."""
        if self._core is not None and token in self._drivers:
            self._core.park(token, parked)

    def replay(
        self,
        driver: SourceDriver,
        from_seq: int,
        terms: tuple[float | None, bool] | None,
        *,
        silent: float,
        deadline: float,
        budget: int,
        max_items: int,
        max_bytes: int,
    ) -> int | None:
        """Have the thread ask ``driver``'s replay endpoint for every batch from ``from_seq``; the request's id.

        The thread opens a DEALER of its own, reads and judges the replies, and ends the request
        at the end marker or a limit (``silent`` s without a decodable reply, ``deadline`` s,
        ``budget`` replies, ``max_items`` batches or ``max_bytes`` bytes). ``terms``: the
        machine's `replay_terms` (None: apply nothing); on them the thread applies a complete,
        clean answer itself, if the SUB handed nothing over since that may change the machine's
        mind (a message, a disconnect: `_native_risky`) and the fast path applied nothing the
        machine had not recorded when it worked out ``terms`` (`_native_fast_seen`). The request
        closes the source's fast path, as `SourceMachine.in_order` does while it runs. Its outcome comes to
        ``driver._native_replay_done`` in hand-over order. None when no thread runs or the driver's
        SUB is not on it (between two sessions): the Python requester asks instead.
        """
        core, token = self._core, driver._native_token
        if core is None or token is None or token not in self._drivers:
            return None
        src, cfg = driver.source, self._cfg
        assert src.replay_endpoint is not None  # the driver asks only for a source with one
        rid = next(_replay_ids)
        anchor, late_ok = terms if terms is not None else (None, False)
        core.replay(
            rid,
            token,
            src.replay_endpoint,
            cfg.sub_rcvhwm(None),
            cfg.max_message_size,
            *cfg.reconnect_ms(),
            cfg.tcp_keepalive,
            from_seq,
            terms is not None,
            anchor,
            late_ok,
            driver._native_risky,
            driver._native_fast_seen,
            silent,
            deadline,
            budget,
            max_items,
            max_bytes,
        )
        self._replays[rid] = driver
        driver._native_opened = None  # the request closed its fast path: `_sync_fast` opens it after
        return rid

    def cancel_replay(self, request_id: int) -> None:
        """End replay ``request_id`` now, applying nothing of it; its outcome is still handed over."""
        if self._core is not None and request_id in self._replays:
            self._core.cancel_replay(request_id)

    def replay_progress(self, request_id: int) -> int:
        """Decodable replies of replay ``request_id`` so far (0 once it ended)."""
        if self._core is not None and request_id in self._replays:
            return self._core.replay_progress(request_id)
        return 0

    def disarm_replay(self, request_id: int) -> None:
        """Apply nothing of replay ``request_id`` from now on (synchronous); its replies are handed over."""
        if self._core is not None and request_id in self._replays:
            self._core.disarm_replay(request_id)

    def hold(self) -> bool:
        """Stop the thread applying until `release`, with every batch it applied recorded by its source's machine.

        For a reader of the index and the positions together (a snapshot, `cursors`): the thread
        is held between two visits (`kvroute._core.NativeReceiver.hold`), then its outbox is
        drained into the drivers, so no batch is in the index ahead of its source's seq.
        Holding a held thread only drains again. True when this call held the thread (its
        caller releases it); False when it was held already, or no thread runs.

        Once somebody listens (`KvEventClient.events` holds every transport when it adds an
        iterator), every open fast path is closed here too: the thread carries out those
        commands before it applies again, so no batch applied after the listener came goes
        without its envelope. A driver learns it otherwise only at its next hand-over.
        """
        core = self._core
        if core is None:
            return False
        newly = self._held is not core
        if newly:
            core.hold()
            self._held = core
        self._drain()
        if not any(sink.active for sink, _ in self._sinks.values()):
            return newly
        for token, d in self._drivers.items():
            opened = d._native_opened
            # Open as the sink now needs it or closed: applying without envelopes while an
            # iterator listens, or without payloads while a raw tap is its only listener, is not.
            if opened is not None and not d._native_fits(opened[2]):
                core.close_fast(token)
                d._native_opened = None
            if d._sink.active:
                # Its replay answer, too, must come as events: the machine takes it reply by reply.
                d._disarm_native_replay()
        return newly

    def release(self) -> None:
        """Let a held thread apply again."""
        held, self._held = self._held, None
        if held is not None:
            held.release()

    async def _loop(self) -> None:
        while True:
            if self._dead is not None:
                raise ClientStateError(f"the native receive thread stopped: {self._dead}")
            if self._core is None:
                return  # every source left (the leader is leaving too)
            try:
                await anyio.wait_readable(self._fd)
            except anyio.ClosedResourceError:
                return
            self._take()
            # A drain of thousands of sources' records (the thread batches them, `NOTE_MAX` in
            # src/recv) is fed a chunk at a time (~0.5 ms of Python each), paced: after each, the
            # event loop leaves the core to the receive side (niced below it) `_PACE` times as
            # long, its other tasks running meanwhile. Fed back to back, a drain's ~16 ms held off
            # the receive thread: apply lag p99 ~25 ms a second against ~10 ms (bench_fleet.py,
            # docs/performance.md "Session 23"). The bookkeeping can wait (it is behind by design);
            # applying cannot.
            backlog = self._backlog
            while backlog:
                t = time.perf_counter()
                backlog.popleft()()
                if backlog:
                    await anyio.sleep(_PACE * (time.perf_counter() - t))

    def _drain(self) -> None:
        """Feed the drivers everything the thread left, now: what an earlier drain still had waiting first."""
        self._take()
        backlog = self._backlog
        while backlog:
            backlog.popleft()()

    def _take(self) -> None:
        """Drain the thread into the backlog: chunks of plain records, the other sources' in slices, the hand-overs."""
        core = self._core
        if core is None:
            return
        plain, applied, handovers, logs, dead = core.drain()
        backlog = self._backlog
        for ints, floats in plain:
            backlog.append(partial(self._feed_plain, ints, floats))
        for at in range(0, len(applied), _SLICE):
            backlog.append(partial(self._feed_many, applied[at : at + _SLICE]))
        if handovers or logs or dead is not None:
            backlog.append(partial(self._feed_handovers, handovers, logs, dead))

    def _feed_plain(self, ints_bytes: bytes, floats_bytes: bytes) -> None:
        """A chunk of sources' plain records (`kvroute._core.NativeReceiver.drain`)."""
        drivers = self._drivers
        ints: list[int] = memoryview(ints_bytes).cast("Q").tolist()
        floats = cast("list[float]", memoryview(floats_bytes).cast("d").tolist())  # (typeshed: list[int])
        p = q = 0
        while p < len(ints):
            token, n, elided, blocks = ints[p : p + 4]
            p += 4
            d = drivers.get(token)
            if d is not None:
                d._native_applied(ints[p : p + n], floats[q : q + n], floats[q + n : q + 2 * n], elided, blocks, None)
            p += n
            q += 2 * n

    def _feed_many(self, applied: list[tuple[Any, ...]]) -> None:
        """Sources' records with events skipped or payloads kept, as tuples."""
        drivers = self._drivers
        for token, seqs, tss, lags, elided, blocks, skipped, payloads in applied:
            d = drivers.get(token)
            if d is not None:
                d._native_applied(seqs, tss, lags, elided, blocks, skipped, payloads)

    def _feed_handovers(self, handovers: list[tuple[Any, ...]], logs: list[str], dead: str | None) -> None:
        """A drain's hand-overs, in order, after its records; then the fast paths they closed, opened again."""
        drivers = self._drivers
        for msg in logs:
            _index_log.warning("%s", msg)
        touched: dict[SourceDriver, None] = {}
        wall = time.time()
        self.draining = True
        try:
            for h in handovers:
                if h[0] == 3:
                    owner = self._replays.pop(h[2], None)
                    if owner is not None:
                        owner._native_replay_done(*h[2:])
                        touched[owner] = None  # unparked, its fast path opened, at the end
                    continue
                d = drivers.get(h[1])
                if d is None or d._recreate:
                    continue  # a removed source's, or a SUB's being recreated (a dead engine's stream)
                d._native_consumed += 1
                kind = h[0]
                if kind != 1 or h[2] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    d._native_risky += 1  # as the thread counts them (`src/recv`, `Source::risky`)
                if kind == 0:
                    d._on_messages([h[2]], wall)
                elif kind == 1:
                    d._on_monitor_event(_zmq.MonitorEvent(h[2], h[3], h[4]))
                else:
                    d._on_quiet()
                touched[d] = None
        finally:
            self.draining = False
        for d in touched:
            d._sync_fast()
        if dead is not None:
            log.error("the native receive thread stopped: %s", dead)
            self._dead = dead
