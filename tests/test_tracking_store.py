"""The campaign's MLflow store is checked before anything runs, never silently recreated.

A truncated or corrupt `mlflow.db`, or one that lacks the runs the campaign's records name,
stops `campaign resume` with exit 2 naming the file and `campaign repair-tracking`, which
moves a broken store aside (kept) and rebuilds the campaign's runs from its files. A brand-new
campaign still gets its store made.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
import yaml

from tasks.mlflow_store import make_from_template
from tasks.records import CampaignRecord, TrialEntry, write_campaign
from tasks.tracking_store import TrackingStoreError, check_tracking_store, missing_runs, set_store_aside, sqlite_problem
from training.config import TrialConfig
from training.layout import trial_files
from training.spec import parse_spec


def spec_for(tmp_path: Path, name: str = "c"):
    return parse_spec({
        "campaign": {"name": name}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 20, "batch_size": 16, "lr": 0.1},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(tmp_path / "runs")},
    })


def store(tmp_path: Path) -> Path:
    assert make_from_template(f"sqlite:///{tmp_path}/mlflow.db")
    return tmp_path / "mlflow.db"


@pytest.fixture(autouse=True)
def the_spec_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_a_sound_store_absent_or_empty_is_no_problem(tmp_path):
    path = tmp_path / "mlflow.db"
    assert sqlite_problem(path) is None and not path.exists()  # absent: nothing made by looking
    path.touch()
    assert sqlite_problem(path) is None  # empty: MLflow makes a store in it
    path.unlink()
    assert sqlite_problem(store(tmp_path)) is None


@pytest.mark.parametrize("damage,words", [
    ("truncate", ["is truncated", "bytes of the"]),
    ("junk", ["is not an SQLite database"]),
    ("pages", ["is corrupt"]),
    ("other", ["not an MLflow store", "runs"]),
    ("directory", ["is not a regular file"]),
    ("fifo", ["is not a regular file"]),
])
def test_a_broken_store_is_named_for_what_is_wrong(tmp_path, damage, words):
    path = tmp_path / "mlflow.db"
    if damage in ("truncate", "junk", "pages"):
        data = store(tmp_path).read_bytes()
        path.write_bytes({"truncate": data[: len(data) // 3],
                          "junk": b"\x00garbage" * 100,
                          "pages": data[:4096] + b"\xa5" * (len(data) - 4096)}[damage])
    elif damage == "other":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE notes (x)")
    elif damage == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)  # sqlite3 would block opening it
    problem = sqlite_problem(path)
    assert problem is not None and all(w in problem for w in words), problem


def campaign_with_runs(tmp_path: Path, spec, parent: str, trial_run: str) -> None:
    runs = spec.tracking.runs_dir
    write_campaign(runs, CampaignRecord(name=spec.campaign.name, trials=(TrialEntry("t1", "lr=0.1", 20),), mlflow_run_id=parent))
    files = trial_files(runs / spec.campaign.name / "t1")
    files.root.mkdir(parents=True)
    config = TrialConfig(trial_id="t1", seed=0, model={}, data={}, steps=20, batch_size=16, lr=0.1, mlflow_run_id=trial_run)
    files.config.write_text(config.to_json())


def test_records_naming_runs_the_store_lacks_stop_the_launch(tmp_path):
    spec = spec_for(tmp_path)
    check_tracking_store(spec)  # a new campaign: no record, no store, nothing to say...
    assert not (tmp_path / "mlflow.db").exists()  # ...and nothing made by the check
    campaign_with_runs(tmp_path, spec, "a" * 32, "b" * 32)
    check_tracking_store(parse_spec({**spec.model_dump(mode="json"), "tracking": {
        **spec.model_dump(mode="json")["tracking"], "mlflow_uri": "file:///elsewhere"}}))  # a store it cannot ask: MLflow's word stands
    for damage in ("absent", "empty", "new store"):
        if damage == "empty":
            (tmp_path / "mlflow.db").touch()
        elif damage == "new store":
            (tmp_path / "mlflow.db").unlink()
            store(tmp_path)
        message = " ".join(str(pytest.raises(TrackingStoreError, check_tracking_store, spec, "p.yaml").value).split())
        assert f"{tmp_path}/mlflow.db does not have the campaign's run {'a' * 32}" in message, message
        assert "1 trial run(s) (t1" in message and "campaign repair-tracking p.yaml" in message, message
    assert missing_runs(f"sqlite:///{tmp_path}/mlflow.db", ["a" * 32]) == ["a" * 32]


def test_a_broken_store_stops_the_launch_and_is_set_aside_whole(tmp_path):
    spec = spec_for(tmp_path)
    path = store(tmp_path)
    path.write_bytes(path.read_bytes()[:5000])
    message = " ".join(str(pytest.raises(TrackingStoreError, check_tracking_store, spec, "p.yaml").value).split())
    assert f"tracking.mlflow_uri: the MLflow store {path} is truncated" in message, message
    assert "`campaign repair-tracking p.yaml` moves it aside (kept)" in message, message
    (tmp_path / "mlflow.db-journal").write_bytes(b"j")
    aside = set_store_aside(path)
    assert aside.name.startswith("mlflow.db.broken-") and aside.read_bytes()[:6] == b"SQLite"
    assert (tmp_path / f"{aside.name}-journal").read_bytes() == b"j" and not path.exists()


def launch(cli, folder: Path, command: str = "resume"):
    return cli(command, "params.yaml", "--no-live", cwd=folder)


@pytest.mark.slow
def test_a_truncated_store_stops_resume_and_repair_brings_the_finished_trials_back(tmp_path, digits_npz):
    from mlflow import MlflowClient

    from conftest import campaign_cli

    runs, db = tmp_path / "runs", tmp_path / "mlflow.db"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "kept"}, "data": {"path": str(digits_npz)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 20, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "eval_every": 10, "log_every": 5},
        "grid": {"training.lr": [0.05, 0.1]}, "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{db}", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    assert not db.exists()
    first = launch(campaign_cli, tmp_path, "launch")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert db.exists()  # a brand-new campaign's store is made as before
    record = json.loads((runs / "kept" / "campaign.json").read_text())
    finals = {t["id"]: json.loads((runs / "kept" / t["id"] / "result.json").read_text())["metrics"] for t in record["trials"]}

    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])  # a disk that filled, a copy cut short
    cut = db.stat().st_size
    refused = launch(campaign_cli, tmp_path)
    output = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert f"{db} is truncated" in output and "campaign repair-tracking params.yaml" in output, output
    assert not any(p.name.startswith("mlflow.db.broken") for p in tmp_path.iterdir())  # nothing moved but by the repair

    repaired = campaign_cli("repair-tracking", "params.yaml", cwd=tmp_path)
    said = " ".join(repaired.stdout.split())
    assert repaired.returncode == 0, repaired.stdout[-3000:] + repaired.stderr[-3000:]
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("mlflow.db.broken-") and not p.name.endswith(("-wal", "-shm"))]
    assert aside.stat().st_size == cut  # the broken store is kept as it was
    assert "2 trial run(s) rebuilt" in said and "campaign resume params.yaml" in said, said

    again = launch(campaign_cli, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "finished 2/2" in again.stdout and "nothing to train" in again.stdout  # from its records: every trial finished
    client = MlflowClient(f"sqlite:///{db}")
    record = json.loads((runs / "kept" / "campaign.json").read_text())
    assert client.get_run(record["mlflow_run_id"]).info.status == "FINISHED"
    for trial in record["trials"]:
        run_id = json.loads((runs / "kept" / trial["id"] / "trial.json").read_text())["mlflow_run_id"]
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == record["mlflow_run_id"]
        for key, value in finals[trial["id"]].items():  # the final metrics, as the trial's result has them
            assert float(run.data.tags[f"final.{key}"]) == pytest.approx(value, rel=1e-5)
            assert run.data.metrics[key] == pytest.approx(value)
        assert run.data.params["training.lr"] == str(trial["overrides"]["training.lr"])
        assert [a.path for a in client.list_artifacts(run_id)] == ["train.log"]


@pytest.mark.slow
def test_a_store_without_the_campaigns_runs_stops_resume_until_repaired(tmp_path, digits_npz):
    from mlflow import MlflowClient

    from conftest import campaign_cli

    runs, db = tmp_path / "runs", tmp_path / "mlflow.db"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "replaced"}, "data": {"path": str(digits_npz)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 10, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "eval_every": 10, "log_every": 5},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{db}", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    first = launch(campaign_cli, tmp_path, "launch")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    db.unlink()
    assert make_from_template(f"sqlite:///{db}")  # another, sound store: the campaign's runs are not in it
    refused = launch(campaign_cli, tmp_path)
    output = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and f"{db} does not have the campaign's run" in output, output
    assert "campaign repair-tracking params.yaml" in output, output

    # A repair stopped between making the trial's run and naming it in the trial's config
    # (here in this process: the config's write fails as a kill would end it)...
    import tasks.tracking_store as tracking_store
    from training.spec import load_spec

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed")

    real_write, tracking_store.write_atomic = tracking_store.write_atomic, killed
    try:
        with pytest.raises(KeyboardInterrupt):
            tracking_store.repair_tracking(load_spec(tmp_path / "params.yaml"))
    finally:
        tracking_store.write_atomic = real_write
    # ...and run again to its end: one run of the trial, not two.
    repaired = campaign_cli("repair-tracking", "params.yaml", cwd=tmp_path)
    assert repaired.returncode == 0, repaired.stdout[-3000:] + repaired.stderr[-3000:]
    assert not any(p.name.startswith("mlflow.db.broken") for p in tmp_path.iterdir())  # a sound store stays where it is
    again = launch(campaign_cli, tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trials = [r for r in MlflowClient(f"sqlite:///{db}").search_runs(
        [MlflowClient(f"sqlite:///{db}").get_experiment_by_name("campaigns").experiment_id]) if r.data.tags.get("campaign.kind") == "trial"]
    assert len(trials) == 1 and trials[0].info.status == "FINISHED" and "final.val_accuracy" in trials[0].data.tags
