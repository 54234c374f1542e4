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
from training.host_records import write_host_status


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


def test_a_grow_that_landed_and_finished_before_the_campaign_looked_is_reported_applied(tmp_path):
    job, inventory, store, capacity = grow_to_two(tmp_path)
    both = [d.id for d in inventory.devices]
    agent_says(job, 1, "finished", both)  # the short rest of training ran on both, and ended
    assert "resized to 2" in serve_resizes(job, inventory, store, capacity)
    assert job.device_ids == both and read_json(trial_files(job.trial_dir).resize_answer)["status"] == "applied"


def test_a_grow_whose_agent_failed_is_not_reported_applied_and_gives_its_new_device_back(tmp_path):
    job, inventory, store, capacity = grow_to_two(tmp_path)
    first = inventory.devices[0].id
    agent_says(job, 1, "failed", [first])  # the agent took seq 1 and failed
    assert "its agent failed before its resize" in serve_resizes(job, inventory, store, capacity)
    assert job.device_ids == [first] and job.awaiting is None
    assert read_json(trial_files(job.trial_dir).resize_answer)["status"] == "rejected"
    assert [l.device_id for l in store.leases()] == [first]


def gpus_with_auto_memory(tmp_path: Path):
    """A [1, 2]-device trial on two 80 GiB GPUs that needs 18 GiB on each at 2 and 30 GiB at 1
    (`memory_gb: auto`: fewer devices, more memory each), leased at 2."""
    from cluster.types import Device, Inventory
    from flows.run.live import claims

    store = LeaseStore(tmp_path / "leases.db")
    job, _, _ = running_trial(tmp_path, store)
    store.release(job.holder)
    inventory = Inventory(tuple(Device(f"n/gpu{i}", "n", i, "gpu", "H100", 80 * GIB) for i in range(2)))
    capacity = {d.id: d.memory_bytes for d in inventory.devices}
    job.devices = list(inventory.devices)
    job.request = SizedRequest(job.trial.id, 1, 2, (30 * GIB, 18 * GIB))
    assert store.acquire(job.holder, claims(job, job.devices), capacity)
    return job, inventory, store, capacity


GIB = 1 << 30


def test_a_shrink_leases_the_memory_the_new_size_needs_on_the_devices_it_keeps(tmp_path):
    job, inventory, store, capacity = gpus_with_auto_memory(tmp_path)
    request_resize(job.trial_dir, 1)
    assert "requested" in serve_resizes(job, inventory, store, capacity)
    assert store.usage()["n/gpu0"] == 30 * GIB  # before the agent is told
    agent_says(job, 1, "running", ["n/gpu0"])
    assert "resized to 1" in serve_resizes(job, inventory, store, capacity)
    assert store.usage() == {"n/gpu0": 30 * GIB}


def test_a_shrink_onto_a_device_without_the_memory_it_needs_there_is_refused(tmp_path):
    job, inventory, store, capacity = gpus_with_auto_memory(tmp_path)
    assert store.acquire("other/t", {"n/gpu0": 55 * GIB, "n/gpu1": 55 * GIB}, capacity)  # another trial packed beside it
    request_resize(job.trial_dir, 1)
    assert serve_resizes(job, inventory, store, capacity) is None
    answer = read_json(trial_files(job.trial_dir).resize_answer)
    assert answer["status"] == "rejected" and "needs 30.0 GiB on each" in answer["detail"], answer
    assert job.device_ids == ["n/gpu0", "n/gpu1"] and store.usage() == {"n/gpu0": 73 * GIB, "n/gpu1": 73 * GIB}


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


# --- a pool trial whose agent spans nodes in memory (flows/run/live.py Hosts) ------------------

def two_node_trial(tmp_path: Path):
    """A [1, 2] trial under an agent on node a of a two-node pool (one CPU slot each), and a
    record of the host segments the campaign asked for and ended."""
    from cluster.inventory import DeclaredNode, declared_inventory
    from flows.run.live import Hosts

    store = LeaseStore(tmp_path / "leases.db")
    spec = parse_spec({"campaign": {"name": "c"}, "model": {"name": "mlp"}, "training": {"steps": 10, "batch_size": 8, "lr": 0.1}})
    (trial,) = expand_grid(spec)
    inventory = declared_inventory([DeclaredNode("a", 1, 1 << 30, "cpu"), DeclaredNode("b", 1, 1 << 30, "cpu")])
    capacity = {d.id: d.memory_bytes for d in inventory.devices}
    a0, b0 = inventory.devices
    assert store.acquire(f"c/{trial.id}", {a0.id: 1 << 20}, capacity)
    job = Running(trial, SizedRequest(trial.id, 1, 2, (1 << 20, 1 << 20)), [a0], f"c/{trial.id}", run_id="r",
                  trial_dir=tmp_path / trial.id, elastic=True, agent_node="a")
    asked: list = []
    hosts = Hosts(start=lambda job, node, devices, seq: asked.append(("start", node, [d.id for d in devices], seq)) or f"run-{len(asked)}",
                  end=lambda run: asked.append(("end", run)))
    return job, inventory, store, capacity, hosts, asked


def host_says(job: Running, node: str, seq: int, status: str, reason: str = "") -> None:
    write_host_status(job.trial_dir, node, seq, status, reason)


def test_a_grow_onto_another_node_tells_the_agent_only_once_the_host_there_is_up(tmp_path):
    from training.agent_commands import read_command

    job, inventory, store, capacity, hosts, asked = two_node_trial(tmp_path)
    serve = lambda: serve_resizes(job, inventory, store, capacity, recall=lambda _: asked.append("recalled"), hosts=hosts)  # noqa: E731
    request_resize(job.trial_dir, 2)
    assert "its hosts on b start" in serve()
    assert asked == [("start", "b", ["b/cpu0"], 1)] and read_command(trial_files(job.trial_dir).control, 1) is None
    assert {lease.device_id for lease in store.leases()} == {"a/cpu0", "b/cpu0"}  # the campaign's lease first
    host_says(job, "b", 0, "ready")  # an earlier grow's host: not this one
    assert serve() is None and read_command(trial_files(job.trial_dir).control, 1) is None
    host_says(job, "b", 1, "ready")
    assert "hosts ready on b" in serve()
    command = read_command(trial_files(job.trial_dir).control, 1)
    assert [(d["id"], d["node"]) for d in command.devices] == [("a/cpu0", "a"), ("b/cpu0", "b")]  # rank 0 stays on a
    agent_says(job, 1, "running", ["a/cpu0", "b/cpu0"])
    assert "resized to 2" in serve() and job.device_ids == ["a/cpu0", "b/cpu0"]

    # Node b lost: the agent went on without it; the campaign follows and gives b's lease back.
    agent_says(job, 1, "running", ["a/cpu0"])
    assert "without node b" in serve() and job.device_ids == ["a/cpu0"]
    assert {lease.device_id for lease in store.leases()} == {"a/cpu0"}
    assert "recalled" not in asked and read_command(trial_files(job.trial_dir).control, 2) is None  # nothing stopped or relaunched


def test_a_grow_whose_host_is_refused_on_its_node_is_answered_rejected_and_leases_nothing(tmp_path):
    from training.agent_commands import read_command

    job, inventory, store, capacity, hosts, asked = two_node_trial(tmp_path)
    request_resize(job.trial_dir, 2)
    serve_resizes(job, inventory, store, capacity, recall=lambda _: None, hosts=hosts)
    host_says(job, "b", 1, "refused", "node lease file: b/cpu0 held by another campaign")
    assert "refused" in serve_resizes(job, inventory, store, capacity, recall=lambda _: None, hosts=hosts)
    answer = read_json(trial_files(job.trial_dir).resize_answer)
    assert answer["status"] == "rejected" and "b/cpu0 held by another campaign" in answer["detail"]
    assert job.hosting is None and job.next_seq == 1 and read_command(trial_files(job.trial_dir).control, 1) is None
    assert {lease.device_id for lease in store.leases()} == {"a/cpu0"} and asked == [("start", "b", ["b/cpu0"], 1)]


def test_only_a_trial_whose_agent_keeps_a_device_on_its_node_moves_in_memory(tmp_path):
    from flows.run.live import new_host_nodes

    job, inventory, *_ = two_node_trial(tmp_path)
    a0, b0 = inventory.devices
    assert new_host_nodes(job, [a0, b0]) == ["b"] and new_host_nodes(job, [a0]) == []
    assert new_host_nodes(job, [b0]) is None  # rank 0 stays on the agent's node: a move off it is a relaunch
    job.agent_node = None
    assert new_host_nodes(job, [a0, b0]) is None  # under torchrun across nodes, or no shared folder


def test_prefect_console_lines_to_a_file_go_through_a_plain_handler_with_the_same_text_and_a_terminals_stay(tmp_path):
    import logging
    import os

    from prefect.logging.handlers import PrefectConsoleHandler

    from flows.run.live_view import plain_console_logs

    out = open(tmp_path / "out.txt", "w")
    leader, follower = os.openpty()
    terminal = os.fdopen(follower, "w")
    to_file, to_terminal = logging.getLogger("campaign.test_plain_file"), logging.getLogger("campaign.test_plain_terminal")
    for logger, stream in ((to_file, out), (to_terminal, terminal)):
        handler = PrefectConsoleHandler(stream=stream)
        handler.setFormatter(logging.Formatter("%(levelname)s | %(name)s - %(message)s"))
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logging.INFO)
    try:
        line = "trial a-1 starts on vm/cpu0: lr=[0.1, 0.2] (see http://127.0.0.1:4200/runs)"
        to_file.info(line)  # through rich
        plain_console_logs()
        to_file.info(line)
        out.flush()
        said = (tmp_path / "out.txt").read_text().splitlines()
        assert said == [f"INFO | campaign.test_plain_file - {line}"] * 2
        assert not any(isinstance(h, PrefectConsoleHandler) for h in to_file.handlers)
        assert isinstance(to_terminal.handlers[0], PrefectConsoleHandler)  # a terminal keeps Prefect's colours
    finally:
        for logger in (to_file, to_terminal):
            logger.handlers = []
        out.close()
        terminal.close()
        os.close(leader)
