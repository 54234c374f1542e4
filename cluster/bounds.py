"""Lower bounds on a workload's average job completion time (JCT), for jobs whose batch is fixed.

A goal stated as a multiple of another scheduler's average JCT can be out of every
scheduler's reach; these bounds say where. Two of them, both exact consequences of the
simulator's rules (cluster/simulator.py), never estimates:

- **alone**: a job cannot finish sooner than one start's pause plus its work at its best
  speed (its true step-time curve at its fastest size and placement), as if it had the
  cluster to itself from its arrival.
- **capacity**: the jobs share the cluster's devices. A time-indexed linear program gives
  every job, in every slot of `slot_s` seconds, a fractional number of devices (together
  at most the cluster's) and at most the progress its speed-up curve's concave hull allows
  on them (any schedule's average over a slot is below the hull, by concavity). A job's
  completion time is at least its mean progress time plus half its fastest possible run
  (progress never outpaces the best speed, so the mean lies at least that far before the
  end), and at least its alone bound; the program minimises the sum of the larger of the
  two. Reading each slot's progress at the slot's start keeps the sum a lower bound;
  a shorter slot tightens it.

The program's horizon is certified rather than guessed: from its dual solution, no
progress after the horizon could lower the optimum (the horizon doubles until that holds).
Restarts after the first start, whole devices, node boundaries and decision ticks are
relaxed away: real schedules pay them, so both bounds stay below any schedule's average.

Pure logic (scipy's HiGHS solves the program); no I/O.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from cluster.jobs import Cluster
from cluster.policy import upper_hull
from cluster.workloads import WorkloadJob


@dataclass(frozen=True)
class CapacityBound:
    """The capacity bound of a workload: its average and each job's, in seconds of JCT."""

    avg_jct_s: float
    per_job_s: Mapping[str, float]
    horizon_s: float  # certified: a later horizon gives the same bound
    slot_s: float


def best_rates(job: WorkloadJob, cluster: Cluster) -> list[float]:
    """Steps per second at 0..`max_devices` devices, each on its fastest placement."""
    truth = job.true_model
    rates = [0.0]
    for devices in range(1, job.max_devices + 1):
        nodes = range(cluster.min_nodes(devices), min(devices, len(cluster.nodes)) + 1)
        rates.append(max(1.0 / truth.step_time(devices, k) for k in nodes))
    return rates


def alone_jct(job: WorkloadJob, cluster: Cluster, pause_s: float) -> float:
    """The job's JCT with the cluster to itself: one pause, then its work at its best speed."""
    return pause_s + job.steps(cluster) / max(best_rates(job, cluster))


def capacity_bound(
    cluster: Cluster, jobs: Sequence[WorkloadJob], pause_s: float, slot_s: float = 300.0, horizon_s: float | None = None
) -> CapacityBound:
    """The capacity bound (module docstring) of `jobs` on `cluster`; every batch fixed.
    `horizon_s` is where the search for a certified horizon starts (by default, from the
    jobs' arrivals and their least device-time)."""
    adaptive = [job.id for job in jobs if job.goodput]
    if adaptive:
        raise ValueError(f"the capacity bound covers jobs whose batch is fixed; {adaptive[0]} chooses its batch (goodput)")
    if not jobs:
        raise ValueError("the capacity bound needs at least one job")
    if slot_s <= 0:
        raise ValueError(f"slot_s must be > 0, got {slot_s}")
    curves = [(job.steps(cluster), best_rates(job, cluster)) for job in jobs]  # each job's work and speed by size
    if horizon_s is None:
        least_device_s = sum(steps * min(n / r for n, r in enumerate(rates) if r > 0) for steps, rates in curves)
        horizon_s = max(job.arrival for job in jobs) + least_device_s / cluster.total + pause_s + max(steps / max(rates) for steps, rates in curves)
    while True:
        bound = _solve(cluster, jobs, curves, pause_s, slot_s, horizon_s)
        if bound is not None:
            return bound
        horizon_s *= 2


def _solve(cluster: Cluster, jobs: Sequence[WorkloadJob], curves: Sequence[tuple[float, list[float]]], pause_s: float, slot_s: float,
           horizon_s: float) -> CapacityBound | None:
    """The program at one horizon; None where its duals do not certify the horizon."""
    slots = max(1, math.ceil(horizon_s / slot_s))
    horizon_s = slots * slot_s
    # Columns: per job, its devices k and progress y (a fraction of its work) in each slot
    # from the one it may first run in; then one z per job, its JCT bound.
    objective: list[np.ndarray] = []
    upper: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    rhs: list[np.ndarray] = []
    capacity_cols: list[np.ndarray] = []
    capacity_slots: list[np.ndarray] = []
    progress: list[tuple[np.ndarray, np.ndarray]] = []  # per job: its y columns and their slots' start times
    alone: list[float] = []
    half_run: list[float] = []
    column = row = 0
    for job, (steps, rates) in zip(jobs, curves):
        fastest_s = steps / max(rates)  # its whole run at its best speed
        earliest = job.arrival + pause_s  # its first start pays one pause
        first = min(int(earliest // slot_s), slots - 1)
        slot = np.arange(first, slots)
        start = np.maximum(slot * slot_s, earliest)
        open_s = np.maximum((slot + 1) * slot_s - start, 0.0)  # the part of each slot the job exists in
        n = len(slot)
        k_cols = column + np.arange(n)
        y_cols = column + n + np.arange(n)
        column += 2 * n
        objective += [np.zeros(2 * n)]
        upper += [np.full(n, float(job.max_devices)), np.ones(n)]
        hull = upper_hull(list(enumerate(rates)))
        pieces = [((r1 - r0) / (n1 - n0), r0 - (r1 - r0) / (n1 - n0) * n0) for (n0, r0), (n1, r1) in zip(hull, hull[1:])]
        pieces.append((0.0, max(rates)))
        for slope, intercept in pieces:
            # y <= (slope * k * slot_s + intercept * open_s) / steps: k is the slot's average.
            here = row + np.arange(n)
            rows += [here, here]
            cols += [y_cols, k_cols]
            vals += [np.ones(n), np.full(n, -slope * slot_s / steps)]
            rhs.append(intercept * open_s / steps)
            row += n
        capacity_cols.append(k_cols)
        capacity_slots.append(slot)
        progress.append((y_cols, start))
        alone.append(pause_s + fastest_s)  # alone_jct
        half_run.append(fastest_s / 2)
    z_cols = column + np.arange(len(jobs))
    column += len(jobs)
    objective.append(np.ones(len(jobs)))
    # Every slot's devices fit the cluster.
    rows.append(row + np.concatenate(capacity_slots))
    cols.append(np.concatenate(capacity_cols))
    vals.append(np.ones(sum(len(c) for c in capacity_cols)))
    rhs.append(np.full(slots, float(cluster.total)))
    row += slots
    # z_j >= mean progress time + half its fastest run - arrival.
    for j, (job, (y_cols, start)) in enumerate(zip(jobs, progress)):
        rows += [np.full(len(y_cols) + 1, row + j)]
        cols += [np.append(y_cols, z_cols[j])]
        vals += [np.append(start, -1.0)]
    rhs.append(np.array([job.arrival - h for job, h in zip(jobs, half_run)]))
    z_row0 = row
    row += len(jobs)
    a_ub = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, column))
    # Every job's work is done.
    eq_rows = np.concatenate([np.full(len(y), j) for j, (y, _) in enumerate(progress)])
    a_eq = sp.csr_matrix((np.ones(len(eq_rows)), (eq_rows, np.concatenate([y for y, _ in progress]))), shape=(len(jobs), column))
    bounds = np.column_stack([np.zeros(column), np.full(column, np.inf)])
    bounds[: column - len(jobs), 1] = np.concatenate(upper)
    bounds[column - len(jobs):, 0] = alone  # z_j >= its alone bound
    result = linprog(np.concatenate(objective), A_ub=a_ub, b_ub=np.concatenate(rhs), A_eq=a_eq, b_eq=np.ones(len(jobs)),
                     bounds=bounds, method="highs")
    if result.status == 2:  # infeasible: the work does not fit before the horizon
        return None
    if result.status != 0:
        raise RuntimeError(f"the capacity bound's program failed: {result.message}")
    # Progress in a slot after the horizon (starting at `horizon_s`) would have reduced cost
    # -(lambda_j + w_j * horizon_s) (its devices' columns cost nothing and touch no binding
    # row); if none is negative, no longer horizon lowers the optimum.
    done = result.eqlin.marginals
    later = result.ineqlin.marginals[z_row0: z_row0 + len(jobs)]
    if np.any(-(done + later * horizon_s) < -1e-7 * max(1.0, horizon_s)):
        return None
    z = result.x[z_cols]
    return CapacityBound(float(statistics.fmean(z)), {job.id: float(v) for job, v in zip(jobs, z)}, horizon_s, slot_s)
