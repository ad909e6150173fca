"""`SubscriberConfig`: how the ZMQ transport subscribes (socket options, replay bounds, memory budgets, limits)."""

from __future__ import annotations

import math

import msgspec

from ..._errors import ConfigError
from ..._models import EventSource
from ..._wire import Limits
from . import sockets as _zmq

__all__ = ["SubscriberConfig", "curve_keys"]

_MiB = 1 << 20

# What a SubscriberConfig field that is not a plain int must be, for the type error message.
_KIND = {
    "limits": "a kvroute.Limits",
    "tcp_keepalive": "a bool",
    "native_receive": "a bool",
    "curve_public_key": "a z85 str or None",
    "curve_secret_key": "a z85 str or None",
    "rcvhwm": "an int or None",
    "max_sources": "an int or None",
    **{
        name: "a number"
        for name in (
            "reconnect_ivl",
            "reconnect_ivl_max",
            "replay_timeout",
            "replay_deadline",
            "replay_slice",
            "quiet_interval",
        )
    },
}


class SubscriberConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How `KvEventClient` subscribes: socket options, replay bounds, memory budgets, fan-out and decode limits.

    Times are in seconds, sizes in bytes. Defaults:

    - ``max_message_size`` 4 MiB: a step's batch is far smaller (a 65,536-token step is
      ~0.3 MB of msgpack); larger messages make libzmq drop the connection.
    - ``queue_bytes`` 64 MiB: what each socket (SUB, replay DEALER) may queue inside libzmq.
      Its receive high-water mark is at most ``queue_bytes // max_message_size`` messages
      (at least 1): past it the engine's side buffers (its PUB holds 100,000 batches).
    - ``rcvhwm`` None: use the source's advertised ``hwm``, else libzmq's 1,000; either way
      clamped to [1, ``queue_bytes // max_message_size``] (an advertised 0, libzmq's
      "unlimited", never is).
    - ``wakeup_bytes`` 4 MiB: payload bytes the receiver takes from one socket per visit
      (at least one message) before it turns to the next; it yields to the event loop every
      5 ms of work, so a flood never blocks the loop for long.
    - ``held_bytes`` 8 MiB: payload bytes of the live batches held while a replay is
      outstanding (decoded, an engine's batch takes ~7x its payload); past it the newest
      held batch is dropped (a replay fetches it again; counted in ``overflows``), as past
      ``max_held`` batches.
      One replay answer is read up to the same size before it is handed over.
    - ``reconnect_ivl`` 0.1 / ``reconnect_ivl_max`` 5.0: libzmq's 100 ms first retry, backing
      off to 5 s against an engine that stays down.
    - ``tcp_keepalive`` True: the OS probes idle connections, so a vanished host is noticed.
    - ``replay_timeout`` 1.0: the longest a replay holds a slot without a decodable reply (for
      the first one, and between replies; junk does not count); an idle engine may answer
      ~100 ms late (docs/protocol.md §4).
    - ``replay_deadline`` 30.0 / ``replay_budget`` 100,000: one replay request ends after
      this long (from its first turn holding a slot: waiting for one does not count) or this
      many replies (malformed ones included), end marker or not; what came is applied and
      the rest asked again.
    - ``replay_slice`` 0.1: a replay holding a slot this long gives it up as soon as another
      source waits for one (its replies so far are applied; it queues again for the rest);
      one streaming decodable batches (>= 200/s) keeps it for 10 slices. So a few slow or
      hostile replay endpoints cannot starve the others.
    - ``max_concurrent_replays`` 32: replay slots shared by all sources; each engine serves
      one at a time, and a reconnect storm must not stall every pump at once. At most this many
      answers are held at once, each up to ``held_bytes`` (256 MiB of payload at the defaults,
      x7 decoded while an ``events()`` listener wants its events). It was 8 until session 13:
      a cold fleet's replays queue behind the slots, and 32 synced 1,024 ranks in 0.62-0.74x the
      wall time and ~0.78x the CPU of 8 (docs/performance.md, "Session 13, cold sync").
    - ``quiet_interval`` 2.0: a source silent this long gets a replay probe (docs/recovery.md rules
      7-8: lost tail, silent restart); one small request per source per interval. Silent means
      its SUB had nothing to read: a client that is slow itself probes nobody for it. The
      probe is asked only while a replay slot is free, never queued behind busy ones (rule 9):
      while every slot is taken or waited for, the tick is deferred (``probes_deferred``): the
      next slot that comes free with no source waiting is offered to it, else the next tick
      asks again.
    - ``recv_batch`` 1024: messages taken from one socket per visit, at most 64 (then the
      other ready sockets get their turn).
    - ``events_buffer`` 10,000: envelopes buffered per `events()` iterator before the
      oldest are dropped.
    - ``max_sources`` None: sources subscribed at once, more are refused (logged, counted).
      None = as many as the process's file descriptors and the zmq context's socket limit
      allow, at most 4,096 (checked when the client starts; an explicit value that does
      not fit raises `ConfigError` there).
    - ``curve_public_key`` / ``curve_secret_key``: the client's CURVE key pair (z85); used
      for every source that names a ``curve_server_key``. Never shown by ``repr``.
    - ``limits``: decode caps per batch (`Limits`).
    - ``native_receive`` True (the default): read every plaintext tcp:// and ipc:// source's
      SUB on the compiled core's receive thread (`NativeReceiver`), which applies in-order
      batches itself and hands the rest to the recovery machine (docs/architecture.md, "The
      native loop"); CURVE and inproc:// sources stay on the Python receiver. ``held_bytes``
      then also bounds the messages the thread has handed over and Python has not taken yet,
      client-wide. False: every SUB is read on the event loop (the Python receiver). Same run,
      1,024 ranks: cold sync 2.5 s on the thread, 13.7 s on the event loop (docs/performance.md, "Fleet scale").
    - ``receive_nice`` 5: nice steps (0-19) the native receive side's threads (its loop,
      libzmq's I/O and reaper threads) run below the thread that started the client, so on a
      saturated core the event loop, which serves the router's requests, is not kept waiting
      behind ingest (Linux, where nice is per thread; elsewhere ignored). Nice weighs threads
      against the other threads of the same cgroup (a container): there, the router's own.
      4,096 ranks at ~700k blocks/s on one saturated core: event-loop lag p99 12 ms at 5, 8-10
      ms at 10, 21-27 ms at 0, apply lag level (docs/performance.md, "Session 15, fleet"). The
      cost: while the loop itself is busy, ingest gets about a quarter of its share at 5 (a
      tenth at 10) and its apply lag grows: beside a router loop ~80 % busy at 1M, apply lag
      p99 1.1 s at 5 against 0.46 s at 0, and at 10 ingest fell behind. 0: as the caller's,
      for a router that wants its index fresh first.

    Memory, per source, at most: ``queue_bytes`` queued in libzmq (SUB), ``held_bytes`` of
    payload held behind an outstanding replay (about 7x that decoded), and its index state;
    and per replay slot one answer of up to ``held_bytes`` (held as payload bytes; x7 decoded
    while an ``events()`` listener or a raw tap wants its events). Held batches exist
    only for a source with a gap or an identity check pending, never because the client
    is slow: a client past its ceiling leaves the backlog in the engines' PUB queues (which
    drop past their high-water mark: gaps, fetched again by replay within these bounds).

    Invalid values, wrong types included, raise `ConfigError` (a `KvRouteError` and a
    `ValueError`).
    """

    max_message_size: int = 4 * _MiB
    queue_bytes: int = 64 * _MiB
    rcvhwm: int | None = None
    wakeup_bytes: int = 4 * _MiB
    held_bytes: int = 8 * _MiB
    reconnect_ivl: float = 0.1
    reconnect_ivl_max: float = 5.0
    tcp_keepalive: bool = True
    replay_timeout: float = 1.0
    replay_deadline: float = 30.0
    replay_budget: int = 100_000
    replay_slice: float = 0.1
    max_concurrent_replays: int = 32
    quiet_interval: float = 2.0
    recv_batch: int = 1024
    events_buffer: int = 10_000
    max_sources: int | None = None
    curve_public_key: str | None = None
    curve_secret_key: str | None = None
    limits: Limits = msgspec.field(default_factory=Limits)
    native_receive: bool = True
    receive_nice: int = 5

    def __post_init__(self) -> None:
        # msgspec checks types when decoding, not when a Struct is built by hand: check here,
        # so a wrong type is a ConfigError now rather than a TypeError inside a running driver.
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            if f.name == "limits":
                ok = isinstance(value, Limits)
            elif f.name in ("tcp_keepalive", "native_receive"):
                ok = isinstance(value, bool)
            elif f.name.startswith("curve_"):
                ok = value is None or isinstance(value, str)
            elif value is None and f.name in ("rcvhwm", "max_sources"):
                ok = True
            elif isinstance(f.default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool)
            if not ok:
                raise ConfigError(f"{f.name} must be {_KIND.get(f.name, 'an int')}, not {value!r}")
        if (self.curve_public_key is None) != (self.curve_secret_key is None):
            raise ConfigError("curve_public_key and curve_secret_key go together")
        for name in ("replay_timeout", "quiet_interval", "reconnect_ivl", "replay_deadline", "replay_slice"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, not {value!r}")
        if not (math.isfinite(self.reconnect_ivl_max) and self.reconnect_ivl_max >= 0):
            raise ConfigError(f"reconnect_ivl_max must be a finite number >= 0, not {self.reconnect_ivl_max!r}")
        for name in (
            "max_concurrent_replays",
            "recv_batch",
            "events_buffer",
            "max_sources",
            "rcvhwm",
            "max_message_size",
            "queue_bytes",
            "wakeup_bytes",
            "held_bytes",
            "replay_budget",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, not {value!r}")
        if not 0 <= self.receive_nice <= 19:
            raise ConfigError(f"receive_nice must be in 0..19, not {self.receive_nice!r}")
        if self.max_message_size >= 1 << 63:
            raise ConfigError(f"max_message_size must be < 2**63, not {self.max_message_size}")

    def __repr__(self) -> str:
        # The secret key never reaches a log line or a traceback through repr.
        fields = ", ".join(
            f"{name}={'<secret>' if name == 'curve_secret_key' and value is not None else repr(value)}"
            for name, value in msgspec.structs.asdict(self).items()
        )
        return f"SubscriberConfig({fields})"

    def sub_rcvhwm(self, advertised: int | None) -> int:
        """The receive high-water mark a socket gets: the configured or advertised one, within the byte budget."""
        cap = max(1, self.queue_bytes // self.max_message_size)
        wanted = self.rcvhwm if self.rcvhwm is not None else advertised if advertised is not None else 1000
        # An advertised 0 is libzmq's "unlimited" (and a negative one is nonsense): the cap.
        return cap if wanted < 1 else min(wanted, cap)

    def reconnect_ms(self) -> tuple[int, int]:
        """``reconnect_ivl`` and ``reconnect_ivl_max`` in the compiled core's whole milliseconds.

        A positive interval never rounds down to 0 ms; a 0 maximum stays 0 (no back-off).
        """
        return max(1, round(self.reconnect_ivl * 1000)), max(0, round(self.reconnect_ivl_max * 1000))


def curve_keys(source: EventSource, config: SubscriberConfig) -> _zmq.CurveKeys | None:
    """The client's CURVE key pair for ``source``, when the source names a server key and the config has a pair."""
    if config.curve_public_key is None or config.curve_secret_key is None or source.curve_server_key is None:
        return None
    return _zmq.CurveKeys(config.curve_public_key, config.curve_secret_key)
