"""A discrete-event replay of a workload against any policy, on a simulated clock.

Events are job arrivals, completions and periodic ticks; the policy decides on each and
the simulator applies its decision. Between events every job's speed is constant, so the
clock jumps from one event to the next and never waits on the wall clock (only the
policy's own decision time is measured, on the wall clock).

A job holds its devices from the moment it is placed. Each start, resize or restart
costs `pause_s` in which it holds them without progress (checkpoint, relaunch, restore).
Its speed is its true step-time curve at its size and number of nodes; the policy sees
only an `OnlineStepTime` model, started from a prior and fed the (noisy) step times the
job reports while it runs, as a live trial would. A decision that over-commits a node or
breaks a gang raises InvalidAllocation: a bug in the policy, never silently repaired.

A goodput job (`WorkloadJob.goodput`) trains at the batch that maximises its goodput on
its devices (cluster.goodput), with its gradient noise scale growing through training;
its progress is counted in reference steps, and the policy sees a `GoodputView` of its
learned model at its current noise scale. After each decision the simulator records
whether devices were left idle while a job that could use them waited or ran below its
request (`idle_decisions`).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from cluster.goodput import GoodputView, NoiseGrowth, rate
from cluster.jobs import Cluster, InvalidAllocation, Job, Placement, devices_of, nodes_of, same_placement, validate_allocation
from cluster.policy import Policy
from cluster.throughput import OnlineStepTime, prior_from_size
from cluster.types import StepTimeModel
from cluster.workloads import WorkloadError, WorkloadJob

PriorFn = Callable[[WorkloadJob, Cluster], StepTimeModel]


def size_prior(job: WorkloadJob, cluster: Cluster) -> StepTimeModel:
    """The default prior: from the job's requested size only."""
    return prior_from_size(job.requested, cluster.largest_node)


@dataclass(frozen=True, slots=True)
class SimConfig:
    pause_s: float = 20.0  # per start, resize or restart
    tick_s: float = 60.0  # periodic decisions, besides arrivals and completions
    report_every_s: float = 600.0  # a running job reports its step time this often
    noise: float = 0.05  # log-normal sigma of reported step times
    oracle: bool = False  # give the policy the true curves instead of learned models
    prior: PriorFn = size_prior
    max_decisions: int = 2_000_000  # a policy that never lets the workload finish


@dataclass(frozen=True, slots=True)
class JobRecord:
    """How one job went."""

    id: str
    arrival: float
    start: float  # first placement
    finish: float
    requested: int
    resizes: int  # placement changes while running (size or nodes)
    preemptions: int  # taken off all its devices before finishing
    device_seconds: float
    spread_device_seconds: float = 0.0  # held on more nodes than its size needs

    @property
    def restarts(self) -> int:
        """Every resize and preemption stops the job's processes (and costs a pause)."""
        return self.resizes + self.preemptions

    @property
    def completion_time(self) -> float:
        return self.finish - self.arrival


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    cluster_devices: int
    jobs: tuple[JobRecord, ...]
    decision_s: tuple[float, ...]  # wall-clock time of each policy call
    paused_device_seconds: float
    idle_decisions: int = 0  # decisions that left a device idle next to a job below its request

    @property
    def makespan(self) -> float:
        return max((j.finish for j in self.jobs), default=0.0) - min((j.arrival for j in self.jobs), default=0.0)

    @property
    def utilization(self) -> float:
        """Device-time held by jobs over the cluster's device-time until the last finish."""
        span = self.makespan * self.cluster_devices
        return sum(j.device_seconds for j in self.jobs) / span if span else 0.0

    def summary(self) -> dict[str, float]:
        jct = np.array([j.completion_time for j in self.jobs]) if self.jobs else np.zeros(1)
        decisions = np.array(self.decision_s) if self.decision_s else np.zeros(1)
        return {
            "jobs": float(len(self.jobs)),
            "avg_jct_s": float(jct.mean()),
            "median_jct_s": float(np.median(jct)),
            "p99_jct_s": float(np.percentile(jct, 99)),
            "makespan_s": self.makespan,
            "utilization": self.utilization,
            "resizes": float(sum(j.resizes for j in self.jobs)),
            "preemptions": float(sum(j.preemptions for j in self.jobs)),
            "restarts_per_job": float(np.mean([j.restarts for j in self.jobs])) if self.jobs else 0.0,
            "max_restarts": float(max((j.restarts for j in self.jobs), default=0)),
            "spread_fraction": sum(j.spread_device_seconds for j in self.jobs) / max(1e-9, sum(j.device_seconds for j in self.jobs)),
            "decisions": float(len(self.decision_s)),
            "idle_share": self.idle_decisions / max(1, len(self.decision_s)),
            "decision_mean_ms": float(decisions.mean() * 1e3),
            "decision_p99_ms": float(np.percentile(decisions, 99) * 1e3),
        }


@dataclass(slots=True)
class _Live:
    """A job's state during the simulation."""

    spec: WorkloadJob
    work: float  # steps to finish
    model: StepTimeModel  # what the policy sees
    done: float = 0.0
    placement: Placement = field(default_factory=dict)
    since: float = 0.0
    paused_until: float = 0.0
    step_s: float = math.inf  # true step time at the current placement
    attained: float = 0.0
    start: float = math.nan
    resizes: int = 0
    preemptions: int = 0
    spread: float = 0.0  # device-seconds on more nodes than needed
    last_report: float = -math.inf
    noise: NoiseGrowth | None = None  # a goodput job's noise scale through training
    most_devices: int = 0  # the most devices it has run on

    @property
    def noise_scale(self) -> float:
        assert self.noise is not None
        return self.noise.at(self.done / self.work)

    def true_step(self, placement: Placement) -> float:
        """Seconds per reference step on `placement` (a goodput job: at its best batch now)."""
        n, k = devices_of(placement), nodes_of(placement)
        if self.noise is None:
            return self.spec.true_model.step_time(n, k)
        return 1.0 / rate(self.spec.true_model, n, k, self.noise_scale)[0]

    def finish_at(self, now: float) -> float:
        if not self.placement:
            return math.inf
        return max(now, self.paused_until) + (self.work - self.done) * self.step_s

    def advance(self, start: float, end: float, min_nodes: int) -> float:
        """Progress from `start` to `end` (`min_nodes`: the fewest that hold its devices);
        returns the paused device-seconds in between."""
        n = devices_of(self.placement)
        if not n:
            return 0.0
        self.attained += n * (end - start)
        if nodes_of(self.placement) > min_nodes:
            self.spread += n * (end - start)
        running_from = max(start, self.paused_until)
        if end > running_from:
            self.done = min(self.work, self.done + (end - running_from) / self.step_s)
        return n * max(0.0, min(end, self.paused_until) - start)


def simulate(
    cluster: Cluster,
    workload: Sequence[WorkloadJob],
    policy: Policy,
    config: SimConfig = SimConfig(),
    seed: int = 0,
) -> SimResult:
    """Replay `workload` on `cluster` under `policy` until every job has finished."""
    return _Simulation(cluster, workload, policy, config, seed).run()


class _Simulation:
    def __init__(self, cluster: Cluster, workload: Sequence[WorkloadJob], policy: Policy, config: SimConfig, seed: int) -> None:
        for job in workload:
            if max(job.requested, job.min_devices) > cluster.total:
                raise WorkloadError(
                    f"job {job.id} asks for {max(job.requested, job.min_devices)} devices; "
                    f"the cluster has {cluster.total}. Shrink the job or simulate a larger cluster"
                )
        self.cluster, self.policy, self.config = cluster, policy, config
        self.rng = random.Random(seed)
        self.pending = sorted(workload, key=lambda j: (j.arrival, j.id))
        self.active: dict[str, _Live] = {}
        self.records: list[JobRecord] = []
        self.decision_s: list[float] = []
        self.paused = 0.0
        self.now = 0.0
        self.idle_decisions = 0

    def run(self) -> SimResult:
        index = 0
        next_tick = 0.0
        while index < len(self.pending) or self.active:
            arrival = self.pending[index].arrival if index < len(self.pending) else math.inf
            finishes = {job_id: live.finish_at(self.now) for job_id, live in self.active.items()}
            completion = min(finishes.values(), default=math.inf)
            tick = next_tick if self.active else math.inf
            t = min(arrival, completion, tick)
            self._advance(t)
            for job_id, at in finishes.items():
                if at <= t:
                    self._complete(self.active.pop(job_id))
            while index < len(self.pending) and self.pending[index].arrival <= t:
                self._arrive(self.pending[index])
                index += 1
            if self.active:
                self._decide(more_to_come=index < len(self.pending))
                if not any(live.placement for live in self.active.values()):
                    # Nothing else can happen but more ticks: the policy would never finish.
                    raise InvalidAllocation(
                        f"policy {self.policy.name} left the cluster idle at t={self.now:.0f}s "
                        f"with {len(self.active)} job(s) waiting: {sorted(self.active)[:5]}"
                    )
            next_tick = (math.floor(t / self.config.tick_s) + 1) * self.config.tick_s
            if len(self.decision_s) > self.config.max_decisions:
                raise InvalidAllocation(f"policy {self.policy.name} made {len(self.decision_s)} decisions without finishing")
        return SimResult(
            self.policy.name, self.cluster.total, tuple(sorted(self.records, key=lambda r: r.id)), tuple(self.decision_s), self.paused,
            self.idle_decisions,
        )

    def _advance(self, t: float) -> None:
        for live in self.active.values():
            self.paused += live.advance(self.now, t, self.cluster.min_nodes(devices_of(live.placement)) if live.placement else 0)
        self.now = t

    def _arrive(self, spec: WorkloadJob) -> None:
        work = spec.steps(self.cluster)
        if self.config.oracle:
            model: StepTimeModel = spec.true_model
        else:
            model = OnlineStepTime(self.config.prior(spec, self.cluster), spec.max_devices, self.cluster.largest_node)
        self.active[spec.id] = _Live(spec, work, model, since=spec.arrival, noise=spec.noise)

    def _complete(self, live: _Live) -> None:
        self.records.append(
            JobRecord(
                live.spec.id,
                live.spec.arrival,
                live.start,
                self.now,
                live.spec.requested,
                live.resizes,
                live.preemptions,
                live.attained,
                live.spread,
            )
        )

    def _report_step_times(self) -> None:
        """Running jobs past their pause tell their model how fast they really go."""
        for live in self.active.values():
            if not live.placement or live.paused_until > self.now or not isinstance(live.model, OnlineStepTime):
                continue
            if live.last_report < live.since or self.now - live.last_report >= self.config.report_every_s:
                # A goodput job reports its step time at its reference batch (the trainer times
                # the per-sample compute and the all-reduce apart, as Pollux's does).
                n, k = devices_of(live.placement), nodes_of(live.placement)
                truth = live.spec.true_model.step_time(n, k) if live.noise is not None else live.step_s
                live.model.observe(n, k, truth * self.rng.lognormvariate(0.0, self.config.noise))
                live.last_report = self.now

    def _decide(self, more_to_come: bool = True) -> None:
        self._report_step_times()
        for live in self.active.values():
            if live.noise is not None and live.placement:  # the noise scale grew: so did its best batch
                live.step_s = live.true_step(live.placement)
        views = [
            Job(
                live.spec.id,
                live.spec.arrival,
                live.spec.requested,
                live.spec.min_devices,
                live.spec.max_devices,
                live.model if live.noise is None else GoodputView(live.model, live.noise_scale),
                attained=live.attained,
                placement=live.placement,
                since=live.since,
                explored_nodes=self._explored_nodes(live),
                preemptions=live.preemptions,
                restarts=live.resizes + live.preemptions,
                explored_devices=live.most_devices,
                remaining_steps=live.work - live.done,  # as a campaign's trials tell it: the policy may ignore it
                # What a restart cost it, as a campaign's trainer measures each resize.
                pause_s=self.config.pause_s if live.resizes + live.preemptions else None,
            )
            for live in self.active.values()
        ]
        started = time.perf_counter()
        # Whether jobs are still to arrive: what a campaign knows of its own queue (not the when).
        allocation = self.policy.decide(self.cluster, views, self.now, more_to_come)
        self.decision_s.append(time.perf_counter() - started)
        try:
            validate_allocation(self.cluster, views, allocation)
        except InvalidAllocation as e:
            raise InvalidAllocation(f"policy {self.policy.name} at t={self.now:.1f}s: {e}") from None
        for job_id, live in self.active.items():
            self._apply(live, allocation.get(job_id) or {})
        if self._left_idle():
            self.idle_decisions += 1

    def _left_idle(self) -> bool:
        """Devices stay free while a job below its request could have used them: a waiting job
        that fits in them, or a running one that could grow without spreading (free devices
        on a node it runs on, or a node that would hold it whole with more). Devices that a
        job could only reach across one more node, slower, are not counted."""
        used: dict[str, int] = {}
        for live in self.active.values():
            for node, count in live.placement.items():
                used[node] = used.get(node, 0) + count
        free = {n.name: n.size - used.get(n.name, 0) for n in self.cluster.nodes}
        total = sum(free.values())
        if total <= 0:
            return False
        widest = max(free.values())
        for live in self.active.values():
            held = devices_of(live.placement)
            if held >= live.spec.requested:
                continue
            if not held and live.spec.min_devices <= total:
                return True
            if held and (any(free[node] for node, count in live.placement.items() if count)
                         or (nodes_of(live.placement) == 1 and widest > held)):
                return True
        return False

    def _explored_nodes(self, live: _Live) -> int:
        if isinstance(live.model, OnlineStepTime):
            return max((k for _, k in live.model.observations), default=0)
        return len(self.cluster.nodes)  # the true curve: nothing left to explore

    def _apply(self, live: _Live, placement: Placement) -> None:
        if same_placement(placement, live.placement):
            return
        new = {n: c for n, c in placement.items() if c}
        if live.placement and new:
            live.resizes += 1
        elif live.placement:
            live.preemptions += 1
        live.placement = new
        live.since = self.now
        if new:
            if math.isnan(live.start):
                live.start = self.now
            live.paused_until = self.now + self.config.pause_s
            live.step_s = live.true_step(new)
            live.most_devices = max(live.most_devices, devices_of(new))
        else:
            live.step_s = math.inf
