"""The second transport: a gateway servicer's ``SubscribeKvEvents`` gRPC stream (docs/protocol.md §6).

One stream per target (``host:port`` + service) carries every data-parallel rank; each rank is
one `EventSource` (endpoint ``grpc://host:port/<service>``) followed by a `GatewayRankDriver`
with its own `SourceMachine` (no replay endpoint: the servicer's relay fills gaps itself). The
drivers of one target share a `GatewayStream`, which reads the stream and hands each batch to
its rank. Stream semantics, and what this module does about them:

- A batch's ``sequence_number`` is its rank's own publisher seq: fed to that rank's machine,
  which detects gaps and restarts exactly as on ZMQ (a stream joined mid-life starts partial).
- ``load_only`` batches (heartbeats) repeat the last seq: their load is kept, nothing admitted.
- ``snapshot`` chunks: chunk 0 is `SourceMachine.on_resync` (the worker's state is replaced,
  partial when ``unknown_before`` > 0), later chunks are ordinary batches (consecutive seqs).
- ``DATA_LOSS`` / ``OUT_OF_RANGE``: every rank's state is gone (`SourceMachine.on_data_loss`)
  and the stream is resubscribed from 0. Any other end is a disconnect; the next stream resumes
  with ``start_sequence_number`` when the target streams a single rank (a servicer that keeps
  history continues it; one that does not answers OUT_OF_RANGE, and resuming is not tried on
  that stream again), otherwise starts from 0 and the machines reset on reconnect.
- Reconnects back off exponentially (tenacity's policy), are counted and logged.

Events map onto the same Structs the msgpack decoder produces (`kvroute._wire`): int64 hashes
fold onto uint64, ``tier`` (else the raw ``medium``, else the legacy ``cache_level``) becomes
``medium``, extra keys become the msgpack shapes (text, bytes, int, ``[identifier, offset]``).
An event that cannot be mapped (blocks of different sizes, an extra key of unknown kind, too
many blocks) is skipped and counted; a batch that does not parse, or names no finite timestamp,
is undecodable for its rank's machine (a gap it cannot fill: reset, partial).

grpcio's threaded API runs behind anyio worker threads (as discovery does), so asyncio and trio
both work.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
import grpc
import msgspec
import tenacity
from google.protobuf.message import DecodeError as ProtobufDecodeError

from ._events import LifecycleEvent
from ._index import PrefixIndex
from ._load import EngineLoad, EngineLoads
from ._models import EventSource, WorkerStatus
from ._proto import smg_common_pb2 as pb
from ._snapshot import Cursor
from ._source import Action, Apply, Emit, RecreateSubscriber, ResetWorker, SourceMachine
from ._subscriber import (
    EventSink,
    RateLimitedLog,
    SourceCounters,
    SourceStats,
    SubscriberConfig,
    apply_items,
    emit_lifecycle,
)
from ._tls import TlsConfig
from ._wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent, EventBatch, Limits


class ChannelOptions(Protocol):
    """What a stream needs of `kvroute.DiscoveryOptions` to open its channel (discovery imports this module)."""

    @property
    def tls(self) -> TlsConfig | None: ...

    @property
    def metadata(self) -> Sequence[tuple[str, str | bytes]]: ...

__all__ = [
    "GATEWAY_SERVICES",
    "GatewayRankDriver",
    "GatewayStream",
    "GatewayTransport",
    "convert_batch",
    "gateway_endpoint",
    "parse_gateway_endpoint",
]

log = logging.getLogger("kvroute.gateway")

#: The gateway servicers' service names and the engine each fronts.
GATEWAY_SERVICES: Final = {
    "vllm.grpc.engine.VllmEngine": "vllm",
    "sglang.grpc.scheduler.SglangScheduler": "sglang",
    "trtllm.TrtllmService": "trtllm",
    "mlx.grpc.engine.MlxEngine": "mlx",
    "tokenspeed.grpc.scheduler.TokenSpeedScheduler": "tokenspeed",
}
_SCHEME: Final = "grpc://"
_MASK64: Final = (1 << 64) - 1
_SEQ_END: Final = (1 << 64) - 1

_TIER_MEDIUM: Final = {
    pb.KV_CACHE_TIER_DEVICE: "GPU",
    pb.KV_CACHE_TIER_HOST: "CPU",
    pb.KV_CACHE_TIER_DISK: "DISK",
    pb.KV_CACHE_TIER_EXTERNAL: "EXTERNAL",
}
_LEVEL_MEDIUM: Final = {0: "GPU", 1: "CPU", 2: "DISK", 3: "EXTERNAL"}
_LOCALITY: Final = {pb.KV_CACHE_LOCALITY_LOCAL: "LOCAL", pb.KV_CACHE_LOCALITY_REMOTE: "REMOTE"}

# Reconnect back-off: 0.1 s doubling to 5 s, plus up to 0.1 s of jitter; reset by a stream that
# delivered anything.
_BACKOFF: Final = tenacity.wait_exponential(multiplier=0.1, max=5.0) + tenacity.wait_random(0, 0.1)
_RETRYING: Final = tenacity.Retrying(wait=_BACKOFF)
_DATA_LOSS: Final = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OUT_OF_RANGE})


def gateway_endpoint(address: str, service: str) -> str:
    """The `EventSource.endpoint` of a rank of ``service``'s stream at ``address`` (``host:port``)."""
    return f"{_SCHEME}{address}/{service}"


def parse_gateway_endpoint(endpoint: str) -> tuple[str, str] | None:
    """``(address, service)`` of a gateway endpoint, or None when ``endpoint`` is not one."""
    if not endpoint.startswith(_SCHEME):
        return None
    address, sep, service = endpoint[len(_SCHEME) :].partition("/")
    if not sep or not address or service not in GATEWAY_SERVICES:
        return None
    return address, service


# --- mapping the proto onto the msgpack Structs ---------------------------------------------------


class _Unusable(Exception):
    """One event that cannot be mapped; it is skipped and counted."""


def _medium(msg: Any, level: int | None) -> str | None:
    if msg.HasField("tier") and msg.tier in _TIER_MEDIUM:
        return _TIER_MEDIUM[msg.tier]
    if msg.HasField("medium") and msg.medium:
        return str(msg.medium)
    if level is not None:
        return _LEVEL_MEDIUM.get(level, "EXTERNAL")
    return None


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _extra_key(key: pb.KvBlockExtraKey) -> Any:
    kind = key.WhichOneof("key")
    if kind == "text":
        return key.text
    if kind == "blob":
        return bytes(key.blob)
    if kind == "number":
        return key.number
    if kind == "multimodal":
        return [key.multimodal.identifier, key.multimodal.offset]
    # A key kvroute cannot read would change what the block's content key means: dropping it
    # could make the block look like one without it, so the event goes instead.
    raise _Unusable("extra key of unknown kind")


def _stored(ev: pb.KvBlocksStored, limits: Limits) -> BlockStored:
    blocks = ev.blocks
    if len(blocks) > limits.max_blocks_per_event:
        raise _Unusable(f"{len(blocks)} blocks in one event")
    bs = blocks[0].block_size if blocks else 0
    if blocks and not 0 < bs <= limits.max_block_size:
        raise _Unusable(f"block_size {bs}")
    tokens: list[int] = []
    hashes: list[int | bytes] = []
    keyed = False
    for i, b in enumerate(blocks):
        if b.block_size != bs:
            raise _Unusable("blocks of different sizes in one event")
        n = len(b.token_ids)
        if n != bs and not (i == len(blocks) - 1 and 0 < n < bs):
            raise _Unusable(f"block {i} has {n} tokens, block_size {bs}")
        tokens.extend(b.token_ids)
        hashes.append(b.block_hash & _MASK64)
        keyed = keyed or len(b.extra_keys) > 0
    extra = [[_extra_key(k) for k in b.extra_keys] or None for b in blocks] if keyed else None
    first = blocks[0] if blocks else None
    level = first.cache_level if first is not None and first.HasField("cache_level") else None
    parent = ev.parent_block_hash & _MASK64 if ev.HasField("parent_block_hash") else None
    locality = _LOCALITY.get(ev.locality) if ev.HasField("locality") else None
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=bs,
        lora_id=first.lora_id if first is not None and first.HasField("lora_id") else None,
        medium=_medium(ev, level),
        lora_name=_opt(ev, "lora_name") or None,
        extra_keys=extra,
        group_idx=_opt(ev, "group_idx"),
        kv_cache_spec_kind=_opt(ev, "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt(ev, "kv_cache_spec_sliding_window"),
        locality=locality,
        ownership=_opt(ev, "ownership"),
        session_id=_opt(ev, "session_id"),
        cache_salt=_opt(ev, "cache_salt") or None,
    )


def _removed(ev: pb.KvBlocksRemoved, limits: Limits) -> BlockRemoved:
    if len(ev.block_hashes) > limits.max_blocks_per_event:
        raise _Unusable(f"{len(ev.block_hashes)} hashes in one removal")
    level = ev.cache_level if ev.HasField("cache_level") else None
    return BlockRemoved(
        block_hashes=[h & _MASK64 for h in ev.block_hashes],
        medium=_medium(ev, level),
        group_idx=_opt(ev, "group_idx"),
        locality=_LOCALITY.get(ev.locality) if ev.HasField("locality") else None,
        ownership=_opt(ev, "ownership"),
    )


def convert_batch(msg: pb.KvEventBatch, limits: Limits) -> tuple[EventBatch | None, int, int]:
    """``msg`` as an `EventBatch`, with the counts of unknown and unusable events skipped.

    The batch is None when it cannot be used at all (a timestamp that is not finite, more
    events than ``limits`` allow): its seq is then lost to the rank.
    """
    if not math.isfinite(msg.timestamp) or len(msg.events) > limits.max_events_per_batch:
        return None, 0, 0
    events: list[EngineEvent] = []
    unknown = unusable = 0
    for ev in msg.events:
        kind = ev.WhichOneof("data")
        try:
            if kind == "stored":
                events.append(_stored(ev.stored, limits))
            elif kind == "removed":
                events.append(_removed(ev.removed, limits))
            elif kind == "cleared":
                events.append(AllBlocksCleared())
            else:
                unknown += 1
        except _Unusable:
            unusable += 1
    rank = msg.dp_rank if msg.HasField("dp_rank") else None
    return EventBatch(ts=msg.timestamp, events=events, data_parallel_rank=rank), unknown, unusable


def _load(msg: pb.EngineLoad, received: float) -> EngineLoad:
    return EngineLoad(
        running_requests=msg.running_requests,
        waiting_requests=msg.waiting_requests,
        waiting_uncached_tokens=_opt(msg, "waiting_uncached_tokens"),
        token_usage=msg.token_usage,
        active_token_usage=_opt(msg, "active_token_usage"),
        gen_throughput=msg.gen_throughput,
        max_running_requests=msg.max_running_requests,
        age_ms=msg.age_ms,
        sample=msg.sample,
        engine_silence_ms=_opt(msg, "engine_silence_ms"),
        engine_reports_steps=_opt(msg, "engine_reports_steps"),
        prefill_pending_tokens=_opt(msg, "prefill_pending_tokens"),
        received=received,
    )


# --- one rank ----------------------------------------------------------------------------------------


class GatewayRankDriver:
    """Follows one rank of a gateway stream for the client (the `kvroute._transport.Driver` of gRPC)."""

    def __init__(
        self,
        source: EventSource,
        transport: GatewayTransport,
        *,
        index: PrefixIndex,
        sink: EventSink,
        on_change: Callable[[], None],
    ) -> None:
        self.source = source
        self.key = source.key
        # One set of counters, shared with the machine (as the ZMQ driver does): SourceStats and
        # the Prometheus families are derived from its fields.
        self.counters = SourceCounters()
        self.machine = SourceMachine(has_replay=False, stats=self.counters)
        self._transport = transport
        self._index = index
        self._sink = sink
        self._on_change = on_change
        self._limits = transport.config.limits
        self._log = RateLimitedLog(f"{source.worker_id}[{source.dp_rank}] {source.endpoint}")
        self._stopped = False
        self._stream: GatewayStream | None = None
        self.connected = False

    # --- the Driver interface

    async def run(self) -> None:
        """Join the target's shared stream until cancelled."""
        stream = self._transport.attach(self)
        self._stream = stream
        try:
            self.execute(self.machine.start())
            if stream.established:
                self.connect(continued=False)
            await anyio.sleep_forever()
        finally:
            self._transport.detach(self)
            self._stream = None
            self.connected = False

    def stop(self) -> None:
        """Stop touching the index and the listeners."""
        self._stopped = True

    def status(self) -> WorkerStatus:
        """The worker's sync state as the router reads it."""
        return WorkerStatus(state=self.machine.state, partial=self.machine.partial)

    def cursor(self) -> Cursor | None:
        """The newest applied seq and its ts (`SourceMachine.applied`)."""
        applied = self.machine.applied
        return Cursor(*applied) if applied is not None else None

    def stats(self) -> SourceStats:
        """This rank's counters, with its newest engine load record."""
        m = self.machine
        stream = self._stream
        counters = msgspec.structs.asdict(self.counters)
        counters["skipped_frames"] = stream.malformed if stream is not None else 0
        return SourceStats(
            **counters,
            last_seq=m.last_seq,
            connected=self.connected,
            partial=m.partial,
            state=m.state,
            load=self._transport.loads.get(self.key),
        )

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
            self._transport.loads.update(self.key, _load(msg.load, time.monotonic()))
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

    def execute(self, actions: Sequence[Action]) -> None:
        """Carry out the machine's actions against the index and the listeners."""
        if self._stopped:
            return
        changed = False
        reconnect = False
        for action in actions:
            if isinstance(action, Apply):
                self._apply(action.items)
            elif isinstance(action, Emit):
                self._emit(action.event)
                changed = True
            elif isinstance(action, ResetWorker):
                self._index.remove_worker(self.key)
            elif isinstance(action, RecreateSubscriber):
                # One stream serves every rank, in the servicer's order: nothing a dead engine
                # process sent can follow what its successor sent, so the rank starts over on
                # the same stream instead of ending it for all ranks.
                reconnect = True
        if changed:
            self._on_change()
        if reconnect and self.connected:
            self.execute(self.machine.on_reconnected())

    def _apply(self, items: Sequence[tuple[int, float, EventBatch]]) -> None:
        self.counters.blocks += apply_items(self._index, self.source, self._sink, items)

    def _emit(self, event: LifecycleEvent) -> None:
        emit_lifecycle(self._log, self._sink, self.source, event)


# --- one stream per target ---------------------------------------------------------------------------


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


#: How long after a call's headers its status may still arrive: a refusal (UNIMPLEMENTED,
#: OUT_OF_RANGE) comes as a trailers-only answer, whose headers grpc can hand out a moment
#: before it marks the call done.
_ANSWER_GRACE: Final = 0.2


async def _ended(call: Any) -> bool:
    """Whether the call ended with its headers (a refusal) rather than starting to stream."""

    def wait() -> bool:
        try:
            call.exception(timeout=_ANSWER_GRACE)
        except grpc.FutureTimeoutError:
            return False
        except grpc.FutureCancelledError:
            return True
        return True

    return await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)


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
    not a ``KvEventBatch``), ``unclaimed`` (batches of a rank no driver follows; their ranks
    are in ``seen_ranks``).
    """

    def __init__(self, address: str, service: str, options: ChannelOptions) -> None:
        self.address = address
        self.service = service
        self.method = f"/{service}/SubscribeKvEvents"
        self.ranks: dict[int, GatewayRankDriver] = {}
        self.established = False
        self.resume_supported = True
        self.streams = 0
        self.reconnects = 0
        self.data_losses = 0
        self.malformed = 0
        self.unclaimed = 0
        self.seen_ranks: set[int] = set()
        self.scope = anyio.CancelScope()
        self._options = options
        self._metadata = tuple(options.metadata)
        self._log = RateLimitedLog(f"{address} {service}", log)

    def _channel(self) -> grpc.Channel:
        opts: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]
        tls = self._options.tls
        if tls is None:
            return grpc.insecure_channel(self.address, options=opts)
        creds = tls.credentials(self.address)
        if tls.server_name:
            opts.append(("grpc.ssl_target_name_override", tls.server_name))
        return grpc.secure_channel(self.address, creds, options=opts)

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
        channel = self._channel()
        call: Any = None
        delivered = False
        try:
            request = pb.SubscribeKvEventsRequest(start_sequence_number=start, load_records_before_first_batch=True)
            stub = channel.unary_stream(self.method, request_serializer=_serialize, response_deserializer=None)
            call = stub(request, metadata=self._metadata)
            self.streams += 1
            await anyio.to_thread.run_sync(call.initial_metadata, abandon_on_cancel=True)
            if not await _ended(call):
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
        drv = self.ranks.get(rank)
        if drv is None:
            self.seen_ranks.add(rank)
            self.unclaimed += 1
            return
        drv.on_batch(msg)


class GatewayTransport:
    """The `kvroute._transport.Transport` of gateway streams: one shared `GatewayStream` per target and service.

    ``spawn`` starts a stream's task (the client's task group); ``loads`` receives every
    rank's engine load records.
    """

    def __init__(
        self,
        config: SubscriberConfig,
        options: ChannelOptions,
        loads: EngineLoads,
        spawn: Callable[[GatewayStream], None],
    ) -> None:
        self.config = config
        self.options = options
        self.loads = loads
        self._spawn = spawn
        self.streams: dict[tuple[str, str], GatewayStream] = {}

    def handles(self, source: EventSource) -> bool:
        """Sources whose endpoint is ``grpc://host:port/<service>``."""
        return source.endpoint.startswith(_SCHEME)

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

    def attach(self, drv: GatewayRankDriver) -> GatewayStream:
        """Join ``drv`` to its target's stream, starting the stream if it is the first rank."""
        parsed = parse_gateway_endpoint(drv.source.endpoint)
        assert parsed is not None  # refused by problem() otherwise
        stream = self.streams.get(parsed)
        if stream is None:
            stream = self.streams[parsed] = GatewayStream(parsed[0], parsed[1], self.options)
            self._spawn(stream)
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


# --- discovery ---------------------------------------------------------------------------------------


async def probe_stream(
    channel: grpc.Channel, service: str, metadata: Sequence[tuple[str, str | bytes]], deadline: float
) -> grpc.RpcError | None:
    """Open ``service``'s ``SubscribeKvEvents`` on ``channel``: None when it streams, else the ended call.

    A servicer with no publisher answers UNIMPLEMENTED, as does a server without the service.
    The stream is cancelled as soon as its headers arrive; ``deadline``: seconds the call may take.
    """
    stub = channel.unary_stream(
        f"/{service}/SubscribeKvEvents", request_serializer=_serialize, response_deserializer=None
    )
    call: Any = stub(pb.SubscribeKvEventsRequest(), timeout=deadline, metadata=tuple(metadata))
    try:
        await anyio.to_thread.run_sync(call.initial_metadata, abandon_on_cancel=True)
        if await _ended(call) and call.code() != grpc.StatusCode.OK:
            err: grpc.RpcError = call  # the ended call is the RpcError grpc would raise
            return err
        return None
    finally:
        call.cancel()


def gateway_sources(target: str, address: str, service: str, ranks: int, worker_id: str) -> list[EventSource]:
    """One `EventSource` per rank of ``service``'s stream at ``address``."""
    endpoint = gateway_endpoint(address, service)
    engine = GATEWAY_SERVICES[service]
    return [
        EventSource(worker_id=worker_id, dp_rank=r, endpoint=endpoint, engine=engine, target=target)
        for r in range(max(1, ranks))
    ]
