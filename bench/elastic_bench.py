"""Elastic trials (issue 4): is a resize safe, how long does it pause training, what does the
trainer cost? Three figures measured in one run, side by side. Prints them; passes nothing.

    .venv/bin/python bench/elastic_bench.py              # all three, ~20 min here
    .venv/bin/python bench/elastic_bench.py --part overhead --groups 6

1. Equivalence. The same trial (same seed, 2 logical ranks, traced) at a fixed 2 processes
   and resized 2 -> 1 -> 2: the sample ids of every step compared one by one, the largest
   difference of the loss of every step and of the final parameters. A control run at a
   fixed 1 process (both logical ranks in one process, their gradients accumulated instead
   of all-reduced) shows what float rounding alone (another order of operations) does over
   as many steps.
2. Resize pause. One trial resized 2 -> 1 -> 2 -> 1 ... through memory (mode "resize", ours)
   and one through stop, disk checkpoint, end every process, start anew, load from disk
   (mode "restart", the naive path). Pause = last step at the old size -> first step at the
   new size (training makes no progress); latency = request -> first step at the new size.
   Ours starts joiners while the trial keeps training: that start-up is in the latency, not
   in the pause. The phases are the medians of each resize's pause_breakdown_s.
3. Overhead. Steps per second of our trainer as a campaign runs it (MLflow logging to a
   real SQLite store, progress file, asynchronous DCP checkpoints every `checkpoint_every`
   steps), launched both ways a campaign launches it: by torchrun (a fixed-size trial,
   "ours") and by the elastic agent (an elastic trial, checking for a resize every control
   step, "elastic"), against bench/plain_ddp.py (a hand-written DDP loop: same
   model, data, global batch split, SGD with momentum, warm-up + cosine lr; nothing else),
   both at 2 processes pinned one per core (ours with 2 logical ranks, one per process).
   Timed from step `warm` (start-up, the metrics sink's MLflow import included, stays out)
   to the step before the last (ours evaluates at its last step), on every 10th step: ours
   from the MLflow timestamps of train_loss (ms, stamped as the step completes), the plain
   loop from the wall time it records after each step. The three runs of a group go back to back, in rotating order, so all
   see the host's load of the same moment; the figure is the median over groups of the
   time-per-step ratio to the plain loop. The CPU time of the workers and their children (every thread, the
   metrics sink included, sampled from /proc) is given beside it: it moves much less with
   the load of a shared host than wall time does. The default settings checkpoint every
   few seconds (production runs checkpoint every several minutes) and, for scale, every
   50 steps (a checkpoint every ~0.2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from elastic_helpers import cpu_slot, finish, final_weights, resize, resizes, run, start, trace, trial_config, wait_for_step  # noqa: E402
from training.config import TrialConfig  # noqa: E402
from training.data import prepare_digits  # noqa: E402
from training.elastic import FINISHED, PREEMPTED
from training.agent_commands import write_command  # noqa: E402

# gloo on loopback, one thread per process: what tasks/trial.py gives a trial on CPU slots.
LAUNCH_ENV = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
              "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
CORES = "0,1"  # the two CPU slots (rank i pinned to the i-th core), for ours and the plain loop alike


def log_tail(cfg: TrialConfig, chars: int = 1500) -> str:
    path = Path(cfg.trial_dir) / "agent.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- 1. equivalence ------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """One run against a fixed-size run, step by step."""
    steps: int
    max_weight_diff: float
    max_loss_diff: float
    worst_loss_step: int
    first_loss_over_1e6: int | None  # the first step whose loss differs by more than 1e-6
    differing_steps: list[int]  # steps whose sample ids differ (or that one run lacks)


def compare(fixed: TrialConfig, other: TrialConfig) -> Comparison:
    ta, tb = trace(fixed), trace(other)
    differing = sorted(s for s in set(ta) | set(tb) if s not in ta or s not in tb or ta[s][0] != tb[s][0])
    common = sorted(set(ta) & set(tb))
    loss_diff = {s: abs(ta[s][1] - tb[s][1]) for s in common}
    worst = max(loss_diff, key=loss_diff.get)
    wa, wb = final_weights(fixed), final_weights(other)
    return Comparison(fixed.steps, max(float((wa[k] - wb[k]).abs().max()) for k in wa), loss_diff[worst], worst,
                      next((s for s in common if loss_diff[s] > 1e-6), None), differing)


@dataclass(frozen=True)
class Equivalence:
    events: list[dict]
    elastic: Comparison  # resized vs fixed 2 processes
    control: Comparison  # fixed 1 process vs fixed 2: what float rounding alone does over the same steps
    elastic_vs_fixed1: Comparison  # resized vs fixed 1 process: the arithmetic it ran most steps with


def equivalence(work: Path, data: Path, steps: int, plan: list[tuple[int, int]]) -> Equivalence:
    """Three traced trials, one after another: fixed 2, resized per `plan` (step, devices), fixed 1."""
    runs = {}
    for name, devices, resizes_plan in (("fixed2", 2, []), ("elastic", 2, plan), ("fixed1", 1, [])):
        # Steps of ~10 ms (as in tests/test_elastic.py): a joiner's ~3 s start-up spans a few
        # hundred of them, so a grow asked for at a chosen step lands well before the end.
        cfg = runs[name] = trial_config(work / f"eq-{name}", data, steps=steps, trace=True,
                                        batch_size=128, model={"name": "small_cnn", "width": 32, "dropout": 0.1})
        finish(run(cfg, devices, resizes_plan), cfg)
    return Equivalence(resizes(runs["elastic"]), compare(runs["fixed2"], runs["elastic"]), compare(runs["fixed2"], runs["fixed1"]),
                       compare(runs["fixed1"], runs["elastic"]))


# --- 2. resize pause ---------------------------------------------------------------------
@dataclass
class PausePath:
    mode: str
    events: list[dict] = field(default_factory=list)
    error: str | None = None


def wait_for_event(cfg: TrialConfig, count: int, proc: subprocess.Popen, timeout: float = 180) -> dict:
    """The trial's `count`-th resize event, once written (by the new generation's rank 0)."""
    deadline = time.time() + timeout
    while len(found := resizes(cfg)) < count:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with code {proc.returncode} before resize {count}")
        if time.time() > deadline:
            raise TimeoutError(f"resize {count} not done in {timeout:.0f} s")
        time.sleep(0.01)
    return found[count - 1]


def resize_series(work: Path, data: Path, mode: str, targets: list[int], gap: int) -> PausePath:
    """One trial at 2 processes, resized to each of `targets` in turn, each once the previous
    resize is done and `gap` steps have run at its size; then preempted (it stops cleanly)."""
    cfg = trial_config(work / f"pause-{mode}", data, steps=10**7, trace=False, checkpoint_every=10**6, eval_every=10**7)
    path = PausePath(mode)
    proc = start(cfg, 2)
    try:
        wait_for_step(cfg, gap, proc)
        for seq, devices in enumerate(targets, 1):
            resize(cfg, seq, devices, mode)
            event = wait_for_event(cfg, seq, proc)
            path.events.append(event)
            wait_for_step(cfg, event["step"] + gap, proc)
        write_command(Path(cfg.trial_dir) / "control", len(targets) + 1, [])  # preempt: the trial ends
        code = proc.wait(timeout=120)
        if code not in (PREEMPTED, FINISHED):
            raise RuntimeError(f"agent exited with code {code} when preempted")
    except (AssertionError, RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        path.error = f"{e}\n--- end of {cfg.trial_dir}/agent.log ---\n{log_tail(cfg)}"
    finally:
        if proc.poll() is None:
            proc.terminate()  # the agent ends its workers on SIGTERM
            proc.wait(timeout=60)
    return path


# --- 3. overhead ---------------------------------------------------------------------------
LOG_EVERY = 10  # ours logs train_loss every 10 steps (the campaign's default): both loops are timed on these steps


@dataclass(frozen=True)
class Setting:
    width: int
    batch: int
    steps: int
    warm: int  # steps excluded as start-up (the metrics sink's MLflow import, first allocations)
    checkpoint_every: int  # ours: an asynchronous DCP checkpoint every this many steps

    @property
    def label(self) -> str:
        return f"SmallCNN w{self.width}, batch {self.batch}"


@dataclass(frozen=True)
class Timing:
    window_steps_per_s: float  # steps in [warm, steps-1] / their wall time
    typical_step_s: float  # median over the window's LOG_EVERY-step intervals, per step
    cpu_per_step_s: float  # CPU time (user + system, every thread of both ranks) per step in the window
    checkpoint_pause_s: float | None = None  # ours: median extra time of an interval holding a checkpoint
    children_cpu_s: float = 0.0  # CPU seconds of the workers' children over the whole run (ours: the metrics sink)


def timing(step_done_at: dict[int, float], cpu: list[tuple[float, float, float]], s: Setting, checkpoints: bool = False) -> Timing:
    """From the completion times of every LOG_EVERY-th step and (wall time, CPU) samples: the
    window from the first such step >= warm to the last one < steps (ours evaluates at its
    final step: it stays out). The CPU at a step's end is interpolated between the samples
    around it. With `checkpoints`, an interval (c, c + LOG_EVERY] after a checkpoint step c
    holds the checkpoint's staging on the training thread: its excess over the typical
    interval is the checkpoint's pause."""
    known = sorted(k for k in step_done_at if s.warm <= k < s.steps and k % LOG_EVERY == 0)
    first, last = known[0], known[-1]
    ends = np.array([step_done_at[k] for k in known])
    times, used, by_children = zip(*cpu)
    cpu_first, cpu_last = np.interp([ends[0], ends[-1]], times, used)
    intervals = np.diff(ends)
    typical = float(np.median(intervals))
    pause = None
    if checkpoints:
        holding = [i for i, k in enumerate(known[:-1]) if k % s.checkpoint_every == 0]
        pause = float(np.median(intervals[holding]) - typical) if holding else None
    return Timing((last - first) / (ends[-1] - ends[0]), typical / LOG_EVERY, float(cpu_last - cpu_first) / (last - first), pause, by_children[-1])


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cpu_seconds(pid: int) -> float | None:
    """User + system time of every thread of a live process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def torchrun(args: list[str], env: dict[str, str], log: Path, ranks: int = 2) -> list[tuple[float, float, float]]:
    return launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args], env, log, ranks)


def launch(cmd: list[str], env: dict[str, str], log: Path, ranks: int = 2, every_s: float = 0.05) -> list[tuple[float, float, float]]:
    """Run a launcher (torchrun, or the elastic agent) whose children are the `ranks` workers,
    to the end; (wall time, CPU seconds of its workers and their children, CPU seconds of
    the children alone) every `every_s`.

    Sampling /proc from outside costs the workers nothing and treats ours and the plain loop
    alike; it is a few file reads per sample, in this process."""
    samples: list[tuple[float, float, float]] = []
    workers: list[int] = []
    last: dict[int, float] = {}
    grandchildren: set[int] = set()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        while proc.poll() is None:
            if len(workers) < ranks:
                workers = children(proc.pid)
            grandchildren.update(c for w in workers for c in children(w))  # the metrics sink is a worker's child
            for pid in [*workers, *grandchildren]:
                used = cpu_seconds(pid)
                if used is not None:  # an exited process keeps its last reading
                    last[pid] = used
            samples.append((time.time(), sum(last.values()), sum(last.get(pid, 0.0) for pid in grandchildren)))
            time.sleep(every_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
    return samples


class Tracking:
    """A real MLflow SQLite store in the work directory; one run per launch of ours."""

    def __init__(self, work: Path):
        from mlflow import MlflowClient

        self.uri = f"sqlite:///{work / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name("elastic-bench")
        self.experiment = found.experiment_id if found else self.client.create_experiment("elastic-bench")

    def new_run(self, name: str) -> str:
        return self.client.create_run(self.experiment, run_name=name).info.run_id

    def step_times(self, run_id: str) -> dict[int, float]:
        return {m.step: m.timestamp / 1000 for m in self.client.get_metric_history(run_id, "train_loss")}


def bench_trial(work: Path, data: Path, s: Setting, tracking: Tracking, name: str) -> tuple[TrialConfig, Path, str]:
    run_id = tracking.new_run(name)
    # Two logical ranks, one per process: each process trains the same contiguous half of the
    # global batch as the plain loop's rank does.
    cfg = TrialConfig(trial_id=name, seed=0, model={"name": "small_cnn", "width": s.width, "dropout": 0.1},
                      data={"path": str(data)}, logical_ranks=2, steps=s.steps, batch_size=s.batch, lr=0.05, warmup_steps=20,
                      # evaluation at the end only, as the plain loop has none
                      checkpoint_every=s.checkpoint_every, log_every=LOG_EVERY, eval_every=s.steps, keep_checkpoints=2,
                      trial_dir=str(work / name), mlflow_tracking_uri=tracking.uri, mlflow_run_id=run_id)
    Path(cfg.trial_dir).mkdir(parents=True)
    config = Path(cfg.trial_dir) / "trial.json"
    config.write_text(cfg.to_json())
    return cfg, config, run_id


def run_ours(work: Path, data: Path, s: Setting, tracking: Tracking, name: str) -> Timing:
    """Our trainer as a campaign runs a fixed-size trial: torchrun -m training.train."""
    cfg, config, run_id = bench_trial(work, data, s, tracking, name)
    cpu = torchrun(["-m", "training.train", "--config", str(config)], {**LAUNCH_ENV, "CAMPAIGN_CPU_CORES": CORES}, Path(cfg.trial_dir) / "train.log")
    return timing(tracking.step_times(run_id), cpu, s, checkpoints=True)


def run_elastic(work: Path, data: Path, s: Setting, tracking: Tracking, name: str) -> Timing:
    """Our trainer as a campaign runs an elastic trial: the agent, one worker per CPU slot,
    each checking for a resize every control step; no resize is asked for."""
    cfg, config, run_id = bench_trial(work, data, s, tracking, name)
    control = Path(cfg.trial_dir) / "control"
    write_command(control, 0, [cpu_slot(int(core)) for core in CORES.split(",")])
    cpu = launch([sys.executable, "-m", "training.elastic", "--config", str(config), "--control", str(control)],
                 LAUNCH_ENV, Path(cfg.trial_dir) / "agent.log")
    return timing(tracking.step_times(run_id), cpu, s, checkpoints=True)


def run_plain(work: Path, data: Path, s: Setting, name: str) -> Timing:
    out = work / f"{name}.json"
    cpu = torchrun([str(REPO / "bench" / "plain_ddp.py"), "--data", str(data), "--steps", str(s.steps), "--width", str(s.width),
              "--batch-size", str(s.batch), "--cores", CORES, "--timing-out", str(out)], LAUNCH_ENV, work / f"{name}.log")
    done_at = json.loads(out.read_text())["done_at"]
    return timing({k + 1: t for k, t in enumerate(done_at)}, cpu, s)


OURS = {"ours": run_ours, "elastic": run_elastic}  # our two launch paths, each against the plain loop


def overhead(work: Path, data: Path, s: Setting, groups: int, tracking: Tracking, console: Console) -> list[dict[str, Timing]]:
    """Groups of three runs back to back (ours by torchrun, ours elastic, plain), the order
    rotating from group to group, so a drift of the host's load favours none of them."""
    results = []
    for i in range(groups):
        tag = f"w{s.width}-b{s.batch}-c{s.checkpoint_every}-{i}"
        names = ["ours", "elastic", "plain"]
        group: dict[str, Timing] = {}
        for name in names[i % 3:] + names[:i % 3]:
            group[name] = (run_plain(work, data, s, f"plain-{tag}") if name == "plain"
                           else OURS[name](work, data, s, tracking, f"{name}-{tag}"))
        console.print(f"  {s.label}, checkpoint every {s.checkpoint_every}, group {i + 1}/{groups}: " + "; ".join(
            f"{name} {group[name].window_steps_per_s:.1f} steps/s, {group[name].cpu_per_step_s * 1000:.2f} CPU ms/step" for name in names)
            + f" (load {os.getloadavg()[0]:.2f})")
        results.append(group)
    return results


# --- report ----------------------------------------------------------------------------
def print_equivalence(console: Console, eq: Equivalence, planned: int) -> None:
    steps = eq.elastic.steps
    plan = ", ".join(f"{len(e['from'])} -> {len(e['to'])} at step {e['step']} (pause {e['pause_s'] * 1000:.0f} ms)" for e in eq.events)
    table = Table(title=f"1. Equivalence over {steps} steps, same seed: resized ({plan}) vs fixed 2 processes")
    table.add_column("figure")
    table.add_column("resized vs fixed 2", justify="right")
    table.add_column("control: fixed 1 vs fixed 2", justify="right")
    table.add_column("resized vs fixed 1", justify="right")

    def ids(c: Comparison) -> str:
        if not c.differing_steps:
            return f"identical at all {steps} steps"
        shown = ", ".join(map(str, c.differing_steps[:10])) + (" ..." if len(c.differing_steps) > 10 else "")
        return f"DIFFER at {len(c.differing_steps)} steps: {shown}"

    rows = [("sample ids, step by step", ids),
            ("max |final parameter difference|", lambda c: f"{c.max_weight_diff:.2e}"),
            ("max |loss difference| (at step)", lambda c: f"{c.max_loss_diff:.2e} ({c.worst_loss_step})"),
            ("first step with |loss difference| > 1e-6", lambda c: str(c.first_loss_over_1e6) if c.first_loss_over_1e6 is not None else "none")]
    for label, cell in rows:
        table.add_row(label, cell(eq.elastic), cell(eq.control), cell(eq.elastic_vs_fixed1))
    console.print(table)
    console.print("The control changes only the order of float32 operations (one process runs both logical ranks and "
                  "accumulates their gradients; two run one each and all-reduce): what it shows is rounding, grown by "
                  "training, the floor for any resized run. Bit-exact equality is not required; the sample ids must be identical.")
    if len(eq.events) < planned:
        console.print(f"[red]only {len(eq.events)} of {planned} resizes happened[/red] before the trial ended: raise --eq-steps")


def direction(e: dict) -> str:
    return f"{len(e['from'])}->{len(e['to'])}"


def print_pause(console: Console, paths: list[PausePath]) -> None:
    table = Table(title="2. Resize pause (median over resizes; ms)")
    for col in ("path", "resizes", "pause 2->1", "pause 1->2", "pause, all", "latency 2->1", "latency 1->2", "latency, all"):
        table.add_column(col, justify="right")
    by = {}
    for p in paths:
        ev = p.events
        pause = {d: [e["pause_s"] * 1000 for e in ev if direction(e) == d] for d in ("2->1", "1->2")}
        lat = {d: [e["latency_s"] * 1000 for e in ev if direction(e) == d] for d in ("2->1", "1->2")}
        by[p.mode] = median([e["pause_s"] for e in ev]), median([e["latency_s"] for e in ev])
        name = {"resize": "ours (memory)", "restart": "restart (disk)"}[p.mode]
        table.add_row(name, str(len(ev)), *(f"{median(pause[d]):.0f}" for d in pause), f"{by[p.mode][0] * 1000:.0f}",
                      *(f"{median(lat[d]):.0f}" for d in lat), f"{by[p.mode][1] * 1000:.0f}")
    console.print(table)
    if "resize" in by and "restart" in by and paths[0].events and paths[1].events:
        console.print(f"restart / ours: pause x{by['restart'][0] / by['resize'][0]:.0f}, latency x{by['restart'][1] / by['resize'][1]:.1f}")

    phases = Table(title="where the pause goes: median of each pause_breakdown_s phase (ms), in the order they happen")
    phases.add_column("phase (time up to it)")
    columns = [(p.mode, d) for p in paths for d in ("2->1", "1->2")]
    for mode, d in columns:
        phases.add_column(f"{mode} {d}", justify="right")
    names = []
    for p in paths:
        for e in p.events:
            names += [n for n in e["pause_breakdown_s"] if n not in names]
    for n in names:
        row = []
        for mode, d in columns:
            values = [e["pause_breakdown_s"][n] * 1000 for p in paths if p.mode == mode for e in p.events
                      if direction(e) == d and n in e["pause_breakdown_s"]]
            row.append(f"{median(values):.1f}" if values else "-")
        phases.add_row(n, *row)
    console.print(phases)
    console.print("phases: stopped = the old generation stops at a control step (restart: + a blocking disk "
                  "checkpoint); ready = every process started, imported, data and model built (restart; ours starts "
                  "joiners before the stop, and shows this phase only when they became ready just after the last old "
                  "step); assigned = the agent hands out the new generation; process_group = init of the new gloo "
                  "group; state = broadcast from rank 0 (ours) or DCP load from disk (restart); first_step = the first "
                  "step at the new size.")
    for p in paths:
        if p.error:
            console.print(f"[red]{p.mode} path FAILED[/red]: {escape(p.error)}")


def print_overhead(console: Console, results: dict[Setting, list[dict[str, Timing]]]) -> None:
    table = Table(title="3. Overhead: our trainer (MLflow, progress, async checkpoints) vs a plain DDP loop, 2 processes; "
                        "'ours' = torchrun (a fixed-size trial), 'elastic' = the agent (an elastic trial, resize checks on) "
                        "(medians over the groups; 'slower by' = median of the groups' time-per-step ratios - 1)")
    for col in ("setting", "ours", "checkpoint every", "window", "groups", "steps/s ours", "steps/s plain", "wall: ours slower by (range)",
                "CPU: ours more by (range)", "typical step ms ours / plain", "checkpoint pause ms", "metrics sink CPU s, whole run"):
        table.add_column(col, justify="right")
    for s, groups in results.items():
        for name in OURS:
            pairs = [(g[name], g["plain"]) for g in groups]
            wall = [p.window_steps_per_s / o.window_steps_per_s - 1 for o, p in pairs]
            cpu = [o.cpu_per_step_s / p.cpu_per_step_s - 1 for o, p in pairs]
            pauses = [o.checkpoint_pause_s for o, _ in pairs if o.checkpoint_pause_s is not None]
            ours_rate = median([o.window_steps_per_s for o, _ in pairs])
            table.add_row(s.label, name, f"{s.checkpoint_every} steps (~{s.checkpoint_every / ours_rate:.1f} s)", f"steps {s.warm}-{s.steps - 1}",
                          str(len(pairs)), f"{ours_rate:.1f}", f"{median([p.window_steps_per_s for _, p in pairs]):.1f}",
                          f"{median(wall):+.1%} ({min(wall):+.1%} .. {max(wall):+.1%})",
                          f"{median(cpu):+.1%} ({min(cpu):+.1%} .. {max(cpu):+.1%})",
                          f"{median([o.typical_step_s for o, _ in pairs]) * 1000:.2f} / {median([p.typical_step_s for _, p in pairs]) * 1000:.2f}",
                          f"{median(pauses) * 1000:.1f}" if pauses else "-", f"{median([o.children_cpu_s for o, _ in pairs]):.2f}")
    console.print(table)
    console.print("CPU = user + system time of both worker processes, every thread (training, gloo, checkpoint writers), "
                  "the workers' children (the MLflow sink, at the lowest priority) included, sampled from /proc (the "
                  "elastic agent itself is not counted: it waits, polling its control files). "
                  "CPU time moves less than wall time with the host's load, but not none (a busy sibling core slows each "
                  f"instruction). 'typical step' = median {LOG_EVERY}-step interval, per step. 'checkpoint pause' = how much "
                  "longer than typical the interval holding a checkpoint's staging is. The sink's CPU is mostly its one-time import "
                  "of MLflow, on otherwise idle cores (SCHED_IDLE): the window starts after it.")


def guarded(console: Console, part: str, measure) -> None:
    """Run one part; a failure is reported and the other parts still run."""
    try:
        measure()
    except Exception as e:  # a bench reports what broke instead of hiding the other figures
        console.print(f"[red]part {part} FAILED[/red]: {e.__class__.__name__}: {escape(str(e))}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "equivalence", "pause", "overhead"), default="all")
    parser.add_argument("--eq-steps", type=int, default=2000, help="steps of the equivalence trials")
    parser.add_argument("--eq-plan", default="200:1,600:2",
                        help="step:devices resizes of the elastic run (a grow needs ~3-5 s of steps after it for the joiner to start)")
    parser.add_argument("--resize-reps", type=int, default=2, help="2->1->2 cycles per path in the pause part")
    parser.add_argument("--gap", type=int, default=50, help="steps at each size between resizes")
    parser.add_argument("--groups", type=int, default=5, help="(ours, elastic, plain) groups per overhead setting")
    parser.add_argument("--settings", default="32:128:2500:1000:500,16:64:8000:4000:1000,16:64:8000:4000:50",
                        help="overhead settings width:batch:steps:warm-up steps:checkpoint every, comma-separated")
    parser.add_argument("--workdir", type=Path, help="keep trials, logs and the MLflow store here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error(f"--workdir {args.workdir} is not empty: finished trials there would be skipped, not measured")
    return args


def print_header(console: Console) -> None:
    """The command as typed and the host: what a reader needs to rerun and weigh the figures."""
    exe = Path(sys.executable)
    exe = exe.relative_to(REPO) if exe.is_relative_to(REPO) else exe
    console.print(f"[bold]command:[/bold] {shlex.join([str(exe), *sys.argv])}")
    console.print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
                  f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    console = Console(width=160, emoji=False)  # the command line is printed as typed (no ':100:' emoji)
    os.environ.update({k: v for k, v in LAUNCH_ENV.items() if k != "OMP_NUM_THREADS"})
    started = time.time()
    print_header(console)
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = prepare_digits(work / "digits.npz")
        if args.part in ("all", "equivalence"):
            plan = [tuple(int(x) for x in item.split(":")) for item in args.eq_plan.split(",")]
            guarded(console, "equivalence", lambda: print_equivalence(console, equivalence(work, data, args.eq_steps, plan), len(plan)))
        if args.part in ("all", "pause"):
            targets = [1, 2] * args.resize_reps
            guarded(console, "pause", lambda: print_pause(
                console, [resize_series(work, data, mode, targets, args.gap) for mode in ("resize", "restart")]))
        if args.part in ("all", "overhead"):
            def measure_overhead() -> None:
                tracking = Tracking(work)
                settings = [Setting(*(int(x) for x in item.split(":"))) for item in args.settings.split(",")]
                print_overhead(console, {s: overhead(work, data, s, args.groups, tracking, console) for s in settings})
            guarded(console, "overhead", measure_overhead)
    console.print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; bench took {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
