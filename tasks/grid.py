"""Grid expansion: a pure function from the campaign spec to its trials, with stable ids."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from training.spec import CampaignSpec, TrialSpec, set_path
from training.config import LOADER_FIELDS
from training.layout import portable_name

NOT_TRAINED = ("stall_timeout_s", "cuda_graphs")  # a graph replays the step it captured: the same computation  # training settings that are not part of a trial's identity
LABEL_VALUE_CHARS = 60  # a grid value's share of a label; the whole value is in the trial's spec and MLflow params


@dataclass(frozen=True)
class Trial:
    id: str  # stable: derived from everything the trial's training depends on; a portable folder name
    label: str  # the grid point, for people: "lr=0.05 width=8"
    overrides: dict[str, Any]  # grid key -> value
    spec: TrialSpec


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shown(value: Any) -> str:
    """A grid value as a label shows it: control characters escaped (a label reaches terminals,
    Prefect and MLflow run names) and a long value cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in _short(value))
    return text if len(text) <= LABEL_VALUE_CHARS else text[:LABEL_VALUE_CHARS - 1] + "…"


def trial_id(spec: TrialSpec, overrides: dict[str, Any]) -> str:
    """Readable prefix from the grid point plus a hash of the whole resolved trial.

    Changing anything that affects training (steps, seed, a non-grid field) changes the id,
    so a resume never continues a checkpoint under different settings. The id is the trial's
    folder name: the prefix is the grid point as it reads ("lr0.1-width16") when that is a
    portable name, else a slug of it with a hash of all of it (training.layout.portable_name),
    so a value such as '../x', 'a/b' or a 300-character text never leads a path out of the
    campaign's folder or past a filesystem's name limit.
    """
    # How batches are fed (loader workers, device residency) and how long a stall is waited
    # out do not change what is trained.
    canonical = json.dumps(spec.model_dump(mode="json", exclude={"data": set(LOADER_FIELDS), "training": set(NOT_TRAINED)}),
                           sort_keys=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    readable = portable_name("-".join(f"{key.split('.')[-1]}{_short(v)}" for key, v in overrides.items())) if overrides else ""
    return f"{readable}-{digest}" if readable else digest


def _base(spec: CampaignSpec) -> dict[str, Any]:
    base = spec.model_dump()
    base["training"].setdefault("logical_ranks", None)
    if base["training"]["logical_ranks"] is None:
        base["training"]["logical_ranks"] = spec.resources.max_devices  # None for `auto`: decided by sizing
    return base


def make_trial(spec: CampaignSpec, overrides: dict[str, Any], seed_index: int = 0, base: dict[str, Any] | None = None) -> Trial:
    """The trial at one point of the grid or search space (and one of its seeds)."""
    base = _base(spec) if base is None else base
    raw = {"seed": spec.campaign.seed + seed_index, **copy.deepcopy({k: base[k] for k in ("data", "model", "optimizer", "loss", "training")})}
    for key, value in overrides.items():
        set_path(raw, key, value)
    trial_spec = TrialSpec.model_validate(raw)
    label = " ".join(f"{k.split('.')[-1]}={_shown(v)}" for k, v in overrides.items()) or "default"
    if seed_index:
        label += f" seed+{seed_index}"
    return Trial(trial_id(trial_spec, overrides), label, overrides, trial_spec)


def expand_grid(spec: CampaignSpec) -> list[Trial]:
    """The cartesian product of the grid axes, in the order the spec lists them.

    A trial's logical width is resolved here when the spec leaves it to the devices (their
    maximum), so that it is part of the trial's identity: it changes the result."""
    keys = list(spec.grid)
    base = _base(spec)
    return [make_trial(spec, dict(zip(keys, values)), base=base)
            for values in (itertools.product(*(spec.grid[k] for k in keys)) if keys else [()])]


def grid_points(spec: CampaignSpec) -> list[dict[str, Any]]:
    """Every point of a grid: the `grid` section's, or a grid search's `choice` dimensions."""
    axes = spec.grid if spec.search is None else {k: d.choice for k, d in spec.search.space.items()}
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]
