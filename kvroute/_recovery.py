"""The recovery machine's vocabulary: the actions it returns, its counters, and its state.

`kvroute._source.RecoveryMachine` (docs/recovery.md) takes inputs and returns `Action`s; the
drivers carry them out. Its state is five named components, each with a transition table, the
way h11's ``_state.py`` keeps a connection's; the end marker of a replay (docs/protocol.md §4)
is defined here, once, for every module that reads or writes it.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, NamedTuple

import msgspec
from msgspec import Meta

from ._events import LifecycleEvent, ReplayPurpose, ResetReason
from ._wire import EventBatch

__all__ = [
    "REPLAY_END_MARKER",
    "REPLAY_END_SEQ",
    "TRANSITIONS",
    "Action",
    "Apply",
    "Emit",
    "History",
    "Holding",
    "Identity",
    "Link",
    "Payload",
    "RecoveryPhase",
    "RecoveryStats",
    "RecreateSubscriber",
    "Reply",
    "ReplayRequest",
    "RequestReplay",
    "ResetWorker",
]

#: The replay end marker's seq (0xFF x 8, docs/protocol.md §4); real seqs are below it.
REPLAY_END_SEQ: Final = (1 << 64) - 1
#: The same as the 8 bytes of a reply's seq frame.
REPLAY_END_MARKER: Final = REPLAY_END_SEQ.to_bytes(8, "big")


#: A batch the machine may apply: decoded, or its engine payload as received, already judged
#: applicable by the core's verdict (`kvroute._core.judge`, the rule `PrefixIndex.apply_payload`
#: applies) and applied by the driver through the raw-bytes ingest (`PrefixIndex.apply_payloads`).
#: The machine reads neither: it holds and orders them by seq and ts, which come with them.
Payload = EventBatch | bytes


class Apply(msgspec.Struct, frozen=True):
    """Apply these ``(seq, ts, batch)`` items to the index, in this order."""

    items: list[tuple[int, float, Payload]]


class RequestReplay(msgspec.Struct, frozen=True):
    """Ask the source's replay endpoint for every buffered batch from ``from_seq`` on.

    ``purpose``: "cold" (start, rule 6), "gap" (rule 3), "retry" (the previous answer left
    seqs missing or lost its end marker, rule 4), "probe" (quiet tick or first connect:
    lost tail, rule 8) or "identity" (reconnect, or old seqs no longer in the ts ring:
    rules 2 and 7). Probes and identity checks ask from the newest applied seq, so the
    first reply can be compared with what was applied.
    """

    from_seq: int
    purpose: ReplayPurpose


#: The request `SourceMachine.replay_in_flight` holds: the same struct the action carries.
ReplayRequest = RequestReplay


class ResetWorker(msgspec.Struct, frozen=True):
    """Drop every block of this worker from the index (``PrefixIndex.remove_worker``).

    ``reason`` is one of the reason tokens of `kvroute._events`.
    """

    reason: ResetReason


class RecreateSubscriber(msgspec.Struct, frozen=True):
    """Close the SUB socket and open a new one, discarding every message read from the old one."""


class Emit(msgspec.Struct, frozen=True):
    """Deliver this lifecycle event to the source's listeners."""

    event: LifecycleEvent


Action = Apply | RequestReplay | ResetWorker | RecreateSubscriber | Emit


class RecoveryStats(msgspec.Struct, kw_only=True):
    """Counters of one source's machine, monotonic over its lifetime.

    The one definition of the recovery counters: `kvroute.SourceStats`, `kvroute.TotalStats`
    and the Prometheus per-source families are derived from these fields (each field's
    description is its metric's help text), so adding a counter here is the whole change.
    """

    batches: Annotated[int, Meta(description="Batches applied to the index, live or replayed.")] = 0
    duplicates: Annotated[int, Meta(description="Copies of a batch already applied or held, dropped.")] = 0
    stale: Annotated[
        int, Meta(description="Old seqs no longer in the ts ring, unreadable, or sent while down, dropped.")
    ] = 0
    undecodable: Annotated[int, Meta(description="Undecodable batches that fell in the sequence (holes).")] = 0
    invalid: Annotated[int, Meta(description="Seqs out of range and replies with no request, dropped.")] = 0
    gaps: Annotated[int, Meta(description="Live seq gaps seen (an undecodable in-order batch is one too).")] = 0
    replays: Annotated[int, Meta(description="Replay requests issued.")] = 0
    replay_failures: Annotated[int, Meta(description="Replay requests that got no usable answer.")] = 0
    identity_checks: Annotated[int, Meta(description="Replay requests that checked the engine's identity.")] = 0
    probes: Annotated[int, Meta(description="Replay probes for a lost tail (quiet source, first connect).")] = 0
    restarts: Annotated[int, Meta(description="Engine restarts seen.")] = 0
    resets: Annotated[int, Meta(description="Times the worker's index state was dropped.")] = 0
    uncovered: Annotated[int, Meta(description="Losses no replay could fill (gaps skipped for good).")] = 0
    overflows: Annotated[int, Meta(description="Batches that found the hold (waiting for a replay) full.")] = 0


# --- the machine's state: five components, each moved only by the events its table names -------------
#
# As h11's _state.py: a component has named values and a transition table, (value, event) -> value;
# `RecoveryMachine._move` is the only writer and refuses a pair the table does not list (a bug, not
# bad input). `RecoveryMachine.state` (what the router reads) is derived from them.

#: Where the source's history starts: "cold" (a cold replay from seq 0 will say), "first-live"
#: (no replay, or the cold one failed: the first live seq starts it) or "known".
History = Literal["cold", "first-live", "known"]
#: The publisher connection: "idle" (not begun), "unconnected" (begun, not connected yet: live
#: batches are taken), "held" (not connected yet, live batches held: resumed, or a disconnect came
#: before `start`), "up", "down" (was up: hold everything, ask nothing, until the reconnect). A
#: disconnect after `start` or `resume` whose connect has not been reported yet (the report may
#: lag) leads to "down" too: a connection existed, and what it delivered may be a dead engine's.
Link = Literal["idle", "unconnected", "held", "up", "down"]
#: Whether the engine is the one whose state the index holds: "unknown" (nothing asked), "asking"
#: (an identity check is due or in flight: nothing is trusted), "vouched" (an anchored replay
#: answered since the last (re)connect).
Identity = Literal["unknown", "asking", "vouched"]
#: The reply to the replay request in flight: "none" (no request), "awaited", or "moot" (a restart
#: or outage made it meaningless: it is dropped when it comes, `replay_abandoned`).
Reply = Literal["none", "awaited", "moot"]
#: What the index may hold of this worker: "nothing" (reset, or never applied) or "run" (applied
#: or restored batches since the last reset).
Holding = Literal["nothing", "run"]

_LINKS: Final[tuple[Link, ...]] = ("idle", "unconnected", "held", "up", "down")
_IDENTITIES: Final[tuple[Identity, ...]] = ("unknown", "asking", "vouched")

TRANSITIONS: Final[dict[str, dict[tuple[str, str], str]]] = {
    "history": {
        **{(h, "fresh-start-with-replay"): "cold" for h in ("cold", "first-live", "known")},
        **{(h, "fresh-start-without-replay"): "first-live" for h in ("cold", "first-live", "known")},
        **{(h, "known"): "known" for h in ("cold", "first-live", "known")},  # an answer, a first seq, a snapshot
        ("cold", "cold-replay-failed"): "first-live",
        ("known", "cold-replay-failed"): "first-live",
    },
    "link": {
        ("idle", "start"): "unconnected",
        ("idle", "resume"): "held",
        **{(link, "connect"): "up" for link in _LINKS},
        ("idle", "disconnect"): "held",
        # The connect of a SUB that disconnects was only not reported yet: the next connect
        # is a reconnect (rule 7), not a first one.
        **{(link, "disconnect"): "down" for link in ("unconnected", "held")},
        ("up", "disconnect"): "down",
        ("down", "disconnect"): "down",
        **{(link, "fresh-start"): "unconnected" for link in _LINKS},
    },
    "identity": {
        **{(i, "ask"): "asking" for i in _IDENTITIES},
        **{(i, "forget"): "unknown" for i in _IDENTITIES},
        **{(i, "vouch"): "vouched" for i in _IDENTITIES},
        # A (re)connect or a disconnect: what vouched before vouches no more; a question stays.
        ("unknown", "doubt"): "unknown",
        ("asking", "doubt"): "asking",
        ("vouched", "doubt"): "unknown",
    },
    "reply": {
        ("none", "request"): "awaited",
        ("awaited", "abandon"): "moot",
        ("moot", "abandon"): "moot",
        ("awaited", "settle"): "none",
        ("moot", "settle"): "none",
    },
    "holding": {
        ("nothing", "apply"): "run",
        ("run", "apply"): "run",
        ("nothing", "reset"): "nothing",
        ("run", "reset"): "nothing",
    },
}


class RecoveryPhase(NamedTuple):
    """The machine's state at one instant, one value per component (see the vocabulary above)."""

    history: History
    link: Link
    identity: Identity
    reply: Reply
    holding: Holding
