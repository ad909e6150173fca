"""Warm restart: the index and each source's position written to one versioned msgpack file.

A snapshot holds, per worker, its engine-hash → content-key map (with copies per tier), and
per source the last applied seq and that batch's ts. A client started from a snapshot replays
each source from the saved seq; the ts lets it tell the same engine from a restarted one
(docs/recovery.md rule 7) before trusting the restored blocks.

Format: msgpack of `_Snapshot`; ``format`` and ``version`` are checked first, and the content
hash version must match (keys made by another hash definition would never match a query).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import msgspec

import kvroute._core as _core

from ._errors import SnapshotError
from ._hashing import HASH_VERSION
from ._models import WorkerKey
from ._wire import BlockHash

__all__ = [
    "Cursor",
    "SnapGroup",
    "SnapWorker",
    "check_header",
    "encode_snapshot",
    "read_snapshot",
    "refuse_unreadable",
    "snapshot_bytes",
    "write_snapshot",
]

_FORMAT = "kvroute-index"
# The tables' layout goes with the content hash version (checked below): a layout change
# comes with a new hash version, so an older file is refused by that check.
_VERSION = 1


class Cursor(msgspec.Struct, frozen=True, array_like=True):
    """Where a source stood: the last applied seq and the ts of that batch."""

    seq: int
    ts: float


class SnapGroup(msgspec.Struct, array_like=True):
    """One non-primary KV-cache group of a worker: its hit rule and engine hash → (content key, tier mask)."""

    group_idx: int
    kind: str
    window: int | None
    block_size: int
    hashes: list[BlockHash]
    keys: list[bytes]
    masks: list[int]


class SnapWorker(msgspec.Struct, array_like=True):
    """One worker's tables as the index keeps them (engine hash → content key, presence per tier, groups)."""

    worker_id: str
    dp_rank: int
    classes: list[tuple[int, int]]
    primary: int | None
    lookahead: int
    hashes: list[BlockHash]
    keys: list[bytes]
    special: list[tuple[BlockHash, list[int]]]
    groups: list[SnapGroup]
    # SGLang with EAGLE (its stores came as bigram cells): served a page less at the prompt's edge. Last and
    # defaulted, so a file written before it reads as it did (no mark) and the format version stays.
    bigram: bool = False


class _SnapCursor(msgspec.Struct, array_like=True):
    worker_id: str
    dp_rank: int
    cursor: Cursor


class _Snapshot(msgspec.Struct):
    format: str
    version: int
    hash_version: int
    created: float
    workers: list[SnapWorker]
    cursors: list[_SnapCursor]


class _Header(msgspec.Struct):
    format: str = ""
    version: int = 0
    hash_version: int = 0


def write_snapshot(path: str | os.PathLike[str], workers: list[SnapWorker], cursors: dict[WorkerKey, Cursor]) -> None:
    """Write ``workers`` and ``cursors`` to ``path`` atomically (a crash leaves the old file intact)."""
    snap = _Snapshot(
        format=_FORMAT,
        version=_VERSION,
        hash_version=HASH_VERSION,
        created=time.time(),
        workers=workers,
        cursors=[_SnapCursor(k.worker_id, k.dp_rank, c) for k, c in cursors.items()],
    )
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.msgpack.encode(snap))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def encode_snapshot(core: _core.Index, cursors: Mapping[WorkerKey, Cursor]) -> bytes:
    """A `PrefixIndex`'s core (``index._core``) and ``cursors`` as a snapshot file's bytes, without a file.

    What `write_snapshot` would write for them.

    The core exports the tables under one read lock and writes msgspec's encoding of `_Snapshot`
    itself (no Python object per entry): the JetStream relay and replica put it in the object store.
    """
    rows = [(k.worker_id, k.dp_rank, c.seq, c.ts) for k, c in cursors.items()]
    return core.snapshot_bytes(rows, (_FORMAT, _VERSION, HASH_VERSION, time.time()))


def snapshot_bytes(path: str | os.PathLike[str]) -> bytes:
    """A snapshot file's bytes, unchecked. Raises `SnapshotError` when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc.strerror}") from None


def check_header(path: str | os.PathLike[str], fmt: str, version: int, hash_version: int) -> None:
    """Refuse a snapshot of another format, version or content hash version (`SnapshotError`)."""
    if fmt != _FORMAT:
        raise SnapshotError(f"{path} is not a kvroute snapshot (format {fmt!r})")
    if version != _VERSION:
        raise SnapshotError(f"{path} has snapshot version {version}; this kvroute reads {_VERSION}")
    if hash_version and hash_version != HASH_VERSION:
        # Keys made by another hash definition would never match a query: start cold.
        raise SnapshotError(
            f"{path} was written with content hash v{hash_version}; this kvroute uses v{HASH_VERSION}"
            " (start without it: the sources replay their history)"
        )


def refuse_unreadable(path: str | os.PathLike[str], data: bytes, why: str) -> NoReturn:
    """Raise the `SnapshotError` for a file whose body did not read (``why``).

    A file that is not a kvroute snapshot of this version (header unreadable, another format,
    version or hash version) is refused as such, as `read_snapshot` refuses it; otherwise it is
    corrupt.
    """
    try:
        header = msgspec.msgpack.decode(data, type=_Header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError(f"{path} is not a kvroute snapshot: {exc}") from None
    check_header(path, header.format, header.version, header.hash_version)
    raise SnapshotError(f"{path} is corrupt: {why}")


def read_snapshot(path: str | os.PathLike[str]) -> tuple[list[SnapWorker], dict[WorkerKey, Cursor]]:
    """Read and check a snapshot into Structs: its workers' tables and the saved cursors. Raises `SnapshotError`.

    `PrefixIndex.restore` does not build these: the compiled core reads the file itself.
    """
    data = snapshot_bytes(path)
    try:
        snap = msgspec.msgpack.decode(data, type=_Snapshot)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        refuse_unreadable(path, data, str(exc))
    check_header(path, snap.format, snap.version, snap.hash_version)
    # Each worker's tables are checked by PrefixIndex.restore: one bad worker is dropped, not the file.
    return snap.workers, {WorkerKey(c.worker_id, c.dp_rank): c.cursor for c in snap.cursors}
