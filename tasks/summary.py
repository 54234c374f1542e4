"""The campaign summary: DVC metrics (`dvc metrics show`) and the parent run's metrics."""

from __future__ import annotations

from typing import Any

from flows.spec import CampaignSpec
from tasks.grid import Trial
from training.files import write_json_atomic

RANK_BY = "val_accuracy"
REPORTED = ("val_accuracy", "val_loss", "train_loss")  # per trial, in the DVC metrics


def summarize(trials: list[Trial], results: dict[str, dict[str, Any]], failed: dict[str, str]) -> dict[str, Any]:
    per_trial = {t.id: results[t.id]["metrics"] for t in trials if t.id in results}
    summary: dict[str, Any] = {"trials": len(trials), "finished": len(per_trial), "failed": len(failed)}
    ranked = [(m[RANK_BY], tid) for tid, m in per_trial.items() if RANK_BY in m]
    if ranked:
        best_value, best_id = max(ranked)
        summary["best"] = {"trial": best_id, RANK_BY: best_value}
    summary["per_trial"] = {tid: {k: round(m[k], 6) for k in REPORTED if k in m} for tid, m in per_trial.items()}
    return summary


def write_summary(spec: CampaignSpec, trials: list[Trial], results: dict[str, dict[str, Any]], failed: dict[str, str]) -> dict[str, Any]:
    summary = summarize(trials, results, failed)
    write_json_atomic(spec.tracking.summary, {"campaign": spec.campaign.name, **summary})
    return summary
