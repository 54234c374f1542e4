"""A trial's result record, and what makes a trial finished.

The trainer writes `result.json` once, after its final checkpoint is durable, so a result
on disk means the trial ran to its end. It stays finished whatever becomes of its
checkpoints: one that no longer verifies (resumed under another checkpoint key: a reset
home folder, another user, a node without the key) is reported by `campaign status`, never
a reason to train the trial again. `campaign resume --rerun TRIAL` is how a person asks for
that (`set_aside`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from training.files import read_status_json
from training.layout import trial_files

MAX_RESULT_BYTES = 1 << 20  # a dict of final metrics


def result_problem(result: Any) -> str | None:
    """None if `result` has the shape the trainer writes, else what is wrong with it."""
    if not isinstance(result, dict):
        return "not a JSON object"
    if not isinstance(result.get("checkpoint"), str):
        return "no checkpoint path"
    if not isinstance(result.get("metrics"), dict):
        return "no metrics"
    return None


def read_result(trial_dir: str | Path) -> dict[str, Any] | None:
    """The trial's result if it has one, else None. A result.json that is not one (junk, a
    FIFO, the wrong shape) is warned about and read as no result: the trial runs again and
    its trainer replaces the file."""
    return read_status_json(trial_files(trial_dir).result, result_problem, limit=MAX_RESULT_BYTES)


def set_aside(trial_dir: str | Path) -> Path | None:
    """Move a finished trial's result, progress and checkpoints to `rerun-<time>/` in its
    folder, so that the next launch trains it from scratch; nothing is deleted. None when
    there was nothing to move."""
    files = trial_files(trial_dir)
    moving = [path for path in (files.result, files.progress, files.checkpoints) if path.exists()]
    if not moving:
        return None
    aside = files.root / time.strftime("rerun-%Y%m%d-%H%M%S")
    aside.mkdir()
    for path in moving:
        path.rename(aside / path.name)
    return aside
