"""An elastic trial's resize log (`resizes.jsonl`): one line per resize it went through, the one
shape rank 0 of a new generation appends and `campaign status`, the benches and the tests read.

Each line says from which devices to which, at which step, how (a resize, a restart, a node
lost), how long training stood still (`pause_s`, and
where that went) and how long from the request to the first step at the new size, and what
the new size trains with (its global batch, learning rate and samples seen: a goodput
trial's change with its size). Lines are appended whole; a line that is not one (junk,
another version's, cut short by a crash) is skipped with a warning naming the file and line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.files import append_json_line, envelope_problem, read_json_lines
from training.layout import trial_files

SCHEMA = 1
MODES = ("resize", "restart", "node lost")  # the command's, a function trial's restart, or the agent's own


@dataclass(frozen=True)
class ResizeEvent:
    time: float
    step: int
    seq: int  # the agent's command it carried out
    mode: str
    before: tuple[str, ...]  # devices ("from" on disk)
    after: tuple[str, ...]  # ("to" on disk)
    pause_s: float  # no progress from the old size's last step to the new size's first
    latency_s: float  # from the request to the first step at the new size
    batch_size: int  # the global batch the new size trains with
    lr: float
    samples_seen: int
    goodput: bool = False
    pause_breakdown_s: dict[str, float] = field(default_factory=dict)
    schema: int = SCHEMA

    def to_json(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["from"], raw["to"] = list(raw.pop("before")), list(raw.pop("after"))
        return raw

    def line(self) -> str:
        """'2 -> 1 devices at step 276 (resize, paused 53 ms; 1.2 s from the request)', and for
        a goodput trial the batch and learning rate it now trains with."""
        batch = f", batch {self.batch_size}, lr {self.lr:.4g}" if self.goodput else ""
        return (f"{len(self.before)} -> {len(self.after)} devices at step {self.step} "
                f"({self.mode}, paused {self.pause_s * 1000:.0f} ms; {self.latency_s:.1f} s from the request{batch})")


FIELDS = set(ResizeEvent.__dataclass_fields__) - {"before", "after"} | {"from", "to"}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, FIELDS)) is not None:
        return wrong
    if not all(_whole(raw.get(k)) for k in ("step", "seq", "batch_size", "samples_seen")):
        return "step, seq, batch_size or samples_seen is not a whole number"
    if not all(isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool) for k in ("time", "pause_s", "latency_s", "lr")):
        return "time, pause_s, latency_s or lr is not a number"
    if not all(isinstance(raw.get(k), list) and all(isinstance(d, str) for d in raw[k]) for k in ("from", "to")):
        return "from or to is not a list of device names"
    if raw.get("mode") not in MODES:
        return f"mode {raw.get('mode')!r} is not one of {', '.join(MODES)}"
    return None


def append_resize(trial_dir: str | Path, event: ResizeEvent) -> None:
    append_json_line(trial_files(trial_dir).resizes, event.to_json())


def read_resizes(trial_dir: str | Path) -> list[ResizeEvent]:
    """Every resize of the trial, in order ([] before its first); lines that are not one are skipped, warned."""
    events = []
    for raw in read_json_lines(trial_files(trial_dir).resizes, _problem):
        raw = dict(raw)
        before, after = tuple(raw.pop("from")), tuple(raw.pop("to"))
        events.append(ResizeEvent(**{**raw, "before": before, "after": after, "goodput": bool(raw.get("goodput", False)),
                                     "pause_breakdown_s": dict(raw.get("pause_breakdown_s") or {}), "schema": SCHEMA}))
    return events


class NewPauses:
    """What each trial's latest resize cost it (`pause_s`), read from its log only when that has
    grown since the last look: the campaign asks every scheduling round, a trial resizes
    rarely."""

    def __init__(self) -> None:
        self._sizes: dict[Path, int] = {}

    def latest(self, trial_dir: str | Path) -> float | None:
        """The pause of the trial's last resize if its log grew since the last call, else None."""
        path = trial_files(trial_dir).resizes
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if self._sizes.get(path) == size:
            return None
        self._sizes[path] = size
        events = read_resizes(trial_dir)
        return events[-1].pause_s if events else None
