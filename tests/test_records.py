"""Each record has one typed owner that writes it and every reader goes through:
progress.json (training.progress), control/state.json (training.agent_state) and
campaign.json and record.json (tasks.records). A file that is not one is refused, named."""

from __future__ import annotations

import json
import os
import warnings

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
    update_campaign(tmp_path, "c", state="running", launches=1, objective=("val_loss", "min"))
    record = read_campaign(tmp_path, "c")
    assert (record.state, record.launches, record.trial("t1").devices, record.trial("t1").overrides) == ("running", 1, (1, 2), {"training.lr": 0.1})
    assert record.objective == ("val_loss", "min")
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
    ({"name": "c", "objective": ["val_loss", "lowest"]}, "objective .* is not \\[metric, min\\|max\\]"),
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


# --- the agent's commands and refusals (training.agent_commands) ----------------------------

def test_a_command_reads_back_as_written_and_a_relay_renumbers_it(tmp_path):
    from training.agent_commands import read_command, write_command

    written = write_command(tmp_path, 3, [{"id": "a/cpu0", "env": {"X": "1"}}, {"id": "b/cpu1", "env": {}, "node": "b"}])
    command = read_command(tmp_path, 3)
    assert command == written and command.device_ids == ["a/cpu0", "b/cpu1"] and command.mode == "resize"
    assert read_command(tmp_path, 4) is None  # not written yet
    command.renumbered(1).write(tmp_path / "inner")
    assert read_command(tmp_path / "inner", 1).devices == command.devices


@pytest.mark.parametrize("raw, why", [
    ({"seq": 2, "devices": [{"id": "a/cpu0"}]}, "holds command 2, not 1"),
    ({"seq": 1, "devices": ["a/cpu0"]}, "devices are not a list of objects with an id"),
    ({"seq": 1, "devices": [], "mode": "teleport"}, "mode is not one of"),
    ({"seq": 1, "devices": [], "schema": 9}, "written by another version"),
    ({"seq": 1, "devices": [], "run": "rm -rf /"}, "unknown fields"),
])
def test_a_file_that_is_not_a_command_is_refused_naming_it(tmp_path, raw, why):
    """A command the agent cannot read is an error naming the file, never skipped or guessed at."""
    from training.agent_commands import read_command
    from training.files import InputError
    from training.layout import command_in

    command_in(tmp_path, 1).write_text(json.dumps(raw))
    with pytest.raises(InputError, match=why) as error:
        read_command(tmp_path, 1)
    assert str(command_in(tmp_path, 1)) in str(error.value)


def test_a_refusal_says_why_and_an_unreadable_one_still_refuses(tmp_path):
    from training.agent_commands import read_refusal, refuse
    from training.layout import refusal_in

    refuse(tmp_path, 2, "node lease file: a/cpu1 held by another campaign")
    assert read_refusal(tmp_path, 2).reason == "node lease file: a/cpu1 held by another campaign"
    assert read_refusal(tmp_path, 3) is None
    refusal_in(tmp_path, 3).write_text("{not json")
    assert "cannot be read" in read_refusal(tmp_path, 3).reason  # the command was still not applied


def test_clearing_commands_leaves_nothing_of_an_earlier_sequence(tmp_path):
    from training.agent_commands import clear_commands, read_command, read_refusal, refuse, write_command
    from training.agent_state import agent_state_now, read_agent_state

    write_command(tmp_path, 0, [{"id": "a/cpu0"}])
    refuse(tmp_path, 1, "no")
    agent_state_now(0, 0, ["a/cpu0"], "running").write(tmp_path)
    (tmp_path / "stop-1").touch()  # not the sequence's: stays
    clear_commands(tmp_path)
    assert (read_command(tmp_path, 0), read_refusal(tmp_path, 1), read_agent_state(tmp_path)) == (None, None, None)
    assert (tmp_path / "stop-1").exists()


# --- batch.json (training.batch_choice) ----------------------------------------------------

def test_a_batch_choice_reads_back_and_one_that_is_not_reads_as_none(tmp_path):
    from training.batch_choice import batch_choice_now, read_batch_choice

    batch_choice_now(2, 96, 1.5).write(tmp_path)
    choice = read_batch_choice(tmp_path)
    assert (choice.devices, choice.batch_size, choice.scale) == (2, 96, 1.5)
    for raw, why in [({"devices": 2, "batch_size": "96"}, "batch_size is not a whole number"), ({"devices": 0, "batch_size": 8}, "devices"),
                     ({"devices": 2, "batch_size": 8, "schema": 2}, "another version"), ("96", "not a JSON object")]:
        trial_files(tmp_path).batch.write_text(json.dumps(raw))
        with pytest.warns(UserWarning, match=why):
            assert read_batch_choice(tmp_path) is None  # the batch then follows the size


# --- agent-store.json and host-<node>.json (training.host_records) ---------------------------

def test_an_agent_store_and_a_host_status_read_back_and_files_that_are_not_read_as_none(tmp_path):
    from training.host_records import publish_agent_store, read_agent_store, read_host_status, write_host_status

    assert read_agent_store(tmp_path) is None and read_host_status(tmp_path, "b") is None  # nothing said yet
    trial_files(tmp_path).control.mkdir(parents=True)
    publish_agent_store(tmp_path, "10.0.0.1:29500", "a")
    store = read_agent_store(tmp_path)
    assert (store.endpoint, store.node) == ("10.0.0.1:29500", "a")
    write_host_status(tmp_path, "b", 3, "refused", "held by another campaign")
    status = read_host_status(tmp_path, "b")
    assert (status.seq, status.status, status.reason) == (3, "refused", "held by another campaign")
    assert read_host_status(tmp_path, "c") is None  # each node its own file
    with pytest.raises(ValueError, match="not one of ready, refused"):
        write_host_status(tmp_path, "b", 4, "maybe")
    for raw, why in [({"endpoint": "10.0.0.1", "node": "a"}, "host:port"), ({"endpoint": "h:1", "node": 3}, "node"),
                     ({"endpoint": "h:1", "node": "a", "port": 1}, "unknown fields"), ([], "not a JSON object")]:
        trial_files(tmp_path).agent_store.write_text(json.dumps(raw))
        with pytest.warns(UserWarning, match=why):
            assert read_agent_store(tmp_path) is None  # the campaign starts no host until the agent says where it is
    for raw, why in [({"seq": 3, "status": "up"}, "status"), ({"seq": -1, "status": "ready"}, "seq"),
                     ({"seq": 3, "status": "ready", "schema": 9}, "another version"), ({"seq": 3, "status": "ready", "reason": 1}, "reason")]:
        trial_files(tmp_path).host_status("b").write_text(json.dumps(raw))
        with pytest.warns(UserWarning, match=why):
            assert read_host_status(tmp_path, "b") is None  # as if the host had said nothing yet


# --- the line logs: resizes.jsonl (training.resize_log), allocations.jsonl (tasks.records) ---

def _resize(step: int, **changes):
    from training.resize_log import ResizeEvent

    fields = dict(time=100.0 + step, step=step, seq=1, mode="resize", before=("a/cpu0", "a/cpu1"), after=("a/cpu0",),
                  pause_s=0.05, latency_s=1.2, batch_size=64, lr=0.1, samples_seen=64 * step, pause_breakdown_s={"stopped": 0.01})
    return ResizeEvent(**{**fields, **changes})


def test_resize_events_read_back_in_order_with_from_and_to_on_disk(tmp_path):
    from training.resize_log import append_resize, read_resizes

    assert read_resizes(tmp_path) == []
    append_resize(tmp_path, _resize(10))
    append_resize(tmp_path, _resize(20, before=("a/cpu0",), after=("a/cpu0", "b/cpu0"), mode="node lost", goodput=True))
    events = read_resizes(tmp_path)
    assert [(e.step, e.mode, len(e.before), len(e.after)) for e in events] == [(10, "resize", 2, 1), (20, "node lost", 1, 2)]
    first = json.loads(trial_files(tmp_path).resizes.read_text().splitlines()[0])
    assert (first["from"], first["to"], first["schema"]) == (["a/cpu0", "a/cpu1"], ["a/cpu0"], 1)
    assert events[0].line() == "2 -> 1 devices at step 10 (resize, paused 50 ms; 1.2 s from the request)"
    assert events[1].line().endswith("batch 64, lr 0.1)")


def test_a_line_that_is_not_a_resize_is_skipped_naming_the_file_and_line(tmp_path):
    from training.resize_log import append_resize, read_resizes

    append_resize(tmp_path, _resize(10))
    with open(trial_files(tmp_path).resizes, "a") as f:
        f.write('{"step": "eleven"}\n' + "junk\n")
    append_resize(tmp_path, _resize(30))
    with open(trial_files(tmp_path).resizes, "a") as f:
        f.write('{"time": 1.0, "step": 4')  # a write cut short by a crash: no newline
    with pytest.warns(UserWarning, match=r"3 line\(s\) of .*resizes.jsonl.*line 2: .*not a whole number.*line 3: .*not valid JSON.*line 5: cut short"):
        assert [e.step for e in read_resizes(tmp_path)] == [10, 30]


def test_the_latest_pause_is_read_once_per_resize_for_the_scheduler(tmp_path):
    from training.resize_log import NewPauses, append_resize

    pauses = NewPauses()
    assert pauses.latest(tmp_path) is None  # no resize yet: the spec's estimate stands
    append_resize(tmp_path, _resize(10, pause_s=3.5))
    assert pauses.latest(tmp_path) == 3.5
    assert pauses.latest(tmp_path) is None  # nothing new since: not read again
    append_resize(tmp_path, _resize(20, pause_s=0.75))
    assert pauses.latest(tmp_path) == 0.75  # the last resize's, not a mean of them


def test_allocations_read_back_and_feed_the_timeline(tmp_path):
    from tasks.records import log_allocation, read_allocations
    from tasks.timeline import intervals

    log_allocation(tmp_path, "t1", ["a/cpu0", "a/cpu1"], "start", memory_bytes=1 << 20)
    log_allocation(tmp_path, "t1", ["a/cpu0"], "resize")
    log_allocation(tmp_path, "t1", [], "end")
    with open(tmp_path / "allocations.jsonl", "a") as f:
        f.write('{"time": 1.0, "trial": "t2", "devices": "a/cpu1", "reason": "start"}\n')
    with pytest.warns(UserWarning, match="devices are not a list"):
        events = read_allocations(tmp_path)
    assert [(e.trial, e.devices, e.reason, e.memory_bytes) for e in events] == [
        ("t1", ("a/cpu0", "a/cpu1"), "start", 1 << 20), ("t1", ("a/cpu0",), "resize", None), ("t1", (), "end", None)]
    assert sorted((b.device, b.ended_by) for b in intervals(events)) == [("a/cpu0", "end"), ("a/cpu0", "resize"), ("a/cpu1", "resize")]


def test_lines_appended_by_several_processes_at_once_stay_whole(tmp_path):
    """The campaign and a trial's agent may append at once: each line is one O_APPEND write.

    The writers are new interpreters, as the campaign and an agent are: a child forked from a
    test worker inherits whatever earlier tests left in it (a fork there once exited 1 at its
    multiprocessing hooks, before a line was written)."""
    import subprocess
    import sys

    from tasks.records import read_allocations

    code = ("import sys; from pathlib import Path; from tasks.records import log_allocation\n"
            "for _ in range(200): log_allocation(Path(sys.argv[1]), sys.argv[2], [f'{sys.argv[2]}/cpu{i}' for i in range(40)], 'resize')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"n{i}"], stderr=subprocess.PIPE, text=True) for i in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn line would be warned about
        events = read_allocations(tmp_path)
    assert len(events) == 800 and all(len(e.devices) == 40 for e in events)


# --- the resize request and answer (tasks.resize) ------------------------------------------

def test_a_resize_request_and_its_answer_read_back(tmp_path):
    from tasks.resize import answer, pending_request, read_answer, request_resize

    request_id = request_resize(tmp_path, 3, by="policy")
    request = pending_request(tmp_path, set())
    assert (request.id, request.devices, request.by) == (request_id, 3, "policy")
    answer(tmp_path, request_id, "applied", "now on a/cpu0, a/cpu1, a/cpu2")
    assert read_answer(tmp_path).status == "applied" and pending_request(tmp_path, set()) is None
    trial_files(tmp_path).resize_answer.write_text(json.dumps({"id": request_id, "status": "maybe", "detail": ""}))
    with pytest.warns(UserWarning, match="a status that is not one of"):
        assert read_answer(tmp_path) is None


def test_a_request_with_a_field_nobody_reads_is_moved_aside_and_answered(tmp_path):
    from tasks.resize import pending_request, read_answer

    trial_files(tmp_path).resize_request.parent.mkdir(parents=True)
    trial_files(tmp_path).resize_request.write_text(json.dumps({"id": "x", "devices": 2, "devices_now": 9}))
    assert pending_request(tmp_path, set()) is None
    assert read_answer(tmp_path).status == "rejected" and "unknown fields ['devices_now']" in read_answer(tmp_path).detail
    assert trial_files(tmp_path).resize_request.with_name("request.json.rejected").exists()
