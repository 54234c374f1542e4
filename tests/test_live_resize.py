"""A trial in a real campaign is resized by hand (`campaign resize`) and keeps going."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from cluster.inventory import discover
from cluster.leases import LeaseStore
from training.files import read_json
from training.layout import campaign_files, trial_files

from conftest import wait_for

pytestmark = pytest.mark.slow  # real campaigns, torchrun or elastic trials: `make test-fast` skips them


def live_params(tmp_path: Path, data: Path, name: str, training: dict, **sections) -> Path:
    """A campaign of elastic [1, 2]-device trials on 2 CPU slots, stores in tmp_path."""
    params = {
        "campaign": {"name": name, "seed": sections.pop("seed", 1)},
        "data": {"path": str(data)},
        "model": {"name": "small_cnn", "width": 8},
        "training": {"batch_size": 30, "lr": 0.05, "log_every": 50, **training},
        "resources": {"devices": [1, 2]},
        "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name,
                     "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "m.json")},
        **sections,
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def resize(runs: Path, trial: str, devices: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "resize", trial, str(devices), "--runs-dir", str(runs), "--wait-s", "90"],
                          capture_output=True, text=True, timeout=120)


def test_hand_resize_in_a_live_campaign(tmp_path, digits_npz, prefect_backend, monkeypatch):
    """Another campaign holds one of the two slots, so the [1, 2] trial starts on one. The
    trial is held from step 100 (each control step while its `hold` file is there: a held
    trial still answers its agent, then waits again), so every resize lands mid-trial, on a
    600-step trial, however loaded the machine."""
    from flows.run.campaign import HOLD_ENV, campaign_flow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(HOLD_ENV, "100")
    runs = tmp_path / "runs"
    live_params(tmp_path, digits_npz, "live", {"steps": 600, "checkpoint_every": 2000, "eval_every": 600})
    slots = [d.id for d in discover(cpu_slots=2).devices]
    capacity = {s: discover(cpu_slots=2).device(s).memory_bytes for s in slots}
    store = LeaseStore()
    # Renewed while held (`hold`): a campaign slow to start must not find it expired.
    someone_else = contextlib.ExitStack()
    someone_else.enter_context(store.hold("someone-else/x", {slots[1]: capacity[slots[1]]}, capacity))
    outcomes: dict[str, subprocess.CompletedProcess] = {}

    def drive():
        deadline = time.time() + 120
        record = None
        while record is None and time.time() < deadline:
            record = read_json(runs / "live" / "campaign.json")
            time.sleep(0.1)
        trial = record["trials"][0]["id"]
        trial_dir = runs / "live" / trial
        trial_dir.mkdir(parents=True, exist_ok=True)
        trial_files(trial_dir).hold.touch()
        outcomes["too many"] = resize(runs, trial, 3)  # refused by the CLI itself, from the campaign's record
        while (read_json(trial_dir / "progress.json") or {}).get("state") != "held" and time.time() < deadline:
            time.sleep(0.05)
        outcomes["blocked"] = resize(runs, trial, 2)  # the free slot is held by another campaign
        someone_else.close()
        outcomes["grow"] = resize(runs, trial, 2)
        outcomes["shrink"] = resize(runs, trial, 1)
        trial_files(trial_dir).hold.unlink()

    driver = threading.Thread(target=drive)
    driver.start()
    summary = campaign_flow(str(tmp_path / "params.yaml"))
    driver.join()
    assert summary["finished"] == 1

    assert outcomes["too many"].returncode == 2 and "1 to 2 devices" in outcomes["too many"].stderr
    assert outcomes["blocked"].returncode == 2 and "not enough free devices" in outcomes["blocked"].stderr
    assert outcomes["grow"].returncode == 0, outcomes["grow"].stderr
    assert outcomes["shrink"].returncode == 0, outcomes["shrink"].stderr

    record = json.loads((runs / "live" / "campaign.json").read_text())
    trial = record["trials"][0]["id"]
    events = [json.loads(l) for l in (runs / "live" / trial / "resizes.jsonl").read_text().splitlines()]
    assert [(len(e["from"]), len(e["to"])) for e in events] == [(1, 2), (2, 1)]

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = [r for r in client.search_runs([client.get_experiment_by_name("live").experiment_id]) if r.data.tags.get("campaign.kind") == "trial"]
    assert {"resize.1", "resize.2"} <= set(run.data.tags)
    assert run.data.tags["resize.1"].startswith("1 -> 2 devices at step ") and "paused" in run.data.tags["resize.1"]  # readable
    sizes = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "world_size"), key=lambda m: m.step)]
    assert sizes == [1, 2, 1]  # the trial's history of sizes, read back
    assert run.info.status == "FINISHED" and LeaseStore().leases() == []


def test_a_hand_preemption_is_answered_and_the_trial_resumes(tmp_path, digits_npz, prefect_backend, monkeypatch):
    """`campaign resize TRIAL 0` stops the trial at once and says so; with nothing else to
    run, the campaign resumes it from its checkpoint instead of sitting on free devices.
    The trial is held at step 300 until the preemption's command reached its agent: under
    load it once ran to its end (3,000 fast steps) before the preemption landed."""
    from flows.run.campaign import HOLD_ENV, campaign_flow
    from training.agent_commands import read_command

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(HOLD_ENV, "300")
    runs = tmp_path / "runs"
    live_params(tmp_path, digits_npz, "park", {"steps": 800, "checkpoint_every": 100, "eval_every": 800})
    outcome: list[tuple[int, str, str]] = []

    def drive():
        deadline = time.time() + 120
        while (record := read_json(runs / "park" / "campaign.json")) is None and time.time() < deadline:
            time.sleep(0.1)
        trial_dir = runs / "park" / record["trials"][0]["id"]
        trial_dir.mkdir(parents=True, exist_ok=True)
        trial_files(trial_dir).hold.touch()
        while (read_json(trial_dir / "progress.json") or {}).get("state") != "held" and time.time() < deadline:
            time.sleep(0.05)
        asked = subprocess.Popen([sys.executable, "-m", "flows.cli", "resize", record["trials"][0]["id"], "0", "--runs-dir", str(runs),
                                  "--wait-s", "90"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The preemption reached the agent's folder: a command to run on no device.
        preempt = lambda: any(getattr(read_command(trial_dir / "control", seq), "devices", None) == () for seq in range(1, 4))
        while not preempt() and time.time() < deadline:
            time.sleep(0.05)
        trial_files(trial_dir).hold.unlink()
        out, err = asked.communicate(timeout=120)
        outcome.append((asked.returncode, out, err))

    driver = threading.Thread(target=drive)
    driver.start()
    summary = campaign_flow(str(tmp_path / "params.yaml"))
    driver.join()
    assert outcome[0][0] == 0, outcome[0][2]
    assert "preempted" in outcome[0][1]
    assert summary["finished"] == 1
    (trial,) = json.loads((runs / "park" / "campaign.json").read_text())["trials"]
    reasons = [json.loads(l)["reason"] for l in (runs / "park" / "allocations.jsonl").read_text().splitlines()]
    assert reasons == ["start", "preempted", "start", "end"]
    assert json.loads((runs / "park" / trial["id"] / "result.json").read_text())["resumed_from_step"] >= 200
    log = (runs / "park" / trial["id"] / "train.log").read_text()  # an elastic trial's log tells its story too
    assert log.count("generation 0 on 2 device(s)") == 2 and "state from disk" in log and "finished 800 steps" in log


def test_policy_grows_a_trial_when_another_finishes(tmp_path, digits_npz, prefect_backend, monkeypatch):
    """The long trial is held from step 100 until the policy has grown it (a held trial still
    answers its agent), so it is still running when the short one ends, however loaded the
    machine, without training thousands of steps to make sure."""
    from flows.run.campaign import HOLD_ENV, campaign_flow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(HOLD_ENV, "100")
    runs = tmp_path / "runs"
    live_params(tmp_path, digits_npz, "grow", {"steps": 600, "checkpoint_every": 1000, "eval_every": 3000}, seed=2,
                grid={"training.steps": [600, 1200]}, scheduling={"resize_pause_s": 0.5, "min_run_s": 1.0, "order": "attained"})

    def hold_the_long_one_until_it_grows():
        files = campaign_files(runs / "grow")
        record = wait_for(lambda: read_json(files.record), 120, "the campaign's record")
        long = next(t["id"] for t in record["trials"] if t["steps"] == 1200)
        hold = trial_files(runs / "grow" / long).hold
        hold.parent.mkdir(parents=True, exist_ok=True)
        hold.touch()

        def grown() -> bool:
            events = [json.loads(l) for l in files.allocations.read_text().splitlines() if l.strip()] if files.allocations.exists() else []
            return any(e["trial"] == long and e["reason"] == "resize" for e in events)

        try:
            wait_for(grown, 240, "the long trial's resize", every=0.05)
        finally:
            hold.unlink()

    driver = threading.Thread(target=hold_the_long_one_until_it_grows)
    driver.start()
    summary = campaign_flow(str(tmp_path / "params.yaml"))
    driver.join()
    assert summary["finished"] == 2

    record = json.loads((runs / "grow" / "campaign.json").read_text())
    short, long = (t["id"] for t in record["trials"])
    allocations = [json.loads(l) for l in (runs / "grow" / "allocations.jsonl").read_text().splitlines()]
    # Least attained service: both start side by side on one slot each (admitting a trial beats
    # growing one). By remaining work, the default, the short trial would take both slots first.
    starts = {a["trial"]: a["devices"] for a in allocations if a["reason"] == "start"}
    assert len(starts[short]) == 1 and len(starts[long]) == 1 and starts[short] != starts[long]
    # When the short one ends, the long one gets its slot too, by a resize, and keeps going.
    end_short = next(a["time"] for a in allocations if a["trial"] == short and a["reason"] == "end")
    grown = [a for a in allocations if a["trial"] == long and a["reason"] == "resize"]
    assert grown and grown[0]["time"] > end_short and len(grown[0]["devices"]) == 2
    events = [json.loads(l) for l in (runs / "grow" / long / "resizes.jsonl").read_text().splitlines()]
    assert (len(events[0]["from"]), len(events[0]["to"])) == (1, 2)
    # Who had which device when: no device held by two trials at any time.
    holding: dict[str, set[str]] = {}
    for a in allocations:
        holding[a["trial"]] = set(a["devices"])
        held = [d for devices in holding.values() for d in devices]
        assert len(held) == len(set(held)), f"a device held twice at {a}"


def test_by_default_the_trial_with_least_work_left_goes_first(tmp_path, digits_npz, prefect_backend, monkeypatch):
    """Trials declare their steps: the policy runs the shortest on both slots first (shortest
    remaining work first), and the long one starts on them when it ends."""
    from flows.run.campaign import campaign_flow

    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    live_params(tmp_path, digits_npz, "srpt", {"steps": 300, "checkpoint_every": 1000, "eval_every": 3000}, seed=2,
                grid={"training.steps": [1200, 300]}, scheduling={"resize_pause_s": 0.5, "min_run_s": 1.0})
    assert campaign_flow(str(tmp_path / "params.yaml"))["finished"] == 2
    record = json.loads((runs / "srpt" / "campaign.json").read_text())
    long, short = (t["id"] for t in record["trials"])
    allocations = [json.loads(l) for l in (runs / "srpt" / "allocations.jsonl").read_text().splitlines()]
    starts = {a["trial"]: a for a in allocations if a["reason"] == "start"}
    assert len(starts[short]["devices"]) == 2, allocations
    end_short = next(a["time"] for a in allocations if a["trial"] == short and a["reason"] == "end")
    assert starts[long]["time"] >= end_short and len(starts[long]["devices"]) == 2, allocations


def test_policy_preempts_a_running_trial_for_a_waiting_one(tmp_path, digits_npz, prefect_backend, monkeypatch):
    """Three elastic trials on two slots: least-attained-service makes a running trial yield
    (a resize to zero) so the waiting one starts; the yielded one resumes from its checkpoint."""
    from flows.run.campaign import HOLD_ENV, campaign_flow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(HOLD_ENV, "100")
    runs = tmp_path / "runs"
    # Every trial is held from step 100 until the first yield (a held trial still answers its
    # agent: the yield stops it), so the yield lands mid-trial however loaded the machine.
    live_params(tmp_path, digits_npz, "share", {"steps": 600, "checkpoint_every": 1000, "eval_every": 600}, seed=3,
                grid={"training.lr": [0.01, 0.02, 0.03]}, scheduling={"resize_pause_s": 0.5, "min_run_s": 0.5, "order": "attained"})

    def release_after_the_first_yield():
        deadline = time.time() + 120
        while (record := read_json(runs / "share" / "campaign.json")) is None and time.time() < deadline:
            time.sleep(0.1)
        holds = [trial_files(runs / "share" / trial["id"]).hold for trial in record["trials"]]
        for hold in holds:
            hold.parent.mkdir(parents=True, exist_ok=True)
            hold.touch()
        allocations = runs / "share" / "allocations.jsonl"
        while time.time() < deadline and not (allocations.exists() and '"preempted"' in allocations.read_text()):
            time.sleep(0.05)
        for hold in holds:
            hold.unlink()

    driver = threading.Thread(target=release_after_the_first_yield)
    driver.start()
    summary = campaign_flow(str(tmp_path / "params.yaml"))
    driver.join()
    assert summary["finished"] == 3

    allocations = [json.loads(l) for l in (runs / "share" / "allocations.jsonl").read_text().splitlines()]
    first_starts = {}
    for a in allocations:
        if a["reason"] == "start":
            first_starts.setdefault(a["trial"], a["time"])
    preempted = [a for a in allocations if a["reason"] == "preempted"]
    assert preempted, "no running trial yielded to the waiting one"
    waiting = max(first_starts, key=first_starts.get)  # the one that could not start at first
    assert first_starts[waiting] >= preempted[0]["time"]  # it started on the devices a yield freed
    yielded = preempted[0]["trial"]
    log = (runs / "share" / yielded / "train.log").read_text()
    assert "already finished" not in log
    result = json.loads((runs / "share" / yielded / "result.json").read_text())
    assert result["steps"] == 600 and result["resumed_from_step"] > 0  # it went on from its checkpoint
    holding: dict[str, set[str]] = {}
    for a in allocations:
        holding[a["trial"]] = set(a["devices"])
        held = [d for devices in holding.values() for d in devices]
        assert len(held) == len(set(held)), f"a device held twice at {a}"
