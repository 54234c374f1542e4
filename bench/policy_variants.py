"""Variants of our elastic policy against the same Pollux replays, in seconds rather than minutes.

`bench/scheduler_bench.py --pollux-cache DIR` replays Pollux once per workload and keeps it;
this replays only ours, once per variant, on the same workloads and settings, against those
kept replays and the same floors, and prints one line per variant: the gap to the floor
closed per workload and its mean, the p99 against Pollux's, restarts per job against
Pollux's and, with `--repro`, reproducible mode's average JCT over Pollux's. The first line
is the defaults: the goal table of `scheduler_bench.py` gives the same figures to the digit.

Each variant is the policy's knobs, `name=value` pairs separated by commas (any field of
`cluster.policy.ElasticPolicy`); `--sim` moves the simulator instead (`oracle=1`: the true
step-time curves; `noise=0`: step times reported without noise); `--noise-seed N` replays
ours with another draw of that noise, and a list of them (`--noise-seed 0,100,200,300`)
prints each variant at every draw and then its totals over them: on these workloads the
noise alone moves p99 against Pollux's between 3 and 6 of 6, so a variant is better only
where its totals are. `--kinds` adds ours's restarts per job by what caused them (a growth
past the request or up to it, a shrink, a move, a preemption). `--requests max` (or `min`)
replays reproducible mode with every job requesting its max (what a campaign's elastic trial
declares: a range, no size within it) or its min, its work unchanged. Prints; never passes or
fails on the figures.

    .venv/bin/python bench/scheduler_bench.py --heavy 0 --pollux-cache /tmp/pollux     # once (~35 min)
    .venv/bin/python bench/policy_variants.py --pollux-cache /tmp/pollux 'rank_q=3' 'min_efficiency=0.3,yield_min_s=2400'
    .venv/bin/python bench/policy_variants.py --pollux-cache /tmp/pollux --sim oracle=1 --repro
    .venv/bin/python bench/policy_variants.py --pollux-cache /tmp/pollux --noise-seed 0,100,200,300 'min_run_s=7200'
    .venv/bin/python bench/policy_variants.py --pollux-cache /tmp/pollux --requests max
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pickle
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import scheduler_bench as bench  # noqa: E402
from cluster.jobs import Cluster, Job, Placement, devices_of, same_placement  # noqa: E402
from cluster.policy import ElasticPolicy, Policy  # noqa: E402
from cluster.simulator import SimConfig, simulate  # noqa: E402
from cluster.workloads import WorkloadJob, read_philly, sample_philly  # noqa: E402


def parse_knobs(text: str, fields: dict[str, dataclasses.Field]) -> dict[str, object]:
    """'rank_q=3,admit_short=0' -> {'rank_q': 3.0, 'admit_short': False}, each value of its field's type."""
    knobs: dict[str, object] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = pair.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"{pair!r}: not name=value with name one of {', '.join(sorted(fields))}")
        kind = fields[name].type
        try:
            knobs[name] = bool(float(value)) if kind in (bool, "bool") else int(value) if kind in (int, "int") else float(value)
        except ValueError:
            raise SystemExit(f"{pair!r}: {value!r} is not a number") from None
    return knobs


KINDS = ("growth past the request", "growth up to it", "shrink", "move", "preemption")


def restart_kind(before: Placement, after: Placement | None, requested: int) -> str | None:
    """Which of KINDS a decision's change to a running job is; None where it left it as it was."""
    if not after:
        return "preemption"
    if same_placement(after, before):
        return None
    held, given = devices_of(before), devices_of(after)
    if given == held:
        return "move"
    if given > held:
        return "growth past the request" if given > max(held, requested) else "growth up to it"
    return "shrink"


@dataclass
class CountingRestarts:
    """A policy that counts, by kind, the restarts its decisions cause the running jobs."""

    policy: Policy
    counts: collections.Counter = field(default_factory=collections.Counter)

    @property
    def name(self) -> str:
        return self.policy.name

    def decide(self, cluster: Cluster, jobs: Sequence[Job], now: float, more_to_come: bool = True) -> dict[str, dict[str, int]]:
        out = self.policy.decide(cluster, jobs, now, more_to_come)
        for job in jobs:
            kind = restart_kind(job.placement, out.get(job.id), job.requested) if job.running else None
            if kind:
                self.counts[kind] += 1
        return out


# (jobs, seed) -> what every variant replays that workload against, made once per worker
# process: its jobs, Pollux's kept replay and the floor (hundreds of lone-job replays).
_PREPARED: dict[tuple[int, int], tuple] = {}


def _prepared(args: argparse.Namespace, jobs: int, seed: int) -> tuple:
    if (jobs, seed) not in _PREPARED:
        cluster = Cluster.uniform(args.nodes, args.per_node)
        config = SimConfig(pause_s=args.pause, tick_s=args.tick)
        workload = sample_philly(read_philly(args.trace), cluster, jobs, seed=seed, growth=args.growth)
        adaptive = [replace(j, goodput=True, noise_model="published") for j in workload]
        kept = bench._pollux_cache(args, jobs, seed, adaptive)
        if not kept.exists():
            raise SystemExit(f"no Pollux replay of {jobs} jobs, seed {seed} in {args.pollux_cache} for this code and these settings: "
                             f"run bench/scheduler_bench.py --jobs {jobs} --seeds {seed} --heavy 0 --pollux-cache {args.pollux_cache} first")
        pollux = pickle.loads(kept.read_bytes())[0].summary()
        floor = statistics.mean(bench.alone_times(cluster, adaptive, config, seed).values())
        _PREPARED[jobs, seed] = (cluster, config, workload, adaptive, pollux, floor)
    return _PREPARED[jobs, seed]


def one_workload(task: tuple) -> dict[str, float]:
    """Ours (goodput, and reproducible if asked) on one workload, against its kept Pollux replay."""
    args, (jobs, seed), knobs, sim, repro, noise_seed, kinds, requests = task
    cluster, config, workload, adaptive, pollux, floor = _prepared(args, jobs, seed)
    if requests != "trace":
        workload = [requested_at(job, job.max_devices if requests == "max" else job.min_devices, cluster) for job in workload]
    policy = ElasticPolicy(**{"pause_s": args.pause, **knobs})
    counting = CountingRestarts(policy) if kinds else None
    ours = simulate(cluster, adaptive, counting or policy, replace(config, **sim), seed=seed + noise_seed).summary()
    row = {"gap": bench.gap_closed(ours["avg_jct_s"], pollux["avg_jct_s"], floor), "p99": ours["p99_jct_s"] / pollux["p99_jct_s"],
           "restarts": ours["restarts_per_job"], "pollux_restarts": pollux["restarts_per_job"]}
    if counting is not None:
        row["kinds"] = {kind: counting.counts[kind] / len(adaptive) for kind in KINDS}
    if repro:
        fixed = simulate(cluster, workload, policy, replace(config, **sim), seed=seed + noise_seed).summary()
        row["repro"] = fixed["avg_jct_s"] / pollux["avg_jct_s"]
        row["repro_p99"], row["repro_restarts"] = fixed["p99_jct_s"] / pollux["p99_jct_s"], fixed["restarts_per_job"]
    return row


def requested_at(job: WorkloadJob, devices: int, cluster: Cluster) -> WorkloadJob:
    """The job as if it had requested `devices`, its work unchanged: its duration at that size
    (by its true step times). With a fixed batch the request moves only what the scheduler
    reads of it: its model's prior and which of its devices are on loan."""
    model = job.true_model
    scale = model.step_time(devices, cluster.min_nodes(devices)) / model.step_time(job.requested, cluster.min_nodes(job.requested))
    return replace(job, requested=devices, duration=job.duration * scale)


def _each(rows: list[dict[str, float]], show) -> str:
    return " ".join(show(r) for r in rows)


def line(name: str, rows: list[dict[str, float]]) -> str:
    gaps = [r["gap"] for r in rows]
    goal = bench.REPRODUCIBLE_GOAL
    text = (f"{name}: gap closed {_each(rows, lambda r: '%.1f' % (100 * r['gap']))} % (mean {100 * statistics.mean(gaps):.1f} %); "
            f"p99 <= Pollux's on {sum(r['p99'] <= 1.0 for r in rows)} of {len(rows)} ({_each(rows, lambda r: '%.3f' % r['p99'])}); "
            f"restarts <= Pollux's on {sum(r['restarts'] <= r['pollux_restarts'] for r in rows)} "
            f"({_each(rows, lambda r: '%.2f/%.2f' % (r['restarts'], r['pollux_restarts']))})")
    if "repro" in rows[0]:
        text += (f"; reproducible / Pollux's {_each(rows, lambda r: '%.3f' % r['repro'])} "
                 f"(<= {goal} on {sum(r['repro'] <= goal for r in rows)}), its p99 / Pollux's "
                 f"{_each(rows, lambda r: '%.3f' % r['repro_p99'])}, its restarts {_each(rows, lambda r: '%.2f' % r['repro_restarts'])}")
    if "kinds" in rows[0]:
        text += "; restarts per job by kind: " + ", ".join(f"{kind} {_each(rows, lambda r: '%.2f' % r['kinds'][kind])}" for kind in KINDS)
    return text


def totals(name: str, by_seed: dict[int, list[dict[str, float]]]) -> str:
    """One variant over several draws of the noise: its mean gap closed at each and over all,
    and how many (workload, draw) pairs meet each goal."""
    rows = [r for seed_rows in by_seed.values() for r in seed_rows]
    means = [statistics.mean(r["gap"] for r in seed_rows) for seed_rows in by_seed.values()]
    text = (f"{name}, over noise seeds {', '.join(map(str, by_seed))}: gap closed, mean {100 * statistics.mean(means):.1f} % "
            f"({' / '.join('%.1f' % (100 * m) for m in means)}); p99 <= Pollux's on {sum(r['p99'] <= 1.0 for r in rows)} of {len(rows)}; "
            f"restarts <= Pollux's on {sum(r['restarts'] <= r['pollux_restarts'] for r in rows)} of {len(rows)}")
    if "repro" in rows[0]:
        text += f"; reproducible <= {bench.REPRODUCIBLE_GOAL} on {sum(r['repro'] <= bench.REPRODUCIBLE_GOAL for r in rows)} of {len(rows)}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help="knobs of ElasticPolicy, name=value,name=value (the defaults always run first)")
    parser.add_argument("--pollux-cache", type=Path, required=True, metavar="DIR", help="where scheduler_bench.py kept its Pollux replays")
    parser.add_argument("--jobs", type=bench._ints, default=[160, 320, 480])
    parser.add_argument("--seeds", type=bench._ints, default=[1, 2])
    parser.add_argument("--sim", default="", help="simulator settings for ours, name=value (oracle=1, noise=0, report_every_s=60)")
    parser.add_argument("--repro", action="store_true", help="also reproducible mode (every batch fixed)")
    parser.add_argument("--noise-seed", type=bench._ints, default=[0], metavar="N[,N...]",
                        help="moves the seed of the noise in ours's reported step times by N (0: the bench's): "
                             "how much of a difference between variants is that noise; several: each, then the totals")
    parser.add_argument("--kinds", action="store_true", help="also ours's restarts per job by kind (growth past the request, "
                        "growth up to it, shrink, move, preemption)")
    parser.add_argument("--requests", choices=("trace", "max", "min"), default="trace",
                        help="reproducible mode (implies --repro) with every job's request at its max (what a campaign's "
                             "elastic trial declares: its range and no size within it) or its min, its work unchanged")
    parser.add_argument("--workers", type=int, default=2)
    ours = parser.parse_args()
    ours.repro = ours.repro or ours.requests != "trace"
    # The replays' settings are scheduler_bench.py's defaults: its own parser gives them.
    sys.argv = [sys.argv[0], "--pollux-cache", str(ours.pollux_cache)]
    args = bench._parse()
    fields = {f.name: f for f in dataclasses.fields(ElasticPolicy) if f.name != "name"}
    sim = parse_knobs(ours.sim, {f.name: f for f in dataclasses.fields(SimConfig) if f.name != "prior"})
    loads = [(jobs, seed) for jobs in ours.jobs for seed in ours.seeds]
    variants = [(text or "defaults", parse_knobs(text, fields)) for text in ["", *ours.variants]]  # a typo fails before any replay
    if ours.requests != "trace":  # only reproducible mode's replays move the requests: say so on each line
        variants = [(f"{name} (reproducible: every request at its {ours.requests})", knobs) for name, knobs in variants]
    with ProcessPoolExecutor(ours.workers) as pool:
        for name, knobs in variants:
            by_seed = {}
            for noise_seed in ours.noise_seed:
                by_seed[noise_seed] = list(pool.map(one_workload, [(args, load, knobs, sim, ours.repro, noise_seed, ours.kinds, ours.requests) for load in loads]))
                label = name if len(ours.noise_seed) == 1 else f"  {name}, noise seed {noise_seed}"
                print(line(label, by_seed[noise_seed]), flush=True)
            if len(by_seed) > 1:
                print(totals(name, by_seed), flush=True)


if __name__ == "__main__":
    main()
