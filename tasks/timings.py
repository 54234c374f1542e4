"""Where a launch's time goes (`campaign launch --timings`): each phase's time since the
command was started (the process's own start, read from the kernel, so the interpreter's
start and the imports count), and the first training step of any trial, seen in the trials'
progress files as it happens."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

WATCH_EVERY_S = 0.05


def process_started_at() -> float:
    """This process's start, as a wall-clock time (Linux: /proc); now where that is unknown."""
    try:  # seconds since boot, both: the uptime now and the process's start (btime is whole seconds only)
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


# Where the command runs in a process started before it (the resident server's spare launch,
# tasks/spares.py): when the command itself was started, and what it did before this process
# took it over, as (phase, time).
_handed_over: tuple[float, list[tuple[str, float]]] | None = None


def handed_over(command_started_at: float, marks: list[tuple[str, float]]) -> None:
    """This process runs a command started at `command_started_at`: its phases count from then."""
    global _handed_over
    _handed_over = (command_started_at, list(marks))


class Phases:
    """Marks of a launch's phases, each said as it is reached (`say`), so that no phase is silent."""

    def __init__(self, say: Callable[[str], None], started_at: float | None = None):
        self.say = say
        if started_at is None:
            started_at = _handed_over[0] if _handed_over is not None else process_started_at()
        self.started_at = started_at
        self.marks: list[tuple[str, float]] = []
        self.firsts: dict[str, float] = {}  # mark_first's: when each kind was first marked
        self._lock = threading.Lock()
        for phase, at in _handed_over[1] if _handed_over is not None else ():
            self.mark(phase, at)

    def mark(self, phase: str, at: float | None = None) -> None:
        at = time.time() if at is None else at
        with self._lock:
            since_last = at - (self.marks[-1][1] if self.marks else self.started_at)
            self.marks.append((phase, at))
        self.say(f"{at - self.started_at:6.2f} s  (+{since_last:.2f} s)  {phase}")

    def since_start(self, phase: str) -> float | None:
        return next((at - self.started_at for name, at in self.marks if name == phase), None)


class FirstStepWatch:
    """Marks "first training step" once any of `trial_dirs` reports a step beyond where it
    stood when the launch began (its checkpoint's step: a resumed trial starts there), written
    after the launch submitted its first trial (a worker of a launch just killed may still be
    writing its last steps when a `resume` begins)."""

    def __init__(self, phases: Phases, baselines: dict[Path, int]):
        self.phases, self.baselines = phases, baselines
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="first-step-watch", daemon=True)

    def start(self) -> "FirstStepWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            if self.check():
                return

    def check(self) -> bool:
        """Mark the first step if a trial reports one now: whether it did."""
        from training.progress import read_progress

        submitted = self.phases.firsts.get("submitted")
        for trial_dir, baseline in self.baselines.items() if submitted is not None else ():
            progress = read_progress(trial_dir)
            if progress is not None and progress.updated >= submitted and progress.step > baseline:
                self.phases.mark(f"first training step (trial {trial_dir.name}, step {progress.step})", progress.updated)
                return True
        return False


# The launch's phases, where --timings asked for them: the flow and the trial launches mark
# theirs through `mark` (nothing when none is registered).
_current: Phases | None = None


def register(phases: Phases | None) -> None:
    global _current
    _current = phases


def mark(phase: str) -> None:
    if _current is not None:
        _current.mark(phase)


def mark_first(kind: str, phase: str) -> None:
    """Mark `phase` if it is the first of its `kind` (the first trial submitted, launched, ...)."""
    if _current is not None and kind not in _current.firsts:
        _current.firsts[kind] = time.time()
        _current.mark(phase, _current.firsts[kind])
