"""The trust rule read from the states provider's set of unvouched workers (`VouchingStates`).

A `Router` reads ``unvouched_workers`` once per ``select`` instead of ``worker_status`` per
candidate. The set is kept by each source's recovery machine as its state changes: these tests
move a real `KvEventClient`'s source (and a `JetStreamReplica`'s workers) between states and
check that the very next ``select``, on both scoring paths, believes exactly the claims the
status rule believes.
"""

from __future__ import annotations

import socket

import pytest
from _publisher_helpers import FAST, wait_for

from kvroute._client import KvEventClient
from kvroute._jetstream_replica import JetStreamReplica
from kvroute._models import EventSource, VouchingStates, WorkerKey, WorkerStates, WorkerStatus
from kvroute._router import CostModel, Router
from kvroute._wire import BlockStored
from kvroute.sim._publisher import EventPublisher

BS = 16
PROMPT = list(range(5000, 5000 + 8 * BS))


class PythonPath(CostModel, frozen=True, kw_only=True):
    """The stock weights through the Python scoring path (a subclass takes it)."""


def _believed(status: WorkerStatus | None, trust_partial: bool) -> bool:
    """The rule both paths implement, from a status."""
    return status is not None and status.state == "synced" and (trust_partial or not status.partial)


def _check(states: WorkerStates, routers: dict[tuple[str, bool], Router], worker: WorkerKey) -> dict[bool, bool]:
    """Each router's very next ``select`` credits ``worker``'s claim exactly when its status says so,
    and the provider's set agrees with its statuses; the rule's answer per ``trust_partial``."""
    status = states.worker_status(worker)
    got: dict[bool, bool] = {}
    for (path, trust_partial), router in routers.items():
        want = _believed(status, trust_partial)
        d = router.select(PROMPT)
        assert d.worker == worker, path
        assert (d.overlap_blocks > 0) == want, (path, trust_partial, status)
        got[trust_partial] = want
    assert isinstance(states, VouchingStates)
    assert states.live_set() == states.live_workers()
    for trust_partial in (False, True):
        unvouched = {w for w in states.live_workers() if not _believed(states.worker_status(w), trust_partial)}
        assert states.unvouched_workers(trust_partial) == unvouched
    return got


def _routers(states: WorkerStates, index: object) -> dict[tuple[str, bool], Router]:
    return {
        (path, tp): Router(index, states=states, cost=cost, trust_partial=tp, seed=1)  # type: ignore[arg-type]
        for path, cost in (("compiled", CostModel()), ("python", PythonPath()))
        for tp in (False, True)
    }


@pytest.mark.anyio
async def test_a_source_turning_partial_unsynced_and_synced_is_judged_by_the_very_next_select() -> None:
    async with EventPublisher() as pub:
        src = pub.source("w")
        key = src.key
        async with KvEventClient([src], config=FAST) as client:
            routers = _routers(client, client.index)
            # before the source synced, nothing it claims is believed
            assert client.unvouched_workers(False) == client.unvouched_workers(True) == {key}
            pub.publish([BlockStored(block_hashes=list(range(1, 9)), token_ids=PROMPT, block_size=BS)])
            await client.wait_synced(10)
            await wait_for(lambda: client.index.num_blocks(key) == 8, "the prompt's blocks applied")
            assert _check(client, routers, key) == {False: True, True: True}

            driver = client._subs[key].driver
            machine = driver.machine
            # Partial, as the JetStream transport marks it (outside any input of the machine).
            machine.partial = True
            assert _check(client, routers, key) == {False: False, True: True}
            machine.partial = False
            assert _check(client, routers, key) == {False: True, True: True}

            # Unsynced: the SUB's monitor reports a disconnect (the driver carries out the actions).
            driver.execute(machine.on_disconnected())
            assert _check(client, routers, key) == {False: False, True: False}
            # Reconnected: the identity check's replay runs against the real publisher.
            driver.execute(machine.on_reconnected())
            _check(client, routers, key)
            await wait_for(lambda: machine.vouching[0], "synced again after the identity check")
            # synced again: the next select believes it, with nothing awaited in between
            assert _check(client, routers, key) == {False: True, True: True}

            # A gap held for replay (resyncing), then filled.
            driver.execute(machine.on_live(machine.last_seq + 5, 1.0, None))
            status = client.worker_status(key)
            assert status is not None and status.state != "synced"
            assert _check(client, routers, key) == {False: False, True: False}

            # A removed source is no longer known: never vouched for, and not live either.
            assert client.remove_source(key)
            assert client.unvouched_workers(False) == client.unvouched_workers(True) == frozenset()
            assert client.live_set() == frozenset() == client.live_workers()
            # its machine may take inputs until its task is cancelled: they no longer count
            machine.partial = True
            assert client.unvouched_workers(False) == frozenset()


def test_a_replica_keeps_its_unvouched_workers_with_its_partial_flags() -> None:
    replica = JetStreamReplica()
    a, b = WorkerKey("a", 0), WorkerKey("b", 0)
    wa, wb = replica._worker(a), replica._worker(b)
    # not caught up with the log yet: nothing is vouched for
    assert replica.unvouched_workers(True) == replica.unvouched_workers(False) == {a, b} == replica.live_set()
    replica._reader.target = replica.position  # the log's end at subscription, reached
    assert replica.synced
    assert replica.unvouched_workers(False) == replica.unvouched_workers(True) == frozenset()
    wa.mark_partial("relay", 3)
    assert replica.unvouched_workers(False) == {a} and replica.unvouched_workers(True) == frozenset()
    wb.lost("gap", "lost 4..9", 4)
    assert replica.unvouched_workers(False) == {a, b} == replica.partial_workers()
    wa.reset("restart", "seq 0 again")
    assert replica.unvouched_workers(False) == {b}
    replica._remove(b, "gone")
    assert replica.live_set() == {a} == replica.live_workers()
    assert replica.unvouched_workers(False) == frozenset() == replica.partial_workers()
    for w in (a, b):
        status = replica.worker_status(w)
        for tp in (False, True):
            assert (w in replica.unvouched_workers(tp)) == (w in replica.live_workers() and not _believed(status, tp))


@pytest.mark.anyio
async def test_a_worker_is_unvouched_before_it_is_live_and_until_its_blocks_are_gone() -> None:
    # A router on another thread reads the live set, then the unvouched set, then matches: a
    # worker live but not yet unvouched (a warm restart's restored state, before its identity
    # check), or vouched for again while the index still holds its blocks, would be believed.
    # The client orders its two sets around each change so that no such moment exists.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = EventSource(worker_id="w", endpoint=f"tcp://127.0.0.1:{port}", block_size=BS)  # never syncs
    key = dead.key
    async with KvEventClient([], config=FAST) as client:
        live_when_tracked: list[bool] = []
        update = client._vouching.update

        def tracked(worker: WorkerKey, synced: bool, partial: bool) -> None:
            if worker == key:
                live_when_tracked.append(worker in client.live_set())
            update(worker, synced, partial)

        client._vouching.update = tracked  # type: ignore[method-assign]
        assert client.add_source(dead)
        assert live_when_tracked[:1] == [False] and key in client.live_set()
        assert key in client.unvouched_workers(trust_partial=True)
        unvouched_at_removal: list[bool] = []
        remove_worker = client.index.remove_worker

        def removing(worker: WorkerKey) -> None:
            unvouched_at_removal.append(worker in client.unvouched_workers(trust_partial=True))
            remove_worker(worker)

        client.index.remove_worker = removing  # type: ignore[method-assign]
        assert client.remove_source(dead)
        assert unvouched_at_removal == [True]
        assert key not in client.live_set() and key not in client.unvouched_workers(trust_partial=True)
