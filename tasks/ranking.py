"""Which trial is best: pure logic shared by the summary and the terminal's tables (no imports
beyond the standard library, so that `campaign status` stays quick)."""

from __future__ import annotations

RANK_BY = "val_accuracy"  # a grid's trials are ranked by it, highest first


def best_trial(metrics: dict[str, dict[str, float]], objective: tuple[str, str] = (RANK_BY, "max")) -> tuple[str, float] | None:
    """The trial whose metrics (trial id -> its metrics) are best by the objective (metric, min|max),
    and its value; None when no trial has the metric. Ties go to the same trial every time."""
    metric, mode = objective
    ranked = [(m[metric], tid) for tid, m in metrics.items() if metric in m]
    if not ranked:
        return None
    value, tid = max(ranked) if mode == "max" else min(ranked)
    return tid, value
