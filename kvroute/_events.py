"""Lifecycle events: what happened to a source, delivered beside its engine events.

`KvEventClient.events()` yields `Envelope`s. An envelope's ``event`` is either an engine
event (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, with the batch's ``seq`` and
``ts``) or one of the lifecycle events below (``seq`` None, ``ts`` the client's clock).

Every lifecycle event is a frozen msgspec Struct with a ``kind`` class attribute
("connected", "gap", ...). On the wire (``msgspec.json.encode``) the kind is written as
the ``"type"`` key, the same key engine events use for their class name, so one
`Envelope` type encodes and decodes every event (msgspec requires one tag key per union).

Reason tokens (``Reset.reason``, ``Partial.reason``), stable for logs and metrics:

- ``"restart"``: the engine restarted (its seq went back with a different ts, or the
  identity check failed); its old state is gone.
- ``"not-in-buffer"``: the replay buffer no longer reaches back to the missing seqs.
- ``"no-progress"``: a replay retry returned nothing new while seqs were still missing.
- ``"replay-failed"``: the replay timed out or its socket failed.
- ``"no-replay"``: the source has no replay endpoint, so nothing lost can be recovered.
- ``"undecodable"``: a payload failed to decode and its replayed copy (if any) too.
- ``"overflow"``: too many live batches were held while the engine's identity was unchecked
  (after a disconnect, or an old seq that needs an identity check).
- ``"reconnect"``: the SUB reconnected to a source without replay, whose identity
  therefore cannot be checked.
- ``"snapshot"``: a gateway stream replaced the worker's state with a snapshot (docs/protocol.md §6);
  as a `Partial` reason, the snapshot itself misses older history (``unknown_before`` > 0).
- ``"data-loss"``: a gateway stream ended with DATA_LOSS or OUT_OF_RANGE (a gap its relay
  could not fill, or a publisher restart): the worker's state is gone.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from ._models import EventSource
from ._wire import EngineEvent

__all__ = [
    "GapReason",
    "ReplayPurpose",
    "ResetReason",
    "Connected",
    "Disconnected",
    "Envelope",
    "Gap",
    "LifecycleEvent",
    "Overflow",
    "Partial",
    "Removed",
    "Replayed",
    "Reset",
    "Synced",
]


#: Why a worker was reset or marked partial: the reason tokens above.
ResetReason = Literal[
    "restart",
    "not-in-buffer",
    "no-progress",
    "replay-failed",
    "no-replay",
    "undecodable",
    "overflow",
    "reconnect",
    # Gateway streams (docs/protocol.md §6): a resync from a snapshot, and a stream ended by DATA_LOSS.
    "snapshot",
    "data-loss",
]
#: What a replay request is for: a cold start, a gap, a retry, a quiet probe or an identity check.
ReplayPurpose = Literal["cold", "gap", "retry", "probe", "identity"]
#: Why seqs were missed: a jump in the live stream, or a batch that failed to decode.
GapReason = Literal["seq", "undecodable"]


class Connected(msgspec.Struct, frozen=True, tag="connected", tag_field="type"):
    """The source's SUB socket connected (the first time, or again after a disconnect)."""

    kind: ClassVar[str] = "connected"


class Disconnected(msgspec.Struct, frozen=True, tag="disconnected", tag_field="type"):
    """The source's SUB socket lost its connection; the worker is not synced until it is back."""

    kind: ClassVar[str] = "disconnected"


class Gap(msgspec.Struct, frozen=True, tag="gap", tag_field="type"):
    """Live seqs ``expected`` .. ``got - 1`` were missed; a replay is asked for them.

    ``reason`` is "seq" for a jump in the live stream, "undecodable" when the batch at
    ``expected`` arrived but failed to decode (then ``got == expected``).
    """

    kind: ClassVar[str] = "gap"
    expected: int
    got: int
    reason: GapReason = "seq"


class Replayed(msgspec.Struct, frozen=True, tag="replayed", tag_field="type"):
    """A replay answered: ``count`` new batches from ``from_seq`` on were taken.

    ``purpose`` is the request's ("cold", "gap", "retry", "probe", "identity").
    """

    kind: ClassVar[str] = "replayed"
    from_seq: int
    count: int
    purpose: ReplayPurpose | Literal[""] = ""


class Reset(msgspec.Struct, frozen=True, tag="reset", tag_field="type"):
    """Every block of the worker was dropped from the index.

    ``reason`` is one of the module's reason tokens; ``detail`` says more, for people.
    """

    kind: ClassVar[str] = "reset"
    reason: ResetReason
    detail: str = ""


class Partial(msgspec.Struct, frozen=True, tag="partial", tag_field="type"):
    """The worker's history before ``first_seq`` is unknown: the index holds a subset of its cache."""

    kind: ClassVar[str] = "partial"
    reason: ResetReason
    first_seq: int


class Removed(msgspec.Struct, frozen=True, tag="removed", tag_field="type"):
    """The source is gone (no longer discovered, or removed by the caller); its blocks were dropped."""

    kind: ClassVar[str] = "removed"
    reason: str


class Overflow(msgspec.Struct, frozen=True, tag="overflow", tag_field="type"):
    """The events() iterator fell behind and ``dropped`` envelopes were discarded (the index is unaffected)."""

    kind: ClassVar[str] = "overflow"
    dropped: int


class Synced(msgspec.Struct, frozen=True, tag="synced", tag_field="type"):
    """The source caught up: cold start, gap or restart recovery is done and nothing is pending."""

    kind: ClassVar[str] = "synced"


LifecycleEvent = Connected | Disconnected | Gap | Replayed | Reset | Partial | Removed | Overflow | Synced


class Envelope(msgspec.Struct, frozen=True):
    """One item of `KvEventClient.events()`: an engine or lifecycle event and where it came from.

    ``seq`` is the engine batch's seq for engine events and None for lifecycle events;
    ``ts`` is the batch's engine timestamp, or the client's wall clock for lifecycle events.
    """

    source: EventSource
    seq: int | None
    ts: float
    event: EngineEvent | LifecycleEvent
