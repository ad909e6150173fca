"""The relay's lease under CPU starvation (docs/replicas.md, "High availability"), against a real ``nats-server -js``.

The active relay renews its lease from a thread and NATS connection of its own: an event loop that
does not run for several lease ttls (a long apply on a loaded machine) must not lose the lease, so no
standby takes over and no session restarts (each restart, or a second relay publishing, would leave
followers partial). Only a loop stalled past ``lease_stall`` lets the lease go; the standby then takes
over and the followers stay exact.
"""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from _publisher_helpers import FAST
from test_jetstream import Fleet, NatsServer, _steady, assert_same, client_at, nats_server, replica_at

from kvroute import ConfigError, JetStreamRelay, JetStreamReplica, KvEventClient, SubscriberConfig

__all__ = ["nats_server"]  # the fixture, imported for this module's tests


def _starve(seconds: float) -> None:
    """Hold the calling event loop with CPU work (the GIL still switches to other threads, as under load)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


class _Standby:
    """A second relay for the same stream on an event loop in a thread of its own (not starved with the first)."""

    def __init__(self, url: str, fleet: Fleet, stream: str, config: SubscriberConfig = FAST, **kw: float) -> None:
        self.active = threading.Event()
        self.started = threading.Event()
        self._stop = threading.Event()
        self.sessions = 0

        async def main() -> None:
            relay = JetStreamRelay(url, fleet.sources(), stream=stream, config=config, name="standby", **kw)
            async with relay:
                self.started.set()
                while not self._stop.is_set():
                    if relay.active:
                        self.active.set()
                    self.sessions = relay.stats().sessions
                    await anyio.sleep(0.02)

        self._thread = threading.Thread(target=anyio.run, args=(main,), daemon=True)

    def __enter__(self) -> _Standby:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def test_lease_stall_must_cover_the_ttl() -> None:
    with pytest.raises(ConfigError):
        JetStreamRelay("nats://127.0.0.1:1", lease_ttl=5.0, lease_stall=1.0)


@pytest.mark.anyio
async def test_a_starved_relay_keeps_its_lease_and_its_session(nats_server: NatsServer) -> None:
    from kvroute.sim import EventPublisher

    async with EventPublisher() as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        fleet.step(10)
        async with (
            KvEventClient(fleet.sources(), config=FAST) as direct,
            JetStreamRelay(nats_server.url, fleet.sources(), stream="L", config=FAST, lease_ttl=1.0) as relay,
            JetStreamReplica(nats_server.url, stream="L") as replica,
        ):
            await relay.wait_synced(20)
            with _Standby(nats_server.url, fleet, "L", lease_ttl=1.0) as standby:
                assert await anyio.to_thread.run_sync(standby.started.wait, 20)
                await _steady(fleet, 10)
                # The event loop the relay (and its renewals before this change) runs on does not run
                # for 3.5 lease ttls; batches keep coming meanwhile.
                fleet.step(5)
                _starve(3.5)
                fleet.step(5)
                await _steady(fleet, 10)
                # The standby polls every ttl / 4: give it the time to see a lapsed lease, had there been one.
                await anyio.sleep(1.5)
                assert not standby.active.is_set(), "the standby took the lease over from a starved relay"
                assert relay.active
                assert relay.stats().sessions == 1
                last = fleet.last()
                await client_at(direct, last)
                await replica_at(replica, last)
                assert_same(replica.index, direct.index, fleet.queries())
                st = replica.stats()
                assert (st.gaps, st.stream_gaps, st.undecodable) == (0, 0, 0)
                assert not replica.partial_workers()


@pytest.mark.anyio
async def test_a_wedged_relay_lets_the_lease_go_and_the_standby_carries_on(nats_server: NatsServer) -> None:
    from kvroute.sim import EventPublisher

    async with EventPublisher() as p0, EventPublisher() as p1:
        fleet = Fleet([p0, p1])
        fleet.step(10)
        kw = {"lease_ttl": 0.5, "lease_stall": 1.0}
        async with (
            JetStreamRelay(nats_server.url, fleet.sources(), stream="W", config=FAST, **kw) as relay,
            JetStreamReplica(nats_server.url, stream="W") as replica,
        ):
            await relay.wait_synced(20)
            # The standby's replay timeout outlasts the stall: the engines' replay servers run on the
            # wedged loop too, and answer its identity check only once that loop runs again.
            with _Standby(nats_server.url, fleet, "W", SubscriberConfig(replay_timeout=5.0), **kw) as standby:
                assert await anyio.to_thread.run_sync(standby.started.wait, 20)
                await _steady(fleet, 5)
                # Stalled well past lease_stall + ttl: the renewals stop, the standby takes over.
                _starve(4.0)
                fleet.step(5)
                assert await anyio.to_thread.run_sync(standby.active.wait, 20), "the standby never took over"
                # The wedged relay notices once its loop runs again, and stands by.
                with anyio.fail_after(10):
                    while relay.active:  # noqa: ASYNC110 (a flag the relay's own task clears)
                        await anyio.sleep(0.02)
                await _steady(fleet, 10)
                last = fleet.last()
                await replica_at(replica, last, timeout=30)
                # What a client following the engines from their whole history holds.
                async with KvEventClient(fleet.sources(), config=FAST) as direct:
                    await client_at(direct, last)
                    assert_same(replica.index, direct.index, fleet.queries())
                st = replica.stats()
                assert (st.gaps, st.stream_gaps, st.undecodable) == (0, 0, 0)
                assert not replica.partial_workers()
