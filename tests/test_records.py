"""Each record has one typed owner that writes it and every reader goes through:
progress.json (training.progress), control/state.json (training.agent_state) and
campaign.json and record.json (tasks.records). A file that is not one is refused, named."""

from __future__ import annotations

import json
import os

import pytest

from tasks.records import trial_status
from training.layout import trial_files
from training.progress import SCHEMA, progress_now, read_progress


def test_a_progress_record_reads_back_as_written(tmp_path):
    progress_now("running", 12, 100, 2, 64, {"train_loss": 0.5, "step_time_s": 0.01}, samples_seen=768).write(tmp_path)
    progress = read_progress(tmp_path)
    assert (progress.state, progress.step, progress.world_size, progress.samples_seen, progress.schema) == ("running", 12, 2, 768, SCHEMA)
    assert progress.metrics == {"train_loss": 0.5, "step_time_s": 0.01}
    assert trial_status(tmp_path, "t", "t", 100).step == 12


@pytest.mark.parametrize("content, why", [
    ({"state": "running", "step": 3}, "steps is not a whole number"),
    ({"schema": SCHEMA + 1}, "written by another version"),
    ({"schema": SCHEMA, "state": "running", "step": "3", "steps": 9, "world_size": 1, "batch_size": 8, "samples_seen": 0,
      "metrics": {}, "updated": 0.0}, "step is not a whole number"),
    ({"schema": SCHEMA, "state": "running", "step": 3, "steps": 9, "world_size": 1, "batch_size": 8, "samples_seen": 0,
      "metrics": {"loss": "low"}, "updated": 0.0}, "metrics are not numbers"),
    ([1, 2], "not a JSON object"),
])
def test_a_file_that_is_not_a_progress_record_reads_as_none_and_says_why(tmp_path, content, why):
    trial_files(tmp_path).progress.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match=why):
        assert read_progress(tmp_path) is None
    with pytest.warns(UserWarning):
        assert trial_status(tmp_path, "t", "t", 9).step == 0  # status goes on without it


def test_a_fifo_in_its_place_is_refused_without_blocking(tmp_path):
    os.mkfifo(trial_files(tmp_path).progress)
    with pytest.warns(UserWarning, match="FIFO"):
        assert read_progress(tmp_path) is None


# --- campaign.json (tasks.records.CampaignRecord) ------------------------------------------

def test_a_campaign_record_reads_back_as_written_and_an_unversioned_one_still_reads(tmp_path):
    from tasks.records import CampaignRecord, TrialEntry, read_campaign, update_campaign, write_campaign

    write_campaign(tmp_path, CampaignRecord(name="c", trials=(TrialEntry("t1", "lr=0.1", 20, {"training.lr": 0.1}, (1, 2)),)))
    update_campaign(tmp_path, "c", state="running", launches=1)
    record = read_campaign(tmp_path, "c")
    assert (record.state, record.launches, record.trial("t1").devices, record.trial("t1").overrides) == ("running", 1, (1, 2), {"training.lr": 0.1})
    raw = json.loads((tmp_path / "c" / "campaign.json").read_text())
    assert raw["schema"] == 1 and raw["trials"][0]["devices"] == [1, 2]
    del raw["schema"]  # as the versions before records had one wrote it
    (tmp_path / "c" / "campaign.json").write_text(json.dumps(raw))
    assert read_campaign(tmp_path, "c") == record
    with pytest.raises(TypeError):
        update_campaign(tmp_path, "c", colour="blue")  # a field nobody reads is not written either


@pytest.mark.parametrize("raw, why", [
    ({"name": "c", "schema": 2}, "written by a newer version"),
    ({"name": "c", "trials": [{"id": "t1"}]}, "trial entry"),
    ({"name": "c", "colour": "blue"}, "unknown fields"),
    ({"name": "c", "started": "yesterday"}, "not a number"),
    ("c", "not a JSON object"),
])
def test_a_file_that_is_not_a_campaign_record_is_refused_naming_it(tmp_path, raw, why):
    from tasks.records import read_campaign
    from training.files import InputError

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "campaign.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match=f"campaign.json is not a campaign record .*{why}.*move it aside"):
        read_campaign(tmp_path, "c")


def test_campaign_status_on_a_foreign_record_exits_2_naming_it(tmp_path):
    from conftest import campaign_cli

    (tmp_path / "runs" / "c").mkdir(parents=True)
    (tmp_path / "runs" / "c" / "campaign.json").write_text(json.dumps({"name": "c", "schema": 9}))
    done = campaign_cli("status", "c", "--runs-dir", str(tmp_path / "runs"))
    assert done.returncode == 2 and "written by a newer version" in " ".join(done.stderr.split())


# --- control/state.json (training.agent_state) ---------------------------------------------

def test_an_agent_state_reads_back_and_a_relay_renumbers_it(tmp_path):
    from training.agent_state import agent_state_now, read_agent_state

    agent_state_now(3, 2, ["cpu0", "cpu1"], "running").write(tmp_path)
    state = read_agent_state(tmp_path)
    assert (state.seq, state.gen, state.devices, state.status) == (3, 2, ("cpu0", "cpu1"), "running")
    state.renumbered(7).write(tmp_path / "outer")
    assert read_agent_state(tmp_path / "outer").seq == 7


@pytest.mark.parametrize("raw, why", [
    ({"seq": 1, "gen": 0, "devices": ["cpu0"], "status": "sleeping", "time": 0.0}, "status 'sleeping' is not one of"),
    ({"seq": 1, "devices": ["cpu0"], "status": "running"}, "seq or gen"),
    ({"seq": 1, "gen": 0, "devices": "cpu0", "status": "running"}, "devices are not a list"),
    ({"seq": 1, "gen": 0, "devices": [], "status": "running", "schema": 5}, "written by another version"),
])
def test_a_file_that_is_not_an_agent_state_reads_as_none(tmp_path, raw, why):
    from training.agent_state import read_agent_state
    from training.layout import agent_state_in

    agent_state_in(tmp_path).write_text(json.dumps(raw))
    with pytest.warns(UserWarning, match=why):
        assert read_agent_state(tmp_path) is None


# --- record.json (tasks.records.TrialRecord) -----------------------------------------------

def test_a_trial_record_keeps_its_attempts_and_refuses_a_field_nobody_reads(tmp_path):
    from tasks.records import read_trial_record, record_state, update_record

    assert read_trial_record(tmp_path).state == "pending"  # not started yet
    held = update_record(tmp_path, state="running", devices=["cpu0"])
    update_record(tmp_path, attempts=held.attempts + 1, intervals=[{"devices": ["cpu0"], "start": 1.0, "end": None}])
    record = read_trial_record(tmp_path)
    assert (record.state, record.devices, record.attempts, record.schema) == ("running", ("cpu0",), 1, 1)
    assert record.owner and record_state(record) == "running"  # stamped with this process, alive
    with pytest.raises(TypeError):
        update_record(tmp_path, colour="blue")


def test_a_file_that_is_not_a_trial_record_reads_as_not_started(tmp_path):
    from tasks.records import read_trial_record, trial_status

    (tmp_path / "record.json").write_text(json.dumps({"state": "running", "devices": "cpu0"}))
    with pytest.warns(UserWarning, match="devices or intervals that are not lists"):
        assert read_trial_record(tmp_path).state == "pending"
    with pytest.warns(UserWarning):
        assert trial_status(tmp_path, "t", "t", 9).state == "pending"
