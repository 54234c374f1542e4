"""The campaign flow's side of a resize (flows/run/live.py): what it answers and which leases it keeps,
once the trial's agent has taken the command. Real lease store and control files, no processes."""

from __future__ import annotations

from pathlib import Path

from cluster.inventory import discover
from cluster.leases import LeaseStore
from cluster.sizing import SizedRequest
from flows.run.live import Running, serve_resizes
from training.spec import parse_spec
from tasks.grid import expand_grid
from tasks.resize import request_resize
from training.layout import trial_files
from training.files import read_json, write_json_atomic


def running_trial(tmp_path: Path, store: LeaseStore):
    """A [1, 2]-device trial running on the first of two CPU slots, its lease held."""
    spec = parse_spec({"campaign": {"name": "c"}, "model": {"name": "mlp"}, "training": {"steps": 10, "batch_size": 8, "lr": 0.1}})
    (trial,) = expand_grid(spec)
    inventory = discover(cpu_slots=2)
    capacity = {d.id: d.memory_bytes for d in inventory.devices}
    request = SizedRequest(trial.id, 1, 2, (1 << 20, 1 << 20))
    first = inventory.devices[0]
    holder = f"c/{trial.id}"
    assert store.acquire(holder, {first.id: 1 << 20}, capacity)
    job = Running(trial, request, [first], holder, run_id="r", trial_dir=tmp_path / trial.id, elastic=True)
    return job, inventory, capacity


def agent_says(job: Running, seq: int, status: str, devices: list[str]) -> None:
    write_json_atomic(job.trial_dir / "control" / "state.json", {"seq": seq, "gen": seq + 1, "devices": devices, "status": status, "time": 0.0})


def grow_to_two(tmp_path: Path):
    store = LeaseStore(tmp_path / "leases.db")
    job, inventory, capacity = running_trial(tmp_path, store)
    request_resize(job.trial_dir, 2)
    assert "requested" in serve_resizes(job, inventory, store, capacity)
    assert job.awaiting is not None and {l.device_id for l in store.leases()} == {d.id for d in inventory.devices}
    assert serve_resizes(job, inventory, store, capacity) is None  # the agent has not taken it yet
    return job, inventory, store, capacity


def test_an_applied_grow_moves_the_trial_to_its_new_devices(tmp_path):
    job, inventory, store, capacity = grow_to_two(tmp_path)
    agent_says(job, 1, "running", [d.id for d in inventory.devices])
    assert "resized to 2" in serve_resizes(job, inventory, store, capacity)
    assert job.device_ids == [d.id for d in inventory.devices] and job.awaiting is None
    assert read_json(trial_files(job.trial_dir).resize_answer)["status"] == "applied"
    assert {l.device_id for l in store.leases()} == set(job.device_ids)


def test_a_trial_that_finishes_before_its_grow_lands_is_not_reported_resized(tmp_path):
    job, inventory, store, capacity = grow_to_two(tmp_path)
    first = inventory.devices[0].id
    agent_says(job, 1, "finished", [first])  # the agent took seq 1, but training ended first
    assert "finished before its resize" in serve_resizes(job, inventory, store, capacity)
    assert job.device_ids == [first] and job.awaiting is None
    result = read_json(trial_files(job.trial_dir).resize_answer)
    assert result["status"] == "finished" and "before the resize" in result["detail"]
    assert [l.device_id for l in store.leases()] == [first]  # the device the grow took is free again


def test_the_campaign_loop_waits_for_the_first_trial_to_end_on_the_trials_threads():
    """`first_finished` (the campaign loop's wait): None while nothing ended, then the future
    that ended. It waits on the task runner's thread futures, not on Prefect's SIGALRM
    timeout, which once landed inside a lock's release and failed a campaign."""
    import threading
    import time
    from concurrent.futures import Future
    from uuid import uuid4

    from prefect.futures import PrefectConcurrentFuture

    from flows.run.campaign import first_finished

    slow, quick = Future(), Future()
    futures = [PrefectConcurrentFuture(uuid4(), slow), PrefectConcurrentFuture(uuid4(), quick)]
    started = time.monotonic()
    assert first_finished(futures, 0.2) is None and time.monotonic() - started >= 0.2
    threading.Timer(0.1, quick.set_result, args=({"steps": 1},)).start()
    assert first_finished(futures, 10) is futures[1]
