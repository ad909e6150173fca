"""What `KvEventClient.stats` reports: each source's `SourceStats`, their totals, and the client's own counters.

The per-source counters are defined once (`kvroute._recovery.RecoveryStats` and
`kvroute._transports._base.SourceCounters`); the totals are their field-by-field sums, so a
counter added there is totalled here without a change.
"""

from __future__ import annotations

import msgspec

from ._models import WorkerKey
from ._transports._base import COUNTER_FIELDS, SourceCounters, SourceStats

__all__ = ["ClientStats", "TotalStats", "client_stats"]


class TotalStats(SourceCounters, frozen=True, kw_only=True):  # type: ignore[misc]  # see SourceStats
    """Every `SourceCounters` field summed over the current sources, and how many are connected / synced / partial."""

    sources: int = 0
    connected: int = 0
    synced: int = 0
    partial: int = 0


class ClientStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of `KvEventClient` counters.

    ``sources``: per current source; ``totals``: their sum; ``refused_sources``: times a
    source was refused (see `KvEventClient.add_source`; discovery offers one again each round); ``removed_sources``:
    sources removed so far; ``failed_sources``: sources removed because their driver failed;
    ``adopted_sources``: ranks a gateway stream carried that discovery had not announced, followed
    from their first batch on; ``events_dropped``: envelopes dropped by full `events()` buffers.
    """

    sources: dict[WorkerKey, SourceStats]
    totals: TotalStats
    refused_sources: int = 0
    removed_sources: int = 0
    failed_sources: int = 0
    adopted_sources: int = 0
    events_dropped: int = 0


def client_stats(
    per: dict[WorkerKey, SourceStats],
    *,
    refused: int,
    removed: int,
    failed: int,
    adopted: int,
    events_dropped: int,
) -> ClientStats:
    """A `ClientStats` of the sources' snapshots ``per`` and the client's own counters."""
    sums = {name: sum(getattr(st, name) for st in per.values()) for name, _ in COUNTER_FIELDS}
    totals = TotalStats(
        sources=len(per),
        connected=sum(st.connected for st in per.values()),
        synced=sum(st.state == "synced" for st in per.values()),
        partial=sum(st.partial for st in per.values()),
        **sums,
    )
    return ClientStats(
        sources=per,
        totals=totals,
        refused_sources=refused,
        removed_sources=removed,
        failed_sources=failed,
        adopted_sources=adopted,
        events_dropped=events_dropped,
    )
