"""The second transport: a gateway servicer's ``SubscribeKvEvents`` gRPC stream (docs/protocol.md §6).

One stream per target (``host:port`` + service) carries every data-parallel rank; each rank is
one `EventSource` (endpoint ``grpc://host:port/<service>``) followed by a `GatewayRankDriver`
with its own `RecoveryMachine` (no replay endpoint: the servicer's relay fills gaps itself). The
drivers of one target share a `GatewayStream`, which reads the stream and hands each batch to
its rank. Stream semantics, and what this module does about them:

- The stream is the truth about which ranks exist. ``GetLoads`` (discovery's rank count) is a
  hint: a servicer reports a rank only once it has stats, so an engine that just started may
  name one rank while two publish. A batch for a rank no driver follows starts that rank
  (`GatewayTransport` asks the client to add its source, ``adopted_ranks`` counts it) as a source
  whose history begins with that batch; a live stream vouches for the ranks it carries, so
  discovery does not remove them while it does (`GatewayRankDriver.vouched`).

- A batch's ``sequence_number`` is its rank's own publisher seq: fed to that rank's machine,
  which detects gaps and restarts exactly as on ZMQ (a stream joined mid-life starts partial).
- ``load_only`` batches (heartbeats) repeat the last seq: their load is kept, nothing admitted.
- ``snapshot`` chunks: chunk 0 is `RecoveryMachine.on_resync` (the worker's state is replaced,
  exact when ``unknown_before`` is 0, partial otherwise), later chunks are ordinary batches
  (consecutive seqs).
- ``DATA_LOSS`` / ``OUT_OF_RANGE``: every rank's state is gone (`RecoveryMachine.on_data_loss`)
  and the stream is resubscribed from 0. Any other end is a disconnect; the next stream resumes
  with ``start_sequence_number`` when the target streams a single rank (a servicer that keeps
  history continues it; one that does not answers OUT_OF_RANGE, and resuming is not tried on
  that stream again), otherwise starts from 0 and the machines reset on reconnect.
- Reconnects back off exponentially (tenacity's policy), are counted and logged.

Batches are converted by `kvroute._wire_proto` (beside the msgpack codec); an event that
cannot be mapped is skipped and counted, a batch that does not parse, or names no finite
timestamp, is undecodable for its rank's machine (a gap it cannot fill: reset, partial).

grpcio's threaded API runs behind anyio worker threads (as discovery does), so asyncio and trio
both work.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final, Protocol

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
import grpc
import msgspec
import tenacity
from google.protobuf.message import DecodeError as ProtobufDecodeError

from .._grpc import answer_ended, open_channel, serialize
from .._index import PrefixIndex
from .._load import EngineLoad, EngineLoads
from .._models import GATEWAY_SERVICES, EventSource, is_gateway_endpoint, parse_gateway_endpoint
from .._proto import smg_common_pb2 as pb
from .._snapshot import Cursor
from .._source import Action, RecreateSubscriber
from .._tls import TlsConfig
from .._wire import Limits
from .._wire_proto import convert_batch, convert_load
from ._base import DriverBase, EventSink, RateLimitedLog

__all__ = ["ChannelOptions", "GatewayRankDriver", "GatewayStream", "GatewayTransport"]

log = logging.getLogger("kvroute.gateway")

# Reconnect back-off: 0.1 s doubling to 5 s, plus up to 0.1 s of jitter; reset by a stream that
# delivered anything.
_BACKOFF: Final = tenacity.wait_exponential(multiplier=0.1, max=5.0) + tenacity.wait_random(0, 0.1)
_RETRYING: Final = tenacity.Retrying(wait=_BACKOFF)
_DATA_LOSS: Final = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OUT_OF_RANGE})

#: Batches kept for a rank the stream just started, until its driver attaches (the client
#: starts it on its next loop turn: a handful at most arrive meanwhile).
_ADOPT_BACKLOG: Final = 1024


class ChannelOptions(Protocol):
    """What a stream needs of `kvroute.DiscoveryOptions` to open its channel."""

    @property
    def tls(self) -> TlsConfig | None:
        """TLS for the channel, or None for plaintext."""
        ...

    @property
    def metadata(self) -> Sequence[tuple[str, str | bytes]]:
        """Call metadata sent with the stream (credentials)."""
        ...


# --- one rank ----------------------------------------------------------------------------------------


class GatewayRankDriver(DriverBase):
    """Follows one rank of a gateway stream for the client (the `kvroute._transports._base.Driver` of gRPC)."""

    def __init__(
        self,
        source: EventSource,
        transport: GatewayTransport,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
    ) -> None:
        super().__init__(source, index=index, sink=sink, on_change=on_change, has_replay=False)
        self._transport = transport
        self._limits = transport.limits
        self._stream: GatewayStream | None = None

    async def run(self) -> None:
        """Join the target's shared stream until cancelled."""
        stream = self._transport.attach(self)
        self._stream = stream
        try:
            self.execute(self.first_actions())
            if stream.established:
                self.connect(continued=False)
            # Batches that arrived before this rank had a driver (it was started by them).
            for msg in stream.backlog.pop(self.source.dp_rank, ()):
                self.on_batch(msg)
            await anyio.sleep_forever()
        finally:
            self._transport.detach(self)
            self._stream = None
            self.connected = False

    def refresh_counters(self) -> None:
        """Messages that are not a ``KvEventBatch`` are the shared stream's, counted once for all ranks."""
        stream = self._stream
        self.counters.skipped_frames = stream.malformed if stream is not None else 0

    def load(self) -> EngineLoad | None:
        """The rank's newest load record from the stream."""
        return self._transport.loads.get(self.key)

    def vouched(self) -> bool:
        """The stream is live and has carried this rank's batches: the rank exists, whatever ``GetLoads`` says."""
        stream = self._stream
        return stream is not None and stream.established and self.source.dp_rank in stream.seen_ranks

    def streaming(self) -> str | None:
        """The service whose stream carries this rank, while that stream is established."""
        stream = self._stream
        return stream.service if stream is not None and stream.established else None

    # --- fed by the stream

    def connect(self, *, continued: bool) -> None:
        """The stream is established (``continued``: it resumes this rank's applied run)."""
        self.connected = True
        self.execute(self.machine.on_reconnected(continued=continued))

    def disconnect(self, *, data_loss: str | None) -> None:
        """The stream ended; ``data_loss`` names why the rank's state is gone, if it is."""
        was = self.connected
        self.connected = False
        if data_loss is not None:
            self.execute(self.machine.on_data_loss(data_loss))
        if was:
            self.execute(self.machine.on_disconnected())

    def on_batch(self, msg: pb.KvEventBatch) -> None:
        """One batch of this rank's stream."""
        c = self.counters
        c.messages += 1
        if msg.HasField("load"):
            self._transport.loads.update(self.key, convert_load(msg.load, time.monotonic()))
            if msg.load.load_only:
                return  # a heartbeat: its load is kept, nothing is admitted
        seq = msg.sequence_number
        batch, unknown, unusable = convert_batch(msg, self._limits)
        c.unknown_events += unknown + unusable
        if unusable:
            self._log.warn("unusable events", f"{unusable} event(s) of seq {seq} skipped")
        if batch is None:
            c.decode_errors += 1
            self._log.warn("undecodable batch", f"seq {seq}: non-finite timestamp or too many events")
        snap = msg.snapshot if msg.HasField("snapshot") else None
        if snap is not None and batch is not None and snap.count > 0 and snap.index == 0:
            self.execute(self.machine.on_resync(seq, batch.ts, batch, partial=snap.unknown_before > 0))
            return
        if snap is not None and not snap.index < snap.count:
            c.decode_errors += 1
            self._log.warn("malformed snapshot", f"seq {seq}: chunk {snap.index} of {snap.count}")
            batch = None
        self.execute(self.machine.on_live(seq, batch.ts if batch is not None else 0.0, batch))

    def on_action(self, action: Action) -> None:
        """A restart (`RecreateSubscriber`): the rank starts over on the same stream.

        One stream serves every rank, in the servicer's order: nothing a dead engine process
        sent can follow what its successor sent, so the rank starts over instead of ending
        the stream for all ranks.
        """
        if isinstance(action, RecreateSubscriber) and self.connected:
            self.execute(self.machine.on_reconnected())


# --- one stream per target ---------------------------------------------------------------------------


class _Reader:
    """Reads one call's messages in a worker thread; the event loop takes them in bursts.

    One loop wakeup per burst instead of one thread hop per message: the thread appends to a
    deque and wakes the loop only when the loop said it is waiting (checked after it says so,
    so no message is left behind).
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._buf: deque[bytes] = deque()
        self._ended = False
        self._waiting = False
        self._wakeup = anyio.Event()
        self.error: grpc.RpcError | None = None

    def _kick(self) -> None:
        self._wakeup.set()

    def _read(self) -> None:
        buf = self._buf
        try:
            for raw in self._call:
                buf.append(raw)
                if self._waiting:
                    self._waiting = False
                    anyio.from_thread.run_sync(self._kick)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self._ended = True
            with contextlib.suppress(anyio.RunFinishedError):
                anyio.from_thread.run_sync(self._kick)

    async def run(self) -> None:
        """Read until the call ends (its cancellation frees the thread)."""
        await anyio.to_thread.run_sync(self._read, abandon_on_cancel=True)

    async def take(self) -> list[bytes] | None:
        """Every message read so far (waiting for one), or None once the call has ended."""
        while True:
            if self._buf:
                out = list(self._buf)
                for _ in out:
                    self._buf.popleft()
                return out
            if self._ended:
                return None
            self._wakeup = anyio.Event()
            self._waiting = True
            if self._buf or self._ended:
                self._waiting = False
                continue
            await self._wakeup.wait()


class GatewayStream:
    """One ``SubscribeKvEvents`` stream, shared by the rank drivers of one target and service.

    Runs (`run`) while any rank is attached. Counters: ``streams`` opened, ``reconnects``
    (streams that ended and were reopened), ``data_losses``, ``malformed`` (messages that are
    not a ``KvEventBatch``), ``adopted_ranks`` (ranks the stream started because their batches
    came unannounced), ``unclaimed`` (batches of a rank no driver follows and the client refused
    to start). ``seen_ranks``: the ranks the current stream has carried.
    """

    def __init__(self, address: str, service: str, options: ChannelOptions, adopt: Callable[[int], bool]) -> None:
        self.address = address
        self.service = service
        self.method = f"/{service}/SubscribeKvEvents"
        self.ranks: dict[int, GatewayRankDriver] = {}
        #: Batches of ranks started by the stream, waiting for their driver.
        self.backlog: dict[int, list[pb.KvEventBatch]] = {}
        self.established = False
        self.resume_supported = True
        self.streams = 0
        self.reconnects = 0
        self.data_losses = 0
        self.malformed = 0
        self.adopted_ranks = 0
        self.unclaimed = 0
        self.seen_ranks: set[int] = set()
        self.scope = anyio.CancelScope()
        self._options = options
        self._metadata = tuple(options.metadata)
        self._adopt = adopt
        # Ranks the client refused to start on this stream (asked once per stream).
        self._refused: set[int] = set()
        self._log = RateLimitedLog(f"{address} {service}", log)

    async def run(self) -> None:
        """Subscribe, dispatch, resubscribe with back-off; until `scope` is cancelled."""
        failures = 0
        with self.scope:
            while True:
                start = self._resume_from()
                try:
                    delivered, code, detail = await self._session(start)
                except Exception as exc:  # containment: the client's other sources go on
                    # Something other than the stream failed (a channel that cannot be built, an
                    # index that raised): every rank's state is suspect, as after DATA_LOSS.
                    log.exception("%s %s: stream failed", self.address, self.service)
                    delivered, code, detail = False, grpc.StatusCode.DATA_LOSS, f"{type(exc).__name__}: {exc}"
                if code in _DATA_LOSS:
                    if start and code == grpc.StatusCode.OUT_OF_RANGE and not delivered:
                        # This servicer keeps no history to resume from; from now on, start at 0.
                        self.resume_supported = False
                    self.data_losses += 1
                    self._log.warn("stream lost data", f"{code.name}: {detail}; clearing and resubscribing from 0")
                    for drv in list(self.ranks.values()):
                        drv.disconnect(data_loss=f"{code.name}: {detail}")
                else:
                    for drv in list(self.ranks.values()):
                        drv.disconnect(data_loss=None)
                    name = code.name if code is not None else "no status"
                    self._log.warn("stream ended", f"{name}: {detail}")
                failures = 0 if delivered else failures + 1
                self.reconnects += 1
                if failures:
                    state = tenacity.RetryCallState(_RETRYING, None, (), {})
                    state.attempt_number = failures
                    await anyio.sleep(_BACKOFF(state))

    def _resume_from(self) -> int:
        """``start_sequence_number`` for the next stream: the single rank's next seq, or 0."""
        if not self.resume_supported or len(self.ranks) != 1:
            return 0
        (drv,) = self.ranks.values()
        applied = drv.machine.applied
        return applied[0] + 1 if applied is not None else 0

    async def _session(self, start: int) -> tuple[bool, grpc.StatusCode | None, str]:
        """One stream's life: (whether it delivered anything, its status code, details)."""
        channel = open_channel(self.address, self._options.tls)
        call: Any = None
        delivered = False
        try:
            request = pb.SubscribeKvEventsRequest(start_sequence_number=start, load_records_before_first_batch=True)
            stub = channel.unary_stream(self.method, request_serializer=serialize, response_deserializer=None)
            call = stub(request, metadata=self._metadata)
            self.streams += 1
            await anyio.to_thread.run_sync(call.initial_metadata, abandon_on_cancel=True)
            if not await answer_ended(call):
                self.established = True
                for drv in list(self.ranks.values()):
                    drv.connect(continued=bool(start))
            reader = _Reader(call)
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader.run)
                while True:
                    batch = await reader.take()
                    if batch is None:
                        break
                    delivered = True
                    for raw in batch:
                        self._dispatch(raw)
            if reader.error is not None:
                return delivered, reader.error.code(), reader.error.details() or ""
            return delivered, call.code(), call.details() or ""
        except grpc.RpcError as exc:
            return delivered, exc.code(), exc.details() or ""
        finally:
            self.established = False
            self.seen_ranks.clear()
            self.backlog.clear()
            self._refused.clear()
            if call is not None:
                call.cancel()
            channel.close()

    def _dispatch(self, raw: bytes) -> None:
        try:
            msg = pb.KvEventBatch.FromString(raw)
        except ProtobufDecodeError as exc:
            self.malformed += 1
            self._log.warn("malformed message", f"not a KvEventBatch: {exc}")
            return
        rank = msg.dp_rank if msg.HasField("dp_rank") else 0
        self.seen_ranks.add(rank)
        drv = self.ranks.get(rank)
        if drv is not None:
            drv.on_batch(msg)
            return
        backlog = self.backlog.get(rank)
        if backlog is None and rank not in self._refused:
            # A rank nobody announced (GetLoads leaves out a rank with no stats yet): the
            # stream says it exists, so it becomes a source whose history begins here.
            if self._adopt(rank):
                self.adopted_ranks += 1
                self._log.warn("rank started by the stream", f"rank {rank} was not announced; following it")
                backlog = self.backlog[rank] = []
            else:
                self._refused.add(rank)
        if backlog is not None and len(backlog) < _ADOPT_BACKLOG:
            backlog.append(msg)
            return
        # Refused, or more waiting than a driver about to start could be owed: its machine
        # sees the hole as a gap (partial), never a wrong claim.
        self.unclaimed += 1


class GatewayTransport:
    """The `kvroute._transports._base.Transport` of gateway streams: one shared `GatewayStream` per target and service.

    ``spawn`` starts a stream's task (the client's task group); ``loads`` receives every
    rank's engine load records; ``adopt(source, like)`` asks the client to follow ``source``,
    a rank the stream carries that no driver follows, the way it follows ``like`` (True when it
    does).
    """

    def __init__(
        self,
        limits: Limits,
        options: ChannelOptions,
        loads: EngineLoads,
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], object],
        adopt: Callable[[EventSource, EventSource], bool],
    ) -> None:
        self.limits = limits
        self.options = options
        self.loads = loads
        self._spawn = spawn
        self._adopt = adopt
        self.streams: dict[tuple[str, str], GatewayStream] = {}

    def handles(self, source: EventSource) -> bool:
        """Sources whose endpoint is ``grpc://host:port/<service>``."""
        return is_gateway_endpoint(source.endpoint)

    def hold(self) -> bool:
        """Nothing to hold: a stream's batches are applied on the event loop (`Transport.hold`). False."""
        return False

    def release(self) -> None:
        """Nothing was held (`Transport.release`)."""

    def problem(self, source: EventSource) -> str | None:
        """Why ``source`` is not a usable gateway rank, or None."""
        if parse_gateway_endpoint(source.endpoint) is None:
            return f"not a gateway stream endpoint (grpc://host:port/<one of {', '.join(GATEWAY_SERVICES)}>)"
        if source.replay_endpoint is not None:
            return "a gateway stream has no replay endpoint (its relay fills gaps)"
        return None

    def driver(
        self,
        source: EventSource,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
        resume: Cursor | None,
    ) -> GatewayRankDriver:
        """A rank driver; a restored position cannot be vouched for, so ``resume`` is not used."""
        return GatewayRankDriver(source, self, index=index, sink=sink, on_change=on_change)

    def live(self, address: str, service: str) -> bool:
        """Whether ``service``'s stream at ``address`` is established now (the target's proof of life)."""
        stream = self.streams.get((address, service))
        return stream is not None and stream.established

    def attach(self, drv: GatewayRankDriver) -> GatewayStream:
        """Join ``drv`` to its target's stream, starting the stream if it is the first rank."""
        parsed = parse_gateway_endpoint(drv.source.endpoint)
        assert parsed is not None  # refused by problem() otherwise
        stream = self.streams.get(parsed)
        if stream is None:
            template = drv.source

            def adopt(rank: int) -> bool:
                return self._adopt(msgspec.structs.replace(template, dp_rank=rank), template)

            stream = self.streams[parsed] = GatewayStream(parsed[0], parsed[1], self.options, adopt)
            self._spawn(stream.run)
        stream.ranks[drv.source.dp_rank] = drv
        return stream

    def detach(self, drv: GatewayRankDriver) -> None:
        """Leave the stream; the last rank to leave stops it."""
        parsed = parse_gateway_endpoint(drv.source.endpoint)
        stream = self.streams.get(parsed) if parsed is not None else None
        if stream is None:
            return
        if stream.ranks.get(drv.source.dp_rank) is drv:
            del stream.ranks[drv.source.dp_rank]
        self.loads.remove(drv.key)
        if not stream.ranks:
            stream.scope.cancel()
            del self.streams[parsed]  # type: ignore[arg-type]
