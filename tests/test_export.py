"""`campaign export` (tasks/export.py) beyond the end-to-end runs (tests/test_flow.py for the
project's loop, tests/test_function.py for a function): a pool's trial whose checkpoint is on
the DVC remote only, and the refusals, each naming the trial and the fix, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.export import export_trial
from tasks.records import CampaignRecord, TrialEntry, write_campaign
from training.checkpoint import Checkpointer
from training.checkpoint_remote import CheckpointRemote
from training.config import TrialConfig
from training.errors import CampaignError
from training.manifest import MANIFEST
from training.result import write_result

WEIGHTS = {"layer.weight": torch.arange(6.0).reshape(2, 3), "layer.bias": torch.ones(2)}


def a_trial(runs: Path, saved_in: Path, remote: CheckpointRemote | None = None, config: bool = True) -> CampaignRecord:
    """Campaign `c`'s finished trial `t1`, its final checkpoint (step 20) written in `saved_in`."""
    record = CampaignRecord(name="c", trials=(TrialEntry("t1", "lr=0.1", 20),), objective=("val_loss", "min"))
    write_campaign(runs, record)
    trial_dir = runs / "c" / "t1"
    trial_dir.mkdir(parents=True, exist_ok=True)
    saver = Checkpointer(saved_in, keep=2, rank=0, world_size=1, remote=remote)
    saver.save(20, {"trainer": {"model": dict(WEIGHTS), "progress": {"step": 20}}}, blocking=True)
    if config:
        remote_spec = {"url": remote.url, "key": "c/t1"} if remote else None
        (trial_dir / "trial.json").write_text(TrialConfig(trial_id="t1", seed=0, model={"name": "mlp", "hidden": 3}, data={},
                                                          steps=20, batch_size=4, lr=0.1, trial_dir=str(trial_dir),
                                                          checkpoint_remote=remote_spec).to_json())
    write_result(trial_dir / "result.json", {"trial_id": "t1", "steps": 20, "metrics": {"val_loss": 0.25},
                                             "checkpoint": str(saved_in / "step-00000020")})
    return record


def test_a_pool_trials_checkpoint_is_pulled_from_the_remote_into_its_folder_and_exported(tmp_path):
    runs = tmp_path / "runs"
    remote = CheckpointRemote(str(tmp_path / "remote"), "c/t1", keep=2)
    record = a_trial(runs, tmp_path / "node-a" / "checkpoints", remote)  # written on another node: not in the trial's folder
    assert not (runs / "c" / "t1" / "checkpoints").exists()
    written = export_trial(runs, record, "t1", tmp_path / "t1.pt")
    exported = torch.load(tmp_path / "t1.pt", weights_only=True)
    assert written["model_spec"] == exported["model_spec"] == {"name": "mlp", "hidden": 3}
    assert (exported["step"], exported["metrics"], exported["objective"]) == (20, {"val_loss": 0.25}, ["val_loss", "min"])
    assert exported["model"].keys() == WEIGHTS.keys() and all(torch.equal(exported["model"][k], v) for k, v in WEIGHTS.items())
    assert (runs / "c" / "t1" / "checkpoints" / "step-00000020" / MANIFEST).is_file()  # pulled as a resume pulls it


def test_a_pruned_trial_exports_the_weights_of_its_last_save_and_says_their_step(tmp_path):
    """A pruned trial's state at its stop is not written: its result names its last save."""
    runs = tmp_path / "runs"
    record = a_trial(runs, runs / "c" / "t1" / "checkpoints")
    result = json.loads((runs / "c" / "t1" / "result.json").read_text())
    write_result(runs / "c" / "t1" / "result.json", {**{k: result[k] for k in ("trial_id", "metrics", "checkpoint")},
                                                     "steps": 27, "pruned": True})
    export_trial(runs, record, "t1", tmp_path / "t1.pt")
    assert torch.load(tmp_path / "t1.pt", weights_only=True)["step"] == 20


def test_a_checkpoint_that_does_not_verify_is_refused_and_nothing_is_written(tmp_path):
    runs = tmp_path / "runs"
    record = a_trial(runs, runs / "c" / "t1" / "checkpoints")
    (runs / "c" / "t1" / "checkpoints" / "step-00000020" / MANIFEST).write_text("{}")
    with pytest.raises(CampaignError, match=r"trial t1's final checkpoint .*step-00000020 does not verify .*--rerun t1"):
        export_trial(runs, record, "t1", tmp_path / "t1.pt")
    assert list(tmp_path.glob("*.pt")) == [] and list(tmp_path.glob(".*partial")) == []


def test_a_trial_without_a_result_or_a_config_is_refused_naming_it(tmp_path):
    runs = tmp_path / "runs"
    record = a_trial(runs, runs / "c" / "t1" / "checkpoints", config=False)
    with pytest.raises(CampaignError, match="trial t1 has no trial.json"):
        export_trial(runs, record, "t1", tmp_path / "t1.pt")
    (runs / "c" / "t1" / "result.json").unlink()
    with pytest.raises(CampaignError, match=r"trial t1 has no result to export \(it has not finished\)"):
        export_trial(runs, record, "t1", tmp_path / "t1.pt")
    assert not (tmp_path / "t1.pt").exists()
