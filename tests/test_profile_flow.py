"""`campaign profile` end to end: Prefect (test harness), a real torchrun DDP profile, MLflow on SQLite."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from torch import nn

from cluster.leases import LeaseStore
from cluster.types import Device, Inventory
from flows.run.profile import TrialNotFoundError, profile_flow
from training.spec import load_spec
from tasks.grid import expand_grid
from tasks.tracking import open_campaign_run, open_trial_run
from training.models import MODELS
from training.profiler import DdpProfile, ModelProfile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_params(root: Path, name: str, devices: int, data: Path) -> Path:
    params = {
        "campaign": {"name": name, "seed": 1},
        "data": {"path": str(data)},  # the profile runs on real samples
        "model": {"name": "small_cnn", "width": 4, "dropout": 0.1},
        "training": {"steps": 10, "batch_size": 16, "lr": 0.05},
        "grid": {"training.lr": [0.05, 0.2]},
        "resources": {"devices": devices},
        "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": name, "runs_dir": str(root / "runs")},
    }
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def markdown_artifacts(flow_run_id) -> list:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return [a for a in found if a.type == "markdown"]


def test_a_finished_trial_gets_its_profile_in_its_own_mlflow_run_and_in_prefect(tmp_path, digits_npz, prefect_backend, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path, "prof", devices=2, data=digits_npz)
    spec = load_spec(params)
    trial = expand_grid(spec)[1]
    uri = spec.tracking.mlflow_uri
    client = MlflowClient(uri)
    # The campaign ran before: its parent and child runs exist and are finished.
    parent_id = open_campaign_run(uri, "prof", "prof", spec.grid, 2)
    run_id = open_trial_run(uri, parent_id, "prof", trial)
    for rid in (parent_id, run_id):
        client.set_terminated(rid, "FINISHED")
    ended = {rid: client.get_run(rid).info.end_time for rid in (parent_id, run_id)}

    state = profile_flow(str(params), trial.id, return_state=True)
    summary = state.result()
    result = summary.result
    assert result is not None and result.ddp_error is None
    assert summary.trial_id == trial.id and len(summary.devices) == 2

    # A run of its own under the campaign's: the trial's run is untouched (its charts stay its
    # training curves), and the campaign's runs keep their finished state.
    profile_run = client.get_run(summary.mlflow_run_id)
    assert summary.mlflow_run_id not in (parent_id, run_id)
    assert profile_run.info.status == "FINISHED" and profile_run.info.run_name == f"profile {trial.label}"
    tags = profile_run.data.tags
    assert (tags["mlflow.parentRunId"], tags["campaign.kind"], tags["campaign.profiled_trial"]) == (parent_id, "profile", trial.id)
    assert "campaign.trial_id" not in tags  # a trial's run is found by that tag: this is not one
    assert len(client.search_runs([client.get_experiment_by_name("prof").experiment_id])) == 3
    for rid in (parent_id, run_id):
        info = client.get_run(rid).info
        assert info.status == "FINISHED" and info.end_time == ended[rid]
    assert client.get_run(run_id).data.metrics == {} and client.list_artifacts(run_id) == []
    assert profile_run.data.metrics == {}  # no two-point "curves" over device counts: its figures and tags say it
    logged = {a.path for a in client.list_artifacts(summary.mlflow_run_id, "profile")}
    assert {"profile/profile.md", "profile/roofline.png", "profile/profile.json", "profile/ddp.json", "profile/predictions.json"} <= logged
    markdown = Path(client.download_artifacts(summary.mlflow_run_id, "profile/profile.md", str(tmp_path / "dl"))).read_text()
    assert markdown == result.markdown
    for layer in ("features.0", "features.2", "head.2"):
        assert f"| {layer} |" in markdown
    assert "DDP at 2 process(es) (gloo), global batch 16" in markdown
    roofline = client.download_artifacts(summary.mlflow_run_id, "profile/roofline.png", str(tmp_path / "dl"))
    assert Path(roofline).read_bytes()[:8] == PNG_MAGIC
    predicted = {k: float(v) for k, v in tags.items() if k.startswith("profile.step_ms.predicted_")}
    assert sorted(predicted) == ["profile.step_ms.predicted_1", "profile.step_ms.predicted_2"] and min(predicted.values()) > 0
    assert float(tags["profile.step_ms.measured_1"]) > 0 and float(tags["profile.step_ms.measured_2"]) > 0  # the DDP run's
    assert tags["profile.trial"] == trial.id and tags["profile.dir"].endswith(f"{trial.id}/profile")

    # On disk, readable back by code; the DDP part all-reduced exactly the model's gradients.
    profile_dir = tmp_path / "runs" / "prof" / trial.id / "profile"
    assert ModelProfile.from_json((profile_dir / "profile.json").read_text()) == result.profile
    ddp = DdpProfile.from_json((profile_dir / "ddp.json").read_text())
    assert ddp.world_size == 2 and ddp.global_batch == 16 and ddp.allreduce_bytes == result.profile.gradient_bytes
    predictions = json.loads((profile_dir / "predictions.json").read_text())
    assert [(p["devices"], p["per_device_batch"]) for p in predictions] == [(1, 16), (2, 8)]
    assert predictions[0]["allreduce_s"] == 0 < predictions[1]["allreduce_s"]
    assert sorted(p.name for p in profile_dir.parent.iterdir()) == ["profile"]  # no staging left behind
    # The live scheduler starts an elastic trial from this prior: the same predictions, read back.
    from tasks.profile import load_prior

    prior = load_prior(profile_dir)
    assert [round(prior.step_time(n), 9) for n in (1, 2)] == [round(p["step_s"], 9) for p in predictions]
    assert load_prior(tmp_path / "nowhere") is None

    # The flow run carries the table as a markdown artifact.
    artifacts = markdown_artifacts(state.state_details.flow_run_id)
    assert [(a.key, a.data) for a in artifacts] == [(summary.artifact_key, result.markdown)]
    assert LeaseStore().leases() == []


def test_an_unknown_trial_id_is_refused_with_the_valid_ones(tmp_path, digits_npz, prefect_backend, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = write_params(tmp_path, "typo", devices=1, data=digits_npz)
    valid = [t.id for t in expand_grid(load_spec(params))]
    with pytest.raises(TrialNotFoundError, match="no trial 'lr0.5-0000'") as err:
        profile_flow(str(params), "lr0.5-0000")
    assert all(tid in str(err.value) for tid in valid)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


class Picky(nn.Linear):
    """Trains on the pre-flight check's two samples, fails at the profile's batch (as a batch
    that does not fit a device would)."""

    def forward(self, x):
        if len(x) > 2:
            raise RuntimeError(f"cannot take a batch of {len(x)}")
        return super().forward(x)


def broken_model(**kwargs) -> nn.Module:
    return nn.Sequential(nn.Flatten(), Picky(64, 10))


def vanished_core(spec) -> Inventory:
    """The host's slots after a core went offline (no core can be unplugged here)."""
    return Inventory(tuple(Device(f"host/cpu{i}", "host", 4000 + i, "cpu", "CPU core", 2**30) for i in range(2)))


@pytest.mark.parametrize(
    "breakage, culprit",
    [("model", "layer 1 (Picky)"), ("device", "CPU slot host/cpu0 (core 4000) is not available")],
)
def test_a_trial_that_cannot_be_profiled_goes_on_without_a_profile(breakage, culprit, tmp_path, digits_npz, prefect_backend, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    if breakage == "model":
        monkeypatch.setitem(MODELS, "small_cnn", broken_model)
    else:
        monkeypatch.setattr("flows.run.profile.inventory_for", vanished_core)
    caplog.set_level(logging.WARNING)
    params = write_params(tmp_path, "broken", devices=2, data=digits_npz)
    summary = profile_flow(str(params))  # completes: a profile is advice, not a result
    assert summary.result is None and summary.mlflow_run_id is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"trial {summary.trial_id} goes on without a profile" in w and culprit in w for w in warnings), warnings
    trial_dir = tmp_path / "runs" / "broken" / summary.trial_id
    assert not trial_dir.exists() or list(trial_dir.iterdir()) == []  # nothing half-written
    assert not (tmp_path / "mlflow.db").exists()
    assert LeaseStore().leases() == []


def test_a_failed_ddp_part_drops_only_that_part_and_the_campaigns_run_waits_for_its_launch(tmp_path, digits_npz, prefect_backend, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface")  # the ranks cannot form their group
    caplog.set_level(logging.WARNING)
    params = write_params(tmp_path, "noddp", devices=2, data=digits_npz)
    summary = profile_flow(str(params))
    result = summary.result
    assert summary.trial_id == expand_grid(load_spec(params))[0].id  # the first trial by default
    assert result.ddp is None and "exited with code" in result.ddp_error
    assert all(d in result.ddp_error for d in summary.devices)  # the devices are named
    assert "The DDP measurement on 2 device(s) failed" in result.markdown and "| features.2 |" in result.markdown
    assert "ddp.log" in result.files and "ddp.json" not in result.files
    assert [p.devices for p in result.predictions] == [1, 2]
    assert any("profiled without its DDP part" in r.getMessage() for r in caplog.records)

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("noddp").experiment_id])
    # The campaign's run created the way a campaign would, and left for `campaign launch` to run
    # (SCHEDULED); no trial's run yet: the profile has its own, finished.
    assert sorted(r.data.tags["campaign.kind"] for r in runs) == ["campaign", "profile"]
    parent = next(r for r in runs if r.data.tags["campaign.kind"] == "campaign")
    own = next(r for r in runs if r.data.tags["campaign.kind"] == "profile")
    assert parent.info.status == "SCHEDULED" and own.info.status == "FINISHED"
    assert own.info.run_id == summary.mlflow_run_id and own.data.tags["campaign.profiled_trial"] == summary.trial_id
    assert own.data.tags["mlflow.parentRunId"] == parent.info.run_id and "exited with code" in own.data.tags["profile.ddp_error"]
    assert "profile/ddp.log" in {a.path for a in client.list_artifacts(own.info.run_id, "profile")}


def test_a_profile_whose_lease_was_reclaimed_while_it_ran_keeps_nothing(tmp_path, digits_npz, prefect_backend, monkeypatch):
    """Another process's sweep took the profile's lease while it measured (its process had
    stalled past the heartbeat timeout): another trial may have shared the devices, so the
    figures are refused, with the reason, and nothing is logged."""
    from contextlib import contextmanager

    from conftest import wait_for
    from flows.run.profile import DevicesBusyError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CAMPAIGN_LEASE_TIMEOUT_S", "0.4")  # the heartbeat renews every 0.1 s
    params = write_params(tmp_path, "reclaimed", devices=1, data=digits_npz)
    held = {}
    real_hold = LeaseStore.hold

    @contextmanager
    def hold(self, *args, **kwargs):
        with real_hold(self, *args, **kwargs) as lease:
            held["lease"] = lease
            yield lease

    def measured_while_reclaimed(job):
        (lease,) = LeaseStore().leases()
        LeaseStore().release(lease.holder)  # what a sweep that found it expired does
        wait_for(lambda: held["lease"].lost, 10, "the heartbeat to find the lease gone", every=0.02)
        return object()  # figures measured on devices it no longer held

    monkeypatch.setattr(LeaseStore, "hold", hold)
    monkeypatch.setattr("flows.run.profile.profile_trial", measured_while_reclaimed)
    with pytest.raises(DevicesBusyError, match="was reclaimed while trial .* was profiled"):
        profile_flow(str(params))
    assert not (tmp_path / "mlflow.db").exists() and LeaseStore().leases() == []
