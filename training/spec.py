"""params.yaml parsed once, at the edge, into typed objects (pydantic).

Nothing below flows/ handles raw dicts. Every mistake becomes one SpecError that lists
each culprit as a field path (e.g. `grid.training.lr[1]`) with what would be valid.
"""

from __future__ import annotations

import copy
import math
import os
import posixpath
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_serializer, model_validator

from training.errors import CampaignError


class SpecError(CampaignError):
    """The campaign spec is invalid; the message names every bad field and the fix."""


class Strict(BaseModel):
    # No field takes inf or NaN: a bound such as `gt=0` alone lets `.inf` through, and no run
    # can honour an infinite pause, memory or norm (nor compare a NaN with anything).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Every number of the spec is bounded to what a run can honour, checked before anything runs
# (tests/test_spec_bounds.py). The limits, and why each is where it is:
MAX_SEED = 2**32 - 1  # numpy's legacy seeding (np.random.seed, RandomState: Optuna's samplers, users' code) takes < 2**32
MAX_STEPS = 10**9  # steps and every interval counted in steps: ~11 days at 1 ms a step; steps x batch stays far inside int64
MAX_BATCH = 2**24  # samples in one step (or one forward pass): 16 M
MAX_DEVICES = 4096  # processes of one trial, and its logical ranks
MAX_SLOTS = 1024  # devices of one node (CPU slots, a declared node's): each is a Device the inventory and the packer walk
MAX_NODES = 256  # declared nodes of `campaign plan`'s cluster
MAX_MEMORY_GB = 1024.0  # GiB of one device: past any accelerator's (the lease store keeps it as bytes in a 64-bit row)
MAX_BUILTIN_PARAMETERS = 2**30  # a built-in model's weights: 4 GiB in fp32, 12+ GiB with gradients and momentum
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a wait in seconds: a week, past any step, evaluation or checkpoint worth waiting out
MAX_PERIOD_S = 3600.0  # a sampling period in seconds: an hour


CAMPAIGN_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # a folder's name under runs_dir: no '/', never '.' or '..'


class CampaignSection(Strict):
    name: str = Field(pattern=CAMPAIGN_NAME, max_length=64)
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="search.seeds runs seed + 0..K-1, each <= 2**32 - 1")


TARGET = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"  # package.module:callable
TARGET_HELP = "a callable named 'package.module:callable'"
DIGITS_PATH = Path("data/digits.npz")
METRICS = ("val_loss", "val_accuracy", "train_loss")  # what the project's loop reports at its evaluations
METRIC_NAME = r"^[A-Za-z_][A-Za-z0-9_.]*$"
OUTPUT_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # model.output: auto, loss, logits or another attribute (training.outputs)


class DataSection(Strict):
    """The built-in digits (`path` of the prepared .npz) or a user's `target` returning (train, val)."""

    path: Path | None = Field(default=None, description="the prepared digits .npz (default data/digits.npz)")
    target: str | None = Field(default=None, pattern=TARGET, description=f"{TARGET_HELP} returning (train, val) map-style datasets")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the target")
    workers: int = Field(default=0, ge=0, le=64, description="DataLoader worker processes per trial process")
    on_device: Union[bool, Literal["auto"]] = Field(
        default="auto", description="keep the whole training set in device memory (auto: tensor datasets that fit)")

    @model_validator(mode="after")
    def _one_source(self) -> "DataSection":
        if self.target and self.path:
            raise ValueError("data.path (the built-in digits) and data.target (your datasets) exclude each other: keep one")
        if self.kwargs and not self.target:
            raise ValueError("data.kwargs are the target's arguments: set data.target too")
        return self

    @property
    def digits_path(self) -> Path | None:
        return None if self.target else (self.path or DIGITS_PATH)

    def trial_dict(self, root: Path) -> dict[str, Any]:
        """What a trial's processes build the data from (training.workload.build_datasets)."""
        loader = {"workers": self.workers, "on_device": self.on_device}
        if self.target:
            return {"target": self.target, "kwargs": dict(self.kwargs), **loader}
        path = self.digits_path
        return {"path": str(path if path.is_absolute() else (root / path).resolve()), **loader}


class SmallCNNSpec(Strict):
    name: Literal["small_cnn"]
    width: int = Field(default=16, ge=1, le=1024)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)


class MLPSpec(Strict):
    name: Literal["mlp"]
    width: int = Field(default=128, ge=1, le=65536)
    depth: int = Field(default=2, ge=1, le=64)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _buildable(self) -> "MLPSpec":
        # Each bound alone admits 64 layers of 65536 x 65536 (275 G weights): the check before
        # the campaign builds the model, and that one would never come back.
        weights = 64 * self.width + (self.depth - 1) * self.width ** 2 + self.width * 10  # digits: 64 features, 10 classes
        if weights > MAX_BUILTIN_PARAMETERS:
            raise ValueError(f"model.width ({self.width}) and model.depth ({self.depth}) make {weights:,} weights, more than the "
                             f"{MAX_BUILTIN_PARAMETERS:,} a built-in model may have: lower width or depth (a bigger model is a "
                             "model.target)")
        return self


class TargetModelSpec(Strict):
    """Any model: a callable returning a torch.nn.Module, called with `kwargs`."""

    target: str = Field(pattern=TARGET, description=f"{TARGET_HELP} returning a torch.nn.Module "
                        "(training.hf:from_config builds a Hugging Face transformers model from its config)")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    output: str = Field(
        default="auto", pattern=OUTPUT_NAME,
        description="which part of the model's output the loss takes: auto (a tensor; a tuple's first element; a "
                    "dict's or Hugging Face ModelOutput's logits), logits or another attribute name, or loss (the "
                    "model computes its own: called as model(inputs, labels=targets), the loss section left out)")

    @model_serializer(mode="wrap")
    def _output_at_default_left_out(self, handler: Any) -> dict[str, Any]:
        # A spec written before model.output existed keeps its trials' ids (tasks/grid.py hashes
        # the dump), and with them their checkpoints; the trainer reads a missing one as auto.
        dumped = handler(self)
        if self.output == "auto":
            dumped.pop("output", None)
        return dumped


def _model_kind(raw: Any) -> str | None:
    if isinstance(raw, dict):
        return "target" if "target" in raw else raw.get("name")
    return "target" if isinstance(raw, TargetModelSpec) else getattr(raw, "name", None)


ModelSpec = Annotated[
    Union[Annotated[SmallCNNSpec, Tag("small_cnn")], Annotated[MLPSpec, Tag("mlp")], Annotated[TargetModelSpec, Tag("target")]],
    Discriminator(_model_kind, custom_error_type="model_kind",
                  custom_error_message="model needs `name: small_cnn | mlp` (a built-in) or `target: package.module:callable`"),
]


class LossSection(Strict):
    """The training loss, a mean over the batch's samples: a built-in name or a target."""

    name: Literal["cross_entropy", "mse"] | None = None
    target: str | None = Field(default=None, pattern=TARGET, description=f"{TARGET_HELP}: (outputs, targets) -> mean loss")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_loss(self) -> "LossSection":
        if self.name and self.target:
            raise ValueError("loss.name (a built-in) and loss.target exclude each other: keep one")
        if self.kwargs and not self.target:
            raise ValueError("loss.kwargs are the target's arguments: set loss.target too")
        return self

    def trial_dict(self) -> dict[str, Any]:
        if self.target:
            return {"target": self.target, "kwargs": dict(self.kwargs)}
        return {"name": self.name or "cross_entropy"}


class OptimizerSection(Strict):
    """A torch.optim class by name; `kwargs` are its arguments (the learning rate is training.lr)."""

    name: str = Field(default="SGD", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="a torch.optim class: SGD, AdamW, ...")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kwargs")
    @classmethod
    def _no_lr(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "lr" in kwargs:
            raise ValueError("the learning rate is training.lr (the schedule scales it): remove optimizer.kwargs.lr")
        for key, value in kwargs.items():
            if (problem := _optimizer_kwarg_problem(key, value)) is not None:
                raise ValueError(f"optimizer.kwargs.{key} {problem}")
        return kwargs


# The optimizer's numbers torch.optim checks loosely or not at all (a NaN passes every `< 0`
# test; SGD takes any momentum >= 0, and one past 1 diverges): (low, high, low open, high open).
OPTIMIZER_KWARG_RANGES = {
    "momentum": (0.0, 1.0, False, True),
    "dampening": (0.0, 1.0, False, False),
    "weight_decay": (0.0, 1.0, False, False),
    "betas": (0.0, 1.0, False, True),  # each of the two
    "rho": (0.0, 1.0, False, False),
    "eps": (0.0, 1.0, True, False),  # a divisor: 0 divides by zero where a second moment is 0
}


def _number(value: float) -> str:
    """A bound as people read it: 4294967295, 1024, 0.5 (not 4.29497e+09)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _interval(low: float, high: float, low_open: bool = False, high_open: bool = False) -> str:
    return f"{'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"


def _optimizer_kwarg_problem(key: str, value: Any) -> str | None:
    """Why an optimizer keyword's value cannot be honoured, or None: every number finite, and
    the ones in OPTIMIZER_KWARG_RANGES within their range."""
    listed = isinstance(value, (list, tuple))
    items = list(value) if listed else [value]
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if any(number(v) and not math.isfinite(v) for v in items):
        return "must be a finite number"
    if key not in OPTIMIZER_KWARG_RANGES:
        return None
    low, high, low_open, high_open = OPTIMIZER_KWARG_RANGES[key]
    valid = _interval(low, high, low_open, high_open)
    pair = key == "betas"
    if listed != pair or (pair and len(items) != 2) or not all(map(number, items)):
        return f"must be two numbers, each in {valid}" if pair else f"must be a number in {valid}"
    inside = lambda v: (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
    if not all(map(inside, items)):
        return f"must be {'each ' if pair else ''}in {valid}"
    return None


DEFAULT_OPTIMIZER = OptimizerSection(name="SGD", kwargs={"momentum": 0.9})
MOVED_TO_OPTIMIZER = ("momentum", "weight_decay")


class TrainingSection(Strict):
    steps: int = Field(ge=1, le=MAX_STEPS)
    batch_size: int = Field(ge=1, le=MAX_BATCH, description="global batch, the same at every number of devices")
    lr: float = Field(gt=0.0, le=10.0)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    precision: Literal["fp32", "bf16", "fp16"] = Field(default="fp32", description="autocast dtype; fp16 adds a gradient scaler")
    grad_clip_norm: float | None = Field(default=None, gt=0.0, le=1e6, description="clip the global gradient norm to this "
                                         "(past 1e6 it clips nothing a run reaches: leave it unset)")
    compile: bool = Field(default=False, description="torch.compile the model")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="capture each step's forward and backward in a CUDA graph and replay it (fewer kernel launches: small models "
                    "run faster); auto and on: where the step can be captured (a GPU, one process, one micro-batch of static "
                    "shapes), else the plain step, with the reason in the trial's log; off: never")
    logical_ranks: int | None = Field(
        default=None, ge=1, le=MAX_DEVICES,
        description="data-parallel width the result is defined for (default: the most devices a trial may use)")
    scaling: Literal["reproducible", "goodput"] = Field(
        default="reproducible",
        description="reproducible: the batch is fixed, results do not depend on the schedule; goodput: an elastic trial's "
                    "batch follows its devices (batch_size is the batch at its most devices) and lr is scaled with it")
    lr_scaling: Literal["linear", "sqrt"] = Field(
        default="linear", description="goodput: how lr follows the batch (linear for SGD, sqrt for Adam-like optimizers)")
    max_batch_size: int | None = Field(
        default=None, ge=1, le=MAX_BATCH,
        description="goodput: the scheduler may grow the batch up to this when the measured gradient noise scale makes "
                    "it pay (Pollux); unset: the batch follows the devices")
    reduction: Literal["fast", "exact"] = Field(
        default="fast", description="fast: DDP's all-reduce, equal to float rounding at any device count; "
                                    "exact: gradients summed in logical order, bit for bit at any device count")
    max_device_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH,
                                         description="samples per forward pass at most: gradient accumulation above it")
    # Intervals past training.steps are allowed (only the final checkpoint or evaluation then).
    checkpoint_every: int = Field(default=50, ge=1, le=MAX_STEPS)
    log_every: int = Field(default=10, ge=1, le=MAX_STEPS)
    eval_every: int = Field(default=50, ge=1, le=MAX_STEPS)
    target: str | None = Field(default=None, pattern=TARGET, description=f"your own training function, {TARGET_HELP} taking "
                               "(ctx, **kwargs) (training.function): it runs instead of the project's loop")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of training.target (grid key training.kwargs.x)")
    check: str | None = Field(default=None, pattern=TARGET, description="a dry run of your function (ctx, **kwargs) on two samples with "
                              "one report and one save, run before the campaign starts")
    stall_timeout_s: Union[float, Literal["auto"], None] = Field(
        default="auto",
        description="seconds a running trial may go without progress (a step done, or a function trial's report; from its "
                    "launch, its first word) before it counts as stalled: its Python stacks go to its train.log, it is stopped, "
                    "recorded failed and not retried (tasks/watchdog.py). null: never; auto (unset): the longest of 300 s, "
                    "10 times its measured step time and 3 times the longest wait between two of its steps seen so far "
                    "(evaluations and checkpoints included), so 300 s before its first step (imports, compile, data loading); "
                    "a resize's next generation gets at least 300 s")

    @field_validator("stall_timeout_s", mode="before")
    @classmethod
    def _stall_timeout(cls, value: Any) -> Any:
        if value is None or value == "auto":
            return value
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
                or value > MAX_TIMEOUT_S):
            raise ValueError(f"must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}] (a week), null (never counted stalled) or "
                             "auto (from the trial's measured step time, at least 300 s)")
        return float(value)

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            moved = [k for k in MOVED_TO_OPTIMIZER if k in raw]
            if moved:
                raise ValueError(f"training.{moved[0]} moved to the optimizer: write `optimizer: {{name: SGD, kwargs: {{{moved[0]}: "
                                 f"{raw[moved[0]]}}}}}`")
        return raw

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> "TrainingSection":
        if self.target is None and (self.kwargs or self.check):
            raise ValueError("training.kwargs and training.check belong to training.target (your own function): set it, or remove them")
        if self.target is not None:
            ours = {name: value for name, value in (
                ("precision", self.precision != "fp32"), ("compile", self.compile), ("cuda_graphs", self.cuda_graphs != "auto"),
                ("grad_clip_norm", self.grad_clip_norm is not None),
                ("scaling", self.scaling != "reproducible"), ("max_batch_size", self.max_batch_size is not None),
                ("reduction", self.reduction != "fast"), ("max_device_batch", self.max_device_batch is not None)) if value}
            if ours:
                name = next(iter(ours))
                raise ValueError(f"training.{name} sets the project's own loop, and training.target runs yours: remove {name} "
                                 "and do it in your function (pass your own settings in training.kwargs)")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})")
        return self


def _whole(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


class ResourcesSection(Strict):
    devices: Union[Annotated[int, Field(ge=1, le=MAX_DEVICES)],
                   tuple[Annotated[int, Field(ge=1, le=MAX_DEVICES)], Annotated[int, Field(ge=1, le=MAX_DEVICES)]],
                   Literal["auto"]] = Field(
        default=1, description="DDP processes of each trial: N, [min, max] (elastic), or auto (fewest that fit)")
    memory_gb: Union[Annotated[float, Field(gt=0, le=MAX_MEMORY_GB)], Literal["auto"], None] = Field(
        default=None, description="memory per device: unset = a whole device; GiB or auto (measured) = may share a GPU")

    # One message each, with the valid range, instead of one per member of the union.
    @field_validator("devices", mode="before")
    @classmethod
    def _devices_in_range(cls, value: Any) -> Any:
        count = lambda v: _whole(v) and 1 <= v <= MAX_DEVICES
        if value == "auto" or count(value) or (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(count, value))):
            return value
        raise ValueError(f"must be a number of devices in [1, {MAX_DEVICES}], a range [min, max] of them (elastic), or auto "
                         "(the fewest that fit)")

    @field_validator("memory_gb", mode="before")
    @classmethod
    def _memory_in_range(cls, value: Any) -> Any:
        if value is None or value == "auto" or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                 and math.isfinite(value) and 0 < value <= MAX_MEMORY_GB):
            return value
        raise ValueError(f"must be GiB per device in (0, {MAX_MEMORY_GB:g}], auto (measured), or unset (a whole device)")

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
    devices: int = Field(ge=1, le=MAX_SLOTS)
    memory_gb: float = Field(gt=0, le=MAX_MEMORY_GB)
    kind: Literal["gpu", "cpu"] = "gpu"
    model: str = ""
    nvlink_pairs: list[tuple[int, int]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _pairs_name_devices(self) -> "DeclaredNodeSpec":
        for a, b in self.nvlink_pairs:
            if not (0 <= a < self.devices and 0 <= b < self.devices) or a == b:
                raise ValueError(f"cluster node {self.name!r}: nvlink pair [{a}, {b}] must name two different devices in "
                                 f"[0, {self.devices - 1}]")
        return self


class ClusterSection(Strict):
    cpu_slots: int | None = Field(default=None, ge=1, le=MAX_SLOTS, description="CPU slots when there is no GPU; unset: one per "
                                  "core; more than the cores share them round-robin")
    warm_workers: bool = Field(default=True, description="one-device trials run in processes kept warm between trials "
                               "(torch imported once), not a torchrun each")
    nodes: list[DeclaredNodeSpec] | None = Field(
        default=None, max_length=MAX_NODES, description="a declared cluster, for `campaign plan` (launch uses the devices of this host)")
    pool: str | None = Field(
        default=None, pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$",
        description="run the trials on the nodes of this campaign pool (`campaign worker --pool NAME` on each), not this host")
    shared_storage: bool = Field(
        default=True, description="a pool's nodes see tracking.runs_dir at the same path; false: each node keeps its trials "
                                  "in a folder of its own, their files travel through the Prefect API and their checkpoints "
                                  "through tracking.dvc_remote")


class SchedulingSection(Strict):
    """How elastic trials ([min, max] devices) are sized and resized while they run."""

    resize_pause_s: float = Field(default=2.0, gt=0, le=3600.0, description="what a resize costs a trial until one of the campaign's resizes is timed (then the timed pause); smaller gains are not worth one")
    min_run_s: float = Field(default=20.0, gt=0, le=86400.0, description="a trial runs at least this long between two resizes (a day at most)")
    order: Literal["remaining", "attained"] = Field(
        default="remaining",
        description="who goes first when devices are short: the trial with the least work left (its steps less those "
                    "done: shortest remaining first, the lowest average completion time) or the one that has run least "
                    "(least attained service: every trial moves forward together)")


class Choice(Strict):
    choice: list[Any] = Field(min_length=1)


class Uniform(Strict):
    uniform: tuple[float, float]


class LogUniform(Strict):
    log_uniform: tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]]


class IntUniform(Strict):
    int_uniform: tuple[int, int]


DIMENSION_KINDS = ("choice", "uniform", "log_uniform", "int_uniform")


def _dimension_kind(raw: Any) -> str | None:
    keys = set(raw) if isinstance(raw, dict) else set(type(raw).model_fields) if isinstance(raw, BaseModel) else set()
    kinds = [k for k in DIMENSION_KINDS if k in keys]
    return kinds[0] if len(kinds) == 1 else None


Dimension = Annotated[
    Union[Annotated[Choice, Tag("choice")], Annotated[Uniform, Tag("uniform")], Annotated[LogUniform, Tag("log_uniform")],
          Annotated[IntUniform, Tag("int_uniform")]],
    Discriminator(_dimension_kind, custom_error_type="dimension_kind",
                  custom_error_message="a search dimension is one of {choice: [a, b, ...]}, {uniform: [low, high]}, "
                                       "{log_uniform: [low, high]}, {int_uniform: [low, high]}"),
]


class SearchSection(Strict):
    """Search beyond the grid: trials drawn from a space by an Optuna sampler, resumable."""

    strategy: Literal["grid", "random", "sobol", "tpe"] = "random"
    trials: int | None = Field(default=None, ge=1, le=100_000, description="how many points (grid: all of them)")
    space: dict[str, Dimension] = Field(min_length=1, description="key -> {choice: [...]} | {uniform: [lo, hi]} | "
                                        "{log_uniform: [lo, hi]} | {int_uniform: [lo, hi]}")
    seeds: int = Field(default=1, ge=1, le=100, description="each point runs this many times, seeds campaign.seed + 0..K-1")
    metric: str = Field(default="val_loss", pattern=METRIC_NAME, description="what trials report: " + ", ".join(METRICS) + " (a function trial: any name it reports)")
    mode: Literal["min", "max"] | None = Field(default=None, description="default: max for val_accuracy, else min")

    @model_validator(mode="after")
    def _consistent(self) -> "SearchSection":
        for key, dim in self.space.items():
            bounds = getattr(dim, "uniform", None) or getattr(dim, "log_uniform", None) or getattr(dim, "int_uniform", None)
            if bounds is not None and bounds[0] >= bounds[1]:
                raise ValueError(f"search.space.{key}: [low, high] needs low < high (got {list(bounds)})")
        if self.strategy == "grid":
            ranged = [k for k, d in self.space.items() if not isinstance(d, Choice)]
            if ranged:
                raise ValueError(f"search.strategy grid takes only `choice` dimensions; {', '.join(ranged)} are ranges: "
                                 "list their values, or use strategy random | sobol | tpe")
        elif self.trials is None:
            raise ValueError(f"search.trials is required with strategy {self.strategy}: how many points to try")
        return self


class EarlyStoppingSection(Strict):
    """Stop bad trials at an evaluation (Optuna's pruners): their devices go to the others."""

    rule: Literal["asha", "hyperband", "median"] = "asha"
    metric: str | None = Field(default=None, pattern=METRIC_NAME, description="default: search.metric")
    mode: Literal["min", "max"] | None = Field(default=None, description="default: search.mode")
    min_steps: int = Field(default=1, ge=1, le=MAX_STEPS, description="no trial is stopped before this step (at most training.steps)")
    reduction_factor: int = Field(default=3, ge=2, le=100, description="asha/hyperband: 1/factor of the trials go on at each rung")


class TrackingSection(Strict):
    mlflow_uri: str = Field(default="sqlite:///mlflow.db", description="overridden by $MLFLOW_TRACKING_URI")
    experiment: str = Field(default="campaigns", min_length=1)
    runs_dir: Path = Path("checkpoints")
    summary: Path | None = Field(default=None, description="campaign summary, DVC metrics (default: metrics/<campaign name>.json, "
                                                           "so one campaign never overwrites another's)")
    keep_checkpoints: int = Field(default=2, ge=1, le=1000)
    system_metrics_every_s: float = Field(default=10.0, ge=0, le=MAX_PERIOD_S, description="per-trial device metrics period; 0: "
                                          "none; else at least 0.1 (a reading of the devices takes milliseconds)")

    @field_validator("system_metrics_every_s")
    @classmethod
    def _sampling_period(cls, every: float) -> float:
        if 0 < every < 0.1:
            raise ValueError(f"must be 0 (none) or a period in [0.1, {MAX_PERIOD_S:g}] seconds: a sampler that never sleeps "
                             "takes a core from the trials")
        return every
    dvc_remote: str | None = Field(default=None, min_length=1, description="a DVC remote (its name in .dvc/config, a URL or "
                                   "a folder) each checkpoint is pushed to and a resume pulls from: nodes need no shared storage")
    rank_by: str | None = Field(default=None, pattern=METRIC_NAME, description="the metric a grid's best trial is chosen by (the "
                                "summary, MLflow's view, `campaign status`); default: val_accuracy for the project's loop, "
                                "val_loss for your function (training.target); a search ranks by its own metric")
    rank_mode: Literal["min", "max"] | None = Field(default=None, description="min or max of tracking.rank_by; default: max for "
                                                   "val_accuracy, min for any other metric")


def tracking_uri(tracking: TrackingSection) -> str:
    """The MLflow store: $MLFLOW_TRACKING_URI when set (a team's server), else the spec's."""
    return os.environ.get("MLFLOW_TRACKING_URI") or tracking.mlflow_uri


class TrialSpec(Strict):
    """One grid point, fully resolved: everything a trial's training depends on."""

    seed: int
    data: DataSection
    model: ModelSpec | None = None  # None: a function trial (training.target) builds its own
    optimizer: OptimizerSection
    loss: LossSection
    training: TrainingSection


GRID_SECTIONS = ("model", "data", "training", "optimizer", "loss")


class CampaignSpec(Strict):
    campaign: CampaignSection
    data: DataSection = DataSection()
    model: ModelSpec | None = None  # required unless training.target names your own function
    optimizer: OptimizerSection = DEFAULT_OPTIMIZER
    loss: LossSection = LossSection()
    training: TrainingSection
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    search: SearchSection | None = None
    early_stopping: EarlyStoppingSection | None = None
    resources: ResourcesSection = ResourcesSection()
    cluster: ClusterSection = ClusterSection()
    scheduling: SchedulingSection = SchedulingSection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="before")
    @classmethod
    def _summary_per_campaign(cls, raw: Any) -> Any:
        """Each campaign's summary in a file of its own unless the spec names one (an example
        must not write the file the default campaign's DVC stage tracks)."""
        if isinstance(raw, dict) and isinstance(raw.get("campaign"), dict) and isinstance(raw["campaign"].get("name"), str):
            tracking = raw.get("tracking") if isinstance(raw.get("tracking"), dict) else {}
            if tracking.get("summary") is None and (raw.get("tracking") is None or isinstance(raw.get("tracking"), dict)):
                raw = {**raw, "tracking": {**tracking, "summary": f"metrics/{raw['campaign']['name']}.json"}}
        return raw

    @field_validator("grid")
    @classmethod
    def _grid_axes(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            section, _, field = key.partition(".")
            if section not in GRID_SECTIONS or not field or "" in field.split("."):
                raise ValueError(f"grid key {key!r} must be '<section>.<field>' with a section of {', '.join(GRID_SECTIONS)} "
                                 "(deeper for kwargs: 'model.kwargs.depth')")
            if not isinstance(values, list) or not values:
                raise ValueError(f"grid axis {key!r} is empty: give it at least one value")
            if len({repr(v) for v in values}) != len(values):
                raise ValueError(f"grid axis {key!r} repeats a value: {values}")
        return grid

    @field_validator("search")
    @classmethod
    def _search_keys(cls, search: SearchSection | None) -> SearchSection | None:
        for key in (search.space if search else {}):
            section, _, field = key.partition(".")
            if section not in GRID_SECTIONS or not field or "" in field.split("."):
                raise ValueError(f"search.space key {key!r} must be '<section>.<field>' with a section of {', '.join(GRID_SECTIONS)}")
        return search

    @property
    def function(self) -> bool:
        """Trials run the user's own training function (training.target), not the project's loop."""
        return self.training.target is not None

    @model_validator(mode="after")
    def _model_or_function(self) -> "CampaignSpec":
        if self.model is None and not self.function:
            raise ValueError("model is missing: give `model: {name: small_cnn}` (a built-in), `model: {target: pkg.module:callable}`, "
                             "or your own training function as training.target")
        if self.function and (self.resources.devices == "auto" or self.resources.memory_gb == "auto"):
            field = "devices" if self.resources.devices == "auto" else "memory_gb"
            raise ValueError(f"resources.{field}: auto measures the project's loop on its model; a function trial (training.target) "
                             f"owns its model: give resources.{field} as a number" + (" of GiB, or leave it out (a whole device)" if field == "memory_gb" else ""))
        if getattr(self.model, "output", None) == "loss" and (self.loss.name or self.loss.target):
            raise ValueError(f"loss.{'name' if self.loss.name else 'target'}: model.output: loss trains on the loss the model "
                             "computes itself, and this one would not be used: remove the loss section, or set model.output "
                             "to the part of the output your loss takes (auto: logits)")
        for field, metric in (("search.metric", self.search.metric if self.search else None),
                              ("early_stopping.metric", self.early_stopping.metric if self.early_stopping else None),
                              ("tracking.rank_by", self.tracking.rank_by)):
            if metric is not None and metric not in METRICS and not self.function:
                raise ValueError(f"{field}: the project's loop reports {', '.join(METRICS)}, not {metric!r}: pick one of "
                                 "them (any name your function reports works with training.target)")
        return self

    @model_validator(mode="after")
    def _one_way_to_vary(self) -> "CampaignSpec":
        if self.grid and self.search is not None:
            raise ValueError("grid and search are two ways to vary trials: give one (a grid is `search: {strategy: grid, "
                             "space: {key: {choice: [...]}}}`)")
        stop = self.early_stopping
        if stop is not None and self.search is not None and (
                (stop.metric is not None and stop.metric != self.search.metric) or (stop.mode is not None and stop.mode != (self.search.mode or stop.mode))):
            raise ValueError(f"early_stopping judges trials by the search's objective ({self.search.metric}): leave "
                             "early_stopping.metric and mode out, or make them the search's")
        ranked = self.tracking.rank_by, self.tracking.rank_mode
        if self.searched and (ranked[0] not in (None, self.objective[0]) or ranked[1] not in (None, self.objective[1])):
            where = "search" if self.search is not None else "early_stopping"
            raise ValueError(f"tracking.rank_by: a campaign with {where} ranks its trials by that objective ({self.objective[0]}, "
                             f"{self.objective[1]}): leave tracking.rank_by and rank_mode out, or make them {where}'s metric and mode")
        if self.early_stopping is not None and not self.function and self.training.eval_every > self.training.steps:
            raise ValueError(f"early_stopping needs evaluations: training.eval_every ({self.training.eval_every}) is past "
                             f"training.steps ({self.training.steps})")
        return self

    @model_validator(mode="after")
    def _derived_numbers_in_range(self) -> "CampaignSpec":
        """Numbers the campaign derives from two fields stay in range too."""
        seeds = self.search.seeds if self.search is not None else 1
        if self.campaign.seed + seeds - 1 > MAX_SEED:
            raise ValueError(f"campaign.seed ({self.campaign.seed}) + search.seeds ({seeds}) - 1 is past {MAX_SEED} (2**32 - 1), "
                             f"the largest seed numpy's RandomState takes: campaign.seed must be in [0, {MAX_SEED - seeds + 1}]")
        stop = self.early_stopping
        if stop is not None and stop.min_steps > self.training.steps:
            raise ValueError(f"early_stopping.min_steps ({stop.min_steps}) is past training.steps ({self.training.steps}): no trial "
                             f"would ever be stopped; early_stopping.min_steps must be in [1, {self.training.steps}]")
        return self

    @model_validator(mode="after")
    def _pool_without_shared_storage(self) -> "CampaignSpec":
        """What a pool whose nodes share no folder with the campaign needs (flows/pool/mirror.py)."""
        if self.cluster.shared_storage:
            return self
        if self.cluster.pool is None:
            raise ValueError("cluster.shared_storage: false is about a pool's nodes: name the pool (cluster.pool) or leave "
                             "shared_storage out")
        if self.tracking.dvc_remote is None:
            raise ValueError("cluster.shared_storage: false needs tracking.dvc_remote: the checkpoints travel between the "
                             "nodes through it (a folder every node reaches, or any DVC remote)")
        uri = tracking_uri(self.tracking)
        if not uri.startswith(("http://", "https://", "databricks")):
            raise ValueError(f"cluster.shared_storage: false needs an MLflow server every node reaches as tracking.mlflow_uri "
                             f"(or $MLFLOW_TRACKING_URI), not {uri!r}: start one on the head (`mlflow server --host "
                             "ADDRESS --backend-store-uri sqlite:///mlflow.db`) and give its http:// address")
        if self.early_stopping is not None:
            raise ValueError("early_stopping reports to a study in the campaign's folder, which the nodes do not see with "
                             "cluster.shared_storage: false: drop early_stopping or share the runs folder")
        return self

    @property
    def varies(self) -> dict[str, list[Any]]:
        """key -> values that bound it (the grid's values; a range's ends), for checking each in its field."""
        if self.search is None:
            return self.grid
        out = {}
        for key, dim in self.search.space.items():
            out[key] = list(getattr(dim, "choice", None) or getattr(dim, "uniform", None) or getattr(dim, "log_uniform", None)
                            or getattr(dim, "int_uniform", None))
        return out

    @property
    def objective(self) -> tuple[str, str]:
        """(metric, min|max): what the search optimizes and early stopping judges trials by."""
        metric = (self.search.metric if self.search else None) or (self.early_stopping.metric if self.early_stopping else None) or "val_loss"
        mode = (self.search.mode if self.search else None) or (self.early_stopping.mode if self.early_stopping else None)
        return metric, mode or ("max" if metric == "val_accuracy" else "min")

    @property
    def searched(self) -> bool:
        """Trials come from an Optuna study (a search, or a grid with early stopping)."""
        return self.search is not None or self.early_stopping is not None

    @model_validator(mode="after")
    def _batch_covers_devices(self) -> "CampaignSpec":
        most = self.resources.max_devices
        logical = self.training.logical_ranks
        if most is not None and logical is not None and logical < most:
            raise ValueError(f"training.logical_ranks ({logical}) is smaller than the {most} devices of resources.devices: "
                             "every process holds at least one logical rank; raise logical_ranks or lower the devices")
        goodput = self.training.scaling == "goodput" or "goodput" in self.varies.get("training.scaling", [])
        if self.training.max_batch_size is not None and not goodput:
            raise ValueError("training.max_batch_size lets the scheduler choose a goodput trial's batch; this campaign has "
                             "scaling: reproducible (the batch is fixed): remove max_batch_size or use scaling: goodput")
        if self.training.max_batch_size is not None and self.training.max_batch_size < self.training.batch_size:
            raise ValueError(f"training.max_batch_size ({self.training.max_batch_size}) is below training.batch_size "
                             f"({self.training.batch_size}): the batch may only grow from batch_size; raise max_batch_size")
        if goodput and not (isinstance(self.resources.devices, tuple) and self.resources.devices[0] < self.resources.devices[1]):
            raise ValueError(f"training.scaling: goodput changes the batch when a trial is resized, and resources.devices "
                             f"({self.resources.devices!r}) is one size: give a range [min, max] or use scaling: reproducible")
        width = logical or most
        if width is not None and self.training.batch_size < width:
            raise ValueError(
                f"training.batch_size ({self.training.batch_size}) is smaller than the {width} "
                + ("logical ranks of training.logical_ranks" if logical else "devices of resources.devices")
                + ": every logical rank needs at least one sample per step"
            )
        return self


MODEL_TAGS = ("small_cnn", "mlp", "target")


RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")


def _constraints_at(loc: list[Any]) -> list[Any] | None:
    """The constraints (annotated_types Ge, Gt, Le, Lt) of the field an error's location names,
    walking CampaignSpec's models, tagged unions, lists, tuples and mappings; None where the
    location leads nowhere known."""
    walked = _walk(loc)
    if walked is None:
        return None
    tp, found = walked
    _unwrap(tp, found)
    return found


def _fields_at(loc: list[Any]) -> list[str]:
    """The field names of the model at `loc` (a section, a model variant, a search
    dimension), or [] where the location leads to no model."""
    walked = _walk(loc)
    if walked is None:
        return []
    tp = _unwrap(walked[0], [])
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _unwrap(tp: Any, found: list[Any]) -> Any:
    """`tp` without Annotated and Optional wrappers; their constraints appended to `found`."""
    import types
    import typing

    from pydantic.fields import FieldInfo

    while True:
        if typing.get_origin(tp) is Annotated:
            tp, *extra = typing.get_args(tp)
            for item in extra:
                found += item.metadata if isinstance(item, FieldInfo) else [item]
        elif typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp) and \
                len(typing.get_args(tp)) == 2:  # Optional: pydantic puts no step in the location for it
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        else:
            return tp


def _walk(loc: list[Any]) -> tuple[Any, list[Any]] | None:
    """The type at an error's location in CampaignSpec, with the constraints met on the last
    step; None where the location leads nowhere known."""
    import types
    import typing

    tp, found = CampaignSpec, []
    for part in loc:
        tp = _unwrap(tp, found)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel) and part in tp.model_fields:
            field = tp.model_fields[part]
            tp, found = field.annotation, list(field.metadata)
        elif origin in (Union, types.UnionType):  # a tagged union: the location names the member's tag
            tagged = [a for a in args if typing.get_origin(a) is Annotated
                      and any(isinstance(m, Tag) and m.tag == part for m in typing.get_args(a)[1:])]
            if not tagged:
                return None
            tp, found = tagged[0], []
        elif origin is list and isinstance(part, int):
            tp, found = args[0], []
        elif origin is tuple and isinstance(part, int) and part < len(args):
            tp, found = args[part], []
        elif origin is dict:
            tp, found = args[1], []
        else:
            return None
    return tp, found


def _valid_range(loc: list[Any]) -> str | None:
    """'valid range [1, 1024]' for the numeric field at `loc`, from its constraints."""
    low = high = None
    low_open = high_open = False
    for c in _constraints_at(loc) or []:
        for name, is_low, is_open in (("ge", True, False), ("gt", True, True), ("le", False, False), ("lt", False, True)):
            if type(c).__name__.lower() == name:
                if is_low:
                    low, low_open = getattr(c, name), is_open
                else:
                    high, high_open = getattr(c, name), is_open
    if low is None and high is None:
        return None
    if high is None:
        return f"valid: {'>' if low_open else '>='} {_number(low)}"
    if low is None:
        return f"valid: {'<' if high_open else '<='} {_number(high)}"
    return f"valid range {_interval(low, high, low_open, high_open)}"


def _close_field(name: str, fields: list[str]) -> str | None:
    """"did you mean 'lr'?" for a misspelt field name, where one field is close to it."""
    import difflib

    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


def _format_errors(source: str, error: ValidationError, prefix: str = "") -> list[str]:
    lines = []
    for e in error.errors():
        loc = list(e["loc"])
        valid = _valid_range(loc) if e["type"] in RANGE_ERRORS else None
        if e["type"] == "extra_forbidden" and loc:
            valid = _close_field(str(loc[-1]), _fields_at(loc[:-1]))
        if len(loc) > 1 and loc[0] == "model" and loc[1] in MODEL_TAGS:  # the union's tag, not a field
            del loc[1]
        if len(loc) > 3 and loc[:2] == ["search", "space"] and loc[3] in DIMENSION_KINDS and loc[4:5] == [loc[3]]:
            del loc[3]  # search.space.<key>.<tag>.<field>: the tag repeats the field
        path = prefix + ".".join(str(p) for p in loc)
        # A whole-spec check names its fields in its message: the whole input would bury it.
        got = "" if e["type"] in ("missing",) or not loc else f" (got {e.get('input')!r})"
        lines.append(f"  {path or '<root>'}: {e['msg']}{got}" + (f"; {valid}" if valid else ""))
    return lines


def set_path(raw: dict[str, Any], key: str, value: Any) -> None:
    """raw[a][b][c] = value for key 'a.b.c', making the dicts on the way (grid overrides)."""
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _grid_value_errors(spec: CampaignSpec) -> list[str]:
    """Check each grid value (or search range end) in its field's type and range, naming `grid.<key>[i]`."""
    problems = []
    base = spec.model_dump()
    where = "grid" if spec.search is None else "search.space"
    for key, values in spec.varies.items():
        section, _, rest = key.partition(".")
        field, _, deeper = rest.partition(".")
        if getattr(spec, section) is None:  # a function trial's model: its own function builds it
            problems.append(f"  {where}.{key}: there is no {section} section to vary: your function (training.target) builds "
                            f"its own {section}; vary its arguments instead (training.kwargs.<name>)")
            continue
        known = type(getattr(spec, section)).model_fields
        if field not in known:
            hint = _close_field(field, list(known))
            problems.append(f"  {where}.{key}: {section} has no field {field!r}; {hint + ' ' if hint else ''}valid: "
                            f"{', '.join(sorted(known))}")
            continue
        if deeper and not isinstance(getattr(getattr(spec, section), field), dict):
            problems.append(f"  {where}.{key}: {section}.{field} is not a mapping; only kwargs take deeper keys")
            continue
        for i, value in enumerate(values):
            raw = copy.deepcopy(base)
            set_path(raw, key, value)
            try:
                CampaignSpec.model_validate(raw)
            except ValidationError as e:
                for line in _format_errors("", e):
                    problems.append(f"  {where}.{key}[{i}] = {value!r}:{line.split(':', 1)[1]}")
    return problems


def _escaped(text: str) -> str:
    """`text` with what a terminal should not print raw (control characters, NUL, surrogates) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _untextual_errors(raw: Any, path: str = "") -> list[str]:
    """Every key or string value that is not text every store takes, by its field path: a NUL
    byte (a process's arguments and environment, a file name, PostgreSQL behind MLflow or
    Prefect: none holds one) or a lone surrogate (no UTF-8 for it). YAML's \\0 and \\ud800
    escapes make them."""
    def problem(text: str) -> str | None:
        if "\0" in text:
            return "holds a NUL byte (\\0), which no process argument, file name or tracking database can hold: remove it"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "holds a lone surrogate (\\ud800-\\udfff), which is not text in UTF-8: write the character itself"
        return None

    problems = []
    if isinstance(raw, dict):
        for key, value in raw.items():
            where = f"{path}.{_escaped(str(key))}" if path else _escaped(str(key))
            why = problem(key) if isinstance(key, str) else None
            if why:
                problems.append(f"  {where}: the key {why}")
            problems += _untextual_errors(value, where)
    elif isinstance(raw, (list, tuple)):
        for i, value in enumerate(raw):
            problems += _untextual_errors(value, f"{path}[{i}]")
    elif isinstance(raw, str):
        why = problem(raw)
        if why:
            problems.append(f"  {path}: {why}")
    return problems


# MLflow's rules for a parameter (mlflow.utils.validation, not imported: the spec is read before
# anything heavy): every field of a trial is logged as one (`model.kwargs.depth` = "2"), the grid
# on the campaign's run (`grid.training.lr` = "[0.1, 0.2]"). A name or value it refuses would fail
# the campaign at its first MLflow call, after its flow started: refused here instead.
MLFLOW_NAME = re.compile(r"[/\w.\- :]*")
MLFLOW_NAME_CHARS, MLFLOW_VALUE_CHARS = 250, 6000


def _mlflow_name_problem(name: str) -> str | None:
    normal = posixpath.normpath(name)
    if not MLFLOW_NAME.fullmatch(name) or normal != name or normal == "." or normal.startswith(("..", "/")):
        return (f"logged to MLflow as the parameter {name!r}, which MLflow refuses: a key's names may hold letters, digits, "
                "'_', '-', '.', ' ', ':' and single '/' between names; rename the key")
    if len(name) > MLFLOW_NAME_CHARS:
        return f"logged to MLflow as a parameter named with {len(name)} characters, more than its {MLFLOW_NAME_CHARS}: shorten the key"
    return None


def _mlflow_params(prefix: str, value: Any) -> dict[str, str]:
    """What tasks.tracking logs for `value` under `prefix`: a dict as one parameter per leaf."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(_mlflow_params(f"{prefix}.{k}", v))
        return out
    return {prefix: str(value)}


def _unloggable_errors(spec: CampaignSpec) -> list[str]:
    """Every user-named key (kwargs, grid and search keys) and value a trial's or the campaign's
    MLflow run would refuse as a parameter, by field path."""
    problems = []

    def check(where: str, params: dict[str, str]) -> None:
        for name, text in params.items():
            why = _mlflow_name_problem(name)
            if why is None and len(text) > MLFLOW_VALUE_CHARS:
                why = (f"logged to MLflow as {name!r}, {len(text)} characters long, more than the {MLFLOW_VALUE_CHARS} of a "
                       "parameter: pass a shorter value (a file's path, say)")
            if why:
                problems.append(f"  {where}: {why}")

    for section in GRID_SECTIONS:
        kwargs = getattr(getattr(spec, section), "kwargs", None) or {}
        for key, value in kwargs.items():
            check(f"{section}.kwargs.{_escaped(str(key))}", _mlflow_params(f"{section}.kwargs.{key}", value))
    where = "grid" if spec.search is None else "search.space"
    for key, values in spec.varies.items():
        # The campaign's run logs each axis (a search's: its dimension) as `grid.<key>`.
        axis = str(values) if spec.search is None else str(spec.search.space[key].model_dump())
        check(f"{where}.{_escaped(key)}", {f"grid.{key}": axis})
        for i, value in enumerate(values):
            check(f"{where}.{_escaped(key)}[{i}]", _mlflow_params(key, value))
    return problems


def parse_spec(raw: Any, source: str = "params.yaml") -> CampaignSpec:
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the spec must be a mapping with sections campaign, model, training, ... (got {type(raw).__name__})")
    problems = _untextual_errors(raw)
    if problems:
        raise SpecError(f"{source} is invalid:\n" + "\n".join(problems))
    try:
        spec = CampaignSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"{source} is invalid:\n" + "\n".join(_format_errors(source, e))) from None
    problems = _grid_value_errors(spec) or _unloggable_errors(spec)
    if problems:
        raise SpecError(f"{source} is invalid:\n" + "\n".join(problems))
    return spec


MAX_SPEC_BYTES = 1 << 20  # a campaign spec is a page or two; anything this big is a mistake or an attack
MAX_SPEC_DEPTH = 32  # a spec nests 4 or 5 levels; PyYAML's composer recurses once per level


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without anchors and aliases: a few lines of aliases can expand to gigabytes
    (the "billion laughs"), and a campaign spec has no use for them. Nesting is bounded too:
    the composer recurses per level, and `[[[[...` would end in a RecursionError."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise SpecError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not allowed in a campaign "
                            "spec: write the value out")
        if self._depth >= MAX_SPEC_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise SpecError(f"line {line}: nested deeper than {MAX_SPEC_DEPTH} levels: a campaign spec nests a few "
                            "levels (section, field, list); flatten it")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_spec(path: str | Path, pool: str | None = None) -> CampaignSpec:
    """The spec at `path`; `pool` (`campaign launch --pool`) sets cluster.pool, checked as if written there.

    Read through training.files.read_bounded: a regular file of at most MAX_SPEC_BYTES, never
    a blocking open; any YAML the loader cannot make into plain data is a SpecError naming the file."""
    from training.files import InputError, read_bounded

    path = Path(path)
    fix = "pass the path of a campaign spec (e.g. params.yaml)"
    try:
        text = read_bounded(path, MAX_SPEC_BYTES, fix=f"a campaign spec is a regular file of at most {MAX_SPEC_BYTES} "
                                                      f"bytes; {fix}").decode("utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path} does not exist: {fix}") from None
    except InputError as e:
        raise SpecError(str(e)) from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path} is not a text file ({e.__class__.__name__}: not UTF-8 at byte {e.start}): {fix}") from None
    try:
        raw = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path} is not valid YAML: {e}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:  # e.g. `2020-13-01` read as a date
        raise SpecError(f"{path}: a value YAML cannot convert ({e.__class__.__name__}: {e}): quote it") from None
    if pool is not None and isinstance(raw, dict):
        raw = {**raw, "cluster": {**(raw.get("cluster") or {}), "pool": pool}}
    return parse_spec(raw, str(path))


def check_data(spec: CampaignSpec, root: Path = Path(".")) -> None:
    """The built-in data's file must exist before anything starts (a target is checked by
    tasks.workload.check_trials, which builds it)."""
    path = spec.data.digits_path
    if path is None or (spec.function and "data" not in spec.model_fields_set):  # a function trial loads its own data
        return
    full = path if path.is_absolute() else root / path
    if not full.is_file():
        raise SpecError(
            f"data.path: {path} " + ("is not a file" if full.exists() else "does not exist") + ": run `dvc repro prepare` "
            f"(or `python -m training.data --out {path}`) first, or point data.path at the prepared .npz"
        )


def check_dvc_remote(value: str) -> str:
    """The checkpoint remote's URL, once a probe was written there and removed (exit 2 if not)."""
    from training.checkpoint_remote import RemoteError, check_remote, resolve_remote

    url = resolve_remote(value)
    try:
        check_remote(url)
    except RemoteError as e:
        raise SpecError(f"tracking.dvc_remote: cannot write to the remote {value!r} ({e}): create the folder, install the "
                        "remote's DVC plugin (dvc-s3, dvc-ssh, ...) or fix its credentials, or drop tracking.dvc_remote") from None
    return url


SUMMARY_WRITER = "campaign"  # the summary's "written_by": how a later launch knows the file for its own
SUMMARY_COUNTS = ("trials", "finished", "failed")  # what every summary has held, with "campaign" and "per_trial"
SUMMARY_FIELDS = {"campaign", "written_by", "trials", "finished", "pruned", "failed", "best", "per_trial"}
MAX_SUMMARY_BYTES = 64 << 20  # a summary is a line per trial; a file this big is not one


def _unreadable(error: Exception, path: Path) -> str:
    """What training.files' InputError says `path` is ("is a directory, not a regular file"), without the path and its fix."""
    return str(error).removeprefix(f"{path} ").rsplit(": ", 1)[0]


def summary_not_ours(path: Path, campaign: str) -> str | None:
    """None when `path` may take `campaign`'s summary (tasks/summary.py): it does not exist, or it
    is a summary this campaign wrote: a JSON object naming the campaign, with `"written_by":
    "campaign"`, or (written before that key) exactly a summary's fields. Else what it is, for
    the error: the summary replaces its file whole, and a spec must not make it replace
    params.yaml, a dataset, or another campaign's summary ("is not JSON, so not a campaign summary")."""
    from training.files import InputError, loads_json, read_bounded

    try:
        data = read_bounded(path, MAX_SUMMARY_BYTES)
    except FileNotFoundError:
        return None
    except InputError as e:
        return _unreadable(e, path)
    try:
        raw = loads_json(data, path)
    except InputError:
        return "is not JSON, so not a campaign summary"
    if not isinstance(raw, dict):
        return f"is JSON but not a campaign summary (a {type(raw).__name__})"
    marked = raw.get("written_by") == SUMMARY_WRITER
    shaped = (set(raw) <= SUMMARY_FIELDS and isinstance(raw.get("per_trial"), dict)
              and all(isinstance(raw.get(k), int) for k in SUMMARY_COUNTS))
    if not (marked or shaped) or not isinstance(raw.get("campaign"), str):
        return "is JSON but not a campaign summary"
    if raw["campaign"] != campaign:
        return f"is the summary of campaign {raw['campaign']!r}, not of {campaign!r}"
    return None


def trial_metrics_folder(summary: Path) -> Path:
    """Where each trial's figures go beside the summary (metrics/campaign.json ->
    metrics/campaign-trials/<trial>.json): DVC shows a file per row, so `dvc metrics show`
    is a row per trial with a column per metric, not one line with a column per trial's metric."""
    return summary.with_name(f"{summary.stem}-trials")


TRIAL_METRIC_NAMES = ("val_accuracy", "val_loss", "train_loss")  # what a trial's file holds (tasks/summary.py)


def trial_metrics_not_ours(folder: Path) -> str | None:
    """None when `folder` may take the trials' figures: it does not exist, or it is a folder of
    files the campaign wrote (JSON objects of TRIAL_METRIC_NAMES only). Else what it holds,
    for the error: stale files in it are removed, so it must hold nothing else."""
    from training.files import InputError, loads_json, read_bounded

    if not folder.exists():
        return None
    if folder.is_symlink() or not folder.is_dir():
        return "is not a folder"
    for path in sorted(folder.iterdir()):
        try:
            raw = loads_json(read_bounded(path, 1 << 20), path)
        except (InputError, OSError):
            return f"holds {path.name}, which is not a trial's figures"
        if not isinstance(raw, dict) or not set(raw) <= set(TRIAL_METRIC_NAMES):
            return f"holds {path.name}, which is not a trial's figures"
    return None


def _latest_pointer_not_ours(path: Path) -> str | None:
    """None when `path` (<runs_dir>/latest, rewritten by every launch) is absent or holds a campaign's name."""
    from training.files import InputError, read_bounded

    try:
        text = read_bounded(path, 4096)
    except FileNotFoundError:
        return None
    except InputError as e:
        return _unreadable(e, path)
    name = text.decode("utf-8", "replace").strip()
    return None if re.fullmatch(CAMPAIGN_NAME, name) else "does not hold the name of the campaign launched last"


def check_outputs(spec: CampaignSpec) -> None:
    """Every file the spec points the campaign's output at is new or one this campaign wrote:
    the summary, the runs folder and its `latest` pointer (the trial folders inside it are
    named by training.layout.portable_name; an SQLite MLflow store is checked by
    tasks.tracking_store, which reads it with sqlite3). SpecError (exit 2) naming each path
    that is not, and the fix, before anything runs."""
    from training.layout import latest_pointer

    problems = []
    summary = spec.tracking.summary
    if summary is not None and (why := summary_not_ours(summary, spec.campaign.name)):
        problems.append(f"  tracking.summary: {summary} exists and {why}; the campaign would replace it with its summary. "
                        f"Point tracking.summary at a new file (e.g. metrics/{spec.campaign.name}.json) or move {summary} aside")
    if summary is not None and (why := trial_metrics_not_ours(trial_metrics_folder(summary))):
        problems.append(f"  tracking.summary: {trial_metrics_folder(summary)} (each trial's figures, beside the summary) {why}. "
                        "Point tracking.summary at a new file or move the folder aside")
    runs = spec.tracking.runs_dir
    for folder, what in ((runs, "tracking.runs_dir"), (runs / spec.campaign.name, "the campaign's folder in tracking.runs_dir")):
        if folder.exists() and not folder.is_dir():
            problems.append(f"  {what}: {folder} exists and is not a folder; the campaign keeps its trials' folders there. "
                            "Point tracking.runs_dir at a folder (new or a campaign's) or move the file aside")
    if runs.is_dir() and (why := _latest_pointer_not_ours(latest_pointer(runs))):
        problems.append(f"  tracking.runs_dir: {latest_pointer(runs)} exists and {why}; every launch rewrites it. Point "
                        "tracking.runs_dir at a folder of campaigns (e.g. checkpoints) or move the file aside")
    if problems:
        raise SpecError("the campaign would overwrite files it did not write:\n" + "\n".join(problems))


def check_tracking(spec: CampaignSpec, timeout_s: float = 5.0) -> None:
    """The MLflow store must be reachable before anything starts: a server that is down
    would otherwise fail the campaign only after Prefect and the checks have run. Every
    output path the spec names must be new or the campaign's own (check_outputs)."""
    check_outputs(spec)
    uri = tracking_uri(spec.tracking)
    where = "$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.mlflow_uri"
    scheme = uri.split(":", 1)[0].lower()
    if scheme in ("http", "https"):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
                return
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise SpecError(f"{where}: cannot reach the MLflow server at {uri} ({reason}): start it, or set {where} "
                            "to a local store such as sqlite:///mlflow.db") from None
    if spec.tracking.dvc_remote is not None:
        check_dvc_remote(spec.tracking.dvc_remote)
    if scheme == "sqlite":
        path = uri.split(":///", 1)[1] if ":///" in uri else ""
        folder = Path(path).parent if path and path != ":memory:" else None
        if folder is not None and not folder.is_dir():
            raise SpecError(f"{where}: {uri} is in a folder that does not exist ({folder}): create it or point the URI elsewhere")
