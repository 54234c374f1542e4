"""How well and how fast cluster/packing.py packs, against the optimum and on a real trace.

    .venv/bin/python bench/packing_bench.py       # both parts, about a minute
    .venv/bin/python bench/packing_bench.py --part trace \
        --pod-lists default gpushare100 multigpu50 --until 130

Part "optimum": random small instances solved exactly with OR-Tools CP-SAT (max placed
demand = devices x memory, same rules as pack: memory fits per device, gangs whole and on one
node); prints packed / optimal demand per policy, for the given (random) order and for
largest-first order.

Part "trace": the Alibaba GPU-sharing trace (see bench/alibaba_trace.py) arrives task by
task onto its 1,213 nodes; prints per policy the fragmentation (the ATC'23 measure: expected
free GPU capacity that the trace's GPU tasks cannot use, with each task kind weighted by its
share of the pod list) and the free capacity, both in % of all GPU capacity, at milestones
of arrived GPU demand (in % of capacity), the tasks that could not be placed, and the time
to place one task and the whole sequence. CPU and host memory are not modelled (the packer
places devices only), unlike the paper's simulator.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from ortools.sat.python import cp_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find bench/ and cluster/

from bench.alibaba_trace import CITATION, POD_LISTS, load_nodes, load_pods  # noqa: E402
from cluster.packing import POLICIES, Packer, pack, workload_of  # noqa: E402
from cluster.types import Device, Inventory, Link, Request  # noqa: E402

MIB = 2**20
MODELS_MIB = (16 * 1024, 24 * 1024, 40 * 1024, 80 * 1024)  # per-node GPU memory, mixed


# -- part 1: against the exact optimum -------------------------------------------------


def random_instance(rng: np.random.Generator) -> tuple[Inventory, list[Request]]:
    """2-4 nodes of 2-8 GPUs (one model per node, NVLink pairs on some), 8-20 requests."""
    devices, links = [], {}
    for n in range(int(rng.integers(2, 5))):
        mem = int(rng.choice(MODELS_MIB)) * MIB
        ids = [f"n{n}/gpu{i}" for i in range(int(rng.integers(2, 9)))]
        devices += [Device(d, f"n{n}", i, "gpu", "sim", mem) for i, d in enumerate(ids)]
        if rng.random() < 0.5:  # NVLink pairs (0,1), (2,3)...; other pairs cross sockets
            for i in range(len(ids)):
                for j in range(i + 1, len(ids)):
                    link = Link.NVLINK if i // 2 == j // 2 else Link.CROSS_SOCKET
                    links[frozenset((ids[i], ids[j]))] = link
    inventory = Inventory(tuple(devices), links)
    largest_node = max(sum(d.node == n for d in devices) for n in inventory.nodes)
    capacity = sum(d.memory_bytes for d in devices)
    requests, demand = [], 0
    # Enough requests that they rarely all fit: about 1.3x the capacity, 8 to 20 of them.
    while len(requests) < 8 or (demand < 1.3 * capacity and len(requests) < 20):
        kind = rng.random()
        if kind < 0.55:  # one shared device: a fraction of some model's memory
            count, mem_mib = 1, int(rng.choice(MODELS_MIB) * rng.uniform(0.1, 0.9))
        elif kind < 0.75:  # one whole device of some model
            count, mem_mib = 1, int(rng.choice(MODELS_MIB))
        else:  # a gang, shared or whole devices
            count = int(rng.integers(2, min(4, largest_node) + 1))
            whole = rng.random() < 0.5
            mem_mib = int(rng.choice(MODELS_MIB) * (1 if whole else rng.uniform(0.1, 0.9)))
        requests.append(Request(f"t{len(requests)}", count, mem_mib * MIB))
        demand += count * mem_mib * MIB
    return inventory, requests


def optimum(inventory: Inventory, requests: list[Request], time_limit: float) -> tuple[int, bool]:
    """Most demand (devices x MiB) placeable at once, and whether CP-SAT proved it optimal."""
    model = cp_model.CpModel()
    placed = []
    on_device: dict[str, list] = {d.id: [] for d in inventory.devices}
    for r in requests:
        on_nodes = []
        for node in inventory.nodes:
            fit = [d for d in inventory.devices
                   if d.node == node and d.memory_bytes >= r.memory_bytes]
            if len(fit) < r.devices:
                continue
            here = model.new_bool_var("")
            picks = [model.new_bool_var("") for _ in fit]
            model.add(sum(picks) == r.devices * here)
            for d, y in zip(fit, picks):
                on_device[d.id].append((r.memory_bytes // MIB, y))
            on_nodes.append(here)
        x = model.new_bool_var("")
        model.add(sum(on_nodes) == x)
        placed.append((r.devices * (r.memory_bytes // MIB), x))
    for d in inventory.devices:
        if on_device[d.id]:
            model.add(sum(m * y for m, y in on_device[d.id]) <= d.memory_bytes // MIB)
    model.maximize(sum(w * x for w, x in placed))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 2
    status = solver.solve(model)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), solver.status_name(status)
    return round(solver.objective_value), status == cp_model.OPTIMAL


def demand_mib(placements, requests) -> int:
    """Devices x MiB of the requests that `placements` placed."""
    by_id = {r.trial_id: r for r in requests}
    return sum(by_id[p.trial_id].devices * (p.memory_bytes // MIB) for p in placements)


def run_optimum(instances: int, seed: int, time_limit: float) -> None:
    rng = np.random.default_rng(seed)
    orders = ("given", "largest-first")
    ratios: dict[tuple[str, str], list[float]] = {(p, o): [] for p in POLICIES for o in orders}
    proved = all_fit = 0
    solve_s = []
    for _ in range(instances):
        inventory, requests = random_instance(rng)
        t0 = time.perf_counter()
        best, exact = optimum(inventory, requests, time_limit)
        solve_s.append(time.perf_counter() - t0)
        proved += exact
        all_fit += best == sum(r.devices * (r.memory_bytes // MIB) for r in requests)
        largest = sorted(requests, key=lambda r: -r.devices * r.memory_bytes)
        for policy in POLICIES:
            for order, reqs in zip(orders, (requests, largest)):
                got = demand_mib(pack(reqs, inventory, policy=policy), requests)
                ratios[policy, order].append(got / best if best else 1.0)
    print(f"== packed demand / CP-SAT optimum: {instances} random instances (seed {seed}); "
          f"2-4 nodes x 2-8 GPUs of 16/24/40/80 GiB, 8-20 requests up to ~1.3x capacity "
          f"(55% one shared GPU, 20% one whole GPU, 25% gangs of 2-4); gangs on one node in both")
    print(f"   optimum proved for {proved}/{instances} (limit {time_limit:g} s each, "
          f"median solve {statistics.median(solve_s):.3f} s); every request fits in {all_fit}")
    print(f"   {'policy':<11} {'order':<14} {'median':>7} {'mean':>7} {'worst':>7} {'=opt':>6}")
    for (policy, order), r in ratios.items():
        at_opt = sum(x >= 1 - 1e-9 for x in r)
        print(f"   {policy:<11} {order:<14} {statistics.median(r):7.3f} {statistics.fmean(r):7.3f} "
              f"{min(r):7.3f} {at_opt:>3}/{len(r)}")


# -- part 2: the Alibaba trace ---------------------------------------------------------


@dataclass
class TraceRun:
    policy: str
    rows: list[tuple[str, float, float, int]]  # milestone, frag %, free %, failed so far
    failed: int
    place_ms: np.ndarray  # wall clock per place() call
    cpu_ms: np.ndarray  # this thread's CPU time per call: steadier on a shared machine
    build_s: float


def arrivals(pods, capacity: int, until_pct: float, seed: int) -> list[Request]:
    """The pod list in order, then (if `until_pct`) tasks drawn from it until arrived demand
    reaches `until_pct` % of capacity, as the paper inflates a workload past saturation.

    A list without creation times (multigpu50: the default list with its multi-GPU tasks
    appended) is shuffled, or all the big tasks would arrive last into a full cluster.
    """
    rng = np.random.default_rng(seed)
    seq = list(pods.requests)
    if not pods.timed:
        seq = [seq[i] for i in rng.permutation(len(seq))]
    demand = sum(r.devices * r.memory_bytes for r in seq)
    while demand < until_pct / 100 * capacity:
        r = pods.requests[int(rng.integers(len(pods.requests)))]
        seq.append(Request(f"{r.trial_id}+{len(seq)}", r.devices, r.memory_bytes))
        demand += r.devices * r.memory_bytes
    return seq


def replay(inventory, seq, workload, policy: str, marks: list[float]) -> TraceRun:
    t0 = time.perf_counter()
    packer = Packer(inventory, policy=policy, workload=workload)
    build = time.perf_counter() - t0
    cap = packer.capacity_bytes
    rows, failed, arrived = [], 0, 0
    times, cpu = np.empty(len(seq)), np.empty(len(seq))
    pending = list(marks)

    def row(label: str) -> None:
        rows.append((label, 100 * packer.fragmentation() / cap,
                     100 * packer.free_total_bytes / cap, failed))

    for i, req in enumerate(seq):
        t, c = time.perf_counter(), time.thread_time()
        placed = packer.place(req)
        times[i], cpu[i] = time.perf_counter() - t, time.thread_time() - c
        failed += placed is None
        arrived += req.devices * req.memory_bytes
        while pending and arrived >= pending[0] / 100 * cap:
            row(f"{pending.pop(0):g}%")
    row(f"end {100 * arrived / cap:.0f}%")
    return TraceRun(policy, rows, failed, times * 1e3, cpu * 1e3, build)


def run_trace(pod_lists: list[str], until_pct: float, seed: int) -> None:
    inventory = load_nodes()
    marks = [m for m in (50, 70, 90, 100, 110, 120, 130) if m <= max(until_pct, 100)]
    print(f"\n{CITATION}")
    for name in pod_lists:
        pods = load_pods(name)
        capacity = sum(d.memory_bytes for d in inventory.devices)
        seq = arrivals(pods, capacity, until_pct, seed)
        workload = workload_of(pods.requests)
        print(f"\n== trace {name}: {len(inventory.nodes)} nodes, {len(inventory.devices)} GPUs "
              f"(1 GPU = 1000 units); {len(pods.requests)} GPU tasks "
              + ("in arrival order" if pods.timed else f"shuffled (no creation_time; seed {seed})")
              + (f" + {len(seq) - len(pods.requests)} drawn from them (seed {seed})"
                 if len(seq) > len(pods.requests) else "")
              + f"; {pods.cpu_only} tasks with num_gpu=0 skipped")
        runs = [replay(inventory, seq, workload, p, marks) for p in POLICIES]
        print("   arrived = GPU demand arrived so far, % of capacity; frag / free = % of capacity;"
              " fail = tasks not placed so far")
        print("   " + f"{'arrived':<10}" + "".join(f"{r.policy:>24}" for r in runs))
        print("   " + " " * 10 + "".join(f"{'frag  free  fail':>24}" for _ in runs))
        for i, (label, *_) in enumerate(runs[0].rows):
            cells = "".join(f"{r.rows[i][1]:>10.2f}{r.rows[i][2]:>6.2f}{r.rows[i][3]:>6d}"
                            + " " * 2 for r in runs)
            print(f"   {label:<10}{cells}")
        print(f"   time to place one task (ms; wall, and CPU of this thread) and the whole "
              f"sequence (s), {len(seq)} tasks on {len(inventory.devices)} GPUs:")
        for r in runs:
            ms, cpu = r.place_ms, r.cpu_ms
            print(f"   {r.policy:<11} wall median {np.median(ms):6.3f} p99 "
                  f"{np.percentile(ms, 99):6.3f} max {ms.max():6.2f} | CPU median "
                  f"{np.median(cpu):6.3f} p99 {np.percentile(cpu, 99):6.3f} | total "
                  f"{ms.sum() / 1e3:5.2f} s wall (set-up {r.build_s:.3f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "optimum", "trace"), default="all")
    ap.add_argument("--instances", type=int, default=100, help="random instances for CP-SAT")
    ap.add_argument("--time-limit", type=float, default=3.0, help="CP-SAT seconds per instance")
    ap.add_argument("--pod-lists", nargs="+", choices=POD_LISTS, default=["default"])
    ap.add_argument("--until", type=float, default=0.0,
                    help="keep drawing tasks from the pod list until arrived GPU demand is this "
                         "%% of capacity (0: the pod list only)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.part in ("all", "optimum"):
        run_optimum(args.instances, args.seed, args.time_limit)
    if args.part in ("all", "trace"):
        run_trace(args.pod_lists, args.until, args.seed)


if __name__ == "__main__":
    main()
