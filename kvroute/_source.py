"""The per-source recovery state machine: sans-I/O, no sockets, no clock reads.

One `RecoveryMachine` follows one KV-event source (one engine rank). A transport's driver
(`kvroute._transports._base.DriverBase`) feeds it inputs and carries out the actions it returns,
in order; the machine decides everything else. docs/recovery.md's rules 1-9 are the spec; the rule
numbers below refer to them.

Inputs (each returns ``list[Action]``):

- `start()`: cold start (rule 6). With a replay endpoint: replay from seq 0, holding live
  batches meanwhile. Without: the first live seq starts the history (partial if > 0), and the
  source is synced once connected (no history to fetch; an idle engine sends nothing).
- `resume(seq, ts)`: warm start instead of `start()`, when the index already holds the
  worker's state through ``seq`` (restored from a snapshot). Nothing is trusted until the
  first connect's identity check (rule 7) vouches for the engine; see `resume`.
- `on_live(seq, ts, batch)`: one live message; ``batch`` None means the payload failed to
  decode (then ``ts`` is ignored; pass anything).
- `on_replay(items, complete)`: the replies to the request in flight, in arrival order, as
  ``(seq, ts, batch | None)`` without the end marker; ``complete`` says the end marker was
  seen. Call it once per request, when the end marker arrives or the reply timeout fires
  with at least one reply. No reply at all is `on_replay_failed`.
- `on_replay_failed(reason)`: the request timed out with no reply, or its socket failed.
- `on_quiet()`: no live message for the configured quiet interval (rules 7-8; the driver
  owns the interval and bounds concurrent replays across sources, rule 9).
- `on_reconnected()` / `on_disconnected()`: the SUB socket monitor saw a connect /
  disconnect. Report every connect, the first one included: a source is "synced" only
  while its SUB is connected. ``on_reconnected(continued=True)``: the transport's server
  vouches that what follows continues the applied run (a gateway stream resumed with
  ``start_sequence_number``, docs/protocol.md §6), so a source without replay keeps its state.
- `on_resync(seq, ts, batch, partial=...)`: the first chunk of a state snapshot (a gateway
  stream, docs/protocol.md §6): the worker's state is replaced by what the snapshot's chunks,
  ``seq`` and the ones after it, hold; ``partial`` when the snapshot misses older history.
- `on_data_loss(detail)`: the transport reports that batches of this source were lost for
  good (a gateway stream's DATA_LOSS): reset, and follow the source from scratch.

Actions (see each class): `Apply`, `RequestReplay`, `ResetWorker`, `RecreateSubscriber`,
`Emit`; the driver's obligations in carrying them out are docs/recovery.md's "The driver's side".
The machine's replay side (taking an answer, the batches held for one) is its base class,
`kvroute._replay_answers.ReplayAnswers`; its vocabulary (actions, counters, state components and
their transition tables) is `kvroute._recovery`.

Guarantee, for a driver that keeps the obligations: everything `Apply` hands out since the
last `ResetWorker` is a contiguous run of one engine process's batches, in seq order, each
once; so the index never holds a block whose removal the machine skipped. ``partial``
says the run does not reach back to that process's seq 0.
"""

from __future__ import annotations

import functools
import math
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Literal

from ._events import (
    Connected,
    Disconnected,
    Gap,
    Partial,
    ReplayPurpose,
    Reset,
    ResetReason,
    Synced,
)
from ._models import SourceState
from ._recovery import (
    REPLAY_END_SEQ,
    TRANSITIONS,
    Action,
    Apply,
    Emit,
    History,
    Holding,
    Identity,
    Link,
    RecoveryPhase,
    RecoveryStats,
    RecreateSubscriber,
    ReplayRequest,
    Reply,
    RequestReplay,
    ResetWorker,
)
from ._replay_answers import Held, ReplayAnswers
from ._wire import EventBatch

__all__ = [
    "Action",
    "Apply",
    "Emit",
    "History",
    "Holding",
    "Identity",
    "Link",
    "RecoveryMachine",
    "RecoveryPhase",
    "RecreateSubscriber",
    "Reply",
    "ReplayRequest",
    "RequestReplay",
    "ResetWorker",
    "RecoveryStats",
    "SourceMachine",
]


def _empty_ring(cap: int) -> tuple[array[int], array[float]]:
    """A ts ring of ``cap`` empty slots: seqs (REPLAY_END_SEQ: empty) and their ts."""
    return array("Q", [REPLAY_END_SEQ]) * cap, array("d", [0.0]) * cap


def _regrown(ring_seq: array[int], ring_ts: array[float], cap: int) -> tuple[array[int], array[float]]:
    """The ts ring ``ring_seq``/``ring_ts`` at capacity ``cap`` (a multiple of its own): every seq in slot seq % cap.

    Two seqs in different slots mod the old capacity are in different slots mod a multiple of it.
    """
    new_seq, new_ts = _empty_ring(cap)
    for old, ts in zip(ring_seq, ring_ts):
        if old != REPLAY_END_SEQ:
            new_seq[old % cap] = old
            new_ts[old % cap] = ts
    return new_seq, new_ts


@functools.cache
def _run_digits(n: int) -> tuple[int, int]:
    """For `_regrown_run`: n 64-bit digits, as one integer in this machine's byte order, of 1 each and of 0..n-1."""
    return (
        int.from_bytes(array("Q", [1]) * n, sys.byteorder),
        int.from_bytes(array("Q", range(n)), sys.byteorder),
    )


def _regrown_run(
    ring_seq: array[int], ring_ts: array[float], newest: int, cap: int
) -> tuple[array[int], array[float]] | None:
    """`_regrown` of a full ring that holds exactly the seqs ``newest - n + 1 .. newest`` (n its size), with
    slices instead of a loop over its slots; None for any other ring (`_regrown` then).

    In-order batches fill the ring that way, and every source's ring grows at the same seqs: a fleet's 4,096 rings
    grown slot by slot at once held the event loop for ~0.2 s at 256 slots (bench_fleet.py: an apply lag spike
    each time; docs/performance.md "Session 22"), and would for ~0.9 s at 2,048. The check is exact and runs in
    C: the ring, rotated to start at the oldest seq, read as one integer of 64-bit digits, equals
    ``lo * ones + ramp`` (each digit ``lo + j``, below 2^64, so no digit carries into the next) only if every
    slot holds its seq.
    """
    n = len(ring_seq)
    lo = newest - n + 1
    if lo < 0:
        return None
    k = lo % n
    run = ring_seq[k:] + ring_seq[:k]
    ones, ramp = _run_digits(n)
    if int.from_bytes(run, sys.byteorder) != lo * ones + ramp:
        return None
    run_ts = ring_ts[k:] + ring_ts[:k]
    new_seq, new_ts = _empty_ring(cap)
    # The run's seqs take cap's slots from lo % cap on, wrapping at cap (n <= cap / 2: it fits).
    at = lo % cap
    head = min(n, cap - at)
    new_seq[at : at + head] = run[:head]
    new_ts[at : at + head] = run_ts[:head]
    new_seq[: n - head] = run[head:]
    new_ts[: n - head] = run_ts[head:]
    return new_seq, new_ts


def _first_ring_cap(ts_ring: int) -> int:
    """The ts ring's first capacity: ``ts_ring`` halved while it stays even and at least 64 slots."""
    cap = ts_ring
    while cap % 2 == 0 and cap // 2 >= 64:
        cap //= 2
    return cap


class RecoveryMachine(ReplayAnswers):
    """Sequence, gap, restart and replay logic of one source, as a pure state machine (formerly `SourceMachine`).

    ``has_replay``: the source has a replay endpoint. ``ts_ring``: how many applied seqs
    keep their ts, to tell a duplicate from a restart (rule 2); the default 4,096 (up to 64 KB a
    source, grown as seqs are applied from 1 KB: a fleet of idle or freshly synced sources does not
    pay it up front) outlasts a replay's overlap with live traffic (a ROUTER sends at most 1,000
    replies ahead of the reader, docs/protocol.md §4), and an older seq costs one identity check,
    never a wrong answer. ``max_held``: how many batches may wait for a replay; past it the
    newest is dropped (the replay or a later one fetches it again from the engine's buffer),
    or, while the engine's identity is unchecked, the source starts over. The default 100,000
    is the engines' PUB hwm (docs/protocol.md §1): a replay outstanding that long has let the
    publisher drop anyway.
    """

    def __init__(
        self,
        *,
        has_replay: bool,
        ts_ring: int = 4096,
        max_held: int = 100_000,
        max_held_bytes: int | None = None,
        stats: RecoveryStats | None = None,
    ) -> None:
        if ts_ring < 1:
            raise ValueError(f"ts_ring must be >= 1, got {ts_ring}")
        if max_held < 1:
            raise ValueError(f"max_held must be >= 1, got {max_held}")
        self.has_replay = has_replay
        self.ts_ring = ts_ring
        self.max_held = max_held
        #: Like ``max_held``, in the sizes `on_live` is given (None: no byte bound).
        self.max_held_bytes = max_held_bytes
        #: Newest seq accounted for: applied, or skipped as lost. -1 before anything.
        self.last_seq = -1
        # The history before the current run is unknown (`partial`).
        self._partial = False
        #: Called (no argument) whenever whether a router may believe this source's index claims
        #: changes: `state` entering or leaving "synced", or `partial` flipping. `KvEventClient`
        #: keeps its set of unvouched workers with it (`kvroute._models.Vouching`), so a router
        #: reads one set per `select` instead of a status per candidate. None: nobody listens.
        self.on_vouching: Callable[[], None] | None = None
        # (state == "synced", partial) as last reported to ``on_vouching``
        self._vouching = (False, False)
        #: The replay request the driver is carrying out, if any.
        self.replay_in_flight: RequestReplay | None = None
        #: Counted into ``stats`` when given (the driver's per-source counters extend it).
        self.stats = stats if stats is not None else RecoveryStats()
        # The ts ring: it holds what a ring of ``ts_ring`` slots would (slot seq % ts_ring: the
        # newest applied seq of that residue and its ts), in ``_ring_cap`` slots at seq % _ring_cap
        # (REPLAY_END_SEQ: empty). Two flat arrays, 16 bytes a slot, one store each per batch. The
        # capacity starts small and doubles (`_grow`) before a store would drop a seq the full ring
        # keeps: at 4,096 sources the full rings, allocated up front, were 256 MB and ~6 % of a
        # cold sync's CPU.
        self._ring_cap = _first_ring_cap(ts_ring)
        self._ring_seq, self._ring_ts = _empty_ring(self._ring_cap)
        #: Newest seq recorded in the ring (-1: none since the last restart).
        self._newest = -1
        self._held: dict[int, Held] = {}
        # Sizes of the held live batches given one (`on_live`'s ``size``), and their sum.
        self._held_size: dict[int, int] = {}
        self._held_bytes = 0
        # The state (`RecoveryPhase`), one field per component, written only by `_move`.
        # Initial history not known yet: with replay, a cold replay is needed; without, the
        # first live message starts the history (and ``_first_reason`` says why).
        self._history: History = "cold" if has_replay else "first-live"
        self._link: Link = "idle"
        self._identity: Identity = "unknown"
        self._reply: Reply = "none"
        self._holding: Holding = "nothing"
        self._first_reason: ResetReason = "no-replay"
        # ts of the seq an identity check / probe asked from; None for other requests.
        self._anchor_ts: float | None = None
        # Identity checks that got no answer in a row (IDENTITY_ATTEMPTS of them: a restart).
        self._identity_failures = 0

    # --- read-only state ------------------------------------------------------------

    @property
    def phase(self) -> RecoveryPhase:
        """The machine's state, one value per component (`History`, `Link`, `Identity`, `Reply`, `Holding`)."""
        return RecoveryPhase(self._history, self._link, self._identity, self._reply, self._holding)

    def _move(self, component: str, event: str) -> None:
        """Move ``component`` by ``event`` as its transition table says; a pair it does not list is a bug."""
        attr = "_" + component
        before = getattr(self, attr)
        after = TRANSITIONS[component].get((before, event))
        if after is None:
            raise RuntimeError(f"recovery machine: {component} {before!r} has no transition on {event!r}")
        setattr(self, attr, after)

    @property
    def _down(self) -> bool:
        """Live batches are held (or, without replay, dropped) and no replay is asked: not connected, holding."""
        return self._link == "held" or self._link == "down"

    @property
    def state(self) -> SourceState:
        """ "syncing", "synced" or "resyncing", as `kvroute._models.WorkerStatus.state` means them."""
        if self._identity == "asking" or self._link != "up":
            return "syncing"
        if self._history == "cold" or (self._history == "first-live" and self.has_replay):
            return "syncing"
        req = self.replay_in_flight
        if self._held or (req is not None and req.purpose in ("gap", "retry")):
            return "resyncing"
        return "synced"

    @property
    def partial(self) -> bool:
        """The history before the current run is unknown (see `Partial`)."""
        return self._partial

    @partial.setter
    def partial(self, value: bool) -> None:
        # a transport may mark the history partial outside an input (the JetStream relay's word)
        self._partial = value
        self._report(self.state == "synced")

    @property
    def vouching(self) -> tuple[bool, bool]:
        """``(state == "synced", partial)``: what a router's trust in this source's claims rests on."""
        return self.state == "synced", self._partial

    @property
    def replay_abandoned(self) -> bool:
        """The answer to the request in flight will be ignored (a restart or disconnect made it moot).

        The driver may stop waiting for it and call `on_replay_failed` at once; the
        machine asks again, if it still needs to, once that request is settled.
        """
        return self._reply == "moot"

    @property
    def applied(self) -> tuple[int, float] | None:
        """The newest applied seq and its ts, while the index holds this source's run; None otherwise.

        None before anything is applied and after a reset until the next batch is. This is
        the position a snapshot saves (`resume` takes it back): the index's state for the
        worker is exactly the run that ends here.
        """
        if self._holding == "nothing" or self._newest < 0:
            return None
        return self._newest, self._ring_ts[self._newest % self._ring_cap]

    @property
    def probe_due(self) -> bool:
        """A quiet tick now would ask a probe (`on_quiet`): replay endpoint, link up, cold replay done, none in flight.

        The driver reads it before a quiet tick to hold a replay slot for the probe, or to
        defer it while none is free (rule 9).
        """
        return self.has_replay and self.replay_in_flight is None and self._history != "cold" and not self._down

    @property
    def held(self) -> int:
        """How many batches wait for a replay to close a gap."""
        return len(self._held)

    # --- inputs ---------------------------------------------------------------------

    def start(self) -> list[Action]:
        """Begin following the source: the cold start of rule 6 (a no-op when already begun)."""
        if self._link == "idle":
            self._move("link", "start")
        before = self.state
        out: list[Action] = []
        self._advance(out)
        return self._done(before, out)

    def resume(self, seq: int, ts: float) -> list[Action]:
        """Begin following the source from a restored position (warm restart) instead of `start`.

        The index holds the worker's state through ``seq``, the batch applied with ``ts``.
        With a replay endpoint nothing is asked or applied until the SUB first connects (an
        engine that is down cannot vouch for anything; live batches are held meanwhile).
        Then one identity check replays from ``seq`` (rule 7): the same engine keeps the
        state and the replay fills what it published since. A first reply with another ts,
        an empty or twice failed answer (a restarted engine), or one that begins past ``seq``
        (the buffer no longer reaches back to it, so the engine cannot be told from a
        restarted one) is a failed identity check: reset, fresh SUB, cold replay (which
        marks the worker partial when the buffer does not reach seq 0). Without a replay
        endpoint nothing can vouch for the state: the worker is reset at once and the source
        starts as after `start`. Raises ValueError for a seq out of range or a ts that is not
        finite, RuntimeError once the machine has begun.
        """
        if self._link != "idle":
            raise RuntimeError("resume() must come first, instead of start()")
        if not 0 <= seq < REPLAY_END_SEQ or not math.isfinite(ts):
            raise ValueError(f"cannot resume from seq {seq!r} with ts {ts!r}")
        before = self.state
        out: list[Action] = []
        self._move("holding", "apply")  # the restored state
        if not self.has_replay:
            self._move("link", "start")
            self._reset("no-replay", f"restored state through seq {seq} cannot be checked without replay", out)
            return self._done(before, out)
        self._move("link", "resume")  # until the first connect: hold live batches, ask nothing
        self._move("history", "known")
        self.last_seq = seq
        self._record(seq, ts)
        self._move("identity", "ask")
        return self._done(before, out)

    def in_order(self, seq: int) -> bool:
        """Rule 1's condition: a decodable batch with this live seq would just be applied, nothing else.

        The driver's fast path asks this before decoding: when True it may decode and apply
        the payload itself and report it with `on_applied` (an undecodable one still goes to
        `on_live`); when False the batch goes to `on_live`.
        """
        return (
            seq == self.last_seq + 1
            and seq != REPLAY_END_SEQ
            and self.replay_in_flight is None
            and not self._held
            and self._history == "known"
            and self._identity != "asking"
            and self._link != "held"
            and self._link != "down"
        )

    def on_applied(self, seq: int, ts: float) -> None:
        """The driver applied the live batch ``seq`` (``ts`` finite) itself, after `in_order` said so."""
        # Rule 1 as in `on_live` (`_record` inlined, and the holding table's "apply", which leads
        # to "run" from either value, written direct): the ring, the run, the count.
        i = seq % self._ring_cap
        if self._ring_cap != self.ts_ring:
            i = self._ring_slot(seq, i)
        self._ring_seq[i] = seq
        self._ring_ts[i] = ts
        self._newest = self.last_seq = seq
        self._holding = "run"
        self.stats.batches += 1

    def on_applied_many(self, seqs: Sequence[int], tss: Sequence[float]) -> None:
        """`on_applied` of each of ``seqs`` in turn (in order, non-empty), with its ts in ``tss``.

        A receive thread's records of a source come so, several a drain (src/recv, `NOTE_MAX`): one
        call, the ring written in a loop here, not a call a batch.
        """
        cap, ring_seq, ring_ts, ts_ring = self._ring_cap, self._ring_seq, self._ring_ts, self.ts_ring
        newest = self._newest
        for seq, ts in zip(seqs, tss):
            i = seq % cap
            if cap != ts_ring and ring_seq[i] != REPLAY_END_SEQ:
                # A taken slot: `_ring_slot` decides (it may grow the ring, and `_regrown_run` reads the newest seq).
                self._newest = newest
                i = self._ring_slot(seq, i)
                cap, ring_seq, ring_ts = self._ring_cap, self._ring_seq, self._ring_ts
            ring_seq[i] = seq
            ring_ts[i] = ts
            newest = seq
        self._newest = self.last_seq = newest
        self._holding = "run"
        self.stats.batches += len(seqs)

    def on_live(self, seq: int, ts: float, batch: EventBatch | None, size: int = 0) -> list[Action]:
        """One live message; ``batch`` None = its payload failed to decode; ``size``: its bytes (``max_held_bytes``)."""
        if batch is not None and self.in_order(seq):
            # Rule 1, the hot path: in order, nothing pending.
            self.on_applied(seq, ts)
            return [Apply([(seq, ts, batch)])]
        before = self.state
        out: list[Action] = []
        self._live(seq, ts, batch, out, size)
        return self._done(before, out)

    def on_quiet(self) -> list[Action]:
        """The source was quiet for the quiet interval: probe for a lost tail (rules 7-8), if `probe_due`."""
        if not self.probe_due:
            return []
        before = self.state
        out: list[Action] = []
        self._request_probe("probe", out)
        return self._done(before, out)

    def on_reconnected(self, *, continued: bool = False) -> list[Action]:
        """The SUB socket (re)connected: check the engine is the one whose state is held (rule 7).

        ``continued``: the server vouches that the stream continues the applied run (a resumed
        gateway stream); nothing is reset, and a seq that does not follow is a gap or a
        restart as on any live stream.
        """
        before = self.state
        out: list[Action] = [Emit(Connected())]
        first = self._link != "up" and self._link != "down"
        self._move("link", "connect")
        self._move("identity", "doubt")
        if first or continued:
            # What the SUB missed before it joined (slow joiner) shows as a gap at the next
            # live seq, or to the quiet probe (rules 3 and 8). A resumed source asks its
            # identity question now that the engine is there to answer it.
            self._advance(out)
            return self._done(before, out)
        if self.has_replay and self._newest >= 0 and self._history != "cold":
            self._ask_identity(out)
        else:
            # Nothing an identity check could vouch for (no replay endpoint, or nothing
            # applied yet). Messages the old connection queued may be a dead process's and
            # look just like the new one's, so start over on a fresh SUB (rule 7: a silent
            # restart must not leave the old blocks claimed).
            self._reset("reconnect", "reconnected with no applied seq a replay can vouch for", out)
            self._fresh_start("reconnect", out)
        return self._done(before, out)

    def on_resync(self, seq: int, ts: float, batch: EventBatch, *, partial: bool) -> list[Action]:
        """The first chunk (seq ``seq``) of a state snapshot: it and the chunks after it are the state.

        The worker is reset, sequence state is forgotten (the snapshot's seqs continue into
        the live stream), and the chunk is applied; the following chunks arrive as live
        batches. ``partial``: the snapshot does not cover the engine's whole history.
        """
        if not 0 <= seq < REPLAY_END_SEQ or not math.isfinite(ts):
            self.stats.invalid += 1
            return []
        before = self.state
        out: list[Action] = []
        self._reset("snapshot", f"state snapshot from seq {seq}", out)
        self._forget()
        # The snapshot is the history from here: the next live batch continues it (an
        # exact worker unless ``partial``), it does not start one of unknown past.
        self._move("history", "known")
        self.last_seq = seq - 1
        if partial:
            self._mark_partial("snapshot", seq, out)
        self._hold(seq, ts, batch, False, out)
        self._drain(out)
        return self._done(before, out)

    def on_data_loss(self, detail: str) -> list[Action]:
        """Batches of this source were lost beyond recovery: reset and start over (like a restart)."""
        before = self.state
        out: list[Action] = []
        self.stats.uncovered += 1
        self._reset("data-loss", detail, out)
        self._fresh_start("data-loss", out)
        return self._done(before, out)

    def on_disconnected(self) -> list[Action]:
        """The SUB socket lost its connection; the source is "syncing" until it is back."""
        before = self.state
        self._move("link", "disconnect")
        self._move("identity", "doubt")
        if self.has_replay:
            # The engine may be gone, and whatever comes next (live or replayed) may be its
            # successor's: hold everything and ask nothing until the reconnect's identity
            # check vouches for the newest batch applied, which is then still the one
            # applied before the disconnect (rule 7).
            if self._newest >= 0:
                self._move("identity", "ask")
            if self._anchor_ts is None:
                self._abandon()
        return self._done(before, [Emit(Disconnected())])

    # --- internals ------------------------------------------------------------------

    def _done(self, before: SourceState, out: list[Action]) -> list[Action]:
        synced = self.state == "synced"
        if before != "synced" and synced:
            out.append(Emit(Synced()))
        self._report(synced)
        return out

    def _report(self, synced: bool) -> None:
        """Call ``on_vouching`` when ``(synced, partial)`` differs from what it last heard."""
        now = (synced, self._partial)
        if now != self._vouching:
            self._vouching = now
            if self.on_vouching is not None:
                self.on_vouching()

    def _record(self, seq: int, ts: float) -> None:
        i = seq % self._ring_cap
        if self._ring_cap != self.ts_ring:
            i = self._ring_slot(seq, i)
        self._ring_seq[i] = seq
        self._ring_ts[i] = ts
        self._newest = seq

    def _ring_slot(self, seq: int, i: int) -> int:
        """Slot ``i`` (seq % _ring_cap) for storing ``seq``, after growing the ring while that store
        would drop a seq a ring of ``ts_ring`` slots keeps (one of another residue mod ts_ring)."""
        while True:
            old = self._ring_seq[i]
            if old == REPLAY_END_SEQ or (old - seq) % self.ts_ring == 0 or self._ring_cap == self.ts_ring:
                return i
            self._grow()
            i = seq % self._ring_cap

    def _grow(self) -> None:
        """Double the ring's capacity (it divides ``ts_ring``, so it reaches it): every seq keeps its ts."""
        cap = self._ring_cap * 2
        grown = _regrown_run(self._ring_seq, self._ring_ts, self._newest, cap)
        if grown is None:
            grown = _regrown(self._ring_seq, self._ring_ts, cap)
        self._ring_cap = cap
        self._ring_seq, self._ring_ts = grown

    def _recorded(self, seq: int) -> float | None:
        """The ts ``seq`` was applied with, if the ring still holds it."""
        i = seq % self._ring_cap
        return self._ring_ts[i] if self._ring_seq[i] == seq else None

    def _forget(self) -> None:
        """Drop all sequence state, as for a new engine process."""
        self.last_seq = -1
        self._partial = False
        self._ring_cap = _first_ring_cap(self.ts_ring)
        self._ring_seq, self._ring_ts = _empty_ring(self._ring_cap)
        self._newest = -1
        self._held.clear()
        self._held_size.clear()
        self._held_bytes = 0
        self._move("identity", "forget")
        self._identity_failures = 0

    def _live(self, seq: int, ts: float, batch: EventBatch | None, out: list[Action], size: int = 0) -> None:
        if not 0 <= seq < REPLAY_END_SEQ:
            self.stats.invalid += 1
            return
        if self._down and not self.has_replay:
            # Whatever arrives now is dropped with the rest at the reconnect's fresh start.
            self.stats.stale += 1
            return
        if batch is None:
            self.stats.undecodable += 1
        if self._history == "first-live":
            self._move("history", "known")
            if seq > 0:
                self.last_seq = seq - 1
                self._mark_partial(self._first_reason, seq, out)
        last = self.last_seq
        if seq <= last:
            self._old_live(seq, ts, batch, out)
            return
        if not self._held and self.replay_in_flight is None and self._history != "cold":
            if seq > last + 1:
                self.stats.gaps += 1
                out.append(Emit(Gap(last + 1, seq)))
            elif batch is None:
                self.stats.gaps += 1
                out.append(Emit(Gap(seq, seq, "undecodable")))
        if not self._hold(seq, ts, batch, False, out):
            return
        if size and seq in self._held and seq not in self._held_size:
            self._held_size[seq] = size
            self._held_bytes += size
        if len(self._held) > self.max_held or (
            self.max_held_bytes is not None and self._held_bytes > self.max_held_bytes
        ):
            self.stats.overflows += 1
            what = (
                f"more than {self.max_held} batches"
                if len(self._held) > self.max_held
                else f"more than {self.max_held_bytes} bytes of batches"
            )
            if self._identity == "asking" or self._down:
                # Applying them would trust an engine that has not been checked: start over.
                self._restart(f"{what} held while the engine's identity is unchecked", out, reason="overflow")
                return
            # Batches are held only while a replay is in flight, and it (or its retry, or the
            # next gap or quiet probe) brings the newest one back from the engine's buffer:
            # drop that one rather than give up the older gap, which the replay may still fill.
            newest = max(self._held)
            del self._held[newest]
            self._held_bytes -= self._held_size.pop(newest, 0)
        self._advance(out)

    def _old_live(self, seq: int, ts: float, batch: EventBatch | None, out: list[Action]) -> None:
        """Rule 2: a live seq <= last is a duplicate, a stale message, or a restarted engine."""
        recorded = self._recorded(seq)
        if batch is None:
            # Its ts is unknown, so it proves nothing; the next decodable one will.
            self.stats.stale += 1
            return
        if recorded is not None:
            if recorded == ts:
                self.stats.duplicates += 1
                return
            self._restart(f"seq {seq} arrived again with ts {ts!r}, applied with ts {recorded!r}", out)
            return
        self.stats.stale += 1
        if not self.has_replay:
            # Without replay nothing but a restart moves the stream behind `last`.
            self._restart(f"seq {seq} arrived after seq {self.last_seq}, and no replay endpoint can check", out)
            return
        if self._identity != "unknown" or self._newest < 0:
            # One identity check answers for every such message (rule 2); with nothing
            # recorded since the last restart, the index holds nothing to protect.
            return
        self._ask_identity(out)

    def _ask_identity(self, out: list[Action]) -> None:
        """Rule 2/7: check once that the engine is the one whose state is held.

        A replay in flight that does not vouch for the engine is dropped: its answer may
        come from a successor and would extend the old run with the new engine's batches.
        """
        self._move("identity", "ask")
        self._identity_failures = 0
        if self._anchor_ts is None:
            self._abandon()
        self._advance(out)

    def _abandon(self) -> None:
        if self.replay_in_flight is not None:
            self._move("reply", "abandon")

    def _advance(self, out: list[Action]) -> None:
        """With no request in flight: apply what is ready, or ask for what is missing."""
        if self.replay_in_flight is not None:
            return
        if self._down:
            return
        if not self.has_replay:
            self._drain(out)
            if self._held:
                nxt = self._held.get(self.last_seq + 1)
                reason: ResetReason = "undecodable" if nxt is not None else "no-replay"
                self._uncover(None, reason, "no replay endpoint to recover lost batches from", out)
                self._drain(out)
            return
        if self._history == "cold":
            self._request(0, "cold", None, out)
            return
        if self._identity == "asking":
            if self._newest >= 0:
                self._request_probe("identity", out)
                return
            # Nothing applied since the last restart: the index holds nothing to vouch for.
            self._move("identity", "forget")
        self._drain(out)
        if self._held:
            self._request(self.last_seq + 1, "gap", None, out)

    def _request(self, from_seq: int, purpose: ReplayPurpose, anchor_ts: float | None, out: list[Action]) -> None:
        req = RequestReplay(from_seq, purpose)
        self.replay_in_flight = req
        self._move("reply", "request")
        self._anchor_ts = anchor_ts
        stats = self.stats
        stats.replays += 1
        if purpose == "identity":
            stats.identity_checks += 1
        elif purpose == "probe":
            stats.probes += 1
        out.append(req)

    def _request_probe(self, purpose: Literal["probe", "identity"], out: list[Action]) -> None:
        """Replay from the newest applied seq, so the first reply vouches for the engine (rule 7)."""
        if self._newest >= 0:
            self._request(self._newest, purpose, self._recorded(self._newest), out)
        else:
            self._request(self.last_seq + 1, purpose, None, out)

    def _restart(self, detail: str, out: list[Action], reason: ResetReason = "restart") -> None:
        """Rule 2's restart: reset, fresh SUB, follow the new process from its seq 0."""
        if reason == "restart":
            self.stats.restarts += 1
        self.stats.resets += 1
        out.append(ResetWorker(reason))
        out.append(Emit(Reset(reason, detail)))
        self._move("holding", "reset")
        self._fresh_start("no-replay", out)

    def _fresh_start(self, first_reason: ResetReason, out: list[Action]) -> None:
        """Follow the source from scratch on a new SUB, as after `start()`."""
        out.append(RecreateSubscriber())
        self._forget()
        self._move("link", "fresh-start")
        self._anchor_ts = None
        self._abandon()
        self._move("history", "fresh-start-with-replay" if self.has_replay else "fresh-start-without-replay")
        self._first_reason = first_reason
        self._advance(out)

    def _reset(self, reason: ResetReason, detail: str, out: list[Action]) -> None:
        if self._holding == "run":
            self.stats.resets += 1
            out.append(ResetWorker(reason))
            out.append(Emit(Reset(reason, detail)))
            self._move("holding", "reset")

    def _mark_partial(self, reason: ResetReason, first_seq: int, out: list[Action]) -> None:
        self._partial = True
        out.append(Emit(Partial(reason, first_seq)))



#: The machine's name before it was named for what it does; kept for code written against it.
SourceMachine = RecoveryMachine
