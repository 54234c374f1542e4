"""A trial's result record, and what makes a trial finished.

The trainer writes `result.json` once, after its final checkpoint is durable (a pruned
trial's last save: its state at the stop is not written), so a result on disk means the
trial ran to its end. It is signed like a checkpoint's manifest: an
HMAC-SHA256 under this host's checkpoint key (training/manifest.py `signing_key`) over its
canonical content, so that someone who can write the trial's folder but not read the key
cannot make the campaign believe a trial finished with numbers it never reached (a forged
accuracy would otherwise be the campaign's best trial, and `campaign status` would print
whatever a hand-written file says).

Every read checks it: the known fields with their types, metrics that are finite numbers,
the trial id of the folder it is in, a checkpoint named for the step it claims, and the
signature. A result that fails any of these (malformed, unsigned: written before results
were signed, or by hand; forged; signed under another checkpoint key) is named in a warning
and read as no result: the next launch runs the trial again, and its trainer, resuming from
the final checkpoint when that one verifies, trains no step: it evaluates and writes the
result again, signed (re-finalised). Where no checkpoint verifies either (another key), the
trial is trained again: neither its numbers nor its weights can be trusted.

A signed result stays finished whatever becomes of its checkpoints afterwards (deleted,
corrupted): `campaign status` reports those, never a reason to train the trial again.
`campaign resume --rerun TRIAL` is how a person asks for that (`set_aside`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any

from training.files import InputError, envelope_problem, read_json, write_json_atomic
from training.layout import trial_files
from training.manifest import PREFIX, key_path, signing_key, step_dir_name

MAX_RESULT_BYTES = 1 << 20  # a dict of final metrics
RESULT_SCHEMA = 1
# Bound into every result's signature: the same key signs checkpoint manifests and an elastic
# agent's spawn requests, and no signature made for one of those may pass for a result.
SIGNATURE_DOMAIN = b"campaign result v1\n"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    # An int is finite however large (math.isfinite would overflow converting 10**400 to a float).
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


# Every field a trainer (training/trainer.py) or a function trial (training/function.py)
# writes, and what its value must be; the first four are in every result.
REQUIRED_FIELDS = ("trial_id", "steps", "metrics", "checkpoint")
_FIELD_CHECKS = {
    "trial_id": (lambda v: isinstance(v, str) and v != "", "text"),
    "steps": (lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "metrics": (lambda v: isinstance(v, dict), "an object"),  # and each value a finite number: _metrics_problem
    "checkpoint": (lambda v: isinstance(v, str), "text"),
    "samples_seen": (lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "scaling": (lambda v: isinstance(v, str), "text"),
    "world_size": (lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "pruned": (lambda v: isinstance(v, bool), "true or false"),
    "resumed_from_step": (lambda v: _is_int(v) and v >= 0, "a whole number >= 0"),
    "wall_s": (_is_finite_number, "a finite number"),  # a difference of wall clocks: negative after a clock step back
    "peak_device_memory_bytes": (lambda v: v is None or (_is_int(v) and v >= 0), "a whole number >= 0 or null"),
    "device_memory": (lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) and _is_int(x) for k, x in v.items())),
                      "an object of whole numbers or null"),
    "function": (lambda v: isinstance(v, str), "text"),
    # A metric that was not a finite number (a diverged loss) is left out of `metrics`, named here.
    "nonfinite_metrics": (lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "a list of names"),
}
RESULT_FIELDS = (*_FIELD_CHECKS, "schema", "hmac")


def _canonical(body: dict[str, Any]) -> bytes:
    """The bytes a result's signature covers: every field but the signature, as sorted compact
    JSON. Computed from the parsed content, not the file's bytes, so a copy that writes the
    JSON out again (a pool's mirror) keeps its signature; floats print as their shortest repr,
    which reads back to the same float."""
    content = {k: v for k, v in body.items() if k != "hmac"}
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _signature(body: dict[str, Any]) -> str:
    return hmac.new(signing_key(), SIGNATURE_DOMAIN + _canonical(body), hashlib.sha256).hexdigest()


def signed_result(result: dict[str, Any]) -> dict[str, Any]:
    """`result` as it is written: a metric that is not a finite number moved from `metrics`
    to `nonfinite_metrics` (JSON has no NaN, and a reader takes only finite numbers), the
    schema, and the signature."""
    metrics = {k: float(v) for k, v in result.get("metrics", {}).items()}
    body = {**result, "metrics": {k: v for k, v in metrics.items() if math.isfinite(v)}, "schema": RESULT_SCHEMA}
    body.pop("hmac", None)
    body.pop("nonfinite_metrics", None)
    if nonfinite := sorted(k for k, v in metrics.items() if not math.isfinite(v)):
        body["nonfinite_metrics"] = nonfinite
    if (wrong := _shape_problem(body, result.get("trial_id"))) is not None:
        raise ValueError(f"a trial's result must be one a reader takes: {wrong}")  # a bug in the writer, not input
    return {**body, "hmac": _signature(body)}


def write_result(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write the trial's result, signed (rank 0, once the final checkpoint is durable); what was written."""
    signed = signed_result(result)
    write_json_atomic(path, signed)
    return signed


def _shape_problem(raw: Any, trial_id: str | None) -> str | None:
    """What is wrong with the result's fields, or None (its signature is checked apart)."""
    if (wrong := envelope_problem(raw, RESULT_SCHEMA, RESULT_FIELDS)) is not None:
        return wrong
    if missing := [k for k in REQUIRED_FIELDS if k not in raw]:
        return f"no {', '.join(missing)}"
    for name, (valid, what) in _FIELD_CHECKS.items():
        if name in raw and not valid(raw[name]):
            return f"{name} is {str(raw[name])[:60]!r}, not {what}"
    if (wrong := _metrics_problem(raw["metrics"])) is not None:
        return wrong
    if trial_id is not None and raw["trial_id"] != trial_id:
        return f"it is trial {raw['trial_id'][:60]!r}'s result, not {trial_id!r}'s"
    return _checkpoint_problem(raw)


def _metrics_problem(metrics: dict[str, Any]) -> str | None:
    """The first metric that is not a finite number (the summary ranks them, the tables format
    them, the search tells them to its study), named."""
    for name, value in metrics.items():
        if not _is_finite_number(value):
            return f"metric {name[:60]!r} is {str(value)[:60]!r}, not a finite number"
    return None


def _checkpoint_problem(raw: dict[str, Any]) -> str | None:
    """The checkpoint a result names is the one its step was saved as: the project's loop
    saves its last step (`steps`) before it writes the result; a function trial's last save
    is at or before its last reported step, and it may have saved nothing (""), as may a
    pruned trial's (final: its state at the stop is not written). Only the name is compared:
    the folder may have moved (a pool node's copy, a copied campaign)."""
    name, steps = Path(raw["checkpoint"]).name, raw["steps"]
    if "function" in raw or raw.get("pruned") is True:
        saved = re.fullmatch(rf"{re.escape(PREFIX)}([0-9]{{8,}})", name)
        if raw["checkpoint"] == "" or (saved is not None and int(saved.group(1)) <= steps):
            return None
        return f"checkpoint {raw['checkpoint'][:80]!r} is not a save at or before step {steps}"
    if name != step_dir_name(steps):
        return f"checkpoint {raw['checkpoint'][:80]!r} is not the final checkpoint of step {steps} ({step_dir_name(steps)})"
    return None


def result_problem(raw: Any, trial_id: str | None = None) -> str | None:
    """None if `raw` is a result this host's trainer wrote for `trial_id` (any trial's when
    None), else what is wrong with it."""
    if (wrong := _shape_problem(raw, trial_id)) is not None:
        return wrong
    if "hmac" not in raw:
        return "it is not signed (written by an earlier version, or not by a trainer)"
    # As bytes: compare_digest refuses a str with non-ASCII characters (TypeError, not a mismatch).
    if not isinstance(raw["hmac"], str) or not hmac.compare_digest(raw["hmac"].encode(), _signature(raw).encode()):
        return (f"its signature does not match this host's checkpoint key ({key_path()}): changed after it was written, "
                "or signed under another key")
    return None


def result_report(trial_dir: str | Path, trial_id: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(the trial's result, None) when it has a valid one; (None, why) when its result.json
    is not one, the file named in `why`; (None, None) when it has none. `trial_id`: the
    trial the folder holds (default: the folder's name, as a campaign names them)."""
    path = trial_files(trial_dir).result
    try:
        raw = read_json(path, limit=MAX_RESULT_BYTES)
    except InputError as e:
        return None, str(e)
    if raw is None:
        return None, None
    if (wrong := result_problem(raw, Path(trial_dir).name if trial_id is None else trial_id)) is not None:
        return None, f"{path}: {wrong}"
    return raw, None


REFINALISED = "read as no result: the next launch re-finalises the trial from its final checkpoint (or trains it again where none verifies)"


def read_result(trial_dir: str | Path, trial_id: str | None = None) -> dict[str, Any] | None:
    """The trial's result if it has a valid one, else None. A result.json that is not one
    (junk, a FIFO, the wrong shape, unsigned, forged) is warned about, naming the file and
    what is wrong, and read as no result (see the module's docstring)."""
    result, problem = result_report(trial_dir, trial_id)
    if problem is not None:
        warnings.warn(f"ignoring {problem}; {REFINALISED}", stacklevel=2)
    return result


def set_aside(trial_dir: str | Path) -> Path | None:
    """Move a finished trial's result, progress, checkpoints and metrics journal to
    `rerun-<time>/` in its folder, so that the next launch trains it from scratch and journals
    its curves anew; nothing is deleted. None when there was nothing to move."""
    files = trial_files(trial_dir)
    moving = [path for path in (files.result, files.progress, files.checkpoints, files.metrics_journal) if path.exists()]
    if not moving:
        return None
    aside = files.root / time.strftime("rerun-%Y%m%d-%H%M%S")
    aside.mkdir()
    for path in moving:
        path.rename(aside / path.name)
    return aside
