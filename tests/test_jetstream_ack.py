"""`ack_sequences`: a delivery's stream and consumer sequences read as nats-py's `Msg.metadata` reads them."""

from __future__ import annotations

import pytest

pytest.importorskip("nats")

from nats.aio.msg import Msg

from kvroute._jetstream_log import ack_sequences

REPLIES = [
    "$JS.ACK.KVROUTE.c1.1.12345.678.1700000000000000000.3",  # v1: 9 tokens
    "$JS.ACK._.ACCHASH.KVROUTE.c1.2.99.7.1700000000000000000.0",  # v2 without its trailing token: 11
    "$JS.ACK.hub.ACCHASH.KVROUTE.c1.1.18446744073709551615.1.1700000000000000000.0.xyz",  # v2: 12
]


@pytest.mark.parametrize("reply", REPLIES)
def test_the_sequences_are_nats_pys(reply: str) -> None:
    seq = Msg(_client=None, subject="s", reply=reply).metadata.sequence  # type: ignore[arg-type]
    assert ack_sequences(reply) == (seq.stream, seq.consumer)


@pytest.mark.parametrize(
    "reply", ["", "$JS", "_INBOX.abc", "$JS.ACK.KVROUTE.c1", "$JS.FC.KVROUTE.c1.1.2.3.4.5", "$JS.ACK.S.c.1.x.2.3.4"]
)
def test_anything_else_is_none(reply: str) -> None:
    assert ack_sequences(reply) is None
