"""A trial's metrics journal (`metrics.jsonl`): every metric it logged, the source MLflow is fed from.

MLflow hears of a trial's metrics through a hub or sink process that sends them in batches
(training/metrics.py): a kill of the campaign's process group takes with it the batches not
sent yet, and a trial resumed from its checkpoint does not log those steps again. So rank 0
appends each logged step here first, one JSON line per log call, flushed before the call
returns (a killed process loses nothing the kernel has; the journal is fsynced before each
checkpoint is written, so a crash of the machine loses no step a checkpoint covers). The
campaign feeds the journal to MLflow again at each start of the trial (flows/run/campaign.py),
and MLflow's senders log a (key, step) only when the run does not hold it yet: whatever was
lost in flight is sent then, and nothing twice.

Steps past the checkpoint a resume starts from: the first value made durable wins. A resumed
segment replays the steps between its checkpoint and the last one its killed predecessor
journaled, and logs none of them again (in `reduction: exact` they are the same numbers bit
for bit; otherwise they differ by the float order of a sum). The project's loop and function
trials journal through the same logger (training.metrics.MetricsLogger), so one rule holds for both.

One owner: the trial's rank 0 (one segment at a time: the lease fence ends a stale one).
Bounded: past MAX_BYTES nothing more is journaled (said once), and metrics still go to MLflow.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

MAX_BYTES = 256 << 20  # ~2 million lines: far past any trial's log steps


class MetricsJournal:
    """Append-only; the last step journaled per key, to tell a replayed step from a new one."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.last_step: dict[str, int] = {}
        self.full = False
        self._file = None
        self._size = 0
        for key, step, _value, _stamp in read_journal(self.path, repair=True):
            self.last_step[key] = max(step, self.last_step.get(key, -1))

    def admit(self, step: int, metrics: dict[str, float], stamp_ms: int) -> dict[str, float]:
        """The metrics of `step` not journaled before (a replayed step's are not), appended
        and flushed before this returns; what the caller sends on."""
        fresh = {k: float(v) for k, v in metrics.items() if step > self.last_step.get(k, -1)}
        if not fresh:
            return fresh
        line = json.dumps({"step": int(step), "t": stamp_ms, "m": fresh}, separators=(",", ":")) + "\n"
        try:
            self._append(line)
        except OSError as e:  # a full disk: training goes on, MLflow still hears of it
            warnings.warn(f"metrics journal {self.path}: cannot append ({e}); later metrics reach MLflow only in flight")
            self.full = True
        for k in fresh:
            self.last_step[k] = step
        return fresh

    def _append(self, line: str) -> None:
        if self.full:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            self._size = self._file.tell()
        if self._size + len(line) > MAX_BYTES:
            warnings.warn(f"metrics journal {self.path} reached {MAX_BYTES >> 20} MiB: later metrics reach MLflow only in flight")
            self.full = True
            return
        self._file.write(line)
        self._file.flush()  # in the kernel's hands: a killed process loses none of it
        self._size += len(line)

    def sync(self) -> None:
        """Durable on disk (before a checkpoint is written: no step it covers can be lost)."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_journal(path: Path | str, repair: bool = False) -> Iterator[tuple[str, int, float, int]]:
    """(key, step, value, timestamp ms) of every journaled metric, in order. A last line cut
    short by a kill is left out (and, with `repair`, cut off the file, so the next append
    starts on a line of its own); a line that is not a journal line is skipped."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    whole = data[: data.rfind(b"\n") + 1]
    if repair and len(whole) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
    for raw in whole.splitlines():
        try:
            item = json.loads(raw)
            step, stamp, metrics = int(item["step"]), int(item["t"]), dict(item["m"])
        except (ValueError, KeyError, TypeError):
            continue
        for key, value in metrics.items():
            if isinstance(key, str) and isinstance(value, (int, float)) and not isinstance(value, bool):
                yield key, step, float(value), stamp
