"""Records that stay true through kills: a trial's metrics journal is the source MLflow is fed
from, each (key, step) once; the result is made only of what the checkpoint holds.

The kill loop SIGKILLs a campaign's whole process group at random steps (a seeded draw: the
same moments on every run), launches it again, and repeats; its trial's MLflow history and
result must equal an uninterrupted campaign's, key for key and step for step."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from training import metrics_journal
from training.metrics_journal import MetricsJournal, read_journal

from conftest import wait_for


def test_a_replayed_step_is_not_journaled_again_and_the_first_value_stays(tmp_path):
    journal = MetricsJournal(tmp_path / "metrics.jsonl")
    assert journal.admit(10, {"train_loss": 1.0, "lr": 0.1}, 1) == {"train_loss": 1.0, "lr": 0.1}
    assert journal.admit(20, {"train_loss": 0.5}, 2) == {"train_loss": 0.5}
    journal.close()
    resumed = MetricsJournal(tmp_path / "metrics.jsonl")  # a segment resumed from step 10's checkpoint
    assert resumed.admit(20, {"train_loss": 0.6, "val_loss": 0.7}, 3) == {"val_loss": 0.7}  # a new key at a replayed step
    assert resumed.admit(30, {"train_loss": 0.4}, 4) == {"train_loss": 0.4}
    resumed.close()
    assert [(k, s, v) for k, s, v, _ in read_journal(tmp_path / "metrics.jsonl")] == [
        ("train_loss", 10, 1.0), ("lr", 10, 0.1), ("train_loss", 20, 0.5), ("val_loss", 20, 0.7), ("train_loss", 30, 0.4)]


def test_a_line_cut_short_by_a_kill_is_dropped_and_the_next_append_starts_clean(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":10,"t":1,"m":{"train_loss":1.0}}\n{"step":20,"t":2,"m":{"train_lo')
    journal = MetricsJournal(path)
    assert journal.last_step == {"train_loss": 10}
    journal.admit(20, {"train_loss": 0.5}, 3)
    journal.close()
    assert [(k, s) for k, s, _, _ in read_journal(path)] == [("train_loss", 10), ("train_loss", 20)]


def test_the_journal_is_bounded_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_journal, "MAX_BYTES", 100)
    journal = MetricsJournal(tmp_path / "metrics.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10):
            journal.admit(step, {"train_loss": 1.0}, 1)
    journal.close()
    assert (tmp_path / "metrics.jsonl").stat().st_size <= 100
    assert len([w for w in caught if "reached" in str(w.message)]) == 1


def test_mlflow_gets_each_key_and_step_once_whatever_is_sent_again(tmp_path):
    """The senders' rule (hub and sink alike): a (key, step) the run holds is not logged again,
    a hole is filled."""
    from mlflow import MlflowClient

    from training.metrics import _Runs

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("e")).info.run_id
    for step in (0, 20):  # what reached MLflow before a kill: step 10 was lost in flight
        client.log_metric(run, "train_loss", float(step), step=step)
    items = [{"uri": uri, "run": run, "key": "train_loss", "value": float(s), "timestamp": 1, "step": s} for s in (0, 10, 20, 30)]
    _Runs().send(items + items[1:2])  # the journal fed again, and a step twice in one batch
    history = sorted((m.step, m.value) for m in client.get_metric_history(run, "train_loss"))
    assert history == [(0, 0.0), (10, 10.0), (20, 20.0), (30, 30.0)]


def test_steps_a_failed_batch_did_not_log_are_logged_when_sent_again(tmp_path):
    """A store that refuses a batch keeps none of its steps (here the run is deleted for a
    while; a store locked by another writer refuses the same way, after its busy timeout):
    the sink must not count them as held, or the journal fed again skips them for good."""
    from mlflow import MlflowClient

    from training.metrics import _Runs

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("e")).info.run_id
    runs = _Runs()
    runs.steps(uri, run)  # what the run holds, read as at the sink's first send
    items = [{"uri": uri, "run": run, "key": "train_loss", "value": float(s), "timestamp": 1, "step": s} for s in (10, 20)]
    client.delete_run(run)
    runs.send(items)  # refused: the run is not active
    client.restore_run(run)
    assert client.get_metric_history(run, "train_loss") == []
    runs.send(items)  # the journal fed again through the same sink
    assert sorted((m.step, m.value) for m in client.get_metric_history(run, "train_loss")) == [(10, 10.0), (20, 20.0)]


# --- the kill loop ------------------------------------------------------------------------

STEPS, LOG_EVERY, CHECKPOINT_EVERY = 300, 10, 50
TIMINGS = ("step_time_s",)  # measured, not computed: they differ between any two runs
# And the signature, which covers them; the checkpoint's path names the campaign's folder.
RESULT_TIMINGS = ("wall_s", "resumed_from_step", "checkpoint", "peak_device_memory_bytes", "device_memory", "hmac")


def write_campaign(folder: Path, digits: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "kills"}, "data": {"path": str(digits)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": STEPS, "batch_size": 16, "lr": 0.05, "reduction": "exact", "log_every": LOG_EVERY,
                     "checkpoint_every": CHECKPOINT_EVERY, "eval_every": 100},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"),
                     "summary": str(folder / "s.json")},
    }))


def launch(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=folder,
                            stdout=open(folder / "out.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)


def trial_dir(folder: Path) -> Path:
    return next(p for p in (folder / "runs" / "kills").iterdir() if (p / "trial.json").exists())


def progress_step(folder: Path) -> int:
    try:
        return int(json.loads((trial_dir(folder) / "progress.json").read_text())["step"])
    except (StopIteration, OSError, ValueError, KeyError):
        return -1


def history(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    run_id = _trial_run(client)
    keys = [m.key for m in client.get_run(run_id).data.to_proto().metrics]
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in keys if not key.startswith("system/")}


def _trial_run(client) -> str:
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`campaign.kind` = 'trial'")
    assert len(runs) == 1, [r.data.tags for r in runs]
    return runs[0].info.run_id


def result(folder: Path) -> dict:
    raw = json.loads((trial_dir(folder) / "result.json").read_text())
    kept = {k: v for k, v in raw.items() if k not in RESULT_TIMINGS}
    kept["metrics"] = {k: v for k, v in raw["metrics"].items() if k not in TIMINGS}
    return kept


@pytest.mark.slow
def test_sigkills_at_random_steps_leave_the_history_and_result_of_an_uninterrupted_run(tmp_path, digits_npz):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    write_campaign(whole, digits_npz)
    write_campaign(killed, digits_npz)
    assert launch(whole).wait(timeout=900) == 0, (whole / "out.log").read_text()[-4000:]

    draw = random.Random(59)
    at = sorted(draw.sample(range(LOG_EVERY, STEPS - LOG_EVERY), 3))  # the steps the kills come after
    for step in at:
        proc = launch(killed)
        try:
            wait_for(lambda: progress_step(killed) >= step or proc.poll() is not None, 600, f"step {step}")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the campaign, its hub, its Prefect server: all at once
            proc.wait()
    assert launch(killed).wait(timeout=900) == 0, (killed / "out.log").read_text()[-4000:]

    expected, got = history(whole), history(killed)
    assert sorted(got) == sorted(expected)
    for key in expected:
        steps = [s for s, _ in got[key]]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice"
        assert steps == [s for s, _ in expected[key]], f"{key}: steps {sorted(set(s for s, _ in expected[key]) - set(steps))} missing"
        if key not in TIMINGS:
            assert got[key] == expected[key], key
    assert result(killed) == result(whole)
