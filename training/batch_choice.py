"""The batch the scheduler chose for a goodput trial's next size (`batch.json`): the one shape
the campaign writes and the trainer reads.

A goodput trial with `max_batch_size` trains each size at the batch the policy chose for
goodput there (`scale` x its batch_size). The campaign writes the choice before it starts or
resizes the trial; rank 0 reads it when a generation attaches and broadcasts it, so every
rank trains one batch. A choice made for another size does not apply (the batch follows the
size). A file that is not a choice (junk, another version's, the wrong shape) reads as none,
warned: the trial trains at the batch its size gives, and the campaign's next write
replaces it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.files import envelope_problem, read_status_json, write_json_atomic
from training.layout import trial_files

SCHEMA = 1
MAX_BATCH_CHOICE_BYTES = 64 << 10  # four numbers


@dataclass(frozen=True)
class BatchChoice:
    devices: int  # the size it was chosen for
    batch_size: int  # the global batch at that size
    scale: float  # batch_size / the trial's batch_size, as the policy chose it
    at: float = 0.0
    schema: int = SCHEMA

    def write(self, trial_dir: str | Path) -> None:
        write_json_atomic(trial_files(trial_dir).batch, asdict(self))


def batch_choice_now(devices: int, batch_size: int, scale: float) -> BatchChoice:
    return BatchChoice(devices=int(devices), batch_size=int(batch_size), scale=float(scale), at=time.time())


def _problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, BatchChoice.__dataclass_fields__)) is not None:
        return wrong
    for name in ("devices", "batch_size"):
        if not isinstance(raw.get(name), int) or isinstance(raw.get(name), bool) or raw[name] < 1:
            return f"{name} is not a whole number >= 1"
    if not all(isinstance(raw.get(k, 0.0), (int, float)) and not isinstance(raw.get(k), bool) for k in ("scale", "at")):
        return "scale or at is not a number"
    return None


def read_batch_choice(trial_dir: str | Path) -> BatchChoice | None:
    """The scheduler's choice, or None when there is none (yet) or the file is not one (warned)."""
    raw = read_status_json(trial_files(trial_dir).batch, _problem, limit=MAX_BATCH_CHOICE_BYTES)
    if raw is None:
        return None
    return BatchChoice(devices=raw["devices"], batch_size=raw["batch_size"], scale=float(raw.get("scale", 0.0)),
                       at=float(raw.get("at", 0.0)))
