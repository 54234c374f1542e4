"""Which trial is best: pure logic shared by the summary and the terminal's tables (no imports
beyond the standard library, so that `campaign status` stays quick)."""

from __future__ import annotations

from typing import Any, Iterable

RANK_BY = "val_accuracy"  # a grid's trials are ranked by it, highest first
DEFAULT_OBJECTIVE = (RANK_BY, "max")  # a grid of the project's loop; a record's from before records kept their objective


def best_trial(metrics: dict[str, dict[str, float]], objective: tuple[str, str] = DEFAULT_OBJECTIVE) -> tuple[str, float] | None:
    """The trial whose metrics (trial id -> its metrics) are best by the objective (metric, min|max),
    and its value; None when no trial has the metric. Ties go to the same trial every time."""
    metric, mode = objective
    ranked = [(m[metric], tid) for tid, m in metrics.items() if metric in m]
    if not ranked:
        return None
    value, tid = max(ranked) if mode == "max" else min(ranked)
    return tid, value


def best_finished(rows: Iterable[Any], objective: tuple[str, str] | None) -> tuple[str, float] | None:
    """The best of the trials (`tasks.records.TrialStatus` rows) that finished, as in the summary:
    a running trial's metrics are not its result yet, and a pruned one was stopped early."""
    return best_trial({r.trial_id: r.metrics for r in rows if r.state == "finished"}, objective or DEFAULT_OBJECTIVE)
