"""Router replicas on NATS JetStream (docs/replicas.md): the log's vocabulary, shared by relay and replica.

`kvroute._jetstream_relay.JetStreamRelay` follows engines with a `KvEventClient` and republishes,
per worker and in order, what that client applied; `kvroute._jetstream_replica.JetStreamReplica`
rebuilds the same index from the latest snapshot plus the log, and never talks to the engines;
`kvroute._jetstream_nats` runs nats-py for both on either anyio backend. This module is what they
agree on: the stream, its subjects and records, the message ids, the snapshot store and the lease.

The log (one JetStream stream, subject ``kvroute.<stream>.<worker>.<rank>``), record by record.
Each record is a 4-byte big-endian header length, a msgpack header, then (batches only) a body:

- ``batches`` (`_Batches`): a run of one worker's engine batches, in the order the relay's client
  applied them: worker, ``prev`` (the seq of the worker's batch before the run in the log, None
  right after a reset) and one ``(seq, ts, length)`` per batch; the body is the batches' msgpack
  payloads back to back, which a replica hands to the compiled core as they are
  (`PrefixIndex.apply_payload`). Within a run each batch's ``prev`` is the batch before it.
  ``Nats-Msg-Id`` is worker + first and last seq + first ts: the ts tells a restarted engine's seq
  N from the old one's, so a relay that publishes the same run again (an unanswered ack) is dropped
  by the server's duplicate window; a run cut differently (a relay restart, a second relay) is
  caught by the replica, which skips every batch at or below the worker's last seq.
- ``runs`` (`_Runs`, on the subject ``kvroute.<stream>.runs``): the runs of several workers the
  relay took in one turn, one `_Batches` header's fields per worker, the payloads of all of them
  back to back: one message, one server write and one delivery per turn however many workers
  published in it. Its ``Nats-Msg-Id`` is a digest of its header (every run's worker, seqs, ts and
  lengths), so publishing the same record again is dropped as a run's is; a worker's batches keep
  their order, as every record of the log is in the order the relay published it.
- ``reset`` / ``partial`` / ``removed``: what the relay's client did to the worker (header only);
  ``present``: the client follows a worker the log has not named yet (synced with no batch: an idle
  engine), so replicas route to it as a client following the engines would.

Replica rules (docs/recovery.md, applied to the log): a batch whose ``prev`` is not the worker's
last applied seq is an uncovered gap (a record the log lost): the worker is reset and marked
partial, then the batch applied. A jump in the stream's own sequence (records removed by retention
before the replica read them) resets every worker the same way. Nothing is ever over-claimed.

Snapshots: the relay writes its client's index (`PrefixIndex.snapshot`, kvroute's own format) to a
JetStream object store at an interval, named by the stream sequence it covers, taken at an instant
when everything the client applied is acknowledged by the stream; the client's index was seeded
from the log when the session started, so it then holds exactly the records up to that sequence,
and a replica restoring it and reading on from the next sequence is exact.

High availability: relays for one stream share a lease (a key of the meta KV bucket): see
`kvroute._jetstream_relay`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from ._errors import ConfigError, JetStreamError
from ._models import WorkerKey

__all__ = [
    "LEASE_KEY",
    "SNAPSHOTS_KEPT",
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_KEY",
    "JetStreamError",
    "SnapshotInfo",
    "check_stream_name",
    "decode_record",
    "encode_record",
    "ensure_stream",
    "fetch_object",
    "meta_bucket",
    "nats_module",
    "object_store",
    "record_header",
    "run_msg_id",
    "runs_msg_id",
    "runs_subject",
    "subject_prefix",
    "worker_subject",
]

log = logging.getLogger("kvroute.jetstream")

#: The meta bucket's key naming the newest snapshot object (objects are never rewritten in place: a
#: replica reading one while the relay writes the next would wait for chunks that are gone).
SNAPSHOT_KEY: Final = "snapshot"
#: Snapshot objects kept: the newest and the ones before it, which a slow reader may still be reading.
SNAPSHOTS_KEPT: Final = 3
LEASE_KEY: Final = "leader"
SNAPSHOT_FORMAT: Final = 1


# --- the log's records ------------------------------------------------------------------------------


class _Batches(msgspec.Struct, array_like=True, tag="batches"):
    """A run of one worker's batches: ``items`` are (seq, ts, payload length), the payloads follow the header."""

    worker_id: str
    dp_rank: int
    prev: int | None
    items: list[tuple[int, float, int]]


class _Runs(msgspec.Struct, array_like=True, tag="runs"):
    """Runs of several workers' batches in one record: ``runs`` are (worker_id, dp_rank, prev, items) as in
    `_Batches`; the body is every run's payloads back to back, in that order."""

    runs: list[tuple[str, int, int | None, list[tuple[int, float, int]]]]


class _Reset(msgspec.Struct, array_like=True, tag="reset"):
    worker_id: str
    dp_rank: int
    reason: str
    detail: str


class _Partial(msgspec.Struct, array_like=True, tag="partial"):
    worker_id: str
    dp_rank: int
    reason: str
    first_seq: int


class _Removed(msgspec.Struct, array_like=True, tag="removed"):
    worker_id: str
    dp_rank: int
    reason: str


class _Present(msgspec.Struct, array_like=True, tag="present"):
    """The relay's client follows this worker (synced), before any batch of it: a router may route to it."""

    worker_id: str
    dp_rank: int



_Record = _Batches | _Runs | _Reset | _Partial | _Removed | _Present
_decode_header = msgspec.msgpack.Decoder(_Record).decode
_encode_header = msgspec.msgpack.Encoder().encode
#: A record's header length prefix (4 bytes, big-endian).
_HEAD: Final = 4


def encode_record(rec: _Record, payloads: Sequence[bytes] = ()) -> bytes:
    """One log record: the header's length, the header, then ``payloads`` back to back (`_Batches`, `_Runs`)."""
    header = _encode_header(rec)
    return b"".join((len(header).to_bytes(_HEAD, "big"), header, *payloads))


def record_header(data: bytes) -> bytes:
    """An encoded record's header bytes (what `runs_msg_id` digests)."""
    return data[_HEAD : _HEAD + int.from_bytes(data[:_HEAD], "big")]


def decode_record(data: bytes) -> tuple[_Record, int]:
    """A record's header and where its body starts; raises msgspec's DecodeError / ValidationError."""
    n = int.from_bytes(data[:_HEAD], "big")
    if len(data) < _HEAD + n:
        raise msgspec.DecodeError(f"record of {len(data)} bytes is shorter than its {n}-byte header")
    rec = _decode_header(data[_HEAD : _HEAD + n])
    if isinstance(rec, _Batches):
        body = sum(i[2] for i in rec.items)
    elif isinstance(rec, _Runs):
        body = sum(i[2] for run in rec.runs for i in run[3])
    else:
        body = 0
    if _HEAD + n + body != len(data):
        raise msgspec.DecodeError("record body length does not match its items")
    return rec, _HEAD + n


def run_msg_id(key: WorkerKey, items: Sequence[tuple[int, float, int]]) -> str:
    """The ``Nats-Msg-Id`` of a run of ``key``'s batches (see the module docs)."""
    return f"{key.worker_id}/{key.dp_rank}:{items[0][0]}-{items[-1][0]}:{items[0][1]!r}"


def runs_msg_id(header: bytes) -> str:
    """The ``Nats-Msg-Id`` of a `_Runs` record: a digest of its header, which names every run in it (worker,
    seqs, each batch's ts and length), so the same runs published again carry the same id."""
    return f"runs:{hashlib.blake2b(header, digest_size=16).hexdigest()}"


def runs_subject(stream: str) -> str:
    """The subject of ``stream``'s `_Runs` records (three tokens: no worker's subject, which has four)."""
    return f"{subject_prefix(stream)}.runs"


class SnapshotInfo(msgspec.Struct):
    """What a snapshot object's description says: the stream sequence it covers and the workers' flags."""

    format: int
    stream_seq: int
    workers: list[tuple[str, int]]
    partial: list[tuple[str, int]]


def subject_prefix(stream: str) -> str:
    """The subjects of ``stream``'s records: ``kvroute.<stream>``."""
    return f"kvroute.{stream}"


def worker_subject(stream: str, key: WorkerKey) -> str:
    """The subject of one worker's records (the worker id base64url-encoded: any text is a valid token)."""
    token = base64.urlsafe_b64encode(key.worker_id.encode()).rstrip(b"=").decode() or "_"
    return f"{subject_prefix(stream)}.{token}.{key.dp_rank}"


def check_stream_name(stream: str) -> None:
    """Refuse a stream name JetStream (or a subject token) cannot carry, with `ConfigError`."""
    if not stream or any(c in stream for c in " .*>/\\\t\r\n"):
        raise ConfigError(f"stream name {stream!r} must be non-empty without spaces, '.', '*', '>' or slashes")


def nats_module() -> Any:
    """Import nats-py (the ``kvroute[jetstream]`` extra), or raise `ConfigError`."""
    try:
        import nats
        import nats.js.api
        import nats.js.errors
    except ImportError:  # pragma: no cover - the extra is installed wherever this runs in tests
        raise ConfigError("JetStream needs nats-py: pip install 'kvroute[jetstream]'") from None
    return nats


async def ensure_stream(js: Any, stream: str, storage: str, max_age: float, duplicate_window: float) -> None:
    """Create the stream (and the snapshot store and lease bucket) unless they exist."""
    nats = nats_module()
    api = nats.js.api
    try:
        await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        cfg = api.StreamConfig(
            name=stream,
            subjects=[f"{subject_prefix(stream)}.>"],
            storage=api.StorageType.FILE if storage == "file" else api.StorageType.MEMORY,
            max_age=max_age or None,
            duplicate_window=duplicate_window,
            discard=api.DiscardPolicy.OLD,
        )
        with contextlib.suppress(nats.js.errors.BadRequestError):  # another relay created it meanwhile
            await js.add_stream(cfg)
    await object_store(js, stream, create=True)
    await meta_bucket(js, stream, create=True)


async def object_store(js: Any, stream: str, *, create: bool) -> Any:
    """The stream's snapshot object store (created when ``create``, else None when missing)."""
    nats = nats_module()
    try:
        return await js.object_store(f"{stream}_snapshots")
    except nats.js.errors.NotFoundError:
        if not create:
            return None
        return await js.create_object_store(f"{stream}_snapshots")


async def meta_bucket(js: Any, stream: str, *, create: bool) -> Any:
    """The stream's meta KV bucket: the lease and the newest snapshot's name (None when missing, unless ``create``)."""
    nats = nats_module()
    try:
        return await js.key_value(f"{stream}_meta")
    except nats.js.errors.NotFoundError:
        if not create:
            return None
        return await js.create_key_value(bucket=f"{stream}_meta", history=1)



#: Chunks asked for in one pull request when reading a snapshot object.
_PULL: Final = 256


async def fetch_object(js: Any, stream: str, name: str) -> tuple[bytes, str] | None:
    """A snapshot object's bytes (its digest checked) and description; None when it does not exist.

    nats-py's ``ObjectStore.get`` joins the chunks by repeated concatenation (quadratic: 8 s for
    25 MB here) behind a push consumer it answers flow control for only every 250 ms; this reads
    them with one pull consumer and joins them once.
    """
    nats = nats_module()
    api = nats.js.api
    store = await object_store(js, stream, create=False)
    if store is None:
        return None
    try:
        info = await store.get_info(name)
    except nats.js.errors.ObjectNotFoundError:
        return None
    description = info.description or ""
    if not info.size:
        return b"", description
    bucket = f"{stream}_snapshots"
    cfg = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.ALL,
        mem_storage=True,
        num_replicas=1,
        inactive_threshold=30.0,
    )
    sub = await js.pull_subscribe(f"$O.{bucket}.C.{info.nuid}", stream=f"OBJ_{bucket}", config=cfg)
    parts: list[bytes] = []
    try:
        while len(parts) < info.chunks:
            parts += [m.data for m in await sub.fetch(min(_PULL, info.chunks - len(parts)), timeout=10.0)]
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    data = b"".join(parts)
    want = (info.digest or "").split("=", 1)[-1]
    got = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if len(data) != info.size or want.rstrip("=") != got.rstrip("="):
        raise ValueError(f"snapshot object {name}: {len(data)} bytes, digest mismatch or short read")
    return data, description
