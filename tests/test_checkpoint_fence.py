"""A checkpoint is committed only under a live grant, and a late write under an old grant is
not trusted as newer (training.fence, training.manifest), with a real lease file and DCP."""

from __future__ import annotations


import pytest
import torch

from cluster.leases import LeaseStore
from training.checkpoint import Checkpointer
from training.fence import Fenced, commit_guard, grant_of
from training.manifest import checkpoint_report, list_checkpoints

CAPACITY = {"cpu0": 1 << 30}


def state(step: int) -> dict:
    return {"trainer": {"w": torch.full((4,), float(step))}}


def grant(store: LeaseStore, holder: str) -> dict:
    assert store.acquire(holder, CAPACITY, CAPACITY)
    return store.fence(holder)


def test_a_commit_after_the_lease_was_lost_is_refused_and_leaves_nothing_in_view(tmp_path):
    store = LeaseStore(tmp_path / "leases.db", 6.0)
    lease = grant(store, "campaign-a")
    root = tmp_path / "checkpoints"
    saver = Checkpointer(root, keep=3, rank=0, world_size=1, guard=commit_guard(lease), grant=grant_of(lease))
    saver.save(10, state(10))
    store.release("campaign-a")  # reclaimed while the holder was stalled, say
    with pytest.raises(Fenced, match="campaign-a"):
        saver.save(20, state(20))
    assert [p.name for p in list_checkpoints(root)] == ["step-00000010"]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000010"]  # no half-written folder either
    latest, refused = checkpoint_report(root)
    assert latest is not None and latest.name == "step-00000010" and refused == []


def test_a_late_write_under_an_older_grant_is_not_trusted_as_newer(tmp_path):
    store = LeaseStore(tmp_path / "leases.db", 6.0)
    old = grant(store, "campaign-a")
    store.release("campaign-a")
    new = grant(store, "campaign-a")  # the trial was granted again and went on
    assert new["epoch"] > old["epoch"]
    root = tmp_path / "checkpoints"
    Checkpointer(root, keep=3, rank=0, world_size=1, grant=grant_of(new)).save(10, state(10))
    # The old holder passed its commit check just before it lost the lease, and wrote on.
    Checkpointer(root, keep=3, rank=0, world_size=1, grant=grant_of(old)).save(20, state(20))
    latest, refused = checkpoint_report(root)
    assert latest is not None and latest.name == "step-00000010"
    assert [(p.name, "late write" in why) for p, why in refused] == [("step-00000020", True)]


def test_grants_in_order_and_grants_of_another_lease_file_are_trusted(tmp_path):
    other = LeaseStore(tmp_path / "other-node.db", 6.0)
    other.leases()  # made first: its epochs count from an earlier time (cluster.leases.first_epoch)
    store = LeaseStore(tmp_path / "leases.db", 6.0)
    old = grant(store, "campaign-a")
    store.release("campaign-a")
    new = grant(store, "campaign-a")
    in_order = tmp_path / "in-order"
    Checkpointer(in_order, keep=3, rank=0, world_size=1, grant=grant_of(old)).save(10, state(10))
    Checkpointer(in_order, keep=3, rank=0, world_size=1, grant=grant_of(new)).save(20, state(20))
    assert checkpoint_report(in_order)[0].name == "step-00000020"
    # Epochs grow per lease file: a trial resumed on another node's file has its own count.
    moved = grant(other, "campaign-a")
    assert moved["epoch"] < new["epoch"]
    Checkpointer(in_order, keep=3, rank=0, world_size=1, grant=grant_of(moved)).save(30, state(30))
    assert checkpoint_report(in_order) == (in_order / "step-00000030", [])


def test_a_grant_of_the_wrong_shape_makes_the_checkpoint_invalid(tmp_path):
    root = tmp_path / "checkpoints"
    Checkpointer(root, keep=3, rank=0, world_size=1, grant={"lease_file": "h:/x", "epoch": "7"}).save(10, state(10))
    latest, refused = checkpoint_report(root)
    assert latest is None and "grant" in refused[0][1]


def test_a_lease_file_unreadable_at_commit_time_does_not_refuse_a_healthy_commit(tmp_path):
    """A lease file that cannot be read this instant is not proof of a lost lease: the commit
    goes through (the fence's own thread acts on an unreadable file near the renew deadline)."""
    store = LeaseStore(tmp_path / "leases.db", 6.0)
    lease = grant(store, "campaign-a")
    unreadable = {**lease, "db": str(tmp_path)}  # a directory: sqlite cannot open it
    assert commit_guard(unreadable)() is None
    saver = Checkpointer(tmp_path / "checkpoints", keep=3, rank=0, world_size=1, guard=commit_guard(unreadable), grant=grant_of(lease))
    saver.save(10, state(10))
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000010"]
    store.release("campaign-a")
    assert "campaign-a" in commit_guard(lease)()  # read, and gone: refused


def test_a_commit_of_a_launch_the_trial_no_longer_runs_under_is_refused(tmp_path):
    """A pool node the campaign lost but that lives on (cut off from the server, the shared
    folder still mounted) keeps its own lease: the trial folder's `launch.json`, which the
    campaign writes before it sends the trial again, is what refuses its commits."""
    from training.files import write_json_atomic

    store = LeaseStore(tmp_path / "leases.db", 6.0)
    marker = tmp_path / "launch.json"
    lease = {**grant(store, "campaign-a"), "launch": "first", "launch_file": str(marker)}
    root = tmp_path / "checkpoints"
    saver = Checkpointer(root, keep=3, rank=0, world_size=1, guard=commit_guard(lease), grant=grant_of(lease))
    saver.save(10, state(10))  # no launch named yet (or unreadable): no proof, the commit goes through
    write_json_atomic(marker, {"launch": "first"})
    saver.save(20, state(20))
    write_json_atomic(marker, {"launch": "second"})  # the campaign launched the trial again elsewhere
    with pytest.raises(Fenced, match="launched again"):
        saver.save(30, state(30))
    assert [p.name for p in list_checkpoints(root)] == ["step-00000020", "step-00000010"]
    assert "launched again" in commit_guard(lease)() and commit_guard({**lease, "launch": "second"})() is None
