"""A trial's workload (model, data, loss, optimizer) as the trainer builds it, and the check
that every distinct one builds and trains on real samples before a campaign starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.spec import TrialSpec
from tasks.grid import Trial
from training.errors import CampaignError


def trial_function(spec: TrialSpec) -> dict[str, Any]:
    """A function trial's TrialConfig fields (training.function): the target with its kwargs,
    and the trial's whole spec for ctx.config; nothing for a trial of the project's loop."""
    if spec.training.target is None:
        return {}
    return {"function": {"target": spec.training.target, "kwargs": dict(spec.training.kwargs)}, "point": spec.model_dump(mode="json")}


def trial_workload(spec: TrialSpec, root: Path = Path(".")) -> dict[str, Any]:
    """The plain dicts training.workload builds from (TrialConfig's model, data, loss, optimizer);
    a function trial builds its own: empty model and data."""
    if spec.training.target is not None:
        return {"model": {}, "data": {}, "loss": spec.loss.trial_dict(), "optimizer": spec.optimizer.model_dump(mode="json")}
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
        if trial.spec.training.target is not None:
            _check_function(trial, seen, len(trials) > 1)
            continue
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


def _check_function(trial: Trial, seen: set[str], several: bool) -> None:
    """A function trial's target (and its check hook, in a folder of its own) once per distinct one."""
    import tempfile

    from training.config import TrialConfig
    from training.function import check_function

    t = trial.spec.training
    check = {"target": t.check, "kwargs": dict(t.kwargs)} if t.check else None
    key = json.dumps([trial_function(trial.spec)["function"], check], sort_keys=True, default=str)
    if key in seen:
        return
    seen.add(key)
    with tempfile.TemporaryDirectory(prefix="campaign-check-") as folder:
        cfg = TrialConfig(trial_id=trial.id, seed=trial.spec.seed, model={}, data={}, steps=1, batch_size=t.batch_size,
                          lr=t.lr, checkpoint_every=t.checkpoint_every, keep_checkpoints=1, trial_dir=folder,
                          async_checkpoints=False, **trial_function(trial.spec))
        try:
            check_function(cfg.function, check, cfg)
        except CampaignError as e:
            where = f"trial {trial.id} ({trial.label}): " if several and trial.overrides else ""
            raise type(e)(f"{where}{e}") from None
