"""Workloads for the simulator: jobs sampled from the Philly trace, synthetic ones, files.

A workload job carries what a trace knows (arrival, duration at its requested size,
requested devices) plus what an elastic scheduler needs (min and max devices) and the
job's true speed-up curve, which the simulator uses and the policy never sees. The curve
follows the job's size class by GPU-time, as the Pollux artifact maps Philly jobs to
applications: short jobs are small models that scale poorly, the longest ones are
ImageNet-like and scale well.

Bad input (a missing column, a negative duration, a job larger than the cluster) raises
WorkloadError naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterable, Mapping, NoReturn, Sequence

from cluster.goodput import NoiseGrowth
from cluster.jobs import Cluster
from cluster.throughput import AnalyticStepTime
from cluster.types import StepTimeModel
from training.errors import CampaignError

# True step-time curves by size class (seconds). On one 4-device node they speed up
# 2.4x (small) to 3.7x (xlarge); across nodes the all-reduce costs 2-8x more, so small jobs
# lose speed when spread and only the largest keep gaining up to 16-32 devices.
SCALING: Mapping[str, AnalyticStepTime] = {
    "small": AnalyticStepTime(fixed=0.010, compute=0.090, intra=0.006, inter=0.050, per_node=0.002),
    "medium": AnalyticStepTime(fixed=0.012, compute=0.288, intra=0.012, inter=0.075, per_node=0.003),
    "large": AnalyticStepTime(fixed=0.010, compute=0.490, intra=0.010, inter=0.025, per_node=0.003),
    "xlarge": AnalyticStepTime(fixed=0.008, compute=0.792, intra=0.008, inter=0.015, per_node=0.005),
}
_CLASS_LIMITS_GPU_HOURS = (("small", 1.0), ("medium", 10.0), ("large", 100.0), ("xlarge", math.inf))

# An elastic job may grow to this many times its requested size (within the cluster).
DEFAULT_GROWTH = 4


class WorkloadError(CampaignError):
    """A workload or trace file cannot be used as it stands."""


@dataclass(frozen=True, slots=True)
class WorkloadJob:
    """One job of a workload. `duration` is its run time at `requested` devices, packed."""

    id: str
    arrival: float  # seconds from the start of the workload
    duration: float
    requested: int
    min_devices: int
    max_devices: int
    scaling: str  # a key of SCALING: the job's true step-time curve
    goodput: bool = False  # its batch is chosen for goodput (training.scaling: goodput)
    noise_model: str = "published"  # a key of NOISE_SCALES: whose gradient noise scale its size class takes

    @property
    def true_model(self) -> StepTimeModel:
        """Its time per step of its reference batch (the batch at its request), at any size."""
        return SCALING[self.scaling]

    def steps(self, cluster: Cluster) -> float:
        """Its work: reference steps, `duration` at `requested` devices on the fewest nodes."""
        return self.duration / self.true_model.step_time(self.requested, cluster.min_nodes(self.requested))

    @property
    def noise(self) -> NoiseGrowth | None:
        """A goodput job's gradient noise scale through training (None: its batch is fixed)."""
        return noise_growth(self.scaling, self.noise_model) if self.goodput else None


# Where each size class's gradient noise scale comes from, by model:
# - "measured": what the trainer measured (bench/noise_scale.py) on the project's example
#   workloads, tiny models on CPU: the short jobs are small models like the built-in digits
#   CNN, the long ones image and language models. Their noise scale stays near their batch
#   through training, so a fixed batch costs little there.
# - "published": the gradient statistics the Pollux artifact measured training real models,
#   for the applications it maps the same Philly size classes to (under 1 GPU-hour CIFAR-10,
#   under 10 DeepSpeech2, under 100 YOLOv3, the rest ImageNet); each row names its source.
#   The honest model for the bench: the trace's jobs are those models, not ours.
NOISE_SCALES: Mapping[str, Path] = {
    "measured": Path(__file__).with_name("noise_scales.json"),
    "published": Path(__file__).with_name("noise_scales_published.json"),
}
NOISE_WORKLOAD: Mapping[str, Mapping[str, str]] = {
    "measured": {"small": "default", "medium": "resnet20", "large": "resnet20", "xlarge": "chargpt"},
    "published": {"small": "cifar10", "medium": "deepspeech2", "large": "yolov3", "xlarge": "imagenet"},
}


def noise_growth(scaling: str, model: str = "published", path: Path | None = None) -> NoiseGrowth:
    """The noise scale, in units of the job's batch, from the start to the end of training,
    of the workload that stands for `scaling` under `model` (a key of NOISE_SCALES)."""
    if model not in NOISE_SCALES:
        raise WorkloadError(f"unknown noise model {model!r}: one of {', '.join(NOISE_SCALES)}")
    path = path or NOISE_SCALES[model]
    measured = _measured_noise(path)
    name = NOISE_WORKLOAD[model][scaling]
    if name not in measured:
        hint = "; run bench/noise_scale.py" if model == "measured" else ""
        raise WorkloadError(f"{path}: no noise scale for workload {name!r}{hint}")
    return measured[name]


_noise_cache: dict[Path, dict[str, NoiseGrowth]] = {}


def _measured_noise(path: Path) -> dict[str, NoiseGrowth]:
    if path not in _noise_cache:
        try:
            rows = json.loads(path.read_text())
            _noise_cache[path] = {
                name: NoiseGrowth(float(row["noise_scale_start"]) / float(row["batch_size"]),
                                  float(row["noise_scale_end"]) / float(row["batch_size"]))
                for name, row in rows.items()
            }
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"{path}: cannot read the noise scales ({e})") from e
    return _noise_cache[path]


def scaling_class(gpu_seconds: float) -> str:
    hours = gpu_seconds / 3600.0
    return next(name for name, limit in _CLASS_LIMITS_GPU_HOURS if hours < limit)


def elastic_range(requested: int, cluster: Cluster, growth: int = DEFAULT_GROWTH) -> tuple[int, int]:
    """(min, max) devices of a trace job: any size from 1 up to `growth` x its request."""
    return 1, min(cluster.total, max(requested, requested * growth))


# ---------------------------------------------------------------- the Philly trace


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One row of the Philly trace."""

    line: int
    submitted: datetime
    duration: float
    num_gpus: int


_PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus")


def read_philly(path: str | Path) -> list[TraceJob]:
    """Every job of a Philly trace file (columns timestamp, duration, num_gpus, ...)."""
    path = Path(path)
    rows: list[TraceJob] = []
    with _open_csv(path, _PHILLY_COLUMNS) as reader:
        for line, row in enumerate(reader, start=2):
            where = _Where(path, line)
            duration = where.number(row, "duration", minimum=0.0)
            num_gpus = where.integer(row, "num_gpus", minimum=1)
            try:
                submitted = datetime.fromisoformat(row["timestamp"].strip())
            except ValueError:
                where.fail("timestamp", f"{row['timestamp']!r} is not a date-time (YYYY-MM-DD HH:MM:SS)")
            rows.append(TraceJob(line, submitted, duration, num_gpus))
    return rows


def sample_philly(
    trace: Sequence[TraceJob],
    cluster: Cluster,
    jobs: int,
    seed: int,
    start_hour: int = 2,
    window_hours: int = 8,
    growth: int = DEFAULT_GROWTH,
    min_duration_s: float = 60.0,
    max_gpu_hours: float = 1000.0,
) -> tuple[WorkloadJob, ...]:
    """`jobs` jobs submitted in a daily window of the trace, arriving at their time of day.

    As in the Pollux artifact: jobs of every day of the trace submitted between
    `start_hour` and `start_hour + window_hours` form the pool, the sample keeps their time
    of day as arrival, and jobs shorter than a minute or over 1,000 GPU-hours are left out.
    More jobs in the same window is a higher load. Jobs larger than the cluster are left
    out of the pool: the sample is for this cluster.
    """
    pool = []
    for job in trace:
        offset = (_seconds_of_day(job.submitted) - start_hour * 3600) % 86400
        if (
            offset < window_hours * 3600
            and job.duration >= min_duration_s
            and job.duration * job.num_gpus < max_gpu_hours * 3600
            and job.num_gpus <= cluster.total
        ):
            pool.append((offset, job))
    if len(pool) < jobs:
        raise WorkloadError(f"the trace has {len(pool)} usable jobs in the window, fewer than the {jobs} asked for")
    picked = sorted(random.Random(seed).sample(pool, jobs), key=lambda p: (p[0], p[1].line))
    out = []
    for index, (offset, job) in enumerate(picked):
        low, high = elastic_range(job.num_gpus, cluster, growth)
        out.append(
            WorkloadJob(
                id=f"job{index:04d}",
                arrival=float(offset),
                duration=job.duration,
                requested=job.num_gpus,
                min_devices=low,
                max_devices=high,
                scaling=scaling_class(job.duration * job.num_gpus),
            )
        )
    return tuple(out)


def _seconds_of_day(t: datetime) -> int:
    return t.hour * 3600 + t.minute * 60 + t.second


# ---------------------------------------------------------------- synthetic workloads


def synthetic(
    cluster: Cluster,
    jobs: int,
    seed: int,
    mean_interarrival_s: float = 120.0,
    median_duration_s: float = 1800.0,
    growth: int = DEFAULT_GROWTH,
) -> tuple[WorkloadJob, ...]:
    """Poisson arrivals, heavy-tailed durations, mostly one-device jobs (as in Philly)."""
    rng = random.Random(seed)
    sizes = [s for s in (1, 2, 4, 8, 16) if s <= cluster.total]
    weights = [0.80, 0.06, 0.07, 0.05, 0.02][: len(sizes)]
    now, out = 0.0, []
    for index in range(jobs):
        now += rng.expovariate(1.0 / mean_interarrival_s)
        requested = rng.choices(sizes, weights)[0]
        duration = max(60.0, median_duration_s * rng.lognormvariate(0.0, 1.5))
        low, high = elastic_range(requested, cluster, growth)
        out.append(
            WorkloadJob(
                id=f"job{index:04d}",
                arrival=round(now, 3),
                duration=round(duration, 3),
                requested=requested,
                min_devices=low,
                max_devices=high,
                scaling=scaling_class(duration * requested),
            )
        )
    return tuple(out)


# ---------------------------------------------------------------- workload files

_REQUIRED = ("job_id", "arrival_s", "duration_s", "num_gpus")
_OPTIONAL = ("min_gpus", "max_gpus", "scaling")


def write_workload(path: str | Path, jobs: Iterable[WorkloadJob]) -> None:
    """Save a workload as CSV, readable back with `read_workload`."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_REQUIRED + _OPTIONAL)
        for j in jobs:
            writer.writerow(
                (j.id, repr(j.arrival), repr(j.duration), j.requested, j.min_devices, j.max_devices, j.scaling)
            )


def read_workload(path: str | Path, cluster: Cluster, growth: int = DEFAULT_GROWTH) -> tuple[WorkloadJob, ...]:
    """A workload CSV, checked against `cluster`, sorted by arrival.

    Columns job_id, arrival_s, duration_s, num_gpus are required; min_gpus and max_gpus
    default to the elastic range of `elastic_range`, scaling to the class of the job's
    GPU-time.
    """
    path = Path(path)
    jobs: list[WorkloadJob] = []
    seen: dict[str, int] = {}
    with _open_csv(path, _REQUIRED) as reader:
        for line, row in enumerate(reader, start=2):
            where = _Where(path, line)
            job_id = (row.get("job_id") or "").strip()
            if not job_id:
                where.fail("job_id", "is empty")
            if job_id in seen:
                where.fail("job_id", f"{job_id!r} already used on line {seen[job_id]}")
            seen[job_id] = line
            arrival = where.number(row, "arrival_s", minimum=0.0)
            duration = where.number(row, "duration_s", minimum=0.0, strict=True)
            requested = where.integer(row, "num_gpus", minimum=1)
            if requested > cluster.total:
                where.fail(
                    "num_gpus",
                    f"job {job_id} asks for {requested} devices; the cluster has {cluster.total}. "
                    "Shrink the job or declare a larger cluster",
                )
            low, high = elastic_range(requested, cluster, growth)
            if _present(row, "min_gpus"):
                low = where.integer(row, "min_gpus", minimum=1)
            if _present(row, "max_gpus"):
                high = where.integer(row, "max_gpus", minimum=1)
            if not low <= requested <= high <= cluster.total:
                where.fail(
                    "min_gpus/max_gpus",
                    f"need min_gpus <= num_gpus <= max_gpus <= {cluster.total} (the cluster), "
                    f"got {low} <= {requested} <= {high}",
                )
            scaling = (row.get("scaling") or "").strip() or scaling_class(duration * requested)
            if scaling not in SCALING:
                where.fail("scaling", f"{scaling!r} is not one of {sorted(SCALING)}")
            jobs.append(WorkloadJob(job_id, arrival, duration, requested, low, high, scaling))
    return tuple(sorted(jobs, key=lambda j: (j.arrival, j.id)))


# ---------------------------------------------------------------- CSV checking


class _open_csv:
    """A DictReader over `path` that fails with WorkloadError unless `required` columns exist."""

    def __init__(self, path: Path, required: Sequence[str]) -> None:
        self.path, self.required = path, required

    def __enter__(self) -> csv.DictReader:
        try:
            # A .gz trace is read as it is shipped (data/traces/ holds them compressed).
            opener = gzip.open if self.path.suffix == ".gz" else open
            self._file = opener(self.path, "rt", newline="")
        except OSError as e:
            raise WorkloadError(f"{self.path}: cannot read the file ({e.strerror})") from e
        reader = csv.DictReader(self._file)
        header = [c.strip() for c in reader.fieldnames or ()]
        missing = [c for c in self.required if c not in header]
        if missing:
            self._file.close()
            raise WorkloadError(
                f"{self.path}: missing column(s) {', '.join(missing)}; "
                f"the header must name {', '.join(self.required)} (it has: {', '.join(header) or 'nothing'})"
            )
        reader.fieldnames = header
        return reader

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _present(row: Mapping[str, str | None], column: str) -> bool:
    return bool((row.get(column) or "").strip())


@dataclass(frozen=True, slots=True)
class _Where:
    """Error helpers that name the file, the line and the field."""

    path: Path
    line: int

    def fail(self, field: str, problem: str) -> NoReturn:
        raise WorkloadError(f"{self.path}, line {self.line}, {field}: {problem}")

    def number(self, row: Mapping[str, str | None], field: str, minimum: float, strict: bool = False) -> float:
        raw = (row.get(field) or "").strip()
        try:
            value = float(raw)
        except ValueError:
            self.fail(field, f"{raw!r} is not a number" if raw else "is empty")
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            self.fail(field, f"{raw} must be {bound}")
        return value

    def integer(self, row: Mapping[str, str | None], field: str, minimum: int) -> int:
        value = self.number(row, field, minimum=float(minimum))
        if value != int(value):
            self.fail(field, f"{value:g} must be a whole number")
        return int(value)
