"""What ``kvroute demo`` reports: the figures of a run, its live progress, and the results table.

`DemoResult` holds every policy's `PolicyResult` and per-request `RequestRecord`s; `render`
prints them (rich when installed, aligned plain text otherwise) with each policy's hit rate as
a share of what was reachable (`reachable_hits`: an infinite cache that sees every request).
The progress reporters show a run as it goes; `_demo_run` drives them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Protocol, TextIO

import msgspec

from kvroute import WorkerKey

from . import _display

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

__all__ = [
    "DemoResult",
    "FaultNote",
    "PolicyResult",
    "Reporter",
    "RequestRecord",
    "make_reporter",
    "percentile",
    "render",
    "with_oracle_shares",
]


# --- the figures ----------------------------------------------------------------------------------


class FaultNote(msgspec.Struct, frozen=True, kw_only=True):
    """One injected fault: when (seconds into the run), where, what, and how recovery went.

    ``detected_after``: seconds until the client reset the worker (restarts); ``synced_after``:
    seconds until every rank of the engine was synced again (None: not within the run).
    """

    t: float
    engine: str
    action: str
    detected_after: float | None = None
    synced_after: float | None = None


class PolicyResult(msgspec.Struct, frozen=True, kw_only=True):
    """One policy's figures. Times in seconds unless the name says ``_us`` (microseconds).

    ``hit_rate``: prompt tokens the engines found cached / prompt tokens; ``reachable_hit_rate``:
    the workload's infinite-cache bound (`reachable_hits`), the same for every policy;
    ``reachable_share``: ``hit_rate`` as a share of it. ``oracle_hit_rate``: the oracle policy's hit
    rate in the same demo (the capacity-aware reachable: kvroute's cost model over the engines' true
    caches and in-flight prompts, on this fleet), ``oracle_share``: ``hit_rate`` as a share of it,
    ``oracle_ttft_ratio``: ``ttft_p50`` over the oracle's (None when the oracle did not run). ``prefill_tokens``:
    prompt tokens computed. TTFT and latency are the engines' (queueing included).
    ``load_imbalance``: requests on the busiest worker / mean per worker (1.0 is even).
    ``decision_*_us``: measured wall time of the policy's ``select``. ``index_*``: the client's
    index at the end: (block, worker) entries, deep memory size; ``engine_blocks``: what the
    engines' caches hold then (the index is a subset: equal wherever replay covered losses).
    ``batches_applied`` / ``blocks_stored``: events applied to the index, live or replayed.
    """

    policy: str
    requests: int
    completed: int
    failed: int
    retried: int
    rejected: int
    hit_rate: float
    reachable_hit_rate: float
    reachable_share: float
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    ttft_p50: float
    ttft_p99: float
    latency_p50: float
    latency_p99: float
    load_imbalance: float
    decision_p50_us: float
    decision_p99_us: float
    index_blocks: int
    index_memory_bytes: int
    engine_blocks: int
    batches_applied: int
    blocks_stored: int
    gaps: int
    replays: int
    replayed_batches: int
    resets: int
    partial_workers: int
    workers: int
    wall_time: float
    faults: list[FaultNote] = msgspec.field(default_factory=list)
    transport: str = "zmq"
    replicas: int = 1
    index_digests: list[str] = msgspec.field(default_factory=list)
    oracle_hit_rate: float | None = None
    oracle_share: float | None = None
    oracle_ttft_ratio: float | None = None


def with_oracle_shares(results: dict[str, PolicyResult]) -> dict[str, PolicyResult]:
    """``results`` with every policy's ``oracle_*`` figures filled in from the ``oracle`` policy's (if it ran)."""
    oracle = results.get("oracle")
    if oracle is None:
        return results
    return {
        name: msgspec.structs.replace(
            r,
            oracle_hit_rate=oracle.hit_rate,
            oracle_share=round(r.hit_rate / oracle.hit_rate, 4) if oracle.hit_rate else None,
            oracle_ttft_ratio=round(r.ttft_p50 / oracle.ttft_p50, 4) if oracle.ttft_p50 else None,
        )
        for name, r in results.items()
    }


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request: when it finished (seconds into the run), where, and what it cost."""

    id: int
    done: float
    worker: WorkerKey
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    kind: str


class DemoResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `run_demo` returns: per-policy results (in run order), per-request records, the workload's shape."""

    policies: dict[str, PolicyResult]
    records: dict[str, list[RequestRecord]]
    workload: dict[str, int]
    wall_time: float


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def load_imbalance(per_worker: Mapping[WorkerKey, int], fleet: Set[WorkerKey]) -> float:
    """Requests on the busiest worker ÷ the mean per worker (1.0 is even; 0 when none were routed).

    The mean is over ``fleet`` (the workers live at the end) and every worker that took a
    request: a worker dropped before the end (a discovery timeout on a loaded host) still
    took its share, and a mean over the live ones alone put the figure below 1 (0.74 was
    printed once), which no busiest-over-mean can be.
    """
    total = sum(per_worker.values())
    if not total:
        return 0.0
    return round(max(per_worker.values()) / (total / len(fleet | per_worker.keys())), 3)


# --- progress -------------------------------------------------------------------------------------


class Reporter(Protocol):
    """Where a run reports its progress: one bar (or line) per policy, and notes such as injected faults."""

    def start(self, policy: str, total: int) -> None: ...

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None: ...

    def refresh(self) -> None: ...

    def stop(self) -> None: ...

    def note(self, text: str) -> None: ...


class _Silent:
    def start(self, policy: str, total: int) -> None:
        return None

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None:
        return None

    def refresh(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def note(self, text: str) -> None:
        return None


class _PlainReporter:
    """Progress as a line per tenth of each policy's requests (no rich installed)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._total = 0
        self._shown = -1

    def start(self, policy: str, total: int) -> None:
        self._total = total
        self._shown = -1
        print(f"{policy}: {total} requests", file=self._out, flush=True)

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None:
        tenth = done * 10 // max(1, self._total)
        if tenth > self._shown:
            self._shown = tenth
            print(
                f"  {policy}: {done}/{self._total} hit rate {hit_rate:.1%} TTFT p50 {ttft_p50 * 1e3:.0f} ms",
                file=self._out,
                flush=True,
            )

    def refresh(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def note(self, text: str) -> None:
        print(f"  {text}", file=self._out, flush=True)


class _RichReporter:
    """A rich progress bar per policy; refreshed by the demo's own task (auto_refresh would start a thread)."""

    def __init__(self, out: TextIO) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = _display.console(out)
        self._progress: Progress = Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("hit rate {task.fields[hit]:>6}  TTFT p50 {task.fields[ttft]:>7}"),
            TimeElapsedColumn(),
            console=self.console,
            auto_refresh=False,
        )
        self._tasks: dict[str, TaskID] = {}
        self._progress.start()

    def start(self, policy: str, total: int) -> None:
        self._tasks[policy] = self._progress.add_task(policy, total=total, hit="-", ttft="-")
        self._progress.refresh()

    def update(self, policy: str, done: int, hit_rate: float, ttft_p50: float) -> None:
        self._progress.update(
            self._tasks[policy], completed=done, hit=f"{hit_rate:.1%}", ttft=f"{ttft_p50 * 1e3:.0f} ms"
        )

    def refresh(self) -> None:
        self._progress.refresh()

    def stop(self) -> None:
        self._progress.refresh()
        self._progress.stop()

    def note(self, text: str) -> None:
        self._progress.console.print(f"  {text}", highlight=False)


def make_reporter(out: TextIO, quiet: bool) -> Reporter:
    """Silent when ``quiet``; else a rich progress display on ``out``, or plain lines without rich."""
    if quiet:
        return _Silent()
    try:
        return _RichReporter(out)
    except ImportError:
        return _PlainReporter(out)


# --- output ---------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]  # int becomes float on purpose
    return f"{n:.1f} GiB"


def _replicas(r: PolicyResult) -> str:
    if r.replicas <= 1:
        return "1"
    agree = "equal" if len(set(r.index_digests)) == 1 else "differ"
    return f"{r.replicas} ({agree}: {r.index_digests[0][:8] if r.index_digests else '-'})"


_ROWS: tuple[tuple[str, Callable[[PolicyResult], str]], ...] = (
    ("prefix-cache hit rate", lambda r: f"{r.hit_rate:.1%}"),
    ("share of the oracle's hits ¹", lambda r: f"{r.oracle_share:.0%}" if r.oracle_share is not None else "-"),
    ("share of infinite-cache hits ²", lambda r: f"{r.reachable_share:.0%}" if r.reachable_hit_rate else "-"),
    ("prefill tokens computed", lambda r: f"{r.prefill_tokens:,}"),
    ("TTFT p50 / p99 (simulated)", lambda r: f"{r.ttft_p50 * 1e3:.0f} / {r.ttft_p99 * 1e3:.0f} ms"),
    ("TTFT p50 ÷ the oracle's", lambda r: f"{r.oracle_ttft_ratio:.2f}" if r.oracle_ttft_ratio is not None else "-"),
    ("latency p50 / p99", lambda r: f"{r.latency_p50 * 1e3:.0f} / {r.latency_p99 * 1e3:.0f} ms"),
    ("load imbalance (max/mean)", lambda r: f"{r.load_imbalance:.2f}"),
    ("decision p50 / p99 (measured)", lambda r: f"{r.decision_p50_us:.0f} / {r.decision_p99_us:.0f} µs"),
    ("index blocks (engines hold)", lambda r: f"{r.index_blocks:,} ({r.engine_blocks:,})"),
    ("index memory", lambda r: _fmt_bytes(r.index_memory_bytes)),
    ("events applied (batches / blocks)", lambda r: f"{r.batches_applied:,} / {r.blocks_stored:,}"),
    ("gaps / replays / resets", lambda r: f"{r.gaps} / {r.replays} / {r.resets}"),
    ("completed / retried / failed", lambda r: f"{r.completed} / {r.retried} / {r.failed + r.rejected}"),
    ("router replicas (indexes at the end)", _replicas),
    ("wall time", lambda r: f"{r.wall_time:.1f} s"),
)


def render(result: DemoResult, out: TextIO) -> None:
    """Print the results table (and the fault recovery, if any) to ``out``; rich when installed."""
    policies = list(result.policies.values())
    header = ["", *(p.policy for p in policies)]
    rows = [[label, *(fmt(p) for p in policies)] for label, fmt in _ROWS]
    fault_lines = [
        f"{p.policy}: t={f.t:.1f}s {f.action} {f.engine}"
        + (f" → reset after {f.detected_after * 1e3:.0f} ms" if f.detected_after is not None else "")
        + (f", synced again after {f.synced_after * 1e3:.0f} ms" if f.synced_after is not None else "")
        for p in policies
        for f in p.faults
    ]
    title = f"kvroute demo — {_shape(result.workload)}"
    fault_lines += _notes(result)
    try:
        from rich.table import Table
    except ImportError:
        print(title, file=out)
        for line in _display.align([header, *rows]):
            print(line, file=out)
        for line in fault_lines:
            print(line, file=out)
    else:
        table = Table(title=title)
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console = _display.console(out)
        console.print(table)
        for line in fault_lines:
            console.print(line, highlight=False)
    summary = _summary(result)
    if summary:
        print(summary, file=out)


# How `run_demo` names the workload's figures and request kinds, as the title spells them out.
_SHAPE_LABELS = {
    "requests": "requests",
    "prompt_tokens": "prompt tokens",
    "turn": "conversation turns",
    "tenant": "tenant prompts (shared system prompt)",
    "oneoff": "one-off prompts",
    "trace": "trace records",
}


def _shape(workload: dict[str, int]) -> str:
    head = [f"{workload[k]:,} {_SHAPE_LABELS[k]}" for k in ("requests", "prompt_tokens") if k in workload]
    kinds = [f"{v:,} {_SHAPE_LABELS.get(k, k)}" for k, v in workload.items() if k not in ("requests", "prompt_tokens")]
    return ", ".join(head) + (f" (by kind: {', '.join(kinds)})" if kinds else "")


def _notes(result: DemoResult) -> list[str]:
    """The footnotes the table's rows refer to, and what the run was (so nothing needs --help to read)."""
    first = next(iter(result.policies.values()), None)
    notes = [
        "¹ oracle: kvroute's cost model over the engines' true caches and the prompts they are computing (no"
        " event lag, nothing missed): what a cache-aware router deciding one request at a time reaches on this"
        " fleet's capacity, evictions and timing.",
        "² infinite cache: every earlier prompt still cached, wherever it ran: no router on any fleet does better.",
        "Requests run concurrently: the same --seed gives figures a few percent apart from run to run.",
    ]
    if first is not None and first.transport == "gateway":
        notes.append(
            "Events and the engines' load followed over the gateway servicer's SubscribeKvEvents stream"
            " (--gateway-stream, or --replicas)."
        )
    if any(p.replicas > 1 for p in result.policies.values()):
        notes.append(
            "kvroute_xN_router_load / _engine_load: N router processes, requests spread over them in turn, each"
            " pricing only its own requests / also the engines' reported queues; indexes compared by digest."
        )
    return notes


def _summary(result: DemoResult) -> str:
    kv = result.policies.get("kvroute")
    others = [p for p in result.policies.values() if p.policy not in ("kvroute", "oracle")]
    if kv is None or not (others or kv.oracle_share is not None):
        return ""
    parts = [f"kvroute: {kv.hit_rate:.1%} of prompt tokens cached"]
    if kv.oracle_share is not None and kv.oracle_ttft_ratio is not None:
        parts.append(f", {kv.oracle_share:.0%} of the oracle's hits at {kv.oracle_ttft_ratio:.2f}x its TTFT p50")
    if kv.reachable_hit_rate:
        parts.append(f" ({kv.reachable_share:.0%} of the infinite-cache {kv.reachable_hit_rate:.1%})")
    if others:
        best = max(others, key=lambda p: p.hit_rate)
        parts.append(
            f"; vs {best.hit_rate:.1%} for {best.policy}, the best baseline"
            f" ({best.prefill_tokens - kv.prefill_tokens:,} more tokens prefilled there),"
            f" TTFT p50 {kv.ttft_p50 * 1e3:.0f} ms vs {best.ttft_p50 * 1e3:.0f} ms"
        )
    parts.append(f". Total {result.wall_time:.1f} s.")
    return "".join(parts)
