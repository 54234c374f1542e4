"""The host's work per step inside a trial started by `campaign launch` (issue 29), against the
plain loop run alone: the other half of `bench/gpu_throughput.py --host-overhead`, which
measures our loop in isolation.

At tiny shapes (batch 4, a few channels; `gpu_throughput.workloads(tiny=True)`) a CPU step is
host work: Python, dispatch, the data path; on a GPU that is what a small model's step waits
on. Per workload and round, alternating which side goes first:

- **plain**: the hand-written loop (`gpu_throughput.Plain`) in a process of its own, pinned
  to one core with one thread, as a trial's CPU slot runs;
- **campaign**: the same model, data, optimizer, batch and schedule as a one-trial campaign
  (`campaign launch --no-live`, one CPU slot, one logical rank), with its MLflow sink, progress
  files and fence running as they do for any trial; checkpoints and evaluations are kept out
  of the timed steps (on both sides).

Each side's time per step is the median of its `--log-every`-step windows after the warm-up
(the trainer's own `step_time_s` metric, read from the campaign's MLflow store; the plain
loop times its windows the same way). Printed: the extra host time per step of the campaign's
trial over the plain loop, the median over rounds (goal <= 5 %). Prints; passes nothing.

    .venv/bin/python bench/host_overhead_campaign.py                  # 5 rounds, all three workloads
    .venv/bin/python bench/host_overhead_campaign.py --workloads small_cnn --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENV = {"PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def tiny_workload(name: str, digits: Path):
    from bench.gpu_throughput import workloads

    return workloads(on_gpu=False, digits=digits, tiny=True)[name]


def plain_child(job: dict) -> None:
    """The plain loop alone on one core: prints its window times (seconds per step) as JSON."""
    import torch

    from bench.gpu_throughput import Plain

    os.sched_setaffinity(0, {job["core"]})
    torch.set_num_threads(1)
    w = tiny_workload(job["workload"], Path(job["digits"]))
    every, total = job["log_every"], job["warmup"] + job["steps"]
    loop = Plain(w, torch.device("cpu"), "fp32", total, every)
    loop.run(job["warmup"])
    windows = []
    for _ in range(job["steps"] // every):
        start = time.perf_counter()
        loop.run(every)  # reads the loss at the window's end, as the trainer does at a log step
        windows.append((time.perf_counter() - start) / every)
    print(json.dumps(windows))


def run_plain(workload: str, digits: Path, warmup: int, steps: int, every: int, core: int) -> float:
    job = {"workload": workload, "digits": str(digits), "warmup": warmup, "steps": steps, "log_every": every, "core": core}
    done = subprocess.run([sys.executable, __file__, "--plain", json.dumps(job)], env={**os.environ, **ENV}, cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))


def run_campaign(workload: str, digits: Path, warmup: int, steps: int, every: int, folder: Path, name: str) -> float:
    w = tiny_workload(workload, digits)
    total = warmup + steps
    spec = {
        "campaign": {"name": name, "seed": 0},
        "data": w.data, "model": w.model, "optimizer": w.optimizer,
        "training": {"steps": total, "batch_size": w.batch, "lr": w.lr, "schedule": "cosine", "warmup_steps": 20, "precision": "fp32",
                     "logical_ranks": 1, "checkpoint_every": total, "eval_every": total, "log_every": every},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"),
                     "summary": str(folder / f"{name}.json")},
    }
    params = folder / f"{name}.yaml"
    params.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", str(params), "--no-live"], env={**os.environ, **ENV}, cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"campaign {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with sqlite3.connect(folder / "mlflow.db") as db:
        rows = db.execute("SELECT step, value FROM metrics WHERE key = 'step_time_s' ORDER BY step").fetchall()
    # Windows after the warm-up, and not the last one (it ends with the final evaluation's step).
    windows = [value for step, value in rows if warmup < step < total]
    if not windows:
        raise SystemExit(f"campaign {name}: no step_time_s windows after step {warmup} in its MLflow store")
    return statistics.median(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="small_cnn,resnet,gpt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per side and round")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        plain_child(json.loads(args.plain))
        return
    from training.data import prepare_digits

    # The plain loop takes the core a one-slot campaign gives its trial: the last one
    # (campaign launch keeps its own processes on the others).
    core = max(os.sched_getaffinity(0))
    report: dict = {"workloads": {}}
    print(f"{args.rounds} rounds of {args.steps} steps after {args.warmup}, windows of {args.log_every}; plain on core {core}")
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        digits = prepare_digits(Path(tmp) / "digits.npz")
        for workload in args.workloads.split(","):
            extras, plain_s, ours_s = [], [], []
            for r in range(args.rounds):
                folder = Path(tmp) / f"{workload}-{r}"
                folder.mkdir()
                sides = [("plain", lambda: run_plain(workload, digits, args.warmup, args.steps, args.log_every, core)),
                         ("campaign", lambda: run_campaign(workload, digits, args.warmup, args.steps, args.log_every, folder, f"{workload}-{r}"))]
                got = dict((label, measure()) for label, measure in (sides if r % 2 == 0 else sides[::-1]))
                plain_s.append(got["plain"])
                ours_s.append(got["campaign"])
                extras.append(got["campaign"] / got["plain"] - 1)
                print(f"  {workload} round {r}: plain {got['plain'] * 1e6:.0f} us/step, in a campaign {got['campaign'] * 1e6:.0f} us/step "
                      f"({100 * extras[-1]:+.1f} %)", flush=True)
            extra = statistics.median(extras)
            print(f"{workload:10s} extra host time per step in a campaign trial: {100 * extra:+.1f} % "
                  f"(plain {statistics.median(plain_s) * 1e6:.0f} us/step; rounds {100 * min(extras):+.1f} .. {100 * max(extras):+.1f} %; "
                  f"goal <= 5 %)", flush=True)
            report["workloads"][workload] = {"plain_s_per_step": statistics.median(plain_s), "campaign_s_per_step": statistics.median(ours_s),
                                             "extra": extra, "rounds": extras}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
