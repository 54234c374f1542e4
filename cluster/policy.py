"""Scheduling policies: who holds how many devices on which nodes, decided from plain data.

Every policy is a frozen dataclass of parameters with one pure method,
`decide(cluster, jobs, now) -> {job id: {node: devices}}`, called on each event (arrival,
completion, periodic tick). Jobs missing from the result hold nothing. No I/O, no state
kept between calls: the previous decision is each job's `placement`, so the simulator and
the live campaign run the same code (DESIGN invariant 5).

- `ElasticPolicy` (ours): resizes jobs within [min, max] devices, weighing speed-up per
  device, least attained service, resize pauses, locality and starvation.
- `FifoPolicy`: first in, first out, each job at its requested size, never preempted.
- `LasPolicy`: discretized least-attained-service (5 queues) at requested sizes,
  preemptive, packed on the fewest nodes.
- `TiresiasPolicy`: Tiresias as the Pollux artifact runs it (2 queues, emptiest nodes
  first): the published baseline.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Protocol, Sequence

from cluster.goodput import GoodputView
from cluster.jobs import Cluster, Job, Placement, devices_of, nodes_of, same_placement, speedup
from cluster.types import StepTimeModel


class Policy(Protocol):
    """What the simulator and the live scheduler call. `more_to_come`: whether jobs may still
    arrive (a campaign knows its queue: trials not yet submitted, a search's budget left; a
    trace replay, its arrivals to come)."""

    name: str

    def decide(self, cluster: Cluster, jobs: Sequence[Job], now: float, more_to_come: bool = True) -> dict[str, dict[str, int]]: ...


# ---------------------------------------------------------------- placement on nodes


class NodePool:
    """Free devices per node, with best-fit placement that puts a job on the fewest nodes.

    Nodes are bucketed by free count so that a placement costs O(largest node) rather than
    O(nodes): the policy must decide in well under a second on thousands of devices.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.names = [n.name for n in cluster.nodes]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.free = [n.size for n in cluster.nodes]
        self.top = max(self.free, default=0)
        self.buckets: list[list[int]] = [[] for _ in range(self.top + 1)]
        for i, f in enumerate(self.free):
            self.buckets[f].append(i)
        self.total_free = sum(self.free)

    def _move(self, i: int, delta: int) -> None:
        bucket = self.buckets[self.free[i]]
        del bucket[bisect.bisect_left(bucket, i)]
        self.free[i] += delta
        bisect.insort(self.buckets[self.free[i]], i)
        self.total_free += delta

    def take(self, placement: Placement) -> None:
        for node, count in placement.items():
            if count:
                i = self.index[node]
                assert self.free[i] >= count, f"node {node} has {self.free[i]} free, not {count}"
                self._move(i, -count)

    def give_back(self, placement: Placement) -> None:
        for node, count in placement.items():
            if count:
                self._move(self.index[node], count)

    def plan(self, count: int, prefer: Sequence[int] = ()) -> dict[str, int] | None:
        """Where `count` devices would go, without taking them; None if they do not fit.

        One node if any holds them all (best fit: the fewest free that suffice, `prefer`
        nodes first); otherwise the nodes with most free first, then a best fit for the
        remainder: the fewest nodes.
        """
        if count > self.total_free:
            return None
        used: dict[int, int] = {}
        remaining = count
        while remaining:
            fits = self._best_fit(remaining, prefer, used)
            if fits is not None:
                used[fits] = remaining
                break
            i = self._fullest(prefer, used)
            used[i] = self.free[i]
            remaining -= self.free[i]
        return {self.names[i]: c for i, c in used.items()}

    def _best_fit(self, count: int, prefer: Sequence[int], used: Mapping[int, int]) -> int | None:
        fitting = [i for i in prefer if self.free[i] >= count and i not in used]
        if fitting:
            return min(fitting, key=lambda i: (self.free[i], i))
        for f in range(count, self.top + 1):
            for i in self.buckets[f]:
                if i not in used:
                    return i
        return None

    def _fullest(self, prefer: Sequence[int], used: Mapping[int, int]) -> int:
        for f in range(self.top, 0, -1):
            candidates = [i for i in prefer if self.free[i] == f and i not in used]
            if candidates:
                return min(candidates)
            for i in self.buckets[f]:
                if i not in used:
                    return i
        raise AssertionError("plan() checked total_free first")

    def place(self, count: int, prefer: Sequence[int] = ()) -> dict[str, int] | None:
        plan = self.plan(count, prefer)
        if plan is not None:
            self.take(plan)
        return plan

    def prefer(self, placement: Placement) -> list[int]:
        return sorted(self.index[n] for n, c in placement.items() if c)


def _extend_in_place(pool: NodePool, held: Placement, extra: int) -> dict[str, int]:
    """`held` plus up to `extra` of the free devices on its own nodes (not taken from `pool`)."""
    extended = dict(held)
    for i in pool.prefer(held):
        add = min(pool.free[i], extra)
        if add:
            extended[pool.names[i]] += add
            extra -= add
    return extended


def _shrink_in_place(placement: Placement, devices: int) -> dict[str, int]:
    """Keep `devices` of a job's devices, on the nodes where it has the most (fewest nodes)."""
    kept: dict[str, int] = {}
    for node, count in sorted(placement.items(), key=lambda nc: (-nc[1], nc[0])):
        if devices <= 0:
            break
        if count:
            kept[node] = min(count, devices)
            devices -= kept[node]
    return kept


# ---------------------------------------------------------------- baselines


@dataclass(frozen=True, slots=True)
class FifoPolicy:
    """First in, first out at the requested size; a running job is never touched.

    Strict order: a job that does not fit blocks the ones behind it (no backfilling),
    unless `backfill` is set.
    """

    backfill: bool = False
    name: str = "fifo"

    def decide(self, cluster: Cluster, jobs: Sequence[Job], now: float, more_to_come: bool = True) -> dict[str, dict[str, int]]:
        pool = NodePool(cluster)
        out: dict[str, dict[str, int]] = {}
        for job in jobs:
            if job.running:
                pool.take(job.placement)
                out[job.id] = dict(job.placement)
        for job in sorted((j for j in jobs if not j.running), key=lambda j: (j.arrival, j.id)):
            placed = pool.place(_fixed_size(job))
            if placed is None:
                if self.backfill:
                    continue
                break
            out[job.id] = placed
        return out


@dataclass(frozen=True, slots=True)
class LasPolicy:
    """Discretized least attained service at the requested size, preemptive, packed.

    Jobs fall into queues by attained device-time (`thresholds`, device-seconds); lower
    queues go first, FIFO within a queue. Jobs run in that order while devices last (a job
    that does not fit is skipped); a running job keeps its devices unless preempted; new
    jobs go on the fewest nodes. Against `TiresiasPolicy` (the Pollux artifact's: one
    threshold, emptiest nodes first) in bench/scheduler_bench.py, these five queues and the
    packing cut the average completion time by 0-28% (2026-11-23, six Philly samples); a
    replay in another simulator found it 4% behind that Tiresias, so the bench shows both.
    """

    thresholds: tuple[float, ...] = (600.0, 3600.0, 4 * 3600.0, 16 * 3600.0)
    name: str = "las"

    def decide(self, cluster: Cluster, jobs: Sequence[Job], now: float, more_to_come: bool = True) -> dict[str, dict[str, int]]:
        chosen = _by_queue(cluster, jobs, self.thresholds)
        pool = NodePool(cluster)
        out: dict[str, dict[str, int]] = {}
        for job in chosen:
            if job.running:
                pool.take(job.placement)
                out[job.id] = dict(job.placement)
        # Largest first packs best; the count check above guarantees everything fits.
        for job in sorted((j for j in chosen if not j.running), key=lambda j: -_fixed_size(j)):
            placed = pool.place(_fixed_size(job))
            assert placed is not None
            out[job.id] = placed
        return out


@dataclass(frozen=True, slots=True)
class TiresiasPolicy:
    """Tiresias' discretized least attained service (Gu et al., NSDI'19) as the Pollux
    artifact runs it, the published baseline of the elastic-scheduling papers.

    Two queues split at 16 GPU-hours of attained service; first come first served within a
    queue; a pass in queue order marks jobs running while their requested GPUs last (one
    that does not fit is skipped, and preempted if it ran); new jobs take GPUs from the
    node with the most free first, without consolidating. No starvation rule (the artifact
    runs with it off). The artifact orders its second queue by demotion time; this one,
    stateless, by arrival.
    """

    thresholds: tuple[float, ...] = (16 * 3600.0,)
    name: str = "tiresias"

    def decide(self, cluster: Cluster, jobs: Sequence[Job], now: float, more_to_come: bool = True) -> dict[str, dict[str, int]]:
        chosen = _by_queue(cluster, jobs, self.thresholds)
        free = {n.name: n.size for n in cluster.nodes}
        out: dict[str, dict[str, int]] = {}
        for job in chosen:
            if job.running:
                out[job.id] = dict(job.placement)
                for node, count in job.placement.items():
                    free[node] -= count
        # The node with the most free devices first (ties: the last name, as max() would pick),
        # from a heap: a decision over thousands of nodes must not scan them all per device.
        heap = [(-count, _Desc(node)) for node, count in free.items()]
        heapq.heapify(heap)
        for job in chosen:
            if job.running:
                continue
            placed: dict[str, int] = {}
            need = _fixed_size(job)
            while need:
                _, key = heapq.heappop(heap)
                node = key.name
                take = min(free[node], need)
                placed[node] = placed.get(node, 0) + take
                free[node] -= take
                need -= take
                heapq.heappush(heap, (-free[node], key))
            out[job.id] = placed
        return out


@dataclass(frozen=True, slots=True)
class _Desc:
    """A node name that sorts in reverse, for the heap's ties."""

    name: str

    def __lt__(self, other: "_Desc") -> bool:
        return self.name > other.name


def _by_queue(cluster: Cluster, jobs: Sequence[Job], thresholds: Sequence[float]) -> list[Job]:
    """Discretized LAS's pass: queues by attained service (lowest first), first come first
    served within one; each job runs at its size while devices last (one that does not fit
    is skipped)."""
    capacity = cluster.total
    chosen: list[Job] = []
    for job in sorted(jobs, key=lambda j: (bisect.bisect_right(thresholds, j.attained), j.arrival, j.id)):
        size = job.devices if job.running else _fixed_size(job)
        if size <= capacity:
            chosen.append(job)
            capacity -= size
    return chosen


def _fixed_size(job: Job) -> int:
    return min(max(job.requested, job.min_devices), job.max_devices)


# ---------------------------------------------------------------- the elastic policy


@dataclass(frozen=True, slots=True)
class ElasticPolicy:
    """Greedy elastic allocation by weighted marginal speed-up, then locality-aware packing.

    Each job's value of holding n devices is w * S(n): S its predicted speed-up (its
    step-time model, packed on the fewest nodes), w its weight. Where every job's length is
    known, w is heSRPT's marginal value for its rank by remaining work (`rank_q`, `rank_tie`):
    the shortest weighs most, every job keeps a share. Where some are not, w falls with the
    remaining work (`remaining_scale_s`) or, lengths unknown, with the service attained
    (`las_scale_s`, `las_power`, `las_cap_s`). Devices go one chunk at a time to the job
    whose concave hull of value gains most per device. Around that greedy:

    - protection: held devices weigh more (`hysteresis`; `loan_hysteresis` past the
      request, where a newcomer may take them back); a job is left as it is for `min_run_s`
      after a change, and is preempted at most `preemption_budget` times;
    - short jobs first: a protected job far longer than a waiting one yields down to its
      minimum (`yield_ratio`, not within `yield_min_s` of its last change), and lends a
      waiting short job the devices it needs when that costs less than the wait for the
      soonest finish (`admit_short`); a job waiting `starvation_s` runs before anything else;
    - efficiency: past its request a job grows only while its speed-up per device stays at
      least `min_efficiency`, and takes idle devices only down to `fixed_fill_efficiency`
      (fixed batch) or `goodput_fill_efficiency` while jobs may still arrive; devices no
      job wants in the greedy go to whoever gains from them (`fill_idle`);
    - restarts: a growth must pay for its pause (the job's measured resize cost, else
      `pause_s`) by `min_gain` over its run so far (at least `min_horizon_s`), at most its
      known remaining run (`remaining_horizon`), and comes only `grow_after_s` after the
      job's last change, except for a short fixed-batch job never resized (`early_growth`);
      `arrival_window_s` prices growth past the request by how soon arrivals want the
      devices, `critical_boost` weighs up the job that finishes last whatever is done
      (both off by default);
    - locality: best fit on the fewest nodes, growth in place, a spread job repacked onto
      fewer nodes where the speed-up pays for the move (`repack`), and one node more tried,
      once, by a long-running job whose model doubts spreading (`explore_after_s`).

    Why each rule is there and what it did against Pollux when it came in:
    docs/reference/elastic-policy.md; every figure's command: docs/benchmarks.md.
    """

    pause_s: float = 20.0
    hysteresis: float = 0.8
    loan_hysteresis: float = 3.0  # the same for devices held past the request (on loan: a waiting job may take them back)
    las_scale_s: float = 1800.0
    las_power: float = 1.0
    min_run_s: float = 3600.0
    min_gain: float = 0.05
    min_horizon_s: float = 600.0
    starvation_s: float = 6 * 3600.0
    explore_after_s: float = 1800.0
    las_cap_s: float = 16 * 3600.0
    preemption_budget: int = 3
    grow_after_s: float = 3600.0
    repack: bool = True
    fill_idle: bool = True
    know_remaining: bool = True
    remaining_scale_s: float = 1800.0
    yield_ratio: float = 0.5
    yield_min_s: float = 900.0
    rank_q: float = 8.0
    rank_tie: float = 1.5
    arrival_window_s: float = 0.0  # 0: growth past the request is not limited by arrivals
    critical_boost: float = 1.0  # weight factor of a job that finishes last whatever is done (1: none)
    admit_short: bool = True  # a protected long job lends a waiting short one its devices when that costs less than the wait
    min_efficiency: float = 0.5  # past its request, the greedy grows a job only while its speed-up per device stays at least this
    fixed_fill_efficiency: float = 0.3  # past its request, a job whose batch is fixed takes idle devices only down to this speed-up per device
    goodput_fill_efficiency: float = 0.3  # the same for a goodput job (its batch grows with its devices)
    early_growth: bool = True  # a fixed-batch job never resized that ends within grow_after_s grows without waiting it out
    remaining_horizon: bool = True  # a growth pays within the job's known remaining run, not only its run so far
    name: str = "elastic"

    def decide(self, cluster: Cluster, jobs: Sequence[Job], now: float, more_to_come: bool = True) -> dict[str, dict[str, int]]:
        jobs = sorted(jobs, key=lambda j: (j.arrival, j.id))
        reclaim_s = self._reclaim_s(cluster, jobs, now)
        someone_waits = any(not job.running for job in jobs)
        plans = [self._plan(cluster, job, now, someone_waits) for job in jobs]
        self._weigh_by_rank(plans)
        self._boost_critical(cluster, plans)
        self._yield_to_shorter(cluster, plans, now)
        self._admit_starving(cluster, plans)
        for plan in plans:
            plan.hull = self._hull(cluster, plan)
        # Growths not worth their pause are frozen at the current size and the devices
        # handed out again; a few rounds settle it (what is left after them stays frozen).
        frozen: set[int] = set()
        for _ in range(3):
            sizes = _greedy(plans, cluster.total, frozen)
            newly = {i for i, p in enumerate(plans) if i not in frozen and not self._worth_resizing(cluster, p, sizes[i], now, reclaim_s)}
            if not newly:
                break
            frozen |= newly
        else:
            sizes = _greedy(plans, cluster.total, frozen)
            # What the last freeze handed out again was not checked: a growth that does not
            # pay stays at its size (unchecked, a job grew minutes after a change, then was
            # trimmed back, over and over: each a restart).
            for i, plan in enumerate(plans):
                if not self._worth_resizing(cluster, plan, sizes[i], now, reclaim_s):
                    sizes[i] = plan.job.devices
        self._explore(cluster, plans, sizes)
        out = self._place(cluster, plans, sizes)
        if self.fill_idle:
            self._fill_idle(cluster, plans, out, reclaim_s, more_to_come)
        return out

    def _reclaim_s(self, cluster: Cluster, jobs: Sequence[Job], now: float) -> float:
        """How soon devices free now will be wanted by jobs still to arrive: the devices no
        job holds or waits for, over the rate at which recent arrivals requested devices."""
        if not self.arrival_window_s:
            return math.inf
        recent = sum(_fixed_size(j) for j in jobs if now - j.arrival < self.arrival_window_s)
        spare = cluster.total - sum(j.devices if j.running else _fixed_size(j) for j in jobs)
        if recent <= 0:
            return math.inf
        return max(spare, 0) * self.arrival_window_s / recent

    # -- sizing -------------------------------------------------------------------

    def _plan(self, cluster: Cluster, job: Job, now: float, someone_waits: bool) -> _JobPlan:
        # Past las_cap_s of service, long jobs rank alike: the held devices' hysteresis then
        # keeps the running ones running instead of taking turns (each turn a restart).
        remaining = self._remaining_device_s(cluster, job)
        if remaining is not None:
            weight = (1.0 + remaining / self.remaining_scale_s) ** -self.las_power
        else:
            weight = (1.0 + min(job.attained, self.las_cap_s) / self.las_scale_s) ** -self.las_power
        protected = job.running and (job.unchanged_for(now) < self.min_run_s or job.preemptions >= self.preemption_budget)
        if protected and _last_node_lost(cluster, job):
            protected = False  # it measured that its widest node slows it: no reason to keep it there
        starving = not job.running and job.unchanged_for(now) >= self.starvation_s
        # While a job waits, protection keeps a running job its request, not what it holds
        # past it: those devices were idle when it took them (on loan), and the newcomer may
        # want them back.
        floor = (min(job.devices, _fixed_size(job)) if someone_waits else job.devices) if protected else 0
        return _JobPlan(job, weight, starving, floor=floor, remaining=remaining)

    def _weigh_by_rank(self, plans: list[_JobPlan]) -> None:
        """heSRPT's weights by rank of remaining work, when every job's length is known."""
        if not self.rank_q or not plans or any(p.remaining is None for p in plans):
            return
        m, q = len(plans), self.rank_q
        # Jobs whose work left is within a factor `rank_tie` of each other share their ranks'
        # mean weight: a job is not stopped for a newcomer barely shorter than itself.
        longest_first = sorted(plans, key=lambda p: (-p.remaining, p.job.arrival, p.job.id))  # type: ignore[operator]
        start = 0
        while start < m:
            end = start + 1
            while end < m and longest_first[end].remaining * self.rank_tie >= longest_first[start].remaining:  # type: ignore[operator]
                end += 1
            weights = [((i / m) ** q - ((i - 1) / m) ** q) ** (1.0 / q) for i in range(start + 1, end + 1)]
            for plan in longest_first[start:end]:
                plan.weight = sum(weights) / len(weights)
            start = end

    def _boost_critical(self, cluster: Cluster, plans: list[_JobPlan]) -> None:
        """A job whose work left takes longer at its fastest size (within its max) than all
        the other jobs' work left on the rest of the cluster finishes last whatever is done:
        an hour it runs slower now is an hour on its completion, and the cluster drains
        around it later with devices it cannot use. Its weight is `critical_boost` times its
        rank's."""
        if self.critical_boost == 1.0 or not plans or any(p.remaining is None for p in plans):
            return
        total = cluster.total
        work = sum(p.remaining for p in plans)  # type: ignore[misc]
        for plan in plans:
            job = plan.job
            step_s, size = min((job.model.step_time(n, cluster.min_nodes(n)), n)
                               for n in _candidate_sizes(cluster, job.min_devices, min(job.max_devices, total), 0))
            if job.remaining_steps * step_s >= (work - plan.remaining) / max(total - size, 1):  # type: ignore[operator]
                plan.weight *= self.critical_boost

    def _yield_to_shorter(self, cluster: Cluster, plans: list[_JobPlan], now: float) -> None:
        """Protected jobs far longer than the shortest waiting job keep only their minimum.

        All they hold beyond it goes back to the greedy, not just what the waiting jobs need:
        on the Philly workloads that was 1-3 % better on average JCT than yielding only as
        much as the waiting jobs need, and keeping the minimum ~1 % better than keeping the
        request (the devices go where they are worth most now), at somewhat more restarts."""
        waiting = [p.remaining for p in plans if not p.job.running and p.remaining is not None]
        if not waiting or not self.yield_ratio:
            return
        shortest = min(waiting)
        for plan in plans:
            keep = plan.job.min_devices
            far_longer = plan.remaining is not None and shortest < self.yield_ratio * plan.remaining
            # Not again within yield_min_s of its last change: each yield is a restart.
            if plan.floor > keep and far_longer and plan.job.unchanged_for(now) >= self.yield_min_s:
                plan.floor = keep
        if self.admit_short:
            self._admit_short(cluster, plans)

    def _admit_short(self, cluster: Cluster, plans: list[_JobPlan]) -> None:
        """A waiting job that the protected jobs' floors leave no room for takes the devices
        it needs from the protected job that it is far shorter than and that its start delays
        least, when that delay is under the wait for the soonest finish: the timers keep long
        jobs from churning among themselves, not a short job from starting.

        The long job's delay is two pauses (the shrink and the growth back) plus the share of
        its speed the lent devices give (its model's) over the short job's run;
        the wait is how soon a running job with a known end finishes (what holding the short
        job costs it). Shortest waiting job first; each long job lends once per decision."""
        spare = cluster.total - sum(p.floor for p in plans)
        waiting = sorted((p for p in plans if not p.job.running and p.remaining is not None and not p.starving),
                         key=lambda p: (p.remaining, p.job.arrival, p.job.id))  # type: ignore[arg-type, return-value]
        if not waiting:
            return
        ends = [run for p in plans if (run := _remaining_run_s(p.job)) is not None]
        soonest = min(ends, default=math.inf)
        lenders = [p for p in plans if p.floor > p.job.min_devices and p.remaining is not None and p.job.running]
        starving = any(p.starving for p in plans)
        longest = max((p for p in plans if p.job.running and p.remaining is not None),
                      key=lambda p: p.remaining, default=None)  # type: ignore[arg-type, return-value]
        for plan in waiting:
            need = plan.job.min_devices - max(spare, 0)
            if need <= 0:
                # There is room, but the greedy may still keep it with the jobs that hold it
                # (hysteresis). Holding the newcomer back for a finish costs it more than its
                # start costs the longest running job, far longer than it (two pauses and at
                # most its whole run): it starts, unless a starving job is owed the room first.
                if (not starving and longest is not None and plan.remaining < self.yield_ratio * longest.remaining  # type: ignore[operator]
                        and 2 * self._pause_s(longest.job) + _run_at_min_s(cluster, plan.job) < soonest):
                    plan.floor = plan.job.min_devices
                spare -= plan.job.min_devices
                continue
            run_s = _run_at_min_s(cluster, plan.job)
            best: tuple[float, _JobPlan] | None = None
            for lender in lenders:
                if lender.floor - lender.job.min_devices < need or plan.remaining >= self.yield_ratio * lender.remaining:  # type: ignore[operator]
                    continue
                job = lender.job
                slower = 1.0 - _speedup_packed(cluster, job, job.devices - need) / speedup(job.model, job.devices, nodes_of(job.placement))
                delay = 2 * self._pause_s(job) + run_s * max(slower, 0.0)
                if delay < soonest and (best is None or delay < best[0]):
                    best = (delay, lender)
            if best is None:
                return  # a shorter job that cannot start holds the longer ones back from jumping it
            best[1].floor -= need
            lenders.remove(best[1])
            spare += need - plan.job.min_devices

    def _remaining_device_s(self, cluster: Cluster, job: Job) -> float | None:
        """Device-seconds the job still needs at its requested size, when its length is known."""
        if not self.know_remaining or job.remaining_steps is None:
            return None
        n = _fixed_size(job)
        return job.remaining_steps * job.model.step_time(n, cluster.min_nodes(min(n, cluster.total))) * n

    def _admit_starving(self, cluster: Cluster, plans: list[_JobPlan]) -> None:
        """Starving jobs, longest waiting first, get their minimum before any greedy choice."""
        capacity = cluster.total - sum(p.floor for p in plans)
        blocked = False
        for plan in sorted((p for p in plans if p.starving), key=lambda p: (p.job.unchanged_since, p.job.id)):
            if plan.job.min_devices <= capacity:
                plan.floor = plan.job.min_devices
                capacity -= plan.floor
            else:
                blocked = True
                break
        if blocked:
            # Hold everything still (no start, no growth) until the starving job fits.
            for plan in plans:
                if plan.floor == 0:
                    plan.cap = plan.job.devices

    def _value(self, cluster: Cluster, plan: _JobPlan, n: int) -> float:
        job = plan.job
        current = job.devices
        gain = _speedup_packed(cluster, job, n)
        if current:
            kept = min(n, current)
            keep = speedup(job.model, kept, nodes_of(job.placement)) if kept == current else _speedup_packed(cluster, job, kept)
            # Devices past the request weigh more: taking them back restarts the job, and it
            # grows into the next idle devices again (another restart).
            own = min(kept, _fixed_size(job))
            keep_own = keep if own == kept else _speedup_packed(cluster, job, own)
            gain += self.hysteresis * keep_own + self.loan_hysteresis * (keep - keep_own)
        return plan.weight * gain

    def _hull(self, cluster: Cluster, plan: _JobPlan) -> list[tuple[int, float]]:
        """The upper concave hull of (devices, value) from the job's floor: the greedy's steps."""
        job = plan.job
        top = min(job.max_devices, plan.cap if plan.cap is not None else job.max_devices)
        if top < max(plan.floor, job.min_devices):
            plan.points = [(plan.floor, 0.0)]
            return plan.points
        base_value = self._value(cluster, plan, plan.floor) if plan.floor else 0.0
        points = [(plan.floor, base_value)]
        # Past its request (or what it holds), a size whose speed-up per device falls under
        # `min_efficiency` is no step of the greedy's: devices are contended there. Devices no
        # job wants still go to it (`_fill_idle`), and speed-up per device only falls with size.
        efficient_up_to = max(_fixed_size(job), job.devices)
        for n in _candidate_sizes(cluster, max(plan.floor, job.min_devices), top, job.devices):
            if n > plan.floor:
                if self.min_efficiency and n > efficient_up_to and _speedup_packed(cluster, job, n) < self.min_efficiency * n:
                    break
                points.append((n, self._value(cluster, plan, n)))
        plan.points = points
        return upper_hull(points)

    def _worth_resizing(self, cluster: Cluster, plan: _JobPlan, size: int, now: float, reclaim_s: float = math.inf) -> bool:
        """Growing a running job must pay for its pause over its expected remaining run, and
        wait `grow_after_s` since its last change (a job shrunk for a newcomer does not bounce
        back at once: each bounce is a restart)."""
        job = plan.job
        current = job.devices
        if not current or size <= current:
            return True
        if job.unchanged_for(now) < self.grow_after_s and not self._grows_early(job):
            return False
        return self._pays(job, speedup(job.model, current, nodes_of(job.placement)), _speedup_packed(cluster, job, size),
                          reclaim_s if size > _fixed_size(job) else math.inf)

    def _grows_early(self, job: Job) -> bool:
        """A job whose batch is fixed, not resized since it started, whose remaining run at
        its size is shorter than `grow_after_s`: that wait keeps a shrunk job from bouncing
        back; this one it would only keep below its best size to its end (`early_growth`)."""
        if not (self.early_growth and self.know_remaining) or job.restarts or isinstance(job.model, GoodputView):
            return False
        run = _remaining_run_s(job)
        return run is not None and run < self.grow_after_s

    def _explore(self, cluster: Cluster, plans: list[_JobPlan], sizes: list[int]) -> None:
        """Give idle devices to long jobs to run on one more node than they ever did."""
        idle = cluster.total - sum(sizes)
        if idle <= 0 or any(p.cap is not None for p in plans):
            return
        node = cluster.largest_node
        candidates = []
        for i, plan in enumerate(plans):
            job, size = plan.job, sizes[i]
            if not size or job.attained / size < self.explore_after_s:
                continue
            nodes = cluster.min_nodes(size)
            target = min(job.max_devices, node * (nodes + 1))
            # The node it last added must have paid off (per what it measured there): a job held
            # on a spread that did not pay (protected from a shrink for now) explores no further.
            paid = nodes < 2 or _last_node_pays(job.model, size, nodes, node)
            if paid and job.explored_nodes <= nodes and size == node * nodes and cluster.min_nodes(target) == nodes + 1:
                candidates.append((-job.attained / size, i, target))
        for _, i, target in sorted(candidates):  # the longest-running first
            if target - sizes[i] <= idle:
                idle -= target - sizes[i]
                sizes[i] = target
                plans[i].exploring = True

    # -- placement ----------------------------------------------------------------

    def _place(self, cluster: Cluster, plans: list[_JobPlan], sizes: list[int]) -> dict[str, dict[str, int]]:
        pool = NodePool(cluster)
        out: dict[str, dict[str, int]] = {}
        growing: list[int] = []
        for i, (plan, size) in enumerate(zip(plans, sizes)):
            current = plan.job.devices
            if not size or not current:
                continue
            if size <= current:
                out[plan.job.id] = dict(plan.job.placement) if size == current else _shrink_in_place(plan.job.placement, size)
                pool.take(out[plan.job.id])
            else:
                pool.take(plan.job.placement)
                growing.append(i)
        if self.repack:
            self._repack(cluster, pool, plans, sizes, out)
        starting = [i for i, (p, s) in enumerate(zip(plans, sizes)) if s and not p.job.devices]
        for i in sorted(growing + starting, key=lambda i: (-sizes[i], i)):
            job = plans[i].job
            placed = self._grow(pool, job, sizes[i], plans[i].exploring) if job.devices else pool.place(sizes[i])
            assert placed is not None, "the greedy never hands out more than the cluster holds"
            if placed is not job.placement and not plans[i].exploring:
                placed = self._trim_spread(cluster, pool, job, placed, plans[i].floor)
            out[job.id] = dict(placed)
        self._backfill(pool, plans, sizes, out)
        return out

    def _repack(self, cluster: Cluster, pool: NodePool, plans: list[_JobPlan], sizes: list[int], out: dict[str, dict[str, int]]) -> None:
        """A job that keeps its size but spans more nodes than it needs moves to fewer, when
        the speed-up pays for the move's pause over its expected remaining run. The widest
        first: they lose most to the network."""
        spread = [i for i, (plan, size) in enumerate(zip(plans, sizes))
                  if size and size == plan.job.devices and nodes_of(out[plan.job.id]) > cluster.min_nodes(size)]
        for i in sorted(spread, key=lambda i: (-nodes_of(out[plans[i].job.id]), i)):
            job, held = plans[i].job, out[plans[i].job.id]
            pool.give_back(held)
            moved = pool.plan(sizes[i], pool.prefer(held))
            if moved is not None and nodes_of(moved) < nodes_of(held) and self._pays(
                    job, speedup(job.model, sizes[i], nodes_of(held)), speedup(job.model, sizes[i], nodes_of(moved))):
                pool.take(moved)
                out[job.id] = moved
            else:
                pool.take(held)

    def _pays(self, job: Job, before: float, after: float, reclaim_s: float = math.inf, min_gain: float | None = None) -> bool:
        """Going from speed-up `before` to `after` pays for a pause, over a horizon of the
        running job's run so far (its expected remaining run) or, shorter, its known remaining
        run at its current size, by at least `min_gain`."""
        horizon = min(max(self.min_horizon_s, job.attained / job.devices), reclaim_s)
        run = _remaining_run_s(job)
        if self.remaining_horizon and self.know_remaining and run is not None:
            # Its run so far guesses at its run to come; a known length says: a job that ends
            # in minutes gains minutes from a growth, whatever it has run.
            horizon = min(horizon, run)
        pause_s = self._pause_s(job)
        if horizon <= pause_s:
            return False
        return after * (horizon - pause_s) >= before * horizon * (1.0 + (self.min_gain if min_gain is None else min_gain))

    def _pause_s(self, job: Job) -> float:
        """What stopping and restarting the job costs it: what its last restart took, where
        measured (a large model's checkpoint and restore take far longer than a small one's),
        else the policy's estimate."""
        return self.pause_s if job.pause_s is None else job.pause_s

    def _grow(self, pool: NodePool, job: Job, size: int, exploring: bool = False) -> Placement:
        """Extend in place or move whole, whichever spans fewer nodes; keep it if no better
        (unless exploring: then the point is to measure what the model doubts)."""
        held = dict(job.placement)
        extended = _extend_in_place(pool, held, size - devices_of(held))
        extra = size - devices_of(extended)
        if extra:
            pool.take({n: extended[n] - held[n] for n in extended})
            rest = pool.plan(extra)
            pool.give_back({n: extended[n] - held[n] for n in extended})
            assert rest is not None
            for node, count in rest.items():
                extended[node] = extended.get(node, 0) + count
        pool.give_back(held)
        moved = pool.plan(size, pool.prefer(held))
        assert moved is not None
        best = moved if nodes_of(moved) < nodes_of(extended) else extended
        if not exploring and speedup(job.model, size, nodes_of(best)) <= speedup(job.model, devices_of(held), nodes_of(held)):
            pool.take(held)
            return job.placement  # spreading would undo the growth: stay as it is
        pool.take(best)
        return best

    def _trim_spread(self, cluster: Cluster, pool: NodePool, job: Job, placed: Placement, floor: int = 0) -> dict[str, int]:
        """Drop the nodes that cost a spread job more in network than they add in compute,
        never below `floor` (the devices a protected or starving job keeps)."""
        if nodes_of(placed) <= cluster.min_nodes(devices_of(placed)):
            return dict(placed)
        ranked = sorted(placed.items(), key=lambda nc: (-nc[1], nc[0]))
        best, best_speed, total = len(ranked), -1.0, 0
        for k, (_, count) in enumerate(ranked, start=1):
            total += count
            if total >= max(job.min_devices, floor):
                s = speedup(job.model, total, k)
                if s > best_speed * (1.0 + 1e-9):
                    best, best_speed = k, s
        kept = dict(ranked[:best])
        pool.give_back({n: c for n, c in ranked[best:]})
        return kept

    def _fill_idle(self, cluster: Cluster, plans: list[_JobPlan], out: dict[str, dict[str, int]], reclaim_s: float = math.inf,
                   more_to_come: bool = True) -> None:
        """No device stays idle that a job could use: what the decision left free goes, one
        step at a time, to the job that gains most from it (weighted speed-up per device):
        a waiting job starts, a job below its request grows toward it when that wins back its
        pause, one at its request grows toward its max when that pays for the pause by
        `min_gain`. The freeze timers limit changes
        that move or shrink running jobs, not growth into devices nobody holds. A starving
        job's hold is the exception: it waits for these devices."""
        if any(p.cap is not None for p in plans):
            return
        pool = NodePool(cluster)
        for placement in out.values():
            pool.take(placement)
        # Jobs this decision already moved or shrank change no further, but for free devices on
        # the nodes they keep: they restart anyway, and a job shrunk below its request must not
        # sit beside an idle device of its own node.
        changed = {p.job.id for p in plans if p.job.id in out and p.job.running and not same_placement(out[p.job.id], p.job.placement)}
        while pool.total_free:
            best: tuple[float, int, dict[str, int]] | None = None
            for i, plan in enumerate(plans):
                job = plan.job
                held = out.get(job.id)
                if job.id in changed:
                    grown = self._grow_on_own_nodes(pool, plan, held)
                    if grown is not None and (best is None or grown[0] > best[0]):
                        best = (grown[0], i, grown[1])
                    continue
                current = devices_of(held)
                top = min(job.max_devices, current + pool.total_free)
                if top < max(current + 1, job.min_devices):
                    continue
                before = _speedup_packed(cluster, job, current) if not held else speedup(job.model, current, nodes_of(held))
                for n in _candidate_sizes(cluster, max(current + 1, job.min_devices), top, current):
                    if held:
                        probe = replace(job, placement=held)
                        placed = self._grow(pool, probe, n)
                        if placed is probe.placement:
                            continue  # spreading would undo the growth
                        pool.give_back(placed)  # _grow took it: only a plan here
                        pool.take(held)
                    else:
                        placed = pool.plan(n)
                        if placed is None:
                            continue
                    after = speedup(job.model, n, nodes_of(placed))
                    if after <= before * (1.0 + 1e-9):
                        continue
                    fill_efficiency = self.fixed_fill_efficiency if _batch_fixed(job) else self.goodput_fill_efficiency
                    if more_to_come and n > max(job.requested, job.devices) and after < fill_efficiency * n:
                        continue  # a batch split (or grown) this thin gains little, and the job would hold these devices
                    # Past its request a growth pays by `min_gain` before the devices are wanted
                    # again; toward it, it must at least win back its own pause.
                    past = n > job.requested
                    if job.running and not self._pays(job, before, after, reclaim_s if past else math.inf, None if past else 0.0):
                        continue
                    gain = plan.weight * (after - before) / (n - current)
                    if best is None or gain > best[0]:
                        best = (gain, i, dict(placed))
            if best is None:
                return
            _, i, placed = best
            job = plans[i].job
            held = out.get(job.id)
            if held:
                pool.give_back(held)
            pool.take(placed)
            out[job.id] = placed
            if job.running and not same_placement(placed, job.placement) and devices_of(placed) < devices_of(job.placement):
                changed.add(job.id)

    def _grow_on_own_nodes(self, pool: NodePool, plan: _JobPlan, held: Placement | None) -> tuple[float, dict[str, int]] | None:
        """The job extended onto every free device of the nodes it holds (up to its max), and
        its weighted gain per device, if that makes it faster."""
        job = plan.job
        if not held:
            return None
        extended = _extend_in_place(pool, held, job.max_devices - devices_of(held))
        added = devices_of(extended) - devices_of(held)
        if not added:
            return None
        before, after = speedup(job.model, devices_of(held), nodes_of(held)), speedup(job.model, devices_of(extended), nodes_of(extended))
        if after <= before * (1.0 + 1e-9):
            return None
        return plan.weight * (after - before) / added, extended

    def _backfill(self, pool: NodePool, plans: list[_JobPlan], sizes: list[int], out: dict[str, dict[str, int]]) -> None:
        """Devices freed by trimming go to waiting jobs at their minimum, on one node."""
        if any(p.cap is not None for p in plans):
            return  # a starving job is holding the cluster still
        waiting = [p for p, s in zip(plans, sizes) if not s and p.job.id not in out]
        for plan in sorted(waiting, key=lambda p: (-p.weight, p.job.arrival, p.job.id)):
            if pool.total_free < plan.job.min_devices:
                continue
            placed = pool.plan(plan.job.min_devices)
            if placed is not None and nodes_of(placed) == 1:
                pool.take(placed)
                out[plan.job.id] = placed


@dataclass(slots=True)
class _JobPlan:
    """The elastic policy's working state for one job during one decision."""

    job: Job
    weight: float
    starving: bool
    floor: int  # devices it keeps whatever the greedy does (protected or starving)
    remaining: float | None = None  # device-seconds of work left at its request, when its length is known
    cap: int | None = None  # devices it may not exceed (None: its max)
    exploring: bool = False  # given idle devices to measure one more node
    points: list[tuple[int, float]] | None = None  # (devices, value) from the floor up
    hull: list[tuple[int, float]] | None = None  # their upper concave hull


def _batch_fixed(job: Job) -> bool:
    """The job's batch is fixed (reproducible): more devices split it, never grow it. A goodput
    job's model is a `GoodputView` (its batch grows with its devices)."""
    return not isinstance(job.model, GoodputView)


def _run_at_min_s(cluster: Cluster, job: Job) -> float:
    """How long the job's known remaining steps take at its minimum size."""
    return job.remaining_steps * job.model.step_time(job.min_devices, cluster.min_nodes(job.min_devices))  # type: ignore[operator]


def _last_node_pays(model: StepTimeModel, size: int, nodes: int, node: int) -> bool:
    """`size` devices on `nodes` nodes beat the nodes - 1 whole nodes of `node` devices before it."""
    return speedup(model, size, nodes) > speedup(model, node * (nodes - 1), nodes - 1)


def _last_node_lost(cluster: Cluster, job: Job) -> bool:
    """Its model says the running job would be at least as fast on one node fewer (whole nodes)."""
    nodes = nodes_of(job.placement)
    if nodes < 2 or job.explored_nodes < nodes:
        return False  # not measured there yet: the prior alone does not undo a placement
    return not _last_node_pays(job.model, job.devices, nodes, cluster.largest_node)


def _speedup_packed(cluster: Cluster, job: Job, n: int) -> float:
    return speedup(job.model, n, cluster.min_nodes(n)) if n else 0.0


def _candidate_sizes(cluster: Cluster, low: int, high: int, current: int) -> list[int]:
    """Sizes worth considering: every size within a node, then whole multiples of a node.

    Beyond four nodes the multiples thin out geometrically: a decision must stay fast
    when jobs may take hundreds of devices.
    """
    node = max(cluster.largest_node, 1)
    sizes = set(range(low, min(high, node) + 1))
    k = 2
    while k * node <= high:
        if k * node >= low:
            sizes.add(k * node)
        k = k + 1 if k < 4 else int(k * 1.5)
    sizes.update(s for s in (low, high, current) if low <= s <= high)
    return sorted(sizes)


def _remaining_run_s(job: Job) -> float | None:
    """A running job's known remaining run at its current size (None: not known, or not running)."""
    if not job.running or job.remaining_steps is None:
        return None
    return job.remaining_steps * job.model.step_time(job.devices, nodes_of(job.placement))


def upper_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Upper concave hull of points sorted by x, starting at the first point, up to its
    highest (points on a chord are dropped)."""
    hull: list[tuple[int, float]] = []
    for p in points:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) >= 0:
            hull.pop()
        hull.append(p)
    # Only rising steps are worth devices.
    end = max(range(len(hull)), key=lambda i: (hull[i][1], -i))
    return hull[: end + 1]


def _cross(o: tuple[int, float], a: tuple[int, float], b: tuple[int, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _greedy(plans: Sequence[_JobPlan], capacity: int, frozen: Iterable[int]) -> list[int]:
    """Hand out devices hull step by hull step, best value per device first.

    A step too large for what is left is replaced by the job's best step that still fits,
    so a nearly full cluster is still filled.
    """
    frozen = set(frozen)
    sizes = [p.floor for p in plans]
    for i in frozen:
        sizes[i] = max(sizes[i], plans[i].job.devices)
    capacity -= sum(sizes)
    assert capacity >= 0, "floors and frozen sizes fit by construction"
    hulls = [list(p.hull or ()) for p in plans]
    heap = [(-_slope(h, 0), i, 0) for i, h in enumerate(hulls) if i not in frozen and len(h) > 1]
    heapq.heapify(heap)
    while heap and capacity > 0:
        _, i, step = heapq.heappop(heap)
        hull = hulls[i]
        (n0, v0), (n1, _) = hull[step], hull[step + 1]
        if n1 - n0 <= capacity:
            sizes[i] = n1
            capacity -= n1 - n0
            if step + 2 < len(hull):
                heapq.heappush(heap, (-_slope(hull, step + 1), i, step + 1))
            continue
        fit = _best_fitting_step(plans[i], n0, v0, capacity)
        if fit is not None:
            hull[step + 1 :] = [fit]
            heapq.heappush(heap, (-_slope(hull, step), i, step))
    return sizes


def _slope(hull: list[tuple[int, float]], step: int) -> float:
    (n0, v0), (n1, v1) = hull[step], hull[step + 1]
    return (v1 - v0) / (n1 - n0)


def _best_fitting_step(plan: _JobPlan, n0: int, v0: float, capacity: int) -> tuple[int, float] | None:
    """The candidate size beyond n0 within `capacity` more devices that gains most per device."""
    assert plan.points is not None
    best: tuple[int, float] | None = None
    best_slope = 0.0
    for n, v in plan.points:
        if n0 < n <= n0 + capacity and (v - v0) / (n - n0) > best_slope:
            best, best_slope = (n, v), (v - v0) / (n - n0)
    return best
