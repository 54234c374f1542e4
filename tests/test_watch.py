"""Watching a campaign from the terminal: `campaign status --watch`, `campaign logs TRIAL -f`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import campaign_cli
from training.files import write_json_atomic


def a_campaign(runs: Path) -> Path:
    """A campaign record with one trial that is still running (its owner: this process)."""
    from tasks.records import update_record, write_campaign

    write_campaign(runs, "w", {"name": "w", "trials": [{"id": "t1", "label": "lr=0.1", "steps": 10, "devices": [1, 1]}]})
    trial = runs / "w" / "t1"
    trial.mkdir(parents=True)
    update_record(trial, state="running", devices=["cpu0"])
    (trial / "train.log").write_text("trial t1: world size 1, fresh start\n")
    return trial


def test_logs_follow_a_trial_until_it_ends_and_watch_ends_with_it(tmp_path):
    runs = tmp_path / "runs"
    trial = a_campaign(runs)
    follow = subprocess.Popen([sys.executable, "-m", "flows.cli", "logs", "t1", "-f", "--runs-dir", str(runs)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = subprocess.Popen([sys.executable, "-m", "flows.cli", "status", "--watch", "--interval", "0.2", "--runs-dir", str(runs)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    assert follow.poll() is None and watch.poll() is None  # the trial runs: both keep going
    with open(trial / "train.log", "a") as log:
        log.write("trial t1: finished 10 steps\n")
    write_json_atomic(trial / "result.json", {"checkpoint": str(trial / "none"), "steps": 10, "metrics": {"val_accuracy": 0.5}})
    out, err = follow.communicate(timeout=30)
    assert follow.returncode == 0, err
    assert out == "trial t1: world size 1, fresh start\ntrial t1: finished 10 steps\n"
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0 and "finished" in out and "0.5000" in out, err


def test_logs_name_the_trials_when_the_trial_is_unknown(tmp_path):
    runs = tmp_path / "runs"
    a_campaign(runs)
    done = campaign_cli("logs", "nope", "--runs-dir", str(runs))
    assert done.returncode == 2 and "its trials: t1" in done.stderr
    done = campaign_cli("logs", "t1", "--runs-dir", str(runs))
    assert done.returncode == 0 and done.stdout == "trial t1: world size 1, fresh start\n"


def test_the_timeline_has_a_bar_per_device_and_holding(tmp_path):
    from tasks.timeline import intervals, write_timeline

    events = [
        {"time": 10.0, "trial": "a", "devices": ["d0", "d1"], "reason": "start"},
        {"time": 11.0, "trial": "b", "devices": ["d2"], "reason": "start"},
        {"time": 15.0, "trial": "a", "devices": ["d0"], "reason": "resize"},
        {"time": 18.0, "trial": "b", "devices": [], "reason": "preempted"},
        {"time": 20.0, "trial": "a", "devices": [], "reason": "end"},
        {"time": 21.0, "trial": "b", "devices": ["d1"], "reason": "start"},
    ]
    bars = {(b.trial, b.device, b.start, b.end, b.ended_by) for b in intervals(events, now=25.0)}
    assert bars == {("a", "d0", 10.0, 15.0, "resize"), ("a", "d1", 10.0, 15.0, "resize"), ("a", "d0", 15.0, 20.0, "end"),
                    ("b", "d2", 11.0, 18.0, "preempted"), ("b", "d1", 21.0, 25.0, "running")}
    (tmp_path / "allocations.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    png, html = write_timeline(tmp_path, "campaign t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in html.read_text() and "campaign t" in html.read_text()
