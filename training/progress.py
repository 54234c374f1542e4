"""A trial's progress record (`progress.json`): the one shape both loops write and every
reader takes.

Rank 0 of a trial writes it about once a second and at each change of state (running,
held, resizing, finished); the campaign's scheduler reads its step time, size and noise
scale, `campaign status` and the live view its step and metrics. Written atomically and
without fsync (a status, not a result: a crash loses at most the last second of it).
A file that is not a progress record (junk, another version's, the wrong shape) reads as
none, with a warning naming it: a trial's next write replaces it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.files import read_status_json, write_json_atomic
from training.layout import trial_files

SCHEMA = 1
MAX_PROGRESS_BYTES = 1 << 20  # a step and a few dozen metrics


@dataclass(frozen=True)
class Progress:
    state: str  # running, held, resizing, finished, ...
    step: int  # in reference steps (a goodput trial: samples / its batch_size), as campaign.json counts them
    steps: int
    world_size: int
    batch_size: int  # the global batch now (a goodput trial's follows its size)
    samples_seen: int = 0  # 0 where the loop does not count them (a function trial)
    metrics: dict[str, float] = field(default_factory=dict)  # the latest of each, step_time_s among them
    updated: float = 0.0
    schema: int = SCHEMA

    def write(self, trial_dir: str | Path) -> None:
        write_json_atomic(trial_files(trial_dir).progress, asdict(self), durable=False)


def progress_now(state: str, step: int, steps: int, world_size: int, batch_size: int, metrics: dict[str, float],
                 samples_seen: int = 0) -> Progress:
    return Progress(state=state, step=int(step), steps=int(steps), world_size=int(world_size), batch_size=int(batch_size),
                    samples_seen=int(samples_seen), metrics=dict(metrics), updated=time.time())


def progress_problem(raw: Any) -> str | None:
    """None if `raw` is a progress record of this version, else what is wrong with it."""
    if not isinstance(raw, dict):
        return "not a JSON object"
    if raw.get("schema", 0) not in (0, SCHEMA):  # 0: written before records had a version, the same fields
        return f"schema {raw.get('schema')!r}, not {SCHEMA} (written by another version)"
    for name in ("step", "steps", "world_size", "batch_size", "samples_seen"):
        if not isinstance(raw.get(name), int) or isinstance(raw.get(name), bool):
            return f"{name} is not a whole number"
    if not isinstance(raw.get("state"), str) or not isinstance(raw.get("updated"), (int, float)):
        return "no state or time"
    metrics = raw.get("metrics")
    if not isinstance(metrics, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in metrics.values()):
        return "metrics are not numbers by name"
    if set(raw) - set(Progress.__dataclass_fields__):
        return f"unknown fields {sorted(set(raw) - set(Progress.__dataclass_fields__))}"
    return None


def read_progress(trial_dir: str | Path) -> Progress | None:
    """The trial's progress, or None when it has none (yet) or the file is not one (warned)."""
    raw = read_status_json(trial_files(trial_dir).progress, progress_problem, limit=MAX_PROGRESS_BYTES)
    return None if raw is None else Progress(**{**raw, "schema": SCHEMA})
