"""The recovery machine's replay side: taking a replay's answer, and the batches held until one comes.

`kvroute._source.RecoveryMachine` follows one source; this base class is the half of it that a
replay's answer drives (docs/recovery.md rules 3-7): the answer is merged with the live batches held
meanwhile and the contiguous run applied (rules 3, 4), a start older than the buffer or a copy that
will not decode is a loss skipped for good (rules 5, 6), the first reply of an anchored request
vouches for the engine or proves a restart (rule 7), and a request that got no answer means what its
purpose says. The machine's inputs, its state and the live path are in `kvroute._source`; the two
share the fields declared below, and the methods each calls of the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._events import Replayed, ReplayPurpose, ResetReason
from ._models import SourceState
from ._recovery import (
    REPLAY_END_SEQ,
    Action,
    Apply,
    Emit,
    Holding,
    Identity,
    Payload,
    RecoveryStats,
    Reply,
    RequestReplay,
)

__all__ = ["IDENTITY_ATTEMPTS", "Held", "ReplayAnswers"]

#: An identity check that fails this many times in a row (no answer) is taken as a restart:
#: one failure may be a dropped reply under load (docs/protocol.md §4), a second means the
#: old state cannot be vouched for (rule 2: "a failed identity check means the engine restarted").
IDENTITY_ATTEMPTS = 2

#: A batch waiting to be applied: (ts, batch or payload, None when undecodable; came from a replay).
Held = tuple[float, Payload | None, bool]


class ReplayAnswers:
    """The replay side of `kvroute._source.RecoveryMachine` (module docstring); not used alone."""

    # The machine's fields this half reads and writes (set in RecoveryMachine.__init__).
    last_seq: int
    max_held: int
    replay_in_flight: RequestReplay | None
    stats: RecoveryStats
    _held: dict[int, Held]
    _held_size: dict[int, int]
    _held_bytes: int
    _anchor_ts: float | None
    _identity_failures: int
    _first_reason: ResetReason
    _identity: Identity
    _reply: Reply
    _holding: Holding

    if TYPE_CHECKING:
        # The machine's methods this half calls (defined in kvroute._source.RecoveryMachine).
        @property
        def state(self) -> SourceState: ...
        def _move(self, component: str, event: str) -> None: ...
        def _done(self, before: SourceState, out: list[Action]) -> list[Action]: ...
        def _advance(self, out: list[Action]) -> None: ...
        def _record(self, seq: int, ts: float) -> None: ...
        def _recorded(self, seq: int) -> float | None: ...
        def _request(
            self, from_seq: int, purpose: ReplayPurpose, anchor_ts: float | None, out: list[Action]
        ) -> None: ...
        def _restart(self, detail: str, out: list[Action], reason: ResetReason = "restart") -> None: ...
        def _reset(self, reason: ResetReason, detail: str, out: list[Action]) -> None: ...
        def _mark_partial(self, reason: ResetReason, first_seq: int, out: list[Action]) -> None: ...

    def on_replay(self, items: Sequence[tuple[int, float, Payload | None]], *, complete: bool) -> list[Action]:
        """The replies to the request in flight, in arrival order; ``complete``: end marker seen.

        Each item's batch is decoded or its judged payload (`kvroute._recovery.Payload`), None
        when it did not decode or was untrusted (then ``ts`` is ignored).
        """
        req = self.replay_in_flight
        if req is None:
            self.stats.invalid += 1
            return []
        if not items and not complete:
            return self.on_replay_failed("no reply")
        before = self.state
        out: list[Action] = []
        self.replay_in_flight = None
        anchor_ts, self._anchor_ts = self._anchor_ts, None
        moot = self._reply == "moot"
        self._move("reply", "settle")
        if moot:
            pass  # asked before a restart or an outage: nothing it says applies now
        elif anchor_ts is not None:
            self._answer_anchored(req, anchor_ts, items, complete, out)
        else:
            self._answer(req, req.from_seq, items, complete, True, out)
        self._advance(out)
        return self._done(before, out)

    def replay_terms(self) -> tuple[float | None, bool] | None:
        """Whether a complete, clean answer to the request in flight would be taken whole, and on what terms.

        ``(anchor_ts, late_ok)`` when nothing is held and the answer will not be moot: every reply
        decodable and trusted, seqs without a hole from the request's start (after its anchor, the
        first reply, whose ts must be ``anchor_ts``, for an identity check or probe: rule 7), or
        from a later first seq when ``late_ok`` (rules 5-6: a loss that resets nothing, as nothing
        was applied yet). Such an answer is applied in full and nothing else happens but what
        `on_replay_applied` does; the native receive thread applies it itself on these terms
        (`kvroute._transports.zmq.native`). None: the answer must come through `on_replay`.
        """
        req = self.replay_in_flight
        if req is None or self._reply != "awaited" or self._held:
            return None
        if self._anchor_ts is not None:
            return (self._anchor_ts, False) if self.last_seq == req.from_seq else None
        if self.last_seq + 1 != req.from_seq:
            return None
        return None, self._holding == "nothing"

    def on_replay_applied(
        self, first: int, last: int, records: Sequence[tuple[int, float]], count: int
    ) -> list[Action]:
        """The driver applied the whole answer to the request in flight itself, on `replay_terms`.

        ``first``..``last``: the ``count`` seqs applied (none: the anchor alone answered);
        ``records``: the newest of them with their ts (the ts ring's worth). The same transitions
        as `on_replay` with that answer, less the `Apply`. An answer applied off those terms (a
        driver bug: the index now holds what the machine did not take) starts the source over.
        """
        req = self.replay_in_flight
        terms = self.replay_terms()
        before = self.state
        out: list[Action] = []
        if req is not None:
            self.replay_in_flight = None
            self._anchor_ts = None
            self._move("reply", "settle")
        anchor_ts, late_ok = terms if terms is not None else (None, False)
        start = -1 if req is None else req.from_seq + (anchor_ts is not None)
        if req is None or terms is None or (
            count and (first < start or (first > start and not late_ok) or last != first + count - 1)
        ):
            self._restart(f"replay seqs {first}..{last} were applied off the machine's terms", out)
        else:
            if anchor_ts is not None:
                self._move("identity", "vouch")
                self._identity_failures = 0
            self._move("history", "known")
            if count:
                record = self._record
                for seq, ts in records:
                    record(seq, ts)
                self.last_seq = last
                self._move("holding", "apply")
                self.stats.batches += count
            if count or req.purpose in ("cold", "gap", "retry"):
                out.append(Emit(Replayed(req.from_seq, count, req.purpose)))
            if count and first > start:
                # A start older than the buffer (docs/protocol.md §4) with nothing applied before:
                # `_uncover`'s loss, whose reset has nothing to drop.
                self.stats.uncovered += 1
                self._mark_partial("not-in-buffer", first, out)
        self._advance(out)
        return self._done(before, out)

    def on_replay_failed(self, reason: str) -> list[Action]:
        """The request in flight got no reply (timeout) or its socket failed."""
        req = self.replay_in_flight
        if req is None:
            self.stats.invalid += 1
            return []
        before = self.state
        out: list[Action] = []
        self.replay_in_flight = None
        anchored = self._anchor_ts is not None
        self._anchor_ts = None
        moot = self._reply == "moot"
        self._move("reply", "settle")
        if not moot:
            self.stats.replay_failures += 1
            self._failed(req, anchored, reason, out)
        self._advance(out)
        return self._done(before, out)


    def _hold(self, seq: int, ts: float, batch: Payload | None, replayed: bool, out: list[Action]) -> bool:
        """Keep a batch until it can be applied; False when it proved a restart (already handled)."""
        held = self._held
        cur = held.get(seq)
        if cur is not None:
            cur_ts, cur_batch, cur_replayed = cur
            if cur_batch is not None:
                if batch is not None and cur_ts != ts:
                    self._restart(f"seq {seq} came with ts {ts!r} and {cur_ts!r}", out)
                    return False
                self.stats.duplicates += 1
                return True
            if batch is None:
                held[seq] = (cur_ts, None, cur_replayed or replayed)
                return True
        held[seq] = (ts, batch, replayed)
        return True


    def _answer_anchored(
        self,
        req: RequestReplay,
        anchor_ts: float,
        items: Sequence[tuple[int, float, Payload | None]],
        complete: bool,
        out: list[Action],
    ) -> None:
        """Rule 7: the first reply must be the anchor seq with the ts it was applied with."""
        if not items:
            self._restart(f"replay from seq {req.from_seq} came back empty: the engine never got that far", out)
            return
        seq, ts, batch = items[0]
        if seq != req.from_seq or batch is None or ts != anchor_ts:
            got = "undecodable" if batch is None else f"ts {ts!r}"
            self._restart(
                f"replay from seq {req.from_seq} (applied with ts {anchor_ts!r}) began with seq {seq}, {got}", out
            )
            return
        self._move("identity", "vouch")
        self._identity_failures = 0
        self._answer(req, req.from_seq + 1, items[1:], complete, False, out)

    def _answer(
        self,
        req: RequestReplay,
        from_seq: int,
        items: Sequence[tuple[int, float, Payload | None]],
        complete: bool,
        floor_means_lost: bool,
        out: list[Action],
    ) -> None:
        """Rules 3-6: merge replayed batches with the held ones and apply the contiguous run."""
        # An answer establishes where the history starts (from_seq, or the floor below).
        self._move("history", "known")
        last_before = self.last_seq
        taken = 0
        first: int | None = None
        stats = self.stats
        for seq, ts, batch in items:
            if not from_seq <= seq < REPLAY_END_SEQ:
                stats.invalid += 1
                continue
            if first is None:
                first = seq
            if seq <= self.last_seq:
                recorded = self._recorded(seq)
                if batch is not None and recorded is not None and recorded != ts:
                    self._restart(f"replayed seq {seq} has ts {ts!r}, applied with ts {recorded!r}", out)
                    return
                stats.duplicates += 1
                continue
            full = len(self._held) >= self.max_held and seq not in self._held
            if full:
                self._drain(out)
                full = len(self._held) >= self.max_held
            if full and (seq != self.last_seq + 1 or batch is None):
                # The rest is asked again once the held ones are applied (rule 4).
                stats.overflows += 1
                continue
            if batch is None:
                stats.undecodable += 1
            if not self._hold(seq, ts, batch, True, out):
                return
            taken += 1
            if full:
                # The batch that continues the run is always taken: applying it makes room.
                self._drain(out)
        if taken or req.purpose in ("cold", "gap", "retry"):
            out.append(Emit(Replayed(req.from_seq, taken, req.purpose)))
        if floor_means_lost and first is not None and first > from_seq:
            # A start older than the buffer silently starts at its oldest batch (docs/protocol.md §4).
            self._uncover(first, "not-in-buffer", f"replay from seq {from_seq} began at seq {first}", out)
        self._uncover_undecodable(out)
        self._drain(out)
        progressed = self.last_seq > last_before
        if self._held:
            if progressed or req.purpose != "retry":
                self._request(self.last_seq + 1, "retry", None, out)
                return
            self._uncover(None, "no-progress", f"retry from seq {req.from_seq} brought nothing new", out)
            self._drain(out)
        elif not complete and progressed:
            # The end marker was lost, so replies before it may have been dropped too (docs/protocol.md §4).
            self._request(self.last_seq + 1, "retry", None, out)

    def _failed(self, req: RequestReplay, anchored: bool, reason: str, out: list[Action]) -> None:
        if anchored:
            if self._identity == "asking":
                self._identity_failures += 1
                if self._identity_failures >= IDENTITY_ATTEMPTS:
                    self._restart(f"identity check failed {self._identity_failures} times: {reason}", out)
            return
        if req.purpose == "cold":
            if not self._held and self.last_seq < 0:
                # Nothing known at all: like a source without replay, the next live seq starts it.
                self._move("history", "cold-replay-failed")
                self._first_reason = "replay-failed"
                return
            self._move("history", "known")
        if self._held:
            self._uncover(None, "replay-failed", f"replay from seq {req.from_seq} failed: {reason}", out)
            self._drain(out)


    def _uncover(self, limit: int | None, reason: ResetReason, detail: str, out: list[Action]) -> None:
        """Rule 5: seqs missing below ``limit`` (None: anywhere) are lost; skip past the highest."""
        held = self._held
        last = self.last_seq
        if limit is None:
            if not held:
                return
            h = max(held)
        else:
            h = limit - 1
        # Walk down over the held, decodable run that ends at h: the hole is just below it.
        while h > last:
            entry = held.get(h)
            if entry is None or entry[1] is None:
                break
            h -= 1
        if h > last:
            self._skip_to(h, reason, detail, out)

    def _uncover_undecodable(self, out: list[Action]) -> None:
        """A replayed copy that fails to decode cannot be fixed by asking again: that seq is lost."""
        bad = [seq for seq, (_, batch, replayed) in self._held.items() if batch is None and replayed]
        if bad:
            h = max(bad)
            self._skip_to(h, "undecodable", f"seq {h} failed to decode, and so did its replayed copy", out)

    def _skip_to(self, h: int, reason: ResetReason, detail: str, out: list[Action]) -> None:
        for seq in [s for s in self._held if s <= h]:
            del self._held[seq]
            self._held_bytes -= self._held_size.pop(seq, 0)
        self.last_seq = h
        self.stats.uncovered += 1
        self._reset(reason, detail, out)
        self._mark_partial(reason, h + 1, out)


    def _drain(self, out: list[Action]) -> None:
        """Apply the held batches that continue the applied run."""
        held = self._held
        if not held:
            return
        items: list[tuple[int, float, Payload]] = []
        nxt = self.last_seq + 1
        while True:
            entry = held.get(nxt)
            if entry is None or entry[1] is None:
                break
            del held[nxt]
            if self._held_size:
                self._held_bytes -= self._held_size.pop(nxt, 0)
            items.append((nxt, entry[0], entry[1]))
            self._record(nxt, entry[0])
            nxt += 1
        if items:
            self.last_seq = nxt - 1
            self._move("holding", "apply")
            self.stats.batches += len(items)
            out.append(Apply(items))
