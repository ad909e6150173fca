"""`KvEventClient.live_set()` built by its first reader after a change, and still ordered after the vouching.

The client no longer rebuilds its live frozenset on every source added (O(n²) at a 4,096-source
start): a change marks it stale and the next reader builds it from the subscriptions. A reader that
builds it must still never see a worker live before it is unvouched (a router on another thread
would believe a warm restart's restored state for a moment): the new source is tracked before it
joins the subscriptions the set is built from.
"""

from __future__ import annotations

import socket

import pytest
from _publisher_helpers import FAST

from kvroute._client import KvEventClient
from kvroute._models import EventSource, WorkerKey


def _dead_source(name: str) -> EventSource:
    """A source on a port nobody listens on (it never syncs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return EventSource(worker_id=name, endpoint=f"tcp://127.0.0.1:{port}", block_size=16)


@pytest.mark.anyio
async def test_a_stale_live_set_built_mid_change_never_holds_a_worker_not_yet_unvouched() -> None:
    first, second = _dead_source("a"), _dead_source("b")
    async with KvEventClient([], config=FAST) as client:
        assert client.add_source(first)  # nobody has read the set since: it is stale now
        live_when_tracked: list[bool] = []
        update = client._vouching.update

        def tracked(worker: WorkerKey, synced: bool, partial: bool) -> None:
            if worker == second.key:
                # a router reading now builds the stale set from the subscriptions
                live_when_tracked.append(worker in client.live_set())
            update(worker, synced, partial)

        client._vouching.update = tracked  # type: ignore[method-assign]
        assert client.add_source(second)
        assert live_when_tracked[:1] == [False]
        # the set built while tracking was marked stale again by the addition
        assert client.live_set() == {first.key, second.key} == client.live_workers()
        assert client.live_set() is client.live_set()  # kept until the next change
        assert client.remove_source(first)
        assert client.live_set() == {second.key}
