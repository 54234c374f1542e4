"""A trial's workload (model, data, loss, optimizer) as the trainer builds it, and the check
that every distinct one builds and trains on real samples before a campaign starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.spec import TrialSpec
from tasks.grid import Trial
from training.errors import CampaignError


def trial_workload(spec: TrialSpec, root: Path = Path(".")) -> dict[str, Any]:
    """The plain dicts training.workload builds from (TrialConfig's model, data, loss, optimizer)."""
    model = spec.model.model_dump(mode="json")
    return {
        "model": model,
        "data": spec.data.trial_dict(root),
        "loss": spec.loss.trial_dict(),
        "optimizer": spec.optimizer.model_dump(mode="json"),
    }


def check_trials(trials: list[Trial]) -> None:
    """Build each distinct workload once and run a training step on two real samples; the
    first failure is raised naming the field (and the trial, when the grid varies it)."""
    from training.workload import check_workload

    seen: set[str] = set()
    for trial in trials:
        work = trial_workload(trial.spec)
        key = json.dumps(work, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            check_workload(**work, lr=trial.spec.training.lr)
        except CampaignError as e:
            where = f"trial {trial.id} ({trial.label}): " if len(trials) > 1 and trial.overrides else ""
            raise type(e)(f"{where}{e}") from None
