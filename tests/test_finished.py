"""Finished stays finished: a trial's result stands when its checkpoints cannot be verified.

Resuming under another checkpoint key (a reset home folder, another user, a node without
the key) used to refuse every checkpoint as unsigned and train every finished trial again.
Now the result decides; `campaign status` names the refused checkpoints and why, and
`campaign resume --rerun TRIAL` is how a person asks for a new run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from tasks.records import CampaignRecord, TrialEntry, completed_result, trial_status, write_campaign
from training.checkpoint import Checkpointer
from training.files import write_json_atomic
from training.manifest import KEY_ENV, list_checkpoints, verify
from training.result import set_aside


def finished_trial(trial_dir: Path) -> dict:
    saver = Checkpointer(trial_dir / "checkpoints", keep=3, rank=0, world_size=1)
    for step in (10, 20):
        saver.save(step, {"trainer": {"w": torch.full((4,), float(step))}}, blocking=True)
    result = {"trial_id": trial_dir.name, "checkpoint": str(list_checkpoints(trial_dir / "checkpoints")[0]), "steps": 20,
              "metrics": {"val_accuracy": 0.9}}
    write_json_atomic(trial_dir / "result.json", result)
    return result


def test_a_finished_trial_stays_finished_under_another_key(tmp_path, monkeypatch):
    from conftest import campaign_cli

    runs = tmp_path / "runs"
    write_campaign(runs, CampaignRecord(name="c", trials=(TrialEntry("t1", "x", 20),)))
    result = finished_trial(runs / "c" / "t1")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "another.key"))  # as after a reset home folder
    assert verify(Path(result["checkpoint"])) is not None  # the checkpoints are refused...
    assert completed_result(runs / "c" / "t1") == result  # ...and the trial is still finished
    status = trial_status(runs / "c" / "t1", "t1", "x", 20)
    assert status.state == "finished" and status.checkpoint is None
    assert [name for name, _ in status.refused] == ["step-00000020", "step-00000010"]
    assert all("signature does not match" in why for _, why in status.refused)

    shown = campaign_cli("status", "c", "--runs-dir", str(runs), cwd=tmp_path)
    output = " ".join(shown.stdout.split())
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "checkpoint step-00000020 refused: the manifest's signature does not match" in output, output
    assert "campaign resume --rerun t1" in output, output


def test_a_malformed_result_is_no_result(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"metrics": {}}))  # no checkpoint: not what a trainer writes
    with pytest.warns(UserWarning, match="no checkpoint path"):
        assert completed_result(tmp_path) is None
    (tmp_path / "result.json").unlink()
    os.mkfifo(tmp_path / "result.json")
    with pytest.warns(UserWarning, match="is a FIFO"):
        assert completed_result(tmp_path) is None


def test_rerun_sets_the_result_and_checkpoints_aside(tmp_path):
    trial_dir = tmp_path / "t1"
    finished_trial(trial_dir)
    aside = set_aside(trial_dir)
    assert aside is not None and aside.parent == trial_dir and aside.name.startswith("rerun-")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "result.json"]
    assert completed_result(trial_dir) is None and not (trial_dir / "checkpoints").exists()
    assert set_aside(trial_dir) is None


@pytest.mark.slow
def test_resume_under_another_key_trains_nothing_and_rerun_trains_again(tmp_path, digits_npz):
    from conftest import campaign_cli

    runs = tmp_path / "runs"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "keyed"}, "data": {"path": str(digits_npz)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 20, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "eval_every": 10},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    first = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (trial_dir,) = [p for p in (runs / "keyed").iterdir() if p.is_dir()]
    result = (trial_dir / "result.json").read_text()
    starts = (trial_dir / "train.log").read_text().count("fresh start")

    os.environ[KEY_ENV], key = str(tmp_path / "another.key"), os.environ[KEY_ENV]
    try:
        again = campaign_cli("resume", "params.yaml", "--no-live", cwd=tmp_path)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert (trial_dir / "result.json").read_text() == result  # not recomputed
        assert (trial_dir / "train.log").read_text().count("fresh start") == starts
        assert "finished 1/1" in again.stdout

        bad = campaign_cli("resume", "params.yaml", "--no-live", "--rerun", "nope", cwd=tmp_path)
        assert bad.returncode == 2 and "has no such trial" in bad.stderr, bad.stderr[-2000:]
        rerun = campaign_cli("resume", "params.yaml", "--no-live", "--rerun", trial_dir.name, cwd=tmp_path)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        assert (trial_dir / "train.log").read_text().count("fresh start") == starts + 1
        assert json.loads((trial_dir / "result.json").read_text())["steps"] == 20
        assert len(list(trial_dir.glob("rerun-*/result.json"))) == 1
    finally:
        os.environ[KEY_ENV] = key


def test_status_steps_read_the_newest_of_progress_and_checkpoint(tmp_path):
    trial_dir = tmp_path / "t1"
    finished_trial(trial_dir)
    (trial_dir / "result.json").unlink()  # still running: progress is written at most once a second
    from training.progress import progress_now

    progress_now("running", 5, 40, 1, 8, {}).write(trial_dir)
    assert trial_status(trial_dir, "t1", "x", 40).step == 20  # the checkpoint at 20 is newer
    progress_now("running", 25, 40, 1, 8, {}).write(trial_dir)
    assert trial_status(trial_dir, "t1", "x", 40).step == 25
