"""The relay's raw tap (`kvroute._fanout.Hub.raw`): what a `KvEventClient` applied, as the engines' own bytes.

A real client follows a real ZMQ publisher (kvroute.sim). With the relay's tap the only listener, every
in-order batch reaches it as the payload the engine sent, byte for byte, in seq order (no decoding, no
re-encoding: what the relay republishes); with an ``events()`` iterator open beside it the tap gets
the decoded envelopes instead (the relay then encodes them back), and raw bytes again once it is closed.
"""

from __future__ import annotations

import contextlib

import anyio
import msgspec
import pytest
from _publisher_helpers import FAST, Workload, assert_index_equal, first_batch_lands, truth_index

from kvroute import BlockStored, Envelope, KvEventClient, WorkerKey
from kvroute._jetstream_publish import _Publisher, _Tap
from kvroute._transports.zmq.driver import SourceDriver
from kvroute._wire import encode_batch
from kvroute.sim import EventPublisher

# No quiet probe while the test publishes: a probe holds the batches that come during it and the machine
# applies them, which reaches the tap as envelopes by design (`set_raw_tap`); FAST's 0.3 s interval let one
# fire between two publishes when a CPU hog ran beside the suite.
TAP = msgspec.structs.replace(FAST, quiet_interval=60.0)


async def _until(tap: _Tap, n: int) -> None:
    with anyio.fail_after(10):
        while len(tap.items) < n:  # noqa: ASYNC110 (the client's task fills it)
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_the_tap_gets_the_engines_payload_bytes_in_order() -> None:
    wl = Workload(seed=5)
    async with EventPublisher() as pub:
        src = pub.source("w")
        client = KvEventClient([src], config=TAP)
        tap = _Tap(10_000)
        client.set_raw_tap(tap)
        async with client:
            await client.wait_synced(10)
            await first_batch_lands(client, pub, src.key, wl)
            first = pub.next_seq
            tap.items.clear()  # the lifecycle facts of connecting, and the first batches
            for _ in range(30):
                pub.publish(wl.batch())
            await _until(tap, 30)
            items = list(tap.items)
            tap.items.clear()
            assert all(type(i) is tuple for i in items), items
            assert [i[1] for i in items] == list(range(first, first + 30))
            for source, seq, ts, payload, blocks in items:  # type: ignore[misc]
                batch = pub.history[seq]
                assert source.key == WorkerKey("w", 0)
                assert payload == encode_batch(batch, form=pub.form, signed_hashes=pub.signed_hashes)
                assert ts == batch.ts
                assert blocks == sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))

            # A listener beside the tap: the general path, events as envelopes (the relay encodes them).
            stream = client.events()
            for _ in range(5):
                pub.publish(wl.batch())
            with anyio.fail_after(10):
                while not any(isinstance(i, Envelope) and i.seq == first + 34 for i in tap.items):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert all(isinstance(i, Envelope) for i in tap.items)
            assert {i.seq for i in tap.items if isinstance(i, Envelope)} == set(range(first + 30, first + 35))

            # The relay's publisher turns both forms into the same runs: one record per worker here.
            counts = dict.fromkeys(("records", "batches", "blocks", "removals", "resets", "partials"), 0)
            publisher = _Publisher(None, "S", counts, "s", {}, set(), publish_timeout=1.0)  # type: ignore[arg-type]
            for item in items:
                publisher.take_raw(*item)  # type: ignore[misc]
            while tap.items:
                publisher.take(tap.items.popleft())  # type: ignore[arg-type]
            publisher._flush_group()
            publisher.close_runs()
            assert counts["batches"] == 35 and counts["records"] == 1

            # Closed: publishing the next envelope cleans the closed iterator up; from then on, raw bytes again.
            await stream.aclose()
            for _ in range(5):
                pub.publish(wl.batch())
            with anyio.fail_after(10):
                while not any((i.seq if isinstance(i, Envelope) else i[1]) == first + 39 for i in tap.items):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            tap.items.clear()
            pub.publish(wl.batch())
            await _until(tap, 1)
            assert type(tap.items[0]) is tuple and tap.items[0][1] == first + 40


@pytest.mark.anyio
async def test_the_receive_thread_applies_for_a_tap_alone_and_hands_it_every_payload() -> None:
    # The relay's path on the native receiver: the thread applies in-order batches itself (the
    # event loop only does rule 1's bookkeeping) and keeps each payload for the tap; a tap attached
    # to a running client (none before) gets every batch from the next one on, as bytes.
    wl = Workload(seed=9)
    config = msgspec.structs.replace(TAP, native_receive=True)
    async with EventPublisher() as pub:
        src = pub.source("w")
        client = KvEventClient([src], config=config)
        async with client:
            await client.wait_synced(10)
            await first_batch_lands(client, pub, src.key, wl)
            driver = client._subs[src.key].driver  # type: ignore[attr-defined]
            assert isinstance(driver, SourceDriver) and driver._native is not None
            tap = _Tap(100_000)
            client.set_raw_tap(tap)
            first = pub.next_seq
            # The first batch after attaching reaches Python (attaching closed the thread's fast path,
            # which reopens keeping payloads at that hand-over); the rest, the thread applies.
            pub.publish(wl.batch())
            await _until(tap, 1)
            before = driver.native_batches
            for _ in range(20):  # rounds of 10: none lost to the PUB's queue on a loaded host
                for _ in range(10):
                    pub.publish(wl.batch())
                await _until(tap, pub.next_seq - first)
            items = list(tap.items)
            assert all(type(i) is tuple for i in items), [i for i in items if type(i) is not tuple][:3]
            assert [i[1] for i in items] == list(range(first, first + 201))
            for source, seq, ts, payload, blocks in items:  # type: ignore[misc]
                batch = pub.history[seq]
                assert source.key == src.key and ts == batch.ts
                assert payload == encode_batch(batch, form=pub.form, signed_hashes=pub.signed_hashes)
                assert blocks == sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
            assert driver.native_batches == before + 200
            assert_index_equal(client.index, truth_index({src.key: pub}), wl.queries)


@pytest.mark.anyio
async def test_a_tap_attached_to_a_running_client_gets_every_batch_after_it() -> None:
    # Four engines publishing without pause while the receive thread applies on its fast paths
    # (no listener: no payloads kept). Attaching the tap holds the thread and closes those paths
    # before it applies again (the closes are carried out before its next visit, not at the end of
    # its round), so the tap gets every batch applied after it was attached, as the engine's bytes
    # or as envelopes, and the paths reopen keeping payloads.
    workloads = [Workload(seed=11 + i) for i in range(4)]
    config = msgspec.structs.replace(TAP, native_receive=True)
    async with contextlib.AsyncExitStack() as stack:
        pubs = [await stack.enter_async_context(EventPublisher()) for _ in workloads]
        sources = [p.source(f"w{i}") for i, p in enumerate(pubs)]
        client = KvEventClient(sources, config=config)
        await stack.enter_async_context(client)
        await client.wait_synced(10)
        for p, src, wl in zip(pubs, sources, workloads):
            await first_batch_lands(client, p, src.key, wl)
        stop = anyio.Event()

        async def publish() -> None:
            while not stop.is_set():
                for p, wl in zip(pubs, workloads):
                    p.publish(wl.batch())
                await anyio.sleep(0.002)

        async with anyio.create_task_group() as tg:
            tg.start_soon(publish)
            await anyio.sleep(0.3)
            tap = _Tap(1_000_000)
            client.set_raw_tap(tap)
            # Held while attaching: every batch applied so far is recorded, and the tap gets the rest.
            at_attach = {src.key: client.stats().sources[src.key].last_seq for src in sources}
            await anyio.sleep(0.5)
            stop.set()
        with anyio.fail_after(10):
            while any(  # noqa: ASYNC110 (the client's task applies them)
                client.stats().sources[src.key].last_seq != p.next_seq - 1 for p, src in zip(pubs, sources)
            ):
                await anyio.sleep(0.01)
        seen: dict[WorkerKey, list[int]] = {src.key: [] for src in sources}
        for item in tap.items:
            if type(item) is tuple:
                seen[item[0].key].append(item[1])  # type: ignore[index, union-attr]
            elif isinstance(item, Envelope) and item.seq is not None:
                got = seen[item.source.key]
                if not got or got[-1] != item.seq:  # one envelope per event of a batch
                    got.append(item.seq)
        for p, src in zip(pubs, sources):
            seqs = seen[src.key]
            assert seqs == list(range(at_attach[src.key] + 1, p.next_seq)), (src.key, at_attach, seqs[:3])
        assert sum(type(i) is tuple for i in tap.items) > len(tap.items) // 2


def test_a_full_tap_takes_nothing_more() -> None:
    tap = _Tap(2)
    for seq in range(4):
        tap.raw(None, seq, 0.0, b"", 0)  # type: ignore[arg-type]
    assert [i[1] for i in tap.items] == [0, 1]  # type: ignore[index]
    assert tap.overflowed == 2
