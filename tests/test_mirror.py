"""A pool trial's folder copied between a node and the campaign without shared storage
(flows/pool/mirror.py): the copies themselves, between two real folders. The Prefect
artifacts that carry them run in tests/test_pool.py's pool without a shared folder."""

from __future__ import annotations

import json

from flows.pool.mirror import apply_down, apply_up, appended_sizes, down_snapshot, file_stamps, record_seed, up_snapshot
from training.agent_commands import read_command, write_command
from training.files import read_json, write_json_atomic
from training.layout import trial_files


def through_json(snapshot):
    return json.loads(json.dumps(snapshot))  # as an artifact carries it


def test_a_segment_on_a_node_and_the_campaigns_copy_see_each_others_files(tmp_path):
    campaign, node = trial_files(tmp_path / "campaign" / "t1"), trial_files(tmp_path / "node" / "t1")
    campaign.root.mkdir(parents=True)
    # What the campaign holds before this segment: an earlier segment's log and record.
    campaign.log.write_text("segment 1 on another node\n")
    write_json_atomic(campaign.record, {"state": "starting", "attempts": 1, "devices": ["b/cpu0"]})
    campaign.hold.touch()
    write_json_atomic(campaign.batch, {"batch_size": 64})
    # What the node has from a segment of its own long ago: its log, a checkpoint, a relay's inner folder.
    (node.checkpoints / "step-00000050").mkdir(parents=True)
    (node.checkpoints / "step-00000050" / "__0_0.distcp").write_bytes(b"\0" * 100)
    node.log.write_text("an old segment on this node\n")
    (node.control / "node-a").mkdir(parents=True)
    write_json_atomic(node.control / "node-a" / "inner.json", {"seq": 3})
    write_json_atomic(node.progress, {"step": 999, "state": "held"})  # an old segment's, from just before this one

    base, seed = appended_sizes(campaign.root), record_seed(campaign.root)
    apply_down(node.root, through_json(down_snapshot(campaign.root, seed)), seed=True)
    assert read_json(node.record)["attempts"] == 1 and node.hold.exists() and read_json(node.batch) == {"batch_size": 64}
    since, before = appended_sizes(node.root), file_stamps(node.root)
    # Nothing of this segment yet: neither the record it was seeded with nor the old progress goes up.
    assert up_snapshot(node.root, since, before) == {"files": {}, "appended": {}}

    # The segment runs: its log grows, the record and progress change, the config names the node's paths.
    with open(node.log, "a") as f:
        f.write("segment 2: resumed at step 50\n")
    write_json_atomic(node.record, {"state": "running", "attempts": 2, "devices": ["a/cpu0"]})
    write_json_atomic(node.progress, {"step": 60, "state": "held"})
    write_json_atomic(node.config, {"trial_dir": str(node.root)})
    snapshot = through_json(up_snapshot(node.root, since, before))
    assert not any(rel.startswith("checkpoints") or "node-a" in rel for rel in snapshot["files"]), snapshot["files"]
    apply_up(campaign.root, snapshot, base)
    assert campaign.log.read_text() == "segment 1 on another node\nsegment 2: resumed at step 50\n"
    assert read_json(campaign.record)["attempts"] == 2 and read_json(campaign.progress)["step"] == 60
    assert not campaign.config.exists() and not campaign.checkpoints.exists()
    assert campaign.hold.exists()  # a file the campaign writes never comes back up

    # The campaign drops the hold and asks the elastic agent to resize: both reach the node.
    campaign.hold.unlink()
    write_command(campaign.control, 1, [{"id": "a/cpu1"}])
    apply_down(node.root, through_json(down_snapshot(campaign.root, seed)))
    assert not node.hold.exists() and read_command(node.control, 1).device_ids == ["a/cpu1"]
    assert read_json(node.record)["attempts"] == 2  # the record seeds a segment once, before its launch

    # The copy is applied again with more of the log: the campaign's copy is never doubled.
    with open(node.log, "a") as f:
        f.write("step 150: done\n")
    write_json_atomic(node.result, {"steps": 150})
    apply_up(campaign.root, through_json(up_snapshot(node.root, since, before)), base)
    apply_up(campaign.root, through_json(up_snapshot(node.root, since, before)), base)
    assert campaign.log.read_text().count("segment 2") == 1 and campaign.log.read_text().endswith("step 150: done\n")
    assert read_json(campaign.result) == {"steps": 150}


def test_a_trial_across_nodes_meets_through_the_campaigns_copy_and_keeps_each_nodes_log(tmp_path):
    """The host node's rendezvous endpoint goes up and down to the other node, which never
    deletes it; each node's log is its own file in the campaign's copy."""
    campaign, host, other = (trial_files(tmp_path / name / "t1") for name in ("campaign", "a", "b"))
    for files in (campaign, host, other):
        files.root.mkdir(parents=True)
    since, before = {}, {}
    write_json_atomic(host.rendezvous("abc"), {"endpoint": "10.0.0.2:29400"})
    host.log.write_text("host: world size 2\n")
    (other.root / "train-b.log").write_text("node b: world size 2\n")
    for files in (host, other):
        apply_up(campaign.root, through_json(up_snapshot(files.root, since, before)), {})
    apply_down(other.root, through_json(down_snapshot(campaign.root)))
    assert read_json(other.rendezvous("abc")) == {"endpoint": "10.0.0.2:29400"}
    apply_down(host.root, {"files": {}, "seed": {}})  # a copy from before the endpoint reached the campaign
    assert host.rendezvous("abc").exists()  # the host's own endpoint stays
    assert campaign.log.read_text() == "host: world size 2\n"
    assert (campaign.root / "train-b.log").read_text() == "node b: world size 2\n"


def test_an_agents_state_reaches_the_nodes_hosting_its_workers_and_never_its_own(tmp_path):
    """An elastic agent on node a grown onto node b: its state (written on a by its relay) goes up
    to the campaign and down to b's host only. a never gets the campaign's older copy over its
    own, and b's copy never goes back up as b's."""
    campaign, agent, host = (trial_files(tmp_path / name / "t1") for name in ("campaign", "a", "b"))
    for files in (campaign, agent, host):
        files.root.mkdir(parents=True)
    since, before = {}, {}
    agent.agent_state.parent.mkdir(parents=True)
    write_json_atomic(agent.agent_state, {"seq": 2, "devices": ["a/cpu0", "b/cpu0"], "status": "running"})
    apply_up(campaign.root, through_json(up_snapshot(agent.root, since, before)), {})
    down = through_json(down_snapshot(campaign.root))
    apply_down(host.root, down, hosting=True)
    assert read_json(host.agent_state)["devices"] == ["a/cpu0", "b/cpu0"]
    assert up_snapshot(host.root, since, before, hosting=True)["files"] == {}

    # The agent shrinks off b; the campaign's copy still says it holds b when it is sent down.
    write_json_atomic(agent.agent_state, {"seq": 3, "devices": ["a/cpu0"], "status": "running"})
    apply_down(agent.root, down)
    assert read_json(agent.agent_state)["seq"] == 3
    apply_up(campaign.root, through_json(up_snapshot(agent.root, since, before)), {})
    apply_down(host.root, through_json(down_snapshot(campaign.root)), hosting=True)
    assert read_json(host.agent_state)["devices"] == ["a/cpu0"]  # b's host sees it has no part left
