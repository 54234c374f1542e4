"""A one-device trial staged after a running one, to start in its warm worker the moment it ends.

Between two short trials on one device the campaign's own round trip (the loop sees the
end, closes the run, leases the device again, opens the next MLflow run, submits the next
Prefect task, which sends the worker its trial) is what keeps the device idle: a few tenths
of a second, as long as a trivial trial itself. So when a running warm trial is about to
end and a one-device trial waits, the campaign does that work ahead (its MLflow run, its
config) and stages it after the running one (tasks.trial.Successor); the running trial's
worker starts it as soon as its own trial has ended with a result, once the device's lease
has moved to it (the take-over, in the ending trial's task thread), and the loop catches up
afterwards (its record, allocation and task run). A device still goes to one trial at a
time: the same worker runs them one after the other, under one lease after the other.

`seconds_left` is the pure rule for "about to end".
"""

from __future__ import annotations

import math
import os
import statistics
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from cluster.types import Placement
from tasks.grid import Trial
from training.config import TrialConfig

# Stage the next trial when the running one should end within this many seconds (default 2):
# its MLflow run is open (shown running) about this long before it starts. 0: never; inf:
# always, even before anything says how long a trial takes.
STAGE_AHEAD_ENV = "CAMPAIGN_STAGE_AHEAD_S"
STAGE_AHEAD_S = 2.0
# At most this many trials staged one after the other on a worker: trials shorter than the
# loop's round (it opens their runs, submits their tasks) would otherwise find none staged.
STAGE_DEPTH = 3
# A staged trial moves to another worker whose trial should end this much sooner (a margin
# over the estimates' noise, so that it does not move back and forth).
RESTAGE_MARGIN_S = 0.1


@dataclass
class Staged:
    """A trial staged after a running one (the key of `CampaignRun.staged`)."""

    trial: Trial
    placement: Placement  # the running trial's device, at this trial's claim
    holder: str  # its lease holder once the device is its own
    run_id: str  # its MLflow run, opened when it was staged
    config: TrialConfig  # without its lease: the take-over adds it
    taken: TrialConfig | None = None  # set by the take-over: the device is its own, its worker was told to start it
    taken_at: float | None = None  # when (set after `taken`: a chain whose head it is reads both)
    scheduled: bool = False  # staged before anything said when the trial before it ends: its run says SCHEDULED until it starts


def seconds_left(step: int | None, steps: int, step_time_s: float | None, running_s: float,
                 finished_s: list[float]) -> float | None:
    """How long a running trial should still take, or None when nothing says: from its
    progress (`step` of `steps`, its measured step time or its time so far per step), else
    from the typical wall time of the campaign's trials that finished (`finished_s`)."""
    if step is not None and step > 0 and steps > 0:
        per_step = step_time_s if step_time_s else running_s / step
        return max(0.0, (steps - step) * per_step)
    if finished_s:
        return max(0.0, statistics.median(finished_s) - running_s)
    return None


def restage_moves(heads: list[tuple[str, float | None, bool, bool]], margin: float = RESTAGE_MARGIN_S) -> list[tuple[str, str]]:
    """Which staged trials move: `heads` are the running warm trials (id, seconds left or
    None, whether a trial is staged after it, whether that one may move: it is alone). A
    staged trial moves to the running trial with nothing staged after it that should end
    soonest, when that is sooner by more than `margin`: with trials of unequal lengths it
    would otherwise wait while a device idles. (from, to) pairs, the latest-ending first."""
    idle = sorted((left, trial) for trial, left, staged, _ in heads if not staged and left is not None)
    moves = []
    for trial, left, staged, movable in sorted(heads, key=lambda h: -(h[1] or 0.0)):
        if idle and movable and left is not None and idle[0][0] + margin < left:
            moves.append((trial, idle.pop(0)[1]))
    return moves


def staging_order(left: float | None, depth: int) -> tuple[int, float]:
    """Which worker's chain gets the next staged trial first: the shallowest, then the one
    that should end soonest (`left` None: nothing says yet, after those that say)."""
    return depth, math.inf if left is None else left


def stage_ahead_s() -> float:
    return float(os.environ.get(STAGE_AHEAD_ENV) or STAGE_AHEAD_S)


def may_stage(left: float | None, depth: int, ahead: float, max_depth: int, unknown: bool = True) -> bool:
    """Whether one more trial is staged on a worker's chain whose last staged trial (or its
    running one: `depth` 0) should end in `left` seconds (None: nothing says yet), staging
    `ahead` seconds ahead (stage_ahead_s), at most `max_depth` deep. A chain nothing says the
    end of yet (its trial has just started, none of the campaign has finished) is staged as
    one that ends soon: short trials end before the loop learns how long they take, and
    their workers would idle a round of the loop each; trials staged so are SCHEDULED in
    MLflow until they start (and a device that frees first takes them: `restage_moves`,
    the loop's unstaging). Not where a trial's draw must wait for the ones before to be
    told to the study (`unknown` False: a search that learns from them)."""
    if ahead <= 0 or depth >= max_depth:
        return False
    if left is None:
        return unknown or math.isinf(ahead)
    return math.isinf(ahead) or left <= ahead


def next_end(step: int, steps: int, rule: str | None, min_steps: int, factor: int) -> int:
    """The next step at which a trial at `step` may end: its last, or under early stopping
    (`rule`) the next point its pruner may stop it at: an asha rung (min_steps x factor^k),
    any evaluation from min_steps on for the others."""
    if rule is None:
        return steps
    if rule == "asha":
        rung = min_steps
        while rung <= step:
            rung *= factor
        return min(rung, steps)
    return min(max(step + 1, min_steps), steps)


class RunOpener:
    """Opens the MLflow runs of trials about to be staged, in a thread of its own, while the
    loop goes on: a run's opening is a few store transactions in the campaign's hub (~50 ms
    on a loaded host), longer than a trivial trial's handover, and the loop opened each
    trial's run as it staged it. A run opened ahead of a trial whose start nothing tells yet
    says SCHEDULED until it starts."""

    def __init__(self, open_run: Callable[[Trial, bool], str]):
        self.open_run = open_run  # (trial, scheduled) -> run id
        self.opening: dict[str, tuple[Future, bool]] = {}
        self.pool: ThreadPoolExecutor | None = None

    def ahead(self, trials: list[Trial], scheduled: bool) -> None:
        """Open these trials' runs next (those not opened yet)."""
        for trial in trials:
            if trial.id not in self.opening:
                if self.pool is None:
                    self.pool = ThreadPoolExecutor(1, thread_name_prefix="run-opener")
                self.opening[trial.id] = (self.pool.submit(self.open_run, trial, scheduled), scheduled)

    def keep(self, trial_id: str, run_id: str, scheduled: bool) -> None:
        """A staged trial went back to the queue: its run, opened already, for its next start."""
        kept: Future = Future()
        kept.set_result(run_id)
        self.opening[trial_id] = (kept, scheduled)

    def take(self, trial: Trial) -> tuple[str, bool] | None:
        """(the trial's run, whether it says SCHEDULED) once opened ahead, waiting for it if
        it is being opened; None if it was not, or its opening failed (the caller opens it,
        and says why if that fails again)."""
        opening = self.opening.pop(trial.id, None)
        try:
            return (opening[0].result(), opening[1]) if opening is not None else None
        except Exception:
            return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
