"""A warm worker handed straight to the next trial (flows/run/handover.py, tasks.trial.Successor):
the rule for "about to end", and real campaigns whose one-device trials start in the worker
of the trial before them as it ends, each once, never two on a device."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import campaign_cli
from flows.run.handover import STAGE_DEPTH, may_stage, next_end, restage_moves, seconds_left, staging_order
from tasks.records import read_allocations
from test_function import trial_runs, write_params


def test_time_left_comes_from_the_trials_progress_else_from_the_trials_that_finished():
    assert seconds_left(10, 100, 0.5, 8.0, []) == pytest.approx(45.0)  # its measured step time
    assert seconds_left(10, 100, None, 5.0, []) == pytest.approx(45.0)  # its time so far per step
    assert seconds_left(100, 100, 0.5, 60.0, [1.0]) == 0.0
    assert seconds_left(None, 100, None, 0.5, [1.0, 2.0, 9.0]) == pytest.approx(1.5)  # the typical trial's
    assert seconds_left(0, 100, None, 3.0, [2.0]) == 0.0  # past the typical time: about to end
    assert seconds_left(None, 100, None, 0.5, []) is None  # nothing says


def test_the_next_trial_is_staged_on_the_shallowest_chain_then_the_one_ending_soonest_unknown_last():
    chains = [(None, 0), (3.0, 0), (0.5, 1), (1.0, 0)]
    assert sorted(chains, key=lambda c: staging_order(*c)) == [(1.0, 0), (3.0, 0), (None, 0), (0.5, 1)]


def test_under_early_stopping_a_trial_may_end_at_its_pruners_next_point():
    assert next_end(0, 300, None, 25, 3) == 300
    assert [next_end(s, 300, "asha", 25, 3) for s in (0, 24, 25, 74, 75, 225)] == [25, 25, 75, 75, 225, 300]
    assert [next_end(s, 300, "median", 40, 3) for s in (0, 39, 40, 299)] == [40, 40, 41, 300]


def test_a_trial_is_staged_after_one_that_ends_within_the_window_or_whose_end_is_unknown_and_never_when_it_is_off():
    assert may_stage(1.5, 0, 2.0, STAGE_DEPTH) and not may_stage(2.5, 0, 2.0, STAGE_DEPTH)
    assert may_stage(1.5, STAGE_DEPTH - 1, 2.0, STAGE_DEPTH) and not may_stage(1.5, STAGE_DEPTH, 2.0, STAGE_DEPTH)
    # Nothing says when it ends (it has just started): staged as one that ends soon (runs SCHEDULED).
    assert may_stage(None, 0, 2.0, STAGE_DEPTH) and may_stage(None, STAGE_DEPTH - 1, 2.0, STAGE_DEPTH)
    assert not may_stage(None, STAGE_DEPTH, 2.0, STAGE_DEPTH)
    assert may_stage(None, 2, math.inf, STAGE_DEPTH) and may_stage(1e9, 0, math.inf, STAGE_DEPTH)
    assert not may_stage(0.0, 0, 0.0, STAGE_DEPTH) and not may_stage(None, 0, 0.0, STAGE_DEPTH)  # off
    assert not may_stage(None, 0, 2.0, 0)
    # Where a search learns from the finished trials: not before something says.
    assert not may_stage(None, 0, 2.0, STAGE_DEPTH, unknown=False) and may_stage(1.5, 0, 2.0, STAGE_DEPTH, unknown=False)


def test_runs_opened_ahead_are_opened_once_in_another_thread_and_a_failed_one_is_opened_again_by_the_caller():
    import threading
    from types import SimpleNamespace

    from flows.run.handover import RunOpener

    calls: list[tuple[str, str]] = []

    def open_run(trial, scheduled):
        calls.append((trial.id, threading.current_thread().name))
        if trial.id == "bad":
            raise RuntimeError("database is locked")
        return f"run-{trial.id}"

    opener = RunOpener(open_run)
    a, b, bad = (SimpleNamespace(id=i) for i in ("a", "b", "bad"))
    opener.ahead([a, bad], scheduled=True)
    opener.ahead([a, bad], scheduled=False)  # asked again while opening: not opened twice
    assert opener.take(a) == ("run-a", True) and opener.take(bad) is None and opener.take(b) is None
    assert opener.take(a) is None  # taken once
    opener.keep("b", "run-b", False)  # a staged trial back in the queue: its run kept for its start
    assert opener.take(b) == ("run-b", False)
    opener.close()
    assert sorted(c[0] for c in calls) == ["a", "bad"] and all(c[1].startswith("run-opener") for c in calls)


def test_a_staged_trial_moves_to_a_worker_that_ends_sooner_by_more_than_the_margin():
    # (running trial, seconds left, something staged after it, that one may move)
    assert restage_moves([("a", 2.0, True, True), ("b", 0.5, False, False)]) == [("a", "b")]
    assert restage_moves([("a", 0.55, True, True), ("b", 0.5, False, False)]) == []  # within the margin: stays
    assert restage_moves([("a", 2.0, True, False), ("b", 0.5, False, False)]) == []  # the head of a chain: stays
    assert restage_moves([("a", 2.0, True, True), ("b", None, False, False)]) == []  # nothing says when b ends
    assert restage_moves([("a", None, True, True), ("b", 0.5, False, False)]) == []
    # Two staged, one free worker: the one that would wait longest moves.
    assert restage_moves([("a", 1.0, True, True), ("c", 3.0, True, True), ("b", 0.2, False, False)]) == [("c", "b")]
    assert restage_moves([("a", 1.0, True, True), ("c", 3.0, True, True), ("b", 0.2, False, False), ("d", 0.4, False, False)]) == [
        ("c", "b"), ("a", "d")]


def _never_two_on_a_device(root: Path) -> dict[str, list[str]]:
    """Replay the allocation log: no device starts a trial while another holds it. Returns
    each device's trials in order."""
    holding: dict[str, str] = {}
    order: dict[str, list[str]] = {}
    for event in read_allocations(root):
        if event.reason == "start":
            for device in event.devices:
                assert device not in holding, f"{event.trial} started on {device} held by {holding.get(device)}"
                holding[device] = event.trial
                order.setdefault(device, []).append(event.trial)
        else:
            for device in [d for d, t in holding.items() if t == event.trial]:
                del holding[device]
    assert not holding
    return order


@pytest.mark.slow
def test_staged_trials_start_in_the_worker_of_the_one_before_each_once_and_never_two_on_a_device(tmp_path, monkeypatch):
    """Eight short function trials on two slots, staged whatever their length: the trials
    after the first two start in the worker of the one before them as it ends (said among the
    campaign's events); every trial runs once (one call in its log), finishes, and its
    MLflow run holds each reported step once; the allocation log never shows a device held
    by two trials; the runs and task runs all end as they should."""
    monkeypatch.setenv("CAMPAIGN_STAGE_AHEAD_S", "inf")
    write_params(tmp_path, "chain", {"kwargs": {"every": 5}, "steps": 20},
                 grid={"training.lr": [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08]})
    done = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = tmp_path / "runs" / "chain"
    trials = sorted(p.parent.name for p in root.glob("*/result.json"))
    assert len(trials) == 8
    for trial in trials:
        assert json.loads((root / trial / "result.json").read_text())["steps"] == 20
        assert (root / trial / "train.log").read_text().count("calling mylab.loop:fit") == 1  # run once
    order = _never_two_on_a_device(root)
    assert sorted(t for ts in order.values() for t in ts) == trials
    handed = [line for line in (done.stdout + done.stderr).splitlines() if "in the warm worker of" in line]
    assert handed, done.stdout[-3000:]
    for line in handed:  # each right after the one before it on the same device
        trial, before = line.split("trial ", 1)[1].split()[0], line.split("in the warm worker of ", 1)[1].split(",")[0]
        device_order = next(ts for ts in order.values() if trial in ts)
        assert device_order.index(trial) == device_order.index(before) + 1, (line, order)
    client, runs = trial_runs(tmp_path)
    assert len(runs) == 8 and {r.info.status for r in runs} == {"FINISHED"}
    for run in runs:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
        assert sorted(steps) == [5, 10, 15, 20], (run.data.tags.get("campaign.trial"), steps)


@pytest.mark.slow
def test_short_trials_are_staged_before_anything_says_how_long_they_take(tmp_path):
    """With the default window, nothing says at first how long the first two trials take: a
    trial is staged after each all the same, and starts in its worker as it ends; every run
    ends FINISHED. (A ticket written just as its trial ends may find the worker gone idle:
    that trial then starts the usual way, so at least one of the two is handed over.)"""
    write_params(tmp_path, "first", {"kwargs": {"every": 50}, "steps": 200}, grid={"training.lr": [0.01, 0.02, 0.03, 0.04]})
    done = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = tmp_path / "runs" / "first"
    order = _never_two_on_a_device(root)
    handed = [line for line in (done.stdout + done.stderr).splitlines() if "in the warm worker of" in line]
    assert 1 <= len(handed) <= 2, done.stdout[-3000:]
    for line in handed:
        trial, before = line.split("trial ", 1)[1].split()[0], line.split("in the warm worker of ", 1)[1].split(",")[0]
        device_order = next(ts for ts in order.values() if trial in ts)
        assert device_order.index(trial) == device_order.index(before) + 1, (line, order)
    _, runs = trial_runs(tmp_path)
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}
