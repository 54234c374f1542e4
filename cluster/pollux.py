"""Pollux (Qiao et al., OSDI'21) as a baseline: goodput speed-ups and a genetic search.

Written from the paper (sections 3-4) and its artifact's simulator policy (petuum/adaptdl,
`simulator/pollux.py`): adaptdl-sched 0.2.11 installs from the registry, but its policy
module does not import with the pymoo it gets (0.6: `pymoo.operators.crossover.util` is
gone). What it does, and where it differs:

- Each job's speed-up table: its goodput at (k nodes, r devices), the batch chosen for
  goodput (cluster.goodput: the same throughput model fitted online from the job's step
  times, with compute and all-reduce terms, and its measured gradient noise scale), over
  its goodput at its fair share, ceil(devices / jobs). A job with a fixed batch has the
  plain throughput ratio.
- A job may run on at most twice the devices it has ever run on (once started at one):
  Pollux grows a job only where its model has been measured, doubling.
- The cluster-wide search: allocations are matrices (jobs x nodes) of device counts; a
  population of 100 evolves by single-point crossover over jobs, the artifact's three
  mutations (reset a job to its current allocation, zero some counts, raise some where
  devices are free) and its repair (at most one distributed job per node, at most the
  job's maximum devices and 16 nodes, node capacities granted in order of least attained
  service); the fitness is the power mean (p = -1) of the jobs' speed-ups, a job whose
  allocation changes scaled by max(age - restarts x delay, 0) / (age + delay), the
  restart penalty. The population is kept from one decision to the next.
- The artifact runs NSGA-II over (fitness, utility) for 100 generations and picks the
  best fitness; here an elitist genetic algorithm over the fitness alone runs
  `generations` generations (within `budget_s` of wall time, when set) (the artifact's utility serves
  its cluster autoscaler, which a fixed cluster does not use). On large clusters the
  population shrinks so that one generation's arrays stay within `max_cells`.

It keeps state between calls (its population and its speed-up tables), unlike our
policies: it is a baseline for the simulator, not a policy of the live campaign.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from cluster.jobs import Cluster, Job

MAX_JOB_NODES = 16  # the artifact's repair: a job spans at most 16 nodes
POWER = -1.0  # power mean of speed-ups: more negative is fairer


@dataclass
class PolluxPolicy:
    restart_delay_s: float = 30.0  # the artifact's delay in the restart penalty
    # The artifact decides once a minute, so a job is up to a minute old when it is first
    # placed; here decisions also come on arrivals, and a job counts as at least this old
    # (a job of age 0 would be worth nothing anywhere, and wait for the next tick).
    min_age_s: float = 60.0
    population: int = 100
    generations: int = 100
    # Wall-clock cap on the search (None: always `generations`, as the simulator runs it, so that a
    # replay does not depend on the host's load); the decision-time bench sets 0.6 s.
    budget_s: float | None = None
    max_cells: int = 4_000_000  # population x jobs x nodes, per generation array
    seed: int = 0
    name: str = "pollux"
    _rng: np.random.Generator = field(init=False, repr=False)
    _previous: tuple[list[str], list[str], np.ndarray] | None = field(default=None, init=False, repr=False)
    _tables: dict[str, tuple[tuple, np.ndarray]] = field(default_factory=dict, init=False, repr=False)
    _cell_s: float = field(default=0.0, init=False, repr=False)  # seconds per population x jobs x nodes cell, last measured

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def decide(self, cluster: Cluster, jobs: Sequence[Job], now: float, more_to_come: bool = True) -> dict[str, dict[str, int]]:
        if not jobs:
            return {}
        started = time.perf_counter()
        # Least attained service first, then arrival: the order in which repair grants devices.
        jobs = sorted(jobs, key=lambda j: (j.attained, j.arrival, j.id))
        nodes = [n.name for n in cluster.nodes]
        capacity = np.array([n.size for n in cluster.nodes], dtype=np.int64)
        problem = _Problem(self, cluster, jobs, nodes, capacity, now)
        cells = len(jobs) * len(nodes)
        size = max(4, min(self.population, self.max_cells // max(cells, 1)))
        seeded_at = time.perf_counter()
        population = problem.repair(self._seed_population(jobs, nodes, problem, size))
        fitness = problem.fitness(population)
        # No generation starts unless it can end within the budget. Its cost: what one cost per
        # cell in the last decision, else ten times the seeding's (a generation mutates, so its
        # repair has far more to fix than the seeding's).
        generation_s = max(10.0 * (time.perf_counter() - seeded_at), self._cell_s * cells * size)
        for _ in range(self.generations):
            before = time.perf_counter()
            if self.budget_s is not None and before - started + generation_s > self.budget_s:  # it would end past the budget
                break
            children = problem.repair(problem.mutate(problem.crossover(population, fitness)))
            merged = np.concatenate([population, children])
            scores = np.concatenate([fitness, problem.fitness(children)])
            keep = np.argsort(-scores, kind="stable")[:size]
            population, fitness = merged[keep], scores[keep]
            generation_s = time.perf_counter() - before
            self._cell_s = generation_s / (cells * size)
        self._previous = ([j.id for j in jobs], nodes, population)
        best = population[int(np.argmax(fitness))]
        out: dict[str, dict[str, int]] = {}
        for j, job in enumerate(jobs):
            row = best[j]
            held = np.flatnonzero(row)
            if held.size:
                out[job.id] = {nodes[n]: int(row[n]) for n in held}
        return out

    def _seed_population(self, jobs: Sequence[Job], nodes: list[str], problem: _Problem, size: int) -> np.ndarray:
        """The last decision's population, mapped onto today's jobs and nodes; the current
        allocation fills it up (the artifact seeds NSGA-II the same way)."""
        base = problem.base
        population = np.repeat(base[None], size, axis=0)
        population[-1] = _first_fit(base, problem.capacity, problem.low)  # as adaptdl places an arriving job
        if self._previous is not None:
            prev_jobs, prev_nodes, prev = self._previous
            if prev_nodes == nodes:
                index = {job_id: i for i, job_id in enumerate(prev_jobs)}
                dst = [j for j, job in enumerate(jobs) if job.id in index]
                src = [index[jobs[j].id] for j in dst]
                count = min(size, len(prev))
                population[:count] = 0
                population[:count, dst] = prev[:count][:, src]
        return population

    def speedup_table(self, cluster: Cluster, job: Job, fair: int, top: int) -> np.ndarray:
        """Speed-up at [nodes, devices] for devices <= top, relative to `fair` devices packed.
        Kept while the job's model, noise scale and limits are the same."""
        model = job.model
        inner = getattr(model, "model", model)
        observed = getattr(inner, "observations", {})
        key = (top, fair, len(observed), sum(c for c, _ in observed.values()), round(getattr(model, "noise_scale", 0.0), 3))
        cached = self._tables.get(job.id)
        if cached is not None and cached[0] == key:
            return cached[1]
        per_node = cluster.largest_node
        depth = min(top, MAX_JOB_NODES)
        r = np.arange(1, top + 1)[None, :].repeat(depth, axis=0)
        k = np.arange(1, depth + 1)[:, None].repeat(top, axis=1)
        legal = (k <= r) & (k >= np.ceil(r / per_node))
        fair_nodes = cluster.min_nodes(min(fair, cluster.total))
        rates = _rates(model, np.where(legal, r, 1), np.where(legal, k, 1))
        base = _rates(model, np.array([fair]), np.array([fair_nodes]))[0]
        table = np.zeros((depth + 1, top + 1))
        table[1:, 1:] = np.where(legal, rates / base, 0.0)
        self._tables[job.id] = (key, table)
        return table


def _first_fit(base: np.ndarray, capacity: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The current allocation plus each waiting job at its minimum on the first node with
    room (adaptdl's `allocate_job` for an arriving job, between optimisation cycles)."""
    state = base.copy()
    free = capacity - state.sum(axis=0)
    for j in np.flatnonzero(state.sum(axis=1) == 0):
        need = max(int(low[j]), 1)
        room = np.flatnonzero(free >= need)
        if room.size:
            state[j, room[0]] = need
            free[room[0]] -= need
    return state


def _rates(model, devices: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Reference steps per second at each (devices, nodes), from the job's fitted analytic
    throughput model (Pollux's own model is analytic: no per-configuration correction);
    for a goodput job at the best batch for its noise scale."""
    inner = getattr(model, "model", model)
    params = getattr(inner, "params", None)
    if params is None:  # no analytic form: ask the model, one configuration at a time
        return np.vectorize(lambda n, k: 1.0 / model.step_time(int(n), int(k)))(devices, nodes).astype(float)
    fixed, compute, intra, inter, per_node = params
    n, k = devices.astype(float), nodes.astype(float)
    allreduce = np.where(n > 1, 2.0 * (n - 1) / n, 0.0)
    step = fixed + compute / n + np.where(k > 1, inter, intra) * allreduce + per_node * (k - 1)
    noise = getattr(model, "noise_scale", None)
    if noise is None:
        return 1.0 / step
    per_scale = np.minimum(compute / n, step)
    scale = np.clip(np.sqrt(noise * np.maximum(step - per_scale, 0.0) / np.maximum(per_scale, 1e-12)), 1.0, model.max_batch)
    if noise <= 0:
        scale = np.ones_like(step)
    gain = scale * (noise + 1.0) / (noise + scale) if noise > 0 else np.ones_like(step)
    return gain / (step + per_scale * (scale - 1.0))


class _Problem:
    """One decision's search: the jobs, nodes and speed-up tables, and the genetic operators."""

    def __init__(self, policy: PolluxPolicy, cluster: Cluster, jobs: Sequence[Job], nodes: list[str],
                 capacity: np.ndarray, now: float) -> None:
        self.rng = policy._rng
        self.capacity = capacity
        node_index = {name: i for i, name in enumerate(nodes)}
        self.base = np.zeros((len(jobs), len(nodes)), dtype=np.int64)
        for j, job in enumerate(jobs):
            for node, count in job.placement.items():
                if count:
                    self.base[j, node_index[node]] = count
        fair = -(-cluster.total // len(jobs))  # ceil
        # At most twice what it has run on, within its own limit (a new job: one device).
        self.top = np.array([min(job.max_devices, max(2 * job.explored_devices, 1, job.devices)) for job in jobs])
        self.low = np.array([job.min_devices for job in jobs])
        self.tables = [policy.speedup_table(cluster, job, fair, int(top)) for job, top in zip(jobs, self.top)]
        width = max(t.shape[1] for t in self.tables)
        depth = max(t.shape[0] for t in self.tables)
        self.speedups = np.zeros((len(jobs), depth, width))
        for j, t in enumerate(self.tables):
            self.speedups[j, : t.shape[0], : t.shape[1]] = t
        # The artifact scales speed-ups so that one node's share is worth 1.
        self.scale = len(nodes) / cluster.total
        age = np.array([max(now - job.arrival, policy.min_age_s) for job in jobs])
        restarts = np.array([job.restarts for job in jobs], dtype=float)
        delay = policy.restart_delay_s
        self.penalty = np.maximum(age - restarts * delay, 0.0) / (age + delay)

    def fitness(self, states: np.ndarray) -> np.ndarray:
        replicas = states.sum(axis=2)
        spans = np.count_nonzero(states, axis=2)
        jobs = np.arange(states.shape[1])[None, :]
        depth, width = self.speedups.shape[1], self.speedups.shape[2]
        speedup = self.speedups[jobs, np.minimum(spans, depth - 1), np.minimum(replicas, width - 1)] * self.scale
        changed = np.any(states != self.base[None], axis=2)
        speedup = np.where(changed, speedup * self.penalty[None, :], speedup)
        return (np.mean((speedup + 1e-3) ** POWER, axis=1)) ** (1.0 / POWER)

    def crossover(self, states: np.ndarray, fitness: np.ndarray) -> np.ndarray:
        """Binary tournaments pick parent pairs; single-point crossover over jobs."""
        size, jobs = states.shape[0], states.shape[1]
        picks = self.rng.integers(size, size=(2, size, 2))
        parents = np.where(fitness[picks[..., 0]] >= fitness[picks[..., 1]], picks[..., 0], picks[..., 1])
        a, b = states[parents[0]], states[parents[1]]
        point = self.rng.integers(jobs, size=(size, 1, 1))
        first = np.arange(jobs)[None, :, None] < point
        return np.where(first, a, b)

    def mutate(self, states: np.ndarray) -> np.ndarray:
        """The artifact's three mutations: reset to the current allocation, zero, raise."""
        size, jobs, nodes = states.shape
        reset = self.rng.random((size, jobs)) < 0.1
        states = np.where(reset[..., None], self.base[None], states)
        zeroing = np.where(self.rng.random((size, jobs)) < 0.1, 0.1, 0.0)
        states = np.where(self.rng.random(states.shape, dtype=np.float32) < zeroing[..., None], 0, states)
        free = self.capacity[None, :] - states.sum(axis=1)  # (size, nodes)
        fits = np.broadcast_to((free >= 1)[:, None, :], states.shape)
        p1 = fits / np.maximum(fits.sum(axis=1, keepdims=True), 1)
        holds = np.logical_and(states > 0, fits)
        p2 = holds / np.maximum(holds.sum(axis=1, keepdims=True), 1)
        raise_ = self.rng.random(states.shape, dtype=np.float32) < p1 + p2 - p1 * p2
        upper = np.broadcast_to(self.capacity[None, None, :], states.shape)
        raised = states + np.floor(self.rng.random(states.shape, dtype=np.float32) * (upper - states + 1)).astype(np.int64)
        return np.where(raise_, raised, states)

    def repair(self, states: np.ndarray) -> np.ndarray:
        """Legal allocations, as the artifact repairs them. Each rule is applied only to the
        nodes or jobs that break it (on a large cluster nearly none do, and the dense
        population x jobs x nodes arrays cost seconds per pass)."""
        states = states.copy()
        # At most one distributed job per node (the first in job order keeps it).
        distributed = np.count_nonzero(states, axis=2) > 1
        on_node = (states > 0) & distributed[..., None]
        crowded = np.flatnonzero((on_node.sum(axis=1) > 1).any(axis=0))
        if crowded.size:
            sub = states[:, :, crowded]
            sub[np.cumsum(on_node[:, :, crowded], axis=1) > 1] = 0
            states[:, :, crowded] = sub
        # At most `top` devices and MAX_JOB_NODES nodes per job, nodes taken in random order.
        over = (states.sum(axis=2) > self.top[None, :]) | (np.count_nonzero(states, axis=2) > MAX_JOB_NODES)
        members, jobs = np.nonzero(over)
        if members.size:
            rows = states[members, jobs]
            shuffle = np.argsort(self.rng.random(rows.shape, dtype=np.float32), axis=1)
            shuffled = np.take_along_axis(rows, shuffle, axis=1)
            shuffled = np.diff(np.minimum(np.cumsum(shuffled, axis=1), self.top[jobs][:, None]), axis=1, prepend=0)
            shuffled[np.cumsum(shuffled > 0, axis=1) > MAX_JOB_NODES] = 0
            states[members, jobs] = np.take_along_axis(shuffled, np.argsort(shuffle, axis=1), axis=1)
        # Node capacities, granted in job order (least attained service first).
        full = np.flatnonzero((states.sum(axis=1) > self.capacity[None, :]).any(axis=0))
        if full.size:
            sub = states[:, :, full]
            states[:, :, full] = np.diff(np.minimum(np.cumsum(sub, axis=1), self.capacity[None, None, full]), axis=1, prepend=0)
        # A job runs whole or not at all.
        states[states.sum(axis=2) < self.low[None, :]] = 0
        return states
