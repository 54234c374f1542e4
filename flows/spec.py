"""params.yaml parsed once, at the edge, into typed objects (pydantic).

Nothing below flows/ handles raw dicts. Every mistake becomes one SpecError that lists
each culprit as a field path (e.g. `grid.training.lr[1]`) with what would be valid.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training.errors import CampaignError


class SpecError(CampaignError):
    """The campaign spec is invalid; the message names every bad field and the fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CampaignSection(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64)
    seed: int = Field(default=0, ge=0)


class DataSection(Strict):
    path: Path = Path("data/digits.npz")


class SmallCNNSpec(Strict):
    name: Literal["small_cnn"]
    width: int = Field(default=16, ge=1, le=1024)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)


class MLPSpec(Strict):
    name: Literal["mlp"]
    width: int = Field(default=128, ge=1, le=65536)
    depth: int = Field(default=2, ge=1, le=64)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)


ModelSpec = Annotated[Union[SmallCNNSpec, MLPSpec], Field(discriminator="name")]


class TrainingSection(Strict):
    steps: int = Field(ge=1)
    batch_size: int = Field(ge=1, description="global batch, the same at every number of devices")
    lr: float = Field(gt=0.0, le=10.0)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    checkpoint_every: int = Field(default=50, ge=1)
    log_every: int = Field(default=10, ge=1)
    eval_every: int = Field(default=50, ge=1)

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> "TrainingSection":
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})")
        return self


class ResourcesSection(Strict):
    devices: Union[Annotated[int, Field(ge=1)], tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]], Literal["auto"]] = Field(
        default=1, description="DDP processes of each trial: N, [min, max] (elastic), or auto (fewest that fit)")
    memory_gb: Union[Annotated[float, Field(gt=0)], Literal["auto"], None] = Field(
        default=None, description="memory per device: unset = a whole device; GiB or auto (measured) = may share a GPU")

    @field_validator("devices")
    @classmethod
    def _range_ordered(cls, devices):
        if isinstance(devices, tuple) and devices[0] > devices[1]:
            raise ValueError(f"[min, max] must have min <= max (got [{devices[0]}, {devices[1]}])")
        return devices

    @property
    def max_devices(self) -> int | None:
        """The most processes a trial may run with; None for auto (decided by sizing)."""
        if self.devices == "auto":
            return None
        return self.devices[1] if isinstance(self.devices, tuple) else self.devices


class DeclaredNodeSpec(Strict):
    name: str = Field(min_length=1)
    devices: int = Field(ge=1)
    memory_gb: float = Field(gt=0)
    kind: Literal["gpu", "cpu"] = "gpu"
    model: str = ""
    nvlink_pairs: list[tuple[int, int]] = Field(default_factory=list)


class ClusterSection(Strict):
    cpu_slots: int | None = Field(default=None, ge=1, description="CPU slots when there is no GPU; unset: one per core")
    nodes: list[DeclaredNodeSpec] | None = Field(
        default=None, description="a declared cluster, for `campaign plan` (launch uses the devices of this host)")


class SchedulingSection(Strict):
    """How elastic trials ([min, max] devices) are sized and resized while they run."""

    resize_pause_s: float = Field(default=2.0, gt=0, description="what a resize costs a trial; smaller gains are not worth one")
    min_run_s: float = Field(default=20.0, gt=0, description="a trial runs at least this long between two resizes")


class TrackingSection(Strict):
    mlflow_uri: str = Field(default="sqlite:///mlflow.db", description="overridden by $MLFLOW_TRACKING_URI")
    experiment: str = Field(default="campaigns", min_length=1)
    runs_dir: Path = Path("checkpoints")
    summary: Path = Field(default=Path("metrics/campaign.json"), description="campaign summary, DVC metrics")
    keep_checkpoints: int = Field(default=2, ge=1)


def tracking_uri(tracking: TrackingSection) -> str:
    """The MLflow store: $MLFLOW_TRACKING_URI when set (a team's server), else the spec's."""
    return os.environ.get("MLFLOW_TRACKING_URI") or tracking.mlflow_uri


class TrialSpec(Strict):
    """One grid point, fully resolved: everything a trial's training depends on."""

    seed: int
    data: DataSection
    model: ModelSpec
    training: TrainingSection


class CampaignSpec(Strict):
    campaign: CampaignSection
    data: DataSection = DataSection()
    model: ModelSpec
    training: TrainingSection
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    resources: ResourcesSection = ResourcesSection()
    cluster: ClusterSection = ClusterSection()
    scheduling: SchedulingSection = SchedulingSection()
    tracking: TrackingSection = TrackingSection()

    @field_validator("grid")
    @classmethod
    def _grid_axes(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            section, _, field = key.partition(".")
            if section not in ("model", "training") or not field or "." in field:
                raise ValueError(f"grid key {key!r} must be 'model.<field>' or 'training.<field>'")
            if not values:
                raise ValueError(f"grid axis {key!r} is empty: give it at least one value")
            if len({repr(v) for v in values}) != len(values):
                raise ValueError(f"grid axis {key!r} repeats a value: {values}")
        return grid

    @model_validator(mode="after")
    def _batch_covers_devices(self) -> "CampaignSpec":
        most = self.resources.max_devices
        if most is not None and self.training.batch_size < most:
            raise ValueError(
                f"training.batch_size ({self.training.batch_size}) is smaller than the {most} devices of resources.devices: "
                "every process needs at least one sample per step"
            )
        return self


def _format_errors(source: str, error: ValidationError, prefix: str = "") -> list[str]:
    lines = []
    for e in error.errors():
        path = prefix + ".".join(str(p) for p in e["loc"] if not (isinstance(p, str) and p in ("small_cnn", "mlp")))
        got = "" if e["type"] in ("missing",) else f" (got {e.get('input')!r})"
        lines.append(f"  {path or '<root>'}: {e['msg']}{got}")
    return lines


def _grid_value_errors(spec: CampaignSpec) -> list[str]:
    """Check each grid value in its field's type and range, naming `grid.<key>[i]`."""
    problems = []
    base = spec.model_dump()
    for key, values in spec.grid.items():
        section, _, field = key.partition(".")
        known = type(getattr(spec, section)).model_fields
        if field not in known:
            problems.append(f"  grid.{key}: {section} has no field {field!r}; valid: {', '.join(sorted(known))}")
            continue
        for i, value in enumerate(values):
            raw = copy.deepcopy(base)
            raw[section][field] = value
            try:
                CampaignSpec.model_validate(raw)
            except ValidationError as e:
                for line in _format_errors("", e):
                    problems.append(f"  grid.{key}[{i}] = {value!r}:{line.split(':', 1)[1]}")
    return problems


def parse_spec(raw: Any, source: str = "params.yaml") -> CampaignSpec:
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the spec must be a mapping with sections campaign, model, training, ... (got {type(raw).__name__})")
    try:
        spec = CampaignSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"{source} is invalid:\n" + "\n".join(_format_errors(source, e))) from None
    problems = _grid_value_errors(spec)
    if problems:
        raise SpecError(f"{source} is invalid:\n" + "\n".join(problems))
    return spec


def load_spec(path: str | Path) -> CampaignSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path} does not exist: pass the path of a campaign spec (e.g. params.yaml)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{path} is not valid YAML: {e}") from None
    return parse_spec(raw, str(path))


def check_data(spec: CampaignSpec, root: Path = Path(".")) -> None:
    """The data file must exist before anything starts."""
    path = spec.data.path if spec.data.path.is_absolute() else root / spec.data.path
    if not path.is_file():
        raise SpecError(
            f"data.path: {spec.data.path} does not exist: run `dvc repro prepare` "
            f"(or `python -m training.data --out {spec.data.path}`) first, or point data.path at the prepared .npz"
        )
