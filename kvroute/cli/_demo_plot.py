"""``kvroute demo --plot``: hit rate and time to first token over the run, one line per policy."""

from __future__ import annotations

from ._demo_report import DemoResult, percentile

__all__ = ["plot"]

# Sliding window (completions) of the live hit rate in the plot.
_PLOT_WINDOW = 50


def plot(result: DemoResult, path: str) -> None:
    """Save hit rate and TTFT over time per policy to ``path`` (matplotlib, imported here: the demo extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, recs in result.records.items():
        ordered = sorted(recs, key=lambda r: r.done)
        times, hits, ttfts = [], [], []
        for i in range(len(ordered)):
            window = ordered[max(0, i - _PLOT_WINDOW + 1) : i + 1]
            prompt = sum(r.prompt_tokens for r in window)
            times.append(ordered[i].done)
            hits.append(100.0 * sum(r.cached_tokens for r in window) / prompt if prompt else 0.0)
            ttfts.append(1e3 * percentile([r.ttft for r in window], 50))
        ax_hit.plot(times, hits, label=name)
        ax_ttft.plot(times, ttfts, label=name)
    first = next(iter(result.policies.values()), None)
    for fault in first.faults if first is not None else ():
        for ax in (ax_hit, ax_ttft):
            ax.axvline(fault.t, color="grey", linestyle=":", linewidth=1)
        ax_hit.annotate(f"{fault.action} {fault.engine}", (fault.t, 2), rotation=90, fontsize=7, color="grey")
    ax_hit.set_ylabel(f"hit rate, % (last {_PLOT_WINDOW} requests)")
    ax_ttft.set_ylabel(f"TTFT p50, ms (last {_PLOT_WINDOW})")
    ax_ttft.set_xlabel("seconds into the run")
    ax_hit.legend()
    ax_hit.grid(alpha=0.3)
    ax_ttft.grid(alpha=0.3)
    fig.suptitle("kvroute demo: prefix-cache hit rate and time to first token per routing policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
