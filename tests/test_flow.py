"""The campaign flow end to end: Prefect (test harness), torchrun trials, MLflow, records."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from cluster.leases import LeaseStore
from tasks.records import campaign_status
from tasks.records import read_allocations
from tasks.timeline import intervals as timeline_intervals
from training.manifest import latest_valid_checkpoint

pytestmark = pytest.mark.slow  # real campaigns, torchrun or elastic trials: `make test-fast` skips them


def write_params(root: Path, data: Path) -> Path:
    params = {
        "campaign": {"name": "flow-test", "seed": 3},
        "data": {"path": str(data)},
        "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 30, "batch_size": 32, "lr": 0.05, "checkpoint_every": 10, "eval_every": 10, "log_every": 5},
        "grid": {"training.lr": [0.05, 0.2], "model.width": [4, 8]},
        "resources": {"devices": 1},
        "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "flow-test",
                     "runs_dir": str(root / "runs"), "summary": str(root / "metrics.json"),
                     "system_metrics_every_s": 0.2},
    }
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def prefect_flow_run_name(flow_run_id) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        return prefect.read_flow_run(flow_run_id).name


def test_grid_runs_as_ddp_trials_tracked_in_mlflow(tmp_path, digits_npz, prefect_backend, monkeypatch):
    from flows.run.campaign import campaign_flow

    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path, digits_npz)
    state = campaign_flow(str(params), return_state=True)
    summary = state.result()
    assert summary["trials"] == 4 and summary["finished"] == 4 and summary["failed"] == 0
    # The flow run carries the campaign as a markdown table: every trial, its state and MLflow run.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId, TaskRunFilter, TaskRunFilterFlowRunId

    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as prefect:
        artifacts = {a.key: a for a in prefect.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))}
        task_runs = prefect.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))
        read = lambda: {t.name: [log.message for log in prefect.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[t.id])))]
                        for t in task_runs}
        logs, deadline = read(), time.time() + 30
        while not all(any(": finished 30 steps: " in m for m in ms) for ms in logs.values()) and time.time() < deadline:
            time.sleep(0.5)  # Prefect ships logs to its API in batches, after the fact
            logs = read()
    assert set(artifacts) == {"campaign-flow-test", "campaign-flow-test-timeline"}
    artifact = artifacts["campaign-flow-test"]
    assert artifact.data.count("| finished |") == 4
    assert f"best **{summary['best']['trial']}**" in artifact.data
    timeline = json.loads(artifacts["campaign-flow-test-timeline"].data)  # who held which device when, as a table
    assert len(timeline) == 4 and {row["ended_by"] for row in timeline} == {"end"}
    # One task run per trial, and the trial's own log on it (train.log, line by line).
    assert len(task_runs) == 4
    # Runs told apart in Prefect's lists: the flow run by its campaign and launch, a task run by its trial.
    assert prefect_flow_run_name(flow_run_id) == "flow-test · launch 1"
    trial_ids = {t["id"] for t in json.loads((tmp_path / "runs" / "flow-test" / "campaign.json").read_text())["trials"]}
    assert {t.name for t in task_runs} == trial_ids
    assert all(set(t.tags) == {"campaign:flow-test"} for t in task_runs)
    for name, messages in logs.items():
        assert any(": world size 1, fresh start" in m for m in messages), (name, messages)
        assert any(": step 15/30: train_loss " in m for m in messages), (name, messages)  # the log follows training
        assert any(": finished 30 steps: " in m for m in messages), (name, messages)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("flow-test")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("campaign.kind") == "campaign"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    # The parent's outcome as tags and summary.json; no one-point metrics to crowd the compare view's charts.
    assert parents[0].data.metrics == {} and parents[0].data.tags["summary.finished"] == "4"
    assert parents[0].data.tags["summary.best.trial"] in {c.data.tags["campaign.trial_id"] for c in children}
    assert "summary.json" in {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow's UI opens it on its training runs
    # The record names the flow run and the MLflow experiment: the live view links to them.
    record = json.loads((tmp_path / "runs" / "flow-test" / "campaign.json").read_text())
    assert record["flow_run_id"] == str(flow_run_id) and record["mlflow_experiment_id"] == exp.experiment_id
    assert record["mlflow_run_id"] == parents[0].info.run_id
    timeline = {a.path for a in client.list_artifacts(parents[0].info.run_id, "timeline")}
    assert timeline == {"timeline/timeline.png", "timeline/timeline.html"}  # who held which device when
    assert [a.path for a in client.list_artifacts(parents[0].info.run_id, "curves")] == ["curves/curves.png"]  # every trial's curves
    assert len(children) == 4
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert child.info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(child.info.run_id)] == ["train.log"]  # the trial's log, on its page
        assert 0.0 < float(child.data.tags["final.val_accuracy"]) <= 1.0  # the final values: tags, not one-point metrics
        assert not any(k.startswith("final") for k in child.data.metrics)
        assert child.data.params["training.lr"] in ("0.05", "0.2")
        assert child.data.tags["world_size"] == "1"
        # Metrics arrived from rank 0, batched: one point every log_every (5) steps.
        history = client.get_metric_history(child.info.run_id, "train_loss")
        assert sorted(m.step for m in history) == list(range(5, 31, 5))
        # Evaluations at the steps they ran (eval_every 10), not repeated at each log step.
        assert sorted(m.step for m in client.get_metric_history(child.info.run_id, "val_accuracy")) == [10, 20, 30]
        # System metrics of exactly its own CPU slot, under MLflow's names.
        system = {k for k in child.data.metrics if k.startswith("system/")}
        cores = {"system/cpu_utilization_percentage", "system/cpu_0_utilization_percentage"}  # one slot, no GPU
        assert cores <= system <= cores | {"system/trial_memory_rss_megabytes"}, system

    rows = campaign_status(tmp_path / "runs", "flow-test")
    assert len(rows) == 4
    for row in rows:
        assert row.state == "finished" and row.step == 30
        trial_dir = tmp_path / "runs" / "flow-test" / row.trial_id
        assert latest_valid_checkpoint(trial_dir / "checkpoints").name == "step-00000030"
        assert len(row.devices) == 1
    # Two CPU slots, one device per trial: trials ran side by side, never on the same slot.
    intervals = []
    for row in rows:
        record = json.loads((tmp_path / "runs" / "flow-test" / row.trial_id / "record.json").read_text())
        assert record["attempts"] == 1
        intervals += record["intervals"]
    overlapping = [(a, b) for i, a in enumerate(intervals) for b in intervals[i + 1:] if a["start"] < b["end"] and b["start"] < a["end"]]
    for a, b in overlapping:
        assert not set(a["devices"]) & set(b["devices"]), f"one device given to two trials at once: {a} {b}"
    # The scheduler gave both free slots at once (its allocation log); whether the two processes'
    # lives overlapped as well depends on the machine's load (a 2 s trial may end first), so the
    # side-by-side check reads what was decided, not what the OS happened to run.
    bars = timeline_intervals(read_allocations(tmp_path / "runs" / "flow-test"))
    held_together = [(a, b) for i, a in enumerate(bars) for b in bars[i + 1:] if a.trial != b.trial and a.start < b.end and b.start < a.end]
    assert held_together, "no two trials held devices at the same time on two free slots"
    assert all(a.device != b.device for a, b in held_together), held_together
    assert LeaseStore().leases() == []  # every lease released

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["finished"] == 4 and "per_trial" not in metrics  # each trial's figures in a file of its own
    assert {p.stem for p in (tmp_path / "metrics-trials").iterdir()} == {r.trial_id for r in rows}

    exported_is_the_best_trial_and_reproduces_its_accuracy(tmp_path, digits_npz, summary["best"])

    # Launching the same spec again recomputes nothing and adds no runs.
    again = campaign_flow(str(params))
    assert again["finished"] == 4
    runs_after = client.search_runs([exp.experiment_id])
    assert len(runs_after) == 5
    for row in campaign_status(tmp_path / "runs", "flow-test"):
        record = json.loads((tmp_path / "runs" / "flow-test" / row.trial_id / "record.json").read_text())
        assert record["attempts"] == 1


def exported_is_the_best_trial_and_reproduces_its_accuracy(root: Path, digits: Path, best: dict) -> None:
    """`campaign export` writes the best trial's weights to a file `torch.load` reads with its
    safe default (weights_only); the model built from the file's spec with those weights scores
    the trial's reported validation accuracy on the same split. Exporting again replaces it; a
    file that is not an export is never written over."""
    import numpy as np
    import torch

    from conftest import campaign_cli
    from training.workload import build_model

    done = campaign_cli("export", "--runs-dir", str(root / "runs"), cwd=root)
    path = root / "exports" / "flow-test" / f"{best['trial']}.pt"
    assert done.returncode == 0 and str(path.relative_to(root)) in " ".join(done.stdout.split()), done.stdout + done.stderr
    exported = torch.load(path, weights_only=True)
    assert (exported["format"], exported["trial_id"], exported["step"]) == ("campaign-export/1", best["trial"], 30)
    assert exported["metrics"]["val_accuracy"] == pytest.approx(best["val_accuracy"])
    model = build_model(exported["model_spec"])
    model.load_state_dict(exported["model"])  # strict: every weight, no stranger
    split = np.load(digits)
    with torch.no_grad():
        predicted = model.eval()(torch.from_numpy(split["val_x"])).argmax(-1)
    assert (predicted == torch.from_numpy(split["val_y"])).float().mean().item() == pytest.approx(best["val_accuracy"], abs=1e-6)

    assert campaign_cli("export", best["trial"], "--runs-dir", str(root / "runs"), cwd=root).returncode == 0  # again: replaced
    foreign = root / "notes.pt"
    foreign.write_text("my notes")
    refused = campaign_cli("export", "--runs-dir", str(root / "runs"), "--out", str(foreign), cwd=root)
    assert refused.returncode == 2 and "is not an export of a trial" in refused.stderr and foreign.read_text() == "my notes"


def test_two_device_trial_waits_for_two_then_starts_with_both(tmp_path, digits_npz, prefect_backend, monkeypatch):
    import threading
    import time

    from cluster.inventory import discover
    from flows.run.campaign import campaign_flow

    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path, digits_npz)
    raw = yaml.safe_load(params.read_text())
    raw["campaign"]["name"] = "waits"
    raw["grid"] = {"training.lr": [0.1]}
    raw["training"].update(steps=10)
    raw["resources"]["devices"] = 2
    params.write_text(yaml.safe_dump(raw))

    inventory = discover(cpu_slots=2)
    capacity = {d.id: d.memory_bytes for d in inventory.devices}
    store = LeaseStore()
    first = inventory.devices[0].id
    assert store.acquire("another-campaign/trial", {first: capacity[first]}, capacity)  # held by this live process
    released_at = []

    def release_later():
        time.sleep(4)
        released_at.append(time.time())
        store.release("another-campaign/trial")

    threading.Thread(target=release_later, daemon=True).start()
    summary = campaign_flow(str(params))
    assert summary["finished"] == 1

    (row,) = campaign_status(tmp_path / "runs", "waits")
    record = json.loads((tmp_path / "runs" / "waits" / row.trial_id / "record.json").read_text())
    (interval,) = record["intervals"]
    assert sorted(interval["devices"]) == sorted(capacity)  # both slots, as one gang
    assert interval["start"] >= released_at[0]  # not before the other holder let go
    assert "world size 2" in (tmp_path / "runs" / "waits" / row.trial_id / "train.log").read_text()
