"""How soon a launch trains, and how soon a relaunch with nothing to do answers: the default
campaign (params.yaml, a fresh runs folder and MLflow store each round) launched

- cold: a temporary Prefect server of its own (CAMPAIGN_SERVER=off), as every launch did before
  the folder's resident server;
- warm: the folder's resident server already running (started by an uncounted first launch);
- warm without its spares (CAMPAIGN_SPARES=off): the launch runs where it was typed, and
  starts the MLflow hub and the warm workers' zygote, which import MLflow and torch for them,
  as before the spares;
- again with nothing left to train (every trial finished): the no-op relaunch.

Rounds alternate the order of the cases. Before each launch the bench waits until the warm
folder's resident server has its spares ready (tasks/spares.py: it makes them once, while no
launch of the folder runs; each launch is served by forked copies of them), so that no launch
shares the host with their imports. The times are the launch's own `--timings` marks (seconds since
the command's process started): "first training step" is the first step of any trial, seen in
its progress file. Goals (issue 61): first step <= 2 s warm, <= 6 s cold; no-op relaunch <= 1 s.

    .venv/bin/python bench/instant_start.py              # 3 rounds
    .venv/bin/python bench/instant_start.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tasks.spares: where the resident server's spares say they are ready
MARK = re.compile(r"timings\s+([\d.]+) s\s+\(\+[\d.]+ s\)\s+(.*)")


def project(folder: Path, digits: Path) -> Path:
    """The default campaign in `folder`: params.yaml as the repository has it, its data path absolute."""
    folder.mkdir(parents=True)
    spec = yaml.safe_load((ROOT / "params.yaml").read_text())
    spec["data"]["path"] = str(digits)
    (folder / "params.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return folder


def launch(folder: Path, server: str, spares: str = "on") -> tuple[dict[str, float], float]:
    """The launch's --timings marks (phase -> seconds since its start) and its wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "CAMPAIGN_SERVER": server,
           "CAMPAIGN_SPARES": spares, "COLUMNS": "400"}
    env.pop("PREFECT_API_URL", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # Python's default: the project's bytecode cached (some hosts set it)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live", "--timings"], cwd=folder,
                          env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the launch in {folder} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    marks = {}
    for line in done.stdout.splitlines():
        if m := MARK.search(line):
            marks.setdefault(m.group(2).split(" (")[0].strip(), float(m.group(1)))
    return marks, wall


def settle(folder: Path, timeout_s: float = 90.0) -> bool:
    """Wait until the folder's resident server has a spare of each kind ready (False: not in time)."""
    from tasks.spares import KINDS, ready, state_path

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(state_path(folder, kind).exists() and ready(folder, kind) is not None for kind in KINDS):
            return True
        time.sleep(0.2)
    return False


def fresh(folder: Path) -> None:
    """The campaign's runs, store and summary gone: the next launch trains every trial."""
    for name in ("checkpoints", "mlflow.db", "metrics"):
        path = folder / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="instant-start-"))
    digits = work / "digits.npz"
    subprocess.run([sys.executable, "-m", "training.data", "--out", str(digits)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    cold, warm = project(work / "cold", digits), project(work / "warm", digits)
    launch(warm, "on")  # uncounted: starts the warm folder's resident server (and migrates its database)
    cases = [("cold", cold, "off", "on"), ("warm", warm, "on", "on"), ("warm, no spares", warm, "on", "off")]
    firsts: dict[str, list[float]] = {name: [] for name, *_ in cases}
    walls: dict[str, list[float]] = {**{name: [] for name, *_ in cases}, "no-op": []}
    try:
        for round_ in range(args.rounds):
            for name, folder, server, spares in cases[round_ % len(cases):] + cases[:round_ % len(cases)]:
                if not settle(warm):
                    print("  (the resident server's spares were not ready in time)", flush=True)
                fresh(folder)
                marks, wall = launch(folder, server, spares)
                first = marks.get("first training step")
                firsts[name].append(first if first is not None else float("nan"))
                walls[name].append(wall)
                taken = [kind for kind in ("launch", "hub", "zygote") if f"the resident server's spare {kind} taken" in marks]
                print(f"round {round_ + 1} {name}: first training step {first:.2f} s, campaign {wall:.2f} s "
                      f"(load {os.getloadavg()[0]:.1f}; spares taken: {', '.join(taken) or 'none'})", flush=True)
            settle(warm)
            _, wall = launch(warm, "on")  # every trial finished: nothing to do
            walls["no-op"].append(wall)
            print(f"round {round_ + 1} no-op relaunch: {wall:.2f} s", flush=True)
    finally:
        subprocess.run([sys.executable, "-m", "flows.cli", "stop-server"], cwd=warm, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedians of {args.rounds} rounds (load {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores):")
    print(f"  first training step, cold (a temporary Prefect server): {median(firsts['cold'])} s   goal <= 6 s")
    print(f"  first training step, warm (the folder's resident server): {median(firsts['warm'])} s   goal <= 2 s")
    print(f"  first training step, warm without its spares: {median(firsts['warm, no spares'])} s")
    print(f"  no-op relaunch: {median(walls['no-op'])} s   goal <= 1 s")
    print(f"  the whole campaign: cold {median(walls['cold'])} s, warm {median(walls['warm'])} s, "
          f"warm without spares {median(walls['warm, no spares'])} s")


if __name__ == "__main__":
    main()
