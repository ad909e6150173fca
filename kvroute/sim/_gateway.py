"""A simulated gateway servicer: ``SubscribeKvEvents`` as the Shepherd Model Gateway serves it (docs/protocol.md §6).

``GatewayKvService(ranks=2, service="vllm.grpc.engine.VllmEngine")`` is told every batch the
engine's publishers sent (`record`, already in order: the relay it stands for fills gaps from
replay) and streams them to every subscriber as ``KvEventBatch`` protos under each rank's own
seq, with the engine's load (``load`` callback) on every batch and ``load_only`` heartbeats
while nothing flows. It keeps, per rank, a bounded history (``history`` batches) and the live
blocks it has seen, which is what a zero cursor is served from:

- the history still reaches the rank's seq 0: the history, then live batches;
- otherwise (history rolled, or the record began mid-life, e.g. after a servicer restart): a
  snapshot, ``KvSnapshotChunk`` s with consecutive seqs ending at the rank's last seq, chunk 0
  beginning with AllBlocksCleared, one Stored per physical copy, parents first, and
  ``unknown_before`` = the first seq the record holds (0 when it covers the whole life);
- nothing recorded yet: live only.

A non-zero ``start_sequence_number`` resumes a single-rank stream from its history, and is
refused with OUT_OF_RANGE when the history does not hold it (or the engine has several ranks).
A publisher restart (a seq that goes back) or `lose` (a gap the relay could not fill) ends
every stream with DATA_LOSS and starts the rank's record over. `inject` sends raw bytes on every
stream (malformed messages); `fail_next` fails the next calls. ``GetLoads`` answers the rank
count, as the vLLM, SGLang and TokenSpeed servicers do.

Threads: the server is grpc's threaded one (as the discovery services); a stream's handler
thread waits on its own queue, and every piece of state lives on the event loop.
"""

from __future__ import annotations

import contextlib
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.from_thread
import grpc

from .._models import GATEWAY_SERVICES, normalize_medium
from .._proto import smg_common_pb2 as pb
from .._wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from ._grpc import _Abort, _Service

__all__ = ["GatewayKvService", "LoadFigures", "batch_to_proto"]

_I64 = 1 << 63
_TIERS = {
    "GPU": pb.KV_CACHE_TIER_DEVICE,
    "CPU": pb.KV_CACHE_TIER_HOST,
    "DISK": pb.KV_CACHE_TIER_DISK,
    "EXTERNAL": pb.KV_CACHE_TIER_EXTERNAL,
}

#: A rank's load as the sim reports it: running, waiting, waiting uncached tokens, KV usage,
#: prefill pending tokens, engine silence in ms (None: not wedged / unknown).
LoadFigures = tuple[int, int, int, float, int, int | None]


def _fold(h: int | bytes) -> int:
    """An engine hash as the proto's int64 (a digest folds to its last 8 bytes, as the relay does)."""
    v = int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & ((1 << 64) - 1)
    return v - (1 << 64) if v >= _I64 else v


def _extra(key: Any) -> pb.KvBlockExtraKey:
    if isinstance(key, str):
        return pb.KvBlockExtraKey(text=key)
    if isinstance(key, bytes):
        return pb.KvBlockExtraKey(blob=key)
    if isinstance(key, int):
        return pb.KvBlockExtraKey(number=key)
    ident, offset = key
    return pb.KvBlockExtraKey(multimodal=pb.KvMultimodalKey(identifier=str(ident), offset=int(offset)))


def _stored_proto(ev: BlockStored) -> pb.KvBlocksStored:
    bs = ev.block_size
    out = pb.KvBlocksStored(tier=_TIERS[normalize_medium(ev.medium)], locality=pb.KV_CACHE_LOCALITY_LOCAL)
    for i, h in enumerate(ev.block_hashes):
        block = out.blocks.add(block_hash=_fold(h), token_ids=ev.token_ids[i * bs : (i + 1) * bs], block_size=bs)
        keys = ev.extra_keys[i] if ev.extra_keys is not None and i < len(ev.extra_keys) else None
        for key in keys or ():
            block.extra_keys.append(_extra(key))
    if ev.parent_block_hash is not None:
        out.parent_block_hash = _fold(ev.parent_block_hash)
    if ev.medium is not None:
        out.medium = ev.medium
    if ev.lora_name is not None:
        out.lora_name = ev.lora_name
    return out


def batch_to_proto(seq: int, batch: EventBatch, rank: int) -> pb.KvEventBatch:
    """A published batch as the servicer streams it (stores, removals, clears; placeholders dropped)."""
    out = pb.KvEventBatch(sequence_number=seq, timestamp=batch.ts, dp_rank=rank)
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if ev.block_hashes and ev.token_ids:
                out.events.add(stored=_stored_proto(ev))
        elif isinstance(ev, BlockRemoved):
            removed = pb.KvBlocksRemoved(
                block_hashes=[_fold(h) for h in ev.block_hashes],
                tier=_TIERS[normalize_medium(ev.medium)],
                locality=pb.KV_CACHE_LOCALITY_LOCAL,
            )
            out.events.add(removed=removed)
        elif isinstance(ev, AllBlocksCleared):
            out.events.add(cleared=pb.KvCacheCleared())
    return out


class _Record:
    """What the servicer knows of one rank: its history window and its live blocks."""

    def __init__(self, history: int) -> None:
        self.history: deque[pb.KvEventBatch] = deque(maxlen=history)
        self.first: int | None = None  # the first seq this record holds (None: nothing yet)
        self.last = -1
        self.last_ts = 0.0
        # (tier, hash) -> [single-block Stored event, physical copies], in store order.
        self.blocks: dict[tuple[int, int], list[Any]] = {}

    def apply(self, msg: pb.KvEventBatch) -> None:
        if self.first is None:
            self.first = msg.sequence_number
        self.last = msg.sequence_number
        self.last_ts = msg.timestamp
        self.history.append(msg)
        for ev in msg.events:
            kind = ev.WhichOneof("data")
            if kind == "cleared":
                self.blocks.clear()
            elif kind == "stored":
                st = ev.stored
                parent = st.parent_block_hash if st.HasField("parent_block_hash") else None
                for b in st.blocks:
                    one = pb.KvBlocksStored(tier=st.tier, locality=st.locality)
                    one.blocks.append(b)
                    if parent is not None:
                        one.parent_block_hash = parent
                    if st.HasField("medium"):
                        one.medium = st.medium
                    if st.HasField("lora_name"):
                        one.lora_name = st.lora_name
                    entry = self.blocks.get((st.tier, b.block_hash))
                    if entry is None:
                        self.blocks[(st.tier, b.block_hash)] = [one, 1]
                    else:
                        entry[1] += 1
                    parent = b.block_hash
            elif kind == "removed":
                rm = ev.removed
                for h in rm.block_hashes:
                    entry = self.blocks.get((rm.tier, h))
                    if entry is None:
                        continue
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self.blocks[(rm.tier, h)]

    def reaches_start(self) -> bool:
        return bool(self.history) and self.history[0].sequence_number == 0

    def snapshot(self, rank: int, chunk_blocks: int) -> list[pb.KvEventBatch]:
        """The live blocks as snapshot chunks, parents before children, ending at ``last``."""
        ordered: list[pb.KvBlocksStored] = []
        emitted: set[tuple[int, int]] = set()
        for key in self.blocks:
            chain = []
            k: tuple[int, int] | None = key
            while k is not None and k in self.blocks and k not in emitted:
                chain.append(k)
                emitted.add(k)
                one = self.blocks[k][0]
                k = (key[0], one.parent_block_hash) if one.HasField("parent_block_hash") else None
            for c in reversed(chain):
                ordered.extend([self.blocks[c][0]] * self.blocks[c][1])
        count = max(1, min(self.last + 1, math.ceil(len(ordered) / chunk_blocks)))
        per = math.ceil(len(ordered) / count) if ordered else 0
        out = []
        for i in range(count):
            msg = pb.KvEventBatch(sequence_number=self.last - (count - 1) + i, timestamp=self.last_ts, dp_rank=rank)
            msg.snapshot.CopyFrom(
                pb.KvSnapshotChunk(index=i, count=count, blocks=len(ordered), unknown_before=self.first or 0)
            )
            if i == 0:
                msg.events.add(cleared=pb.KvCacheCleared())
            for st in ordered[i * per : (i + 1) * per]:
                msg.events.add(stored=st)
            out.append(msg)
        return out


class _Stream:
    """One subscriber: its queue (read by the handler thread) and the last seq sent per rank."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[bytes | _Abort] = queue.SimpleQueue()
        self.last_sent: dict[int, int] = {}


class GatewayKvService(_Service):
    """The gateway servicer's ``SubscribeKvEvents`` (and ``GetLoads`` rank count); see the module docstring.

    ``load(rank)``: the rank's `LoadFigures`, or None for no load record. ``heartbeat``: seconds
    of silence before a ``load_only`` batch. ``chunk_blocks``: blocks per snapshot chunk.
    """

    def __init__(
        self,
        *,
        ranks: int = 1,
        service: str = "vllm.grpc.engine.VllmEngine",
        load: Callable[[int], LoadFigures | None] | None = None,
        history: int = 10_000,
        heartbeat: float = 0.5,
        chunk_blocks: int = 256,
        api_key: str | None = None,
    ) -> None:
        if service not in GATEWAY_SERVICES:
            raise ValueError(f"unknown gateway service {service!r}")
        if ranks < 1 or history < 1 or chunk_blocks < 1 or not heartbeat > 0:
            raise ValueError("ranks, history and chunk_blocks must be >= 1, heartbeat > 0")
        super().__init__(api_key=api_key)
        self.service_name = service
        self.ranks = ranks
        self.load = load
        self.heartbeat = heartbeat
        self.chunk_blocks = chunk_blocks
        self._history = history
        self._records = [_Record(history) for _ in range(ranks)]
        self._streams: set[_Stream] = set()
        self._sample = 0
        #: Counters: streams opened, snapshots served, DATA_LOSS endings, OUT_OF_RANGE refusals.
        self.streams_opened = 0
        self.snapshots_served = 0
        self.data_losses = 0
        self.refusals = 0

    @property
    def subscribers(self) -> int:
        """Streams currently open."""
        return len(self._streams)

    # --- fed by the engine (on the event loop)

    def record(self, rank: int, seq: int, batch: EventBatch) -> None:
        """The engine's publisher of ``rank`` sent ``batch`` as ``seq``: record it and stream it."""
        rec = self._records[rank]
        if rec.first is not None and seq <= rec.last:
            self._lose(rank, f"publisher of rank {rank} restarted its sequence at {seq} after {rec.last}")
            rec = self._records[rank]
        msg = batch_to_proto(seq, batch, rank)
        rec.apply(msg)
        self._stamp(msg)
        data = msg.SerializeToString()
        for stream in self._streams:
            stream.last_sent[rank] = seq
            stream.queue.put(data)

    def lose(self, rank: int) -> None:
        """A gap on ``rank`` the relay could not fill: DATA_LOSS on every stream, the rank's record starts over."""
        self._lose(rank, f"KV event replay of rank {rank} could not fill a gap")

    def _lose(self, rank: int, why: str) -> None:
        self._records[rank] = _Record(self._history)
        for stream in self._streams:
            stream.queue.put(_Abort(grpc.StatusCode.DATA_LOSS, why))
            self.data_losses += 1
        self._streams.clear()

    def inject(self, data: bytes) -> None:
        """Send raw bytes as one message on every open stream (a malformed batch)."""
        for stream in self._streams:
            stream.queue.put(data)

    def end_streams(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """End every open stream with ``code`` (the records stay)."""
        for stream in self._streams:
            stream.queue.put(_Abort(code, "stream ended by the simulated servicer"))
        self._streams.clear()

    # --- load

    def _load_proto(self, rank: int, load_only: bool) -> pb.EngineLoad | None:
        figures = self.load(rank) if self.load is not None else None
        if figures is None:
            return None
        running, waiting, uncached, usage, pending, silence = figures
        self._sample += 1
        out = pb.EngineLoad(
            running_requests=running,
            waiting_requests=waiting,
            waiting_uncached_tokens=uncached,
            token_usage=usage,
            sample=self._sample,
            load_only=load_only,
            prefill_pending_tokens=pending,
        )
        if silence is not None:
            out.engine_silence_ms = silence
        return out

    def _stamp(self, msg: pb.KvEventBatch) -> None:
        load = self._load_proto(msg.dp_rank, False)
        if load is not None:
            msg.load.CopyFrom(load)

    def _heartbeats(self, stream: _Stream) -> list[bytes]:
        out = []
        for rank in range(self.ranks):
            load = self._load_proto(rank, True)
            if load is None:
                continue
            msg = pb.KvEventBatch(sequence_number=stream.last_sent.get(rank, 0), timestamp=time.time(), dp_rank=rank)
            msg.load.CopyFrom(load)
            out.append(msg.SerializeToString())
        return out

    # --- serving

    def _open(self, request: pb.SubscribeKvEventsRequest) -> tuple[_Stream, list[bytes]] | _Abort:
        start = request.start_sequence_number
        stream = _Stream()
        first: list[bytes] = []
        if start:
            rec = self._records[0]
            held = [m for m in rec.history if m.sequence_number >= start]
            # Servable: the history holds ``start``, or ``start`` is the next seq (nothing missed yet).
            reachable = (held and held[0].sequence_number == start) or (rec.first is not None and start == rec.last + 1)
            if self.ranks != 1 or not reachable:
                self.refusals += 1
                return _Abort(grpc.StatusCode.OUT_OF_RANGE, f"seq {start} is not in the servicer's history")
            for m in held:
                self._stamp(m)
                first.append(m.SerializeToString())
            stream.last_sent[0] = rec.last
        else:
            for rank, rec in enumerate(self._records):
                if rec.first is None:
                    continue
                if rec.reaches_start():
                    msgs = list(rec.history)
                else:
                    msgs = rec.snapshot(rank, self.chunk_blocks)
                    self.snapshots_served += 1
                for m in msgs:
                    self._stamp(m)
                    first.append(m.SerializeToString())
                stream.last_sent[rank] = rec.last
        self._streams.add(stream)
        self.streams_opened += 1
        return stream, first

    def _subscribe(self, request: pb.SubscribeKvEventsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        opened = self._serve(context, lambda: self._open(request))
        stream, first = opened
        context.send_initial_metadata(())
        try:
            yield from first
            while context.is_active():
                try:
                    item = stream.queue.get(timeout=self.heartbeat)
                except queue.Empty:
                    try:
                        beats = anyio.from_thread.run_sync(self._heartbeats, stream, token=self._token)
                    except anyio.RunFinishedError:
                        return
                    yield from beats
                    continue
                if isinstance(item, _Abort):
                    context.abort(item.code, item.details)
                yield item
        finally:
            with contextlib.suppress(anyio.RunFinishedError):
                anyio.from_thread.run_sync(self._streams.discard, stream, token=self._token)

    def _get_loads(self, request: pb.RankCountRequest, context: grpc.ServicerContext) -> pb.RankCountResponse:
        answer: pb.RankCountResponse = self._serve(context, lambda: pb.RankCountResponse(dp_rank_count=self.ranks))
        return answer

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        """The grpc handler for ``/<service>/SubscribeKvEvents`` and ``/<service>/GetLoads``."""
        subscribe = grpc.unary_stream_rpc_method_handler(
            self._subscribe,
            request_deserializer=pb.SubscribeKvEventsRequest.FromString,
            response_serializer=None,
        )
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {"SubscribeKvEvents": subscribe}
        if GATEWAY_SERVICES[self.service_name] in ("vllm", "sglang", "tokenspeed"):
            methods["GetLoads"] = grpc.unary_unary_rpc_method_handler(
                self._get_loads,
                request_deserializer=pb.RankCountRequest.FromString,
                response_serializer=pb.RankCountResponse.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(self.service_name, methods)
