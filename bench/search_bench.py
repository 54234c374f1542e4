"""Search (issue 12): time to a target validation accuracy with ASHA, random search without
stopping, and a grid, on the same devices, side by side in one run. Prints; passes nothing.

    .venv/bin/python bench/search_bench.py            # ~4 min on 2 CPU slots
    .venv/bin/python bench/search_bench.py --trials 12 --steps 600

Each strategy is a real campaign (`campaign launch`, its own temp folder, Prefect, MLflow,
torchrun) of `--trials` trials of SmallCNN on digits over the same space (lr log-uniform in
[1e-4, 0.5], width in {4, 8, 16}), on `--slots` CPU slots:

- grid: `--trials` points spread over the space (lr on a log grid x the widths), to the end;
- random: the random sampler's first `--trials` draws, to the end;
- asha: the same draws (same sampler seed), with ASHA stopping trials from `min_steps` on.

Read per strategy: `to target` (seconds from launch to the first evaluation of any trial at
or above `--target`, from MLflow's metric timestamps), `wall` (the whole campaign), the
best validation accuracy, and device-seconds spent (sum of trials' wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def params(folder: Path, name: str, args, digits: Path, strategy: str) -> dict:
    space = {"training.lr": {"log_uniform": [1e-4, 0.5]}, "model.width": {"choice": [4, 8, 16]}}
    spec = {
        "campaign": {"name": name, "seed": args.seed}, "data": {"path": str(digits)}, "model": {"name": "small_cnn", "width": 8},
        "training": {"steps": args.steps, "batch_size": 32, "lr": 0.05, "eval_every": args.eval_every,
                     "checkpoint_every": args.eval_every, "log_every": args.eval_every},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": args.slots},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / "s.json")},
    }
    if strategy == "grid":
        widths = [4, 8, 16]
        n_lr = max(1, math.ceil(args.trials / len(widths)))
        lrs = [round(10 ** (-4 + i * (math.log10(0.5) + 4) / max(1, n_lr - 1)), 6) for i in range(n_lr)]
        spec["grid"] = {"training.lr": lrs, "model.width": widths}
    else:
        spec["search"] = {"strategy": "random", "trials": args.trials, "space": space, "metric": "val_accuracy"}
    if strategy == "asha":
        spec["early_stopping"] = {"rule": "asha", "min_steps": args.min_steps, "reduction_factor": 3}
    return spec


def run(strategy: str, args, digits: Path, work: Path) -> dict:
    import yaml
    from mlflow import MlflowClient

    folder = work / strategy
    folder.mkdir()
    (folder / "params.yaml").write_text(yaml.safe_dump(params(folder, strategy, args, digits, strategy)))
    env = {**os.environ, "CAMPAIGN_LEASE_DB": str(folder / "leases.db"), "PYTHONPATH": str(ROOT)}
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=folder, env=env,
                          capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("campaigns").experiment_id], "tags.`campaign.kind` = 'trial'")
    reached, best, device_s, pruned = [], 0.0, 0.0, 0
    for r in runs:
        history = client.get_metric_history(r.info.run_id, "val_accuracy")
        reached += [m.timestamp / 1000 - started for m in history if m.value >= args.target]
        best = max([best] + [m.value for m in history])
        device_s += (r.info.end_time - r.info.start_time) / 1000
        pruned += r.data.tags.get("campaign.state") == "pruned"
    return {"trials": len(runs), "pruned": pruned, "to_target_s": min(reached) if reached else None, "wall_s": wall,
            "best_val_accuracy": best, "device_s": device_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--min-steps", type=int, default=50)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategies", default="grid,random,asha")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    sys.path.insert(0, str(ROOT))
    from training.data import prepare_digits

    with tempfile.TemporaryDirectory(prefix="search-bench-") as tmp:
        work = Path(tmp)
        digits = prepare_digits(work / "digits.npz")
        results = {s: run(s, args, digits, work) for s in args.strategies.split(",")}
    print(f"{args.trials} trials x {args.steps} steps, SmallCNN on digits, {args.slots} CPU slots; target val_accuracy {args.target}")
    print(f"{'strategy':<8} {'trials':>6} {'pruned':>6} {'to target':>10} {'wall':>8} {'device-s':>9} {'best acc':>9}")
    for name, r in results.items():
        target = f"{r['to_target_s']:.1f} s" if r["to_target_s"] is not None else "never"
        print(f"{name:<8} {r['trials']:>6} {r['pruned']:>6} {target:>10} {r['wall_s']:>6.1f} s {r['device_s']:>8.1f} {r['best_val_accuracy']:>9.4f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
