"""All trials' metric curves in one figure (loss and accuracy against step), from MLflow.

Written next to the campaign record and logged to the campaign's MLflow run, so a campaign
is compared at a glance without opening each trial.
"""

from __future__ import annotations

from pathlib import Path

from tasks.hub_calls import in_hub
from tasks.timeline import FAST_PNG

CURVES = ("train_loss", "val_loss", "val_accuracy")


def draw_curves(histories: dict[str, dict[str, list[tuple[int, float]]]], title: str, png: Path) -> Path | None:
    """histories: trial label -> metric -> [(step, value)]; one panel per metric that any trial has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in CURVES if any(h.get(m) for h in histories.values())]
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for label, history in histories.items():
            points = sorted(history.get(metric, []))
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], label=label, linewidth=1)
        ax.set_title(metric)
        ax.set_xlabel("step")
        if metric.endswith("loss"):
            ax.set_yscale("log")
    # A fixed corner and fixed margins (in inches): "best" and tight_layout measure every
    # line and label, which doubled the drawing's cost, paid after the campaign's last trial.
    # Losses fall and accuracies rise: the legend takes the corner the last panel's curves leave free.
    axes[0][-1].legend(fontsize="x-small", loc="upper right" if metrics[-1].endswith("loss") else "lower right")
    fig.suptitle(title)
    width = 5 * len(metrics)
    fig.subplots_adjust(left=0.8 / width, right=1 - 0.3 / width, bottom=0.55 / 4, top=1 - 0.75 / 4, wspace=0.25)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, pil_kwargs=FAST_PNG)
    plt.close(fig)
    return png


@in_hub
def campaign_curves(uri: str, run_ids: dict[str, str], labels: dict[str, str], title: str, png: Path | str) -> Path | None:
    """Read each trial's history from its MLflow run and draw them together (in the
    campaign's hub when it has one: a path as a string then)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    histories = {
        f"{labels.get(trial, trial)}": {m: [(p.step, p.value) for p in client.get_metric_history(run_id, m)] for m in CURVES}
        for trial, run_id in run_ids.items()
    }
    return draw_curves(histories, title, Path(png))
