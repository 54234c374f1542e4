"""What Prefect shows of a folder's campaigns: a flow run whose campaign died is Crashed, not
Running forever (flows/run/crashed.py), and each project folder keeps its runs in its own
Prefect database (flows/servers/prefect_db.py)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import campaign_cli, wait_for, without_shared_prefect_server
from flows.run.crashed import flow_run_state
from flows.servers.prefect_db import FOLDER_DB, URL_ENV, database_settings
from tasks.records import CampaignRecord, TrialEntry, read_campaign, write_campaign
from training.progress import read_progress


def write_params(folder: Path, name: str, data: Path, steps: int = 30) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": name}, "data": {"path": str(data)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": steps, "batch_size": 32, "lr": 0.1, "eval_every": 10, "checkpoint_every": 5},
        "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "experiment": name, "runs_dir": "runs"},
    }))
    return folder / "params.yaml"


def post(url: str, body: dict) -> object:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def flow_run(api: str, flow_run_id: str) -> dict:
    with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=30) as response:
        return json.load(response)


# --- each folder its own database -----------------------------------------------------------------

def test_a_folder_keeps_its_own_prefect_database_unless_the_user_says_where_prefect_lives(tmp_path):
    url = lambda path: f"sqlite+aiosqlite:///{path}"  # noqa: E731
    assert database_settings(tmp_path, {}) == {URL_ENV: url(tmp_path / FOLDER_DB)}
    for users in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_API_DATABASE_CONNECTION_URL", URL_ENV):
        assert database_settings(tmp_path, {users: "theirs"}) == {}  # where they said Prefect lives, it stays
    # Named outright (`--prefect-db`, CAMPAIGN_PREFECT_DB): shared with other folders, whatever else is set.
    assert database_settings(tmp_path, {"PREFECT_HOME": "x"}, Path("~/.prefect/prefect.db")) == \
        {URL_ENV: url(Path.home() / ".prefect" / "prefect.db")}
    assert database_settings(tmp_path, {}, Path("shared/p.db")) == {URL_ENV: url(tmp_path / "shared" / "p.db")}


def flow_run_names(database: Path) -> list[str]:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        return sorted(name for (name,) in db.execute("select name from flow_run"))


@pytest.mark.slow
def test_two_folders_campaigns_do_not_see_each_others_flow_runs(tmp_path, digits_npz, monkeypatch, prefect_database):
    without_shared_prefect_server(monkeypatch)  # as a user runs it: the folder's own servers
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):  # the same campaign in two clones
        write_params(folder, "twin", digits_npz, steps=10)
        prefect_database(folder / FOLDER_DB)  # migrated already: the test waits for no migration
    try:
        # A with the folder's resident server (a user's default), B with a temporary server per launch.
        monkeypatch.setenv("CAMPAIGN_SERVER", "on")
        done_a = campaign_cli("launch", "params.yaml", "--no-live", cwd=a)
        assert done_a.returncode == 0, done_a.stdout + done_a.stderr
        monkeypatch.setenv("CAMPAIGN_SERVER", "off")
        done_b = campaign_cli("launch", "params.yaml", "--no-live", cwd=b)
        assert done_b.returncode == 0, done_b.stdout + done_b.stderr
        # Each folder's database holds its own flow run, and only it.
        assert flow_run_names(a / FOLDER_DB) == ["twin · launch 1"]
        assert flow_run_names(b / FOLDER_DB) == ["twin · launch 1"]
        ids = {folder: read_campaign(folder / "runs", "twin").flow_run_id for folder in (a, b)}
        assert ids[a] != ids[b]
        # A's server, the one A's `campaign ui` shows, lists A's run and not B's.
        api = json.loads((a / ".campaign" / "server.json").read_text())["prefect_api"]
        assert [r["id"] for r in post(f"{api}/flow_runs/filter", {})] == [ids[a]]
    finally:
        campaign_cli("stop-server", cwd=a)


# --- a campaign that died: its flow run Crashed --------------------------------------------------

@pytest.mark.slow
def test_a_campaign_killed_outright_leaves_a_crashed_flow_run_and_the_resume_a_completed_one(tmp_path, digits_npz, monkeypatch):
    from flows.run.campaign import HOLD_ENV
    from tasks.grid import expand_grid
    from training.layout import trial_files
    from training.spec import load_spec

    params = write_params(tmp_path, "killed", digits_npz)
    api = os.environ["PREFECT_API_URL"]  # the test process's server: this folder's campaigns report to it
    monkeypatch.chdir(tmp_path)  # the spec read as the launch reads it (its paths from the folder): the same trial id
    (trial,) = expand_grid(load_spec(params))
    trial_dir = tmp_path / "runs" / "killed" / trial.id
    trial_dir.mkdir(parents=True)
    trial_files(trial_dir).hold.touch()  # the trainer waits at step 5 while it exists
    launch = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=tmp_path,
                              env={**os.environ, HOLD_ENV: "5"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        held = lambda: (p := read_progress(trial_dir)) is not None and p.state == "held"  # noqa: E731
        try:
            wait_for(lambda: held() or launch.poll() is not None, 240, "the trial held at its step")
        except AssertionError:
            launch.kill()
            raise AssertionError(f"{read_progress(trial_dir)}: {launch.communicate()[0][-3000:]}") from None
        assert launch.poll() is None, launch.stdout.read()[-3000:]
        first = read_campaign(tmp_path / "runs", "killed").flow_run_id
        assert flow_run_state(api, first) == "RUNNING"
        os.kill(launch.pid, signal.SIGKILL)  # no cleanup in the process itself
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.communicate(timeout=60)
    # The warden has ended what the launch left (the campaign's owner lock is free with them).
    wait_for(lambda: read_campaign(tmp_path / "runs", "killed").state == "interrupted", 60, "the warden's records")
    assert flow_run_state(api, first) == "RUNNING"  # what nobody told Prefect

    trial_files(trial_dir).hold.unlink()
    resumed = campaign_cli("resume", "params.yaml", "--no-live", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"last flow run ({first}) was left running by a process that died: marked Crashed" in resumed.stdout
    crashed = flow_run(api, first)
    assert crashed["state"]["type"] == "CRASHED" and "killed outright" in crashed["state"]["message"]
    second = read_campaign(tmp_path / "runs", "killed").flow_run_id
    assert second != first and flow_run(api, second)["state"]["type"] == "COMPLETED"
    # Its task runs that were running with it are Crashed too, none left Running.
    tasks = post(f"{api}/task_runs/filter", {"flow_runs": {"id": {"any_": [first]}}})
    assert tasks and all(t["state"]["type"] in ("CRASHED", "COMPLETED", "FAILED") for t in tasks), [t["state"] for t in tasks]
    assert any(t["state"]["type"] == "CRASHED" for t in tasks)


OWNER = ("import sys, time; from pathlib import Path; from flows.run.owner import claim_campaign; "
         "claim_campaign(Path(sys.argv[1]), 'gone', 'launch'); print('owned', flush=True); time.sleep(600)")


@pytest.mark.slow
def test_status_marks_the_flow_run_crashed_once_its_owner_is_killed_and_not_before(tmp_path):
    api = os.environ["PREFECT_API_URL"]
    flow = post(f"{api}/flows/", {"name": "campaign"})
    run = post(f"{api}/flow_runs/", {"flow_id": flow["id"], "name": "gone · launch 1",
                                     "state": {"type": "RUNNING", "name": "Running"}})
    runs = tmp_path / "runs"
    write_campaign(runs, CampaignRecord(name="gone", state="running", flow_run_id=run["id"],
                                        trials=(TrialEntry(id="t-1", label="lr=0.1", steps=10),)))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(runs / "gone")], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline() == "owned\n"
        alive = campaign_cli("status", "gone", "--runs-dir", "runs", cwd=tmp_path)
        assert alive.returncode == 0, alive.stderr
        assert flow_run_state(api, run["id"]) == "RUNNING"  # its owner lives: the campaign runs
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    dead = campaign_cli("status", "gone", "--runs-dir", "runs", cwd=tmp_path)
    assert dead.returncode == 0, dead.stderr
    assert "marked Crashed" in dead.stdout
    state = flow_run(api, run["id"])["state"]
    assert state["type"] == "CRASHED" and "no process owns the campaign since" in state["message"]
    again = campaign_cli("status", "gone", "--runs-dir", "runs", cwd=tmp_path)
    assert "marked Crashed" not in again.stdout  # said once
