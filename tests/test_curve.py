"""ZMQ CURVE end to end: a CURVE publisher (PUB and replay ROUTER), clients with right, wrong and no keys."""

from __future__ import annotations

import logging

import anyio
import msgspec
import pytest
from _publisher_helpers import FAST, Workload, assert_index_equal, settle, truth_index

from kvroute._client import KvEventClient
from kvroute._models import WorkerKey
from kvroute._transports.zmq import sockets as _zmq
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute.sim._publisher import EventPublisher

pytestmark = pytest.mark.anyio


def _keyed(keys: _zmq.CurveKeys) -> SubscriberConfig:
    return msgspec.structs.replace(FAST, curve_public_key=keys.public, curve_secret_key=keys.secret)


async def test_right_keys_sync_and_wrong_keys_get_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvroute.subscriber")
    server, mine = _zmq.curve_keypair(), _zmq.curve_keypair()
    impostor = _zmq.curve_keypair()  # the server key a misconfigured client was given
    mismatched = _zmq.CurveKeys(mine.public, _zmq.curve_keypair().secret)  # halves of two pairs
    wl = Workload(41)
    async with EventPublisher(curve=server) as pub:
        for _ in range(5):  # history only the replay ROUTER (also CURVE) can give
            pub.publish(wl.batch())
        good = pub.source("good")
        bad = {
            # CURVE towards a server key that is not the publisher's.
            "wrong-server-key": (pub.source("wrong-server-key", curve_server_key=impostor.public), _keyed(mine)),
            # A client key pair whose secret does not match its public key.
            "mismatched-pair": (pub.source("mismatched-pair"), _keyed(mismatched)),
            # Plaintext to a CURVE publisher (the source does not say it needs CURVE).
            "plaintext": (pub.source("plaintext", curve_server_key=None), FAST),
        }
        async with (
            KvEventClient([good], config=_keyed(mine)) as client,
            KvEventClient([bad["wrong-server-key"][0]], config=bad["wrong-server-key"][1]) as c1,
            KvEventClient([bad["mismatched-pair"][0]], config=bad["mismatched-pair"][1]) as c2,
            KvEventClient([bad["plaintext"][0]], config=bad["plaintext"][1]) as c3,
        ):
            stream = client.events()
            await settle(client, stream, {good.key: 4})
            for _ in range(3):
                pub.publish(wl.batch())
            await settle(client, stream, {good.key: 7})
            assert_index_equal(client.index, truth_index({good.key: pub}), wl.queries)
            st = client.stats().sources[good.key]
            assert st.connected and st.replayed_batches >= 5 and st.decode_errors == 0
            # The others had as long (a cold replay, three live batches) and more: nothing.
            with anyio.move_on_after(0.5):
                await c1.wait_synced(10)
            for name, other in zip(bad, (c1, c2, c3)):
                key = WorkerKey(name, 0)
                status = other.worker_status(key)
                ost = other.stats().sources[key]
                assert status is not None and not status.synced, name
                assert not ost.connected and ost.messages == 0 and ost.batches == 0, name
                assert other.index.num_blocks() == 0, name
                with pytest.raises(TimeoutError):
                    await other.wait_synced(0.05)
    # Each bad client retried its handshake every reconnect interval (20-100 ms) for about a
    # second; each logged it once (rate limit: one line per kind per source per 10 s).
    handshakes = sorted(r.getMessage().split("[")[0] for r in caplog.records if "handshake failed" in r.getMessage())
    assert handshakes == sorted(bad)


async def test_a_curve_source_without_a_client_key_pair_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvroute.client")
    server = _zmq.curve_keypair()
    async with EventPublisher(curve=server) as pub, KvEventClient(config=FAST) as client:
        src = pub.source("w")
        assert not client.add_source(src)
        assert not client.add_source(src)  # discovery offers it again every round: counted, logged once
        stats = client.stats()
        assert stats.refused_sources == 2 and not stats.sources
        refusals = [r for r in caplog.records if "refused source" in r.getMessage()]
        assert len(refusals) == 1 and "requires CURVE" in refusals[0].getMessage()
