"""Our elastic policy against Pollux, Tiresias, LAS and FIFO, on Philly-derived workloads.

Each workload is sampled from the Philly trace (Microsoft, 2017, as distributed with the
Pollux OSDI'21 artifact; shipped in data/traces/): jobs submitted in a daily 8-hour window,
arriving at their time of day, on a cluster of 16 nodes x 4 GPUs; more jobs in the window
is a higher load (six workloads at 160, 320, 480 jobs, two with twice the heaviest load).
An elastic job may run on 1 to `--growth` times its request (4 by default).

- ours, reproducible: our policy, every job's batch fixed (results schedule-independent),
  lengths known;
- ours, goodput: our policy, every job `scaling: goodput` (its batch chosen for goodput);
  like a campaign's trials, each job tells the policy how many steps it has left (its
  declared steps less those done), and the policy runs shortest remaining work first;
- ours, goodput, lengths unknown: the same, told nothing of lengths (least attained service,
  what a cluster scheduler that runs opaque jobs knows, as Pollux does);
- pollux: cluster/pollux.py on the same goodput jobs (batch chosen for goodput);
- tiresias (the Pollux artifact's), las (5 queues), fifo: fixed batch, requested size.

A goodput job's gradient noise scale grows through training from the start to the end
values of the workload that stands for its size class, by `--noise` model: "published"
(the default), the gradient statistics the Pollux artifact measured training the real models
it maps the trace's size classes to (cluster/noise_scales_published.json, each row naming its
source); "measured", what the trainer measured on the project's tiny example workloads
(cluster/noise_scales.json, written by bench/noise_scale.py), whose noise scale barely grows
past their batch, so a fixed batch costs little. `--noise measured,published` replays both
and prints, per workload, the price of a fixed batch under each. Every policy replays the same
workloads in the discrete-event simulator (simulated clock; only the policy's own decision
time is wall-clock). Then the decision time alone is measured at 4,096 GPUs (1,024 nodes x
4) with 2,000 active jobs.

    .venv/bin/python bench/scheduler_bench.py                       # the eight workloads (long: Pollux's search)
    .venv/bin/python bench/scheduler_bench.py --jobs 160 --seeds 1 --heavy 0   # one workload, a few minutes
    .venv/bin/python bench/scheduler_bench.py --heavy 0 --pollux-cache /tmp/pollux   # Pollux replayed once, reused after
    .venv/bin/python bench/scheduler_bench.py --heavy 0 --noise measured,published   # both efficiency models side by side

Each workload's floor is the average JCT if every goodput job had the cluster to itself from
its arrival (its true curves, best size and batch); the goal table states ours against it:
the gap closed, (Pollux - ours) / (Pollux - floor), beside p99, makespan and restarts. Its
fixed-batch floor is the same with every job's batch fixed, as in reproducible mode (each
job alone at its best size): the reproducible table states it against Pollux's average, so
a workload whose fixed-batch floor is above 1.05x Pollux's is one where no scheduler meets
the reproducible goal. `--capacity-bound SLOT_S` adds reproducible mode's capacity bound
(cluster/bounds.py: the jobs also share the cluster's devices, a linear program over slots of
SLOT_S seconds; about 15 s for 160 jobs at 300 s, 2 min and 5 GB for 480): a tighter floor,
so the goal is out of reach wherever it is above 1.05x as well. `--by-length` breaks both
modes down against Pollux, each tenth beside its jobs' floor.

Prints tables; never passes or fails on the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cluster.bounds import capacity_bound  # noqa: E402
from cluster.jobs import Cluster, Job  # noqa: E402
from cluster.policy import ElasticPolicy, FifoPolicy, LasPolicy, Policy, TiresiasPolicy  # noqa: E402
from cluster.pollux import PolluxPolicy  # noqa: E402
from cluster.simulator import SimConfig, SimResult, simulate  # noqa: E402
from cluster.throughput import OnlineStepTime, prior_from_size  # noqa: E402
from cluster.workloads import NOISE_SCALES, WorkloadJob, read_philly, sample_philly, synthetic  # noqa: E402

TRACE = REPO / "data" / "traces" / "philly_jobs.csv.gz"  # the Philly trace, shipped with the repository


OURS = "ours, reproducible"
GOODPUT = "ours, goodput"
UNKNOWN = "ours, goodput, lengths unknown"  # least attained service: what a cluster scheduler knows
POLLUX = "pollux"
FIXED = (OURS, "tiresias (Pollux artifact's)", "las (5 queues)", "fifo")  # fixed batch: the same under every noise model
# `--sweep`: our policy's knobs, each moved alone, in goodput mode against the same Pollux runs.
SWEEP = {
    "las power 0": {"las_power": 0.0}, "las power 0.5": {"las_power": 0.5}, "las power 2": {"las_power": 2.0},
    "las scale 600 s": {"las_scale_s": 600.0}, "las scale 7200 s": {"las_scale_s": 7200.0},
    "las cap 4 h": {"las_cap_s": 4 * 3600.0}, "no las cap": {"las_cap_s": 1e9}, "min gain 0": {"min_gain": 0.0},
    "starvation 1 h": {"starvation_s": 3600.0}, "min run 1800 s": {"min_run_s": 1800.0},
    "min run 5400 s": {"min_run_s": 5400.0}, "min run 7200 s": {"min_run_s": 7200.0}, "grow after 1800 s": {"grow_after_s": 1800.0},
    "min run + grow after 600 s": {"min_run_s": 600.0, "grow_after_s": 600.0}, "preemption budget 6": {"preemption_budget": 6},
    "no yield to shorter": {"yield_ratio": 0.0}, "yield ratio 0.3": {"yield_ratio": 0.3}, "yield min 600 s": {"yield_min_s": 600.0}, "yield min 1200 s": {"yield_min_s": 1200.0},
    "no rank weights (1 / remaining)": {"rank_q": 0.0}, "rank q 3": {"rank_q": 3.0}, "rank q 8": {"rank_q": 8.0},
    "no rank ties": {"rank_tie": 1.0}, "hysteresis 0.5": {"hysteresis": 0.5},
    "arrival window 2 h": {"arrival_window_s": 7200.0}, "arrival window 2 h, grow after 4 h": {"arrival_window_s": 7200.0, "grow_after_s": 14400.0},
    "arrival window 2 h, no repacking": {"arrival_window_s": 7200.0, "repack": False},
    "arrival window 2 h, grow after 4 h, no repacking": {"arrival_window_s": 7200.0, "grow_after_s": 14400.0, "repack": False},
    "critical boost 2": {"critical_boost": 2.0}, "critical boost 4": {"critical_boost": 4.0},
    "no min efficiency": {"min_efficiency": 0.0}, "min efficiency 0.35": {"min_efficiency": 0.35}, "min efficiency 0.6": {"min_efficiency": 0.6},
}
POLLUX_BUDGET_S = 0.6  # at 4,096 GPUs its search stops in time for a decision within 1 s (replays run all its generations)


def main() -> None:
    args = _parse()
    console = Console(width=200)
    console.print(f"[bold]command:[/bold] {' '.join(sys.argv)}")
    console.print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}")
    cluster = Cluster.uniform(args.nodes, args.per_node)
    trace = read_philly(args.trace)
    config = SimConfig(pause_s=args.pause, tick_s=args.tick)
    loads = [(jobs, seed) for jobs in args.jobs for seed in args.seeds]
    loads += [(2 * max(args.jobs), seed) for seed in args.seeds[: args.heavy]]
    goals: dict[str, list] = {model: [] for model in args.noise}
    prices = []
    for jobs, seed in loads:
        workload = sample_philly(trace, cluster, jobs, seed=seed, growth=args.growth)
        gpu_hours = sum(j.duration * j.requested for j in workload) / 3600
        fixed: dict[str, tuple[SimResult, float]] = {}  # fixed-batch runs read no noise scale: replayed once for every model
        price = [f"{jobs} jobs, seed {seed}"]
        fixed_alone = alone_times(cluster, workload, config, seed)  # reproducible mode's floor, per job
        fixed_bound = statistics.mean(fixed_alone.values())
        capacity = capacity_bound(cluster, workload, args.pause, args.capacity_bound).avg_jct_s if args.capacity_bound else None
        for model in args.noise:
            adaptive = [replace(j, goodput=True, noise_model=model) for j in workload]
            runs: list[tuple[str, Policy, list]] = [
                (OURS, ElasticPolicy(pause_s=args.pause), workload),
                (GOODPUT, ElasticPolicy(pause_s=args.pause), adaptive),
                (UNKNOWN, ElasticPolicy(pause_s=args.pause, know_remaining=False), adaptive),
                (POLLUX, PolluxPolicy(generations=args.pollux_generations, seed=seed), adaptive),
                ("tiresias (Pollux artifact's)", TiresiasPolicy(), workload),
                ("las (5 queues)", LasPolicy(), workload),
                ("fifo", FifoPolicy(), workload),
            ]
            if args.sweep:
                runs += [(f"ours, goodput, {name}", ElasticPolicy(pause_s=args.pause, **knobs), adaptive) for name, knobs in SWEEP.items()]
            results = {}
            for name, policy, jobs_of in runs:
                if name in fixed:
                    results[name] = fixed[name]
                    continue
                started = time.perf_counter()
                cached = _pollux_cache(args, jobs, seed, adaptive) if name == POLLUX and args.pollux_cache else None
                if cached is not None and cached.exists():
                    results[name] = pickle.loads(cached.read_bytes())
                    continue
                # Jobs tell every policy their steps left; only ours reads them (UNKNOWN is told not to).
                # Ours may be replayed at another seed of the step times' noise, beside the same Pollux run.
                ours_seed = seed + args.ours_seed_offset if isinstance(policy, ElasticPolicy) else seed
                results[name] = (simulate(cluster, jobs_of, policy, config, seed=ours_seed), time.perf_counter() - started)
                if name in FIXED:
                    fixed[name] = results[name]
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    cached.write_bytes(pickle.dumps(results[name]))
            goodput_alone = alone_times(cluster, adaptive, config, seed)
            bound = statistics.mean(goodput_alone.values())
            title = (f"Philly sample: {jobs} jobs in 8 h (seed {seed}), {gpu_hours:,.0f} GPU-hours of work, "
                     f"{cluster.total} GPUs ({args.nodes} x {args.per_node}), growth {args.growth}x, noise scales {model}; "
                     f"each job alone on the cluster: avg JCT {bound / 3600:.2f} h (goodput), {fixed_bound / 3600:.2f} h (batch fixed)")
            pollux = results[POLLUX][0].summary()
            console.print(_workload_table(title, results, pollux))
            if args.by_length:
                console.print(_length_table(results[GOODPUT][0], results[POLLUX][0], goodput_alone, GOODPUT))
                console.print(_length_table(results[OURS][0], results[POLLUX][0], fixed_alone, OURS))
            ours, goodput, unknown = results[OURS][0].summary(), results[GOODPUT][0].summary(), results[UNKNOWN][0].summary()
            goals[model].append((f"{jobs} jobs, seed {seed}", goodput, ours, pollux, bound, unknown, fixed_bound, capacity))
            price += [f"{ours['avg_jct_s'] / goodput['avg_jct_s']:.3f}", f"{ours['avg_jct_s'] / pollux['avg_jct_s']:.3f}"]
        prices.append(price)
    for model in args.noise:
        console.print(_goal_table(goals[model], model))
        console.print(_reproducible_table(goals[model], model))
    console.print(_price_table(args.noise, prices))
    console.print(_scale_table(args))


def alone_bound(cluster: Cluster, jobs: Sequence[WorkloadJob], config: SimConfig, seed: int) -> float:
    """The average JCT if every job had the cluster to itself from its arrival (the true
    step-time curves known, at its best size within its max and, a goodput job, its best
    batch; a job whose batch is fixed keeps it): no scheduler sharing the cluster does
    better, so a goal below it cannot be reached."""
    return statistics.mean(alone_times(cluster, jobs, config, seed).values())


def alone_times(cluster: Cluster, jobs: Sequence[WorkloadJob], config: SimConfig, seed: int) -> dict[str, float]:
    """Each job's JCT with the cluster to itself from its arrival (see `alone_bound`)."""
    oracle = replace(config, oracle=True)
    # Alone, no other job wants the devices: it takes every one that speeds it up, however
    # little (the policy's fill efficiencies keep a job off them when shared).
    alone = ElasticPolicy(pause_s=config.pause_s, fixed_fill_efficiency=0.0, goodput_fill_efficiency=0.0)
    return {job.id: simulate(cluster, [replace(job, arrival=0.0)], alone, oracle, seed=seed).jobs[0].completion_time for job in jobs}


# What a Pollux replay depends on besides the bench's settings and its jobs: a change to any
# of these makes `--pollux-cache` replay Pollux again (our policy's code is not among them).
# What cluster/workloads.py and the noise scale files give a replay is in the jobs themselves
# (their sizes, true curves and noise scales), which the digest takes instead of the files:
# an edit there that leaves the jobs as they were keeps the replays.
POLLUX_SOURCES = ("cluster/pollux.py", "cluster/jobs.py", "cluster/simulator.py", "cluster/goodput.py", "cluster/throughput.py",
                  "cluster/types.py")


def _pollux_cache(args: argparse.Namespace, jobs: int, seed: int, workload: list[WorkloadJob]) -> Path:
    """Where `--pollux-cache` keeps this workload's Pollux replay: named by the workload and
    a digest of every setting, job and source file the replay depends on (and the trace)."""
    digest = hashlib.sha256(repr((jobs, seed, args.growth, args.nodes, args.per_node, args.pause, args.tick,
                                  args.pollux_generations, platform.python_version())).encode())
    digest.update(repr([(j.id, j.arrival, j.duration, j.requested, j.min_devices, j.max_devices, j.true_model, j.noise)
                        for j in workload]).encode())
    for path in (*(REPO / name for name in POLLUX_SOURCES), args.trace):
        digest.update(path.read_bytes())
    return args.pollux_cache / f"pollux-{jobs}s{seed}-{digest.hexdigest()[:16]}.pkl"


def gap_closed(ours: float, pollux: float, floor: float) -> float:
    """The share of Pollux's distance to the floor that ours closes: (Pollux - ours) /
    (Pollux - floor); 1 is the floor itself, 0 Pollux, negative behind Pollux."""
    return (pollux - ours) / (pollux - floor) if pollux > floor else 0.0


def _goal_table(goals: list[tuple[str, dict, dict, dict, float, dict, float, float | None]], model: str) -> Table:
    """Issue 62's goals, per workload: ours against Pollux and the floor (every job alone on
    the cluster at its best size and batch), with the average gap closed over the workloads."""
    table = Table(title=f"Ours against Pollux and the floor, noise scales {model}. Goals: goodput gap to the floor closed >= 35 % on average "
                        "and >= 10 % on each; p99 <= Pollux's; restarts/job <= Pollux's; reproducible avg JCT <= 1.05x Pollux's")
    for column in ("workload", "avg JCT h goodput / pollux / floor", "gap closed", "goodput p99 h / pollux", "makespan h / pollux",
                   "restarts/job goodput / pollux", "reproducible avg", "repro gap closed", "lengths unknown avg",
                   "idle share goodput / repro / pollux", "goals met"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    closed = []
    for name, goodput, ours, pollux, bound, unknown, *_ in goals:
        gap = gap_closed(goodput["avg_jct_s"], pollux["avg_jct_s"], bound)
        closed.append(gap)
        repro = ours["avg_jct_s"] / pollux["avg_jct_s"]
        met = {"gap": gap >= 0.10, "p99": goodput["p99_jct_s"] <= pollux["p99_jct_s"],
               "restarts": goodput["restarts_per_job"] <= pollux["restarts_per_job"], "repro": repro <= 1.05}
        table.add_row(name, f"{goodput['avg_jct_s'] / 3600:.3f} / {pollux['avg_jct_s'] / 3600:.3f} / {bound / 3600:.3f}", f"{gap:+.1%}",
                      f"{goodput['p99_jct_s'] / 3600:.1f} / {pollux['p99_jct_s'] / 3600:.1f} ({goodput['p99_jct_s'] / pollux['p99_jct_s']:.3f})",
                      f"{goodput['makespan_s'] / 3600:.1f} / {pollux['makespan_s'] / 3600:.1f}",
                      f"{goodput['restarts_per_job']:.2f} / {pollux['restarts_per_job']:.2f}",
                      f"{repro:.3f}", f"{gap_closed(ours['avg_jct_s'], pollux['avg_jct_s'], bound):+.1%}",
                      f"{unknown['avg_jct_s'] / pollux['avg_jct_s']:.3f}",
                      f"{goodput['idle_share']:.3f} / {ours['idle_share']:.3f} / {pollux['idle_share']:.3f}",
                      ", ".join(n for n, ok in met.items() if ok) or "none")
    if closed:
        mean = statistics.mean(closed)
        table.add_row("mean", "", f"{mean:+.1%}", "", "", "", "", "", "", "", "gap" if mean >= 0.35 else "none")
    return table


REPRODUCIBLE_GOAL = 1.05  # issue 62: reproducible mode's average JCT at most this many times Pollux's


def _reproducible_table(goals: list[tuple[str, dict, dict, dict, float, dict, float, float | None]], model: str) -> Table:
    """Reproducible mode against its own floor: every job alone at its best size with its
    batch fixed, and (where computed) its capacity bound. Where either is above the goal's
    multiple of Pollux's average, no scheduler meets the goal: Pollux's jobs choose their
    batch, these cannot."""
    table = Table(title=f"Reproducible mode (every batch fixed) against its floor (each job alone at its best size, its batch fixed), "
                        f"noise scales {model}: average JCT over Pollux's; the goal, <= {REPRODUCIBLE_GOAL}, is out of any "
                        "scheduler's reach where the floor or the capacity bound (the jobs share the devices) is above it")
    for column in ("workload", "reproducible avg JCT h / fixed-batch floor", "reproducible / pollux", "fixed-batch floor / pollux",
                   "capacity bound / pollux", "goodput floor / pollux", "reproducible / fixed-batch floor", "goal reachable"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, _, ours, pollux, bound, _, fixed_bound, capacity in goals:
        floor = fixed_bound / pollux["avg_jct_s"]
        shared = capacity / pollux["avg_jct_s"] if capacity is not None else None
        table.add_row(name, f"{ours['avg_jct_s'] / 3600:.3f} / {fixed_bound / 3600:.3f}", f"{ours['avg_jct_s'] / pollux['avg_jct_s']:.3f}",
                      f"{floor:.3f}", "-" if shared is None else f"{shared:.3f}", f"{bound / pollux['avg_jct_s']:.3f}",
                      f"{ours['avg_jct_s'] / fixed_bound:.3f}", "yes" if max(floor, shared or 0.0) <= REPRODUCIBLE_GOAL else "no")
    return table


def _price_table(models: list[str], prices: list[list[str]]) -> Table:
    """The price of a fixed batch under each noise model: our reproducible mode's average JCT
    over our goodput mode's, and over Pollux's (whose jobs choose their batch)."""
    table = Table(title="The price of a fixed batch: average JCT of ours, reproducible (every batch fixed) over ours, "
                        "goodput, and over Pollux, by noise model")
    table.add_column("workload", justify="left")
    for model in models:
        table.add_column(f"{model}: repro / goodput", justify="right")
        table.add_column(f"{model}: repro / pollux", justify="right")
    for row in prices:
        table.add_row(*row)
    return table


def _workload_table(title: str, results: dict[str, tuple[SimResult, float]], pollux: dict) -> Table:
    table = Table(title=title)
    for column in ("policy", "avg JCT h", "vs Pollux", "median h", "p99 h", "makespan h", "util.", "restarts/job", "max",
                   "idle share", "decide ms mean/p99", "sim s"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, (result, wall) in results.items():
        s = result.summary()
        table.add_row(
            name,
            f"{s['avg_jct_s'] / 3600:.2f}",
            f"{s['avg_jct_s'] / pollux['avg_jct_s']:.3f}",
            f"{s['median_jct_s'] / 3600:.2f}",
            f"{s['p99_jct_s'] / 3600:.1f}",
            f"{s['makespan_s'] / 3600:.1f}",
            f"{s['utilization']:.2f}",
            f"{s['restarts_per_job']:.2f}",
            f"{s['max_restarts']:.0f}",
            f"{s['idle_share']:.3f}",
            f"{s['decision_mean_ms']:.2f}/{s['decision_p99_ms']:.1f}",
            f"{wall:.1f}",
        )
    return table


def _length_table(ours: SimResult, pollux: SimResult, alone: Mapping[str, float], name: str = GOODPUT) -> Table:
    """Where ours (`name`: goodput or reproducible) gains and loses against Pollux: the jobs
    in tenths by their JCT under Pollux, each tenth's summed JCT, the same jobs' floor (each
    alone at its best size, `alone`: in ours' mode, goodput or batch fixed), wait to start,
    device-hours and restarts, and its share of the difference in the workload's total JCT."""
    mine = {j.id: j for j in ours.jobs}
    theirs = sorted(pollux.jobs, key=lambda j: j.completion_time)
    total = sum(j.completion_time for j in theirs)
    table = Table(title=f"By length: the jobs in tenths by their JCT under Pollux, {name} / Pollux; floor: the same jobs each alone "
                        "at its best size in that mode; share: the tenth's part of the difference in total JCT (negative: ours shorter)")
    for column in ("tenth", "JCT h", "floor h", "share", "waiting h", "device-h", "avg devices", "restarts"):
        table.add_column(column, justify="right")
    n = len(theirs)
    for tenth in range(10):
        part = theirs[tenth * n // 10:(tenth + 1) * n // 10]
        pairs = [(mine[j.id], j) for j in part]

        def both(value) -> tuple[float, float]:
            return sum(value(o) for o, _ in pairs), sum(value(p) for _, p in pairs)

        jct, wait = both(lambda j: j.completion_time), both(lambda j: j.start - j.arrival)
        device_s, run_s, restarts = both(lambda j: j.device_seconds), both(lambda j: j.finish - j.start), both(lambda j: j.restarts)
        table.add_row(f"{tenth + 1}", f"{jct[0] / 3600:.1f} / {jct[1] / 3600:.1f}", f"{sum(alone[j.id] for j in part) / 3600:.1f}",
                      f"{(jct[0] - jct[1]) / total:+.3f}",
                      f"{wait[0] / 3600:.1f} / {wait[1] / 3600:.1f}", f"{device_s[0] / 3600:.0f} / {device_s[1] / 3600:.0f}",
                      f"{device_s[0] / max(run_s[0], 1):.1f} / {device_s[1] / max(run_s[1], 1):.1f}",
                      f"{restarts[0]:.0f} / {restarts[1]:.0f}")
    return table


def _scale_table(args: argparse.Namespace) -> Table:
    """Decision time with `big_jobs` active jobs on `big_nodes` x per_node devices."""
    cluster = Cluster.uniform(args.big_nodes, args.per_node)
    workload = synthetic(cluster, args.big_jobs, seed=11, mean_interarrival_s=5.0)
    rng = random.Random(11)
    now = max(j.arrival for j in workload) + 1.0
    waiting = []
    for spec in workload:
        model = OnlineStepTime(prior_from_size(spec.requested, args.per_node), spec.max_devices, args.per_node)
        nodes = cluster.min_nodes(spec.requested)
        model.observe(spec.requested, nodes, spec.true_model.step_time(spec.requested, nodes))
        model.step_time(1, 1)  # fitted, as after the job's first report
        attained = rng.expovariate(1 / 3600.0) if rng.random() < 0.7 else 0.0
        waiting.append(Job(spec.id, spec.arrival, spec.requested, spec.min_devices, spec.max_devices, model, attained,
                           explored_devices=spec.requested if attained else 0, remaining_steps=rng.expovariate(1 / 5000.0)))
    table = Table(title=f"Decision time: {args.big_jobs} active jobs on {cluster.total} GPUs ({args.big_nodes} x {args.per_node}). "
                        "Goal: <= 1 s for every policy")
    for column in ("policy", "all waiting, ms", "steady state, ms", "jobs placed", "GPUs used"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, make in (("fifo", FifoPolicy), ("tiresias", TiresiasPolicy), ("las (5 queues)", LasPolicy), ("ours", ElasticPolicy),
                       (POLLUX, lambda: PolluxPolicy(generations=args.pollux_generations, budget_s=POLLUX_BUDGET_S))):
        # One untimed decision by another instance first: the first touch of fresh memory is
        # what a fresh process pays once (on some hosts 30x a warm one: 0.36 s against 0.012 s
        # for 65 MB), not what each decision of a running scheduler costs.
        make().decide(cluster, waiting, now)
        policy = make()
        cold, first = _time(policy, cluster, waiting, now, args.repeats)
        # The next periodic decision: the same jobs, placed as decided, a little older.
        placed = [
            replace(j, attained=j.attained + 60.0 * sum(first.get(j.id, {}).values()), placement=first.get(j.id, {}), since=now - 900.0)
            for j in waiting
        ]
        steady, second = _time(policy, cluster, placed, now + 60.0, args.repeats)
        used = sum(sum(p.values()) for p in second.values())
        table.add_row(name, f"{cold * 1e3:.0f}", f"{steady * 1e3:.0f}", f"{len(second)}", f"{used}")
    return table


def _time(policy: Policy, cluster: Cluster, jobs: list[Job], now: float, repeats: int):
    """Median wall time of `repeats` decisions, and the decision."""
    times, decision = [], {}
    for _ in range(repeats):
        started = time.perf_counter()
        decision = policy.decide(cluster, jobs, now)
        times.append(time.perf_counter() - started)
    return statistics.median(times), decision


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _models(text: str) -> list[str]:
    models = [v for v in text.split(",") if v]
    unknown = [m for m in models if m not in NOISE_SCALES]
    if unknown or not models:
        raise argparse.ArgumentTypeError(f"noise models are {', '.join(NOISE_SCALES)}; got {text!r}")
    return models


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE, help="Philly jobs CSV")
    parser.add_argument("--jobs", type=_ints, default=[160, 320, 480], help="jobs per workload (load levels)")
    parser.add_argument("--seeds", type=_ints, default=[1, 2], help="sampling seeds")
    parser.add_argument("--heavy", type=int, default=2, help="workloads with twice the heaviest load (one per seed, up to this many)")
    parser.add_argument("--pollux-generations", type=int, default=20, help="generations of Pollux's search per decision "
                        "(the artifact runs 100; its population carries over from one decision to the next)")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--pause", type=float, default=20.0, help="seconds lost per start, resize or restart")
    parser.add_argument("--tick", type=float, default=60.0, help="seconds between periodic decisions")
    parser.add_argument("--sweep", action="store_true", help="also our policy with each knob moved alone (goodput mode), beside the same Pollux run")
    parser.add_argument("--pollux-cache", type=Path, default=None, metavar="DIR",
                        help="keep each workload's Pollux replay in DIR and reuse it while Pollux, the simulator, the trace "
                             "and these settings are unchanged (our policy's changes replay in minutes)")
    parser.add_argument("--capacity-bound", type=float, default=0.0, metavar="SLOT_S",
                        help="also reproducible mode's capacity bound (cluster/bounds.py), its program in slots of SLOT_S "
                             "seconds (300: within minutes; shorter is tighter and slower); 0: not computed")
    parser.add_argument("--by-length", action="store_true", help="also, per workload, ours (goodput, then reproducible) against "
                        "Pollux by tenths of job length, beside each tenth's floor")
    parser.add_argument("--noise", type=_models, default=["published"], metavar="MODELS",
                        help="whose gradient noise scales the goodput jobs take, comma-separated: published (the Pollux "
                             "artifact's measured training runs of real models) and/or measured (the trainer's, on the "
                             "project's tiny example workloads)")
    parser.add_argument("--ours-seed-offset", type=int, default=0, metavar="N",
                        help="replay ours (every mode) at the simulator's seed + N (the step times' noise), the others at the seed")
    parser.add_argument("--growth", type=int, default=4, help="an elastic job may take up to this many times its request")
    parser.add_argument("--big-nodes", type=int, default=1024)
    parser.add_argument("--big-jobs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


if __name__ == "__main__":
    main()
