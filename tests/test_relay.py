"""The command relay of an elastic trial on a pool node (flows/pool/relay.py), on real files and a
real lease file, with the agent's side written by hand."""

from __future__ import annotations

import os

from conftest import wait_for
from cluster.leases import LeaseStore
from flows.pool.relay import CommandRelay
from training.agent_state import agent_state_now
from training.agent_commands import read_command, read_refusal, write_command
from training.files import read_json

CAPACITY = {"a/cpu0": 1, "a/cpu1": 1}


def leased(store: LeaseStore) -> set[str]:
    return {lease.device_id for lease in store.leases()}


def test_a_grow_is_forwarded_only_once_the_node_lease_file_gave_the_devices(tmp_path):
    store = LeaseStore(tmp_path / "leases.db")
    outer, inner = tmp_path / "control", tmp_path / "control" / "node-a"
    assert store.acquire("c/t@a:1", {"a/cpu0": 1}, CAPACITY, pid=os.getpid())
    assert store.acquire("other/u@a:2", {"a/cpu1": 1}, CAPACITY, pid=os.getpid())  # another campaign, on the node itself
    with CommandRelay(outer, inner, store, "c/t@a:1", CAPACITY, ["a/cpu0"]):
        write_command(outer, 1, [{"id": "a/cpu0"}, {"id": "a/cpu1"}])
        refused = wait_for(lambda: read_refusal(outer, 1), 10, "the relay", every=0.02)
        assert "a/cpu1 held by another campaign" in refused.reason
        assert read_command(inner, 1) is None  # the agent never saw it

        store.release("other/u@a:2")
        write_command(outer, 2, [{"id": "a/cpu0"}, {"id": "a/cpu1"}])
        forwarded = wait_for(lambda: read_command(inner, 1), 10, "the grow forwarded", every=0.02)  # the agent's numbering
        assert forwarded.seq == 1 and forwarded.device_ids == ["a/cpu0", "a/cpu1"]
        assert leased(store) == {"a/cpu0", "a/cpu1"}  # leased before the agent was told

        agent_state_now(1, 1, ["a/cpu0", "a/cpu1"], "running").write(inner)
        wait_for(lambda: (read_json(outer / "state.json") or {}).get("seq") == 2, 10, "the state in the campaign's numbering", every=0.02)

        write_command(outer, 3, [{"id": "a/cpu1"}])  # a shrink: the lease stays until the agent let go
        wait_for(lambda: read_command(inner, 2), 10, "the relay", every=0.02)
        assert leased(store) == {"a/cpu0", "a/cpu1"}
        agent_state_now(2, 2, ["a/cpu1"], "running").write(inner)
        # The relay gives the lease back and passes the state on in two steps: wait for both
        # (waiting for the first alone raced the second under load: `assert 2 == 3`).
        wait_for(lambda: leased(store) == {"a/cpu1"} and (read_json(outer / "state.json") or {}).get("seq") == 3, 10,
                 "the shrink's lease given back and its state passed on", every=0.02)


def test_an_earlier_segments_state_in_the_agents_folder_is_not_read_as_a_shrink(tmp_path):
    """Shared storage keeps the folder of a segment that ran before (the trial's node died):
    its "running on other devices" must not release the new segment's lease."""
    store = LeaseStore(tmp_path / "leases.db")
    outer, inner = tmp_path / "control", tmp_path / "control" / "node-b"
    inner.mkdir(parents=True)
    agent_state_now(4, 4, ["b/cpu5"], "running").write(inner)
    write_command(inner, 1, [{"id": "b/cpu5"}])
    assert store.acquire("c/t@b:1", {"a/cpu0": 1}, CAPACITY, pid=os.getpid())
    with CommandRelay(outer, inner, store, "c/t@b:1", CAPACITY, ["a/cpu0"]) as relay:
        wait_for(lambda: relay.rounds >= 5, 10, "five relay rounds", every=0.02)
        assert leased(store) == {"a/cpu0"}
        assert read_json(outer / "state.json") is None and read_command(inner, 1) is None


def test_a_trial_that_shares_its_gpus_grows_onto_one_another_campaign_shares_too(tmp_path):
    """Several small trials share a GPU by memory, as the campaign packed them: a relay of a
    trial at 4 GiB per device leases 4 GiB of the new device, beside another campaign's 4 GiB
    on a 16 GiB GPU; one for whole devices is refused it."""
    gib = 2**30
    capacity = {"a/gpu0": 16 * gib, "a/gpu1": 16 * gib}
    store = LeaseStore(tmp_path / "leases.db")
    outer, inner = tmp_path / "control", tmp_path / "control" / "node-a"
    assert store.acquire("c/t@a:1", {"a/gpu0": 4 * gib}, capacity, pid=os.getpid())
    assert store.acquire("other/u@a:2", {"a/gpu1": 4 * gib}, capacity, pid=os.getpid())
    with CommandRelay(outer, inner, store, "c/t@a:1", capacity, ["a/gpu0"], 4 * gib):
        write_command(outer, 1, [{"id": "a/gpu0"}, {"id": "a/gpu1"}])
        wait_for(lambda: read_command(inner, 1), 10, "the grow forwarded", every=0.02)
    assert sorted((lease.holder, lease.device_id, lease.memory_bytes) for lease in store.leases()) == [
        ("c/t@a:1", "a/gpu0", 4 * gib), ("c/t@a:1", "a/gpu1", 4 * gib), ("other/u@a:2", "a/gpu1", 4 * gib)]
    store.release("c/t@a:1")
    assert store.acquire("w/x@a:3", {"a/gpu0": 4 * gib}, capacity, pid=os.getpid())
    whole_outer = tmp_path / "whole"
    with CommandRelay(whole_outer, whole_outer / "node-a", store, "w/x@a:3", capacity, ["a/gpu0"]):  # whole devices (the default)
        write_command(whole_outer, 1, [{"id": "a/gpu0"}, {"id": "a/gpu1"}])
        refused = wait_for(lambda: read_refusal(whole_outer, 1), 10, "the relay", every=0.02)
    assert "a/gpu1 held by another campaign" in refused.reason


def test_a_lease_file_locked_past_its_busy_timeout_refuses_the_grow_and_the_relay_goes_on(tmp_path, monkeypatch):
    """Another process holds the node's lease file locked longer than a writer waits: the grow
    is refused (saying why), not lost with the relay's thread; the next one goes through."""
    import sqlite3

    monkeypatch.setenv("CAMPAIGN_LEASE_BUSY_S", "0.2")
    store = LeaseStore(tmp_path / "leases.db")
    outer, inner = tmp_path / "control", tmp_path / "control" / "node-a"
    assert store.acquire("c/t@a:1", {"a/cpu0": 1}, CAPACITY, pid=os.getpid())
    with CommandRelay(outer, inner, store, "c/t@a:1", CAPACITY, ["a/cpu0"]):
        locker = sqlite3.connect(tmp_path / "leases.db", timeout=0, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # the one write lock, held
        try:
            write_command(outer, 1, [{"id": "a/cpu0"}, {"id": "a/cpu1"}])
            refused = wait_for(lambda: read_refusal(outer, 1), 10, "the relay", every=0.02)
            assert "locked" in refused.reason and read_command(inner, 1) is None
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        write_command(outer, 2, [{"id": "a/cpu0"}, {"id": "a/cpu1"}])
        forwarded = wait_for(lambda: read_command(inner, 1), 10, "the next grow forwarded", every=0.02)
        assert forwarded.device_ids == ["a/cpu0", "a/cpu1"] and leased(store) == {"a/cpu0", "a/cpu1"}
