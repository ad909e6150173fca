"""What a fleet's cold sync costs outside the index: its log lines, its vouching sets, its endpoint checks.

A cold sync of 4,096 ranks whose replay buffers have wrapped makes every source's history
partial at once (one WARNING per source was ~10 % of the sync's CPU); each state change rebuilt
the client's published sets of unvouched workers (O(n²) over the sync); and each source's
endpoints were checked on a throwaway pyzmq socket (~7 %).
"""

from __future__ import annotations

import logging
import threading

import msgspec
import pytest
import zmq

from kvroute._events import Partial
from kvroute._fanout import Hub
from kvroute._models import EventSource, Vouching, WorkerKey
from kvroute._transports import _base
from kvroute._transports.zmq import sockets as _zmq
from kvroute._transports.zmq.config import SubscriberConfig
from kvroute._transports.zmq.transport import _plain_tcp, source_problem


def _source(n: int) -> EventSource:
    return EventSource(worker_id=f"w{n}", endpoint=f"tcp://127.0.0.1:{6000 + n}")


def _history_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvroute.subscriber" and r.levelno == level and "history incomplete" in r.getMessage()
    ]


def test_a_fleet_of_partial_histories_is_one_warning_with_each_source_at_debug(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG, "kvroute.subscriber")
    monkeypatch.setattr(_base, "_HISTORY_INCOMPLETE", _base.FleetWarning("history incomplete"))
    sink = Hub()
    sources = [_source(n) for n in range(50)]
    for src in sources:
        log = _base.RateLimitedLog(f"{src.worker_id}[0] {src.endpoint}")
        _base.emit_lifecycle(log, sink, src, Partial("not-in-buffer", 7))
    (warning,) = _history_lines(caplog, logging.WARNING)
    assert warning.startswith("w0[0] ") and "not-in-buffer: blocks known from seq 7 on" in warning
    debug = _history_lines(caplog, logging.DEBUG)
    assert len(debug) == 50 and all(any(line.startswith(f"w{n}[0] ") for line in debug) for n in range(50))


def test_the_next_fleet_warning_counts_the_sources_it_left_out(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, "kvroute.subscriber")
    now = [100.0]
    monkeypatch.setattr(_base.time, "monotonic", lambda: now[0])
    fleet = _base.FleetWarning("history incomplete")
    for n in range(5):
        fleet.warn(_base.RateLimitedLog(f"w{n}"), "detail")
    now[0] += 11.0  # past the 10 s window
    fleet.warn(_base.RateLimitedLog("w9"), "detail")
    lines = _history_lines(caplog, logging.WARNING)
    assert lines == [
        "w0: history incomplete: detail",
        "w9: history incomplete: detail (and 4 more sources since the last report: each at DEBUG, in its stats)",
    ]


def test_vouching_builds_its_published_sets_once_per_change_and_keeps_them_consistent() -> None:
    v = Vouching()
    a, b, c = WorkerKey("a", 0), WorkerKey("b", 0), WorkerKey("c", 0)
    assert v.unvouched(True) == frozenset() and v.any_unsynced() is None
    v.update(a, False, False)
    v.update(b, True, True)
    v.update(c, False, True)
    assert v.unsynced == {a, c} and v.untrusted == {a, b, c}
    assert v.unvouched(True) is v.unsynced and v.unvouched(False) is v.untrusted
    kept = v.unsynced
    v.update(b, True, True)  # no change: the published sets stay the very same objects
    assert v.unsynced is kept
    assert v.any_unsynced() in {a, c}
    v.update(a, True, False)
    v.discard(c)
    assert v.unsynced == frozenset() and v.untrusted == {b} and v.any_unsynced() is None
    v.clear()
    assert v.untrusted == frozenset()


def test_vouching_readers_on_another_thread_never_see_a_half_made_change() -> None:
    # Each worker moves between "not synced" and "synced but partial": untrusted either way, so
    # every read of the untrusted set, whatever the writer is doing, holds every worker.
    v = Vouching()
    keys = [WorkerKey(f"w{n}", 0) for n in range(64)]
    for key in keys:
        v.update(key, False, False)
    everyone = frozenset(keys)
    stop = threading.Event()
    seen: list[bool] = []
    errors: list[BaseException] = []

    def read() -> None:
        # An exception (a set changing size while it is copied, without the lock) would end this
        # thread silently and leave `seen` all true: it is kept and fails the test.
        try:
            while not stop.is_set():
                seen.append(v.unvouched(False) == everyone)
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(50):
            for key in keys:
                v.update(key, True, True)
            for key in keys:
                v.update(key, False, False)
    finally:
        stop.set()
        reader.join()
    assert not errors and seen and all(seen)


_ENDPOINTS = [
    "tcp://127.0.0.1:5557",
    "tcp://localhost:1",
    "tcp://engine-3.pods.cluster.local:5557",
    "tcp://host_name:80",
    "tcp://[::1]:5557",
    "tcp://[fe80::1]:65535",
    "tcp://127.0.0.1:99999",
    "tcp://127.0.0.1",
    "tcp://127.0.0.1:",
    "tcp://:5557",
    "tcp://a b:1",
    "tcp://*:5557",
    "tcp://127.0.0.1:55x",
    "nonsense://x",
    "127.0.0.1:5557",
    "ipc:///tmp/kvroute-test.sock",
    "inproc://kvroute-test",
]


@pytest.mark.parametrize("endpoint", _ENDPOINTS)
def test_an_endpoint_checked_without_a_socket_is_one_libzmq_accepts_and_a_bad_one_gets_libzmqs_error(
    endpoint: str,
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    try:
        _zmq.connect(ctx, zmq.DEALER, endpoint).close(linger=0)
        libzmq: str | None = None
    except (zmq.ZMQError, ValueError) as exc:
        libzmq = f"cannot connect to {endpoint!r}: {exc}"
    if _plain_tcp.fullmatch(endpoint):
        assert libzmq is None  # the shortcut only skips endpoints libzmq takes
    source = msgspec.structs.replace(_source(0), endpoint=endpoint)
    assert source_problem(source, ctx, SubscriberConfig()) == libzmq
    with_replay = msgspec.structs.replace(_source(0), replay_endpoint=endpoint)
    assert source_problem(with_replay, ctx, SubscriberConfig()) == libzmq
