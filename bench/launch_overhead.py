"""What a campaign spends on itself (issue 26): from `campaign launch` to its first trial's
start, and from its last trial's end to the command's return, on a tiny campaign (2 MLP
trials of 20 steps on 2 CPU slots, a fresh MLflow store and runs folder each round).

    .venv/bin/python bench/launch_overhead.py                       # this checkout, 5 rounds
    .venv/bin/python bench/launch_overhead.py --against /tmp/before  # and another checkout, rounds alternating
    .venv/bin/python bench/launch_overhead.py --trials 8 --steps 2 --prestart-both  # warm workers started ahead, or not

Starts and ends come from the campaign's own allocations.jsonl; the launch and the return
are the wall clock around the command. Each side has one Prefect home for all its rounds,
made by a launch that is not counted (Prefect makes its database once, at a machine's first
launch). Goals: first start <= 5 s, return <= 2 s after the
last end. Prints medians (and every round); passes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def one_launch(repo: Path, folder: Path, digits: Path, prefect_home: Path, trials: int = 2, steps: int = 20,
               extra_env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """(first start, return after the last end, the command's wall), seconds."""
    folder.mkdir(parents=True)
    every = max(1, steps // 2)
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "overhead"}, "data": {"path": str(digits)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": steps, "batch_size": 32, "lr": 0.1, "eval_every": every, "checkpoint_every": every},
        "grid": {"training.lr": [round(0.05 * (i + 1), 4) for i in range(trials)]}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "experiment": "overhead", "runs_dir": "runs",
                     "summary": "summary.json"},
    }))
    env = {**os.environ, "PYTHONPATH": str(repo), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PREFECT_HOME": str(prefect_home), **(extra_env or {})}
    env.pop("PREFECT_API_URL", None)
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=folder, env=env,
                          capture_output=True, text=True)
    returned = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{repo}: the launch failed\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    events = [json.loads(line) for line in (folder / "runs" / "overhead" / "allocations.jsonl").read_text().splitlines() if line.strip()]
    first_start = min(e["time"] for e in events if e["reason"] == "start")
    last_end = max(e["time"] for e in events if e["reason"] == "end")
    return first_start - started, returned - last_end, returned - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, default=None, help="another checkout of the project, measured in the same rounds")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prestart-both", action="store_true",
                        help="this checkout twice: the first trials' warm workers started ahead, and not (CAMPAIGN_PRESTART_WORKERS)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from training.data import prepare_digits

    sides = {"this checkout": (ROOT, {})} | ({f"{args.against}": (args.against.resolve(), {})} if args.against else {})
    if args.prestart_both:
        sides = {"workers started ahead": (ROOT, {"CAMPAIGN_PRESTART_WORKERS": "1"}),
                 "workers started by the trials": (ROOT, {"CAMPAIGN_PRESTART_WORKERS": "0"})}
    figures: dict[str, list[tuple[float, float, float]]] = {label: [] for label in sides}
    with tempfile.TemporaryDirectory(prefix="launch-overhead-") as tmp:
        digits = prepare_digits(Path(tmp) / "digits.npz")
        homes = {label: Path(tmp) / f"prefect-{i}" for i, label in enumerate(sides)}
        for label, (repo, env) in sides.items():  # not counted: makes each side's Prefect database, as a first launch does once
            one_launch(repo, Path(tmp) / f"warm-up-{homes[label].name}", digits, homes[label], args.trials, args.steps, env)
        for r in range(args.rounds):
            order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
            for label, (repo, env) in order:
                figures[label].append(one_launch(repo, Path(tmp) / f"{r}-{homes[label].name}", digits, homes[label],
                                                 args.trials, args.steps, env))
                start, end, wall = figures[label][-1]
                print(f"round {r} {label}: first trial started {start:.1f} s after the launch; returned {end:.1f} s after "
                      f"the last end; {wall:.1f} s in all", flush=True)
    for label, rounds in figures.items():
        print(f"{label}: first start {statistics.median(s for s, _, _ in rounds):.1f} s (goal <= 5), return "
              f"{statistics.median(e for _, e, _ in rounds):.1f} s after the last end (goal <= 2), "
              f"{statistics.median(w for _, _, w in rounds):.1f} s in all, medians of {len(rounds)}")


if __name__ == "__main__":
    main()
