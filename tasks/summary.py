"""The campaign summary: DVC metrics (`dvc metrics show`), the parent run's tags and summary.json.

The file names its campaign and says `"written_by": "campaign"`: a later launch replaces it
only when it is this campaign's own (training.spec.summary_not_ours, checked before anything
runs and again here), never a file the spec happens to point at."""

from __future__ import annotations

from typing import Any

from training.errors import CampaignError
from training.spec import (SUMMARY_WRITER, TRIAL_METRIC_NAMES, CampaignSpec, summary_not_ours, trial_metrics_folder,
                           trial_metrics_not_ours)
from tasks.grid import Trial
from training.files import write_json_atomic
from tasks.ranking import DEFAULT_OBJECTIVE, RANK_BY, best_trial

REPORTED = TRIAL_METRIC_NAMES  # per trial, in the DVC metrics


def summarize(trials: list[Trial], results: dict[str, dict[str, Any]], failed: dict[str, str], pruned: set[str] = frozenset(),
              objective: tuple[str, str] = DEFAULT_OBJECTIVE) -> dict[str, Any]:
    """Counts, the best trial by the objective (pruned trials stopped early: not candidates), and each trial's metrics."""
    per_trial = {t.id: results[t.id]["metrics"] for t in trials if t.id in results}
    summary: dict[str, Any] = {"trials": len(trials), "finished": len(per_trial) - len(pruned & set(per_trial)),
                               "pruned": len(pruned & set(per_trial)), "failed": len(failed)}
    best = best_trial({tid: m for tid, m in per_trial.items() if tid not in pruned}, objective)
    if best is not None:
        summary["best"] = {"trial": best[0], objective[0]: best[1]}
    summary["per_trial"] = {tid: {k: round(m[k], 6) for k in REPORTED if k in m} for tid, m in per_trial.items()}
    return summary


def ranked_by(spec: CampaignSpec) -> tuple[str, str]:
    """The campaign's metric and min|max: a search's (or early stopping's) objective; a grid's
    `tracking.rank_by`, else validation accuracy for the project's loop and validation loss for
    a function, which reports no accuracy of the loop's. The summary's best trial, MLflow's view
    and its charts, and the terminal's tables follow it."""
    if spec.searched:
        return spec.objective
    metric = spec.tracking.rank_by or ("val_loss" if spec.function else RANK_BY)
    return metric, spec.tracking.rank_mode or ("max" if metric == "val_accuracy" else "min")


def varied_params(spec: CampaignSpec) -> list[str]:
    """The parameters the campaign's trials differ by (their MLflow params' names): the grid's, the search space's."""
    return list(dict.fromkeys([*spec.grid, *(spec.search.space if spec.search else ())]))


def write_summary(spec: CampaignSpec, trials: list[Trial], results: dict[str, dict[str, Any]], failed: dict[str, str],
                  pruned: set[str] = frozenset()) -> dict[str, Any]:
    summary = summarize(trials, results, failed, pruned, ranked_by(spec))
    path, name = spec.tracking.summary, spec.campaign.name
    # Checked before the launch (training.spec.check_outputs); again now: a file may have been put there since.
    if why := summary_not_ours(path, name):
        raise CampaignError(f"tracking.summary: {path} {why}, and was left as it is; the trials' results are on disk "
                            f"and in MLflow: move {path} aside or point tracking.summary at a new file, then launch again")
    folder = trial_metrics_folder(path)
    if why := trial_metrics_not_ours(folder):
        raise CampaignError(f"tracking.summary: {folder} {why}, and was left as it is; move it aside, then launch again")
    # DVC reads the numbers (`dvc metrics show`): the counts and the best trial here, the two
    # strings saying whose file this is, and each trial's figures in a file of its own.
    write_json_atomic(path, {"campaign": name, "written_by": SUMMARY_WRITER, **{k: v for k, v in summary.items() if k != "per_trial"}})
    write_trial_metrics(folder, summary["per_trial"])
    return summary


def write_trial_metrics(folder, per_trial: dict[str, dict[str, float]]) -> None:
    """<folder>/<trial>.json per trial with figures; files of trials no longer in the campaign removed."""
    folder.mkdir(parents=True, exist_ok=True)
    for trial_id, metrics in per_trial.items():
        write_json_atomic(folder / f"{trial_id}.json", metrics)
    for stale in set(p.name for p in folder.iterdir()) - {f"{t}.json" for t in per_trial}:
        (folder / stale).unlink(missing_ok=True)


def summary_markdown(name: str, summary: dict[str, Any], trials: list[Trial], states: dict[str, str], run_ids: dict[str, str],
                     mlflow_ui: str | None = None, experiment_id: str | None = None) -> str:
    """The campaign as a markdown table (the flow run's Prefect artifact): every trial, its
    state and metrics, its MLflow run (a link when an MLflow UI is known, and one to the
    campaign's view there); the best trial first in words."""
    from tasks.tracking import campaign_view_url

    def run_cell(run_id: str | None) -> str:
        if run_id is None:
            return "-"
        if mlflow_ui and experiment_id:
            return f"[{run_id}]({mlflow_ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id})"
        return run_id

    lines = [f"# campaign {name}", ""]
    counts = f"{summary['finished']} finished, {summary.get('pruned', 0)} pruned, {summary['failed']} failed of {summary['trials']}"
    best = summary.get("best")
    if best:
        metric, value = next((k, v) for k, v in best.items() if k != "trial")
        lines.append(f"{counts}; best **{best['trial']}**: {metric} {value:.4f}")
    else:
        lines.append(counts)
    if mlflow_ui and experiment_id:
        lines += ["", f"MLflow: [every trial, best first]({campaign_view_url(mlflow_ui, experiment_id, name)}) · "
                      f"[their curves]({campaign_view_url(mlflow_ui, experiment_id, name, charts=True)})"]
    lines += ["", "| trial | grid point | state | " + " | ".join(REPORTED) + " | MLflow run |",
              "| --- | --- | --- | " + " | ".join("---" for _ in REPORTED) + " | --- |"]
    for t in trials:
        metrics = summary["per_trial"].get(t.id, {})
        cells = [f"{metrics[k]:.4f}" if k in metrics else "-" for k in REPORTED]
        lines.append(f"| {t.id} | {t.label} | {states.get(t.id, '-')} | " + " | ".join(cells) + f" | {run_cell(run_ids.get(t.id))} |")
    return "\n".join(lines) + "\n"
