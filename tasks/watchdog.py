"""The campaign's watchdog for stalled trials (`training.stall_timeout_s`).

A trial whose step stops advancing (a hung collective, a deadlocked data loader, user code
that sleeps) would otherwise stay `running` forever, and the trials queued behind it for its
devices would wait forever. `tasks/trial.py: run_plan` runs a `Watchdog` beside each segment
it launches: it reads the trial's progress file (rank 0 writes it about once a second while
the trial steps, at each change of state, and at a function trial's reports) and, once it
has stood still too long while the trial runs, has every trial process that can dump its Python stacks write them to
the trial's log (SIGUSR1: `training.process.dump_stacks_on_request`), then stops the trial's
process groups. `run_plan` then records the trial failed with the stall as its reason.

The rule is pure (`StallClock`: fed what was seen and when, no clock or file of its own) so
that a test drives it with a fake clock; `Watchdog` does the reading, signalling and stopping.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from training.process import STACKS_SIGNAL, process_table, stop_process_groups
from training.progress import Progress, read_progress

AUTO = "auto"  # training.stall_timeout_s unset: derived from the trial's own step time
FLOOR_S = 300.0  # auto never waits less: the first step pays imports, compile, data loading
RESIZE_FLOOR_ENV = "CAMPAIGN_RESIZE_FLOOR_S"  # tests: a resize's floor in seconds, for a hang they can wait out


def resize_floor_s() -> float:
    """What a resize gets at least, whatever the limit: FLOOR_S (tests may set less)."""
    return float(os.environ.get(RESIZE_FLOOR_ENV, FLOOR_S))
STEP_TIME_MULTIPLE = 10.0  # auto waits at least this many measured step times...
GAP_MULTIPLE = 3.0  # ...and this many times the longest wait seen between two writes (an evaluation, a checkpoint, a report)
RUNNING = "running"  # a step that stands still past the limit is a stall
RESIZING = "resizing"  # between two generations: stalled past the limit too, and never sooner than FLOOR_S
FINISHED = "finished"  # its result is written: processes still there past the limit hang in their teardown

RESIZE_STALL = "stalled in a resize"  # the reason's start: run_plan queues such a trial again once

POLL_S = 1.0  # the progress file changes at most about once a second
DUMP_WAIT_S = 5.0  # at most this long for the stack dumps to reach the log before the trial is stopped
DUMP_QUIET_S = 0.5  # the log unchanged this long: the dumps are written
# A stalled trial saves nothing on SIGTERM (it is stuck): SIGKILL comes soon after, so its devices free up.
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Seen:
    """What the watchdog read of a trial at one moment."""

    state: str | None  # None: nothing written since this segment's launch
    step: int  # the last step written (by an earlier segment when state is None; 0 if none)
    step_time_s: float | None = None
    # When it was written: a write is progress even at the same step (a function trial that
    # reports one step again; the project's loop writes only when its step has moved).
    updated: float = 0.0


def seen_in(progress: Progress | None, launched_at: float) -> Seen:
    """`progress` as this segment's: a file written before its launch (an earlier segment's,
    left as it ended) says nothing of this one but the step it resumes near."""
    if progress is None:
        return Seen(None, 0)
    if progress.updated < launched_at:
        return Seen(None, progress.step)
    return _written(progress)


def _written(progress: Progress) -> Seen:
    """A write of this segment's, as the rule sees it."""
    step_time = progress.metrics.get("step_time_s")
    return Seen(progress.state, progress.step, float(step_time) if step_time else None, progress.updated)


def seen_since(progress: Progress | None, before: Progress | None) -> Seen:
    """`progress` as this segment's, `before` being what the file held at its launch: for a
    reader on another host than the writer (the campaign watching a trial across nodes), whose
    clock says nothing of the writer's, any change of the file is this segment's."""
    if progress is None or (before is not None and progress.updated == before.updated):
        return Seen(None, progress.step if progress is not None else 0)
    return _written(progress)


@dataclass(frozen=True)
class Stall:
    step: int
    waited_s: float
    silent: bool  # nothing written since the launch
    finished: bool = False  # its result was written; its processes did not end (their teardown hangs)
    resizing: bool = False  # between two generations: the next one never stepped past where the resize stopped

    @property
    def reason(self) -> str:
        """What the trial's record says (`campaign status` shows it)."""
        if self.finished:
            return f"finished at step {self.step}, but its processes were still there {self.waited_s:.0f} s later"
        if self.resizing:
            return f"{RESIZE_STALL} at step {self.step} for {self.waited_s:.0f} s (its next generation never trained a step)"
        return f"stalled at step {self.step} for {self.waited_s:.0f} s" + (" (no progress since its launch)" if self.silent else "")


def queued_again(stall: Stall, reason_before: str | None) -> bool:
    """Whether a trial its watchdog stopped is queued again, like a preemption, to resume from
    its last checkpoint, rather than failed for good. A resize that hung (a worker that never
    let go, a rendezvous or a checkpoint load that never ended: a node taken back across
    nodes) says nothing of a fresh start, so it is; once: a trial whose run before this one
    (`reason_before`, its record's reason at this launch) ended the same way would come back
    into the same hang at every resize. Any other stall is final."""
    return stall.resizing and not (reason_before or "").startswith(RESIZE_STALL)


def default_limit_s(step_time_s: float | None, longest_gap_s: float) -> float:
    """`auto`: the longest of FLOOR_S, STEP_TIME_MULTIPLE step times and GAP_MULTIPLE times the
    longest wait between two steps seen so far (an evaluation or a checkpoint's staging makes
    one step long; the trial is not stalled while it does that again)."""
    return max(FLOOR_S, STEP_TIME_MULTIPLE * (step_time_s or 0.0), GAP_MULTIPLE * longest_gap_s)


class StallClock:
    """The stall rule for one segment: how long its progress has stood still, against its limit.

    The clock restarts at each new write of the progress file (the project's loop writes it
    when its step has moved, about once a second, and at each change of state: a hold, a
    resize; a function trial when it reports); a trial stalls when it is running, has written
    nothing since its launch, is between two generations of a resize (new workers that never
    start training: a rendezvous, a state transfer or a checkpoint load that hangs), or has
    finished but its processes outlive the limit. A resize gets at least FLOOR_S whatever the
    setting, until the next generation has stepped past where it stopped: its new workers
    start afresh (imports, a CUDA context, a collective's setup, a compile), which a limit
    chosen for one step does not allow for. `timeout_s`: seconds, AUTO or None (never stalls).
    """

    def __init__(self, timeout_s: float | str | None, launched_at: float):
        self.timeout_s = timeout_s
        self.changed_at = launched_at
        self.last: tuple[str, int, float] | None = None  # (state, step, updated) last seen; None: nothing since the launch
        self.step_time_s: float | None = None
        self.longest_gap_s = 0.0  # between two writes seen while running
        # The step a resize stopped at, until the next generation steps past it: its start
        # (imports, its data and model made, a compile; a function trial's whole setup comes
        # after its first "running") is a resize's too, with the resize's floor.
        self.resized_at: int | None = None
        self.floor_s = resize_floor_s()

    def restarted(self, step: int, floor_s: float, now: float) -> None:
        """The trial restarts from its checkpoint without saying so in its progress (torchrun
        across nodes going on without a lost node, or taking it back): a resize's floor,
        `floor_s`, from `now` until a step past `step`."""
        self.resized_at, self.floor_s, self.changed_at = step, max(self.floor_s, floor_s), now

    def limit_s(self) -> float | None:
        if self.timeout_s is None:
            return None
        if self.timeout_s == AUTO:
            return default_limit_s(self.step_time_s, self.longest_gap_s)
        return float(self.timeout_s)

    def observe(self, seen: Seen, now: float) -> Stall | None:
        """Take in what was seen at `now`; the stall, if this is one."""
        key = None if seen.state is None else (seen.state, seen.step, seen.updated)
        if key != self.last:
            if self.last is not None and key is not None and self.last[0] == RUNNING == key[0]:
                self.longest_gap_s = max(self.longest_gap_s, now - self.changed_at)
            self.last, self.changed_at = key, now
        if seen.step_time_s:
            self.step_time_s = seen.step_time_s
        if seen.state == RESIZING:
            self.resized_at = seen.step
        elif seen.state == RUNNING and self.resized_at is not None and seen.step > self.resized_at:
            self.resized_at, self.floor_s = None, resize_floor_s()
        limit = self.limit_s()
        if limit is not None and self.resized_at is not None:
            limit = max(limit, self.floor_s)
        waited = now - self.changed_at
        # Finished: the result is written, so stopping what is left (a teardown that hangs: a
        # process group never destroyed, an exit hook joining a helper) frees the devices and
        # changes nothing of the outcome (run_plan reads the result first).
        if limit is None or seen.state not in (None, RUNNING, RESIZING, FINISHED) or waited <= limit:
            return None
        return Stall(seen.step, waited, silent=seen.state is None, finished=seen.state == FINISHED,
                     resizing=self.resized_at is not None and seen.state != FINISHED)


# --- the trial's processes -----------------------------------------------------------------


def trial_processes(groups: Sequence[int]) -> list[int]:
    """Every process of the trial's process groups and their descendants: torchrun's and the
    elastic agent's workers lead sessions of their own, under their launcher."""
    table = process_table()
    found = {pid for pid, (_, pgid) in table.items() if pgid in groups}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum`: to any other process SIGUSR1 is fatal
    (a launcher, a zygote, a metrics sink), so only the ones that dump stacks are sent it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (signum - 1) & 1)


def dump_stacks(groups: Sequence[int], log_path: Path, wait_s: float = DUMP_WAIT_S) -> list[int]:
    """Ask each of the trial's processes that can (it catches STACKS_SIGNAL) to write its Python
    stacks to the trial's log; return, with the pids asked, once the log has stopped growing
    (or after `wait_s`)."""
    pids = [pid for pid in trial_processes(groups) if catches(pid, STACKS_SIGNAL)]
    for pid in pids:
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            pass
    if pids:
        _wait_until_quiet(log_path, wait_s)
    return pids


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _wait_until_quiet(path: Path, wait_s: float) -> None:
    """Until `path` has not grown for DUMP_QUIET_S, at most `wait_s`."""
    deadline = time.monotonic() + wait_s
    size, quiet_since = _log_size(path), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < DUMP_QUIET_S:
        time.sleep(0.05)
        now = _log_size(path)
        if now != size:
            size, quiet_since = now, time.monotonic()


# --- the watchdog --------------------------------------------------------------------------


class Watchdog:
    """Watches one segment of a trial from a thread of its own, for as long as the `with`
    block (the segment) lasts. On a stall: the stacks to `log_path`, then the trial's process
    groups (`groups()`, those of the segment now) stopped; `stall` says what happened."""

    def __init__(self, trial_dir: Path, timeout_s: float | str | None, log_path: Path, groups: Callable[[], list[int]],
                 every_s: float = POLL_S):
        self.trial_dir, self.log_path, self.groups, self.every_s = Path(trial_dir), Path(log_path), groups, every_s
        self.timeout_s = timeout_s
        self.stall: Stall | None = None
        self._dumped = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog {self.trial_dir.name}", daemon=True)

    def __enter__(self) -> "Watchdog":
        if self.timeout_s is not None:  # null: never stalled, nothing to watch
            self._launched_at = time.time()  # the progress file's clock: what was written before is an earlier segment's
            self._clock = StallClock(self.timeout_s, time.monotonic())
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            if self.stall is None:
                self.stall = self._clock.observe(seen_in(read_progress(self.trial_dir), self._launched_at), time.monotonic())
            if self.stall is not None:  # each round until the segment ends: a process still being started when it stalled too
                self._stop_trial()

    def _stop_trial(self) -> None:
        groups = self.groups()
        if not groups:
            return
        if not self._dumped:
            self._dumped = True
            with open(self.log_path, "a") as log:  # the log says why the stacks follow and the trial ends
                log.write(f"\ncampaign watchdog: trial {self.trial_dir.name} {self.stall.reason}: its Python stacks follow, "
                          f"then it is stopped (training.stall_timeout_s)\n")
            dump_stacks(groups, self.log_path)
        stop_process_groups(groups, STOP_GRACE_S)
