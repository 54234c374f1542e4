"""Grid expansion: a pure function from the campaign spec to its trials, with stable ids."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from flows.spec import CampaignSpec, TrialSpec


@dataclass(frozen=True)
class Trial:
    id: str  # stable: derived from everything the trial's training depends on
    label: str  # the grid point, for people: "lr=0.05 width=8"
    overrides: dict[str, Any]  # grid key -> value
    spec: TrialSpec


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def trial_id(spec: TrialSpec, overrides: dict[str, Any]) -> str:
    """Readable prefix from the grid point plus a hash of the whole resolved trial.

    Changing anything that affects training (steps, seed, a non-grid field) changes the id,
    so a resume never continues a checkpoint under different settings.
    """
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    readable = "-".join(f"{key.split('.')[-1]}{_short(v)}" for key, v in overrides.items())
    return f"{readable}-{digest}" if readable else digest


def expand_grid(spec: CampaignSpec) -> list[Trial]:
    """The cartesian product of the grid axes, in the order the spec lists them."""
    keys = list(spec.grid)
    trials = []
    base = spec.model_dump()
    for values in itertools.product(*(spec.grid[k] for k in keys)) if keys else [()]:
        raw = {"seed": spec.campaign.seed, "data": base["data"], "model": dict(base["model"]), "training": dict(base["training"])}
        overrides = dict(zip(keys, values))
        for key, value in overrides.items():
            section, _, field = key.partition(".")
            raw[section][field] = value
        trial_spec = TrialSpec.model_validate(raw)
        label = " ".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in overrides.items()) or "default"
        trials.append(Trial(trial_id(trial_spec, overrides), label, overrides, trial_spec))
    return trials
