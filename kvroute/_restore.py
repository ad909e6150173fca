"""Warm restart, the client's side: the restored positions it hands its sources, and the restored workers
no source claims.

A client given ``index=PrefixIndex.restore(path)`` resumes each source whose worker has a saved position
(`RecoveryMachine.resume`: identity check first, docs/recovery.md rule 7) and drops the restored state of
every other worker: one whose source cannot check its position (no replay endpoint), one no configured or
discovered source feeds once discovery has had its say, one whose position is out of range. `Restored`
keeps that bookkeeping; `KvEventClient` asks it at each step (a source added, discovery answered, the
client left). A source that takes no position while its worker had restored state (or a position) gets a
`Reset` envelope first, published to the client's listeners: a republisher (the JetStream relay's tap)
must tell its followers that the state went, or they would keep what the client's index no longer has.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Container, Mapping

from ._events import Envelope, Reset
from ._index import PrefixIndex
from ._models import EventSource, WorkerKey
from ._recovery import REPLAY_END_SEQ
from ._snapshot import Cursor

__all__ = ["Restored"]

log = logging.getLogger("kvroute.client")


class Restored:
    """The restored positions not yet taken by a source, and the restored workers not yet claimed by one.

    Made from the index at the client's construction: it takes the index's ``restored_cursors``
    over (and empties that attribute, so a later ``index.snapshot(path)`` cannot pair stale
    positions with a changed index). A position out of range (or a ts that is not finite) drops
    that worker's restored state, with a warning; the other workers keep theirs.
    """

    def __init__(self, index: PrefixIndex, publish: Callable[[Envelope], None]) -> None:
        self._index = index
        self._publish = publish
        self._positions: dict[WorkerKey, Cursor] = {}
        # Workers whose restored state went at construction, before anybody listened: their
        # source announces it when it starts (`take`).
        self._dropped: dict[WorkerKey, str] = {}
        for key, cursor in index.restored_cursors.items():
            if isinstance(cursor.seq, int) and 0 <= cursor.seq < REPLAY_END_SEQ and math.isfinite(cursor.ts):
                self._positions[key] = cursor
            else:
                # One bad position costs that worker its restored state, never the fleet's.
                log.warning("%s: restored state dropped: invalid position seq %r, ts %r", key, cursor.seq, cursor.ts)
                index.remove_worker(key)
                self._dropped[key] = f"restored state dropped: invalid position seq {cursor.seq!r}"
        index.restored_cursors = {}
        self._unclaimed: set[WorkerKey] = index.workers() | set(self._positions)

    def take(self, source: EventSource) -> Cursor | None:
        """The position ``source`` resumes from, if any; the worker's restored state goes when there is none.

        `RecoveryMachine.start` assumes an empty slate, and a position is usable only with a
        replay endpoint to check it against. When restored state (or a restored position) goes
        here, a ``Reset("no-replay")`` envelope for ``source`` is published first, before any of
        the source's own events.
        """
        key = source.key
        self._unclaimed.discard(key)
        cursor = self._positions.pop(key, None)
        why = self._dropped.pop(key, None)
        if cursor is not None and source.replay_endpoint is None:
            log.info("%s: restored state dropped: no replay endpoint to check it against", key)
            why = f"restored state through seq {cursor.seq} cannot be checked without replay"
            cursor = None
        if cursor is None and self._index.num_blocks(key):
            self._index.remove_worker(key)
            why = why or "restored state without a position"
        if why is not None:
            self._publish(Envelope(source=source, seq=None, ts=time.time(), event=Reset("no-replay", why)))
        return cursor

    def drop_unclaimed(self, fed: Container[WorkerKey]) -> None:
        """Forget every restored worker no source feeds (``fed``): call once discovery has had its say."""
        for key in self._unclaimed:
            if key not in fed:
                log.info("%s: restored state dropped: no configured or discovered source feeds it", key)
                self._index.remove_worker(key)
                self._positions.pop(key, None)
        self._unclaimed.clear()
        for key in [k for k in self._dropped if k not in fed]:
            del self._dropped[key]

    @property
    def pending(self) -> bool:
        """Some restored worker is not claimed yet."""
        return bool(self._unclaimed)

    def saved(self, current: Mapping[WorkerKey, Cursor]) -> dict[WorkerKey, Cursor]:
        """What a snapshot saves: the ``current`` sources' positions, and the restored ones not taken yet."""
        out = dict(current)
        for key, cursor in self._positions.items():
            out.setdefault(key, cursor)
        return out

    def restart_from(self, positions: Mapping[WorkerKey, Cursor]) -> None:
        """The client left ``async with`` with its sources at ``positions``: entering again resumes from there."""
        self._positions = dict(positions)
        self._unclaimed = self._index.workers() | set(self._positions)
