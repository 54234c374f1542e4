"""The live side of the elastic policy: the same `decide` the simulator replays, on real trials.

`LiveScheduler` keeps what the policy needs to know of each elastic trial (arrival, device
time attained, when its placement last changed, a step-time model refined from the step
times the trial reports) and turns a decision into actions: trials to start at a size,
running trials to resize. It does no I/O: the flow reads progress and applies actions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.goodput import GoodputView
from cluster.jobs import Cluster, Job, Node, validate_allocation
from cluster.policy import ElasticPolicy, Policy
from cluster.throughput import OnlineStepTime, prior_from_size
from cluster.types import Inventory, StepTimeModel


@dataclass
class Tracked:
    trial_id: str
    min_devices: int
    max_devices: int
    arrival: float
    model: OnlineStepTime
    placement: dict[str, int] = field(default_factory=dict)  # where it runs: node -> devices
    devices: int = 0
    since: float | None = None
    attained: float = 0.0  # device-seconds held
    last_update: float | None = None
    pinned: int | None = None  # a person resized it by hand: the policy keeps it at that size
    preemptions: int = 0  # times it was stopped on all its devices (the policy bounds how often)
    max_batch_scale: float = 1.0  # a goodput trial's batch may grow to this many times batch_size
    noise_scale: float | None = None  # its gradient noise scale, in batch_size units, as last measured
    remaining_steps: float | None = None  # reference steps left: its declared steps less those done

    @property
    def view(self) -> StepTimeModel:
        """What the policy reads: time per reference step, at the best batch for a goodput
        trial that may choose its batch (once its noise scale was measured)."""
        if self.max_batch_scale > 1.0 and self.noise_scale is not None:
            return GoodputView(self.model, self.noise_scale, self.max_batch_scale)
        return self.model


@dataclass(frozen=True)
class Actions:
    start: dict[str, int] = field(default_factory=dict)  # trial -> devices to start with
    resize: dict[str, int] = field(default_factory=dict)  # running trial -> new device count (0 preempts)
    batch: dict[str, float] = field(default_factory=dict)  # trial started or resized -> its batch, in batch_size units


class LiveScheduler:
    def __init__(self, policy: Policy, devices_per_node: int, multi_node: bool = False):
        """`multi_node`: trials may span nodes (a pool's: torchrun across them); else each
        stays on one node (DDP over loopback)."""
        self.policy = policy
        self.devices_per_node = devices_per_node
        self.multi_node = multi_node
        self.tracked: dict[str, Tracked] = {}
        # trial -> what its last resize cost it, kept after it finishes: the campaign's other
        # trials' estimate until they have resized themselves.
        self.pauses: dict[str, float] = {}

    def arrive(self, trial_id: str, min_devices: int, max_devices: int, now: float, prior: StepTimeModel | None = None,
               max_batch_scale: float = 1.0, steps: int | None = None) -> None:
        """A trial to schedule; `prior`: its step-time model from a profile, if it has one
        (else a guess from its size). Either way, its own step times refine it.
        `max_batch_scale` > 1: a goodput trial whose batch the policy may grow that far.
        `steps`: its declared length in reference steps (the policy favours the trial
        closest to its end, as shortest-remaining-first does)."""
        if trial_id not in self.tracked:
            prior = prior or prior_from_size(max_devices, self.devices_per_node)
            model = OnlineStepTime(prior, max_devices=max_devices, devices_per_node=self.devices_per_node)
            self.tracked[trial_id] = Tracked(trial_id, min_devices, max_devices, now, model, max_batch_scale=max_batch_scale,
                                             remaining_steps=steps)

    def running(self, trial_id: str, node: str | Mapping[str, int], devices: int, now: float) -> None:
        """The trial now runs on `devices` devices of `node` (0: it stopped); `node`, for a
        trial across nodes: how many of its devices each node holds."""
        t = self.tracked[trial_id]
        self._accrue(t, now)
        placement = dict(node) if isinstance(node, Mapping) else {node: devices}
        if devices != t.devices or (devices and placement != t.placement):
            t.since = now
            if t.devices and not devices:  # it ran and was stopped on all its devices
                t.preemptions += 1
        t.placement, t.devices = (placement if devices else {}), devices

    def pin(self, trial_id: str, devices: int) -> None:
        """A person chose this trial's size: the policy no longer changes it."""
        self.tracked[trial_id].pinned = devices

    def unpin(self, trial_id: str) -> None:
        self.tracked[trial_id].pinned = None

    def unpin_parked(self) -> list[str]:
        """Give trials parked by a hand preemption (pinned at 0) back to the policy; their ids."""
        parked = [t.trial_id for t in self.tracked.values() if t.pinned == 0]
        for trial_id in parked:
            self.unpin(trial_id)
        return parked

    def observe(self, trial_id: str, devices: int, step_time_s: float, nodes: int = 1) -> None:
        """A step time the trial reported at a size (over `nodes` nodes): refines its model."""
        if devices > 0 and step_time_s > 0:
            self.tracked[trial_id].model.observe(devices, nodes, step_time_s)

    def observe_noise(self, trial_id: str, noise_scale: float) -> None:
        """The trial's gradient noise scale (in batch_size units), as its trainer measured it."""
        if noise_scale > 0:
            self.tracked[trial_id].noise_scale = noise_scale

    def observe_pause(self, trial_id: str, pause_s: float) -> None:
        """What the trial's last resize cost it: no step from its old size's last to its new
        size's first (its trainer's `resize_pause_s`)."""
        if pause_s >= 0:
            self.pauses[trial_id] = pause_s

    def restart_cost_s(self, trial_id: str) -> float | None:
        """What stopping and restarting the trial costs: its own last resize's pause once it
        has one; before that, the median of the campaign's other trials' (finished ones too:
        one campaign's trials share their model family, loader and checkpoint size far more
        than any default does); None while no trial has resized (then the policy's `pause_s`,
        the spec's `resize_pause_s`)."""
        if (own := self.pauses.get(trial_id)) is not None:
            return own
        return statistics.median(self.pauses.values()) if self.pauses else None

    def progressed(self, trial_id: str, steps_left: float) -> None:
        """The trial has `steps_left` reference steps to go (from its progress)."""
        self.tracked[trial_id].remaining_steps = max(0.0, steps_left)

    def finish(self, trial_id: str) -> None:
        self.tracked.pop(trial_id, None)

    def _accrue(self, t: Tracked, now: float) -> None:
        if t.last_update is not None:
            t.attained += t.devices * (now - t.last_update)
        t.last_update = now

    def decide(self, free_devices: dict[str, list[str]], now: float | None = None, more_to_come: bool = True) -> Actions:
        """Decide over the devices this campaign may use: node -> device ids (ours and free);
        `more_to_come`: whether trials may still arrive (a search's budget left)."""
        now = time.time() if now is None else now
        # Devices of trials a person pinned are theirs, not the policy's to hand out.
        pinned: dict[str, int] = {}
        for t in self.tracked.values():
            if t.pinned is not None and t.devices:
                for node, count in t.placement.items():
                    pinned[node] = pinned.get(node, 0) + count
        nodes = [Node(node, tuple(ids[:max(0, len(ids) - pinned.get(node, 0))])) for node, ids in sorted(free_devices.items())]
        cluster = Cluster(tuple(n for n in nodes if n.size))
        if not cluster.nodes:
            return Actions()
        jobs = []
        for t in self.tracked.values():
            self._accrue(t, now)
            if t.pinned is not None:
                continue  # its size is a person's choice
            # Trials run on one node (DDP over loopback) unless they may span nodes, and others'
            # leases shrink what is usable.
            high = min(t.max_devices, cluster.total if self.multi_node else cluster.largest_node)
            if t.min_devices > high:
                continue  # it cannot run on what is usable now: it waits
            placement = dict(t.placement) if t.devices else {}
            jobs.append(Job(t.trial_id, t.arrival, high, t.min_devices, high, t.view,
                            attained=t.attained, placement=placement, since=t.since if t.since is not None else t.arrival,
                            preemptions=t.preemptions, remaining_steps=t.remaining_steps, pause_s=self.restart_cost_s(t.trial_id)))
        if not jobs:
            return Actions()
        allocation = self.policy.decide(cluster, jobs, now, more_to_come)
        validate_allocation(cluster, jobs, allocation)  # a policy bug is raised, never fixed up
        start, resize, batch = {}, {}, {}
        for t in self.tracked.values():
            if t.pinned is not None or not any(j.id == t.trial_id for j in jobs):
                continue
            target = sum(allocation.get(t.trial_id, {}).values())
            if t.devices == 0 and target > 0:
                start[t.trial_id] = target
            elif t.devices > 0 and target != t.devices:
                resize[t.trial_id] = target
            else:
                continue
            if target and isinstance(t.view, GoodputView):  # its batch changes only when its processes restart
                batch[t.trial_id] = t.view.batch_scale(target, 1)
        return Actions(start, resize, batch)


def live_policy(resize_pause_s: float, min_run_s: float, order: str = "remaining") -> ElasticPolicy:
    """The elastic policy with time constants for trials of minutes, not of hours.
    `order`: "remaining" (shortest remaining work first) or "attained" (least attained service)."""
    return ElasticPolicy(pause_s=resize_pause_s, min_run_s=min_run_s, min_horizon_s=min_run_s, grow_after_s=min_run_s,
                         las_scale_s=60 * min_run_s, remaining_scale_s=60 * min_run_s, explore_after_s=6 * min_run_s,
                         starvation_s=30 * min_run_s, yield_min_s=2 * min_run_s / 3, know_remaining=order == "remaining")


def usable_devices(inventory: Inventory, foreign: set[str]) -> dict[str, list[str]]:
    """node -> device ids the campaign may use: those no other campaign holds."""
    out: dict[str, list[str]] = {}
    for d in inventory.devices:
        if d.id not in foreign:
            out.setdefault(d.node, []).append(d.id)
    return out
