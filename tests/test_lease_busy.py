"""A lease database locked past its busy timeout is waited out, not fatal.

Another process holds the SQLite lease file in an exclusive transaction (a real lock, from
another connection) for longer than the store's busy timeout while a campaign runs: the
campaign goes on, a trial that finishes meanwhile is recorded finished (on disk and in
MLflow) while the lock is still held, and the campaign ends in order once the file frees.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import wait_for

pytestmark = pytest.mark.slow  # a real campaign: torchrun trials, Prefect, MLflow

BUSY_S = 1.0  # the store's busy timeout in the campaign under test


def mlflow_status(tmp_path: Path, trial_id: str) -> str | None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("campaigns")
    runs = client.search_runs([experiment.experiment_id], f"tags.`campaign.trial_id` = '{trial_id}'") if experiment else []
    return runs[0].info.status if runs else None


def test_a_trial_finishing_while_the_lease_file_is_locked_is_recorded_finished(tmp_path, digits_npz):
    runs, db = tmp_path / "runs", tmp_path / "leases.db"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "locked"}, "data": {"path": str(digits_npz)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 80, "batch_size": 16, "lr": 0.05, "checkpoint_every": 40, "eval_every": 40},
        "grid": {"training.lr": [0.05, 0.1]},  # two trials on both slots: one runs, one waits (the loop polls the leases)
        "resources": {"devices": 2}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    env = {**os.environ, "CAMPAIGN_LEASE_DB": str(db), "CAMPAIGN_LEASE_BUSY_S": str(BUSY_S)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        first = wait_for(lambda: next(iter(runs.glob("locked/*/progress.json")), None), 240, "the first trial to train")
        trial_dir = first.parent
        lock = sqlite3.connect(db, isolation_level=None, timeout=30)
        lock.execute("BEGIN EXCLUSIVE")  # every write transaction of the campaign now waits, then times out
        locked_at = time.time()
        try:
            wait_for(lambda: (trial_dir / "result.json").exists() or proc.poll() is not None, 240, "the trial's result")
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            # Still locked: the loop has met the lock (more than its busy timeout) and goes on.
            wait_for(lambda: time.time() - locked_at > 4 * BUSY_S, 30, "the lock to outlast the busy timeout")
            wait_for(lambda: "finished" in (trial_dir / "record.json").read_text(), 60, "the finished trial's record")
            wait_for(lambda: mlflow_status(tmp_path, trial_dir.name) == "FINISHED", 60, "its MLflow run FINISHED")
            assert proc.poll() is None, proc.stdout.read()[-4000:]
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "finished 2/2 trials" in out, out[-4000:]
    # The campaign met the lock and waited it out: its loop's own write (a queue mark, an
    # acquire), or the finished trial's release (the loop's polls read a snapshot: they never wait).
    assert "the lease database is locked" in out or "waits for the lease file" in out, out[-4000:]
