"""A new SQLite MLflow store is copied from an empty one MLflow made, and is MLflow's own."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mlflow import MlflowClient

from tasks.mlflow_store import make_from_template


def test_a_new_store_is_copied_from_the_template_and_has_its_own_default_experiment(tmp_path, monkeypatch):
    monkeypatch.setenv("CAMPAIGN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert make_from_template("sqlite:///a/mlflow.db")  # relative to the working folder, as MLflow reads it
    assert list((tmp_path / "cache").glob("mlflow-*-empty.db"))  # made once, by MLflow
    assert make_from_template(f"sqlite:///{tmp_path}/b/mlflow.db")

    for folder in ("a", "b"):
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/{folder}/mlflow.db")
        (default,) = client.search_experiments()
        # MLflow made the default experiment when it opened the copy: this store's artifact
        # folder (./mlruns of the working folder), not the template's in the cache.
        assert default.experiment_id == "0" and "cache" not in default.artifact_location
        run = client.create_run(client.create_experiment(f"exp-{folder}"), tags={"t": folder})
        client.log_metric(run.info.run_id, "loss", 0.5, step=1)
        assert client.get_metric_history(run.info.run_id, "loss")[0].value == 0.5
    # The two stores are separate files: each holds its own run only.
    assert sorted(e.name for e in MlflowClient(tracking_uri="sqlite:///a/mlflow.db").search_experiments()) == ["Default", "exp-a"]


def test_an_existing_store_and_other_stores_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("CAMPAIGN_CACHE_DIR", str(tmp_path / "cache"))
    existing = tmp_path / "mlflow.db"
    existing.write_bytes(b"not ours to replace")
    assert not make_from_template(f"sqlite:///{existing}")
    assert existing.read_bytes() == b"not ours to replace"
    assert not make_from_template(f"sqlite:///{tmp_path}/missing-folder/mlflow.db")
    assert not (tmp_path / "missing-folder").exists()
    for uri in ("http://127.0.0.1:5000", "file:///tmp/mlruns", "sqlite:///:memory:", "postgresql://u@h/db"):
        assert not make_from_template(uri)
    assert not (tmp_path / "cache").exists()  # nothing made for stores it does not make
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left behind


def test_a_store_deleted_by_hand_leaves_no_log_for_the_new_one_and_a_closed_one_is_one_whole_file(tmp_path):
    """The stores are kept in WAL mode: a new store made where one was deleted (its -wal and
    -shm left behind) starts empty, and a store's log is folded into its file as the process
    that wrote it exits."""
    import subprocess
    import sys

    from tasks.mlflow_store import make_from_template

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    write = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
             f"from tasks.tracking import open_campaign_run\n"
             f"open_campaign_run({uri!r}, 'e', 'c', {{}}, 1)\n")
    subprocess.run([sys.executable, "-c", write], check=True, timeout=120)
    assert not Path(f"{db}-wal").exists() or Path(f"{db}-wal").stat().st_size == 0  # folded as it exited
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    Path(f"{db}-wal").write_bytes(b"an old log")  # what a store deleted by hand leaves
    db.unlink()
    assert make_from_template(uri) and not Path(f"{db}-wal").exists()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
