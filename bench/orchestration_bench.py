"""Orchestration cost (issue 12): N trivial trials through a campaign, against DVC's
experiment queue running the same trial, in one run. Prints; passes nothing.

    .venv/bin/python bench/orchestration_bench.py              # 8 trials on 2 slots, both systems
    .venv/bin/python bench/orchestration_bench.py --trials 16 --skip-dvc

A trivial trial: an MLP of width 4 on digits, 2 steps, one evaluation; training is a few
milliseconds, so what is measured is the fixed cost: process start, imports, rendezvous,
checkpoint, result, records, tracking.

- ours: `campaign launch` of a grid of N learning rates, `resources.devices: 1`, on `--slots`
  CPU slots (Prefect's ephemeral API, MLflow on SQLite, DVC not involved).
- dvc: a fresh git + DVC repo whose one stage runs the same trial the way a campaign does
  (`python -m training.launch --standalone --nproc-per-node=1 -m training.train`), N
  experiments queued with `dvc exp run --queue -S lr=...`, run by `dvc queue start -j
  <slots>`; timed from `queue start` until `dvc queue status` shows none queued or running.

Read: wall seconds for N trials, and fixed cost per trial = wall x slots / N (slot-seconds
each trial costs beyond its training). Ours is also run with `--scale` x N trials: the
difference between the two campaigns, per extra trial, is the marginal cost of a trial once
the campaign is up (its start: Prefect's API, the checks, the first workers, is paid once).
The goal in issue 12: ours >= 5x faster than DVC's queue, and <= 1 s per trial.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAINING = {"steps": 2, "batch_size": 16, "lr": 0.05, "eval_every": 2, "checkpoint_every": 2, "log_every": 2}


def lrs(n: int) -> list[float]:
    return [round(0.01 + 0.01 * i, 4) for i in range(n)]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
            "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1"}


def ours(work: Path, digits: Path, n: int, slots: int) -> float:
    import yaml

    folder = work / f"ours-{n}"
    folder.mkdir(parents=True)
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "trivial"}, "data": {"path": str(digits)}, "model": {"name": "mlp", "width": 4},
        "training": TRAINING, "grid": {"training.lr": lrs(n)}, "resources": {"devices": 1}, "cluster": {"cpu_slots": slots},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / "s.json")},
    }))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=folder,
                          env={**env(), "CAMPAIGN_LEASE_DB": str(folder / "leases.db")}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"campaign failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return wall


MAKE_TRIAL = '''
import json, sys, yaml
from training.config import TrialConfig
p = yaml.safe_load(open("params.yaml"))
cfg = TrialConfig(trial_id="t", seed=0, model={"name": "mlp", "width": 4}, data={"path": p["data"]}, lr=float(p["lr"]),
                  trial_dir="out", **{k: v for k, v in p["training"].items() if k != "lr"})
open("trial.json", "w").write(cfg.to_json())
'''


def dvc(work: Path, digits: Path, n: int, slots: int) -> float:
    import yaml

    repo = work / "dvc"
    repo.mkdir(parents=True)
    run = lambda *cmd: subprocess.run(cmd, cwd=repo, env=env(), check=True, capture_output=True, text=True)
    run("git", "init", "-q")
    run("git", "config", "user.email", "bench@example.com")
    run("git", "config", "user.name", "bench")
    run("dvc", "init", "-q")
    (repo / "make_trial.py").write_text(MAKE_TRIAL)
    (repo / "params.yaml").write_text(yaml.safe_dump({"lr": 0.05, "data": str(digits), "training": TRAINING}))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"trial": {
        "cmd": "python make_trial.py && python -m training.launch --standalone --nproc-per-node=1 -m training.train --config trial.json",
        "deps": ["make_trial.py"], "params": ["lr", "data", "training"], "outs": ["out"],
    }}}))
    run("git", "add", "-A")
    run("git", "commit", "-qm", "trial")
    for lr in lrs(n):
        run("dvc", "exp", "run", "--queue", "-S", f"lr={lr}")
    started = time.perf_counter()
    run("dvc", "queue", "start", "-j", str(slots))
    while True:
        status = run("dvc", "queue", "status").stdout
        if not any(word in status for word in ("Queued", "Running")):
            break
        time.sleep(0.5)
    wall = time.perf_counter() - started
    if status.count("Success") < n:
        raise SystemExit(f"dvc queue: not every experiment succeeded:\n{status}\n{run('dvc', 'queue', 'logs', '--help').stdout[:0]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--scale", type=int, default=4, help="ours also runs scale x trials, for the marginal cost")
    parser.add_argument("--skip-dvc", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from training.data import prepare_digits

    with tempfile.TemporaryDirectory(prefix="orchestration-bench-") as tmp:
        work = Path(tmp)
        digits = prepare_digits(work / "digits.npz")
        big = args.trials * args.scale
        # Not counted: the first launch after a change to the code checks the workload (it
        # builds the model and trains a step: torch's import) and remembers that it passed
        # (tasks/workload.py); this makes that record, as a user's first launch does.
        ours(work / "warm-up", digits, 1, args.slots)
        results = {"ours": ours(work, digits, args.trials, args.slots)}
        if not args.skip_dvc:
            results["dvc queue"] = dvc(work / "small", digits, args.trials, args.slots)
        results[f"ours x{args.scale}"] = ours(work, digits, big, args.slots)
        if not args.skip_dvc:
            results[f"dvc queue x{args.scale}"] = dvc(work / "big", digits, big, args.slots)
    print(f"trivial trials on {args.slots} CPU slots")
    print(f"{'system':<10} {'trials':>6} {'wall':>8} {'per trial (slot-s)':>19}")
    for name, wall in results.items():
        n = big if " x" in name else args.trials
        print(f"{name:<10} {n:>6} {wall:>6.1f} s {wall * args.slots / n:>17.2f} s")
    marginal = (results[f"ours x{args.scale}"] - results["ours"]) * args.slots / (big - args.trials)
    print(f"ours, marginal cost of a trial once the campaign is up: {marginal:.2f} slot-s")
    if "dvc queue" in results:
        print(f"ours is {results['dvc queue'] / results['ours']:.2f}x faster than dvc's queue at {args.trials} trials, "
              f"{results[f'dvc queue x{args.scale}'] / results[f'ours x{args.scale}']:.2f}x at {big}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
