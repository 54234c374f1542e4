"""What a short trial's bookkeeping costs in the campaign's SQLite stores, side by side.

- MLflow: a trial's run opened and closed (`open_trial_run` + `close_trial_run`, as the
  campaign's hub makes them) on a store in WAL mode (tasks.tracking's) against SQLite's default
  rollback journal.
- Optuna: a trial's first report and pruning check (`training.pruning.Pruning`, ASHA, each
  trial told pruned before the next is asked, as a search's are) through the study's journal
  (`training.pruning.storage`) against Optuna's SQLite storage in WAL mode, each kept per
  process (the study's storage before the journal).

Each side in a fresh process, alternating, `--rounds` times; prints the medians and their ratio.

    .venv/bin/python bench/store_commits.py --rounds 3
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

ROOT = Path(__file__).resolve().parent.parent
TRIALS = 40


def mlflow_side(wal: bool) -> float:
    """Median ms per trial's run opened and closed."""
    from tasks import tracking
    from tasks.grid import expand_grid
    from training.spec import parse_spec

    if not wal:
        tracking._sqlite_in_wal_mode = lambda: None  # SQLite's default: a rollback journal per commit
    uri = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    spec = parse_spec({"campaign": {"name": "c"}, "model": {"name": "mlp"}, "training": {"steps": 20, "batch_size": 8, "lr": 0.1},
                       "grid": {"training.lr": [0.001 * i for i in range(1, TRIALS + 1)]}})
    parent = tracking.open_campaign_run(uri, "e", "c", {}, TRIALS)
    took = []
    for trial in expand_grid(spec):
        started = time.perf_counter()
        run = tracking.open_trial_run(uri, parent, "c", trial)
        tracking.close_trial_run(uri, run, {"checkpoint": "x", "metrics": {"val_loss": 0.5}, "steps": 20}, ["cpu:0"])
        took.append(time.perf_counter() - started)
    return statistics.median(took[5:]) * 1e3


def pruning_side(kind: str) -> float:
    """Median ms per trial's first report and pruning check."""
    import functools
    import sqlite3

    import optuna

    from training import pruning
    from training.files import commit_to_wal

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder = tempfile.mkdtemp()
    if kind == "sqlite":
        def wal_connection(path: str) -> sqlite3.Connection:
            conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
            commit_to_wal(conn)
            return conn

        path = f"{folder}/search.db"
        kept = optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"creator": functools.partial(wal_connection, path)})
        pruning.storage = lambda _path: kept
    else:
        path = f"{folder}/search.journal"
    study = optuna.create_study(storage=pruning.storage(path), study_name="s",
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=25, reduction_factor=3))
    took = []
    for i in range(TRIALS // 2):
        trial_id = study.ask()._trial_id
        trial = pruning.Pruning({"storage": path, "study": "s", "trial_id": trial_id, "metric": "val_loss", "rule": "asha",
                                 "min_steps": 25, "reduction_factor": 3, "max_steps": 300})
        started = time.perf_counter()
        trial.should_stop(25, {"val_loss": 1.0 / (i + 1)})
        took.append(time.perf_counter() - started)
        study.tell(trial._optuna_trial().number, state=optuna.trial.TrialState.PRUNED)
    return statistics.median(took[2:]) * 1e3


SIDES = {"mlflow wal": lambda: mlflow_side(True), "mlflow rollback journal": lambda: mlflow_side(False),
         "study journal": lambda: pruning_side("journal"), "study sqlite": lambda: pruning_side("sqlite")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(SIDES[args.side]()))
        return
    print(f"command: {' '.join(sys.argv)}\ndate: {time.strftime('%Y-%m-%d %H:%M')}; load {os.getloadavg()[0]:.1f}", flush=True)
    got: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            done = subprocess.run([sys.executable, __file__, "--side", side], cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, check=True)
            got[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {side: statistics.median(values) for side, values in got.items()}
    for side, values in got.items():
        print(f"{side:26s} {median[side]:7.1f} ms median ({', '.join(f'{v:.1f}' for v in values)})")
    print(f"run opened and closed: WAL {median['mlflow wal'] / median['mlflow rollback journal']:.2f}x the rollback journal's time")
    print(f"first report and check: journal {median['study journal'] / median['study sqlite']:.2f}x SQLite's time")


if __name__ == "__main__":
    main()
