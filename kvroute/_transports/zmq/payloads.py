"""One ZMQ payload, as the driver takes it: decoded and checked for the recovery machine, or applied in place.

`_decode_checked` is the verdict on a payload the machine is given as a decoded batch (a live
batch off the fast path, a replayed one while a listener wants its events); `_judge` the same
verdict on a replayed payload the machine holds as bytes (applied later by the raw-bytes ingest,
`PrefixIndex.apply_payloads`); `_fast_apply` is the per-message fast path (docs/recovery.md rule 1).
"""

from __future__ import annotations

from ..._core import decode_checked as _core_decode_checked
from ..._core import judge as _core_judge
from ..._index import ApplyReport, PrefixIndex
from ..._models import WorkerKey
from ..._wire import BatchDecoder, EventBatch

__all__ = ["_decode_checked", "_fast_apply", "_judge"]


def _decode_checked(decoder: BatchDecoder, payload: bytes) -> tuple[EventBatch | None, str, str]:
    """A batch the machine may take as decodable, or None with the (kind, detail) of why not.

    The verdict is the core's (`wire::verdict`, the one `apply_payload` applies): a ts that is
    not finite cannot tell a duplicate from a restart, nor be saved as a position, so the batch
    is a hole like any undecodable one; a removal or clear that could not be read makes the
    batch untrusted (applying the rest could leave blocks the engine dropped), and the machine
    asks for a replay and, when that cannot fix it, resets the worker.
    """
    lim = decoder.limits
    batch, kind, detail = _core_decode_checked(
        payload, lim.max_events_per_batch, lim.max_blocks_per_event, lim.max_block_size
    )
    if batch is not None:
        decoder.count_skipped(batch.skipped)
    return (None if kind else batch), kind, detail


def _judge(decoder: BatchDecoder, payload: bytes) -> tuple[float, str, str]:
    """`_decode_checked`'s verdict on ``payload`` without building its batch: ``(ts, kind, detail)``.

    ``kind`` "" when the payload may be applied (``ts`` is then its finite ts); else why not, as
    `_decode_checked` says it (the core's `wire::verdict`). The decoder keeps the skip counts.
    """
    lim = decoder.limits
    ts, kind, detail, skipped = _core_judge(
        payload, lim.max_events_per_batch, lim.max_blocks_per_event, lim.max_block_size
    )
    if skipped:
        decoder.count_skipped(skipped)
    return ts, kind, detail


def _fast_apply(index: PrefixIndex, key: WorkerKey, decoder: BatchDecoder, payload: bytes) -> ApplyReport:
    """Decode one in-order live payload and apply it to ``key``'s state: the per-message fast path.

    The compiled core's raw-bytes ingest (`PrefixIndex.apply_payload`: one call, off the GIL,
    no Python object per event); ``decoder`` only lends its `Limits` and keeps the source's
    skip counts. Everything around it, the seq check before and the machine's bookkeeping
    after, stays as it is.
    """
    report = index.apply_payload(key, payload, decoder.limits)
    decoder.count_skipped(report.skipped)
    return report

