"""Finished stays finished: a trial's signed result stands when its checkpoints cannot be
verified (corrupted, deleted); `campaign status` names the refused checkpoints and why, and
`campaign resume --rerun TRIAL` is how a person asks for a new run.

Under another checkpoint key (a reset home folder, another user, a node without the key)
the result's signature does not hold either: neither its numbers nor its weights can be
trusted, so the trial reads as unfinished (`unverified`, saying why) and a launch trains it
again; restoring the key that signed them makes it finished again (training/result.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from tasks.records import CampaignRecord, TrialEntry, completed_result, trial_status, update_record, write_campaign
from training.checkpoint import Checkpointer
from training.manifest import KEY_ENV, MANIFEST, list_checkpoints, verify
from training.result import set_aside, write_result


def finished_trial(trial_dir: Path) -> dict:
    saver = Checkpointer(trial_dir / "checkpoints", keep=3, rank=0, world_size=1)
    for step in (10, 20):
        saver.save(step, {"trainer": {"w": torch.full((4,), float(step))}}, blocking=True)
    return write_result(trial_dir / "result.json", {"trial_id": trial_dir.name, "steps": 20, "metrics": {"val_accuracy": 0.9},
                                                    "checkpoint": str(list_checkpoints(trial_dir / "checkpoints")[0])})


def test_a_signed_result_stays_finished_when_its_checkpoints_no_longer_verify(tmp_path):
    from conftest import campaign_cli

    runs = tmp_path / "runs"
    write_campaign(runs, CampaignRecord(name="c", trials=(TrialEntry("t1", "x", 20),)))
    result = finished_trial(runs / "c" / "t1")
    for checkpoint in list_checkpoints(runs / "c" / "t1" / "checkpoints"):
        (checkpoint / MANIFEST).write_text("{}")  # corrupted after the trial finished
    assert verify(Path(result["checkpoint"])) is not None  # the checkpoints are refused...
    assert completed_result(runs / "c" / "t1") == result  # ...and the trial is still finished
    status = trial_status(runs / "c" / "t1", "t1", "x", 20)
    assert status.state == "finished" and status.checkpoint is None and status.reason is None
    assert [name for name, _ in status.refused] == ["step-00000020", "step-00000010"]

    shown = campaign_cli("status", "c", "--runs-dir", str(runs), cwd=tmp_path)
    output = " ".join(shown.stdout.split())
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "checkpoint step-00000020 refused: the manifest is malformed" in output, output
    assert "campaign resume --rerun t1" in output, output


def test_under_another_key_a_finished_trial_is_unverified_until_its_key_is_back(tmp_path, monkeypatch):
    from conftest import campaign_cli

    runs = tmp_path / "runs"
    write_campaign(runs, CampaignRecord(name="c", trials=(TrialEntry("t1", "x", 20),)))
    result = finished_trial(runs / "c" / "t1")
    update_record(runs / "c" / "t1", state="finished")
    key = os.environ[KEY_ENV]
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "another.key"))  # as after a reset home folder
    with pytest.warns(UserWarning, match=r"result\.json: its signature does not match this host's checkpoint key"):
        assert completed_result(runs / "c" / "t1") is None  # launched again: nothing of it can be trusted
    status = trial_status(runs / "c" / "t1", "t1", "x", 20)
    assert status.state == "unverified" and status.metrics == {} and "another.key" in status.reason
    shown = campaign_cli("status", "c", "--runs-dir", str(runs), cwd=tmp_path)
    output = " ".join(shown.stdout.split())
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr[-2000:]
    assert f"trial t1 unverified: result refused: {runs / 'c' / 't1' / 'result.json'}: its signature does not match" in output, output

    monkeypatch.setenv(KEY_ENV, key)  # the key that signed it, restored
    assert completed_result(runs / "c" / "t1") == result
    assert trial_status(runs / "c" / "t1", "t1", "x", 20).state == "finished"


def test_a_malformed_result_is_no_result(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"metrics": {}}))  # no checkpoint: not what a trainer writes
    with pytest.warns(UserWarning, match="no trial_id, steps, checkpoint"):
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
def test_resume_under_another_key_trains_again_and_rerun_trains_again(tmp_path, digits_npz):
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
    starts = (trial_dir / "train.log").read_text().count("fresh start")

    os.environ[KEY_ENV], key = str(tmp_path / "another.key"), os.environ[KEY_ENV]
    try:
        # Neither the result nor the checkpoints verify: nothing says the trial ran, so it runs.
        again = campaign_cli("resume", "params.yaml", "--no-live", cwd=tmp_path)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "its signature does not match this host's checkpoint key" in again.stdout + again.stderr
        assert (trial_dir / "train.log").read_text().count("fresh start") == starts + 1
        assert "finished 1/1" in again.stdout
        starts += 1

        bad = campaign_cli("resume", "params.yaml", "--no-live", "--rerun", "nope", cwd=tmp_path)
        assert bad.returncode == 2 and "has no such trial" in bad.stderr, bad.stderr[-2000:]
        rerun = campaign_cli("resume", "params.yaml", "--no-live", "--rerun", trial_dir.name, cwd=tmp_path)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        assert (trial_dir / "train.log").read_text().count("fresh start") == starts + 1
        assert json.loads((trial_dir / "result.json").read_text())["steps"] == 20
        assert len(list(trial_dir.glob("rerun-*/result.json"))) == 1
        # The rerun's curves: journaled anew and logged to a run of its own (the old run holds
        # every step it logs); the old run is kept, tagged as set aside.
        (aside,) = trial_dir.glob("rerun-*")
        assert (aside / "metrics.jsonl").exists() and (trial_dir / "metrics.jsonl").exists()
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`campaign.kind` = 'trial'")
        by_tag = {r.data.tags["campaign.trial_id"]: r for r in runs}
        assert set(by_tag) == {trial_dir.name, f"{trial_dir.name}@{aside.name}"}, set(by_tag)
        new_steps = [m.step for m in client.get_metric_history(by_tag[trial_dir.name].info.run_id, "train_loss")]
        assert new_steps and sorted(new_steps) == sorted(set(new_steps)) and max(new_steps) == 20, new_steps
        assert by_tag[trial_dir.name].data.metrics["train_loss"] == json.loads((trial_dir / "result.json").read_text())["metrics"]["train_loss"]
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
