"""Elastic trials (issue 4): is a resize safe, how long does it pause training, what does the
trainer cost? Three figures measured in one run, side by side. Prints them; passes nothing.

    PYTHONPATH=. .venv/bin/python bench/elastic_bench.py              # all three, ~5 min here
    PYTHONPATH=. .venv/bin/python bench/elastic_bench.py --part overhead --pairs 6

1. Equivalence. The same trial (same seed, traced) at a fixed 2 processes and resized
   2 -> 1 -> 2: the largest difference of the final parameters and of the loss of every step,
   and the sample ids of every step compared one by one.
2. Resize pause. One trial resized 2 -> 1 -> 2 -> 1 ... through memory (mode "resize", ours)
   and one through stop, disk checkpoint, end every process, start anew, load from disk
   (mode "restart", the naive path). Pause = last step at the old size -> first step at the
   new size (training makes no progress); latency = request -> first step at the new size.
   Ours starts joiners while the trial keeps training: that start-up is in the latency, not
   in the pause. The phases are the medians of each resize's pause_breakdown_s.
3. Overhead. Steps per second of our trainer as a campaign runs it (torchrun, MLflow
   logging to a real SQLite store, progress file, periodic asynchronous DCP checkpoints)
   against bench/plain_ddp.py (a hand-written DDP loop: same model, data, global batch split,
   SGD with momentum, warm-up + cosine lr; nothing else), both at 2 processes pinned one per
   core. Timed over steps [warm-up, steps-1]: ours from the MLflow timestamps of each
   step's train_loss (ms, stamped when the step completes), the plain loop from the wall
   time it records after each step. Neither evaluates inside the window (ours evaluates at
   the last step only, which is outside it). The two alternate (ours, plain, ours, plain,
   ...), so each pair saw the host's load of the same moment; the figure is the median of
   the pairs' ratios. "Typical step" compares the median step interval instead: a gap
   between it and the window figure is periodic work (checkpoints, progress writes).
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
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from elastic_helpers import finish, final_weights, resize, resizes, run, start, trace, trial_config, wait_for_step  # noqa: E402
from training.config import TrialConfig  # noqa: E402
from training.data import prepare_digits  # noqa: E402
from training.elastic import FINISHED, PREEMPTED, write_command  # noqa: E402

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
@dataclass
class Equivalence:
    steps: int
    events: list[dict]
    max_weight_diff: float
    max_loss_diff: float
    worst_loss_step: int
    differing_steps: list[int]  # steps whose sample ids differ (or that one run lacks)


def equivalence(work: Path, data: Path, steps: int, plan: list[tuple[int, int]]) -> Equivalence:
    fixed = trial_config(work / "eq-fixed", data, steps=steps, trace=True)
    finish(run(fixed, 2), fixed)
    elastic = trial_config(work / "eq-elastic", data, steps=steps, trace=True)
    finish(run(elastic, 2, plan), elastic)
    ta, tb = trace(fixed), trace(elastic)
    differing = sorted(s for s in set(ta) | set(tb) if s not in ta or s not in tb or ta[s][0] != tb[s][0])
    common = sorted(set(ta) & set(tb))
    loss_diff = {s: abs(ta[s][1] - tb[s][1]) for s in common}
    worst = max(loss_diff, key=loss_diff.get)
    wa, wb = final_weights(fixed), final_weights(elastic)
    weight_diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    return Equivalence(steps, resizes(elastic), weight_diff, loss_diff[worst], worst, differing)


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
@dataclass(frozen=True)
class Setting:
    width: int
    batch: int
    steps: int
    warm: int  # steps excluded as start-up (imports on the logging thread, first allocations)

    @property
    def label(self) -> str:
        return f"SmallCNN w{self.width}, batch {self.batch}"


@dataclass(frozen=True)
class Timing:
    window_steps_per_s: float  # steps in [warm, steps-1] / their wall time
    typical_step_s: float  # median interval between consecutive steps in the window


def timing(step_done_at: dict[int, float], s: Setting) -> Timing:
    """From the completion times of steps 1..steps: the window [warm, steps-1]."""
    last = s.steps - 1  # ours evaluates at its final step: keep that step out
    window = [step_done_at[k] for k in range(s.warm, last + 1)]
    return Timing((last - s.warm) / (window[-1] - window[0]), float(np.median(np.diff(window))))


def torchrun(args: list[str], env: dict[str, str], log: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    with open(log, "ab") as out:
        code = subprocess.run(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {code}:\n{log.read_text(errors='replace')[-2000:]}")


class Tracking:
    """A real MLflow SQLite store in the work directory; one run per launch of ours."""

    def __init__(self, work: Path):
        from mlflow import MlflowClient

        self.uri = f"sqlite:///{work / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.experiment = self.client.create_experiment("elastic-bench")

    def new_run(self, name: str) -> str:
        return self.client.create_run(self.experiment, run_name=name).info.run_id

    def step_times(self, run_id: str) -> dict[int, float]:
        return {m.step: m.timestamp / 1000 for m in self.client.get_metric_history(run_id, "train_loss")}


def run_ours(work: Path, data: Path, s: Setting, tracking: Tracking, name: str) -> Timing:
    run_id = tracking.new_run(name)
    cfg = TrialConfig(trial_id=name, seed=0, model="small_cnn", model_kwargs={"width": s.width, "dropout": 0.1},
                      data_path=str(data), steps=s.steps, batch_size=s.batch, lr=0.05, warmup_steps=20,
                      # the campaign's defaults (params.yaml): checkpoint every 50, progress every 10;
                      # evaluation at the end only, as the plain loop has none
                      checkpoint_every=50, log_every=10, eval_every=s.steps, keep_checkpoints=2,
                      trial_dir=str(work / name), mlflow_tracking_uri=tracking.uri, mlflow_run_id=run_id)
    Path(cfg.trial_dir).mkdir(parents=True)
    config = Path(cfg.trial_dir) / "trial.json"
    config.write_text(cfg.to_json())
    torchrun(["-m", "training.train", "--config", str(config)], {**LAUNCH_ENV, "CAMPAIGN_CPU_CORES": CORES}, Path(cfg.trial_dir) / "train.log")
    return timing(tracking.step_times(run_id), s)


def run_plain(work: Path, data: Path, s: Setting, name: str) -> Timing:
    out = work / f"{name}.json"
    torchrun([str(REPO / "bench" / "plain_ddp.py"), "--data", str(data), "--steps", str(s.steps), "--width", str(s.width),
              "--batch-size", str(s.batch), "--cores", CORES, "--timing-out", str(out)], LAUNCH_ENV, work / f"{name}.log")
    done_at = json.loads(out.read_text())["done_at"]
    return timing({k + 1: t for k, t in enumerate(done_at)}, s)


def overhead(work: Path, data: Path, s: Setting, pairs: int, tracking: Tracking, console: Console) -> list[tuple[Timing, Timing]]:
    results = []
    for i in range(pairs):
        ours = run_ours(work, data, s, tracking, f"ours-w{s.width}-b{s.batch}-{i}")
        plain = run_plain(work, data, s, f"plain-w{s.width}-b{s.batch}-{i}")
        console.print(f"  {s.label} pair {i + 1}/{pairs}: ours {ours.window_steps_per_s:.1f} steps/s, "
                      f"plain {plain.window_steps_per_s:.1f} steps/s (load {os.getloadavg()[0]:.2f})")
        results.append((ours, plain))
    return results


# --- report ----------------------------------------------------------------------------
def print_equivalence(console: Console, eq: Equivalence, planned: int) -> None:
    table = Table(title=f"1. Equivalence: fixed 2 processes vs resized, {eq.steps} steps, same seed")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for e in eq.events:
        table.add_row(f"resize {len(e['from'])} -> {len(e['to'])}", f"first step at new size: {e['step']}, pause {e['pause_s'] * 1000:.0f} ms")
    table.add_row("max |final parameter difference|", f"{eq.max_weight_diff:.2e}")
    table.add_row("max |loss difference| over steps", f"{eq.max_loss_diff:.2e} (step {eq.worst_loss_step})")
    if eq.differing_steps:
        shown = ", ".join(map(str, eq.differing_steps[:10])) + (" ..." if len(eq.differing_steps) > 10 else "")
        table.add_row("sample ids", f"DIFFER at {len(eq.differing_steps)} steps: {shown}")
    else:
        table.add_row("sample ids", f"identical at all {eq.steps} steps")
    console.print(table)
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
    console.print("phases: stopped = the old generation stops at its next control step (restart: + a blocking disk "
                  "checkpoint); ready = every process started, imported, data and model built (restart only: ours "
                  "starts joiners before the stop); assigned = the agent hands out the new generation; process_group "
                  "= init of the new gloo group; state = broadcast from rank 0 (ours) or DCP load from disk (restart); "
                  "first_step = the first step at the new size.")
    for p in paths:
        if p.error:
            console.print(f"[red]{p.mode} path FAILED[/red]: {p.error}")


def print_overhead(console: Console, results: dict[Setting, list[tuple[Timing, Timing]]]) -> None:
    table = Table(title="3. Overhead: our trainer (MLflow + async checkpoints + progress) vs a plain DDP loop, 2 processes")
    for col in ("setting", "window", "pairs", "ours steps/s", "plain steps/s", "ours/plain (median of pairs)", "slower by",
                "typical step ours/plain (ms)"):
        table.add_column(col, justify="right")
    for s, pairs in results.items():
        ratios = [o.window_steps_per_s / p.window_steps_per_s for o, p in pairs]
        r = median(ratios)
        typical_o, typical_p = median([o.typical_step_s for o, _ in pairs]), median([p.typical_step_s for _, p in pairs])
        table.add_row(s.label, f"steps {s.warm}-{s.steps - 1}", str(len(pairs)),
                      f"{median([o.window_steps_per_s for o, _ in pairs]):.1f}", f"{median([p.window_steps_per_s for _, p in pairs]):.1f}",
                      f"{r:.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f})", f"{(1 / r - 1) * 100:+.1f}%",
                      f"{typical_o * 1000:.2f} / {typical_p * 1000:.2f}")
    console.print(table)


def guarded(console: Console, part: str, measure) -> None:
    """Run one part; a failure is reported and the other parts still run."""
    try:
        measure()
    except Exception as e:  # a bench reports what broke instead of hiding the other figures
        console.print(f"[red]part {part} FAILED[/red]: {e.__class__.__name__}: {e}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "equivalence", "pause", "overhead"), default="all")
    parser.add_argument("--eq-steps", type=int, default=2000, help="steps of the equivalence trials")
    parser.add_argument("--eq-plan", default="200:1,600:2",
                        help="step:devices resizes of the elastic run (a grow needs ~3-5 s of steps after it for the joiner to start)")
    parser.add_argument("--resize-reps", type=int, default=2, help="2->1->2 cycles per path in the pause part")
    parser.add_argument("--gap", type=int, default=50, help="steps at each size between resizes")
    parser.add_argument("--pairs", type=int, default=3, help="(ours, plain) pairs per overhead setting")
    parser.add_argument("--settings", default="32:128:400:150,16:64:900:300",
                        help="overhead settings width:batch:steps:warm-up steps, comma-separated")
    parser.add_argument("--workdir", type=Path, help="keep trials, logs and the MLflow store here (default: a temp dir)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    console = Console(width=160)
    os.environ.update({k: v for k, v in LAUNCH_ENV.items() if k != "OMP_NUM_THREADS"})
    started = time.time()
    exe = Path(sys.executable)
    exe = exe.relative_to(REPO) if exe.is_relative_to(REPO) else exe
    console.print(f"[bold]command:[/bold] PYTHONPATH=. {shlex.join([str(exe), *sys.argv])}")
    console.print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
                  f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = prepare_digits(work / "digits.npz")
        if args.part in ("all", "equivalence"):
            plan = [tuple(int(x) for x in item.split(":")) for item in args.eq_plan.split(",")]
            guarded(console, "equivalence", lambda: print_equivalence(console, equivalence(work, data, args.eq_steps, plan), len(plan)))
        if args.part in ("all", "pause"):
            targets = [1, 2] * args.resize_reps
            guarded(console, "pause", lambda: print_pause(console, [resize_series(work, data, mode, targets, args.gap) for mode in ("resize", "restart")]))
        if args.part in ("all", "overhead"):
            def measure_overhead() -> None:
                tracking = Tracking(work)
                settings = [Setting(*(int(x) for x in item.split(":"))) for item in args.settings.split(",")]
                print_overhead(console, {s: overhead(work, data, s, args.pairs, tracking, console) for s in settings})
            guarded(console, "overhead", measure_overhead)
    console.print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; bench took {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
