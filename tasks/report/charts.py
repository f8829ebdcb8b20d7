"""The report's PNG charts (the loss curves and the scaling history, which evaluate writes beside report.json), and
the matplotlib set-up every chart of the run draws with (`pyplot`, `png`; the GPU-time ledger's usage chart too)."""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Iterable
from typing import Any


def pyplot():
    """matplotlib's pyplot on the Agg backend, imported when a chart is drawn (matplotlib is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on Airflow workers; must precede pyplot
    from matplotlib import pyplot

    return pyplot


def png(plot, figure) -> bytes:
    """The figure as PNG bytes, laid out tight, then closed (`plot`, pyplot, keeps every open figure)."""
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=110)
    plot.close(figure)
    return buffer.getvalue()


def loss_chart(curves: dict[str, list[dict[str, Any]]], title: str,
               eval_points: dict[str, tuple[float, float]] | None = None) -> bytes:
    """Training loss against tokens seen, one line per run (label -> metrics lines), and each model's eval loss as
    a labelled point at the tokens it had seen when training ended (label -> (tokens_seen, eval_loss))."""
    plot = pyplot()
    figure, axes = plot.subplots(figsize=(7.5, 4.2))
    # Matching curves are the expected outcome, so later lines are dashed and thinner to keep both visible.
    for index, ((label, points), (style, width)) in enumerate(
            zip(curves.items(), itertools.cycle([("-", 3.0), ("--", 1.6)]))):
        color = f"C{index}"
        points = [p for p in points if p.get("loss") is not None and p.get("tokens_seen") is not None]
        if points:
            axes.plot([p["tokens_seen"] for p in points], [p["loss"] for p in points], label=label,
                      linestyle=style, linewidth=width, alpha=0.85, color=color)
        tokens_seen, eval_loss = (eval_points or {}).get(label, (None, None))
        if tokens_seen is not None and eval_loss is not None and math.isfinite(eval_loss):
            # The value goes in the legend: matching models put both points on one spot, over a noisy curve.
            axes.scatter([tokens_seen], [eval_loss], marker="D", s=50, color=color, edgecolor="black", zorder=3,
                         label=f"{label} eval loss {eval_loss:.3f}")
    axes.set_xlabel("tokens seen")
    axes.set_ylabel("loss (nats per token)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend()
    else:
        axes.text(0.5, 0.5, "no metrics recorded", ha="center", va="center", transform=axes.transAxes)
    return png(plot, figure)


def scaling_chart(history: list[dict[str, Any]], current_run_id: str,
                  predicted: list[dict[str, Any]] | None = None) -> bytes:
    """Throughput and scaling efficiency against workers, every run in the history; this run highlighted, and
    the preflight advisor's prediction for this run (rows of N, tokens_per_s, efficiency) as a dashed line."""
    plot = pyplot()
    figure, (throughput_axes, efficiency_axes) = plot.subplots(1, 2, figsize=(10, 4.2))
    for axes, field, ylabel in ((throughput_axes, "tokens_per_s", "train tokens/s"),
                                (efficiency_axes, "efficiency", "scaling efficiency (speedup / N)")):
        points = [p for p in history if p.get(field) is not None]
        others = [p for p in points if p["run_id"] != current_run_id]
        current = [p for p in points if p["run_id"] == current_run_id]
        axes.scatter([p["num_workers"] for p in others], [p[field] for p in others], color="tab:gray", alpha=0.6,
                     label="earlier runs")
        axes.scatter([p["num_workers"] for p in current], [p[field] for p in current], color="tab:red", s=60,
                     zorder=3, label="this run")
        means = _mean_by_workers(points, field)
        if means:
            axes.plot(list(means), list(means.values()), color="tab:blue", linewidth=1.2, label="mean per N")
        if predicted:
            axes.plot([row["num_workers"] for row in predicted], [row[field] for row in predicted],
                      color="tab:orange", linestyle="--", marker="x", linewidth=1.2, label="predicted (this run)")
        if field == "efficiency":
            axes.axhline(1.0, color="tab:green", linestyle="--", linewidth=1, label="ideal")
            axes.set_ylim(bottom=0)
        axes.set_xlabel("workers (N)")
        axes.set_ylabel(ylabel)
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(f"Scaling across {len({p['run_id'] for p in history})} runs")
    return png(plot, figure)


def _mean_by_workers(points: Iterable[dict[str, Any]], field: str) -> dict[int, float]:
    grouped: dict[int, list[float]] = {}
    for point in points:
        grouped.setdefault(point["num_workers"], []).append(point[field])
    return {n: sum(values) / len(values) for n, values in sorted(grouped.items())}
